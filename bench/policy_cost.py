"""Benchmark: what each cache policy costs per lookup, on the shape of a real model's decode.

What this is: a trace fitted to Qwen3-30B-A3B's measured routing (all 48 layers, 128 experts, top-8: 384 lookups a
decoded token; bench/cache_policies.py's locality and window; one request of 8 prompt and --tokens decode tokens),
replayed by `simulate.sweep` through each policy at 25% coverage, global pool, pre-filled from the measured counts;
each policy once to warm up (its compiled parts load), then timed --repeat times (the fastest and the slowest run):
microseconds per lookup and milliseconds per decoded token. `cooc` is timed twice: as registered
(policies.CompiledCoocPolicy) and as its reference, CoocPolicy, which decides the same in the interpreter. The
engine pays a policy per lookup in the same way (experts/cache.py's SlotTable), so on a GPU these milliseconds are
part of every decoded token.
With --engine, the whole of the engine's bookkeeping per lookup instead: the demo model (4 MoE layers x 32 experts,
top-4) on the CPU backend with a pool of 25% of its experts under each policy, rounds of 3 requests of 64 sampled
tokens (one to warm up, then --repeat timed); SlotCache.lookup timed on its decode calls (the policy, the slot table, the counters, the miss path's choice, the
live gap; not the promotions' copies, which each call's finish() makes first): microseconds per decode lookup, and what that is a token on a 48-layer top-8 model (x 384).
What this is not: the pool's copies or the experts' compute, nor a test.

    PYTHONPATH=. python bench/policy_cost.py [--tokens 64] [--repeat 3] [--policies lru,cooc,...] [--engine]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import cache_policies as cp
    from pymoe.experts import policies
    from pymoe.experts.policies import ENGINE_POLICIES
    from pymoe.experts.profile import Profile
    from pymoe.experts.simulate import slots_for_coverage, sweep
    from pymoe.experts.trace import fitted_trace

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens (default 64)")
    ap.add_argument("--policies", default=",".join(ENGINE_POLICIES), help="comma-separated (default: all)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per policy (default 3)")
    ap.add_argument("--engine", action="store_true", help="time the engine's SlotCache.lookup on the demo model")
    args = ap.parse_args()
    if args.engine:
        return engine_cost(args.policies.split(","), args.tokens, args.repeat)
    heat = np.asarray(json.load(open(cp.HEAT_30B))["heat"], dtype=np.int64)  # [48, 128]
    L, E, K = heat.shape[0], heat.shape[1], 8
    tr = fitted_trace(heat, locality=cp.FIT_LOCALITY, window=cp.FIT_WINDOW, k=K, n_requests=1, prompt_len=8,
                      decode_len=args.tokens, seed=0)
    prof = Profile.from_heat(heat)
    slots = slots_for_coverage(25, L, E)
    lookups = tr.n_tokens * L * K
    print(f"fitted Qwen3-30B-A3B: {L} layers x {E} experts, top-{K}; {tr.n_tokens} tokens ({lookups} lookups); "
          f"{slots} slots (25%), global pool")
    def timed(name: str, label: str) -> None:
        sweep(tr, [name], [slots], ["global"], profile=prof, phase="decode")  # warm: compiled parts loaded
        runs = []
        for _ in range(max(1, args.repeat)):
            t = time.perf_counter()
            sweep(tr, [name], [slots], ["global"], profile=prof, phase="decode")
            runs.append(time.perf_counter() - t)
        lo, hi = min(runs), max(runs)
        print(f"{label:16s} {1e6 * lo / lookups:5.1f}-{1e6 * hi / lookups:5.1f} us a lookup, "
              f"{1e3 * lo / tr.n_tokens:5.2f}-{1e3 * hi / tr.n_tokens:5.2f} ms a token of {L * K} lookups", flush=True)

    for name in args.policies.split(","):
        timed(name, name)
        if name == "cooc":  # its reference in the interpreter, under the same name for this run only
            compiled = policies.POLICIES["cooc"]
            policies.POLICIES["cooc"] = policies.CoocPolicy
            try:
                timed("cooc", "cooc reference")
            finally:
                policies.POLICIES["cooc"] = compiled

def engine_cost(names, tokens: int, repeat: int) -> None:
    """--engine: SlotCache.lookup's time per decode lookup on the demo model, per policy: a round of 3 requests to
    warm up, then `repeat` rounds timed (the fastest and the slowest)."""
    import pymoe
    from pymoe import demo

    for name in names:
        eng = pymoe.load(demo.demo_model(), backend="cpu", cache_slots=32, policy=name)  # 25% of 4 x 32 experts
        cache, spent = eng.cache, [0.0, 0]
        lookup = cache.lookup

        def timed(layer, expert_ids, phase, rows=None):
            cache.finish(layer)  # the last call's promotions copied first, untimed: bytes, not bookkeeping
            t = time.perf_counter()
            lookup(layer, expert_ids, phase, rows)
            if phase == "decode":
                spent[0] += time.perf_counter() - t
                spent[1] += expert_ids.size

        cache.lookup = timed  # this engine's cache only
        per = []
        for round_ in range(1 + max(1, repeat)):
            spent[:] = [0.0, 0]
            for seed in range(3):
                list(eng.generate("The quick brown fox", max_tokens=tokens, temperature=0.7, seed=seed))
            if round_:  # the first round warms up
                per.append(spent[0] / max(spent[1], 1))
        lo, hi = min(per), max(per)
        print(f"{name:11s} {1e6 * lo:5.1f}-{1e6 * hi:5.1f} us a decode lookup ({spent[1]} a round, hit rate "
              f"{cache.stats.hit_rate('decode'):.3f}); x 384: {1e3 * 384 * lo:5.2f}-{1e3 * 384 * hi:5.2f} ms a token "
              "of a 48-layer top-8 model", flush=True)

if __name__ == "__main__":
    main()
