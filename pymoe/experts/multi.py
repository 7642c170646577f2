"""Several cards in one box: the planner's chain and the simulator's replay with one slot pool per card.

What this is:
    split_layers(n_layers, weights)        contiguous layer ranges, one per card, sized by largest remainder
    plan_devices(vrams, facts, ...)        `pymoe plan MODEL --devices 24GiB,16GiB`: per card its layers, dense + KV
                                           share, free bytes, slots, coverage, hit rate and time terms; the hops
                                           between cards; the whole model's tok/s
    simulate_devices(trace, ranges, ...)   `pymoe simulate TRACE --devices N|sizes`: one pool per card over its
                                           layers' experts, per-card and total hit rates
What this is not: the engine on several devices (backends/multi_device.py, which splits layers with
`split_layers` as the planner does), nor expert parallelism across machines (scale.py, placement.py). Every number
is a prediction from stated inputs, as in plan.py.

The layer split (pipeline parallel, as llama.cpp's `--tensor-split` with `--split-mode layer`): card d gets a
contiguous range of n_d layers with n_d proportional to its *usable* bytes u_d = VRAM_d - runtime - reserve (the
draft head's extra reserve counts on the last card, which runs the output head). Each layer brings the same dense +
KV bytes c (the model's totals / n_layers: an assumption; the real embedding sits on the first card, the output
head on the last), so card d's free bytes are u_d - n_d * c and its free bytes *per layer* u_d / n_d - c are the same
on every card: each card's slot pool covers the same share of its own layers' experts. Rounding is by largest
remainder (every card at least one layer while there are as many layers as cards).

Why one pool per card and not one global pool by heat: a slot holds an expert of a layer the card runs; an expert
of a layer on card 0 sitting in card 1's memory would be read across the inter-card link at every use, which is a
miss path (PCIe), not a hit. Within a card the pool is global over its layers (hot layers take more slots), as the
engine's global pool is.

The cost model per decoded token (batch 1, the cards run one after another, each on its own PCIe link):
    t = fixed + sum_d (resident_d + spill_d + dense_d) + (D - 1) * hop
    resident_d = moe_d * k * hit_d * S / device_bw      spill_d = moe_d * k * (1 - hit_d) * S / pcie_bw
    dense_d    = dense_bytes_per_token * n_d / n_layers / device_bw
    hop        = n_embd * 4 bytes / pcie_bw + hop latency (the float32 residual stream moves to the next card once
                 per token per boundary; the latency, DEFAULT_HOP_US, is an assumed small-copy + event-wait cost)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from pymoe.errors import PymoeError
from .plan import (GB, CostModel, ModelFacts, facts_from_gguf, fmt_size, parse_size,
                   parse_size_list, slots_for)

DEFAULT_HOP_US = 10.0  # assumed: one small device-to-device copy + the event the next card waits on, over PCIe
RESIDUAL_BYTES = 4  # the residual stream is float32 (one n_embd row per token)


def split_layers(n_layers: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """[(lo, hi)] contiguous layer ranges, n_d proportional to weights[d] by largest remainder (ties: the first
    card), every card at least one layer while n_layers >= len(weights)."""
    w = np.asarray(weights, dtype=np.float64)  # [D]
    if w.size == 0 or (w < 0).any() or w.sum() <= 0:
        raise PymoeError(f"cannot split {n_layers} layers by shares {list(weights)}: give positive shares")
    quota = n_layers * w / w.sum()  # [D]
    n = np.floor(quota).astype(np.int64)  # [D]
    for d in np.argsort(-(quota - n), kind="stable")[:n_layers - int(n.sum())]:
        n[d] += 1
    while n_layers >= w.size and (n == 0).any():  # a tiny card still gets a layer: from the card with the most
        n[int(np.argmax(n))] -= 1
        n[int(np.flatnonzero(n == 0)[0])] += 1
    ends = np.cumsum(n)
    return [(int(e - k), int(e)) for e, k in zip(ends, n)]


def split_count(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split by weights, largest remainder (ties: the first share): sums to total exactly."""
    w = np.asarray(weights, dtype=np.float64)
    quota = total * w / w.sum()
    n = np.floor(quota).astype(np.int64)
    for d in np.argsort(-(quota - n), kind="stable")[:total - int(n.sum())]:
        n[d] += 1
    return [int(x) for x in n]


