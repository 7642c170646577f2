"""A device function for tests/test_simulator.py that must live in a module of its own (not the kernel's): while it
runs, the simulator points this module's `cuda` at its fake module."""
from numba import cuda


@cuda.jit(device=True)
def mirrored(buf, tid):
    """buf[tid] = tid; a barrier; then the value of the mirror thread, read through `cuda` after the barrier."""
    buf[tid] = tid
    cuda.syncthreads()
    return buf[cuda.blockDim.x - 1 - cuda.threadIdx.x]
