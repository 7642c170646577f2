"""Gated DeltaNet on the device (qwen3next, qwen35moe): the short conv and the gated delta rule of one token (a decode
step) or of a prompt chunk's T tokens in order, on the conv and recurrent state the device KV cache keeps for its
sequence (backends/cuda.py `DeviceKVCache`).

What this is: two kernels plus their host wrappers, taking and returning device arrays (one token, T = 1), and their
chunk forms `conv_chunk` and `rule_chunk` (the same per-token bodies, `_conv_token` and `_rule_token`, stepped
through T tokens inside one launch: x, qkvc, z, b, a, o gain a leading T axis):

  conv_step(x, state, w, out)     out = silu(sum_i [state; x][i] * w[:, i]), then state = its last K - 1 rows
                                  x float32 [C] (attn_qkv's product), state float32 [K - 1, C], w float32 [C, K]
  rule_step(qkvc, z, b, a, dt, A, norm, MT, o, nk, tiled, eps)
                                  per v head h (one thread block each):
                                    q, k  = l2norm of q/k head kh (kh = h % nk tiled, else h // r), q / sqrt(dk)
                                    beta  = sigmoid(b_h), decay = exp(softplus(a_h + dt_h) * A_h)
                                    M_h   = decay M_h;  d = beta (v_h - M_h k);  M_h += d k^T;  o_h = M_h q
                                    o_h   = rmsnorm(o_h) * norm * silu(z_h)          (the gated RMSNorm)
                                  qkvc float32 [2 nk dk + nv dv] (the conv's output), z float32 [nv dv], MT float32
                                  [nv, dk, dv]: the state M [nv, dv, dk] transposed per head (updated in place; see
                                  below), o float32 [nv dv]; b, a: where beta and alpha
                                  sit: `tiled` (qwen35moe) b[h], a[h] (ssm_beta's, ssm_alpha's products); else
                                  (qwen3next, ssm_ba grouped by q/k head: r betas, then r alphas) b = a = the
                                  product, b at kh 2r + h % r, a at kh 2r + r + h % r
The references (tests/test_cuda_deltanet_kernels.py compares each kernel with them): `conv_step_reference`,
`rule_step_reference`, `conv_chunk_reference` and `rule_chunk_reference`, written with engine/deltanet.py's own
functions (causal_conv, l2norm, softplus, delta_rule_recurrent, or delta_rule_chunked with `chunked`) and
reference.rmsnorm: the host's math.
What this is not: the projections (quant_matvec.matmul), or the chunked (WY) form of the rule: rule_chunk steps
through the chunk's tokens one after the other (T sequential steps per v head), where engine/deltanet.py's chunked
form does matrix products per block of 64.

Version 1 (these): the conv one thread per channel; the rule one block of RULE_THREADS threads per v head, each
thread owning rows of M_h (a row is read and written twice, decayed and corrected, with no barrier between rows: rows
are independent); q and k of the head in shared memory (dk <= MAX_DK). The state is stored transposed on the device
(MT [nv, dk, dv], engine/deltanet.py's M [nv, dv, dk] per head transposed), so that when the threads of a warp
step through their rows' j-th elements together they read consecutive floats (one 128-byte transaction per warp,
where M's own layout would scatter them dk floats apart): the state, 2 reads and 2 writes of nv dv dk floats per
layer and token, is the kernel's whole traffic (reasoned, not measured: no GPU was at hand). A decode step's Gated
DeltaNet layer is then 4 matmuls (qkv, gate, ba, out; 5 on qwen35moe: beta and alpha apart) and these 2 launches.
Shape legend: C = 2 nk dk + nv dv conv channels, K conv width, nk q/k heads of dk, nv v heads of dv, r = nv / nk.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .quant_matvec import THREADS, check, on_device
from .reduce import block_sum

MAX_DK = 256  # the largest q/k head the rule kernel holds in shared memory (Qwen3-Next: 128)
RULE_THREADS = 128  # threads per v head (a power of two: reduce.py); Qwen3-Next's dv = 128: one row each


# ----------------------------------------------------------------------------------------------------------------
# The short causal conv
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _conv_token(x, state, w, out, c):
    """Channel c of one token: out[c] = silu(sum_i [state[:, c]; x[c]][i] w[c, i]), taps in order; the state moves
    on by one. x, out 1-D rows [C]."""
    Km1 = state.shape[0]
    acc = np.float32(0.0)
    for i in range(Km1):
        acc += state[i, c] * w[c, i]
    acc += x[c] * w[c, Km1]
    for i in range(Km1 - 1):
        state[i, c] = state[i + 1, c]
    if Km1 > 0:
        state[Km1 - 1, c] = x[c]
    out[c] = acc / (np.float32(1.0) + math.exp(-acc))


@cuda.jit
def conv_step_kernel(x, state, w, out):
    """One thread per channel c (`_conv_token`). grid (ceil(C / THREADS),), block (THREADS,)."""
    c = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
    if c < x.shape[0]:
        _conv_token(x, state, w, out, c)


@cuda.jit
def conv_chunk_kernel(x, state, w, out):
    """T tokens: one thread per channel c steps through them in order (each channel's conv is its own: no
    barrier). x, out [T, C]. grid (ceil(C / THREADS),), block (THREADS,)."""
    c = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
    if c < x.shape[1]:
        for t in range(x.shape[0]):
            _conv_token(x[t], state, w, out[t], c)


def conv_step(x, state, w, out, stream=0):
    """x float32 [C], state float32 [K - 1, C] (advanced in place), w float32 [C, K] -> out float32 [C]."""
    x, state, w, out = (on_device(a, n) for a, n in ((x, "x"), (state, "state"), (w, "w"), (out, "out")))
    check(x, "x", np.float32, 1)
    check(state, "state", np.float32, 2)
    check(w, "w", np.float32, 2)
    C = x.shape[0]
    if tuple(w.shape) != (C, state.shape[0] + 1) or state.shape[1] != C or tuple(out.shape) != (C,):
        raise ValueError(f"conv_step: x {tuple(x.shape)}, state {tuple(state.shape)}, w {tuple(w.shape)}, out "
                         f"{tuple(out.shape)} must be [C], [K - 1, C], [C, K], [C]")
    if C:
        conv_step_kernel[((C + THREADS - 1) // THREADS,), THREADS, stream](x, state, w, out)
    return out


def conv_step_reference(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> np.ndarray:
    """conv_step in NumPy: engine/deltanet.causal_conv of one token, then silu; state advanced in place."""
    from pymoe.backends.reference import silu
    from pymoe.engine.deltanet import causal_conv

    y, state[:] = causal_conv(x[None], state, w)
    return silu(y[0]).astype(np.float32)


def conv_chunk(x, state, w, out, stream=0):
    """x float32 [T, C] (T tokens in order), state float32 [K - 1, C] (advanced in place), w float32 [C, K] -> out
    float32 [T, C]."""
    x, state, w, out = (on_device(a, n) for a, n in ((x, "x"), (state, "state"), (w, "w"), (out, "out")))
    check(x, "x", np.float32, 2)
    check(state, "state", np.float32, 2)
    check(w, "w", np.float32, 2)
    T, C = x.shape
    if tuple(w.shape) != (C, state.shape[0] + 1) or state.shape[1] != C or tuple(out.shape) != (T, C):
        raise ValueError(f"conv_chunk: x {tuple(x.shape)}, state {tuple(state.shape)}, w {tuple(w.shape)}, out "
                         f"{tuple(out.shape)} must be [T, C], [K - 1, C], [C, K], [T, C]")
    if C and T:
        conv_chunk_kernel[((C + THREADS - 1) // THREADS,), THREADS, stream](x, state, w, out)
    return out


def conv_chunk_reference(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> np.ndarray:
    """conv_chunk in NumPy: engine/deltanet.causal_conv of T tokens, then silu; state advanced in place."""
    from pymoe.backends.reference import silu
    from pymoe.engine.deltanet import causal_conv

    y, state[:] = causal_conv(x, state, w)
    return silu(y).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# The gated delta rule and the gated RMSNorm
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _rule_token(qkvc, z, b, a, dt, A, norm, MT, o, nk, tiled, eps, qs, ks, buf):
    """v head h = blockIdx.x of one token (see the module docstring): qkvc, z, b, a, o 1-D rows; qs, ks, buf the
    block's shared arrays."""
    h = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nv, dk, dv = MT.shape[0], MT.shape[1], MT.shape[2]
    r = nv // nk
    kh = h % nk if tiled else h // r
    key_dim = nk * dk
    sq = np.float32(0.0)
    sk = np.float32(0.0)
    for j in range(tid, dk, RULE_THREADS):
        qv = qkvc[kh * dk + j]
        kv = qkvc[key_dim + kh * dk + j]
        qs[j] = qv
        ks[j] = kv
        sq += qv * qv
        sk += kv * kv
    sq = block_sum(buf, tid, sq)
    sk = block_sum(buf, tid, sk)
    iq = np.float32(1.0) / math.sqrt(sq + np.float32(eps))
    ik = np.float32(1.0) / math.sqrt(sk + np.float32(eps))
    scale = np.float32(1.0) / math.sqrt(np.float32(dk))
    for j in range(tid, dk, RULE_THREADS):
        qs[j] = qs[j] * iq * scale
        ks[j] = ks[j] * ik
    cuda.syncthreads()
    if tiled:
        braw, araw = b[h], a[h]
    else:
        braw, araw = b[kh * 2 * r + h % r], a[kh * 2 * r + r + h % r]
    beta = np.float32(1.0) / (np.float32(1.0) + math.exp(-braw))
    u = araw + dt[h]
    sp = u if u > np.float32(20.0) else math.log1p(math.exp(u))  # softplus (ggml's: x itself above 20)
    decay = math.exp(np.float32(sp) * A[h])
    ss = np.float32(0.0)
    for i in range(tid, dv, RULE_THREADS):  # this thread's rows of M_h: M[h, i, j] = MT[h, j, i]
        acc = np.float32(0.0)
        for j in range(dk):  # forget, and read M k on the way
            m = MT[h, j, i] * decay
            MT[h, j, i] = m
            acc += m * ks[j]
        d = beta * (qkvc[2 * key_dim + h * dv + i] - acc)  # the delta
        acc = np.float32(0.0)
        for j in range(dk):  # write, and read M q on the way
            m = MT[h, j, i] + d * ks[j]
            MT[h, j, i] = m
            acc += m * qs[j]
        o[h * dv + i] = acc
        ss += acc * acc
    ss = block_sum(buf, tid, ss)
    inv = np.float32(1.0) / math.sqrt(ss / np.float32(dv) + np.float32(eps))
    for i in range(tid, dv, RULE_THREADS):
        g = z[h * dv + i]
        o[h * dv + i] = o[h * dv + i] * inv * norm[i] * (g / (np.float32(1.0) + math.exp(-g)))


