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
plus, for qwen2moe, a shared expert every token uses, scaled by sigmoid(x @ ffn_gate_inp_shexp).

Experts are fetched through the expert cache (`cache.expert(layer, e)`), never from the model directly: this file
does not know where an expert's bytes live (mmap, a VRAM slot, ...). Once they are computed, `cache.finish(layer)`
lets the cache copy the experts it promoted into their slots (never under an expert this call reads from a slot).
Tokens are grouped by expert so each chosen expert's weights are read once per call, however many tokens routed to
it: in decode that is K experts; in a prefill of T tokens at most E.
"""
from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def route(logits: np.ndarray, k: int, norm_topk: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [T, E] -> (expert ids int [T, K], weights float32 [T, K]), highest probability first."""
    probs = softmax(logits.astype(np.float32))  # [T, E]
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [T, K]
    w = np.take_along_axis(probs, ids, axis=-1)  # [T, K]
    if norm_topk:
        w = w / w.sum(axis=-1, keepdims=True)
    return ids, w.astype(np.float32)


def swiglu_expert(backend, ex, types, x: np.ndarray) -> np.ndarray:
    """One expert on the tokens routed to it: x [n, D] -> [n, D]. `ex` = raw gate/up/down rows, `types` their qtypes."""
    gate = backend.linear_raw(ex.gate, types["gate"], x)  # [n, F]
    up = backend.linear_raw(ex.up, types["up"], x)  # [n, F]
    return backend.linear_raw(ex.down, types["down"], silu(gate) * up)  # [n, D]


def moe_block(layer, x: np.ndarray, cache, backend, phase: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, D] (already ffn-normed) -> (y [T, D], expert ids [T, K], their weights [T, K]). `layer`: model.Layer."""
    cfg = layer.cfg
    logits = backend.linear(layer.ffn_gate_inp, x)  # [T, E]
    ids, w = getattr(backend, "route", route)(logits, cfg.n_expert_used, cfg.norm_topk)  # [T, K], [T, K]
    cache.lookup(layer.index, ids, phase)

    experts = {e: cache.expert(layer.index, e) for e in np.unique(ids).tolist()}  # each chosen expert once
    fused = getattr(backend, "moe_experts", None)  # a backend's fused kernel for all of them (CPU: integer path)
    y = fused(experts, layer.expert_types, x, ids, w) if fused else None  # [T, D], or None: no fused path
    if y is None:  # the plain path: one expert at a time, on all of its tokens
        y = np.zeros_like(x)  # [T, D]
        for e, ex in experts.items():
            tok, slot = np.nonzero(ids == e)  # tokens routed to e, and at which of their K positions
            out = swiglu_expert(backend, ex, layer.expert_types, x[tok])  # [n, D]
            y[tok] += w[tok, slot][:, None] * out
    finish = getattr(cache, "finish", None)  # (a stand-in cache in a test may have nothing to finish)
    if finish is not None:
        finish(layer.index)

    if cfg.has_shared_expert:
        sh = layer.shared
        h = silu(backend.linear(sh["gate"], x)) * backend.linear(sh["up"], x)  # [T, S]
        gate = sigmoid((x * sh["gate_inp"]).sum(axis=-1, keepdims=True))  # [T, 1]; per-row order, as in decode
        y += gate * backend.linear(sh["down"], h)
    return y, ids, w
