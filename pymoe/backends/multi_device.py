"""Several devices in one box: the CUDA backend split by contiguous layer ranges, one slot pool per device.

What this is:
  - `device_ranges(n_layers, usable, split)`: the layer ranges, one per device: experts/multi.split_layers (handed
    in by api.py) over the devices' usable bytes, the rule `pymoe plan --devices` plans with
    (experts/multi.plan_devices), so that the planner and the engine put the same layers on the same card.
  - `MultiDeviceBackend`: one backends/cuda.CUDABackend per device. `for_layer(i)` is the backend layer i runs on
    (engine/model.Model.backend_for): its `DeviceShard`, which holds that layer's dense weights, its KV rows and its
    experts' slot pool. Everything else (the output head, the host-side norms) is the last device's, as in
    llama.cpp's layer split (`--split-mode layer`). The model file is pinned and mapped once (a portable
    registration: cuda.HostMapping) and shared by every device.
  - `MultiKV`: one sequence's KV cache: a cuda.DeviceKVCache per device, each holding its layers' rows.
  The expert cache over the devices, one SlotCache each, is experts/device_caches.DeviceCaches.
  - `MultiCounts`: the devices' backends/device_counts.DeviceCounts, summed (`snapshot`) and per device.

Why one pool per device, not one global pool by measured heat: a slot holds an expert of a layer its device runs; an
expert of a layer of device 0 held in device 1's memory would be read across the inter-device link at every use,
which is a miss path (PCIe), not a hit. Within a device the pool is global over its layers (hot layers take more
slots), as the one-device pool is; this is the pool `pymoe simulate --devices` replays (experts/multi.py), so the
engine's per-device counts equal the simulator's on the same trace (tests/test_multi_device.py).

The residual stream: the CUDA backend keeps it on the host between blocks (each block's input goes to its device
and the block's output comes back), so a range boundary adds no copy of it: device d + 1 reads the residual from the
host as device d did. What a boundary does add is counted per device: the RoPE tables each device uploads once per
forward call. The planner's hop term (n_embd x 4 bytes over PCIe + latency per boundary) is what a device-resident
residual stream will pay.

Without a GPU: Numba's CUDA simulator has one device (`cuda.select_device(1)` raises "Only a single device supported
by the simulator"), so the simulated devices are several CUDABackend instances in its one context, each with its own
memory budget (PYMOE_SIM_DEVICE_GIB: one size for all, or one per device, comma-separated) and its own counters. On
GPUs, each device's calls run in that device's context (`cuda.gpus[i]`).
What this is not: tensor parallelism (a layer split across devices), or expert parallelism across machines
(experts/scale.py, experts/placement.py).
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import numpy as np

from pymoe.errors import PymoeError
from .device_counts import DeviceCounts, _empty
from .protocol import HostRecurrent
from .cuda import DEFAULT_RESERVE, CUDABackend, DeviceKVCache, simulated, simulated_device_gib


def parse_device_ids(text: str) -> list[int]:
    """`--devices 0,1` -> [0, 1] (CUDA device indices, each once); `--devices 2` -> [0, 1] (the first N)."""
    t = str(text).strip()
    try:
        ids = [int(v) for v in t.split(",")] if "," in t else list(range(int(t)))
    except ValueError:
        raise PymoeError(f"--devices {text!r}: give device indices (0,1) or a count (2)") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise PymoeError(f"--devices {text!r}: give distinct device indices >= 0, at least one")
    return ids


def simulated_device_sizes(n: int) -> list[float]:
    """The simulated devices' sizes in GiB: PYMOE_SIM_DEVICE_GIB, one number for all (cuda.simulated_device_gib,
    default 8) or one per device (`8,4`)."""
    raw = os.environ.get("PYMOE_SIM_DEVICE_GIB", "")
    if "," not in raw:
        return [simulated_device_gib()] * n
    try:
        sizes = [float(part) for part in raw.split(",")]
    except ValueError:
        sizes = [-1.0]
    if not all(g > 0 and math.isfinite(g) for g in sizes):
        raise PymoeError(f"PYMOE_SIM_DEVICE_GIB must be positive numbers of GiB, got {raw!r}")
    if len(sizes) != n:
        raise PymoeError(f"PYMOE_SIM_DEVICE_GIB gives {len(sizes)} sizes for {n} devices")
    return sizes


def device_ranges(n_layers: int, usable: list, split) -> list[range]:
    """Contiguous layer ranges in device order, sized by usable bytes: split(n_layers, weights) -> [(lo, hi)], the
    planner's split (experts/multi.split_layers, handed in by api.py: the backends import nothing of experts/)."""
    if len(usable) > n_layers:
        raise PymoeError(f"--devices: {len(usable)} devices for {n_layers} layers: at most one device per layer")
    return [range(lo, hi) for lo, hi in split(n_layers, [max(u, 1e-9) for u in usable])]


