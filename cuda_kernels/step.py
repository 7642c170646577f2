"""The decode step on the device (version 3): the kernels that keep the residual stream, the routing and the token
on the GPU, so that a decode step moves only the token id in and the token id plus the routing ids out.

What this is: small kernels plus their host wrappers, each taking and returning device arrays:

  embed(w, qtype, tokens, out)      out[t] = row tokens[t] of w, decoded (token_embd's raw GGUF rows on the device)
  add(Y, X)                         Y += X                          (the residual adds; Y, X float32 [T, n])
  swiglu(G, U)                      G = silu(G) * U                 (the shared expert's hidden row)
  sigmoid_gate(Y, X, g)             Y[t] *= sigmoid(X[t] . g)       (qwen2moe's shared-expert gate)
  route_softmax(logits, k, ...)     softmax, top-K (highest first, ties to the lower id), renormalised over the K
                                    when norm_topk, times `scale`   -> ids int32 [T, K], weights float32 [T, K]
  route_sigmoid(logits, k, bias, ..) sigmoid, top-K of probs + bias (the bias only chooses), weights the unbiased
                                    probs (/ their sum), times `scale` (GLM-4.5)
  argmax(logits, out)               out[t] = the first index of the largest logit of row t  (greedy decoding)
  routed_experts(...)               y[t] = sum_k w[t, k] * expert_{ids[t, k]}(X[t]), each expert read from its slot
                                    (table[e] >= 0: the slot's bytes in VRAM) or, table[e] == -1, from the mapped
                                    model file over PCIe at its byte offset: the residency table replaces the host's
                                    per-expert dispatch, so no host round trip decides where an expert is read;
                                    table[e] == -2: left out (a "cpu" miss, which the CPU computes and adds).

The references (tests/test_cuda_step_kernels.py compares each kernel with them): `reference.route` and
`reference.route_sigmoid` (the routers of backends/reference.py), quant.dequantize(w)[tokens], np.argmax, `+`,
reference.silu and reference.sigmoid, and for the routed experts swiglu on the bytes the table points at, added in
k order (`routed_experts_reference`).

Versions: 1 (these). route_softmax runs one thread per token (E <= a few hundred: a single pass of loops is a few
microseconds; a block-wide top-K is the next step if it ever shows). The routed expert kernels are moe.py's
version 2 (one block per (row, pair), the routing weight applied in the down kernel, which owns each (t, d) output
and adds the K experts of token t in k order: no atomics, no zeroed output).
Shape legend: T tokens, K experts per token, P = T * K pairs, E experts of a layer, D n_embd, F n_ff_exp, V vocab.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from pymoe.quant import get_format

from .quant_matvec import THREADS, check, on_device, retarget, row_partial_for, specialise
from .reduce import block_sum, block_sum_rows

# Placeholders bound per format by quant_matvec.specialise (the same names row_partial uses)
SCALE = CODE = None
QK = TYPE_SIZE = GROUP = GROUPS = 0
DECODE_ROW = GATE_PARTIAL = UP_PARTIAL = DOWN_PARTIAL = None
# the routed experts' form, bound by retarget beside the row dots: BIASED adds each expert's gate/up/down biases,
# ACTIVATE(gate, up) -> h (silu(gate) * up here; gpt-oss's clamped SwiGLU: cuda_kernels/gpt_oss.py)
BIASED = False
ACTIVATE = None
_KERNELS: dict = {}


# ----------------------------------------------------------------------------------------------------------------
# Embedding rows
# ----------------------------------------------------------------------------------------------------------------
def decode_row_into(row, out, t, first, step):
    """out[t, :] = the weights of one raw row (uint8 [S]), units first, first + step, ... (quant_matvec.decode_rows)."""
    n_units = (row.shape[0] // TYPE_SIZE) * GROUPS
    for u in range(first, n_units, step):
        b = u // GROUPS
        g = u - b * GROUPS
        s = b * TYPE_SIZE
        k0 = g * GROUP
        dl, ml = SCALE(row, s, g)
        for i in range(GROUP):
            out[t, b * QK + k0 + i] = dl * CODE(row, s, k0 + i) - ml


def embed_kernel(w, tokens, out):
    """w uint8 [V, S], tokens int32 [T] -> out float32 [T, D]; grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    DECODE_ROW(w[tokens[t]], out, t, cuda.threadIdx.x, THREADS)


