"""Multi-head latent attention (MLA): DeepSeek-V2/V3's attention over a compressed KV cache.

What this is: `mla_block(backend, layer, x, kvs, layer_i, rope)`, the layer plan's "mla" attention kind, as
llama.cpp's deepseek2.cpp computes it with the absorption trick (read in the llama.cpp that llama-cpp-python 0.3.36
vendors; the converter splits kv_b_proj into attn_k_b and attn_v_b for it). Tested through the whole model against
llama.cpp (tests/test_model_vs_llamacpp.py, arch deepseek2).
On the CUDA backend, over one sequence's device KV cache, the block is `mla_device`: the same math with its
MLA-specific parts (the cache rows, the absorbed query, the value up-projection) in cuda_kernels/mla.py and the
attention over the device copy of the compressed cache, for the rows of a device step (version 3: x a device array;
one decode token, or speculation's verify forward of T rows, engine/model.py `verify_on_device`) and for T rows of a
prompt chunk or of a verify forward outside a device step (x on the host: it goes up once and the block's output
comes back once). The host form (`mla_core`) runs on the other backends and for several sequences at once (the
server's batched forward).
What this is not: the uncompressed form (a KV of H full heads: mathematically the same, H times the memory), or a
kernel.

For T tokens (H heads; C = kv_lora_rank; R = rope dims; N = nope dims = key_length_mla - R; V = value_length_mla):
    q      = x @ attn_q.T, or rmsnorm(x @ attn_q_a.T) * attn_q_a_norm @ attn_q_b.T      [T, H, N + R]
    q_nope, q_pe = q[..., :N], rope(q[..., N:])                                          (normal-style pairs)
    ckv    = x @ attn_kv_a_mqa.T                                                         [T, C + R]
    c      = rmsnorm(ckv[:, :C]) * attn_kv_a_norm      the compressed KV: what the cache holds, one "head"
    k_pe   = rope(ckv[:, C:])                          one rope key shared by all heads
    q_abs  = q_nope @ attn_k_b[h]                      [T, H, C]  (k_b: [H, C, N]: the key up-projection, moved
                                                                   onto the query: q_nope . (k_b c) = (q_nope k_b) . c)
    K      = [c | k_pe] [T, 1, C + R]                 written to the KV cache (MQA: one KV head); V = K[..., :C]
    a      = softmax([q_abs | q_pe] . K * s) V          [T, H, C]   s = mscale^2 / sqrt(N + R)
    out    = a @ attn_v_b[h].T -> [T, H * V] @ attn_output.T   (v_b: [H, V, C], the value up-projection)
mscale = 1 + 0.1 * yarn_log_mul * ln(factor) with YaRN (DeepSeek's mscale_all_dim), else 1; the RoPE tables of
these layers carry no extra factor (llama.cpp's attn factor cancels it for DeepSeek, backends/reference.RopeScaling).
"""
from __future__ import annotations

import numpy as np

from pymoe import quant
from .kv import join_rows, segments


def mla_weights(b, lt, cfg) -> dict:
    """The layer's MLA tensors: projections as backend weights, the absorbed per-head matrices as float32 (the host
    form's) and, on a backend that runs the block on the device (`mla_on_device`), also as their stored rows there
    (k_b_rows [H * C, S], v_b_rows [H * V, S] of the file's type: cuda_kernels/mla.py reads them as they are)."""
    f32 = lambda name: np.ascontiguousarray(quant.dequantize(  # noqa: E731  small 3-D tensors, dequantized once
        np.asarray(lt(name).data).view(np.uint8), lt(name).qtype)).reshape(lt(name).shape) \
        if lt(name).qtype != quant.QType.F32 else np.asarray(lt(name).data, np.float32)
    w = dict(kv_a=b.dense(lt("attn_kv_a_mqa.weight")), kv_a_norm=b.vector(lt("attn_kv_a_norm.weight")),
             k_b=f32("attn_k_b.weight"), v_b=f32("attn_v_b.weight"), out=b.dense(lt("attn_output.weight")))
    if hasattr(b, "mla_on_device"):
        w.update(k_b_rows=b.dense(lt("attn_k_b.weight")), v_b_rows=b.dense(lt("attn_v_b.weight")))
    if cfg.q_lora_rank:
        w.update(q_a=b.dense(lt("attn_q_a.weight")), q_a_norm=b.vector(lt("attn_q_a_norm.weight")),
                 q_b=b.dense(lt("attn_q_b.weight")))
    else:
        w.update(q=b.dense(lt("attn_q.weight")))
    return w


def mla_scale(cfg) -> float:
    """The attention's score scale: mscale^2 / sqrt(key_length_mla) (deepseek2.cpp's kq_scale)."""
    mscale = 1.0
    if cfg.rope_scaling == "yarn" and cfg.rope_scale > 1.0:
        mscale = 1.0 + 0.1 * cfg.yarn_log_mul * np.log(cfg.rope_scale)
    return float(np.float32(mscale * mscale / np.sqrt(cfg.head_dim_mla)))


