"""The IQ family: IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M -- codebook ("grid") quants.

What this is: each type's byte diagram and its layout (scale, code) in the form quant/layout.py compiles to the NumPy
reference, the Numba CPU decoder and the CUDA decoder. The definitions are llama.cpp's ggml-common.h (`block_iq*`,
the grids) and ggml-quants.c (`dequantize_row_iq*`), read in the llama.cpp that llama-cpp-python 0.3.36 vendors;
tests/test_iquants.py holds every type bit-exact to gguf-py's `gguf.dequantize` and to that library's own
`dequantize_row_*`. The grids are in data/ggml_grids.npz, written by tools/extract-ggml-grids from ggml-common.h.
What this is not: a quantizer (IQ quantization searches the grids with an importance matrix; the test files are
written by llama.cpp's own quantizer, tests/test_ftypes.py). The integer dots of IQ4_NL and IQ4_XS are in quant/qact.py
(section 3b), those of IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M in its section 3c (the grids as LLVM
constants).

The idea shared by IQ2/IQ3: weights come in groups of 8 (IQ2) or 4 (IQ3) whose *magnitudes* are one entry of a
fixed grid (IQ2_XXS: 256 entries of 8 bytes from {8, 25, 43}; IQ3_XXS: 256 entries of 4 bytes, ...), chosen by an
index of 8-10 bits, plus one sign bit per weight. Signs come 7 at a time: the 8th is implied, the number of minus
signs of a group of 8 being even (KSIGNS below expands 7 bits to 8: bit 7 = parity of the other 7). IQ1 grids hold
-1/0/+1 and a per-group shift of +-1/8 (`delta`); IQ4 is a 16-entry non-linear table (KVALUES_IQ4NL).
Float order (kept, so decoding is bit-exact): scales are `d * (0.5 + s) * 0.25` left to right (IQ2), the weight
`scale * grid` then the sign, which our `dl * (+-grid)` equals exactly in IEEE arithmetic.

Shape legend: B blocks, QK_K = 256 weights per super-block (IQ4_NL: 32), s = first byte of a block.
"""
from __future__ import annotations

import os

import numpy as np

from . import QType, QuantFormat, register
from .layout import F32_ZERO, Layout, decoder, reference

QK_K = 256
_GRIDS = np.load(os.path.join(os.path.dirname(__file__), "data", "ggml_grids.npz"))
# Flat tables (one byte per weight; entry i of a grid of width W is GRID[W * i : W * i + W]), global constants for
# Numba and the device.
IQ2XXS_GRID = _GRIDS["iq2xxs_grid"].astype(np.int64).reshape(-1)  # [256 * 8] magnitudes 8, 25, 43
IQ2XS_GRID = _GRIDS["iq2xs_grid"].astype(np.int64).reshape(-1)  # [512 * 8]
IQ2S_GRID = _GRIDS["iq2s_grid"].astype(np.int64).reshape(-1)  # [1024 * 8]
IQ3XXS_GRID = _GRIDS["iq3xxs_grid"].astype(np.int64).reshape(-1)  # [256 * 4] magnitudes 4, 12, ..., 62
IQ3S_GRID = _GRIDS["iq3s_grid"].astype(np.int64).reshape(-1)  # [512 * 4] magnitudes 1, 3, ..., 15
IQ1S_GRID = _GRIDS["iq1s_grid"].astype(np.int64).reshape(-1)  # [2048 * 8] values -1, 0, +1 (IQ1_S and IQ1_M)

# 7 sign bits -> 8: bit 7 is the parity of bits 0..6, so every group of 8 has an even number of minus signs
# (ggml-common.h's ksigns_iq2xs; tests/test_iquants.py checks this against it).
KSIGNS = np.array([i | (bin(i).count("1") & 1) << 7 for i in range(128)], dtype=np.int64)  # [128]
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int64)  # [16] IQ4's non-linear levels (ggml-common.h kvalues_iq4nl)
IQ1_DELTA = np.float32(0.125)  # IQ1S_DELTA = IQ1M_DELTA


def signed(magnitude, sign_bit):
    """+-magnitude as float32 (sign_bit 1 = minus)."""
    return np.float32(magnitude * (1 - 2 * sign_bit))


def iq4_nibble(src, i, k32):
    """4-bit index of weight k32 (0..31) of a 32-weight IQ4 group whose 16 bytes start at src[i]:
    byte k32 % 16, low nibble for k32 < 16, high nibble for k32 >= 16 (the Q4_0 order)."""
    return (u8(src, i + (k32 & 15)) >> (4 * (k32 >> 4))) & 15


