"""Attention on the GPU against the KV cache, grouped-query (GQA): one new query token (decode) or a chunk of T.

    out[h] = sum_{s <= p} softmax_s(q[h] . k[s, g] / sqrt(Dh)) v[s, g]       g = h // (H / G)

What this is: `decode_attention(q, k_cache, v_cache, pos)` and its kernel. Causality is implicit: the query at
position pos attends to keys 0..pos (which the caller has already written, its own key included), so the kernel
simply stops at n_keys = pos + 1; nothing is masked.
`chunk_attention(q, k_cache, v_cache, p0, window, sinks)` is the prefill form: T queries at positions p0..p0+T-1 in
one launch, query t against keys first_t..p0+t (first_t = 0, or p0 + t - window + 1 with a sliding window), with
gpt-oss's per-head sink logit optionally in the softmax (as gpt_oss.decode_attention_ws); V may be a strided view
(MLA: the cache rows' first kv_lora_rank values).
What this is not: the KV-cache writes, RoPE (norm_rope.py). The reference is
pymoe.backends.reference.attention(q, k[:p0+T], v[:p0+T], p0, window, sinks), NumPy (q[None] and p0 = pos for decode).

Versions (naive -> fast):
  1. (this) one block of THREADS threads per query head, three passes over the keys in one kernel:
       a. scores[h, s] = q[h] . k[s, g] * scale for s strided over the threads; block max (reduce.py);
       b. scores[h, s] = exp(scores[h, s] - max), block sum;
       c. out[h, d] = sum_s scores[h, s] v[s, g, d] / sum for d strided over the threads (coalesced over d).
     The scores live in a global scratch [H, S_max] (any context length fits; it stays in L2 for decode-size S);
     the G / H query heads sharing a KV head each read it again (H / G times the KV traffic of a fused kernel).
  2. chunk_attention_kernel: one block per (query token, query head), the same three passes without the global
     scratch: a. the scores' maximum; b+c. the keys in tiles of THREADS, each thread scoring key tile + tid again
     (the score rounded to float32 through shared memory, as version 1's global scratch rounds it), its
     exp(score - max) added to the sum and left in shared memory, then every thread adding the tile's weighted
     values into its output dimensions d = tid, tid + THREADS, ... (up to MAX_DV_PER_THREAD of them, in registers).
     Each float32 operation is version 1's, in version 1's order (thread tid's partial sums over keys first + tid,
     first + tid + THREADS, ...; the values added in key order), so a chunk's rows equal the decode kernel's, one
     token at a time; the dot products are computed twice (a, then b+c) instead of stored.
  Not done: split-K "flash-decoding" (many blocks per head, partial softmax merged with a log-sum-exp), one block
  per KV head serving its H / G query heads, online softmax in registers, half-precision KV.

Test: NUMBA_ENABLE_CUDASIM=1 pytest -m cuda tests/test_cuda_kernels.py -k attention
Shape legend: H query heads, G KV heads (n_head_kv), Dh key/query head size, Dv value head size, S_max cache rows.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .quant_matvec import check, on_device
from .reduce import NEG_INF, block_max, block_sum

THREADS = 64  # threads per block (a power of two: reduce.py); one block per query head
MAX_DV_PER_THREAD = 8  # chunk_attention's output accumulators per thread: Dv <= THREADS * 8 = 512 (MLA's C = 512)


@cuda.jit(device=True)
def _attend_one(q, k, v, n_keys, scale, scores, out, buf):
    """Query head blockIdx.x of one token against keys 0..n_keys-1 (decode_attention_kernel's body; buf: the
    block's shared float32 [THREADS])."""
    h = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    g = h // (q.shape[0] // k.shape[1])  # the KV head this query head reads
    Dh = q.shape[1]

    # a. scaled scores and their maximum (subtracted before exp: no overflow)
    best = NEG_INF
    for s in range(tid, n_keys, THREADS):
        dot = np.float32(0.0)
        for d in range(Dh):
            dot += q[h, d] * k[s, g, d]
        score = dot * scale
        scores[h, s] = score
        if score > best:  # not max(): numba 0.68's built-in CUDA target cannot type it
            best = score
    best = block_max(buf, tid, best)

    # b. unnormalised probabilities and their sum (each thread revisits the keys it scored)
    total = np.float32(0.0)
    for s in range(tid, n_keys, THREADS):
        e = math.exp(scores[h, s] - best)
        scores[h, s] = e
        total += e
    total = block_sum(buf, tid, total)  # its barriers also make every thread's scores visible to the block

    # c. probability-weighted sum of the values, one output dimension per thread
    for d in range(tid, v.shape[2], THREADS):
        acc = np.float32(0.0)
        for s in range(n_keys):
            acc += scores[h, s] * v[s, g, d]
        out[h, d] = acc / total


@cuda.jit
def decode_attention_kernel(q, k, v, n_keys, scale, scores, out):
    """q float32 [H, Dh], k float32 [S_max, G, Dh], v float32 [S_max, G, Dv], keys 0..n_keys-1 used;
    scores float32 [H, >= n_keys] scratch; out float32 [H, Dv]. grid (H,), block (THREADS,)."""
    buf = cuda.shared.array(THREADS, np.float32)  # [THREADS]
    _attend_one(q, k, v, n_keys, scale, scores, out, buf)


@cuda.jit
def decode_attention_at_kernel(q, k, v, at, scale, scores, out):
    """decode_attention_kernel at position at[0] (int32 in device memory: a device step's, so that a CUDA graph
    replays the launch at every position): keys 0..at[0]; k, v the whole cache [S_max, ...], scores [H, S_max]."""
    buf = cuda.shared.array(THREADS, np.float32)  # [THREADS]
    n_keys = at[0] + 1
    if n_keys > k.shape[0]:  # (the host checks the position before it uploads it)
        n_keys = k.shape[0]
    _attend_one(q, k, v, n_keys, scale, scores, out, buf)


@cuda.jit
def kv_store_kernel(k, v, k_cache, v_cache, at):
    """k float32 [T, G, Dh], v [T, G, Dv] -> k_cache, v_cache rows at[0] + t (int32 in device memory: a device step's
    KV row, so that a CUDA graph replays the write at every position); grid (T, G), block (THREADS,)."""
    t = cuda.blockIdx.x
    g = cuda.blockIdx.y
    r = at[0] + t
    if r < k_cache.shape[0]:
        for d in range(cuda.threadIdx.x, k.shape[2], THREADS):
            k_cache[r, g, d] = k[t, g, d]
        for d in range(cuda.threadIdx.x, v.shape[2], THREADS):
            v_cache[r, g, d] = v[t, g, d]


def kv_store(k, v, k_cache, v_cache, at, stream=0):
    """k [T, G, Dh], v [T, G, Dv] (device) into k_cache [S_max, G, Dh], v_cache [S_max, G, Dv] at rows at[0].. (at:
    int32 [1] on the device); the device step's KV write (a copy into rows known only on the device)."""
    k, v, kc, vc = (on_device(a, n) for a, n in ((k, "k"), (v, "v"), (k_cache, "k_cache"), (v_cache, "v_cache")))
    at = on_device(at, "at")
    check(at, "at", np.int32, 1)
    for a, n in ((k, "k"), (v, "v"), (kc, "k_cache"), (vc, "v_cache")):
        check(a, n, np.float32, 3)
    if tuple(k.shape[1:]) != tuple(kc.shape[1:]) or tuple(v.shape[1:]) != tuple(vc.shape[1:]) \
            or k.shape[0] != v.shape[0]:
        raise ValueError(f"kv_store: k {tuple(k.shape)}, v {tuple(v.shape)} do not fit k_cache {tuple(kc.shape)}, "
                         f"v_cache {tuple(vc.shape)}")
    if k.shape[0]:
        kv_store_kernel[(k.shape[0], k.shape[1]), THREADS, stream](k, v, kc, vc, at)
    return kc, vc


def kv_store_reference(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, r0: int) -> None:
    """NumPy twin: the rows written in place."""
    k_cache[r0:r0 + k.shape[0]] = k
    v_cache[r0:r0 + v.shape[0]] = v


def decode_attention(q, k_cache, v_cache, pos: int, out=None, scores=None, stream=0):
    """q float32 [H, Dh] (one token at position pos), k_cache [S_max, G, Dh], v_cache [S_max, G, Dv] (device,
    rows 0..pos filled) -> out float32 [H, Dv]. `scores` float32 [H, >= pos + 1] is optional scratch. pos: an int,
    or int32 [1] in device memory that the kernel reads (`decode_attention_at_kernel`; scores then [H, S_max])."""
    q, k, v = on_device(q, "q"), on_device(k_cache, "k_cache"), on_device(v_cache, "v_cache")
    check(q, "q", np.float32, 2)
    check(k, "k_cache", np.float32, 3)
    check(v, "v_cache", np.float32, 3)
    H, Dh = q.shape
    S_max, G, _ = k.shape
    Dv = v.shape[2]
    if k.shape[2] != Dh or v.shape[:2] != k.shape[:2] or G == 0 or H % G:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         f"fit (need k [S, G, {Dh}], v [S, G, Dv], {H} query heads a multiple of G)")
    at = None
    if not isinstance(pos, (int, np.integer)):  # int32 [1] on the device: decode_attention_at_kernel
        at = on_device(pos, "pos")
        check(at, "pos", np.int32, 1)
        pos = S_max - 1  # (the scratch and the checks below: the whole cache)
    if not 0 <= pos < S_max:
        raise ValueError(f"decode_attention: position {pos} outside the cache of {S_max} rows")
    out = cuda.device_array((H, Dv), np.float32, stream=stream) if out is None else on_device(out, "out")
    check(out, "out", np.float32, 2)
    scores = (cuda.device_array((H, pos + 1), np.float32, stream=stream) if scores is None
              else on_device(scores, "scores"))  # [H, >= pos + 1]
    check(scores, "scores", np.float32, 2)
    if tuple(out.shape) != (H, Dv) or scores.shape[0] != H or scores.shape[1] < pos + 1:
        raise ValueError(f"decode_attention: out {tuple(out.shape)} must be {(H, Dv)}, scores "
                         f"{tuple(scores.shape)} at least {(H, pos + 1)}")
    if at is not None:
        decode_attention_at_kernel[H, THREADS, stream](q, k, v, at, np.float32(1.0 / math.sqrt(Dh)), scores, out)
        return out
    decode_attention_kernel[H, THREADS, stream](q, k, v, pos + 1, np.float32(1.0 / math.sqrt(Dh)), scores, out)
    return out


