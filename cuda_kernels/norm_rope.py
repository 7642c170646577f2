"""RMSNorm, rotary position embedding (RoPE, NEOX and normal pairing) and a bias add on the GPU.

What this is: `rmsnorm(X, w, eps)`, `rope(x, cos, sin, neox, p0)` and `add_bias(Y, b)`, each one small kernel plus
its host wrapper (rope's p0 an int, or int32 [1] in device memory that the kernel reads: a device step's position,
so that a CUDA graph replays the launch at every position, backends/cuda_graphs.py).
What this is not: the reference (pymoe.backends.reference.rmsnorm, pymoe.backends.reference.apply_rope, NumPy; tests compare), nor the
computation of the rotation angles: `rope` takes the cos/sin tables that pymoe.backends.reference.rope_tables builds (float64
angles rounded to float32, exactly the reference's values), typically once for the whole context, on the device.
Computing theta = pos * base^(-2i/d) in float32 on the device would be off by up to ~1e-3 rad at pos ~ 10^4.

  rmsnorm:  out[t] = X[t] / sqrt(mean(X[t]^2) + eps) * w          X, out float32 [T, n], w float32 [n]
  rope:     pairs (a, b) of every head of every token rotated by the angle of (token position, pair index i):
              NEOX   (qwen*, olmoe): a = x[i], b = x[i + n]          i < n = rope_dim / 2
              normal (llama, Mixtral): a = x[2i], b = x[2i + 1]
            a' = a cos - b sin, b' = b cos + a sin; dims past rope_dim untouched.
  add_bias: Y[t] += b                                                Y float32 [T, n], b float32 [n] (qwen2moe's
            q/k/v biases)

Versions (naive -> fast):
  rmsnorm 1 (this): one block of THREADS threads per token: strided sum of squares, shared-memory tree sum
    (reduce.py), then a strided scaled write. The row is read twice (it is small: n = D floats, cached).
  rope 1 (this): one block per token, one thread per (head, pair), in place. Memory-bound and trivially parallel;
    fusing it into the Q/K projection's epilogue is the next step (not done).

Test: NUMBA_ENABLE_CUDASIM=1 pytest -m cuda tests/test_cuda_kernels.py -k "rmsnorm or rope"
Shape legend: T tokens, n normalised width, Hh heads, Dh head size, P rows of the cos/sin tables (positions).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .quant_matvec import check, on_device
from .reduce import block_sum

THREADS = 128  # threads per block (a power of two: reduce.py); one block per token


@cuda.jit
def rmsnorm_kernel(X, w, eps, out):
    """X float32 [T, n], w float32 [n], eps float32 -> out float32 [T, n]; grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n = X.shape[1]
    ss = np.float32(0.0)
    for i in range(tid, n, THREADS):
        ss += X[t, i] * X[t, i]
    buf = cuda.shared.array(THREADS, np.float32)  # [THREADS]
    ss = block_sum(buf, tid, ss)
    denom = math.sqrt(ss / np.float32(n) + eps)
    for i in range(tid, n, THREADS):
        out[t, i] = X[t, i] / denom * w[i]


@cuda.jit(device=True)
def _rope_token(x, cos, sin, t, p, neox):
    """Token t of x float32 [T, Hh, Dh] rotated in place by row p of cos, sin float32 [P, n] (the block's part)."""
    n = cos.shape[1]
    for j in range(cuda.threadIdx.x, x.shape[1] * n, THREADS):  # j = (head, pair)
        h = j // n
        i = j - h * n
        if neox:
            ia, ib = i, i + n
        else:
            ia, ib = 2 * i, 2 * i + 1
        c, s = cos[p, i], sin[p, i]
        a, b = x[t, h, ia], x[t, h, ib]
        x[t, h, ia] = a * c - b * s
        x[t, h, ib] = b * c + a * s


