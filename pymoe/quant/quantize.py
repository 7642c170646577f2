"""K-quant quantizers (Q2_K, Q3_K, Q4_K, Q6_K): float32 blocks of 256 -> raw GGUF blocks. gguf-py cannot do these.

What this is: NumPy re-statements of llama.cpp's reference quantizers (ggml-quants.c: `quantize_row_q2_K_ref`,
`quantize_row_q3_K_ref`, `quantize_row_q4_K_ref`, `quantize_row_q6_K_ref`, and their helpers `make_qkx2_quants`,
`make_q3_quants`, `make_qx_quants`), i.e. what `llama-quantize` writes when it runs without an importance matrix.
The byte layouts and the value mapping are llama.cpp's; the search algorithms are the same, step by step, so the
error is llama.cpp's error. Everything is vectorised over blocks and sub-blocks: the only Python loops run over the
small fixed number of candidate scales (or, for Q3_K's coordinate descent, over the 16 positions of a sub-block).
Arithmetic stays in float32 and sums run left to right (`sum_f32`), like the C loops, so that ties and comparisons
break the same way: the output is byte-identical to llama.cpp's (tests/test_quantize.py checks this against the
`quantize_row_*_ref` functions exported by llama-cpp-python's libggml-base when that package is installed).

What this is not: the importance-matrix (`quant_weights`) variants, a fast path (quantizing is done once, offline,
by tools and tests), or the dequantizer (that is `kquants.py`; the oracle for both is `gguf.dequantize`).

Shape legend: B blocks (super-blocks of QK_K = 256 weights), S sub-blocks per block (16 of 16 or 8 of 32),
G = B*S groups handled at once by the helpers, N weights per group (16 or 32).

Entry point: `QUANTIZERS[GGMLQuantizationType.Q4_K](w)` with w float32 [B, 256] -> uint8 [B, type_size].
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType

QType = GGMLQuantizationType
QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)  # llama.cpp: a group whose largest |x| is below this is "all zero"
f32 = np.float32


# ----------------------------------------------------------------------------------------------------------------
# Numeric helpers: the C semantics we must reproduce
# ----------------------------------------------------------------------------------------------------------------

def nearest_int(v: np.ndarray) -> np.ndarray:
    """llama.cpp's `nearest_int`: float32 -> int32, rounding half to even.

    The C code adds 12582912.f (1.5 * 2**23) and reads the mantissa bits: at that magnitude the float32 spacing is
    exactly 1.0, so the IEEE add itself rounds to the nearest integer with ties to even. `np.rint` on float32 is the
    same rounding (valid for |v| < 2**22, which the C code asserts).
    """
    v = np.rint(np.asarray(v, dtype=np.float32))
    # beyond 2**22 the C trick returns garbage (its assert is off in release builds); we clamp instead, which only
    # matters for values that are clamped to a few levels right after anyway
    return np.clip(np.nan_to_num(v), -4194303, 4194303).astype(np.int32)


def sum_f32(a: np.ndarray) -> np.ndarray:
    """Left-to-right float32 sum over the last axis: [..., N] -> [...].

    NumPy's `sum` uses pairwise summation; the C loops accumulate one term at a time. The last-bit difference can
    flip an `error < best_error` comparison, so we use the sequential `cumsum` and keep its last column.
    """
    return np.cumsum(a, axis=-1, dtype=np.float32)[..., -1]


def to_fp16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGML_FP32_TO_FP16 (round to nearest even) -> (fp16 values to store, the same values back as float32).

    The C quantizers re-read the stored fp16 scale before the final rounding of the weights, so the weights are
    quantized against the scale a reader will actually see, not the unrounded float32 one.
    """
    h = np.asarray(v, dtype=np.float32).astype(np.float16)
    return h, h.astype(np.float32)


def fp16_bytes(h: np.ndarray) -> np.ndarray:
    """fp16 [B] -> little-endian uint8 [B, 2]."""
    return np.ascontiguousarray(h.astype("<f2")).view(np.uint8).reshape(-1, 2)


def value_of_max_abs(x: np.ndarray) -> np.ndarray:
    """The signed entry with the largest magnitude along the last axis (the first one on ties, like the C `>`)."""
    i = np.argmax(np.abs(x), axis=-1)  # [...]
    return np.take_along_axis(x, i[..., None], axis=-1)[..., 0]


