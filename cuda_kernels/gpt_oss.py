"""gpt-oss's blocks in the device decode step (version 3): attention with a sliding window and sinks, the biased
top-K-then-softmax router, and the routed experts with biases and OpenAI's clamped SwiGLU.

What this is: three kernels (four launches) and their host wrappers, each taking and returning device arrays:

  decode_attention_ws(q, k, v, pos, window, sinks)   attention.decode_attention with a sliding window (window > 0:
                                    keys max(0, pos - window + 1) .. pos) and, per head, one sink logit that joins
                                    the softmax's denominator and maximum but has no value
  route_softmax_weight(logits, bias, k, ids, w)      the K largest of logits + bias (highest first, ties to the lower
                                    id), softmaxed among themselves (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)
  routed_experts_oai(...)           step.routed_experts with each expert's biases (gate/up float32 [E, F], down [E, D])
                                    and swiglu_oai between the products:
                                    h = swiglu_oai(gate x + b_gate[e], up x + b_up[e]), y += w (down h + b_down[e]);
                                    each expert read where the residency table says (slot, -1 the mapped file, -2
                                    left out: a "cpu" miss, which the CPU computes with its biases and adds)

The references (tests/test_cuda_gpt_oss_kernels.py compares each kernel with them): reference.attention with
`window` and `sinks`, reference.route_softmax_weight on logits + bias, and `routed_experts_oai_reference` (swiglu
with biases, reference.swiglu_oai, on the bytes the table points at, added in k order).
Versions: 1 (these), the structure of the kernels they extend (attention.py version 1: one block per head, three
passes; step.py's router: one thread per token; step.py's routed experts: one block per (row, pair), the down
kernel owning each (t, d) output and adding the token's K experts in k order).
Shape legend: H query heads, G KV heads, Dh / Dv head sizes, T tokens, K experts per token, P = T * K pairs,
E experts of a layer, D n_embd, F n_ff_exp.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .attention import THREADS as ATTN_THREADS
from .quant_matvec import THREADS, check, on_device
from .reduce import NEG_INF, block_max, block_sum
from .step import _chosen, routed_experts

ALPHA, LIMIT = 1.702, 7.0  # swiglu_oai's (ggml_swiglu_oai as llama.cpp calls it for gpt-oss; reference.swiglu_oai)


# ----------------------------------------------------------------------------------------------------------------
# Attention: a sliding window and sinks
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _attend_ws(q, k, v, first, n_keys, scale, sinks, has_sinks, scores, out, buf):
    """decode_attention_ws_kernel's body (buf: the block's shared float32 [ATTN_THREADS])."""
    h = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    g = h // (q.shape[0] // k.shape[1])  # the KV head this query head reads
    Dh = q.shape[1]

    # a. scaled scores and their maximum (with the sink's logit: the maximum ggml subtracts)
    best = NEG_INF
    for s in range(first + tid, n_keys, ATTN_THREADS):
        dot = np.float32(0.0)
        for d in range(Dh):
            dot += q[h, d] * k[s, g, d]
        score = dot * scale
        scores[h, s] = score
        if score > best:
            best = score
    best = block_max(buf, tid, best)
    if has_sinks and sinks[h] > best:
        best = sinks[h]

    # b. unnormalised probabilities and their sum, the sink's term added once
    total = np.float32(0.0)
    for s in range(first + tid, n_keys, ATTN_THREADS):
        e = math.exp(scores[h, s] - best)
        scores[h, s] = e
        total += e
    total = block_sum(buf, tid, total)
    if has_sinks:
        total += math.exp(sinks[h] - best)

    # c. the values, weighted
    for d in range(tid, v.shape[2], ATTN_THREADS):
        acc = np.float32(0.0)
        for s in range(first, n_keys):
            acc += scores[h, s] * v[s, g, d]
        out[h, d] = acc / total


@cuda.jit
def decode_attention_ws_kernel(q, k, v, first, n_keys, scale, sinks, has_sinks, scores, out):
    """q float32 [H, Dh], k [S_max, G, Dh], v [S_max, G, Dv], keys first..n_keys-1; sinks float32 [H];
    scores float32 [H, >= n_keys] scratch; out float32 [H, Dv]. grid (H,), block (ATTN_THREADS,).
    out[h] = sum_s exp(s_s - m) v_s / (sum_s exp(s_s - m) + exp(sink_h - m)), m = max(max_s s_s, sink_h)."""
    buf = cuda.shared.array(ATTN_THREADS, np.float32)
    _attend_ws(q, k, v, first, n_keys, scale, sinks, has_sinks, scores, out, buf)


@cuda.jit
def decode_attention_ws_at_kernel(q, k, v, at, window, scale, sinks, has_sinks, scores, out):
    """decode_attention_ws_kernel at position at[0] (int32 in device memory: a device step's, so that a CUDA graph
    replays the launch at every position): keys max(0, at[0] - window + 1)..at[0] (window 0: from 0)."""
    buf = cuda.shared.array(ATTN_THREADS, np.float32)
    n_keys = at[0] + 1
    if n_keys > k.shape[0]:  # (the host checks the position before it uploads it)
        n_keys = k.shape[0]
    first = 0
    if window > 0 and n_keys > window:
        first = n_keys - window
    _attend_ws(q, k, v, first, n_keys, scale, sinks, has_sinks, scores, out, buf)


def decode_attention_ws(q, k_cache, v_cache, pos: int, window: int, sinks, out, scores, stream=0):
    """q float32 [H, Dh] (one token at position pos), k_cache [S_max, G, Dh], v_cache [S_max, G, Dv] (rows 0..pos
    filled), window (0: none), sinks float32 [H] or None (device) -> out float32 [H, Dv]; scores float32
    [H, >= pos + 1] scratch. pos: an int, or int32 [1] in device memory that the kernel reads
    (`decode_attention_ws_at_kernel`; scores then [H, S_max])."""
    q, k, v = on_device(q, "q"), on_device(k_cache, "k_cache"), on_device(v_cache, "v_cache")
    out, scores = on_device(out, "out"), on_device(scores, "scores")
    check(q, "q", np.float32, 2)
    H, Dh = q.shape
    S_max, G, _ = k.shape
    at = None
    if not isinstance(pos, (int, np.integer)):  # int32 [1] on the device: decode_attention_ws_at_kernel
        at = on_device(pos, "pos")
        check(at, "pos", np.int32, 1)
        pos = S_max - 1  # (the scratch and the checks below: the whole cache)
    if k.shape[2] != Dh or v.shape[:2] != k.shape[:2] or G == 0 or H % G or not 0 <= pos < S_max:
        raise ValueError(f"decode_attention_ws: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} at "
                         f"position {pos} do not fit")
    if tuple(out.shape) != (H, v.shape[2]) or scores.shape[0] != H or scores.shape[1] < pos + 1:
        raise ValueError(f"decode_attention_ws: out {tuple(out.shape)} must be {(H, v.shape[2])}, scores "
                         f"{tuple(scores.shape)} at least {(H, pos + 1)}")
    has_sinks = sinks is not None
    sinks = on_device(sinks, "sinks") if has_sinks else scores[:, 0]  # (unread without sinks)
    if at is not None:
        decode_attention_ws_at_kernel[H, ATTN_THREADS, stream](q, k, v, at, int(window),
                                                               np.float32(1.0 / math.sqrt(Dh)), sinks, has_sinks,
                                                               scores, out)
        return out
    first = max(0, pos - window + 1) if window else 0
    decode_attention_ws_kernel[H, ATTN_THREADS, stream](q, k, v, first, pos + 1, np.float32(1.0 / math.sqrt(Dh)),
                                                        sinks, has_sinks, scores, out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The router: the K largest biased logits, softmaxed among themselves
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit
def route_softmax_weight_kernel(logits, bias, has_bias, k, ids, w):
    """logits float32 [T, E], bias float32 [E] -> ids int32 [T, K], w float32 [T, K]; grid (T,), block (1,).
    l = logits + bias (when has_bias); the K largest l, highest first, ties to the lower id (strict >, as a stable
    argsort); w = exp(l_j - l_0) / sum_j exp(l_j - l_0) (l_0 the largest)."""
    t = cuda.blockIdx.x
    E = logits.shape[1]
    for j in range(k):
        best = -1
        bl = np.float32(0.0)
        for e in range(E):
            if not _chosen(ids, t, j, e):
                v = logits[t, e] + bias[e] if has_bias else logits[t, e]
                if best < 0 or v > bl:
                    best = e
                    bl = v
        ids[t, j] = best
        w[t, j] = bl
    top = w[t, 0]
    total = np.float32(0.0)
    for j in range(k):
        v = math.exp(w[t, j] - top)
        w[t, j] = v
        total += v
    for j in range(k):
        w[t, j] = w[t, j] / total


def route_softmax_weight(logits, bias, k: int, ids, w, stream=0):
    """Router logits [T, E] and bias [E] (device) or None -> (ids int32 [T, K], weights float32 [T, K]) written
    into ids, w; returns them."""
    logits, ids, w = on_device(logits, "logits"), on_device(ids, "ids"), on_device(w, "w")
    check(logits, "logits", np.float32, 2)
    check(ids, "ids", np.int32, 2)
    check(w, "w", np.float32, 2)
    T, E = logits.shape
    has_bias = bias is not None
    bias = (on_device(bias, "bias") if has_bias else logits[0] if T  # (a row standing in, unread: no
            else cuda.device_array(E, np.float32))  # allocation, so that a CUDA graph replays the launch)
    if tuple(ids.shape) != (T, k) or tuple(w.shape) != (T, k) or tuple(bias.shape) != (E,) or not 1 <= k <= E:
        raise ValueError(f"route_softmax_weight: ids {tuple(ids.shape)}, w {tuple(w.shape)} must be ({T}, {k}), "
                         f"bias {tuple(bias.shape)} ({E},), k <= E")
    if T:
        route_softmax_weight_kernel[(T,), 1, stream](logits, bias, has_bias, k, ids, w)
    return ids, w


# ----------------------------------------------------------------------------------------------------------------
# The routed experts: biases and the clamped SwiGLU, read where the residency table says
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def swiglu_oai(a, c):
    """gpt-oss's clamped SwiGLU for one element (reference.swiglu_oai): g = min(gate, limit), u = clamp(up, -limit,
    limit); g sigmoid(alpha g) (u + 1). The routed experts' ACTIVATE in `routed_experts_oai`."""
    if a > np.float32(LIMIT):
        a = np.float32(LIMIT)
    if c > np.float32(LIMIT):
        c = np.float32(LIMIT)
    if c < np.float32(-LIMIT):
        c = np.float32(-LIMIT)
    return a / (np.float32(1.0) + math.exp(np.float32(ALPHA) * -a)) * (c + np.float32(1.0))


