"""Benchmark: decode hit rate of the slot pool with and without the router lookahead's prefetch into slots.

What this is: the demo model (or MODEL) on the CPU backend with `--cache-slots` (the GPU pool's accounting,
emulated in RAM: the same hits, misses and copies a GPU pool would make), one sampled request per setting, the
decode counters of the expert cache printed as a markdown table: hit rate without the lookahead, with `--lookahead
K'` (K' predicted per token, at most K' copies per layer-step), the copies it started (prefetched) and the lookups
that hit them at the layer they were for (prefetch hits), and the slot copies in all (promoted + prefetched: the
host-to-device traffic a GPU would make). The tokens are the same in every setting (checked).
What this is not: a timing (on a GPU the copies overlap with the next layer's attention; the simulator in CI does
not time), or a replay (the simulator's replay of a trace recorded with the lookahead, `pymoe simulate --prefetch`,
is bench/prefetch_replay.py).

    PYTHONPATH=. nice python bench/lookahead_slots.py --tokens 64
"""
from __future__ import annotations

import argparse

import pymoe
from pymoe.experts.prefetch import Lookahead


def run(path, slots, policy, k, tokens, prompt, seed):
    e = pymoe.load(path, cache_slots=slots, policy=policy, pcie_frac=1.0)
    if k:
        e.model.lookahead = Lookahead(e.model, k=k, advise=False)
    out = list(e.generate(prompt, max_tokens=tokens, stop_at_eos=False, temperature=0.7, seed=seed))
    return out, dict(e.cache.stats.counts["decode"])


def main() -> None:
    from pymoe import demo

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="lfru,lru")
    ap.add_argument("--k", default="4,8", help="K' values of the lookahead to run (besides off)")
    ap.add_argument("--coverage", default="10,25,50", help="pool sizes, % of all experts")
    a = ap.parse_args()
    path = a.model or demo.demo_model()
    cfg = pymoe.load(path).config
    prompt = demo.DEMO_PROMPT if a.model is None else [1, 2, 3, 4]
    n_total = len(cfg.moe_layers) * cfg.n_expert
    print("| policy | coverage (slots) | lookahead | decode hit rate | prefetched | prefetch hits | slot copies |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for policy in a.policies.split(","):
        for cov in (int(c) for c in a.coverage.split(",")):
            slots = max(1, round(n_total * cov / 100))
            base = None
            for k in [0] + [int(k) for k in a.k.split(",")]:
                toks, d = run(path, slots, policy, k, a.tokens, prompt, a.seed)
                base = base or toks
                assert toks == base, "the lookahead changed the tokens"
                print(f"| {policy} | {cov}% ({slots}) | {'off' if not k else f'top-{k}'} | "
                      f"{100 * d['hits'] / d['lookups']:.1f}% | {d['prefetched']} | {d['prefetch_hits']} | "
                      f"{d['promoted'] + d['prefetched']} |", flush=True)


if __name__ == "__main__":
    main()
