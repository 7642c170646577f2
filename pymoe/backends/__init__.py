"""Backends: where the arithmetic runs, behind one contract (protocol.py): `reference` (plain NumPy, the readable
twin), `cpu` (Numba kernels, integer activations) and `cuda` (Numba CUDA kernels, CuPy to pin the model file).
`multi_device` runs the cuda backend on several devices (`--devices`), a range of layers each.
The model code above them (engine/) is identical for every backend.
"""
from .cpu import CPUBackend
from .reference import ReferenceBackend

BACKENDS = ("auto", "cpu", "cuda", "reference")


def get_backend(name: str = "auto", threads=None, reserve=None, **options):
    """`auto`: cuda when a CUDA GPU is present (not the simulator), else cpu. `reserve`: device bytes left free
    (cuda). `options`: the backend's own (CPUBackend: act_bits; CUDABackend: kernels, free_bytes)."""
    from pymoe.errors import PymoeError

    if name == "auto":
        from .cuda import cuda_available

        name = "cuda" if cuda_available() else "cpu"
    if name == "cpu":
        return CPUBackend(threads=threads, **options)  # act_bits
    if "act_bits" in options:
        raise PymoeError(f"--act-bits sets the CPU backend's integer path; the {name} backend has none "
                         "(use --backend cpu)")
    if name == "reference":
        return ReferenceBackend(threads=threads)
    if name == "cuda":
        from .cuda import DEFAULT_RESERVE, CUDABackend

        return CUDABackend(threads=threads, reserve=DEFAULT_RESERVE if reserve is None else reserve, **options)
    raise PymoeError(f"unknown backend '{name}' (choose from {', '.join(BACKENDS)})")
