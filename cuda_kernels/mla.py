"""Multi-head latent attention (engine/mla.py) on the device: the kernels of the MLA block (a decode step's token or a
prompt chunk's T rows, engine/mla.mla_device) that the generic ones (quant_matvec.matmul for the projections,
norm_rope.rmsnorm for the q_a norm, attention.decode_attention and chunk_attention for the attention itself) do not
cover.

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
  mla_query_q(q, k_b, qtype, ...), mla_value_q(a, v_b, qtype, out)
        the same, k_b and v_b as the file's rows of `qtype` (uint8 [H * C, S], [H * V, S]): "Versions" below

Between mla_query and mla_value, attention.decode_attention (one token) or attention.chunk_attention (T rows,
causal within the chunk) runs over the cache rows as one KV head: K = the whole row [c | k_pe], V = its first C
values (a view of the same device array, never a second copy), its scale 1 / sqrt(C + R) times the `scale` mla_query
folded into Q (engine/mla.py: mla_scale(cfg) * sqrt(C + R)). RoPE rows come from the cos/sin tables of the whole
context in a decode step (backends/reference.rope_tables with the file's scaling, uploaded once), of the forward's
positions in a prompt chunk (uploaded once per forward), pairs as norm_rope.rope pairs them (normal: (2i, 2i + 1);
NEOX: (i, i + R / 2)).

Versions: 1 (mla_kv_row, mla_query, mla_value): one block per token (mla_kv_row) or per (token, head) (mla_query,
mla_value), the threads strided over the outputs, each output a sequential dot product; k_b and v_b float32
[H, C, N], [H, V, C]. 2 (mla_query_q, mla_value_q: what the CUDA backend runs): the same blocks, k_b and v_b read in
their stored type, any quant_matvec format (F32 included), as the file's rows [H * C, S] and [H * V, S] (head h's
rows h C .. h C + C - 1); each thread decodes and dots whole rows (quant_matvec.row_partial, its version 1 walk:
simple, uncoalesced). The device then holds the stored bytes, not float32 copies: for DeepSeek-V3 (H 128, C 512,
N = V = 128: 2 x 8,388,608 weights per layer) 2 x 8.5 MiB per layer in Q8_0, 2 x 16 MiB in F16, against 2 x 32 MiB
as float32 (61 layers: 1.0 GiB in Q8_0 against 3.8 GiB). Twins: mla_query_q_reference, mla_value_q_reference (the
version 1 twins on pymoe.quant.dequantize's floats).
Shape legend: T tokens, H heads, C kv_lora_rank, R rope dims, N = key_length_mla - R, V value_length_mla.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from pymoe.backends.reference import apply_rope, rmsnorm

from pymoe.quant import QType

from .quant_matvec import check, on_device, retarget, row_partial_for, weight_cols
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


# ----------------------------------------------------------------------------------------------------------------
# Version 2: k_b and v_b read in their stored type (any quant_matvec format, F32 included)
# ----------------------------------------------------------------------------------------------------------------
ROW_PARTIAL = QUERY_Q = None  # bound per format by `_for`: quant_matvec.row_partial of the weights' format, and
# _query_q compiled with it (a device function: the simulator runs only device functions' bodies on its threads)
_COMPILED: dict = {}


def _for(template, qtype):
    """`template` compiled for one format: a device function (_query_q) or a kernel (the others)."""
    key = (template.__name__, QType(qtype))
    if key not in _COMPILED:
        name = f"{template.__name__}_{QType(qtype).name}"
        if template is _query_q:
            _COMPILED[key] = retarget(template, cuda.jit(device=True), name, ROW_PARTIAL=row_partial_for(qtype))
        else:
            _COMPILED[key] = retarget(template, cuda.jit, name, ROW_PARTIAL=row_partial_for(qtype),
                                      QUERY_Q=_for(_query_q, qtype))
    return _COMPILED[key]


def _query_q(q, kb, cos, sin, p0, neox, scale, Q):
    """mla_query_q's body (a template: ROW_PARTIAL bound per format). kb uint8 [H * C, S]: head h's rows h C ..
    h C + C - 1, each N weights; thread i walks whole rows c = i, i + THREADS, ... (quant_matvec's version 1 walk:
    one row's decode per thread)."""
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    C = kb.shape[0] // q.shape[1]
    R = Q.shape[2] - C
    N = q.shape[2] - R
    half = R // 2
    acc = cuda.local.array(1, np.float32)
    qh = q[:, h]  # [T, N + R]: the row partial reads its first N columns
    for c in range(tid, C, THREADS):
        acc[0] = np.float32(0.0)
        ROW_PARTIAL(kb[h * C + c], qh, t, 1, 0, 1, acc)
        Q[t, h, c] = acc[0] * scale
    for i in range(tid, half, THREADS):
        _rotate(q[t, h, N:], Q[t, h, C:], i, half, neox, cos[p0 + t, i], sin[p0 + t, i], scale)


def mla_query_q_kernel(q, kb, cos, sin, p0, neox, scale, Q):
    """q float32 [T, H, N + R], kb uint8 [H * C, S] -> Q float32 [T, H, C + R]; grid (T, H), block (THREADS,)."""
    QUERY_Q(q, kb, cos, sin, p0, neox, scale, Q)


def mla_query_q_at_kernel(q, kb, cos, sin, pos, neox, scale, Q):
    """mla_query_q_kernel with p0 = pos[0] in device memory (as mla_query_at_kernel)."""
    if pos[0] + q.shape[0] <= cos.shape[0]:
        QUERY_Q(q, kb, cos, sin, pos[0], neox, scale, Q)


def mla_value_q_kernel(a, vb, out):
    """a float32 [T, H, C], vb uint8 [H * V, S] (head h's rows h V .. h V + V - 1, C weights each) -> out float32
    [T, H, V]; grid (T, H), block (THREADS,): thread i walks whole rows v = i, i + THREADS, ..."""
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    V = out.shape[2]
    acc = cuda.local.array(1, np.float32)
    ah = a[:, h]  # [T, C]
    for v in range(cuda.threadIdx.x, V, THREADS):
        acc[0] = np.float32(0.0)
        ROW_PARTIAL(vb[h * V + v], ah, t, 1, 0, 1, acc)
        out[t, h, v] = acc[0]


def head_rows(w, qtype, H: int, name: str) -> tuple:
    """A per-head 3-D tensor's raw rows w uint8 [H * R, S] (GGUF's [H, R, cols] as quant_matvec reads it) -> (R,
    cols), after checking that the rows split into H heads."""
    w = on_device(w, name)
    cols = weight_cols(w, qtype, name)
    if H <= 0 or w.shape[0] % H:
        raise ValueError(f"{name}: {w.shape[0]} rows do not split into {H} heads")
    return w.shape[0] // H, cols


def mla_query_q(q, k_b, qtype, cos, sin, p0, neox: bool, scale: float, Q, stream=0):
    """mla_query with k_b as its stored rows: uint8 [H * C, S] of `qtype` (attn_k_b's [H, C, N], any quant_matvec
    format); returns Q. p0: an int, or int32 [1] in device memory (`mla_query_q_at_kernel`)."""
    q, k_b, cos, sin, Q = (on_device(a, n) for a, n in ((q, "q"), (k_b, "k_b"), (cos, "cos"), (sin, "sin"),
                                                        (Q, "Q")))
    check(q, "q", np.float32, 3)
    check(Q, "Q", np.float32, 3)
    T, H, NR = q.shape
    C, N = head_rows(k_b, qtype, H, "k_b")
    R = NR - N
    at = None
    if not isinstance(p0, (int, np.integer)):
        at = on_device(p0, "p0")
        check(at, "p0", np.int32, 1)
        p0 = 0
    if R <= 0 or R % 2 or tuple(Q.shape) != (T, H, C + R) or cos.shape[1] != R // 2 or p0 + T > cos.shape[0]:
        raise ValueError(f"mla_query_q: q {tuple(q.shape)}, k_b rows {tuple(k_b.shape)} ({C} x {N} per head), Q "
                         f"{tuple(Q.shape)}, cos {tuple(cos.shape)} at {p0} do not fit (need Q [T, H, C + R])")
    if T and at is not None:
        _for(mla_query_q_at_kernel, qtype)[(T, H), THREADS, stream](
            q, k_b, cos, sin, at, bool(neox), np.float32(scale), Q)
    elif T:
        _for(mla_query_q_kernel, qtype)[(T, H), THREADS, stream](
            q, k_b, cos, sin, p0, bool(neox), np.float32(scale), Q)
    return Q


def mla_value_q(a, v_b, qtype, out, stream=0):
    """mla_value with v_b as its stored rows: uint8 [H * V, S] of `qtype` (attn_v_b's [H, V, C]); returns out."""
    a, out = on_device(a, "a"), on_device(out, "out")
    check(a, "a", np.float32, 3)
    check(out, "out", np.float32, 3)
    T, H, C = a.shape
    V, cols = head_rows(v_b, qtype, H, "v_b")
    if cols != C or tuple(out.shape) != (T, H, V):
        raise ValueError(f"mla_value_q: a {tuple(a.shape)}, v_b rows {tuple(v_b.shape)} ({V} x {cols} per head), "
                         f"out {tuple(out.shape)} do not fit (need out [T, H, V])")
    if T:
        _for(mla_value_q_kernel, qtype)[(T, H), THREADS, stream](a, on_device(v_b, "v_b"), out)
    return out


def head_floats(rows: np.ndarray, qtype, H: int) -> np.ndarray:
    """The twins' view of stored per-head rows: uint8 [H * R, S] -> float32 [H, R, cols] (pymoe.quant.dequantize,
    what engine/mla.mla_weights makes for the host form)."""
    from pymoe import quant

    w = quant.dequantize(np.ascontiguousarray(rows), qtype)  # [H * R, cols]
    return w.reshape(H, w.shape[0] // H, -1).astype(np.float32)


def mla_query_q_reference(q, k_b_rows, qtype, cos, sin, neox: bool, scale: float) -> np.ndarray:
    """NumPy twin of mla_query_q: mla_query_reference on the dequantized rows."""
    return mla_query_reference(q, head_floats(k_b_rows, qtype, q.shape[1]), cos, sin, neox, scale)


def mla_value_q_reference(a, v_b_rows, qtype) -> np.ndarray:
    """NumPy twin of mla_value_q: mla_value_reference on the dequantized rows."""
    return mla_value_reference(a, head_floats(v_b_rows, qtype, a.shape[1]))


__all__ = ["mla_kv_row", "mla_query", "mla_value", "mla_query_q", "mla_value_q", "mla_kv_row_reference",
           "mla_query_reference", "mla_value_reference", "mla_query_q_reference", "mla_value_q_reference"]
