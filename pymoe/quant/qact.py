"""Integer activations: x quantized per 256 (or 32) values, and the integer dot products of every K-quant with it.

What this is: the fast path of a quantized mat-vec, the way llama.cpp computes it on a CPU. Instead of decoding the
weights to float and multiplying by float x, x is quantized once per call, and each weight block is dotted with it
in integer arithmetic; floats appear only once per block (the block's scales). Three pieces:
  1. `quantize_act` (Numba, per row) and its NumPy reference `quantize_act_ref`: x float32 [C] -> activations
        qs    int16 (or int8) [C]   q = round(x / d), in -QMAX..QMAX (32767, or 127 for int8)
        d     float32 [C / 256]     one scale per 256 values: 8 bits, 1 / (127 / max|x|) as llama.cpp's;
                                    16 bits, the power of two just above max|x| / QMAX
        bsums int32   [C / 16]      the sum of each run of 16 q: what the "- dmin * m" term of a weight needs
     With int8 values these are llama.cpp's block_q8_K values, bit for bit (three arrays here, not a packed struct;
     ggml divides by the signed maximum, so its d and q are these negated where that maximum is positive:
     tests/test_kernels_qact.py checks against ggml's quantize_row_q8_K_ref). pymoe's default is int16: 8-bit x
     moves the logits of the tiny test models by as much as llama.cpp's own 8-bit run does (bench/act_accuracy.py),
     16-bit x stays within ~1e-3 of float math. The kernels take either: the width is the dtype of qs
     (`CPUBackend(act_bits=8)` selects int8).
     At 8 bits, the formats llama.cpp pairs with block_q8_0 (ACT32_TYPES: Q8_0, Q4_0, Q2_0, MXFP4, IQ4_NL) take x
     per 32 values instead, `quantize_act32` (twin `quantize_act32_ref`, ggml's quantize_row_q8_0_ref bit for bit):
        d     float32 [C / 32]      fp16(max|x| / 127) as float32, q = roundf(x / (max|x| / 127))
     (qs and bsums as above). `act_group(qtype, bits)` says which; the row dots of those formats multiply each
     group's weight scale by its own d of x (`_GroupScaleCode.times_dx`).
     Two planes (act_bits PLANES = 15, `quantize_planes_ref`, twin `quantize_planes`): x rounded to q in
     -32512..32512 against a power-of-two d per 256 values (per 32 for ACT32_TYPES), written q = 255 hi + lo with
     hi and lo int8 in -127..127; each plane is an 8-bit activation row (hi with scale 255 d, lo with d, bsums of
     its own), so every 8-bit dot, tile dot and fused kernel computes dot(w, d q) as the sum of its results on the
     two planes: 16 bits' accuracy (q is 16 bits' q wherever max|x| / 32512 and max|x| / 32767 round up to the same
     power of two) with the 8-bit integer path's instructions, tiles and bounds, at two 8-bit dots per weight.
  2. Row dots, the only code in pymoe that writes LLVM IR (Numba widens every integer scalar operation to 64 bits,
     and LLVM then vectorises a loop of small-integer products in 64-bit lanes, or not at all; the IR states the
     narrow lanes explicitly and LLVM emits `vpmaddwd` / `vpmaddubsw` / `vpdpbusd`):
       `row_dot_<type>(w, xq, xd, xbs)`: a whole weight row from a static block layout table, in vector
       registers, float32 [16] lane accumulators and one reduction per row; `row_dot_rows_*` the same for every row
       of a 2-D x, each block unpacked once (prefill), bit for bit.
     They are tested against the float reference through the vec_dots, and against their portable twins.
     `_make_row_dot` builds them from a _RowDotCode: the LLVM helpers every format shares (vec, load, x86, ...),
     the parts by format family (_GridCode: IQ1-IQ3's grids and signs; _GroupScaleCode: the 32-weight blocks'
     gathers, codebooks and float group scales; _BlockCode: a block's integers and scales, the K-quants' fields
     among them; _StepCode: a block's terms for 16- and 8-bit x) and the three intrinsics' codegen.
  3. `ACT_DOTS[qtype](w, xq, xd, xbs)` for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, (section 3b) IQ4_XS, IQ4_NL, MXFP4, Q8_0,
     Q4_0, Q2_0 and (section 3c) IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: one raw weight row (whole
     runs of 256 weights) times quantized activations -> float32; `ACT_DOTS_ROWS[qtype]` for many rows at once
     (bit-identical results). Other formats use the float path.
  With 8-bit activations the row dots take llama.cpp's AVX2 route: each group's 32 int8 weights (their magnitudes,
  the signs moved onto x by vpsignb for formats with negative integers) times 32 int8 x by vpmaddubsw, then the
  sub-block scales (or ones) by vpmaddwd: half the instructions and half the activation bytes of the 16-bit route
  per weight (measured on Zen 3, 1 thread: ~1.6x on one token, ~2x on 64 tokens). The width is the dtype of xq.
What this is not: the kernels that loop over rows and tokens (kernels.py), nor the reference of the result: the
reference of `vec_dot(w, act)` is `dequantize(w) @ dequantize_act(act)` (tests/test_kernels_qact.py).

Numerics. Each sub-block sum is an exact integer (a 32-lane sum of products < 2^6 * 2^15 * 32 < 2^31; the sums
over sub-blocks are int64, or, in row_dot, int32 lanes with the bound stated there; two planes: each plane is an
8-bit row, |hi|, |lo| <= 127, so the 8-bit bounds hold for each, and the planes meet only in float32, hi's result
plus lo's). Per block, the float result is
    d_w * d_x * sum_s sc_s * isum_s  -  dmin_w * d_x * sum_s m_s * bsum_s
so the integer path differs from the float path only by the rounding of x: |x_i - d q_i| <= d / 2 per value,
hence |y_int - y_float| <= sum_blocks (d_b / 2) * sum_{i in b} |w_i|, plus float32 rounding (what the tests check;
two planes: d_b the lo plane's d, x - d q exact).

Weight layouts: the diagrams in kquants.py. Shape legend: T rows (tokens), C values, nb = C / 256 blocks.
"""
from __future__ import annotations

import math
import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import QType
from . import iquants, mxfp4
from .jit import bind
from .kquants import Q2_K_SIZE, Q3_K_SIZE, Q4_K_SIZE, Q5_K_SIZE, Q6_K_SIZE, QK_K


SUB = 16  # values per bsum: the smallest sub-block of any K-quant
PLANES = 15  # the activation width carried as two int8 planes (`quantize_planes_ref`): 8-bit dots, 15-bit x
ACT_DTYPES = {8: np.int8, 16: np.int16, PLANES: np.int8}  # activation width (bits) -> dtype of qs
PLANE_BASE = 255  # q = PLANE_BASE * hi + lo, hi and lo int8 in -127..127
PLANE_QMAX = PLANE_BASE * 127 + 127  # 32512: the largest |q| two planes hold (every integer up to it, once)


# ----------------------------------------------------------------------------------------------------------------
# 1. Quantizing activations
# ----------------------------------------------------------------------------------------------------------------
def qmax_of(dtype) -> int:
    return _QMAX.get(dtype) or int(np.iinfo(dtype).max)  # 127 or 32767: symmetric, -QMAX..QMAX


_QMAX = {np.dtype(np.int8): 127, np.dtype(np.int16): 32767}  # np.iinfo costs ~1 us a call: per token, per matrix
EXACT_SCALE_QMAX = 127  # the width whose scale is max|x| / QMAX itself (8 bits); wider ones take a power of two


