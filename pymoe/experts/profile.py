"""Expert profiles: every (layer, expert) pair ranked by how often the router chose it (format: docs/trace-files.md).

What this is: `Profile` = pairs int [n_pairs, 2] (layer, expert), hottest first, with their counts int64 [n_pairs].
Built from a routing trace (`from_trace`) or from aggregate heat counts `heat[layer][expert]` (`from_heat`, e.g.
/work/shared/data/routing-heat/*.json via `load_heat_json`); saved as the little-endian binary `expert-profile.bin`
that `pymoe run --profile` reads to pre-fill its slots hottest first and that the static / pinned-lru policies
rank by. `coverage_hit_rate(n)` is the static bound: the share of all counted lookups the top n pairs serve.
What this is not: a cache policy (policies.py) or a simulator (simulate.py).

Binary layout (all little-endian):
    offset  size  field
    0       8     magic b"PYMOEPRF"
    8       4     uint32 version (1)
    12      4     uint32 n_layers
    16      4     uint32 n_experts
    20      4     uint32 n_pairs
    24      8     uint64 built_for_slots (the slot count it was built for; n_pairs if not given)
    32      12*n  n_pairs records {uint16 layer, uint16 expert, uint64 count}, hottest first
Ranking: count descending, ties by global key (layer * n_experts + expert) ascending, so it is deterministic.
Pairs never routed are kept (count 0) at the end, so a profile covers every slot a model can have.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Optional

import numpy as np

from pymoe.errors import PymoeError, file_error

MAGIC = b"PYMOEPRF"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQ")  # magic, version, n_layers, n_experts, n_pairs, built_for_slots: 32 bytes
RECORD = np.dtype([("layer", "<u2"), ("expert", "<u2"), ("count", "<u8")])  # 12 bytes, packed


class Profile:
    def __init__(self, n_layers: int, n_experts: int, pairs, counts, built_for_slots: Optional[int] = None):
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        self.pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)  # [n_pairs, 2] (layer, expert), hottest first
        self.counts = np.asarray(counts, dtype=np.int64).reshape(-1)  # [n_pairs]
        self.built_for_slots = built_for_slots

    # --- building ---------------------------------------------------------------------------------------------
    @classmethod
    def from_heat(cls, heat) -> "Profile":
        """heat int [L, E] (times each expert was routed to, per layer) -> all L*E pairs ranked."""
        heat = np.asarray(heat, dtype=np.int64)  # [L, E]
        if heat.ndim != 2 or (heat < 0).any():
            raise PymoeError(f"heat must be a non-negative [layers, experts] array, got shape {heat.shape}")
        L, E = heat.shape
        order = np.argsort(-heat.reshape(-1), kind="stable")  # [L*E] global keys, hottest first, ties by key
        pairs = np.stack([order // E, order % E], axis=1)  # [L*E, 2]
        return cls(L, E, pairs, heat.reshape(-1)[order])

    @classmethod
    def from_trace(cls, trace, phase: Optional[str] = None) -> "Profile":
        """Count every (layer, expert) lookup of a Trace (one phase, or all) and rank them."""
        return cls.from_traces([trace], phase)

    @classmethod
    def from_traces(cls, traces, phase: Optional[str] = None) -> "Profile":
        """The lookups of several traces of one model shape, counted together."""
        L, E = traces[0].n_layers, traces[0].n_experts
        counts = np.zeros(L * E, dtype=np.int64)  # [L*E]
        for trace in traces:
            if (trace.n_layers, trace.n_experts) != (L, E):
                raise PymoeError(f"traces of different shapes: {L}x{E} and {trace.n_layers}x{trace.n_experts}")
            counts += np.bincount(trace.keys(phase), minlength=L * E)
        return cls.from_heat(counts.reshape(L, E))

    # --- reading it -------------------------------------------------------------------------------------------
    @property
    def n_pairs(self) -> int:
        return int(self.pairs.shape[0])

    def keys(self, n: Optional[int] = None) -> np.ndarray:
        """int64 [n_pairs] (or the first n): global keys layer * n_experts + expert, hottest first."""
        keys = self.pairs[:, 0] * self.n_experts + self.pairs[:, 1]  # [n_pairs]
        return keys if n is None else keys[:n]

    def top(self, n: int) -> np.ndarray:
        """int64 [min(n, n_pairs), 2]: the n hottest (layer, expert) pairs (what n slots pre-fill with)."""
        return self.pairs[:max(0, int(n))]

    def heat(self) -> np.ndarray:
        """int64 [L, E]: the counts back as a layer x expert matrix (pairs missing from the profile count 0)."""
        heat = np.zeros((self.n_layers, self.n_experts), dtype=np.int64)  # [L, E]
        heat[self.pairs[:, 0], self.pairs[:, 1]] = self.counts
        return heat

    def coverage_hit_rate(self, n_slots: int) -> float:
        """Share of all counted lookups served by the top n_slots pairs: the hit rate of a static cache of that
        size on the data the profile was built from (an upper bound for static when built in-sample)."""
        total = int(self.counts.sum())
        return float(self.counts[:max(0, int(n_slots))].sum()) / total if total else 0.0

    def log_line(self, path) -> str:
        slots = self.built_for_slots if self.built_for_slots is not None else self.n_pairs
        return f"profile {path}: {self.n_pairs} ranked pairs, built for {slots} slots"

    # --- the file ---------------------------------------------------------------------------------------------
    def save(self, path, built_for_slots: Optional[int] = None) -> None:
        slots = built_for_slots if built_for_slots is not None else (
            self.built_for_slots if self.built_for_slots is not None else self.n_pairs)
        if self.n_layers > 65536 or self.n_experts > 65536:
            raise PymoeError(f"{path}: {self.n_layers} layers x {self.n_experts} experts exceed the uint16 fields")
        rec = np.empty(self.n_pairs, dtype=RECORD)  # [n_pairs]
        rec["layer"], rec["expert"], rec["count"] = self.pairs[:, 0], self.pairs[:, 1], self.counts
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, self.n_layers, self.n_experts, self.n_pairs, int(slots)))
            f.write(rec.tobytes())
        os.replace(tmp, path)
        self.built_for_slots = int(slots)

    @classmethod
    def load(cls, path) -> "Profile":
        """Read and validate a profile file; any defect is a one-line PymoeError naming the file."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise file_error(path, e.strerror.lower() if e.strerror else str(e)) from None
        if len(data) < HEADER.size or data[:8] != MAGIC:
            raise file_error(path, "not a pymoe expert profile (bad magic)")
        _, version, L, E, n_pairs, slots = HEADER.unpack_from(data)
        if version != VERSION:
            raise file_error(path, f"unsupported profile version {version} (this pymoe reads {VERSION})")
        want = HEADER.size + n_pairs * RECORD.itemsize
        if len(data) != want:
            raise file_error(path, f"truncated or padded profile: {len(data)} bytes, header says {want}")
        rec = np.frombuffer(data, dtype=RECORD, offset=HEADER.size, count=n_pairs)  # [n_pairs]
        pairs = np.stack([rec["layer"], rec["expert"]], axis=1).astype(np.int64)  # [n_pairs, 2]
        if n_pairs and (pairs[:, 0].max() >= L or pairs[:, 1].max() >= E):
            raise file_error(path, f"pair out of range for {L} layers x {E} experts")
        if np.unique(pairs[:, 0] * E + pairs[:, 1]).size != n_pairs:
            raise file_error(path, "a (layer, expert) pair is listed twice")
        return cls(L, E, pairs, rec["count"].astype(np.int64), built_for_slots=int(slots))


def load_heat_json(path) -> Profile:
    """A routing-heat JSON ({"heat": [[count per expert] per layer], ...}) as a Profile."""
    try:
        with open(path) as f:
            heat = json.load(f)["heat"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise file_error(path, f"not a routing-heat JSON ({type(e).__name__}: {e})") from None
    return Profile.from_heat(heat)


def load_profile_source(path, phase: Optional[str] = None) -> Profile:
    """A profile from what a user has: a profile .bin, a routing-heat .json, or a trace .npz."""
    if str(path).endswith(".json"):
        return load_heat_json(path)
    if str(path).endswith(".npz"):
        from .trace import Trace

        return Profile.from_trace(Trace.load(path), phase)
    return Profile.load(path)
