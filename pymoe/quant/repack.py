"""Weights repacked 8 rows at a time (Q2_K..Q6_K, Q8_0, MXFP4, IQ4_XS; IQ1-IQ3 decoded, in prefill), and the 8-bit
dots that read them: 8 rows a lane.

What this is: the CPU layout llama.cpp calls a "repack" (its block_q4_Kx8 and friends), written from the idea, not
the code. A one-row dot (qact.row_dot_*) spends much of a block on things every row repeats: unpacking the scales,
the float epilogue, and a reduction of 16 lanes into one float at the end. With 8 rows interleaved, one vector lane
belongs to one row, so:
  - a 32-byte load holds 4 consecutive weights of each of 8 rows for two groups (low and high nibbles),
  - 4 activations broadcast to all 8 lanes (vpbroadcastd) meet all 8 rows in one vpmaddubsw,
  - a group's 8 scales are 8 bytes (one vector), the block's fp16 factors 8 more,
  - the 8 results come out as one float32 [8] vector: no reduction at all.
Measured on Zen 3, 1 thread, one 512 x 1024 Q4_K matrix at 8 bits: 11.5 us against the one-row dot's 35.8.

A matrix of R rows (a multiple of 8) and C columns (a multiple of 256) is stored uint8 [R / 8, C / 256 * TILE]:
row-group g's 256-column block b at [g, b * TILE]. Per format (TILE_BYTES):

  Q2_K (672 bytes, as raw: 8 x 84)
    byte    0: d     fp16 [8]                 row r's super-scale at 2 r
    byte   16: dmin  fp16 [8]
    byte   32: scale uint8 [16 sub-blocks][8] the byte of sub-block k (16 weights) of row r at 32 + 8 k + r:
                                              scale in the low nibble, min in the high one, as stored
    byte  160: qs    [2 halves h][8 chunks c][8 rows r][4 bytes]: row r's Q2_K bytes qs[32 h + 4 c .. + 3], each
                     holding 4 weights in bit-planes j = 0..3: weights 128 h + 32 j + 4 c .. + 3
  Q3_K (912 bytes; 8 x 110 = 880 raw: the 6-bit scales unpacked)
    byte    0: d     fp16 [8]
    byte   16: scale int8 [16 sub-blocks][8]  sub-block k of row r at 16 + 8 k + r (-32..31)
    byte  144: qs    [2 halves h][8 chunks c][8 rows r][4 bytes]: row r's qs[32 h + 4 c .. + 3] (2-bit planes j:
                     weights 128 h + 32 j + 4 c ..)
    byte  656: hmask [8 chunks c][8 rows r][4 bytes]: row r's hmask[4 c .. + 3] (bit 4 h + j: the third bit)
  Q6_K (1680 bytes, as raw: 8 x 210)
    byte    0: d     fp16 [8]
    byte   16: scale int8 [16 sub-blocks][8]
    byte  144: ql    [2 h][2 m][8 chunks c][8 rows r][4 bytes]: row r's ql[64 h + 32 m + 4 c .. + 3] (low nibbles:
                     plane j = m, high nibbles: j = 2 + m)
    byte 1168: qh    [2 h][8 chunks c][8 rows r][4 bytes]: row r's qh[32 h + 4 c .. + 3] (bits 2 j: the top 2 bits)
  Q4_K (1184 bytes; 8 x 144 = 1152 raw: the 6-bit scales and mins unpacked to a byte each)
    byte    0: d     fp16 [8]                 row r's super-scale at 2 r
    byte   16: dmin  fp16 [8]
    byte   32: scale uint8 [8 sub-blocks][8]  sub-block j of row r at 32 + 8 j + r
    byte   96: min   uint8 [8 sub-blocks][8]
    byte  160: qs    [4 pairs p][8 chunks c][8 rows r][4 bytes]: row r's Q4_K bytes qs[32 p + 4 c .. + 3], i.e.
                     weights 64 p + 4 c .. + 3 (low nibbles: sub-block 2 p) and 64 p + 32 + 4 c .. + 3 (high: 2 p + 1)
  Q5_K (1440 bytes; 8 x 176 = 1408 raw): Q4_K's 1184 bytes (d, dmin, scales, mins, qs: the same places), then
    byte 1184: qh    [8 chunks c][8 rows r][4 bytes]: row r's qh[4 c .. + 3], bit j the fifth bit of sub-block j's
                     weight 32 j + 4 c .. + 3
  MXFP4 (1088 bytes, as raw: 8 rows x 8 blocks of 17)
    byte    0: e     uint8 [8 groups][8]      the E8M0 scale of row r's block g (weights 32 g ..) at 8 g + r
    byte   64: qs    [8 groups g][4 chunks c][8 rows r][4 bytes]: row r's block-g bytes qs[4 c .. + 3], i.e.
                     weights 32 g + 4 c .. + 3 (low nibbles) and 32 g + 16 + 4 c .. + 3 (high)
  Q8_0 (2176 bytes, as raw: 8 rows x 8 blocks of 34)
    byte    0: d     fp16 [8 groups][8]       row r's block-g scale at 2 (8 g + r)
    byte  128: qs    [8 groups g][8 chunks c][8 rows r][4 bytes]: row r's block-g int8 weights 32 g + 4 c .. + 3
  IQ4_XS (1104 bytes; 8 x 136 = 1088 raw: the 6-bit scales unpacked)
    byte    0: d     fp16 [8]
    byte   16: scale int8 [8 groups][8]       group g's 6-bit scale of row r minus 32 (-32..31) at 16 + 8 g + r
    byte   80: qs    [8 groups g][4 chunks c][8 rows r][4 bytes]: as MXFP4's (indices into the IQ4 codebook)

  decoded (2208 bytes; IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: `DECODED`, the layout in qact's section 3c)
    byte    0: d     float32 [8]              row r's block scale, times the format's power of two (exact)
    byte   32: scale int8 [16 sub-blocks][8]  the integer scale 2s + 1 of sub-block k (16 weights) of row r
    byte  160: qs    int8 [8 groups g][8 chunks c][8 rows r][4 bytes]: row r's signed integers 32 g + 4 c .. + 3
    Not a copy kept beside the raw rows (4 to 8 times their bytes): the MoE kernel decodes 16 rows of an expert at a
    time into scratch (qact's row_decode, per row) when the expert has enough tokens in a prefill chunk, and runs
    this layout's tile dot over all of them (`decode_tiles` is the whole-matrix form, for the tests and benches).

  scaled (4416 bytes per 16 rows; Q2_K and Q3_K, `SCALED_BLOCK`): each weight times its sub-block's scale as one byte,
    made from the tiles two row-groups at a time (`scale_pair`) where prefill meets an expert (or a dense matrix)
    with enough rows of x (`SCALED_MIN_ROWS`), so that its dot is vpdpbusd alone: no unpacking and no multiply per
    16 weights and token. Scratch, never kept (3 to 4 times the tiles' bytes).

`repack_ref(raw, qtype)` makes a layout from raw rows (NumPy, the reference), `repack(raw, qtype)` the same bytes
compiled (what the CPU backend runs: an expert is repacked the first time decode uses it); `unpack(tiles, qtype)` is
the inverse (the tests' round trip). `TILE_DOTS[qtype]`: the dot of one row-group and one token (an intrinsic, for
compiled callers: the fused MoE kernel); `tile_matmul(tiles, qtype, xq, xd, xbs)`: a whole matrix times T tokens.

Numerics (8-bit activations only: qact's x, int8 qs, d per 256, bsums per 16), per row:
  Q2_K, Q4_K and Q5_K, per 256-block b:
    isum = sum_j sc_j * sum_{k in sub-block j} q_k x_k      exact int32 (|isum| <= 8 * 63 * 32 * 31 * 127 < 2^26)
    msum = sum_j m_j * (the bsums of sub-block j)           exact int32
    acc  = fma(float(isum), d * dx, acc); acc = fma(float(msum), -(dmin * dx), acc)      blocks in order
  Q3_K and Q6_K, per 256-block b (q' = q + bias >= 0 against x, the bias brought back through the bsums):
    isum = sum_k sc_k * (sum_{i in sub-block k} q'_i x_i - bias * bsum_k)     = sum_k sc_k sum (q_i) x_i, exact
    acc  = fma(float(isum), d * dx, acc)
  IQ4_XS, per 256-block b (v the codebook level, |v| <= 127; sc_g the group's scale - 32):
    isum = sum_g sc_g * sum_{k in g} v_k x_k                  exact int32 (|isum| <= 256 * 32 * 127 * 127 < 2^28)
    acc  = fma(float(isum), d * dx, acc)
  decoded (IQ1-IQ3; q the signed integer, |q| <= 62, sc_k = 2s + 1 <= 31, d the block's float times 2^-k):
    isum = sum_k sc_k * sum_{i in sub-block k} q_i x_i       exact int32 (|isum| <= 256 * 62 * 127 * 31 < 2^27)
    acc  = fma(float(isum), d * dx, acc)
  MXFP4 and Q8_0, per group g of 32 (8 a block):
    isum = sum_{k in g} v_k x_k                              exact int32 (v the codebook level, |v| <= 12, or the
                                                             int8 weight)
    acc  = fma(float(isum), s_g * dx, acc)                   groups in order, s_g = 2^(e_g - 128), or d_g
which is what the one-row dots compute for these formats at 8 bits (qact's `exact_blocks`: the same integers, the
same float operations in the same order), so a row gives the same bits from either layout. In a tile, one group's
products per row sit in two int16 lanes of several vpmaddubsw results added together, below 2^15: Q2_K 4 * 2 * 3 *
127 = 3048, Q3_K 4 * 2 * 7 * 127 = 7112, Q4_K 8 * 2 * 15 * 127 = 30480, Q5_K 4 * 2 * 31 * 127 = 31496 (so
half a sub-block at a time goes into int32), Q6_K 2 * 2 * 63 * 127 = 32004 (so two chunks
at a time go into int32), MXFP4 8 * 2 * 12 * 127 = 24384, IQ4_XS 2 * 127 * 127 = 32258 and Q8_0 2 * 128 * 127 =
32512 (so each chunk goes into int32 on its own); with VNNI every product goes straight into int32. A product of an
int32 sum known to lie within int16 and a small factor takes vpmaddwd (vpdpwssd with VNNI: `_Emit.mul16`), one
operation where vpmulld takes two: the mins' and biases' terms (m or sc times a bsum, |bsum| <= 16 * 127; Q4_K's
32-value sums 32 * 127) and, with VNNI, Q2_K's and Q3_K's sub-block sums times their scales (|sum| <= 16 * 3 * 127 =
6096 and 16 * 7 * 127 = 14224; Q6_K's, up to 16 * 63 * 127, keep vpmulld). The same integers either way.
Prefill uses the same tile dot per (row-group, token), with the tile rows in L1 while a chunk of tokens goes by; on a
CPU with 512-bit VNNI the formats in PAIR read two row-groups per call (16 rows in the lanes of one vector, each row's
integers and float operations those of its own row-group's call: the same bits; `_Emit`).
What this is not: a 16-bit-activation path (its sums need qact's 16-lane split, so 16-bit activations read the
raw rows).
"""
from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import QType, get_format, qact
from .jit import bind
from .iquants import KVALUES_IQ4NL
from .kquants import (Q2_K_SIZE, Q3_K_SIZE, Q4_K_SIZE, Q5_K_SIZE, Q6_K_SIZE, QK_K, _q3_k_scale, _q3_k_scales,
                      _scale_min_k4_jit, scale_min_k4)
from .qact import KVALUES_FP4, _AVX2, host_features, prefetch_ahead

ROWS = 8  # rows per tile
MXFP4_SIZE = 17  # bytes of one MXFP4 block (32 weights)
Q8_0_SIZE = 34  # bytes of one Q8_0 block (32 weights)
IQ4_XS_SIZE = 136  # bytes of one IQ4_XS block (256 weights)
TILE_BYTES = {QType.Q2_K: 32 + 128 + 512, QType.Q3_K: 16 + 128 + 512 + 256, QType.Q4_K: 32 + 64 + 64 + 1024,
              QType.Q5_K: 32 + 64 + 64 + 1024 + 256, QType.Q6_K: 16 + 128 + 1024 + 512, QType.MXFP4: 64 + 1024,
              QType.Q8_0: 128 + 2048, QType.IQ4_XS: 16 + 64 + 1024}  # bytes per 8 rows and 256 columns
RAW_BYTES = {QType.Q2_K: Q2_K_SIZE, QType.Q3_K: Q3_K_SIZE, QType.Q4_K: Q4_K_SIZE, QType.Q5_K: Q5_K_SIZE,
             QType.Q6_K: Q6_K_SIZE,
             QType.MXFP4: 8 * MXFP4_SIZE, QType.Q8_0: 8 * Q8_0_SIZE,
             QType.IQ4_XS: IQ4_XS_SIZE}  # one row's 256 columns, as stored


def fits(qtype, rows: int, cols: int) -> bool:
    """Whether a matrix of this type and shape has a repacked layout (TILE_BYTES' types), whole tiles of 8 rows."""
    return qtype in TILE_BYTES and rows % ROWS == 0 and cols % QK_K == 0 and rows > 0


def _blocks(raw: np.ndarray, qtype) -> tuple:
    """raw uint8 [R, nb * RAW] -> (its [R / 8, nb, 8 rows, RAW] view, nb), checked."""
    raw = np.asarray(raw)
    R, nbytes = raw.shape
    size = RAW_BYTES[QType(qtype)]
    if R % ROWS or nbytes % size:
        raise ValueError(f"repack: {R} rows of {nbytes} bytes are not whole 8-row tiles of {QType(qtype).name} blocks")
    nb = nbytes // size
    return raw.reshape(R // ROWS, ROWS, nb, size).transpose(0, 2, 1, 3), nb


# ----------------------------------------------------------------------------------------------------------------
# The layouts, in NumPy (the reference)
def repack_ref(raw: np.ndarray, qtype) -> np.ndarray:
    """Raw rows uint8 [R, nb * RAW] (R a multiple of 8) -> tiles uint8 [R / 8, nb * TILE_BYTES]."""
    qtype = QType(qtype)
    blk, nb = _blocks(raw, qtype)  # [G, nb, 8 rows, RAW]
    G = blk.shape[0]
    out = np.empty((G, nb, TILE_BYTES[qtype]), dtype=np.uint8)
    if qtype == QType.Q2_K:
        out[..., 0:16] = blk[..., 80:82].reshape(G, nb, 16)  # d of rows 0..7
        out[..., 16:32] = blk[..., 82:84].reshape(G, nb, 16)  # dmin
        out[..., 32:160] = blk[..., 0:16].transpose(0, 1, 3, 2).reshape(G, nb, 128)  # scale bytes [sub][row]
        qs = blk[..., 16:80].reshape(G, nb, ROWS, 2, 8, 4)  # [.., row, half h, chunk c, 4 bytes]
        out[..., 160:] = qs.transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 512)  # [h][c][row][4]
    elif qtype == QType.Q3_K:
        out[..., 0:16] = blk[..., 108:110].reshape(G, nb, 16)  # d of rows 0..7
        sc = _q3_k_scales(blk[..., 96:108].reshape(-1, 12)).reshape(G, nb, ROWS, 16)  # int8, -32..31
        out[..., 16:144] = sc.transpose(0, 1, 3, 2).reshape(G, nb, 128).view(np.uint8)  # [sub][row]
        qs = blk[..., 32:96].reshape(G, nb, ROWS, 2, 8, 4)  # [.., row, half h, chunk c, 4 bytes]
        out[..., 144:656] = qs.transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 512)  # [h][c][row][4]
        hm = blk[..., 0:32].reshape(G, nb, ROWS, 8, 4)  # [.., row, chunk c, 4 bytes]
        out[..., 656:] = hm.transpose(0, 1, 3, 2, 4).reshape(G, nb, 256)  # [c][row][4]
    elif qtype == QType.Q6_K:
        out[..., 0:16] = blk[..., 208:210].reshape(G, nb, 16)  # d of rows 0..7
        out[..., 16:144] = blk[..., 192:208].transpose(0, 1, 3, 2).reshape(G, nb, 128)  # int8 scales [sub][row]
        ql = blk[..., 0:128].reshape(G, nb, ROWS, 2, 2, 8, 4)  # [.., row, h, m, chunk c, 4 bytes]
        out[..., 144:1168] = ql.transpose(0, 1, 3, 4, 5, 2, 6).reshape(G, nb, 1024)  # [h][m][c][row][4]
        qh = blk[..., 128:192].reshape(G, nb, ROWS, 2, 8, 4)  # [.., row, h, chunk c, 4 bytes]
        out[..., 1168:] = qh.transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 512)  # [h][c][row][4]
    elif qtype in (QType.Q4_K, QType.Q5_K):
        out[..., 0:16] = blk[..., 0:2].reshape(G, nb, 16)  # d of rows 0..7
        out[..., 16:32] = blk[..., 2:4].reshape(G, nb, 16)  # dmin
        sc = blk[..., 4:16]  # [G, nb, 8, 12] the packed 6-bit table
        s0, m0, s1, m1 = scale_min_k4(sc[..., 0:4], sc[..., 4:8], sc[..., 8:12])  # [G, nb, 8, 4]: sub 0-3, 4-7
        scales = np.concatenate([s0, s1], axis=-1)  # [G, nb, 8 rows, 8 sub-blocks]
        mins = np.concatenate([m0, m1], axis=-1)
        out[..., 32:96] = scales.transpose(0, 1, 3, 2).reshape(G, nb, 64)  # [sub][row]
        out[..., 96:160] = mins.transpose(0, 1, 3, 2).reshape(G, nb, 64)
        q0 = 16 if qtype == QType.Q4_K else 48  # Q5_K: qh[32] at 16, then qs
        qs = blk[..., q0:q0 + 128].reshape(G, nb, ROWS, 4, 8, 4)  # [.., row, pair p, chunk c, 4 bytes]
        out[..., 160:1184] = qs.transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 1024)  # [p][c][row][4]
        if qtype == QType.Q5_K:
            qh = blk[..., 16:48].reshape(G, nb, ROWS, 8, 4)  # [.., row, chunk c, 4 bytes]
            out[..., 1184:] = qh.transpose(0, 1, 3, 2, 4).reshape(G, nb, 256)  # [c][row][4]
    elif qtype == QType.IQ4_XS:
        out[..., 0:16] = blk[..., 0:2].reshape(G, nb, 16)  # d of rows 0..7
        sh = blk[..., 2].astype(np.int16) | (blk[..., 3].astype(np.int16) << 8)  # [G, nb, 8] scales_h
        j = np.arange(8)
        low = (blk[..., 4 + j // 2] >> (4 * (j % 2))) & 15  # [G, nb, 8 rows, 8 groups]
        ls = low.astype(np.int16) | (((sh[..., None] >> (2 * j)) & 3) << 4)  # the 6-bit scales, 0..63
        out[..., 16:80] = (ls - 32).astype(np.int8).transpose(0, 1, 3, 2).reshape(G, nb, 64).view(np.uint8)
        qs = blk[..., 8:].reshape(G, nb, ROWS, 8, 4, 4)  # [.., row, group g, chunk c, 4 bytes]
        out[..., 80:] = qs.transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 1024)  # [g][c][row][4]
    elif qtype == QType.Q8_0:
        b = blk.reshape(G, nb, ROWS, 8, Q8_0_SIZE)  # [.., row, group, 34]
        out[..., 0:128] = b[..., 0:2].transpose(0, 1, 3, 2, 4).reshape(G, nb, 128)  # d [group][row]
        qs = b[..., 2:].reshape(G, nb, ROWS, 8, 8, 4)  # [.., row, group g, chunk c, 4 bytes]
        out[..., 128:] = qs.transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 2048)  # [g][c][row][4]
    else:  # MXFP4
        b = blk.reshape(G, nb, ROWS, 8, MXFP4_SIZE)  # [.., row, group, 17]
        out[..., 0:64] = b[..., 0].transpose(0, 1, 3, 2).reshape(G, nb, 64)  # e [group][row]
        qs = b[..., 1:].reshape(G, nb, ROWS, 8, 4, 4)  # [.., row, group g, chunk c, 4 bytes]
        out[..., 64:] = qs.transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 1024)  # [g][c][row][4]
    return out.reshape(G, nb * TILE_BYTES[qtype])


