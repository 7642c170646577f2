"""MXFP4 (ggml type 39), gpt-oss's expert format, and NVFP4 (type 40): FP4 E2M1 codes with power-of-two-ish scales.

What this is: the layout (scale, code) in the form quant/layout.py compiles to the NumPy reference, the Numba CPU
decoder and the CUDA decoder. Definition: OCP Microscaling (MX) v1.0's MXFP4, as llama.cpp stores it
(ggml-common.h `block_mxfp4`, ggml-impl.h `ggml_e8m0_to_fp32_half`, ggml-quants.c `dequantize_row_mxfp4`, in the
llama.cpp that llama-cpp-python 0.3.36 vendors); tests/test_iquants.py holds it bit-exact to gguf-py and to ggml.
What this is not: a quantizer (gpt-oss ships MXFP4 weights; llama.cpp's MXFP4_MOE ftype writes the test files).

Layout (one block = 32 weights):

   byte   0          1 ... 16
          e (E8M0)   qs[16]: weight j < 16 in the low nibble of qs[j], weight j + 16 in the high nibble

   a nibble is an FP4 E2M1 number: sign bit, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
   negatives. llama.cpp stores them doubled, as integers (KVALUES_FP4 = 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ... -12),
   and halves the scale instead:  w = KVALUES_FP4[q] * 2^(e - 128)   (E8M0: a bare exponent with bias 127, halved)

Numerics: 2^(e - 128) is a power of two for every byte e (e = 0 and 1 give float32 subnormals 2^-128, 2^-127, as
ggml's bit patterns 0x00200000, 0x00400000 do), and an integer times a power of two is exact unless it overflows.

NVFP4 (NVIDIA's FP4: 64 weights in 36 bytes, 4.5 bits per weight; ggml-common.h `block_nvfp4`, ggml-impl.h
`ggml_ue4m3_to_fp32`, ggml-quants.c `dequantize_row_nvfp4`):

   bytes 0-3: d[4], one UE4M3 scale per 16 weights   bytes 4-35: qs[32], 8 bytes per 16 weights: weight j < 8 of
   sub-block g in the low nibble of qs[8g + j], weight j + 8 in the high nibble
   UE4M3 byte x: e = bits 3-6, m = bits 0-2 (bit 7 ignored): m 2^-9 if e = 0, else (1 + m/8) 2^(e-7); ggml halves
   it (the codes are doubled) and reads the byte 0x7F as 0.   w = KVALUES_FP4[q] * scale
   Every scale is a small integer times a power of two, so the product, like MXFP4's, is exact.
"""
from __future__ import annotations

import numpy as np

from . import QType, QuantFormat, register
from .layout import F32_ZERO, Layout, decoder, pick, pow2_scalar as pow2, reference, u8  # noqa: F401 (bound per target)

KVALUES_FP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int64)  # [16] 2 x E2M1


def mxfp4_scale(src, s, g):
    return pow2(u8(src, s) - 128), F32_ZERO


def mxfp4_code(src, s, k):
    return np.float32(KVALUES_FP4[(u8(src, s + 1 + (k & 15)) >> (4 * (k >> 4))) & 15])


def nvfp4_scale(src, s, g):
    x = u8(src, s + g)
    e, m = (x >> 3) & 15, x & 7
    mantissa = pick(e == 0, m, 8 + m)  # the significand as an integer: m (subnormal) or 8 + m (1.m in eighths)
    exponent = pick(e == 0, -10, e - 11)  # its power of two, ggml's halving included: m 2^-9 / 2, (8 + m) 2^(e-10) / 2
    return np.float32(1 - np.int64(x == 0x7F)) * np.float32(mantissa) * pow2(exponent), F32_ZERO


def nvfp4_code(src, s, k):
    g, j = k >> 4, k & 15  # sub-block of 16, weight in it
    return np.float32(KVALUES_FP4[(u8(src, s + 4 + 8 * g + (j & 7)) >> (4 * (j >> 3))) & 15])


LAYOUT = Layout("MXFP4", 32, 17, 32, mxfp4_scale, mxfp4_code)
NVFP4_LAYOUT = Layout("NVFP4", 64, 36, 16, nvfp4_scale, nvfp4_code)
MXFP4 = register(QuantFormat(QType.MXFP4, 32, 17, reference(LAYOUT), decoder(LAYOUT), None, LAYOUT))
NVFP4 = register(QuantFormat(QType.NVFP4, 64, 36, reference(NVFP4_LAYOUT), decoder(NVFP4_LAYOUT), None, NVFP4_LAYOUT))