@cuda.jit(device=True)
def attend_tiled(q, t, h, k, v, first, n_keys, scale, sinks, has_sinks, out, buf, tile):
    """Query t, head h (one block) of q float32 [T, H, Dh] against keys first..n_keys-1 of k [S_max, G, Dh], v
    [S_max, G, Dv] (any strides) -> out[t, h, :] float32 [Dv]; sinks float32 [H] read only with has_sinks; buf, tile:
    the block's shared float32 [THREADS]. The body of chunk_attention_kernel and of
    ragged_attention.ragged_decode_attention_kernel (one device function: the same float32 operations in the same
    order, so each row of either equals the decode kernel's bits)."""
    tid = cuda.threadIdx.x
    g = h // (q.shape[1] // k.shape[1])  # the KV head this query head reads
    Dh = q.shape[2]
    Dv = v.shape[2]

    # a. the scaled scores' maximum (with the sink's logit: the maximum ggml subtracts)
    best = NEG_INF
    for s in range(first + tid, n_keys, THREADS):
        dot = np.float32(0.0)
        for d in range(Dh):
            dot += q[t, h, d] * k[s, g, d]
        score = dot * scale
        if score > best:  # not max(): numba 0.68's built-in CUDA target cannot type it
            best = score
    best = block_max(buf, tid, best)
    if has_sinks and sinks[h] > best:
        best = sinks[h]

    # b+c. tile by tile: the unnormalised probabilities (their sum per thread), then the values they weight
    acc = cuda.local.array(MAX_DV_PER_THREAD, np.float32)  # [Dv / THREADS] this thread's output dimensions
    for i in range(MAX_DV_PER_THREAD):
        acc[i] = np.float32(0.0)
    total = np.float32(0.0)
    for base in range(first, n_keys, THREADS):
        s = base + tid
        if s < n_keys:
            dot = np.float32(0.0)
            for d in range(Dh):
                dot += q[t, h, d] * k[s, g, d]
            tile[tid] = dot * scale  # stored, so rounded to float32 as version 1's scores[h, s]
        cuda.syncthreads()
        if s < n_keys:
            e = math.exp(tile[tid] - best)
            tile[tid] = e
            total += e
        cuda.syncthreads()
        m = n_keys - base  # keys in this tile
        if m > THREADS:
            m = THREADS
        for j in range(m):
            w = tile[j]
            for i in range(MAX_DV_PER_THREAD):
                d = tid + i * THREADS
                if d < Dv:
                    acc[i] += w * v[base + j, g, d]
        cuda.syncthreads()  # everyone has read the tile before the next one overwrites it
    total = block_sum(buf, tid, total)
    if has_sinks:
        total += math.exp(sinks[h] - best)
    for i in range(MAX_DV_PER_THREAD):
        d = tid + i * THREADS
        if d < Dv:
            out[t, h, d] = acc[i] / total