def quantize_act_ref(x: np.ndarray, bits: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [T, C] (C a multiple of 256) -> (qs int16/int8 [T, C], d float32 [T, C/256], bsums int32 [T, C/16]).

    Per block of 256, 16 bits: d = the smallest power of two >= max|x| / QMAX (d = 2^e, e = frexp's exponent, at
    least 2^-100), q = rint(x / d) (round half to even; x / d is exact, a power-of-two scaling). A power-of-two d
    costs at most one bit against d = max|x| / QMAX, and buys stability: a change of max|x| in its last bits (the
    decode and the prefill forward compute attention in different orders) leaves d, hence every other q, alone;
    with d = max|x| / QMAX it moves the rounding of the whole block and, at 16 bits, the logits by ~1e-4.
    8 bits: that one bit is what llama.cpp's 8-bit blocks have and a power of two would lose (pymoe's 8-bit logits
    were 1.3-1.5x farther from float than llama.cpp's with it: bench/act_accuracy.py), so d is llama.cpp's
    block_q8_K scale: iscale = 127 / max|x| (float32), q = rint(x * iscale) (within +-127 without a clamp), d = 1 / iscale; an
    all-zero block has d = 0. The Numba twin does the same float32 operations and agrees bit for bit.
    """
    dtype = ACT_DTYPES[bits]
    x = np.asarray(x, dtype=np.float32)
    T, C = x.shape
    blocks = x.reshape(T, C // QK_K, QK_K)  # [T, nb, 256]
    amax = np.abs(blocks).max(axis=-1, keepdims=True)  # [T, nb, 1] float32
    qmax = qmax_of(dtype)
    if qmax == EXACT_SCALE_QMAX:  # 8 bits: llama.cpp's block_q8_K scale, iscale = 127 / max|x|, d = 1 / iscale
        with np.errstate(divide="ignore"):
            iscale = np.where(amax > 0, np.float32(qmax) / amax, np.float32(0)).astype(np.float32)  # [T, nb, 1]
        d = np.where(amax > 0, np.float32(1) / np.where(amax > 0, iscale, 1), np.float32(0)).astype(np.float32)
    else:  # 16 bits: the smallest power of two >= max|x| / QMAX
        _, e = np.frexp(amax.astype(np.float64) / qmax)  # ratio = m * 2^e, m in [0.5, 1): 2^e >= ratio
        e = np.maximum(e, -100)
        d = np.ldexp(1.0, e).astype(np.float32)  # [T, nb, 1]
        iscale = np.ldexp(1.0, -e).astype(np.float32)
    # no clamp: |x| <= max|x| gives |x * iscale| <= QMAX (1 + 2^-23) < QMAX + 1/2 (one float32 rounding), so rint is
    # within +-QMAX (llama.cpp's MIN(127, v) never acts either)
    qs = np.rint(blocks * iscale).astype(dtype)  # [T, nb, 256]
    bsums = qs.reshape(T, C // SUB, SUB).astype(np.int32).sum(axis=-1)  # [T, C/16]
    return qs.reshape(T, C), d.reshape(T, C // QK_K), bsums.astype(np.int32)


def dequantize_act(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The values the integer path really multiplies: qs [T, C], d [T, C/256] or [T, C/32] (per-32 blocks) ->
    float32 [T, C] = d * q."""
    T, C = qs.shape
    return (qs.reshape(T, d.shape[1], -1).astype(np.float32) * d[:, :, None]).reshape(T, C)


# 8-bit activations per 32 values (llama.cpp's block_q8_0): the x of the formats whose ggml-cpu type traits name
# GGML_TYPE_Q8_0 as their vec_dot_type, among those with an integer dot here (Q4_1/Q5_1, paired with Q8_1, and Q5_0
# take the float path). One scale per 32-weight group of the weight is one per 32 values of x: the row dots' group
# scales times x's (`_GroupScaleCode.times_dx`). The others (K-quants, IQ1-IQ4_XS) pair with block_q8_K (per 256).
ACT32_TYPES = frozenset({QType.Q4_0, QType.Q8_0, QType.IQ4_NL, QType.MXFP4, QType.Q2_0})
QK8_0 = 32  # values per block_q8_0


def act_group(qtype, bits: int) -> int:
    """The values per activation scale that a weight of this type is dotted with: 32 (8-bit x, or two 8-bit planes,
    for a Q8_0-paired format, llama.cpp's block_q8_0 layout), else 256 (block_q8_K at 8 bits; every format at 16
    bits)."""
    return QK8_0 if bits in (8, PLANES) and qtype in ACT32_TYPES else QK_K


# Two int8 planes ("15-bit x on the 8-bit dots", act_bits PLANES): x is rounded to q in -32512..32512 against a
# power-of-two scale d per group (256 or 32 values: the 8-bit layout of the weight's type, `act_group`), and q is
# written in base 255 as q = 255 hi + lo, hi = rint(q / 255) and lo = q - 255 hi both in -127..127 (255 is odd: q /
# 255 is never a tie, so hi is unique and |lo| <= 127). Each plane is an ordinary 8-bit activation row, hi with scale
# 255 d, lo with d, and bsums of its own: every 8-bit dot is linear in (q, bsums) for a fixed scale, so
#     dot(w, d q) = dot8(w, hi, 255 d, bsums(hi)) + dot8(w, lo, d, bsums(lo))
# with both integer dots inside the 8-bit path's bounds (|hi|, |lo| <= 127). Rows: token t's hi plane is row 2 t,
# its lo plane row 2 t + 1 (so a token's two planes are a C-contiguous [2, C] block, the 8-bit kernels' "two tokens").
# Base 256 would leave q = 256 k + 128 without a representation within -127..127 (vpsignb cannot negate -128).
def quantize_planes_ref(x: np.ndarray, group: int = QK_K) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [T, C] (C a multiple of 256) -> (qs int8 [2T, C], d float32 [2T, C/group], bsums int32 [2T, C/16]),
    rows 2t (hi, scale 255 d) and 2t + 1 (lo, scale d) of token t. Per group: d = the smallest power of two >=
    max|x| / 32512 (at least 2^-100; `quantize_act_ref`'s 16-bit rule with QMAX 32512), q = rint(x / d) (exact
    scaling; |q| <= 32512 without a clamp, as there), hi = rint(q / 255), lo = q - 255 hi."""
    x = np.asarray(x, dtype=np.float32)
    T, C = x.shape
    blocks = x.reshape(T, C // group, group)  # [T, ng, group]
    amax = np.abs(blocks).max(axis=-1, keepdims=True)  # [T, ng, 1]
    _, e = np.frexp(amax.astype(np.float64) / PLANE_QMAX)  # 2^e >= max|x| / QMAX
    e = np.maximum(e, -100)
    d = np.ldexp(1.0, e).astype(np.float32)  # [T, ng, 1]
    q = np.rint(blocks * np.ldexp(1.0, -e).astype(np.float32)).astype(np.int32)  # [T, ng, group]
    hi = np.rint(q / PLANE_BASE).astype(np.int32)  # (float64: q / 255 exact enough, never a tie)
    lo = q - PLANE_BASE * hi
    qs = np.stack([hi.reshape(T, C), lo.reshape(T, C)], axis=1).reshape(2 * T, C).astype(np.int8)  # [2T, C]
    ds = np.stack([d.reshape(T, -1) * np.float32(PLANE_BASE), d.reshape(T, -1)], axis=1)  # [T, 2, ng]
    bsums = qs.reshape(2 * T, C // SUB, SUB).astype(np.int32).sum(axis=-1)  # [2T, C/16]
    return qs, ds.reshape(2 * T, C // group).astype(np.float32), bsums.astype(np.int32)


def dequantize_planes(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The values the two-plane path multiplies: qs int8 [2T, C], d [2T, C/group] -> float32 [T, C] = 255 d hi + d
    lo (exact: the sum is d q, q an integer below 2^15, d a power of two)."""
    planes = dequantize_act(qs, d)  # [2T, C]
    return planes[0::2] + planes[1::2]


def sum_planes(y: np.ndarray) -> np.ndarray:
    """A product's result over the two planes, float32 [2T, R] -> [T, R]: hi's row plus lo's."""
    return y[0::2] + y[1::2]


def quantize_act32_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [T, C] (C a multiple of 256) -> (qs int8 [T, C], d float32 [T, C/32], bsums int32 [T, C/16]):
    ggml's quantize_row_q8_0_ref per 32 values, its fp16 scale as float32 (exact). Per block: d = max|x| / 127
    (float32), id = 1 / d (0 for an all-zero block), q = roundf(x * id) (half away from zero; within +-127: x * id
    is at most 127 (1 + 2^-22)), the stored scale fp16(d) (round to nearest even). q is rounded against the float32
    d, the dot multiplies by the fp16 one: as llama.cpp. bsums as quantize_act_ref's (what the VNNI tile dots take
    off)."""
    x = np.asarray(x, dtype=np.float32)
    T, C = x.shape
    blocks = x.reshape(T, C // QK8_0, QK8_0)  # [T, C/32, 32]
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)  # [T, C/32, 1]
    with np.errstate(divide="ignore"):
        iscale = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), np.float32(0)).astype(np.float32)
    v = (blocks * iscale).astype(np.float32)  # [T, C/32, 32]
    qs = (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(np.int8)  # roundf
    bsums = qs.reshape(T, C // SUB, SUB).astype(np.int32).sum(axis=-1)  # [T, C/16]
    return qs.reshape(T, C), d.astype(np.float16).astype(np.float32).reshape(T, C // QK8_0), bsums.astype(np.int32)


@njit(cache=True)
def quantize_act(x, qs, d, bsums, qmax):
    """One row: x float32 [C] -> qs int16/int8 [C], d float32 [C/256], bsums int32 [C/16] (written); qmax =
    32767 or 127, the largest value of qs's dtype. Twin of `quantize_act_ref`."""
    # Written for the vector unit (a plain loop's bits for finite x): 16 running maxima, one per lane (a single running
    # maximum is a chain of dependent compares; the maximum is the same in any order), and the float -> int8 step
    # through int32. 64 rows of 512 values in L1, 1 thread: 1.37 ns a value before, 0.62 so; in the MoE kernel its
    # h blocks are ~2.5% of a 512-token layer (mid Q4_K_M, 1 thread: 3.7 ms of ~60, 1.4 so)
    lanes = np.empty(SUB, dtype=np.float32)  # [16] running maxima
    for b in range(x.shape[0] // QK_K):
        xb = x[b * QK_K:(b + 1) * QK_K]  # [256]
        lanes[:] = 0.0
        for s in range(QK_K // SUB):
            for i in range(SUB):
                lanes[i] = max(lanes[i], abs(xb[SUB * s + i]))
        amax = np.float32(0.0)
        for i in range(SUB):
            amax = max(amax, lanes[i])
        if qmax == EXACT_SCALE_QMAX:  # 8 bits: llama.cpp's block_q8_K scale (see quantize_act_ref)
            iscale = np.float32(qmax) / amax if amax > 0 else np.float32(0.0)
            d[b] = np.float32(1.0) / iscale if amax > 0 else np.float32(0.0)
        else:
            e = max(math.frexp(np.float64(amax) / qmax)[1], -100)
            d[b] = np.float32(math.ldexp(1.0, e))
            iscale = np.float32(math.ldexp(1.0, -e))
        qb = qs[b * QK_K:(b + 1) * QK_K]  # [256]
        for i in range(QK_K):  # (through int32: float -> int8 in one step is not a vector loop; no clamp: the ref's)
            qb[i] = np.int32(np.rint(xb[i] * iscale))
        for s in range(QK_K // SUB):
            acc = np.int32(0)
            for i in range(SUB * s, SUB * s + SUB):
                acc += np.int32(qb[i])
            bsums[b * (QK_K // SUB) + s] = acc


@njit(cache=True, inline="always")
def fp16_round(v):
    """float32 v >= 0 -> the float32 of its nearest fp16 (ties to even; GGML_FP32_TO_FP16 then back, exact):
    11 significant bits, the subnormals' step 2^-24 below 2^-14, infinity from 65520 on."""
    a = np.float64(v)
    if a >= 65520.0:
        return np.float32(np.inf)
    if a < 2.0 ** -14:
        return np.float32(np.rint(a * 2.0 ** 24) * 2.0 ** -24)
    m, e = math.frexp(a)  # a = m 2^e, m in [0.5, 1)
    return np.float32(math.ldexp(np.rint(math.ldexp(m, 11)), e - 11))


@njit(cache=True)
def quantize_act32(x, qs, d, bsums):
    """One row, 8 bits per 32 values: x float32 [C] -> qs int8 [C], d float32 [C/32], bsums int32 [C/16]
    (written). Twin of `quantize_act32_ref` (ggml's quantize_row_q8_0_ref), bit for bit."""
    for b in range(x.shape[0] // QK8_0):
        xb = x[b * QK8_0:(b + 1) * QK8_0]  # [32]
        amax = np.float32(0.0)
        for i in range(QK8_0):
            amax = max(amax, abs(xb[i]))
        db = amax / np.float32(127.0)
        iscale = np.float32(1.0) / db if db > 0 else np.float32(0.0)
        d[b] = fp16_round(db)
        for i in range(QK8_0):  # roundf: half away from zero (|v| + 1/2 exact in float64)
            v = xb[i] * iscale
            r = np.int32(math.floor(np.float64(abs(v)) + 0.5))
            qs[b * QK8_0 + i] = -r if v < 0 else r
    for s in range(x.shape[0] // SUB):
        acc = np.int32(0)
        for i in range(SUB * s, SUB * s + SUB):
            acc += np.int32(qs[i])
        bsums[s] = acc


@njit(cache=True)
def quantize_planes(x, qs, d, bsums, group):
    """One row x float32 [C] -> its two planes: qs int8 [2, C], d float32 [2, C/group], bsums int32 [2, C/16]
    (written; row 0 hi, row 1 lo). Twin of `quantize_planes_ref`, bit for bit."""
    for b in range(x.shape[0] // group):
        xb = x[b * group:(b + 1) * group]
        amax = np.float32(0.0)
        for i in range(group):
            amax = max(amax, abs(xb[i]))
        e = max(math.frexp(np.float64(amax) / PLANE_QMAX)[1], -100)
        db = np.float32(math.ldexp(1.0, e))
        iscale = np.float32(math.ldexp(1.0, -e))
        d[0, b] = db * np.float32(PLANE_BASE)
        d[1, b] = db
        for i in range(group):
            q = np.int32(np.rint(xb[i] * iscale))
            h = np.int32(np.rint(np.float64(q) / PLANE_BASE))
            qs[0, b * group + i] = h
            qs[1, b * group + i] = q - PLANE_BASE * h
    for p in range(2):
        for s in range(x.shape[0] // SUB):
            acc = np.int32(0)
            for i in range(SUB * s, SUB * s + SUB):
                acc += np.int32(qs[p, i])
            bsums[p, s] = acc


@njit(cache=True, inline="always")
def quantize_act_in(x, qs, d, bsums, qmax, group):
    """quantize_act (group 256) or quantize_act32 (group 32, qmax 127) of one row: what the kernels call, the
    layout given by the weight's type (`act_group`)."""
    if group == QK8_0:
        quantize_act32(x, qs, d, bsums)
    else:
        quantize_act(x, qs, d, bsums, qmax)


@njit(cache=True)
def quantize_act_rows(x, qs, d, bsums, qmax, group):
    """x float32 [T, C] -> qs [T, C], d [T, C/group], bsums [T, C/16] (written), row by row."""
    for t in range(x.shape[0]):
        quantize_act_in(x[t], qs[t], d[t], bsums[t], qmax, group)


@njit(cache=True)
def quantize_planes_rows(x, qs, d, bsums, group):
    """x float32 [T, C] -> qs int8 [2T, C], d [2T, C/group], bsums [2T, C/16] (written), token by token."""
    for t in range(x.shape[0]):
        quantize_planes(x[t], qs[2 * t:2 * t + 2], d[2 * t:2 * t + 2], bsums[2 * t:2 * t + 2], group)


def quantize_rows(x: np.ndarray, bits: int = 16, group: int = QK_K) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [T, C] -> fresh (qs, d, bsums) of T rows (the Numba quantizer); group 32 (8 bits or PLANES): one
    scale per 32 values (`act_group`). bits PLANES: 2T rows, each token's hi and lo planes (`quantize_planes_ref`)."""
    dtype = np.dtype(ACT_DTYPES[bits])
    if group != QK_K and (group != QK8_0 or bits not in (8, PLANES)):
        raise ValueError(f"activation group must be 256, or 32 at 8 bits; got {group} at {bits}")
    T, C = x.shape
    if bits == PLANES:
        qs = np.empty((2 * T, C), dtype=np.int8)  # [2T, C]
        d = np.empty((2 * T, C // group), dtype=np.float32)  # [2T, C/group]
        bsums = np.empty((2 * T, C // SUB), dtype=np.int32)  # [2T, C/16]
        quantize_planes_rows(np.ascontiguousarray(x, dtype=np.float32), qs, d, bsums, group)
        return qs, d, bsums
    qs = np.empty((T, C), dtype=dtype)  # [T, C]
    d = np.empty((T, C // group), dtype=np.float32)  # [T, C/group]
    bsums = np.empty((T, C // SUB), dtype=np.int32)  # [T, C/16]
    quantize_act_rows(np.ascontiguousarray(x, dtype=np.float32), qs, d, bsums, qmax_of(dtype), group)
    return qs, d, bsums


def quantize_for(x: np.ndarray, qtype, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_rows(x, bits) in the layout a weight of this type is dotted with (`act_group`)."""
    return quantize_rows(x, bits, act_group(qtype, bits))


def _prefetch(locality: int, name: str):
    """An intrinsic: a hint that the 64-byte line at an integer address will be read soon, at this locality (3: keep
    it in every cache level, x86 prefetcht0; 0: non-temporal, prefetchnta). No fault, no effect on results."""
    def prefetch(typingctx, address):
        sig = types.void(address)

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
            fn = cgutils.get_or_insert_function(builder.module,
                                                ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]),
                                                "llvm.prefetch.p0")
            builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, locality), ir.Constant(i32, 1)])  # read, data
            return context.get_dummy_value()

        return sig, codegen

    prefetch.__name__ = prefetch.__qualname__ = name
    return intrinsic(prefetch)


prefetch_line = _prefetch(3, "prefetch_line")  # bytes worth keeping: dense weights, the KV cache


@njit(cache=True, inline="always")
def prefetch_ahead(base, pos, nbytes, end, dist):
    """prefetch_line over base + [pos + dist, pos + dist + nbytes), clipped at base + end."""
    for off in range(pos + dist, min(end, pos + dist + nbytes), 64):
        prefetch_line(base + off)


@njit(cache=True, inline="always")
def prefetch_ahead_stream(base, pos, nbytes, end, dist):
    """prefetch_ahead with the hint for bytes read once (STREAM_LOCALITY)."""
    for off in range(pos + dist, min(end, pos + dist + nbytes), 64):
        prefetch_line_stream(base + off)


# ----------------------------------------------------------------------------------------------------------------
# 2. The whole-row form: one call per weight row, all its blocks, everything in vector registers.
#     row_dot(w, xq, xd, xbs) = sum_b (d_b dx_b) sum_k sc[k // 16] v_k xq[256 b + k]  (- dmin_b dx_b sum_s m_s bsum_s)
# The layout is static, given when the intrinsic is made: 8 groups of 32 weights per 256-block (group g = weights
# 32g..32g+31), each a bit field (byte offset, shift, mask) and optionally a second, high field (offset, shift,
# mask, position); the 16 sub-block scales as bit fields of the block's bytes
# picked per lane (byte index, shift, mask, position; minus a bias); a value bias subtracted from every weight's
# integer (Q3_K: 4, Q6_K: 32); optionally the 16 mins (Q2_K: the high nibbles of the scale bytes; Q4_K: 6-bit
# fields) and the block's two fp16 factors d, dmin. Per block:
#   - unpack: each group's 32 integers times their sub-block's scale, in 16-bit lanes (|scale * v| <= 45 for Q2_K,
#     128 for Q3_K, 945 for Q4_K, 1953 for Q5_K, 4096 for Q6_K), once per block, whatever the number of activation
#     rows (the one-row form, whose blocks are used once, may instead multiply each group's 16 pair sums by their
#     scales, `prescale_one`: the same integers lane by lane, hence the same bits);
#   - per activation row: 8 multiply-adds of pairs (vpmaddwd, or vpdpwssd with VNNI) into one int32 [16] vector:
#     |lane| <= 16 products * 4096 * 32767 < 2^31, so the integer sums are exact; the mins against the row's bsums
#     (int32 [16], |m * bsum| <= 63 * 16 * 32767); both converted to float32 [16] and multiply-added (llvm.fma: one
#     rounding) with the scalars d * dx and -dmin * dx into a float32 [16] accumulator of the row, lane by lane;
#   - at the end of the row: one reduction of the accumulator, in a fixed tree (lanes i and i + 8, then i + 4, ...).
# No horizontal sum per block (the old per-block form spent most of its time there), and every float operation is
# plain IEEE (no fast-math flags), in an order that does not depend on the number of rows: row t of row_dot_rows
# has exactly the bits of row_dot on row t alone. The fp16 factors are converted by LLVM's fpext (vcvtph2ps): exact.
_LANE = list(range(32))


def _is_act(a) -> bool:  # activations int8/int16
    return isinstance(a, types.Array) and a.dtype in (types.int8, types.int16)


def host_features() -> dict:
    """This CPU's features as LLVM names them ("avx2", "avx512bw", "avx512vnni", ...) when Numba compiles for it;
    empty when it compiles for a named CPU (NUMBA_CPU_NAME): then every kernel takes its portable form."""
    import numba
    from llvmlite import binding

    return dict(binding.get_host_cpu_features()) if numba.config.CPU_NAME in (None, "host") else {}


def host_cpu_name() -> str:
    """The CPU Numba compiles for, as LLVM names it ("znver5", "rocketlake", ...): NUMBA_CPU_NAME when set, else this
    machine's."""
    import numba
    from llvmlite import binding

    return numba.config.CPU_NAME if numba.config.CPU_NAME not in (None, "host") else binding.get_host_cpu_name()


def _stream_locality() -> int:
    """The hint for the bytes a decode step reads once (the routed experts, kernels._moe_kernel): 0, non-temporal
    (prefetchnta), on AMD Zen; 2 (prefetcht1: into L2, not L1) on Zen 4; 3 (prefetcht0, every level) elsewhere.
    PYMOE_STREAM_LOCALITY=0..3 chooses; PYMOE_NT=1 / 0 is 0 / 3. The measurements: kernels.py, the comment
    below `_ACT_KERNELS`."""
    if os.environ.get("PYMOE_STREAM_LOCALITY"):
        return int(os.environ["PYMOE_STREAM_LOCALITY"])
    if os.environ.get("PYMOE_NT"):
        return 0 if os.environ["PYMOE_NT"] != "0" else 3
    cpu = host_cpu_name()
    return 2 if cpu == "znver4" else 0 if cpu.startswith("znver") else 3


def _dense_locality() -> int:
    """The hint for the bytes read again next token (the dense weights' one-token tile dots, repack.TILE_DOTS): 3
    (prefetcht0) except on Zen 4, where 2 (prefetcht1) was faster (docs/performance.md, round nineteen);
    PYMOE_DENSE_LOCALITY=0..3 chooses."""
    return int(os.environ.get("PYMOE_DENSE_LOCALITY") or (2 if host_cpu_name() == "znver4" else 3))


STREAM_LOCALITY, DENSE_LOCALITY = _stream_locality(), _dense_locality()
prefetch_line_stream = _prefetch(STREAM_LOCALITY, f"prefetch_line_stream{STREAM_LOCALITY}")  # bytes read once per
# token: routed experts (kernels._moe_kernel)


def _host_has_avx512bw() -> bool:
    """Whether this CPU has AVX-512BW (`host_features`): then row_dot calls vpmaddwd by its x86 intrinsic (the
    portable pattern above is what other CPUs get; the integers are the same)."""
    return bool(host_features().get("avx512bw"))


_PMADDWD_512 = _host_has_avx512bw()


def _host_has_avx2() -> bool:
    """Whether this CPU has AVX2 (`host_features`): then the row dots call its instructions by their x86 intrinsics
    (vpmaddwd, vpmaddubsw, vpsignb, and vpshufb for a 16-entry codebook); other CPUs get portable patterns with the
    same integers (`portable=True` builds those here, for the tests)."""
    return bool(host_features().get("avx2"))


_AVX2 = _host_has_avx2()


def _host_has_fast_pdep() -> bool:
    """Whether this CPU has BMI2's pdep at one instruction's cost: every BMI2 CPU but AMD's Zen 1 and 2, whose pdep is
    microcoded (hundreds of cycles). Then the Grid formats whose row index is split over two fields (IQ1_S, IQ1_M,
    IQ2_S, IQ3_S) build four indices with two pdep (Grid.rows, `_GridCode.row_indices`)."""
    return bool(host_features().get("bmi2")) and host_cpu_name() not in ("znver1", "znver2")


_PDEP = _host_has_fast_pdep()


class Gather:
    """A group of 32 weights whose lanes are not 32 consecutive bytes under one shift: lane l is
    (byte index[l] of the block) >> shift[l] & mask, e.g. IQ4's 16 bytes read twice (low nibbles, then high ones)
    or Q2_0's four weights per byte. Built from the block's bytes by shuffles with constant lane lists."""

    def __init__(self, index, shift, mask: int):
        assert len(index) == len(shift) == 32
        self.index, self.shift, self.mask = list(index), list(shift), mask


class Grid:
    """A group of 32 weights whose magnitudes are rows of a grid (IQ2: 8 weights a row, IQ3: 4) and whose signs come
    8 weights at a time (IQ2/IQ3, iquants.py). `rows`: one field list per row of the group, whose OR is the row's
    index into `grid` (int8 [n, width], the magnitudes); `signs`: one field list per 8 weights, whose OR is the index
    of their sign pattern in `sign_table` (int8 [m, 8] of +-1). A field (offset, nbytes, shift, mask, pos) is the
    little-endian integer of nbytes bytes at the block's byte offset, >> shift & mask, << pos. `name` names the two
    tables in the compiled code (LLVM constants the row lookups load from, one 8- or 4-byte load a row).
    IQ1 (grid values -1, 0, +1 and a shift of +-1/8 per 8 weights): no signs; `grid` holds 8 times the values and
    `delta` one field list per 8 weights giving one bit: their integers are 8 * grid + 1, or - 1 where it is set."""

    def __init__(self, name: str, rows, signs, grid: np.ndarray, sign_table, delta=None):
        assert grid.shape[1] * len(rows) == 32
        assert (signs is None or (len(signs) == 4 and sign_table.shape[1] == 8)) and (delta is None or len(delta) == 4)
        self.name, self.rows, self.signs, self.grid, self.sign_table = name, rows, signs, grid, sign_table
        self.delta = delta


def _pdep_plan(four) -> tuple:
    """For 4 Grid rows (field lists), the pdep form of their indices if they fit it, else (): each row = byte l of 4
    consecutive bytes (whole, at bit 0) + a high part (mask m, at bit pos) from one little-endian word of 1, 2 or 4
    bytes, the 4 high parts evenly spaced in it (pdep deposits a word's low bits in order). -> (the 4 bytes' offset,
    the word's offset, its bytes, the first part's bit offset in it, the source mask of the 4 high parts in the word
    shifted by that offset, the destination mask: part l at bits 16 l + pos, as many bits as the parts' spacing)."""
    if any(len(f) != 2 for f in four):
        return ()
    firsts, highs = [f[0] for f in four], [f[1] for f in four]
    if [f[1:] for f in firsts] != [(1, 0, 255, 0)] * 4 or [f[0] - firsts[0][0] for f in firsts] != [0, 1, 2, 3]:
        return ()
    base = min(h[0] for h in highs)
    span = max(h[0] + h[1] for h in highs) - base
    mask, pos = highs[0][3], highs[0][4]
    if span not in (1, 2, 4) or any(h[3] != mask or h[4] != pos for h in highs) or pos + mask.bit_length() > 16:
        return ()
    bits = [8 * (h[0] - base) + h[2] for h in highs]  # each high part's bit offset in the word
    stride = bits[1] - bits[0]  # pdep deposits the word's low bits in order: the parts must be evenly spaced, and
    # each takes `stride` bits at 16 l + pos (the bits between parts, masked to 0, land above each part)
    if (any(b1 - b0 != stride for b0, b1 in zip(bits, bits[1:])) or stride < mask.bit_length() or pos + stride > 16
            or bits[-1] + mask.bit_length() > 8 * span):
        return ()
    return (firsts[0][0], base, span, bits[0], sum(mask << (b - bits[0]) for b in bits),
            sum(((1 << stride) - 1) << (16 * l + pos) for l in range(4)))


def _make_row_dot(groups, scale_fields, scale_bias: int, value_bias: int, size: int, d_off: int, dmin_off: int,
                  min_fields, signed_scales: bool = False, codebook=None, group_scales=None, signed_values=False,
                  portable: bool = False, prescale_one: bool = False, exact_blocks: bool = False, d_mult: float = 1.0,
                  d_fields=None, decoder: bool = False):
    """-> (row_dot(w, xq, xd, xbs) -> float32 for one activation row (1-D xq [C], xd [C/256], xbs [C/16]),
    row_dot_rows(w, xq, xd, xbs, acc, out) writing out[t] = row_dot(w, xq[t], xd[t], xbs[t]) for every row t of
    2-D, C-contiguous xq, xd, xbs; acc: float32 [T, 16] scratch). w: one weight row, uint8 [nb * size].

    Formats of the newer kinds add three options (section 3b):
      codebook: 16 int8 levels; a group's 4-bit fields are indices into it (IQ4_NL, IQ4_XS, MXFP4);
      group_scales: [(byte offset, "f16" | "e8m0_half")] * 8: each group of 32 has a float scale of its own (the
        32- and 64-weight block formats, 256 weights = 8, 4 blocks), in place of d and the integer scales;
      signed_values: a group's bytes are the int8 weights themselves (Q8_0);
      Grid groups: magnitudes from a grid, signs from a table (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), and
        d_mult: the power of two the block's d is multiplied by (exact) so that the integer scales are 2s + 1;
        d_fields: Grid-style fields whose OR is d's fp16 bits, for a d spread over the block (IQ1_M), else d_off.
    portable: never the x86 intrinsics (the path of other CPUs, compiled here by the tests to check it).
    exact_blocks: with 8-bit activations, each block's integer sums (with group_scales: each group's) are added up
    exactly and enter the float accumulator as one multiply-add each, in order (block_terms8), so a row's bits do not
    depend on how its integers sit in lanes: the numerics of the 8-row repacked layouts (quant/repack.py), for the
    formats that have one (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, IQ4_XS) and the Grid formats (decoded tiles).
    decoder: also return a third intrinsic, row_decode(w, tile, r): the row's blocks into row r (0..7) of an 8-row
    decoded tile (DECODED_TILE bytes per block, the layout at DECODED_TILE; formats whose blocks are integers with a
    scale per 16 weights and one d: the Grid formats).
    prescale_one: the one-row form multiplies the weights by their scales before the pair sums, as the rows form
    does (the same integers: both weights of a pair share a scale); else the pair sums after. Which is faster
    depends on the format (measured on Zen 3, 1 thread, 512 x 1024: Q2_K 9.6 vs 8.1 G MAC/s prescaled, Q4_K 6.3
    vs 9.0)."""
    return _RowDotCode(groups, scale_fields, scale_bias, value_bias, size, d_off, dmin_off, min_fields, signed_scales,
                       codebook, group_scales, signed_values, portable, prescale_one, exact_blocks, d_mult,
                       d_fields).intrinsics(decoder)


def _act_rows(x, nd):
    return _is_act(x) and x.dtype != types.int32 and x.ndim == nd and x.layout == "C"


def _arr(a, dtype, nd):
    return isinstance(a, types.Array) and a.dtype == dtype and a.ndim == nd and a.layout == "C"


# The LLVM types of the row dots' code
i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
v16i, v16f = ir.VectorType(i32, 16), ir.VectorType(f32, 16)


# LLVM vector helpers every format family's row dots share (no options in them)

def vec(ty, n, values):
    return ir.Constant(ir.VectorType(ty, n), list(values))


def load(builder, data, offset, ty, n):  # n elements of type ty at data + offset (in elements), any alignment
    ptr = builder.bitcast(builder.gep(data, [offset]), ir.VectorType(ty, n).as_pointer())
    return builder.load(ptr, align=1)


def at(builder, base, byte_offset, ty):  # a pointer to ty at i8* base + byte_offset
    return builder.bitcast(builder.gep(base, [byte_offset]), ty.as_pointer())


def splat(builder, scalar, n=16):  # float -> <n x float>, every lane the scalar
    t = ir.VectorType(f32, n)
    v = builder.insert_element(ir.Constant(t, ir.Undefined), scalar, ir.Constant(i32, 0))
    return builder.shuffle_vector(v, ir.Constant(t, ir.Undefined), vec(i32, n, [0] * n))


def fp16(builder, wdata, s_, off):  # the fp16 field at byte s + off, as float32 (exact)
    h = builder.load(at(builder, wdata, builder.add(s_, ir.Constant(i64, off)), i16), align=1)
    return builder.fpext(builder.bitcast(h, ir.HalfType()), f32)


def concat(builder, parts):  # vectors of one type -> one vector of all their lanes, in order
    while len(parts) > 1:
        if len(parts) % 2:
            parts = parts + [parts[-1]]  # a filler, never picked
        n = parts[0].type.count
        parts = [builder.shuffle_vector(a, b, vec(i32, 2 * n, range(2 * n))) for a, b in zip(parts[0::2], parts[1::2])]
    return parts[0]


def x86(builder, name, ret, args):  # a call of an LLVM intrinsic (x86's, or llvm.fma)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def fma(builder, a, b, c):  # float32 [16]: a * b + c, one rounding
    return x86(builder, "llvm.fma.v16f32", v16f, [a, b, c])


def isum_all(builder, v):  # int32 [n] -> the sum of its lanes, int32 (exact: the bounds above)
    n = v.type.count
    while n > 1:
        n //= 2
        v = builder.add(builder.shuffle_vector(v, v, vec(i32, n, range(n))),
                        builder.shuffle_vector(v, v, vec(i32, n, range(n, 2 * n))))
    return builder.extract_element(v, ir.Constant(i32, 0))


def reduce(builder, v):  # float32 [16] -> float32, lanes i + n/2 added to lanes i, n = 16, 8, 4, 2
    n = 16
    while n > 1:
        n //= 2
        v = builder.fadd(builder.shuffle_vector(v, v, vec(i32, n, range(n))),
                         builder.shuffle_vector(v, v, vec(i32, n, range(n, 2 * n))))
    return builder.extract_element(v, ir.Constant(i32, 0))


class _GridCode:
    """The Grid groups (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): magnitudes as rows of a constant
    grid, signs from a sign table (or IQ1's +-1/8 shifts)."""

    def constant_table(self, builder, name, rows):  # int8 [n, width] -> an LLVM constant array of n width-byte integers
        try:
            return builder.module.get_global(name)
        except KeyError:
            ty = ir.ArrayType(ir.IntType(8 * rows.shape[1]), rows.shape[0])
            table = ir.GlobalVariable(builder.module, ty, name)
            table.initializer = ir.Constant(ty, [int.from_bytes(r.astype(np.int8).tobytes(), "little", signed=True)
                                                 for r in rows])
            table.global_constant, table.linkage = True, "internal"
            return table

    def bit_fields(self, builder, wdata, s_, fields):  # Grid's fields of the block at byte s -> their OR, int64
        out = None
        for off, nbytes, shift, mask, pos in fields:
            ptr = at(builder, wdata, builder.add(s_, ir.Constant(i64, off)), ir.IntType(8 * nbytes))
            v = builder.load(ptr, align=1)
            v = builder.and_(builder.lshr(builder.zext(v, i64), ir.Constant(i64, shift)), ir.Constant(i64, mask))
            v = builder.shl(v, ir.Constant(i64, pos))
            out = v if out is None else builder.or_(out, v)
        return out

    def row_indices(self, builder, wdata, s_, rows):
        """Grid.rows' indices of the block at byte s, int64 each: bit_fields per row, or, with pdep, four rows at a
        time where each row is one byte of 4 consecutive ones plus a high part from one 1-, 2- or 4-byte word at
        increasing bit offsets (IQ1_S, IQ1_M, IQ2_S, IQ3_S): pdep spreads the 4 bytes to bits 16 l, another pdep the
        high parts to bits 16 l + pos, one OR, then a shift and mask per row; the same indices (llama.cpp builds
        IQ1_M's so). Measured IQ1_M, 1 thread, one token, Zen 4: round seventeen's write-up
        (`git show cdf1b2c:docs/performance.md`)."""
        def word(off, n):  # the n-byte little-endian word at byte s + off, as int64
            ptr = at(builder, wdata, builder.add(s_, ir.Constant(i64, off)), ir.IntType(8 * n))
            return builder.zext(builder.load(ptr, align=1), i64)

        out = []
        for q in range(0, len(rows), 4):
            four = rows[q:q + 4]
            packed = self.pdep and len(four) == 4 and _pdep_plan(four)
            if not packed:
                out += [self.bit_fields(builder, wdata, s_, f) for f in four]
                continue
            lo_off, word_off, nbytes, shift, src_mask, dst_mask = packed
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64, i64]),
                                                "llvm.x86.bmi.pdep.64")
            lo = builder.call(fn, [word(lo_off, 4), ir.Constant(i64, 0x00FF00FF00FF00FF)])
            high = builder.lshr(word(word_off, nbytes), ir.Constant(i64, shift))
            hi = builder.call(fn, [builder.and_(high, ir.Constant(i64, src_mask)), ir.Constant(i64, dst_mask)])
            both = builder.or_(lo, hi)
            out += [builder.and_(builder.lshr(both, ir.Constant(i64, 16 * l)), ir.Constant(i64, 0xFFFF))
                    for l in range(4)]
        return out

    def rows_of(self, builder, table, indices, width):
        """Rows of a constant table of width-byte rows (len(indices) * width = 32) -> int8 [32], in order: a scalar
        load per row. Measured against an index vector built by shuffles and one AVX2 gather (vpgatherdq / vpgatherdd),
        Zen 5, 1 thread, one token, 3 runs each: IQ2_XXS 11-15 vs 6-9 G MACs/s, IQ3_XXS 9-11 vs 8: kept the loads."""
        ty = ir.IntType(8 * width)
        v = ir.Constant(ir.VectorType(ty, len(indices)), ir.Undefined)
        for r, index in enumerate(indices):
            row = builder.load(builder.gep(table, [ir.Constant(i64, 0), index]), align=width)
            v = builder.insert_element(v, row, ir.Constant(i32, r))
        return builder.bitcast(v, ir.VectorType(i8, 32))

    def grid_group(self, builder, wdata, s_, spec, split=False):
        """A Grid group -> int8 [32] signed weights (magnitude times sign); with split, for a group with signs:
        (int8 [32] magnitudes, int8 [32] of +-1), which the 8-bit dot puts onto x instead (group_sums8)."""
        width = spec.grid.shape[1]
        v = self.rows_of(builder, self.constant_table(builder, f"pymoe_{spec.name}_grid", spec.grid),
                    self.row_indices(builder, wdata, s_, spec.rows), width)
        if spec.signs is not None:
            signs = self.rows_of(builder, self.constant_table(builder, f"pymoe_{spec.name}_signs", spec.sign_table),
                            [self.bit_fields(builder, wdata, s_, f) for f in spec.signs], 8)
            if split:
                return v, signs
            if self.avx2:
                v = x86(builder, "llvm.x86.avx2.psign.b", v.type, [v, signs])
            else:
                v = builder.select(builder.icmp_signed("<", signs, vec(i8, 32, [0] * 32)), builder.neg(v), v)
        if spec.delta is not None:  # + 1 - 2 * bit, per 8 weights: each bit one field of one byte, so all four come
            # from one load: lane k (weight k) takes its run's byte by a shuffle (measured, IQ1_M, 1 thread, one
            # token, Zen 5: 9.8 -> 13.2 G MACs/s against a scalar extraction per run)
            (offs, shifts) = zip(*((f[0][0], f[0][2]) for f in spec.delta))
            assert all(len(f) == 1 and f[0][1] == 1 and f[0][3] == 1 and f[0][4] == 0 for f in spec.delta)
            lo = min(offs)
            raw = load(builder, wdata, builder.add(s_, ir.Constant(i64, lo)), i8, max(offs) + 1 - lo)
            lanes = builder.shuffle_vector(raw, ir.Constant(raw.type, ir.Undefined),
                                           vec(i32, 32, [offs[k // 8] - lo for k in range(32)]))
            # each lane's bit tested in place (vptestmb, then a blend of -1 and +1 on AVX-512): measured IQ1_M, 1
            # thread, one token, Zen 4, G MACs/s in round seventeen's write-up (git show cdf1b2c:docs/performance.md),
            # against shifting each lane by its run's shift (bytes have no variable shift: widen, vpsrlvw, narrow)
            bit = vec(i8, 32, [1 << shifts[k // 8] for k in range(32)])
            set_ = builder.icmp_unsigned("!=", builder.and_(lanes, bit), vec(i8, 32, [0] * 32))
            v = builder.add(v, builder.select(set_, vec(i8, 32, [-1] * 32), vec(i8, 32, [1] * 32)))
        return v


class _GroupScaleCode:
    """The 32-weight-block formats (Q4_0, Q8_0, Q2_0, IQ4_NL, IQ4_XS, MXFP4): Gather groups, codebook levels and
    a float scale per group."""

    def gather(self, builder, wdata, s_, spec):  # a Gather group -> int8 [32]
        lo = min(spec.index)
        span = max(spec.index) + 1 - lo
        raw = load(builder, wdata, builder.add(s_, ir.Constant(i64, lo)), i8, span)
        shifts = sorted(set(spec.shift))  # each shift once, over all the bytes, then one shuffle picks the lanes
        parts = [builder.and_(builder.lshr(raw, vec(i8, span, [sh] * span)), vec(i8, span, [spec.mask] * span))
                 for sh in shifts]
        table = concat(builder, parts)
        picks = [shifts.index(sh) * span + k - lo for k, sh in zip(spec.index, spec.shift)]
        return builder.shuffle_vector(table, ir.Constant(table.type, ir.Undefined), vec(i32, 32, picks))

    def lookup(self, builder, v):  # int8 [32] of indices 0..15 -> int8 [32] of codebook levels
        if self.avx2:  # vpshufb looks up within each 16-byte half: the table twice
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VectorType(i8, 32),
                                                [ir.VectorType(i8, 32)] * 2), "llvm.x86.avx2.pshuf.b")
            return builder.call(fn, [vec(i8, 32, list(self.codebook) * 2), v])
        out = vec(i8, 32, [self.codebook[0]] * 32)
        for k in range(1, 16):
            out = builder.select(builder.icmp_unsigned("==", v, vec(i8, 32, [k] * 32)),
                                 vec(i8, 32, [self.codebook[k]] * 32), out)
        return out

    def group_scales_at(self, builder, wdata, s_):
        """The 8 groups' float scales of the 256 weights at byte s, as one float32 [8] vector: each field loaded
        on its own (they are 18, 34 or 17 bytes apart), then converted together (fp16: one vcvtph2ps; E8M0, halved
        as ggml_e8m0_to_fp32_half: bits (e - 1) << 23 for e >= 2, the subnormals 0x00200000 << e below)."""
        v8i, kind = ir.VectorType(i32, 8), self.group_scales[0][1]
        assert all(k == kind for _, k in self.group_scales)
        if kind == "f16":
            h = ir.Constant(ir.VectorType(i16, 8), ir.Undefined)
            for g, (off, _) in enumerate(self.group_scales):
                field = builder.load(at(builder, wdata, builder.add(s_, ir.Constant(i64, off)), i16), align=1)
                h = builder.insert_element(h, field, ir.Constant(i32, g))
            return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), ir.VectorType(f32, 8))
        e = ir.Constant(v8i, ir.Undefined)
        for g, (off, _) in enumerate(self.group_scales):
            byte = builder.load(builder.gep(wdata, [builder.add(s_, ir.Constant(i64, off))]))
            e = builder.insert_element(e, builder.zext(byte, i32), ir.Constant(i32, g))
        normal = builder.shl(builder.sub(e, vec(i32, 8, [1] * 8)), vec(i32, 8, [23] * 8))
        small = builder.shl(vec(i32, 8, [0x00200000] * 8), builder.and_(e, vec(i32, 8, [1] * 8)))  # e < 2: e & 1 = e
        bits = builder.select(builder.icmp_unsigned("<", e, vec(i32, 8, [2] * 8)), small, normal)
        return builder.bitcast(bits, ir.VectorType(f32, 8))

    def times_dx(self, builder, d, dx):  # the groups' scales float32 [8] times x's: the block's one scale dx
        # (per 256 values), or its 8 (float32 [8], per 32: 8-bit x), d_g * dx_g; each rounded once
        return builder.fmul(d, dx if isinstance(dx.type, ir.VectorType) else splat(builder, dx, 8))


class _BlockCode:
    """One block's weights as integers (every family: K-quants' bit fields with their 16 integer scales and mins,
    and the kinds of groups above) and its scales."""

    def unpack(self, builder, wdata, s_, prescale, split=False):
        """The block at byte s: its 8 groups as (int16 [32] vector of scale * q, None) if prescale, else as (q,
        int32 [16] scales: lane j of a pair sum gets its sub-block's scale), and its mins int32 [16] (or None).
        With group_scales: the groups as (q, None), the scales applied later in float. prescale "bytes" (the 8-bit
        path): (int8 [32] q, int16 [16] scales per pair lane or None, None), or with split, for Grid groups with
        signs: (int8 [32] magnitudes, scales, int8 [32] signs +-1)."""
        def field(off, shift, mask, n=32):  # (n bytes of the block from s + off) >> shift & mask
            v = load(builder, wdata, builder.add(s_, ir.Constant(i64, off)), i8, n)
            return builder.and_(builder.lshr(v, vec(i8, n, [shift] * n)), vec(i8, n, [mask] * n))

        def lanes16(fields, signed=False):  # 16 per-lane values, int16: each piece gathers one byte per lane,
            lo = min(min(p[0]) for p in fields)  # shifts and masks it per lane, places it at bit `pos`
            span = max(max(p[0]) for p in fields) + 1 - lo  # the bytes, loaded once
            raw = load(builder, wdata, builder.add(s_, ir.Constant(i64, lo)), i8, span)
            out = None
            for index, shifts, mask, pos in fields:
                part = builder.shuffle_vector(raw, ir.Constant(raw.type, ir.Undefined),
                                              vec(i32, 16, [k - lo for k in index]))
                if signed:  # a whole signed byte (Q6_K's scales)
                    part = builder.sext(part, ir.VectorType(i16, 16))
                else:
                    masks = mask if isinstance(mask, list) else [mask] * 16
                    part = builder.and_(builder.lshr(part, vec(i8, 16, shifts)), vec(i8, 16, masks))
                    part = builder.zext(part, ir.VectorType(i16, 16))
                part = builder.shl(part, vec(i16, 16, [pos] * 16))
                out = part if out is None else builder.or_(out, part)
            return out

        scales = None
        if self.scale_fields is not None:
            scales = lanes16(self.scale_fields, self.signed_scales)  # [16] the sub-block scales (one per 16 weights)
            if self.scale_bias:
                scales = builder.sub(scales, vec(i16, 16, [self.scale_bias] * 16))
        out = []
        for g, spec in enumerate(self.groups):
            signs = None  # a Grid group's +-1 signs when they stay apart from its magnitudes (split)
            if isinstance(spec, Gather):
                v = self.gather(builder, wdata, s_, spec)
            elif isinstance(spec, Grid) and split and prescale == "bytes" and spec.signs is not None:
                v, signs = self.grid_group(builder, wdata, s_, spec, split=True)  # magnitudes, and signs for x
            elif isinstance(spec, Grid):
                v = self.grid_group(builder, wdata, s_, spec)
            elif self.signed_values:  # the group's 32 bytes are int8 weights
                v = load(builder, wdata, builder.add(s_, ir.Constant(i64, spec)), i8, 32)
            else:
                off, shift, mask, high = spec
                v = field(off, shift, mask)
                if high is not None:
                    hoff, hshift, hmask, hpos = high
                    v = builder.or_(v, builder.shl(field(hoff, hshift, hmask), vec(i8, 32, [hpos] * 32)))
            if self.codebook is not None:
                v = self.lookup(builder, v)
            if self.value_bias:  # every format's q - bias fits int8 (Q6_K: -32..31)
                v = builder.sub(v, vec(i8, 32, [self.value_bias] * 32))
            if prescale == "bytes":  # the 8-bit path: the int8 values and their scales, int16 [16] per pair lane
                sc = None if scales is None else builder.shuffle_vector(
                    scales, scales, vec(i32, 16, [2 * g] * 8 + [2 * g + 1] * 8))
                out.append((v, sc, signs))
                continue
            w16 = (builder.sext if self.negative else builder.zext)(v, ir.VectorType(i16, 32))
            if scales is None:  # group_scales: the integers as they are
                out.append((w16, None))
            elif prescale:
                sc = builder.shuffle_vector(scales, scales, vec(i32, 32, [2 * g] * 16 + [2 * g + 1] * 16))
                out.append((builder.mul(w16, sc), None))  # [32] scale * q, within 16 bits (bounds above)
            else:
                sc = builder.shuffle_vector(scales, scales, vec(i32, 16, [2 * g] * 8 + [2 * g + 1] * 8))
                out.append((w16, builder.sext(sc, v16i)))
        # [16] (one per 16 weights)
        mins = None if self.min_fields is None else builder.zext(lanes16(self.min_fields), v16i)
        return out, mins

    def block_at(self, builder, wdata, b_, prescale, xbits, split=True):
        """The block's unpacked groups (for the activations' width; split: Grid signs apart, see unpack), its
        scale(s), dmin and first value's index."""
        if xbits == 8:
            prescale = "bytes"
        s_ = builder.mul(b_, ir.Constant(i64, self.size))
        if self.group_scales is not None:
            d = self.group_scales_at(builder, wdata, s_)  # float32 [8], one scale per group
        else:
            if self.d_fields is not None:  # fp16 bits from fields of the block
                d = builder.fpext(builder.bitcast(builder.trunc(self.bit_fields(builder, wdata, s_, self.d_fields),
                                                                i16),
                                                  ir.HalfType()), f32)
            else:
                d = fp16(builder, wdata, s_, self.d_off)
            if self.d_mult != 1.0:  # a power of two: exact
                d = builder.fmul(d, ir.Constant(f32, self.d_mult))
        dmin = fp16(builder, wdata, s_, self.dmin_off) if self.dmin_off >= 0 else None
        return self.unpack(builder, wdata, s_, prescale, split), d, dmin, builder.mul(b_, ir.Constant(i64, QK_K))


class _StepCode:
    """One block's terms added into a row's float32 [16] accumulator: 16-bit activations (row_step: vpmaddwd)
    and 8-bit ones (row_step8: vpmaddubsw, block_terms8 for exact_blocks)."""

    def maddubs(self, builder, w, x):
        """int8 [32] w (as unsigned) times int8 [32] x, pairs added -> int16 [16] (vpmaddubsw; no pair sum here
        reaches its saturation: |w| <= 128, |x| <= 127, 2 * 128 * 127 < 2^15)."""
        v16s = ir.VectorType(i16, 16)
        if self.avx2:
            return x86(builder, "llvm.x86.avx2.pmadd.ub.sw", v16s, [w, x])
        prod = builder.mul(builder.zext(w, ir.VectorType(i16, 32)), builder.sext(x, ir.VectorType(i16, 32)))
        return builder.add(builder.shuffle_vector(prod, prod, vec(i32, 16, _LANE[0::2])),
                           builder.shuffle_vector(prod, prod, vec(i32, 16, _LANE[1::2])))

    def madd16(self, builder, a, b):  # int16 [16] x int16 [16], pairs added -> int32 [8] (vpmaddwd)
        v8i = ir.VectorType(i32, 8)
        if self.avx2:
            return x86(builder, "llvm.x86.avx2.pmadd.wd", v8i, [a, b])
        prod = builder.mul(builder.sext(a, ir.VectorType(i32, 16)), builder.sext(b, ir.VectorType(i32, 16)))
        return builder.add(builder.shuffle_vector(prod, prod, vec(i32, 8, _LANE[0:16:2])),
                           builder.shuffle_vector(prod, prod, vec(i32, 8, _LANE[1:16:2])))

    def group_sums8(self, builder, v, sc, xv, signs=None):
        """The 8-bit path of one group: int8 [32] values v (signed formats: any sign), their scales sc (int16 [16]
        per pair lane, or None), int8 [32] x -> int32 [8], lane i = sum of weights 4i..4i+3 times x (times scale).
        As llama.cpp does it on AVX2: |v| against x with v's sign moved onto x (vpsignb), then vpmaddubsw; a Grid
        group's signs (+-1, v its magnitudes) go onto x directly (the same products: IQ3_XXS, 1 thread, one token,
        G MACs/s in round seventeen's write-up, `git show cdf1b2c:docs/performance.md`)."""
        if signs is not None:
            if self.avx2:
                xv = x86(builder, "llvm.x86.avx2.psign.b", xv.type, [xv, signs])
            else:
                xv = builder.select(builder.icmp_signed("<", signs, vec(i8, 32, [0] * 32)), builder.neg(xv), xv)
        elif self.negative:
            zero = vec(i8, 32, [0] * 32)
            if self.avx2:
                xv = x86(builder, "llvm.x86.avx2.psign.b", xv.type, [xv, v])
            else:
                xv = builder.select(builder.icmp_signed("<", v, zero), builder.neg(xv),
                                    builder.select(builder.icmp_signed("==", v, zero), zero, xv))
            if self.avx2:  # |v| as vpsignb(v, v): one instruction, where LLVM made four of the select below (AVX-512)
                v = x86(builder, "llvm.x86.avx2.psign.b", v.type, [v, v])
            else:  # |v| (-128 -> 128 unsigned, as vpsignb gives it)
                v = builder.select(builder.icmp_signed("<", v, zero), builder.neg(v), v)
        pairs = self.maddubs(builder, v, xv)  # int16 [16]
        return self.madd16(builder, pairs, sc if sc is not None else vec(i16, 16, [1] * 16))

    def row_step8(self, builder, block, d, dmin, xrow, o_, dx, bsrow, b_, acc):
        """row_step for int8 activations: two groups' int32 [8] sums side by side make the int32 [16] of one
        pair of groups (lanes 0-7 group 2k, 8-15 group 2k + 1), then as in row_step."""
        unpacked, mins = block
        isum = None
        ddx = self.times_dx(builder, d, dx) if self.group_scales is not None else None  # float32 [8]: d_g * dx
        for k in range(4):
            sums = [self.group_sums8(builder, v, sc,
                                     load(builder, xrow, builder.add(o_, ir.Constant(i64, 32 * g)), i8, 32),
                                signs) for g, (v, sc, signs) in ((g, unpacked[g]) for g in (2 * k, 2 * k + 1))]
            if self.exact_blocks and ddx is not None:  # each group's sum exactly, then one multiply-add into lane 0
                a0 = builder.extract_element(acc, ir.Constant(i32, 0))
                for g, s in zip((2 * k, 2 * k + 1), sums):
                    a0 = x86(builder, "llvm.fma.f32", f32, [builder.sitofp(isum_all(builder, s), f32),
                                                             builder.extract_element(ddx, ir.Constant(i32, g)), a0])
                acc = builder.insert_element(acc, a0, ir.Constant(i32, 0))
                continue
            term = builder.shuffle_vector(sums[0], sums[1], vec(i32, 16, range(16)))
            if ddx is not None:  # a float scale per group: lanes 0-7 get group 2k's, 8-15 group 2k + 1's
                scale = builder.shuffle_vector(ddx, ddx, vec(i32, 16, [2 * k] * 8 + [2 * k + 1] * 8))
                acc = fma(builder, builder.sitofp(term, v16f), scale, acc)
                continue
            isum = term if isum is None else builder.add(isum, term)
        if ddx is not None:
            return acc
        if self.exact_blocks:
            return self.block_terms8(builder, isum, mins, d, dmin, dx, bsrow, b_, acc)
        return self.block_terms(builder, isum, mins, d, dmin, dx, bsrow, b_, acc)

    def block_terms8(self, builder, isum, mins, d, dmin, dx, bsrow, b_, acc):
        """block_terms for 8-bit activations: each block's two integer sums (the scaled products; the mins times
        the bsums) added up exactly first, then one multiply-add each into lane 0 of acc (the other lanes stay 0,
        so the row's final reduction adds zeros). A row's result is then the same from any arrangement of its
        integers in lanes, which is what lets the 8-row repacked layout (quant/repack.py) give these bits."""
        fma1 = lambda a, b, c: x86(builder, "llvm.fma.f32", f32, [a, b, c])  # noqa: E731
        a0 = fma1(builder.sitofp(isum_all(builder, isum), f32), builder.fmul(d, dx),
                  builder.extract_element(acc, ir.Constant(i32, 0)))
        if mins is not None:  # - dmin * dx * sum_s m_s * bsum_s
            bs = load(builder, bsrow, builder.mul(b_, ir.Constant(i64, 16)), i32, 16)
            msum = builder.sitofp(isum_all(builder, builder.mul(mins, bs)), f32)
            a0 = fma1(msum, builder.fneg(builder.fmul(dmin, dx)), a0)
        return builder.insert_element(acc, a0, ir.Constant(i32, 0))

    def block_terms(self, builder, isum, mins, d, dmin, dx, bsrow, b_, acc):
        """acc + d * dx * isum (int32 [16]) - dmin * dx * mins * the row's bsums of block b: the float epilogue of a
        block with one scale (both widths)."""
        acc = fma(builder, builder.sitofp(isum, v16f), splat(builder, builder.fmul(d, dx)), acc)
        if mins is not None:  # - dmin * dx * m_s * bsum_s
            bs = load(builder, bsrow, builder.mul(b_, ir.Constant(i64, 16)), i32, 16)
            msum = builder.sitofp(builder.mul(mins, bs), v16f)
            acc = fma(builder, msum, splat(builder, builder.fneg(builder.fmul(dmin, dx))), acc)
        return acc

    def row_step(self, builder, block, d, dmin, xrow, xbits, o_, dx, bsrow, b_, acc):
        """acc float32 [16] + this block's terms for one activation row (xrow: its first element). d: the block's
        scale, or with group_scales the 8 groups' as float32 [8] (each group's sums then multiply-added on their own)."""
        if xbits == 8:
            return self.row_step8(builder, block, d, dmin, xrow, o_, dx, bsrow, b_, acc)
        unpacked, mins = block
        isum = None
        ddx = self.times_dx(builder, d, dx) if self.group_scales is not None else None  # float32 [8]: d_g * dx
        for g, (w16, sc) in enumerate(unpacked):
            x16 = load(builder, xrow, builder.add(o_, ir.Constant(i64, 32 * g)), i16, 32)
            if self.pmaddwd_512:  # the instruction itself: LLVM's pattern match goes through i32 lanes and back
                term = x86(builder, "llvm.x86.avx512.pmaddw.d.512", v16i, [w16, x16])
            else:  # two halves of 16 lanes (pairs 0-7, then 8-15: the same lanes as the 512-bit instruction's)
                half = lambda v, h: builder.shuffle_vector(v, v, vec(i32, 16, range(h, h + 16)))  # noqa: E731
                lo, hi = (self.madd16(builder, half(w16, h), half(x16, h)) for h in (0, 16))
                term = builder.shuffle_vector(lo, hi, vec(i32, 16, range(16)))
            if sc is not None:  # not prescaled: the pair sums times their scales (the same integers, exactly)
                term = builder.mul(term, sc)
            if ddx is not None:  # a float scale per group: a lane holds 2 products, |lane| <= 2 * 128 * 32767
                # < 2^24, so its float32 is exact; one multiply-add per group (d_g * dx rounded once, then the fma)
                scale = builder.shuffle_vector(ddx, ddx, vec(i32, 16, [g] * 16))
                acc = fma(builder, builder.sitofp(term, v16f), scale, acc)
                continue
            isum = term if isum is None else builder.add(isum, term)
        if ddx is not None:
            return acc
        return self.block_terms(builder, isum, mins, d, dmin, dx, bsrow, b_, acc)


class _RowDotCode(_GridCode, _GroupScaleCode, _BlockCode, _StepCode):
    """The code generator of one format's row dots: _make_row_dot's options as attributes, the three
    intrinsics' codegen (codegen_one, codegen_rows, codegen_decode) built from the parts above."""

    def __init__(self, groups, scale_fields, scale_bias: int, value_bias: int, size: int, d_off: int,
                 dmin_off: int, min_fields, signed_scales: bool, codebook, group_scales, signed_values: bool,
                 portable: bool, prescale_one: bool, exact_blocks: bool, d_mult: float, d_fields):
        self.groups, self.scale_fields, self.scale_bias, self.value_bias = groups, scale_fields, scale_bias, value_bias
        self.size, self.d_off, self.dmin_off, self.min_fields = size, d_off, dmin_off, min_fields
        self.signed_scales, self.codebook, self.group_scales = signed_scales, codebook, group_scales
        self.signed_values, self.portable, self.prescale_one = signed_values, portable, prescale_one
        self.exact_blocks, self.d_mult, self.d_fields = exact_blocks, d_mult, d_fields
        self.pmaddwd_512 = _PMADDWD_512 and not portable
        self.avx2 = _AVX2 and not portable
        self.pdep = _PDEP and not portable
        self.negative = (codebook is not None or signed_values or value_bias != 0  # a weight's integer can be
                         or any(isinstance(g, Grid) for g in groups))  # negative

    def x32(self, xbits: int) -> bool:
        """Whether x comes with a scale per 32 values (8 bits, a format of group scales: `act_group`'s 32; the
        formats with group_scales are exactly ACT32_TYPES)."""
        return xbits == 8 and self.group_scales is not None

    def codegen_one(self, context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args)]
        wa, xa, xda, bsa = arrays
        n_blocks = builder.udiv(cgutils.unpack_tuple(builder, wa.shape, 1)[0], ir.Constant(i64, self.size))
        xbits = signature.args[1].dtype.bitwidth
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
        with cgutils.for_range(builder, n_blocks) as loop:
            block, d, dmin, o_ = self.block_at(builder, wa.data, loop.index, self.prescale_one, xbits)  # one row
            if self.x32(xbits):  # the block's 8 scales of x, one a group
                dx = load(builder, xda.data, builder.mul(loop.index, ir.Constant(i64, 8)), f32, 8)
            else:
                dx = builder.load(builder.gep(xda.data, [loop.index]))
            builder.store(self.row_step(builder, block, d, dmin, xa.data, xbits, o_, dx, bsa.data, loop.index,
                                   builder.load(acc)), acc)
        return reduce(builder, builder.load(acc))

    def codegen_rows(self, context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args)]
        wa, xa, xda, bsa, acca, outa = arrays
        n_blocks = builder.udiv(cgutils.unpack_tuple(builder, wa.shape, 1)[0], ir.Constant(i64, self.size))
        n_rows = cgutils.unpack_tuple(builder, xa.shape, 2)[0]
        xbits = signature.args[1].dtype.bitwidth
        row_base = lambda a, nd: (builder.bitcast(a.data, i8.as_pointer()),  # noqa: E731
                                  cgutils.unpack_tuple(builder, a.strides, nd)[0])
        (xb, xs), (xdb, xds), (bsb, bss), (accb, accs), (outb, outs) = (
            row_base(a, nd) for a, nd in ((xa, 2), (xda, 2), (bsa, 2), (acca, 2), (outa, 1)))
        with cgutils.for_range(builder, n_rows) as t:
            builder.store(ir.Constant(v16f, [0.0] * 16), at(builder, accb, builder.mul(t.index, accs), v16f), align=4)
        with cgutils.for_range(builder, n_blocks) as loop:
            b_ = loop.index
            block, d, dmin, o_ = self.block_at(builder, wa.data, b_, True, xbits)  # unpacked (scaled) once, every row
            with cgutils.for_range(builder, n_rows) as t:
                xrow = at(builder, xb, builder.mul(t.index, xs), ir.IntType(xbits))
                n_dx = 8 if self.x32(xbits) else 1  # scales of x per block: 8 (per 32 values) or 1
                dx_ptr = at(builder, xdb, builder.add(builder.mul(t.index, xds),
                                                      builder.mul(b_, ir.Constant(i64, 4 * n_dx))), f32)
                dx = load(builder, dx_ptr, ir.Constant(i64, 0), f32, 8) if n_dx == 8 else builder.load(dx_ptr)
                bsrow = at(builder, bsb, builder.mul(t.index, bss), i32)
                acc_ptr = builder.bitcast(at(builder, accb, builder.mul(t.index, accs), f32), v16f.as_pointer())
                new = self.row_step(builder, block, d, dmin, xrow, xbits, o_, dx, bsrow, b_,
                               builder.load(acc_ptr, align=4))
                builder.store(new, acc_ptr, align=4)
        with cgutils.for_range(builder, n_rows) as t:
            acc_ptr = builder.bitcast(at(builder, accb, builder.mul(t.index, accs), f32), v16f.as_pointer())
            total = reduce(builder, builder.load(acc_ptr, align=4))
            builder.store(total, at(builder, outb, builder.mul(t.index, outs), f32))
        return context.get_dummy_value()

    def codegen_decode(self, context, builder, signature, args):
        wa, ta = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:2], args[:2]))
        r = context.cast(builder, args[2], signature.args[2], types.int64)  # the row within the row-group
        n_blocks = builder.udiv(cgutils.unpack_tuple(builder, wa.shape, 1)[0], ir.Constant(i64, self.size))
        tb = builder.bitcast(ta.data, i8.as_pointer())
        with cgutils.for_range(builder, n_blocks) as loop:
            b_ = loop.index
            (groups_, _), d, _, _ = self.block_at(builder, wa.data, b_, "bytes", 8, split=False)  # int8 [32], scales
            t_ = builder.mul(b_, ir.Constant(i64, DECODED_TILE))  # the block's first tile byte
            off = lambda k, per: builder.add(t_, builder.add(ir.Constant(i64, k), builder.mul(r, ir.Constant(i64, per))))  # noqa: E731
            builder.store(d, at(builder, tb, off(DECODED_D, 4), f32), align=1)
            for g, (v, sc, _) in enumerate(groups_):
                for half, lane in ((0, 0), (1, 8)):  # sub-block 2g + half: its scale in pair lanes 0-7, 8-15
                    s8 = builder.trunc(builder.extract_element(sc, ir.Constant(i32, lane)), i8)
                    builder.store(s8, at(builder, tb, off(DECODED_SCALES + 8 * (2 * g + half), 1), i8), align=1)
                words = builder.bitcast(v, ir.VectorType(i32, 8))  # chunk c: weights 32g + 4c .. + 3
                for c in range(8):
                    builder.store(builder.extract_element(words, ir.Constant(i32, c)),
                                  at(builder, tb, off(DECODED_QS + 32 * (8 * g + c), 4), i32), align=1)
        return context.get_dummy_value()

    def intrinsics(self, decoder: bool) -> tuple:
        """-> (row_dot, row_dot_rows[, row_decode]): the Numba intrinsics over this code (see _make_row_dot)."""
        codegen_one, codegen_rows, codegen_decode = self.codegen_one, self.codegen_rows, self.codegen_decode

        @intrinsic
        def row_dot(typingctx, w, xq, xd, xbs):
            if (_arr(w, types.uint8, 1) and _act_rows(xq, 1) and _arr(xd, types.float32, 1)
                    and _arr(xbs, types.int32, 1)):
                return types.float32(w, xq, xd, xbs), codegen_one

        @intrinsic
        def row_dot_rows(typingctx, w, xq, xd, xbs, acc, out):
            if (_arr(w, types.uint8, 1) and _act_rows(xq, 2) and _arr(xd, types.float32, 2)
                    and _arr(xbs, types.int32, 2) and _arr(acc, types.float32, 2)
                    and isinstance(out, types.Array) and out.dtype == types.float32 and out.ndim == 1):
                return types.none(w, xq, xd, xbs, acc, out), codegen_rows

        @intrinsic
        def row_decode(typingctx, w, tile, r):
            if _arr(w, types.uint8, 1) and _arr(tile, types.uint8, 1) and isinstance(r, types.Integer):
                return types.none(w, tile, r), codegen_decode

        return (row_dot, row_dot_rows, row_decode) if decoder else (row_dot, row_dot_rows)

        return (row_dot, row_dot_rows, row_decode) if decoder else (row_dot, row_dot_rows)




# Q4_K's and Q5_K's scales[12] at byte 4: a 6-bit scale and min per 32-weight sub-block j, packed as in get_scale_min:
# j < 4: scale = q[j] & 63, min = q[j + 4] & 63; j >= 4: scale = q[j + 4] & 15 | (q[j - 4] >> 6) << 4, min = q[j + 4]
# >> 4 | (q[j] >> 6) << 4, q = the scale bytes. Lane k of the scales and mins (16 weights) is sub-block k // 2.
_J = [k // 2 for k in range(16)]
_K4_SCALES = [([4 + j if j < 4 else 8 + j for j in _J], [0] * 16, [63 if j < 4 else 15 for j in _J], 0),
              ([4 + j - 4 if j >= 4 else 4 for j in _J], [6] * 16, [3 if j >= 4 else 0 for j in _J], 4)]
_K4_MINS = [([8 + j for j in _J], [0 if j < 4 else 4 for j in _J], [63 if j < 4 else 15 for j in _J], 0),
            ([4 + j for j in _J], [6] * 16, [3 if j >= 4 else 0 for j in _J], 4)]


def _k_row_dots(portable: bool = False) -> dict:
    """{QType: (row_dot, row_dot_rows)} of the K-quants (portable: without x86 intrinsics, for the tests)."""
    return {
        # Q2_K (84 bytes): scales[16] at byte 0 (scale = low nibble, min = high nibble), qs[64] at 16, d at 80, dmin
        # at 82. Group 4h + j = qs[32h + l] bits 2j (weight 128h + 32j + l); scale k = byte k & 15, min k = byte k >> 4.
        QType.Q2_K: _make_row_dot(
            groups=[(16 + 32 * h, 2 * j, 3, None) for h in range(2) for j in range(4)],
            scale_fields=[(list(range(16)), [0] * 16, 15, 0)], scale_bias=0, value_bias=0,
            size=Q2_K_SIZE, d_off=80, dmin_off=82, min_fields=[(list(range(16)), [4] * 16, 15, 0)], prescale_one=True,
            exact_blocks=True, portable=portable),
        # Q3_K (110 bytes): hmask[32] at 0, qs[64] at 32, scales[12] at 96, d at 108. Group 4h + j = qs[32h + l] bits
        # 2j | hmask[l] bit 4h + j << 2, minus 4. Scale k (6 bits, bias 32): low 4 bits = byte 96 + (k & 7) >> 4 (k >>
        # 3), high 2 bits = byte 104 + (k & 3) >> 2 (k >> 2).
        QType.Q3_K: _make_row_dot(
            groups=[(32 + 32 * h, 2 * j, 3, (0, 4 * h + j, 1, 2)) for h in range(2) for j in range(4)],
            scale_fields=[([96 + (k & 7) for k in range(16)], [4 * (k >> 3) for k in range(16)], 15, 0),
                          ([104 + (k & 3) for k in range(16)], [2 * (k >> 2) for k in range(16)], 3, 4)],
            scale_bias=32, value_bias=4, size=Q3_K_SIZE, d_off=108, dmin_off=-1, min_fields=None, prescale_one=True,
            exact_blocks=True, portable=portable),
        # Q4_K (144 bytes): d at 0, dmin at 2, scales[12] at 4 (above), qs[128] at 16: group g (sub-block g) = nibble
        # g % 2 of qs[32 (g // 2) + l]. |scale * q| <= 63 * 15.
        QType.Q4_K: _make_row_dot(
            groups=[(16 + 32 * (g // 2), 4 * (g % 2), 15, None) for g in range(8)], scale_fields=_K4_SCALES,
            min_fields=_K4_MINS, scale_bias=0, value_bias=0, size=Q4_K_SIZE, d_off=0, dmin_off=2, exact_blocks=True,
            portable=portable),
        # Q5_K (176 bytes): Q4_K's d, dmin and scales[12] at 0-15, qh[32] at 16, qs[128] at 48: group g (sub-block g)
        # = nibble g % 2 of qs[32 (g // 2) + l] | bit g of qh[l] << 4. |scale * q| <= 63 * 31.
        QType.Q5_K: _make_row_dot(
            groups=[(48 + 32 * (g // 2), 4 * (g % 2), 15, (16, g, 1, 4)) for g in range(8)], scale_fields=_K4_SCALES,
            min_fields=_K4_MINS, scale_bias=0, value_bias=0, size=Q5_K_SIZE, d_off=0, dmin_off=2, exact_blocks=True,
            portable=portable),
        # Q6_K (210 bytes): ql[128] at 0, qh[64] at 128, scales int8[16] at 192, d at 208. Group 4h + j (weights 128h
        # + 32j + l): low 4 bits = nibble j // 2 of ql[64h + 32 (j % 2) + l], high 2 bits = qh[32h + l] bits 2j; q =
        # that - 32. |scale * q| <= 128 * 32 = 4096, so a lane's 16 products stay below 16 * 4096 * 32767 < 2^31.
        QType.Q6_K: _make_row_dot(
            groups=[(64 * h + 32 * (j % 2), 4 * (j // 2), 15, (128 + 32 * h, 2 * j, 3, 4))
                    for h in range(2) for j in range(4)],
            scale_fields=[([192 + k for k in range(16)], [0] * 16, 255, 0)], signed_scales=True, scale_bias=0,
            value_bias=32, size=Q6_K_SIZE, d_off=208, dmin_off=-1, min_fields=None, exact_blocks=True,
            portable=portable),
    }


ROW_DOTS_K = _k_row_dots()


# ----------------------------------------------------------------------------------------------------------------
# 3b. The newer formats, in the same machinery: 256 weights are one IQ4_XS super-block, or 8 blocks of 32 (Q8_0,
#     Q4_0, IQ4_NL, MXFP4), or 4 blocks of 64 (Q2_0); "group g" is weights 32g..32g+31 of those 256.
#     Byte layouts: legacy.py, iquants.py, mxfp4.py, q2_0.py. Bounds: a codebook level or an int8 weight is at most
#     128 in magnitude; IQ4_XS's scale * level at most 32 * 127 = 4064 < 4096, Q6_K's bound above.
# ----------------------------------------------------------------------------------------------------------------
KVALUES_IQ4NL = tuple(int(v) for v in iquants.KVALUES_IQ4NL)  # [16] the codebooks, as the decoders define them
KVALUES_FP4 = tuple(int(v) for v in mxfp4.KVALUES_FP4)


def _nibbles(first_byte: int) -> Gather:
    """32 weights in 16 bytes: weight l < 16 the low nibble of byte l, weight l + 16 the high one (Q4_0's order)."""
    return Gather([first_byte + (l & 15) for l in range(32)], [4 * (l >> 4) for l in range(32)], 15)


def _row_dots_for(portable: bool = False) -> dict:
    """{QType: (row_dot, row_dot_rows)} of the newer formats (portable: without x86 intrinsics, for the tests)."""
    blocks32 = lambda size: [size * g for g in range(8)]  # noqa: E731 (per group: the first byte of its block)
    return {
        # IQ4_XS (136 bytes): d at 0, scales_h (uint16) at 2, scales_l[4] at 4, qs[128] at 8, 16 bytes a group.
        # Group j's 6-bit scale: low 4 bits = nibble j % 2 of byte 4 + j // 2, high 2 bits = byte 2 + j // 4 >> 2 (j % 4).
        QType.IQ4_XS: _make_row_dot(
            groups=[_nibbles(8 + 16 * g) for g in range(8)], codebook=KVALUES_IQ4NL,
            scale_fields=[([4 + j // 2 for j in _J], [4 * (j % 2) for j in _J], 15, 0),
                          ([2 + j // 4 for j in _J], [2 * (j % 4) for j in _J], 3, 4)],
            scale_bias=32, value_bias=0, size=136, d_off=0, dmin_off=-1, min_fields=None, portable=portable,
            prescale_one=True, exact_blocks=True),  # measured faster in the one-row form (Zen 3: 7.8 vs 6.8 G MACs/s)
        # IQ4_NL (18 bytes a block of 32): d at 0, qs[16] at 2, levels from the IQ4 codebook.
        QType.IQ4_NL: _make_row_dot(
            groups=[_nibbles(b + 2) for b in blocks32(18)], codebook=KVALUES_IQ4NL,
            group_scales=[(b, "f16") for b in blocks32(18)], scale_fields=None, scale_bias=0, value_bias=0,
            size=8 * 18, d_off=-1, dmin_off=-1, min_fields=None, portable=portable),
        # Q4_0 (18 bytes a block of 32): d at 0, qs[16] at 2, q - 8.
        QType.Q4_0: _make_row_dot(
            groups=[_nibbles(b + 2) for b in blocks32(18)],
            group_scales=[(b, "f16") for b in blocks32(18)], scale_fields=None, scale_bias=0, value_bias=8,
            size=8 * 18, d_off=-1, dmin_off=-1, min_fields=None, portable=portable),
        # MXFP4 (17 bytes a block of 32): e (E8M0) at 0, qs[16] at 1, levels 2 x E2M1, scale 2^(e - 128).
        QType.MXFP4: _make_row_dot(
            groups=[_nibbles(b + 1) for b in blocks32(17)], codebook=KVALUES_FP4,
            group_scales=[(b, "e8m0_half") for b in blocks32(17)], scale_fields=None, scale_bias=0,
            value_bias=0, size=8 * 17, d_off=-1, dmin_off=-1, min_fields=None, portable=portable,
            exact_blocks=True),
        # Q8_0 (34 bytes a block of 32): d at 0, qs int8[32] at 2.
        QType.Q8_0: _make_row_dot(
            groups=[b + 2 for b in blocks32(34)], signed_values=True,
            group_scales=[(b, "f16") for b in blocks32(34)], scale_fields=None, scale_bias=0, value_bias=0,
            size=8 * 34, d_off=-1, dmin_off=-1, min_fields=None, portable=portable, exact_blocks=True),
        # Q2_0 (18 bytes a block of 64): d at 0, qs[16] at 2; weight 32h + l of block b (group 2b + h) is bits
        # 2 (l % 4) of qs[8h + l // 4], code - 1.
        QType.Q2_0: _make_row_dot(
            groups=[Gather([18 * (g // 2) + 2 + 8 * (g % 2) + l // 4 for l in range(32)],
                           [2 * (l % 4) for l in range(32)], 3) for g in range(8)],
            group_scales=[(18 * (g // 2), "f16") for g in range(8)], scale_fields=None, scale_bias=0, value_bias=1,
            size=4 * 18, d_off=-1, dmin_off=-1, min_fields=None, portable=portable),
    }


# ----------------------------------------------------------------------------------------------------------------
# 3c. IQ1, IQ2 and IQ3: Grid groups. A row index (bit fields of the block) picks 8 (IQ1, IQ2) or 4 (IQ3) magnitudes
#     from the format's grid; IQ2/IQ3: each 8 weights' signs come from a +-1 table, and the 8-bit dot puts them onto
#     x (vpsignb) and multiplies the magnitudes as they are, as llama.cpp does (the 16-bit dot and the decoder put them
#     onto the magnitudes); IQ1: the grid's -1/0/+1 times 8, plus +-1 (the +-1/8 delta), whose signs the 8-bit path
#     moves onto x like every signed format's. Bounds: |integer| <= 62, 2s + 1 <= 31.
#     Prefill reads them decoded: the MoE kernel decodes 16 rows of an expert (row_decode, one row at a time) into
#     a scratch tile of 8-row groups and runs the tile dots of quant/repack.py (`repack.DECODED`) over all the
#     expert's tokens; the decoded layout, per 8 rows and 256 columns (DECODED_TILE bytes):
#       byte   0: d     float32 [8]                row r's block scale (d times d_mult, exact) at 4 r
#       byte  32: scale int8 [16 sub-blocks][8]   sub-block k's (16 weights) integer scale 2s + 1 at 32 + 8 k + r
#       byte 160: qs    int8 [8 groups g][8 chunks c][8 rows r][4 bytes]: row r's integers 32 g + 4 c .. + 3
#     A weight is d * scale * q, the integers those of the one-row dot (the same bits from either, exact_blocks).
# ----------------------------------------------------------------------------------------------------------------
DECODED_D, DECODED_SCALES, DECODED_QS = 0, 32, 160
DECODED_TILE = 160 + 8 * 256  # 2208 bytes


def _sign_rows(bytes_: np.ndarray) -> np.ndarray:
    """int [m] bytes of 8 sign bits -> int8 [m, 8]: entry j is -1 where bit j is set, else +1."""
    return np.where((bytes_[:, None] >> np.arange(8)) & 1, -1, 1).astype(np.int8)


SIGNS_KSIGNS = _sign_rows(iquants.KSIGNS)  # [128, 8] a 7-bit sign index (IQ2_XXS, IQ2_XS, IQ3_XXS) -> 8 signs
SIGNS_BITS = _sign_rows(np.arange(256))  # [256, 8] a byte of 8 explicit sign bits (IQ2_S, IQ3_S) -> 8 signs


def _field(off: int, nbytes: int = 1, shift: int = 0, mask: int = 255, pos: int = 0) -> tuple:
    return (off, nbytes, shift, mask, pos)


def _iq_scales(byte_of, shift_of):
    """scale_fields for a 4-bit scale s per sub-block (lane k = weights 16k..16k+15) entering as 2s + 1 (with
    scale_bias = -1): nibble (byte_of(k) >> shift_of(k)) & 15, placed at bit 1."""
    return [([byte_of(k) for k in range(16)], [shift_of(k) for k in range(16)], 15, 1)]


def _iq1m_scales():
    """IQ1_M's scale_fields: sub-block k (16 weights) has the 3 bits at 3 (k % 4) of the uint16 at 48 + 2 (k // 4),
    i.e. from bit b = 3 (k % 4) + 8 (k % 4 >= 3) of byte 48 + 2 (k // 4) + (k % 4 >= 3); the one at bit 6 straddles
    bytes: its bits 6-7 (first field) and bit 0 of the next byte (second field, mask 0 elsewhere). Placed at bit 1
    (2s, then scale_bias -1)."""
    first_byte, first_shift, first_mask, second_mask = [], [], [], []
    for k in range(16):
        bit = 3 * (k % 4)  # within the uint16
        first_byte.append(48 + 2 * (k // 4) + bit // 8)
        first_shift.append(bit % 8)
        first_mask.append(3 if bit == 6 else 7)
        second_mask.append(1 if bit == 6 else 0)
    second_byte = [48 + 2 * (k // 4) + 1 for k in range(16)]
    return [(first_byte, first_shift, first_mask, 1), (second_byte, [0] * 16, second_mask, 3)]


def _iq_grid_dots(portable: bool = False) -> dict:
    """{QType: (row_dot, row_dot_rows)} of IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M: Grid groups (byte
    layouts and the float order in iquants.py). Every scale is d * (2s + 1) * 2^-k: IQ2's d (0.5 + s) / 4 =
    d (2s + 1) / 8, IQ3_XXS's d (0.5 + s) / 2 = d (2s + 1) / 4, IQ3_S's d (1 + 2s), IQ1's d (2s + 1) (times 1/8 with
    the delta folded in); so 2s + 1 is the integer sub-block scale (<= 31, times a magnitude <= 62: within 16 bits)
    and d_mult the power of two. portable: without x86 intrinsics, for the tests."""
    grid = lambda flat, width: flat.reshape(-1, width).astype(np.int8)  # noqa: E731
    g8, g4 = range(8), range(4)
    common = dict(scale_bias=-1, value_bias=0, d_off=0, dmin_off=-1, min_fields=None, portable=portable,
                  exact_blocks=True, decoder=True)
    return {
        # IQ2_XXS (66 bytes): group g at 2 + 8g: 4 row indices, then a uint32: 4 x 7 sign bits, the scale in bits 28-31.
        QType.IQ2_XXS: _make_row_dot(
            groups=[Grid("iq2xxs", [[_field(2 + 8 * g + l)] for l in g4],
                         [[_field(6 + 8 * g, 4, 7 * l, 127)] for l in g4], grid(iquants.IQ2XXS_GRID, 8), SIGNS_KSIGNS)
                    for g in g8],
            scale_fields=_iq_scales(lambda k: 9 + 8 * (k // 2), lambda k: 4), size=66, d_mult=0.125, **common),
        # IQ2_XS (74 bytes): qs uint16 [32] at 2, one per 8 weights (9-bit row index, 7 sign bits), scales[8] at 66.
        QType.IQ2_XS: _make_row_dot(
            groups=[Grid("iq2xs", [[_field(2 + 2 * (4 * g + l), 2, 0, 511)] for l in g4],
                         [[_field(2 + 2 * (4 * g + l), 2, 9, 127)] for l in g4], grid(iquants.IQ2XS_GRID, 8),
                         SIGNS_KSIGNS) for g in g8],
            scale_fields=_iq_scales(lambda k: 66 + k // 2, lambda k: 4 * (k % 2)), size=74, d_mult=0.125, **common),
        # IQ2_S (82 bytes): qs[32] at 2 (index bits 0-7), signs[32] at 34, qh[8] at 66 (bits 8-9), scales[8] at 74.
        QType.IQ2_S: _make_row_dot(
            groups=[Grid("iq2s", [[_field(2 + 4 * g + l), _field(66 + g, 1, 2 * l, 3, 8)] for l in g4],
                         [[_field(34 + 4 * g + l)] for l in g4], grid(iquants.IQ2S_GRID, 8), SIGNS_BITS) for g in g8],
            scale_fields=_iq_scales(lambda k: 74 + k // 2, lambda k: 4 * (k % 2)), size=82, d_mult=0.125, **common),
        # IQ3_XXS (98 bytes): qs[64] at 2 (a row index per 4 weights), a uint32 per group at 66 (signs, scale).
        QType.IQ3_XXS: _make_row_dot(
            groups=[Grid("iq3xxs", [[_field(2 + 8 * g + m)] for m in g8],
                         [[_field(66 + 4 * g, 4, 7 * l, 127)] for l in g4], grid(iquants.IQ3XXS_GRID, 4),
                         SIGNS_KSIGNS) for g in g8],
            scale_fields=_iq_scales(lambda k: 69 + 4 * (k // 2), lambda k: 4), size=98, d_mult=0.25, **common),
        # IQ3_S (110 bytes): qs[64] at 2, qh[8] at 66 (bit m: index bit 8 of row m), signs[32] at 74, scales[4] at 106.
        QType.IQ3_S: _make_row_dot(
            groups=[Grid("iq3s", [[_field(2 + 8 * g + m), _field(66 + g, 1, m, 1, 8)] for m in g8],
                         [[_field(74 + 4 * g + l)] for l in g4], grid(iquants.IQ3S_GRID, 4), SIGNS_BITS) for g in g8],
            scale_fields=_iq_scales(lambda k: 106 + k // 4, lambda k: 4 * ((k // 2) % 2)), size=110, **common),
        # IQ1_S (50 bytes): qs[32] at 2 (index bits 0-7), qh uint16 [8] at 34, one per group: bits 3l..3l+2 index
        # bits 8-10 of run l, bits 12-14 the 3-bit scale s, bit 15 the sign of delta. w = d (2s + 1) (grid + delta),
        # delta = +-1/8: d / 8 (2s + 1) (8 grid +- 1), integers within -9..9.
        QType.IQ1_S: _make_row_dot(
            groups=[Grid("iq1s", [[_field(2 + 4 * g + l), _field(34 + 2 * g, 2, 3 * l, 7, 8)] for l in g4], None,
                         8 * grid(iquants.IQ1S_GRID, 8), None, delta=[[_field(35 + 2 * g, 1, 7, 1)]] * 4) for g in g8],
            scale_fields=[([35 + 2 * (k // 2) for k in range(16)], [4] * 16, 7, 1)], size=50, d_mult=0.125, **common),
        # IQ1_M (56 bytes): qs[32] at 0, qh[16] at 32 (a nibble per run: index bits 8-10, then delta's sign), scales
        # uint16 [4] at 48: sub-block k's 3-bit scale at bit 3 (k % 4) of uint16 k // 4 (k % 4 = 2 straddles bytes), d's
        # fp16 bits in the 4 top nibbles. w = d (2s + 1) (grid + delta) as IQ1_S, the delta per run of 8.
        QType.IQ1_M: _make_row_dot(
            groups=[Grid("iq1s", [[_field(4 * g + l), _field(32 + 2 * g + l // 2, 1, 4 * (l % 2), 7, 8)] for l in g4],
                         None, 8 * grid(iquants.IQ1S_GRID, 8), None,
                         delta=[[_field(32 + 2 * g + l // 2, 1, 4 * (l % 2) + 3, 1)] for l in g4]) for g in g8],
            scale_fields=_iq1m_scales(), size=56, d_mult=0.125,
            d_fields=[_field(48 + 2 * i, 2, 12, 15, 4 * i) for i in g4], **{**common, "d_off": -1}),
    }


ROW_DOTS_NEW = _row_dots_for()
ROW_DOTS_GRID = _iq_grid_dots()


# ----------------------------------------------------------------------------------------------------------------
# 3. One weight row (nb blocks, raw bytes) times quantized activations, per type. w uint8 [nb * type_size],
#    xq int16/int8 [nb * 256], xd float32 [nb], xbs int32 [nb * 16] -> float32.
#    Within a block, "weight k" is the k-th of its 256 weights and activation k sits at xq[256 b + k].
#    Numba calls an intrinsic only from a compiled function: one plain function per type and form, compiled from
#    the two templates below with the type's row dot bound as a global (jit.bind).
# ----------------------------------------------------------------------------------------------------------------
def _vec_dot_template(w, xq, xd, xbs):
    return ROW_DOT(w, xq, xd, xbs)  # noqa: F821 (bound by jit.bind)


def _vec_dot_rows_template(w, xq, xd, xbs, acc, out):
    ROW_DOT_ROWS(w, xq, xd, xbs, acc, out)  # noqa: F821 (bound by jit.bind)


ROW_DOTS = {**ROW_DOTS_K, **ROW_DOTS_NEW, **ROW_DOTS_GRID}
ROW_DECODES = {q: dots[2] for q, dots in ROW_DOTS_GRID.items()}  # QType -> row_decode (see DECODED_TILE)
# QType -> vec_dot(w, xq, xd, xbs) -> float32 (one row), and -> vec_dot_rows(w, xq, xd, xbs, acc, out) (out[t] for
# every row t of 2-D xq, xd, xbs; acc float32 [T, 16] scratch; bit for bit the one-row results)
ACT_DOTS = {q: bind(_vec_dot_template, f"vec_dot_{q.name}", dict(ROW_DOT=dots[0])) for q, dots in ROW_DOTS.items()}
ACT_DOTS_ROWS = {q: bind(_vec_dot_rows_template, f"vec_dot_rows_{q.name}", dict(ROW_DOT_ROWS=dots[1]))
                 for q, dots in ROW_DOTS.items()}


def has_int_dot(qtype, cols: int) -> bool:
    """Whether a [*, cols] weight of this type can take the integer path (a K type, rows of whole 256-blocks)."""
    return qtype in ACT_DOTS and cols % QK_K == 0  # an int finds its QType key (IntEnum), no enum call
