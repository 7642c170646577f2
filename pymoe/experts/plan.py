"""The capacity planner behind `pymoe plan`: VRAM -> slots -> coverage -> hit rate -> spill -> decode tok/s, and back.

What this is: the reference article's capacity-planning chain (its sections 2, 3, 6, 8.3 and 10.2) as small pure
functions, one per link, computed for a real model file:

    free bytes  = VRAM - overhead                     (dense weights + KV caches + runtime, or a probed/given value;
                                                       one KV cache per sequence decoded at once, --parallel)
    slots       = floor((free - reserve - extra) / slot_bytes), capped at n_layers * n_expert
    coverage    = slots / (n_layers * n_expert)
    hit rate    = predicted: uniform routing (= coverage, a lower bound), a static profile's bound, or a simulation
                  of a recorded routing trace under the default adaptive policy
    spill share = 1 - hit rate                         (every miss is read over PCIe: the "spill" miss path)
    t(token)    = fixed + resident + spilled + dense   (the cost model below; tok/s = 1 / t)

and the inverse, `vram_for_target`: the least VRAM whose predicted tok/s reaches a target.

The cost model, per decoded token (docs/planning.md works it through with the article's numbers):
    lookups  = n_layers * k                                    routed (layer, expert) pairs of one token
    resident = lookups * hit  * slot_bytes / device_bw         hits read their slot from VRAM
    spilled  = lookups * miss * slot_bytes / pcie_bw           misses read host bytes over PCIe
    dense    = dense_bytes_per_token / device_bw               attention, router, norms, shared expert, output head
    fixed    = fixed_s                                         launches, sync, sampling: what bytes do not explain

What this is not: a measurement. Every output is a prediction from stated inputs; `pymoe simulate` replays real
routing traces and a PCIe probe measures the link. The model is deliberately linear in the miss rate; the article
shows the real curve has a cliff near 95% hits (pipeline bubbles), which a two-point calibration folds into an
*effective* PCIe bandwidth (see `calibrate_two_points`).
"""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from pymoe.errors import PymoeError

