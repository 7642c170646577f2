"""Benchmark: pymoe alone, decode and prefill tok/s on one model file, medians of several runs (no llama.cpp).

What this is: the quick loop used while optimising the CPU path (docs/performance.md): load the model once, warm up,
then for --runs runs each: decode tok/s of --gen-tokens greedy tokens after a 128-token prompt, and prefill tok/s
of 128- and 512-token prompts (fixed pseudo-random ids, as bench/compare_llamacpp.py uses). Prints the median and
the best of each, and the load average, because on a shared 2-core machine a 2-thread Numba kernel waits on its
slowest thread: with another job on a core, timings measure the scheduler. --threads 1 is the stable measure
of the code itself.
What this is not: the comparison with llama.cpp (bench/compare_llamacpp.py), or a correctness check.

    PYTHONPATH=. python bench/bench_forward.py /work/models/mid-q2_k.gguf --threads 2 --runs 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import pymoe


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    ap.add_argument("--runs", type=int, default=5, help="runs per measurement (default 5)")
    ap.add_argument("--gen-tokens", type=int, default=32, help="decoded tokens per decode run (default 32)")
    ap.add_argument("--only", choices=["decode", "prefill128", "prefill512"], help="one measurement only")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before the decode run (default 128; "
                    "attention's share of a token grows with it)")
    args = ap.parse_args()

    engine = pymoe.load(args.model, threads=args.threads, n_ctx=max(512, args.context) + args.gen_tokens + 136)
    model = engine.model
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, engine.config.n_vocab, n) for n in {128, 512, args.context}}
    kv = model.new_kv(64)
    model.prefill(prompts[128][:8], kv)  # warm-up: compilation, page faults
    for _ in range(3):
        model.decode_one_token(5, kv)

    def prefill(n):
        kv = model.new_kv(n + 8)
        t0 = time.perf_counter()
        model.prefill(prompts[n], kv)
        return n / (time.perf_counter() - t0)

    def decode():
        kv = model.new_kv(args.context + args.gen_tokens + 8)
        logits = model.prefill(prompts[args.context], kv)[-1]
        t0 = time.perf_counter()
        for _ in range(args.gen_tokens):
            logits = model.decode_one_token(int(np.argmax(logits)), kv)
        return args.gen_tokens / (time.perf_counter() - t0)

    todo = {"decode": decode, "prefill128": lambda: prefill(128), "prefill512": lambda: prefill(512)}
    load = os.getloadavg()
    print(f"{args.model}: {args.threads} threads, {args.runs} runs, load average before {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}")
    for name, fn in todo.items():
        if args.only and name != args.only:
            continue
        rates = [fn() for _ in range(args.runs)]
        print(f"{name:<11} tok/s: median {statistics.median(rates):7.1f}   best {max(rates):7.1f}")


if __name__ == "__main__":
    main()