# ================================================================================================================
# IQ4_NL (type 20): 32 weights, 18 bytes, 4.5 bpw
#
#   byte 0-1: d (fp16)    bytes 2-17: qs[16]  (weight j < 16: low nibble of qs[j]; weight j + 16: high nibble)
#   w = d * KVALUES_IQ4NL[q]
# ================================================================================================================
def iq4_nl_scale(src, s, g):
    return read_f16(src, s), F32_ZERO


def iq4_nl_code(src, s, k):
    return np.float32(KVALUES_IQ4NL[iq4_nibble(src, s + 2, k)])


# ================================================================================================================
# IQ4_XS (type 23): 256 weights, 136 bytes, 4.25 bpw
#
#   0-1: d (fp16)   2-3: scales_h (uint16: 2 high bits of the 6-bit scale of group g at bits 2g, 2g+1)
#   4-7: scales_l[4] (low 4 bits of group g's scale: nibble g % 2 of byte g / 2)   8-135: qs[128], 16 per group
#   group g of 32 weights (g = 0..7): dl = d * (ls - 32), ls the 6-bit scale;  w = dl * KVALUES_IQ4NL[q]
# ================================================================================================================
def iq4_xs_scale(src, s, g):
    ls = ((u8(src, s + 4 + (g >> 1)) >> (4 * (g & 1))) & 15) | (((u16(src, s + 2) >> (2 * g)) & 3) << 4)
    return read_f16(src, s) * np.float32(ls - 32), F32_ZERO


def iq4_xs_code(src, s, k):
    return np.float32(KVALUES_IQ4NL[iq4_nibble(src, s + 8 + 16 * (k >> 5), k & 31)])


# ================================================================================================================
# IQ2_XXS (type 16): 256 weights, 66 bytes, 2.06 bpw
#
#   0-1: d (fp16)   then 8 groups of 32 weights, 8 bytes each (group g at 2 + 8g):
#     bytes 0-3: four grid indices (uint8), one per run of 8 weights
#     bytes 4-7: uint32 aux: bits 7l..7l+6 = the 7 sign bits of run l (l = 0..3), bits 28-31 = the 4-bit scale s
#   dl = d * (0.5 + s) * 0.25;  weight 8l + j of the group = dl * IQ2XXS_GRID[index_l][j] * sign
# ================================================================================================================
def iq2_xxs_scale(src, s, g):
    aux = u32(src, s + 2 + 8 * g + 4)
    return read_f16(src, s) * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25), F32_ZERO


def iq2_xxs_code(src, s, k):
    g, l, j = k >> 5, (k >> 3) & 3, k & 7  # group, run of 8, weight in the run
    index = u8(src, s + 2 + 8 * g + l)
    signs = KSIGNS[(u32(src, s + 2 + 8 * g + 4) >> (7 * l)) & 127]
    return signed(IQ2XXS_GRID[8 * index + j], (signs >> j) & 1)


# ================================================================================================================
# IQ2_XS (type 17): 256 weights, 74 bytes, 2.31 bpw
#
#   0-1: d (fp16)   2-65: qs[32] uint16, one per run of 8 weights: bits 0-8 grid index (512 entries), bits 9-15 the
#   7 sign bits   66-73: scales[8], one byte per 32 weights: low nibble for its first 16 weights, high nibble for
#   the other 16
#   scale group of 16 weights g: dl = d * (0.5 + nibble) * 0.25;  w = dl * IQ2XS_GRID[index][j] * sign
# ================================================================================================================
def iq2_xs_scale(src, s, g):
    nibble = (u8(src, s + 66 + (g >> 1)) >> (4 * (g & 1))) & 15
    return read_f16(src, s) * (np.float32(0.5) + np.float32(nibble)) * np.float32(0.25), F32_ZERO


def iq2_xs_code(src, s, k):
    q = u16(src, s + 2 + 2 * (k >> 3))  # the run's uint16
    j = k & 7
    return signed(IQ2XS_GRID[8 * (q & 511) + j], (KSIGNS[q >> 9] >> j) & 1)


