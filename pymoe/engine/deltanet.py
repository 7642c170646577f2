"""Gated DeltaNet: the linear-attention layers of Qwen3-Next (three of every four layers of the article's model).

What this is: `gdn_block(backend, layer, x, kvs, layer_i, rope)`, the layer plan's "gdn" attention kind, and its two
forms of the gated delta rule: `delta_rule_recurrent` (token by token: what decode runs) and `delta_rule_chunked`
(blocks of C tokens with matrix products inside a block: the prefill form), tested against each other in
tests/test_deltanet.py and, through the whole model, against llama.cpp (llama.cpp's qwen3next.cpp and
delta-net-base.cpp, read in the llama.cpp that llama-cpp-python 0.3.36 vendors).
On the CUDA backend, over one sequence's device KV cache, the whole layer runs on the device, on the state the device
KV cache keeps: one token of a decode step (its input a device array: `CUDABackend.gdn_step`) or T rows of a prompt
chunk or a verify forward (`gdn_device`: `CUDABackend.gdn_chunk`, the recurrent form over the T tokens in order);
the kernels are cuda_kernels/deltanet.py's, whose references are this file's functions. Several sequences at once
(the server's batched forward) run `gdn_core` on the host, the projections on the device.
What this is not: a device kernel, or softmax attention (engine/attention.py).

The layer, for T tokens (shapes in brackets; nk q/k heads of size dk, nv v heads of size dv, nv = r * nk):
    qkv  = x @ attn_qkv.T                  [T, 2 nk dk + nv dv]   q | k | v, each all heads
    z    = x @ attn_gate.T                 [T, nv dv]             the output gate
    ba   = x @ ssm_ba.T                    [T, 2 nv]              per q/k head j: r betas, then r alphas
                                           (qwen35moe: ssm_beta and ssm_alpha, [T, nv] each)
    qkv  = silu(causal_conv(qkv))          a depth-wise conv of width K over time, per channel, its K - 1 last
                                           inputs carried over to the next call (the conv state)
    q, k = l2norm(q), l2norm(k)            x / sqrt(sum x^2 + eps) per head; v head h reads q/k head h // r
                                           (qwen35moe: h % nk, its converter reorders the V heads so)
    beta = sigmoid(b)                      [T, nv] how much of the new value is written
    g    = softplus(a + ssm_dt) * ssm_a    [T, nv] log of the decay (ssm_a = -exp(A_log) < 0, so 0 < e^g < 1)
    per v head, with a state M [dv, dk] carried from call to call (the recurrent state):
        M  = e^g M                                       forget a little
        d  = beta (v - M k)                              the delta: what M gets wrong about v for key k
        M  = M + d k^T                                   write it
        o  = M q / sqrt(dk)                              read
    y    = (rmsnorm(o) * ssm_norm * silu(z)) @ ssm_out.T   per v head, the gated RMSNorm
State per layer (engine/kv.py `KVCache.recurrent`): conv [K - 1, conv_dim] and M [nv, dv, dk], float32. It holds
the whole past: a sequence can be continued, not cut back (the server's prefix reuse knows: serve/scheduler.py).
"""
from __future__ import annotations

import numpy as np

from pymoe.backends.reference import gdn_state_shapes, rmsnorm, sigmoid, silu
from .kv import join_rows, segments

CHUNK = 64  # tokens per block of the chunked form (llama.cpp's chunking uses 64 too)


