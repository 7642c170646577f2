"""The expert cache interface, and for now its pass-through implementation (every expert read from host memory).

What this is: the one door through which the MoE block reaches expert weights. `moe.py` calls
`cache.lookup(layer, expert_ids, phase)` once per layer with every (token, expert) pair the router chose, then
`cache.expert(layer, e)` for each distinct expert it computes. The cache counts every lookup, so telemetry
("decode expert cache hit rate: 100.0% (H hits / L lookups)") is real from the first version on.
What this is not (yet): a slot pool. `PassThroughCache` keeps no copies: the CPU backend reads every expert straight
from the GGUF memory map, so every lookup is served from (host-)resident bytes and counts as a hit. The slot pool
with its residency table, policies and miss paths (spill / cpu / promote) replaces this class without touching
the model code: it keeps these three methods.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .loader import ExpertBytes, GGUFModel

PHASES = ("prefill", "decode")


@dataclass
class CacheStats:
    lookups: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    hits: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0))

    def hit_rate(self, phase: str) -> float:
        return self.hits[phase] / self.lookups[phase] if self.lookups[phase] else 0.0

    def reset(self) -> None:
        for d in (self.lookups, self.hits):
            for k in d:
                d[k] = 0


class PassThroughCache:
    """Serves every expert from the model's memory map; counts lookups (all hits: the bytes are resident)."""

    n_slots = 0
    policy = "none"

    def __init__(self, model: GGUFModel):
        self.model = model
        self.stats = CacheStats()

    def lookup(self, layer: int, expert_ids: np.ndarray, phase: str) -> None:
        """Account for the router's choices of one layer: expert_ids int [T, K], one lookup per (token, expert)."""
        n = int(expert_ids.size)
        self.stats.lookups[phase] += n
        self.stats.hits[phase] += n

    def expert(self, layer: int, e: int) -> ExpertBytes:
        return self.model.expert(layer, e)
