"""The "legacy" GGML block formats Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (32 weights per block).

What this is: for each format, its bit layout drawn once, a NumPy reference dequantizer (`dequantize_*`, bit-exact
with `gguf.dequantize`: same float32 operations in the same order), its Numba twin (`decode_*`, used by the fused
kernels in `kernels.py`) and a quantizer that wraps gguf-py's (which matches ggml-quants.c).
What this is not: the K-quants (`kquants.py`), nor any matrix code (`kernels.py`).

Numerics, shared by all five: a weight is an integer code q times a per-block scale d (fp16), plus for the "_1"
types a per-block offset m (fp16). In float32, `d * float(q)` is one rounding and `d * float(q) + m` is two (no
fused multiply-add): the references and the Numba twins do exactly that, which is what gguf-py and ggml's scalar
code do, so the results are bit-identical.

Nibble order: the 32 weights of a 4-bit block are packed as qs[j] = w[j] | w[j + 16] << 4 (low nibbles hold the
first half of the block, high nibbles the second half), not as neighbouring pairs.
"""
from __future__ import annotations

import gguf
import numpy as np
from numba import njit

from . import QType, QuantFormat, register
from .floats import read_f16

QK = 32  # weights per block, all five formats
HALF = QK // 2  # 16: one byte of qs holds weight j (low nibble) and weight j + 16 (high nibble)


# ----------------------------------------------------------------------------------------------------------------
# NumPy field readers (vectorised over blocks)
# ----------------------------------------------------------------------------------------------------------------
def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of every block: uint8 [B, type_size] -> float32 [B, 1]."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view("<f2").astype(np.float32)  # [B, 1]


def nibbles(qs: np.ndarray) -> np.ndarray:
    """Packed 4-bit codes uint8 [B, 16] -> uint8 [B, 32] in weight order: low nibbles first, then high nibbles."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)  # [B, 32]


def high_bits(qh: np.ndarray) -> np.ndarray:
    """The 5th bit of each weight: qh uint8 [B, 4] (a little-endian uint32, bit j -> weight j) -> uint8 [B, 32]."""
    return np.unpackbits(qh, axis=1, bitorder="little")  # [B, 32]: byte k bit b -> weight 8k + b


# ----------------------------------------------------------------------------------------------------------------
# Q8_0: 34 bytes, 32 weights, w[j] = d * qs[j]
#
#   byte   0-1        2 ... 33
#          d (fp16)   qs[0..31]  (int8, two's complement, one weight per byte)
# ----------------------------------------------------------------------------------------------------------------
def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 34] -> float32 [B, 32]."""
    d = f16_field(blocks, 0)  # [B, 1]
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [B, 32]
    return q * d  # [B, 32]


@njit(cache=True)
def decode_q8_0(src, out):
    for b in range(src.shape[0] // 34):
        s, o = 34 * b, QK * b  # first byte of the block in src, first weight in out
        d = read_f16(src, s)
        for j in range(QK):
            q = np.int64(src[s + 2 + j])
            if q >= 128:  # reinterpret the byte as int8
                q -= 256
            out[o + j] = np.float32(q) * d


# ----------------------------------------------------------------------------------------------------------------
# Q4_0: 18 bytes, 32 weights, w = d * (q - 8) with q a 4-bit code in 0..15
#
#   byte   0-1        2 ... 17
#          d (fp16)   qs[0..15]: qs[j] = q[j] | q[j + 16] << 4
#                                bits 7..4 = q[j + 16], bits 3..0 = q[j]
# ----------------------------------------------------------------------------------------------------------------
def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 18] -> float32 [B, 32]."""
    d = f16_field(blocks, 0)  # [B, 1]
    q = nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)  # [B, 32] in -8..7
    return d * q.astype(np.float32)  # [B, 32]


@njit(cache=True)
def decode_q4_0(src, out):
    for b in range(src.shape[0] // 18):
        s, o = 18 * b, QK * b
        d = read_f16(src, s)
        for j in range(HALF):
            byte = np.int64(src[s + 2 + j])
            out[o + j] = d * np.float32((byte & 0x0F) - 8)
            out[o + j + HALF] = d * np.float32((byte >> 4) - 8)


# ----------------------------------------------------------------------------------------------------------------
# Q4_1: 20 bytes, 32 weights, w = d * q + m with q in 0..15
#
#   byte   0-1        2-3        4 ... 19
#          d (fp16)   m (fp16)   qs[0..15]: qs[j] = q[j] | q[j + 16] << 4
# ----------------------------------------------------------------------------------------------------------------
def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 20] -> float32 [B, 32]."""
    d = f16_field(blocks, 0)  # [B, 1]
    m = f16_field(blocks, 2)  # [B, 1]
    q = nibbles(blocks[:, 4:]).astype(np.float32)  # [B, 32] in 0..15
    return (d * q) + m  # [B, 32]


