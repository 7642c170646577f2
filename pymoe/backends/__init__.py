"""Backends: where the arithmetic runs. `cpu` (NumPy + Numba kernels) and `cuda` (Numba CUDA kernels, CuPy to pin
the model file; backends/cuda.py).

A backend turns a stored weight into something it can multiply with (`dense`), and multiplies (`linear`,
`linear_raw`, `moe_experts`). The model code above it is identical for every backend.
"""
from .cpu import CPUBackend

BACKENDS = ("auto", "cpu", "cuda")


def get_backend(name: str = "auto", threads=None, reserve=None, **options):
    """`auto`: cuda when a CUDA GPU is present (not the simulator), else cpu. `reserve`: device bytes left free
    (cuda). `options`: the backend's own (CPUBackend: exact, act_bits; CUDABackend: kernels, free_bytes)."""
    from ..errors import PymoeError

    if name == "auto":
        from .cuda import cuda_available

        name = "cuda" if cuda_available() else "cpu"
    if name == "cpu":
        return CPUBackend(threads=threads, **options)  # exact, act_bits
    if name == "cuda":
        from .cuda import DEFAULT_RESERVE, CUDABackend

        return CUDABackend(threads=threads, reserve=DEFAULT_RESERVE if reserve is None else reserve, **options)
    raise PymoeError(f"unknown backend '{name}' (choose from {', '.join(BACKENDS)})")
