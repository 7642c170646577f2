"""The reference backend: every primitive of the backend contract in plain NumPy. The readable twin.

What this is: the math of a forward pass, one short function per primitive, in float32 NumPy, written to be read
next to llama.cpp's graph code (`llm_build_*`, `build_moe_ffn`, `build_norm`, `ggml_rope_ext`):
    rmsnorm        x / sqrt(mean(x^2) + eps) * w
    rope_tables    theta_i = pos * base^(-2i / rope_dim) -> cos, sin
    apply_rope     NEOX style (qwen*, olmoe) rotates pairs (i, i + rope_dim/2); normal style (llama/Mixtral)
                   rotates adjacent pairs (2i, 2i + 1). llama.cpp's converter already permuted the Q/K rows of llama
                   files for the normal style, so the file is used as it is: no un-permutation anywhere.
    attention      causal, scale 1/sqrt(head_dim), grouped-query (query head h reads KV head h // (H / G))
    route          softmax -> top-K -> (renormalised) weights
    swiglu_expert  down(silu(gate(x)) * up(x))
and `ReferenceBackend`, which serves them through the contract of backends/protocol.py: quantized weights are
dequantized by the NumPy reference of their format (pymoe/quant) and multiplied with `@`.
It is what the compiled CPU backend (backends/cpu.py) and the CUDA kernels are tested against, and what
`--backend reference` runs (slowly: it dequantizes a weight every time it multiplies with it).
What this is not: fast, or bit-identical with the CPU backend (its float sums run in BLAS's order).

Shapes: T tokens, S = P + T keys (P already cached), H query heads, G = n_head_kv, Dh / Dv key / value head size,
D n_embd, E experts (K used per token), F one expert's hidden size, R x C a weight's rows x columns.
"""
from __future__ import annotations

import math
from typing import Optional

from dataclasses import dataclass

import numpy as np

from pymoe import quant
from pymoe.gguf.loader import Tensor
from .pool import HostPool


# --- the math ---------------------------------------------------------------------------------------------------
def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., n] normalised over its last axis, times w [n]."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


@dataclass(frozen=True)
class RopeScaling:
    """Context extension of RoPE, as llama.cpp applies it (ggml's rope_yarn; llama-context.cpp's attn factor).

    linear: every angle is multiplied by freq_scale = 1 / factor (positions squeezed).
    yarn:   pair i keeps its original angle (extrapolation) where its wavelength is short, takes the squeezed angle
            where it is long, and a linear ramp between: the ramp runs over pair indices corr_dims (ggml's
            ggml_rope_yarn_corr_dims with beta_fast 32, beta_slow 1 over the original context). cos and sin are
            then multiplied by mscale = 1 + 0.1 ln(factor) (llama.cpp's attn_factor cancels its own get_mscale, so
            this is what remains): q.k grows by mscale^2, YaRN's attention temperature."""

    kind: str = "none"  # none | linear | yarn
    factor: float = 1.0
    ctx_orig: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = None  # YaRN's cos/sin factor; None: 1 + 0.1 ln(factor). DeepSeek (a yarn_log_multiplier in the
    #                       file): llama.cpp's attn factor becomes 1 there, its mscale goes to the attention scale