def moe_range(lo: int, hi: int, n_dense: int) -> tuple[int, int]:
    """Model layers [lo, hi) -> the trace's MoE layers they hold (trace layer = model layer - n_dense)."""
    return max(lo, n_dense) - n_dense, max(hi, n_dense) - n_dense


# --- hit rate per card ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceHitModel:
    """rate(moe_lo, moe_hi, slots): the hit rate of one card's pool of `slots` over MoE layers [moe_lo, moe_hi)."""

    label: str
    rate: Callable[[int, int, int], float]


def uniform_device_hits(n_expert: int) -> DeviceHitModel:
    def rate(lo, hi, slots):
        n = (hi - lo) * n_expert
        return min(1.0, slots / n) if n else 1.0
    return DeviceHitModel("uniform routing (assumed): hit = the card's coverage, a lower bound", rate)


def profile_device_hits(profile, source: str) -> DeviceHitModel:
    """The static bound on the card's own layers: its `slots` hottest pairs among them."""
    from .profile import Profile

    heat = profile.heat()  # [L, E]

    def rate(lo, hi, slots):
        if hi <= lo:
            return 1.0
        return Profile.from_heat(heat[lo:hi]).coverage_hit_rate(slots)
    return DeviceHitModel(f"static profile bound ({source}), per card over its layers", rate)


def trace_device_hits(trace, source: str, policy: Optional[str] = None) -> DeviceHitModel:
    from .policies import DEFAULT_POLICY

    name = policy or DEFAULT_POLICY

    def rate(lo, hi, slots):
        if hi <= lo:
            return 1.0
        return simulate_devices(trace, [(lo, hi)], [slots], name, phase="decode")[0].hit_rate
    return DeviceHitModel(f"simulated on {source} ({name}, one pool per card, decode lookups)", rate)


# --- the planner -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceRow:
    index: int
    vram: int
    layers: tuple[int, int]  # model layers [lo, hi)
    moe_layers: tuple[int, int]  # trace (MoE) layers [lo, hi)
    fixed_bytes: int  # dense weights + KV of its layers
    free: int
    slots: int
    coverage: float
    hit_rate: float
    resident_s: float
    spill_s: float
    dense_s: float

    @property
    def n_moe(self) -> int:
        return self.moe_layers[1] - self.moe_layers[0]

    @property
    def time_s(self) -> float:
        return self.resident_s + self.spill_s + self.dense_s


@dataclass(frozen=True)
class DevicesPlan:
    rows: list
    hop_s: float  # one boundary crossing
    fixed_s: float
    n_total: int

    @property
    def n_hops(self) -> int:
        return len(self.rows) - 1

    @property
    def slots(self) -> int:
        return sum(r.slots for r in self.rows)

    @property
    def coverage(self) -> float:
        return self.slots / self.n_total if self.n_total else 1.0

    @property
    def hit_rate(self) -> float:
        """Lookup-weighted: every MoE layer makes k lookups per token, so a card weighs by its MoE layers."""
        n = sum(r.n_moe for r in self.rows)
        return sum(r.hit_rate * r.n_moe for r in self.rows) / n if n else 1.0

    @property
    def total_s(self) -> float:
        return self.fixed_s + sum(r.time_s for r in self.rows) + self.n_hops * self.hop_s

    @property
    def tok_s(self) -> float:
        return 1.0 / self.total_s


