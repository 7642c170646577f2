"""TQ1_0 and TQ2_0 (ggml types 34, 35): ternary weights {-d, 0, +d} for BitNet-style models; Q1_0 (41): binary.

What this is: the two layouts (scale, code) in the form quant/layout.py compiles to the NumPy reference, the Numba
CPU decoder and the CUDA decoder. Definition: llama.cpp's ggml-common.h (`block_tq1_0`, `block_tq2_0`) and
ggml-quants.c (`dequantize_row_tq1_0`, `dequantize_row_tq2_0`), llama-cpp-python 0.3.36's vendored copy;
tests/test_iquants.py holds both bit-exact to gguf-py and to ggml. Every weight is  w = (t - 1) * d,  t in {0, 1, 2}.
What this is not: a quantizer (llama.cpp's TQ1_0 / TQ2_0 ftypes write the test files).

TQ2_0: 66 bytes, 2.06 bpw: two bits per weight, like Q2_0 but in K-quant order.

   bytes 0-63: qs[64]: weight 128c + 32l + m (c = 0, 1; l = 0..3; m = 0..31) in bits 2l, 2l+1 of qs[32c + m]
   bytes 64-65: d (fp16)

TQ1_0: 54 bytes, 1.69 bpw: five ternary digits per byte (3^5 = 243 <= 256), stored as a fixed-point fraction.

   bytes 0-47: qs[48]   bytes 48-51: qh[4]   bytes 52-53: d (fp16)
   qs[0..31]  hold weights 32n + m        (n = 0..4 digit, m = 0..31 byte)      -> weights 0..159
   qs[32..47] hold weights 160 + 16n + m  (m = 0..15)                           -> weights 160..239
   qh[0..3]   hold weights 240 + 4n + m   (n = 0..3, m = 0..3)                  -> weights 240..255
   digit n of byte q:  t = ((q * 3^n mod 256) * 3) >> 8     (the byte is  ceil(256 * 0.t0 t1 t2 t3 t4 (base 3)):
   multiplying by 3^n shifts digit n to the front, keeping the byte's low 8 bits; * 3 >> 8 reads it off)

Q1_0: 128 weights in 18 bytes, 1.125 bpw (ggml-common.h `block_q1_0`, ggml-quants.c `dequantize_row_q1_0`):

   bytes 0-1: d (fp16)   bytes 2-17: qs[16]: weight j is bit j % 8 of qs[j / 8];  w = +d if the bit is set, else -d
"""
from __future__ import annotations

import numpy as np

from . import QType, QuantFormat, register
from .layout import F32_ZERO, Layout, decoder, pick, read_f16, reference, u8  # noqa: F401 (bound per target)

QK_K = 256
POW3 = np.array([1, 3, 9, 27, 81, 243], dtype=np.int64)


def tq2_0_scale(src, s, g):
    return read_f16(src, s + 64), F32_ZERO


def tq2_0_code(src, s, k):
    c, l, m = k >> 7, (k >> 5) & 3, k & 31
    return np.float32(((u8(src, s + 32 * c + m) >> (2 * l)) & 3) - 1)


def tq1_0_scale(src, s, g):
    return read_f16(src, s + 52), F32_ZERO


def tq1_0_code(src, s, k):
    in_tail = k >= 240  # qh
    in_mid = (k >= 160) & (k < 240)  # qs[32..47]
    byte = pick(in_tail, 48 + ((k - 240) & 3), pick(in_mid, 32 + ((k - 160) & 15), k & 31))
    digit = pick(in_tail, (k - 240) >> 2, pick(in_mid, (k - 160) >> 4, k >> 5))
    q = (u8(src, s + byte) * POW3[digit]) & 255
    return np.float32(((q * 3) >> 8) - 1)


def q1_0_scale(src, s, g):
    return read_f16(src, s), F32_ZERO


def q1_0_code(src, s, k):
    return np.float32(2 * ((u8(src, s + 2 + (k >> 3)) >> (k & 7)) & 1) - 1)  # +1 or -1: d * -1 is exactly -d


TQ1_0_LAYOUT = Layout("TQ1_0", QK_K, 54, QK_K, tq1_0_scale, tq1_0_code)
TQ2_0_LAYOUT = Layout("TQ2_0", QK_K, 66, QK_K, tq2_0_scale, tq2_0_code)
Q1_0_LAYOUT = Layout("Q1_0", 128, 18, 128, q1_0_scale, q1_0_code)
Q1_0 = register(QuantFormat(QType.Q1_0, 128, 18, reference(Q1_0_LAYOUT), decoder(Q1_0_LAYOUT), None, Q1_0_LAYOUT))
TQ1_0 = register(QuantFormat(QType.TQ1_0, QK_K, 54, reference(TQ1_0_LAYOUT), decoder(TQ1_0_LAYOUT), None, TQ1_0_LAYOUT))
TQ2_0 = register(QuantFormat(QType.TQ2_0, QK_K, 66, reference(TQ2_0_LAYOUT), decoder(TQ2_0_LAYOUT), None, TQ2_0_LAYOUT))
