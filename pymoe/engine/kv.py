"""The KV module: one sequence's per-layer attention state, in float32, float16 or int8.

What this is: `new_kv(cfg, n_ctx, kind)` for kind "f32" (`KVCache`), "f16" (halves f32) or "int8" (halves f16
again), all with the one interface the attention blocks (engine/attention.py) use:
    kv.k[layer, p0:p0 + T] = k        write the new tokens' keys   (k [T, G, Dh] float32)
    kv.k[layer, :S]                    read the first S positions   (-> float32-compatible [S, G, Dh])
and the same for kv.v, plus kv.n (tokens stored) / kv.n_ctx / clear(). The int8 cache stores K and V as
`QuantizedPlane`s, small adapters that quantize on write and dequantize the prefix asked for on read, so the blocks
run unchanged. The blocks read and write a cache through the backend (`kv_write`, `kv_read`), so the CUDA backend's
`DeviceKVCache` (backends/cuda.py), the same fields in device memory, runs the very same block code.
State of other kinds goes here, indexed by layer like k and v: a linear-attention (Gated DeltaNet) layer keeps a
recurrent state and a conv state (`recurrent(layer)`, engine/deltanet.py) instead of K/V.
What this is not: a paged or shared KV pool (each sequence owns one cache), or a faster attention: the int8 read
dequantizes the whole prefix every layer and every token, trading compute for memory.

int8 layout, per (layer, position, KV head), in groups of GROUP = 32 values x (GGML's Q8_0 block):
    q = round(x / d) in [-127, 127]  (int8 [32])    d = max|x| / 127  (float16, like the `d` of GGML's Q8_0)
    x ~= q * d                       error <= d / 2 = max|x| / 254 per value
so a head of Dh = 64 costs 64 + 4 bytes instead of 128 (f16) or 256 (f32). Scales per group, not per tensor:
heads differ in range (and qk-norm, RoPE keep each head's own scale), and within a head the RoPE-rotated pairs
differ too (one scale per head of 64 measurably worse: on the tiny llama file the mean per-token logit error is
1.3x llama.cpp's q8_0 cache, vs 0.98x with groups of 32). The rounding of the values (half-even here, half-away in
GGML), a float32 scale, or a scale searched for least squared error change the logits by noise only (measured, see
docs/server.md): the error left is that of any 8-bit KV cache, and tests/test_batch.py holds it to both the
float-oracle tolerances and llama.cpp's own q8_0 cache on the same files.
"""
from __future__ import annotations

import numpy as np

from pymoe.errors import PymoeError
from pymoe.gguf.config import ModelConfig

KV_KINDS = ("f32", "f16", "int8")
GROUP = 32  # int8 values per float16 scale, as in GGML's Q8_0 (llama.cpp's `--cache-type-k q8_0`)


class KVCache:
    """Keys and values of every layer for one sequence: float32 [L, n_ctx, G, Dh]; `n` tokens stored so far."""

    def __init__(self, cfg: ModelConfig, n_ctx: int):
        self.n_ctx = n_ctx
        self.k = np.zeros((cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim), dtype=np.float32)
        self.v = np.zeros((cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim_v), dtype=np.float32)
        self.n = 0

    def clear(self) -> None:
        self.n = 0
        self.__dict__.pop("_recurrent", None)

    def recurrent(self, layer: int, **shapes) -> dict:
        """The state a recurrent layer carries from call to call (Gated DeltaNet: conv [K - 1, C] and ssm
        [H, dv, dk]), float32 zeros on first use; name -> shape as keyword arguments. Unlike K and V it cannot be
        cut back to an earlier position: `clear()` is the only way back (prefix reuse checks
        `ModelConfig.has_recurrent_state`)."""
        states = self.__dict__.setdefault("_recurrent", {})
        if layer not in states:
            states[layer] = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        return states[layer]


class QuantizedPlane:
    """Looks like a float32 array [L, n_ctx, G, Dh] to code that writes and reads [layer, positions] blocks."""

    def __init__(self, shape: tuple):
        self.shape = shape
        dh = shape[-1]
        self.group = GROUP if dh % GROUP == 0 else dh  # values sharing one scale
        self.q = np.zeros(shape, dtype=np.int8)  # [L, n_ctx, G, Dh]
        self.d = np.zeros((*shape[:-1], dh // self.group), dtype=np.float16)  # [L, n_ctx, G, Dh / group]

    def __setitem__(self, index, x: np.ndarray) -> None:
        """index: (layer, positions) covering whole heads; x float32 [..., Dh]."""
        x = np.asarray(x, dtype=np.float32)
        xg = x.reshape(*x.shape[:-1], -1, self.group)  # [..., Dh / group, group]
        d = (np.abs(xg).max(axis=-1) / 127.0).astype(np.float16)  # [..., Dh / group]
        inv = np.where(d > 0, 1.0 / np.maximum(d.astype(np.float32), 1e-30), 0.0)  # an all-zero group stays 0
        q = np.clip(np.rint(xg * inv[..., None]), -127, 127).astype(np.int8)
        self.q[index] = q.reshape(x.shape)
        self.d[index] = d

    def __getitem__(self, index) -> np.ndarray:
        q = self.q[index].astype(np.float32)  # [..., Dh]
        qg = q.reshape(*q.shape[:-1], -1, self.group)  # [..., Dh / group, group]
        return (qg * self.d[index].astype(np.float32)[..., None]).reshape(q.shape)  # [..., Dh]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes


class Float16KVCache(KVCache):
    """KVCache with float16 storage: writes round to f16, reads come back as f16 and attention upcasts."""

    def __init__(self, cfg: ModelConfig, n_ctx: int):
        self.n_ctx, self.n = n_ctx, 0
        self.k = np.zeros((cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim), dtype=np.float16)
        self.v = np.zeros((cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim_v), dtype=np.float16)


class Int8KVCache(KVCache):
    """KVCache with K and V as QuantizedPlanes (int8 values + a float16 scale per 32 values of a head)."""

    def __init__(self, cfg: ModelConfig, n_ctx: int):
        self.n_ctx, self.n = n_ctx, 0
        self.k = QuantizedPlane((cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim))
        self.v = QuantizedPlane((cfg.n_layers, n_ctx, cfg.n_head_kv, cfg.head_dim_v))


def new_kv(cfg: ModelConfig, n_ctx: int, kind: str = "f32") -> KVCache:
    """An empty KV cache of `n_ctx` positions for one sequence, stored as `kind` (f32, f16 or int8)."""
    if kind not in KV_KINDS:
        raise PymoeError(f"KV cache type must be one of {', '.join(KV_KINDS)}, got '{kind}'")
    return {"f32": KVCache, "f16": Float16KVCache, "int8": Int8KVCache}[kind](cfg, n_ctx)


def kv_nbytes(kv: KVCache) -> int:
    """Bytes the cache's K and V storage holds (all n_ctx positions, allocated up front)."""
    return kv.k.nbytes + kv.v.nbytes
