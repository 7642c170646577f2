"""Benchmark: the CPU backend's attention (backends/cpu.py `attention_rows`) at the shapes prefill and decode give it.

What this is: `CPUBackend.attention` on random q, k, v of the `mid` preset's shape by default (16 query heads, 4 KV
heads, head size 64), for a 512-token and a 128-token prompt (p0 = 0, causal), and one decoded token at 170 and
2000 positions. Prints the median time of --runs calls after one warm-up. The inputs stay in cache between calls
(a decode step's keys and values usually come from DRAM: bench/decode_breakdown.py measures them in a model).
What this is not: a comparison. Run it on the commit before a change for the "before" figure (docs/performance.md,
"Attention", gives both for round twelve's register-blocked loops).

    PYTHONPATH=. python bench/bench_attention.py --threads 2
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    ap.add_argument("--heads", type=int, default=16, help="query heads (default 16)")
    ap.add_argument("--kv-heads", type=int, default=4, help="KV heads (default 4)")
    ap.add_argument("--head-dim", type=int, default=64, help="head size of q, k and v (default 64)")
    ap.add_argument("--runs", type=int, default=30, help="timed calls per shape (default 30)")
    args = ap.parse_args()

    import numba

    numba.set_num_threads(args.threads)
    from pymoe.backends.cpu import CPUBackend

    b = CPUBackend()
    rng = np.random.default_rng(0)
    H, G, Dh = args.heads, args.kv_heads, args.head_dim
    print(f"{H} heads, {G} KV heads, head size {Dh}, {args.threads} thread(s): median of {args.runs} calls")
    for T, p0 in ((512, 0), (128, 0), (1, 169), (1, 1999)):
        S = p0 + T
        q = rng.standard_normal((T, H, Dh)).astype(np.float32)
        k, v = (rng.standard_normal((S, G, Dh)).astype(np.float32) for _ in range(2))
        b.attention(q, k, v, p0)
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            b.attention(q, k, v, p0)
            times.append(time.perf_counter() - t0)
        print(f"T = {T:3d} queries after {p0:4d} positions: {np.median(times) * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