def gdn_state_shapes(cfg) -> dict:
    """One Gated DeltaNet layer's state (engine/deltanet.py; the CUDA backend's device copy, transposed): the
    conv's last K - 1 inputs [K - 1, conv_dim] and M [nv, dv, dk] per v head."""
    nv, dk = cfg.ssm_v_heads, cfg.ssm_state
    return dict(conv=(cfg.ssm_conv - 1, 2 * cfg.ssm_k_heads * dk + cfg.ssm_inner),
                ssm=(nv, cfg.ssm_inner // nv, dk))


def gdn_state_bytes(cfg) -> int:
    """Bytes of one Gated DeltaNet layer's state in float32 (`gdn_state_shapes`: conv and recurrent), per sequence;
    0 for a model without such layers."""
    if not cfg.traits.hybrid:
        return 0
    return 4 * sum(math.prod(shape) for shape in gdn_state_shapes(cfg).values())


def rope_scaling(cfg) -> RopeScaling:
    """The RoPE scaling a ModelConfig's file asks for (engine/model.Model.rope_tables, the CUDA step's tables).
    DeepSeek's files carry a yarn_log_multiplier: llama.cpp's YaRN factor on cos/sin is then 1 (the mscale moves
    into the attention scale, engine/mla.py)."""
    return RopeScaling(cfg.rope_scaling, cfg.rope_scale, cfg.rope_ctx_orig, mscale=1.0 if cfg.yarn_log_mul else None)


def yarn_corr_dims(rope_dim: int, ctx_orig: int, base: float, beta_fast: float, beta_slow: float) -> tuple:
    """The pair-index range of YaRN's ramp (ggml_rope_yarn_corr_dims, in float32 as ggml computes it)."""
    def corr_dim(n_rot):  # the dimension whose wavelength turns n_rot times over the original context
        return np.float32(rope_dim * np.log(np.float32(ctx_orig / (n_rot * 2 * np.pi)))
                          / (2 * np.log(np.float32(base))))
    start, end = np.floor(corr_dim(beta_fast)), np.ceil(corr_dim(beta_slow))
    return max(0.0, float(start)), min(rope_dim - 1.0, float(end))


def rope_tables(rope_dim: int, base: float, positions: np.ndarray,
                scaling: RopeScaling = RopeScaling()) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [T, rope_dim/2] for the given positions (angles in float64, as llama.cpp's rope cache)."""
    i = np.arange(rope_dim // 2, dtype=np.float64)
    inv_freq = base ** (-2.0 * i / rope_dim)  # [rope_dim/2]
    theta = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [T, rope_dim/2]
    if scaling.kind == "none" or scaling.factor == 1.0:
        return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    squeezed = theta / scaling.factor  # [T, rope_dim/2] freq_scale * theta
    if scaling.kind == "linear":
        return np.cos(squeezed).astype(np.float32), np.sin(squeezed).astype(np.float32)
    low, high = yarn_corr_dims(rope_dim, scaling.ctx_orig, base, scaling.beta_fast, scaling.beta_slow)
    ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)  # [rope_dim/2] 1: extrapolate, 0: squeeze
    theta = squeezed * (1.0 - ramp) + theta * ramp  # [T, rope_dim/2]
    mscale = 1.0 + 0.1 * np.log(scaling.factor) if scaling.mscale is None else scaling.mscale
    return (np.cos(theta) * mscale).astype(np.float32), (np.sin(theta) * mscale).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """x [T, heads, Dh]; rotates the first rope_dim = 2 * cos.shape[1] dims of every head, leaves the rest."""
    n = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, n]
    out = x.copy()
    if neox:
        a, b = x[..., :n], x[..., n:2 * n]  # pairs (i, i + n)
        out[..., :n] = a * c - b * s
        out[..., n:2 * n] = b * c + a * s
    else:
        a, b = x[..., 0:2 * n:2], x[..., 1:2 * n:2]  # pairs (2i, 2i + 1)
        out[..., 0:2 * n:2] = a * c - b * s
        out[..., 1:2 * n:2] = b * c + a * s
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, p0: int, window: int = 0,
              sinks: np.ndarray = None) -> np.ndarray:
    """Causal GQA attention of T new queries at positions p0.. over S = p0 + T cached keys.

    q [T, H, Dh], k [S, G, Dh], v [S, G, Dv] -> [T, H * Dv].
    window > 0: query position p sees keys p - window + 1 .. p only (llama.cpp's LLAMA_SWA_TYPE_STANDARD).
    sinks float32 [H]: per head, one more logit in the softmax's denominator that has no value ("attention sink",
    gpt-oss): weights = exp(s) / (sum exp(s) + exp(sink)), computed against max(max s, sink) as ggml does.
    """
    T, H, Dh = q.shape
    S, G, Dv = v.shape
    qg = q.reshape(T, G, H // G, Dh)  # [T, G, H/G, Dh]: the query heads sharing each KV head
    scores = np.einsum("tgqd,sgd->gqts", qg, k) / np.float32(np.sqrt(Dh))  # [G, H/G, T, S]
    pos = p0 + np.arange(T)  # [T] the queries' positions
    hidden = np.arange(S)[None, :] > pos[:, None]  # [T, S] the future
    if window:
        hidden |= pos[:, None] - np.arange(S)[None, :] >= window  # [T, S] out of the window
    scores = np.where(hidden, -np.inf, scores)
    top = scores.max(axis=-1, keepdims=True)  # [G, H/G, T, 1]
    if sinks is not None:
        sink = np.asarray(sinks, np.float32).reshape(G, H // G, 1, 1)  # [G, H/G, 1, 1]
        top = np.maximum(top, sink)
    scores = np.exp(scores - top)
    total = scores.sum(axis=-1, keepdims=True)  # [G, H/G, T, 1]
    if sinks is not None:
        total = total + np.exp(sink - top)
    probs = scores / total  # [G, H/G, T, S]
    out = np.einsum("gqts,sgd->tgqd", probs, v)  # [T, G, H/G, Dv]
    return out.reshape(T, H * Dv).astype(np.float32)


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


def route_softmax_weight(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """gpt-oss routing (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT): the K largest logits [T, E] are chosen and
    softmaxed among themselves -> (ids int [T, K], weights float32 [T, K])."""
    logits = logits.astype(np.float32)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # [T, K]
    return ids, softmax(np.take_along_axis(logits, ids, axis=-1)).astype(np.float32)


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    """gpt-oss's expert activation (ggml_swiglu_oai): g = min(gate, limit), u = clamp(up, -limit, limit),
    g * sigmoid(alpha g) * (u + 1)."""
    g = np.minimum(gate, np.float32(limit))
    u = np.clip(up, np.float32(-limit), np.float32(limit))
    return (g / (np.float32(1.0) + np.exp(np.float32(alpha) * -g)) * (u + np.float32(1.0))).astype(np.float32)


@dataclass(frozen=True)
class ExpertFFN:
    """What an expert computes beyond down(silu(gate x) * up x): the activation and per-expert biases
    (gate/up float32 [E, F], down [E, D]), gpt-oss's. None everywhere else."""

    activation: str  # "swiglu_oai"
    bias: dict


def route_sigmoid(logits: np.ndarray, k: int, bias, norm_topk: bool, scale: float, groups: int = 0,
                  groups_used: int = 0, gating: str = "sigmoid") -> tuple[np.ndarray, np.ndarray]:
    """Sigmoid routing (llama.cpp build_moe_ffn with LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID): logits [T, E],
    bias float32 [E] or None -> (ids int [T, K], weights float32 [T, K]). The bias only chooses the experts; the
    weights are the unbiased sigmoids, divided by their sum (clamped below at 2^-14, the smallest normal fp16, as
    llama.cpp does) if norm_topk, times `scale` unless it is 0 or 1.
    groups > 1 (DeepSeek-V3's group-limited choice): the E experts form `groups` groups; each group scores the sum
    of its two best (biased) probabilities, and the K experts are chosen among the `groups_used` best groups only.
    gating "softmax" (DeepSeek-V2 with groups): the probabilities are a softmax instead of sigmoids."""
    probs = (softmax if gating == "softmax" else sigmoid)(logits.astype(np.float32)).astype(np.float32)  # [T, E]
    choose = probs + bias if bias is not None else probs  # [T, E]
    if groups > 1:
        T, E = choose.shape
        per_group = choose.reshape(T, groups, E // groups)  # [T, G, E/G]
        score = np.sort(per_group, axis=-1)[..., -2:].sum(axis=-1)  # [T, G] the two best of each group
        keep = np.argsort(-score, axis=-1, kind="stable")[:, :groups_used]  # [T, G_used]
        mask = np.zeros((T, groups), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choose = np.where(np.repeat(mask, E // groups, axis=1), choose, -np.inf)  # [T, E]
    ids = np.argsort(-choose, axis=-1, kind="stable")[:, :k]  # [T, K]
    w = np.take_along_axis(probs, ids, axis=-1)  # [T, K]
    if norm_topk:
        w = w / np.maximum(w.sum(axis=-1, keepdims=True), np.float32(6.103515625e-5))
    if scale not in (0.0, 1.0):
        w = w * np.float32(scale)
    return ids, w.astype(np.float32)


def swiglu_expert(backend, ex, types: dict, x: np.ndarray, ffn: ExpertFFN = None) -> np.ndarray:
    """One expert on the tokens routed to it: x [n, D] -> [n, D]. `ex` = raw gate/up/down rows, `types` their qtypes;
    the products run on `backend.linear_raw`. ffn (gpt-oss): biases after each product, swiglu_oai in between."""
    gate = backend.linear_raw(ex.gate, types["gate"], x)  # [n, F]
    up = backend.linear_raw(ex.up, types["up"], x)  # [n, F]
    if ffn is None:
        return backend.linear_raw(ex.down, types["down"], silu(gate) * up)  # [n, D]
    b = {p: ffn.bias[p][ex.expert] for p in ffn.bias}  # this expert's gate/up [F], down [D] biases
    h = swiglu_oai(gate + b["gate"], up + b["up"])  # [n, F]
    return backend.linear_raw(ex.down, types["down"], h) + b["down"]  # [n, D]


def experts_one_by_one(backend, experts: dict, types: dict, x: np.ndarray, ids: np.ndarray,
                       w: np.ndarray, ffn: ExpertFFN = None) -> np.ndarray:
    """y [T, D] = sum_k w[t, k] * expert_{ids[t, k]}(x[t]): one expert at a time, on all of its tokens (each
    expert's weights are read once per call). experts {e: ExpertBytes}, x [T, D], ids int [T, K], w [T, K]."""
    y = np.zeros_like(x)  # [T, D]
    for e, ex in experts.items():
        tok, slot = np.nonzero(ids == e)  # tokens routed to e, and at which of their K positions
        y[tok] += w[tok, slot][:, None] * swiglu_expert(backend, ex, types, x[tok], ffn)  # [n, D]
    return y


# --- the backend --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseWeight:
    """A 2-D weight ready to multiply on the host: float32 [R, C] (F32 tensors) or raw rows uint8 [R, row_bytes]
    + qtype (everything else), both views into the memory map; tiles: the CPU backend's repacked copy for one-token
    products at 8 bits (quant/repack.py), where it makes one."""

    qtype: quant.QType
    raw: np.ndarray
    shape: tuple  # (R, C)
    tiles: Optional[np.ndarray] = None  # uint8 [R / 8, row_tiles]
    bits: Optional[int] = None  # the CPU backend's activation width for this weight, where not its dense one


def host_dense(t: Tensor) -> DenseWeight:
    if t.qtype == quant.QType.F32:
        return DenseWeight(t.qtype, np.asarray(t.data, dtype=np.float32).reshape(t.shape), t.shape)
    return DenseWeight(t.qtype, t.rows(), t.shape)


class HostArrays:
    """The array primitives of a backend that computes on the host: nothing moves, views are NumPy's."""

    def to_device(self, x: np.ndarray) -> np.ndarray:
        return x

    def to_host(self, a: np.ndarray) -> np.ndarray:
        return a

    def add(self, a: np.ndarray, vec: np.ndarray) -> np.ndarray:
        return a + vec

    def view(self, a: np.ndarray, shape: tuple) -> np.ndarray:
        return a.reshape(shape)

    def split_gate(self, qg: np.ndarray, Dh: int) -> tuple:
        """Gated attention's q projection [T, H 2 Dh] (per head the query, then the output gate) -> q, gate
        [T, H Dh] each."""
        T = qg.shape[0]
        q4 = qg.reshape(T, -1, 2, Dh)  # [T, H, 2, Dh]
        return np.ascontiguousarray(q4[:, :, 0].reshape(T, -1)), q4[:, :, 1].reshape(T, -1)

    def gate_output(self, out: np.ndarray, gate: np.ndarray) -> np.ndarray:
        """out [T, n] * sigmoid(gate [T, n]): gated attention's output gate."""
        return out * sigmoid(gate)

    def kv_write(self, kv, layer: int, p0: int, k: np.ndarray, v) -> None:
        kv.write(layer, p0, k, v)

    def kv_read(self, kv, layer: int, S: int) -> tuple:
        return kv.read(layer, S)


class ReferenceBackend(HostArrays):
    """backends/protocol.py's contract in NumPy: the functions above, and `dequantize(w) @ x` for every weight."""

    name = "reference"
    threads = 1

    def __init__(self, threads=None):
        pass  # NumPy's BLAS picks its own threads

    def warm_up(self, qtypes, progress: bool = False) -> None:
        pass  # nothing is compiled

    def share_cpu(self) -> None:
        pass  # NumPy's BLAS picks its own threads

    def warm_up_experts(self, expert_types: dict) -> None:
        pass

    def dense(self, t: Tensor) -> DenseWeight:
        return host_dense(t)

    def vector(self, t: Tensor) -> np.ndarray:
        return t.floats().reshape(-1)

    def linear_raw(self, raw: np.ndarray, qtype: quant.QType, x: np.ndarray) -> np.ndarray:
        """x float32 [T, C] @ W.T -> [T, R], W stored as `raw` (float32 [R, C], or uint8 rows [R, row_bytes])."""
        if qtype == quant.QType.F32:
            w = raw if raw.dtype == np.float32 else raw.view(np.float32)  # [R, C]
        else:
            w = quant.dequantize(raw, qtype)  # [R, C]
        return (x @ w.T).astype(np.float32)

    def linear(self, w: DenseWeight, x: np.ndarray) -> np.ndarray:
        return self.linear_raw(w.raw, w.qtype, x)

    def linear_many(self, ws: list, x: np.ndarray) -> list:
        return [self.linear(w, x) for w in ws]

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        return rmsnorm(x, w, eps)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
        return apply_rope(x, cos, sin, neox)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, p0: int, window: int = 0,
                  sinks=None) -> np.ndarray:
        return attention(np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32), p0,
                         window, sinks)

    def route(self, logits: np.ndarray, k: int, norm_topk: bool) -> tuple[np.ndarray, np.ndarray]:
        return route(logits, k, norm_topk)

    def moe_experts(self, experts: dict, expert_types: dict, x: np.ndarray, ids: np.ndarray,
                    w: np.ndarray, ffn: ExpertFFN = None) -> np.ndarray:
        return experts_one_by_one(self, experts, expert_types, x, ids, w, ffn)

    def new_pool(self, n_slots: int, slot_bytes: int, layouts: list) -> HostPool:
        return HostPool(n_slots, slot_bytes, layouts)

    def new_kv(self, n_ctx: int):
        return None  # the engine's host KV cache
