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
What this is not: the KV writes or RoPE (cuda_kernels/batch_step.py); the rest of the batched device step that
launches it (engine/device_batch.py, backends/cuda.py `attention_batch`).
The reference is `ragged_decode_attention_reference` (below): reference.attention of each row over its own cache.

Versions: 1 (this). One block per (row, query head), attention.chunk_attention_kernel's body (the device function
attention.attend_tiled) with n_keys = pos[b] + 1 over cache seqs[b]: each float32 operation in the same order, so
row b equals the decode-attention kernel run alone on its sequence's cache (tests/test_cuda_ragged_attention.py holds
both).
Shape legend: B rows (sequences), H query heads, G KV heads, Dh / Dv key / value head size, S caches in the pool,
S_max positions per cache.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .attention import MAX_DV_PER_THREAD, THREADS, attend_tiled
from .quant_matvec import check, on_device


@cuda.jit
def ragged_decode_attention_kernel(q, k_all, v_all, seqs, pos, window, scale, sinks, has_sinks, out):
    """q float32 [B, H, Dh]; k_all float32 [S, S_max, G, Dh], v_all float32 [S, S_max, G, Dv] (any strides); seqs,
    pos int32 [B]; window (0: none); sinks float32 [H] (read only with has_sinks); out float32 [B, H, Dv].
    grid (B, H), block (THREADS,). Row b sees keys first..pos[b] of cache seqs[b]: attention.attend_tiled over
    that cache (chunk_attention_kernel's body)."""
    b = cuda.blockIdx.x
    c = seqs[b]
    n_keys = pos[b] + 1  # causal: this query's own key is the last it sees
    first = 0
    if window > 0 and n_keys > window:
        first = n_keys - window
    buf = cuda.shared.array(THREADS, np.float32)  # [THREADS] the reductions'
    tile = cuda.shared.array(THREADS, np.float32)  # [THREADS] one tile's scores, then their exp(score - max)
    attend_tiled(q, b, cuda.blockIdx.y, k_all[c], v_all[c], first, n_keys, scale, sinks, has_sinks, out, buf, tile)


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
