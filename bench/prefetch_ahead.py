"""Benchmark: decode with the MoE kernel's software prefetch at several distances, alternated in one process.

What this is: the measurement behind kernels.PREFETCH_AHEAD. It loads one model file, then for --rounds rounds,
for each distance in turn: a fresh KV cache, a 128-token prompt, 48 greedy decode steps, the first 8 not counted.
Prints the 20th percentile, median and mean ms per token of each distance. The distances alternate step by step
in one process, so a shared host's drift (large on the VMs this project runs on) reaches them alike.
Since round eleven, the one-token tile dots (8-bit decode of repacked experts) ask for their bytes from inside
their block loop at a compile-time distance (repack.STREAM_AHEAD); PREFETCH_AHEAD sets the rest: the raw-row paths
(16-bit activations, types without tiles) and the many-token calls.
What this is not: a side-by-side with llama.cpp (bench/compare_llamacpp.py), or a check of results (the hints do
not change a bit: tests/test_repack.py and the kernel tests run with the default distance).

    PYTHONPATH=. PYMOE_ACT_BITS=8 python bench/prefetch_ahead.py /work/bigm/mid-Q4_K_M.gguf --threads 2
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import pymoe
from pymoe.quant import kernels


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    ap.add_argument("--distances", default="0,2048,4096,8192", help="bytes ahead, comma-separated (0: no hints)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds over the distances (default 8)")
    args = ap.parse_args()

    engine = pymoe.load(args.model, threads=args.threads, n_ctx=512)
    model = engine.model
    rng = np.random.default_rng(0)
    distances = [int(d) for d in args.distances.split(",")]
    times = {d: [] for d in distances}  # seconds per decoded token
    for _ in range(args.rounds):
        for d in distances:
            kernels.PREFETCH_AHEAD = d
            kv = model.new_kv(256)
            model.prefill(rng.integers(0, model.cfg.n_vocab, 128), kv)
            token = 1
            for i in range(48):
                t0 = time.perf_counter()
                token = int(np.argmax(model.decode_one_token(token, kv)))
                if i >= 8:
                    times[d].append(time.perf_counter() - t0)
    kernels.PREFETCH_AHEAD = distances[0]
    print(f"{args.model}: {args.threads} threads, act_bits {engine.backend.act_bits}, {args.rounds} rounds")
    for d, ts in times.items():
        ts.sort()
        print(f"  ahead {d:6d} B: p20 {ts[len(ts) // 5] * 1e3:6.2f}  median {ts[len(ts) // 2] * 1e3:6.2f}  "
              f"mean {np.mean(ts) * 1e3:6.2f} ms/token")


if __name__ == "__main__":
    main()
