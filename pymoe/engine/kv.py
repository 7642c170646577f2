"""The KV module: one sequence's per-layer attention state, in float32, float16 or int8.

What this is: `new_kv(cfg, n_ctx, kind)` for kind "f32" (`KVCache`), "f16" (halves f32) or "int8" (halves f16
again), all with the one interface the attention blocks (engine/attention.py) use, through the backend's
`kv_write` / `kv_read`:
    kv.write(layer, p0, k, v)   the new tokens' keys and values   (k [T, G, Dh], v [T, G, Dv] float32)
    kv.read(layer, S)           the first S positions             (-> float32-compatible [S, G, Dh], [S, G, Dv])
    kv.read(layer, S, key_blocks=True)   the same, keys stored in tiles handed over as they are (the CPU backend)
plus kv.n (tokens stored) / kv.n_ctx / clear(). Rows exist only for the layers that keep K/V
(`ModelConfig.kv_layers`: not Gated DeltaNet layers), and MLA has no V plane: its V is the first kv_lora_rank
values of the compressed K row, read from there (so an MLA cache holds kv_lora_rank + rope values per token and
layer, as llama.cpp's does). The int8 cache stores K and V as `QuantizedPlane`s, small adapters that quantize on
write and dequantize the prefix asked for on read, so the blocks run unchanged; the f32 cache stores its keys in
tiles of 64 positions (`KeyTiles`), the layout CPU attention computes scores in, the same way. The CUDA backend's
`DeviceKVCache` (backends/cuda.py), the same fields in device memory, runs the very same block code.
State of other kinds goes here too: a linear-attention (Gated DeltaNet) layer keeps a recurrent state and a conv
state (`recurrent(layer)`, engine/deltanet.py) instead of K/V.
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

import os
from typing import Optional

import numpy as np

from pymoe.backends.attention_simd import TILE_KEYS, KeyBlocks
from pymoe.backends.protocol import HostRecurrent
from pymoe.errors import PymoeError
from pymoe.gguf.config import ModelConfig

KV_KINDS = ("f32", "f16", "int8")
GROUP = 32  # int8 values per float16 scale, as in GGML's Q8_0 (llama.cpp's `--cache-type-k q8_0`)


class KVCache(HostRecurrent):
    """Keys and values for one sequence: float32 K [L_kv, n_ctx, G, Dh] and V [L_kv, n_ctx, G, Dv] over the L_kv
    layers that keep them (`rows`: layer -> row; ModelConfig.kv_layers), `n` tokens stored so far; K stored in
    tiles of 64 positions (`KeyTiles`), which it reads and writes as that array. MLA's V is the first Dv values of
    its K row, so it has no V plane (`v` None; `read` slices it from K, kept position-first)."""

    def __init__(self, cfg: ModelConfig, n_ctx: int, layers: Optional[tuple] = None):
        """layers: the layers to keep K/V for (default: ModelConfig.kv_layers(); the MTP block: its own one)."""
        self.n_ctx, self.n = n_ctx, 0
        # M-RoPE after an image (engine/multimodal.py): an image of T tokens advances the rope position by
        # max(rows, cols), not T; from storage index i on, position = index + d, for the last (i, d) with i <= index
        self.shifts: list = []
        self.rows = {layer: r for r, layer in enumerate(cfg.kv_layers() if layers is None else layers)}
        shape = (len(self.rows), n_ctx, cfg.n_head_kv)
        self.k = self._plane((*shape, cfg.head_dim), keys=bool(cfg.kv_v_width))
        self.v = self._plane((*shape, cfg.kv_v_width)) if cfg.kv_v_width else None
        self.v_in_k = 0 if cfg.kv_v_width else cfg.head_dim_v  # MLA: V = K[..., :v_in_k]

    def _plane(self, shape: tuple, keys: bool = False):
        """A plane [L, n_ctx, G, Dh]; keys: it holds keys only (there is a V plane; MLA's K rows also hold its V):
        stored in tiles of 64 positions (`KeyTiles`), the layout CPU attention computes scores from."""
        return KeyTiles(shape) if keys else np.zeros(shape, dtype=np.float32)

    def write(self, layer: int, p0: int, k: np.ndarray, v) -> None:
        """k [T, G, Dh], v [T, G, Dv] (or None without a V plane) into positions p0 .. p0 + T - 1."""
        r = self.rows[layer]
        self.k[r, p0:p0 + k.shape[0]] = k
        if self.v is not None:
            self.v[r, p0:p0 + v.shape[0]] = v

    def read(self, layer: int, S: int, key_blocks: bool = False) -> tuple:
        """-> K [S, G, Dh], V [S, G, Dv] of the first S positions. key_blocks: keys stored in tiles come back as
        they are (a `KeyBlocks`, what CPU attention reads), not copied into K."""
        if key_blocks and isinstance(self.k, KeyTiles):
            return self.k.blocks(self.rows[layer], S), self.v[self.rows[layer], :S]
        k = self.k[self.rows[layer], :S]
        return k, (self.v[self.rows[layer], :S] if self.v is not None else k[..., :self.v_in_k])

    def clear(self) -> None:
        self.n = 0
        self.shifts = []
        self.__dict__.pop("_recurrent", None)

    def pos_delta(self, n: Optional[int] = None) -> int:
        """rope position - storage index at storage index n (default self.n): 0 until an image (M-RoPE)."""
        n = self.n if n is None else n
        return next((d for i, d in reversed(self.shifts) if i <= n), 0)

    def copy_from(self, other: "KVCache", n: int) -> None:
        """Become a copy of `other`'s first n positions: K/V rows of every layer (MLA: its latent rows), and the
        recurrent states (Gated DeltaNet: conv and ssm), which hold the whole past, so with them n must be other.n.
        The caches must be of one kind and shape. The n > 1 choices of one request share one prefill so
        (serve/scheduler.py): the prompt is prefilled into one slot and copied into the others."""
        if type(other) is not type(self) or other.rows != self.rows or n > min(self.n_ctx, other.n):
            raise PymoeError("copy_from: the caches differ in kind or layers, or hold fewer positions than asked")
        if other.__dict__.get("_recurrent") and n != other.n:
            raise PymoeError("copy_from: a recurrent state holds the whole past and cannot be cut to a prefix")
        copy_positions(self.k, other.k, n)
        if self.v is not None:
            copy_positions(self.v, other.v, n)
        self.restore_recurrent(other.save_recurrent())
        self.n = n
        self.shifts = [(i, d) for i, d in getattr(other, "shifts", []) if i <= n]


def copy_kv(b, cfg: ModelConfig, dst, src, n: int) -> None:
    """dst becomes a copy of src's first n positions, whatever each is: two host caches of one kind by
    `KVCache.copy_from` (stored values as they are); with a device KV cache on either side (backends/cuda.py
    `DeviceKVCache`) the float32 rows of every layer through the backend's kv_read / kv_write (device to device,
    or across PCIe), and the recurrent states through their host copies. b: the backend that owns device caches."""
    owns = getattr(b, "owns", lambda kv: False)
    if type(dst) is type(src) and not owns(src):
        return dst.copy_from(src, n)
    saved = src.save_recurrent()
    if n > min(dst.n_ctx, src.n) or dst.rows != src.rows or (saved and n != src.n):
        raise PymoeError("copy_kv: the caches differ in layers, hold fewer positions than asked, or hold a "
                         "recurrent state that cannot be cut to a prefix")
    for layer in src.rows:
        k, v = b.kv_read(src, layer, n)  # [n, G, Dh], [n, G, Dv] (MLA: V is part of the K row, not copied apart)
        b.kv_write(dst, layer, 0, b.to_host(k) if not owns(dst) else k,
                   None if not cfg.kv_v_width else b.to_host(v) if not owns(dst) else v)
    dst.restore_recurrent(saved)
    dst.n = n
    dst.shifts = [(i, d) for i, d in getattr(src, "shifts", []) if i <= n]


# --- the rows of a block's input that belong to each sequence (engine/attention.py) ----------------------------

class Seqs(list):
    """N KV caches and the rows each owns in a block's input, in order: sequence j's next `counts[j]` tokens (a
    batched forward of several tokens per sequence: engine/batch.py forward_batch, the server's speculative
    verification of several slots at once). A plain list of N caches owns one row each."""

    def __init__(self, kvs, counts):
        super().__init__(kvs)
        self.counts = [int(c) for c in counts]
        if len(self.counts) != len(self) or min(self.counts, default=1) < 1:
            raise PymoeError(f"{len(self)} sequences need a row count >= 1 each, got {self.counts}")


def segments(kvs: list, T: int) -> list:
    """Which rows of a block's input belong to which sequence -> [(kv, rows slice)]: one cache owns all T rows (its
    next T tokens, from kv.n on); N caches own one row each (row j: the next token of sequence j, a batched step),
    or counts[j] rows each (`Seqs`)."""
    if len(kvs) == 1:
        return [(kvs[0], slice(0, T))]
    counts = kvs.counts if isinstance(kvs, Seqs) else [1] * len(kvs)
    if T != sum(counts):
        raise PymoeError(f"attention over {len(kvs)} sequences of {counts} rows, got {T} rows")
    ends = np.cumsum(counts)
    return [(kv, slice(int(e) - c, int(e))) for kv, c, e in zip(kvs, counts, ends)]


def join_rows(b, parts: list):
    """The per-sequence results, back in row order: [T_j, n] each -> [T, n] (one part: itself, where it lives;
    several: on the host, where the output projection then runs)."""
    return parts[0] if len(parts) == 1 else np.concatenate([b.to_host(p) for p in parts])


def copy_positions(dst, src, n: int) -> None:
    """dst[:, :n] = src[:, :n] for K or V planes [L, n_ctx, ...] of one kind, stored values as they are (an int8
    plane's codes and scales, not a requantization of its dequantized values)."""
    if isinstance(src, QuantizedPlane):
        dst.q[:, :n], dst.d[:, :n] = src.q[:, :n], src.d[:, :n]
    elif isinstance(src, KeyTiles):
        nb = (n + TILE_KEYS - 1) // TILE_KEYS  # whole tiles (positions past n are not read before written)
        dst.t[:, :, :nb] = src.t[:, :, :nb]
    else:
        dst[:, :n] = src[:, :n]


class KeyTiles:
    """Looks like a float32 array [L, n_ctx, G, Dh] to code that writes and reads [layer, positions] blocks, and
    stores the keys in tiles of 64 positions: t [L, G, nb, Dh, 64], key d of head g at position s in t[l, g, s // 64,
    d, s % 64]. CPU attention sums q . k over d for 16 positions at a time (a vector of 16 keys per d:
    attention_simd.scores_into); here those vectors are in place, each 64-position tile [Dh, 64] contiguous, where
    the position-first layout had every layer's keys transposed for every token (~half of a decode step's attention
    at 160 positions, growing with the context). `blocks` hands the tiles over as they are (attention_simd.KeyBlocks);
    indexing copies them back into [T, G, Dh]."""

    def __init__(self, shape: tuple):
        L, n_ctx, G, Dh = self.shape = shape
        self.t = np.zeros((L, G, (n_ctx + TILE_KEYS - 1) // TILE_KEYS, Dh, TILE_KEYS), np.float32)

    def __setitem__(self, index, x: np.ndarray) -> None:
        """index: (layer, positions p0:p1); x float32 [p1 - p0, G, Dh], written tile by tile."""
        layer, pos = index
        p0, p1, _ = pos.indices(self.shape[1])
        x = np.asarray(x, dtype=np.float32)
        for b in range(p0 // TILE_KEYS, (p1 + TILE_KEYS - 1) // TILE_KEYS):
            lo, hi = max(p0, b * TILE_KEYS), min(p1, (b + 1) * TILE_KEYS)  # positions of tile b
            self.t[layer, :, b, :, lo - b * TILE_KEYS:hi - b * TILE_KEYS] = x[lo - p0:hi - p0].transpose(1, 2, 0)

    def __getitem__(self, index) -> np.ndarray:
        """index: (layer, positions p0:p1) -> float32 [p1 - p0, G, Dh], a copy."""
        layer, pos = index
        p0, p1, _ = pos.indices(self.shape[1])
        return np.asarray(KeyBlocks(self.t[layer], p1))[p0:]

    def blocks(self, layer: int, S: int) -> KeyBlocks:
        """The first S positions of this row's keys, the tiles themselves (a view)."""
        return KeyBlocks(self.t[layer], S)

    @property
    def nbytes(self) -> int:
        return self.t.nbytes


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

    def _plane(self, shape: tuple, keys: bool = False):
        return np.zeros(shape, dtype=np.float16)


class Int8KVCache(KVCache):
    """KVCache with K and V as QuantizedPlanes (int8 values + a float16 scale per 32 values of a head)."""

    def _plane(self, shape: tuple, keys: bool = False):
        return QuantizedPlane(shape)


def memory_limit() -> int:
    """Bytes this process can ever hold: the machine's memory plus swap, lowered by an address-space limit
    (`ulimit -v`) or a cgroup's memory.max when one is set."""
    import resource

    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:
            limit += next(int(line.split()[1]) * 1024 for line in f if line.startswith("SwapTotal:"))
    except (OSError, StopIteration, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, soft)
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text.isdigit():
            limit = min(limit, int(text))
    except OSError:
        pass
    return limit


def kv_bytes(cfg: ModelConfig, n_ctx: int, kind: str = "f32", sequences: int = 1) -> int:
    """Bytes of `sequences` KV caches of `n_ctx` positions stored as `kind`."""
    per_value = {"f32": 4, "f16": 2, "int8": 1 + 2 / GROUP}[kind]
    return int(cfg.kv_values_per_token() * n_ctx * per_value * sequences)


SERVE_KV_SHARE = 0.25  # pymoe serve's default context: the slots' KV caches take at most this share of memory_limit()
#                        (a choice: the rest is for the model's mapped weights, the expert pool and the OS)
SERVE_CTX_FLOOR = 4096  # ... and never fewer positions than this (llama.cpp's common_params n_ctx before it became
#                         0, "the context the model was trained with"), unless the model was trained on fewer
CTX_STEP = 256  # the default context is a multiple of this


def default_ctx(cfg: ModelConfig, kind: str = "f16", sequences: int = 1, memory: Optional[int] = None) -> tuple:
    """pymoe serve's context per slot when -c is not given -> (n_ctx, why): the model's trained context, cut so
    that `sequences` KV caches of `kind` take at most SERVE_KV_SHARE of the memory this process can use (`memory`,
    default memory_limit()), in steps of CTX_STEP, and not below min(SERVE_CTX_FLOOR, the trained context)."""
    memory = memory_limit() if memory is None else memory
    trained = cfg.n_ctx_train
    per_token = kv_bytes(cfg, 1, kind, sequences)
    fit = int(SERVE_KV_SHARE * memory // max(per_token, 1)) // CTX_STEP * CTX_STEP
    n = min(trained, max(fit, min(SERVE_CTX_FLOOR, trained)))
    why = (f"the model's trained context" if n == trained else
           f"the model's {trained} cut to {SERVE_KV_SHARE:g} of {memory / 2**30:.1f} GiB for {sequences} slot(s)' KV"
           if n == fit else f"the floor of {SERVE_CTX_FLOOR}")
    return n, why


def check_kv_fits(cfg: ModelConfig, n_ctx: int, kind: str = "f32", sequences: int = 1) -> None:
    """A one-line error when `sequences` KV caches of `n_ctx` positions could never be held (the caches are
    allocated up front; an untouched page costs nothing, so a context that fits memory is fine even when most of it
    is never used). It names the bytes: a file whose context_length is 2**31 asks for terabytes."""
    need = kv_bytes(cfg, n_ctx, kind, sequences)
    have = memory_limit()
    if need > have:
        raise PymoeError(f"a context of {n_ctx} tokens needs {need / 2**30:,.1f} GiB of KV cache"
                         + (f" ({sequences} sequences)" if sequences > 1 else "")
                         + f", more than the {have / 2**30:,.1f} GiB this process can use: give a smaller context "
                         "(-c/--ctx-size)")


def new_kv(cfg: ModelConfig, n_ctx: int, kind: str = "f32") -> KVCache:
    """An empty KV cache of `n_ctx` positions for one sequence, stored as `kind` (f32, f16 or int8)."""
    if kind not in KV_KINDS:
        raise PymoeError(f"KV cache type must be one of {', '.join(KV_KINDS)}, got '{kind}'")
    return {"f32": KVCache, "f16": Float16KVCache, "int8": Int8KVCache}[kind](cfg, n_ctx)


def kv_nbytes(kv: KVCache) -> int:
    """Bytes the cache's K and V storage holds (all n_ctx positions, allocated up front; a device KV cache says)."""
    if hasattr(kv, "nbytes"):
        return kv.nbytes
    return kv.k.nbytes + (kv.v.nbytes if kv.v is not None else 0)
