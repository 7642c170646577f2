"""Multi-head latent attention (engine/mla.py) on the device: the kernels of the MLA block (a decode step's token or a
prompt chunk's T rows, engine/mla.mla_device) that the generic ones (quant_matvec.matmul for the projections, norm_rope.rmsnorm for the q_a norm, attention.decode_attention
for the attention itself) do not cover.

What this is: three small kernels plus their host wrappers, taking and returning device arrays, and their NumPy twins
(`*_reference`, written with backends/reference.py's rmsnorm and apply_rope; tests/test_cuda_mla_kernels.py compares
each kernel with its twin):

  mla_kv_row(ckv, w, eps, cos, sin, p0, neox, cache, r0)
        cache[r0 + t, 0] = [rmsnorm(ckv[t, :C]) * w | rope_{p0 + t}(ckv[t, C:])]      the compressed cache row
        ckv float32 [T, C + R] (x @ attn_kv_a_mqa.T), w float32 [C] (attn_kv_a_norm), cache float32 [S, 1, C + R]
  mla_query(q, k_b, cos, sin, p0, neox, scale, Q)
        Q[t, h] = scale * [q[t, h, :N] @ k_b[h].T | rope_{p0 + t}(q[t, h, N:])]       the absorbed, roped query
        q float32 [T, H, N + R], k_b float32 [H, C, N] (attn_k_b), Q float32 [T, H, C + R]
  mla_value(a, v_b, out)
        out[t, h] = v_b[h] @ a[t, h]                                                    the value up-projection
        a float32 [T, H, C] (attention over the cache), v_b float32 [H, V, C] (attn_v_b), out float32 [T, H, V]

Between mla_query and mla_value, attention.decode_attention (one token) or attention.chunk_attention (T rows,
causal within the chunk) runs over the cache rows as one KV head: K = the whole
row [c | k_pe], V = its first C values (a view of the same device array, never a second copy), its scale
1 / sqrt(C + R) times the `scale` mla_query folded into Q (engine/mla.py: mla_scale(cfg) * sqrt(C + R)).
RoPE rows come from the cos/sin tables of the whole context (backends/reference.rope_tables with the file's scaling,
uploaded once), pairs as norm_rope.rope pairs them (normal: (2i, 2i + 1); NEOX: (i, i + R / 2)).

Versions: 1 (these). One block per token (mla_kv_row) or per (token, head) (mla_query, mla_value), the threads
strided over the outputs, each output a sequential dot product. k_b and v_b stay float32 (engine/mla.mla_weights
dequantizes them once), as on the host: reading them quantized (a per-head batched mat-vec) is the next step.
Shape legend: T tokens, H heads, C kv_lora_rank, R rope dims, N = key_length_mla - R, V value_length_mla.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from pymoe.backends.reference import apply_rope, rmsnorm

from .quant_matvec import check, on_device
from .reduce import block_sum

THREADS = 32  # threads per block (a power of two: reduce.py)


@cuda.jit(device=True)
def _rotate(src, dst, i, half, neox, c, s, scale):
    """Pair i of a rope part of `half` pairs, times scale: src, dst 1-D views of the part's R values."""
    if neox:
        ia, ib = i, i + half
    else:
        ia, ib = 2 * i, 2 * i + 1
    a = src[ia]
    b = src[ib]
    dst[ia] = (a * c - b * s) * scale
    dst[ib] = (b * c + a * s) * scale


# ----------------------------------------------------------------------------------------------------------------
# The compressed cache row
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _kv_row(ckv, w, eps, cos, sin, p0, neox, cache, r0, buf):
    """mla_kv_row_kernel's body (buf: the block's shared float32 [THREADS])."""
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    C = w.shape[0]
    half = (ckv.shape[1] - C) // 2
    acc = np.float32(0.0)
    for i in range(tid, C, THREADS):
        acc += ckv[t, i] * ckv[t, i]
    ss = block_sum(buf, tid, acc)
    inv = np.float32(1.0) / math.sqrt(ss / np.float32(C) + eps)
    row = cache[r0 + t, 0]
    for i in range(tid, C, THREADS):
        row[i] = ckv[t, i] * inv * w[i]
    for i in range(tid, half, THREADS):
        _rotate(ckv[t, C:], row[C:], i, half, neox, cos[p0 + t, i], sin[p0 + t, i], np.float32(1.0))


@cuda.jit
def mla_kv_row_kernel(ckv, w, eps, cos, sin, p0, neox, cache, r0):
    """ckv float32 [T, C + R] -> cache[r0 + t, 0] float32 [C + R]; grid (T,), block (THREADS,)."""
    buf = cuda.shared.array(THREADS, np.float32)
    _kv_row(ckv, w, eps, cos, sin, p0, neox, cache, r0, buf)