@cuda.jit
def rule_step_kernel(qkvc, z, b, a, dt, A, norm, MT, o, nk, tiled, eps):
    """One block per v head h (`_rule_token`); grid (nv,), block (RULE_THREADS,)."""
    qs = cuda.shared.array(MAX_DK, np.float32)
    ks = cuda.shared.array(MAX_DK, np.float32)
    buf = cuda.shared.array(RULE_THREADS, np.float32)
    _rule_token(qkvc, z, b, a, dt, A, norm, MT, o, nk, tiled, eps, qs, ks, buf)


@cuda.jit
def rule_chunk_kernel(qkvc, z, b, a, dt, A, norm, MT, o, nk, tiled, eps):
    """T tokens in order: one block per v head h steps through them (`_rule_token` each, its state rows kept by the
    same threads from token to token); qkvc, z, b, a, o [T, ...]. grid (nv,), block (RULE_THREADS,)."""
    qs = cuda.shared.array(MAX_DK, np.float32)
    ks = cuda.shared.array(MAX_DK, np.float32)
    buf = cuda.shared.array(RULE_THREADS, np.float32)
    for t in range(qkvc.shape[0]):
        cuda.syncthreads()  # every thread is done with the last token's q and k before they are overwritten
        _rule_token(qkvc[t], z[t], b[t], a[t], dt, A, norm, MT, o[t], nk, tiled, eps, qs, ks, buf)


