"""Benchmark: the repacked 8-row tiles (pymoe/quant/repack.py) against the raw-row integer dots, one matrix, 8 bits.

What this is: for each format with a tile layout (and the IQ1-IQ3 formats through their decoded one), one R x C matrix of random valid blocks, multiplied by T tokens of
8-bit activations (T = 1: decode; 64, 512: prefill) through `repack.tile_matmul` and through `kernels.matmul_act`
on the raw rows (the one-row / multi-row dots, `exact_blocks` numerics). Both give the same bits (checked here on
every call pair); the table is G MACs/s, the minimum time of many alternated calls (this host drifts: the minimum
is the least disturbed). Warm caches: the matrix fits in L2, so this is the kernels' arithmetic, not memory.
What this is not: a model measurement (bench/bench_forward.py with PYMOE_ACT_BITS=8 and PYMOE_REPACK=0/1;
bench/compare_llamacpp.py).

    PYTHONPATH=. python bench/bench_repack.py --threads 1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # quant_helpers: random valid blocks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="Numba threads (default 1)")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--tokens", default="1,64,512", help="token counts (default 1,64,512)")
    args = ap.parse_args()

    import numba

    numba.set_num_threads(args.threads)
    from pymoe.quant import kernels, qact, repack
    from quant_helpers import random_rows

    rng = np.random.default_rng(0)
    R, C = args.rows, args.cols
    print(f"{R} x {C}, 8-bit activations, {args.threads} thread(s): G MACs/s, tiles / raw rows")
    # the formats with a tile layout, then the Grid formats (IQ1-IQ3) through their decoded layout: for those the
    # time of decoding the matrix (what the MoE kernel does once per prefill chunk and expert) is printed after
    layouts = [(q, q) for q in repack.TILE_BYTES] + [(q, repack.DECODED) for q in qact.ROW_DECODES]
    for qtype, layout in layouts:
        raw = random_rows(qtype, R, C, rng)  # [R, row_bytes]
        tiles = repack.repack(raw, qtype) if layout != repack.DECODED else repack.decode_tiles(raw, qtype)
        cells = []
        for T in (int(t) for t in args.tokens.split(",")):
            x = rng.standard_normal((T, C)).astype(np.float32)
            xact = qact.quantize_for(x, qtype, 8)
            calls = {"tiles": lambda: repack.tile_matmul(tiles, layout, *xact),
                     "raw": lambda: kernels.matmul_act(raw, qtype, x, 8, xact=xact)}
            if not np.array_equal(calls["tiles"](), calls["raw"]()):
                raise SystemExit(f"bench_repack: {qtype.name} T={T}: the tiles' result differs from the raw rows'")
            best = {k: float("inf") for k in calls}
            for _ in range(max(10, 2000 // T)):
                for k, f in calls.items():
                    t0 = time.perf_counter()
                    f()
                    best[k] = min(best[k], time.perf_counter() - t0)
            cells.append(f"T={T}: {R * C * T / best['tiles'] / 1e9:5.1f} / {R * C * T / best['raw'] / 1e9:5.1f}")
        if layout == repack.DECODED:
            best = min(_timed(lambda: repack.decode_tiles(raw, qtype)) for _ in range(20))
            cells.append(f"decoding: {R * C / best / 1e9:5.2f} G weights/s")
        print(f"{qtype.name:7s} " + "   ".join(cells))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
