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
       `dot_bits32h(q, i, shift, mask, qh, ih, hshift, hmask, hpos, x, j)` = sum_l v_l * x[j+l] over 32 lanes,
       v_l a low bit field of q[i+l] with a high one of qh[ih+l], one sub-block at a time: Q5_K uses it;
       `row_dot_q2_k/q3_k/q4_k/q6_k(w, xq, xd, xbs)`: a whole weight row from a static block layout table, in
       vector registers, float32 [16] lane accumulators and one reduction per row; `row_dot_rows_*` the same for
       every row of a 2-D x, each block unpacked once (prefill), bit for bit.
     Each has a plain twin it is tested against (`dot_bits_h_ref`; the row forms against the float reference
     through the vec_dots).
  3. `vec_dot_<type>(w, xq, xd, xbs)` for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: one raw weight row (nb blocks) times
     quantized activations -> float32; `vec_dot_rows_<type>` (all but Q5_K) for many rows at once (bit-identical
     results).
     `ACT_DOTS` / `ACT_DOTS_ROWS` map a QType to them; other formats use the float path.
What this is not: the kernels that loop over rows and tokens (kernels.py), nor the reference of the result: the
reference of `vec_dot(w, act)` is `dequantize(w) @ dequantize_act(act)` (tests/test_kernels_qact.py).

Numerics. Each sub-block sum is an exact integer (a 32-lane sum of products < 2^6 * 2^15 * 32 < 2^31; the sums
over sub-blocks are int64, or, in row_dot, int32 lanes with the bound stated there). Per block, the float result is
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
from .kquants import Q2_K_SIZE, Q3_K_SIZE, Q4_K_SIZE, Q5_K_SIZE, Q6_K_SIZE, QK_K, get_scale_min

read_f16 = njit(cache=True, inline="always")(_read_f16_call.py_func)  # the same code, inlined: no call per block

SUB = 16  # values per bsum: the smallest sub-block of any K-quant
ACT_DTYPES = {8: np.int8, 16: np.int16}  # activation width (bits) -> dtype of qs


# ----------------------------------------------------------------------------------------------------------------
# 1. Quantizing activations
# ----------------------------------------------------------------------------------------------------------------
def qmax_of(dtype) -> int:
    return _QMAX.get(dtype) or int(np.iinfo(dtype).max)  # 127 or 32767: symmetric, -QMAX..QMAX