@contextlib.contextmanager
def named(device: str):
    """A one-line error raised on one device of several says which one (`cuda:1: device memory budget ...`)."""
    try:
        yield
    except PymoeError as e:
        if str(e).startswith("cuda:"):
            raise
        raise PymoeError(f"{device}: {e}") from None


class MultiCounts:
    """The devices' DeviceCounts: `forward` reaches every device; `snapshot` is their sum (what one device's
    counts would read); `per_device(phase)` each one's."""

    def __init__(self, parts: list):
        self.parts = parts

    def forward(self, phase: str, n_tokens: int) -> None:
        for c in self.parts:
            c.forward(phase, n_tokens)

    def snapshot(self, phase: str) -> dict:
        out = _empty()
        for c in self.parts:
            s = c.snapshot(phase)
            for k in ("launches", "synchronisations"):
                out[k] += s[k]
            for w, n in s["bytes"].items():
                out["bytes"][w] = out["bytes"].get(w, 0) + n
        first = self.parts[0].snapshot(phase)  # every device sees every forward call
        out["forwards"], out["tokens"] = first["forwards"], first["tokens"]
        return out

    def per_device(self, phase: str) -> list[dict]:
        return [c.snapshot(phase) for c in self.parts]


class MultiKV(HostRecurrent):
    """One sequence's KV cache over several devices: parts[d] a DeviceKVCache with device d's layers' rows. The
    engine advances `n` (engine/model.py); the shards hand each layer its device's part (DeviceShard.kv_write).
    Gated DeltaNet's state (qwen3next, qwen35moe) stays on the host here (`HostRecurrent`: several devices run
    version 2 only)."""

    def __init__(self, parts: list, n_ctx: int):
        self.parts, self.n_ctx, self.n = parts, n_ctx, 0

    def clear(self) -> None:
        self.n = 0
        self.__dict__.pop("_recurrent", None)



class DeviceShard:
    """Device d's CUDABackend, as the layers of its range see it: every primitive is the backend's, run in the
    device's context, with a MultiKV cache narrowed to the device's part."""

    def __init__(self, backend: CUDABackend, d: int, context, name: str):
        self.inner, self.d, self._context, self.name_of = backend, d, context, name

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr) or name == "cuda":
            return attr
        context = self._context

        def in_context(*args, **kwargs):
            with context(), named(self.name_of):
                return attr(*args, **kwargs)
        return in_context

    def _part(self, kv):
        return kv.parts[self.d] if isinstance(kv, MultiKV) else kv

    def kv_write(self, kv, layer: int, p0: int, k, v) -> None:
        with self._context():
            self.inner.kv_write(self._part(kv), layer, p0, k, v)

    def kv_read(self, kv, layer: int, S: int) -> tuple:
        with self._context():
            return self.inner.kv_read(self._part(kv), layer, S)