def plan_devices(vrams: Sequence[int], facts: ModelFacts, per_layer_bytes: float, runtime: int, reserve: int,
                 hits: DeviceHitModel, cost: CostModel, extra_reserve: int = 0,
                 hop_us: float = DEFAULT_HOP_US) -> DevicesPlan:
    """Cards in pipeline order -> one row per card and the whole model (module docstring: the split rule and the
    cost model). per_layer_bytes: dense weights + KV cache of one layer (the model's totals / n_layers)."""
    if not vrams:
        raise PymoeError("--devices: give at least one card size")
    if facts.n_layers < len(vrams):
        raise PymoeError(f"--devices: {len(vrams)} cards for {facts.n_layers} layers: at most one card per layer")
    D = len(vrams)
    extras = [0] * (D - 1) + [int(extra_reserve)]  # the draft head sits beside the output head, on the last card
    usable = [max(0, v - runtime - reserve - x) for v, x in zip(vrams, extras)]
    if sum(usable) <= 0:
        raise PymoeError("--devices: no card has memory left after the runtime and the reserve")
    ranges = split_layers(facts.n_layers, [u if u > 0 else 1e-9 for u in usable])
    S, k, E = facts.slot_bytes, facts.k, facts.n_expert
    rows = []
    for d, ((lo, hi), v, x) in enumerate(zip(ranges, vrams, extras)):
        mlo, mhi = moe_range(lo, hi, facts.n_dense)
        fixed_bytes = int(round(per_layer_bytes * (hi - lo)))
        free = max(0, int(v) - runtime - fixed_bytes)
        slots = slots_for(free, reserve, S, x, cap=(mhi - mlo) * E)
        hit = hits.rate(mlo, mhi, slots)
        lookups = (mhi - mlo) * k
        rows.append(DeviceRow(d, int(v), (lo, hi), (mlo, mhi), fixed_bytes, free, slots,
                              slots / ((mhi - mlo) * E) if mhi > mlo else 1.0, hit,
                              resident_s=lookups * hit * S / cost.device_bw,
                              spill_s=lookups * (1 - hit) * S / cost.pcie_bw,
                              dense_s=facts.dense_bytes_per_token * (hi - lo) / facts.n_layers / cost.device_bw))
    hop = facts.n_embd * RESIDUAL_BYTES / cost.pcie_bw + hop_us * 1e-6
    return DevicesPlan(rows, hop, cost.fixed_s, facts.n_total)


def format_devices(plan: DevicesPlan, facts: ModelFacts) -> list[str]:
    head = ("card", "VRAM", "layers", "MoE layers", "dense+KV", "free", "slots", "coverage", "hit rate",
            "resident ms", "spill ms", "dense ms")
    cells = [list(head)]
    for r in plan.rows:
        cells.append([f"cuda:{r.index}", fmt_size(r.vram), f"{r.layers[0]}-{r.layers[1] - 1}", str(r.n_moe),
                      fmt_size(r.fixed_bytes), fmt_size(r.free), str(r.slots), f"{100 * r.coverage:.1f}%",
                      f"{100 * r.hit_rate:.1f}%", f"{1e3 * r.resident_s:.3f}", f"{1e3 * r.spill_s:.3f}",
                      f"{1e3 * r.dense_s:.3f}"])
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    lines.append(f"hops: {plan.n_hops} x {1e3 * plan.hop_s:.4f} ms ({facts.n_embd} x {RESIDUAL_BYTES} bytes of "
                 f"residual per boundary over PCIe + latency) = {1e3 * plan.n_hops * plan.hop_s:.3f} ms")
    lines.append(f"whole model: {plan.slots} slots, coverage {100 * plan.coverage:.1f}%, hit "
                 f"{100 * plan.hit_rate:.1f}%, t = {1e3 * plan.total_s:.3f} ms (fixed {1e3 * plan.fixed_s:g}) -> "
                 f"{plan.tok_s:.1f} tok/s (predicted)")
    return lines


