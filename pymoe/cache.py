"""The expert cache: a fixed pool of slots holding hot experts, a residency table, a policy, and the miss paths.

What this is: the one door through which the MoE block reaches expert weights. Per layer, `moe.py` calls
    cache.lookup(layer, expert_ids [T, K], phase)   every (token, expert) pair the router chose: accounting + policy
    cache.expert(layer, e)                          the bytes to compute expert e with: a slot, or host memory
Two implementations keep these methods:
  - `PassThroughCache`: no pool. Every expert is read in place from the GGUF memory map, so every lookup counts as a
    hit. The CPU backend's default: host RAM already holds every expert.
  - `SlotCache`: N slots, each one expert's gate + up + down bytes exactly as stored in the GGUF, a residency table
    `[n_layers, n_experts] -> slot or -1`, and a policy from `policies.py` (the same code `pymoe simulate` replays
    traces with). On the CPU backend the pool is a bounded buffer in RAM: the *accounting* (hits, misses by path,
    promotions, evictions) is what a GPU pool does, which is what makes every cache behaviour testable in CI.

A decode miss is served one of two ways, and may also be promoted:
  - spill: the GPU reads the expert straight from pinned, mapped host memory over PCIe (no slot needed);
  - cpu:   the CPU computes that expert's output in place from the mmap while the GPU does the rest;
    the share of misses sent over PCIe is `pcie_frac` (the rest go to the CPU), assigned deterministically by
    error diffusion so the split is exact and reproducible;
  - promote: when the policy admits the expert, its bytes are copied into a slot (the policy's victim is evicted),
    so the *next* lookup hits. On a GPU the copy runs on a copy stream overlapped with compute.
Prefill lookups never promote: a prompt chunk touches nearly every expert, so letting it through the policy would
flush the decode working set. Prefill misses are "staged" (streamed once per chunk), hits refresh the policy.
What this is not: a policy (policies.py), or the code that moves bytes to a GPU (backends/cuda.py does the copies;
here the CPU backend's copies are plain NumPy).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from .errors import PymoeError
from .loader import EXPERT_PROJ, ExpertBytes, GGUFModel
from .policies import DEFAULT_POLICY

PHASES = ("prefill", "decode")
COUNTERS = ("lookups", "hits", "spill", "cpu", "staged", "promoted", "evicted")


@dataclass
class CacheStats:
    """Counters per phase. lookups = hits + spill + cpu (decode) or hits + staged (prefill)."""

    counts: dict = field(default_factory=lambda: {p: dict.fromkeys(COUNTERS, 0) for p in PHASES})

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

    def reset(self) -> None:
        for c in self.counts.values():
            for k in c:
                c[k] = 0


class PassThroughCache:
    """Serves every expert from the model's memory map; counts lookups (all hits: the bytes are resident)."""

    n_slots = 0
    policy_name = "none"

    def __init__(self, model: GGUFModel, miss_path: Optional[str] = None):
        """miss_path None: host RAM is where experts are computed (CPU backend), every lookup a hit. "spill": a GPU
        with no slots (`--cache none`): every lookup is a miss read over PCIe (staged in prefill)."""
        self.model = model
        self.miss_path = miss_path
        self._where = miss_path
        self.stats = CacheStats()

    def lookup(self, layer: int, expert_ids: np.ndarray, phase: str) -> None:
        """Account for the router's choices of one layer: expert_ids int [T, K], one lookup per (token, expert)."""
        n = int(expert_ids.size)
        c = self.stats.counts[phase]
        c["lookups"] += n
        self._where = "staged" if phase == "prefill" else self.miss_path  # for expert(), until the next lookup
        c["hits" if self.miss_path is None else self._where] += n

    def expert(self, layer: int, e: int) -> ExpertBytes:
        ex = self.model.expert(layer, e)
        return ex if self.miss_path is None else replace(ex, where=self._where)

    def describe(self) -> str:
        cfg = self.model.config
        if self.miss_path is not None:
            return f"expert cache: none (all {cfg.n_layers * cfg.n_expert} experts read over PCIe from pinned host memory)"
        return (f"expert cache: none (all {cfg.n_layers * cfg.n_expert} experts read in place from the memory map; "
                "--cache-slots N emulates a GPU slot pool)")


