"""Slot pools: the memory of the expert cache's N slots. `HostPool` is a bounded buffer in RAM (the CPU backend's, and
the reference backend's); backends/cuda.py's `DevicePool` subclasses it, keeping the slot layout and replacing where
the bytes live and how they are copied (a copy stream, events).

What this is not: the cache's policy or accounting (experts/cache.py decides what goes in which slot and when).
"""
from __future__ import annotations

import numpy as np

from pymoe.gguf.loader import ExpertBytes


class HostPool:
    """The slot pool of the CPU backend: uint8 [N, slot_bytes] in RAM. A GPU backend's pool subclasses it, keeping
    the slot layout and replacing where the bytes live and how they are copied (backends/cuda.py: `DevicePool`).

    Slot layout: an expert of layer i fills the first `layouts[i].nbytes` bytes of a slot as gate | up | down, each
    with layer i's own types and row sizes (`loader.ExpertLayout`); `slot_bytes` is the largest over the layers, so
    any slot can hold an expert of any layer, and a slot is always read with the layout of the expert it holds."""

    def __init__(self, n_slots: int, slot_bytes: int, layouts: list):
        self.layouts = list(layouts)  # [L] loader.ExpertLayout, one per layer (None: a dense layer, no experts)
        need = max(lay.nbytes for lay in self.layouts if lay is not None)
        if slot_bytes < need:
            raise ValueError(f"slots of {slot_bytes} bytes cannot hold the largest expert ({need} bytes)")
        self.bytes = self.allocate(n_slots, slot_bytes)  # [N, slot_bytes]

    def allocate(self, n_slots: int, slot_bytes: int):
        return np.zeros((n_slots, slot_bytes), dtype=np.uint8)

    def write(self, slot: int, ex: ExpertBytes) -> None:
        for name, off, _ in self.layouts[ex.layer].parts:
            src = getattr(ex, name)
            self.bytes[slot, off:off + src.nbytes] = src.reshape(-1)

    def part(self, slot: int, off: int, shape: tuple):
        """The bytes of one matrix of a slot, as rows: uint8 [rows, row_bytes], a view."""
        return self.bytes[slot, off:off + shape[0] * shape[1]].reshape(shape)

    def view(self, slot: int, layer: int, e: int) -> ExpertBytes:
        """Expert e of `layer`, which the slot holds, read with that layer's layout."""
        views = {name: self.part(slot, off, shape) for name, off, shape in self.layouts[layer].parts}
        return ExpertBytes(layer, e, **views, where="slot", slot=slot)

    def read(self, slot: int) -> np.ndarray:
        """uint8 [slot_bytes]: the slot's bytes, on the host."""
        return self.bytes[slot]

    def synchronize(self) -> None:
        pass