@cuda.jit
def mla_kv_row_at_kernel(ckv, w, eps, cos, sin, pos, neox, cache, row):
    """mla_kv_row_kernel with p0 = pos[0] and r0 = row[0], int32 in device memory (a device step's position and
    cache row: a CUDA graph replays the launch at every position); rows past the cache or the tables are not
    written (the host checks them before it uploads them)."""
    buf = cuda.shared.array(THREADS, np.float32)
    if row[0] + ckv.shape[0] <= cache.shape[0] and pos[0] + ckv.shape[0] <= cos.shape[0]:
        _kv_row(ckv, w, eps, cos, sin, pos[0], neox, cache, row[0], buf)


def mla_kv_row(ckv, w, eps: float, cos, sin, p0: int, neox: bool, cache, r0: int, stream=0):
    """Write T compressed rows at cache rows r0.. (positions p0.. for RoPE); returns cache. p0, r0: ints, or int32
    [1] each in device memory that the kernel reads (`mla_kv_row_at_kernel`)."""
    ckv, w, cos, sin, cache = (on_device(a, n) for a, n in ((ckv, "ckv"), (w, "w"), (cos, "cos"), (sin, "sin"),
                                                            (cache, "cache")))
    check(ckv, "ckv", np.float32, 2)
    check(cache, "cache", np.float32, 3)
    T, CR = ckv.shape
    R = CR - w.shape[0]
    if not isinstance(p0, (int, np.integer)):  # int32 [1] each on the device: mla_kv_row_at_kernel
        pos, row = on_device(p0, "p0"), on_device(r0, "r0")
        check(pos, "p0", np.int32, 1)
        check(row, "r0", np.int32, 1)
        if R <= 0 or R % 2 or tuple(cache.shape[1:]) != (1, CR) or cos.shape[1] != R // 2:
            raise ValueError(f"mla_kv_row: ckv {tuple(ckv.shape)}, w {tuple(w.shape)}, cache {tuple(cache.shape)}, "
                             f"cos {tuple(cos.shape)} do not fit (need cache [S, 1, C + R], cos [P, R / 2])")
        if T:
            mla_kv_row_at_kernel[(T,), THREADS, stream](ckv, w, np.float32(eps), cos, sin, pos, bool(neox), cache,
                                                        row)
        return cache
    if R <= 0 or R % 2 or tuple(cache.shape[1:]) != (1, CR) or r0 + T > cache.shape[0] or cos.shape[1] != R // 2 \
            or p0 + T > cos.shape[0]:
        raise ValueError(f"mla_kv_row: ckv {tuple(ckv.shape)}, w {tuple(w.shape)}, cache {tuple(cache.shape)} at "
                         f"row {r0}, cos {tuple(cos.shape)} at {p0} do not fit (need cache [S, 1, C + R], "
                         f"cos [P, R / 2])")
    if T:
        mla_kv_row_kernel[(T,), THREADS, stream](ckv, w, np.float32(eps), cos, sin, p0, bool(neox), cache, r0)
    return cache


def mla_kv_row_reference(ckv: np.ndarray, w: np.ndarray, eps: float, cos: np.ndarray, sin: np.ndarray,
                         neox: bool) -> np.ndarray:
    """NumPy twin (engine/mla.mla_block's c and k_pe): ckv [T, C + R], cos/sin [T, R / 2] -> rows [T, C + R]."""
    C = w.shape[0]
    c = rmsnorm(ckv[:, :C], w, eps)  # [T, C]
    k_pe = apply_rope(np.ascontiguousarray(ckv[:, None, C:]), cos, sin, neox)[:, 0]  # [T, R]
    return np.concatenate([c, k_pe], axis=-1).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# The absorbed query
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _query(q, k_b, cos, sin, p0, neox, scale, Q):
    """mla_query_kernel's body."""
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    C, N = k_b.shape[1], k_b.shape[2]
    half = (q.shape[2] - N) // 2
    for c in range(tid, C, THREADS):
        acc = np.float32(0.0)
        for n in range(N):
            acc += q[t, h, n] * k_b[h, c, n]
        Q[t, h, c] = acc * scale
    for i in range(tid, half, THREADS):
        _rotate(q[t, h, N:], Q[t, h, C:], i, half, neox, cos[p0 + t, i], sin[p0 + t, i], scale)


@cuda.jit
def mla_query_kernel(q, k_b, cos, sin, p0, neox, scale, Q):
    """q float32 [T, H, N + R], k_b float32 [H, C, N] -> Q float32 [T, H, C + R]; grid (T, H), block (THREADS,)."""
    _query(q, k_b, cos, sin, p0, neox, scale, Q)