def mla_block(b, layer, x: np.ndarray, kvs: list, layer_i: int, rope: tuple) -> np.ndarray:
    """x [T, D] (attn-normed, host) -> [T, D]; writes the compressed K and V of each sequence's new tokens at its
    kv.n .. kvs: one cache (x: its next T tokens) or N (x: one row each; engine/kv.py `segments`). Projections, norms
    and RoPE run once over all T rows; the absorbed products, the cache write and attention per sequence."""
    if not isinstance(x, np.ndarray) or (len(kvs) == 1 and getattr(b, "mla_on_device", lambda kv: False)(kvs[0])):
        return mla_device(b, layer, x, kvs[0], layer_i, rope)  # a device step's token, or T rows of one sequence
    cfg, w, eps = layer.cfg, layer.mla, layer.cfg.rms_eps
    T, H = x.shape[0], cfg.n_head
    C, R = cfg.kv_lora_rank, cfg.rope_dim
    N = cfg.head_dim_mla - R
    if cfg.q_lora_rank:
        q = b.linear(w["q_b"], b.rmsnorm(b.linear(w["q_a"], x), w["q_a_norm"], eps))  # [T, H * (N + R)]
    else:
        q = b.linear(w["q"], x)
    q = np.asarray(q, np.float32).reshape(T, H, N + R)
    cos, sin = rope
    q_pe = b.rope(np.ascontiguousarray(q[..., N:]), cos, sin, cfg.rope_neox)  # [T, H, R]
    ckv = np.asarray(b.linear(w["kv_a"], x), np.float32)  # [T, C + R]
    c = b.rmsnorm(np.ascontiguousarray(ckv[:, :C]), w["kv_a_norm"], eps)  # [T, C]
    k_pe = b.rope(np.ascontiguousarray(ckv[:, None, C:]), cos, sin, cfg.rope_neox)  # [T, 1, R]
    out = join_rows(b, [mla_core(b, layer, q[rows, :, :N], q_pe[rows], c[rows], k_pe[rows], kv, layer_i)
                        for kv, rows in segments(kvs, T)])  # [T, H * V]
    return b.linear(w["out"], out)  # [T, D]


def mla_core(b, layer, q_nope, q_pe, c, k_pe, kv, layer_i: int) -> np.ndarray:
    """One sequence's T rows: q_nope [T, H, N], q_pe [T, H, R] (roped), c [T, C], k_pe [T, 1, R] (roped) ->
    [T, H * V]: the absorbed query, the cache write at kv.n, attention over the sequence's cache, the value
    up-projection."""
    cfg, w = layer.cfg, layer.mla
    T, p0, H = c.shape[0], kv.n, cfg.n_head
    C, R = cfg.kv_lora_rank, cfg.rope_dim
    q_abs = np.einsum("thn,hcn->thc", q_nope, w["k_b"]).astype(np.float32)  # [T, H, C]
    Q = np.concatenate([q_abs, q_pe], axis=-1)  # [T, H, C + R]
    b.kv_write(kv, layer_i, p0, np.concatenate([c[:, None, :], k_pe], axis=-1), None)  # V = K[..., :C] on read
    # attention() scales by 1 / sqrt(C + R); MLA's scale is mla_scale: the queries carry the ratio
    Q = Q * np.float32(mla_scale(cfg) * np.sqrt(C + R))
    a = np.asarray(b.attention(Q, *b.kv_read(kv, layer_i, p0 + T), p0), np.float32).reshape(T, H, C)  # [T, H, C]
    return np.einsum("thc,hvc->thv", a, w["v_b"]).astype(np.float32).reshape(T, H * cfg.head_dim_v_mla)


def mla_device(b, layer, x, kv, layer_i: int, rope: tuple):
    """MLA on the device for one sequence's T rows (backends/cuda.py): x [T, D] (attn-normed; a device array in a
    device step, one token or a verify step's T rows, else a host array sent up once) -> [T, D] (device in a step,
    else host: one copy back);
    mla_block and mla_core's math with the backend's MLA primitives: the cache rows [c | k_pe] written at kv.n..
    (`mla_kv_write`: rmsnorm and RoPE), the absorbed, roped queries with the scale folded in (`mla_query`), attention
    over the device cache (V = K[..., :C]; token t sees positions 0..kv.n + t), the value up-projection
    (`mla_value`). rope: (cos, sin) [T, R / 2] of the rows' positions (a device step reads its own on the device)."""
    cfg, w, eps = layer.cfg, layer.mla, layer.cfg.rms_eps
    C, R = cfg.kv_lora_rank, cfg.rope_dim
    x = b.to_device(x)  # [T, D] (a device array stays; the backend's scratch for this block starts afresh)
    T = x.shape[0]
    if cfg.q_lora_rank:
        q = b.linear(w["q_b"], b.rmsnorm(b.linear(w["q_a"], x), w["q_a_norm"], eps))  # [T, H * (N + R)]
    else:
        q = b.linear(w["q"], x)
    ckv = b.linear(w["kv_a"], x)  # [T, C + R]
    b.mla_kv_write(kv, layer_i, kv.n, ckv, w["kv_a_norm"], eps, cfg.rope_neox, rope)  # rows kv.n .. kv.n + T - 1
    # attention() scales by 1 / sqrt(C + R); MLA's scale is mla_scale: the queries carry the ratio (as mla_core)
    Q = b.mla_query(q, w["k_b_rows"], float(np.float32(mla_scale(cfg) * np.sqrt(C + R))), cfg.rope_neox, kv.n,
                    rope)  # [T, H, C + R]
    a = b.attention(Q, *b.kv_read(kv, layer_i, kv.n + T), kv.n)  # [T, H * C]
    return b.to_host(b.linear(w["out"], b.mla_value(a, w["v_b_rows"])))  # [T, H * V] -> [T, D]
