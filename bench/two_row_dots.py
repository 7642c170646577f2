"""Benchmark: decode's two-row tile dots (a token's two 8-bit planes, `--act-bits 15`) against the one-token dot, one process.

What this is: the measurement behind quant/repack.py's DUAL set and CPU_FORMS. For each format, one loop over the 8-row
groups of a 512 x 1024 matrix of random valid blocks (warm: the tiles fit in L2), 1 thread: the one-token dot
(repack.TILE_DOTS_STREAM) on one plane, and the two-row dot on both planes in its plain form, where the CPU has
512-bit VNNI its dual form (repack._make_tile_dot2(dual=False / True)), and the form `twice` (the one-token dot on
each plane, twice=True), called in an order drawn anew each round; the forms' results are checked equal first.
Prints the median microseconds per matrix and the two-row / one-token ratio (2.0: the second plane costs a whole
dot; 1.0: nothing).
What this is not: a decode step (bench/decode_breakdown.py, bench/compare_llamacpp.py --act-bits 15), nor cold
weights (decode reads the experts from DRAM: bench/stream_ahead.py).

    PYTHONPATH=. python bench/two_row_dots.py --formats Q2_K,Q3_K,Q4_K,Q6_K
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
    args = start(__doc__, "Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q8_0,IQ4_XS,MXFP4")
    from numba import njit

    from pymoe.quant import QType, qact, repack
    from quant_helpers import random_rows

    R, C = 512, 1024
    rng = np.random.default_rng(0)
    X = rng.standard_normal((1, C)).astype(np.float32)

    def one_loop(dot):
        @njit
        def run(tiles, xq, xd, xbs, y, reps):
            for _ in range(reps):
                for g in range(tiles.shape[0]):
                    dot(tiles[g], xq[0], xd[0], xbs[0], y[g, 0])
        return run

    def two_loop(dot):
        @njit
        def run(tiles, xq, xd, xbs, y, reps):
            for _ in range(reps):
                for g in range(tiles.shape[0]):
                    dot(tiles[g], xq, xd, xbs, y[g])
        return run

    print(f"{R} x {C}, 1 thread, us per matrix (median of {args.rounds} alternated rounds); two-row / one-token")
    for name in args.formats.split(","):
        qtype = QType[name]
        tiles = repack.repack(random_rows(qtype, R, C, rng), qtype)
        xq, xd, xbs = qact.quantize_for(X, qtype, qact.PLANES)  # a token's two planes [2, C]
        forms = {"one-token": one_loop(repack.TILE_DOTS_STREAM[qtype]),
                 "two-row": two_loop(repack._make_tile_dot2(qtype, locality=qact.STREAM_LOCALITY, dual=False))}
        if repack._WIDE and qact._AVX2 and qtype in repack.PAIR:  # (the dual form's blocks are PAIR's)
            forms["two-row dual"] = two_loop(repack._make_tile_dot2(qtype, locality=qact.STREAM_LOCALITY, dual=True))
        forms["twice"] = two_loop(repack._make_tile_dot2(qtype, locality=qact.STREAM_LOCALITY, twice=True))
        ys = {f: np.zeros((R // 8, 2, 8), np.float32) for f in forms}
        for f, run in forms.items():  # compile, and the same results from every form
            run(tiles, xq, xd, xbs, ys[f], 1)
        for f in forms:
            if f != "one-token" and not np.array_equal(ys[f], ys["two-row"]):
                raise SystemExit(f"two_row_dots: {name}: the forms' results differ")
        if not np.array_equal(ys["one-token"][:, 0], ys["two-row"][:, 0]):
            raise SystemExit(f"two_row_dots: {name}: the two-row dot's first plane differs from the one-token dot's")
        times = {f: [] for f in forms}
        for _ in range(args.rounds):
            for f in rng.permutation(list(forms)):
                t0 = time.perf_counter()
                forms[f](tiles, xq, xd, xbs, ys[f], 20)
                times[f].append((time.perf_counter() - t0) / 20)
        med = {f: np.median(v) * 1e6 for f, v in times.items()}
        cells = [f"{f} {t:6.1f}" + ("" if f == "one-token" else f" ({t / med['one-token']:.2f})") for f, t in med.items()]
        print(f"{name:6s} " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
