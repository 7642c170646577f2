"""The CPU backend: the primitives of backends/protocol.py compiled with Numba, on weights read in place.

What this is: `linear(w, x)` = x @ W.T for a stored weight W of any supported type, without ever dequantizing a
quantized W as a whole (quant/kernels.py decodes one block at a time). F32 weights are used in place (a view into
the memory map) through `f32_matmul` (bits independent of T). Small float vectors (norms, biases, the shared-expert
gate) are read once as float32.
Two paths for quantized weights, chosen once by `act_bits`:
  - integer (act_bits 15 = two 8-bit planes (qact.quantize_planes_ref: 16-bit accuracy through the 8-bit dots and
    tiles), the default when the experts have tiles (`default_width`), else 16, the default otherwise; 8 =
    llama.cpp's; or "auto": 8 for the routed experts, 16 for the rest,
    `ACT_MODES`; PYMOE_ACT_BITS=8): weights of a type in `qact.ACT_DOTS` (the K-quants, IQ1-IQ4, MXFP4, Q8_0, Q4_0,
    Q2_0; rows of whole 256-blocks) take the integer path, as llama.cpp does: x is quantized per 256 values (at 8
    bits per 32 for the formats llama.cpp pairs with block_q8_0: `qact.act_group`) and each block is dotted in
    integer arithmetic (quant/qact.py); the routed experts of a layer run in one fused kernel (`moe_experts`: gate + up + SwiGLU,
    then down with the routing weights, all chosen experts and tokens in one parallel call);
  - float (act_bits 0; every other type always): the float kernels decode a block to float32 and dot it with
    float x; the experts run one at a time. The CUDA backend computes its "cpu" misses this way (float math, as
    its kernels do).
Repacked weights (the products at 8 bits and at 15, two 8-bit planes): Q2_K..Q6_K, Q8_0, MXFP4 and IQ4_XS matrices are also kept 8 rows interleaved
(quant/repack.py); every product then reads 8 rows per call (one token, or a prefill chunk's tokens 4 at a time)
with the same bits: the dense weights repacked at load (`dense`), a routed expert the first time it runs
(`expert_row`; a copy in RAM beside the memory map, whose pages these products no longer read). The copies are
cut from chunks of 2 MiB pages (backends/arena.py: a decoded token reads ~100 MiB of them; in 4 KiB pages each
page is a TLB miss).
`CPUBackend(repack=False)` or PYMOE_REPACK=0 turns it off. The experts' copies are anonymous memory that the
system cannot drop as it drops the file's pages, so they stop at a budget (`repack_budget`: half the memory
available when the backend is made, or PYMOE_REPACK_MIB); an expert first run beyond it is read in place from the
memory map, by the same kernel with the same bits (a file of ~17 GB of experts on a 24 GiB machine would
otherwise end in the out-of-memory killer).
It implements every primitive of backends/protocol.py; rmsnorm and rope give the NumPy reference's bits exactly,
route the same experts (weights within exp's rounding), attention and F32 products the reference's math in an
order that does not depend on T (so a token gives the same bits decoded alone or in a prefill). The reference is backends/reference.py (`--backend reference`),
which the tests hold this backend to.
What this is not: a cache. Experts reach this backend as raw bytes chosen by the expert cache.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from typing import Optional

import numba
import numpy as np
from numba import njit, prange

from pymoe import quant
from pymoe.gguf.loader import Tensor
from .arena import HugeArena
from .attention_simd import MAX_DV, TILE_KEYS, KeyBlocks, scores_into, weighted_into
from .pool import HostPool
from .threads import ThreadGovernor, adaptive
from .reference import DenseWeight, HostArrays, experts_one_by_one, host_dense
from pymoe.quant import kernels, qact, repack
from pymoe.quant.kernels import dot, exp_f32
from pymoe.quant.qact import QK_K, has_int_dot, prefetch_line

# --act-bits -> (the dense products' activation width, the routed experts'): 16, 15 and 8 all at one width, 0 float
# kernels only; "auto" 8-bit x for the routed experts (the bulk of a token's weights), 16-bit for the rest
# (attention, shared expert, output head: docs/performance.md "Accuracy")
ACT_MODES = {"16": (16, 16), "8": (8, 8), "15": (15, 15), "0": (0, 0), "auto": (16, 8)}
DEFAULT_ACT_BITS = "16"  # without a file to look at (a CPUBackend made on its own); a model's: `default_width`
HEAD_NAMES = ("output.weight", "token_embd.weight")  # the output head's tensor (token_embd: a tied head)


def default_width(file) -> str:
    """The width a model runs at without --act-bits or PYMOE_ACT_BITS: "15" (two 8-bit planes: the 16-bit path's
    accuracy through the 8-bit dots, docs/performance.md "Accuracy: each activation width against the float model,
    beside llama.cpp") when every routed expert matrix of the file has a repacked layout (quant/repack.py `fits`: 8-row
    tiles of a K-quant, IQ4_XS or MXFP4), else "16": on raw rows two 8-bit dots a weight are slower than one 16-bit
    dot (Q2_0, the IQ1-IQ3 grids, rows that are not whole tiles)."""
    from pymoe.quant import repack

    for i in file.config.moe_layers:
        for p in ("gate", "up", "down"):
            t = file.layer_tensor(i, f"ffn_{p}_exps.weight")
            if not repack.fits(t.qtype, *t.shape[-2:]):  # shape [E, rows, cols]
                return "16"
    return "15"


def act_mode(act_bits) -> tuple:
    """--act-bits (8, 15, 16, 0, "auto"; None: PYMOE_ACT_BITS, else DEFAULT_ACT_BITS) -> (its name, 8 / 15 / 16 / 0 / "auto",
    dense bits, expert bits)."""
    key = str(act_bits if act_bits is not None else os.environ.get("PYMOE_ACT_BITS", DEFAULT_ACT_BITS))
    if key not in ACT_MODES:
        raise ValueError(f"act_bits must be 0 (float), 8, 15, 16 or auto, got {key}")
    return (key if key == "auto" else int(key)), *ACT_MODES[key]


@njit(parallel=True, cache=True)
def attention_rows(q, k, kt, v, p0, window, sinks, out, threads, in_place):
    """Causal GQA attention, each query on its own: q [T, H, Dh], k [S, G, Dh], v [S, G, Dv] (S = p0 + T),
    kt [G, nb, Dh, 64] (nb * 64 >= S) the keys in tiles of 64 positions -> out float32 [T, H * Dv] (written);
    threads: Numba's thread count. in_place: kt already holds the keys (the f32 KV cache's own plane, engine/kv.py
    `KeyTiles`; k is not read), else it is scratch, filled here from k.
    The math of reference.attention, in an order that depends only on the query's position, not on T: query t gives the
    same bits in a prefill of T tokens as alone in decode_one_token. The integer path needs that: it rounds
    activations, which would turn float-order noise (~1e-7) into rounding flips (~1e-4 in the logits of the tiny
    test models).
    SIMD over keys: the scores as sum_d q[d] * kt[g, b, d, :] (each key's sum in order d = 0, 1, ..; a vector multiply
    and add per d for 16 keys, no horizontal sum per key; `attention_simd.scores_into`: the sums in registers, each
    key row loaded once for 4 heads), e^x by exp_f32 (vectorised), the softmax sum in 16 interleaved partial sums
    (lane s % 16) added in a fixed tree, the output as sum_s p_s v[s] over Dv lanes (`attention_simd.weighted_into`,
    the output rows in registers)."""
    T, H, Dh = q.shape
    S, G, Dv = v.shape
    if kt.shape[1] * TILE_KEYS < S or kt.shape[2] != Dh or kt.shape[3] != TILE_KEYS:
        raise ValueError("attention_rows: kt must be [G, nb, Dh, 64] with nb * 64 >= S")
    sqrt_dh = np.float32(np.sqrt(Dh))
    # Keys not in tiles (an f16 or int8 cache's, read as float32): into kt first, kt[g, s // 64, d, s % 64] =
    # k[s, g, d], one KV head per task. In decode the cache's keys and values come from DRAM (a token's expert
    # weights went through every cache since this layer last ran): the loop asks for the key 16 rows ahead and for
    # the value rows the output loop will read (hints only; 37 -> 32 us a layer at 160 positions, measured in one
    # process, alternated call by call). The f32 cache's tiles need none of it: its keys are read where they are.
    row_k, row_v = G * Dh * 4, G * Dv * 4  # bytes from one position to the next (k, v C-contiguous float32)
    if not in_place:  # (a parallel region costs a few us even with no iterations)
        for g in prange(G):
            k_at, v_at = k.ctypes.data + g * Dh * 4, v.ctypes.data + g * Dv * 4  # head g of position 0
            for s in range(S):
                for c in range(0, Dv * 4, 64):
                    prefetch_line(v_at + s * row_v + c)
                if s + 16 < S:
                    for c in range(0, Dh * 4, 64):
                        prefetch_line(k_at + (s + 16) * row_k + c)
                tile = kt[g, s // TILE_KEYS]
                for d in range(Dh):
                    tile[d, s % TILE_KEYS] = k[s, g, d]
    # A task: one query and `hpt` of the heads that read one KV head (scores_into and weighted_into load each key and
    # value row once for up to 4 heads). All of a KV head's heads per task unless that leaves fewer than two tasks a
    # thread (decode: T = 1), then halved until it does not.
    hpg = H // G  # query heads per KV head
    hpt = hpg
    while hpt % 2 == 0 and T * (H // hpt) < 2 * threads:
        hpt //= 2
    per_query = H // hpt
    for task in prange(T * per_query):
        i, c = task // per_query, task % per_query
        # Queries in the order 0, T-1, 1, T-2, ...: query t reads p0 + t + 1 keys, and Numba gives each thread one
        # contiguous range of tasks, so in plain order the last thread would get the longest queries (3x the
        # first thread's work at T = 512, 2 threads); zig-zag, each range holds short and long ones alike.
        t = i // 2 if i % 2 == 0 else T - 1 - i // 2
        h0 = c * hpt  # heads h0 .. h0 + hpt - 1
        g = h0 // hpg  # the KV head they read
        n = p0 + t + 1  # keys 0 .. p0 + t: causal
        lo = max(0, n - window) if window > 0 else 0  # sliding window: keys lo .. p0 + t
        scores = np.empty((hpt, (n + 15) // 16 * 16), dtype=np.float32)  # [hpt, n] and the rest of the last 16
        scores_into(q[t, h0:h0 + hpt], kt[g], n, scores)  # sum_d q[h, d] * key(d, s), sums in registers
        totals = np.empty(hpt, dtype=np.float32)
        for j in range(hpt):
            sc = scores[j]
            top = np.float32(-np.inf)
            for s in range(n):
                sc[s] = sc[s] / sqrt_dh
                if s >= lo:
                    top = max(top, sc[s])
            if sinks.shape[0] > 0:  # gpt-oss: the head's sink logit joins the max and the sum, with no value
                top = max(top, sinks[h0 + j])
            for s in range(n):
                sc[s] = exp_f32(sc[s] - top) if s >= lo else np.float32(0.0)
            part = np.zeros(16, dtype=np.float32)  # [16] the softmax sum, lane s % 16
            for s0 in range(0, n - n % 16, 16):
                for k16 in range(16):
                    part[k16] += sc[s0 + k16]
            for s in range(n - n % 16, n):
                part[s % 16] += sc[s]
            w = 8
            while w >= 1:  # lanes j + w added to lanes j: a fixed tree
                for k16 in range(w):
                    part[k16] += part[k16 + w]
                w //= 2
            totals[j] = part[0]
            if sinks.shape[0] > 0:
                totals[j] += exp_f32(sinks[h0 + j] - top)
        o = out[t, h0 * Dv:(h0 + hpt) * Dv].reshape((hpt, Dv))  # [hpt, Dv] these heads' outputs
        if Dv % 16 == 0 and Dv <= MAX_DV:  # the value rows' Dv / 16 vectors in registers
            weighted_into(scores, totals, v[:, g], n, o)
        else:
            for j in range(hpt):
                o[j] = 0.0
                for s in range(n):
                    p = scores[j, s] / totals[j]
                    vs = v[s, g]
                    for d in range(Dv):
                        o[j, d] += p * vs[d]


@njit(parallel=True, cache=True)
def f32_matmul(w, x, y):
    """y[t, r] = dot(w[r], x[t]) for float32 w [R, C], x [T, C] (y [T, R] written): F32 weights (the router) on the
    fast path. One SIMD dot per (row, token), its order fixed by C alone: the same bits for any T (BLAS's order
    changes with the shape)."""
    for r in prange(w.shape[0]):
        for t in range(x.shape[0]):
            y[t, r] = dot(w[r], x[t])


@njit(cache=True)
def route_rows(logits, k, norm_topk, ids, w):
    """reference.route compiled: logits float32 [T, E] -> ids int64 [T, K] (written), the K most probable experts, highest
    first, ties to the lower id (a stable sort of -probs), and w float32 [T, K] (written) their softmax
    probabilities, divided by their sum if norm_topk. The float32 operations of reference.route, sums in NumPy's
    pairwise order; exp is libm's expf where NumPy has its own SIMD one (they may differ in the last bit)."""
    T, E = logits.shape
    p = np.empty(E, dtype=np.float32)
    taken = np.zeros(E, dtype=np.bool_)
    for t in range(T):
        top = logits[t, 0]
        for e in range(1, E):
            top = max(top, logits[t, e])
        for e in range(E):
            p[e] = np.exp(logits[t, e] - top)
        total = pairwise_sum(p, E)
        for e in range(E):
            p[e] = p[e] / total
            taken[e] = False
        for j in range(k):  # selection: the highest remaining, the lowest id among equals
            best = -1
            for e in range(E):
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            w[t, j] = p[best]
        if norm_topk:
            s = pairwise_sum(w[t], k)
            for j in range(k):
                w[t, j] = w[t, j] / s


