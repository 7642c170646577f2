"""The batched decode step's own kernels: RoPE and the KV write of B rows, row b at its own position, into its own
sequence's cache.

What this is: the two per-row operations a device step of the server's B slots needs beyond the kernels that take
T rows already (embedding, norms, products, routers, routed experts, argmax: step.py, norm_rope.py, quant_matvec.py)
and the ragged attention (ragged_attention.py):

  rope_rows(x, cos, sin, pos, neox)              x[b] rotated by table row pos[b]     (x float32 [B, Hh, Dh])
  kv_store_rows(k, v, k_all, v_all, seqs, rows)  k_all[seqs[b], rows[b]] = k[b], the same for v
                                                 (k_all: one layer's caches of every sequence, [S, S_max, G, Dh])

The per-row table (pos, seqs, rows: int32 [B] each) is device data that the step uploads in its one copy
(backends/cuda.py `begin_batch`), so a CUDA graph replays the launches for every position.
What this is not: the rest of the step (engine/device_batch.py drives it over backends/cuda.py's primitives).
The references: `rope_rows_reference` (reference.apply_rope of each row at its position) and
`kv_store_rows_reference` (the rows written in place); tests/test_cuda_batch_step.py holds each kernel to them.

Versions: 1 (these). rope_rows is norm_rope.rope_at_kernel with the position read per row (the same device function,
so row b's bits are the single step's); kv_store_rows is attention.kv_store_kernel with the cache row chosen per row.
Shape legend: B rows (sequences), Hh heads, Dh head size, G KV heads, Dv value head size, S caches, S_max positions.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

from .attention import THREADS as KV_THREADS
from .norm_rope import THREADS, _rope_token, rope_arrays
from .quant_matvec import check, on_device


@cuda.jit
def rope_rows_kernel(x, cos, sin, pos, neox):
    """x float32 [B, Hh, Dh] rotated in place, row b by row pos[b] of cos, sin float32 [P, n] (a row past the tables
    is left as it is: the host checks each position before it uploads it). grid (B,), block (THREADS,)."""
    b = cuda.blockIdx.x
    p = pos[b]
    if p >= 0 and p < cos.shape[0]:
        _rope_token(x, cos, sin, b, p, neox)


def rope_rows(x, cos, sin, pos, neox: bool, stream=0):
    """x float32 [B, Hh, Dh] (device), cos, sin float32 [P, rope_dim / 2], pos int32 [B] (device) -> x, rotated in
    place (row b at table row pos[b])."""
    x, cos, sin = rope_arrays("rope_rows", x, cos, sin)
    pos = on_device(pos, "pos")
    check(pos, "pos", np.int32, 1)
    B = x.shape[0]
    if pos.shape[0] != B:
        raise ValueError(f"rope_rows: pos has {pos.shape[0]} entries for {B} rows")
    if B:
        rope_rows_kernel[B, THREADS, stream](x, cos, sin, pos, bool(neox))
    return x


def rope_rows_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: np.ndarray, neox: bool) -> np.ndarray:
    """The NumPy twin: reference.apply_rope of row b at table row pos[b] -> float32 [B, Hh, Dh] (a new array)."""
    from pymoe.backends.reference import apply_rope

    pos = np.asarray(pos, np.int64)
    return apply_rope(x, cos[pos], sin[pos], neox).astype(np.float32)


@cuda.jit
def kv_store_rows_kernel(k, v, k_all, v_all, seqs, rows):
    """k float32 [B, G, Dh], v [B, G, Dv] -> k_all[seqs[b], rows[b]], v_all[seqs[b], rows[b]] (k_all [S, S_max, G,
    Dh], v_all [S, S_max, G, Dv], any strides); grid (B, G), block (KV_THREADS,)."""
    b = cuda.blockIdx.x
    g = cuda.blockIdx.y
    c = seqs[b]
    r = rows[b]
    if c >= 0 and c < k_all.shape[0] and r >= 0 and r < k_all.shape[1]:
        for d in range(cuda.threadIdx.x, k.shape[2], KV_THREADS):
            k_all[c, r, g, d] = k[b, g, d]
        for d in range(cuda.threadIdx.x, v.shape[2], KV_THREADS):
            v_all[c, r, g, d] = v[b, g, d]


def kv_store_rows(k, v, k_all, v_all, seqs, rows, stream=0):
    """k [B, G, Dh], v [B, G, Dv] (device) into k_all [S, S_max, G, Dh], v_all [S, S_max, G, Dv] (one layer's caches
    of every sequence: backends/cuda.py `kv_pool`[:, layer row]) at cache seqs[b], row rows[b] (int32 [B], device)."""
    k, v, ka, va = (on_device(a, n) for a, n in ((k, "k"), (v, "v"), (k_all, "k_all"), (v_all, "v_all")))
    seqs, rows = on_device(seqs, "seqs"), on_device(rows, "rows")
    check(seqs, "seqs", np.int32, 1)
    check(rows, "rows", np.int32, 1)
    for a, n in ((k, "k"), (v, "v")):
        check(a, n, np.float32, 3)
    for a, n in ((ka, "k_all"), (va, "v_all")):
        check(a, n, np.float32, 4)
    B = k.shape[0]
    if tuple(k.shape[1:]) != tuple(ka.shape[2:]) or tuple(v.shape[1:]) != tuple(va.shape[2:]) or v.shape[0] != B:
        raise ValueError(f"kv_store_rows: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit k_all {tuple(ka.shape)}, "
                         f"v_all {tuple(va.shape)}")
    if seqs.shape[0] != B or rows.shape[0] != B:
        raise ValueError(f"kv_store_rows: seqs {tuple(seqs.shape)} and rows {tuple(rows.shape)} need {B} entries")
    if B:
        kv_store_rows_kernel[(B, k.shape[1]), KV_THREADS, stream](k, v, ka, va, seqs, rows)
    return ka, va


def kv_store_rows_reference(k: np.ndarray, v: np.ndarray, k_all: np.ndarray, v_all: np.ndarray, seqs, rows) -> None:
    """The NumPy twin: the rows written in place."""
    for b, (c, r) in enumerate(zip(np.asarray(seqs).tolist(), np.asarray(rows).tolist())):
        k_all[c, r] = k[b]
        v_all[c, r] = v[b]
