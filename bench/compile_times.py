"""Benchmark: where a cold start's Numba compile time goes, per compiled function, on one model file.

What this is: with Numba's cache pointed at an empty folder (run it as `NUMBA_CACHE_DIR=$(mktemp -d) ...`), load the
model, prefill a --prompt-tokens prompt and decode --tokens greedy tokens, timing every compilation through Numba's
compile events; prints the wall time and the --top functions by compile seconds (a function's time includes the
functions compiled inside it: the fused MoE kernel's includes its phases). With a warm cache it shows what is left.
What this is not: a speed measurement (bench/bench_forward.py), nor the test suite's time (docs/testing.md).

    NUMBA_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python bench/compile_times.py /work/bigm/mid-Q4_K_M.gguf
"""
from __future__ import annotations

import argparse
import collections
import time

import numpy as np
from numba.core import event


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=2, help="decoded tokens (default 2)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    rec = event.RecordingListener()
    event.register("numba:compile", rec)
    t0 = time.perf_counter()
    import pymoe

    engine = pymoe.load(args.model, threads=args.threads, n_ctx=args.prompt_tokens + args.tokens + 8)
    model = engine.model
    kv = model.new_kv(args.prompt_tokens + args.tokens + 8)
    logits = model.prefill(np.arange(args.prompt_tokens) % engine.config.n_vocab, kv)[-1]
    for _ in range(args.tokens):
        logits = model.decode_one_token(int(np.argmax(logits)), kv)
    print(f"{args.model}: load, prefill of {args.prompt_tokens} tokens and {args.tokens} decoded: "
          f"{time.perf_counter() - t0:.1f} s")
    starts, seconds = {}, collections.Counter()
    for ts, ev in rec.buffer:  # start and end events of each (function, signature) compilation
        key = (id(ev.data.get("dispatcher")), str(ev.data.get("args")))
        if ev.is_start:
            starts[key] = ts
        elif key in starts:
            fn = getattr(ev.data.get("dispatcher"), "py_func", None)
            seconds[getattr(fn, "__name__", "?")] += ts - starts.pop(key)
    for name, s in seconds.most_common(args.top):
        print(f"  {s:7.1f} s  {name}")


if __name__ == "__main__":
    main()