def devices_report(facts: ModelFacts, devices: str, overhead_total: Optional[int], n_ctx: int, runtime: int,
                   reserve: int, extra: int, cost: CostModel, hits: DeviceHitModel, hop_us: float) -> list[str]:
    """The `pymoe plan --devices` part of the report. overhead_total: --overhead SIZE (dense + KV of the whole
    model; the runtime is added per card) or None (auto: the file's dense bytes + KV at --ctx)."""
    vrams = parse_size_list(devices, what="--devices")
    if not (hop_us >= 0 and math.isfinite(hop_us)):
        raise PymoeError(f"--hop-us {hop_us}: must be zero or positive")
    total = overhead_total if overhead_total is not None else \
        facts.dense_resident_bytes + facts.kv_bytes_per_ctx_token * n_ctx
    per_layer = total / facts.n_layers
    plan = plan_devices(vrams, facts, per_layer, runtime, reserve, hits, cost, extra, hop_us)
    lines = [f"devices: {len(vrams)} cards in pipeline order; layers split by usable bytes (VRAM - runtime "
             f"{fmt_size(runtime)} - reserve {fmt_size(reserve)}), largest remainder; dense + KV "
             f"{fmt_size(per_layer)} per layer; hit rate: {hits.label}",
             f"  per card: t_d = moe_d x {facts.k} x (hit x {fmt_size(facts.slot_bytes)} / {cost.device_bw / GB:g} "
             f"GB/s + miss x {fmt_size(facts.slot_bytes)} / PCIe {cost.pcie_bw / GB:g} GB/s) + dense share; "
             f"hop = {facts.n_embd * RESIDUAL_BYTES} B / PCIe + {hop_us:g} us (assumed)"]
    return lines + format_devices(plan, facts)


# --- the simulator: one pool per card --------------------------------------------------------------------------------
def sub_trace(trace, lo: int, hi: int):
    """The trace of MoE layers [lo, hi) only (what one card's pool sees), same rows, order and phases."""
    from .trace import Trace

    meta = dict(trace.meta, n_layers=hi - lo, first_moe_layer=trace.first_moe_layer + lo)
    return Trace(trace.experts[:, lo:hi], trace.weights[:, lo:hi], trace.phase, trace.request, trace.forward, meta)


def simulate_devices(trace, ranges: Sequence[tuple[int, int]], slots: Sequence[int], policy: str,
                     phase: Optional[str] = "decode", profile=None) -> list:
    """One SimResult per card: its pool of slots[d] over the MoE layers ranges[d], replayed as `pymoe simulate
    --pool global` replays a whole trace (the cards' pools share nothing, so each replays its own layers' lookups in
    the trace's order). profile: a whole-model profile to pre-fill from (its rows for the card's layers), or None:
    in-sample, as sweep() builds it."""
    from .profile import Profile
    from .simulate import sweep

    out = []
    for (lo, hi), n in zip(ranges, slots):
        sub = sub_trace(trace, lo, hi)
        p = None if profile is None else Profile.from_heat(profile.heat()[lo:hi])
        out.append(sweep(sub, [policy], [int(n)], ["global"], profile=p, phase=phase)[0])
    return out


def parse_devices(text: str, n_layers: int) -> list[float]:
    """`--devices 4` (four equal cards) or `--devices 24GiB,16GiB` / `3,2` (shares by size) -> shares."""
    t = str(text).strip()
    if t.isdigit():
        n = int(t)
        if n < 1:
            raise PymoeError(f"--devices {text!r}: at least one card")
        shares = [1.0] * n
    else:
        shares = [float(v) for v in parse_size_list(t, what="--devices")]
        if min(shares) <= 0:
            raise PymoeError(f"--devices {text!r}: every card needs a positive size")
    if len(shares) > n_layers:
        raise PymoeError(f"--devices {text!r}: {len(shares)} cards for {n_layers} MoE layers")
    return shares


def simulate_devices_report(trace, devices: str, policies: Sequence[str], slots_list: Sequence[int],
                            phase: Optional[str], profile=None) -> str:
    """What `pymoe simulate TRACE --devices ...` prints: per slot count and policy, one line per card, the total."""
    L, E = trace.n_layers, trace.n_experts
    shares = parse_devices(devices, L)
    ranges = split_layers(L, shares)
    lines = [f"devices: {len(shares)} cards, MoE layers split by share (largest remainder): "
             + ", ".join(f"cuda:{d} {lo}-{hi - 1}" for d, (lo, hi) in enumerate(ranges))
             + "; each card's slots = its share of the total (largest remainder); one pool per card"]
    for total in slots_list:
        per = split_count(int(total), shares)
        for name in policies:
            res = simulate_devices(trace, ranges, per, name, phase, profile)
            lookups, hits = sum(r.lookups for r in res), sum(r.hits for r in res)
            lines.append(f"{name}, {total} slots ({100 * total / (L * E):.1f}% coverage):")
            for d, ((lo, hi), r) in enumerate(zip(ranges, res)):
                lines.append(f"  cuda:{d} layers {lo}-{hi - 1}: {r.slots} slots, coverage {100 * r.coverage:.1f}%, "
                             f"hit {100 * r.hit_rate:.1f}% ({r.hits}/{r.lookups}), misses/token "
                             f"{r.misses_per_token:.2f}")
            lines.append(f"  total: hit {100 * hits / lookups if lookups else 0:.1f}% ({hits}/{lookups}), "
                         f"misses/token {sum(r.misses_per_token for r in res):.2f}")
    return "\n".join(lines) + "\n"