# ================================================================================================================
# IQ2_S (type 28): 256 weights, 82 bytes, 2.56 bpw
#
#   0-1: d (fp16)   2-33: qs[32], low 8 bits of the grid index of run r (= 8 weights)   34-65: signs[32], one
#   explicit byte of 8 sign bits per run   66-73: qh[8], per 32 weights: bits 2l, 2l+1 = bits 8-9 of run l's index
#   74-81: scales[8] as IQ2_XS.   index of run l of group g = qs[4g + l] | (qh[g] << (8 - 2l)) & 0x300 (1024 entries)
# ================================================================================================================
def iq2_s_scale(src, s, g):
    nibble = (u8(src, s + 74 + (g >> 1)) >> (4 * (g & 1))) & 15
    return read_f16(src, s) * (np.float32(0.5) + np.float32(nibble)) * np.float32(0.25), F32_ZERO


def iq2_s_code(src, s, k):
    g, l, j = k >> 5, (k >> 3) & 3, k & 7
    index = u8(src, s + 2 + 4 * g + l) | ((u8(src, s + 66 + g) << (8 - 2 * l)) & 0x300)
    return signed(IQ2S_GRID[8 * index + j], (u8(src, s + 34 + 4 * g + l) >> j) & 1)


# ================================================================================================================
# IQ3_XXS (type 18): 256 weights, 98 bytes, 3.06 bpw
#
#   0-1: d (fp16)   2-65: qs[64], grid indices, 8 per group of 32 (one per 4 weights)   66-97: 8 uint32 aux, one
#   per group: 4 x 7 sign bits (run l of 8 weights at bits 7l) and the 4-bit scale s in bits 28-31
#   dl = d * (0.5 + s) * 0.5;  weight 4h + j of run l (h = 0, 1) = dl * IQ3XXS_GRID[qs[8g + 2l + h]][j] * sign
# ================================================================================================================
def iq3_xxs_scale(src, s, g):
    aux = u32(src, s + 66 + 4 * g)
    return read_f16(src, s) * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.5), F32_ZERO


def iq3_xxs_code(src, s, k):
    g, l, j = k >> 5, (k >> 3) & 3, k & 7
    index = u8(src, s + 2 + 8 * g + 2 * l + (j >> 2))
    signs = KSIGNS[(u32(src, s + 66 + 4 * g) >> (7 * l)) & 127]
    return signed(IQ3XXS_GRID[4 * index + (j & 3)], (signs >> j) & 1)


# ================================================================================================================
# IQ3_S (type 21): 256 weights, 110 bytes, 3.44 bpw
#
#   0-1: d (fp16)   2-65: qs[64], low 8 bits of the grid index of each 4 weights   66-73: qh[8], per group of 32:
#   bit i = bit 8 of the index of its i-th 4 weights (512 entries)   74-105: signs[32], one byte per 8 weights
#   106-109: scales[4], a nibble per group g (low nibble for even g): dl = d * (1 + 2 * nibble)
#   weight 4h + j of run l: index = qs[8g + 2l + h] | bit (2l + h) of qh[g] << 8;  w = dl * IQ3S_GRID[index][j] * sign
# ================================================================================================================
def iq3_s_scale(src, s, g):
    nibble = (u8(src, s + 106 + (g >> 1)) >> (4 * (g & 1))) & 15
    return read_f16(src, s) * np.float32(1 + 2 * nibble), F32_ZERO


def iq3_s_code(src, s, k):
    g, l, j = k >> 5, (k >> 3) & 3, k & 7
    h = j >> 2
    index = u8(src, s + 2 + 8 * g + 2 * l + h) | (((u8(src, s + 66 + g) >> (2 * l + h)) & 1) << 8)
    return signed(IQ3S_GRID[4 * index + (j & 3)], (u8(src, s + 74 + 4 * g + l) >> j) & 1)


# ================================================================================================================
# IQ1_S (type 19): 256 weights, 50 bytes, 1.56 bpw
#
#   0-1: d (fp16)   2-33: qs[32], low 8 bits of the grid index of each run of 8 weights   34-49: qh[8] uint16, one
#   per group of 32: bits 3l..3l+2 = bits 8-10 of run l's index (2048 entries), bits 12-14 the 3-bit scale s,
#   bit 15 the sign of delta
#   dl = d * (2s + 1);  w = dl * (IQ1S_GRID[index][j] + delta),  delta = -1/8 if bit 15 else +1/8
# ================================================================================================================
def iq1_s_scale(src, s, g):
    qh = u16(src, s + 34 + 2 * g)
    return read_f16(src, s) * np.float32(2 * ((qh >> 12) & 7) + 1), F32_ZERO


