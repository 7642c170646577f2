"""Gated DeltaNet's decode step on the device (qwen3next, qwen35moe): the short conv and the gated delta rule of one
token, on the conv and recurrent state the device KV cache keeps for its sequence (backends/cuda.py
`DeviceKVCache`).

What this is: two kernels plus their host wrappers, taking and returning device arrays (one token, T = 1):

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
The references (tests/test_cuda_deltanet_kernels.py compares each kernel with them): `conv_step_reference` and
`rule_step_reference`, written with engine/deltanet.py's own functions (causal_conv, l2norm, softplus,
delta_rule_recurrent) and reference.rmsnorm: the host decode's math.
What this is not: the projections (quant_matvec.matmul), or prefill (the chunked form runs on the host,
engine/deltanet.py).

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
@cuda.jit
def conv_step_kernel(x, state, w, out):
    """One thread per channel c: out[c] = silu(sum_i xin[i] w[c, i]) with xin = [state[:, c]; x[c]], taps in
    order; then the state moves on by one. grid (ceil(C / THREADS),), block (THREADS,)."""
    c = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
    if c >= x.shape[0]:
        return
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


# ----------------------------------------------------------------------------------------------------------------
# The gated delta rule and the gated RMSNorm
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit
def rule_step_kernel(qkvc, z, b, a, dt, A, norm, MT, o, nk, tiled, eps):
    """One block per v head h (see the module docstring); grid (nv,), block (RULE_THREADS,)."""
    h = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nv, dk, dv = MT.shape[0], MT.shape[1], MT.shape[2]
    r = nv // nk
    kh = h % nk if tiled else h // r
    key_dim = nk * dk
    qs = cuda.shared.array(MAX_DK, np.float32)
    ks = cuda.shared.array(MAX_DK, np.float32)
    buf = cuda.shared.array(RULE_THREADS, np.float32)
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


def rule_step_reference(qkvc, z, b, a, dt, A, norm, MT, nk: int, tiled: bool, eps: float) -> np.ndarray:
    """rule_step in NumPy, as engine/deltanet.gdn_core computes one token (MT [nv, dk, dv], the state transposed as
    the kernel keeps it, advanced in place) -> o [nv dv]."""
    from pymoe.backends.reference import rmsnorm, sigmoid, silu
    from pymoe.engine.deltanet import delta_rule_recurrent, l2norm, softplus

    M = np.ascontiguousarray(MT.transpose(0, 2, 1))  # [nv, dv, dk] engine/deltanet.py's layout
    nv, dv, dk = M.shape
    r, key_dim = nv // nk, nk * dk
    q = l2norm(qkvc[:key_dim].reshape(1, nk, dk), eps)  # [1, nk, dk]
    k = l2norm(qkvc[key_dim:2 * key_dim].reshape(1, nk, dk), eps)
    v = np.ascontiguousarray(qkvc[2 * key_dim:].reshape(1, nv, dv))  # [1, nv, dv]
    if tiled:
        q, k = np.tile(q, (1, r, 1)), np.tile(k, (1, r, 1))  # [1, nv, dk]
        b_raw, a_raw = b[None], a[None]  # [1, nv]
    else:
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
        ba4 = b.reshape(1, nk, 2, r)
        b_raw, a_raw = ba4[:, :, 0].reshape(1, nv), ba4[:, :, 1].reshape(1, nv)
    beta = sigmoid(b_raw).astype(np.float32)
    g = softplus(a_raw + dt) * A
    o = delta_rule_recurrent(q * np.float32(1.0 / np.sqrt(dk)), k, v, g, beta, M)  # [1, nv, dv]
    MT[:] = M.transpose(0, 2, 1)
    o = rmsnorm(o, norm, eps) * silu(z.reshape(1, nv, dv))
    return o.reshape(nv * dv).astype(np.float32)
