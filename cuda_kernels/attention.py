"""Decode attention on the GPU: one new query token at position p against the KV cache, grouped-query (GQA).

    out[h] = sum_{s <= p} softmax_s(q[h] . k[s, g] / sqrt(Dh)) v[s, g]       g = h // (H / G)

What this is: `decode_attention(q, k_cache, v_cache, pos)` and its kernel. Causality is implicit: the query at
position pos attends to keys 0..pos (which the caller has already written, its own key included), so the kernel
simply stops at n_keys = pos + 1; nothing is masked.
What this is not: prefill attention (T queries at once, pymoe.backends.reference.attention on the host), the KV-cache writes,
RoPE (norm_rope.py). The reference is pymoe.backends.reference.attention(q[None], k[:pos+1], v[:pos+1], p0=pos), NumPy.

Versions (naive -> fast):
  1. (this) one block of THREADS threads per query head, three passes over the keys in one kernel:
       a. scores[h, s] = q[h] . k[s, g] * scale for s strided over the threads; block max (reduce.py);
       b. scores[h, s] = exp(scores[h, s] - max), block sum;
       c. out[h, d] = sum_s scores[h, s] v[s, g, d] / sum for d strided over the threads (coalesced over d).
     The scores live in a global scratch [H, S_max] (any context length fits; it stays in L2 for decode-size S);
     the G / H query heads sharing a KV head each read it again (H / G times the KV traffic of a fused kernel).
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


@cuda.jit
def decode_attention_kernel(q, k, v, n_keys, scale, scores, out):
    """q float32 [H, Dh], k float32 [S_max, G, Dh], v float32 [S_max, G, Dv], keys 0..n_keys-1 used;
    scores float32 [H, >= n_keys] scratch; out float32 [H, Dv]. grid (H,), block (THREADS,)."""
    h = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    g = h // (q.shape[0] // k.shape[1])  # the KV head this query head reads
    Dh = q.shape[1]
    buf = cuda.shared.array(THREADS, np.float32)  # [THREADS]

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


def decode_attention(q, k_cache, v_cache, pos: int, out=None, scores=None, stream=0):
    """q float32 [H, Dh] (one token at position pos), k_cache [S_max, G, Dh], v_cache [S_max, G, Dv] (device,
    rows 0..pos filled) -> out float32 [H, Dv]. `scores` float32 [H, >= pos + 1] is optional scratch."""
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
    decode_attention_kernel[H, THREADS, stream](q, k, v, pos + 1, np.float32(1.0 / math.sqrt(Dh)), scores, out)
    return out