def safe(den: np.ndarray) -> np.ndarray:
    """A divisor with zeros replaced by 1, for divisions whose result is masked out where den == 0."""
    return np.where(den == 0, f32(1), den).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Sub-block searches (the helpers of ggml-quants.c), each over G groups of N weights at once
# ----------------------------------------------------------------------------------------------------------------

def affine_error(scale, minv, L, x, w, use_mad):
    """Weighted error of x ~ scale*L + min: sum w*|d| (use_mad) or sum w*d^2, d = scale*L + min - x.  -> [G]"""
    diff = (scale[:, None] * L + minv[:, None]) - x  # [G, N]
    diff = np.abs(diff) if use_mad else diff * diff
    return sum_f32(w * diff)


def make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """Fit x ~ scale*L - the_min with L in [0, nmax] (asymmetric, "scale and min"), as llama.cpp's make_qkx2_quants.

    x, w float32 [G, N] (w: per-weight importance). Returns scale [G], the_min [G] (>= 0), L uint8 [G, N].
    1. Start from the range fit: min = min(x) (clamped to <= 0, so 0 stays exactly representable), scale =
       (max - min)/nmax, L = round((x - min)/scale).
    2. Try nstep+1 slightly different inverse scales (nmax + rmin + rdelta*k)/(max - min): each gives a different
       rounding L; for that L the best (scale, min) is a 2x2 weighted least-squares solve. Keep whichever candidate
       has the smallest weighted error. Rounding is the non-convex part; the candidates sample it. (`min` in the
       candidate grid is the best min found so far, as in the C code, where the variable is updated in the loop.)
    """
    x = x.astype(np.float32)
    w = w.astype(np.float32)
    xmin = np.minimum(x.min(axis=1), f32(0))  # [G]  min clamped to <= 0
    xmax = x.max(axis=1)  # [G]
    flat = xmax == xmin  # [G]  constant (or all-zero) group: nothing to fit
    span = safe(xmax - xmin)  # [G]
    sum_w = sum_f32(w)  # [G]
    sum_x = sum_f32(w * x)  # [G]

    # step 1: range fit
    iscale = f32(nmax) / span  # [G]
    scale = f32(1) / iscale  # [G]
    minv = xmin.copy()  # [G]
    L = np.clip(nearest_int(iscale[:, None] * (x - xmin[:, None])), 0, nmax).astype(np.float32)  # [G, N]
    best_error = affine_error(scale, minv, L, x, w, use_mad)  # [G]

    # step 2: candidate inverse scales, each followed by a weighted least-squares (scale, min)
    # NB: like the C code, each candidate grid starts at the *best min so far* (min is updated in the loop), so
    # the search walks: an accepted fit moves the origin of the next roundings.
    for k in range(nstep + 1):
        iscale = (f32(rmin) + f32(rdelta) * f32(k) + f32(nmax)) / safe(xmax - minv)  # [G]
        Laux = np.clip(nearest_int(iscale[:, None] * (x - minv[:, None])), 0, nmax).astype(np.float32)  # [G, N]
        wl = w * Laux  # [G, N]
        sum_l = sum_f32(wl)  # [G]
        sum_l2 = sum_f32(wl * Laux)  # [G]
        sum_xl = sum_f32(wl * x)  # [G]
        # normal equations of min over (s, m) of sum w (s*L + m - x)^2; D is their determinant
        D = sum_w * sum_l2 - sum_l * sum_l  # [G]
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe(D)  # [G]
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe(D)  # [G]
        # a positive offset is not representable (the format subtracts min >= 0): refit the scale through 0
        pos = this_min > 0  # [G]
        this_scale = np.where(pos, sum_xl / safe(sum_l2), this_scale)
        this_min = np.where(pos, f32(0), this_min)
        cur_error = affine_error(this_scale, this_min, Laux, x, w, use_mad)  # [G]
        better = (D > 0) & (cur_error < best_error)  # [G]
        L = np.where(better[:, None], Laux, L)
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale)
        minv = np.where(better, this_min, minv)

    scale = np.where(flat, f32(0), scale).astype(np.float32)
    L = np.where(flat[:, None], f32(0), L)
    return scale, (-minv).astype(np.float32), L.astype(np.uint8)


