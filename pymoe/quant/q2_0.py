"""Q2_0 (ggml type 42): 64 weights in 18 bytes, 2.25 bits per weight, the expert type of the reference article.

What this is: the layout drawn once, the NumPy reference dequantizer (`dequantize_q2_0`), its Numba twin
(`decode_q2_0`, used by the fused kernels in `kernels.py`) and the quantizer (`quantize_q2_0`), a NumPy restatement of
llama.cpp's `quantize_row_q2_0_ref`. The definition is llama.cpp's ggml-quants.c (`dequantize_row_q2_0`,
`quantize_row_q2_0_ref`) and ggml-common.h (`block_q2_0`), read in the llama.cpp that llama-cpp-python 0.3.36
vendors; tests/test_q2_0.py holds the reference bit-exact to that library's `dequantize_row_q2_0` and the quantizer
byte-identical to its `quantize_row_q2_0_ref`. gguf-py 0.19 does not know the type: `ggml_types.py` registers it.
What this is not: the integer dot product (quant/qact.py, section 3b: the CPU's default path for Q2_0 rows of
whole 256-weight runs; the float kernels remain its reference).

Layout (one block = 64 weights):

   byte   0-1        2          3          ...   17
          d (fp16)   qs[0]      qs[1]            qs[15]
                     |33|22|11|00|  weights 4i+3 | 4i+2 | 4i+1 | 4i   in byte qs[i]
                     bits 7-6 5-4 3-2 1-0

   weight j (0..63) is the 2-bit code q = (qs[j / 4] >> 2 * (j % 4)) & 3, and  w = (q - 1) * d:
   codes 0, 1, 2, 3 -> -d, 0, +d, +2d   (one zero level, asymmetric: one more level above zero than below)

Numerics: the C dequantizer computes `((int)q - 1) * d` in float32: one product of a small integer and the fp16
scale, exact. The reference and the Numba twin do the same, so zeros keep the sign IEEE gives them (0 * -d = -0).

The reference quantizer (llama.cpp's, so the bytes are the same): d = max |x| of the block (stored as fp16),
q = clamp(roundf(x / d) + 1, 0, 3) with roundf rounding halves away from zero and x / d computed as x * (1/d) in
float32 with the *unrounded* d. Since |x| <= d, roundf gives -1, 0 or +1: the quantizer never writes code 3 (+2d),
which only a smarter quantizer (or another tool) would use. Everything above d/2 in magnitude becomes +-d, the rest 0:
a ternary code with a large step: relative RMS error 0.716 on Gaussian blocks, 0.686 on Student-t(3) ones (Q2_K:
0.296; measured in tests/test_q2_0.py). The format could do better with a fitted scale; the bytes would then no longer
be llama.cpp's.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import QType, QuantFormat, register
from .floats import read_f16
from .quantize import fp16_bytes, to_fp16

QK = 64  # weights per block
TYPE_SIZE = 2 + QK // 4  # 18 bytes: fp16 d + 16 bytes of 2-bit codes
SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)  # bit offset of weight 4i + k inside qs[i], k = 0..3


# ----------------------------------------------------------------------------------------------------------------
# Reference dequantizer (NumPy, vectorised over blocks) and its Numba twin
# ----------------------------------------------------------------------------------------------------------------
def dequantize_q2_0(blocks: np.ndarray) -> np.ndarray:
    """uint8 [B, 18] -> float32 [B, 64]."""
    d = np.ascontiguousarray(blocks[:, 0:2]).view("<f2").astype(np.float32)  # [B, 1]
    q = (blocks[:, 2:, None] >> SHIFTS) & np.uint8(3)  # [B, 16, 4]: byte i, code k -> weight 4i + k
    q = q.reshape(-1, QK).astype(np.int8) - np.int8(1)  # [B, 64] in -1..2
    return q.astype(np.float32) * d  # [B, 64]


@njit(cache=True)
def decode_q2_0(src, out):
    for b in range(src.shape[0] // TYPE_SIZE):
        s, o = TYPE_SIZE * b, QK * b  # first byte of the block in src, first weight in out
        d = read_f16(src, s)
        for i in range(QK // 4):
            byte = np.int64(src[s + 2 + i])
            for k in range(4):
                out[o + 4 * i + k] = np.float32(((byte >> (2 * k)) & 3) - 1) * d


# ----------------------------------------------------------------------------------------------------------------
# Quantizer: llama.cpp's quantize_row_q2_0_ref, step by step
# ----------------------------------------------------------------------------------------------------------------
def roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf on float32: to the nearest integer, halves away from zero (np.rint rounds halves to even).

    `v - trunc(v)` is exact in float32 (the fraction's bits are a subset of v's), so the test `>= 0.5` is exact;
    `floor(|v| + 0.5)` would not be (0.49999997 + 0.5 rounds up to 1.0 in float32).
    """
    whole = np.trunc(v)
    up = np.abs(v - whole) >= np.float32(0.5)
    return np.where(up, whole + np.sign(v), whole).astype(np.float32)


def quantize_q2_0(w: np.ndarray) -> np.ndarray:
    """float32 [B, 64] -> uint8 [B, 18] (llama.cpp quantize_row_q2_0_ref; NaN inputs are not handled)."""
    x = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, QK)  # [B, 64]
    amax = np.abs(x).max(axis=1, initial=np.float32(0))  # [B]  the C loop starts from 0 and keeps the max
    d16, _ = to_fp16(amax)  # [B]  stored scale: round to nearest even
    inv = np.where(amax > 0, np.float32(1) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))  # [B] float32
    q = np.clip(roundf(x * inv[:, None]) + np.float32(1), 0, 3).astype(np.uint8)  # [B, 64] codes 0..2 (3 unused)
    qs = (q.reshape(-1, QK // 4, 4) << SHIFTS).sum(axis=2, dtype=np.uint8)  # [B, 16]  disjoint bits: sum == or
    return np.concatenate([fp16_bytes(d16), qs], axis=1)  # [B, 18]


Q2_0 = register(QuantFormat(QType.Q2_0, QK, TYPE_SIZE, dequantize_q2_0, decode_q2_0, quantize_q2_0))