def unpack(tiles: np.ndarray, qtype) -> np.ndarray:
    """The inverse of repack_ref: tiles uint8 [R / 8, nb * TILE_BYTES] -> raw rows uint8 [R, nb * RAW]."""
    qtype = QType(qtype)
    G, nb = tiles.shape[0], tiles.shape[1] // TILE_BYTES[qtype]
    t = tiles.reshape(G, nb, TILE_BYTES[qtype])
    if qtype == QType.Q2_K:
        blk = np.empty((G, nb, ROWS, Q2_K_SIZE), dtype=np.uint8)
        blk[..., 80:82] = t[..., 0:16].reshape(G, nb, ROWS, 2)
        blk[..., 82:84] = t[..., 16:32].reshape(G, nb, ROWS, 2)
        blk[..., 0:16] = t[..., 32:160].reshape(G, nb, 16, ROWS).transpose(0, 1, 3, 2)
        blk[..., 16:80] = t[..., 160:].reshape(G, nb, 2, 8, ROWS, 4).transpose(0, 1, 4, 2, 3, 5).reshape(
            G, nb, ROWS, 64)
    elif qtype == QType.Q3_K:
        blk = np.empty((G, nb, ROWS, Q3_K_SIZE), dtype=np.uint8)
        blk[..., 108:110] = t[..., 0:16].reshape(G, nb, ROWS, 2)
        sc = (t[..., 16:144].reshape(G, nb, 16, ROWS).transpose(0, 1, 3, 2).view(np.int8).astype(np.int16)
              + 32).astype(np.uint8)  # [G, nb, row, 16]: the 6-bit fields
        blk[..., 96:104] = (sc[..., 0:8] & 15) | ((sc[..., 8:16] & 15) << 4)  # low 4 bits: scale k at byte k & 7
        hi = sc >> 4  # [.., 16]: the high 2 bits, scale k at byte 104 + (k & 3), bits 2 (k >> 2)
        blk[..., 104:108] = hi[..., 0:4] | (hi[..., 4:8] << 2) | (hi[..., 8:12] << 4) | (hi[..., 12:16] << 6)
        blk[..., 32:96] = t[..., 144:656].reshape(G, nb, 2, 8, ROWS, 4).transpose(0, 1, 4, 2, 3, 5).reshape(
            G, nb, ROWS, 64)
        blk[..., 0:32] = t[..., 656:].reshape(G, nb, 8, ROWS, 4).transpose(0, 1, 3, 2, 4).reshape(G, nb, ROWS, 32)
    elif qtype == QType.Q6_K:
        blk = np.empty((G, nb, ROWS, Q6_K_SIZE), dtype=np.uint8)
        blk[..., 208:210] = t[..., 0:16].reshape(G, nb, ROWS, 2)
        blk[..., 192:208] = t[..., 16:144].reshape(G, nb, 16, ROWS).transpose(0, 1, 3, 2)
        blk[..., 0:128] = t[..., 144:1168].reshape(G, nb, 2, 2, 8, ROWS, 4).transpose(0, 1, 5, 2, 3, 4, 6).reshape(
            G, nb, ROWS, 128)
        blk[..., 128:192] = t[..., 1168:].reshape(G, nb, 2, 8, ROWS, 4).transpose(0, 1, 4, 2, 3, 5).reshape(
            G, nb, ROWS, 64)
    elif qtype in (QType.Q4_K, QType.Q5_K):
        blk = np.empty((G, nb, ROWS, RAW_BYTES[qtype]), dtype=np.uint8)
        blk[..., 0:2] = t[..., 0:16].reshape(G, nb, ROWS, 2)
        blk[..., 2:4] = t[..., 16:32].reshape(G, nb, ROWS, 2)
        scales = t[..., 32:96].reshape(G, nb, 8, ROWS).transpose(0, 1, 3, 2)  # [G, nb, row, sub]
        mins = t[..., 96:160].reshape(G, nb, 8, ROWS).transpose(0, 1, 3, 2)
        s0, s1, m0, m1 = scales[..., :4], scales[..., 4:], mins[..., :4], mins[..., 4:]
        blk[..., 4:8] = (s0 & 63) | ((s1 >> 4) << 6)  # scale_min_k4's inverse
        blk[..., 8:12] = (m0 & 63) | ((m1 >> 4) << 6)
        blk[..., 12:16] = (s1 & 15) | ((m1 & 15) << 4)
        q0 = 16 if qtype == QType.Q4_K else 48
        blk[..., q0:q0 + 128] = t[..., 160:1184].reshape(G, nb, 4, 8, ROWS, 4).transpose(0, 1, 4, 2, 3, 5).reshape(
            G, nb, ROWS, 128)
        if qtype == QType.Q5_K:
            blk[..., 16:48] = t[..., 1184:].reshape(G, nb, 8, ROWS, 4).transpose(0, 1, 3, 2, 4).reshape(
                G, nb, ROWS, 32)
    elif qtype == QType.IQ4_XS:
        blk = np.empty((G, nb, ROWS, IQ4_XS_SIZE), dtype=np.uint8)
        blk[..., 0:2] = t[..., 0:16].reshape(G, nb, ROWS, 2)
        ls = (t[..., 16:80].reshape(G, nb, 8, ROWS).transpose(0, 1, 3, 2).view(np.int8).astype(np.int16)
              + 32)  # [G, nb, row, group]: 0..63
        blk[..., 4:8] = (ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)  # scales_l: groups 2 i, 2 i + 1
        sh = ((ls >> 4) << (2 * np.arange(8))).sum(axis=-1)  # scales_h: group j's top 2 bits at bit 2 j
        blk[..., 2], blk[..., 3] = sh & 255, sh >> 8
        blk[..., 8:] = t[..., 80:].reshape(G, nb, 8, 4, ROWS, 4).transpose(0, 1, 4, 2, 3, 5).reshape(G, nb, ROWS, 128)
    elif qtype == QType.Q8_0:
        b = np.empty((G, nb, ROWS, 8, Q8_0_SIZE), dtype=np.uint8)
        b[..., 0:2] = t[..., 0:128].reshape(G, nb, 8, ROWS, 2).transpose(0, 1, 3, 2, 4)
        b[..., 2:] = t[..., 128:].reshape(G, nb, 8, 8, ROWS, 4).transpose(0, 1, 4, 2, 3, 5).reshape(G, nb, ROWS, 8, 32)
        blk = b.reshape(G, nb, ROWS, 8 * Q8_0_SIZE)
    else:
        b = np.empty((G, nb, ROWS, 8, MXFP4_SIZE), dtype=np.uint8)
        b[..., 0] = t[..., 0:64].reshape(G, nb, 8, ROWS).transpose(0, 1, 3, 2)
        b[..., 1:] = t[..., 64:].reshape(G, nb, 8, 4, ROWS, 4).transpose(0, 1, 4, 2, 3, 5).reshape(G, nb, ROWS, 8, 16)
        blk = b.reshape(G, nb, ROWS, 8 * MXFP4_SIZE)
    return blk.transpose(0, 2, 1, 3).reshape(G * ROWS, -1)


# ----------------------------------------------------------------------------------------------------------------
# The same bytes, compiled (the NumPy forms take ~1.3 ms for a 512 x 1024 matrix, these ~0.15)
@njit(cache=True, inline="always")
def _interleave(t, dst, r, blk, src, n):
    """Row r's n 4-byte chunks blk[src + 4 c .. + 3] -> t[dst + 32 c + 4 r ..]: every tile's [chunk][row][4 bytes]
    order of the quants."""
    for c in range(n):
        for i in range(4):
            t[dst + 32 * c + 4 * r + i] = blk[src + 4 * c + i]


