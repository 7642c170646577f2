"""The MoE block: route each token to K of E experts, run those experts (SwiGLU), mix their outputs.

Shape legend
    T  tokens in this forward call (T = 1 in decode)
    D  residual width (n_embd)
    E  routed experts per layer, K of them used per token (n_expert, n_expert_used)
    F  one expert's hidden size (n_ff_exp); S the shared expert's (n_ff_shexp)

The path, as llama.cpp computes it (build_moe_ffn):
    logits = x @ ffn_gate_inp.T                       [T, E]   the router
    probs  = softmax(logits)                          [T, E]
    ids    = top-K of probs                           [T, K]
    w      = probs[ids]  (/ sum(w) if norm_topk)      [T, K]
    y[t]   = sum_k w[t, k] * expert_{ids[t, k]}(x[t])  [T, D]
    expert(x) = down(silu(gate(x)) * up(x))
plus, for qwen2moe ("moe+shared" in the layer plan), a shared expert every token uses, scaled by
sigmoid(x @ ffn_gate_inp_shexp). The router's softmax/top-K and the experts' SwiGLU are backend primitives (`route`,
`moe_experts`; their NumPy form: backends/reference.py).

Experts are fetched through the expert cache (`cache.expert(layer, e)`), never from the model directly: this file
does not know where an expert's bytes live (mmap, a VRAM slot, ...). Once they are computed, `cache.finish(layer)`
lets the cache copy the experts it promoted into their slots (never under an expert this call reads from a slot).
Tokens are grouped by expert so each chosen expert's weights are read once per call, however many tokens routed to
it: in decode that is K experts; in a prefill of T tokens at most E.
"""
from __future__ import annotations

import numpy as np

from pymoe.backends.reference import sigmoid, silu


def moe_block(layer, x: np.ndarray, cache, backend, phase: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, D] (already ffn-normed) -> (y [T, D], expert ids [T, K], their weights [T, K]). `layer`: model.Layer."""
    cfg = layer.cfg
    logits = backend.linear(layer.ffn_gate_inp, x)  # [T, E]
    ids, w = backend.route(logits, cfg.n_expert_used, cfg.norm_topk)  # [T, K], [T, K]
    cache.lookup(layer.index, ids, phase)
    experts = {e: cache.expert(layer.index, e) for e in np.unique(ids).tolist()}  # each chosen expert once
    y = backend.moe_experts(experts, layer.expert_types, x, ids, w)  # [T, D]
    cache.finish(layer.index)  # the experts are computed: promoted ones may now be copied into their slots

    if layer.plan.ffn == "moe+shared":
        sh = layer.shared
        h = silu(backend.linear(sh["gate"], x)) * backend.linear(sh["up"], x)  # [T, S]
        gate = sigmoid((x * sh["gate_inp"]).sum(axis=-1, keepdims=True))  # [T, 1]; per-row order, as in decode
        y += gate * backend.linear(sh["down"], h)
    return y, ids, w


FFN = {"moe": moe_block, "moe+shared": moe_block}  # a layer plan's feed-forward kind -> its block
