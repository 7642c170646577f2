"""What `/v1/status` (JSON) and `/metrics` (Prometheus text) show: the scheduler's and the expert cache's counters.

Both read the counters at request / scrape time, under the scheduler's lock: nothing is counted twice, and nothing
here counts anything. What this is not: the counting (scheduler.py counts requests and tokens, experts/cache.py
counts lookups) or the routes (app.py).
"""
from __future__ import annotations

import math
import os

from pymoe.engine.kv import kv_nbytes
from pymoe.experts.cache import COUNTERS


def model_id(engine) -> str:
    """The name the server answers with (/v1/models, every reply's `model`): the GGUF file's name."""
    return os.path.basename(engine.file.path)


def status_of(scheduler) -> dict:
    """/v1/status: model, backend, KV, slots and their cached tokens, expert cache, request outcomes, recent jobs."""
    eng, cfg, cache = scheduler.engine, scheduler.engine.config, scheduler.engine.cache
    n_experts = len(cfg.moe_layers) * cfg.n_expert
    counts = {p: dict(c) for p, c in cache.stats.counts.items()}
    S = scheduler
    with S.lock:
        return dict(
            model=model_id(eng), arch=cfg.arch, backend=eng.backend.name, n_ctx=S.n_ctx,
            kv=S.kv_kind, kv_bytes_per_slot=kv_nbytes(S.slots[0].kv), parallel=len(S.slots),
            max_queue=S.max_queue, queue_depth=S.queue.qsize(), max_batch=S.max_batch,
            slots=[dict(index=s.index, busy=s.job is not None, cached_tokens=len(s.tokens)) for s in S.slots],
            cache=dict(describe=cache.describe(), slots=cache.n_slots, experts=n_experts,
                       policy=cache.policy_name, pool=cache.n_slots > 0,
                       coverage=cache.n_slots / n_experts,  # of the slot pool: 0 with none
                       counts=counts),
            requests=dict(S.outcomes), tokens=dict(S.totals), last=dict(S.last),
            recent=list(S.recent),
        )


def registry_for(scheduler):
    """A Prometheus registry holding one collector for this scheduler (one per app: tests run several)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(ServerCollector(scheduler))
    return registry


class ServerCollector:
    """Reads the scheduler's and the expert cache's counters at scrape time."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        S = self.scheduler
        with S.lock:
            outcomes, totals, last = dict(S.outcomes), dict(S.totals), dict(S.last)
        req = CounterMetricFamily("pymoe_requests", "Requests by outcome (ok, cancelled, rejected = 429, "
                                  "bad_request = 400, unauthorized, not_found, bad_method, too_large, timeout = 408 "
                                  "or past the request time limit, error).", labels=["outcome"])
        for outcome, n in sorted(outcomes.items()):
            req.add_metric([outcome], n)
        yield req
        yield GaugeMetricFamily("pymoe_queue_depth", "Requests waiting for a slot.", value=S.queue.qsize())
        yield GaugeMetricFamily("pymoe_slots_busy", "Slots decoding a request.", value=S.busy())
        yield GaugeMetricFamily("pymoe_slots", "Parallel slots (--parallel).", value=len(S.slots))
        for name, doc in (("prompt_tokens", "Prompt tokens received."),
                          ("reused_tokens", "Prompt tokens whose KV was reused from a slot (prefix reuse)."),
                          ("generated_tokens", "Tokens generated."), ("prefill_seconds", "Seconds spent in prefill."),
                          ("decode_seconds", "Seconds spent in batched decode steps.")):
            yield CounterMetricFamily(f"pymoe_{name}", doc, value=totals.get(name, 0))
        yield GaugeMetricFamily("pymoe_decode_tokens_per_second", "Tokens per second of the last batched decode "
                                "step, all slots together.", value=last["decode_tok_s"])
        yield GaugeMetricFamily("pymoe_prefill_tokens_per_second", "Prompt tokens per second of the last prefill.",
                                value=last["prefill_tok_s"])
        yield from self._cache_metrics(CounterMetricFamily, GaugeMetricFamily)

    def _cache_metrics(self, CounterMetricFamily, GaugeMetricFamily):
        cache = self.scheduler.engine.cache
        counts = {p: dict(c) for p, c in cache.stats.counts.items()}
        for name in COUNTERS:
            fam = CounterMetricFamily(f"pymoe_expert_{name}", f"Expert cache {name} by phase.", labels=["phase"])
            for phase, c in counts.items():
                fam.add_metric([phase], c[name])
            yield fam
        pool = cache.n_slots > 0
        rate = GaugeMetricFamily("pymoe_expert_hit_rate", "Expert cache hits / lookups (NaN with no slot pool: no "
                                 "cache, no hit rate).", labels=["phase"])
        for phase, c in counts.items():
            value = (c["hits"] / c["lookups"] if c["lookups"] else 0.0) if pool else math.nan
            rate.add_metric([phase], value)
        yield rate
        d = counts["decode"]
        for path in ("spill", "cpu"):
            yield GaugeMetricFamily(f"pymoe_expert_{path}_share", f"Share of decode expert lookups served by {path}.",
                                    value=d[path] / d["lookups"] if d["lookups"] else 0.0)