def iq1_s_code(src, s, k):
    g, l, j = k >> 5, (k >> 3) & 3, k & 7
    qh = u16(src, s + 34 + 2 * g)
    index = u8(src, s + 2 + 4 * g + l) | (((qh >> (3 * l)) & 7) << 8)
    return np.float32(IQ1S_GRID[8 * index + j]) + IQ1_DELTA * np.float32(1 - 2 * ((qh >> 15) & 1))


# ================================================================================================================
# IQ1_M (type 29): 256 weights, 56 bytes, 1.75 bpw -- no field for d: it is spread over the scales' top nibbles
#
#   0-31: qs[32], low 8 bits of each run's grid index   32-47: qh[16], one byte per 2 runs: low nibble for the even
#   run (bits 0-2: index bits 8-10, bit 3: delta sign), high nibble for the odd run
#   48-55: scales as 4 uint16 sc[0..3]: 3-bit scales, four per uint16 (group g of 32 weights: bits 6(g % 2) .. +2
#   of sc[g / 2] for its first 16 weights, the next 3 bits for the other 16), and d's fp16 bits in the top nibbles:
#   d = fp16(sc[0] >> 12 | (sc[1] >> 8) & 0xf0 | (sc[2] >> 4) & 0xf00 | sc[3] & 0xf000)
#   scale group of 16 weights: dl = d * (2 * scale + 1);  w = dl * (IQ1S_GRID[index][j] + delta)
# ================================================================================================================
def iq1_m_d(src, s):
    bits = ((u16(src, s + 48) >> 12) | ((u16(src, s + 50) >> 8) & 0xF0) | ((u16(src, s + 52) >> 4) & 0xF00)
            | (u16(src, s + 54) & 0xF000))
    return f16_bits(bits)


def iq1_m_scale(src, s, g):
    group32, half = g >> 1, g & 1
    sc = u16(src, s + 48 + 2 * (group32 >> 1))
    return iq1_m_d(src, s) * np.float32(2 * ((sc >> (6 * (group32 & 1) + 3 * half)) & 7) + 1), F32_ZERO


def iq1_m_code(src, s, k):
    g, l, j = k >> 5, (k >> 3) & 3, k & 7
    qh = u8(src, s + 32 + 2 * g + (l >> 1)) >> (4 * (l & 1))  # this run's nibble in its low 4 bits
    index = u8(src, s + 4 * g + l) | ((qh & 7) << 8)
    return np.float32(IQ1S_GRID[8 * index + j]) + IQ1_DELTA * np.float32(1 - 2 * ((qh >> 3) & 1))


LAYOUTS = {
    QType.IQ4_NL: Layout("IQ4_NL", 32, 18, 32, iq4_nl_scale, iq4_nl_code),
    QType.IQ4_XS: Layout("IQ4_XS", QK_K, 136, 32, iq4_xs_scale, iq4_xs_code),
    QType.IQ3_XXS: Layout("IQ3_XXS", QK_K, 98, 32, iq3_xxs_scale, iq3_xxs_code),
    QType.IQ3_S: Layout("IQ3_S", QK_K, 110, 32, iq3_s_scale, iq3_s_code),
    QType.IQ2_XXS: Layout("IQ2_XXS", QK_K, 66, 32, iq2_xxs_scale, iq2_xxs_code),
    QType.IQ2_XS: Layout("IQ2_XS", QK_K, 74, 16, iq2_xs_scale, iq2_xs_code),
    QType.IQ2_S: Layout("IQ2_S", QK_K, 82, 16, iq2_s_scale, iq2_s_code),
    QType.IQ1_S: Layout("IQ1_S", QK_K, 50, 32, iq1_s_scale, iq1_s_code),
    QType.IQ1_M: Layout("IQ1_M", QK_K, 56, 16, iq1_m_scale, iq1_m_code),
}

# The names the layouts call (u8, u16, u32, read_f16, f16_bits) are bound per target by layout.helpers_for; these
# module-level ones make the functions importable and runnable as plain Python on scalars.
from .layout import f16_bits_scalar as f16_bits, read_f16, u8, u16, u32  # noqa: E402,F401

for _qtype, _layout in LAYOUTS.items():
    register(QuantFormat(_qtype, _layout.block_size, _layout.type_size, reference(_layout), decoder(_layout), None,
                         _layout))
