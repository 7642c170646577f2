"""The expert cache: a fixed pool of slots holding hot experts, a residency table, a policy, and the miss paths.

What this is: the one door through which the MoE block reaches expert weights. Per layer, `moe.py` calls
    cache.lookup(layer, expert_ids [T, K], phase)   every (token, expert) pair the router chose: accounting + policy
    cache.expert(layer, e)                          the bytes to compute expert e with: a slot, or host memory
    cache.finish(layer)                             those experts are computed: promoted bytes may land in slots
Two implementations keep these methods:
  - `PassThroughCache`: no pool, so no hits and no misses: every lookup is counted as "host" (read in place from
    the GGUF memory map; the CPU backend's default: host RAM already holds every expert), or, on a GPU with no
    slots (`--cache none`), as "spill" (decode) / "staged" (prefill): read over PCIe.
  - `SlotCache`: N slots, each one expert's gate + up + down bytes exactly as stored in the GGUF (with its own
    layer's types: they may change from layer to layer), a residency table `[n_layers, n_experts] -> slot or -1`,
    and a policy from `policies.py` (the same code `pymoe simulate` replays traces with). On the CPU backend the
    pool is a bounded buffer in RAM: the *accounting* (hits, misses by path, promotions, evictions) is what a GPU
    pool does, which is what makes every cache behaviour testable in CI.

A decode miss is served one of two ways, and may also be promoted:
  - spill: the GPU reads the expert straight from pinned, mapped host memory over PCIe (no slot needed);
  - cpu:   the CPU computes that expert's output in place from the mmap while the GPU does the rest;
    the share of misses sent over PCIe is `pcie_frac` (the rest go to the CPU), assigned deterministically by
    error diffusion so the split is exact and reproducible;
  - promote: when the policy admits the expert, its bytes are copied into a slot (the policy's victim is evicted),
    so the *next* lookup hits. The copy is made by `finish`, once this lookup's experts are computed (on a GPU:
    queued on the copy stream behind the compute stream's reads of that slot), so a slot is never overwritten
    under an expert this very lookup serves from it.
One lookup call is one decision per expert: an expert chosen by several rows of the call (tokens of a prefill
chunk, sequences of a batched decode step) is served by one path, decided at its first (token, expert) pair, and
every row that chose it is counted under that path (`rows`: per-row counters, for batched decode).
Both also keep `heat` int64 [n_layers, n_experts]: decode lookups per expert since start, what the monitor page's
heat map shows (/v1/status?experts=1, serve/metrics.py) next to the residency table.
Prefill lookups never promote: a prompt chunk touches nearly every expert, so letting it through the policy would
flush the decode working set. Prefill misses are "staged" (streamed once per chunk), hits refresh the policy.
Slots never sit empty: `fill()` (called by the engine at start-up) places the profile's hottest experts, then the
MoE layers' experts in policies.fill_order, until every slot is taken; the simulator starts from the same keys.
With a warm rule (`--warm-set N`), `end_prefill()`, called once a request's prompt is read, places the experts of
the prompt's last N tokens (policies.WarmSet, the rule the simulator replays), so decode starts warm.
The router lookahead (experts/prefetch.py, `--lookahead N`) calls `prefetch(layer, experts)` in decode, one layer
early: the predicted experts that are not resident are placed through the policy (SlotTable.prefetch: the admission
rules and the per-step insert cap of the layer they are for, the policy's admit and victim) and their bytes copied in
at once (on a GPU: on the copy stream, overlapped with the attention of the layer that will read them), so that
layer's lookup hits them ("prefetch_hits").
On the CPU backend nothing crosses PCIe: "spill" and "cpu" are the split a GPU would make (`gpu` False), and every
expert is computed the same way.
`force_spill(share)` (a measurement, not a policy: bench/gpu_check.py's spill cliff) serves a random share of the
decode lookups that hit over PCIe instead, counted as spill; a device step reads the same choice through the
residency table it is given (`step_table`).
What this is not: a policy (policies.py), or the code that moves bytes to a GPU (backends/cuda.py does the copies;
here the CPU backend's copies are plain NumPy).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
from numba import njit

from pymoe.errors import PymoeError
from pymoe.gguf.loader import EXPERT_PROJ, ExpertBytes, GGUFModel
from pymoe.backends.pool import HostPool
from . import compiled_cooc as cc
from .policies import DEFAULT_POLICY, CompiledCoocPolicy, check_engine_policy, prefetch_ranked, start_keys

PHASES = ("prefill", "decode")
# What each lookup was served by (ExpertBytes.where -> counter: slot -> hits; spill, cpu, staged, host), and what it
# did to the pool (promoted, evicted). The router lookahead's copies (`prefetch`) are counted apart: prefetched =
# experts it placed in slots ahead of their layer (a pool event: no batch row owns it), prefetch_hits = the hits of
# that layer's next lookup on those slots, the misses the lookahead turned into hits (part of `hits`).
COUNTERS = ("lookups", "hits", "spill", "cpu", "staged", "host", "promoted", "evicted", "prefetched", "prefetch_hits")


class CounterViews:
    """What is read off counters per phase (`self.counts`: {phase: {counter: n}}): a cache's own (CacheStats) or
    the sum over several devices' pools (backends/multi_device.py)."""

    @property
    def lookups(self) -> dict:
        return {p: c["lookups"] for p, c in self.counts.items()}

    @property
    def hits(self) -> dict:
        return {p: c["hits"] for p, c in self.counts.items()}

    def snapshot(self, phase: str) -> dict:
        return dict(self.counts[phase])

    def hit_rate(self, phase: str) -> float:
        c = self.counts[phase]
        return c["hits"] / c["lookups"] if c["lookups"] else 0.0