# Sizes are binary (GiB = 2**30), as the article's log lines and nvidia-smi use them; bandwidths are decimal
# (GB/s = 1e9 bytes/s), as PCIe and HBM specs and the article's probe ("13.9 GB/s") use them.
SIZE_UNITS = {
    "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
KiB, MiB, GiB = 2**10, 2**20, 2**30
GB = 1e9

# Defaults: the article's machine (RTX 5090 on a PCIe Gen3 x16 slot), so that `pymoe plan` with no options predicts
# for the setup whose numbers docs/planning.md works through. Replace them with your own card's numbers.
DEFAULT_RESERVE = "700MiB"  # activations and workspace kept free beside the cache (the article's engine)
DEFAULT_VRAM = "12,16,24,32,48GiB"
DEFAULT_DEVICE_BW_GBS = 1792.0  # RTX 5090 memory bandwidth (spec sheet)
DEFAULT_PCIE_GBS = 13.9  # the article's PCIe probe: Gen3 x16, host -> device
DEFAULT_FIXED_MS = 3.46  # fitted to the article's two measured points (docs/planning.md, "calibration")
DEFAULT_RUNTIME = "512MiB"  # CUDA context + kernels' workspace, a typical value; measure yours with nvidia-smi
DEFAULT_CTX = 4096
KV_BYTES_PER_VALUE = 4  # pymoe's KV cache is float32 (engine/kv.KVCache)

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


# --- parsing sizes ----------------------------------------------------------------------------------------------
def parse_size(text, default_unit: Optional[str] = None, what: str = "size") -> int:
    """`"700MiB"` -> 734003200 bytes. Units B, KiB/MiB/GiB/TiB (binary), KB/MB/GB/TB (decimal), any case.

    A bare number takes `default_unit`; with none, only 0 may go without a unit (is "700" bytes or MiB? say which).
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(text)
    m = _SIZE_RE.match(str(text))
    if not m:
        raise PymoeError(f"{what} {text!r}: not a size (expected a number and a unit, e.g. 700MiB or 8.31GiB)")
    number, unit = float(m.group(1)), m.group(2).lower()
    if not unit:
        if default_unit is None and number != 0:
            raise PymoeError(f"{what} {text!r}: give a unit (B, KiB, MiB, GiB, KB, MB, GB), e.g. {m.group(1)}MiB")
        unit = (default_unit or "b").lower()
    if unit not in SIZE_UNITS:
        raise PymoeError(f"{what} {text!r}: unknown unit {m.group(2)!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    return int(round(number * SIZE_UNITS[unit]))


def parse_size_list(text: str, what: str = "--vram") -> list[int]:
    """`"12,16,24GiB"` -> bytes each. An entry without a unit takes the last unit written in the list (GiB if none)."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not p for p in parts):
        raise PymoeError(f"{what} {text!r}: expected a comma-separated list of sizes, e.g. 12,16,24GiB")
    units = [_SIZE_RE.match(p).group(2) if _SIZE_RE.match(p) else "" for p in parts]
    list_unit = next((u for u in reversed(units) if u), "GiB")
    return [parse_size(p, default_unit=list_unit, what=what) for p in parts]


def fmt_size(n: float) -> str:
    """Bytes for a person, in the article's style: `8.31 GiB`, `700 MiB`, `1.318 MiB`."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            v = n / scale
            digits = 0 if v == int(v) else (2 if unit == "GiB" else 3 if v < 10 else 1)
            return f"{v:.{digits}f} {unit}"
    return f"{int(n)} B"


# --- link 1: VRAM -> slots -> coverage (pure arithmetic, the article's "first hop") ------------------------------
def free_for_vram(vram_bytes: int, overhead_bytes: int) -> int:
    """Device bytes free when the cache is sized: the card minus what is already there (never negative)."""
    return max(0, int(vram_bytes) - int(overhead_bytes))


def slots_for(free_bytes: int, reserve_bytes: int, slot_bytes: int, extra_reserve: int = 0,
              cap: Optional[int] = None) -> int:
    """How many expert slots fit: floor((free - reserve - extra) / slot_bytes), at least 0, at most `cap`.

    `cap` is n_layers * n_expert: a slot per expert is full coverage, more would be waste.
    """
    if slot_bytes <= 0:
        raise PymoeError(f"slot size must be positive, got {slot_bytes} bytes")
    budget = int(free_bytes) - int(reserve_bytes) - int(extra_reserve)
    n = max(0, budget // int(slot_bytes))
    return n if cap is None else min(n, int(cap))


def coverage(slots: int, n_total: int) -> float:
    """Share of all (layer, expert) pairs that have a slot."""
    return min(1.0, slots / n_total) if n_total else 0.0


def auto_line(free_bytes: int, reserve_bytes: int, slots: int, extra_reserve: int = 0) -> str:
    """The auto-sizing log line, worded as the article's engine prints it (section 1.3)."""
    extra = f" (+{fmt_size(extra_reserve)} for the draft head)" if extra_reserve else ""
    return f"expert cache auto: {fmt_size(free_bytes)} free, {fmt_size(reserve_bytes)} reserved{extra} -> {slots} slots"


# --- the model's facts: read once from the file ----------------------------------------------------------------
@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs to know about a model; from a GGUF file (`facts_from_gguf`) or written by hand."""

    name: str
    n_layers: int
    n_expert: int
    k: int  # experts used per token per layer
    slot_bytes: int  # one expert's gate + up + down, as stored (the largest over layers)
    dense_resident_bytes: int = 0  # every non-expert tensor: what sits in VRAM beside the cache
    dense_bytes_per_token: int = 0  # what one decoded token reads of them (one embedding row, not the whole table)
    kv_bytes_per_ctx_token: int = 0  # KV cache bytes per context position, all layers
    n_dense: int = 0  # leading dense layers (no experts): n_layers counts them; traces and profiles hold MoE layers
    n_embd: int = 0  # the residual width: what crosses from one card to the next (experts/multi.py)
    state_bytes_per_seq: int = 0  # a sequence's fixed-size state beside its KV cache (Gated DeltaNet's conv and
    # recurrent state, float32, once: `overhead_for` counts it twice when planning for speculation)

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense

    @property
    def n_total(self) -> int:
        return self.n_moe_layers * self.n_expert

    @property
    def lookups_per_token(self) -> int:
        return self.n_moe_layers * self.k


def dense_bytes(model) -> tuple[int, int]:
    """(resident, read per decoded token) bytes of a model's non-expert tensors.

    Everything but the routed experts lives on the device. A decoded token reads all of it once, except the token
    embedding, of which it reads one row (when the output head is tied to it, the head reads it all anyway).
    """
    resident = per_token = 0
    for t in model.tensors.values():
        if "_exps." in t.name:
            continue
        resident += t.nbytes
        if t.name == "token_embd.weight" and not model.config.tied_output:
            per_token += t.nbytes // t.shape[0]
        else:
            per_token += t.nbytes
    return resident, per_token


def kv_bytes_per_ctx_token(cfg, bytes_per_value: int = KV_BYTES_PER_VALUE) -> int:
    """K and V of one position over the layers that keep them (not Gated DeltaNet layers, whose state has a fixed
    size): n_kv_layers * n_head_kv * (head_dim + head_dim_v) values."""
    return cfg.kv_values_per_token() * bytes_per_value


def facts_from_gguf(path) -> ModelFacts:
    from pymoe.backends.reference import gdn_state_bytes
    from pymoe.gguf.loader import load_gguf

    m = load_gguf(path)
    cfg = m.config
    resident, per_token = dense_bytes(m)
    return ModelFacts(name=str(path), n_layers=cfg.n_layers, n_expert=cfg.n_expert, k=cfg.n_expert_used,
                      slot_bytes=m.slot_bytes, dense_resident_bytes=resident, dense_bytes_per_token=per_token,
                      kv_bytes_per_ctx_token=kv_bytes_per_ctx_token(cfg), n_dense=cfg.n_dense_lead,
                      state_bytes_per_seq=sum(1 for r in cfg.recurrent or () if r) * gdn_state_bytes(cfg),
                      n_embd=cfg.n_embd)


@dataclass(frozen=True)
class Overhead:
    """Device bytes that are not the expert cache nor its reserve: the VRAM -> free-bytes step, term by term."""

    dense: int
    kv: int
    runtime: int

    @property
    def total(self) -> int:
        return self.dense + self.kv + self.runtime

    def describe(self, n_ctx: int, sequences: int = 1) -> str:
        caches = f"{sequences} KV caches" if sequences > 1 else "KV cache"
        return (f"{fmt_size(self.total)} = dense weights {fmt_size(self.dense)} + {caches} ({n_ctx} positions, "
                f"float32) {fmt_size(self.kv)} + runtime {fmt_size(self.runtime)}")


def overhead_for(facts: ModelFacts, n_ctx: int = DEFAULT_CTX, runtime_bytes: int = parse_size(DEFAULT_RUNTIME),
                 sequences: int = 1, speculation: bool = False) -> Overhead:
    """The overhead of `sequences` sequences decoded at once, each with its own device KV cache of n_ctx positions
    and its recurrent state, twice with `speculation` (the state and its snapshot: the CUDA backend's
    `sequence_bytes` of an engine prepared for speculation, api.Engine `speculation`, `pymoe run --spec`; allocated
    before the slot pool)."""
    state = facts.state_bytes_per_seq * (2 if speculation else 1)
    kv = (facts.kv_bytes_per_ctx_token * n_ctx + state) * sequences
    return Overhead(facts.dense_resident_bytes, kv, runtime_bytes)


# --- link 2: slots -> hit rate (three predictors, weakest assumption first) ------------------------------------
@dataclass(frozen=True)
class HitModel:
    """A hit-rate predictor: `rate(slots) -> share of decode lookups that hit`, with what it assumes."""

    label: str
    rate: Callable[[int], float]
    note: str


def uniform_hit_model(n_total: int) -> HitModel:
    """Every expert equally likely: hit rate = coverage. A lower bound for any cache filled with the hottest experts
    (the top c% of a skewed distribution carry at least c% of its mass)."""
    return HitModel("uniform routing (assumed)", lambda slots: coverage(slots, n_total),
                    "hit rate = coverage: a lower bound; real routing is skewed, pass --profile or --trace")


def profile_hit_model(profile, source: str = "profile") -> HitModel:
    """A static profile's bound: the share of routed lookups its `slots` hottest (layer, expert) pairs carry.

    In-sample it is what a cache pre-filled from the profile and never changed would hit; adaptive policies do better
    by following temporal locality (docs/planning.md: 56.6% static vs 86.5% measured at 23.5% coverage)."""
    return HitModel(f"static profile bound ({source})", lambda slots: float(profile.coverage_hit_rate(int(slots))),
                    "hottest pairs pinned, never changed: adaptive policies beat it by following temporal locality")


def trace_hit_model(trace, facts: ModelFacts, source: str = "trace", policy: Optional[str] = None) -> HitModel:
    """Hit rate simulated on a recorded routing trace: decode lookups counted, one global pool, default policy.

    It runs the simulator exactly as `pymoe simulate TRACE --pool global --phase decode --policy lfru` does (the
    engine's own policy code, slots pre-filled from an in-sample profile, prefill misses kept out of the cache), so
    the planner's hit rates are the numbers `pymoe simulate` prints. Memoised per slot count: the table and the
    inverse search ask for the same counts again."""
    from .policies import DEFAULT_POLICY  # lazy: only needed with --trace
    from .simulate import sweep

    name = policy or DEFAULT_POLICY

    @functools.lru_cache(maxsize=None)
    def rate(slots: int) -> float:
        if slots >= facts.n_total:
            return 1.0  # every expert has a slot: after the pre-fill nothing misses; skip the replay
        return float(sweep(trace, [name], [int(slots)], pools=["global"], phase="decode")[0].hit_rate)

    return HitModel(f"simulated on {source} ({name}, global pool, decode lookups)", lambda s: rate(int(s)),
                    "replays the recorded routing order, so it captures temporal locality (as `pymoe simulate`)")


# --- link 3: hit rate -> time per token (the cost model) -------------------------------------------------------
@dataclass(frozen=True)
class CostModel:
    device_bw: float  # bytes/s the GPU reads its own memory at
    pcie_bw: float  # bytes/s a miss's bytes cross the host -> device link at
    fixed_s: float  # per-token time no byte count explains (launches, sync, sampling, framework)

    @classmethod
    def from_options(cls, device_gbs=DEFAULT_DEVICE_BW_GBS, pcie_gbs=DEFAULT_PCIE_GBS, fixed_ms=DEFAULT_FIXED_MS):
        for name, v in (("--device-bw", device_gbs), ("--pcie", pcie_gbs)):
            if not (v > 0 and math.isfinite(v)):
                raise PymoeError(f"{name} {v}: must be a positive bandwidth in GB/s")
        if not (fixed_ms >= 0 and math.isfinite(fixed_ms)):
            raise PymoeError(f"--fixed-ms {fixed_ms}: must be zero or positive")
        return cls(device_gbs * GB, pcie_gbs * GB, fixed_ms / 1e3)


@dataclass(frozen=True)
class TokenTime:
    """One decoded token's predicted time, term by term (seconds)."""

    resident_s: float
    spill_s: float
    dense_s: float
    fixed_s: float

    @property
    def total_s(self) -> float:
        return self.resident_s + self.spill_s + self.dense_s + self.fixed_s

    @property
    def tok_s(self) -> float:
        return 1.0 / self.total_s if self.total_s > 0 else math.inf


def resident_bytes_per_token(hit_rate: float, facts: ModelFacts) -> float:
    return facts.lookups_per_token * hit_rate * facts.slot_bytes


def spilled_bytes_per_token(hit_rate: float, facts: ModelFacts) -> float:
    return facts.lookups_per_token * (1.0 - hit_rate) * facts.slot_bytes


def decode_time_per_token(hit_rate: float, facts: ModelFacts, cost: CostModel) -> TokenTime:
    """t = fixed + L*k*h*S/device_bw + L*k*(1-h)*S/pcie_bw + dense/device_bw (module docstring)."""
    return TokenTime(resident_s=resident_bytes_per_token(hit_rate, facts) / cost.device_bw,
                     spill_s=spilled_bytes_per_token(hit_rate, facts) / cost.pcie_bw,
                     dense_s=facts.dense_bytes_per_token / cost.device_bw,
                     fixed_s=cost.fixed_s)


def prefetch_time_per_token(hit_rate: float, prefetched_per_token: float, facts: ModelFacts,
                            cost: CostModel) -> TokenTime:
    """decode_time_per_token with the router lookahead's prefetch (experts/prefetch.py): its copies cross the same
    link, so each prefetched expert adds S / pcie_bw to the spill term, as a miss's bytes do. No overlap term (the
    model has none): a copy hidden behind the previous layer's compute would cost less, so this is the prefetch's
    cost when the link is the critical path. A prefetch lowers this time only if it removes more misses than it copies
    (the resident term's S / device_bw per removed miss is the small difference)."""
    t = decode_time_per_token(hit_rate, facts, cost)
    extra = prefetched_per_token * facts.slot_bytes / cost.pcie_bw
    return TokenTime(resident_s=t.resident_s, spill_s=t.spill_s + extra, dense_s=t.dense_s, fixed_s=t.fixed_s)


def calibrate_two_points(point_a: tuple[float, float], point_b: tuple[float, float], lookups_per_token: int,
                         slot_bytes: float, device_bw: float, dense_bytes_per_token: float = 0.0
                         ) -> tuple[float, float]:
    """Two measured (miss rate, tok/s) points -> the cost model's two unknowns (fixed_s, effective pcie_bw).

    t(m) = fixed + dense/B_d + L*k*S*[(1-m)/B_d + m/B_p] is linear in the miss rate m with slope
    L*k*S*(1/B_p - 1/B_d), so the two points give the slope (hence B_p) and then the intercept (hence fixed).
    """
    (m1, r1), (m2, r2) = point_a, point_b
    if m1 == m2:
        raise PymoeError("calibration needs two different miss rates")
    t1, t2 = 1.0 / r1, 1.0 / r2
    per_byte_gap = (t1 - t2) / (lookups_per_token * slot_bytes * (m1 - m2))  # 1/B_p - 1/B_d
    inv_pcie = per_byte_gap + 1.0 / device_bw
    if inv_pcie <= 0:
        raise PymoeError("calibration: the points imply misses are cheaper than hits; check them")
    bytes_term = lookups_per_token * slot_bytes * ((1 - m2) / device_bw + m2 * inv_pcie)
    fixed = t2 - bytes_term - dense_bytes_per_token / device_bw
    return fixed, 1.0 / inv_pcie


# --- the table --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanRow:
    vram: Optional[int]  # the card's bytes (None when the free bytes were given directly)
    free: int
    slots: int
    slot_bytes: int
    coverage: float
    hit_rate: float
    time: TokenTime

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def spill_share(self) -> float:
        """Share of routed lookups read over PCIe: every miss takes the spill path in this model."""
        return 1.0 - self.hit_rate

    @property
    def tok_s(self) -> float:
        return self.time.tok_s


def plan_row(free_bytes: int, facts: ModelFacts, reserve: int, hit_model: HitModel, cost: CostModel,
             extra_reserve: int = 0, vram: Optional[int] = None) -> PlanRow:
    slots = slots_for(free_bytes, reserve, facts.slot_bytes, extra_reserve, cap=facts.n_total)
    h = hit_model.rate(slots)
    return PlanRow(vram, int(free_bytes), slots, facts.slot_bytes, coverage(slots, facts.n_total), h,
                   decode_time_per_token(h, facts, cost))


def plan_table(vrams: Sequence[int], facts: ModelFacts, overhead: int, reserve: int, hit_model: HitModel,
               cost: CostModel, extra_reserve: int = 0) -> list[PlanRow]:
    """One row per card size: VRAM -> free -> slots -> coverage -> hit -> spill -> tok/s."""
    return [plan_row(free_for_vram(v, overhead), facts, reserve, hit_model, cost, extra_reserve, vram=v)
            for v in sorted(vrams)]


# --- the inverse: a speed target -> the VRAM it needs --------------------------------------------------------------
@dataclass(frozen=True)
class TargetPlan:
    target_tok_s: float
    slots: Optional[int]  # None: unreachable
    vram: Optional[int]
    row: PlanRow  # the row at `slots` (or at full coverage when unreachable: the ceiling)

    @property
    def reachable(self) -> bool:
        return self.slots is not None


def vram_for_slots(slots: int, facts: ModelFacts, overhead: int, reserve: int, extra_reserve: int = 0) -> int:
    """The least VRAM that auto-sizes to `slots` slots: the exact inverse of free_for_vram + slots_for."""
    return int(overhead) + int(reserve) + int(extra_reserve) + slots * facts.slot_bytes


def vram_for_target(target_tok_s: float, facts: ModelFacts, overhead: int, reserve: int, hit_model: HitModel,
                    cost: CostModel, extra_reserve: int = 0) -> TargetPlan:
    """The least VRAM whose predicted decode speed reaches `target_tok_s`, by bisection over the slot count.

    Predicted tok/s rises with the slot count (more slots -> hit rate no lower -> fewer PCIe bytes), so the least
    slot count meeting the target is a bisection over [0, n_total]. If even full coverage is too slow, the target is
    unreachable by adding VRAM: the fixed, dense and resident terms remain (the row at full coverage is returned).
    """
    if not (target_tok_s > 0 and math.isfinite(target_tok_s)):
        raise PymoeError(f"--target {target_tok_s}: must be a positive tok/s")

    def row_at(slots: int) -> PlanRow:
        v = vram_for_slots(slots, facts, overhead, reserve, extra_reserve)
        return plan_row(free_for_vram(v, overhead), facts, reserve, hit_model, cost, extra_reserve, vram=v)

    top = row_at(facts.n_total)
    if top.tok_s < target_tok_s:
        return TargetPlan(target_tok_s, None, None, top)
    lo, hi = 0, facts.n_total  # invariant: row_at(hi) meets the target
    while lo < hi:
        mid = (lo + hi) // 2
        if row_at(mid).tok_s >= target_tok_s:
            hi = mid
        else:
            lo = mid + 1
    row = row_at(hi)
    return TargetPlan(target_tok_s, hi, row.vram, row)


# --- probing the device (only for `--free auto`) -----------------------------------------------------------------
def probe_free_bytes() -> int:
    """Free bytes on the current CUDA device, as the cache's auto-sizing would see them."""
    try:
        from numba import cuda

        if not cuda.is_available():
            raise RuntimeError("no CUDA device")
        free, _total = cuda.current_context().get_memory_info()
        return int(free)
    except Exception as e:  # no driver, no device, simulator: all mean "cannot probe here"
        raise PymoeError(f"--free auto: cannot probe the device ({type(e).__name__}: {e}); pass --free SIZE") from None


# --- printing ---------------------------------------------------------------------------------------------------
COLUMNS = ("VRAM", "free", "cache", "slots", "coverage", "hit rate", "spill share",
           "resident ms", "spill ms", "dense ms", "fixed ms", "tok/s")


def _cells(row: PlanRow) -> list[str]:
    t = row.time
    return [fmt_size(row.vram) if row.vram is not None else "-", fmt_size(row.free),
            fmt_size(row.cache_bytes), str(row.slots), f"{100 * row.coverage:.1f}%", f"{100 * row.hit_rate:.1f}%",
            f"{100 * row.spill_share:.2f}%", f"{1e3 * t.resident_s:.3f}", f"{1e3 * t.spill_s:.3f}",
            f"{1e3 * t.dense_s:.3f}", f"{1e3 * t.fixed_s:.3f}", f"{t.tok_s:.1f}"]


def format_rows(rows: Sequence[PlanRow]) -> list[str]:
    cells = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return lines


def format_header(facts: ModelFacts, cost: CostModel, hit_model: HitModel, reserve: int, extra_reserve: int,
                  overhead: Optional[str]) -> list[str]:
    E, k, S = facts.n_expert, facts.k, facts.slot_bytes
    lines = [
        f"model: {facts.name}",
        f"  experts: {facts.n_moe_layers} layers x {E} = {facts.n_total} slots for full coverage, top-{k} -> {facts.lookups_per_token}"
        f" routed lookups per decoded token; slot {S} bytes ({fmt_size(S)}, one expert's gate+up+down)",
        f"  dense bytes read per token: {facts.dense_bytes_per_token} ({fmt_size(facts.dense_bytes_per_token)})",
    ]
    if overhead:
        lines.append(f"  overhead before the cache: {overhead}")
    extra = f" + {fmt_size(extra_reserve)} extra" if extra_reserve else ""
    lines += [
        f"sizing: slots = floor((free - {fmt_size(reserve)} reserve{extra}) / {fmt_size(S)}), at most {facts.n_total}",
        f"hit rate: {hit_model.label}: {hit_model.note}",
        "spill share = 1 - hit rate (every miss read over PCIe)",
        "cost model per decoded token: t = resident + spill + dense + fixed, tok/s = 1/t",
        f"  resident = {facts.lookups_per_token} x hit x {fmt_size(S)} / device {cost.device_bw / GB:g} GB/s",
        f"  spill    = {facts.lookups_per_token} x (1 - hit) x {fmt_size(S)} / PCIe {cost.pcie_bw / GB:g} GB/s",
        f"  dense    = {fmt_size(facts.dense_bytes_per_token)} / device {cost.device_bw / GB:g} GB/s",
        f"  fixed    = {1e3 * cost.fixed_s:g} ms (launches, sync, sampling; --fixed-ms)",
    ]
    return lines


def format_target(plan: TargetPlan) -> str:
    if not plan.reachable:
        return (f"target {plan.target_tok_s:g} tok/s: unreachable: even 100% coverage predicts "
                f"{plan.row.tok_s:.1f} tok/s (the fixed, dense and resident terms remain)")
    r = plan.row
    return (f"target {plan.target_tok_s:g} tok/s: needs {fmt_size(plan.vram)} VRAM -> {r.slots} slots, "
            f"coverage {100 * r.coverage:.1f}%, hit {100 * r.hit_rate:.1f}%, predicted {r.tok_s:.1f} tok/s")


# --- the whole `pymoe plan` report -------------------------------------------------------------------------------
def load_hit_model(facts: ModelFacts, trace_path: Optional[str] = None, profile_path: Optional[str] = None
                   ) -> HitModel:
    """--trace, --profile or neither -> the hit-rate predictor (lazy imports: each format has its own module)."""
    if trace_path and profile_path:
        raise PymoeError("give --trace or --profile, not both")
    if profile_path:
        from .profile import load_profile_source  # a profile .bin, a routing-heat .json or a trace .npz

        profile = load_profile_source(profile_path)
        check_shape(profile_path, profile.n_layers, profile.n_experts, facts)
        return profile_hit_model(profile, source=str(profile_path))
    if trace_path:
        from .trace import Trace

        trace = Trace.load(trace_path)
        check_shape(trace_path, trace.n_layers, trace.n_experts, facts)
        return trace_hit_model(trace, facts, source=str(trace_path))
    return uniform_hit_model(facts.n_total)


def check_shape(path, n_layers: int, n_experts: int, facts: ModelFacts) -> None:
    """A profile or trace of another model would predict nonsense: its keys are another model's experts. Both hold
    the MoE layers only (experts/trace.py)."""
    if (n_layers, n_experts) != (facts.n_moe_layers, facts.n_expert):
        raise PymoeError(f"{path}: made for {n_layers} MoE layers x {n_experts} experts, but the model has "
                         f"{facts.n_moe_layers} x {facts.n_expert}")


def plot_plan(path, facts: ModelFacts, overhead: int, reserve: int, hit_model: HitModel, cost: CostModel,
              extra_reserve: int, cards: Sequence[int], title: str) -> None:
    """`pymoe plan --plot`: hit rate and predicted decode tok/s against VRAM, from the overhead to a card that holds
    every expert, the --vram card sizes marked."""
    from .simulate import pyplot

    plt = pyplot()
    top = max(vram_for_slots(facts.n_total, facts, overhead, reserve, extra_reserve), *cards)
    vrams = np.linspace(overhead + reserve + extra_reserve, top, 80).astype(np.int64)
    rows = plan_table(vrams, facts, overhead, reserve, hit_model, cost, extra_reserve)
    marked = plan_table(cards, facts, overhead, reserve, hit_model, cost, extra_reserve)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    unit, scale = ("GiB", 2.0 ** 30) if top >= 2 ** 31 else ("MiB", 2.0 ** 20)
    a.plot([r.vram / scale for r in rows], [100 * r.hit_rate for r in rows])
    b.plot([r.vram / scale for r in rows], [r.tok_s for r in rows])
    for r in marked:
        for ax, y, fmt in ((a, 100 * r.hit_rate, "{:.0f}%"), (b, r.tok_s, "{:.0f} tok/s")):
            ax.plot([r.vram / scale], [y], "o", color="C3")
            ax.annotate(f"{fmt_size(r.vram)}: " + fmt.format(y), (r.vram / scale, y), textcoords="offset points",
                        xytext=(5, -12), fontsize=8)
    a.set_ylabel("decode hit rate, %")
    a.set_title(hit_model.label, fontsize=8)
    b.set_ylabel("predicted decode tok/s")
    for ax in (a, b):
        ax.set_xlabel(f"VRAM, {unit}")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plan_report(model_path, vram: str = DEFAULT_VRAM, free: Optional[str] = None, reserve: str = DEFAULT_RESERVE,
                extra_reserve: str = "0", device_bw_gbs: float = DEFAULT_DEVICE_BW_GBS,
                pcie_gbs: float = DEFAULT_PCIE_GBS, fixed_ms: float = DEFAULT_FIXED_MS, overhead: str = "auto",
                runtime: str = DEFAULT_RUNTIME, n_ctx: int = DEFAULT_CTX, targets: Sequence[float] = (),
                trace_path: Optional[str] = None, profile_path: Optional[str] = None,
                plot_path: Optional[str] = None, parallel: int = 1, speculation: bool = False) -> str:
    """Everything `pymoe plan` prints, as text: the inputs, the cost model, the table, the auto line, the inverse.
    parallel: sequences decoded at once (`pymoe serve -np`), each a KV cache of n_ctx positions in the overhead.
    speculation (`pymoe plan --spec`): each sequence's recurrent state counted twice (`overhead_for`).
    (`pymoe plan --devices`, several cards at once: experts/multi.py devices_plan_report.)"""
    reserve_b = parse_size(reserve, what="--reserve")
    extra_b = parse_size(extra_reserve, what="--extra-reserve")
    vrams = parse_size_list(vram, what="--vram")
    free_b = None if free is None else probe_free_bytes() if str(free).lower() == "auto" \
        else parse_size(free, default_unit="GiB", what="--free")
    cost = CostModel.from_options(device_bw_gbs, pcie_gbs, fixed_ms)
    if n_ctx < 0:
        raise PymoeError(f"--ctx {n_ctx}: must be zero or positive")
    if parallel < 1:
        raise PymoeError(f"--parallel {parallel}: must be >= 1")

    facts = facts_from_gguf(model_path)
    if str(overhead).lower() == "auto":
        parts = overhead_for(facts, n_ctx, parse_size(runtime, what="--runtime"), parallel, speculation)
        twice = ", --spec: each sequence's recurrent state and its snapshot" if speculation and \
            facts.state_bytes_per_seq else ""
        overhead_b, overhead_text = parts.total, parts.describe(n_ctx, parallel) + f" (--overhead auto{twice})"
    else:
        overhead_b = parse_size(overhead, what="--overhead")
        overhead_text = f"{fmt_size(overhead_b)} (--overhead)"
    hit_model = load_hit_model(facts, trace_path, profile_path)

    lines = format_header(facts, cost, hit_model, reserve_b, extra_b, None if free_b is not None else overhead_text)
    lines.append("")
    if free_b is not None:
        row = plan_row(free_b, facts, reserve_b, hit_model, cost, extra_b)
        lines.append(auto_line(free_b, reserve_b, row.slots, extra_b))
        lines += format_rows([row])
    else:
        lines += format_rows(plan_table(vrams, facts, overhead_b, reserve_b, hit_model, cost, extra_b))
    for target in targets:
        lines.append(format_target(vram_for_target(target, facts, overhead_b, reserve_b, hit_model, cost, extra_b)))
    if plot_path is not None:
        plot_plan(plot_path, facts, overhead_b, reserve_b, hit_model, cost, extra_b, vrams,
                  f"{os.path.basename(str(model_path))}: VRAM -> hit rate -> decode tok/s")
        lines.append(f"plot: {plot_path}")
    return "\n".join(lines)
