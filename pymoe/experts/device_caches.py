"""The expert cache over several devices: one experts/cache.SlotCache per device, over that device's layers.

What this is: `DeviceCaches`, what api.py makes for `--devices` (backends/multi_device.MultiDeviceBackend): one
SlotCache per device over the MoE layers of the device's range, its pool in that device's memory (the device
backend's `new_pool`); the engine's lookups go to the layer's device; counters are the sum over devices (`stats`,
cache.SummedStats) and per device (`per_device`); the live Belady gap is summed too. Why one pool per device and not
one global pool: backends/multi_device.py. `pymoe simulate --devices` replays the same pools (experts/multi.py).
What this is not: the devices themselves (backends/multi_device.py), or the planner's split (experts/multi.py).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .cache import COUNTERS, SlotCache, SummedStats


class DeviceCaches:
    """The expert cache over several devices: one SlotCache per device over its layers (backends/multi_device.py, "Why one pool per device"); a device
    whose layers are all dense (a dense-lead model's first device) has none. The cache's methods the engine calls
    go to the layer's device; counters are summed (`stats`) and per device (`per_device`)."""

    def __init__(self, file, backend: "MultiDeviceBackend", slots: list[int], **options):
        from pymoe.backends.multi_device import named  # (the device's name on an error raised while filling it)

        self.backend = backend
        self.parts: list = []  # [D] SlotCache, or None for a device without experts
        for d, (r, n) in enumerate(zip(backend.ranges, slots)):
            if not any(i in r for i in file.config.moe_layers):
                self.parts.append(None)
                continue
            with backend.context(d)(), named(f"cuda:{backend.ids[d]}"):
                cache = SlotCache(file, int(n), new_pool=backend.devices[d].new_pool, gpu=True, layers=r,
                                  **options)
            backend.devices[d].cache_pool = cache.pool
            self.parts.append(cache)
        self.pools = [c for c in self.parts if c is not None]
        first = self.pools[0]
        self.n_slots = sum(c.n_slots for c in self.pools)
        self.n_total = sum(c.n_total for c in self.pools)
        self.policy_name, self.pcie_frac, self.slot_bytes = first.policy_name, first.pcie_frac, first.slot_bytes
        self.warm_rule, self.profile = first.warm_rule, first.profile
        self.gpu = True  # misses read over PCIe cross it (the request line says so)
        self.stats = SummedStats(self.pools)
        self.gap = _SummedGap(self.pools)
        self.offsets = np.cumsum([0] + [c.n_slots for c in self.pools])[:-1]  # each pool's slots, numbered globally

    def _of(self, layer: int):
        d = self.backend.device_of(layer)
        return self.parts[d], self.backend.context(d)

    def lookup(self, layer: int, expert_ids: np.ndarray, phase: str, rows: Optional[list] = None) -> None:
        cache, ctx = self._of(layer)
        with ctx():
            cache.lookup(layer, expert_ids, phase, rows)

    def expert(self, layer: int, e: int):
        return self._of(layer)[0].expert(layer, e)

    def finish(self, layer: int) -> None:
        cache, ctx = self._of(layer)
        with ctx():
            cache.finish(layer)

    def prefetch(self, layer: int, experts, limit: int = 0) -> int:
        cache, ctx = self._of(layer)
        with ctx():
            return cache.prefetch(layer, experts, limit)

    def end_prefill(self) -> None:
        for d, c in enumerate(self.parts):
            if c is not None:
                with self.backend.context(d)():
                    c.end_prefill()

    @property
    def warmed(self) -> dict:
        return {k: sum(c.warmed[k] for c in self.pools) for k in ("copied", "evicted")}

    @property
    def heat(self) -> np.ndarray:
        return sum(c.heat for c in self.pools)  # [L, E]: each device counts its own layers only

    @property
    def residency(self) -> np.ndarray:
        """[L, E] -> slot (numbered across devices: a device's slots follow the previous device's) or -1."""
        out = np.full_like(self.pools[0].residency, -1)
        for c, off in zip(self.pools, self.offsets):
            mine = c.residency >= 0
            out[mine] = c.residency[mine] + off
        return out

    def fill(self, profile=None) -> str:
        lines = []
        for d, (i, c) in enumerate(zip(self.backend.ids, self.parts)):
            if c is not None:
                with self.backend.context(d)():
                    lines.append(f"cuda:{i}: {c.fill(profile)}")
        return "\n".join(lines)

    def describe(self) -> str:
        head = (f"expert cache on {len(self.parts)} devices, one pool per device over its layers: "
                f"{self.n_slots} slots of {self.slot_bytes} bytes ({100 * self.n_slots / self.n_total:.1f}% of "
                f"{self.n_total} experts)")
        return "\n".join([head] + [f"cuda:{i} layers {r.start}-{r.stop - 1}: "
                                   + (c.describe() if c is not None else "dense layers only, no slot pool")
                                   for i, r, c in zip(self.backend.ids, self.backend.ranges, self.parts)])

    def per_device(self, phase: str) -> list[dict]:
        """Each device's counters of `phase` and its slots: what the request line and /v1/status show."""
        return [dict(c.stats.snapshot(phase) if c is not None else dict.fromkeys(COUNTERS, 0),
                     slots=c.n_slots if c is not None else 0, layers=[r.start, r.stop - 1], device=f"cuda:{i}")
                for i, r, c in zip(self.backend.ids, self.backend.ranges, self.parts)]


class _SummedGap:
    """experts/gap.LiveGap's totals over several pools (each pool's Belady bound on its own lookups)."""

    def __init__(self, parts: list):
        self.parts = parts

    def totals(self) -> dict:
        out: dict = {}
        for c in self.parts:
            for k, v in c.gap.totals().items():
                out[k] = out.get(k, 0) + v
        return out

    def close(self) -> None:
        for c in self.parts:
            c.gap.close()
