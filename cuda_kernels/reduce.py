"""Block-wide reductions shared by the CUDA kernels: sum and max over the threads of one thread block.

What this is: three `cuda.jit(device=True)` functions, the classic shared-memory tree (llm.c dev/cuda
`layernorm_forward` version 2 style): each thread writes its partial value to shared memory, then half of the
threads add the other half's values, log2(threads) times, with a barrier after each step.
What this is not: the fastest reduction. A warp-shuffle reduction (`cuda.shfl_down_sync`) needs no shared memory
and no barrier inside a warp, but Numba's CUDA simulator does not implement warp shuffles, and every kernel here
must run under NUMBA_ENABLE_CUDASIM=1 in CI; the tree is portable and, for one warp or two per block, costs little
next to the memory traffic of the kernels that use it.

Contract (all three): every thread of the block calls the function (it contains barriers: a call from inside a
branch some threads skip deadlocks a real GPU), `blockDim.x` is a power of two, and `buf` is a shared float32 array
of at least blockDim.x entries (rows of at least blockDim.x entries for `block_sum_rows`), free for the duration of
the call. On return every thread holds the block-wide result and `buf` may be reused at once.
"""
from __future__ import annotations

import numpy as np
from numba import cuda


@cuda.jit(device=True)
def block_sum(buf, tid, value):
    """Sum of `value` over the block's threads (buf shared float32 [>= blockDim.x]) -> the total, in every thread."""
    buf[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            buf[tid] += buf[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = buf[0]
    cuda.syncthreads()  # everyone has read buf[0] before anyone reuses buf
    return total


@cuda.jit(device=True)
def block_max(buf, tid, value):
    """Maximum of `value` over the block's threads (buf shared float32 [>= blockDim.x]) -> in every thread."""
    buf[tid] = value
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            if buf[tid + stride] > buf[tid]:  # not max(): see quant_matvec.tile_size
                buf[tid] = buf[tid + stride]
        cuda.syncthreads()
        stride //= 2
    best = buf[0]
    cuda.syncthreads()
    return best


@cuda.jit(device=True)
def block_sum_rows(buf, tid, acc, n):
    """n sums at once: acc[j] (j < n, a per-thread local array) summed over the block, written back into acc.

    buf is shared float32 [>= n, >= blockDim.x]; the n tree reductions share their barriers.
    """
    for j in range(n):
        buf[j, tid] = acc[j]
    cuda.syncthreads()
    stride = cuda.blockDim.x // 2
    while stride > 0:
        if tid < stride:
            for j in range(n):
                buf[j, tid] += buf[j, tid + stride]
        cuda.syncthreads()
        stride //= 2
    for j in range(n):
        acc[j] = buf[j, 0]
    cuda.syncthreads()


NEG_INF = np.float32(-np.inf)  # the identity of max, the start value of a running maximum
