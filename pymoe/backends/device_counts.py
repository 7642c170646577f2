"""What a device backend costs, counted: kernel launches, host<->device bytes (by what they carry), host syncs.

What this is: `DeviceCounts`, a few integers the CUDA backend (backends/cuda.py) adds to at each launch, copy and
synchronisation site, kept per phase of the forward call under way ("prefill", "decode"; "load" before the first
one: weights, RoPE tables, kernel warm-up, the slots' pre-fill; the PCIe probe's own copies, experts/probe.py, are
not counted). The engine names the phase at the start of each forward (`forward`). Counting is exact in Numba's
CUDA simulator, which is how the cost of the GPU path is measured without a GPU (docs/expert-cache.md, "The GPU
path's cost, counted").

Byte names say what crosses and which way ("... to device", "... to host"); bytes a kernel reads from pinned,
mapped host memory (the spill path) are PCIe bytes too, named "expert spill reads over PCIe". Device-to-device
copies (the KV write of the attention block) do not cross PCIe and are not counted.
What this is not: timing (no clock here), or the expert cache's own counters (experts/cache.py).
"""
from __future__ import annotations

import copy


def _empty() -> dict:
    return {"forwards": 0, "tokens": 0, "launches": 0, "synchronisations": 0, "bytes": {}}


class DeviceCounts:
    def __init__(self):
        self.phases: dict[str, dict] = {"load": _empty()}
        self._now = self.phases["load"]

    def forward(self, phase: str, n_tokens: int) -> None:
        """A forward call of `n_tokens` tokens starts: what follows is counted under `phase`."""
        self._now = self.phases.setdefault(phase, _empty())
        self._now["forwards"] += 1
        self._now["tokens"] += int(n_tokens)

    def launch(self, n: int = 1) -> None:
        self._now["launches"] += n

    def copy(self, what: str, nbytes: int) -> None:
        b = self._now["bytes"]
        b[what] = b.get(what, 0) + int(nbytes)

    def sync(self) -> None:
        self._now["synchronisations"] += 1

    def snapshot(self, phase: str) -> dict:
        return copy.deepcopy(self.phases.get(phase, _empty()))


def difference(after: dict, before: dict) -> dict:
    """after - before, two snapshots of one phase."""
    out = {k: after[k] - before[k] for k in ("forwards", "tokens", "launches", "synchronisations")}
    out["bytes"] = {w: n - before["bytes"].get(w, 0) for w, n in after["bytes"].items()
                    if n != before["bytes"].get(w, 0)}
    return out


def per_token(c: dict) -> dict:
    """Means per token of a phase's counts (a decode token: a decoded token), bytes by name and in all."""
    n = max(c["tokens"], 1)
    return {"tokens": c["tokens"], "launches": c["launches"] / n, "synchronisations": c["synchronisations"] / n,
            "bytes": sum(c["bytes"].values()) / n, "bytes_by_name": {w: b / n for w, b in sorted(c["bytes"].items())}}


def line(c: dict) -> str:
    """`device per token: L launches, B host<->device bytes, S synchronisations` over a phase's tokens."""
    m = per_token(c)
    return (f"device per token: {m['launches']:.1f} launches, {m['bytes']:,.0f} host<->device bytes, "
            f"{m['synchronisations']:.1f} synchronisations")