@cuda.jit
def rope_kernel(x, cos, sin, p0, neox):
    """x float32 [T, Hh, Dh] rotated in place; cos, sin float32 [P, n]: token t uses row p0 + t.
    grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    _rope_token(x, cos, sin, t, p0 + t, neox)


@cuda.jit
def rope_at_kernel(x, cos, sin, at, neox):
    """rope_kernel with p0 = at[0], int32 in device memory (a device step's position: a CUDA graph replays the
    launch whatever the position); a row past the tables is left as it is (the host checks p0 before it uploads
    it). grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    p = at[0] + t
    if p >= 0 and p < cos.shape[0]:
        _rope_token(x, cos, sin, t, p, neox)


@cuda.jit
def add_bias_kernel(Y, b):
    """Y float32 [T, n] += b float32 [n]; grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    for i in range(cuda.threadIdx.x, Y.shape[1], THREADS):
        Y[t, i] += b[i]


def add_bias(Y, b, stream=0):
    """Y float32 [T, n] += b float32 [n], in place; returns Y."""
    Y, b = on_device(Y, "Y"), on_device(b, "b")
    check(Y, "Y", np.float32, 2)
    check(b, "b", np.float32, 1)
    if b.shape[0] != Y.shape[1]:
        raise ValueError(f"add_bias: b has {b.shape[0]} values for rows of {Y.shape[1]}")
    if Y.shape[0]:
        add_bias_kernel[Y.shape[0], THREADS, stream](Y, b)
    return Y


def rmsnorm(X, w, eps: float, out=None, stream=0):
    """X float32 [T, n] (or [n]) normalised over its last axis, times w float32 [n] -> out (new, or given; out may
    be X itself: each thread rewrites only the values it read, after the block's sum)."""
    X, w = on_device(X, "X"), on_device(w, "w")
    one_row = len(X.shape) == 1
    if one_row:
        X = X.reshape(1, X.shape[0])  # [1, n]
    check(X, "X", np.float32, 2)
    check(w, "w", np.float32, 1)
    T, n = X.shape
    if w.shape[0] != n:
        raise ValueError(f"rmsnorm: w has {w.shape[0]} values for rows of {n}")
    Y = cuda.device_array((T, n), np.float32, stream=stream) if out is None else on_device(out, "out")
    Y = Y.reshape(T, n)
    check(Y, "out", np.float32, 2)
    if T:
        rmsnorm_kernel[T, THREADS, stream](X, w, np.float32(eps), Y)
    return Y.reshape(n) if one_row else Y


def rope_arrays(op: str, x, cos, sin):
    """x float32 [T, Hh, Dh], cos, sin float32 [P, n] on the device, checked for the rotation `op` (rope here,
    batch_step.rope_rows): the tables of one shape, rotating at most Dh values -> (x, cos, sin) as device arrays."""
    x, cos, sin = on_device(x, "x"), on_device(cos, "cos"), on_device(sin, "sin")
    check(x, "x", np.float32, 3)
    check(cos, "cos", np.float32, 2)
    check(sin, "sin", np.float32, 2)
    Dh = x.shape[2]
    if tuple(cos.shape) != tuple(sin.shape) or 2 * cos.shape[1] > Dh:
        raise ValueError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must match and rotate at most "
                         f"head size {Dh}")
    return x, cos, sin


def rope(x, cos, sin, neox: bool, p0: int = 0, stream=0):
    """Rotate x float32 [T, Hh, Dh] in place (token t at table row p0 + t of cos, sin float32 [P, n]); returns x.
    p0: an int, or int32 [1] in device memory (read by the kernel: `rope_at_kernel`)."""
    x, cos, sin = rope_arrays("rope", x, cos, sin)
    T = x.shape[0]
    if not isinstance(p0, (int, np.integer)):  # int32 [1] on the device: rope_at_kernel
        check(on_device(p0, "p0"), "p0", np.int32, 1)
        if T:
            rope_at_kernel[T, THREADS, stream](x, cos, sin, p0, bool(neox))
        return x
    if p0 < 0 or p0 + T > cos.shape[0]:
        raise ValueError(f"rope: positions {p0}..{p0 + T - 1} outside the {cos.shape[0]} rows of the tables")
    if T:
        rope_kernel[T, THREADS, stream](x, cos, sin, p0, bool(neox))
    return x