class HostPool:
    """The slot pool of the CPU backend: uint8 [N, slot_bytes] in RAM. A GPU backend's pool subclasses it, keeping
    the slot layout and replacing where the bytes live and how they are copied (backends/cuda.py: `DevicePool`)."""

    def __init__(self, n_slots: int, slot_bytes: int, parts: list):
        self.layout, off = [], 0  # [(name, byte offset, (rows, row_bytes))]: gate | up | down in every slot
        for name, shape in parts:
            self.layout.append((name, off, shape))
            off += shape[0] * shape[1]
        self.bytes = self.allocate(n_slots, slot_bytes)  # [N, slot_bytes]

    def allocate(self, n_slots: int, slot_bytes: int):
        return np.zeros((n_slots, slot_bytes), dtype=np.uint8)

    def write(self, slot: int, ex: ExpertBytes) -> None:
        for name, off, _ in self.layout:
            src = getattr(ex, name)
            self.bytes[slot, off:off + src.nbytes] = src.reshape(-1)

    def part(self, slot: int, off: int, shape: tuple):
        """The bytes of one matrix of a slot, as rows: uint8 [rows, row_bytes], a view."""
        return self.bytes[slot, off:off + shape[0] * shape[1]].reshape(shape)

    def view(self, slot: int, layer: int, e: int) -> ExpertBytes:
        views = {name: self.part(slot, off, shape) for name, off, shape in self.layout}
        return ExpertBytes(layer, e, **views, where="slot", slot=slot)

    def read(self, slot: int) -> np.ndarray:
        """uint8 [slot_bytes]: the slot's bytes, on the host."""
        return self.bytes[slot]

    def synchronize(self) -> None:
        pass