_QMAX = {np.dtype(np.int8): 127, np.dtype(np.int16): 32767}  # np.iinfo costs ~1 us a call: per token, per matrix


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
    dtype = np.dtype(ACT_DTYPES[bits])
    T, C = x.shape
    qs = np.empty((T, C), dtype=dtype)  # [T, C]
    d = np.empty((T, C // QK_K), dtype=np.float32)  # [T, nb]
    bsums = np.empty((T, C // SUB), dtype=np.int32)  # [T, C/16]
    quantize_act_rows(np.ascontiguousarray(x, dtype=np.float32), qs, d, bsums, qmax_of(dtype))
    return qs, d, bsums


# ----------------------------------------------------------------------------------------------------------------
# 2. The integer primitive: sum_l v_l * x[j + l], l < 32, over two fields of bits of the weight bytes
#        v_l = ((q[i + l] >> shift) & mask) | ((qh[ih + l] >> hshift) & hmask) << hpos
#    for Q5_K, which keeps a quant's fifth bit apart: one pass, one reduction per sub-block (the other K types use
#    the whole-row form below). q, qh: uint8 arrays (weight bytes); x: int8 or int16 array (activations), j: its
#    offset. No bounds check: vec_dot_q5_k only passes offsets inside whole blocks.
# ----------------------------------------------------------------------------------------------------------------
def _dot_bits_codegen(lanes: int):
    """LLVM IR for dot_bits*h (args q, i, shift, mask, qh, ih, hshift, hmask, hpos, x, j)."""

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

        bits = builder.or_(field(0), builder.shl(field(4), splat(args[8])))  # low field | high field << hpos
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


def _is_act(a) -> bool:  # activations int8/int16
    return isinstance(a, types.Array) and a.dtype in (types.int8, types.int16)


@intrinsic
def dot_bits32h(typingctx, q, i, shift, mask, qh, ih, hshift, hmask, hpos, x, j):
    if _is_bytes(q) and _is_bytes(qh) and _is_act(x):
        return types.int64(q, i, shift, mask, qh, ih, hshift, hmask, hpos, x, j), _dot_bits_codegen(32)


# The whole-row form (Q2_K, Q3_K): one call per weight row, all its blocks, everything in vector registers.
#     row_dot(w, xq, xd, xbs) = sum_b (d_b dx_b) sum_k sc[k // 16] v_k xq[256 b + k]  (- dmin_b dx_b sum_s m_s bsum_s)
# The layout is static, given when the intrinsic is made: 8 groups of 32 weights per 256-block (group g = weights
# 32g..32g+31), each a bit field (byte offset, shift, mask) and optionally a second, high field (offset, shift,
# mask, position), exactly as dot_bits*h read them; the 16 sub-block scales as bit fields of the block's bytes
# picked per lane (byte index, shift, mask, position; minus a bias); a value bias subtracted from every weight's
# integer (Q3_K: 4, Q6_K: 32); optionally the 16 mins (Q2_K: the high nibbles of the scale bytes; Q4_K: 6-bit
# fields) and the block's two fp16 factors d, dmin. Per block:
#   - unpack: each group's 32 integers times their sub-block's scale, in 16-bit lanes (|scale * v| <= 45 for Q2_K,
#     128 for Q3_K, 945 for Q4_K, 4096 for Q6_K), once per block, whatever the number of activation rows (the
#     one-row form, whose blocks are used once, instead multiplies each group's 16 pair sums by their scales:
#     fewer operations per block, the same integers lane by lane, hence the same bits);
#   - per activation row: 8 multiply-adds of pairs (vpmaddwd, or vpdpwssd with VNNI) into one int32 [16] vector:
#     |lane| <= 16 products * 4096 * 32767 < 2^31, so the integer sums are exact; the mins against the row's bsums
#     (int32 [16], |m * bsum| <= 63 * 16 * 32767); both converted to float32 [16] and multiply-added (llvm.fma: one
#     rounding) with the scalars d * dx and -dmin * dx into a float32 [16] accumulator of the row, lane by lane;
#   - at the end of the row: one reduction of the accumulator, in a fixed tree (lanes i and i + 8, then i + 4, ...).
# No horizontal sum per block (the old per-block form spent most of its time there), and every float operation is
# plain IEEE (no fast-math flags), in an order that does not depend on the number of rows: row t of row_dot_rows
# has exactly the bits of row_dot on row t alone. The fp16 factors are converted by LLVM's fpext (vcvtph2ps): exact.
_LANE = list(range(32))


def _host_has_avx512bw() -> bool:
    """Whether Numba compiles for this machine's CPU and it has AVX-512BW: then row_dot calls vpmaddwd by its x86
    intrinsic (the portable pattern above is what other CPUs get; the integers are the same)."""
    import numba
    from llvmlite import binding

    return numba.config.CPU_NAME in (None, "host") and bool(binding.get_host_cpu_features().get("avx512bw"))


_PMADDWD_512 = _host_has_avx512bw()


def _make_row_dot(groups, scale_fields, scale_bias: int, value_bias: int, size: int, d_off: int, dmin_off: int,
                  min_fields, signed_scales: bool = False):
    """-> (row_dot(w, xq, xd, xbs) -> float32 for one activation row (1-D xq [C], xd [C/256], xbs [C/16]),
    row_dot_rows(w, xq, xd, xbs, acc, out) writing out[t] = row_dot(w, xq[t], xd[t], xbs[t]) for every row t of
    2-D, C-contiguous xq, xd, xbs; acc: float32 [T, 16] scratch). w: one weight row, uint8 [nb * size]."""
    i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    v16i, v16f = ir.VectorType(i32, 16), ir.VectorType(f32, 16)

    def vec(ty, n, values):
        return ir.Constant(ir.VectorType(ty, n), list(values))

    def load(builder, data, offset, ty, n):  # n elements of type ty at data + offset (in elements), any alignment
        ptr = builder.bitcast(builder.gep(data, [offset]), ir.VectorType(ty, n).as_pointer())
        return builder.load(ptr, align=1)

    def at(builder, base, byte_offset, ty):  # a pointer to ty at i8* base + byte_offset
        return builder.bitcast(builder.gep(base, [byte_offset]), ty.as_pointer())

    def splat(builder, scalar):  # float -> <16 x float>
        v = builder.insert_element(ir.Constant(v16f, ir.Undefined), scalar, ir.Constant(i32, 0))
        return builder.shuffle_vector(v, ir.Constant(v16f, ir.Undefined), ir.Constant(v16i, [0] * 16))

    def fp16(builder, wdata, s_, off):  # the fp16 field at byte s + off, as float32 (exact)
        h = builder.load(at(builder, wdata, builder.add(s_, ir.Constant(i64, off)), i16), align=1)
        return builder.fpext(builder.bitcast(h, ir.HalfType()), f32)

    def unpack(builder, wdata, s_, prescale):
        """The block at byte s: its 8 groups as (int16 [32] vector of scale * q, None) if prescale, else as (q,
        int32 [16] scales: lane j of a pair sum gets its sub-block's scale), and its mins int32 [16] (or None)."""
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

        scales = lanes16(scale_fields, signed_scales)  # [16] the sub-block scales (one per 16 weights)
        if scale_bias:
            scales = builder.sub(scales, vec(i16, 16, [scale_bias] * 16))
        out = []
        for g, (off, shift, mask, high) in enumerate(groups):
            v = field(off, shift, mask)
            if high is not None:
                hoff, hshift, hmask, hpos = high
                v = builder.or_(v, builder.shl(field(hoff, hshift, hmask), vec(i8, 32, [hpos] * 32)))
            w16 = builder.zext(v, ir.VectorType(i16, 32))
            if value_bias:
                w16 = builder.sub(w16, vec(i16, 32, [value_bias] * 32))
            if prescale:
                sc = builder.shuffle_vector(scales, scales, vec(i32, 32, [2 * g] * 16 + [2 * g + 1] * 16))
                out.append((builder.mul(w16, sc), None))  # [32] scale * q, within 16 bits (bounds above)
            else:
                sc = builder.shuffle_vector(scales, scales, vec(i32, 16, [2 * g] * 8 + [2 * g + 1] * 8))
                out.append((w16, builder.sext(sc, v16i)))
        mins = None if min_fields is None else builder.zext(lanes16(min_fields), v16i)  # [16] (one per 16 weights)
        return out, mins

    def row_step(builder, block, d, dmin, xrow, xbits, o_, dx, bsrow, b_, acc):
        """acc float32 [16] + this block's terms for one activation row (xrow: its first element)."""
        unpacked, mins = block
        isum = None
        for g, (w16, sc) in enumerate(unpacked):
            xv = load(builder, xrow, builder.add(o_, ir.Constant(i64, 32 * g)), ir.IntType(xbits), 32)
            if _PMADDWD_512:  # the instruction itself: LLVM's pattern match goes through i32 lanes and back
                x16 = xv if xbits == 16 else builder.sext(xv, ir.VectorType(i16, 32))
                pmaddwd = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(v16i, [ir.VectorType(i16, 32)] * 2), "llvm.x86.avx512.pmaddw.d.512")
                term = builder.call(pmaddwd, [w16, x16])
            else:
                prod = builder.mul(builder.sext(w16, ir.VectorType(i32, 32)),
                                   builder.sext(xv, ir.VectorType(i32, 32)))
                even = builder.shuffle_vector(prod, prod, vec(i32, 16, _LANE[0::2]))
                odd = builder.shuffle_vector(prod, prod, vec(i32, 16, _LANE[1::2]))
                term = builder.add(even, odd)  # pairs of products added: LLVM emits vpmaddwd
            if sc is not None:  # not prescaled: the pair sums times their scales (the same integers, exactly)
                term = builder.mul(term, sc)
            isum = term if isum is None else builder.add(isum, term)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fma.v16f32")
        acc = builder.call(fma, [builder.sitofp(isum, v16f), splat(builder, builder.fmul(d, dx)), acc])
        if mins is not None:  # - dmin * dx * m_s * bsum_s
            bs = load(builder, bsrow, builder.mul(b_, ir.Constant(i64, 16)), i32, 16)
            msum = builder.sitofp(builder.mul(mins, bs), v16f)
            acc = builder.call(fma, [msum, splat(builder, builder.fneg(builder.fmul(dmin, dx))), acc])
        return acc

    def reduce(builder, v):  # float32 [16] -> float32, lanes i + n/2 added to lanes i, n = 16, 8, 4, 2
        n = 16
        while n > 1:
            n //= 2
            v = builder.fadd(builder.shuffle_vector(v, v, vec(i32, n, range(n))),
                             builder.shuffle_vector(v, v, vec(i32, n, range(n, 2 * n))))
        return builder.extract_element(v, ir.Constant(i32, 0))

    def block_at(builder, wdata, b_, prescale):
        s_ = builder.mul(b_, ir.Constant(i64, size))
        d = fp16(builder, wdata, s_, d_off)
        dmin = fp16(builder, wdata, s_, dmin_off) if dmin_off >= 0 else None
        return unpack(builder, wdata, s_, prescale), d, dmin, builder.mul(b_, ir.Constant(i64, QK_K))

    def codegen_one(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args)]
        wa, xa, xda, bsa = arrays
        n_blocks = builder.udiv(cgutils.unpack_tuple(builder, wa.shape, 1)[0], ir.Constant(i64, size))
        xbits = signature.args[1].dtype.bitwidth
        acc = cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
        with cgutils.for_range(builder, n_blocks) as loop:
            block, d, dmin, o_ = block_at(builder, wa.data, loop.index, False)  # one row: scales after the sums
            dx = builder.load(builder.gep(xda.data, [loop.index]))
            builder.store(row_step(builder, block, d, dmin, xa.data, xbits, o_, dx, bsa.data, loop.index,
                                   builder.load(acc)), acc)
        return reduce(builder, builder.load(acc))

    def codegen_rows(context, builder, signature, args):
        arrays = [context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args)]
        wa, xa, xda, bsa, acca, outa = arrays
        n_blocks = builder.udiv(cgutils.unpack_tuple(builder, wa.shape, 1)[0], ir.Constant(i64, size))
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
            block, d, dmin, o_ = block_at(builder, wa.data, b_, True)  # unpacked and scaled once, for every row
            with cgutils.for_range(builder, n_rows) as t:
                xrow = at(builder, xb, builder.mul(t.index, xs), ir.IntType(xbits))
                dx_ptr = at(builder, xdb, builder.add(builder.mul(t.index, xds), builder.mul(b_, ir.Constant(i64, 4))),
                            f32)
                bsrow = at(builder, bsb, builder.mul(t.index, bss), i32)
                acc_ptr = builder.bitcast(at(builder, accb, builder.mul(t.index, accs), f32), v16f.as_pointer())
                new = row_step(builder, block, d, dmin, xrow, xbits, o_, builder.load(dx_ptr), bsrow, b_,
                               builder.load(acc_ptr, align=4))
                builder.store(new, acc_ptr, align=4)
        with cgutils.for_range(builder, n_rows) as t:
            acc_ptr = builder.bitcast(at(builder, accb, builder.mul(t.index, accs), f32), v16f.as_pointer())
            total = reduce(builder, builder.load(acc_ptr, align=4))
            builder.store(total, at(builder, outb, builder.mul(t.index, outs), f32))
        return context.get_dummy_value()

    def _act_rows(x, nd):
        return _is_act(x) and x.dtype != types.int32 and x.ndim == nd and x.layout == "C"

    def _arr(a, dtype, nd):
        return isinstance(a, types.Array) and a.dtype == dtype and a.ndim == nd and a.layout == "C"

    @intrinsic
    def row_dot(typingctx, w, xq, xd, xbs):
        if _arr(w, types.uint8, 1) and _act_rows(xq, 1) and _arr(xd, types.float32, 1) and _arr(xbs, types.int32, 1):
            return types.float32(w, xq, xd, xbs), codegen_one

    @intrinsic
    def row_dot_rows(typingctx, w, xq, xd, xbs, acc, out):
        if (_arr(w, types.uint8, 1) and _act_rows(xq, 2) and _arr(xd, types.float32, 2)
                and _arr(xbs, types.int32, 2) and _arr(acc, types.float32, 2)
                and isinstance(out, types.Array) and out.dtype == types.float32 and out.ndim == 1):
            return types.none(w, xq, xd, xbs, acc, out), codegen_rows

    return row_dot, row_dot_rows


# Q2_K (84 bytes): scales[16] at byte 0 (scale = low nibble, min = high nibble), qs[64] at 16, d at 80, dmin at 82.
# Group 4h + j = qs[32h + l] bits 2j (weight 128h + 32j + l); scale k = byte k & 15, min k = byte k >> 4.
row_dot_q2_k, row_dot_rows_q2_k = _make_row_dot(
    groups=[(16 + 32 * h, 2 * j, 3, None) for h in range(2) for j in range(4)],
    scale_fields=[(list(range(16)), [0] * 16, 15, 0)], scale_bias=0, value_bias=0,
    size=Q2_K_SIZE, d_off=80, dmin_off=82, min_fields=[(list(range(16)), [4] * 16, 15, 0)])
# Q3_K (110 bytes): hmask[32] at 0, qs[64] at 32, scales[12] at 96, d at 108. Group 4h + j = qs[32h + l] bits 2j
# | hmask[l] bit 4h + j << 2, minus 4. Scale k (6 bits, bias 32): low 4 bits = byte 96 + (k & 7) >> 4 (k >> 3),
# high 2 bits = byte 104 + (k & 3) >> 2 (k >> 2).
row_dot_q3_k, row_dot_rows_q3_k = _make_row_dot(
    groups=[(32 + 32 * h, 2 * j, 3, (0, 4 * h + j, 1, 2)) for h in range(2) for j in range(4)],
    scale_fields=[([96 + (k & 7) for k in range(16)], [4 * (k >> 3) for k in range(16)], 15, 0),
                  ([104 + (k & 3) for k in range(16)], [2 * (k >> 2) for k in range(16)], 3, 4)],
    scale_bias=32, value_bias=4, size=Q3_K_SIZE, d_off=108, dmin_off=-1, min_fields=None)
# Q4_K (144 bytes): d at 0, dmin at 2, scales[12] at 4 (a 6-bit scale and min per 32-weight sub-block j, packed as in
# get_scale_min: j < 4: scale = q[j] & 63, min = q[j + 4] & 63; j >= 4: scale = q[j + 4] & 15 | (q[j - 4] >> 6) << 4,
# min = q[j + 4] >> 4 | (q[j] >> 6) << 4, q = the scale bytes), qs[128] at 16: group g (sub-block g) = nibble g % 2 of
# qs[32 (g // 2) + l]. Lane k of the scales and mins (16 weights) is sub-block k // 2; |scale * q| <= 63 * 15.
_J = [k // 2 for k in range(16)]
row_dot_q4_k, row_dot_rows_q4_k = _make_row_dot(
    groups=[(16 + 32 * (g // 2), 4 * (g % 2), 15, None) for g in range(8)],
    scale_fields=[([4 + j if j < 4 else 8 + j for j in _J], [0] * 16, [63 if j < 4 else 15 for j in _J], 0),
                  ([4 + j - 4 if j >= 4 else 4 for j in _J], [6] * 16, [3 if j >= 4 else 0 for j in _J], 4)],
    min_fields=[([8 + j for j in _J], [0 if j < 4 else 4 for j in _J], [63 if j < 4 else 15 for j in _J], 0),
                ([4 + j for j in _J], [6] * 16, [3 if j >= 4 else 0 for j in _J], 4)],
    scale_bias=0, value_bias=0, size=Q4_K_SIZE, d_off=0, dmin_off=2)
# Q6_K (210 bytes): ql[128] at 0, qh[64] at 128, scales int8[16] at 192, d at 208. Group 4h + j (weights 128h + 32j
# + l): low 4 bits = nibble j // 2 of ql[64h + 32 (j % 2) + l], high 2 bits = qh[32h + l] bits 2j; q = that - 32.
# |scale * q| <= 128 * 32 = 4096, so a lane's 16 products stay below 16 * 4096 * 32767 < 2^31.
row_dot_q6_k, row_dot_rows_q6_k = _make_row_dot(
    groups=[(64 * h + 32 * (j % 2), 4 * (j // 2), 15, (128 + 32 * h, 2 * j, 3, 4)) for h in range(2) for j in range(4)],
    scale_fields=[([192 + k for k in range(16)], [0] * 16, 255, 0)], signed_scales=True,
    scale_bias=0, value_bias=32, size=Q6_K_SIZE, d_off=208, dmin_off=-1, min_fields=None)


@njit(cache=True)
def dot_bits_h_ref(q, i, shift, mask, qh, ih, hshift, hmask, hpos, x, j, lanes):
    """The plain twin of dot_bits32h (lanes = 32): the value is (low field) | (high field) << hpos."""
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
    return row_dot_q2_k(w, xq, xd, xbs)


@njit(cache=True)
def vec_dot_q3_k(w, xq, xd, xbs):
    # Weight 128h + 32j + l: low 2 bits in qs[32h + l] bits 2j..2j+1, high bit in hmask[l] bit 4h + j;
    # q = low - 4 * (1 - high) = (low | high << 2) - 4: row_dot_q3_k's layout.
    return row_dot_q3_k(w, xq, xd, xbs)


@njit(cache=True)
def vec_dot_q4_k(w, xq, xd, xbs):
    # Sub-block j (32 weights) of qs[32 (j // 2) + l], nibble j % 2, its 6-bit scale and min: row_dot_q4_k's layout.
    return row_dot_q4_k(w, xq, xd, xbs)


@njit(cache=True)
def vec_dot_q5_k(w, xq, xd, xbs):
    # d dmin scales[12] at byte 4 (6-bit scale/min per 32-weight sub-block), qh[32] at 16, qs[128] at 48:
    # weight 64c + 32 half + l = nibble `half` of qs[32c + l] | bit 2c + half of qh[l] << 4 (sub-block 2c + half).
    acc = np.float32(0.0)
    for b in range(w.shape[0] // Q5_K_SIZE):
        s, o = b * Q5_K_SIZE, b * QK_K
        isum = 0
        msum = 0
        for c in range(4):
            for half in range(2):
                sub = 2 * c + half
                sc, m = get_scale_min(w, s + 4, sub)
                isum += sc * dot_bits32h(w, s + 48 + 32 * c, 4 * half, 15, w, s + 16, sub, 1, 4, xq, o + 32 * sub)
                msum += m * (xbs[16 * b + 2 * sub] + xbs[16 * b + 2 * sub + 1])
        dx = xd[b]
        acc += (read_f16(w, s) * dx) * np.float32(isum) - (read_f16(w, s + 2) * dx) * np.float32(msum)
    return acc


@njit(cache=True)
def vec_dot_q6_k(w, xq, xd, xbs):
    # Weight 128h + 32j + l (l < 32): low 4 bits = nibble j // 2 of ql[64h + 32 (j % 2) + l], high 2 bits =
    # qh[32h + l] bits 2j..2j+1; q = (low | high << 4) - 32: row_dot_q6_k's layout.
    return row_dot_q6_k(w, xq, xd, xbs)


@njit(cache=True)
def vec_dot_rows_q2_k(w, xq, xd, xbs, acc, out):
    """out[t] = vec_dot_q2_k(w, xq[t], xd[t], xbs[t]) for every row t, each block unpacked once (prefill; an
    expert's tokens), bit for bit. acc: float32 [T, 16] scratch."""
    row_dot_rows_q2_k(w, xq, xd, xbs, acc, out)


@njit(cache=True)
def vec_dot_rows_q3_k(w, xq, xd, xbs, acc, out):
    """The same for Q3_K."""
    row_dot_rows_q3_k(w, xq, xd, xbs, acc, out)


@njit(cache=True)
def vec_dot_rows_q4_k(w, xq, xd, xbs, acc, out):
    """The same for Q4_K."""
    row_dot_rows_q4_k(w, xq, xd, xbs, acc, out)


@njit(cache=True)
def vec_dot_rows_q6_k(w, xq, xd, xbs, acc, out):
    """The same for Q6_K."""
    row_dot_rows_q6_k(w, xq, xd, xbs, acc, out)


ACT_DOTS = {
    QType.Q2_K: vec_dot_q2_k,
    QType.Q3_K: vec_dot_q3_k,
    QType.Q4_K: vec_dot_q4_k,
    QType.Q5_K: vec_dot_q5_k,
    QType.Q6_K: vec_dot_q6_k,
}


ACT_DOTS_ROWS = {QType.Q2_K: vec_dot_rows_q2_k, QType.Q3_K: vec_dot_rows_q3_k, QType.Q4_K: vec_dot_rows_q4_k,
                 QType.Q6_K: vec_dot_rows_q6_k}  # Q5_K: a loop of vec_dot


def has_int_dot(qtype, cols: int) -> bool:
    """Whether a [*, cols] weight of this type can take the integer path (a K type, rows of whole 256-blocks)."""
    return QType(qtype) in ACT_DOTS and cols % QK_K == 0