@dataclass
class CacheStats(CounterViews):
    """Counters per phase. lookups = hits + spill + cpu (decode) or hits + staged (prefill) with a slot pool;
    with none, lookups = host (read in place, CPU backend) or spill / staged (over PCIe, a GPU with no slots)."""

    counts: dict = field(default_factory=lambda: {p: dict.fromkeys(COUNTERS, 0) for p in PHASES})

    def reset(self) -> None:
        for c in self.counts.values():
            for k in c:
                c[k] = 0


class SummedStats(CounterViews):
    """CacheStats over several caches (one per device: backends/multi_device.py): `counts` is their sum, read live."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def counts(self) -> dict:
        out = {}
        for c in self.parts:
            for phase, cs in c.stats.counts.items():
                acc = out.setdefault(phase, {})
                for k, n in cs.items():
                    acc[k] = acc.get(k, 0) + n
        return out

    def reset(self) -> None:
        for c in self.parts:
            c.stats.reset()


_NO_MASK = np.zeros((0, 0), dtype=bool)  # no forced-spill mask (SlotCache._decode_compiled)
_MISS_PATHS = (None, "spill", "cpu")  # compiled_cooc.decode_step's codes 1 and 2


def _count(counts: tuple, name: str, n: int = 1) -> None:
    """Add n to counter `name` of each counter dict in `counts` (the cache's own, and a batch row's)."""
    for c in counts:
        c[name] = c.get(name, 0) + n


def _warm(heat: np.ndarray, layer: int, expert_ids: np.ndarray, phase: str) -> None:
    """Count a decode lookup call's (token, expert) pairs into heat[layer]: heat int64 [L, E], expert_ids [T, K].
    Prefill is left out: a prompt chunk touches nearly every expert, which says little about the hot ones. So are the
    MTP blocks' experts (`--spec mtp`: layer indices n_layers.., after the trunk): the map is the trunk's."""
    if phase == "decode" and layer < heat.shape[0]:
        _count_ids(heat[layer], np.asarray(expert_ids).reshape(-1))


@njit(cache=True)
def _count_ids(counts, ids):
    """counts[e] += 1 for each e in ids (int [n]; repeats counted each time): np.bincount's sum, in one compiled
    call (the NumPy form, a new [E] array and an add, cost ~1% of a decode step in place, every layer)."""
    for e in ids:
        counts[e] += 1


class PassThroughCache:
    """No slot pool: serves every expert from the model's memory map. Nothing is a hit or a miss, as there is no
    cache: lookups are counted as "host" (read in place) or, on a GPU, "spill" / "staged" (read over PCIe)."""

    n_slots = 0
    policy_name = "none"

    def __init__(self, model: GGUFModel, miss_path: Optional[str] = None):
        """miss_path None: host RAM is where experts are computed (CPU backend): every lookup read in place.
        "spill": a GPU with no slots (`--cache none`): every lookup read over PCIe ("staged" in prefill)."""
        self.model = model
        self.miss_path = miss_path
        self.gpu = miss_path is not None  # the experts are computed on a GPU: what it reads crosses PCIe
        self._where = miss_path or "host"
        self.stats = CacheStats()
        self.heat = np.zeros((model.config.n_layers, model.config.n_expert), dtype=np.int64)  # [L, E] decode lookups

    def lookup(self, layer: int, expert_ids: np.ndarray, phase: str, rows: Optional[list] = None) -> None:
        """Account for the router's choices of one layer: expert_ids int [T, K], one lookup per (token, expert).
        rows: T counter dicts to add each row's counts to as well (batched decode: one row per sequence)."""
        self._where = "host" if not self.gpu else "staged" if phase == "prefill" else self.miss_path
        c = self.stats.counts[phase]
        K = int(expert_ids.size) // expert_ids.shape[0]  # lookups per row
        _count((c,), "lookups", int(expert_ids.size))
        _count((c,), self._where, int(expert_ids.size))
        _warm(self.heat, layer, expert_ids, phase)
        for row in rows or ():  # one counter dict per row of expert_ids
            _count((row,), "lookups", K)
            _count((row,), self._where, K)

    def lookup_step(self, layers: list, ids: np.ndarray) -> None:
        """A decode step's lookups, made after it (SlotCache.lookup_step's protocol): ids int [M, T, K], layer by
        layer."""
        ids = np.asarray(ids, dtype=np.int64)  # [M, T, K]
        for m, layer in enumerate(layers):
            self.lookup(layer, ids[m], "decode")

    def expert(self, layer: int, e: int) -> ExpertBytes:
        ex = self.model.expert(layer, e)
        return ex if self._where == "host" else replace(ex, where=self._where)

    def finish(self, layer: int) -> None:
        pass  # nothing is ever copied

    def end_prefill(self) -> None:
        pass  # no slots to warm

    def prefetch(self, layer: int, experts, limit: int = 0) -> int:
        return 0  # no slots to prefetch into (the CPU backend's lookahead advises the memory map instead)

    def describe(self) -> str:
        cfg = self.model.config
        if self.gpu:
            return (f"expert cache: none (all {len(cfg.moe_layers) * cfg.n_expert} experts read over PCIe from pinned host "
                    "memory)")
        return (f"expert cache: none (all {len(cfg.moe_layers) * cfg.n_expert} experts read in place from the memory map; "
                "--cache-slots N emulates a GPU slot pool)")