def rule_step(qkvc, z, b, a, dt, A, norm, MT, o, nk: int, tiled: bool, eps: float, stream=0):
    """The gated delta rule of one token and the gated RMSNorm (module docstring) -> o float32 [nv dv]; MT the
    state [nv, dk, dv] (transposed), advanced in place."""
    args = [on_device(x, n) for x, n in ((qkvc, "qkvc"), (z, "z"), (b, "b"), (a, "a"), (dt, "dt"), (A, "A"),
                                         (norm, "norm"), (MT, "MT"), (o, "o"))]
    qkvc, z, b, a, dt, A, norm, MT, o = args
    check(MT, "MT", np.float32, 3)
    nv, dk, dv = MT.shape
    if (nk <= 0 or nv % nk or dk > MAX_DK or tuple(qkvc.shape) != (2 * nk * dk + nv * dv,)
            or tuple(z.shape) != (nv * dv,) or tuple(o.shape) != (nv * dv,) or tuple(norm.shape) != (dv,)
            or tuple(dt.shape) != (nv,) or tuple(A.shape) != (nv,)
            or tuple(b.shape) != ((nv,) if tiled else (2 * nv,)) or tuple(a.shape) != tuple(b.shape)):
        raise ValueError(f"rule_step: shapes do not fit MT {tuple(MT.shape)} with {nk} q/k heads (dk <= {MAX_DK}): "
                         f"qkvc {tuple(qkvc.shape)}, z {tuple(z.shape)}, b {tuple(b.shape)}, a {tuple(a.shape)}, "
                         f"norm {tuple(norm.shape)}, o {tuple(o.shape)}")
    if nv:
        rule_step_kernel[(nv,), RULE_THREADS, stream](qkvc, z, b, a, dt, A, norm, MT, o, nk, bool(tiled),
                                                      np.float32(eps))
    return o