def gdn_weights(b, lt, vec, tiled: bool) -> dict:
    """The layer's tensors: projections as backend weights, the small vectors and the conv kernel as float32.
    tiled (qwen35moe): beta and alpha are two projections; else one, ssm_ba, grouped by q/k head (qwen3next)."""
    split = (dict(beta=b.dense(lt("ssm_beta.weight")), alpha=b.dense(lt("ssm_alpha.weight"))) if tiled
             else dict(ba=b.dense(lt("ssm_ba.weight"))))
    return dict(qkv=b.dense(lt("attn_qkv.weight")), gate=b.dense(lt("attn_gate.weight")), **split,
                out=b.dense(lt("ssm_out.weight")),
                conv=np.ascontiguousarray(lt("ssm_conv1d.weight").floats()),  # [conv_dim, K]
                dt=vec("ssm_dt.bias"), a=vec("ssm_a"), norm=vec("ssm_norm.weight"))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x), and x itself above 20 (ggml's op_softplus)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


def l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum x^2 + eps) over the last axis (llama.cpp's build_gdn_l2_norm: rms_norm(x, eps/n) / sqrt(n))."""
    return (x / np.sqrt((x * x).sum(axis=-1, keepdims=True) + np.float32(eps))).astype(np.float32)


def causal_conv(x: np.ndarray, state: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth-wise causal conv: x [T, C] new inputs, state [K - 1, C] the previous ones, w [C, K] ->
    (y [T, C] with y[t, c] = sum_i [state; x][t + i, c] w[c, i], the new state [K - 1, C])."""
    K = w.shape[1]
    xin = np.concatenate([state, x])  # [K - 1 + T, C]
    y = np.zeros_like(x)  # [T, C]
    for i in range(K):  # ggml_ssm_conv's order: one product per tap, in tap order
        y += xin[i:i + x.shape[0]] * w[:, i]
    return y, xin[xin.shape[0] - (K - 1):].copy()


def delta_rule_recurrent(q, k, v, g, beta, M):
    """The gated delta rule token by token. q, k [T, H, dk] (q already scaled), v [T, H, dv], g, beta [T, H],
    M [H, dv, dk] (updated in place) -> o [T, H, dv]."""
    o = np.empty_like(v)
    for t in range(q.shape[0]):
        M *= np.exp(g[t])[:, None, None]  # forget
        d = beta[t][:, None] * (v[t] - np.einsum("hvk,hk->hv", M, k[t]))  # [H, dv] the correction
        M += d[:, :, None] * k[t][:, None, :]  # write
        o[t] = np.einsum("hvk,hk->hv", M, q[t])  # read
    return o


def delta_rule_chunked(q, k, v, g, beta, M, chunk: int = CHUNK):
    """The same rule, C tokens at a time (the WY form used for prefill). Inside a chunk, with G_t = sum of g up to
    t (so e^(G_t - G_s) is the decay from s to t), the corrections d_t solve a triangular system
        d_t + beta_t sum_{s<t} e^(G_t - G_s) (k_t . k_s) d_s = beta_t (v_t - e^(G_t) M0 k_t)
    and then o_t = e^(G_t) M0 q_t + sum_{s<=t} e^(G_t - G_s) (q_t . k_s) d_s,  M = e^(G_C) M0 + sum_s e^(G_C - G_s) d_s k_s^T.
    Same math as delta_rule_recurrent, other rounding: tests/test_deltanet.py compares the two."""
    T, H, dv = v.shape
    o = np.empty_like(v)
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(T, c0 + chunk))
        qc, kc, vc = q[sl].transpose(1, 0, 2), k[sl].transpose(1, 0, 2), v[sl].transpose(1, 0, 2)  # [H, C, d]
        G = np.cumsum(g[sl].T.astype(np.float64), axis=1)  # [H, C] log-decay from the chunk start, inclusive
        bc = beta[sl].T  # [H, C]
        C = G.shape[1]
        decay = np.exp(G[:, :, None] - G[:, None, :])  # [H, C, C] e^(G_t - G_s)
        lower = np.tril(np.ones((C, C), bool), -1)  # s < t
        A = np.where(lower, decay * np.einsum("htk,hsk->hts", kc, kc), 0.0) * bc[:, :, None]  # [H, C, C]
        rhs = bc[:, :, None] * (vc - np.exp(G)[:, :, None] * np.einsum("hvk,htk->htv", M, kc))  # [H, C, dv]
        d = np.linalg.solve(np.eye(C)[None] + A, rhs)  # [H, C, dv] (I + A) d = rhs, A strictly lower triangular
        scores = np.where(np.tril(np.ones((C, C), bool)), decay * np.einsum("htk,hsk->hts", qc, kc), 0.0)
        oc = np.exp(G)[:, :, None] * np.einsum("hvk,htk->htv", M, qc) + np.einsum("hts,hsv->htv", scores, d)
        o[sl] = oc.transpose(1, 0, 2)
        tail = np.exp(G[:, -1:] - G)  # [H, C] e^(G_C - G_s)
        M[:] = (np.exp(G[:, -1])[:, None, None] * M + np.einsum("hs,hsv,hsk->hvk", tail, d, kc)).astype(np.float32)
    return o.astype(np.float32)


def gdn_block(b, layer, x: np.ndarray, kvs: list, layer_i: int, rope=None, chunked=None) -> np.ndarray:
    """x [T, D] (attn-normed, host) -> [T, D]; advances each sequence's conv and recurrent state (rope unused).
    kvs: one cache (x: its next T tokens) or N (x: one row each; engine/kv.py `segments`). The projections in and
    out run once over all T rows; the conv, the rule and the gated norm run per sequence, on its own state.
    chunked: the form of the rule; by default the chunked one for a sequence of at least CHUNK new tokens (long
    prefills, where it is much faster), the recurrent one below that, so that a short prompt gives each token the
    same bits as decoding it would (the CPU backend's contract, tests/test_model.py)."""
    cfg, w = layer.cfg, layer.gdn
    T = x.shape[0]
    nv, dv = cfg.ssm_v_heads, cfg.ssm_inner // cfg.ssm_v_heads
    mix = [w["beta"], w["alpha"]] if cfg.traits.gdn_tiled else [w["ba"]]
    if not isinstance(x, np.ndarray) and x.shape[0] == 1:  # a device decode step's normed residual (backends/
        x = b.to_device(x)  # cuda.py): the conv, the rule and the gated norm run there too, on the device state
        qkv, z, *ba = b.linear_many([w["qkv"], w["gate"], *mix], x)  # [1, conv_dim], [1, nv dv], ba or beta, alpha
        return b.linear(w["out"], b.gdn_step(kvs[0], layer_i, cfg, w, qkv, z, ba))  # [1, D] (device)
    if not isinstance(x, np.ndarray) or (len(kvs) == 1 and getattr(b, "gdn_on_device", lambda kv: False)(kvs[0])):
        return gdn_device(b, layer, x, kvs[0], layer_i)  # T rows of one sequence (a verify step's: on the device)
    qkv, z, *ba = b.linear_many([w["qkv"], w["gate"], *mix], x)  # [T, conv_dim], [T, nv dv], [T, 2 nv] or 2 x [T, nv]
    qkv, z, ba = np.asarray(qkv, np.float32), np.asarray(z, np.float32), [np.asarray(m, np.float32) for m in ba]
    o = join_rows(b, [gdn_core(layer, qkv[rows], z[rows], [m[rows] for m in ba], kv, layer_i, chunked)
                      for kv, rows in segments(kvs, T)])  # [T, nv dv]
    return b.linear(w["out"], np.ascontiguousarray(o, np.float32))  # [T, D]


def gdn_device(b, layer, x: np.ndarray, kv, layer_i: int) -> np.ndarray:
    """T rows of one sequence on the device (backends/cuda.py): x [T, D] (attn-normed; host: it goes up once and
    [T, D] comes back once; a device array in a verify step: it stays there), the projections, the conv and the
    rule over the T tokens in order (`CUDABackend.gdn_chunk`: the recurrent form, one launch each, on the state
    the device KV cache keeps) and ssm_out run there."""
    cfg, w = layer.cfg, layer.gdn
    mix = [w["beta"], w["alpha"]] if cfg.traits.gdn_tiled else [w["ba"]]
    x = b.to_device(x)  # [T, D]
    qkv, z, *ba = b.linear_many([w["qkv"], w["gate"], *mix], x)  # [T, conv_dim], [T, nv dv], [T, 2 nv] or 2 x [T, nv]
    return b.to_host(b.linear(w["out"], b.gdn_chunk(kv, layer_i, cfg, w, qkv, z, ba)))  # [T, D]


def gdn_core(layer, qkv, z, ba: list, kv, layer_i: int, chunked=None) -> np.ndarray:
    """One sequence's part of the layer: its T rows of the projections -> o [T, nv dv] (before ssm_out), advancing
    its conv and recurrent state in kv."""
    chunked = qkv.shape[0] >= CHUNK if chunked is None else chunked
    cfg, w = layer.cfg, layer.gdn
    T = qkv.shape[0]
    nk, nv, dk = cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state
    dv, r, key_dim = cfg.ssm_inner // nv, nv // nk, nk * cfg.ssm_state
    st = kv.recurrent(layer_i, **gdn_state_shapes(cfg))
    qkv, st["conv"] = causal_conv(qkv, st["conv"], w["conv"])
    qkv = silu(qkv)
    q = l2norm(qkv[:, :key_dim].reshape(T, nk, dk), cfg.rms_eps)  # [T, nk, dk]
    k = l2norm(qkv[:, key_dim:2 * key_dim].reshape(T, nk, dk), cfg.rms_eps)  # [T, nk, dk]
    v = np.ascontiguousarray(qkv[:, 2 * key_dim:].reshape(T, nv, dv))  # [T, nv, dv]
    if cfg.traits.gdn_tiled:  # qwen35moe: v head h reads q/k head h % nk; beta and alpha come as [T, nv] each
        q, k = np.tile(q, (1, r, 1)), np.tile(k, (1, r, 1))  # [T, nv, dk]
        b_raw, a_raw = ba  # [T, nv] each
    else:  # qwen3next: v head h reads q/k head h // r; per q/k head r betas, then r alphas
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)  # [T, nv, dk]
        ba4 = ba[0].reshape(T, nk, 2, r)
        b_raw, a_raw = ba4[:, :, 0].reshape(T, nv), ba4[:, :, 1].reshape(T, nv)  # [T, nv] each
    beta = sigmoid(b_raw).astype(np.float32)  # [T, nv]
    g = softplus(a_raw + w["dt"]) * w["a"]  # [T, nv] log-decay, <= 0
    rule = delta_rule_chunked if chunked else delta_rule_recurrent
    o = rule(q * np.float32(1.0 / np.sqrt(dk)), k, v, g, beta, st["ssm"])  # [T, nv, dv]
    o = rmsnorm(o, w["norm"], cfg.rms_eps) * silu(z.reshape(T, nv, dv))  # [T, nv, dv]
    return o.reshape(T, nv * dv)
