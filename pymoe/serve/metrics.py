"""What `/v1/status` (JSON) and `/metrics` (Prometheus text) show: the scheduler's and the expert cache's counters.

Both read the counters at request / scrape time, under the scheduler's lock: nothing is counted twice, and nothing
here counts anything. /v1/status is also what the monitor page (monitor.html, at /) polls: slot states, the recent
requests' log lines and, asked for with ?experts=1, the per-layer expert map (residency and heat) it draws.
What this is not: the counting (scheduler.py counts requests and tokens, experts/cache.py counts lookups), the
routes (app.py) or the page's drawing (monitor.html).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np

from pymoe.engine.kv import kv_nbytes
from pymoe.experts.cache import COUNTERS


def model_id(engine) -> str:
    """The name the server answers with (/v1/models, every reply's `model`): the GGUF file's name."""
    return os.path.basename(engine.file.path)


def status_of(scheduler, experts: bool = False) -> dict:
    """/v1/status: model, backend, KV, slots (state, cached tokens), queue depth, expert cache, request outcomes,
    recent jobs (each with its log line), on a device backend its launches, bytes by name and syncs per decoded
    token (`device`). experts: add the per-expert map (`expert_map`; /v1/status?experts=1, what the monitor page
    polls: L x E numbers, too many to send unasked for a 48 x 512 model)."""
    eng, cfg, cache = scheduler.engine, scheduler.engine.config, scheduler.engine.cache
    n_experts = len(cfg.moe_layers) * cfg.n_expert
    counts = {p: dict(c) for p, c in cache.stats.counts.items()}
    S = scheduler
    with S.lock:
        status = dict(
            model=model_id(eng), arch=cfg.arch, backend=eng.backend.name, n_ctx=S.n_ctx,
            kv=S.kv_kind, kv_bytes_per_slot=kv_nbytes(S.slots[-1].kv), parallel=len(S.slots),
            device_kv_slots=S.device_slots(),
            max_queue=S.max_queue, prefill_chunk=S.prefill_chunk, queue_depth=S.waiting(),
            max_batch=S.max_batch,
            slots=[slot_of(s) for s in S.slots],
            cache=dict(describe=cache.describe(), slots=cache.n_slots, experts=n_experts,
                       policy=cache.policy_name, pool=cache.n_slots > 0,
                       coverage=cache.n_slots / n_experts,  # of the slot pool: 0 with none
                       counts=counts, gap=gap_of(cache)),
            requests=dict(S.outcomes), tokens=dict(S.totals), last=dict(S.last),
            recent=list(S.recent),
        )
    device_counts = getattr(eng.backend, "counts", None)
    if device_counts is not None:  # CUDA: the device's cost per decoded token since start (backends/device_counts.py)
        from pymoe.backends.device_counts import per_token

        status["device"] = dict(decode_per_token=per_token(device_counts.snapshot("decode")))
        if hasattr(device_counts, "per_device"):  # several devices (backends/multi_device.py): each one's too
            status["device"]["per_device"] = [per_token(c) for c in device_counts.per_device("decode")]
    if hasattr(cache, "per_device"):  # several devices: each pool's slots, layers and counters since start
        status["cache"]["per_device"] = [dict(d, prefill=p) for d, p in zip(cache.per_device("decode"),
                                                                             cache.per_device("prefill"))]
    if experts:
        status["expert_map"] = expert_map(cache, cfg)
    return status


def slot_of(slot) -> dict:
    """One slot now: idle (no job), prefill (its prompt is being read, chunk by chunk) or decode."""
    job = slot.job
    state = "idle" if job is None else "prefill" if slot.pending else "decode"
    return dict(index=slot.index, busy=job is not None, state=state, cached_tokens=len(slot.tokens),
                generated=job.stats.n_generated if job is not None else 0)


def gap_of(cache) -> Optional[dict]:
    """The live gap (experts/gap.py): decode lookups in the closed windows since start, the engine's hits on them and
    Belady's with the same slots from the same contents, and both rates; None with no slot pool."""
    gap = getattr(cache, "gap", None)
    if gap is None:
        return None
    g = gap.totals()
    n = g["lookups"]
    return dict(g, hit_rate=g["hits"] / n if n else 0.0, belady_hit_rate=g["belady_hits"] / n if n else 0.0)


def expert_map(cache, cfg) -> dict:
    """Per MoE layer, per expert: resident (1: in a slot now) and heat (decode lookups since start). The engine
    thread keeps writing both while this reads them: a map one lookup call old is good enough to look at."""
    layers = list(cfg.moe_layers)
    residency = getattr(cache, "residency", None)  # [L, E] slot or -1; a PassThroughCache has no pool
    resident = residency[layers] >= 0 if residency is not None else np.zeros((len(layers), cfg.n_expert), bool)
    return dict(layers=layers, n_expert=cfg.n_expert, resident=resident.astype(int).tolist(),  # [L_moe][E] 0/1
                heat=cache.heat[layers].tolist())  # [L_moe][E] decode lookups


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
        yield GaugeMetricFamily("pymoe_queue_depth", "Requests waiting for a slot.", value=S.waiting())
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
        g = gap_of(cache)
        if g is not None:
            yield GaugeMetricFamily("pymoe_expert_decode_window_hit_rate", "Engine hits / decode lookups in the live "
                                    "gap's closed windows (the lookups Belady was replayed on).", value=g["hit_rate"])
            yield GaugeMetricFamily("pymoe_expert_decode_belady_hit_rate", "Belady's hits / the same decode lookups, "
                                    "same slots and starting contents (experts/gap.py).", value=g["belady_hit_rate"])
        d = counts["decode"]
        for path in ("spill", "cpu"):
            yield GaugeMetricFamily(f"pymoe_expert_{path}_share", f"Share of decode expert lookups served by {path}.",
                                    value=d[path] / d["lookups"] if d["lookups"] else 0.0)
