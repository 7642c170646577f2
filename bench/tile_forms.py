"""Benchmark: the forms of one format's tile dot side by side (AVX2, VNNI on 256 bits, VNNI on 512 bits), one process.

What this is: the measurement behind quant/repack.py's WIDE and VNNI_MANY sets. For each format, one 8-row-group
loop over a 512 x 1024 matrix of random valid blocks (warm: the tiles fit in L2), one token (decode) and MANY tokens
at a time (prefill), with each form of the dot compiled in this process (`repack._make_tile_dot(qtype, vnni=, wide=)`,
whatever WIDE and VNNI_MANY say) and called in an order drawn anew each round; every form's results are checked
equal first. Prints G MACs/s, the median of the rounds. Forms the CPU lacks are skipped.
What this is not: the product a model runs (bench/bench_repack.py: `tile_matmul` against the raw rows), nor a model
measurement (bench/compare_llamacpp.py).

    PYTHONPATH=. python bench/tile_forms.py --formats IQ4_XS,Q5_K,Q8_0
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # quant_helpers: random valid blocks
sys.path.insert(0, os.path.dirname(__file__))  # tile_bench: the shared start
from tile_bench import start  # noqa: E402


def main():
    args = start(__doc__, "Q4_K,Q5_K,Q8_0,IQ4_XS")
    from numba import njit

    from pymoe.quant import QType, qact, repack
    from quant_helpers import random_rows

    forms = {"avx2": dict(vnni=False)}
    if repack._VNNI:
        forms["vnni"] = dict(vnni=True, wide=False)
    if repack._WIDE:
        forms["vnni-wide"] = dict(vnni=True, wide=True)
    R, C, M = 512, 1024, repack.MANY
    rng = np.random.default_rng(0)
    X = rng.standard_normal((M, C)).astype(np.float32)

    def loops(dot):
        @njit
        def one(tiles, xq, xd, xbs, y, reps):
            for _ in range(reps):
                for g in range(tiles.shape[0]):
                    dot(tiles[g], xq[0], xd[0], xbs[0], y[g * 8:(g + 1) * 8])

        @njit
        def many(tiles, xq, xd, xbs, y4, reps):
            for _ in range(reps):
                for g in range(tiles.shape[0]):
                    dot(tiles[g], xq, xd, xbs, y4[g])

        return one, many

    print(f"{R} x {C}, 1 thread, G MACs/s (median of {args.rounds} alternated rounds): one token / {M} tokens a call")
    for name in args.formats.split(","):
        qtype = QType[name]
        tiles = repack.repack(random_rows(qtype, R, C, rng), qtype)
        xq, xd, xbs = qact.quantize_for(X, qtype, 8)  # x in the layout the format takes (qact.act_group)
        built = {f: loops(repack._make_tile_dot(qtype, ahead=0, **kw)) for f, kw in forms.items()}
        first = None
        for one, many in built.values():  # compile, and the same results from every form
            y, y4 = np.empty(R, np.float32), np.empty((R // 8, M, 8), np.float32)
            one(tiles, xq, xd, xbs, y, 1)
            many(tiles, xq, xd, xbs, y4, 1)
            if first is None:
                first = (y, y4)
            elif not (np.array_equal(y, first[0]) and np.array_equal(y4, first[1])):
                raise SystemExit(f"tile_forms: {name}: the forms' results differ")
        times = {(f, k): [] for f in built for k in ("one", "many")}
        y, y4 = np.empty(R, np.float32), np.empty((R // 8, M, 8), np.float32)
        for _ in range(args.rounds):
            for f in rng.permutation(list(built)):
                one, many = built[f]
                t0 = time.perf_counter()
                one(tiles, xq, xd, xbs, y, 50)
                times[(f, "one")].append((time.perf_counter() - t0) / 50)
                t0 = time.perf_counter()
                many(tiles, xq, xd, xbs, y4, 20)
                times[(f, "many")].append((time.perf_counter() - t0) / 20)
        cells = [f"{f} {R * C / np.median(times[(f, 'one')]) / 1e9:6.1f} / "
                 f"{R * C * M / np.median(times[(f, 'many')]) / 1e9:6.1f}" for f in built]
        print(f"{name:6s} " + "   ".join(cells))


if __name__ == "__main__":
    main()
