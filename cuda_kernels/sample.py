"""Sampling on the device: the host sampler's random draw (engine/sampler.py, temperature > 0 with top-k, top-p and
min-p) made where the logits are, so that a decode step sends 4 bytes back instead of V floats.

What this is: one kernel plus its host wrappers and its NumPy twin:

  sample(logits, temperature, top_k, top_p, min_p, u, out)
      logits float32 [T, V] (device), u a uniform double in [0, 1) -> out int32 [T]: row t's token, the one
      `sample_reference` (and the host Sampler, given the same u) picks.
  sample_at(logits, draw_k, draw_f, out)
      the same with the settings and u already in device memory (`draw_record`, `draw_views`): what a decode step
      launches, its settings uploaded with its token id (backends/cuda.py `begin_step`), so a graph replays it.

The host Sampler draws with `rng.choice(n, p=probs)`, which in NumPy's Generator (numpy/random/_generator.pyx,
`choice` with replace=True) is: cdf = p.cumsum(); cdf /= cdf[-1]; u = self.random(); searchsorted(cdf, u,
side='right'): one double from the generator, then a search. So the host draws u from the sampler's own generator
(the generator advances as for a host draw; tests/test_cuda_sample_kernel.py checks both facts) and the device repeats
the host's arithmetic on the same candidates in the same order, in float64:
  1. candidates: the k = top_k (all V at 0) largest logits in the host's order (np.argsort(-logits, kind="stable"):
     larger first, ties by smaller id). Found by a radix select on the logits' order-preserving 32-bit keys (four
     passes of 8 bits with a 256-bin shared histogram) for the k-th largest key; the keys above it and the first of
     the keys equal to it (by id: per-thread contiguous chunks and an exclusive scan of their tie counts) are
     gathered, then ranked by (key, id) in shared memory.
  2. p = exp(l - l[0]) / sum (numpy's pairwise summation order: `pairwise_sum`, NumPy's pairwise_sum of
     numpy/_core/src/umath/loops_utils.h.src), top-p (first prefix whose sequential cumulative sum reaches top_p),
     min-p (p >= min_p p[0]), the temperature (z = l / T; an overflowing z[0] is greedy), probs = exp(z - max z) /
     pairwise sum, the cumulative sum divided by its last element, and the first index whose value exceeds u.
     Thread 0 runs this O(k) scalar chain; the exponentials of step 2's first line run on every thread.
Where the float results could still differ from the host's: exp (CUDA's double exp is within 1 ulp; NumPy's may round
the other way), which moves a cut or a cumulative sum by an ulp, so the token differs only where u or top_p or min_p
p[0] lies within a few ulps (~1e-16) of a boundary; NaN logits (the host sorts NaN last, the keys put it first).
What this is not: a sort of the whole vocabulary: k is at most K_MAX (`fits`); a larger top-k (or top-k 0 with
V > K_MAX) stays on the host, as do the other samplers (typical-p, XTC, mirostat, penalties, grammar).
Version 1: grid (T,), one block per row, `threads` threads (THREADS on a GPU).
Shape legend: T rows, V vocabulary, k candidates (<= K_MAX).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .quant_matvec import check, on_device

K_MAX = 1024  # the most candidates (top-k) the kernel takes: their keys, ids and probabilities sit in shared memory
THREADS = 128  # threads per block (at most; a power of two is not needed)
BINS = 256  # radix-select digits of 8 bits
LEAF = 128  # numpy's PW_BLOCKSIZE: pairwise summation adds blocks of up to 128 with 8 accumulators
STACK = 16  # the pairwise summation's explicit stack: depth log2(K_MAX / LEAF) + 1 internal nodes, 2 entries each


def fits(top_k: int, V: int) -> bool:
    """The kernel takes this draw: k = top_k (V if 0 or more than V) candidates fit in its shared arrays."""
    k = V if top_k <= 0 or top_k > V else top_k
    return 0 < k <= K_MAX


# ----------------------------------------------------------------------------------------------------------------
# The NumPy twin: the host sampler's draw with the uniform number given
# ----------------------------------------------------------------------------------------------------------------
def sample_reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
                     u: float) -> np.ndarray:
    """logits float32 [T, V] -> int32 [T]: Sampler._distribution's candidates and probabilities (with only top-k,
    top-p, min-p and the temperature), then Generator.choice's search with the uniform u."""
    from pymoe.engine.sampler import filter_candidates

    out = np.zeros(logits.shape[0], np.int32)
    for t, row in enumerate(np.asarray(logits, np.float32)):
        ids, cand = filter_candidates(row, top_k, top_p, min_p)  # [C] most likely first, float64
        with np.errstate(over="ignore"):
            z = cand / temperature  # [C]
        if not np.isfinite(z[0]):  # the host's greedy fallback
            out[t] = ids[0]
            continue
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        cdf = probs.cumsum()  # Generator.choice
        cdf /= cdf[-1]
        out[t] = ids[int(cdf.searchsorted(u, side="right"))]
    return out


