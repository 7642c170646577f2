"""Benchmark: what the router lookahead's prefetch into slots does to the decode hit rate, replayed by the simulator
on a demo-model trace recorded with the lookahead on (`pymoe simulate TRACE --prefetch`).

What this is: the measurement behind docs/expert-cache.md's "Prefetch in the simulator" table. The demo model
samples --requests requests of --tokens tokens (temperature 0.7, repeat penalty 1.1, seeds 0 .. n - 1, the demo
prompt) with `Lookahead(k=4)` (`--lookahead 4`: K' = K = 4 predicted per token, at most 4 placed per layer-step),
traced as `pymoe run --lookahead 4 --trace` does; the lookahead's predictions depend only on the routing, not on the
pool, so one trace serves every pool. Each cell is `simulate.sweep` counting decode lookups, pools pre-filled from
the demo's packaged profile, once without and once with the recorded prefetch replayed (`--prefetch`).
What this is not: the cache_policies.py table (a separate, shorter trace: recording the lookahead costs a router
matmul per layer per token, and that bench's 8 x 256 tokens would take minutes more), or a timing measurement (a
prefetch's worth is a copy overlapped with attention on a GPU, not counted here).

    PYTHONPATH=. python bench/prefetch_replay.py [--requests 2] [--tokens 128] [--trace OUT.npz]
"""
from __future__ import annotations

import argparse
import time

from cache_policies import record  # the demo trace recorder, here with the lookahead on (this folder is on sys.path)
from pymoe import demo
from pymoe.experts.policies import Admission
from pymoe.experts.profile import Profile
from pymoe.experts.simulate import slots_for_coverage, sweep

COVERAGES = (10, 25, 50)
POLICIES = ("static", "lru", "lfu", "lfru", "pinned-lru")
ADMISSIONS = {"none": Admission(), "max 2": Admission(max_inserts=2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--trace", default="/tmp/demo-lookahead-trace.npz")
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = record(args.trace, args.requests, args.tokens, lookahead=4)
    t_rec = time.perf_counter() - t0
    profile = Profile.load(demo.demo_profile())
    L, E = trace.n_layers, trace.n_experts
    slots = [slots_for_coverage(c, L, E) for c in COVERAGES]
    print(f"demo: {trace.summary()} (recorded in {t_rec:.0f} s); pools pre-filled from the demo profile; "
          "decode hit rate %, with prefetch: hit rate (prefetched / prefetch hits)")
    cols = [f"{pool} {c}%" for pool in ("global", "per-layer") for c in COVERAGES]
    print("\n| policy | admission | prefetch | " + " | ".join(cols) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in cols) + " |")
    for name in POLICIES:
        for adm_name, adm in ADMISSIONS.items():
            for pf in (False, True):
                by = {(r.pool, r.slots): r for r in sweep(trace, [name], slots, ["global", "per-layer"],
                                                           profile=profile, phase="decode", admission=adm,
                                                           prefetch=pf)}
                cells = []
                for pool in ("global", "per-layer"):
                    for n in slots:
                        r = by[pool, n]
                        cells.append(f"{100 * r.hit_rate:.1f}" + (f" ({r.prefetched}/{r.prefetch_hits})" if pf else ""))
                print(f"| {name} | {adm_name} | {'on' if pf else 'off'} | " + " | ".join(cells) + " |")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