@njit(cache=True)
def _repack_k4_into(raw, out, raw_size):
    """Q4_K: raw uint8 [R, nb * 144] -> out uint8 [R / 8, nb * 1184]; Q5_K (raw_size 176): raw [R, nb * 176] ->
    out [R / 8, nb * 1440], Q4_K's bytes and then qh."""
    nb = raw.shape[1] // raw_size
    size = out.shape[1] // nb
    q0 = 16 if raw_size == Q4_K_SIZE else 48  # qs; Q5_K: qh[32] at 16, then qs
    for g in range(raw.shape[0] // ROWS):
        for b in range(nb):
            t = out[g, b * size:(b + 1) * size]
            for r in range(ROWS):
                blk = raw[g * ROWS + r, b * raw_size:(b + 1) * raw_size]
                t[2 * r], t[2 * r + 1] = blk[0], blk[1]  # d
                t[16 + 2 * r], t[17 + 2 * r] = blk[2], blk[3]  # dmin
                for i in range(4):  # column i of the 6-bit table: sub-blocks i and i + 4
                    sc_lo, m_lo, sc_hi, m_hi = _scale_min_k4_jit(blk[4 + i], blk[8 + i], blk[12 + i])
                    t[32 + 8 * i + r], t[32 + 8 * (i + 4) + r] = sc_lo, sc_hi
                    t[96 + 8 * i + r], t[96 + 8 * (i + 4) + r] = m_lo, m_hi
                _interleave(t, 160, r, blk, q0, 32)  # qs: pair p, chunk c = chunk 8 p + c
                if q0 == 48:
                    _interleave(t, 1184, r, blk, 16, 8)  # qh: chunk c


@njit(cache=True)
def _repack_q4_k_into(raw, out):
    """raw uint8 [R, nb * 144] -> out uint8 [R / 8, nb * 1184]."""
    _repack_k4_into(raw, out, Q4_K_SIZE)


@njit(cache=True)
def _repack_q5_k_into(raw, out):
    """raw uint8 [R, nb * 176] -> out uint8 [R / 8, nb * 1440]."""
    _repack_k4_into(raw, out, Q5_K_SIZE)


@njit(cache=True)
def _repack_q2_k_into(raw, out):
    """raw uint8 [R, nb * 84] -> out uint8 [R / 8, nb * 672]."""
    nb = raw.shape[1] // Q2_K_SIZE
    size = out.shape[1] // nb
    for g in range(raw.shape[0] // ROWS):
        for b in range(nb):
            t = out[g, b * size:(b + 1) * size]
            for r in range(ROWS):
                blk = raw[g * ROWS + r, b * Q2_K_SIZE:(b + 1) * Q2_K_SIZE]
                t[2 * r], t[2 * r + 1] = blk[80], blk[81]  # d
                t[16 + 2 * r], t[17 + 2 * r] = blk[82], blk[83]  # dmin
                for k in range(16):
                    t[32 + 8 * k + r] = blk[k]  # scale | min << 4 of sub-block k
                _interleave(t, 160, r, blk, 16, 16)  # qs: half h, chunk c = chunk 8 h + c


@njit(cache=True)
def _repack_q3_k_into(raw, out):
    """raw uint8 [R, nb * 110] -> out uint8 [R / 8, nb * 912]."""
    nb = raw.shape[1] // Q3_K_SIZE
    size = out.shape[1] // nb
    for g in range(raw.shape[0] // ROWS):
        for b in range(nb):
            t = out[g, b * size:(b + 1) * size]
            for r in range(ROWS):
                blk = raw[g * ROWS + r, b * Q3_K_SIZE:(b + 1) * Q3_K_SIZE]
                t[2 * r], t[2 * r + 1] = blk[108], blk[109]  # d
                for k in range(16):
                    t[16 + 8 * k + r] = np.uint8(_q3_k_scale(blk, 96, k) & 255)  # int8 as its byte
                _interleave(t, 144, r, blk, 32, 16)  # qs: half h, chunk c = chunk 8 h + c
                _interleave(t, 656, r, blk, 0, 8)  # hmask


@njit(cache=True)
def _repack_q6_k_into(raw, out):
    """raw uint8 [R, nb * 210] -> out uint8 [R / 8, nb * 1680]."""
    nb = raw.shape[1] // Q6_K_SIZE
    size = out.shape[1] // nb
    for g in range(raw.shape[0] // ROWS):
        for b in range(nb):
            t = out[g, b * size:(b + 1) * size]
            for r in range(ROWS):
                blk = raw[g * ROWS + r, b * Q6_K_SIZE:(b + 1) * Q6_K_SIZE]
                t[2 * r], t[2 * r + 1] = blk[208], blk[209]  # d
                for k in range(16):
                    t[16 + 8 * k + r] = blk[192 + k]
                _interleave(t, 144, r, blk, 0, 32)  # ql: h, m, chunk c = chunk 16 h + 8 m + c
                _interleave(t, 1168, r, blk, 128, 16)  # qh: h, chunk c = chunk 8 h + c


@njit(cache=True)
def _repack_blocks32_into(raw, out, block, sb):
    """The formats of 8 blocks of 32 weights per 256 columns, each block a scale of sb bytes then its quants (MXFP4:
    17-byte blocks, a 1-byte E8M0; Q8_0: 34, a 2-byte fp16): raw uint8 [R, nb * 8 block] -> out uint8 [R / 8, nb *
    TILE]: the scales [8 groups][8 rows][sb bytes], then the quants [group][chunk c][row][4 bytes]."""
    chunks = (block - sb) // 4  # 4-byte chunks of one block's quants
    nb = raw.shape[1] // (8 * block)
    size = out.shape[1] // nb
    for g8 in range(raw.shape[0] // ROWS):
        for b in range(nb):
            t = out[g8, b * size:(b + 1) * size]
            for r in range(ROWS):
                row = raw[g8 * ROWS + r]
                for g in range(8):
                    s = (8 * b + g) * block  # the block's first byte
                    for i in range(sb):
                        t[sb * (8 * g + r) + i] = row[s + i]  # its scale
                    _interleave(t, 64 * sb + 32 * chunks * g, r, row, s + sb, chunks)  # qs: group g, chunk c


@njit(cache=True)
def _repack_mxfp4_into(raw, out):
    """raw uint8 [R, nb * 136] -> out uint8 [R / 8, nb * 1088]."""
    _repack_blocks32_into(raw, out, MXFP4_SIZE, 1)


@njit(cache=True)
def _repack_q8_0_into(raw, out):
    """raw uint8 [R, nb * 272] -> out uint8 [R / 8, nb * 2176]."""
    _repack_blocks32_into(raw, out, Q8_0_SIZE, 2)


@njit(cache=True)
def _repack_iq4_xs_into(raw, out):
    """raw uint8 [R, nb * 136] -> out uint8 [R / 8, nb * 1104]."""
    nb = raw.shape[1] // IQ4_XS_SIZE
    size = out.shape[1] // nb
    for g in range(raw.shape[0] // ROWS):
        for b in range(nb):
            t = out[g, b * size:(b + 1) * size]
            for r in range(ROWS):
                blk = raw[g * ROWS + r, b * IQ4_XS_SIZE:(b + 1) * IQ4_XS_SIZE]
                t[2 * r], t[2 * r + 1] = blk[0], blk[1]  # d
                sh = np.int32(blk[2]) | (np.int32(blk[3]) << 8)  # scales_h
                for j in range(8):  # group j's 6-bit scale, minus 32, as a byte
                    ls = ((np.int32(blk[4 + j // 2]) >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)
                    t[16 + 8 * j + r] = np.uint8((ls - 32) & 255)
                _interleave(t, 80, r, blk, 8, 32)  # qs: group g, chunk c = chunk 4 g + c


_REPACK_INTO = {QType.Q2_K: _repack_q2_k_into, QType.Q3_K: _repack_q3_k_into, QType.Q4_K: _repack_q4_k_into,
                QType.Q5_K: _repack_q5_k_into, QType.Q6_K: _repack_q6_k_into, QType.MXFP4: _repack_mxfp4_into,
                QType.Q8_0: _repack_q8_0_into, QType.IQ4_XS: _repack_iq4_xs_into}


def repack(raw: np.ndarray, qtype, empty=None) -> np.ndarray:
    """Raw rows uint8 [R, nb * RAW] -> tiles uint8 [R / 8, nb * TILE_BYTES]: repack_ref's bytes, compiled.
    empty(shape): where the tiles go (the CPU backend's backends/arena.HugeArena.empty; default a new NumPy array)."""
    qtype = QType(qtype)
    _, nb = _blocks(raw, qtype)  # checks the shape
    shape = (raw.shape[0] // ROWS, nb * TILE_BYTES[qtype])
    out = np.empty(shape, dtype=np.uint8) if empty is None else empty(shape)
    _REPACK_INTO[qtype](raw, out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The tile dots, as LLVM IR (see qact for why IR)
_i8, _i16, _i32, _i64, _f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V32B, _V16S, _V8I, _V8F = (ir.VectorType(_i8, 32), ir.VectorType(_i16, 16), ir.VectorType(_i32, 8),
                            ir.VectorType(_f32, 8))


def _vec(ty, n, values):
    return ir.Constant(ir.VectorType(ty, n), list(values))


class _Emit:
    """The few vector operations both tile dots are made of, for one builder (avx2: by AVX2's intrinsics; else
    portable IR with the same integers, what CPUs without AVX2 run)."""

    def __init__(self, builder, avx2: bool, vnni: bool = False, wide: bool = False, stride=None, dual: bool = False):
        self.b, self.avx2, self.vnni = builder, avx2, avx2 and vnni
        # wide (VNNI only, formats in WIDE): two consecutive chunks per operation, 512-bit vectors: lanes 0-7 hold
        # the 8 rows' sums of the first chunk, lanes 8-15 those of the second, added together by `fold`
        # stride (an i64 value: the bytes from one row-group's tiles to the next's; 512-bit VNNI only, formats in
        # PAIR): two row-groups side by side, lanes 0-7 the first's 8 rows and 8-15 the second's, one chunk of each
        # an operation, and that chunk's 4 activations one dword broadcast to all 16 lanes (no shuffle)
        # dual (512-bit VNNI only, formats in DUAL; a token's two planes, `_Both`): one row-group's 8 rows twice, lanes
        # 0-7 against the first row of x and 8-15 against the second, each 256-bit load of weights broadcast to both
        # halves: every operation after the unpacking (the scales' multiplies, the float epilogue) runs once for the
        # two rows; otherwise the pair form's code (16 lanes, a sub-block's chunks into int32 by vpdpbusd)
        self.stride, self.pair, self.dual = stride, stride is not None or dual, dual
        self.width = 2 if self.vnni and wide and not self.pair else 1
        self.lanes = 16 if self.pair else 8  # rows in a result vector
        self.VB = ir.VectorType(_i8, 32 * self.width * (2 if self.pair else 1))  # the weights of one operation
        self.VI, self.VF = ir.VectorType(_i32, self.lanes), ir.VectorType(_f32, self.lanes)  # a value per row
        self.zeros = ir.Constant(self.VI, [0] * self.lanes)

    def x86(self, name, ret, argv):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, [a.type for a in argv]), name)
        return self.b.call(fn, argv)

    def at(self, base, off: int):  # an element offset: base + off
        return self.b.add(base, ir.Constant(_i64, off))

    def load(self, ptr, off, ty):  # ty at ptr + off elements, unaligned
        return self.b.load(self.b.bitcast(self.b.gep(ptr, [off]), ty.as_pointer()), align=1)

    def chunk(self, wbase, off):  # the weights one operation reads, at tile byte off (pair: and off + stride)
        if not self.pair:
            return self.load(wbase, off, self.VB)
        return self.per_row(wbase, off, _V32B)

    def per_row(self, wbase, off, ty):  # ty (a value per row, or a chunk) at byte off; pair: both row-groups'
        v = self.load(wbase, off, ty)
        if not self.pair:
            return v
        n = ty.count
        if self.dual:  # the same row-group's in both halves
            return self.b.shuffle_vector(v, v, _vec(_i32, 2 * n, list(range(n)) * 2))
        second = self.load(wbase, self.b.add(off, self.stride), ty)  # the next row-group's
        return self.b.shuffle_vector(v, second, _vec(_i32, 2 * n, range(2 * n)))

    def barrier(self):  # an empty asm with side effects: no load after it moves before it. The pair form puts one
        # between parts of a block: without, LLVM's scheduler loads and unpacks a whole block's weights first, 32
        # or more 512-bit values at once, and spills them (1 thread, 512 x 1024, 64 tokens, G MACs/s without /
        # with: Q5_K 116 / 166-203, IQ4_XS 184-195 / 234-235)
        self.b.asm(ir.FunctionType(ir.VoidType(), []), "", "", [], True)

    def splat(self, scalar, ty, n):
        v = self.b.insert_element(ir.Constant(ir.VectorType(ty, n), ir.Undefined), scalar, ir.Constant(_i32, 0))
        return self.b.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), _vec(_i32, n, [0] * n))

    def x4(self, xbase, xo, k):  # activations k .. k + 3 of the block at xo, broadcast to the 8 rows: int8 [32]
        return self.b.bitcast(self.splat(self.load(xbase, self.at(xo, k), _i32), _i32, 8), _V32B)

    def xs(self, xbase, xo, k):  # activations k .. k + 4 width - 1 as `width` chunks see them: int8 [32 width]
        if self.pair:  # k .. k + 3 to all 16 lanes (vpdpbusd's embedded broadcast)
            return self.b.bitcast(self.splat(self.load(xbase, self.at(xo, k), _i32), _i32, 16), self.VB)
        if self.width == 1:
            return self.x4(xbase, xo, k)
        two = self.load(xbase, self.at(xo, k), ir.VectorType(_i32, 2))  # k .. k + 3 to lanes 0-7, k + 4 .. to 8-15
        return self.b.bitcast(self.b.shuffle_vector(two, two, _vec(_i32, 16, [0] * 8 + [1] * 8)), self.VB)

    def fold(self, s):  # a wide sub-block sum int32 [16] -> int32 [8] (the two chunks' halves added); else s
        if self.width == 1:
            return s
        b = self.b
        return b.add(b.shuffle_vector(s, s, _vec(_i32, 8, range(8))),
                     b.shuffle_vector(s, s, _vec(_i32, 8, range(8, 16))))

    def nibbles(self, q):  # uint8 [32 width] (pair: [64]) -> (low nibbles, high nibbles)
        n = self.VB.count
        low = _vec(_i8, n, [15] * n)
        return self.b.and_(q, low), self.b.and_(self.b.lshr(q, _vec(_i8, n, [4] * n)), low)

    def maddubs(self, w, x):  # uint8 [32] x int8 [32], pairs added -> int16 [16]
        if self.avx2:
            return self.x86("llvm.x86.avx2.pmadd.ub.sw", _V16S, [w, x])
        b = self.b
        p = b.mul(b.zext(w, ir.VectorType(_i16, 32)), b.sext(x, ir.VectorType(_i16, 32)))
        return b.add(b.shuffle_vector(p, p, _vec(_i32, 16, range(0, 32, 2))),
                     b.shuffle_vector(p, p, _vec(_i32, 16, range(1, 32, 2))))

    def madd16(self, a, c):  # int16 [16] x int16 [16], pairs added -> int32 [8]
        if self.avx2:
            return self.x86("llvm.x86.avx2.pmadd.wd", _V8I, [a, c])
        b = self.b
        p = b.mul(b.sext(a, ir.VectorType(_i32, 16)), b.sext(c, ir.VectorType(_i32, 16)))
        return b.add(b.shuffle_vector(p, p, _vec(_i32, 8, range(0, 16, 2))),
                     b.shuffle_vector(p, p, _vec(_i32, 8, range(1, 16, 2))))

    # A sub-block's products, row by row. Two ways to the same integers: AVX2 sums each chunk's 4 products per row
    # in two int16 lanes (vpmaddubsw, then int16 adds: each block bounds its chunks so these never pass 2^15) and
    # applies the scales with vpmaddwd; VNNI (AVX-512 VNNI or AVX-VNNI) adds the 4 products straight into the row's
    # int32 lane (vpdpbusd) and multiplies by the scale as int32. The sums are exact either way.
    def sub_add(self, s, w, x):  # s (None at first) + the products of uint8 [32] w and int8 [32] x, per row
        if self.vnni:
            vi = ir.VectorType(_i32, self.VB.count // 4)
            acc = ir.Constant(vi, [0] * vi.count) if s is None else s
            return self.x86(f"llvm.x86.avx512.vpdpbusd.{8 * self.VB.count}", vi,
                            [acc, self.b.bitcast(w, vi), self.b.bitcast(x, vi)])  # int32 [8 width]
        return _sum(self, s, self.maddubs(w, x))  # int16 [16]: row r in lanes 2r, 2r + 1

    def sub_scaled(self, s, sc8=None, signed: bool = False):  # -> int32 [8]: row r's sum times its scale
        # sc8: int8 [8], one scale per row (None: 1; signed: int8, else uint8)
        if self.vnni:
            return s if sc8 is None else self.b.mul(s, (self.b.sext if signed else self.b.zext)(sc8, self.VI))
        sc16 = _vec(_i16, 16, [1] * 16) if sc8 is None else _dup_pairs(self, sc8, signed)
        return self.madd16(s, sc16)

    def low16(self, v8, signed: bool = False):  # int8 [lanes] -> int32 [lanes]: the value as int16 in the low half,
        # the high half zero (signed: -1 is 0x0000FFFF), the operand `mul16` takes
        if not signed:
            return self.b.zext(v8, self.VI)
        return self.b.zext(self.b.sext(v8, ir.VectorType(_i16, v8.type.count)), self.VI)

    def mul16(self, v, c, acc=None):  # acc (None: 0) + int32 [lanes] v times c (`low16`'s form), exact where v is
        # within int16: vpmaddwd, one operation where vpmulld takes two (v's low half times c's, plus v's high half,
        # its sign, times 0); with VNNI and acc, vpdpwssd (the multiply and the add in one)
        b = self.b
        if not self.avx2:
            m = b.mul(v, b.sext(b.trunc(c, ir.VectorType(_i16, self.lanes)), self.VI))
            return m if acc is None else b.add(acc, m)
        if self.vnni and acc is not None:
            return self.x86(f"llvm.x86.avx512.vpdpwssd.{32 * self.lanes}", self.VI, [acc, v, c])
        i16 = ir.VectorType(_i16, 2 * self.lanes)
        name = "llvm.x86.avx2.pmadd.wd" if self.lanes == 8 else "llvm.x86.avx512.pmaddw.d.512"
        m = self.x86(name, self.VI, [b.bitcast(v, i16), b.bitcast(c, i16)])
        return m if acc is None else b.add(acc, m)

    def bits(self, q, lo: int, k: int, at: int = 0):  # uint8 [n] -> ((q >> lo) & (2^k - 1)) << at, byte by byte:
        # with GFNI one vgf2p8affineqb (`_GFNI`: the bit matrix moves bits lo .. lo + k - 1 to at .. and clears the
        # rest), else shifts and an and
        b, n = self.b, q.type.count
        if self.avx2 and _GFNI and (lo or at):
            m = [0] * 8  # out bit i is the parity of (matrix byte 7 - i) & q
            for i in range(k):
                m[7 - (at + i)] = 1 << (lo + i)
            return self.x86(f"llvm.x86.vgf2p8affineqb.{8 * n}", q.type,
                            [q, _vec(_i8, n, [v - 256 if v > 127 else v for v in m] * (n // 8)), ir.Constant(_i8, 0)])
        v = b.and_(b.lshr(q, _vec(_i8, n, [lo] * n)) if lo else q, _vec(_i8, n, [(1 << k) - 1] * n))
        return b.shl(v, _vec(_i8, n, [at] * n)) if at else v

    def magnitude(self, v):  # int8 [32] -> |v| (as unsigned bytes: -128 -> 128)
        b, zero = self.b, _vec(_i8, 32, [0] * 32)
        return b.select(b.icmp_signed("<", v, zero), b.neg(v), v)

    def signed_add(self, s, v, mag, x):  # sub_add of int8 [32] v (any sign) against int8 [32] x, mag = |v|:
        b = self.b  # llama.cpp's way, |v| against x with v's sign moved onto it (vpsignb)
        zero = _vec(_i8, 32, [0] * 32)
        if self.avx2:
            x = self.x86("llvm.x86.avx2.psign.b", _V32B, [x, v])
        else:
            x = b.select(b.icmp_signed("<", v, zero), b.neg(x), b.select(b.icmp_signed("==", v, zero), zero, x))
        return self.sub_add(s, mag, x)

    def lookup(self, v, codebook):  # int8 [32] (wide: [64]) of indices 0..15 -> their codebook levels
        if v.type.count == 64:  # (wide forms only, AVX-512BW) vpshufb on 512 bits: the table four times
            return self.x86("llvm.x86.avx512.pshuf.b.512", v.type, [_vec(_i8, 64, list(codebook) * 4), v])
        if self.avx2:  # vpshufb looks up within each 16-byte half: the table twice
            return self.x86("llvm.x86.avx2.pshuf.b", _V32B, [_vec(_i8, 32, list(codebook) * 2), v])
        out = _vec(_i8, 32, [codebook[0]] * 32)
        for k in range(1, 16):
            hit = self.b.icmp_unsigned("==", v, _vec(_i8, 32, [k] * 32))
            out = self.b.select(hit, _vec(_i8, 32, [codebook[k]] * 32), out)
        return out

    def fma(self, a, c, d):  # float32 [lanes]: a * c + d, one rounding
        return self.x86(f"llvm.fma.v{self.lanes}f32", self.VF, [a, c, d])


class _Tok:
    """One token's activations as a tile block sees them: xq's row (int8*), the block's first activation xo, its scale
    dx (float; None for x per 32 values, whose 8 scales of the block start at xd + xdo: `dx_of`), the row's bsums
    (int32*) and the block's first bsum bso."""

    def __init__(self, xbase, xo, dx, bsbase, bso, xd=None, xdo=None):
        self.xbase, self.xo, self.dx, self.bsbase, self.bso = xbase, xo, dx, bsbase, bso
        self.xd, self.xdo = xd, xdo

    def dx_of(self, e: "_Emit", g: int):  # the scale of x over group g (values 32 g .. 32 g + 31) of the block, float
        return self.dx if self.xd is None else e.load(self.xd, e.at(self.xdo, g), _f32)

    def bsum32(self, e: "_Emit", j: int):  # the sum of the block's activations 32 j .. 32 j + 31 (two bsums), int32
        return e.b.add(e.load(self.bsbase, e.at(self.bso, 2 * j), _i32),
                       e.load(self.bsbase, e.at(self.bso, 2 * j + 1), _i32))

    def xs(self, e: "_Emit", k: int):  # activations k .. as one operation takes them (`_Emit.xs`)
        return e.xs(self.xbase, self.xo, k)

    def each(self, e: "_Emit", scalar, ty):  # scalar(tok): a value of type ty of this token, in every lane
        return e.splat(scalar(self), ty, e.lanes)

    def bsum(self, e: "_Emit", k: int):  # the block's bsum k (activations 16 k .. 16 k + 15), int32
        return e.load(self.bsbase, e.at(self.bso, k), _i32)


class _Both:
    """A token's two planes (two rows of x) as the dual form (`_Emit`'s dual) sees them: lanes 0-7 the first row's
    values, 8-15 the second's, wherever a _Tok puts one token's value in every lane."""

    def __init__(self, a: _Tok, c: _Tok):
        self.a, self.c = a, c

    @staticmethod
    def _halves(e: "_Emit", va, vc):  # two [8] vectors -> [16]: va in lanes 0-7, vc in 8-15
        return e.b.shuffle_vector(va, vc, _vec(_i32, 16, range(16)))

    def xs(self, e: "_Emit", k: int):  # activations k .. k + 3 of each row, to its 8 lanes: int8 [64] (one dword
        # to all 16 lanes, the second row's over lanes 8-15: two broadcast loads, one masked)
        first = e.splat(e.load(self.a.xbase, e.at(self.a.xo, k), _i32), _i32, 16)
        second = e.splat(e.load(self.c.xbase, e.at(self.c.xo, k), _i32), _i32, 16)
        return e.b.bitcast(e.b.select(ir.Constant(ir.VectorType(ir.IntType(1), 16), [0] * 8 + [1] * 8), second, first),
                           e.VB)

    def each(self, e: "_Emit", scalar, ty):
        return self._halves(e, e.splat(scalar(self.a), ty, 8), e.splat(scalar(self.c), ty, 8))


def _minus_128_bsum(e: "_Emit", s, x: _Tok, g: int):
    """Group g's per-row sums of (v + 128) x (vpdpbusd's unsigned operand; wide: two halves, folded) -> the sums of
    v x: 128 times the group's activation sum taken off, exactly."""
    return e.b.sub(e.fold(s), e.splat(e.b.mul(x.bsum32(e, g), ir.Constant(_i32, 128)), _i32, 8))


def _minus_128_bsum_start(e: "_Emit", x: _Tok, g: int):
    """(pair) -128 times group g's activation sum in every lane: where vpdpbusd's sums of (v + 128) x start, so that
    they end as the sums of v x. The same integers as `_minus_128_bsum`, with one operation less per group and token
    and no register held across the groups (where the subtraction after made LLVM keep every group's term live:
    spills)."""
    return x.each(e, lambda t: e.b.mul(t.bsum32(e, g), ir.Constant(_i32, -128)), _i32)


def _affine_epilogue(e: _Emit, wbase, t, toks, isums, msums, accs):
    """Per token: acc + d * dx * isum - dmin * dx * msum, lane by lane (d, dmin: the 8 rows' fp16 factors at bytes t,
    t + 16, loaded once for all the tokens)."""
    b = e.b
    half8 = ir.VectorType(ir.HalfType(), 8)
    d8 = b.fpext(e.per_row(wbase, t, half8), e.VF)
    dmin8 = b.fpext(e.per_row(wbase, e.at(t, 16), half8), e.VF)
    out = []
    for x, isum, msum, acc in zip(toks, isums, msums, accs):
        dxv = x.each(e, lambda t: t.dx, _f32)
        acc = e.fma(b.sitofp(isum, e.VF), b.fmul(d8, dxv), acc)
        out.append(e.fma(b.sitofp(msum, e.VF), b.fneg(b.fmul(dmin8, dxv)), acc))
    return out


def _dup_pairs(e: _Emit, v8, signed: bool = False):  # int8 [8] (a value per row) -> int16 [16], lanes 2r and
    pairs = e.b.shuffle_vector(v8, v8, _vec(_i32, 16, [r // 2 for r in range(16)]))  # 2r + 1 row r's
    return (e.b.sext if signed else e.b.zext)(pairs, _V16S)


def _sum(e: _Emit, a, m):  # a running sum, None at first
    return m if a is None else e.b.add(a, m)


class _Sums:
    """Each token's int32 [lanes] running sum of a block's terms, kept as about 4 partial sums a block (4 / tokens
    each, added round-robin, then together): integer adds, the same value in any order, in short dependency chains
    where one chain would wait on every multiply-add (vpdpwssd: `mul16` and the add, fused) before the next."""

    def __init__(self, e: _Emit, n_tok: int):
        self.e, self.parts, self.i = e, [[] for _ in range(n_tok)], 0
        self.p = max(1, 4 // n_tok)

    def add(self, terms):  # one term per token
        for parts, v in zip(self.parts, terms):
            if len(parts) < self.p:
                parts.append(v)
            else:
                parts[self.i % self.p] = self.e.b.add(parts[self.i % self.p], v)
        self.i += 1

    def mul16(self, vs, c):  # + each token's v times c (`_Emit.mul16`, v within int16): vpdpwssd into the partial
        for parts, v in zip(self.parts, vs):  # sum (an intrinsic: LLVM keeps the chains as they are written)
            if len(parts) < self.p:
                parts.append(self.e.mul16(v, c))
            else:
                parts[self.i % self.p] = self.e.mul16(v, c, parts[self.i % self.p])
        self.i += 1

    def totals(self):  # -> the tokens' sums
        out = []
        for parts in self.parts:
            while len(parts) > 1:
                parts = [self.e.b.add(parts[k], parts[k + 1]) if k + 1 < len(parts) else parts[k]
                         for k in range(0, len(parts), 2)]
            out.append(parts[0] if parts else self.e.zeros)
        return out


# Each block function adds one tile block's terms for the tokens `toks` (1 or 4) to their accumulators: the weights
# are loaded and unpacked once, then each token's integer products and float terms are exactly those of a
# one-token call (the same operations in the same order), so a token's bits do not depend on its neighbours.
def _block_q2_k(e: _Emit, wbase, t, toks, accs):
    """Q2_K. A 32-byte load holds, per row, 4 bytes = 4 weights in each of 4 bit-planes j (weights 128 h + 32 j +
    4 c ..); sub-block k (16 weights) = chunks 4 e .. 4 e + 3 of plane j, k = 8 h + 2 j + e. Scale = low nibble
    of the sub-block's byte, min = high nibble. The 2-bit weights are unsigned: no bias (pair form: vpdpbusd, a
    sub-block's 4 chunks into int32 at once, then its scale)."""
    b = e.b
    isums = _Sums(e, len(toks))
    for h in range(2):
        for j in range(4):
            if e.pair:  # (a barrier per plane: see _Emit.barrier)
                e.barrier()
            for half in range(2):
                s = [None] * len(toks)
                for c in range(4 * half, 4 * half + 4):
                    q = e.chunk(wbase, e.at(t, 160 + 32 * (8 * h + c)))
                    v = e.bits(q, 2 * j, 2)
                    k = 128 * h + 32 * j + 4 * c  # the chunk's first weight
                    s = [e.sub_add(a, v, x.xs(e, k)) for a, x in zip(s, toks)]
                k = 8 * h + 2 * j + half
                sc8 = e.per_row(wbase, e.at(t, 32 + 8 * k), ir.VectorType(_i8, 8))
                sc8 = b.and_(sc8, _vec(_i8, sc8.type.count, [15] * sc8.type.count))  # the low nibbles
                if e.vnni:  # row r: sc_rk * its 16 products (|sum| <= 16 * 3 * 127 = 6096: int16)
                    isums.mul16(s, e.low16(sc8))
                else:
                    isums.add([e.sub_scaled(a, sc8) for a in s])
    return _affine_epilogue(e, wbase, t, toks, isums.totals(), _q2_k_msums(e, wbase, t, toks), accs)


def _q2_k_msums(e: _Emit, wbase, t, toks):
    """Q2_K's mins term per token, sum_k m_k * bsum_k (m the high nibble of sub-block k's byte at t + 32 + 8 k),
    exact int32 [lanes]."""
    b = e.b
    msums = _Sums(e, len(toks))
    for k in range(16):
        m8 = e.per_row(wbase, e.at(t, 32 + 8 * k), ir.VectorType(_i8, 8))
        m8 = b.zext(b.lshr(m8, _vec(_i8, m8.type.count, [4] * m8.type.count)), e.VI)
        msums.mul16([x.each(e, lambda tk: tk.bsum(e, k), _i32) for x in toks], m8)  # |bsum| <= 16 * 127
    return msums.totals()


def _block_q4_k(e: _Emit, wbase, t, toks, accs, five: bool = False):
    """Q4_K. A 32-byte load holds 4 weights of each row in two sub-blocks (2 p: low nibbles, 2 p + 1: high).
    five: Q5_K, each nibble with its fifth bit from qh (bit j of a chunk's qh byte for sub-block j), 0..31; without
    VNNI the int16 pair sums of 4 chunks (31496 at most) go into int32 before the next 4."""
    b = e.b
    n = e.VB.count

    def scaled(isums, p, s_lo, s_hi):  # + each row's sums of sub-blocks 2 p, 2 p + 1 times their scales, in int32
        for j, s in ((2 * p, s_lo), (2 * p + 1, s_hi)):
            sc8 = e.per_row(wbase, e.at(t, 32 + 8 * j), ir.VectorType(_i8, 8))  # sub-block j's scales
            isums = [b.add(i, e.sub_scaled(e.fold(a), sc8)) for i, a in zip(isums, s)]  # row r: sc_rj * its sums
        return isums

    isums = [e.zeros] * len(toks)
    for p in range(4):
        if e.pair:
            e.barrier()
        s_lo = s_hi = [None] * len(toks)
        for c in range(0, 8, e.width):  # chunk c (wide: c and c + 1): 4 weights of each row
            lo, hi = e.nibbles(e.chunk(wbase, e.at(t, 160 + 32 * (8 * p + c))))
            if five:
                qh = e.chunk(wbase, e.at(t, 1184 + 32 * c))
                fifth = lambda j: b.shl(b.and_(b.lshr(qh, _vec(_i8, n, [j] * n)), _vec(_i8, n, [1] * n)),  # noqa
                                        _vec(_i8, n, [4] * n))
                lo, hi = b.or_(lo, fifth(2 * p)), b.or_(hi, fifth(2 * p + 1))
            s_lo = [e.sub_add(a, lo, x.xs(e, 64 * p + 4 * c)) for a, x in zip(s_lo, toks)]
            s_hi = [e.sub_add(a, hi, x.xs(e, 64 * p + 32 + 4 * c)) for a, x in zip(s_hi, toks)]
            if five and not e.vnni and c == 3:  # half the sub-block: into int32 before int16 overflows
                isums = scaled(isums, p, s_lo, s_hi)
                s_lo = s_hi = [None] * len(toks)
        isums = scaled(isums, p, s_lo, s_hi)
    msums = _Sums(e, len(toks))
    for j in range(8):
        m8 = b.zext(e.per_row(wbase, e.at(t, 96 + 8 * j), ir.VectorType(_i8, 8)), e.VI)  # sub-block j's mins
        msums.mul16([x.each(e, lambda t: t.bsum32(e, j), _i32) for x in toks], m8)  # |.| <= 32 * 127
    return _affine_epilogue(e, wbase, t, toks, isums, msums.totals(), accs)


def _block_symmetric(qtype):
    """Q3_K and Q6_K: d * sc_k * (q - bias), signed 8-bit scales per 16 weights. In a tile the integers are taken as
    q' = q + bias >= 0 (Q3_K 0..7, Q6_K 0..63) against x by vpmaddubsw (by vpdpbusd in the pair form, which takes a
    sub-block's 4 chunks into int32 at once), and the bias comes back through the bsums: isum = sum_k sc_k (sum q' x -
    bias * bsum_k), exactly the one-row dot's integer."""
    if qtype == QType.Q3_K:
        bias, chunks_per_madd = 4, 4  # |4 chunks of 2 products| <= 4 * 2 * 7 * 127 < 2^15
        small = True  # a sub-block's sum (what meets its scale) within int16: 16 * 7 * 127 = 14224
    else:
        bias, chunks_per_madd = 32, 2  # 2 * 2 * 63 * 127 = 32004 < 2^15
        small = False  # 16 * 63 * 127 (or half of it, without pair) is past int16

    def planes(e: _Emit, wbase, t, h, c):  # the 4 bit-planes j of chunk c: int8 [32] q' of weights 128 h + 32 j + 4 c
        b, n = e.b, e.VB.count  # (pair: [64], both row-groups')
        sh = lambda v, k: b.lshr(v, _vec(_i8, n, [k] * n)) if k else v  # noqa: E731
        mask = lambda v, m: b.and_(v, _vec(_i8, n, [m] * n))  # noqa: E731
        if qtype == QType.Q3_K:  # (GFNI: a plane's 2 low bits and its high bit one vgf2p8affineqb each; the
            # shifts and masks took Q3_K's two-row dot, us a warm 512 x 1024 matrix on Zen 4, to 21.7 against 14.9)
            q = e.chunk(wbase, e.at(t, 144 + 32 * (8 * h + c)))
            hm = e.chunk(wbase, e.at(t, 656 + 32 * c))
            return [b.or_(e.bits(q, 2 * j, 2), e.bits(hm, 4 * h + j, 1, 2)) for j in range(4)]
        lo_a = e.chunk(wbase, e.at(t, 144 + 32 * (16 * h + c)))  # ql[64 h + 4 c ..]
        lo_b = e.chunk(wbase, e.at(t, 144 + 32 * (16 * h + 8 + c)))  # ql[64 h + 32 + 4 c ..]
        hq = e.chunk(wbase, e.at(t, 1168 + 32 * (8 * h + c)))  # qh[32 h + 4 c ..]
        lows = [mask(lo_a, 15), mask(lo_b, 15), sh(lo_a, 4), sh(lo_b, 4)]  # j = 0, 1 low nibbles; 2, 3 high
        return [b.or_(lows[j], e.bits(hq, 2 * j, 2, 4)) for j in range(4)]

    def block(e: _Emit, wbase, t, toks, accs):
        b = e.b
        per = 4 if e.pair else chunks_per_madd  # chunks into int32 at a time (pair: VNNI, the sub-block at once)
        isums = _Sums(e, len(toks))
        for h in range(2):
            for half in range(2):  # chunks 4 half .. 4 half + 3: sub-blocks 8 h + 2 j + half
                if e.pair:
                    e.barrier()
                s = [[None] * len(toks) for _ in range(4)]
                for c in range(4 * half, 4 * half + 4):
                    vs = planes(e, wbase, t, h, c)
                    for j in range(4):
                        s[j] = [e.sub_add(a, vs[j], x.xs(e, 128 * h + 32 * j + 4 * c))
                                for a, x in zip(s[j], toks)]
                    if (c + 1) % per == 0:  # into int32 with the sub-blocks' scales, before 2^15
                        for j in range(4):
                            k = 8 * h + 2 * j + half
                            sc8 = e.per_row(wbase, e.at(t, 16 + 8 * k), ir.VectorType(_i8, 8))
                            if e.vnni and small:
                                isums.mul16(s[j], e.low16(sc8, signed=True))
                            else:
                                isums.add([e.sub_scaled(a, sc8, True) for a in s[j]])
                            s[j] = [None] * len(toks)
        # - bias * sum_k sc_k bsum_k, then d * dx times the whole block's integer
        corr = _Sums(e, len(toks))
        for k in range(16):
            sc = e.low16(e.per_row(wbase, e.at(t, 16 + 8 * k), ir.VectorType(_i8, 8)), signed=True)
            corr.mul16([x.each(e, lambda t: t.bsum(e, k), _i32) for x in toks], sc)  # |bsum| <= 16 * 127
        d8 = b.fpext(e.per_row(wbase, t, ir.VectorType(ir.HalfType(), 8)), e.VF)
        out = []
        for x, isum, m, acc in zip(toks, isums.totals(), corr.totals(), accs):
            total = b.sub(isum, b.mul(m, _vec(_i32, e.lanes, [bias] * e.lanes)))
            out.append(e.fma(b.sitofp(total, e.VF), b.fmul(d8, x.each(e, lambda t: t.dx, _f32)), acc))
        return out

    return block


# MXFP4's levels plus 128 (116..140), as int8 bit patterns: the unsigned operand of vpdpbusd
_FP4_PLUS_128 = [v + 128 - 256 if v + 128 > 127 else v + 128 for v in KVALUES_FP4]


def _block_mxfp4(e: _Emit, wbase, t, toks, accs):
    """MXFP4, group by group: the codebook levels looked up once. With VNNI the level + 128 (unsigned) meets x in
    vpdpbusd and 128 * the group's activation sum comes off after, exactly (as IQ4_XS's); without, |level| meets x
    signed by the level (vpsignb). The +128 form against vpsignb with VNNI (2-core Zen 4, two planes, one 512 x 1024
    matrix, 1 thread, medians of 15 alternated rounds, both compiled in one process): 15.7 / 18.2 us warm, 27.6 /
    30.3 not in cache; decode of the mid MXFP4_MOE file, 2 threads (bench/bench_forward.py --only decode, the trees
    alternated process by process): 117.1 and 108.7 tok/s against 105.1 and 95.3."""
    b = e.b
    accs = list(accs)
    for g in range(8):
        s = [None] * len(toks)
        for c in range(4):
            lo, hi = e.nibbles(e.load(wbase, e.at(t, 64 + 32 * (4 * g + c)), _V32B))
            for idx, k in ((lo, 32 * g + 4 * c), (hi, 32 * g + 16 + 4 * c)):
                if e.vnni:
                    u = e.lookup(idx, _FP4_PLUS_128)
                    s = [e.sub_add(a, u, e.x4(x.xbase, x.xo, k)) for a, x in zip(s, toks)]
                    continue
                v = e.lookup(idx, KVALUES_FP4)
                mag = e.magnitude(v)
                s = [e.signed_add(a, v, mag, e.x4(x.xbase, x.xo, k)) for a, x in zip(s, toks)]
        if e.vnni:  # row r: sum (v + 128) x - 128 * the group's activation sum
            s = [_minus_128_bsum(e, a, x, g) for a, x in zip(s, toks)]
        # the 8 rows' scales 2^(e - 128), as ggml_e8m0_to_fp32_half (qact.group_scales_at, lane = row here)
        ev = b.zext(e.load(wbase, e.at(t, 8 * g), ir.VectorType(_i8, 8)), _V8I)
        normal = b.shl(b.sub(ev, _vec(_i32, 8, [1] * 8)), _vec(_i32, 8, [23] * 8))
        small = b.shl(_vec(_i32, 8, [0x00200000] * 8), b.and_(ev, _vec(_i32, 8, [1] * 8)))
        scale = b.bitcast(b.select(b.icmp_unsigned("<", ev, _vec(_i32, 8, [2] * 8)), small, normal), _V8F)
        for i, x in enumerate(toks):
            isum = e.sub_scaled(s[i])  # [8]: row r's 32 products
            accs[i] = e.fma(b.sitofp(isum, _V8F), b.fmul(scale, e.splat(x.dx_of(e, g), _f32, 8)), accs[i])
    return accs


# IQ4_XS's codebook plus 128: the levels as unsigned bytes (1..241), the operand vpdpbusd takes unsigned
_IQ4_PLUS_128 = [v + 128 - (256 if v + 128 > 127 else 0) for v in KVALUES_IQ4NL]  # as int8 bit patterns


def _block_iq4_xs(e: _Emit, wbase, t, toks, accs):
    """IQ4_XS: a group's levels looked up once, then per token. With VNNI the level + 128 (unsigned) meets x in
    vpdpbusd and 128 * (the group's two bsums) comes off after, exactly (pair: the sums start from -128 * bsum
    instead, the same integer); without, |level| meets x signed by the level (vpsignb) and each chunk's int16 pair
    sums (up to 2 * 127 * 127) go into int32 at once, times the group's scale."""
    b = e.b
    isums = [e.zeros] * len(toks)
    for g in range(8):
        if e.pair and g % 2 == 0:  # (two groups a part: every group's was slower for Q8_0, 202 / 237-246)
            e.barrier()
        sc8 = e.per_row(wbase, e.at(t, 16 + 8 * g), ir.VectorType(_i8, 8))  # the rows' scales of group g, -32..31
        s = [_minus_128_bsum_start(e, x, g) if e.pair else None for x in toks]
        for c in range(0, 4, e.width):  # chunk c (wide: c and c + 1)
            lo, hi = e.nibbles(e.chunk(wbase, e.at(t, 80 + 32 * (4 * g + c))))
            for idx, k in ((lo, 32 * g + 4 * c), (hi, 32 * g + 16 + 4 * c)):
                if e.vnni:
                    u = e.lookup(idx, _IQ4_PLUS_128)
                    s = [e.sub_add(a, u, x.xs(e, k)) for a, x in zip(s, toks)]
                    continue
                v = e.lookup(idx, KVALUES_IQ4NL)
                mag = e.magnitude(v)
                s = [e.signed_add(None, v, mag, e.x4(x.xbase, x.xo, k)) for x in toks]
                isums = [b.add(i, e.sub_scaled(a, sc8, True)) for i, a in zip(isums, s)]
        if e.vnni:  # row r: sc_rg * (sum (v + 128) x - 128 * the group's bsum)
            for i, x in enumerate(toks):
                isums[i] = b.add(isums[i], e.sub_scaled(s[i] if e.pair else _minus_128_bsum(e, s[i], x, g), sc8, True))
    d8 = b.fpext(e.per_row(wbase, t, ir.VectorType(ir.HalfType(), 8)), e.VF)
    return [e.fma(b.sitofp(isum, e.VF), b.fmul(d8, x.each(e, lambda t: t.dx, _f32)), acc)
            for x, isum, acc in zip(toks, isums, accs)]


def _plus_128_sums(e: _Emit, s, w, toks, k):
    """VNNI, int8 weights w (one operation's chunk): each token's sums s (None at first) plus (w + 128) times its
    activations k .. k + 3 (the sign bit flipped makes w + 128 the unsigned byte vpdpbusd takes; the caller takes 128
    times the activations' sum off, or starts from there)."""
    n = e.VB.count
    u = e.b.xor(w, _vec(_i8, n, [-128] * n))
    return [e.sub_add(a, u, x.xs(e, k)) for a, x in zip(s, toks)]


def _block_q8_0(e: _Emit, wbase, t, toks, accs):
    """Q8_0, group by group: with VNNI the int8 weights + 128 (unsigned: the sign bit flipped) meet x in vpdpbusd
    and 128 * (the group's two bsums) comes off after, exactly; without, |w| meets x signed by w (vpsignb) and each
    chunk's int16 pair sums (up to 2 * 128 * 127) go into int32 at once. Then d_g * dx per group, as MXFP4's."""
    b = e.b
    accs = list(accs)
    for g in range(8):
        if e.pair and g % 2 == 0:
            e.barrier()
        s = [_minus_128_bsum_start(e, x, g) if e.pair else None for x in toks]
        for c in range(0, 8, e.width):  # chunk c (wide: c and c + 1)
            w = e.chunk(wbase, e.at(t, 128 + 32 * (8 * g + c)))
            k = 32 * g + 4 * c
            if e.vnni:
                s = _plus_128_sums(e, s, w, toks, k)
                continue
            mag = e.magnitude(w)
            s = [_sum(e, a, e.sub_scaled(e.signed_add(None, w, mag, e.x4(x.xbase, x.xo, k)))) for a, x in zip(s, toks)]
        d8 = b.fpext(e.per_row(wbase, e.at(t, 16 * g), ir.VectorType(ir.HalfType(), 8)), e.VF)  # the rows' d of g
        for i, x in enumerate(toks):
            isum = s[i]
            if e.vnni and not e.pair:  # row r: sum (w + 128) x - 128 * the group's bsum
                isum = _minus_128_bsum(e, isum, x, g)
            accs[i] = e.fma(b.sitofp(isum, e.VF), b.fmul(d8, x.each(e, lambda t: t.dx_of(e, g), _f32)), accs[i])
    return accs


def _block_decoded(e: _Emit, wbase, t, toks, accs):
    """The decoded layout of the Grid formats (IQ1-IQ3, `DECODED`: int8 weights, an integer scale per 16 of them,
    a float d per row and block). With VNNI q + 128 (the sign bit flipped, as Q8_0's) meets x in vpdpbusd, a
    sub-block's 4 chunks into one int32 sum, and 128 * the sub-block's bsum comes off (pair: the sum starts there);
    without, |q| meets x signed by q (vpsignb), each chunk into int32 on its own (2 * 128 * 127 < 2^15). Then, as
    the one-row dot's exact_blocks: isum = sum_k sc_k * (sub-block k's sum of q x), exact (|isum| <= 256 * 62 * 127
    * 31 < 2^27), and acc = fma(float(isum), d * dx, acc)."""
    b = e.b
    isums = [e.zeros] * len(toks)
    for g in range(8):
        if e.pair and g % 2 == 0:  # (as IQ4_XS's and Q8_0's: two groups a part)
            e.barrier()
        for half in range(2):  # sub-block k = 2 g + half: chunks 4 half .. 4 half + 3 of group g
            k = 2 * g + half
            sc8 = e.per_row(wbase, e.at(t, qact.DECODED_SCALES + 8 * k), ir.VectorType(_i8, 8))
            minus = [e.b.mul(e.load(x.bsbase, e.at(x.bso, k), _i32), ir.Constant(_i32, -128)) for x in toks]
            s = [e.splat(m, _i32, e.lanes) if e.pair else None for m in minus]
            for c in range(4 * half, 4 * half + 4):
                w = e.chunk(wbase, e.at(t, qact.DECODED_QS + 32 * (8 * g + c)))
                xk = 32 * g + 4 * c
                if e.vnni:
                    s = _plus_128_sums(e, s, w, toks, xk)
                    continue
                mag = e.magnitude(w)
                isums = [b.add(i, e.sub_scaled(e.signed_add(None, w, mag, e.x4(x.xbase, x.xo, xk)), sc8, True))
                         for i, x in zip(isums, toks)]
            if e.vnni:  # row r: sc_k * (sum (q + 128) x - 128 * bsum_k)
                for i in range(len(toks)):
                    si = s[i] if e.pair else b.add(s[i], e.splat(minus[i], _i32, e.lanes))
                    isums[i] = b.add(isums[i], e.sub_scaled(si, sc8, True))
    d8 = e.per_row(wbase, e.at(t, qact.DECODED_D), ir.VectorType(_f32, 8))
    return [e.fma(b.sitofp(isum, e.VF), b.fmul(d8, x.each(e, lambda t: t.dx, _f32)), acc)
            for x, isum, acc in zip(toks, isums, accs)]


# The scaled layout (prefill's scratch for Q2_K and Q3_K, `scale_pair`): each weight times its sub-block's scale, as
# one byte, so that the dot is vpdpbusd alone, with no multiply per 16 weights and token and no unpacking. Two
# row-groups (16 rows) at a time, per 256 columns (SCALED_BLOCK bytes):
#   byte   0: the first row-group's tile header (its first 160 bytes: d fp16 [8]; Q2_K: dmin fp16 [8], then the
#              scale | min << 4 bytes [16 sub-blocks][8 rows]; Q3_K: only d is read)
#   byte 160: the second row-group's
#   byte 320: qs uint8 [8 groups g][8 chunks c][2 row-groups][8 rows r][4 bytes]: row r's weights 32 g + 4 c .. + 3,
#              64 bytes a (g, c): one 512-bit load. Each u = sc * q + bias: Q2_K sc * q (sc 0..15, q 0..3: 0..45,
#              bias 0), Q3_K sc * q + 127 (sc -32..31, q -4..3: sc * q in -124..128, so u in 3..255)
# vpdpbusd takes u unsigned against x signed: sum u x = sum sc q x + bias * (the block's activation sum), so the sum
# starts from -bias * that sum and ends as the tile dot's integer exactly (Q2_K: isum; Q3_K: isum - 4 * corr, the
# same integer as `_block_symmetric`'s total), then the same float epilogue. |sum u x| <= 256 * 255 * 127 < 2^23.
SCALED_HEAD = 160  # bytes of a row-group's header
SCALED_QS = 2 * SCALED_HEAD
SCALED_BLOCK = SCALED_QS + 2 * 2048  # 4416 bytes per 16 rows and 256 columns
SCALED_BIAS = {QType.Q2_K: 0, QType.Q3_K: 127}
SCALED = {QType.Q2_K: "scaled_q2_k", QType.Q3_K: "scaled_q3_k"}  # a source format -> its scaled layout's key
# The fewest rows of x for which prefill scales two row-groups into scratch (see SCALED_PAIRS): below, the expansion
# costs more than the scaled dot saves. 1 thread, one warm 512 x 1024 matrix, G MACs/s by rows of x, tile_matmul
# with PYMOE_SCALED=0 / scaled from 4 rows on (the 2-core Zen 4 VM, 2026-12-08, medians of 60 calls, two runs):
# Q2_K 8: 112 / 108-109, 12: 117 / 112-114, 16: 119 / 114-115, 24: 122 / 127, 32: 123-124 / 135-137, 64: 125-126 /
# 148-151; Q3_K 8: 96-97 / 75-98, 12: 99-100 / 98-101, 16: 101-103 / 124-126, 24: 104-105 / 143-145, 32: 104-106 /
# 136-155, 64: 106-108 / 176-178. (Q2_K's dot keeps its mins' term, 16 multiplies a block and token.)
SCALED_MIN_ROWS = {QType.Q2_K: 24, QType.Q3_K: 16}


def _block_sum(e: _Emit, x: _Tok):  # the sum of the block's 256 activations (its 16 bsums), int32 (scalar adds)
    vals = [x.bsum(e, k) for k in range(16)]
    while len(vals) > 1:
        vals = [e.b.add(vals[i], vals[i + 1]) for i in range(0, len(vals), 2)]
    return vals[0]


def _block_scaled(src):
    """The scaled layout of Q2_K or Q3_K (see SCALED_BLOCK), 512-bit VNNI pair form only (`_Emit`'s stride: the
    second header SCALED_HEAD bytes on): u meets x in vpdpbusd, two chains a token (groups even and odd: vpdpbusd's
    latency), from -bias * the block's activation sum. Q2_K then takes its mins' term from the bsums and runs
    `_affine_epilogue`; Q3_K runs `_block_symmetric`'s epilogue. The integers and float operations of the source
    format's tile dot: its bits."""
    bias = SCALED_BIAS[src]

    def block(e: _Emit, wbase, t, toks, accs):
        b = e.b
        start = [x.each(e, lambda tk: b.mul(_block_sum(e, tk), ir.Constant(_i32, -bias)), _i32) if bias else None
                 for x in toks]
        chains = [[s0, None] for s0 in start]  # per token: groups 0, 2, 4, 6 / 1, 3, 5, 7
        for g in range(8):
            if g % 2 == 0:
                e.barrier()
            for c in range(8):
                w = e.load(wbase, e.at(t, SCALED_QS + 64 * (8 * g + c)), e.VB)  # [64]: 16 rows x 4 weights
                for ch, x in zip(chains, toks):
                    ch[g % 2] = e.sub_add(ch[g % 2], w, x.xs(e, 32 * g + 4 * c))
        isums = [b.add(c0, c1) for c0, c1 in chains]
        if src == QType.Q2_K:
            return _affine_epilogue(e, wbase, t, toks, isums, _q2_k_msums(e, wbase, t, toks), accs)
        d8 = b.fpext(e.per_row(wbase, t, ir.VectorType(ir.HalfType(), 8)), e.VF)
        return [e.fma(b.sitofp(isum, e.VF), b.fmul(d8, x.each(e, lambda tk: tk.dx, _f32)), acc)
                for x, isum, acc in zip(toks, isums, accs)]

    return block


DECODED = "decoded"  # the key of the decoded layout (qact.DECODED_TILE) beside the QTypes in the tables below
_BLOCKS = {QType.Q2_K: _block_q2_k, QType.Q3_K: _block_symmetric(QType.Q3_K), QType.Q4_K: _block_q4_k,
           QType.Q5_K: lambda *a: _block_q4_k(*a, five=True), QType.Q6_K: _block_symmetric(QType.Q6_K),
           QType.MXFP4: _block_mxfp4, QType.Q8_0: _block_q8_0, QType.IQ4_XS: _block_iq4_xs, DECODED: _block_decoded}
_BLOCKS.update({SCALED[q]: _block_scaled(q) for q in SCALED})
_SCALED_KEYS = frozenset(SCALED.values())
_LAYOUT_BYTES = {**TILE_BYTES, DECODED: qact.DECODED_TILE,
                 **{key: SCALED_BLOCK for key in SCALED.values()}}  # bytes per 8 rows (a scaled layout: 16) and 256
# columns, every layout


def _key(layout):  # a layout's key: a QType (an int finds it), DECODED or a SCALED one
    return layout if isinstance(layout, str) else QType(layout)


def _make_codegen(qtype, avx2: bool, n_tok: int, vnni: bool = False, wide: bool = False, ahead: int = 0,
                  locality: int = 3, pair: bool = False, dual: bool = False):
    """dual (n_tok 2, 512-bit VNNI): the two rows of x in the halves of one vector (`_Emit`'s dual, `_Both`).
    ahead > 0: each block also asks for the bytes `ahead` past its own (llvm.prefetch at `locality`, 3: keep in
    every cache level, 0: non-temporal), one hint per 64 bytes of the block, among the block's own loads (see
    STREAM_AHEAD). Hints only: no fault past the end of the array, no effect on the results."""
    size, block = _LAYOUT_BYTES[qtype], _BLOCKS[qtype]
    i32 = ir.IntType(32)

    def codegen(context, builder, signature, args):
        """out = the 8 rows of one row-group (tiles uint8 [nb * TILE]) times n_tok tokens: 1-D xq int8 [nb * 256],
        xd [nb], xbs [nb * 16], out [8]; or 2-D, one row per token, out [n_tok, 8]. pair: tiles uint8 [2, nb * TILE]
        (two row-groups, 16 rows), 2-D xq, out [n_tok, 16]. dual: out [2, 8] written as one [16] vector."""
        ta, xa, xda, bsa, outa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args))
        stride = None if not pair else (ir.Constant(_i64, SCALED_HEAD) if isinstance(qtype, str) and qtype in _SCALED_KEYS
                                         else cgutils.unpack_tuple(builder, ta.strides, 2)[0])  # (a scaled layout: 1-D)
        e = _Emit(builder, avx2, vnni, wide, stride, dual)
        nd = signature.args[1].ndim
        x32 = qtype in qact.ACT32_TYPES  # x per 32 values (qact.act_group): 8 scales of x a block
        nb = cgutils.unpack_tuple(builder, xda.shape, nd)[nd - 1]
        if x32:
            nb = builder.udiv(nb, ir.Constant(_i64, 8))

        def rows(a, ty):  # the n_tok row pointers of a C-contiguous array (nd 1: the array itself)
            if nd == 1:
                return [a.data]
            stride = cgutils.unpack_tuple(builder, a.strides, 2)[0]
            base = builder.bitcast(a.data, ir.IntType(8).as_pointer())
            return [builder.bitcast(builder.gep(base, [builder.mul(stride, ir.Constant(_i64, i))]), ty.as_pointer())
                    for i in range(n_tok)]

        xrows, xdrows, bsrows = rows(xa, _i8), rows(xda, _f32), rows(bsa, _i32)
        acc_ps = [cgutils.alloca_once_value(builder, ir.Constant(e.VF, [0.0] * e.lanes))
                  for _ in range(1 if dual else n_tok)]
        with cgutils.for_range(builder, nb) as loop:
            bi = loop.index
            t = builder.mul(bi, ir.Constant(_i64, size))  # the block's first byte
            xo = builder.mul(bi, ir.Constant(_i64, QK_K))  # its first activation
            bso = builder.mul(bi, ir.Constant(_i64, 16))
            if ahead:  # this block's share of the hints: a block's bytes `ahead` further on, one per 64 bytes
                prefetch = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                    ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")
                for c in range(0, size, 64):
                    ptr = builder.gep(ta.data, [builder.add(t, ir.Constant(_i64, ahead + c))])
                    builder.call(prefetch, [ptr, *(ir.Constant(i32, v) for v in (0, locality, 1))])  # read, data
            if x32:
                xdo = builder.mul(bi, ir.Constant(_i64, 8))
                toks = [_Tok(xr, xo, None, bsr, bso, xdr, xdo) for xr, xdr, bsr in zip(xrows, xdrows, bsrows)]
            else:
                toks = [_Tok(xr, xo, builder.load(builder.gep(xdr, [bi])), bsr, bso)
                        for xr, xdr, bsr in zip(xrows, xdrows, bsrows)]
            if dual:
                toks = [_Both(*toks)]
            accs = block(e, ta.data, t, toks, [builder.load(p) for p in acc_ps])
            for p, acc in zip(acc_ps, accs):
                builder.store(acc, p)
        out = builder.bitcast(outa.data, e.VF.as_pointer())
        for i, p in enumerate(acc_ps):  # out is C-contiguous: token i's 8 (pair, dual: 16) results at 8 i (16 i)
            builder.store(builder.load(p), builder.gep(out, [ir.Constant(_i64, i)]), align=4)
        return context.get_dummy_value()

    return codegen


def _c(a, dtype, nd=1):
    return isinstance(a, types.Array) and a.dtype == dtype and a.ndim == nd and a.layout == "C"


def _x_rows(xq, xd, xbs, out) -> bool:  # 2-D C-contiguous rows of x (int8, or int16: typed, trapped) and results
    return (isinstance(xq, types.Array) and xq.dtype in (types.int8, types.int16) and _c(xq, xq.dtype, 2)
            and _c(xd, types.float32, 2) and _c(xbs, types.int32, 2) and _c(out, types.float32, 2))


def _trap(context, builder, signature, args):  # the body of a dot typed for a call it never gets (int16 x, a form
    # this CPU lacks): a kernel compiled for both activation widths may hold the call
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.trap")
    builder.call(fn, [])
    return context.get_dummy_value()


MANY = 4  # tokens per call of a tile's many-token dot
# The formats whose many-token dot also comes in a two-row-group form (`_Emit`'s pair: tiles [2, row_tiles] ->
# out [MANY, 16]) where the CPU has 512-bit VNNI: a chunk's 4 activations are then one dword broadcast to 16 rows
# (vpdpbusd's embedded broadcast: no shuffle), where the wide form spends a load and a vpermd per 8 rows and two
# chunks. 1 thread, 512 x 1024, 64 tokens, Zen 5, G MACs/s pair / not (the wide form; Q3_K's and Q6_K's the 256-bit
# one without VNNI), two runs each (bench/bench_repack.py with
# PYMOE_PAIR=1 / 0, the same bits): Q4_K 252-257 / 173-176, IQ4_XS 232-248 / 106-112, Q8_0 244-270 / 119-153, Q5_K
# 178-180 / 151-159 (its fifth bits: more unpacking per chunk); in a second round Q3_K 145-156 / 105-110 and Q6_K
# 138-144 / 110-114 (their pair form takes VNNI, a scale multiply per 16 weights and token, for 16 rows at once), Q4_K
# 242-251 / 177-178, Q5_K 177 / 156-159, Q8_0 239-267 / 119-121, IQ4_XS 233-243 / 113-138. With the blocks' barriers
# (`_Emit.barrier`). Q2_K's pair form came in round fifteen, on an Intel Xeon VM with AVX-512 VNNI: 112-118 / 63-72
# (the same matrix and tokens, three alternated runs); it also serves the down matrices of the IQ1 and IQ2 mixes.
# The decoded layout's (DECODED) is the IQ1-IQ3 prefill's. MXFP4 has no pair form (its prefill was already above
# llama.cpp's).
PAIR = {QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q8_0, QType.IQ4_XS, DECODED}
# The formats whose many-token dot takes vpdpbusd where the CPU has it (every format's one-token dot does). For the
# others, whose scales cover 16 weights, an int32 multiply per sub-block and token cost more than vpdpbusd saves:
# 1 thread, 512 x 1024, 64 tokens, Zen 5, G MACs/s with / without: Q4_K 131-144 / 125, MXFP4 114-116 / 96; Q2_K
# 76-94 / 120, Q3_K 79-93 / 105, Q6_K 72-85 / 90 (bench/bench_repack.py, PYMOE_VNNI=1 / 0); IQ4_XS (scales per 32,
# and no vpsignb per token with VNNI) 122-131 / 96 (two runs against one); Q5_K, wide, 167-169 / 120-125 (one
# row-group loop, medians of 40 alternated calls in one process; narrow VNNI was slower, 98-101: a CPU with VNNI
# but not the 512-bit form would do better without); Q8_0, wide, 187-190 / 101-104 (the same loop).
VNNI_MANY = {QType.Q4_K, QType.Q5_K, QType.Q8_0, QType.MXFP4, QType.IQ4_XS, DECODED}


def _make_tile_dot(qtype, portable: bool = False, vnni: bool = None, wide: bool = None, locality: int = None,
                   ahead: int = None):
    """-> tile_dot(tiles uint8 [nb * TILE_BYTES], xq, xd, xbs, out): the row-group's 8 rows times one token (xq int8
    [nb * 256], xd float32 [nb], xbs int32 [nb * 16], out float32 [8]) or times MANY tokens at once (the same arrays
    2-D, one C-contiguous row per token, out [MANY, 8]: the weights unpacked once for them; each token's bits those
    of its one-token call). It also types for int16 xq, so that a kernel compiled for both activation widths may
    hold the call; at 16 bits its body is a trap (callers pass no tiles then). portable: the IR without x86
    intrinsics (CPUs without AVX2); vnni: with vpdpbusd or without (None: as this CPU allows, `_VNNI`). The
    one-token dot asks for the tile bytes `ahead` (None: STREAM_AHEAD; 0: none) past those it reads, at prefetch
    `locality` (None: qact.DENSE_LOCALITY, for the dense weights, read again next token; the routed experts, read
    once: qact.STREAM_LOCALITY, `TILE_DOTS_STREAM`).
    With tiles 2-D (uint8 [2, nb * TILE_BYTES], two neighbouring row-groups) and MANY tokens, out [MANY, 16]: the pair
    form (formats in PAIR, on a CPU with 512-bit VNNI; a trap elsewhere: callers check PAIRS), lane by lane the bits
    of the one-row-group calls."""
    ahead = STREAM_AHEAD if ahead is None else ahead
    locality = qact.DENSE_LOCALITY if locality is None else locality
    vnni = _VNNI if vnni is None else vnni
    wide_ok = _WIDE if wide is None else wide  # the 512-bit forms allowed
    qtype = _key(qtype)
    wide = wide_ok and qtype in (WIDES if wide is None else WIDE)  # the blocks written for two chunks only (and
    # by default those this CPU runs so)
    codegens = {1: _make_codegen(qtype, _AVX2 and not portable, 1, vnni, wide, ahead, locality),
                2: _make_codegen(qtype, _AVX2 and not portable, MANY, vnni and qtype in VNNI_MANY, wide)}
    pair = _AVX2 and not portable and vnni and wide_ok and qtype in PAIR

    if pair:
        codegens["pair"] = _make_codegen(qtype, True, MANY, True, True, pair=True)

    @intrinsic
    def tile_dot(typingctx, tiles, xq, xd, xbs, out):
        nd = getattr(xq, "ndim", 0)
        if (_c(tiles, types.uint8, 2) and nd == 2 and _c(xq, xq.dtype, 2) and xq.dtype in (types.int8, types.int16)
                and _c(xd, types.float32, 2) and _c(xbs, types.int32, 2) and _c(out, types.float32, 2)):
            # two row-groups, MANY tokens (a trap where this format or CPU has no such form, or at 16 bits)
            return types.none(tiles, xq, xd, xbs, out), codegens["pair"] if pair and xq.dtype == types.int8 else _trap
        if (_c(tiles, types.uint8) and nd in (1, 2) and _c(xq, xq.dtype, nd) and xq.dtype in (types.int8, types.int16)
                and _c(xd, types.float32, nd) and _c(xbs, types.int32, nd) and _c(out, types.float32, nd)):
            return types.none(tiles, xq, xd, xbs, out), codegens[nd] if xq.dtype == types.int8 else _trap

    return tile_dot


def _make_tile_dot2(qtype, locality: int = None, ahead: int = None, dual: bool = None, twice: bool = None):
    """-> tile_dot2(tiles uint8 [nb * TILE_BYTES], xq int8 [2, nb * 256], xd float32 [2, nb] (or [2, 8 nb]: per-32
    x), xbs int32 [2, nb * 16], out float32 [2, 8]): the row-group's 8 rows times two activation rows at once, the
    weights unpacked once for both: a token's two planes (qact.quantize_planes_ref) in decode. The one-token dot's
    instructions and hints (`_make_tile_dot`'s defaults), run for two rows of x: each row's results are the bits of
    its one-token call. dual (None: whether this CPU runs the format's dot so, DUALS): the two rows in the halves of
    512-bit vectors (`_Emit`'s dual), the same bits. twice (None: whether this CPU runs the format so, TWICES, unless
    dual is given): the one-token dot called on each row in turn (the tile read twice, the second time from L1),
    where that is faster than unpacking it once for two rows."""
    ahead = STREAM_AHEAD if ahead is None else ahead
    locality = qact.DENSE_LOCALITY if locality is None else locality
    qtype = _key(qtype)
    if (qtype in TWICES and dual is None) if twice is None else twice:
        one = _make_tile_dot(qtype, locality=locality, ahead=ahead)

        @njit
        def tile_dot2_twice(tiles, xq, xd, xbs, out):
            one(tiles, xq[0], xd[0], xbs[0], out[0])
            one(tiles, xq[1], xd[1], xbs[1], out[1])

        return tile_dot2_twice
    dual = qtype in DUALS if dual is None else dual
    codegen = _make_codegen(qtype, _AVX2, 2, _VNNI, qtype in WIDES and not dual, ahead, locality, dual=dual)

    @intrinsic
    def tile_dot2(typingctx, tiles, xq, xd, xbs, out):
        if _c(tiles, types.uint8) and _x_rows(xq, xd, xbs, out):
            return types.none(tiles, xq, xd, xbs, out), codegen if xq.dtype == types.int8 else _trap

    return tile_dot2


def _host_vnni() -> tuple[bool, bool]:
    """-> (vnni, wide): whether the tile dots may use vpdpbusd on 256-bit vectors (this CPU, `qact.host_features`,
    has AVX-512 VNNI with AVX-512VL, or AVX-VNNI), and on 512-bit ones (AVX-512 VNNI with AVX-512BW). PYMOE_VNNI=0 /
    PYMOE_WIDE=0 say no (the narrower form, e.g. to compare them on one machine)."""
    f = host_features()
    vnni = (os.environ.get("PYMOE_VNNI", "1") != "0" and bool(f.get("avx2"))
            and (bool(f.get("avx512vnni") and f.get("avx512vl")) or bool(f.get("avxvnni"))))
    wide = vnni and os.environ.get("PYMOE_WIDE", "1") != "0" and bool(f.get("avx512vnni") and f.get("avx512bw"))
    return vnni, wide


_VNNI, _WIDE = _host_vnni()
# Whether the x86 forms may take vgf2p8affineqb (GFNI: a byte's bits moved and masked in one operation; `_Emit.bits`).
# PYMOE_GFNI=0 says no.
_GFNI = bool(host_features().get("gfni")) and os.environ.get("PYMOE_GFNI", "1") != "0"
# 512-bit VNNI, two chunks per operation, for the formats in WIDE. Q4_K gained (1 thread, 512 x 1024, Zen 5,
# G MACs/s wide / not: T = 1 82-85 / 70-74, T = 64 167-173 / 105-130, bench/bench_repack.py with PYMOE_WIDE=1 / 0),
# and so did IQ4_XS (one-token 120 / 95, four-token 167 / 169: medians of 40 alternated calls of one row-group loop
# in one process, warm; the many-token form is no slower), Q5_K (one-token 110-112 / 88-90) and Q8_0 (one-token
# 87-107 / 77-82, four-token 128-191 / 127-153, two runs); Q2_K's, Q3_K's and
# Q6_K's one-token dots, written wide too, were no faster (their 16-weight scales: a fold and a multiply per two
# chunks), so they stay 256-bit.
WIDE = {QType.Q4_K, QType.Q5_K, QType.Q8_0, QType.IQ4_XS}
# On Zen 4 (512-bit operations in two 256-bit halves) the 256-bit VNNI form is the faster one (bench/tile_forms.py,
# the 2-core Zen 4 VM, 2026-12-07, G MACs/s one token / 4 tokens, 256-bit / 512-bit: Q4_K 72.6 / 107.1 against 63.5
# / 84.4, Q8_0 94.6 / 140.4 against 86.2 / 110.2, IQ4_XS 70.3 / 125.1 against 62.2 / 85.1; and the plain two-row
# dot, us a warm matrix, 256-bit / 512-bit, bench/two_row_dots.py with PYMOE_WIDE_FORMATS unset / set: Q4_K 8.8 /
# 11.2, Q5_K 10.6 / 13.5, IQ4_XS 9.3 / 12.2, Q8_0 11.3 / 11.3), so there no format runs wide (the pair form of the
# many-token dots, measured faster there in whole prefill, stays).


def _formats_from_env(name: str):
    """The formats a comma list in environment variable `name` names ("" none), or None where it is unset; a name
    that is no format is a one-line ValueError naming the variable."""
    env = os.environ.get(name)
    if env is None:
        return None
    names = {n.strip() for n in env.split(",") if n.strip()}
    if not names <= set(QType.__members__):
        raise ValueError(f"{name}: no such format(s) {sorted(names - set(QType.__members__))}")
    return {QType[n] for n in names}


def _wides() -> set:
    """The formats of WIDE this CPU's tile dots run on 512-bit vectors: where it has 512-bit VNNI (_WIDE), WIDE less
    those measured slower so on this CPU (CPU_FORMS "narrow"); PYMOE_WIDE_FORMATS: a comma list instead ("" none)."""
    chosen = _formats_from_env("PYMOE_WIDE_FORMATS")
    chosen = WIDE - _cpu_forms("narrow") if chosen is None else chosen
    return {q for q in chosen & WIDE if _WIDE}


# the formats whose two-row-group dot this CPU runs (PYMOE_PAIR=0: none, the wide form alone, to compare them)
PAIRS = {q for q in PAIR if _AVX2 and _WIDE and os.environ.get("PYMOE_PAIR", "1") != "0"}
# The formats whose two-row dot (decode's two planes, `_make_tile_dot2`) comes in the dual form on a CPU with
# 512-bit VNNI: the row-group's weights broadcast to both halves of a vector, each plane's activations in one half.
# 1 thread, one warm 512 x 1024 matrix, us dual / plain (the plain form of Q4_K: its wide one), medians of 30-60
# alternated rounds in one process, several processes, Intel Emerald Rapids VM under other jobs
# (bench/two_row_dots.py's loops): Q4_K 9.6-10.8 / 10.7-12.3; Q2_K 11.2-12.9 / 11.1-16.4 (the plain form's time
# moves from process to process, the dual form's less; medians of eight processes 11.9 / 12.4); Q3_K 15.2-17.9 /
# 13.3-16.2; Q6_K 15.7-17.1 / 13.7-15.5; Q5_K 13.7-14.2 / 12.6-12.9; IQ4_XS 11.3 / 11.1; Q8_0 10.3 / 10.5. On this
# CPU a 512-bit operation has two ports where a 256-bit one has three, and a plane's activations take a shuffle
# into their half, so the dual form gains only where the plain form's work besides the dots is large (Q4_K's wide
# fold, Q2_K's scales and mins).
# On Zen 4 (its 512-bit operations run as two 256-bit halves) the dual form is the slower one for every format.
# 1 thread, one warm 512 x 1024 matrix, us one-token / two-row plain / dual / twice (the one-token dot on each plane:
# the tile read a second time from L1), medians of 40 alternated rounds (bench/two_row_dots.py, the 2-core Zen 4 VM,
# 2026-12-07): Q2_K 8.0 / 12.3 / 22.6 / 17.4, Q3_K 8.8 / 14.9 / 22.7 / 18.1, Q4_K 6.2 / 11.3 / 14.3 / 13.1, Q5_K 9.9 /
# 13.5 / 20.7 / 19.2, Q6_K 9.2 / 19.9 / 22.6 / 19.5, Q8_0 8.0 / 10.7 / 16.4 / 14.5, IQ4_XS 9.5 / 14.7 / 20.7 / 20.4.
# Q3_K ran twice there (11.0 / 27.7 / 30.4 / 24.6) until its planes came out by GFNI (`_block_symmetric`): whole
# decode of the mid Q2_K mix, 2 threads, --act-bits 15, the plain two-row dot against twice (bench/techniques.py
# --variants q3_k_two_row --runs 7): 158.5 against 149.8 tok/s.
DUAL = {QType.Q2_K, QType.Q4_K}
# The forms measured faster on one CPU than the defaults above, by the CPU Numba compiles for (qact.host_cpu_name):
# "narrow" the formats of WIDE whose dots run 256 bits wide, "plain" those of DUAL whose two-row dot has no dual
# form, "twice" those whose two-row dot is two one-token dots. Zen 4's figures: above.
CPU_FORMS = {"znver4": {"narrow": WIDE, "plain": DUAL}}


def _cpu_forms(kind: str) -> set:
    return CPU_FORMS.get(qact.host_cpu_name(), {}).get(kind, set())


def _two_row_forms() -> tuple[set, set]:
    """-> (DUALS, TWICES): the formats whose two-row dot this CPU runs in the dual form, and those it runs as two
    one-token dots, as measured for this CPU (CPU_FORMS); PYMOE_DUAL=0 / 1: none / all of DUAL instead (where the
    CPU has 512-bit VNNI); PYMOE_TWICE: a comma list of formats instead ("" none)."""
    env = os.environ.get("PYMOE_DUAL")
    duals = DUAL - _cpu_forms("plain") if env is None else DUAL if env != "0" else set()
    twices = _formats_from_env("PYMOE_TWICE")
    twices = {q for q in (_cpu_forms("twice") if twices is None else twices) if _AVX2}
    return {q for q in duals if _AVX2 and _WIDE} - twices, twices


WIDES = _wides()
DUALS, TWICES = _two_row_forms()
FORM_TAG = ("d" + "".join(sorted(q.name for q in DUALS)) + "t" + "".join(sorted(q.name for q in TWICES))
            + "w" + "".join(sorted(q.name for q in WIDES)))  # the forms chosen, in compiled kernels' names
# (PYMOE_DUAL, PYMOE_TWICE, PYMOE_WIDE_FORMATS)
# How far ahead of the block it reads the one-token dot asks for tile bytes (the next row-group's and beyond: a
# row-group of Q4_K is 4.5 KiB at 1024 columns). Asked from inside the block loop, a hint per 64 bytes among the
# block's own loads, rather than a row-group's worth in one burst before the call (the MoE kernel's and the
# dense products' way until round eleven), which fills the core's miss buffers at once while the dot waits. The
# MoE kernel on 8 random experts not in cache (mid Q4_K_M, 2 threads, 8-bit; bench/stream_ahead.py, median us of
# 480 calls, three runs): no hints 208 / 218 / 215, 4 KiB 171 / 180 / 193, 8 KiB 166 / 175 / 198, 16 KiB 185 /
# 195 / 204. Whole decode, the old bursts and these hints alternated run by run in one process (16 runs of 64
# tokens): the MoE kernel 228 -> 219 us a layer, 4.75 -> 4.64 ms a token.
# On the 2-core Zen 4 VM of round eighteen the hints, non-temporal, only added work (the same benchmark, 2 threads,
# median / p20 us of 720 calls, in two runs: 8 KiB 388 / 309 and 377 / 303, 4 KiB 362 / 280, 1 KiB 325 / 251, none
# 350 / 257 and 330 / 247), so that CPU went without until round nineteen found the hint it wants: into L2
# (qact.STREAM_LOCALITY, with the figures in kernels), 8 KiB ahead as elsewhere. PYMOE_STREAM_AHEAD=<bytes> chooses
# (0: none). The dense weights' dots ask at qact.DENSE_LOCALITY (prefetcht0; prefetcht1 on Zen 4).
STREAM_AHEAD = int(os.environ.get("PYMOE_STREAM_AHEAD", "8192"))
# The dense weights' one-token and two-row dots ask STREAM_AHEAD ahead too, but Q8_0's ask for nothing: its tiles
# are the plainest stream (2176 bytes a block, 34 hints), which the hardware prefetcher follows alone, and the hints
# only cost it. bench/dense_ahead.py (a matrix not in cache, 2 MB of other memory read before each call, two planes,
# 2 threads, 2-core Zen 4, medians of 11 alternated rounds), us a call with no hints / 8 KiB ahead: Q8_0 1024 x 1024
# 36.9 / 44.1 (back to back, no reads between: 38.2 / 47.1; 4096 x 2048: 282.7 / 329.8), Q4_K 31.3 / 23.9. In
# decode (bench/decode_breakdown.py on the mid MXFP4_MOE file, whose dense weights are Q8_0; three runs each,
# alternated) q/k/v took 1.02 / 1.36 / 0.99 ms a token against 1.09 / 1.15 / 1.17 with the hints, the other
# products 0.90 / 1.00 / 0.87 against 0.92 / 0.99 / 1.02: ~2% of the token, under the whole decode's noise
# (bench/techniques.py dense_q8_0_unhinted: a tie). PYMOE_DENSE_AHEAD=<bytes> sets every format's.
_NO_DENSE_HINTS = {QType.Q8_0}


def _dense_ahead(qtype) -> int:
    """Bytes ahead the dense weights' dots of this format ask for: PYMOE_DENSE_AHEAD if set; else none for Q8_0,
    STREAM_AHEAD for the rest."""
    if os.environ.get("PYMOE_DENSE_AHEAD"):
        return int(os.environ["PYMOE_DENSE_AHEAD"])
    return 0 if qtype in _NO_DENSE_HINTS else STREAM_AHEAD


DENSE_AHEAD = {q: _dense_ahead(q) for q in TILE_BYTES}  # every format with tiles
DENSE_TAG = "a" + "-".join(str(a) for a in DENSE_AHEAD.values())  # in the dense products' kernel names
TILE_DOTS = {q: _make_tile_dot(q, ahead=a) for q, a in DENSE_AHEAD.items()}  # the dense weights'
TILE_DOTS_STREAM = {q: _make_tile_dot(q, locality=qact.STREAM_LOCALITY) for q in TILE_DOTS}  # the experts' (the
# hint for bytes read once)
# the decoded layout's (a scratch tile, in L1: no hints ahead)
tile_dot_decoded = _make_tile_dot(DECODED, ahead=0)
# two rows of x a call (a token's two planes): the dense weights' and the experts' (the hint for bytes read once)
TILE_DOTS2 = {q: _make_tile_dot2(q, ahead=DENSE_AHEAD[q]) for q in TILE_DOTS}
TILE_DOTS2_STREAM = {q: _make_tile_dot2(q, locality=qact.STREAM_LOCALITY) for q in TILE_DOTS}


TILE_DOT, TILE_DOT2, TILE_PAIR = None, None, False  # bound per format by _compile_matmul
TILE_SCALED, SCALE, SCALED_DOT, SCALE_PAIR, TILE, SCALED_MIN = False, None, None, None, 0, 0  # (and the scaled path's)


# The scaled layout: the expansion (two row-groups at a time, into scratch, where an expert meets enough rows of x)
# and its dot (MANY rows of x)
def scale_pair_ref(tiles: np.ndarray, qtype) -> np.ndarray:
    """NumPy, the reference: two row-groups of Q2_K or Q3_K tiles uint8 [2, nb * TILE_BYTES] -> their scaled layout
    uint8 [nb * SCALED_BLOCK] (see SCALED_BLOCK)."""
    qtype = QType(qtype)
    nb = tiles.shape[1] // TILE_BYTES[qtype]
    t = tiles.reshape(2, nb, TILE_BYTES[qtype])
    k = (8 * np.arange(2)[:, None, None] + 2 * np.arange(4)[None, :, None]
         + np.arange(8)[None, None, :] // 4)  # [h, j, c] the sub-block of weights 128 h + 32 j + 4 c ..
    j = np.arange(4).reshape(1, 1, 1, 4, 1, 1, 1)  # [rg, nb, h, j, c, r, i]
    if qtype == QType.Q2_K:
        sc = (t[..., 32:160].reshape(2, nb, 16, ROWS) & 15).astype(np.int32)  # [rg, nb, k, r]
        qs = t[..., 160:].reshape(2, nb, 2, 1, 8, ROWS, 4).astype(np.int32)  # [rg, nb, h, -, c, r, i]
        q = (qs >> (2 * j)) & 3  # [rg, nb, h, j, c, r, i]
    else:
        sc = t[..., 16:144].reshape(2, nb, 16, ROWS).view(np.int8).astype(np.int32)
        qs = t[..., 144:656].reshape(2, nb, 2, 1, 8, ROWS, 4).astype(np.int32)
        hm = t[..., 656:].reshape(2, nb, 1, 1, 8, ROWS, 4).astype(np.int32)
        h = np.arange(2).reshape(1, 1, 2, 1, 1, 1, 1)
        q = ((qs >> (2 * j)) & 3) + 4 * ((hm >> (4 * h + j)) & 1) - 4  # -4..3
    u = sc[:, :, k][..., None] * q + SCALED_BIAS[qtype]  # [rg, nb, h, j, c, r, i]: sc[rg, nb, k(h, j, c), r]
    qsout = u.reshape(2, nb, 8, 8, ROWS, 4).transpose(1, 2, 3, 0, 4, 5)  # [nb, g = 4 h + j, c, rg, r, i]
    out = np.concatenate([t[0, :, :SCALED_HEAD], t[1, :, :SCALED_HEAD], qsout.reshape(nb, 4096).astype(np.uint8)],
                         axis=1)
    return out.reshape(nb * SCALED_BLOCK)


def _make_scale_pair(src):
    """-> scale_pair(tiles uint8 [2, nb * TILE_BYTES] (two row-groups, rows C-contiguous), out uint8 [nb *
    SCALED_BLOCK]): scale_pair_ref's bytes, vector code (a 32-byte chunk of 8 rows x 4 weights at a time: a bit-plane
    out by `_Emit.bits`, each row's scale to its 4 bytes by one shuffle, one byte multiply: mod 256 it is exact, the
    result being 0..255)."""
    tile = TILE_BYTES[src]
    q3 = src == QType.Q3_K
    qs_at, sc_at = (144, 16) if q3 else (160, 32)

    def codegen(context, builder, signature, args):
        ta, oa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args, args))
        e = _Emit(builder, _AVX2)
        b = builder
        stride = cgutils.unpack_tuple(b, ta.strides, 2)[0]
        nb = b.udiv(cgutils.unpack_tuple(b, ta.shape, 2)[1], ir.Constant(_i64, tile))
        spread = _vec(_i32, 32, [r // 4 for r in range(32)])  # row r's scale to bytes 4 r .. 4 r + 3
        with cgutils.for_range(b, nb) as loop:
            t0 = b.mul(loop.index, ir.Constant(_i64, tile))
            o = b.mul(loop.index, ir.Constant(_i64, SCALED_BLOCK))
            for rg in range(2):
                t = b.add(t0, stride) if rg else t0
                for i in range(SCALED_HEAD // 32):
                    v = e.load(ta.data, e.at(t, 32 * i), _V32B)
                    b.store(v, b.bitcast(b.gep(oa.data, [e.at(o, SCALED_HEAD * rg + 32 * i)]), _V32B.as_pointer()),
                            align=1)
                for h in range(2):
                    for c in range(8):
                        q = e.load(ta.data, e.at(t, qs_at + 32 * (8 * h + c)), _V32B)
                        hm = e.load(ta.data, e.at(t, 656 + 32 * c), _V32B) if q3 else None
                        for j in range(4):
                            v = e.bits(q, 2 * j, 2)
                            k = 8 * h + 2 * j + c // 4
                            sc = e.load(ta.data, e.at(t, sc_at + 8 * k), ir.VectorType(_i8, 8))
                            sc = b.shuffle_vector(sc, sc, spread)  # [32]
                            if q3:  # sc * (q' - 4) + 127 = sc * q' + (127 - 4 sc), q' = q + 4 (0..7)
                                v = b.or_(v, e.bits(hm, 4 * h + j, 1, 2))
                                u = b.add(b.mul(v, sc), b.sub(_vec(_i8, 32, [127] * 32),
                                                              b.shl(sc, _vec(_i8, 32, [2] * 32))))
                            else:
                                u = b.mul(v, b.and_(sc, _vec(_i8, 32, [15] * 32)))
                            at = e.at(o, SCALED_QS + 64 * (8 * (4 * h + j) + c) + 32 * rg)
                            b.store(u, b.bitcast(b.gep(oa.data, [at]), _V32B.as_pointer()), align=1)
        return context.get_dummy_value()

    @intrinsic
    def scale_pair(typingctx, tiles, out):
        if _c(tiles, types.uint8, 2) and _c(out, types.uint8):
            return types.none(tiles, out), codegen

    return scale_pair


SCALE_PAIRS = {q: _make_scale_pair(q) for q in SCALED}


def scale_pair(tiles: np.ndarray, qtype) -> np.ndarray:
    """Two row-groups of Q2_K or Q3_K tiles uint8 [2, nb * TILE_BYTES] -> their scaled layout uint8 [nb *
    SCALED_BLOCK], compiled (the MoE kernel calls SCALE_PAIRS' intrinsic on its scratch; this is for the tests)."""
    qtype = QType(qtype)
    fn = _SCALE_PAIR_FNS.get(qtype)
    if fn is None:
        one = SCALE_PAIRS[qtype]

        @njit
        def fn(t, o):
            one(t, o)

        _SCALE_PAIR_FNS[qtype] = fn
    tiles = np.ascontiguousarray(tiles)
    out = np.empty(tiles.shape[1] // TILE_BYTES[qtype] * SCALED_BLOCK, dtype=np.uint8)
    fn(tiles, out)
    return out


_SCALE_PAIR_FNS = {}
# The formats whose prefill scales two row-groups of tiles into scratch where they meet SCALED_MIN_ROWS rows of x or
# more (an expert's pairs in the MoE kernel, a prefill chunk in tile_matmul): where this CPU runs their pair form
# (PAIRS, which needs 512-bit VNNI); PYMOE_SCALED=0: none (to compare)
SCALED_PAIRS = {q for q in SCALED if q in PAIRS and _VNNI and os.environ.get("PYMOE_SCALED", "1") != "0"}


def _make_scaled_dot(src):
    """-> scaled_dot(scaled uint8 [nb * SCALED_BLOCK], xq int8 [MANY, nb * 256], xd float32 [MANY, nb], xbs int32
    [MANY, nb * 16], out float32 [MANY, 16]): 16 rows of the scaled layout of `src` times MANY rows of x, each row's
    bits those of the source tiles' one-token calls; a trap where this CPU has no such form or at 16 bits."""
    codegen = _make_codegen(SCALED[src], True, MANY, True, True, pair=True) if src in SCALED_PAIRS else None

    @intrinsic
    def scaled_dot(typingctx, scaled, xq, xd, xbs, out):
        if _c(scaled, types.uint8) and _x_rows(xq, xd, xbs, out):
            return types.none(scaled, xq, xd, xbs, out), (codegen if codegen is not None and xq.dtype == types.int8
                                                          else _trap)

    return scaled_dot


SCALED_DOTS = {q: _make_scaled_dot(q) for q in SCALED}


def _scaled_matmul_template(tiles, xq, xd, xbs, y):
    # y float32 [T, R] = X W^T, W as tiles [R / 8, row_tiles] (R / 8 even, T a multiple of MANY): each pair of
    # row-groups scaled into scratch, then MANY rows of x a call: what the MoE kernel does per expert
    nb = tiles.shape[1] // TILE
    for p in prange(tiles.shape[0] // 2):
        scratch = np.empty(nb * SCALED_BLOCK, dtype=np.uint8)
        out2 = np.empty((MANY, 2 * ROWS), dtype=np.float32)
        SCALE_PAIR(tiles[2 * p:2 * p + 2], scratch)  # (bound by _compile)
        for t in range(0, xq.shape[0], MANY):
            SCALED_DOT(scratch, xq[t:t + MANY], xd[t:t + MANY], xbs[t:t + MANY], out2)
            y[t:t + MANY, 2 * p * ROWS:(2 * p + 2) * ROWS] = out2


_SCALED_MATMULS = {}


def scaled_matmul(tiles: np.ndarray, qtype, xq: np.ndarray, xd: np.ndarray, xbs: np.ndarray) -> np.ndarray:
    """X W^T -> float32 [T, R] for Q2_K or Q3_K tiles uint8 [R / 8, row_tiles] (R / 8 even, T a multiple of MANY,
    qtype in SCALED_PAIRS) through the scaled layout: tile_matmul's bits."""
    qtype = QType(qtype)
    if qtype not in SCALED_PAIRS or tiles.shape[0] % 2 or xq.shape[0] % MANY:
        raise ValueError(f"scaled_matmul: {qtype.name} has no scaled dot on this CPU, or {tiles.shape[0]} row-groups"
                         f" / {xq.shape[0]} rows are not whole pairs / multiples of {MANY}")
    _check_x(qtype, xq, xd)
    fn = _SCALED_MATMULS.get(qtype)
    if fn is None:
        fn = _SCALED_MATMULS[qtype] = _compile(_scaled_matmul_template, f"scaled_matmul_{qtype.name}",
                                               {"SCALE_PAIR": SCALE_PAIRS[qtype], "SCALED_DOT": SCALED_DOTS[qtype],
                                                "TILE": TILE_BYTES[qtype]})
    y = np.empty((xq.shape[0], tiles.shape[0] * ROWS), dtype=np.float32)
    fn(tiles, xq, xd, xbs, y)
    return y


AHEAD = 4096  # bytes of tiles requested ahead of the row-group being read by the many-token product (as
# kernels.PREFETCH_AHEAD; decode of the mid Q4_K_M file, 0 / 4096 alternated in one process, when one-token products
# took this way too: p20 5.32 / 5.15 ms a token, median 5.70 / 5.56). The one-token dot asks for its own
# (STREAM_AHEAD).
TOKENS = 64  # tokens per step of the many-token product: their activations (64 KiB at C = 1024) stay in L2


def _tile_matmul_template(tiles, xq, xd, xbs, y, ahead):
    # y float32 [T, R] = X W^T, W as tiles [R / 8, row_tiles], X as 8-bit rows xq [T, C], xd, xbs. A task owns 4
    # row-groups (32 rows, a few KiB of tiles: in L1) and walks the tokens TOKENS at a time, MANY per TILE_DOT call
    # (the rest one by one), two row-groups a call where the format has that form on this CPU (TILE_PAIR: PAIRS);
    # each token's results are its one-token call's bits.
    n, T = tiles.shape[0], xq.shape[0]
    base, rg = tiles.ctypes.data, tiles.shape[1]  # rg: bytes of a row-group
    for task in prange((n + 3) // 4):
        out = np.empty((MANY, ROWS), dtype=np.float32)
        out2 = np.empty((MANY, 2 * ROWS), dtype=np.float32)  # a two-row-group call's
        g1 = min(n, 4 * task + 4)
        # enough rows of x (TILE_SCALED: Q2_K, Q3_K): the task's two pairs of row-groups scaled once into scratch
        # (scale_pair), then read by the scaled dot (the same bits)
        scaled = TILE_SCALED and xq.itemsize == 1 and T >= SCALED_MIN
        sc = np.empty((2, tiles.shape[1] // TILE * SCALED_BLOCK if scaled else 0), dtype=np.uint8)
        if scaled:
            for h in range(2):
                if 4 * task + 2 * h + 1 < g1:
                    SCALE(tiles[4 * task + 2 * h:4 * task + 2 * h + 2], sc[h])
        for t0 in range(0, T, TOKENS):
            t1 = min(T, t0 + TOKENS)
            g = 4 * task
            while g < g1:
                m = 2 if TILE_PAIR and g + 1 < g1 else 1  # row-groups in this step
                if t0 == 0 and ahead > 0 and T >= MANY:  # the bytes `ahead` asked for on the first pass (one-token
                    # dots ask for their own)
                    prefetch_ahead(base, g * rg, m * rg, n * rg, ahead)
                t = t0
                while t + MANY <= t1:
                    if m == 2:
                        if scaled:
                            SCALED_DOT(sc[(g - 4 * task) // 2], xq[t:t + MANY], xd[t:t + MANY], xbs[t:t + MANY], out2)
                        else:
                            TILE_DOT(tiles[g:g + 2], xq[t:t + MANY], xd[t:t + MANY], xbs[t:t + MANY], out2)
                        for i in range(MANY):
                            y[t + i, g * ROWS:(g + 2) * ROWS] = out2[i]
                    else:
                        TILE_DOT(tiles[g], xq[t:t + MANY], xd[t:t + MANY], xbs[t:t + MANY], out)
                        for i in range(MANY):
                            y[t + i, g * ROWS:(g + 1) * ROWS] = out[i]
                    t += MANY
                if t1 - t == 2 and xq.itemsize == 1:  # two rows left (decode's two planes of one token): one call
                    for h in range(g, g + m):  # of the two-row dot each, the tile unpacked once (the same bits)
                        TILE_DOT2(tiles[h], xq[t:t1], xd[t:t1], xbs[t:t1], out[:2])
                        y[t, h * ROWS:(h + 1) * ROWS] = out[0]
                        y[t + 1, h * ROWS:(h + 1) * ROWS] = out[1]
                    t = t1
                for h in range(g, g + m):
                    for u in range(t, t1):
                        TILE_DOT(tiles[h], xq[u], xd[u], xbs[u], y[u, h * ROWS:(h + 1) * ROWS])
                g += m


def _compile(template, name: str, constants: dict):
    """`template` compiled with some of its globals bound to `constants` (the tile dots), under `name` plus the
    instruction-form suffix (jit.bind): the name keys Numba's on-disk cache, whose key also holds this CPU's name
    and features, not PYMOE_VNNI / PYMOE_WIDE / PYMOE_PAIR / PYMOE_STREAM_AHEAD / PYMOE_DENSE_LOCALITY /
    PYMOE_DUAL / PYMOE_TWICE / PYMOE_WIDE_FORMATS / PYMOE_DENSE_AHEAD."""
    return bind(template, name + f"{'_vnni' if _VNNI else ''}{'_wide' if _WIDE else ''}{'_pair' if PAIRS else ''}"
                f"_s{STREAM_AHEAD}_l{qact.DENSE_LOCALITY}_{FORM_TAG}_{DENSE_TAG}", constants, parallel=True)


@njit(cache=True)
def _never_scale(tiles, out):
    """The scaling of a format without a scaled layout: never reached (TILE_SCALED, kernels' SCALED_* say), compiled
    as a stub."""
    raise AssertionError("no scaled layout for this type")


@njit(cache=True)
def _never_dot(tiles, xq, xd, xbs, out):
    """The scaled dot of a format without one: never reached, a stub (as _never_scale)."""
    raise AssertionError("no scaled layout for this type")


def _compile_matmul(qtype):
    scaled = qtype in SCALED_PAIRS
    return _compile(_tile_matmul_template, f"tile_matmul_{qtype.name}{'_scaled' if scaled else ''}",
                    {"TILE_DOT": TILE_DOTS[qtype], "TILE_DOT2": TILE_DOTS2[qtype], "TILE_PAIR": qtype in PAIRS,
                     "TILE_SCALED": scaled, "SCALE": SCALE_PAIRS[qtype] if scaled else _never_scale,
                     "SCALED_DOT": SCALED_DOTS[qtype] if scaled else _never_dot, "TILE": TILE_BYTES[qtype],
                     "SCALED_MIN": SCALED_MIN_ROWS.get(qtype, 0)})


_MATMULS = {q: _compile_matmul(q) for q in TILE_DOTS}
_MATMULS[DECODED] = _compile(_tile_matmul_template, "tile_matmul_decoded",
                             {"TILE_DOT": tile_dot_decoded, "TILE_DOT2": _make_tile_dot2(DECODED, ahead=0),
                              "TILE_PAIR": DECODED in PAIRS, "TILE_SCALED": False, "SCALE": _never_scale,
                              "SCALED_DOT": _never_dot, "TILE": qact.DECODED_TILE, "SCALED_MIN": 0})


def _decode_template(raw, out):
    # out uint8 [R / 8, nb * DECODED_TILE] = raw uint8 [R, row_bytes] of a Grid format, decoded row by row
    for r in prange(raw.shape[0]):
        ROW_DECODE(raw[r], out[r // ROWS], r % ROWS)  # noqa: F821 (bound by _compile)


_DECODERS = {}


def decode_tiles(raw: np.ndarray, qtype) -> np.ndarray:
    """Raw rows uint8 [R, row_bytes] of a Grid format (qact.ROW_DECODES; R a multiple of 8) -> its decoded
    layout uint8 [R / 8, nb * DECODED_TILE], the input of tile_matmul(..., DECODED, ...). The MoE kernel decodes
    16 rows at a time into scratch instead (kernels._moe_kernel); this is the whole-matrix form for the tests."""
    qtype = QType(qtype)
    fn = _DECODERS.get(qtype)
    if fn is None:
        fn = _DECODERS[qtype] = _compile(_decode_template, f"decode_tiles_{qtype.name}",
                                         {"ROW_DECODE": qact.ROW_DECODES[qtype]})
    raw = np.ascontiguousarray(raw)
    out = np.empty((raw.shape[0] // ROWS, raw.shape[1] // get_format(qtype).row_bytes(QK_K) * qact.DECODED_TILE),
                   dtype=np.uint8)
    fn(raw, out)
    return out


def decoded_matmul(raw: np.ndarray, qtype, xq: np.ndarray, xd: np.ndarray, xbs: np.ndarray) -> np.ndarray:
    """X W^T -> float32 [T, R] for raw rows uint8 [R, row_bytes] of a Grid format (IQ1-IQ3; R a multiple of 8) and
    T rows of 8-bit activations: the matrix decoded (a transient copy, 8.6 bits a weight: 1.1 MiB for 1024 x 1024),
    then tile_matmul over it (a prefill chunk's dense products; kernels.matmul_act calls it). The raw rows' bits."""
    return tile_matmul(decode_tiles(raw, qtype), DECODED, xq, xd, xbs)


def decoded_values(tiles: np.ndarray) -> np.ndarray:
    """NumPy: a decoded layout uint8 [R / 8, nb * DECODED_TILE] -> the weights float32 [R, nb * 256], d * scale *
    q (each product exact in float32: d's 11-bit mantissa times |scale * q| <= 31 * 62 < 2^11)."""
    g, n = tiles.shape[0], tiles.shape[1] // qact.DECODED_TILE
    blk = tiles.reshape(g, n, qact.DECODED_TILE)
    d = blk[:, :, :32].copy().view(np.float32)  # [g, n, 8]
    sc = blk[:, :, 32:160].view(np.int8).reshape(g, n, 16, 8).astype(np.float32)  # [g, n, k, r]
    q = blk[:, :, 160:].view(np.int8).reshape(g, n, 8, 8, 8, 4).astype(np.float32)  # [g, n, group, chunk, r, 4]
    q = q.transpose(0, 4, 1, 2, 3, 5).reshape(g, 8, n, 16, 16)  # [g, r, n, k, 16]
    w = q * sc.transpose(0, 3, 1, 2)[..., None] * d.transpose(0, 2, 1)[:, :, :, None, None]
    return w.reshape(g * 8, n * 256)


def _tile_matvec3_template(t0, t1, t2, xq, xd, xbs, y0, y1, y2):
    # One token (or a token's two planes: xq [2, C], qact.quantize_planes_ref) times three matrices that share it (a
    # layer's q, k and v): one parallel region over all their row-groups, 4 a task, so the short k and v share the
    # threads with q instead of each paying a call and a region of its own. Each row has the bits of tile_matmul's
    # one-token call (the same TILE_DOT, the same order), whose block loop asks for the bytes ahead (STREAM_AHEAD).
    n0, n1, n2 = t0.shape[0], t1.shape[0], t2.shape[0]
    b0, b1 = (n0 + 3) // 4, (n1 + 3) // 4  # tasks of the first two matrices
    for task in prange(b0 + b1 + (n2 + 3) // 4):
        if xq.shape[0] == 2:  # a token's two planes: the two-row dots, each tile unpacked once
            o = np.empty((2, ROWS), dtype=np.float32)
            if task < b0:
                for g in range(4 * task, min(n0, 4 * task + 4)):
                    TILE_DOT2_0(t0[g], xq, xd, xbs, o)
                    y0[:, g * ROWS:(g + 1) * ROWS] = o
            elif task < b0 + b1:
                for g in range(4 * (task - b0), min(n1, 4 * (task - b0) + 4)):
                    TILE_DOT2_1(t1[g], xq, xd, xbs, o)
                    y1[:, g * ROWS:(g + 1) * ROWS] = o
            else:
                for g in range(4 * (task - b0 - b1), min(n2, 4 * (task - b0 - b1) + 4)):
                    TILE_DOT2_2(t2[g], xq, xd, xbs, o)
                    y2[:, g * ROWS:(g + 1) * ROWS] = o
            continue
        if task < b0:
            for g in range(4 * task, min(n0, 4 * task + 4)):
                TILE_DOT_0(t0[g], xq[0], xd[0], xbs[0], y0[0, g * ROWS:(g + 1) * ROWS])
        elif task < b0 + b1:
            for g in range(4 * (task - b0), min(n1, 4 * (task - b0) + 4)):
                TILE_DOT_1(t1[g], xq[0], xd[0], xbs[0], y1[0, g * ROWS:(g + 1) * ROWS])
        else:
            for g in range(4 * (task - b0 - b1), min(n2, 4 * (task - b0 - b1) + 4)):
                TILE_DOT_2(t2[g], xq[0], xd[0], xbs[0], y2[0, g * ROWS:(g + 1) * ROWS])


_MATVEC3 = {}  # (three QTypes) -> the compiled _tile_matvec3_template


def _check_x(qtype, xq: np.ndarray, xd: np.ndarray) -> None:
    """x's scales are in the layout this format's tile dot reads (the dot takes its block count from xd)."""
    if xd.shape[-1] * (32 if qtype in qact.ACT32_TYPES else QK_K) != xq.shape[-1]:
        raise ValueError(f"tile dot: {getattr(qtype, 'name', qtype)} takes x with a scale per "
                         f"{32 if qtype in qact.ACT32_TYPES else QK_K} values, got xd {xd.shape} for xq {xq.shape}")


def tile_matvec3(tiles: list, qtypes: list, xq: np.ndarray, xd: np.ndarray, xbs: np.ndarray) -> list:
    """[tile_matmul(t, q, xq, xd, xbs) for t, q in zip(tiles, qtypes)] for three matrices and one token (xq int8
    [1, C]; or its two planes, [2, C]): the same bits, in one compiled call (a decode step's q, k and v: ~4 us of
    call and region each). The three take x in one layout (qact.act_group)."""
    for q in qtypes:
        _check_x(q, xq, xd)
    key = tuple(qtypes)  # QType is an IntEnum: an int key finds its member's entry (no enum call per token)
    fn = _MATVEC3.get(key)
    if fn is None:
        key = tuple(QType(q) for q in qtypes)
        fn = _MATVEC3[key] = _compile(_tile_matvec3_template, "tile_matvec3_" + "_".join(q.name for q in key),
                                      {**{f"TILE_DOT_{i}": TILE_DOTS[q] for i, q in enumerate(key)},
                                       **{f"TILE_DOT2_{i}": TILE_DOTS2[q] for i, q in enumerate(key)}})
    ys = [np.empty((xq.shape[0], t.shape[0] * ROWS), dtype=np.float32) for t in tiles]  # [1 or 2, R_i]
    fn(*tiles, xq, xd, xbs, *ys)
    return ys


def tile_matmul(tiles: np.ndarray, qtype, xq: np.ndarray, xd: np.ndarray, xbs: np.ndarray) -> np.ndarray:
    """X W^T -> float32 [T, R], W as tiles uint8 [R / 8, nb * TILE_BYTES] of qtype, X as T rows of 8-bit activations
    (xq int8 [T, C], xd [T, C/256] or [T, C/32] as qact.act_group says for qtype, xbs [T, C/16]). Row t has the bits
    of the one-row dot on row t alone."""
    _check_x(qtype, xq, xd)
    y = np.empty((xq.shape[0], tiles.shape[0] * ROWS), dtype=np.float32)  # [T, R]
    _MATMULS[qtype](tiles, xq, xd, xbs, y, AHEAD)  # keyed by QType, an IntEnum: an int finds it too
    return y