@njit(cache=True)
def group_by_expert(ids, w):
    """The router's choices ids int64 [T, K] (distinct in a row), w float32 [T, K] grouped by expert, the form the
    fused MoE kernel takes: -> (used int64 [S] the chosen experts, ascending (the order moe.py's plain loop adds
    them in); start int64 [S + 1]: expert used[i] owns pairs start[i]:start[i+1] of tok int64 [P] (tokens,
    ascending) and weight float32 [P]). A counting sort in one compiled call (the NumPy sort, diff and concatenate
    cost ~10 us of interpreter per layer and token)."""
    T, K = ids.shape
    n_e = 0
    for t in range(T):
        for k in range(K):
            n_e = max(n_e, ids[t, k] + 1)
    count = np.zeros(n_e + 1, dtype=np.int64)  # [E + 1] count[e + 1]: pairs of expert e, then a running sum
    for t in range(T):
        for k in range(K):
            count[ids[t, k] + 1] += 1
    n_used = 0
    for e in range(n_e):
        n_used += count[e + 1] > 0
    used = np.empty(n_used, dtype=np.int64)
    start = np.empty(n_used + 1, dtype=np.int64)
    i = 0
    for e in range(n_e):
        if count[e + 1] > 0:
            used[i] = e
            start[i] = count[e]
            i += 1
        count[e + 1] += count[e]
    start[n_used] = count[n_e]
    pos = count[:n_e].copy()  # [E] the next free pair of each expert
    tok = np.empty(T * K, dtype=np.int64)
    weight = np.empty(T * K, dtype=np.float32)
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            tok[pos[e]] = t
            weight[pos[e]] = w[t, k]
            pos[e] += 1
    return used, start, tok, weight