class SlotCache:
    """N expert slots in a pool, a residency table, a policy; spill / cpu / promote on a miss."""

    def __init__(self, model: GGUFModel, n_slots: int, policy: str = DEFAULT_POLICY, profile=None,
                 pcie_frac: float = 1.0, new_pool=None, **policy_args):
        from .policies import SlotTable, make_policy

        cfg = model.config
        self.model = model
        self.n_layers, self.n_experts = cfg.n_layers, cfg.n_expert
        n_total = self.n_layers * self.n_experts
        if not 1 <= n_slots <= n_total:
            raise PymoeError(f"cache slots must be in 1..{n_total} (the model's experts), got {n_slots}")
        if not 0.0 <= pcie_frac <= 1.0:
            raise PymoeError(f"pcie_frac must be in [0, 1], got {pcie_frac}")
        if policy == "belady":
            raise PymoeError("policy 'belady' needs the future: it exists in `pymoe simulate` only")
        self.n_slots = n_slots
        self.policy_name = policy
        self.pcie_frac = pcie_frac
        self.profile = profile
        profile_keys = list(profile.keys()) if profile is not None else None
        self.table = SlotTable(n_slots, make_policy(policy, n_slots, profile_keys=profile_keys, **policy_args))
        self.residency = np.full((self.n_layers, self.n_experts), -1, dtype=np.int32)  # [L, E] -> slot or -1
        # Byte layout of a slot: gate | up | down, each as stored in the GGUF; the same for every layer of a file.
        ex = model.expert(0, 0)
        self.parts = [(p, getattr(ex, p).shape) for p in EXPERT_PROJ]  # [(name, (rows, row_bytes))]
        self.slot_bytes = model.slot_bytes
        self.pool = (new_pool or HostPool)(n_slots, self.slot_bytes, self.parts)  # a backend's pool (GPU), or RAM
        self._missed: dict = {}  # (layer, expert) -> miss path, for the last lookup call
        self.stats = CacheStats()
        self.clock = 0  # one tick per lookup: the policy's notion of time
        self._pcie_credit = 0.0  # error diffusion of the spill/cpu split

    # --- bytes -------------------------------------------------------------------------------------------------
    def _copy_in(self, slot: int, layer: int, e: int) -> None:
        """Copy expert (layer, e) from host memory into `slot` (on a GPU: a host->device copy on the copy stream)."""
        self.pool.write(slot, self.model.expert(layer, e))
        self.residency[layer, e] = slot

    def expert(self, layer: int, e: int) -> ExpertBytes:
        """The bytes to compute expert e with, and where they are (`ExpertBytes.where`): its slot if it was resident
        at this call's lookup, else host memory tagged with the miss path the lookup chose (spill / cpu / staged).
        An expert promoted by this very lookup is still served by its miss path: its copy into the slot runs on
        the copy stream, overlapped with this token's compute, and the *next* lookup hits."""
        path = self._missed.get((layer, e))
        if path is not None:
            return replace(self.model.expert(layer, e), where=path)
        slot = int(self.residency[layer, e])
        return self.pool.view(slot, layer, e) if slot >= 0 else self.model.expert(layer, e)

    # --- accounting and policy ---------------------------------------------------------------------------------
    def key(self, layer: int, e: int) -> int:
        return layer * self.n_experts + e

    def lookup(self, layer: int, expert_ids: np.ndarray, phase: str) -> None:
        """One layer's routing, expert_ids int [T, K], in token order: count, update the policy, promote/evict."""
        c = self.stats.counts[phase]
        self._missed = {}  # (layer, expert) -> the miss path chosen by this call (read by expert())
        for e in expert_ids.reshape(-1):
            e = int(e)
            key = self.key(layer, e)
            self.clock += 1
            c["lookups"] += 1
            hit, slot, evicted = self.table.access(key, self.clock, insert=phase == "decode")
            if hit:
                c["hits"] += 1
                continue
            if phase == "prefill":
                c["staged"] += 1  # streamed once per chunk; the resident set stays as the policy wants it
                self._missed[layer, e] = "staged"
                continue
            path = self._missed.setdefault((layer, e), self._miss_path())  # one path per expert per call
            c[path] += 1
            if evicted is not None:
                c["evicted"] += 1
                self.residency[divmod(evicted, self.n_experts)] = -1
            if slot is not None:
                c["promoted"] += 1
                self._copy_in(slot, layer, e)

    def _miss_path(self) -> str:
        """'spill' for a pcie_frac share of misses, 'cpu' for the rest (deterministic error diffusion)."""
        self._pcie_credit += self.pcie_frac
        if self._pcie_credit >= 1.0 - 1e-9:
            self._pcie_credit -= 1.0
            return "spill"
        return "cpu"

    # --- start-up ----------------------------------------------------------------------------------------------
    def prefill_from_profile(self, profile=None) -> str:
        """Fill the slots with the profile's hottest (layer, expert) pairs, in rank order; verify slot 0.

        -> the log line: `pre-filled 5784 of 5784 slots from the profile in 0.6 s (12647 MB/s); slot 0 verified`.
        """
        profile = profile if profile is not None else self.profile
        if profile is None:
            raise PymoeError("no profile to pre-fill the expert cache from")
        if (profile.n_layers, profile.n_experts) != (self.n_layers, self.n_experts):
            raise PymoeError(f"profile is for {profile.n_layers} layers x {profile.n_experts} experts, the model has "
                             f"{self.n_layers} x {self.n_experts}")
        t0 = time.perf_counter()
        self.table.prefill([int(k) for k in profile.keys()])  # the hottest keys, in rank order, until full
        placed = [(k, self.table.resident(int(k))) for k in profile.keys()[: self.n_slots]]
        placed = [(k, s) for k, s in placed if s is not None]  # [(key, slot)] in rank order
        for key, slot in placed:
            self._copy_in(slot, *divmod(int(key), self.n_experts))
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
        return (f"pre-filled {len(placed)} of {self.n_slots} slots from the profile in {dt:.1f} s ({mbs:.0f} MB/s)"
                f"{verified}")

    def describe(self) -> str:
        n_total = self.n_layers * self.n_experts
        return (f"expert cache: {self.n_slots} slots of {self.slot_bytes} bytes ({100 * self.n_slots / n_total:.1f}% "
                f"of {n_total} experts), policy {self.policy_name}, pcie_frac {self.pcie_frac:g}")
