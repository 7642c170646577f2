"""Benchmark: decode hit rate of every cache policy at 10/25/50% coverage, with Belady as the bound, on a routing
trace of the demo model recorded here (or on a trace file given).

What this is: the measurement behind docs/expert-cache.md's policy table. Without --trace it records one: the demo
model samples --requests requests of --tokens tokens (temperature 0.7, repeat penalty 1.1, seeds 0 .. n - 1, the
demo prompt), traced as `pymoe run --trace` does. Then `simulate.sweep` replays it through each policy in one global
pool pre-filled from the demo's profile, counting decode lookups (`pymoe simulate TRACE --phase decode`).
What this is not: a test (tests/test_policies.py holds each policy to worked examples).

    PYTHONPATH=. python bench/cache_policies.py [--trace T.npz] [--requests 8] [--tokens 256]
"""
from __future__ import annotations

import argparse

import pymoe
from pymoe import demo
from pymoe.experts.policies import POLICIES
from pymoe.experts.profile import Profile
from pymoe.experts.simulate import slots_for_coverage, sweep
from pymoe.experts.trace import Trace

COVERAGES = (10, 25, 50)


def record(path: str, n_requests: int, n_tokens: int) -> Trace:
    engine = pymoe.load(demo.demo_model(), backend="cpu")
    rec = engine.record_trace()
    for seed in range(n_requests):
        list(engine.generate(demo.DEMO_PROMPT, max_tokens=n_tokens, stop_at_eos=False, temperature=0.7,
                             repeat_penalty=1.1, seed=seed))
    rec.save(path)
    return Trace.load(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=None, help="a trace to replay (default: record one of the demo model)")
    ap.add_argument("--out", default="demo-trace.npz", help="where a recorded trace goes (default demo-trace.npz)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    trace = Trace.load(args.trace) if args.trace else record(args.out, args.requests, args.tokens)
    profile = Profile.load(demo.demo_profile())
    L, E = trace.n_layers, trace.n_experts
    print(trace.summary())
    print(f"global pool pre-filled from {demo.demo_profile()}; decode hit rate %")
    names = list(POLICIES)
    print(f"{'coverage':<10}" + "".join(f"{n:>12}" for n in names))
    for cov in COVERAGES:
        slots = slots_for_coverage(cov, L, E)
        res = {r.policy: r for r in sweep(trace, names, [slots], ["global"], profile=profile, phase="decode")}
        print(f"{f'{cov}% ({slots})':<10}" + "".join(f"{100 * res[n].hit_rate:>12.1f}" for n in names))


if __name__ == "__main__":
    main()
