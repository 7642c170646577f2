"""K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K -- super-blocks of 256 weights with per-sub-block scales.

What this is: for each K type, a bit-layout diagram, a NumPy reference dequantizer (bit-exact with
`gguf.dequantize`, the oracle) and a Numba `decode_block` twin used by the fused kernels in `kernels.py`.
What it is not: the quantizers (those live in `quantize.py`; this module only wires them into the registry), nor the
mat-vec kernels themselves.

The shape of every K type: one fp16 super-scale `d` (and for the "affine" types an fp16 `dmin`), a table of small
integer sub-block scales (and mins), and the packed integer quants. A weight is

    symmetric (Q3_K, Q6_K):   w = (d * sc[s]) * q                        q signed
    affine    (Q2_K, Q4_K, Q5_K): w = (d * sc[s]) * q - (dmin * m[s])     q unsigned

with s = the weight's sub-block (16 weights for Q2_K/Q3_K/Q6_K, 32 for Q4_K/Q5_K). The parenthesisation is the
float32 operation order of llama.cpp's dequantize_row_q*_K and of gguf-py: the two scale products are rounded to
float32 first, then one multiply and one subtract, each rounded (no fused multiply-add). Keeping exactly that order
is what makes the reference and the Numba twin bit-exact with the oracle.

Where the weights sit: the packed arrays are read in runs of 32 (or 64) bytes; one run holds several consecutive
runs of 32 (or 64) weights, one per bit-plane, lowest bits first. For example Q2_K's qs[0:32] holds weights 0..31 in
bits 0-1, weights 32..63 in bits 2-3, 64..95 in bits 4-5 and 96..127 in bits 6-7; qs[32:64] holds weights 128..255
the same way. `_planes` below is that rule, written once; each type's diagram says which run/bits give which weight.

Shape legend: B blocks, 256 weights per block (QK_K).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import QType, QuantFormat, register
from .floats import read_f16  # little-endian fp16 at src[i], src[i+1] -> float32, byte reads (any alignment)
from .quantize import QUANTIZERS

QK_K = 256  # weights per super-block, every K type


# ----------------------------------------------------------------------------------------------------------------------
# Shared pieces

def _f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """Little-endian fp16 at byte `offset` of every block -> float32 [B, 1] (exact widening)."""
    return blocks[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)  # [B, 1]


def _planes(packed: np.ndarray, run: int, bits: int) -> np.ndarray:
    """Unpack bit-planes: uint8 [B, n] -> uint8 [B, n * 8 // bits], values in [0, 2**bits).

    The bytes are cut into runs of `run` bytes. Run r, bit-plane p (bits p*bits .. p*bits+bits-1) holds the weights
    (r * 8 // bits + p) * run + 0 .. run - 1: a run unpacks into 8 // bits consecutive groups of `run` weights.
    """
    B, n = packed.shape
    shifts = (np.arange(8 // bits, dtype=np.uint8) * bits).reshape(1, 1, -1, 1)  # [1, 1, P, 1]
    q = (packed.reshape(B, n // run, 1, run) >> shifts) & np.uint8((1 << bits) - 1)  # [B, n/run, P, run]
    return q.reshape(B, -1)  # [B, n * 8 / bits]


# The 12-byte, 6-bit scale/min table of Q4_K and Q5_K (8 sub-blocks, each with a 6-bit scale and a 6-bit min):
#
#   byte  0..3 : bits 0-5 = scale of sub-block 0..3   bits 6-7 = bits 4-5 of scale of sub-block 4..7
#   byte  4..7 : bits 0-5 = min   of sub-block 0..3   bits 6-7 = bits 4-5 of min   of sub-block 4..7
#   byte 8..11 : bits 0-3 = bits 0-3 of scale of sub-block 4..7
#                bits 4-7 = bits 0-3 of min   of sub-block 4..7
#
# So column i (bytes i, i+4, i+8; i = 0..3) holds everything about sub-blocks i and i+4. `scale_min_k4` decodes one
# column; it is plain integer arithmetic, so the same function runs on NumPy arrays (the reference, one call for all
# columns) and, jitted, on scalars (the Numba decoders) -- one definition of the bit layout for both.

def scale_min_k4(lo, mid, hi):
    """One column of the Q4_K/Q5_K scale table -> (scale_i, min_i, scale_i+4, min_i+4), each 0..63.

    lo = byte i, mid = byte i+4, hi = byte i+8. Works elementwise on uint8 arrays and on scalars.
    """
    sc_lo = lo & 63
    m_lo = mid & 63
    sc_hi = (hi & 15) | ((lo >> 6) << 4)
    m_hi = (hi >> 4) | ((mid >> 6) << 4)
    return sc_lo, m_lo, sc_hi, m_hi


_scale_min_k4_jit = njit(cache=True, inline="always")(scale_min_k4)


@njit(cache=True, inline="always")
def get_scale_min(src, scales_off, j):
    """Scale and min (ints, 0..63) of sub-block j (0..7) from the 12-byte table starting at src[scales_off]."""
    i = j & 3
    sc_lo, m_lo, sc_hi, m_hi = _scale_min_k4_jit(
        np.int64(src[scales_off + i]), np.int64(src[scales_off + 4 + i]), np.int64(src[scales_off + 8 + i]))
    if j < 4:
        return sc_lo, m_lo
    return sc_hi, m_hi


def _scale_min_table(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [B, 12] Q4_K/Q5_K scale table -> (scales uint8 [B, 8], mins uint8 [B, 8]), sub-block order."""
    sc_lo, m_lo, sc_hi, m_hi = scale_min_k4(scales[:, 0:4], scales[:, 4:8], scales[:, 8:12])  # 4 x [B, 4]
    return np.concatenate([sc_lo, sc_hi], axis=1), np.concatenate([m_lo, m_hi], axis=1)  # [B, 8], [B, 8]


def _affine(d, sc, q, dmin, m, sub: int) -> np.ndarray:
    """w = (d * sc) * q - (dmin * m), in gguf-py's float32 order. d, dmin [B, 1]; sc, m [B, S]; q [B, 256]."""
    B = q.shape[0]
    dl = (d * sc.astype(np.float32))[:, :, None]  # [B, S, 1]
    ml = (dmin * m.astype(np.float32))[:, :, None]  # [B, S, 1]
    w = dl * q.reshape(B, -1, sub).astype(np.float32) - ml  # [B, S, sub]
    return w.reshape(B, QK_K)


def _symmetric(d, sc, q, sub: int) -> np.ndarray:
    """w = (d * sc) * q, in gguf-py's float32 order. d [B, 1]; sc [B, S] (signed); q [B, 256] (signed)."""
    B = q.shape[0]
    dl = (d * sc.astype(np.float32))[:, :, None]  # [B, S, 1]
    w = dl * q.reshape(B, -1, sub).astype(np.float32)  # [B, S, sub]
    return w.reshape(B, QK_K)


# ----------------------------------------------------------------------------------------------------------------------
# Q2_K: 84 bytes, 2.625 bits/weight. 16 sub-blocks of 16 weights, affine.
#
#   offset  0 : scales[16]  byte s: bits 0-3 = scale of sub-block s, bits 4-7 = min of sub-block s (4-bit each)
#   offset 16 : qs[64]      2-bit quants; qs[32h + l], bits 2j..2j+1 -> weight 128h + 32j + l  (h 0..1, j 0..3,
#                           l 0..31); the sub-block of weight k is k // 16
#   offset 80 : d    fp16   super-scale of the scales
#   offset 82 : dmin fp16   super-scale of the mins
#
#   w = (d * (sc & 15)) * q - (dmin * (sc >> 4)),  q in 0..3

Q2_K_SIZE = 84


def dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 84] -> float32 [B, 256]."""
    scales = blocks[:, 0:16]  # [B, 16]
    q = _planes(blocks[:, 16:80], run=32, bits=2)  # [B, 256]
    d, dmin = _f16_field(blocks, 80), _f16_field(blocks, 82)  # [B, 1] each
    return _affine(d, scales & 15, q, dmin, scales >> 4, sub=16)


@njit(cache=True)
def decode_q2_k(src, out):
    """n blocks of Q2_K (uint8 [n*84]) -> float32 [n*256]."""
    for b in range(src.shape[0] // Q2_K_SIZE):
        s, o = b * Q2_K_SIZE, b * QK_K
        d, dmin = read_f16(src, s + 80), read_f16(src, s + 82)
        for h in range(2):  # 32-byte half of qs -> weights 128h .. 128h+127
            for g in range(2):  # bytes l = 16g .. 16g+15 share their 4 sub-blocks 8h + 2j + g
                sc0, sc1, sc2, sc3 = (src[s + 8 * h + g], src[s + 8 * h + 2 + g],
                                      src[s + 8 * h + 4 + g], src[s + 8 * h + 6 + g])
                dl0, ml0 = d * np.float32(sc0 & 15), dmin * np.float32(sc0 >> 4)
                dl1, ml1 = d * np.float32(sc1 & 15), dmin * np.float32(sc1 >> 4)
                dl2, ml2 = d * np.float32(sc2 & 15), dmin * np.float32(sc2 >> 4)
                dl3, ml3 = d * np.float32(sc3 & 15), dmin * np.float32(sc3 >> 4)
                for l in range(16 * g, 16 * g + 16):
                    x = src[s + 16 + 32 * h + l]  # one byte = 4 weights, 32 apart
                    base = o + 128 * h + l
                    out[base] = dl0 * np.float32(x & 3) - ml0
                    out[base + 32] = dl1 * np.float32((x >> 2) & 3) - ml1
                    out[base + 64] = dl2 * np.float32((x >> 4) & 3) - ml2
                    out[base + 96] = dl3 * np.float32(x >> 6) - ml3


# ----------------------------------------------------------------------------------------------------------------------
# Q3_K: 110 bytes, 3.4375 bits/weight. 16 sub-blocks of 16 weights, symmetric.
#
#   offset   0 : hmask[32]  high bit of each 3-bit quant; hmask[l] bit j -> weight 32j + l  (j 0..7, l 0..31)
#   offset  32 : qs[64]     low 2 bits, same walk as Q2_K: qs[32h + l] bits 2j..2j+1 -> weight 128h + 32j + l
#   offset  96 : scales[12] sixteen 6-bit scales, stored biased by +32:
#                  bytes 0..7 : bits 0-3 = low 4 bits of scale s (s = byte), bits 4-7 = low 4 bits of scale s + 8
#                  bytes 8..11: bits 2k..2k+1 of byte 8 + i = high 2 bits of scale 4k + i  (k 0..3, i 0..3)
#   offset 108 : d fp16
#
#   q = (low 2 bits) - (4 if the hmask bit is 0 else 0)  in -4..3   (llama.cpp stores the high bit inverted)
#   w = (d * (scale6 - 32)) * q; the sub-block of weight k is k // 16

Q3_K_SIZE = 110


def _q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """uint8 [B, 12] packed -> int8 [B, 16] signed scales (-32..31)."""
    low4 = _planes(scales[:, 0:8], run=8, bits=4)  # [B, 16]: scale s low nibble, s = 0..15
    high2 = _planes(scales[:, 8:12], run=4, bits=2)  # [B, 16]: scale 4k + i from byte 8+i, bits 2k..2k+1
    return (low4 | (high2 << 4)).astype(np.int8) - np.int8(32)  # [B, 16]


def dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 110] -> float32 [B, 256]."""
    high = _planes(blocks[:, 0:32], run=32, bits=1)  # [B, 256]
    low = _planes(blocks[:, 32:96], run=32, bits=2)  # [B, 256]
    q = low.astype(np.int8) - ((high ^ 1) << 2).astype(np.int8)  # [B, 256] in -4..3
    d = _f16_field(blocks, 108)  # [B, 1]
    return _symmetric(d, _q3_k_scales(blocks[:, 96:108]), q, sub=16)


@njit(cache=True, inline="always")
def _q3_k_scale(src, scales_off, s):
    """Signed 6-bit scale s (0..15) of a Q3_K block whose scale table starts at src[scales_off]."""
    low4 = (np.int64(src[scales_off + (s & 7)]) >> (4 * (s >> 3))) & 15
    high2 = (np.int64(src[scales_off + 8 + (s & 3)]) >> (2 * (s >> 2))) & 3
    return (low4 | (high2 << 4)) - 32


@njit(cache=True)
def decode_q3_k(src, out):
    """n blocks of Q3_K (uint8 [n*110]) -> float32 [n*256]."""
    for b in range(src.shape[0] // Q3_K_SIZE):
        s, o = b * Q3_K_SIZE, b * QK_K
        d = read_f16(src, s + 108)
        for h in range(2):
            for g in range(2):  # bytes l = 16g .. 16g+15 share their 4 sub-blocks 8h + 2j + g
                dl0 = d * np.float32(_q3_k_scale(src, s + 96, 8 * h + g))
                dl1 = d * np.float32(_q3_k_scale(src, s + 96, 8 * h + 2 + g))
                dl2 = d * np.float32(_q3_k_scale(src, s + 96, 8 * h + 4 + g))
                dl3 = d * np.float32(_q3_k_scale(src, s + 96, 8 * h + 6 + g))
                for l in range(16 * g, 16 * g + 16):
                    x = np.int64(src[s + 32 + 32 * h + l])  # low bits of 4 weights, 32 apart
                    m = np.int64(src[s + l]) >> (4 * h)  # their high bits: hmask bits 4h .. 4h+3
                    base = o + 128 * h + l
                    out[base] = dl0 * np.float32((x & 3) - (0 if m & 1 else 4))
                    out[base + 32] = dl1 * np.float32(((x >> 2) & 3) - (0 if m & 2 else 4))
                    out[base + 64] = dl2 * np.float32(((x >> 4) & 3) - (0 if m & 4 else 4))
                    out[base + 96] = dl3 * np.float32((x >> 6) - (0 if m & 8 else 4))


# ----------------------------------------------------------------------------------------------------------------------
# Q4_K: 144 bytes, 4.5 bits/weight. 8 sub-blocks of 32 weights, affine.
#
#   offset  0 : d    fp16
#   offset  2 : dmin fp16
#   offset  4 : scales[12]  6-bit scale + 6-bit min per sub-block (the table above `scale_min_k4`)
#   offset 16 : qs[128]     4-bit quants; qs[32c + l] low nibble -> weight 64c + l (sub-block 2c),
#                           high nibble -> weight 64c + 32 + l (sub-block 2c + 1)   (c 0..3, l 0..31)
#
#   w = (d * sc) * q - (dmin * m),  q in 0..15

Q4_K_SIZE = 144


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 144] -> float32 [B, 256]."""
    d, dmin = _f16_field(blocks, 0), _f16_field(blocks, 2)  # [B, 1] each
    sc, m = _scale_min_table(blocks[:, 4:16])  # [B, 8] each
    q = _planes(blocks[:, 16:144], run=32, bits=4)  # [B, 256]
    return _affine(d, sc, q, dmin, m, sub=32)


@njit(cache=True)
def decode_q4_k(src, out):
    """n blocks of Q4_K (uint8 [n*144]) -> float32 [n*256]."""
    for b in range(src.shape[0] // Q4_K_SIZE):
        s, o = b * Q4_K_SIZE, b * QK_K
        d, dmin = read_f16(src, s), read_f16(src, s + 2)
        for c in range(4):  # 32 bytes of qs -> sub-blocks 2c (low nibbles) and 2c+1 (high nibbles)
            sc0, m0 = get_scale_min(src, s + 4, 2 * c)
            sc1, m1 = get_scale_min(src, s + 4, 2 * c + 1)
            dl0, ml0 = d * np.float32(sc0), dmin * np.float32(m0)
            dl1, ml1 = d * np.float32(sc1), dmin * np.float32(m1)
            for l in range(32):
                x = src[s + 16 + 32 * c + l]
                out[o + 64 * c + l] = dl0 * np.float32(x & 15) - ml0
                out[o + 64 * c + 32 + l] = dl1 * np.float32(x >> 4) - ml1


# ----------------------------------------------------------------------------------------------------------------------
# Q5_K: 176 bytes, 5.5 bits/weight. 8 sub-blocks of 32 weights, affine. Q4_K plus a fifth bit.
#
#   offset  0 : d    fp16
#   offset  2 : dmin fp16
#   offset  4 : scales[12]  as Q4_K
#   offset 16 : qh[32]      bit 4 of each quant; qh[l] bit j -> weight 32j + l  (j 0..7, l 0..31)
#   offset 48 : qs[128]     low 4 bits, as Q4_K: qs[32c + l] low/high nibble -> weight 64c + l / 64c + 32 + l
#
#   w = (d * sc) * q - (dmin * m),  q in 0..31

Q5_K_SIZE = 176


def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 176] -> float32 [B, 256]."""
    d, dmin = _f16_field(blocks, 0), _f16_field(blocks, 2)  # [B, 1] each
    sc, m = _scale_min_table(blocks[:, 4:16])  # [B, 8] each
    high = _planes(blocks[:, 16:48], run=32, bits=1)  # [B, 256]
    low = _planes(blocks[:, 48:176], run=32, bits=4)  # [B, 256]
    return _affine(d, sc, low | (high << 4), dmin, m, sub=32)


@njit(cache=True)
def decode_q5_k(src, out):
    """n blocks of Q5_K (uint8 [n*176]) -> float32 [n*256]."""
    for b in range(src.shape[0] // Q5_K_SIZE):
        s, o = b * Q5_K_SIZE, b * QK_K
        d, dmin = read_f16(src, s), read_f16(src, s + 2)
        for c in range(4):
            sc0, m0 = get_scale_min(src, s + 4, 2 * c)
            sc1, m1 = get_scale_min(src, s + 4, 2 * c + 1)
            dl0, ml0 = d * np.float32(sc0), dmin * np.float32(m0)
            dl1, ml1 = d * np.float32(sc1), dmin * np.float32(m1)
            for l in range(32):
                x = np.int64(src[s + 48 + 32 * c + l])
                hb = np.int64(src[s + 16 + l]) >> (2 * c)  # bits 2c, 2c+1: fifth bits of the two weights
                out[o + 64 * c + l] = dl0 * np.float32((x & 15) | ((hb & 1) << 4)) - ml0
                out[o + 64 * c + 32 + l] = dl1 * np.float32((x >> 4) | ((hb & 2) << 3)) - ml1


# ----------------------------------------------------------------------------------------------------------------------
# Q6_K: 210 bytes, 6.5625 bits/weight. 16 sub-blocks of 16 weights, symmetric.
#
#   offset   0 : ql[128]    low 4 bits; ql[64h + l] low nibble -> weight 128h + l, high nibble -> 128h + 64 + l
#                           (h 0..1, l 0..63)
#   offset 128 : qh[64]     high 2 bits; qh[32h + l] bits 2j..2j+1 -> weight 128h + 32j + l  (j 0..3, l 0..31)
#   offset 192 : scales[16] int8, one per sub-block (signed: may be negative)
#   offset 208 : d fp16
#
#   q = (low 4 | high 2 << 4) - 32  in -32..31;  w = (d * scale) * q; the sub-block of weight k is k // 16

Q6_K_SIZE = 210


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 210] -> float32 [B, 256]."""
    low = _planes(blocks[:, 0:128], run=64, bits=4)  # [B, 256]
    high = _planes(blocks[:, 128:192], run=32, bits=2)  # [B, 256]
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)  # [B, 256] in -32..31
    scales = blocks[:, 192:208].view(np.int8)  # [B, 16]
    d = _f16_field(blocks, 208)  # [B, 1]
    return _symmetric(d, scales, q, sub=16)


@njit(cache=True, inline="always")
def _int8_at(src, i):
    """The byte at src[i] read as a two's-complement int8."""
    v = np.int64(src[i])
    return v - 256 if v > 127 else v


@njit(cache=True)
def decode_q6_k(src, out):
    """n blocks of Q6_K (uint8 [n*210]) -> float32 [n*256]."""
    for b in range(src.shape[0] // Q6_K_SIZE):
        s, o = b * Q6_K_SIZE, b * QK_K
        d = read_f16(src, s + 208)
        for h in range(2):  # weights 128h .. 128h+127: ql[64h : 64h+64], qh[32h : 32h+32], scales[8h : 8h+8]
            for g in range(2):  # l = 16g .. 16g+15 share their 4 sub-blocks 8h + 2j + g
                sc = s + 192 + 8 * h + g
                dl0 = d * np.float32(_int8_at(src, sc))
                dl1 = d * np.float32(_int8_at(src, sc + 2))
                dl2 = d * np.float32(_int8_at(src, sc + 4))
                dl3 = d * np.float32(_int8_at(src, sc + 6))
                for l in range(16 * g, 16 * g + 16):
                    a = np.int64(src[s + 64 * h + l])  # low nibbles of weights +0 / +64
                    c = np.int64(src[s + 64 * h + 32 + l])  # low nibbles of weights +32 / +96
                    hb = np.int64(src[s + 128 + 32 * h + l])  # high 2 bits of all four
                    base = o + 128 * h + l
                    out[base] = dl0 * np.float32(((a & 15) | ((hb & 3) << 4)) - 32)
                    out[base + 32] = dl1 * np.float32(((c & 15) | (((hb >> 2) & 3) << 4)) - 32)
                    out[base + 64] = dl2 * np.float32(((a >> 4) | (((hb >> 4) & 3) << 4)) - 32)
                    out[base + 96] = dl3 * np.float32(((c >> 4) | ((hb >> 6) << 4)) - 32)


# ----------------------------------------------------------------------------------------------------------------------
# Registry

for _qtype, _size, _ref, _decode in (
    (QType.Q2_K, Q2_K_SIZE, dequantize_q2_k, decode_q2_k),
    (QType.Q3_K, Q3_K_SIZE, dequantize_q3_k, decode_q3_k),
    (QType.Q4_K, Q4_K_SIZE, dequantize_q4_k, decode_q4_k),
    (QType.Q5_K, Q5_K_SIZE, dequantize_q5_k, decode_q5_k),
    (QType.Q6_K, Q6_K_SIZE, dequantize_q6_k, decode_q6_k),
):
    register(QuantFormat(_qtype, QK_K, _size, _ref, _decode, QUANTIZERS.get(_qtype)))