def routed_experts_oai(slots, host, table, offsets, part_off, row_bytes, types, shape, ids, w, X, Y, H, biases,
                       stream=0):
    """Y [T, D] = the routed experts of one gpt-oss layer (see the module docstring): step.routed_experts's
    kernels with BIASED (biases (gate [E, F], up [E, F], down [E, D]) float32 device arrays) and swiglu_oai;
    shape (D, F); H float32 [P, F] scratch. Returns Y."""
    return routed_experts(slots, host, table, offsets, part_off, row_bytes, types, shape, ids, w, X, Y, H, stream,
                          biases=biases, activate=swiglu_oai, form="oai")


def routed_experts_oai_reference(read, types: dict, ids: np.ndarray, w: np.ndarray, X: np.ndarray,
                                 biases: tuple) -> np.ndarray:
    """NumPy twin of `routed_experts_oai`: read(e) -> (gate, up, down) raw rows of expert e (step.expert_bytes), or
    None for an expert left out; biases (gate [E, F], up [E, F], down [E, D]);
    y[t] = sum over k, in order, of w[t, k] * (down h + b_down[e]), h = swiglu_oai(gate X[t] + b_gate[e],
    up X[t] + b_up[e])  (float32)."""
    from pymoe import quant
    from pymoe.backends.reference import swiglu_oai

    b_gate, b_up, b_down = biases
    T, K = ids.shape
    Y = np.zeros((T, X.shape[1]), np.float32)  # [T, D]
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            rows = read(e)
            if rows is None:  # table -2: computed elsewhere
                continue
            g, u, d = (quant.dequantize(a, types[p]) for a, p in zip(rows, ("gate", "up", "down")))
            x = X[t].astype(np.float32)
            h = swiglu_oai((g @ x).astype(np.float32) + b_gate[e], (u @ x).astype(np.float32) + b_up[e])  # [F]
            Y[t] += np.float32(w[t, k]) * ((d @ h).astype(np.float32) + b_down[e])
    return Y


__all__ = ["decode_attention_ws", "route_softmax_weight", "routed_experts_oai", "routed_experts_oai_reference"]
