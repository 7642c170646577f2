"""Ragged decode attention on the GPU: one new query token for each of B sequences, each over its own KV cache of
its own length, in one launch.

    out[b, h] = sum_{s <= pos[b]} softmax_s(q[b, h] . k_all[seq[b], s, g] / sqrt(Dh)) v_all[seq[b], s, g]

What this is: `ragged_decode_attention(q, k_all, v_all, seqs, pos, window, sinks)` and its kernel, the attention of a
decode step over the server's slots at once (docs/expert-cache.md "What comes next on the GPU"). The KV caches of
the sequences are rows of one array per layer (backends/cuda.py allocates every device KV cache as a slice of one
pool, `CUDABackend.kv_pool`: k_all = pool[:, layer row], [S, S_max, G, Dh], any strides), and the per-sequence table
is two device arrays: seqs int32 [B] (which cache row b reads) and pos int32 [B] (its query's position: keys
0..pos[b], written before, its own included). A sliding window (keys from pos - window + 1) and per-head sinks
(gpt-oss) as attention.chunk_attention has them.
What this is not: the KV writes or RoPE; the rest of a batched device step (the step runs one sequence now:
backends/cuda.py `begin_step`).
The reference is `ragged_decode_attention_reference` (below): reference.attention of each row over its own cache.

Versions: 1 (this). One block per (row, query head), attention.chunk_attention_kernel's passes with n_keys =
pos[b] + 1 and the cache row seq[b]: each float32 operation in the same order, so row b equals the decode-attention
kernel run alone on its sequence's cache (tests/test_cuda_ragged_attention.py holds both).
Shape legend: B rows (sequences), H query heads, G KV heads, Dh / Dv key / value head size, S caches in the pool,
S_max positions per cache.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .attention import MAX_DV_PER_THREAD, THREADS
from .quant_matvec import check, on_device
from .reduce import NEG_INF, block_max, block_sum


@cuda.jit
def ragged_decode_attention_kernel(q, k_all, v_all, seqs, pos, window, scale, sinks, has_sinks, out):
    """q float32 [B, H, Dh]; k_all float32 [S, S_max, G, Dh], v_all float32 [S, S_max, G, Dv] (any strides); seqs,
    pos int32 [B]; window (0: none); sinks float32 [H] (read only with has_sinks); out float32 [B, H, Dv].
    grid (B, H), block (THREADS,). Row b sees keys first..pos[b] of cache seqs[b]."""
    b = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    c = seqs[b]
    g = h // (q.shape[1] // k_all.shape[2])  # the KV head this query head reads
    Dh = q.shape[2]
    Dv = v_all.shape[3]
    n_keys = pos[b] + 1  # causal: this query's own key is the last it sees
    first = 0
    if window > 0 and n_keys > window:
        first = n_keys - window
    buf = cuda.shared.array(THREADS, np.float32)  # [THREADS] the reductions'
    tile = cuda.shared.array(THREADS, np.float32)  # [THREADS] one tile's scores, then their exp(score - max)

    # a. the scaled scores' maximum (with the sink's logit)
    best = NEG_INF
    for s in range(first + tid, n_keys, THREADS):
        dot = np.float32(0.0)
        for d in range(Dh):
            dot += q[b, h, d] * k_all[c, s, g, d]
        score = dot * scale
        if score > best:
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
                dot += q[b, h, d] * k_all[c, s, g, d]
            tile[tid] = dot * scale  # stored, so rounded to float32 as the decode kernel's scores
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
                    acc[i] += w * v_all[c, base + j, g, d]
        cuda.syncthreads()  # everyone has read the tile before the next one overwrites it
    total = block_sum(buf, tid, total)
    if has_sinks:
        total += math.exp(sinks[h] - best)
    for i in range(MAX_DV_PER_THREAD):
        d = tid + i * THREADS
        if d < Dv:
            out[b, h, d] = acc[i] / total


def ragged_decode_attention(q, k_all, v_all, seqs, pos, window: int = 0, sinks=None, out=None, stream=0):
    """q float32 [B, H, Dh] (row b: sequence seqs[b]'s token at position pos[b]), k_all [S, S_max, G, Dh], v_all
    [S, S_max, G, Dv] (device, cache seqs[b]'s rows 0..pos[b] filled; any strides), seqs and pos int32 [B] (device),
    window (0: none), sinks float32 [H] or None -> out float32 [B, H, Dv]. One launch for the B rows. The positions
    are device data (not checked here against S_max: the caller's table keeps pos[b] < S_max)."""
    q, k, v = on_device(q, "q"), on_device(k_all, "k_all"), on_device(v_all, "v_all")
    seqs, pos = on_device(seqs, "seqs"), on_device(pos, "pos")
    check(q, "q", np.float32, 3)
    check(k, "k_all", np.float32, 4)
    check(v, "v_all", np.float32, 4)
    check(seqs, "seqs", np.int32, 1)
    check(pos, "pos", np.int32, 1)
    B, H, Dh = q.shape
    S, S_max, G, _ = k.shape
    Dv = v.shape[3]
    if k.shape[3] != Dh or tuple(v.shape[:3]) != tuple(k.shape[:3]) or G == 0 or H % G:
        raise ValueError(f"ragged_decode_attention: q {tuple(q.shape)}, k_all {tuple(k.shape)}, v_all "
                         f"{tuple(v.shape)} do not fit (need k_all [S, S_max, G, {Dh}], v_all [S, S_max, G, Dv], "
                         f"{H} query heads a multiple of G)")
    if seqs.shape[0] != B or pos.shape[0] != B:
        raise ValueError(f"ragged_decode_attention: seqs {tuple(seqs.shape)} and pos {tuple(pos.shape)} must have "
                         f"one entry per row ({B})")
    if Dv > THREADS * MAX_DV_PER_THREAD:
        raise ValueError(f"ragged_decode_attention: value head size {Dv} over {THREADS * MAX_DV_PER_THREAD}")
    out = cuda.device_array((B, H, Dv), np.float32, stream=stream) if out is None else on_device(out, "out")
    check(out, "out", np.float32, 3)
    if tuple(out.shape) != (B, H, Dv):
        raise ValueError(f"ragged_decode_attention: out {tuple(out.shape)} must be {(B, H, Dv)}")
    has_sinks = sinks is not None
    if has_sinks:
        sinks = on_device(sinks, "sinks")
        check(sinks, "sinks", np.float32, 1)
        if sinks.shape[0] != H:
            raise ValueError(f"ragged_decode_attention: sinks has {sinks.shape[0]} values for {H} heads")
    else:
        sinks = out[0, 0]  # a float32 row standing in (unread without sinks)
    if B:
        ragged_decode_attention_kernel[(B, H), THREADS, stream](q, k, v, seqs, pos, window,
                                                                np.float32(1.0 / math.sqrt(Dh)), sinks, has_sinks,
                                                                out)
    return out


def ragged_decode_attention_reference(q, k_all, v_all, seqs, pos, window: int = 0, sinks=None) -> np.ndarray:
    """The NumPy twin: row b is reference.attention of its query over cache seqs[b]'s keys 0..pos[b] ->
    float32 [B, H, Dv]."""
    from pymoe.backends.reference import attention

    B, H, _ = q.shape
    out = np.empty((B, H, v_all.shape[3]), np.float32)
    for b in range(B):
        c, p = int(seqs[b]), int(pos[b])
        out[b] = attention(q[b][None], k_all[c, :p + 1], v_all[c, :p + 1], p, window,
                           sinks).reshape(H, -1)  # [1, H * Dv] -> [H, Dv]
    return out
