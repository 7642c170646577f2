"""The PCIe probe: how fast misses can be served over PCIe and on the CPU, and the split between them (pcie_frac).

What this is: `probe(file, backend)` measures
  - host->device bandwidth: a pinned host buffer copied to the device, best of N (the spill path reads experts from
    pinned, mapped host memory over the same link, so this is its ceiling);
  - the CPU's expert rate: bytes of expert weights per second the CPU path computes (one token, the routed experts
    of a few layers of this model, as a "cpu" miss is computed), best of N;
and from the two, the share of decode misses to send over PCIe. Both paths read each missed expert's bytes once,
and they run at the same time, so a token's misses are done soonest when both finish together:
    f * B / pcie = (1 - f) * B / cpu    =>    pcie_frac f = pcie / (pcie + cpu)
e.g. 13.9 GB/s over PCIe and 22.7 GB/s on the CPU give 0.38 (the article's line). docs/expert-cache.md explains it.
With no GPU there is no PCIe link to measure and every miss is computed on the CPU: pcie_frac 0
(`NO_GPU_PCIE_FRAC`), which is also what the engine uses on the CPU backend when --pcie-frac is not given, so that
`pymoe probe` always prints the split `pymoe run` will use.
What this is not: a benchmark of the kernels (bench/), or a model of latency (each path also has a fixed cost per
expert, which matters for tiny experts; the measured rates on this model's own experts include it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

MiB = 2**20
NO_GPU_PCIE_FRAC = 0.0  # no GPU: no PCIe to read over, every miss computed on the CPU (probe and engine alike)


@dataclass(frozen=True)
class ProbeResult:
    pcie_gbs: Optional[list]  # host->device GB/s per repeat; None without a GPU
    cpu_gbs: float  # expert bytes per second on the CPU, best repeat, in GB/s
    threads: int

    @property
    def pcie_frac(self) -> float:
        if not self.pcie_gbs:
            return NO_GPU_PCIE_FRAC
        best = max(self.pcie_gbs)
        return best / (best + self.cpu_gbs)

    def line(self) -> str:
        if not self.pcie_gbs:
            return (f"PCIe probe: no CUDA GPU found (nothing to measure) -> pcie_frac {NO_GPU_PCIE_FRAC:g} (every miss "
                    "on the CPU)")
        samples = " ".join(f"{g:.1f}" for g in sorted(self.pcie_gbs))
        return (f"PCIe probe: {max(self.pcie_gbs):.1f} GB/s host->device (best of {samples}) -> pcie_frac "
                f"{self.pcie_frac:.2f}")

    def cpu_line(self) -> str:
        return f"CPU expert rate: {self.cpu_gbs:.1f} GB/s of expert weights ({self.threads} threads)"


def pcie_bandwidth(cuda, nbytes: int = 64 * MiB, repeats: int = 4) -> list:
    """GB/s of one host->device copy of a pinned buffer, per repeat (after one unmeasured warm-up copy)."""
    host = cuda.pinned_array(nbytes, dtype=np.uint8)
    host[:] = 1  # touch every page
    dev = cuda.device_array(nbytes, dtype=np.uint8)
    stream = cuda.stream()
    out = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        dev.copy_to_device(host, stream=stream)
        stream.synchronize()
        if i:
            out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    del dev
    dealloc = getattr(getattr(cuda.current_context(), "deallocations", None), "clear", None)
    if dealloc:  # Numba frees device memory lazily: free the probe's buffer before the slot pool is sized
        dealloc()
    return out


def device_bandwidth(cuda, nbytes: int = 512 * MiB, repeats: int = 4, copies: int = 4) -> list:
    """GB/s of device-to-device copies, bytes read + bytes written (as CUDA's bandwidthTest counts a copy), per
    repeat of `copies` back-to-back copies and one synchronisation (after one unmeasured warm-up repeat): near what
    a kernel streaming its weights from device memory can reach (bench/gpu_check.py sets it beside the decode's
    achieved GB/s). Timed on the host: the copies are long enough (4 x 512 MiB, ~1.3 ms at 3.3 TB/s) that the launch
    and synchronisation (tens of microseconds) move the figure by a few percent at most, downwards. In the
    simulator: NumPy copies' rate."""
    src = cuda.device_array(nbytes, dtype=np.uint8)
    dst = cuda.device_array(nbytes, dtype=np.uint8)
    stream = cuda.stream()
    out = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(copies):
            dst.copy_to_device(src, stream=stream)
        stream.synchronize()
        if i:
            out.append(2 * copies * nbytes / (time.perf_counter() - t0) / 1e9)
    del src, dst
    dealloc = getattr(getattr(cuda.current_context(), "deallocations", None), "clear", None)
    if dealloc:  # as pcie_bandwidth: free the buffers now
        dealloc()
    return out


def cpu_expert_rate(file, cpu_backend, repeats: int = 4, layers: int = 4) -> float:
    """GB/s of expert weights the CPU path computes: the first K experts of up to `layers` MoE layers (the first
    ones: glm4moe and deepseek2 lead with dense layers, which have none), one token."""
    from pymoe.backends.reference import swiglu_expert

    cfg = file.config
    x = np.random.default_rng(0).standard_normal((1, cfg.n_embd)).astype(np.float32)  # [1, D]
    chosen = [file.expert(i, e) for i in cfg.moe_layers[:layers] for e in range(cfg.n_expert_used)]
    types = [file.expert_types(ex.layer) for ex in chosen]
    nbytes = sum(ex.nbytes for ex in chosen)
    best = float("inf")
    for i in range(repeats + 1):  # the first run compiles / pages in: not measured
        t0 = time.perf_counter()
        for ex, ty in zip(chosen, types):
            swiglu_expert(cpu_backend, ex, ty, x)
        if i:
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def probe(file, backend, repeats: int = 4) -> ProbeResult:
    """Measure both rates for this model on this machine. `backend`: a CUDABackend (its CPU side computes the cpu
    misses), or a CPUBackend (no GPU: the PCIe half is left out)."""
    cpu = getattr(backend, "cpu", backend)
    pcie = pcie_bandwidth(backend.cuda, repeats=repeats) if backend.name == "cuda" else None
    return ProbeResult(pcie_gbs=pcie, cpu_gbs=cpu_expert_rate(file, cpu, repeats), threads=cpu.threads)