@njit(cache=True)
def decode_q4_1(src, out):
    for b in range(src.shape[0] // 20):
        s, o = 20 * b, QK * b
        d = read_f16(src, s)
        m = read_f16(src, s + 2)
        for j in range(HALF):
            byte = np.int64(src[s + 4 + j])
            out[o + j] = d * np.float32(byte & 0x0F) + m
            out[o + j + HALF] = d * np.float32(byte >> 4) + m


# ----------------------------------------------------------------------------------------------------------------
# Q5_0: 22 bytes, 32 weights, w = d * (q - 16) with q a 5-bit code in 0..31
#
#   byte   0-1        2-5                      6 ... 21
#          d (fp16)   qh (uint32, little-end)  qs[0..15]: qs[j] = low4(q[j]) | low4(q[j + 16]) << 4
#                     bit j of qh = bit 4 of q[j]   (j = 0..31)
# ----------------------------------------------------------------------------------------------------------------
def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 22] -> float32 [B, 32]."""
    d = f16_field(blocks, 0)  # [B, 1]
    q = nibbles(blocks[:, 6:]) | (high_bits(blocks[:, 2:6]) << np.uint8(4))  # [B, 32] in 0..31
    return d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)  # [B, 32]


@njit(cache=True)
def decode_q5_0(src, out):
    for b in range(src.shape[0] // 22):
        s, o = 22 * b, QK * b
        d = read_f16(src, s)
        qh = (np.int64(src[s + 2]) | (np.int64(src[s + 3]) << 8)
              | (np.int64(src[s + 4]) << 16) | (np.int64(src[s + 5]) << 24))
        for j in range(HALF):
            byte = np.int64(src[s + 6 + j])
            lo = (byte & 0x0F) | (((qh >> j) & 1) << 4)
            hi = (byte >> 4) | (((qh >> (j + HALF)) & 1) << 4)
            out[o + j] = d * np.float32(lo - 16)
            out[o + j + HALF] = d * np.float32(hi - 16)


# ----------------------------------------------------------------------------------------------------------------
# Q5_1: 24 bytes, 32 weights, w = d * q + m with q in 0..31
#
#   byte   0-1        2-3        4-7                      8 ... 23
#          d (fp16)   m (fp16)   qh (uint32, little-end)  qs[0..15]: low 4 bits, same packing as Q5_0
# ----------------------------------------------------------------------------------------------------------------
def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 24] -> float32 [B, 32]."""
    d = f16_field(blocks, 0)  # [B, 1]
    m = f16_field(blocks, 2)  # [B, 1]
    q = nibbles(blocks[:, 8:]) | (high_bits(blocks[:, 4:8]) << np.uint8(4))  # [B, 32] in 0..31
    return (d * q.astype(np.float32)) + m  # [B, 32]


@njit(cache=True)
def decode_q5_1(src, out):
    for b in range(src.shape[0] // 24):
        s, o = 24 * b, QK * b
        d = read_f16(src, s)
        m = read_f16(src, s + 2)
        qh = (np.int64(src[s + 4]) | (np.int64(src[s + 5]) << 8)
              | (np.int64(src[s + 6]) << 16) | (np.int64(src[s + 7]) << 24))
        for j in range(HALF):
            byte = np.int64(src[s + 8 + j])
            lo = (byte & 0x0F) | (((qh >> j) & 1) << 4)
            hi = (byte >> 4) | (((qh >> (j + HALF)) & 1) << 4)
            out[o + j] = d * np.float32(lo) + m
            out[o + j + HALF] = d * np.float32(hi) + m


# ----------------------------------------------------------------------------------------------------------------
# Quantizers: gguf-py's, which reproduce ggml-quants.c's reference quantizers (round-to-nearest per block).
# ----------------------------------------------------------------------------------------------------------------
def gguf_quantizer(qtype: QType):
    """float32 [B, 32] -> uint8 [B, type_size] through `gguf.quantize`."""
    def quantize(w: np.ndarray) -> np.ndarray:
        return gguf.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)  # [B, type_size]
    quantize.__name__ = f"quantize_{qtype.name.lower()}"
    return quantize


Q8_0 = register(QuantFormat(QType.Q8_0, QK, 34, dequantize_q8_0, decode_q8_0, gguf_quantizer(QType.Q8_0)))
Q4_0 = register(QuantFormat(QType.Q4_0, QK, 18, dequantize_q4_0, decode_q4_0, gguf_quantizer(QType.Q4_0)))
Q4_1 = register(QuantFormat(QType.Q4_1, QK, 20, dequantize_q4_1, decode_q4_1, gguf_quantizer(QType.Q4_1)))
Q5_0 = register(QuantFormat(QType.Q5_0, QK, 22, dequantize_q5_0, decode_q5_0, gguf_quantizer(QType.Q5_0)))
Q5_1 = register(QuantFormat(QType.Q5_1, QK, 24, dequantize_q5_1, decode_q5_1, gguf_quantizer(QType.Q5_1)))