def pairwise_sum_reference(a: np.ndarray) -> float:
    """numpy's float64 sum (np.add.reduce of a contiguous array), written out: blocks of up to LEAF summed with 8
    accumulators, longer runs split in two at a multiple of 8 below the middle."""
    n = a.size
    if n < 8:
        r = 0.0
        for x in a:
            r += x
        return r
    if n <= LEAF:
        r = [a[j] for j in range(8)]
        i = 8
        while i < n - n % 8:
            for j in range(8):
                r[j] += a[i + j]
            i += 8
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        for x in a[i:]:
            res += x
        return res
    n2 = n // 2
    n2 -= n2 % 8
    return pairwise_sum_reference(a[:n2]) + pairwise_sum_reference(a[n2:])


# ----------------------------------------------------------------------------------------------------------------
# Device functions
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit(device=True)
def order_key(b):
    """A float32's bits (uint32) -> int64 in [0, 2^32) ordered as the floats: the sign bit flipped for positives, all
    bits for negatives; -0.0 takes +0.0's key (they are equal: the host's stable sort orders them by id)."""
    k = np.int64(b)
    if k == 2147483648:  # -0.0
        return np.int64(2147483648)
    if k > 2147483648:  # negative: a larger magnitude, a smaller key
        return np.int64(4294967295) - k
    return k + np.int64(2147483648)


@cuda.jit(device=True)
def leaf_sum(a, lo, n):
    """numpy's pairwise_sum for n <= LEAF values a[lo:lo + n]."""
    if n < 8:
        r = 0.0
        for i in range(n):
            r += a[lo + i]
        return r
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@cuda.jit(device=True)
def pairwise_sum(a, n):
    """sum(a[:n]) in numpy's pairwise order (`pairwise_sum_reference`), its recursion on an explicit stack: a node
    is split into (left, right), left evaluated first; a finished node's two values are added as left + right."""
    st_lo = cuda.local.array(STACK, np.int64)
    st_n = cuda.local.array(STACK, np.int64)
    st_open = cuda.local.array(STACK, np.int32)
    vals = cuda.local.array(STACK, np.float64)
    st_lo[0], st_n[0], st_open[0] = 0, n, 0
    sp, vp = 1, 0
    while sp > 0:
        lo, m = st_lo[sp - 1], st_n[sp - 1]
        if m <= LEAF:
            sp -= 1
            vals[vp] = leaf_sum(a, lo, m)
            vp += 1
        elif st_open[sp - 1] == 0:
            st_open[sp - 1] = 1
            m2 = m // 2
            m2 -= m2 % 8
            st_lo[sp], st_n[sp], st_open[sp] = lo + m2, m - m2, 0  # right, below
            st_lo[sp + 1], st_n[sp + 1], st_open[sp + 1] = lo, m2, 0  # left, on top: done first
            sp += 2
        else:
            sp -= 1
            vals[vp - 2] = vals[vp - 2] + vals[vp - 1]  # left + right
            vp -= 1
    return vals[0]


# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------
@cuda.jit
def sample_kernel(logits, bits, draw_k, draw_f, out):
    """logits float32 [T, V], bits the same bytes as uint32, the draw's settings in device memory (draw_k int32 [1]:
    top_k; draw_f float64 [4]: temperature, top_p, min_p, u: `draw_record`) -> out[t]; grid (T,), block
    (<= THREADS,)."""
    t = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    V = logits.shape[1]
    top_k = draw_k[0]
    temperature, top_p, min_p, u = draw_f[0], draw_f[1], draw_f[2], draw_f[3]
    k = V if top_k <= 0 or top_k > V else top_k
    hist = cuda.shared.array(BINS, np.int32)
    sel = cuda.shared.array(3, np.int64)  # the key's prefix so far, its mask, the ties at it still to take
    n_gt = cuda.shared.array(1, np.int32)  # keys above the k-th gathered so far
    cnt = cuda.shared.array(THREADS, np.int32)  # each thread's ties -> their exclusive offsets
    keys = cuda.shared.array(K_MAX, np.int64)  # [k] gathered, any order
    ids = cuda.shared.array(K_MAX, np.int32)
    sid = cuda.shared.array(K_MAX, np.int32)  # [k] ids most likely first (ties by id)
    p = cuda.shared.array(K_MAX, np.float64)
    if tid == 0:
        sel[0], sel[1], sel[2] = 0, 0, k
        n_gt[0] = 0
    cuda.syncthreads()
    # 1. the k-th largest key, 8 bits at a time from the top
    for step in range(4):
        shift = 24 - 8 * step
        for b in range(tid, BINS, nt):
            hist[b] = 0
        cuda.syncthreads()
        prefix, mask = sel[0], sel[1]
        for i in range(tid, V, nt):
            key = order_key(bits[t, i])
            if (key & mask) == prefix:
                cuda.atomic.add(hist, (key >> shift) & 255, 1)
        cuda.syncthreads()
        if tid == 0:
            need, above, d = sel[2], 0, 255
            while d > 0 and above + hist[d] < need:
                above += hist[d]
                d -= 1
            sel[2] = need - above
            sel[0] = prefix | (np.int64(d) << shift)
            sel[1] = mask | (np.int64(255) << shift)
        cuda.syncthreads()
    kth, take = sel[0], sel[2]
    above_kth = k - take
    # 2. gather: every key above kth, and the first `take` keys equal to it in id order
    chunk = (V + nt - 1) // nt
    lo = tid * chunk
    hi = lo + chunk if lo + chunk < V else V
    c = 0
    for i in range(lo, hi):
        if order_key(bits[t, i]) == kth:
            c += 1
    cnt[tid] = c
    cuda.syncthreads()
    if tid == 0:
        run = 0
        for j in range(nt):
            c = cnt[j]
            cnt[j] = run
            run += c
    cuda.syncthreads()
    r = cnt[tid]
    for i in range(lo, hi):
        key = order_key(bits[t, i])
        if key > kth:
            slot = cuda.atomic.add(n_gt, 0, 1)
            keys[slot] = key
            ids[slot] = i
        elif key == kth:
            if r < take:
                keys[above_kth + r] = key
                ids[above_kth + r] = i
            r += 1
    cuda.syncthreads()
    # 3. rank by (key descending, id ascending): the host's stable order
    for i in range(tid, k, nt):
        ki, ii, rank = keys[i], ids[i], 0
        for j in range(k):
            if keys[j] > ki or (keys[j] == ki and ids[j] < ii):
                rank += 1
        sid[rank] = ii
    cuda.syncthreads()
    # 4. the host's float64 chain: p = exp(l - l0) / sum, top-p, min-p, temperature, probs, the search for u
    l0 = np.float64(logits[t, sid[0]])
    for i in range(tid, k, nt):
        p[i] = math.exp(np.float64(logits[t, sid[i]]) - l0)
    cuda.syncthreads()
    if tid == 0:
        s = pairwise_sum(p, k)
        for i in range(k):
            p[i] = p[i] / s
        n = k
        if top_p < 1.0:
            cs = 0.0
            for i in range(k):
                cs += p[i]
                if cs >= top_p:
                    n = i + 1
                    break
        m = n
        if min_p > 0.0:
            cut = min_p * p[0]
            m = 0
            for i in range(n):
                if p[i] >= cut:  # sid compacted in place (m <= i)
                    sid[m] = sid[i]
                    m += 1
        z0 = np.float64(logits[t, sid[0]]) / temperature
        if not math.isfinite(z0):  # a temperature so small the largest logit overflows: greedy, as the host
            out[t] = sid[0]
        else:
            zmax = z0
            for i in range(m):
                zi = np.float64(logits[t, sid[i]]) / temperature
                if zi > zmax:
                    zmax = zi
            for i in range(m):
                p[i] = math.exp(np.float64(logits[t, sid[i]]) / temperature - zmax)
            s = pairwise_sum(p, m)
            cs = 0.0
            for i in range(m):  # the cumulative sum of probs = p / s, in place
                cs += p[i] / s
                p[i] = cs
            pick = m - 1
            for i in range(m):
                if p[i] / p[m - 1] > u:  # searchsorted(cdf / cdf[-1], u, side='right')
                    pick = i
                    break
            out[t] = sid[pick]


