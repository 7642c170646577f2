"""Benchmark: decode with the CPU backend's repacked copies in 2 MiB pages (backends/arena.py) and without.

What this is: the measurement behind `HugeArena`. It loads the model file twice, one engine whose backend cuts its
repacked copies (and the dense rows without tiles) from the arena's huge-page chunks (A) and one whose copies are
plain NumPy arrays in 4 KiB pages (B, what PYMOE_HUGE=0 gives), prefills the same --context-token prompt on each,
then decodes greedily --tokens tokens at a time on A and on B in turn (which goes first alternates), for --rounds
rounds; a sequence is started anew from its prompt when it nears the context. It prints each engine's median tok/s,
the median time of the fused MoE kernel call (the experts' bytes: what the pages matter for most), in how many
rounds A was faster, and how much of the process's memory is in huge pages (Linux: /proc/self/smaps_rollup).
Alternating in one process lets a shared host's drift reach both alike. Both engines give the same bits.
What this is not: a side-by-side with llama.cpp (bench/compare_llamacpp.py).

    PYMOE_ACT_BITS=8 PYTHONPATH=. python bench/huge_pages.py /work/bigm/mid-Q4_K_M.gguf --rounds 24
"""
from __future__ import annotations

import argparse
import collections
import re
import statistics
import time

import numpy as np

import pymoe
import pymoe.backends.cpu as cpu
from pymoe.backends.arena import HugeArena
from pymoe.quant import kernels


def huge_kib() -> str:
    try:
        with open("/proc/self/smaps_rollup") as f:
            m = re.search(r"AnonHugePages:\s+(\d+) kB", f.read())
        return f"{int(m.group(1)) // 1024} MiB" if m else "?"
    except OSError:
        return "? (no /proc/self/smaps_rollup)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    ap.add_argument("--rounds", type=int, default=24, help="rounds, each --tokens tokens on A then B (default 24)")
    ap.add_argument("--tokens", type=int, default=16, help="decoded tokens per engine and round (default 16)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens (default 128)")
    args = ap.parse_args()

    n_ctx = args.context + 4 * args.tokens + 8
    engines = {"A": pymoe.load(args.model, threads=args.threads, n_ctx=n_ctx, backend="cpu")}
    plain = cpu.HugeArena
    cpu.HugeArena = lambda: HugeArena(enabled=False)  # the second backend's copies: plain NumPy arrays
    try:
        engines["B"] = pymoe.load(args.model, threads=args.threads, n_ctx=n_ctx, backend="cpu")
    finally:
        cpu.HugeArena = plain
    if not engines["A"].model.backend.repack:
        raise SystemExit("huge_pages: this backend keeps no repacked copies (PYMOE_ACT_BITS=8 and repacking on)")
    current, took = ["A"], collections.defaultdict(list)
    kernel = kernels.moe_act_table

    def timed(*a, **k):
        t0 = time.perf_counter()
        y = kernel(*a, **k)
        took[current[0]].append(time.perf_counter() - t0)
        return y

    kernels.moe_act_table = timed
    prompt = np.random.default_rng(0).integers(0, engines["A"].config.n_vocab, args.context)
    state = {}

    def start(name):
        m = engines[name].model
        kv = m.new_kv(n_ctx)
        state[name] = (kv, m.prefill(prompt, kv)[-1])

    for name in engines:  # each sequence started, and a few tokens decoded first: compilation, first uses
        start(name)
        kv, logits = state[name]
        for _ in range(4):
            logits = engines[name].model.decode_one_token(int(np.argmax(logits)), kv)
        state[name] = (kv, logits)
    took.clear()
    rates = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            current[0] = name
            if state[name][0].n + args.tokens >= n_ctx:
                start(name)
            kv, logits = state[name]
            m = engines[name].model
            t0 = time.perf_counter()
            for _ in range(args.tokens):
                logits = m.decode_one_token(int(np.argmax(logits)), kv)
            rates[name].append(args.tokens / (time.perf_counter() - t0))
            state[name] = (kv, logits)
    kernels.moe_act_table = kernel
    print(f"{args.model}: {args.threads} threads, {args.rounds} rounds of {args.tokens} tokens on each engine; "
          f"memory in huge pages now: {huge_kib()}")
    for name, label in (("A", "copies in 2 MiB pages (arena)"), ("B", "copies in 4 KiB pages (NumPy)")):
        print(f"  {name} {label:<32} median {statistics.median(rates[name]):6.1f} tok/s   MoE kernel median "
              f"{statistics.median(took[name]) * 1e6:6.1f} us")
    print(f"  A faster in {sum(a > b for a, b in zip(rates['A'], rates['B']))} of {args.rounds} rounds")


if __name__ == "__main__":
    main()
