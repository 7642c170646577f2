"""pymoe serve's slot count when -np/--parallel is not given: how many sequences one decode step runs, and why.

The rule (docs/server.md "The default slot count"), per backend and expert-cache coverage:
  - cpu (and reference): CPU_SLOTS, from bench/slots_sweep.py's measurement: every expert is read in place from
    host memory, so sequences batched in one step share the weight reads and nothing is evicted;
  - cuda with a slot pool that holds every routed expert: as cpu (no misses to multiply);
  - cuda with a partial pool, or none: 1. The reference article, section 7: each sequence brings its own experts, the
    union of N sequences' experts is larger than one's, the misses multiply and 4 slots gave less total throughput
    than 1;
and never more slots than memory holds: the default context rule (engine/kv.py default_ctx) gives the slots' KV
caches together at most SERVE_KV_SHARE of the usable memory, so at most as many slots as fit there at the context
they get (-c, or the floor of the default rule). `-np N` overrides it all.
What this is not: the context rule (engine/kv.py), or the scheduler (scheduler.py), which takes the count it is given.
"""
from typing import Optional

from pymoe.engine.kv import SERVE_CTX_FLOOR, SERVE_KV_SHARE, kv_bytes, memory_limit

CPU_SLOTS = 4  # bench/slots_sweep.py on the demo model and a 12-layer qwen3moe Q4_K_M: the figures in docs/server.md


def memory_slots(cfg, kind: str = "f16", n_ctx: Optional[int] = None, memory: Optional[int] = None) -> int:
    """The most slots whose KV caches of `n_ctx` positions (None: the default context rule's floor) fit in
    SERVE_KV_SHARE of `memory` (default engine/kv.py memory_limit()); at least 1."""
    memory = memory_limit() if memory is None else memory
    n_ctx = n_ctx or min(SERVE_CTX_FLOOR, cfg.n_ctx_train)
    return max(1, int(SERVE_KV_SHARE * memory // max(kv_bytes(cfg, n_ctx, kind), 1)))


def default_parallel(cfg, backend: str, coverage: Optional[float], kind: str = "f16", n_ctx: Optional[int] = None,
                     memory: Optional[int] = None) -> tuple:
    """-> (slots, why). backend: the engine's backend name; coverage: the expert slot pool's share of the routed
    experts (None: not known yet, taken as full: the most the rule can give, which pymoe serve sizes the context for
    before the model is loaded); n_ctx: the context per slot (-c), None for the default rule's."""
    if backend == "cuda" and coverage is not None and coverage < 1:
        held = f"an expert cache of {coverage:.0%} of the experts" if coverage > 0 else "no expert cache"
        return 1, (f"cuda backend with {held}: each sequence brings its own experts and the misses multiply "
                   "(the reference article, section 7: 4 slots gave less total throughput than 1)")
    why = ("cuda backend with every expert in slots, as on the cpu: " if backend == "cuda" else f"{backend} backend: ")
    why += f"{CPU_SLOTS} slots decode more tokens per second in total than 1 (bench/slots_sweep.py, docs/server.md)"
    fit = memory_slots(cfg, kind, n_ctx, memory)
    if fit < CPU_SLOTS:
        return fit, (f"{why}, but {fit} slot(s) of KV at {n_ctx or min(SERVE_CTX_FLOOR, cfg.n_ctx_train)} tokens fill "
                     f"the {SERVE_KV_SHARE:g} of memory that KV may take")
    return CPU_SLOTS, why


def coverage(engine) -> float:
    """The share of the routed experts that the engine's slot pool holds (0: no pool)."""
    n_total = len(engine.config.moe_layers) * engine.config.n_expert
    return min(1.0, engine.cache.n_slots / n_total) if n_total else 1.0
