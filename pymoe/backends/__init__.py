"""Backends: where the arithmetic runs. `cpu` (NumPy + Numba kernels) today; `cuda` (CuPy + Numba CUDA) later.

A backend turns a stored weight into something it can multiply with (`dense`), and multiplies (`linear`,
`linear_raw`). The model code above it is identical for every backend.
"""
from .cpu import CPUBackend


def get_backend(name: str = "cpu", threads=None):
    from ..errors import PymoeError

    if name == "cpu":
        return CPUBackend(threads=threads)
    raise PymoeError(f"backend '{name}' is not available (available: cpu)")
