"""Qwen3-Next's gated full attention on the device: the two kernels it adds to softmax attention (engine/attention.py
`gqa_block`, attention kind "gated"); the q/k norms, partial RoPE, the KV cache and attention are norm_rope.py's and
attention.py's.

What this is: two kernels plus their host wrappers, taking device arrays:

  split_gate(qg, q, gate)   attn_q's product holds, per head, the query then the output gate: qg float32 [T, H 2 Dh]
                            -> q [T, H Dh] = qg[:, :, 0], gate [T, H Dh] = qg[:, :, 1] (qg viewed as [T, H, 2, Dh])
  gate_output(out, gate)    out *= sigmoid(gate)    out, gate float32 [T, n]   (before attn_output)

The references (tests/test_cuda_deltanet_kernels.py): `split_gate_reference`, `gate_output_reference` (NumPy, the
host block's own lines). What this is not: a fused attention; each kernel is one pass over a few KiB.
Version 1: grid (T,), THREADS threads striding over the row.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .quant_matvec import THREADS, check, on_device


@cuda.jit
def split_gate_kernel(qg, q, gate, Dh):
    t = cuda.blockIdx.x
    for j in range(cuda.threadIdx.x, q.shape[1], THREADS):  # j = head * Dh + i
        h = j // Dh
        i = j - h * Dh
        q[t, j] = qg[t, 2 * h * Dh + i]
        gate[t, j] = qg[t, 2 * h * Dh + Dh + i]


def split_gate(qg, q, gate, Dh: int, stream=0):
    """qg float32 [T, H 2 Dh] -> q, gate float32 [T, H Dh] (written); returns (q, gate)."""
    qg, q, gate = on_device(qg, "qg"), on_device(q, "q"), on_device(gate, "gate")
    for a, n in ((qg, "qg"), (q, "q"), (gate, "gate")):
        check(a, n, np.float32, 2)
    T, n = q.shape
    if Dh <= 0 or n % Dh or tuple(gate.shape) != (T, n) or tuple(qg.shape) != (T, 2 * n):
        raise ValueError(f"split_gate: qg {tuple(qg.shape)}, q {tuple(q.shape)}, gate {tuple(gate.shape)} must be "
                         f"[T, 2 n], [T, n], [T, n] with n a multiple of Dh = {Dh}")
    if T:
        split_gate_kernel[(T,), THREADS, stream](qg, q, gate, Dh)
    return q, gate


def split_gate_reference(qg: np.ndarray, Dh: int) -> tuple:
    T = qg.shape[0]
    H = qg.shape[1] // (2 * Dh)
    q4 = qg.reshape(T, H, 2, Dh)
    return np.ascontiguousarray(q4[:, :, 0].reshape(T, H * Dh)), np.ascontiguousarray(q4[:, :, 1].reshape(T, H * Dh))


@cuda.jit
def gate_output_kernel(out, gate):
    t = cuda.blockIdx.x
    for j in range(cuda.threadIdx.x, out.shape[1], THREADS):
        out[t, j] = out[t, j] * (np.float32(1.0) / (np.float32(1.0) + math.exp(-gate[t, j])))


def gate_output(out, gate, stream=0):
    """out float32 [T, n] *= sigmoid(gate float32 [T, n]), in place; returns out."""
    out, gate = on_device(out, "out"), on_device(gate, "gate")
    check(out, "out", np.float32, 2)
    if tuple(gate.shape) != tuple(out.shape):
        raise ValueError(f"gate_output: out {tuple(out.shape)} and gate {tuple(gate.shape)} must match")
    if out.shape[0]:
        gate_output_kernel[(out.shape[0],), THREADS, stream](out, gate)
    return out


def gate_output_reference(out: np.ndarray, gate: np.ndarray) -> np.ndarray:
    from pymoe.backends.reference import sigmoid

    return (out * sigmoid(gate)).astype(np.float32)