def load_device_hits(facts: ModelFacts, trace_path: Optional[str], profile_path: Optional[str]) -> DeviceHitModel:
    """--trace, --profile or neither -> the per-card hit-rate predictor (as plan.load_hit_model for one card)."""
    from .plan import check_shape

    if trace_path and profile_path:
        raise PymoeError("give --trace or --profile, not both")
    if profile_path:
        from .profile import load_profile_source

        profile = load_profile_source(profile_path)
        check_shape(profile_path, profile.n_layers, profile.n_experts, facts)
        return profile_device_hits(profile, str(profile_path))
    if trace_path:
        from .trace import Trace

        trace = Trace.load(trace_path)
        check_shape(trace_path, trace.n_layers, trace.n_experts, facts)
        return trace_device_hits(trace, str(trace_path))
    return uniform_device_hits(facts.n_expert)


def simulate_report(trace_path, devices: str, policies: str, slots: Optional[str], coverage: Optional[str],
                    profile_path=None, phase: str = "all") -> str:
    """`pymoe simulate TRACE --devices ...`: the trace, then simulate_devices_report (slots as simulate.report
    reads them: --slots totals, or --coverage percentages of all experts)."""
    from .simulate import slot_counts
    from .trace import Trace

    trace = Trace.load(trace_path)
    L, E = trace.n_layers, trace.n_experts
    slots_list = slot_counts(slots, coverage, L, E)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    profile = None
    if profile_path is not None:
        from .profile import load_profile_source

        profile = load_profile_source(profile_path)
        if (profile.n_layers, profile.n_experts) != (L, E):
            raise PymoeError(f"profile is for {profile.n_layers} layers x {profile.n_experts} experts, the trace has "
                             f"{L} x {E}")
    phase = None if phase == "all" else phase
    head = f"trace {trace_path}: {trace.summary()}\ncounted: {phase or 'all'} lookups\n"
    return head + simulate_devices_report(trace, devices, names, sorted(set(slots_list)), phase, profile)


def devices_plan_report(model_path, devices: str, hop_us: Optional[float] = None, reserve: str = "700MiB",
                        extra_reserve: str = "0", device_bw_gbs: float = 0.0, pcie_gbs: float = 0.0,
                        fixed_ms: float = 0.0, overhead: str = "auto", runtime: str = "0", n_ctx: int = 0,
                        trace_path: Optional[str] = None, profile_path: Optional[str] = None) -> str:
    """`pymoe plan MODEL --devices ...`: the model, then one line per card and the whole model (devices_report);
    the options as plan.plan_report takes them (the CLI passes the planner's defaults)."""
    reserve_b = parse_size(reserve, what="--reserve")
    extra_b = parse_size(extra_reserve, what="--extra-reserve")
    cost = CostModel.from_options(device_bw_gbs, pcie_gbs, fixed_ms)
    if n_ctx < 0:
        raise PymoeError(f"--ctx {n_ctx}: must be zero or positive")
    facts = facts_from_gguf(model_path)
    runtime_b = parse_size(runtime, what="--runtime")
    total = None if str(overhead).lower() == "auto" else parse_size(overhead, what="--overhead")
    hits = load_device_hits(facts, trace_path, profile_path)
    return "\n".join([f"model: {facts.name}"] + devices_report(
        facts, devices, total, n_ctx, runtime_b, reserve_b, extra_b, cost, hits,
        DEFAULT_HOP_US if hop_us is None else hop_us))
