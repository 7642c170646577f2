"""The attention blocks: one function per attention kind, written once over the backend's primitives.

What this is: `gqa_block(backend, layer, x, kv, layer_i, rope)`, the softmax attention of every supported arch:
    q, k, v = x @ attn_q.T, x @ attn_k.T, x @ attn_v.T    (+ q/k/v biases: qwen2moe)
    q, k    = rmsnorm(q), rmsnorm(k)                     (q/k norm: per head, qwen3moe; over the projection, olmoe)
    q, k    = rope(q), rope(k)                           (NEOX or normal pairs, positions kv.n ..)
    kv[layer, kv.n ..] = k, v
    out     = attention(q, kv[layer, :kv.n + T]) @ attn_output.T
`ATTENTION` maps a layer plan's attention kind (gguf/config.LayerPlan) to its block. A new kind (gated attention,
Gated DeltaNet, MLA, sliding window) is one more function here, over the same primitives, plus its per-layer state
in engine/kv.py; docs/adding-a-model.md walks through it.
What this is not: the arithmetic (the backend's: backends/protocol.py), or the KV storage (engine/kv.py).
Shapes: T new tokens, H query heads, G = n_head_kv, Dh / Dv key / value head size, D n_embd.
"""
from __future__ import annotations

import numpy as np


def gqa_block(b, layer, x: np.ndarray, kv, layer_i: int, rope: tuple) -> np.ndarray:
    """x [T, D] (attn-normed) -> [T, D]; writes the T new keys and values into kv at positions kv.n ...
    rope: (cos, sin) [T, rope_dim / 2] of those positions (reference.rope_tables), shared by every layer."""
    cfg = layer.cfg
    if getattr(kv, "on_device", False):  # the backend's own KV cache in device memory: the block runs there
        return b.attention_block(layer, x, kv, layer_i)
    T, p0 = x.shape[0], kv.n
    q, k, v = b.linear_many([layer.attn_q, layer.attn_k, layer.attn_v], x)  # [T, H*Dh], [T, G*Dh], [T, G*Dv]
    if layer.bias:
        q, k, v = q + layer.bias["q"], k + layer.bias["k"], v + layer.bias["v"]
    if cfg.qk_norm == "full":  # olmoe: over the whole projection, before splitting into heads
        q, k = b.rmsnorm(q, layer.q_norm, cfg.rms_eps), b.rmsnorm(k, layer.k_norm, cfg.rms_eps)
    q = q.reshape(T, cfg.n_head, cfg.head_dim)  # [T, H, Dh]
    k = k.reshape(T, cfg.n_head_kv, cfg.head_dim)  # [T, G, Dh]
    v = v.reshape(T, cfg.n_head_kv, cfg.head_dim_v)  # [T, G, Dv]
    if cfg.qk_norm == "head":  # qwen3moe: each head separately
        q, k = b.rmsnorm(q, layer.q_norm, cfg.rms_eps), b.rmsnorm(k, layer.k_norm, cfg.rms_eps)
    cos, sin = rope
    q, k = b.rope(q, cos, sin, cfg.rope_neox), b.rope(k, cos, sin, cfg.rope_neox)
    kv.k[layer_i, p0:p0 + T] = k
    kv.v[layer_i, p0:p0 + T] = v
    out = b.attention(q, kv.k[layer_i, :p0 + T], kv.v[layer_i, :p0 + T], p0)  # [T, H * Dv]
    return b.linear(layer.attn_output, out)  # [T, D]


ATTENTION = {"gqa": gqa_block}