class SlotCache:
    """N expert slots in a pool, a residency table, a policy; spill / cpu / promote on a miss."""

    def __init__(self, model: GGUFModel, n_slots: int, policy: str = DEFAULT_POLICY, profile=None,
                 pcie_frac: float = 1.0, new_pool=None, gpu: bool = False, admission=None, warm=None,
                 layers: Optional[range] = None, **policy_args):
        """new_pool(n_slots, slot_bytes, layouts): the backend's pool (default: HostPool, in RAM); gpu: the pool is
        on a GPU, so spill misses cross PCIe (else the spill / cpu split is only the one a GPU would make);
        admission: policies.Admission; warm: policies.WarmRule, the warm decode set placed by end_prefill().
        layers: the model layers whose experts this pool serves (default: all; one device of several serves its
        own range: backends/multi_device.py), which sets what fill() places and the pool's lookups per token."""
        from .policies import Admission, SlotTable, WarmRule, WarmSet, make_policy

        cfg = model.config
        self.model = model
        self.n_layers, self.n_experts = cfg.n_layers, cfg.n_expert  # keys and tables span every layer, dense too
        self.moe_layers = [i for i in cfg.moe_layers if layers is None or i in layers]  # the MoE layers served
        self.n_total = n_total = len(self.moe_layers) * self.n_experts  # the experts there are: the MoE layers'
        # (leading dense layers have none; the MTP block's are read in place, outside the pool: engine/mtp.py)
        if not 1 <= n_slots <= n_total:
            raise PymoeError(f"cache slots must be in 1..{n_total} (the model's experts), got {n_slots}")
        if not 0.0 <= pcie_frac <= 1.0:
            raise PymoeError(f"pcie_frac must be in [0, 1], got {pcie_frac}")
        check_engine_policy(policy)
        self.n_slots = n_slots
        self.policy_name = policy
        self.pcie_frac = pcie_frac
        self.profile = profile
        self.first_moe = cfg.moe_layers.start  # a profile's layer 0 (profiles and traces hold the MoE layers only)
        profile_keys = self.profile_keys(profile) if profile is not None else None
        if profile_keys is not None and layers is not None:  # this pool's layers' pairs only
            profile_keys = [k for k in profile_keys if k // self.n_experts in layers]
        self.admission = admission or Admission()
        policy_args.setdefault("lookups_per_token", cfg.n_expert_used * len(self.moe_layers))  # one token's lookups
        policy_args.setdefault("n_experts", self.n_experts)  # key // n_experts: the layer (policies.LAYER_POLICIES)
        policy_args.setdefault("k", cfg.n_expert_used)  # one token's lookups per layer
        self.table = SlotTable(n_slots, make_policy(policy, n_slots, profile_keys=profile_keys, **policy_args),
                               self.admission)
        from .gap import LiveGap

        self.gap = LiveGap(self.table)  # Belady's hits on the recent decode lookups, for the telemetry (gap.py)
        self.warm_rule = warm or WarmRule()
        self.warm = WarmSet(self.warm_rule, self.n_experts) if self.warm_rule else None
        self.warmed = {"copied": 0, "evicted": 0}  # what end_prefill() did since start
        self.steps = 0  # lookup calls so far: one per layer per forward, the unit of the insert cap
        self.residency = np.full((self.n_layers, self.n_experts), -1, dtype=np.int32)  # [L, E] -> slot or -1
        self.heat = np.zeros((self.n_layers, self.n_experts), dtype=np.int64)  # [L, E] decode lookups (_warm)
        # Byte layout of a slot: gate | up | down, each as stored in the GGUF, with the types of the layer of the
        # expert it holds (they may change from layer to layer); slots are sized for the largest layer's expert.
        self.layouts = model.expert_layouts()  # [L] loader.ExpertLayout
        self.slot_bytes = model.slot_bytes
        self.pool = (new_pool or HostPool)(n_slots, self.slot_bytes, self.layouts)  # a backend's pool (GPU), or RAM
        self.gpu = bool(gpu)
        self._served: dict = {}  # (layer, expert) -> (where, slot): how the last lookup call serves each expert
        self._pending: dict = {}  # slot -> (layer, expert): promotions whose bytes finish() has not copied yet
        self._prefetched: dict = {}  # layer -> {expert}: placed by prefetch() for that layer's next lookup
        self.stats = CacheStats()
        self.clock = 0  # one tick per lookup: the policy's notion of time
        self._pcie_credit = 0.0  # error diffusion of the spill/cpu split
        self.forced_share, self._forced_seed = 0.0, 0  # force_spill(): off
        self._forced = None  # bool [L, E]: this decode forward's forced-spill mask (None: off)
        self._forced_n, self._forced_fresh = 0, False  # decode forwards drawn; a step_table() mask not yet used
        self._fast = None  # the compiled lookups' buffers (_decode_compiled), made at their first call

    # --- bytes -------------------------------------------------------------------------------------------------
    def _copy_in(self, slot: int, layer: int, e: int) -> None:
        """Copy expert (layer, e) from host memory into `slot` (on a GPU: a host->device copy on the copy stream)."""
        self.pool.write(slot, self.model.expert(layer, e))
        self.residency[layer, e] = slot

    def expert(self, layer: int, e: int) -> ExpertBytes:
        """The bytes to compute expert e with, and where they are (`ExpertBytes.where`), as the last lookup decided:
        the slot it was resident in at that lookup, or host memory tagged with the miss path the lookup chose
        (spill / cpu / staged). An expert promoted by that very lookup is still served by its miss path: its bytes
        land in the slot at finish() (on a GPU, overlapped with compute), and the *next* lookup hits."""
        where, slot = self._served.get((layer, e), (None, -1))
        if where == "slot":
            return self.pool.view(slot, layer, e)
        if where is not None:
            return replace(self.model.expert(layer, e), where=where)
        slot = int(self.residency[layer, e])  # not chosen by the last lookup: wherever it is now
        if slot >= 0 and slot not in self._pending:
            return self.pool.view(slot, layer, e)
        return self.model.expert(layer, e)

    def finish(self, layer: int) -> None:
        """The experts the last lookup served have been computed (on a GPU: their kernels are queued, and the pool
        orders its copies after them): the promotions' bytes may land in their slots now."""
        pending, self._pending = self._pending, {}
        for slot, (lay, e) in pending.items():
            self.pool.write(slot, self.model.expert(lay, e))

    # --- accounting and policy ---------------------------------------------------------------------------------
    def key(self, layer: int, e: int) -> int:
        return layer * self.n_experts + e

    def lookup(self, layer: int, expert_ids: np.ndarray, phase: str, rows: Optional[list] = None) -> None:
        """One layer's routing, expert_ids int [T, K], in token order: count, update the policy, promote/evict.

        Every (token, expert) pair goes through the policy in order. Each distinct expert is served by one path,
        decided at its first pair (a hit: the slot it is in; a miss: spill / cpu / staged), and every pair that
        chose it is counted under that path, so the counters say what the backend does. rows: T counter dicts to
        add each row's counts to as well (batched decode: one row per sequence)."""
        self.finish(layer)  # a caller that skipped finish(): the last call's promotions land before anything else
        c = self.stats.counts[phase]
        self._served = {}
        if phase == "decode" and self.forced_share and layer == self.moe_layers[0]:  # a decode forward begins
            self._next_forced(reuse=True)
        self.steps += 1
        prefetched = self._prefetched.pop(layer, ())  # experts the lookahead placed for this lookup
        if phase == "decode" and not prefetched and self._compiled_lookup(layer, expert_ids, rows):
            return  # (the heat map counted there too)
        _warm(self.heat, layer, expert_ids, phase)
        for t, row in enumerate(expert_ids.reshape(expert_ids.shape[0], -1)):
            counts = (c,) if rows is None else (c, rows[t])
            for e in row.tolist():
                key = self.key(layer, e)
                self.clock += 1
                if phase == "decode":
                    self.gap.before()
                hit, slot, evicted = self.table.access(key, self.clock, insert=phase == "decode", step=self.steps)
                if self.warm is not None and phase == "prefill":
                    self.warm.see(key, (self.steps, t), self.clock)  # (lookup call, row) names the prompt token
                served = self._served.get((layer, e))
                if served is None:  # the first pair of this call to choose e decides how e is served
                    served = (("slot", slot) if hit else ("staged", -1) if phase == "prefill"
                              else (self._miss_path(), -1))
                    if hit and phase == "decode" and self._forced is not None and self._forced[layer, e]:
                        served = ("spill", -1)  # force_spill(): this hit is read over PCIe
                    self._served[layer, e] = served
                _count(counts, "lookups")
                _count(counts, "hits" if served[0] == "slot" else served[0])
                if phase == "decode":
                    self.gap.after(key, served[0] == "slot")
                if served[0] == "slot" and e in prefetched:
                    _count(counts, "prefetch_hits")
                if evicted is not None:
                    _count(counts, "evicted")
                    self.residency[divmod(evicted, self.n_experts)] = -1
                if slot is not None and not hit:  # promoted: the bytes follow at finish()
                    _count(counts, "promoted")
                    self.residency[layer, e] = slot
                    self._pending[slot] = (layer, e)  # a slot promoted into twice in one call keeps the last

    def _compiled_covers(self, n: int) -> bool:
        """Whether one compiled call (compiled_cooc.decode_step) can make n decode lookup pairs in a row, pair for
        pair with the loop's decisions and counts: the default policy (CompiledCoocPolicy), a full pool (no free
        slot), no second-miss admission, and no live-gap window closing before the last pair. Experts the lookahead
        placed for a layer are the caller's check (the loop counts their hits apart)."""
        table, gap = self.table, self.gap
        return (type(table.policy) is CompiledCoocPolicy and not table.free and not self.admission.second_miss
                and n > 0 and len(gap.keys) + n <= gap.window)

    def _compiled_lookup(self, layer: int, expert_ids: np.ndarray, rows: Optional[list]) -> bool:
        """The decode loop of `lookup` in one compiled call, where `_compiled_covers` says it may (else False, and
        `lookup` runs its loop): `_decode_compiled` over this one layer. It pays the interpreter once per call, not
        once per (token, expert) pair (bench/policy_cost.py --engine); tests/test_cache.py holds it to the loop."""
        Tr = expert_ids.shape[0]
        if not self._compiled_covers(expert_ids.size):
            return False
        ids = np.ascontiguousarray(expert_ids, dtype=np.int64).reshape(1, Tr, -1)  # [1, T, K]
        self._decode_compiled([layer], ids, self.steps - 1, rows)  # (lookup has counted this call's step)
        return True

    def lookup_step(self, layers: list, ids: np.ndarray) -> None:
        """A decode step's lookups, made after it (the device step, engine/model.py and engine/device_batch.py): ids
        int [M, T, K], the routing of the M MoE `layers` in order; the same as `lookup(layer, ids[m], "decode")`
        then `finish(layer)` for each layer in turn, which is what it does where the compiled call does not cover
        the step (`_compiled_covers`; also experts the lookahead placed for any of the layers). Otherwise
        `_decode_compiled` makes every layer's lookups in one call and copies each layer's promotions in as that
        layer's finish() would (tests/test_cache.py::test_a_compiled_step_is_its_layer_calls)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)  # [M, T, K]
        if not len(layers) or not self._compiled_covers(ids.size) or any(self._prefetched.get(la) for la in layers):
            for m, layer in enumerate(layers):
                SlotCache.lookup(self, layer, ids[m], "decode")  # the class's: a spy on self.lookup sees it once
                self.finish(layer)
            return
        self.finish(layers[0])  # (nothing is pending between steps; if it were, it lands first, as lookup's does)
        for layer in layers:
            self._prefetched.pop(layer, None)  # (empty: lookup pops them)
        if self.forced_share and layers[0] == self.moe_layers[0]:  # a decode forward begins
            self._next_forced(reuse=True)
        self.steps += len(layers)
        self._decode_compiled(layers, ids, self.steps - len(layers), finish_each=True)

    def _decode_compiled(self, layers: list, ids: np.ndarray, step0: int, rows: Optional[list] = None,
                         finish_each: bool = False) -> None:
        """The decode lookups of M `layers` in order, ids int64 [M, T, K] (C-contiguous), in one compiled call
        (compiled_cooc.decode_step), layer m the insert cap's step step0 + m + 1; then the interpreter applies
        each layer's record (`_apply_record`): the table's counters and slot_of, the promotions (copied in after
        each layer with finish_each, as layer-by-layer lookup and finish calls copy them; else left pending, as one
        lookup call leaves them), the last layer's served paths, the counts (rows: T counter dicts that each row's
        counts are added to as well), and the live gap's keys. The heat map is counted in the kernel."""
        M, Tr, K = ids.shape
        n = Tr * K
        table, policy, gap = self.table, self.table.policy, self.gap
        policy.make_room((max(layers) + 1) * self.n_experts)
        size = cc.R_LIST + 4 * Tr + 7 * n  # one layer's record
        fast = self._fast
        if fast is None or fast["rec"].size < M * size:
            fast = self._fast = self._buffers(2 * M * size)
        rec, miss = fast["rec"], fast["miss"]
        rec[cc.R_FRESH:M * size:size] = 1  # every layer's call is a step of its own (the insert cap's unit) ...
        rec[cc.R_FRESH], rec[cc.R_INSERTS] = table._step != step0 + 1, table._inserts  # ... the first may have begun
        miss[0], miss[1] = self.pcie_frac, self._pcie_credit
        forced = self._forced if self._forced is not None else _NO_MASK  # bool [L, E] or [0, 0]
        if not gap.keys:
            gap.before()  # the live gap's window opens before the call's first pair, as the loop's would
        cc.decode_step(*policy.state, table.slot_array(policy.n_keys), self.residency, self.heat, ids,
                       np.asarray(layers, dtype=np.int64), self.admission.max_inserts, miss, forced, fast["where"],
                       fast["slot"], rec)
        self.clock += M * n
        self._pcie_credit = float(miss[1])
        r = rec[:M * size].tolist()  # one conversion; per layer the R_* fields, then the lists
        row_counts = [dict.fromkeys(("hits", "spill", "cpu", "evicted"), 0) for _ in range(Tr)]
        keys = []
        for m, layer in enumerate(layers):
            keys += self._apply_record(r, m * size, layer, step0 + m + 1, Tr, K, row_counts,
                                       served=m == len(layers) - 1)
            if finish_each:
                self.finish(layer)  # this layer's copies, as its own finish() would make them
        c = self.stats.counts["decode"]
        for t, n_t in enumerate(row_counts):
            n_t["lookups"], n_t["promoted"] = M * K, n_t["evicted"]
            for counts in ((c,) if rows is None else (c, rows[t])):
                for name, k in n_t.items():
                    if k:
                        counts[name] = counts.get(name, 0) + k
        gap.extend(keys, sum(n_t["hits"] for n_t in row_counts))

    def _apply_record(self, r: list, o: int, layer: int, step: int, Tr: int, K: int, row_counts: list,
                      served: bool) -> list:
        """One layer's record of compiled_cooc.decode_step, r[o:] (the R_* fields, then the lists), applied as the
        loop's pairs would have left things: the insert cap's count (step), the table's counters, slot_of and the
        pending copies of the promotions, in pair order; each row's counts added to row_counts[t]; with `served`,
        this layer's served paths become what expert() reads. -> the live gap's keys of this layer."""
        table, n, base = self.table, Tr * K, layer * self.n_experts
        if not r[o + cc.R_FRESH]:  # a miss of this layer reached admission control: the count is this step's
            table._step, table._inserts = step, r[o + cc.R_INSERTS]
        promoted = r[o + cc.R_PROMOTED]
        table.lookups += n
        table.hits += r[o + cc.R_HITS]
        table.evictions += promoted
        at = o + cc.R_LIST + 4 * Tr
        for i in range(at, at + 3 * promoted, 3):  # (key, slot, evicted key), in pair order as the loop makes them
            key, slot, gone = r[i], r[i + 1], r[i + 2]
            del table.slot_of[gone]
            table.slot_of[key] = slot
            self._pending[slot] = (layer, key - base)  # a slot promoted into twice in one call keeps the last
        for t, n_t in enumerate(row_counts):
            h, sp, cpu, ev = r[o + cc.R_LIST + 4 * t:o + cc.R_LIST + 4 * t + 4]
            n_t["hits"] += h
            n_t["spill"] += sp
            n_t["cpu"] += cpu
            n_t["evicted"] += ev
        at += 3 * n
        if served:  # (expert, where, slot)
            self._served = {(layer, r[i]): ("slot", r[i + 2]) if r[i + 1] == 0 else (_MISS_PATHS[r[i + 1]], -1)
                            for i in range(at, at + 3 * r[o + cc.R_SERVED], 3)}
        return r[at + 3 * n:o + cc.R_LIST + 4 * Tr + 7 * n]

    def _buffers(self, n: int) -> dict:
        """The compiled lookups' scratch (compiled_cooc.decode_step): a record of n int64, the miss path's two
        floats, the per-expert served scratch (-1 between calls)."""
        E = self.n_experts
        return {"rec": np.zeros(n, dtype=np.int64), "miss": np.zeros(2), "where": np.full(E, -1, dtype=np.int64),
                "slot": np.full(E, -1, dtype=np.int64)}

    def end_prefill(self) -> None:
        """A request's prompt has been read (generate.py, the server's scheduler): place the warm decode set
        (policies.WarmSet: the experts of the last prompt tokens, within the copy budget), copying their bytes in
        now, so the first decode tokens hit. Without a warm rule, nothing. The live gap's open window closes first
        (gap.py: a window never spans a placement outside a lookup)."""
        self.gap.close()
        if self.warm is None:
            return
        self.finish(-1)  # nothing is pending after prefill; if it were, it lands before slots change hands
        self._served = {}
        for key, slot, evicted in self.warm.apply(lambda key: self.table):
            if evicted is not None:
                self.residency[divmod(evicted, self.n_experts)] = -1
                self.warmed["evicted"] += 1
            self._copy_in(slot, *divmod(key, self.n_experts))  # on a GPU: queued on the copy stream
            self.warmed["copied"] += 1

    def prefetch(self, layer: int, experts, limit: int = 0) -> int:
        """The router lookahead predicts that the next lookup of `layer` (a decode step's) chooses `experts` (ints,
        most wanted first): place those that are not resident, as that lookup's misses would be promoted but one
        layer early, and copy their bytes in now (on a GPU: queued on the copy stream, after the kernels still
        reading a victim's slot; the compute stream waits for the copy before it reads the slot). Admission and the
        insert cap are the lookup's own (SlotTable.prefetch). -> how many were placed (counted "prefetched";
        evictions are counted "evicted", as a promotion's are); limit: at most this many placed (0: no limit).
        Results never change: only where the bytes are read from."""
        self.finish(-1)  # promotions still pending land first (moe.py has called finish already)
        self._served = {}  # the last lookup's experts are computed: nothing is served from its decisions any more
        c = self.stats.counts["decode"]
        placed, n = self._prefetched.setdefault(layer, set()), 0
        keys = [self.key(layer, int(e)) for e in experts]
        step = self.steps + 1  # the insert cap of the next lookup: this layer's
        for key, slot, evicted in prefetch_ranked(lambda key: self.table, keys, step, self._tick, limit):
            e = key - layer * self.n_experts
            if evicted is not None:
                _count((c,), "evicted")
                lay, old = divmod(evicted, self.n_experts)
                self.residency[lay, old] = -1
                self._prefetched.get(lay, set()).discard(old)
            self._copy_in(slot, layer, int(e))
            placed.add(int(e))
            n += 1
            _count((c,), "prefetched")
        return n

    def _tick(self) -> int:
        """One tick of the policy clock (a lookup pair, or a prefetch candidate) -> the new time."""
        self.clock += 1
        return self.clock

    def _miss_path(self) -> str:
        """'spill' for a pcie_frac share of misses, 'cpu' for the rest (deterministic error diffusion)."""
        self._pcie_credit += self.pcie_frac
        if self._pcie_credit >= 1.0 - 1e-9:
            self._pcie_credit -= 1.0
            return "spill"
        return "cpu"

    # --- forced spill: what a spill share costs, at any hit rate (bench/gpu_check.py) ---------------------------
    def force_spill(self, share: float, seed: int = 0) -> None:
        """Serve about `share` of the decode lookups that hit over PCIe instead, as "spill" (and count them so), the
        expert staying in its slot: the spill cliff measured with every expert resident (bench/gpu_check.py).

        Each decode forward n draws a mask bool [L, E] from a generator seeded (seed, n): a lookup of a masked
        resident expert is served as spill. Drawn per forward, not per lookup, because a device step (version 3)
        reads its experts through the residency table before its routing is known on the host: `step_table()`
        gives it the table with the masked experts set to -1 (their changed rows are uploaded as any promotion's
        are), and the step's lookups, made after it, use that same mask. So each lookup is forced with probability
        `share`, independently of the routing; the count over N lookups is binomial (mean share * N), not
        round(share * N), and the counters say what was served. The policy sees every lookup as usual. Prefill is
        never forced. share 0: off."""
        if not 0.0 <= share <= 1.0:
            raise PymoeError(f"forced spill share must be in [0, 1], got {share}")
        self.forced_share, self._forced_seed = float(share), int(seed)
        self._forced, self._forced_n, self._forced_fresh = None, 0, False

    def _next_forced(self, reuse: bool = False) -> None:
        """The mask of the decode forward that begins (reuse: the one step_table() drew for it, if any)."""
        if reuse and self._forced_fresh:
            self._forced_fresh = False
            return
        rng = np.random.default_rng((self._forced_seed, self._forced_n))
        self._forced = rng.random(self.residency.shape) < self.forced_share  # [L, E]
        self._forced_n += 1

    def step_table(self) -> np.ndarray:
        """The residency table a device step reads (int32 [L, E] -> slot or -1): `residency`, or with a forced spill
        share, a copy with this step's masked experts at -1 (the step's lookups then use the same mask)."""
        if not self.forced_share:
            return self.residency
        self._next_forced()
        self._forced_fresh = True
        return np.where(self._forced, -1, self.residency).astype(np.int32)

    # --- start-up ----------------------------------------------------------------------------------------------
    def profile_keys(self, profile) -> list[int]:
        """A profile's (layer, expert) pairs, hottest first, as this cache's keys layer * E + expert: a profile's
        layers are the model's MoE layers (experts/trace.py), so its layer 0 is the model's first MoE layer."""
        n_moe = self.model.config.n_layers - self.first_moe
        if (profile.n_layers, profile.n_experts) != (n_moe, self.n_experts):
            raise PymoeError(f"profile is for {profile.n_layers} MoE layers x {profile.n_experts} experts, the model "
                             f"has {n_moe} x {self.n_experts}")
        return [int(k) + self.first_moe * self.n_experts for k in profile.keys()]

    def fill(self, profile=None) -> str:
        """Fill every slot at start-up (slots never sit empty): the profile's hottest (layer, expert) pairs in rank
        order, then, for the slots left (all of them without a profile), the MoE layers' experts in
        policies.fill_order (layer-interleaved by expert index); copy their bytes in and verify slot 0 byte for byte.
        The simulator starts its tables by the same rule (policies.start_keys), so its counts stay the engine's.

        -> the log line: `pre-filled 5784 of 5784 slots from the profile in 0.6 s (12647 MB/s); slot 0 verified`,
        with `, N of them in expert order` when the profile ran out, or `pre-filled N of N slots in expert order (no
        profile) ...` without one.
        """
        profile = profile if profile is not None else self.profile
        t0 = time.perf_counter()
        ranked = self.profile_keys(profile) if profile is not None else []  # the hottest first, as this cache's keys
        ranked = [k for k in ranked if k // self.n_experts in self.moe_layers]  # (a device's pool: its layers')
        keys = start_keys(ranked, self.moe_layers, self.n_experts)
        self.table.prefill(keys)  # the hottest keys first, until full
        placed, seen = [], set()  # [(key, slot)] in the order filled
        for key in keys:
            slot = self.table.resident(key)
            if slot is not None and key not in seen:
                seen.add(key)
                placed.append((key, slot))
        for key, slot in placed:
            self._copy_in(slot, *divmod(key, self.n_experts))
        self.pool.synchronize()  # a GPU pool copies asynchronously: time the copies, not their launches
        dt = time.perf_counter() - t0
        verified = ""
        if placed:
            key, slot = placed[0]
            layer, e = divmod(int(key), self.n_experts)
            host = np.concatenate([getattr(self.model.expert(layer, e), p).reshape(-1) for p in EXPERT_PROJ])
            if not np.array_equal(self.pool.read(slot)[:host.size], host):  # the device's bytes, on a GPU
                raise PymoeError(f"expert cache: slot {slot} does not hold the bytes of expert {e} of layer {layer}")
            verified = f"; slot {slot} verified"
        mbs = len(placed) * self.slot_bytes / dt / 1e6 if dt > 0 else float("inf")
        rest = len(placed) - len(set(ranked) & seen)  # placed by fill_order
        source = "in expert order (no profile)" if profile is None else "from the profile" + (
            f", {rest} of them in expert order" if rest else "")
        return f"pre-filled {len(placed)} of {self.n_slots} slots {source} in {dt:.1f} s ({mbs:.0f} MB/s){verified}"

    def describe(self) -> str:
        n_total = self.n_total
        return (f"expert cache: {self.n_slots} slots of {self.slot_bytes} bytes ({100 * self.n_slots / n_total:.1f}% "
                f"of {n_total} experts), policy {self.policy_name}, admission: {self.admission}, "
                f"warm decode set: {self.warm_rule}, pcie_frac {self.pcie_frac:g}")
