"""The transformer forward pass of an MoE model, on any backend: embeddings -> layers -> logits.

What this is: `Model(gguf_model, backend, cache)` with
    prefill(tokens, kv)          T prompt tokens at once (mat-mat kernels), fills the KV cache, returns logits [T, V]
    decode_one_token(token, kv)  one token (mat-vec kernels), returns logits [V]
both built on one `forward(tokens, kv, phase)`. Per layer:
    h = x + attn_output( attention( rope( qk_norm( q, k ) ), v ) )    of rmsnorm(x) * attn_norm
    x = h + moe_block( rmsnorm(h) * ffn_norm )
What this is not: a tokenizer, sampler or generation loop (generate.py), or a cache (cache.py).

It computes what llama.cpp computes on the same file (the oracle in tests/test_model_vs_llamacpp.py):
  - RMSNorm: x / sqrt(mean(x^2) + eps) * w.
  - RoPE with theta_i = pos * base^(-2i / rope_dim): NEOX style (qwen*, olmoe) rotates the pairs (i, i + rope_dim/2);
    normal style (llama/Mixtral) rotates adjacent pairs (2i, 2i + 1). llama.cpp's converter already permuted the
    Q/K rows of llama files for the normal style, so the file is used as it is: no un-permutation here.
  - q/k norm: qwen3moe per head (over head_dim), olmoe over the whole projection (over n_head * head_dim).
  - attention: causal, scale 1/sqrt(head_dim), grouped-query (query head h reads KV head h // (n_head / n_head_kv)).
Shapes: T new tokens, P tokens already in the KV cache, H query heads, G = n_head_kv, Dh head size, D n_embd.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .errors import PymoeError
from .moe import moe_block


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., n] normalised over its last axis, times w [n]."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_tables(cfg: ModelConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [T, rope_dim/2] for the given positions."""
    i = np.arange(cfg.rope_dim // 2, dtype=np.float64)
    inv_freq = cfg.rope_freq_base ** (-2.0 * i / cfg.rope_dim)  # [rope_dim/2]
    theta = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [T, rope_dim/2]
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


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


class KVCache:
    """Keys and values of every layer for one sequence: float32 [L, n_ctx, G, Dh]; `n` tokens stored so far."""

    def __init__(self, cfg: ModelConfig, n_ctx: int):
        self.n_ctx = n_ctx
        self.k = np.zeros((cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim), dtype=np.float32)
        self.v = np.zeros((cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim_v), dtype=np.float32)
        self.n = 0

    def clear(self) -> None:
        self.n = 0


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, p0: int) -> np.ndarray:
    """Causal GQA attention of T new queries at positions p0.. over S = p0 + T cached keys.

    q [T, H, Dh], k [S, G, Dh], v [S, G, Dv] -> [T, H * Dv].
    """
    T, H, Dh = q.shape
    S, G, Dv = v.shape
    qg = q.reshape(T, G, H // G, Dh)  # [T, G, H/G, Dh]: the query heads sharing each KV head
    scores = np.einsum("tgqd,sgd->gqts", qg, k) / np.float32(np.sqrt(Dh))  # [G, H/G, T, S]
    future = np.arange(S)[None, :] > (p0 + np.arange(T))[:, None]  # [T, S]
    scores = np.where(future, -np.inf, scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)  # [G, H/G, T, S]
    out = np.einsum("gqts,sgd->tgqd", probs, v)  # [T, G, H/G, Dv]
    return out.reshape(T, H * Dv).astype(np.float32)


@dataclass
class Layer:
    """One transformer block's weights, prepared for a backend. Names are the GGUF tensor names."""

    index: int
    cfg: ModelConfig
    attn_norm: np.ndarray
    attn_q: object
    attn_k: object
    attn_v: object
    attn_output: object
    bias: dict  # q/k/v -> float32 vector (qwen2moe), else empty
    q_norm: object  # float32 [Dh] or [H * Dh] or None
    k_norm: object
    ffn_norm: np.ndarray
    ffn_gate_inp: object  # the router [E, D]
    expert_types: dict  # gate/up/down -> qtype of the 3-D expert tensors
    shared: dict  # qwen2moe: gate/up/down DenseWeight, gate_inp float32 [D]; else empty


class Model:
    def __init__(self, gguf_model, backend, cache, progress: bool = False):
        self.file = gguf_model
        self.cfg: ModelConfig = gguf_model.config
        self.backend = backend
        self.cache = cache
        self.trace = None  # a trace.TraceRecorder, when routing is being recorded (`pymoe run --trace`)
        self.chunk = 512  # most prompt tokens per forward call (prefill)
        cfg, b, t = self.cfg, backend, gguf_model.tensor
        self.token_embd = t("token_embd.weight")  # rows read on demand, dequantized one token at a time
        self.output_norm = b.vector(t("output_norm.weight"))
        self.output = b.dense(t("token_embd.weight") if cfg.tied_output else t("output.weight"))
        from tqdm import tqdm

        self.layers = [self._layer(i) for i in tqdm(range(cfg.n_layers), desc="loading", unit="layer",
                                                    disable=not progress, leave=False)]

    def _layer(self, i: int) -> Layer:
        cfg, b = self.cfg, self.backend
        lt = lambda name: self.file.layer_tensor(i, name)  # noqa: E731
        bias = {p: b.vector(lt(f"attn_{p}.bias")) for p in "qkv"} if cfg.qkv_bias else {}
        norms = (b.vector(lt("attn_q_norm.weight")), b.vector(lt("attn_k_norm.weight"))) if cfg.qk_norm else (None, None)
        shared = {}
        if cfg.has_shared_expert:
            shared = {p: b.dense(lt(f"ffn_{p}_shexp.weight")) for p in ("gate", "up", "down")}
            shared["gate_inp"] = b.vector(lt("ffn_gate_inp_shexp.weight"))
        return Layer(
            index=i, cfg=cfg, attn_norm=b.vector(lt("attn_norm.weight")),
            attn_q=b.dense(lt("attn_q.weight")), attn_k=b.dense(lt("attn_k.weight")),
            attn_v=b.dense(lt("attn_v.weight")), attn_output=b.dense(lt("attn_output.weight")),
            bias=bias, q_norm=norms[0], k_norm=norms[1], ffn_norm=b.vector(lt("ffn_norm.weight")),
            ffn_gate_inp=b.dense(lt("ffn_gate_inp.weight")), expert_types=self.file.expert_types(i), shared=shared,
        )

    # --- the pieces -----------------------------------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """token ids [T] -> float32 [T, D]: only the rows used are dequantized."""
        from . import quant

        t = self.token_embd
        if t.qtype == quant.QType.F32:
            return np.asarray(t.data, dtype=np.float32)[tokens]
        return quant.dequantize(t.rows()[tokens], t.qtype)

    def attention_block(self, layer: Layer, x: np.ndarray, kv: KVCache, layer_i: int, rope=None) -> np.ndarray:
        """rope: (cos, sin) of positions kv.n .. kv.n + T - 1 (rope_tables), computed once per forward call."""
        cfg, b = self.cfg, self.backend
        if getattr(kv, "on_device", False):  # a KV cache in device memory: the backend runs the whole block there
            return b.attention_block(self, layer, x, kv, layer_i)
        T, p0 = x.shape[0], kv.n
        # Optional backend hooks (the CPU fast path: compiled, one quantization of x for q, k and v); the NumPy
        # functions of this file are the fallback, and the contract.
        linear_many = getattr(b, "linear_many", None)
        norm, rotate = getattr(b, "rmsnorm", rmsnorm), getattr(b, "rope", apply_rope)
        if linear_many is not None:
            q, k, v = linear_many([layer.attn_q, layer.attn_k, layer.attn_v], x)  # [T, H*Dh], [T, G*Dh], [T, G*Dv]
        else:
            q = b.linear(layer.attn_q, x)  # [T, H * Dh]
            k = b.linear(layer.attn_k, x)  # [T, G * Dh]
            v = b.linear(layer.attn_v, x)  # [T, G * Dv]
        if layer.bias:
            q, k, v = q + layer.bias["q"], k + layer.bias["k"], v + layer.bias["v"]
        if cfg.qk_norm == "full":  # olmoe: over the whole projection, before splitting into heads
            q, k = norm(q, layer.q_norm, cfg.rms_eps), norm(k, layer.k_norm, cfg.rms_eps)
        q = q.reshape(T, cfg.n_head, cfg.head_dim)  # [T, H, Dh]
        k = k.reshape(T, cfg.n_head_kv, cfg.head_dim)  # [T, G, Dh]
        v = v.reshape(T, cfg.n_head_kv, cfg.head_dim_v)  # [T, G, Dv]
        if cfg.qk_norm == "head":  # qwen3moe: each head separately
            q, k = norm(q, layer.q_norm, cfg.rms_eps), norm(k, layer.k_norm, cfg.rms_eps)
        cos, sin = rope if rope is not None else rope_tables(cfg, np.arange(p0, p0 + T))
        q, k = rotate(q, cos, sin, cfg.rope_neox), rotate(k, cos, sin, cfg.rope_neox)
        kv.k[layer_i, p0:p0 + T] = k
        kv.v[layer_i, p0:p0 + T] = v
        attend = getattr(b, "attention", attention)  # a backend may bring its own (CPU fast path: row by row)
        out = attend(q, kv.k[layer_i, :p0 + T], kv.v[layer_i, :p0 + T], p0)  # [T, H * Dv]
        return b.linear(layer.attn_output, out)  # [T, D]

    # --- the forward pass -------------------------------------------------------------------------------------
    def forward(self, tokens, kv: KVCache, phase: str) -> np.ndarray:
        """tokens [T] appended at kv.n -> logits float32 [T, V]; advances kv.n by T."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        cfg = self.cfg
        if tokens.size == 0:
            raise PymoeError("empty prompt: nothing to run the model on")
        if kv.n + tokens.size > kv.n_ctx:
            raise PymoeError(f"context full: {kv.n} + {tokens.size} tokens exceed the context of {kv.n_ctx}")
        if tokens.min() < 0 or tokens.max() >= cfg.n_vocab:
            raise PymoeError(f"token id out of range 0..{cfg.n_vocab - 1}")
        x = self.embed(tokens)  # [T, D]
        norm = getattr(self.backend, "rmsnorm", rmsnorm)  # a backend's compiled RMSNorm (same contract), if any
        rope = rope_tables(cfg, np.arange(kv.n, kv.n + tokens.size))  # (cos, sin) [T, rope_dim/2], for all layers
        for i, layer in enumerate(self.layers):
            x = x + self.attention_block(layer, norm(x, layer.attn_norm, cfg.rms_eps), kv, i, rope)
            h = norm(x, layer.ffn_norm, cfg.rms_eps)
            y, ids, w = moe_block(layer, h, self.cache, self.backend, phase)
            x = x + y
            if self.trace is not None:
                self.trace.record(i, ids, w, phase)
        if self.trace is not None:
            self.trace.end_forward()
        kv.n += tokens.size
        x = norm(x, self.output_norm, cfg.rms_eps)
        return self.backend.linear(self.output, x)  # [T, V]

    def prefill(self, tokens, kv: KVCache) -> np.ndarray:
        """tokens [T] -> logits [T, V], in forward calls of at most `self.chunk` tokens (`--chunk`): the chunk is
        the unit of prefill's expert traffic (each expert missing from the cache is streamed once per chunk) and
        bounds the activation buffers. Each query's result does not depend on how the prompt is cut."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size <= self.chunk:
            return self.forward(tokens, kv, "prefill")
        if kv.n + tokens.size > kv.n_ctx:  # checked for the whole prompt before any chunk fills the cache
            raise PymoeError(f"context full: {kv.n} + {tokens.size} tokens exceed the context of {kv.n_ctx}")
        return np.concatenate([self.forward(tokens[i:i + self.chunk], kv, "prefill")
                               for i in range(0, tokens.size, self.chunk)])  # [T, V]

    def decode_one_token(self, token: int, kv: KVCache) -> np.ndarray:
        return self.forward([token], kv, "decode")[0]

    def new_kv(self, n_ctx=None) -> KVCache:
        """A KV cache for a new sequence: the backend's own when it has one free (CUDA: in device memory, so that
        attention runs there), else a host one."""
        n_ctx = n_ctx or self.cfg.n_ctx_train
        own = getattr(self.backend, "new_kv", None)
        return (own(n_ctx) if own else None) or KVCache(self.cfg, n_ctx)