def make_q3_quants(x, nmax):
    """Fit x ~ scale*l with l in [-nmax, nmax-1] (symmetric), as llama.cpp's make_q3_quants with do_rmse.

    x float32 [G, N]. Returns scale [G] and L uint8 [G, N] holding l + nmax.
    1. Start from max-magnitude scaling: the largest |x| maps to -nmax (the end with one more level).
    2. Coordinate descent on the x^2-weighted least-squares error: for each position in turn, re-round it against
       the scale implied by all the *other* positions and keep the change if the fit sum(w x l)^2/sum(w l^2)
       improves. Up to 5 passes; the C code stops early when a pass changes nothing, and a pass that changes
       nothing would change nothing again, so running all 5 gives the same result.
    """
    N = x.shape[1]
    x = x.astype(np.float32)
    vmax = value_of_max_abs(x)  # [G]
    zero = np.abs(vmax) < GROUP_MAX_EPS  # [G]
    iscale = f32(-nmax) / safe(vmax)  # [G]
    L = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1).astype(np.float32)  # [G, N]  signed levels
    w = x * x  # [G, N]  weight large values more: they dominate the output error
    wx = w * x  # [G, N]
    sumlx = sum_f32(wx * L)  # [G]
    suml2 = sum_f32(w * L * L)  # [G]
    for _ in range(5):
        for i in range(N):  # sequential by nature: each accepted change updates the running sums
            li, xi, wi, wxi = L[:, i], x[:, i], w[:, i], wx[:, i]
            slx = sumlx - wxi * li  # [G]  sums without position i
            sl2 = suml2 - wi * li * li  # [G]
            new = np.clip(nearest_int(xi * sl2 / safe(slx)), -nmax, nmax - 1).astype(np.float32)  # [G]
            slx_new = slx + wxi * new  # [G]
            sl2_new = sl2 + wi * new * new  # [G]
            # compare sumlx^2/suml2 without dividing (as the C code): larger means smaller residual
            take = (slx > 0) & (new != li) & (sl2_new > 0) & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            L[:, i] = np.where(take, new, li)
            sumlx = np.where(take, slx_new, sumlx)
            suml2 = np.where(take, sl2_new, suml2)
    scale = np.where(suml2 > 0, sumlx / safe(suml2), f32(0))  # [G]
    scale = np.where(zero, f32(0), scale).astype(np.float32)
    L = np.where(zero[:, None], f32(0), L + f32(nmax))  # the C code leaves L = 0 (not nmax) for a zero group
    return scale, L.astype(np.uint8)


def make_qx_quants(x, nmax):
    """Fit x ~ scale*l with l in [-nmax, nmax-1], as llama.cpp's make_qx_quants with rmse_type 1 (no importance).

    x float32 [G, N]. Returns scale [G] and L uint8 [G, N] holding l + nmax.
    Try 19 inverse scales -(nmax + 0.1*k)/max for k = 0, -9..9; for each rounding the x^2-weighted least-squares
    scale is sum(w x l)/sum(w l^2), and the best candidate maximises sum(w x l)^2/sum(w l^2) (= minimises the
    weighted squared error).
    """
    x = x.astype(np.float32)
    vmax = value_of_max_abs(x)  # [G]
    zero = np.abs(vmax) < GROUP_MAX_EPS  # [G]
    w = x * x  # [G, N]
    wx = w * x  # [G, N]

    def fit(iscale):
        l = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1).astype(np.float32)  # [G, N]
        return l, sum_f32(wx * l), sum_f32(w * l * l)

    L, sumlx, suml2 = fit(f32(-nmax) / safe(vmax))
    scale = np.where(suml2 != 0, sumlx / safe(suml2), f32(0)).astype(np.float32)  # [G]
    best = scale * sumlx  # [G]
    for k in range(-9, 10):
        if k == 0:
            continue
        l, slx, sl2 = fit(-(f32(nmax) + f32(0.1) * f32(k)) / safe(vmax))
        take = (sl2 > 0) & (slx * slx > best * sl2)  # [G]
        L = np.where(take[:, None], l, L)
        scale = np.where(take, slx / safe(sl2), scale).astype(np.float32)
        best = np.where(take, scale * slx, best)
    scale = np.where(zero, f32(0), scale).astype(np.float32)
    L = np.where(zero[:, None], f32(0), L + f32(nmax))  # the C code leaves L = 0 (not nmax) for a zero group
    return scale, L.astype(np.uint8)


