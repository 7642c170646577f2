"""Benchmark: where one decoded token's time goes, per backend call, on one model file (pymoe alone).

What this is: where docs/performance.md's roofline gets the split of a decode step. It loads the model, prefills a
--context-token prompt (default 128), decodes --warmup tokens (default 5), times --tokens greedy tokens bare, then
--tokens more with a wrapper around every backend primitive (linear, linear_many, attention, rmsnorm, rope, route,
moe_experts, kv_write, kv_read, ...), the expert cache's lookup / expert / finish, the fused MoE kernel call, and
each attention and FFN block. Prints ms per token bare and wrapped, then ms and calls per token of each row, largest
first. The wrappers themselves add ~1 us a call, and nested rows overlap (the FFN block contains moe_experts, which
contains the kernel call), so the rows do not add up to the total.
What this is not: a speed measurement to quote (bench/bench_forward.py, bench/compare_llamacpp.py), nor a profile of
the kernels' insides.

    PYTHONPATH=. PYMOE_ACT_BITS=8 python bench/decode_breakdown.py /work/bigm/mid-Q4_K_M.gguf --threads 2
    PYTHONPATH=. python bench/decode_breakdown.py /work/bigm/mid-Q4_K_M.gguf --threads 2 --prefill 128 --tokens 5
"""
from __future__ import annotations

import argparse
import collections
import functools
import time

import numpy as np

import pymoe
import pymoe.engine.model as model_mod
from pymoe.quant import kernels

BACKEND_CALLS = ("linear", "linear_many", "attention", "rmsnorm", "rope", "route", "moe_experts", "kv_write",
                 "kv_read", "to_device", "to_host", "view")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    ap.add_argument("--tokens", type=int, default=40, help="decoded tokens timed (default 40)")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens before them (default 128)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="tokens decoded before the timed ones (default 5; more lets a large file's experts get their "
                         "repacked copies first)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="time the prefill of an N-token prompt instead (--tokens prompts, each on a fresh cache)")
    args = ap.parse_args()

    n_ctx = args.context + args.warmup + 2 * args.tokens + 16
    engine = pymoe.load(args.model, threads=args.threads, n_ctx=n_ctx)
    model = engine.model
    seconds, calls = collections.Counter(), collections.Counter()
    if not args.prefill:  # prompt, warm-up, then --tokens timed without the wrappers (the figure to set beside them)
        prompt = np.random.default_rng(0).integers(0, engine.config.n_vocab, args.context)
        kv = model.new_kv(n_ctx)
        logits = model.prefill(prompt, kv)[-1]
        for _ in range(args.warmup):
            logits = model.decode_one_token(int(np.argmax(logits)), kv)
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            logits = model.decode_one_token(int(np.argmax(logits)), kv)
        bare = (time.perf_counter() - t0) / args.tokens

    def timed(fn, label):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - t0
                calls[label] += 1
        return wrapper

    for name in BACKEND_CALLS:
        if hasattr(model.backend, name):
            setattr(model.backend, name, timed(getattr(model.backend, name), f"backend.{name}"))
    for name in ("lookup", "expert", "finish"):
        setattr(model.cache, name, timed(getattr(model.cache, name), f"cache.{name}"))
    kernels.moe_act_table = timed(kernels.moe_act_table, "kernels.moe_act_table (the fused MoE call)")
    for table, kind in ((model_mod.FFN, "ffn"), (model_mod.ATTENTION, "attention")):
        for key in list(table):
            table[key] = timed(table[key], f"{kind} block: {key}")

    if args.prefill:
        prefill_breakdown(engine, model, args, seconds, calls)
        return
    seconds.clear()
    calls.clear()
    t0 = time.perf_counter()
    for _ in range(args.tokens):
        logits = model.decode_one_token(int(np.argmax(logits)), kv)
    total = (time.perf_counter() - t0) / args.tokens
    print(f"{args.model}: {args.threads} threads, act_bits {model.backend.__dict__.get('act_bits', '-')}, "
          f"{args.tokens} tokens: {bare * 1e3:.2f} ms per token bare, then {total * 1e3:.2f} wrapped")
    for label, s in seconds.most_common():
        print(f"  {label:48s} {s / args.tokens * 1e3:8.3f} ms/token  {calls[label] / args.tokens:6.1f} calls/token")


def prefill_breakdown(engine, model, args, seconds, calls):
    """The same rows for prefill: --tokens prompts of --prefill tokens, each on a fresh cache, after one warm-up
    prompt (its experts' repacked copies made, the kernels compiled); ms per prompt."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, engine.config.n_vocab, args.prefill) for _ in range(args.tokens + 1)]
    model.prefill(prompts[0], model.new_kv(args.prefill + 16))
    seconds.clear()
    calls.clear()
    t0 = time.perf_counter()
    for p in prompts[1:]:
        model.prefill(p, model.new_kv(args.prefill + 16))
    total = (time.perf_counter() - t0) / args.tokens
    print(f"{args.model}: {args.threads} threads, act_bits {model.backend.__dict__.get('act_bits', '-')}, prefill of "
          f"{args.prefill} tokens x {args.tokens}: {total * 1e3:.2f} ms per prompt ({args.prefill / total:.0f} tok/s, "
          f"wrapped)")
    for label, s in seconds.most_common():
        print(f"  {label:48s} {s / args.tokens * 1e3:8.3f} ms/prompt  {calls[label] / args.tokens:6.1f} calls/prompt")


if __name__ == "__main__":
    main()
