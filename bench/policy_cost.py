"""Benchmark: what each cache policy costs per lookup, on the shape of a real model's decode.

What this is: a trace fitted to Qwen3-30B-A3B's measured routing (all 48 layers, 128 experts, top-8: 384 lookups a
decoded token; bench/cache_policies.py's locality and window; one request of 8 prompt and --tokens decode tokens),
replayed by `simulate.sweep` through each policy at 25% coverage, global pool, pre-filled from the measured counts;
each policy once to warm up (its compiled parts load), then timed --repeat times (the fastest and the slowest run):
microseconds per lookup and milliseconds per decoded token. `cooc` is timed twice: as registered
(policies.CompiledCoocPolicy) and as its reference, CoocPolicy, which decides the same in the interpreter. The
engine's lookup loop pays a policy per lookup in the same way (experts/cache.py's SlotTable), except where its decode
calls run compiled whole (SlotCache._compiled_lookup: the default policy), which --engine measures; on a GPU these
milliseconds are part of every decoded token.
With --engine, the whole of the engine's bookkeeping per lookup call instead: the demo model (4 MoE layers x 32
experts, top-4; --model FILE: another) on the CPU backend with a pool of 25% of its experts under each policy,
rounds of 3 requests of --tokens sampled tokens (one round to warm up, then --repeat timed); SlotCache.lookup timed
on its decode calls (the policy, the slot table, the counters, the miss path's choice, the live gap; not the
promotions' copies, which each call's finish() makes first): microseconds a call and a pair, milliseconds a token
(one call per MoE layer). `cooc` is timed twice there too: compiled whole, and through the loop.
What this is not: the pool's copies or the experts' compute, nor a test.

    PYTHONPATH=. python bench/policy_cost.py [--tokens 64] [--repeat 3] [--policies lru,cooc,...] [--engine [--model F]]
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
    ap.add_argument("--model", default="", help="--engine on this GGUF file instead of the demo model")
    args = ap.parse_args()
    if args.engine:
        return engine_cost(args.policies.split(","), args.tokens, args.repeat, args.model)
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

def engine_cost(names, tokens: int, repeat: int, path: str = "") -> None:
    """--engine: SlotCache.lookup's time per decode lookup call on the demo model (or `path`), per policy: a round
    of 3 requests to warm up, then `repeat` rounds timed (the fastest and the slowest)."""
    import pymoe
    from pymoe import demo

    from pymoe.gguf.loader import load_gguf

    path = path or demo.demo_model()
    cfg = load_gguf(path).config
    slots = max(1, len(cfg.moe_layers) * cfg.n_expert // 4)  # 25% of the experts
    for name in [x for name in names for x in ([name, "cooc, loop"] if name == "cooc" else [name])]:
        eng = pymoe.load(path, backend="cpu", policy=name.split(",")[0], cache_slots=slots)
        if name.endswith("loop"):
            eng.cache._compiled_lookup = lambda *a: False  # SlotCache.lookup's loop, pair by pair
        cache, spent = eng.cache, [0.0, 0, 0]
        lookup = cache.lookup

        def timed(layer, expert_ids, phase, rows=None):
            cache.finish(layer)  # the last call's promotions copied first, untimed: bytes, not bookkeeping
            t = time.perf_counter()
            lookup(layer, expert_ids, phase, rows)
            if phase == "decode":
                spent[0] += time.perf_counter() - t
                spent[1] += expert_ids.size
                spent[2] += 1

        cache.lookup = timed  # this engine's cache only
        per = []
        for round_ in range(1 + max(1, repeat)):
            spent[:] = [0.0, 0, 0]
            for seed in range(3):
                list(eng.generate("The quick brown fox", max_tokens=tokens, temperature=0.7, seed=seed))
            if round_:  # the first round warms up
                per.append(spent[0] / max(spent[2], 1))
        lo, hi = min(per), max(per)
        K, calls = cfg.n_expert_used, len(cfg.moe_layers)
        print(f"{name:11s} {1e6 * lo:5.1f}-{1e6 * hi:5.1f} us a decode lookup call of {K} pairs "
              f"({1e6 * lo / K:4.1f}-{1e6 * hi / K:4.1f} a pair); {1e3 * calls * lo:5.2f}-{1e3 * calls * hi:5.2f} ms "
              f"a token of this model's {calls} MoE layers (hit rate {cache.stats.hit_rate('decode'):.3f})",
              flush=True)
        if name == "cooc":
            step_cost(path, slots, cfg, tokens)


def step_cost(path: str, slots: int, cfg, tokens: int) -> None:
    """A device step's lookups, made after it (SlotCache.lookup_step) against the layer by layer calls it stands
    for, compiled or through the loop: the decode routing of 3 requests (recorded from a CPU run) replayed through
    fresh caches each way, 3 times, the fastest: ms a token. The promotions' copies are left out (the pool's writes
    made no-ops: on a GPU they are copies on a stream of their own)."""
    import pymoe

    eng = pymoe.load(path, backend="cpu", policy="cooc", cache_slots=slots)
    seen, lookup = [], eng.cache.lookup

    def record(layer, expert_ids, phase, rows=None):
        if phase == "decode":
            seen.append(np.array(expert_ids, dtype=np.int64))
        lookup(layer, expert_ids, phase, rows)

    eng.cache.lookup = record
    for seed in range(3):
        list(eng.generate("The quick brown fox", max_tokens=tokens, temperature=0.7, seed=seed))
    layers = list(cfg.moe_layers)
    steps = [np.stack(seen[i:i + len(layers)]) for i in range(0, len(seen) - len(layers) + 1, len(layers))]
    best = {}
    for how in ("loop", "layer by layer", "lookup_step") * 3:
        cache = pymoe.load(path, backend="cpu", policy="cooc", cache_slots=slots).cache
        cache.pool.write = lambda slot, ex: None
        if how == "loop":
            cache._compiled_lookup = lambda *a: False
        t = time.perf_counter()
        for ids in steps:
            if how == "lookup_step":
                cache.lookup_step(layers, ids)
            else:
                for m, layer in enumerate(layers):
                    cache.lookup(layer, ids[m], "decode")
                    cache.finish(layer)
        best[how] = min(best.get(how, 1e9), (time.perf_counter() - t) / len(steps))
    print(f"{'':11s} a device step's lookups, {len(steps)} tokens replayed: "
          f"{1e3 * best['loop']:.3f} ms a token layer by layer through the loop, {1e3 * best['layer by layer']:.3f} "
          f"layer by layer compiled, {1e3 * best['lookup_step']:.3f} in one call (SlotCache.lookup_step)", flush=True)


if __name__ == "__main__":
    main()
