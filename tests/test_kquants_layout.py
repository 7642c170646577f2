"""Layout checks for the K-quants (pymoe/quant/kquants.py): reference vs gguf-py, Numba twin vs reference.

What this is: small, focused tests of the bit layouts -- random blocks against the oracle, plus hand-placed bits that
pin each field to the weight index the layout comment promises (Q6_K negative scales, Q3_K hmask bits, Q4_K/Q5_K
scale-table sub-blocks 4..7). What it is not: the registry-wide dequant test (tests/test_dequant.py) or kernel tests.
"""
import gguf
import numpy as np
import pytest

from pymoe.quant import QType, get_format

K_TYPES = [QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K]

# Byte offsets of the fp16 super-scales (d, and dmin for the affine types), as in the layout comments.
FP16_OFFSETS = {QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}


def random_blocks(qtype, n, seed=0):
    """uint8 [n, type_size] random bytes, with every fp16 field a random *finite* half (subnormals and zero too)."""
    fmt = get_format(qtype)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, fmt.type_size), dtype=np.uint8)  # [n, type_size]
    for off in FP16_OFFSETS[qtype]:
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)  # [n]
        bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent all ones (inf/nan) -> clear its top bit: finite
        blocks[:, off:off + 2] = bits.view(np.uint8).reshape(n, 2)
    return blocks


def set_f16(blocks, off, value):
    blocks[:, off:off + 2] = np.array([value] * len(blocks), dtype=np.float16).view(np.uint8).reshape(-1, 2)


def oracle(blocks, qtype):
    return gguf.dequantize(blocks.reshape(-1), qtype).reshape(len(blocks), -1)  # [B, 256]


def decode(blocks, qtype, pad=0):
    """Run decode_block over all blocks at once, from a buffer starting `pad` bytes in (alignment-free reads)."""
    fmt = get_format(qtype)
    buf = np.zeros(pad + blocks.size, dtype=np.uint8)
    buf[pad:] = blocks.reshape(-1)
    out = np.full(len(blocks) * fmt.block_size, np.nan, dtype=np.float32)  # [B * 256]
    fmt.decode_block(buf[pad:], out)
    return out.reshape(len(blocks), -1)  # [B, 256]


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_random_blocks_bit_exact(qtype):
    blocks = random_blocks(qtype, 257, seed=int(qtype))
    ref = get_format(qtype).dequantize_ref(blocks)  # [B, 256]
    assert ref.dtype == np.float32 and ref.shape == (257, 256)
    np.testing.assert_array_equal(ref, oracle(blocks, qtype))
    np.testing.assert_array_equal(decode(blocks, qtype), ref)
    np.testing.assert_array_equal(decode(blocks, qtype, pad=3), ref)  # odd start address
    np.testing.assert_array_equal(decode(blocks[:1], qtype), ref[:1])  # one block