@cuda.jit
def chunk_attention_kernel(q, k, v, p0, window, scale, sinks, has_sinks, out):
    """q float32 [T, H, Dh] (positions p0..p0+T-1), k float32 [S_max, G, Dh], v float32 [S_max, G, Dv] (any strides),
    rows 0..p0+T-1 filled; window (0: none); sinks float32 [H] (read only with has_sinks); out float32 [T, H, Dv].
    grid (T, H), block (THREADS,). Query t sees keys first..n_keys-1, n_keys = p0 + t + 1."""
    t = cuda.blockIdx.x
    n_keys = p0 + t + 1  # causal: this query's own key is the last it sees
    first = 0
    if window > 0 and n_keys > window:
        first = n_keys - window
    buf = cuda.shared.array(THREADS, np.float32)  # [THREADS] the reductions'
    tile = cuda.shared.array(THREADS, np.float32)  # [THREADS] one tile's scores, then their exp(score - max)
    attend_tiled(q, t, cuda.blockIdx.y, k, v, first, n_keys, scale, sinks, has_sinks, out, buf, tile)


def chunk_attention(q, k_cache, v_cache, p0: int, window: int = 0, sinks=None, out=None, stream=0):
    """q float32 [T, H, Dh] (tokens at positions p0..p0+T-1), k_cache [S_max, G, Dh], v_cache [S_max, G, Dv] (device,
    rows 0..p0+T-1 filled; V may be a strided view), window (0: none), sinks float32 [H] or None (device)
    -> out float32 [T, H, Dv]. One launch for the chunk."""
    q, k, v = on_device(q, "q"), on_device(k_cache, "k_cache"), on_device(v_cache, "v_cache")
    check(q, "q", np.float32, 3)
    check(k, "k_cache", np.float32, 3)
    check(v, "v_cache", np.float32, 3)
    T, H, Dh = q.shape
    S_max, G, _ = k.shape
    Dv = v.shape[2]
    if k.shape[2] != Dh or v.shape[:2] != k.shape[:2] or G == 0 or H % G:
        raise ValueError(f"chunk_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         f"fit (need k [S, G, {Dh}], v [S, G, Dv], {H} query heads a multiple of G)")
    if T == 0 or p0 < 0 or p0 + T > S_max:
        raise ValueError(f"chunk_attention: positions {p0}..{p0 + T - 1} outside the cache of {S_max} rows")
    if Dv > THREADS * MAX_DV_PER_THREAD:
        raise ValueError(f"chunk_attention: value head size {Dv} over {THREADS * MAX_DV_PER_THREAD}")
    out = cuda.device_array((T, H, Dv), np.float32, stream=stream) if out is None else on_device(out, "out")
    check(out, "out", np.float32, 3)
    if tuple(out.shape) != (T, H, Dv):
        raise ValueError(f"chunk_attention: out {tuple(out.shape)} must be {(T, H, Dv)}")
    has_sinks = sinks is not None
    if has_sinks:
        sinks = on_device(sinks, "sinks")
        check(sinks, "sinks", np.float32, 1)
        if sinks.shape[0] != H:
            raise ValueError(f"chunk_attention: sinks has {sinks.shape[0]} values for {H} heads")
    else:
        sinks = out[0, 0]  # a float32 row standing in (unread without sinks)
    chunk_attention_kernel[(T, H), THREADS, stream](q, k, v, p0, window, np.float32(1.0 / math.sqrt(Dh)), sinks,
                                                    has_sinks, out)
    return out
