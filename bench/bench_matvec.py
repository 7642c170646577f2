"""Benchmark: fused quantized mat-vec throughput (pymoe.quant.matvec) next to the machine's memory read bandwidth.

What this is: for each weight type, the median time of `matvec(w, qtype, x)` on an R x C matrix, as GB/s of weight
bytes read and G weights/s, after a warm-up (compilation). The weights cycle through enough distinct copies to fill
--working-set-mb, so each call streams its matrix from DRAM as a decode step streams experts from the mmap (one
4096 x 4096 Q4_K matrix, 9 MiB, would otherwise sit in the last-level cache and flatter the kernel). Alongside:
the read bandwidth of a Numba parallel sum over a 1 GiB array with 1 and with --threads threads, the ceiling a
memory-bound mat-vec can approach.
What this is not: a correctness test (tests/test_kernels.py) or a model benchmark (`pymoe bench`).

    PYTHONPATH=. python bench/bench_matvec.py --rows 4096 --cols 4096 --threads 2 --types Q2_K,Q4_K
    PYTHONPATH=. python bench/bench_matvec.py --working-set-mb 128 \
        --types Q2_K,Q2_0,MXFP4,NVFP4,IQ4_NL,IQ4_XS,IQ3_XXS,IQ3_S,IQ2_XXS,IQ2_XS,IQ2_S,IQ1_S,IQ1_M,TQ1_0,TQ2_0,Q1_0
"""
from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
from numba import njit, prange

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # quant_helpers

import pymoe.quant as Q  # noqa: E402
from pymoe.quant import QType  # noqa: E402


@njit(cache=True, fastmath={"reassoc"})
def span_sum(a, lo, hi):
    """sum of a[lo:hi] in float32; reassoc lets LLVM keep SIMD partial sums, so the loop waits on memory rather
    than on one chain of dependent additions (without it this would measure the adder's latency, ~5 GB/s)."""
    span = a[lo:hi]  # [hi - lo]; indexing from 0 lets Numba drop its negative-index wraparound test
    acc = np.float32(0.0)
    for i in range(span.shape[0]):
        acc += span[i]
    return acc


@njit(parallel=True, cache=True)
def parallel_sum(a):
    """sum of a float32 [n] array in 1024 spans spread over the threads: a pure streaming read."""
    n_spans = 1024
    step = (a.shape[0] + n_spans - 1) // n_spans
    partial = np.zeros(n_spans, dtype=np.float64)  # [n_spans]
    for c in prange(n_spans):
        partial[c] = span_sum(a, c * step, min(a.shape[0], (c + 1) * step))
    return partial.sum()


def median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up: compilation, page faults
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_bandwidth(threads: int, repeat: int, gib: float = 1.0) -> float:
    """GB/s read by parallel_sum over `gib` GiB with `threads` threads."""
    a = np.ones(int(gib * 2**30) // 4, dtype=np.float32)  # [n] touched once, so it is resident
    numba.set_num_threads(threads)
    return a.nbytes / median_seconds(lambda: parallel_sum(a), repeat) / 1e9


def weight_copies(qtype, rows: int, cols: int, working_set_mb: float, rng) -> list[np.ndarray]:
    """Enough distinct raw [rows, row_bytes] matrices of `qtype` to fill the working set (at least 1).

    Realistic values (quantized Gaussians, no subnormal or NaN scales), built by quantizing 64 rows and tiling them,
    then one copy per matrix so that every call reads different memory. Types pymoe has no quantizer for (the IQ
    family, MXFP4, TQ: llama.cpp writes them) get random blocks with moderate scales (tests/quant_helpers.py): the
    kernels have no data-dependent branches, so the values do not change the time.
    """
    if Q.get_format(qtype).quantize is None:
        from quant_helpers import random_rows
        seed_rows = random_rows(qtype, 64, cols, rng)  # [64, row_bytes]
    else:
        seed_rows = Q.quantize(rng.standard_normal((64, cols)).astype(np.float32), qtype)  # [64, row_bytes]
    w = np.tile(seed_rows, (-(-rows // 64), 1))[:rows]  # [rows, row_bytes]
    n = max(1, int(working_set_mb * 2**20 // w.nbytes))
    return [w.copy() for _ in range(n)]


def bench_type(qtype, rows, cols, threads, repeat, working_set_mb, rng) -> dict:
    numba.set_num_threads(threads)
    mats = weight_copies(qtype, rows, cols, working_set_mb, rng)
    x = rng.standard_normal(cols).astype(np.float32)  # [C]

    def one_pass():
        for w in mats:
            Q.matvec(w, qtype, x)

    seconds = median_seconds(one_pass, repeat) / len(mats)  # per matvec
    return dict(type=qtype.name, mib=mats[0].nbytes / 2**20, copies=len(mats), ms=seconds * 1e3,
                gbs=mats[0].nbytes / seconds / 1e9, gws=rows * cols / seconds / 1e9)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="output features R (default 4096)")
    p.add_argument("--cols", type=int, default=4096, help="input features C, a multiple of 256 (default 4096)")
    p.add_argument("--threads", type=int, default=2, help="Numba threads for the kernels (default 2)")
    p.add_argument("--types", default="Q2_K,Q4_K", help="comma-separated GGML types (default Q2_K,Q4_K)")
    p.add_argument("--repeat", type=int, default=5, help="timed passes; the median is reported (default 5)")
    p.add_argument("--working-set-mb", type=float, default=512, help="weight bytes cycled through (default 512)")
    args = p.parse_args()

    rng = np.random.default_rng(0)
    types = [QType[name.strip()] for name in args.types.split(",")]
    bw1 = memory_bandwidth(1, args.repeat)
    bwn = memory_bandwidth(args.threads, args.repeat)
    print(f"memory read bandwidth (Numba parallel sum, 1 GiB): 1 thread {bw1:.1f} GB/s, "
          f"{args.threads} threads {bwn:.1f} GB/s")
    print(f"matvec {args.rows} x {args.cols}, {args.threads} threads, median of {args.repeat}")
    print(f"{'type':<7} {'MiB':>7} {'copies':>6} {'ms':>8} {'GB/s':>7} {'Gw/s':>7} {'% of bw':>8}")
    for qtype in types:
        r = bench_type(qtype, args.rows, args.cols, args.threads, args.repeat, args.working_set_mb, rng)
        print(f"{r['type']:<7} {r['mib']:>7.2f} {r['copies']:>6} {r['ms']:>8.3f} {r['gbs']:>7.2f} {r['gws']:>7.2f} "
              f"{100 * r['gbs'] / bwn:>7.0f}%")


if __name__ == "__main__":
    main()
