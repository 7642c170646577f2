"""Benchmark: decode's dense one-token products on weights not in cache, their tile dots built with several hints.

What this is: the measurement behind repack.DENSE_AHEAD (how far ahead of the block it reads a dense weight's tile
dot asks for bytes) next to STREAM_AHEAD (the routed experts'). For each format, a random R x C matrix is quantized
and repacked, and copied until the copies fill --working-set-mb, so each call reads its matrix from DRAM as a
decode step does (a layer's q/k/v/o come back only after the rest of the model has been read), with --between-mb
of other memory read before each call (untimed), as the experts are between a decode step's dense products: the
copies back to back are one long stream that flatters the hardware prefetcher (Q8_0 without hints measured 1.2x
faster so, a tie in decode: bench/techniques.py dense_q8_0_unhinted). For each distance
and locality, the dense product (repack's tile_matmul template, the two-row dot of a token's two planes: the
default width; or --bits 8, the one-token dot) is built once; then for --rounds rounds the variants run in an order
drawn anew each round, each over every copy, and the script prints the median us per matrix and GB/s of tile bytes
read. The variants alternate round by round in one process, so a shared host's drift reaches them alike. Every
variant's y is the same bits (checked on the first round).
What this is not: a whole decode step (bench/decode_breakdown.py, bench/compare_llamacpp.py), nor the experts'
kernel (bench/stream_ahead.py).

    PYTHONPATH=. python bench/dense_ahead.py --threads 2 --formats Q4_K,Q6_K,Q8_0 --shape 4096x2048
    PYTHONPATH=. python bench/dense_ahead.py --shape 1024x1024 --distances 8192,16384 --localities 2,3
"""
from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from pymoe import quant
from pymoe.quant import QType, qact, repack


def build(qtype, distance: int, locality: int):
    """The dense product of this format (the tile_matmul template) with its one-token and two-row tile dots asking
    for the bytes `distance` ahead at prefetch `locality` (0: prefetchnta .. 3: prefetcht0)."""
    one = repack._make_tile_dot(qtype, locality=locality, ahead=distance)
    two = repack._make_tile_dot2(qtype, locality=locality, ahead=distance)
    return repack._compile(repack._tile_matmul_template, f"bench_dense_{qtype.name}_a{distance}_l{locality}",
                           {"TILE_DOT": one, "TILE_DOT2": two, "TILE_PAIR": qtype in repack.PAIRS})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    ap.add_argument("--formats", default="Q4_K,Q6_K,Q8_0", help="tiled formats, comma-separated")
    ap.add_argument("--shape", default="4096x2048", help="R x C of the matrix (default 4096x2048: Qwen3-30B-A3B's q)")
    ap.add_argument("--distances", default="4096,8192,16384,32768", help="bytes ahead, comma-separated (0: none)")
    ap.add_argument("--localities", default=str(qact.DENSE_LOCALITY), help="prefetch localities, comma-separated")
    ap.add_argument("--bits", type=int, default=qact.PLANES, help="activation width: 15 (two planes) or 8")
    ap.add_argument("--working-set-mb", type=int, default=256, help="MB of copies cycled through (default 256)")
    ap.add_argument("--rounds", type=int, default=15, help="alternated rounds (default 15)")
    ap.add_argument("--between-mb", type=float, default=2.0,
                    help="MB of other memory read (untimed) before each call, at a random place of a 512 MB buffer, "
                         "as a decode step reads the experts between its dense products (0: the copies back to back, "
                         "one long stream; default 2)")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    R, C = (int(v) for v in args.shape.split("x"))
    rng = np.random.default_rng(0)
    step = int(args.between_mb * 2**20)
    between = np.ones(512 << 20, np.uint8) if step else None
    variants = [(d, l) for d in (int(v) for v in args.distances.split(","))
                for l in (int(v) for v in args.localities.split(","))]
    print(f"{R} x {C}, {args.threads} threads, {args.bits}-bit activations, {args.rounds} rounds; "
          f"STREAM_AHEAD {repack.STREAM_AHEAD}, DENSE_AHEAD "
          f"{ {q.name: a for q, a in repack.DENSE_AHEAD.items()} }, DENSE_LOCALITY {qact.DENSE_LOCALITY}")
    for name in args.formats.split(","):
        qtype = QType[name]
        if quant.get_format(qtype).quantize is not None:
            raw = quant.quantize(rng.standard_normal((R, C)).astype(np.float32) * 0.02, qtype)
        else:  # (MXFP4: no quantizer here) random bytes, the scales' byte kept to finite powers of two
            raw = rng.integers(0, 256, (R, quant.get_format(qtype).row_bytes(C)), dtype=np.uint8)
            raw.reshape(R, -1, 17)[:, :, 0] = rng.integers(118, 128, raw.reshape(R, -1, 17).shape[:2])
        tiles = repack.repack(raw, qtype)
        copies = [tiles.copy() for _ in range(max(2, args.working_set_mb * 2**20 // tiles.nbytes))]
        xq, xd, xbs = qact.quantize_for(rng.standard_normal((1, C)).astype(np.float32), qtype, args.bits)
        fns = {v: build(qtype, *v) for v in variants}
        ys = {}
        for v, fn in fns.items():  # compiled, and the same bits
            ys[v] = np.empty((xq.shape[0], R), np.float32)
            fn(copies[0], xq, xd, xbs, ys[v], repack.AHEAD)
        first = ys[variants[0]]
        for v in variants[1:]:
            if not np.array_equal(ys[v], first):
                raise SystemExit(f"{name}: variant {v} gives other bits than {variants[0]}")
        times = {v: [] for v in variants}
        y = first
        for _ in range(args.rounds):
            for i in rng.permutation(len(variants)):
                v = variants[i]
                fn = fns[v]
                spent = 0.0
                for c in copies:
                    if between is not None:  # other bytes read first, untimed, as a decode step reads experts
                        lo = int(rng.integers(0, between.size - step)) // 4096 * 4096
                        between[lo:lo + step].sum()
                    t0 = time.perf_counter()
                    fn(c, xq, xd, xbs, y, repack.AHEAD)
                    spent += time.perf_counter() - t0
                times[v].append(spent / len(copies))
        for v in variants:
            s = statistics.median(times[v])
            print(f"  {name:6s} ahead {v[0]:6d} locality {v[1]}: {s * 1e6:8.1f} us  {tiles.nbytes / s / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
