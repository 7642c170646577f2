"""CUDA graphs for the device decode step, through CuPy: one step's launches captured once and replayed as one.

What this is: `StepGraphs`, held by the CUDA backend (backends/cuda.py) when graphs are on (`wanted`:
PYMOE_CUDA_GRAPHS=1, the default on a GPU with CuPy and the real kernels; 0, and always in Numba's simulator, where
CuPy cannot run). CuPy owns the compute stream (`CupyCapture`: a `cupy.cuda.Stream`; the Numba kernels
launch on it through `numba.cuda.external_stream(stream.ptr)`), the device memory (CuPy's pool: `allocate`) and the
graphs (`stream.begin_capture()` .. `end_capture()` -> `cupy.cuda.Graph`, `graph.launch(stream)`).

During a device step (`CUDABackend.begin_step` .. `end_step`, or a batched one of B sequences: `begin_batch` ..
`end_batch`, engine/device_batch.py) each launch is held back (`defer`) with its
arguments' fingerprints (backends/device_counts.fingerprint: device pointers, shapes, strides, scalars). At the
step's end (`run`) the list of fingerprints is the graph's key -- the batch size (a single step, or the B rows of a
batched one: the shapes of its arrays and views), the KV cache's arrays, the scratch's capacity all show in it, so a
new shape is a new key, captured anew (one graph per batch size):
    a key seen for the first time   the launches run directly (a warm-up: each kernel is compiled at its first
                                    launch, and nothing may compile during a capture);
    seen once before                the launches are captured on the stream into a graph, which is then launched
                                    (a capture that raises leaves this and every later step direct: `failed`);
    captured                        the graph is launched: one call for the whole step.
So a graph replays only launches identical to the ones it captured, which is what makes replay correct: whatever
varies from step to step (the token id, its position and KV row, the residency table, the routing) lives in device
arrays at fixed addresses, written before the graph runs (tests/test_cuda_graphs.py holds every family's steps to
identical launch lists in the simulator).
Outside the graph, on the same stream: the upload of the token id and position (and of a random draw's settings: the
sample kernel reads them there) and of the residency table's changed rows and the waits for the promotions' copies
(before it), the event the slot copies wait for and the copy back of the token and routing ids (and the drawn id)
(after it). A step whose cache lookups are made inside it ("cpu" misses: host round
trips per MoE layer) runs its launches directly, as does any step in which the host must read the device before
the step ends (`flush`).
What this is not: a second forward pass (the engine's forward runs every step, choosing the same launches), or a
change of results: a replay runs the very kernels on the very arguments (`test_graphs_on_and_off_decode_alike`, a
GPU test in scripts/gpu-check; in the simulator, a stand-in capture that replays the captured calls,
`test_graph_replay_keeps_the_tokens`).
"""
from __future__ import annotations

import os

from pymoe.errors import PymoeError
from .device_counts import fingerprint


def wanted(kernels: str, simulated: bool) -> bool:
    """PYMOE_CUDA_GRAPHS: "1" on, "0" off; unset: on with a GPU, CuPy and the real kernels."""
    raw = os.environ.get("PYMOE_CUDA_GRAPHS", "")
    if raw not in ("", "0", "1"):
        raise PymoeError(f"PYMOE_CUDA_GRAPHS must be 0 or 1, got {raw!r}")
    if raw == "0":
        return False
    ok = not simulated and kernels == "cuda_kernels" and _has_cupy()
    if raw == "1" and not ok:
        raise PymoeError("PYMOE_CUDA_GRAPHS=1 needs a GPU, CuPy and the real kernels (not the simulator, not "
                         "kernels='reference')")
    return ok


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


class CupyCapture:
    """CuPy's side: the stream the step runs on, its capture into a graph, the graph's launch, and device memory
    from CuPy's pool (imported only here, only when graphs are on), all on the device of Numba's current context
    (one of several: backends/multi_device.py makes each device's backend inside its context)."""

    def __init__(self, cuda):
        import cupy

        self.cupy = cupy
        self.device = cupy.cuda.Device(cuda.get_current_device().id)
        with self.device:  # a blocking stream, as numba.cuda.stream() is: ordered after the default stream's
            self.stream = cupy.cuda.Stream()  # synchronous uploads (weights, a norm's first use) as before

    def numba_stream(self, cuda):
        return cuda.external_stream(self.stream.ptr)

    def capture(self, launches: list):
        """The launches captured (not run) into a graph; the stream leaves capture mode whatever happens."""
        with self.device:
            self.stream.begin_capture()
            try:
                for launch in launches:
                    launch()
            finally:
                graph = self.stream.end_capture()
        return graph

    def launch(self, graph) -> None:
        with self.device:
            graph.launch(stream=self.stream)

    def allocate(self, cuda, shape, dtype):
        """A Numba view of a CuPy array from CuPy's pool (the view keeps the array alive)."""
        with self.device:
            return cuda.as_cuda_array(self.cupy.empty(shape, dtype=dtype))


class StepGraphs:
    """The device step's graphs, by the step's launch list (see the module docstring). `capture`: CupyCapture, or
    a stand-in with the same three methods (tests)."""

    def __init__(self, capture):
        self.api = capture
        self.graphs: dict = {}  # launch list -> graph
        self.seen: set = set()  # launch lists run once directly (their kernels compiled)
        self.direct = self.captured = self.replayed = 0  # steps, by how their launches ran
        self.failed = None  # why a capture failed, if one did: the steps run directly from then on
        self._held = None  # the step under way: [(fingerprints, launch)], or None (launches run at once)

    def begin(self) -> None:
        self._held = []

    def defer(self, op: str, args: tuple, launch) -> bool:
        """Hold a launch of the step under way (True), or say there is none (False: run it now)."""
        if self._held is None:
            return False
        self._held.append(((op, tuple(fingerprint(a) for a in args)), launch))
        return True

    def flush(self) -> None:
        """The host needs the device now (a read inside the step): run what is held, directly, and the rest of the
        step's launches as they come."""
        if self._held is not None:
            held, self._held = self._held, None
            for _, launch in held:
                launch()
            self.direct += 1

    def run(self) -> None:
        """The step's end: its launches as one graph (captured on the second sight of the list), or directly."""
        if self._held is None:
            return
        held, self._held = self._held, None
        key = tuple(k for k, _ in held)
        graph = self.graphs.get(key)
        if graph is None and key in self.seen and self.failed is None:
            try:
                graph = self.graphs[key] = self.api.capture([launch for _, launch in held])
                self.captured += 1
            except Exception as e:  # noqa: BLE001  (a driver that refuses a capture: run as without graphs)
                self.failed = f"{type(e).__name__}: {e}"
        elif graph is not None:
            self.replayed += 1
        if graph is None:
            for _, launch in held:
                launch()
            self.seen.add(key)
            self.direct += 1
            return
        self.api.launch(graph)