@cuda.jit
def mla_query_at_kernel(q, k_b, cos, sin, pos, neox, scale, Q):
    """mla_query_kernel with p0 = pos[0], int32 in device memory (a device step's: a CUDA graph replays the launch
    at every position); positions past the tables are not written (the host checks them before the upload)."""
    if pos[0] + q.shape[0] <= cos.shape[0]:
        _query(q, k_b, cos, sin, pos[0], neox, scale, Q)


def mla_query(q, k_b, cos, sin, p0: int, neox: bool, scale: float, Q, stream=0):
    """The absorbed, roped, scaled queries of T tokens at positions p0.. (see the module docstring); returns Q. p0:
    an int, or int32 [1] in device memory that the kernel reads (`mla_query_at_kernel`)."""
    q, k_b, cos, sin, Q = (on_device(a, n) for a, n in ((q, "q"), (k_b, "k_b"), (cos, "cos"), (sin, "sin"),
                                                        (Q, "Q")))
    check(q, "q", np.float32, 3)
    check(k_b, "k_b", np.float32, 3)
    check(Q, "Q", np.float32, 3)
    T, H, NR = q.shape
    _, C, N = k_b.shape
    R = NR - N
    at = None
    if not isinstance(p0, (int, np.integer)):  # int32 [1] on the device: mla_query_at_kernel
        at = on_device(p0, "p0")
        check(at, "p0", np.int32, 1)
        p0 = 0  # (the checks below: the shapes only)
    if k_b.shape[0] != H or R <= 0 or R % 2 or tuple(Q.shape) != (T, H, C + R) or cos.shape[1] != R // 2 \
            or p0 + T > cos.shape[0]:
        raise ValueError(f"mla_query: q {tuple(q.shape)}, k_b {tuple(k_b.shape)}, Q {tuple(Q.shape)}, cos "
                         f"{tuple(cos.shape)} at {p0} do not fit (need k_b [H, C, N], Q [T, H, C + R])")
    if T and at is not None:
        mla_query_at_kernel[(T, H), THREADS, stream](q, k_b, cos, sin, at, bool(neox), np.float32(scale), Q)
    elif T:
        mla_query_kernel[(T, H), THREADS, stream](q, k_b, cos, sin, p0, bool(neox), np.float32(scale), Q)
    return Q


def mla_query_reference(q: np.ndarray, k_b: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool,
                        scale: float) -> np.ndarray:
    """NumPy twin (engine/mla.mla_core's Q): q [T, H, N + R], cos/sin [T, R / 2] -> [T, H, C + R]."""
    N = k_b.shape[2]
    q_pe = apply_rope(np.ascontiguousarray(q[..., N:]), cos, sin, neox)  # [T, H, R]
    q_abs = np.einsum("thn,hcn->thc", q[..., :N], k_b).astype(np.float32)  # [T, H, C]
    return (np.concatenate([q_abs, q_pe], axis=-1) * np.float32(scale)).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# The value up-projection
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit
def mla_value_kernel(a, v_b, out):
    """a float32 [T, H, C], v_b float32 [H, V, C] -> out float32 [T, H, V]; grid (T, H), block (THREADS,)."""
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    C = v_b.shape[2]
    for v in range(cuda.threadIdx.x, v_b.shape[1], THREADS):
        acc = np.float32(0.0)
        for c in range(C):
            acc += a[t, h, c] * v_b[h, v, c]
        out[t, h, v] = acc


def mla_value(a, v_b, out, stream=0):
    """out[t, h] = v_b[h] @ a[t, h]; returns out."""
    a, v_b, out = on_device(a, "a"), on_device(v_b, "v_b"), on_device(out, "out")
    check(a, "a", np.float32, 3)
    check(v_b, "v_b", np.float32, 3)
    check(out, "out", np.float32, 3)
    T, H, C = a.shape
    if tuple(v_b.shape[::2]) != (H, C) or tuple(out.shape) != (T, H, v_b.shape[1]):
        raise ValueError(f"mla_value: a {tuple(a.shape)}, v_b {tuple(v_b.shape)}, out {tuple(out.shape)} do not fit "
                         f"(need v_b [H, V, C], out [T, H, V])")
    if T:
        mla_value_kernel[(T, H), THREADS, stream](a, v_b, out)
    return out


def mla_value_reference(a: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """NumPy twin (engine/mla.mla_core's last product): a [T, H, C] -> [T, H, V]."""
    return np.einsum("thc,hvc->thv", a, v_b).astype(np.float32)


__all__ = ["mla_kv_row", "mla_query", "mla_value", "mla_kv_row_reference", "mla_query_reference",
           "mla_value_reference"]