def rule_chunk(qkvc, z, b, a, dt, A, norm, MT, o, nk: int, tiled: bool, eps: float, stream=0):
    """rule_step for T tokens in order, one launch: qkvc [T, 2 nk dk + nv dv], z [T, nv dv], b, a [T, nv] (tiled)
    or [T, 2 nv] -> o float32 [T, nv dv]; MT advanced in place through the T tokens."""
    args = [on_device(x, n) for x, n in ((qkvc, "qkvc"), (z, "z"), (b, "b"), (a, "a"), (dt, "dt"), (A, "A"),
                                         (norm, "norm"), (MT, "MT"), (o, "o"))]
    qkvc, z, b, a, dt, A, norm, MT, o = args
    check(MT, "MT", np.float32, 3)
    check(qkvc, "qkvc", np.float32, 2)
    nv, dk, dv = MT.shape
    T = qkvc.shape[0]
    if (nk <= 0 or nv % nk or dk > MAX_DK or tuple(qkvc.shape) != (T, 2 * nk * dk + nv * dv)
            or tuple(z.shape) != (T, nv * dv) or tuple(o.shape) != (T, nv * dv) or tuple(norm.shape) != (dv,)
            or tuple(dt.shape) != (nv,) or tuple(A.shape) != (nv,)
            or tuple(b.shape) != ((T, nv) if tiled else (T, 2 * nv)) or tuple(a.shape) != tuple(b.shape)):
        raise ValueError(f"rule_chunk: shapes do not fit MT {tuple(MT.shape)} with {nk} q/k heads (dk <= {MAX_DK}): "
                         f"qkvc {tuple(qkvc.shape)}, z {tuple(z.shape)}, b {tuple(b.shape)}, a {tuple(a.shape)}, "
                         f"norm {tuple(norm.shape)}, o {tuple(o.shape)}")
    if nv and T:
        rule_chunk_kernel[(nv,), RULE_THREADS, stream](qkvc, z, b, a, dt, A, norm, MT, o, nk, bool(tiled),
                                                       np.float32(eps))
    return o


def rule_step_reference(qkvc, z, b, a, dt, A, norm, MT, nk: int, tiled: bool, eps: float) -> np.ndarray:
    """rule_step in NumPy, as engine/deltanet.gdn_core computes one token (MT [nv, dk, dv], the state transposed as
    the kernel keeps it, advanced in place) -> o [nv dv]."""
    return rule_chunk_reference(qkvc[None], z[None], b[None], a[None], dt, A, norm, MT, nk, tiled, eps)[0]


def rule_chunk_reference(qkvc, z, b, a, dt, A, norm, MT, nk: int, tiled: bool, eps: float,
                         chunked: bool = False) -> np.ndarray:
    """rule_chunk in NumPy, as engine/deltanet.gdn_core computes T tokens (MT [nv, dk, dv], the state transposed as
    the kernel keeps it, advanced in place) -> o [T, nv dv]. chunked: the rule in engine/deltanet.py's chunked
    form (delta_rule_chunked, what the host runs for a chunk of at least deltanet.CHUNK tokens) in place of the
    recurrent one the kernel computes."""
    from pymoe.backends.reference import rmsnorm, sigmoid, silu
    from pymoe.engine.deltanet import delta_rule_chunked, delta_rule_recurrent, l2norm, softplus

    M = np.ascontiguousarray(MT.transpose(0, 2, 1))  # [nv, dv, dk] engine/deltanet.py's layout
    nv, dv, dk = M.shape
    T = qkvc.shape[0]
    r, key_dim = nv // nk, nk * dk
    q = l2norm(qkvc[:, :key_dim].reshape(T, nk, dk), eps)  # [T, nk, dk]
    k = l2norm(qkvc[:, key_dim:2 * key_dim].reshape(T, nk, dk), eps)
    v = np.ascontiguousarray(qkvc[:, 2 * key_dim:].reshape(T, nv, dv))  # [T, nv, dv]
    if tiled:
        q, k = np.tile(q, (1, r, 1)), np.tile(k, (1, r, 1))  # [T, nv, dk]
        b_raw, a_raw = b, a  # [T, nv]
    else:
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
        ba4 = b.reshape(T, nk, 2, r)
        b_raw, a_raw = ba4[:, :, 0].reshape(T, nv), ba4[:, :, 1].reshape(T, nv)
    beta = sigmoid(b_raw).astype(np.float32)
    g = softplus(a_raw + dt) * A
    rule = delta_rule_chunked if chunked else delta_rule_recurrent
    o = rule(q * np.float32(1.0 / np.sqrt(dk)), k, v, g, beta, M)  # [T, nv, dv]
    MT[:] = M.transpose(0, 2, 1)
    o = rmsnorm(o, norm, eps) * silu(z.reshape(T, nv, dv))
    return o.reshape(T, nv * dv).astype(np.float32)