def test_q2_k_weight_index():
    """qs[32h + l] bits 2j..2j+1 -> weight 128h + 32j + l; scale/min nibbles of byte k // 16."""
    b = np.zeros((1, 84), dtype=np.uint8)
    set_f16(b, 80, 1.0)
    set_f16(b, 82, 0.5)
    b[0, 16 + 32 + 5] = 0b11_00_00_00  # h=1, l=5, j=3 -> weight 229, q=3
    b[0, 229 // 16] = (7 << 4) | 3  # its sub-block: scale 3, min 7
    w = get_format(QType.Q2_K).dequantize_ref(b)[0]
    assert w[229] == 1.0 * 3 * 3 - 0.5 * 7
    assert np.all(w[np.arange(256) // 16 != 229 // 16] == 0)
    assert np.all(np.delete(w[224:240], 229 - 224) == -3.5)  # q=0 in the same sub-block: -dmin*min
    np.testing.assert_array_equal(w, oracle(b, QType.Q2_K)[0])
    np.testing.assert_array_equal(decode(b, QType.Q2_K)[0], w)


@pytest.mark.parametrize("bit", range(8))
def test_q3_k_hmask_bits(bit):
    """hmask[l] bit j set -> weight 32j + l has no -4 offset; every other weight (low bits 0) is -4 * scale."""
    b = np.zeros((1, 110), dtype=np.uint8)
    set_f16(b, 108, 1.0)
    b[0, 96:104] = 0x11  # every 6-bit scale = 1 + 32 -> signed scale 1 ...
    b[0, 104:108] = 0xAA  # ... plus high bits 0b10 -> 33
    l = 3 * bit + 1
    b[0, l] = 1 << bit
    w = get_format(QType.Q3_K).dequantize_ref(b)[0]
    expect = np.full(256, -4.0, dtype=np.float32)
    expect[32 * bit + l] = 0.0
    np.testing.assert_array_equal(w, expect)
    np.testing.assert_array_equal(w, oracle(b, QType.Q3_K)[0])
    np.testing.assert_array_equal(decode(b, QType.Q3_K)[0], w)


def test_q3_k_negative_and_high_scales():
    b = random_blocks(QType.Q3_K, 16, seed=7)
    b[:8, 104:108] = 0x00  # high 2 bits 0 -> scales -32..-17
    b[8:, 104:108] = 0xFF  # high 2 bits 3 -> scales 16..31
    ref = get_format(QType.Q3_K).dequantize_ref(b)
    np.testing.assert_array_equal(ref, oracle(b, QType.Q3_K))
    np.testing.assert_array_equal(decode(b, QType.Q3_K), ref)


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q5_K], ids=lambda t: t.name)
@pytest.mark.parametrize("j", range(8))
def test_q4_q5_scale_table_sub_block(qtype, j):
    """Set only sub-block j's 6-bit scale (63) and min (45) in the 12-byte table; all quants = 1."""
    fmt = get_format(qtype)
    b = np.zeros((1, fmt.type_size), dtype=np.uint8)
    set_f16(b, 0, 1.0)
    set_f16(b, 2, 1.0)
    s = b[0, 4:16]
    sc, m = 63, 45
    if j < 4:
        s[j], s[j + 4] = sc, m
    else:  # low 4 bits in byte j+4 (scale low nibble, min high nibble), high 2 bits on top of bytes j-4 / j
        s[j + 4] = (sc & 15) | ((m & 15) << 4)
        s[j - 4] |= (sc >> 4) << 6
        s[j] |= (m >> 4) << 6
    qs = 16 if qtype == QType.Q4_K else 48
    b[0, qs:qs + 128] = 0x11  # every 4-bit quant = 1 (Q5_K: fifth bits 0)
    w = fmt.dequantize_ref(b)[0]
    expect = np.zeros(256, dtype=np.float32)
    expect[32 * j:32 * j + 32] = sc * 1 - m
    np.testing.assert_array_equal(w, expect)
    np.testing.assert_array_equal(w, oracle(b, qtype)[0])
    np.testing.assert_array_equal(decode(b, qtype)[0], w)


@pytest.mark.parametrize("j", range(8))
def test_q5_k_fifth_bit(j):
    """qh[l] bit j -> weight 32j + l gains 16."""
    b = np.zeros((1, 176), dtype=np.uint8)
    set_f16(b, 0, 1.0)
    b[0, 4:8] = 1  # scales of sub-blocks 0..3 = 1
    b[0, 12:16] = 1  # scales of sub-blocks 4..7 = 1
    l = 31 - 2 * j
    b[0, 16 + l] = 1 << j
    w = get_format(QType.Q5_K).dequantize_ref(b)[0]
    expect = np.zeros(256, dtype=np.float32)
    expect[32 * j + l] = 16.0
    np.testing.assert_array_equal(w, expect)
    np.testing.assert_array_equal(w, oracle(b, QType.Q5_K)[0])
    np.testing.assert_array_equal(decode(b, QType.Q5_K)[0], w)


def test_q6_k_negative_scales_and_weight_index():
    """int8 scales may be negative; ql/qh place weight 128h + 64p + l / 128h + 32j + l."""
    b = np.zeros((1, 210), dtype=np.uint8)
    set_f16(b, 208, 0.25)
    b[0, 192:208] = np.arange(-128, 128, 16, dtype=np.int8).view(np.uint8)  # scales -128, -112, ..., 112
    w = get_format(QType.Q6_K).dequantize_ref(b)[0]
    scales = np.arange(-128, 128, 16)
    np.testing.assert_array_equal(w, np.repeat(0.25 * scales * -32.0, 16).astype(np.float32))  # q = 0 - 32

    b[0, 64 + 40] = 0xF0  # ql[64h + l], h=1, l=40, high nibble -> weight 128 + 64 + 40 = 232
    b[0, 128 + 32 + 8] = 0b11_00_00_00  # qh[32h + l], h=1, l=8, bits 6-7 -> weight 128 + 96 + 8 = 232
    w = get_format(QType.Q6_K).dequantize_ref(b)[0]
    assert w[232] == np.float32(0.25 * scales[232 // 16]) * (63 - 32)
    np.testing.assert_array_equal(w, oracle(b, QType.Q6_K)[0])
    np.testing.assert_array_equal(decode(b, QType.Q6_K)[0], w)

    r = random_blocks(QType.Q6_K, 64, seed=11)
    r[:, 192:208] |= 0x80  # all scales negative
    ref = get_format(QType.Q6_K).dequantize_ref(r)
    np.testing.assert_array_equal(ref, oracle(r, QType.Q6_K))
    np.testing.assert_array_equal(decode(r, QType.Q6_K), ref)
