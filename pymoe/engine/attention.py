"""The attention blocks: one function per attention kind, written once over the backend's primitives.

What this is: `gqa_block(backend, layer, x, kvs, layer_i, rope)`, the softmax attention of every supported arch:
    q, k, v = x @ attn_q.T, x @ attn_k.T, x @ attn_v.T    (+ q/k/v biases: qwen2moe, glm4moe, gpt-oss)
    q, k    = rmsnorm(q), rmsnorm(k)                     (q/k norm: per head, qwen3moe; over the projection, olmoe)
    q, k    = rope(q), rope(k)                           (NEOX or normal pairs, each row at its own position)
    kv[layer, kv.n ..] = k, v
    out     = attention(q, kv[layer, :kv.n + T]) @ attn_output.T   (+ output bias: gpt-oss)
              (a sliding window on the layers the plan says, and per-head sinks: gpt-oss)
Every block has the same three parts, for the rows of one sequence (prefill, decode) or of N (a batched decode step):
    project  all rows at once: the projections (the weight reads that dominate a decode step), norms, RoPE
    core     per sequence (engine/kv.py `segments`): write its new K/V (or advance its recurrent state), attend
             over its own cache
    output   all rows at once: the output gate and projection
The single-sequence forward is the N = 1 case of the same code: one cache, its T new tokens as the rows.
`ATTENTION` maps a layer plan's attention kind (gguf/config.LayerPlan) to its block. A new kind (gated attention,
Gated DeltaNet, MLA, sliding window) is one more function here, over the same primitives, plus its per-layer state
in engine/kv.py; docs/adding-a-model.md walks through it.
What this is not: the arithmetic (the backend's: backends/protocol.py), or the KV storage (engine/kv.py).
Shapes: T rows (new tokens), H query heads, G = n_head_kv, Dh / Dv key / value head size, D n_embd.
"""
from __future__ import annotations

import numpy as np

from .deltanet import gdn_block
from .kv import join_rows, segments
from .mla import mla_block


def gqa_block(b, layer, x: np.ndarray, kvs: list, layer_i: int, rope: tuple) -> np.ndarray:
    """x [T, D] (attn-normed, host) -> [T, D] (host); writes each sequence's new keys and values into its cache at
    positions kv.n ... rope: (cos, sin) [T, rope_dim / 2] of each row's position (reference.rope_tables).
    Between `to_device` and `to_host` the arrays live where the backend computes (CUDA: device memory)."""
    cfg, eps = layer.cfg, layer.cfg.rms_eps
    H, G, Dh, Dv = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v
    T = x.shape[0]
    # project: all rows
    x = b.to_device(x)  # [T, D]
    q, k, v = b.linear_many([layer.attn_q, layer.attn_k, layer.attn_v], x)  # [T, H*Dh], [T, G*Dh], [T, G*Dv]
    gate = None
    if layer.plan.attention == "gated":  # qwen3next: per head a query then an output gate
        q, gate = b.split_gate(q, Dh)  # [T, H*Dh] each
    if layer.bias:  # qwen2moe
        q, k, v = b.add(q, layer.bias["q"]), b.add(k, layer.bias["k"]), b.add(v, layer.bias["v"])
    if cfg.qk_norm == "full":  # olmoe: over the whole projection, before splitting into heads
        q, k = b.rmsnorm(q, layer.q_norm, eps), b.rmsnorm(k, layer.k_norm, eps)
    q, k, v = b.view(q, (T, H, Dh)), b.view(k, (T, G, Dh)), b.view(v, (T, G, Dv))
    if cfg.qk_norm == "head":  # qwen3moe: each head separately
        q, k = b.rmsnorm(q, layer.q_norm, eps), b.rmsnorm(k, layer.k_norm, eps)
    cos, sin = rope
    q, k = b.rope(q, cos, sin, cfg.rope_neox), b.rope(k, cos, sin, cfg.rope_neox)
    # core: per sequence, over its own cache
    outs = []
    for kv, rows in segments(kvs, T):
        p0, n = kv.n, rows.stop - rows.start
        b.kv_write(kv, layer_i, p0, k[rows], v[rows])
        outs.append(b.attention(q[rows], *b.kv_read(kv, layer_i, p0 + n), p0, layer.plan.window,
                                layer.sinks))  # [n, H * Dv]
    out = join_rows(b, outs)  # [T, H * Dv]
    # output: all rows
    if gate is not None:
        out = b.gate_output(out, gate)  # [T, H * Dv] out * sigmoid(gate)
    y = b.linear(layer.attn_output, out)  # [T, D]
    if layer.out_bias is not None:  # gpt-oss
        y = b.add(y, layer.out_bias)
    return b.to_host(y)  # [T, D]


ATTENTION = {"gqa": gqa_block, "gated": gqa_block, "gdn": gdn_block, "mla": mla_block}
# Kinds whose block computes on host arrays between primitives (no device kernels yet): a device backend runs them
# on its host side (`backend.host_backend`, CUDA: its CPU backend; engine/model.py Model.attention_backend).
HOST_ATTENTION = {"mla"}
