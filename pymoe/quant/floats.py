"""Float tensor types F32, F16, BF16, and the shared fp16 -> fp32 conversion `f16_to_f32`.

What this is: the three GGML float formats seen as "quant formats" with one weight per block (QK = 1), so the
fused kernels in `kernels.py` treat them exactly like the block-quantized types; plus `f16_to_f32`, the one place
where pymoe's Numba code turns an IEEE half-precision bit pattern into a float32 (every fp16 scale field of the
legacy and K-quant blocks goes through it).
What this is not: a conversion library. Rounding to fp16/bf16 is gguf-py's (`gguf.quantize`), and NaN payloads are
not preserved by `f16_to_f32` (no real weight or scale is NaN; the NumPy references do preserve them).

The decode_block functions here read every multi-byte field byte by byte (little-endian), so a block may start at
any byte address: no alignment assumption anywhere.
"""
from __future__ import annotations

import gguf
import numpy as np
from numba import njit

from . import QType, QuantFormat, register

# ----------------------------------------------------------------------------------------------------------------
# fp16 -> fp32, one scalar at a time (Numba)
#
#   fp16 bits:  s eeeee mmmmmmmmmm        value = (-1)^s * 2^(e-15) * (1 + m/1024)   for 1 <= e <= 30
#               15 14-10   9-0                    (-1)^s * 2^-14  * (m/1024)         for e == 0 (subnormal, zero)
#                                                 +-inf (m == 0) / NaN (m != 0)      for e == 31
#
# Every finite fp16 is exactly representable in float32 and each product below is a power-of-two scaling of an
# integer < 2^11, so the result is exact: bit-identical with NumPy's float16 -> float32 cast (tested over all 65536
# patterns). Plain integer and float arithmetic, no table and no libm call, so the same code could run on a GPU.
# ----------------------------------------------------------------------------------------------------------------
_TWO_POW_M24 = np.float32(2.0 ** -24)  # weight of the last mantissa bit of a subnormal fp16
_TWO_POW_M25 = np.float32(2.0 ** -25)  # 2^(e-15) * 2^-10, with the 2^e factor applied as an integer shift


@njit(cache=True)
def f16_to_f32(h):
    """IEEE binary16 bits (an integer in 0..65535, e.g. uint16) -> float32 value (exact; NaN payload not kept)."""
    h = np.int64(h)
    sign = (h >> 15) & 0x1
    exponent = (h >> 10) & 0x1F
    mantissa = h & 0x3FF
    if exponent == 0:  # zero or subnormal: m * 2^-24
        magnitude = np.float32(mantissa) * _TWO_POW_M24
    elif exponent == 31:  # inf or NaN
        magnitude = np.float32(np.inf) if mantissa == 0 else np.float32(np.nan)
    else:  # normal: (1024 + m) * 2^e * 2^-25
        magnitude = np.float32(1024 + mantissa) * np.float32(1 << exponent) * _TWO_POW_M25
    return -magnitude if sign else magnitude


@njit(cache=True)
def read_f16(src, i):
    """The float32 value of the little-endian fp16 field at byte offset i of a uint8 array."""
    return f16_to_f32(np.int64(src[i]) | (np.int64(src[i + 1]) << 8))


# ----------------------------------------------------------------------------------------------------------------
# F32: one little-endian IEEE binary32 per "block".
#
#   byte:  0        1        2        3
#          mmmmmmmm mmmmmmmm emmmmmmm seeeeeee      (4 bytes, 1 weight)
#
# The reference is a reinterpretation of the bytes. The Numba twin assembles the 32 bits from the 4 bytes and
# stores them through a uint32 view of the (aligned, pymoe-owned) output buffer: a bit copy, exact for every value.
# ----------------------------------------------------------------------------------------------------------------
def dequantize_f32(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 4] -> float32 [B, 1]."""
    return np.ascontiguousarray(blocks).view("<f4").astype(np.float32, copy=False)  # [B, 1]


@njit(cache=True)
def decode_f32(src, out):
    bits = out.view(np.uint32)  # [n] the output's bytes, written as whole 32-bit patterns
    for j in range(out.shape[0]):
        i = 4 * j
        bits[j] = (np.uint32(src[i]) | (np.uint32(src[i + 1]) << 8)
                   | (np.uint32(src[i + 2]) << 16) | (np.uint32(src[i + 3]) << 24))


def quantize_f32(w: np.ndarray) -> np.ndarray:
    """float32 [B, 1] -> uint8 [B, 4]."""
    return np.ascontiguousarray(gguf.quantize(w, QType.F32), dtype="<f4").view(np.uint8)  # [B, 4]


# ----------------------------------------------------------------------------------------------------------------
# F16: one little-endian IEEE binary16 per "block".
#
#   byte:  0        1
#          mmmmmmmm seeeeemm      (2 bytes, 1 weight)
# ----------------------------------------------------------------------------------------------------------------
def dequantize_f16(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 2] -> float32 [B, 1]."""
    return np.ascontiguousarray(blocks).view("<f2").astype(np.float32)  # [B, 1]


@njit(cache=True)
def decode_f16(src, out):
    for j in range(out.shape[0]):
        out[j] = read_f16(src, 2 * j)


def quantize_f16(w: np.ndarray) -> np.ndarray:
    """float32 [B, 1] -> uint8 [B, 2] (round to nearest even, by NumPy's cast)."""
    return np.ascontiguousarray(gguf.quantize(w, QType.F16), dtype="<f2").view(np.uint8)  # [B, 2]


# ----------------------------------------------------------------------------------------------------------------
# BF16: the top 16 bits of a float32 (same sign and 8-bit exponent, mantissa cut to 7 bits).
#
#   byte:  0        1
#          emmmmmmm seeeeeee      (2 bytes, 1 weight)   float32 bits = bf16 bits << 16
# ----------------------------------------------------------------------------------------------------------------
def dequantize_bf16(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 2] -> float32 [B, 1]: widen to 32 bits and shift into the high half."""
    bits16 = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32)  # [B, 1]
    return (bits16 << np.uint32(16)).view(np.float32)  # [B, 1]


@njit(cache=True)
def decode_bf16(src, out):
    bits = out.view(np.uint32)  # [n]
    for j in range(out.shape[0]):
        i = 2 * j
        bits[j] = (np.uint32(src[i]) | (np.uint32(src[i + 1]) << 8)) << 16


def quantize_bf16(w: np.ndarray) -> np.ndarray:
    """float32 [B, 1] -> uint8 [B, 2] (round to nearest even, NaN kept quiet: ggml_compute_fp32_to_bf16)."""
    return np.ascontiguousarray(gguf.quantize(w, QType.BF16)).view(np.uint8).reshape(-1, 2)  # [B, 2]


F32 = register(QuantFormat(QType.F32, 1, 4, dequantize_f32, decode_f32, quantize_f32))
F16 = register(QuantFormat(QType.F16, 1, 2, dequantize_f16, decode_f16, quantize_f16))
BF16 = register(QuantFormat(QType.BF16, 1, 2, dequantize_bf16, decode_bf16, quantize_bf16))