DRAW_WORDS = 9  # `draw_record`: 4 float64 as 8 int32 words, then top_k


def draw_record(temperature: float, top_k: int, top_p: float, min_p: float, u: float) -> np.ndarray:
    """A draw's settings as int32 [DRAW_WORDS]: [temperature, top_p, min_p, u (float64, 2 words each), top_k]; at an
    even int32 offset of a device array (8-byte aligned) its words are what `sample_kernel` reads as draw_f (float64
    [4]) and draw_k (int32 [1]): `draw_views`."""
    rec = np.zeros(DRAW_WORDS, np.int32)
    rec[:8].view(np.float64)[:] = (temperature, top_p, min_p, u)
    rec[8] = top_k
    return rec


def draw_views(buf, i: int):
    """The device int32 array buf's words i .. i + DRAW_WORDS (a `draw_record`, i even) -> (draw_k int32 [1],
    draw_f float64 [4]) for `sample_kernel`."""
    if i % 2:
        raise ValueError(f"a draw record at int32 offset {i}: its float64 words need an even offset")
    return buf[i + 8:i + 9], buf[i:i + 8].view(np.float64)


def check_draw(temperature: float, top_k: int, u: float, V: int) -> None:
    """The draw's settings the kernel takes (ValueError otherwise)."""
    if not fits(top_k, V):
        raise ValueError(f"top_k {top_k} over a vocabulary of {V}: more than the kernel's {K_MAX} candidates")
    if not (temperature > 0 and 0.0 <= u < 1.0):
        raise ValueError("temperature must be > 0 and u in [0, 1)")


def sample(logits, temperature: float, top_k: int, top_p: float, min_p: float, u: float, out, threads: int = THREADS,
           stream=0):
    """logits float32 [T, V] (device) -> out int32 [T] (device, written): each row's draw for the uniform u (its
    settings uploaded first: `draw_record`)."""
    logits = on_device(logits, "logits")
    check(logits, "logits", np.float32, 2)
    check_draw(temperature, top_k, u, logits.shape[1])
    rec = cuda.to_device(draw_record(temperature, top_k, top_p, min_p, u), stream=stream)
    return sample_at(logits, *draw_views(rec, 0), out, threads=threads, stream=stream)


def sample_at(logits, draw_k, draw_f, out, threads: int = THREADS, stream=0):
    """logits float32 [T, V] (device), the draw's settings already on the device (`draw_views`: a step uploads them
    with its token id, backends/cuda.py `begin_step`) -> out int32 [T] (device, written). The settings are the
    caller's to check (`check_draw`): the kernel reads them where they are, so a CUDA graph replays it."""
    logits, out = on_device(logits, "logits"), on_device(out, "out")
    check(logits, "logits", np.float32, 2)
    check(out, "out", np.int32, 1)
    if not 0 < threads <= THREADS:
        raise ValueError(f"threads must be in 1..{THREADS}")
    T = logits.shape[0]
    if T:
        sample_kernel[(T,), threads, stream](logits, logits.view(np.uint32), draw_k, draw_f, out)
    return out
