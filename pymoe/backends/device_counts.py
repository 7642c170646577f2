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
Also here: `LaunchRecorder`, each device step's launches with their arguments' fingerprints (device pointers,
shapes, strides, scalars), which must repeat from step to step for a CUDA graph to replay the step
(backends/cuda_graphs.py, tests/test_cuda_graphs.py).
What this is not: timing (no clock here), or the expert cache's own counters (experts/cache.py).
"""
from __future__ import annotations

import copy

import numpy as np


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


# --------------------------------------------------------------------------------------------------------------
# Replayable launches: what a CUDA graph needs of a decode step
# --------------------------------------------------------------------------------------------------------------
# A CUDA graph replays the launches it captured with the argument values it captured: device pointers and scalars.
# So a step can be replayed only if every launch of the next step is the same as the last one's, argument for
# argument; whatever varies from step to step (the position, the token id, the residency table's contents) must be
# read by the kernels from device arrays whose addresses stay put (backends/cuda_graphs.py, docs/expert-cache.md
# "CUDA graphs"). `LaunchRecorder` records what is needed to check that.
def fingerprint(a):
    """What a graph captures of one launch argument: a device array's (pointer, shape, strides, dtype) (a Numba
    kernel receives its pointer and its shape and strides by value), a scalar's value, a tuple's or a dict's
    members', any other object's type name (a stream, a kernel set: not an argument the kernels read)."""
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, np.generic):
        return a.item()
    if isinstance(a, (tuple, list)):
        return tuple(fingerprint(x) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((str(k), fingerprint(v)) for k, v in a.items()))
    if hasattr(a, "__cuda_array_interface__"):  # a device array on a GPU
        cai = a.__cuda_array_interface__
        return ("array", cai["data"][0], tuple(cai["shape"]), cai.get("strides"), cai["typestr"])
    host = getattr(a, "_ary", a)  # the simulator's device array wraps a NumPy array
    if isinstance(host, np.ndarray):
        return ("array", host.__array_interface__["data"][0], host.shape, host.strides, host.dtype.str)
    if hasattr(a, "value") and hasattr(a, "name"):  # an enum (a quant type)
        return (type(a).__name__, a.name)
    return type(a).__name__


class LaunchRecorder:
    """Each launch a device step makes, in order: `steps[i]` is step i's list of (name, grid, block, argument
    fingerprints). Two sources feed it:
      - the CUDA backend's `_launch` (every kernel-set operation, whichever kernel set runs: the NumPy references
        too), as (operation name, None, None, fingerprints): each kernel wrapper derives its grid and block from
        its arguments' shapes and scalars, so equal fingerprints mean equal launches;
      - `kernels()`, a context manager that sees every Numba kernel launch itself (kernel[grid, block, stream]
        (args)), in the simulator or on a GPU, as (kernel name, grid, block, fingerprints).
    Outside a step (`begin` .. `end`), nothing is recorded."""

    def __init__(self):
        self.steps: list = []
        self._now = None

    def begin(self) -> None:
        self._now = []
        self.steps.append(self._now)

    def end(self) -> None:
        self._now = None

    def launch(self, name: str, args: tuple, grid=None, block=None) -> None:
        if self._now is not None:
            self._now.append((name, grid, block, tuple(fingerprint(a) for a in args)))

    def kernels(self):
        """Record the Numba kernel launches themselves while the context is open (the simulator's kernel class, or
        numba.cuda's dispatcher on a GPU)."""
        import contextlib

        from numba import config

        if config.ENABLE_CUDASIM:
            from numba.cuda.simulator.kernel import FakeCUDAKernel as cls
        else:
            from numba.cuda.dispatcher import CUDADispatcher as cls
        recorder, original = self, cls.__getitem__

        def configure(kernel, config_):
            launch = original(kernel, config_)
            name = getattr(kernel, "__name__", None) or kernel.py_func.__name__
            grid, block = (tuple(d) if isinstance(d, tuple) else (d,) for d in config_[:2])

            def call(*args):
                recorder.launch(name, args, grid, block)
                return launch(*args)

            return call

        @contextlib.contextmanager
        def patched():
            cls.__getitem__ = configure
            try:
                yield self
            finally:
                cls.__getitem__ = original

        return patched()


def first_difference(a: list, b: list):
    """The first launch at which two steps' launch lists differ, said in words (None: they are equal)."""
    if len(a) != len(b):
        return f"{len(a)} launches against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            if x[0] != y[0] or x[1:3] != y[1:3]:
                return f"launch {i}: {x[:3]} against {y[:3]}"
            j = next(j for j, (p, q) in enumerate(zip(x[3], y[3])) if p != q)
            return f"launch {i} ({x[0]}): argument {j} is {x[3][j]} then {y[3][j]}"
    return None