def requantize(x, d, L, offset, lo, hi):
    """Final rounding of the weights against the scales as stored: l = clamp(round((x + offset)/d), lo, hi) - lo.

    x [B, S, N], d and offset [B, S] (float32, built from the fp16 super-scales and the quantized sub-scales),
    L uint8 [B, S, N] from the search. Stored values are unsigned, hence the shift by -lo. Where d == 0 the C code
    skips the sub-block and keeps the search's L.
    """
    l = np.clip(nearest_int((x + offset[..., None]) / safe(d)[..., None]), lo, hi) - lo  # [B, S, N]
    return np.where((d == 0)[..., None], L, l).astype(np.uint8)


def pack_2bit(L: np.ndarray) -> np.ndarray:
    """uint8 [B, 256] values 0..3 -> qs uint8 [B, 64].

    Per half of 128 weights h: byte qs[32h + l] holds weights 128h + l + 32k in bits 2k..2k+1, k = 0..3.
    """
    q = L.reshape(-1, 2, 4, 32).astype(np.uint8) & 3  # [B, half, k, l]
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(-1, 64)


def pack_6bit_scales_mins(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K 12-byte scales field from eight 6-bit scales ls and mins lm (uint8 [B, 8]) -> uint8 [B, 12].

        bytes 0..3 : ls[0..3] in bits 0-5, high 2 bits of ls[4..7] in bits 6-7
        bytes 4..7 : lm[0..3] in bits 0-5, high 2 bits of lm[4..7] in bits 6-7
        bytes 8..11: low nibble ls[4..7], high nibble lm[4..7] low 4 bits
    """
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    lo_s, hi_s = ls[:, :4], ls[:, 4:]  # [B, 4]
    lo_m, hi_m = lm[:, :4], lm[:, 4:]  # [B, 4]
    return np.concatenate([
        lo_s | (hi_s >> 4) << 6,
        lo_m | (hi_m >> 4) << 6,
        (hi_s & 0xF) | (hi_m & 0xF) << 4,
    ], axis=1)  # [B, 12]


# ----------------------------------------------------------------------------------------------------------------
# Q2_K
# ----------------------------------------------------------------------------------------------------------------
# 84 bytes / 256 weights, 16 sub-blocks of 16, w = d*(sc & 15)*q - dmin*(sc >> 4), q in 0..3
#
#   | scales[16]: low nibble 4-bit scale, high nibble 4-bit min | qs[64]: 2-bit q (pack_2bit) | d fp16 | dmin fp16 |

def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """float32 [B, 256] -> uint8 [B, 84] (llama.cpp quantize_row_q2_K_ref)."""
    x = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, 16, 16)  # [B, S, N]
    B = x.shape[0]
    # per sub-block (scale, min) search, weighting each weight by |x| and minimising the absolute error
    scales, mins, L = make_qkx2_quants(x.reshape(-1, 16), np.abs(x).reshape(-1, 16), nmax=3,
                                       rmin=-0.5, rdelta=0.1, nstep=15, use_mad=True)
    scales, mins, L = scales.reshape(B, 16), mins.reshape(B, 16), L.reshape(B, 16, 16)
    # the sub-scales and sub-mins are themselves quantized to 4 bits against the block's largest
    max_scale = np.maximum(scales.max(axis=1), f32(0))  # [B]
    max_min = np.maximum(mins.max(axis=1), f32(0))  # [B]
    has_s, has_m = max_scale > 0, max_min > 0  # [B]
    ls = np.where(has_s[:, None], nearest_int((f32(15) / safe(max_scale))[:, None] * scales), 0)  # [B, S]
    lm = np.where(has_m[:, None], nearest_int((f32(15) / safe(max_min))[:, None] * mins), 0)  # [B, S]
    sc = (ls & 0xFF).astype(np.uint8) | ((lm << 4) & 0xFF).astype(np.uint8)  # [B, S]  C stores into a uint8
    d16, d = to_fp16(np.where(has_s, max_scale / f32(15), f32(0)))  # [B]
    m16, dmin = to_fp16(np.where(has_m, max_min / f32(15), f32(0)))  # [B]
    # final rounding against the stored scales: q = round((x + dmin*m)/(d*s))
    dd = d[:, None] * (sc & 0xF).astype(np.float32)  # [B, S]
    dm = dmin[:, None] * (sc >> 4).astype(np.float32)  # [B, S]
    q = requantize(x, dd, L, dm, 0, 3).reshape(B, 256)  # [B, 256]
    return np.concatenate([sc, pack_2bit(q), fp16_bytes(d16), fp16_bytes(m16)], axis=1)


# ----------------------------------------------------------------------------------------------------------------
# Q3_K
# ----------------------------------------------------------------------------------------------------------------
# 110 bytes / 256 weights, 16 sub-blocks of 16, w = d*(s - 32)*(q - 4), q = low 2 bits | high bit << 2, s 6-bit
#
#   | hmask[32]: bit k of byte m = high bit of weight 32k + m | qs[64]: low 2 bits (pack_2bit) |
#   | scales[12]: 6-bit s packed as below | d fp16 |
#   scales bytes 0..7 : low nibble s[0..7], high nibble s[8..15] low 4 bits
#   scales bytes 8..11: byte 8 + i holds the high 2 bits of s[i], s[i+4], s[i+8], s[i+12] in bits 0-1, 2-3, 4-5, 6-7

def pack_q3_scales(s: np.ndarray) -> np.ndarray:
    """Sixteen 6-bit scales uint8 [B, 16] -> Q3_K scales field uint8 [B, 12] (layout above)."""
    s = s.astype(np.uint8)
    low = (s[:, :8] & 0xF) | (s[:, 8:] & 0xF) << 4  # [B, 8]
    hi = (s >> 4).reshape(-1, 4, 4)  # [B, j//4, j%4]
    high = hi[:, 0] | hi[:, 1] << 2 | hi[:, 2] << 4 | hi[:, 3] << 6  # [B, 4]
    return np.concatenate([low, high], axis=1)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """float32 [B, 256] -> uint8 [B, 110] (llama.cpp quantize_row_q3_K_ref)."""
    x = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, 16, 16)  # [B, S, N]
    B = x.shape[0]
    scales, L = make_q3_quants(x.reshape(-1, 16), nmax=4)
    scales, L = scales.reshape(B, 16), L.reshape(B, 16, 16)
    # sub-scales are signed; quantize them to 6 bits so the one of largest magnitude maps to -32
    max_scale = value_of_max_abs(scales)  # [B]
    has = max_scale != 0  # [B]
    iscale = f32(-32) / safe(max_scale)  # [B]
    ls = np.clip(nearest_int(iscale[:, None] * scales), -32, 31) + 32  # [B, S]  0..63
    ls = np.where(has[:, None], ls, 0).astype(np.uint8)
    d16, d = to_fp16(np.where(has, f32(1) / iscale, f32(0)))  # [B]
    # final rounding against the stored scales: l = round(x/(d*(s-32))) in -4..3, stored + 4
    dd = d[:, None] * (ls.astype(np.float32) - f32(32))  # [B, S]
    q = requantize(x, dd, L, np.zeros_like(dd), -4, 3).reshape(B, 256)  # [B, 256]  0..7
    hbit = (q >> 2).reshape(B, 8, 32)  # [B, k, m]
    hmask = np.zeros((B, 32), np.uint8)
    for k in range(8):
        hmask |= hbit[:, k] << k
    return np.concatenate([hmask, pack_2bit(q & 3), pack_q3_scales(ls), fp16_bytes(d16)], axis=1)


# ----------------------------------------------------------------------------------------------------------------
# Q4_K
# ----------------------------------------------------------------------------------------------------------------
# 144 bytes / 256 weights, 8 sub-blocks of 32, w = d*sc*q - dmin*m, q in 0..15, sc and m 6-bit
#
#   | d fp16 | dmin fp16 | scales[12] (pack_6bit_scales_mins) | qs[128] |
#   qs: per chunk c of 64 weights, byte 32c + l = weight 64c + l (low nibble) | weight 64c + 32 + l (high nibble)

def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [B, 256] -> uint8 [B, 144] (llama.cpp quantize_row_q4_K_ref)."""
    x = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, 8, 32)  # [B, S, N]
    B = x.shape[0]
    # importance = rms of the sub-block + |x|: every weight counts, large ones count more; squared error
    av_x = np.sqrt(sum_f32(x * x) / f32(32))  # [B, S]
    weights = av_x[..., None] + np.abs(x)  # [B, S, N]
    scales, mins, L = make_qkx2_quants(x.reshape(-1, 32), weights.reshape(-1, 32), nmax=15,
                                       rmin=-1.0, rdelta=0.1, nstep=20, use_mad=False)
    scales, mins, L = scales.reshape(B, 8), mins.reshape(B, 8), L.reshape(B, 8, 32)
    # sub-scales and sub-mins to 6 bits against the block's largest
    max_scale = np.maximum(scales.max(axis=1), f32(0))  # [B]
    max_min = np.maximum(mins.max(axis=1), f32(0))  # [B]
    inv_scale = np.where(max_scale > 0, f32(63) / safe(max_scale), f32(0))  # [B]
    inv_min = np.where(max_min > 0, f32(63) / safe(max_min), f32(0))  # [B]
    ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)  # [B, S]
    lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)  # [B, S]
    d16, d = to_fp16(max_scale / f32(63))  # [B]
    m16, dmin = to_fp16(max_min / f32(63))  # [B]
    # final rounding against the stored scales: q = round((x + dmin*m)/(d*sc))
    dd = d[:, None] * ls.astype(np.float32)  # [B, S]
    dm = dmin[:, None] * lm.astype(np.float32)  # [B, S]
    q = requantize(x, dd, L, dm, 0, 15).reshape(B, 4, 2, 32)  # [B, chunk, half, l]
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(B, 128)  # [B, 128]
    return np.concatenate([fp16_bytes(d16), fp16_bytes(m16), pack_6bit_scales_mins(ls, lm), qs], axis=1)