def embed(w, qtype, tokens, out, stream=0):
    """out[t] = row tokens[t] of the raw rows w (uint8 [V, S] of `qtype`), decoded; returns out."""
    w, tokens, out = on_device(w, "w"), on_device(tokens, "tokens"), on_device(out, "out")
    check(out, "out", np.float32, 2)
    qtype = get_format(qtype).qtype
    key = ("embed", qtype)
    if key not in _KERNELS:
        _KERNELS[key] = retarget(embed_kernel, cuda.jit, f"embed_kernel_{qtype.name}",
                                 DECODE_ROW=specialise(decode_row_into, qtype, "cuda"))
    if tokens.shape[0]:
        _KERNELS[key][(tokens.shape[0],), THREADS, stream](w, tokens, out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Residual add
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit
def add_kernel(Y, X):
    """Y float32 [T, n] += X float32 [T, n]; grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    for i in range(cuda.threadIdx.x, Y.shape[1], THREADS):
        Y[t, i] += X[t, i]


def _rowwise(kernel, what: str, A, B, names: str, stream):
    """Launch an element-wise kernel of two same-shaped [T, n] device arrays, one block a row; -> A (written)."""
    A, B = on_device(A, names[0]), on_device(B, names[1])
    if tuple(A.shape) != tuple(B.shape) or len(A.shape) != 2:
        raise ValueError(f"{what}: {names[0]} {tuple(A.shape)} and {names[1]} {tuple(B.shape)} must be the same [T, n]")
    if A.shape[0]:
        kernel[(A.shape[0],), THREADS, stream](A, B)
    return A


def add(Y, X, stream=0):
    return _rowwise(add_kernel, "add", Y, X, "YX", stream)


# ----------------------------------------------------------------------------------------------------------------
# The shared expert's activation and gate (qwen2moe)
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit
def swiglu_kernel(G, U):
    """G float32 [T, n] = silu(G) * U (the shared expert's hidden row); grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    for i in range(cuda.threadIdx.x, G.shape[1], THREADS):
        a = G[t, i]
        G[t, i] = a / (np.float32(1.0) + math.exp(-a)) * U[t, i]


def swiglu(G, U, stream=0):
    return _rowwise(swiglu_kernel, "swiglu", G, U, "GU", stream)


@cuda.jit
def sigmoid_gate_kernel(Y, X, g):
    """Y[t] *= sigmoid(X[t] . g): Y float32 [T, D], X float32 [T, D], g float32 [D] (qwen2moe's shared-expert
    gate); grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    acc = np.float32(0.0)
    for i in range(tid, X.shape[1], THREADS):
        acc += X[t, i] * g[i]
    buf = cuda.shared.array(THREADS, np.float32)
    z = block_sum(buf, tid, acc)
    s = np.float32(1.0) / (np.float32(1.0) + math.exp(-z))
    for i in range(tid, Y.shape[1], THREADS):
        Y[t, i] *= s


def sigmoid_gate(Y, X, g, stream=0):
    Y, X, g = on_device(Y, "Y"), on_device(X, "X"), on_device(g, "g")
    if tuple(Y.shape) != tuple(X.shape) or tuple(g.shape) != (X.shape[1],):
        raise ValueError(f"sigmoid_gate: Y {tuple(Y.shape)}, X {tuple(X.shape)} must be [T, D], g {tuple(g.shape)} [D]")
    if Y.shape[0]:
        sigmoid_gate_kernel[(Y.shape[0],), THREADS, stream](Y, X, g)
    return Y


# ----------------------------------------------------------------------------------------------------------------
# The router: softmax, top-K
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def _chosen(ids, t, j, e):
    """Whether expert e is among row t's first j picks (ids[t, :j]): the top-K loops' one-pass selection."""
    for i in range(j):
        if ids[t, i] == e:
            return True
    return False


@cuda.jit
def route_softmax_kernel(logits, k, norm_topk, scale, ids, w):
    """logits float32 [T, E] -> ids int32 [T, K], w float32 [T, K]; grid (T,), block (1,).
    probs = exp(l - max) / sum exp(l - max); the K largest probs, highest first, ties to the lower id (strict >),
    as reference.route's stable argsort; w = probs (/ their sum if norm_topk) * scale."""
    t = cuda.blockIdx.x
    E = logits.shape[1]
    m = logits[t, 0]
    for e in range(1, E):
        if logits[t, e] > m:
            m = logits[t, e]
    s = np.float32(0.0)
    for e in range(E):
        s += math.exp(logits[t, e] - m)
    total = np.float32(0.0)
    for j in range(k):
        best = -1
        bp = np.float32(0.0)
        for e in range(E):
            if not _chosen(ids, t, j, e):
                p = math.exp(logits[t, e] - m) / s
                if best < 0 or p > bp:
                    best = e
                    bp = p
        ids[t, j] = best
        w[t, j] = bp
        total += bp
    for j in range(k):
        v = w[t, j]
        if norm_topk:
            v = v / total
        w[t, j] = v * scale


def route_softmax(logits, k: int, norm_topk: bool, ids, w, scale: float = 1.0, stream=0):
    """Router logits [T, E] -> (ids int32 [T, K], weights float32 [T, K]) written into ids, w; returns them."""
    logits, ids, w = on_device(logits, "logits"), on_device(ids, "ids"), on_device(w, "w")
    check(logits, "logits", np.float32, 2)
    check(ids, "ids", np.int32, 2)
    check(w, "w", np.float32, 2)
    T = logits.shape[0]
    if tuple(ids.shape) != (T, k) or tuple(w.shape) != (T, k) or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"route_softmax: ids {tuple(ids.shape)}, w {tuple(w.shape)} must be ({T}, {k}), "
                         f"k <= E = {logits.shape[1]}")
    if T:
        route_softmax_kernel[(T,), 1, stream](logits, k, bool(norm_topk), np.float32(scale), ids, w)
    return ids, w


@cuda.jit(device=True)
def _normalise_weights(w, t, k, total, norm_topk, scale):
    """Row t's K chosen probabilities w[t, :k] (their sum `total`) -> the routing weights: / max(total, 2^-14) if
    norm_topk (llama.cpp's clamp), then * scale. The sigmoid and group-limited routers' last step."""
    if total < np.float32(6.103515625e-5):
        total = np.float32(6.103515625e-5)
    for j in range(k):
        v = w[t, j]
        if norm_topk:
            v = v / total
        w[t, j] = v * scale


@cuda.jit
def route_sigmoid_kernel(logits, bias, has_bias, k, norm_topk, scale, ids, w):
    """logits float32 [T, E], bias float32 [E] -> ids int32 [T, K], w float32 [T, K]; grid (T,), block (1,).
    probs = sigmoid(l); the K largest probs + bias (the bias only chooses: GLM-4.5, DeepSeek-V3), highest first,
    ties to the lower id; w = probs (/ max(their sum, 2^-14) if norm_topk, as llama.cpp) * scale."""
    t = cuda.blockIdx.x
    E = logits.shape[1]
    total = np.float32(0.0)
    for j in range(k):
        best = -1
        bc = np.float32(0.0)
        bp = np.float32(0.0)
        for e in range(E):
            if not _chosen(ids, t, j, e):
                p = np.float32(1.0) / (np.float32(1.0) + math.exp(-logits[t, e]))
                c = p + bias[e] if has_bias else p
                if best < 0 or c > bc:
                    best = e
                    bc = c
                    bp = p
        ids[t, j] = best
        w[t, j] = bp
        total += bp
    _normalise_weights(w, t, k, total, norm_topk, scale)


def route_sigmoid(logits, k: int, bias, norm_topk: bool, ids, w, scale: float = 1.0, stream=0):
    """Sigmoid routing (reference.route_sigmoid without expert groups): logits [T, E], bias float32 [E] (device) or
    None -> ids int32 [T, K], weights float32 [T, K] written into ids, w; returns them."""
    logits, ids, w = on_device(logits, "logits"), on_device(ids, "ids"), on_device(w, "w")
    check(logits, "logits", np.float32, 2)
    T, E = logits.shape
    if tuple(ids.shape) != (T, k) or tuple(w.shape) != (T, k) or not 1 <= k <= E:
        raise ValueError(f"route_sigmoid: ids {tuple(ids.shape)}, w {tuple(w.shape)} must be ({T}, {k}), k <= E = {E}")
    has_bias = bias is not None
    bias = (on_device(bias, "bias") if has_bias else logits[0] if T  # (a row standing in, unread: no
            else cuda.device_array(E, np.float32))  # allocation, so that a CUDA graph replays the launch)
    if T:
        route_sigmoid_kernel[(T,), 1, stream](logits, bias, has_bias, k, bool(norm_topk), np.float32(scale), ids, w)
    return ids, w


# ----------------------------------------------------------------------------------------------------------------
# Greedy: argmax
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit
def argmax_kernel(logits, out):
    """logits float32 [T, V] -> out int32 [T]: the first index of the maximum; grid (T,), block (THREADS,)."""
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    best = -1
    bv = np.float32(0.0)
    for i in range(tid, logits.shape[1], THREADS):  # ascending i: a later equal value never wins
        if best < 0 or logits[t, i] > bv:
            best = i
            bv = logits[t, i]
    vals = cuda.shared.array(THREADS, np.float32)
    idx = cuda.shared.array(THREADS, np.int32)
    vals[tid] = bv
    idx[tid] = best
    cuda.syncthreads()
    stride = THREADS // 2
    while stride > 0:
        if tid < stride:
            j = idx[tid + stride]
            if j >= 0 and (idx[tid] < 0 or vals[tid + stride] > vals[tid]
                           or (vals[tid + stride] == vals[tid] and j < idx[tid])):
                vals[tid] = vals[tid + stride]
                idx[tid] = j
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        out[t] = idx[0]


def argmax(logits, out, stream=0):
    logits, out = on_device(logits, "logits"), on_device(out, "out")
    check(logits, "logits", np.float32, 2)
    check(out, "out", np.int32, 1)
    if logits.shape[0]:
        argmax_kernel[(logits.shape[0],), THREADS, stream](logits, out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The routed experts, read where the residency table says
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def silu_times(a, c):
    """silu(a) * c: SwiGLU's product for one element (the routed experts' ACTIVATE unless bound otherwise)."""
    return a / (np.float32(1.0) + math.exp(-a)) * c


def routed_gate_up_kernel(slots, host, table, offsets, part_off, row_bytes, ids, X, b_gate, b_up, H):
    """H[p, f] = ACTIVATE(gate_e row f . X[t] (+ b_gate[e, f]), up_e row f . X[t] (+ b_up[e, f])) for pair
    p = t * K + k, e = ids[t, k]; the biases only when BIASED.
    slots uint8 [N, slot_bytes]; host uint8 [file bytes] (mapped); table int32 [E]; offsets int64 [E, 3] (each
    expert's gate/up/down bytes in the file); part_off int64 [3] (in a slot); row_bytes int64 [3]; b_gate, b_up
    float32 [E, F] (BIASED) or any float32 2-D array (not read); grid (F, P), block (THREADS,)."""
    f = cuda.blockIdx.x
    p = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    K = ids.shape[1]
    t = p // K
    e = ids[t, p - t * K]
    s = table[e]
    g = cuda.local.array(1, np.float32)
    u = cuda.local.array(1, np.float32)
    g[0] = 0.0
    u[0] = 0.0
    rg, ru = row_bytes[0], row_bytes[1]
    if s >= 0:  # uniform in the block: the barriers below are reached by every thread
        GATE_PARTIAL(slots[s, part_off[0] + f * rg:part_off[0] + (f + 1) * rg], X, t, 1, tid, THREADS, g)
        UP_PARTIAL(slots[s, part_off[1] + f * ru:part_off[1] + (f + 1) * ru], X, t, 1, tid, THREADS, u)
    elif s == -1:
        GATE_PARTIAL(host[offsets[e, 0] + f * rg:offsets[e, 0] + (f + 1) * rg], X, t, 1, tid, THREADS, g)
        UP_PARTIAL(host[offsets[e, 1] + f * ru:offsets[e, 1] + (f + 1) * ru], X, t, 1, tid, THREADS, u)
    buf = cuda.shared.array((1, THREADS), np.float32)
    block_sum_rows(buf, tid, g, 1)
    block_sum_rows(buf, tid, u, 1)
    if tid == 0:
        a = g[0]
        c = u[0]
        if BIASED:
            a += b_gate[e, f]
            c += b_up[e, f]
        H[p, f] = ACTIVATE(a, c)


def routed_down_kernel(slots, host, table, offsets, part_off, row_bytes, ids, w, H, b_down, Y):
    """Y[t, d] = sum over k, in order, of w[t, k] * (down_e row d . H[t * K + k] (+ b_down[e, d] when BIASED)),
    experts left out (table -2: computed elsewhere, bias included) skipped; b_down float32 [E, D] or any float32
    2-D array (not read); grid (D, T), block (THREADS,)."""
    d = cuda.blockIdx.x
    t = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    K = ids.shape[1]
    rd = row_bytes[2]
    acc = cuda.local.array(1, np.float32)
    buf = cuda.shared.array((1, THREADS), np.float32)
    total = np.float32(0.0)
    for j in range(K):
        e = ids[t, j]
        s = table[e]
        p = t * K + j
        acc[0] = 0.0
        if s >= 0:
            DOWN_PARTIAL(slots[s, part_off[2] + d * rd:part_off[2] + (d + 1) * rd], H, p, 1, tid, THREADS, acc)
        elif s == -1:
            DOWN_PARTIAL(host[offsets[e, 2] + d * rd:offsets[e, 2] + (d + 1) * rd], H, p, 1, tid, THREADS, acc)
        block_sum_rows(buf, tid, acc, 1)
        if s != -2:
            if BIASED:
                total += w[t, j] * (acc[0] + b_down[e, d])
            else:
                total += w[t, j] * acc[0]
    if tid == 0:
        Y[t, d] = total


def routed_experts(slots, host, table, offsets, part_off, row_bytes, types, shape, ids, w, X, Y, H, stream=0,
                   biases=None, activate=silu_times, form: str = ""):
    """Y [T, D] = the routed experts of one layer (see the module docstring); shape (D, F); H float32 [P, F]
    scratch. All arrays on the device (host: the mapped file); returns Y. biases (gate [E, F], up [E, F], down
    [E, D]) float32 device arrays, or None; activate: the device function (gate, up) -> h; form names the pair
    (biases, activate) in the compiled kernels' names ("oai": gpt-oss's, gpt_oss.routed_experts_oai)."""
    D, F = shape
    T, K = ids.shape
    if T == 0:
        return Y
    key = ("routed", form) + tuple(get_format(types[p]).qtype for p in ("gate", "up", "down"))
    if key not in _KERNELS:
        gq, uq, dq = key[2:]
        name = f"{form + '_' if form else ''}{gq.name}_{uq.name}_{dq.name}"
        form_ = dict(BIASED=biases is not None, ACTIVATE=activate)
        _KERNELS[key] = (
            retarget(routed_gate_up_kernel, cuda.jit, f"routed_gate_up_{name}",
                     GATE_PARTIAL=row_partial_for(gq), UP_PARTIAL=row_partial_for(uq), **form_),
            retarget(routed_down_kernel, cuda.jit, f"routed_down_{name}", DOWN_PARTIAL=row_partial_for(dq), **form_))
    gate_up, down = _KERNELS[key]
    b_gate, b_up, b_down = (H, H, H) if biases is None else biases  # unbiased: never read, any float32 [:, :]
    gate_up[(F, T * K), THREADS, stream](slots, host, table, offsets, part_off, row_bytes, ids, X, b_gate, b_up, H)
    down[(D, T), THREADS, stream](slots, host, table, offsets, part_off, row_bytes, ids, w, H, b_down, Y)
    return Y


def expert_bytes(slots: np.ndarray, host: np.ndarray, table: np.ndarray, offsets: np.ndarray, part_off, shapes,
                 e: int) -> list:
    """The NumPy twin's read: expert e's gate, up, down rows (uint8 [rows, row_bytes]) where the table says (None:
    table -2, left out)."""
    s = int(table[e])
    if s == -2:
        return None
    out = []
    for i, (rows, rb) in enumerate(shapes):
        a, o = (slots[s], part_off[i]) if s >= 0 else (host, offsets[e, i])
        flat = a[o:o + rows * rb]
        out.append(np.asarray(flat).reshape(rows, rb))
    return out


def routed_experts_reference(read, types: dict, ids: np.ndarray, w: np.ndarray, X: np.ndarray) -> np.ndarray:
    """NumPy twin of `routed_experts`: read(e) -> (gate, up, down) raw rows of expert e (`expert_bytes`), or None
    for an expert left out;
    y[t] = sum over k, in order, of w[t, k] * down(silu(gate X[t]) * up X[t])  (float32)."""
    from pymoe import quant
    from pymoe.backends.reference import silu

    T, K = ids.shape
    Y = np.zeros((T, X.shape[1]), np.float32)  # [T, D]
    for t in range(T):
        for k in range(K):
            if read(int(ids[t, k])) is None:  # table -2: computed elsewhere
                continue
            g, u, d = (quant.dequantize(a, types[p]) for a, p in zip(read(int(ids[t, k])), ("gate", "up", "down")))
            x = X[t].astype(np.float32)
            h = (silu(g @ x) * (u @ x)).astype(np.float32)  # [F]
            Y[t] += np.float32(w[t, k]) * (d @ h).astype(np.float32)
    return Y


__all__ = ["embed", "add", "swiglu", "sigmoid_gate", "route_softmax", "route_sigmoid", "argmax", "routed_experts",
           "routed_experts_reference", "expert_bytes"]
