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
plus, for "moe+shared" in the layer plan, a shared expert every token uses, scaled by sigmoid(x @ ffn_gate_inp_shexp)
(qwen2moe) or not at all (GLM). The router's softmax/top-K and the experts' SwiGLU are backend primitives (`route`,
`moe_experts`; their NumPy form: backends/reference.py).

Sigmoid routing (GLM-4.5, DeepSeek-V3; config.gating == "sigmoid", reference.route_sigmoid):
    probs  = sigmoid(logits)                          [T, E]   each expert scored on its own
    ids    = top-K of probs + exp_probs_b             [T, K]   a per-expert bias steers the choice only
    w      = probs[ids] (/ sum, if norm_topk) * expert_weights_scale
Softmax-weight routing (gpt-oss; config.gating == "softmax_weight", reference.route_softmax_weight): the router has a
bias, the K largest logits are chosen and softmaxed among themselves; the experts add biases after each product and
use OpenAI's clamped SwiGLU (reference.swiglu_oai, passed to the backend as an ExpertFFN).
A "dense" layer (GLM's and DeepSeek's first layers) is the SwiGLU MLP down(silu(gate(x)) * up(x)): `dense_block`.

Experts are fetched through the expert cache (`cache.expert(layer, e)`), never from the model directly: this file
does not know where an expert's bytes live (mmap, a VRAM slot, ...). Once they are computed, `cache.finish(layer)`
lets the cache copy the experts it promoted into their slots (never under an expert this call reads from a slot).
Tokens are grouped by expert so each chosen expert's weights are read once per call, however many tokens routed to
it: in decode that is K experts; in a prefill of T tokens at most E.
"""
from __future__ import annotations

import numpy as np

from pymoe.backends.reference import route_sigmoid, route_softmax_weight, sigmoid, silu


def moe_block(layer, x: np.ndarray, cache, backend, phase: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, D] (already ffn-normed) -> (y [T, D], expert ids [T, K], their weights [T, K]). `layer`: model.Layer."""
    cfg = layer.cfg
    logits = backend.linear(layer.ffn_gate_inp, x)  # [T, E]
    if not isinstance(x, np.ndarray):  # a device decode step (engine/model.py): route and experts on the device,
        # each expert read where the residency table says; the cache's lookups follow the step
        scale = 1.0 if cfg.expert_weights_scale in (0.0, 1.0) else cfg.expert_weights_scale
        groups = (cfg.n_expert_groups, cfg.n_group_used)  # DeepSeek's group-limited choice when > 1 groups
        if backend.lookups_in_step:  # the cache may send misses to the CPU: its lookup now, one sync for the layer
            ids, w = backend.route_on_device(layer.index, logits, cfg.n_expert_used, cfg.norm_topk, scale,
                                             cfg.gating, layer.expert_bias, layer.router_bias, groups)  # [1, K], [1, K]
            ids_h, w_h, x_h = backend.routing_to_host(ids, w, x)  # host
            cache.lookup(layer.index, ids_h, phase)
            experts = {e: cache.expert(layer.index, e) for e in sorted(set(ids_h.ravel().tolist()))}
            y = backend.experts_as_served(layer.index, experts, layer.expert_types, x, x_h, ids, w, ids_h, w_h,
                                          layer.shared, layer.ffn)  # [1, D] device
            cache.finish(layer.index)
            return y, ids, w
        return backend.moe_on_device(layer.index, logits, x, cfg.n_expert_used, cfg.norm_topk, scale,
                                     layer.expert_types, layer.shared, cfg.gating, layer.expert_bias,
                                     layer.router_bias, layer.ffn, groups)  # [1, D], [1, K], [1, K] device arrays
    if layer.router_bias is not None:  # gpt-oss
        logits = np.asarray(logits) + layer.router_bias
    if cfg.gating == "softmax_weight":  # gpt-oss: top-K logits, softmaxed among themselves
        ids, w = route_softmax_weight(np.asarray(logits), cfg.n_expert_used)  # [T, K], [T, K]
    elif cfg.gating == "sigmoid" or cfg.n_expert_groups > 1:  # GLM, DeepSeek-V3 (and V2's expert groups)
        ids, w = route_sigmoid(np.asarray(logits), cfg.n_expert_used, layer.expert_bias, cfg.norm_topk,
                               cfg.expert_weights_scale, cfg.n_expert_groups, cfg.n_group_used,
                               cfg.gating)  # [T, K], [T, K]
    else:
        ids, w = backend.route(logits, cfg.n_expert_used, cfg.norm_topk)  # [T, K], [T, K]
        if cfg.expert_weights_scale not in (0.0, 1.0):  # llama.cpp skips the scale at 0 and 1
            w = w * np.float32(cfg.expert_weights_scale)
    cache.lookup(layer.index, ids, phase)
    chosen = sorted(set(np.asarray(ids).ravel().tolist()))  # each chosen expert once, ascending (np.unique's ~2 us)
    experts = {e: cache.expert(layer.index, e) for e in chosen}
    y = backend.moe_experts(experts, layer.expert_types, x, ids, w, layer.ffn)  # [T, D]; ffn: gpt-oss's experts
    cache.finish(layer.index)  # the experts are computed: promoted ones may now be copied into their slots

    if layer.plan.ffn == "moe+shared":
        sh = layer.shared
        out = swiglu_mlp(backend, sh, x)  # [T, D]
        if "gate_inp" in sh:  # qwen2moe: a sigmoid gate per token
            out = sigmoid((x * sh["gate_inp"]).sum(axis=-1, keepdims=True)) * out  # [T, 1]; per-row order
        y += out
    return y, ids, w


def swiglu_mlp(backend, w: dict, x: np.ndarray) -> np.ndarray:
    """down(silu(gate(x)) * up(x)) with dense weights w {gate, up, down}: x [T, D] -> [T, D] (the shared expert's
    and a dense layer's MLP)."""
    h = silu(backend.linear(w["gate"], x)) * backend.linear(w["up"], x)  # [T, F]
    return backend.linear(w["down"], h)


def dense_block(layer, x: np.ndarray, cache, backend, phase: str) -> tuple[np.ndarray, None, None]:
    """A dense layer's SwiGLU MLP: x [T, D] (ffn-normed) -> (y [T, D], None, None): no routing, no experts."""
    if not isinstance(x, np.ndarray):  # a device decode step (engine/model.py)
        return backend.mlp_on_device(layer.dense, x), None, None
    return swiglu_mlp(backend, layer.dense, x), None, None


FFN = {"moe": moe_block, "moe+shared": moe_block, "dense": dense_block}  # a layer plan's FFN kind -> its block