@njit(cache=True)
def _pairwise_block(a, lo, n):
    """NumPy's pairwise_sum for n <= 128 values a[lo:lo + n] (float32): see pairwise_sum."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(n):
            res += a[lo + i]
        return res
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


@njit(cache=True)
def pairwise_sum(a, n):
    """sum of a[:n] (float32) in exactly NumPy's order (`pairwise_sum` of numpy/_core/src/umath/loops_utils.h,
    what np.add.reduce does along a contiguous axis): up to 8 values in sequence; up to 128 in 8 interleaved
    partial sums added as ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the rest in sequence; longer runs
    split in two (the first part n // 2 rounded down to a multiple of 8), each summed so, then added. NumPy
    recurses; here an explicit stack does (Numba cannot load a cached self-recursive function back)."""
    if n <= 128:  # one block: no stack (a head's 64 or 128 values: rmsnorm of q and k, per head)
        return _pairwise_block(a, 0, n)
    seg_lo = np.empty(64, dtype=np.int64)  # pending segments (lo, n), or a marker n = -1: add the last two values
    seg_n = np.empty(64, dtype=np.int64)
    vals = np.empty(64, dtype=np.float32)  # finished partial sums, in order
    top, nv = 1, 0
    seg_lo[0], seg_n[0] = 0, n
    while top > 0:
        top -= 1
        lo, m = seg_lo[top], seg_n[top]
        if m < 0:  # both halves done: left + right
            vals[nv - 2] = vals[nv - 2] + vals[nv - 1]
            nv -= 1
        elif m <= 128:
            vals[nv] = _pairwise_block(a, lo, m)
            nv += 1
        else:
            m2 = m // 2
            m2 -= m2 % 8
            seg_lo[top], seg_n[top] = 0, -1  # then add them
            seg_lo[top + 1], seg_n[top + 1] = lo + m2, m - m2  # then the right half
            seg_lo[top + 2], seg_n[top + 2] = lo, m2  # the left half first
            top += 3
    return vals[0]


@njit(cache=True)
def rmsnorm_rows(x, w, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w for each row t of x float32 [N, n] (w float32 [n]): reference.rmsnorm
    in one compiled call (the NumPy form costs ~15 us of interpreter per call, 4 calls per layer and token), bit
    for bit: the same float32 operations, the mean's sum in NumPy's pairwise order. Row by row, so the bits of a
    row do not depend on N either."""
    N, n = x.shape
    sq = np.empty(n, dtype=np.float32)  # [n] x^2 of one row
    for t in range(N):
        _rmsnorm_row(x[t], w, eps, out[t], sq)


@njit(cache=True, inline="always")
def _rmsnorm_row(x, w, eps, out, sq):
    n = x.shape[0]
    for i in range(n):
        sq[i] = x[i] * x[i]
    denom = np.sqrt(pairwise_sum(sq, n) / np.float32(n) + eps)  # float32 throughout
    for i in range(n):
        out[i] = x[i] / denom * w[i]


RMSNORM_PARALLEL_ROWS = 64  # from this many rows (a prefill chunk's) rmsnorm_rows_parallel: a parallel region costs
# a few us, what a decode step's one-row call takes in all


@njit(cache=True, parallel=True)
def rmsnorm_rows_parallel(x, w, eps, out):
    """rmsnorm_rows with the rows shared among the threads, 16 a task (each row's bits as rmsnorm_rows')."""
    N, n = x.shape
    for task in prange((N + 15) // 16):
        sq = np.empty(n, dtype=np.float32)
        for t in range(16 * task, min(N, 16 * task + 16)):
            _rmsnorm_row(x[t], w, eps, out[t], sq)


@njit(cache=True)
def rope_rows(x, cos, sin, neox):
    """reference.apply_rope in place: x float32 [T, heads, Dh], cos/sin float32 [T, n] (n = rope_dim / 2). The same
    float32 expressions as the NumPy form (a c - b s, b c + a s; no fused multiply-add), so the same bits."""
    T, H, _ = x.shape
    n = cos.shape[1]
    for t in range(T):
        for h in range(H):
            for i in range(n):
                c, s = cos[t, i], sin[t, i]
                ia, ib = (i, i + n) if neox else (2 * i, 2 * i + 1)  # NEOX pairs (i, i + n), else (2i, 2i + 1)
                a, b = x[t, h, ia], x[t, h, ib]
                x[t, h, ia] = a * c - b * s
                x[t, h, ib] = b * c + a * s


def repack_budget() -> int:
    """Bytes of experts' repacked copies a CPU backend may make: half of MemAvailable (/proc/meminfo) now, the rest
    left to the file's pages, the KV cache and other processes; no limit where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 1 << 62
    return avail // 2


NO_TILES = (0, 0, 0)  # an expert without repacked matrices
_NO_KEYS = np.zeros((0, 1, 1), dtype=np.float32)  # attention_rows' k when kt holds the keys
_NO_SINKS = np.zeros(0, np.float32)  # attention_rows' sinks for a model without them


class CPUBackend(HostArrays):
    name = "cpu"

    def __init__(self, threads: Optional[int] = None, act_bits: Optional[int] = None, repack: Optional[bool] = None,
                 head_bits: Optional[int] = None, repack_mib: Optional[float] = None):
        """act_bits: 16, 8 or 15 (two 8-bit planes): the integer path's activations (quant/qact.py); 0: float
        kernels only; None: PYMOE_ACT_BITS, else 16 until `fit_width` picks the model's default (`default_width`);
        "auto": 8 bits for the routed experts, 16 for the dense products (ACT_MODES). head_bits: the output
        head's own width (default: the dense products'; bench/act_accuracy.py measures what it costs).
        repack: keep 8-row repacked copies of the weights that have a layout (quant/repack.py) for the products
        at 8 bits (default: yes, unless PYMOE_REPACK=0). repack_mib: the most MiB of experts' repacked copies
        (default: PYMOE_REPACK_MIB, else `repack_budget`'s half of the available memory)."""
        if threads:
            numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
        self.threads = self.most = numba.get_num_threads()  # this forward call's team / the team on a quiet machine
        self.governor = ThreadGovernor(self.most) if adaptive(threads) else None  # backends/threads.py
        self._team = {}  # calling thread's ident -> the team size set there (Numba's count is per calling thread)
        # a width given here or in PYMOE_ACT_BITS holds; else the model's (`fit_width`, called by api.Engine)
        self.width_given = act_bits is not None or "PYMOE_ACT_BITS" in os.environ
        self.head_bits = None if head_bits is None else int(head_bits)
        self._repack_option = repack
        self._set_width(act_bits)
        self._rows = {}  # id(ExpertBytes) -> (the ExpertBytes, its repacked matrices, its row of addresses)
        self._fused = {}  # (expert types, D, F) -> whether moe_experts takes the fused kernel
        self._eps = {}  # rmsnorm's eps -> np.float32(eps)
        self._arena = HugeArena()  # the repacked copies, in 2 MiB pages (~100 MiB of them read a decoded token)
        if repack_mib is None and os.environ.get("PYMOE_REPACK_MIB"):
            repack_mib = float(os.environ["PYMOE_REPACK_MIB"])
        self.expert_budget = repack_budget() if repack_mib is None else int(repack_mib * 2**20)  # bytes
        self.expert_copies = 0  # bytes of the experts' repacked copies made
        self.experts_in_place = 0  # experts first run once the budget was spent (read from the memory map)
        self.copy_seconds = 0.0  # time spent making them (reading the expert's pages, filling fresh memory)

    def _set_width(self, act_bits) -> None:
        self.act_bits, self.dense_bits, self.expert_bits = act_mode(act_bits)  # (see ACT_MODES)
        repack = self._repack_option
        self.repack = bool({8, qact.PLANES} & {self.dense_bits, self.expert_bits, self.head_bits}) and (
            os.environ.get("PYMOE_REPACK", "1") != "0" if repack is None else bool(repack))

    def fit_width(self, file) -> None:
        """Before any weight is prepared: with no width given, the model's default (`default_width`)."""
        if not self.width_given:
            self._set_width(default_width(file))

    def share_cpu(self) -> None:
        """Before a forward call: its team of threads, the cores other processes leave free (backends/threads.py),
        or the count given with -t. Set in the calling thread (the server computes in its scheduler's thread)."""
        n = self.governor.threads() if self.governor is not None else self.most
        me = threading.get_ident()
        if self._team.get(me) != n:
            numba.set_num_threads(n)
            self._team[me] = n
        self.threads = n

    def integer_path(self, qtype: quant.QType, n_cols: int, bits: Optional[int] = None) -> bool:
        """Whether x @ W.T for W of this type and width runs on integer activations (else the float kernels), at
        `bits` (default: the dense products')."""
        return (self.dense_bits if bits is None else bits) != 0 and has_int_dot(qtype, n_cols)

    def warm_up(self, qtypes, progress: bool = False) -> None:
        """Compile (or load from Numba's on-disk cache) the kernels of these types now, at load time, so the first
        request's telemetry measures the model, not the compiler. A zero 1-row matrix is enough to trigger it."""
        from tqdm import tqdm

        todo = sorted(set(qtypes), key=lambda q: q.name)
        for qtype in tqdm(todo, desc="kernels (compiled on first use, then cached)", disable=None if progress else True,
                          leave=False):
            fmt = quant.get_format(qtype)
            w = np.zeros((1, fmt.type_size), dtype=np.uint8)  # [1, row_bytes]: one block
            w.flags.writeable = False  # like the read-only mmap views: Numba compiles per array type
            quant.matvec(w, qtype, np.zeros(fmt.block_size, dtype=np.float32))
            quant.matmul(w, qtype, np.zeros((2, fmt.block_size), dtype=np.float32))
            if self.integer_path(qtype, QK_K):
                w = np.zeros((1, fmt.row_bytes(QK_K)), dtype=np.uint8)  # [1, row_bytes]: one 256-block
                w.flags.writeable = False
                for T in (1, 2):
                    kernels.matmul_act(w, qtype, np.zeros((T, QK_K), dtype=np.float32), self.dense_bits)
        # the other primitives: RMSNorm, RoPE, the row-by-row attention, the F32 kernel, the grouping of routed pairs,
        # the router
        x = np.zeros((2, 2), np.float32)
        self.rmsnorm(x, np.zeros(2, np.float32), 1e-6)
        self.rope(np.zeros((2, 1, 2), np.float32), np.zeros((2, 1), np.float32), np.zeros((2, 1), np.float32), True)
        self.attention(np.zeros((2, 2, 2), np.float32), np.zeros((2, 1, 2), np.float32),
                       np.zeros((2, 1, 2), np.float32), 0)
        w = np.zeros((2, 2), np.float32)
        w.flags.writeable = False  # like the router's read-only mmap view: Numba compiles per array type
        f32_matmul(w, x, np.empty((2, 2), np.float32))
        group_by_expert(np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32))
        self.route(x, 1, True)
        for qtype in todo if self.repack else ():  # the repacking (decode's first use of an expert) and its dot
            if qtype in repack.TILE_BYTES:
                w = np.zeros((repack.ROWS, repack.RAW_BYTES[qtype]), dtype=np.uint8)  # 8 rows of 256 columns
                w.flags.writeable = False  # like the read-only mmap views
                repack.tile_matmul(repack.repack(w, qtype), qtype, *qact.quantize_for(np.zeros((1, QK_K), np.float32),
                                                                                      qtype, 8))

    def warm_up_experts(self, expert_types: dict) -> None:
        """Compile (or load) the fused expert kernel of one gate/up/down type triple."""
        qtypes = tuple(expert_types[p] for p in ("gate", "up", "down"))
        if not all(self.integer_path(q, QK_K, self.expert_bits) for q in qtypes):
            return
        gate, up, down = (np.zeros((QK_K, quant.get_format(q).row_bytes(QK_K)), dtype=np.uint8) for q in qtypes)
        ex = (gate, up, down)  # a 256 x 256 expert (D = F = 256)
        for m in ex:
            m.flags.writeable = False  # like the read-only mmap views: Numba compiles per array type
        x = np.zeros((1, QK_K), dtype=np.float32)
        kernels.moe_act([ex], qtypes, x, [(np.zeros(1, np.int64), np.ones(1, np.float32))], self.expert_bits)

    def dense(self, t: Tensor) -> DenseWeight:
        """With repacking: tiles for a weight of a type with a layout (rows not a multiple of 8, like the mid
        preset's 746-row head: the last tile padded with rows of zero bytes, whose results `_tiled` drops); else
        (the F32 router, an IQ type) its rows copied, so that every product of a decode step reads 2 MiB pages."""
        w = host_dense(t)  # a view into the memory map
        if self.head_bits is not None and t.name in HEAD_NAMES:
            w = replace(w, bits=self.head_bits)
        bits = self.dense_bits if w.bits is None else w.bits
        padded = -(-w.shape[0] // repack.ROWS) * repack.ROWS  # rows rounded up to whole tiles
        if self.repack and bits in (8, qact.PLANES) and repack.fits(w.qtype, padded, w.shape[1]):
            raw = w.raw
            if padded > w.shape[0]:  # zero bytes: a zero scale, finite results
                raw = np.zeros((padded, raw.shape[1]), dtype=np.uint8)
                raw[:w.shape[0]] = w.raw
            w = replace(w, tiles=repack.repack(raw, w.qtype, self._arena.empty))  # [ceil(R / 8), row_tiles]
        elif self.repack and self._arena.enabled:
            w = replace(w, raw=self._arena.copy(w.raw))
        return w

    def expert_row(self, ex, qtypes: tuple, D: int):
        """One expert's row of the fused kernel's address table (`kernels.moe_act_table`): the data addresses of
        its (gate, up, down) raw rows, then of their repacked copies (quant/repack.py; 0 for a matrix of a type
        without that layout, or with repacking off), the copies made on first use. None: a matrix is not
        C-contiguous or not of the layer's shapes (the caller then takes moe_act_grouped's checked path).
        The model's own experts, read in place (ex.where == "host"), are checked once and their row kept with them
        (~10 us of interpreter per layer and token otherwise); a cache slot's bytes change with the expert it
        holds, so its row is made each time, never with tiles."""
        host = ex.where == "host"
        if host:
            hit = self._rows.get(id(ex))
            if hit is not None and hit[0] is ex:
                return hit[2]
        F = ex.gate.shape[0]
        gb, ub, db = (quant.get_format(q).row_bytes(n) for q, n in zip(qtypes, (D, D, F)))
        raw = kernels.expert_addresses(ex.gate, ex.up, ex.down, F, D, gb, ub, db)  # -1: not C-contiguous / wrong shape
        if raw[0] < 0:
            return None
        if not host:
            return (*raw, *NO_TILES)
        fits = [self.repack and self.expert_bits in (8, qact.PLANES) and repack.fits(q, m.shape[0], kernels.cols_of(m, quant.get_format(q)))
                for q, m in zip(qtypes, (ex.gate, ex.up, ex.down))]
        need = sum(m.nbytes for m, f in zip((ex.gate, ex.up, ex.down), fits) if f)  # ~ the copies' size
        if need and self.expert_copies + need > self.expert_budget:  # budget spent: this expert stays in place
            fits = [False] * 3
            self.experts_in_place += 1
        t0 = time.perf_counter()
        mats = [repack.repack(m, q, self._arena.empty) if f else None
                for q, m, f in zip(qtypes, (ex.gate, ex.up, ex.down), fits)]  # [rows / 8, row_tiles] or None
        self.copy_seconds += time.perf_counter() - t0
        self.expert_copies += sum(m.nbytes for m in mats if m is not None)
        row = (*raw, *(0 if m is None else m.ctypes.data for m in mats))
        self._rows[id(ex)] = (ex, mats, row)  # ex kept alive: its id stays its own
        return row

    def vector(self, t: Tensor) -> np.ndarray:
        return t.floats().reshape(-1)

    def linear(self, w: DenseWeight, x: np.ndarray) -> np.ndarray:
        """x float32 [T, C] -> [T, R]."""
        if w.tiles is not None:  # repacked: x quantized to 8 bits (or two planes), the bits of matmul_act on the raw
            bits = self.dense_bits if w.bits is None else w.bits  # rows
            return self._tiled(w, bits, qact.quantize_for(np.ascontiguousarray(x, np.float32), w.qtype, bits))
        return self.linear_raw(w.raw, w.qtype, x, w.bits)

    @staticmethod
    def _tiled(w: DenseWeight, bits: int, xact: tuple) -> np.ndarray:
        """x (quantized: xact) times a repacked weight -> float32 [T, R], the bits of kernels.matmul_act on its raw
        rows; the results of the zero rows that pad its last tile (`dense`) dropped."""
        y = repack.tile_matmul(w.tiles, w.qtype, *xact)  # [T or 2T, R rounded up to 8]
        y = qact.sum_planes(y) if bits == qact.PLANES else y  # [T, R rounded up]
        return y if y.shape[1] == w.shape[0] else np.ascontiguousarray(y[:, :w.shape[0]])

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, p0: int, window: int = 0,
                  sinks=None) -> np.ndarray:
        """reference.attention's contract (q [T, H, Dh], k [S, G, Dh], v [S, G, Dv] -> [T, H * Dv]; a sliding
        window and per-head sinks) by `attention_rows`, whose bits do not depend on T."""
        out = np.empty((q.shape[0], q.shape[1] * v.shape[2]), dtype=np.float32)  # [T, H * Dv]
        S, G, Dh = k.shape
        f32 = np.float32  # (a KV cache may store f16)
        in_place = isinstance(k, KeyBlocks)
        if in_place:  # the f32 cache's key tiles (kv_read below), read where they are
            kt, k = k.tiles, _NO_KEYS
        else:  # [G, nb, Dh, 64] scratch for the key tiles, filled by attention_rows
            kt = np.empty((G, (S + TILE_KEYS - 1) // TILE_KEYS, Dh, TILE_KEYS), dtype=np.float32)
            k = np.ascontiguousarray(k, f32)
        q, v = np.ascontiguousarray(q, f32), np.ascontiguousarray(v, f32)
        sinks = _NO_SINKS if sinks is None else np.ascontiguousarray(sinks, f32)
        attention_rows(q, k, kt, v, p0, int(window), sinks, out, self.threads, in_place)  # (how the work is split:
        # the same bits for any count)
        return out

    def kv_read(self, kv, layer: int, S: int) -> tuple:
        """kv.read's (K [S, G, Dh], V [S, G, Dv]), with the f32 cache's keys as they are stored (a `KeyBlocks` of
        its key tiles, engine/kv.py `KeyTiles`, which `attention` reads in place) instead of copied into [S, G, Dh]."""
        return kv.read(layer, S, key_blocks=True)

    def route(self, logits: np.ndarray, k: int, norm_topk: bool) -> tuple[np.ndarray, np.ndarray]:
        """reference.route's contract: router logits [T, E] -> (ids int [T, K], w float32 [T, K]), compiled (the
        NumPy softmax, argsort and take_along_axis cost ~13 us of interpreter per layer and token)."""
        T = logits.shape[0]
        ids, w = np.empty((T, k), dtype=np.int64), np.empty((T, k), dtype=np.float32)
        route_rows(np.ascontiguousarray(logits, dtype=np.float32), k, bool(norm_topk), ids, w)
        return ids, w

    def rmsnorm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """reference.rmsnorm's contract (x [..., n] normalised over its last axis, times w [n]), bit for bit."""
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])  # [N, n]
        out = np.empty(x2.shape, np.float32)
        fn = rmsnorm_rows_parallel if x2.shape[0] >= RMSNORM_PARALLEL_ROWS else rmsnorm_rows
        eps32 = self._eps.get(eps)
        if eps32 is None:
            eps32 = self._eps[eps] = np.float32(eps)  # (a NumPy scalar made once: 49 calls a decode step)
        fn(x2, np.ascontiguousarray(w, dtype=np.float32), eps32, out)
        return out.reshape(x.shape)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
        """reference.apply_rope's contract (x [T, heads, Dh], cos/sin [T, rope_dim / 2]), bit for bit."""
        out = np.array(x, dtype=np.float32, order="C")  # [T, heads, Dh], a copy, rotated in place
        rope_rows(out, np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32),
                  bool(neox))
        return out

    def linear_many(self, ws: list, x: np.ndarray) -> list:
        """[linear(w, x) for w in ws], x quantized once for all the integer-path weights (q, k and v of a layer)."""
        groups = {qact.act_group(w.qtype, self.dense_bits) for w in ws}  # x's layout for each (qact.act_group)
        whole = all(w.tiles is not None and w.tiles.shape[0] * repack.ROWS == w.shape[0] for w in ws)  # (no padded
        # last tile)
        if x.shape[0] == 1 and len(ws) == 3 and whole and len(groups) == 1:  # decode's q, k, v repacked: one
            # quantization, one call for the three
            xact = qact.quantize_rows(x, self.dense_bits, groups.pop())  # 8 bits, or two planes
            ys = repack.tile_matvec3([w.tiles for w in ws], [w.qtype for w in ws], *xact)
            return [qact.sum_planes(y) for y in ys] if self.dense_bits == qact.PLANES else ys
        xacts = {}  # values per scale -> x quantized so, once for every weight that takes it
        out = []
        for w in ws:
            if w.qtype != quant.QType.F32 and self.integer_path(w.qtype, x.shape[1]):
                group = qact.act_group(w.qtype, self.dense_bits)
                xact = xacts.get(group)
                if xact is None:
                    xact = xacts[group] = qact.quantize_rows(np.ascontiguousarray(x, dtype=np.float32),
                                                             self.dense_bits, group)
                if w.tiles is not None:
                    out.append(self._tiled(w, self.dense_bits, xact))
                    continue
                out.append(kernels.matmul_act(w.raw, w.qtype, x, self.dense_bits, xact=xact))
            else:
                out.append(self.linear(w, x))
        return out

    def linear_raw(self, raw: np.ndarray, qtype: quant.QType, x: np.ndarray, bits: Optional[int] = None) -> np.ndarray:
        """x float32 [T, C] @ W.T where W is stored as `raw` (float32 [R, C], or uint8 rows [R, row_bytes]); bits:
        the activations' width (default: the dense products')."""
        bits = self.dense_bits if bits is None else bits
        if qtype == quant.QType.F32:  # per-row order independent of T (as above)
            w = raw if raw.dtype == np.float32 else raw.view(np.float32)  # [R, C]
            y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)  # [T, R]
            f32_matmul(np.ascontiguousarray(w), np.ascontiguousarray(x, dtype=np.float32), y)
            return y
        if self.integer_path(qtype, x.shape[1], bits):
            return kernels.matmul_act(raw, qtype, x, bits)  # [T, R]: x quantized once, integer dots
        if x.shape[0] == 1:
            return quant.matvec(raw, qtype, x[0])[None, :]  # [1, R]: decode, one token
        return quant.matmul(raw, qtype, x)  # [T, R]: prefill, each weight block decoded once for all T

    def moe_experts(self, experts: dict, expert_types: dict, x: np.ndarray, ids: np.ndarray, w: np.ndarray,
                    ffn=None):
        """The routed experts of one layer, fused: experts {e: ExpertBytes} (every e in ids), x float32 [T, D],
        ids int [T, K], w float32 [T, K] -> y float32 [T, D] = sum_k w[t, k] * expert_{ids[t, k]}(x[t]).
        Without a fused path for these types (float path, a non-K type, odd widths) or for this expert function
        (ffn: gpt-oss's biases and clamped SwiGLU): one expert at a time."""
        qtypes = (expert_types["gate"], expert_types["up"], expert_types["down"])
        F = next(iter(experts.values())).gate.shape[0]
        D = x.shape[1]
        if ffn is not None:
            return experts_one_by_one(_AtExpertBits(self), experts, expert_types, x, ids, w, ffn)
        fused = self._fused.get((qtypes, D, F))
        if fused is None:  # decided once per layer shape (three calls each layer and token otherwise)
            eb = self.expert_bits
            fused = self._fused[(qtypes, D, F)] = (self.integer_path(qtypes[0], D, eb)
                                                   and self.integer_path(qtypes[1], D, eb)
                                                   and self.integer_path(qtypes[2], F, eb)  # gate and up share x's
                                                   and qact.act_group(qtypes[0], eb) == qact.act_group(qtypes[1], eb))
        if not fused:
            return experts_one_by_one(_AtExpertBits(self), experts, expert_types, x, ids, w)
        used, start, tok, weight = group_by_expert(np.ascontiguousarray(ids, dtype=np.int64),
                                                  np.ascontiguousarray(w, dtype=np.float32))
        used = used.tolist()  # [S] the expert ids, ascending
        if len(used) != len(experts):
            raise ValueError(f"moe_experts: got experts {sorted(experts)} for routed ids {used}")
        ex = [experts[e] for e in used]
        rows = [self.expert_row(e, qtypes, D) for e in ex]
        if None not in rows:  # every expert checked: the kernel straight away
            return kernels.moe_act_table(np.array(rows, dtype=np.int64), qtypes, F, x, start, tok, weight,
                                         self.expert_bits, self.threads)
        return kernels.moe_act_grouped([(e.gate, e.up, e.down) for e in ex], qtypes, x, start, tok, weight,
                                       self.expert_bits)  # copies made contiguous, shapes checked (and no tiles)

    # --- memory: host RAM ---------------------------------------------------------------------------------------------
    def new_pool(self, n_slots: int, slot_bytes: int, layouts: list) -> HostPool:
        return HostPool(n_slots, slot_bytes, layouts)

    def new_kv(self, n_ctx: int):
        return None  # the engine's host KV cache


class _AtExpertBits:
    """The backend as one-expert-at-a-time code sees it (reference.swiglu_expert calls `linear_raw` only): its
    products at the routed experts' width."""

    def __init__(self, backend: CPUBackend):
        self.backend = backend

    def linear_raw(self, raw: np.ndarray, qtype: quant.QType, x: np.ndarray) -> np.ndarray:
        return self.backend.linear_raw(raw, qtype, x, self.backend.expert_bits)