# ----------------------------------------------------------------------------------------------------------------
# Q6_K
# ----------------------------------------------------------------------------------------------------------------
# 210 bytes / 256 weights, 16 sub-blocks of 16, w = d*sc*(q - 32), q 6-bit, sc int8
#
#   | ql[128]: low 4 bits | qh[64]: high 2 bits | scales[16] int8 | d fp16 |
#   per half h of 128 weights, position l in 0..31, weight i_k = 128h + 32k + l:
#     ql[64h + l]      = low4(i_0) | low4(i_2) << 4
#     ql[64h + 32 + l] = low4(i_1) | low4(i_3) << 4
#     qh[32h + l]      = high2(i_0) | high2(i_1) << 2 | high2(i_2) << 4 | high2(i_3) << 6

def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [B, 256] -> uint8 [B, 210] (llama.cpp quantize_row_q6_K_ref)."""
    x = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, 16, 16)  # [B, S, N]
    B = x.shape[0]
    scales, L = make_qx_quants(x.reshape(-1, 16), nmax=32)
    scales, L = scales.reshape(B, 16), L.reshape(B, 16, 16)
    # signed sub-scales to int8 so that the one of largest magnitude maps to -128
    max_scale = value_of_max_abs(scales)  # [B]
    zero = np.abs(max_scale) < GROUP_MAX_EPS  # [B]  the C code writes an all-zero block
    iscale = f32(-128) / safe(max_scale)  # [B]
    sc = np.minimum(nearest_int(iscale[:, None] * scales), 127)  # [B, S]
    sc = np.where(zero[:, None], 0, sc).astype(np.int8)
    d16, d = to_fp16(np.where(zero, f32(0), f32(1) / iscale))  # [B]
    # final rounding against the stored scales: l = round(x/(d*sc)) in -32..31, stored + 32
    dd = d[:, None] * sc.astype(np.float32)  # [B, S]
    q = requantize(x, dd, L, np.zeros_like(dd), -32, 31).reshape(B, 2, 4, 32)  # [B, half, k, l]
    q = np.where(zero[:, None, None, None], 0, q).astype(np.uint8)
    lo, hi = q & 0xF, q >> 4
    ql = np.concatenate([lo[:, :, 0] | lo[:, :, 2] << 4, lo[:, :, 1] | lo[:, :, 3] << 4], axis=2)  # [B, half, 64]
    qh = hi[:, :, 0] | hi[:, :, 1] << 2 | hi[:, :, 2] << 4 | hi[:, :, 3] << 6  # [B, half, 32]
    return np.concatenate([ql.reshape(B, 128), qh.reshape(B, 64), sc.view(np.uint8), fp16_bytes(d16)], axis=1)


QUANTIZERS: dict[QType, Callable[[np.ndarray], np.ndarray]] = {
    QType.Q2_K: quantize_q2_k,
    QType.Q3_K: quantize_q3_k,
    QType.Q4_K: quantize_q4_k,
    QType.Q6_K: quantize_q6_k,
}