class MultiDeviceBackend:
    """backends/protocol.py's contract over several devices (module docstring): `for_layer(i)` gives layer i's
    device; the primitives the model calls outside the layers (the output head, the final norm) are the last
    device's."""

    name = "cuda"
    # The decode step on the device (version 3, backends/cuda.py `begin_step`) keeps a token on one device from id to
    # id; with several devices the residual stream goes through the host between ranges (version 2): never forward
    # the question to the last device (__getattr__ would, and the step would run every layer there)
    device_step = False

    def __init__(self, ids: list[int], threads: Optional[int] = None, reserve: int = DEFAULT_RESERVE,
                 free_bytes=None, split=None, **options):
        """ids: CUDA device indices (in the simulator: names of the simulated devices, all in its one context);
        split: the planner's layer split (`device_ranges`; needed by `attach`);
        free_bytes: None (each device's free memory; the simulator: PYMOE_SIM_DEVICE_GIB), one number for every
        device, or one per device (tests)."""
        from .cuda import cuda_module

        self.cuda = cuda = cuda_module()
        self.ids = list(ids)
        n = len(self.ids)
        if not simulated():
            if max(self.ids) >= len(cuda.gpus):
                raise PymoeError(f"--devices {','.join(map(str, self.ids))}: this machine has {len(cuda.gpus)} "
                                 "CUDA device(s)")
        self.note = None
        if free_bytes is None and simulated():
            sizes = simulated_device_sizes(n)
            free_bytes = [int(g * 2**30) for g in sizes]
            self.note = ("simulated devices: " + ", ".join(f"cuda:{i} {g:g} GiB" for i, g in zip(self.ids, sizes))
                         + " (NUMBA_ENABLE_CUDASIM=1: one CUDABackend per device in the simulator's one context; "
                         "times are not a GPU's)")
        if free_bytes is not None and np.ndim(free_bytes) == 0:
            free_bytes = [free_bytes] * n
        if free_bytes is not None and len(free_bytes) != n:
            raise PymoeError(f"{len(free_bytes)} device sizes for {n} devices")
        self.devices: list[CUDABackend] = []
        for d, i in enumerate(self.ids):
            with self.context(d)():
                self.devices.append(CUDABackend(threads=threads, reserve=reserve,
                                                free_bytes=None if free_bytes is None else free_bytes[d], **options))
        self.shards = [DeviceShard(b, d, self.context(d), f"cuda:{i}") for d, (i, b) in
                       enumerate(zip(self.ids, self.devices))]
        self.last = self.shards[-1]
        self.cpu = self.devices[0].cpu
        self.host_backend = self.cpu
        self.threads = self.cpu.threads
        self.reserve = int(reserve)
        self.counts = MultiCounts([b.counts for b in self.devices])
        self.ranges: list[range] = []
        self.split = split
        self._layer_device: list[int] = []

    def context(self, d: int):
        """The device context of device d (on GPUs: cuda.gpus[id]; the simulator's one context: nothing to do)."""
        if simulated():
            return contextlib.nullcontext
        return lambda: self.cuda.gpus[self.ids[d]]

    def __getattr__(self, name):  # anything else (linear of the output head, rope, route...): the last device's
        if name in ("devices", "shards", "last"):
            raise AttributeError(name)
        return getattr(self.last, name)

    # --- set-up -------------------------------------------------------------------------------------------------
    def attach(self, file) -> None:
        """Pin and map the model file once (portable: every device reads it), then split the layers by the devices'
        usable bytes (free - reserve), as the planner does."""
        host = None
        for d, b in enumerate(self.devices):
            with self.context(d)():
                b.attach(file, host)
            host = b.host
        self.ranges = device_ranges(file.config.n_layers, [b.mem.limit for b in self.devices], self.split)
        self._layer_device = [d for d, r in enumerate(self.ranges) for _ in r]
        for b, r in zip(self.devices, self.ranges):
            b.layers = r

    def device_of(self, layer: int) -> int:
        """The device running `layer` (an MTP block, past the trunk's layers: the last device, beside the head)."""
        return self._layer_device[layer] if layer < len(self._layer_device) else len(self.devices) - 1

    def for_layer(self, i: int) -> DeviceShard:
        return self.shards[self.device_of(i)]

    def prepare(self, chunk: int, n_ctx: int, device_kv: bool = True, sequences: int = 1, keep_free: int = 0,
                speculation: bool = False) -> None:
        """Each device's buffers and KV caches (CUDABackend.prepare; each keeps `keep_free` bytes for its pool, and
        with `speculation` a snapshot of its layers' recurrent state)."""
        self.chunk, self.n_ctx = int(chunk), int(n_ctx)
        for d, (i, b) in enumerate(zip(self.ids, self.devices)):
            with self.context(d)(), named(f"cuda:{i}"):
                b.prepare(chunk, n_ctx, device_kv, sequences, keep_free, speculation)

    def memory_line(self) -> str:
        return "\n".join(f"cuda:{i} layers {r.start}-{r.stop - 1}: {b.memory_line()}"
                         for i, r, b in zip(self.ids, self.ranges, self.devices))

    def new_kv(self, n_ctx: int):
        """A MultiKV of every device's KV cache, or None when one of them is lent already (a host KV cache then)."""
        parts = []
        for s in self.shards:
            kv = s.inner.new_kv(n_ctx)
            if kv is None:
                return None  # (the parts taken are released with this list)
            parts.append(kv)
        return MultiKV(parts, n_ctx)

    def share_cpu(self) -> None:
        self.cpu.share_cpu()
        self.threads = self.cpu.threads
        for b in self.devices:
            b.threads = self.threads

    def warm_up(self, qtypes, progress: bool = False) -> None:
        qtypes = list(qtypes)
        for s in self.shards:
            s.warm_up(qtypes, progress)

    def warm_up_experts(self, expert_types: dict) -> None:
        for s in self.shards:
            s.warm_up_experts(expert_types)

    def free_for_cache(self) -> list[int]:
        return [s.free_for_cache() for s in self.shards]

    def close(self) -> None:
        self.devices[0].close()  # the one mapping all of them share
