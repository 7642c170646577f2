"""Integer activations: x quantized per 256 values, and the integer dot products of every K-quant with it.

What this is: the fast path of a quantized mat-vec, the way llama.cpp computes it on a CPU. Instead of decoding the
weights to float and multiplying by float x, x is quantized once per call, and each weight block is dotted with it
in integer arithmetic; floats appear only once per block (the block's scales). Three pieces:
  1. `quantize_act` (Numba, per row) and its NumPy reference `quantize_act_ref`: x float32 [C] -> activations
        qs    int16 (or int8) [C]   q = round(x / d), in -QMAX..QMAX (32767, or 127 for int8)
        d     float32 [C / 256]     one scale per 256 values: the power of two just above max|x| / QMAX
        bsums int32   [C / 16]      the sum of each run of 16 q: what the "- dmin * m" term of a weight needs
     With int8 values this is llama.cpp's block_q8_K (three arrays here, not a packed struct; llama.cpp's d is
     max|x| / 127 itself, pymoe's a power of two: see quantize_act_ref). pymoe's default is
     int16: 8-bit x moves the logits of the tiny test models by up to ~0.2 (random weights, no outliers tamed),
     past the 0.05 the llama.cpp oracle test allows, while 16-bit x is within ~1e-3 of float math. The kernels
     take either: the width is the dtype of qs (`CPUBackend(act_bits=8)` selects int8).
  2. Integer primitives, the only code in pymoe that writes LLVM IR (Numba widens every integer scalar operation
     to 64 bits, and LLVM then vectorises a loop of small-integer products in 64-bit lanes, or not at all; the
     intrinsics state the narrow lanes explicitly and LLVM emits `vpmaddwd` / `vpdpbusd`):
       `dot_bits16/32(q, i, shift, mask, x, j)` = sum_l ((q[i+l] >> shift) & mask) * x[j+l], 16 or 32 lanes
       (and the *h forms with a second, high bit field), one sub-block at a time: Q4_K, Q5_K, Q6_K use these;
       `block_dot_q2_k/q3_k(w, s, x, o)`: a whole 256-weight block from a static layout table, in registers, one
       reduction; `block_dot_rows_*` the same for every row of a 2-D x, the block unpacked once (prefill).
     Each has a plain twin it is tested against (`dot_bits_ref`, `dot_bits_h_ref`; the block forms against the
     float reference through the vec_dots).
  3. `vec_dot_<type>(w, xq, xd, xbs)` for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: one raw weight row (nb blocks) times
     quantized activations -> float32; `vec_dot_rows_q2_k/q3_k` for many rows at once (bit-identical results).
     `ACT_DOTS` / `ACT_DOTS_ROWS` map a QType to them; other formats use the float path.
What this is not: the kernels that loop over rows and tokens (kernels.py), nor the reference of the result: the
reference of `vec_dot(w, act)` is `dequantize(w) @ dequantize_act(act)` (tests/test_kernels_qact.py).

Numerics. Each sub-block sum is an exact integer (a 32-lane sum of products < 2^6 * 2^15 * 32 < 2^31; the sums
over sub-blocks are int64, or, in block_dot, int32 with the bound stated there). Per block, the float result is
    d_w * d_x * sum_s sc_s * isum_s  -  dmin_w * d_x * sum_s m_s * bsum_s
so the integer path differs from the float path only by the rounding of x: |x_i - d q_i| <= d / 2 per value,
hence |y_int - y_float| <= sum_blocks (d_b / 2) * sum_{i in b} |w_i|, plus float32 rounding (what the tests check).

Weight layouts: the diagrams in kquants.py. Shape legend: T rows (tokens), C values, nb = C / 256 blocks.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import QType
from .floats import read_f16 as _read_f16_call
from .kquants import Q2_K_SIZE, Q3_K_SIZE, Q4_K_SIZE, Q5_K_SIZE, Q6_K_SIZE, QK_K, _int8_at, get_scale_min

read_f16 = njit(cache=True, inline="always")(_read_f16_call.py_func)  # the same code, inlined: no call per block

SUB = 16  # values per bsum: the smallest sub-block of any K-quant
ACT_DTYPES = {8: np.int8, 16: np.int16}  # activation width (bits) -> dtype of qs


# ----------------------------------------------------------------------------------------------------------------
# 1. Quantizing activations
# ----------------------------------------------------------------------------------------------------------------
def qmax_of(dtype) -> int:
    return int(np.iinfo(dtype).max)  # 127 or 32767: symmetric, -QMAX..QMAX


def quantize_act_ref(x: np.ndarray, bits: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [T, C] (C a multiple of 256) -> (qs int16/int8 [T, C], d float32 [T, C/256], bsums int32 [T, C/16]).

    Per block of 256: d = the smallest power of two >= max|x| / QMAX (d = 2^e, e = frexp's exponent, at least
    2^-100), q = rint(x / d) (round half to even; x / d is exact, a power-of-two scaling). A power-of-two d costs
    at most one bit against d = max|x| / QMAX, and buys stability: a change of max|x| in its last bits (the
    decode and the prefill forward compute attention in different orders) leaves d, hence every other q, alone;
    with d = max|x| / QMAX it moves the rounding of the whole block and, at 16 bits, the logits by ~1e-4.
    The Numba twin computes the same exponent (in float64) and agrees bit for bit.
    """
    dtype = ACT_DTYPES[bits]
    x = np.asarray(x, dtype=np.float32)
    T, C = x.shape
    blocks = x.reshape(T, C // QK_K, QK_K)  # [T, nb, 256]
    amax = np.abs(blocks).max(axis=-1, keepdims=True).astype(np.float64)  # [T, nb, 1]
    _, e = np.frexp(amax / qmax_of(dtype))  # ratio = m * 2^e, m in [0.5, 1): 2^e >= ratio
    e = np.maximum(e, -100)
    d = np.ldexp(1.0, e).astype(np.float32)  # [T, nb, 1]
    qs = np.rint(blocks * np.ldexp(1.0, -e).astype(np.float32)).astype(dtype)  # [T, nb, 256]
    bsums = qs.reshape(T, C // SUB, SUB).astype(np.int32).sum(axis=-1)  # [T, C/16]
    return qs.reshape(T, C), d.reshape(T, C // QK_K), bsums.astype(np.int32)


def dequantize_act(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The values the integer path really multiplies: qs [T, C], d [T, C/256] -> float32 [T, C] = d * q."""
    T, C = qs.shape
    return (qs.reshape(T, -1, QK_K).astype(np.float32) * d[:, :, None]).reshape(T, C)


@njit(cache=True)
def quantize_act(x, qs, d, bsums, qmax):
    """One row: x float32 [C] -> qs int16/int8 [C], d float32 [C/256], bsums int32 [C/16] (written); qmax =
    32767 or 127, the largest value of qs's dtype. Twin of `quantize_act_ref`."""
    for b in range(x.shape[0] // QK_K):
        xb = x[b * QK_K:(b + 1) * QK_K]  # [256]
        amax = np.float32(0.0)
        for i in range(QK_K):
            amax = max(amax, abs(xb[i]))
        e = max(math.frexp(np.float64(amax) / qmax)[1], -100)
        d[b] = np.float32(math.ldexp(1.0, e))
        iscale = np.float32(math.ldexp(1.0, -e))
        qb = qs[b * QK_K:(b + 1) * QK_K]  # [256]
        for i in range(QK_K):
            qb[i] = np.rint(xb[i] * iscale)
        for s in range(QK_K // SUB):
            acc = 0
            for i in range(SUB * s, SUB * s + SUB):
                acc += qb[i]
            bsums[b * (QK_K // SUB) + s] = acc


@njit(cache=True)
def quantize_act_rows(x, qs, d, bsums, qmax):
    """x float32 [T, C] -> qs [T, C], d [T, C/256], bsums [T, C/16] (written), row by row."""
    for t in range(x.shape[0]):
        quantize_act(x[t], qs[t], d[t], bsums[t], qmax)


def quantize_rows(x: np.ndarray, bits: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [T, C] -> fresh (qs, d, bsums) of T rows (the Numba quantizer)."""
    dtype = ACT_DTYPES[bits]
    T, C = x.shape
    qs = np.empty((T, C), dtype=dtype)  # [T, C]
    d = np.empty((T, C // QK_K), dtype=np.float32)  # [T, nb]
    bsums = np.empty((T, C // SUB), dtype=np.int32)  # [T, C/16]
    quantize_act_rows(np.ascontiguousarray(x, dtype=np.float32), qs, d, bsums, qmax_of(dtype))
    return qs, d, bsums


# ----------------------------------------------------------------------------------------------------------------
# 2. The integer primitive: sum_l v_l * x[j + l], l < 16 or 32, over a field of bits of the weight bytes
#        dot_bits  : v_l = (q[i + l] >> shift) & mask
#        dot_bits*h: v_l = ((q[i + l] >> shift) & mask) | ((qh[ih + l] >> hshift) & hmask) << hpos
#    the second form for the types that keep a quant's high bits apart (Q3_K, Q5_K, Q6_K): one pass, one
#    reduction per sub-block. q, qh: uint8 arrays (weight bytes); x: int8 or int16 array (activations), j: its
#    offset (or the int32 bsums: Q2_K's min term is a 16-lane dot of 4-bit mins with them). No bounds check: the
#    vec_dot functions below only ever pass offsets inside whole blocks.
# ----------------------------------------------------------------------------------------------------------------
def _dot_bits_codegen(lanes: int, two_sources: bool):
    """LLVM IR for dot_bits (args q, i, shift, mask, x, j) or, two_sources, for dot_bits*h (args q, i, shift, mask,
    qh, ih, hshift, hmask, hpos, x, j)."""

    def codegen(context, builder, signature, args):
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        v8, v32 = ir.VectorType(i8, lanes), ir.VectorType(i32, lanes)

        def load(k, offset, vty):  # `lanes` elements of array argument k from offset on, any alignment
            data = context.make_array(signature.args[k])(context, builder, args[k]).data
            return builder.load(builder.bitcast(builder.gep(data, [offset]), vty.as_pointer()), align=1)

        def splat(scalar):  # an int64 scalar -> <lanes x i8>, every lane the same
            v = builder.insert_element(ir.Constant(v8, ir.Undefined), builder.trunc(scalar, i8), ir.Constant(i32, 0))
            return builder.shuffle_vector(v, ir.Constant(v8, ir.Undefined), ir.Constant(v32, [0] * lanes))

        def field(k):  # (bytes of array arg k from offset arg k+1) >> arg k+2 & arg k+3
            return builder.and_(builder.lshr(load(k, args[k + 1], v8), splat(args[k + 2])), splat(args[k + 3]))

        bits = field(0)
        if two_sources:  # | high field << hpos
            bits = builder.or_(bits, builder.shl(field(4), splat(args[8])))
        w16 = builder.zext(bits, ir.VectorType(ir.IntType(16), lanes))  # the weights' integers, 16-bit lanes
        xk = len(args) - 2
        xv = load(xk, args[xk + 1], ir.VectorType(ir.IntType(signature.args[xk].dtype.bitwidth), lanes))
        # 16 x 16 -> 32-bit products, summed: LLVM emits vpmaddwd (pairs of products added) + a reduction
        prod = builder.mul(builder.sext(w16, v32), xv if xv.type == v32 else builder.sext(xv, v32))
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [v32]),
                                                f"llvm.vector.reduce.add.v{lanes}i32")
        return builder.sext(builder.call(reduce, [prod]), i64)

    return codegen


def _is_bytes(a) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.uint8


def _is_act(a) -> bool:  # activations int8/int16, or int32 (the bsums, for a block's min term)
    return isinstance(a, types.Array) and a.dtype in (types.int8, types.int16, types.int32)


def _make_dot_bits(lanes: int, two_sources: bool):
    if two_sources:
        @intrinsic
        def dot_bits(typingctx, q, i, shift, mask, qh, ih, hshift, hmask, hpos, x, j):
            if _is_bytes(q) and _is_bytes(qh) and _is_act(x):
                return (types.int64(q, i, shift, mask, qh, ih, hshift, hmask, hpos, x, j),
                        _dot_bits_codegen(lanes, True))
    else:
        @intrinsic
        def dot_bits(typingctx, q, i, shift, mask, x, j):
            if _is_bytes(q) and _is_act(x):
                return types.int64(q, i, shift, mask, x, j), _dot_bits_codegen(lanes, False)
    return dot_bits


dot_bits16 = _make_dot_bits(16, False)  # (q, i, shift, mask, x, j)
dot_bits32 = _make_dot_bits(32, False)
dot_bits16h = _make_dot_bits(16, True)  # (q, i, shift, mask, qh, ih, hshift, hmask, hpos, x, j)
dot_bits32h = _make_dot_bits(32, True)


# The whole-block form: one call per 256-weight block, everything in vector registers, one reduction at the end.
#     block_dot(w, s, x, o) = sum_k sc[k // 16] * v_k * x[o + k],  k = 0..255
# for a block starting at byte s of w. The layout is static, given when the intrinsic is made: 8 groups of 32
# weights (group g = weights 32g..32g+31), each a bit field (byte offset, shift, mask) and optionally a second,
# high field (offset, shift, mask, position), exactly as dot_bits*h read them; and the 16 sub-block scales as
# bit fields of the block's bytes picked per lane (byte index, shift, mask, position; minus a bias); a value bias
# is subtracted from every weight's integer (Q3_K: 4). Per group:
# 32 values multiplied by 32 activations in pairs (vpmaddwd: 16 int32 sums of two products), times the two
# sub-block scales (8 lanes each), added to one int32 accumulator. block_dot_rows may instead multiply the scales
# into the weights once per block (prescale_rows; |scale * v| <= 45 for Q2_K, 128 for Q3_K: still 16 bits).
# Which is faster is LLVM-codegen dependent; the flags are what measured fastest (AVX-512). No overflow:
# |scale * v| * 2 * 32767 * 8 groups < 2^31. (Q6_K, |scale * v| up to 4096, would overflow.)
_LANE = list(range(32))


def _make_block_dot(groups, scale_fields, scale_bias: int, value_bias: int, prescale_rows: bool):
    """-> (block_dot(w, s, x, o) -> int64, block_dot_rows(w, s, X, o, out) writing out[t] = block_dot(w, s, X[t], o)
    for every row t of the 2-D X: the block is unpacked once, then dotted with each row)."""
    i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)

    def vec(ty, n, values):
        return ir.Constant(ir.VectorType(ty, n), list(values))

    def load(builder, data, offset, ty, n):  # n elements of type ty at data + offset (in elements), any alignment
        ptr = builder.bitcast(builder.gep(data, [offset]), ir.VectorType(ty, n).as_pointer())
        return builder.load(ptr, align=1)

    def unpack(builder, wdata, s_, prescale):
        """The block's 8 groups as int32 [32] vectors of scale * q (each value within 16 bits)."""
        def field(off, shift, mask, n=32):  # (n bytes of the block from s + off) >> shift & mask
            v = load(builder, wdata, builder.add(s_, ir.Constant(i64, off)), i8, n)
            return builder.and_(builder.lshr(v, vec(i8, n, [shift] * n)), vec(i8, n, [mask] * n))

        # the 16 sub-block scales, int32 lanes: each piece gathers one byte per lane, shifts and masks it per lane
        lo = min(min(p[0]) for p in scale_fields)
        span = max(max(p[0]) for p in scale_fields) + 1 - lo  # the scale bytes, loaded once
        raw = load(builder, wdata, builder.add(s_, ir.Constant(i64, lo)), i8, span)
        scales = None
        for index, shifts, mask, pos in scale_fields:
            picked = builder.shuffle_vector(raw, ir.Constant(raw.type, ir.Undefined),
                                            vec(i32, 16, [k - lo for k in index]))
            part = builder.and_(builder.lshr(picked, vec(i8, 16, shifts)), vec(i8, 16, [mask] * 16))
            part = builder.shl(builder.zext(part, ir.VectorType(i32, 16)), vec(i32, 16, [pos] * 16))
            scales = part if scales is None else builder.or_(scales, part)
        if scale_bias:
            scales = builder.sub(scales, vec(i32, 16, [scale_bias] * 16))
        out = []
        for g, (off, shift, mask, high) in enumerate(groups):
            v = field(off, shift, mask)
            if high is not None:
                hoff, hshift, hmask, hpos = high
                v = builder.or_(v, builder.shl(field(hoff, hshift, hmask), vec(i8, 32, [hpos] * 32)))
            w32 = builder.zext(v, ir.VectorType(i32, 32))
            if value_bias:
                w32 = builder.sub(w32, vec(i32, 32, [value_bias] * 32))
            if prescale:  # scale * q once per block: |.| < 2^15 for Q2_K/Q3_K, so 16 bits hold it (said to LLVM:)
                sc = builder.shuffle_vector(scales, scales, vec(i32, 32, [2 * g] * 16 + [2 * g + 1] * 16))
                w32 = builder.mul(w32, sc)
                out.append((builder.sext(builder.trunc(w32, ir.VectorType(ir.IntType(16), 32)),
                                         ir.VectorType(i32, 32)), None))
            else:  # the scales multiply the pair sums (lanes 0..7 sub-block 2g, 8..15 sub-block 2g + 1)
                out.append((w32, builder.shuffle_vector(scales, scales, vec(i32, 16, [2 * g] * 8 + [2 * g + 1] * 8))))
        return out

    def dot_row(builder, unpacked, xdata, xbits, o_):
        """sum over the block of scale * weight * x[o + k], x from xdata (int8/int16 elements) -> int32."""
        acc = None
        for g, (w32, sc) in enumerate(unpacked):
            xv = load(builder, xdata, builder.add(o_, ir.Constant(i64, 32 * g)), ir.IntType(xbits), 32)
            prod = builder.mul(w32, builder.sext(xv, ir.VectorType(i32, 32)))  # [32]; pairs added (vpmaddwd)
            even = builder.shuffle_vector(prod, prod, vec(i32, 16, _LANE[0::2]))
            odd = builder.shuffle_vector(prod, prod, vec(i32, 16, _LANE[1::2]))
            term = builder.add(even, odd)
            if sc is not None:
                term = builder.mul(term, sc)
            acc = term if acc is None else builder.add(acc, term)
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [ir.VectorType(i32, 16)]),
                                                "llvm.vector.reduce.add.v16i32")
        return builder.call(reduce, [acc])

    def codegen_one(context, builder, signature, args):
        w_arr, s_, x_arr, o_ = args
        wdata = context.make_array(signature.args[0])(context, builder, w_arr).data
        xdata = context.make_array(signature.args[2])(context, builder, x_arr).data
        unpacked = unpack(builder, wdata, s_, False)
        return builder.sext(dot_row(builder, unpacked, xdata, signature.args[2].dtype.bitwidth, o_), i64)

    def codegen_rows(context, builder, signature, args):
        w_arr, s_, x_arr, o_, out_arr = args
        wdata = context.make_array(signature.args[0])(context, builder, w_arr).data
        xary = context.make_array(signature.args[2])(context, builder, x_arr)
        n_rows = cgutils.unpack_tuple(builder, xary.shape, 2)[0]
        row_bytes = cgutils.unpack_tuple(builder, xary.strides, 2)[0]
        xbase = builder.bitcast(xary.data, i8.as_pointer())
        xbits = signature.args[2].dtype.bitwidth
        out = context.make_array(signature.args[4])(context, builder, out_arr).data
        unpacked = unpack(builder, wdata, s_, prescale_rows)  # once, for every row
        with cgutils.for_range(builder, n_rows) as loop:
            row = builder.gep(xbase, [builder.mul(loop.index, row_bytes)])
            xdata = builder.bitcast(row, ir.IntType(xbits).as_pointer())
            isum = dot_row(builder, unpacked, xdata, xbits, o_)
            builder.store(builder.sext(isum, i64), builder.gep(out, [loop.index]))
        return context.get_dummy_value()

    @intrinsic
    def block_dot(typingctx, w, s, x, o):
        if _is_bytes(w) and _is_act(x) and x.dtype != types.int32 and x.ndim == 1:
            return types.int64(w, s, x, o), codegen_one

    @intrinsic
    def block_dot_rows(typingctx, w, s, x, o, out):
        if (_is_bytes(w) and _is_act(x) and x.dtype != types.int32 and x.ndim == 2 and x.layout == "C"
                and isinstance(out, types.Array) and out.dtype == types.int64):
            return types.none(w, s, x, o, out), codegen_rows

    return block_dot, block_dot_rows


# Q2_K: group 4h + j = qs[32h + l] bits 2j (qs at byte 16); scale k = byte k & 15.
block_dot_q2_k, block_dot_rows_q2_k = _make_block_dot(
    groups=[(16 + 32 * h, 2 * j, 3, None) for h in range(2) for j in range(4)],
    scale_fields=[(list(range(16)), [0] * 16, 15, 0)], scale_bias=0, value_bias=0, prescale_rows=False)
# Q3_K: group 4h + j = qs[32h + l] bits 2j (qs at byte 32) | hmask[l] bit 4h + j << 2, minus 4.
# Scale k (6 bits, bias 32): low 4 bits = byte 96 + (k & 7) >> 4 (k >> 3), high 2 bits = byte 104 + (k & 3)
# >> 2 (k >> 2).
block_dot_q3_k, block_dot_rows_q3_k = _make_block_dot(
    groups=[(32 + 32 * h, 2 * j, 3, (0, 4 * h + j, 1, 2)) for h in range(2) for j in range(4)],
    scale_fields=[([96 + (k & 7) for k in range(16)], [4 * (k >> 3) for k in range(16)], 15, 0),
                  ([104 + (k & 3) for k in range(16)], [2 * (k >> 2) for k in range(16)], 3, 4)],
    scale_bias=32, value_bias=4, prescale_rows=True)


@njit(cache=True)
def dot_bits_ref(q, i, shift, mask, x, j, lanes):
    """The plain twin of dot_bits16 / dot_bits32 (lanes = 16 / 32)."""
    acc = 0
    for l in range(lanes):
        acc += ((np.int64(q[i + l]) >> shift) & mask) * np.int64(x[j + l])
    return acc


@njit(cache=True)
def dot_bits_h_ref(q, i, shift, mask, qh, ih, hshift, hmask, hpos, x, j, lanes):
    """The plain twin of dot_bits16h / dot_bits32h: the value is (low field) | (high field) << hpos."""
    acc = 0
    for l in range(lanes):
        v = ((np.int64(q[i + l]) >> shift) & mask) | (((np.int64(qh[ih + l]) >> hshift) & hmask) << hpos)
        acc += v * np.int64(x[j + l])
    return acc


# ----------------------------------------------------------------------------------------------------------------
# 3. One weight row (nb blocks, raw bytes) times quantized activations, per K type. w uint8 [nb * type_size],
#    xq int16/int8 [nb * 256], xd float32 [nb], xbs int32 [nb * 16] -> float32.
#    Within a block, "weight k" is the k-th of its 256 weights and activation k sits at xq[256 b + k].
# ----------------------------------------------------------------------------------------------------------------
@njit(cache=True)
def vec_dot_q2_k(w, xq, xd, xbs):
    # qs[32h + l] bits 2j..2j+1 -> weight 128h + 32j + l, sub-block (128h + 32j + l) // 16 = 8h + 2j + l // 16.
    acc = np.float32(0.0)
    for b in range(w.shape[0] // Q2_K_SIZE):
        s, o = b * Q2_K_SIZE, b * QK_K
        isum = block_dot_q2_k(w, s, xq, o)  # sum_s sc_s * sum_{k in s} q_k x_k
        msum = dot_bits16(w, s, 4, 15, xbs, 16 * b)  # sum_s m_s * bsum_s: the mins are the high nibbles
        dx = xd[b]
        acc += (read_f16(w, s + 80) * dx) * np.float32(isum) - (read_f16(w, s + 82) * dx) * np.float32(msum)
    return acc


@njit(cache=True)
def vec_dot_q3_k(w, xq, xd, xbs):
    # Weight 128h + 32j + l: low 2 bits in qs[32h + l] bits 2j..2j+1, high bit in hmask[l] bit 4h + j;
    # q = low - 4 * (1 - high) = (low | high << 2) - 4: block_dot_q3_k's layout.
    acc = np.float32(0.0)
    for b in range(w.shape[0] // Q3_K_SIZE):
        s, o = b * Q3_K_SIZE, b * QK_K
        isum = block_dot_q3_k(w, s, xq, o)
        acc += (read_f16(w, s + 108) * xd[b]) * np.float32(isum)
    return acc


@njit(cache=True)
def _vec_dot_scale_min_k(w, xq, xd, xbs, size, qs_off, qh_off):
    # Q4_K and Q5_K: d dmin scales[12] at byte 4 (6-bit scale/min per 32-weight sub-block), 4-bit quants at qs_off:
    # qs[32c + l]: low nibble -> weight 64c + l (sub-block 2c), high nibble -> 64c + 32 + l (sub-block 2c + 1).
    # Q5_K (qh_off >= 0) adds bit 4 of weight 64c + 32 half + l from qh[l] bit 2c + half. The callers pass
    # constants, so after inlining each format gets straight-line code for its own branch.
    acc = np.float32(0.0)
    for b in range(w.shape[0] // size):
        s, o = b * size, b * QK_K
        isum = 0
        msum = 0
        for c in range(4):
            for half in range(2):
                sub = 2 * c + half
                sc, m = get_scale_min(w, s + 4, sub)
                if qh_off < 0:
                    isum += sc * dot_bits32(w, s + qs_off + 32 * c, 4 * half, 15, xq, o + 32 * sub)
                else:
                    isum += sc * dot_bits32h(w, s + qs_off + 32 * c, 4 * half, 15, w, s + qh_off, sub, 1, 4, xq,
                                             o + 32 * sub)
                msum += m * (xbs[16 * b + 2 * sub] + xbs[16 * b + 2 * sub + 1])
        dx = xd[b]
        acc += (read_f16(w, s) * dx) * np.float32(isum) - (read_f16(w, s + 2) * dx) * np.float32(msum)
    return acc


@njit(cache=True)
def vec_dot_q4_k(w, xq, xd, xbs):
    return _vec_dot_scale_min_k(w, xq, xd, xbs, Q4_K_SIZE, 16, -1)


@njit(cache=True)
def vec_dot_q5_k(w, xq, xd, xbs):
    return _vec_dot_scale_min_k(w, xq, xd, xbs, Q5_K_SIZE, 48, 16)


@njit(cache=True)
def vec_dot_q6_k(w, xq, xd, xbs):
    # Weight 128h + 32j + l (l < 32): low 4 bits = nibble j // 2 of ql[64h + 32 (j % 2) + l], high 2 bits =
    # qh[32h + l] bits 2j..2j+1; q = (low | high << 4) - 32, so sum q x = sum (low | high << 4) x - 32 bsum.
    acc = np.float32(0.0)
    for b in range(w.shape[0] // Q6_K_SIZE):
        s, o = b * Q6_K_SIZE, b * QK_K
        isum = 0
        for h in range(2):
            for j in range(4):
                for g in range(2):
                    sub = 8 * h + 2 * j + g
                    ox = o + 128 * h + 32 * j + 16 * g
                    v = dot_bits16h(w, s + 64 * h + 32 * (j & 1) + 16 * g, 4 * (j >> 1), 15,
                                    w, s + 128 + 32 * h + 16 * g, 2 * j, 3, 4, xq, ox)
                    isum += _int8_at(w, s + 192 + sub) * (v - 32 * xbs[16 * b + sub])
        acc += (read_f16(w, s + 208) * xd[b]) * np.float32(isum)
    return acc


def _make_vec_dot_rows(block_dot_rows, size: int, d_off: int, dmin_off: int):
    """out[t] = vec_dot(w, xq[t], xd[t], xbs[t]) for every row t (xq [T, C]) of a type with a block_dot_rows:
    each block's bits are unpacked once for all T rows (prefill; the experts' tokens). Same float operations, in
    the same order, as the one-row vec_dot: the results are identical. isum: int64 [T] scratch."""
    @njit(cache=True)
    def vec_dot_rows(w, xq, xd, xbs, isum, out):
        out[:] = 0.0
        for b in range(w.shape[0] // size):
            s, o = b * size, b * QK_K
            block_dot_rows(w, s, xq, o, isum)
            d = read_f16(w, s + d_off)
            for t in range(xq.shape[0]):
                dx = xd[t, b]
                if dmin_off >= 0:
                    msum = dot_bits16(w, s, 4, 15, xbs[t], 16 * b)  # Q2_K's min term, as in vec_dot_q2_k
                    out[t] += (d * dx) * np.float32(isum[t]) - (read_f16(w, s + dmin_off) * dx) * np.float32(msum)
                else:
                    out[t] += (d * dx) * np.float32(isum[t])

    return vec_dot_rows


vec_dot_rows_q2_k = _make_vec_dot_rows(block_dot_rows_q2_k, Q2_K_SIZE, 80, 82)
vec_dot_rows_q3_k = _make_vec_dot_rows(block_dot_rows_q3_k, Q3_K_SIZE, 108, -1)

ACT_DOTS = {
    QType.Q2_K: vec_dot_q2_k,
    QType.Q3_K: vec_dot_q3_k,
    QType.Q4_K: vec_dot_q4_k,
    QType.Q5_K: vec_dot_q5_k,
    QType.Q6_K: vec_dot_q6_k,
}


ACT_DOTS_ROWS = {QType.Q2_K: vec_dot_rows_q2_k, QType.Q3_K: vec_dot_rows_q3_k}  # the others: a loop of vec_dot


def has_int_dot(qtype, cols: int) -> bool:
    """Whether a [*, cols] weight of this type can take the integer path (a K type, rows of whole 256-blocks)."""
    return QType(qtype) in ACT_DOTS and cols % QK_K == 0
