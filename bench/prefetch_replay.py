"""Benchmark: what the router lookahead's prefetch into slots does to the decode hit rate, replayed by the simulator
on a demo-model trace recorded with the lookahead on (`pymoe simulate TRACE --prefetch`).

What this is: the measurement behind docs/expert-cache.md's "Prefetch in the simulator" table. The demo model
samples --requests requests of --tokens tokens (temperature 0.7, repeat penalty 1.1, seeds 0 .. n - 1, the demo
prompt) with `Lookahead(k=4)` (`--lookahead 4`: K' = K = 4 predicted per token, at most 4 placed per layer-step),
traced as `pymoe run --lookahead 4 --trace` does; the lookahead's predictions depend only on the routing, not on the
pool, so one trace serves every pool. Each cell is `simulate.sweep` counting decode lookups, pools pre-filled from
the demo's packaged profile, once without and once with the recorded prefetch replayed (`--prefetch`).
Then the cost table (issue 48, "prefetch that pays"): global pool, each engine policy of COST_POLICIES with admission
none and max 2, prefetch off and on: decode misses, misses removed by the prefetch, prefetched copies, the bytes that
cross the host -> device link per decode token and the planner's modelled time per token at 13.9 and 25 GB/s PCIe
(plan.decode_time_per_token with the demo model's facts, plan.facts_from_gguf), every prefetched copy counted as link
bytes on the critical path (prefetch_time_per_token: the planner's model, which has no overlap term).
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
from pymoe.experts.plan import CostModel, facts_from_gguf, prefetch_time_per_token
from pymoe.experts.policies import DEFAULT_POLICY, Admission
from pymoe.experts.profile import Profile
from pymoe.experts.simulate import slots_for_coverage, sweep
from pymoe.experts.trace import Trace

COVERAGES = (10, 25, 50)
POLICIES = ("static", "lru", "lfu", "lfru", "pinned-lru")
ADMISSIONS = {"none": Admission(), "max 2": Admission(max_inserts=2)}
COST_POLICIES = ("lru", "lfru", "pinned-lru", "llamacpp", "s3fifo-c7", "window")
PCIE_GBS = (13.9, 25.0)  # issue 48: the article's probe (Gen3 x16) and a Gen4 x16 link's usable rate


def cost_table(trace, profile, slots) -> list[str]:
    """The cost rows (module docstring): global pool, per coverage, prefetch off then on."""
    facts = facts_from_gguf(demo.demo_model())
    costs = [CostModel.from_options(pcie_gbs=g) for g in PCIE_GBS]
    lines = [f"\ncost (global pool; {facts.slot_bytes} bytes per expert; ms per token = the planner's model, every "
             "miss and every prefetched copy crossing the link):",
             "| policy | admission | coverage | prefetch | decode misses | misses removed | prefetched | link KiB / token "
             "| ms / token @ 13.9 GB/s | ms / token @ 25 GB/s |", "|" + " --- |" * 10]
    names = [n for n in COST_POLICIES if n != DEFAULT_POLICY] + [DEFAULT_POLICY]
    for name in names:
        for adm_name, adm in ADMISSIONS.items():
            off = {r.slots: r for r in sweep(trace, [name], slots, ["global"], profile=profile, phase="decode",
                                             admission=adm)}
            on = {r.slots: r for r in sweep(trace, [name], slots, ["global"], profile=profile, phase="decode",
                                            admission=adm, prefetch=True)}
            for cov, n in zip(COVERAGES, slots):
                for pf, r in (("off", off[n]), ("on", on[n])):
                    misses = r.lookups - r.hits
                    tokens = r.lookups / facts.lookups_per_token
                    removed = (off[n].lookups - off[n].hits) - misses
                    copies = misses + r.prefetched
                    ms = [1e3 * prefetch_time_per_token(r.hits / r.lookups, r.prefetched / tokens, facts, c).total_s
                          for c in costs]
                    lines.append(f"| {name} | {adm_name} | {cov}% | {pf} | {misses} | {removed if pf == 'on' else ''} "
                                 f"| {r.prefetched if pf == 'on' else ''} | {copies * facts.slot_bytes / tokens / 1024:.1f} "
                                 f"| {ms[0]:.3f} | {ms[1]:.3f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--trace", default="/tmp/demo-lookahead-trace.npz", help="where the recorded trace goes")
    ap.add_argument("--replay", default=None, help="replay this trace (recorded with the lookahead) instead of "
                    "recording one")
    args = ap.parse_args()
    t0 = time.perf_counter()
    trace = Trace.load(args.replay) if args.replay else record(args.trace, args.requests, args.tokens, lookahead=4)
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
    print("\n".join(cost_table(trace, profile, slots)))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
