"""Test helpers for the quant formats: valid random raw blocks for every GGML type pymoe registers.

What this is: `random_blocks(qtype, n_blocks, rng)`, the one generator of random raw weights the dequant and kernel
tests use, and `random_rows` on top of it. Random bytes exercise every code path of a decoder (all nibbles, all
sign bits, every scale index); only the fp16 scale fields are replaced by finite, moderate values, because a random
16-bit pattern can be inf or NaN (exponent 31), and NaN is never equal to itself. For the float types the values
themselves are drawn from a normal distribution (a random F32/F16/BF16 bit pattern is just as likely to be NaN).
What this is not: realistic weights (use `pymoe.quant.quantize` on real-looking floats for that).
"""
from __future__ import annotations

import numpy as np

from pymoe.quant import QType, get_format

# Byte offsets of the fp16 fields (d, and m or dmin where the type has one) inside one block, as in gguf-py's
# quants.py (and ggml-common.h): e.g. Q2_K is scales[16] qs[64] d dmin, so d sits at 16 + 64 = 80.
FP16_FIELDS = {
    QType.Q8_0: (0,),  # d qs[32]
    QType.Q4_0: (0,),  # d qs[16]
    QType.Q4_1: (0, 2),  # d m qs[16]
    QType.Q5_0: (0,),  # d qh[4] qs[16]
    QType.Q5_1: (0, 2),  # d m qh[4] qs[16]
    QType.Q2_K: (80, 82),  # scales[16] qs[64] d dmin
    QType.Q3_K: (108,),  # hmask[32] qs[64] scales[12] d
    QType.Q4_K: (0, 2),  # d dmin scales[12] qs[128]
    QType.Q5_K: (0, 2),  # d dmin scales[12] qh[32] qs[128]
    QType.Q6_K: (208,),  # ql[128] qh[64] scales[16] d
    QType.Q2_0: (0,),  # d qs[16]
    QType.IQ4_NL: (0,),  # d qs[16]
    QType.IQ4_XS: (0,),  # d scales_h scales_l[4] qs[128]
    QType.IQ3_XXS: (0,),  # d qs[96]
    QType.IQ3_S: (0,),  # d qs[64] qh[8] signs[32] scales[4]
    QType.IQ2_XXS: (0,),  # d qs[32] (uint16)
    QType.IQ2_XS: (0,),  # d qs[32] (uint16) scales[8]
    QType.IQ2_S: (0,),  # d qs[64] qh[8] scales[8]
    QType.IQ1_S: (0,),  # d qs[32] qh[8] (uint16)
    QType.TQ1_0: (52,),  # qs[48] qh[4] d
    QType.TQ2_0: (64,),  # qs[64] d
    QType.Q1_0: (0,),  # d qs[16]
    QType.MXFP4: (),  # e (E8M0 byte, set below) qs[16]
    QType.NVFP4: (),  # d[4] (UE4M3 bytes: every byte is a finite scale) qs[32]
    QType.IQ1_M: (),  # qs[32] qh[16] scales[8]: d's fp16 bits are the top nibbles of the 4 uint16 scales (below)
}
# MXFP4's scale is 2^(e - 128) for the byte e: drawn over 2^-20 .. 2^1 like the fp16 scales above (moderate, so
# a matrix product stays finite); tests/test_iquants.py tries the extremes (e = 0, 1: float32 subnormal scales; 252).
MXFP4_E_RANGE = (108, 129)
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)


def moderate_f16(n: int, rng: np.random.Generator) -> np.ndarray:
    """n random finite fp16 values with |v| in [2^-20, 2) (subnormals included: fp16 normals start at 2^-14),
    random sign, plus zeros now and then -> uint8 [n, 2] little-endian bytes."""
    magnitude = np.exp2(rng.uniform(-20.0, 1.0, size=n))  # [n]
    values = (rng.choice([-1.0, 1.0], size=n) * magnitude).astype(np.float16)  # [n]
    values[rng.random(n) < 0.02] = 0
    return values.astype("<f2").view(np.uint8).reshape(n, 2)  # [n, 2]


def random_float_values(qtype, n: int, rng: np.random.Generator) -> np.ndarray:
    """n standard-normal values stored as F32/F16/BF16 -> uint8 [n, type_size]."""
    v = rng.standard_normal(n).astype(np.float32)  # [n]
    if qtype == QType.F32:
        return v.astype("<f4").view(np.uint8).reshape(n, 4)
    if qtype == QType.F16:
        return v.astype("<f2").view(np.uint8).reshape(n, 2)
    # BF16: the high half of the float32 bits (truncation is fine: any bf16 pattern is a valid weight)
    return (v.view("<u4") >> np.uint32(16)).astype("<u2").view(np.uint8).reshape(n, 2)


def random_blocks(qtype, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n_blocks, type_size]: valid random raw blocks of `qtype` (no inf/NaN anywhere once dequantized)."""
    qtype = QType(qtype)
    fmt = get_format(qtype)
    if qtype in FLOAT_TYPES:
        return random_float_values(qtype, n_blocks, rng)
    if qtype not in FP16_FIELDS:
        raise KeyError(f"random_blocks: add the fp16 field offsets of {qtype.name} to FP16_FIELDS")
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.type_size), dtype=np.uint8)  # [B, type_size]
    for offset in FP16_FIELDS[qtype]:
        blocks[:, offset:offset + 2] = moderate_f16(n_blocks, rng)
    if qtype == QType.MXFP4:
        blocks[:, 0] = rng.integers(MXFP4_E_RANGE[0], MXFP4_E_RANGE[1] + 1, size=n_blocks)
    if qtype == QType.IQ1_M:  # nibble i of d's bits goes to the top nibble of scales uint16 i (bytes 49, 51, 53, 55)
        d_bits = moderate_f16(n_blocks, rng).view("<u2")[:, 0]  # [B]
        for i in range(4):
            top = ((d_bits >> np.uint16(4 * i)) & np.uint16(15)).astype(np.uint8)  # [B]
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & np.uint8(15)) | (top << np.uint8(4))
    return blocks


def random_rows(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A random raw weight matrix uint8 [rows, row_bytes] of `qtype` with `cols` weights per row."""
    fmt = get_format(qtype)
    assert cols % fmt.block_size == 0, (qtype, cols)
    return random_blocks(qtype, rows * cols // fmt.block_size, rng).reshape(rows, fmt.row_bytes(cols))
