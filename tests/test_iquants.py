"""The formats described once as a layout (MXFP4, IQ4_NL ... IQ1_M, TQ1_0, TQ2_0): both oracles, the tables, extremes.

What this is, beyond the registry-wide tests (tests/test_dequant.py: reference == gguf.dequantize, decode_block ==
reference; tests/test_kernels.py and tests/test_cuda_kernels.py: the fused kernels):
  - the reference bit-exact with llama.cpp's own `dequantize_row_*` (libggml-base through ctypes), the second,
    independent oracle (gguf-py's quants.py is a NumPy transcription of the same C);
  - scales at the extremes of their field: fp16 d = 65504 (largest), 2^-24 (smallest subnormal), -0, 0 and
    negative values; MXFP4's E8M0 bytes 0 and 1 (subnormal float32 scales) and the largest finite ones; IQ1_M's d
    spread over four nibbles;
  - the codebooks in data/ggml_grids.npz (tools/extract-ggml-grids, from ggml-common.h) equal to gguf-py's own
    copies, and the 7-to-8 sign expansion KSIGNS equal to ggml's ksigns_iq2xs;
  - a layout's three compiled forms agree on single blocks at odd addresses (the CPU decoder) and the NumPy
    reference is the source the CUDA decoder compiles (tests/test_cuda_kernels.py runs it in the simulator).
What this is not: models (tests/test_ftypes.py).
"""
import gguf
import gguf.quants as gq
import numpy as np
import pytest

import pymoe.quant as Q
from pymoe.quant import QType, iquants
from ggml_lib import ggml_dequantize, ggml_type_info
from quant_helpers import FP16_FIELDS, random_blocks

LAYOUT_FORMATS = sorted((f for f in Q.FORMATS.values() if f.layout is not None), key=lambda f: f.name)
IDS = [f.name for f in LAYOUT_FORMATS]
EXPECTED = {"NVFP4", "Q1_0", "MXFP4", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0",
            "TQ2_0"}
# fp16 bit patterns at the ends of the field: largest finite, smallest subnormal, smallest normal, -0, +0, -1, -65504
EXTREME_F16 = np.array([0x7BFF, 0x0001, 0x0400, 0x8000, 0x0000, 0xBC00, 0xFBFF], dtype="<u2")


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def test_the_layout_formats_are_the_twelve_of_the_issue_and_llama_cpp_s_two_newest():
    assert set(IDS) == EXPECTED


@pytest.mark.parametrize("fmt", LAYOUT_FORMATS, ids=IDS)
def test_sizes_are_ggml_s(fmt):
    block_size, type_size, name = ggml_type_info(fmt.qtype)
    assert (block_size, type_size, name.upper()) == (fmt.block_size, fmt.type_size, fmt.name)


@pytest.mark.parametrize("fmt", LAYOUT_FORMATS, ids=IDS)
def test_reference_is_bit_exact_with_ggml_and_gguf(fmt):
    raw = random_blocks(fmt.qtype, 48, np.random.default_rng(5)).reshape(6, -1)  # [rows, row_bytes]
    ours = Q.dequantize(raw, fmt.qtype)  # [6, cols]
    assert np.isfinite(ours).all()
    assert np.array_equal(bits(ours), bits(ggml_dequantize(raw, fmt.qtype, fmt.block_size)))
    try:
        theirs = gguf.dequantize(raw, fmt.qtype)
    except NotImplementedError:  # gguf-py 0.19 has no Q1_0 (llama.cpp's is the oracle then)
        assert fmt.qtype == QType.Q1_0
        return
    assert np.array_equal(bits(ours), bits(theirs))


def extreme_blocks(fmt) -> np.ndarray:
    """Random blocks whose scale fields take every extreme value (uint8 [n, type_size])."""
    rng = np.random.default_rng(6)
    if fmt.qtype == QType.MXFP4:
        blocks = random_blocks(fmt.qtype, 8, rng)
        blocks[:, 0] = [0, 1, 2, 127, 128, 200, 251, 252]
        return blocks
    if fmt.qtype == QType.NVFP4:  # every UE4M3 byte, 0x7F (read as 0) and 0xFF (bit 7 ignored: 240) included
        blocks = random_blocks(fmt.qtype, 64, rng)
        blocks[:, :4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
        return blocks
    blocks = random_blocks(fmt.qtype, len(EXTREME_F16), rng)
    field = EXTREME_F16.view(np.uint8).reshape(-1, 2)  # [n, 2]
    if fmt.qtype == QType.IQ1_M:
        d = EXTREME_F16
        for i in range(4):
            top = ((d >> np.uint16(4 * i)) & np.uint16(15)).astype(np.uint8)
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & np.uint8(15)) | (top << np.uint8(4))
    for offset in FP16_FIELDS[fmt.qtype]:
        blocks[:, offset:offset + 2] = field
    return blocks


@pytest.mark.parametrize("fmt", LAYOUT_FORMATS, ids=IDS)
def test_extreme_scales(fmt):
    blocks = extreme_blocks(fmt)
    ours = fmt.dequantize_ref(blocks)  # [n, QK] (may hold inf where d * code overflows, as ggml's does)
    theirs = ggml_dequantize(blocks, fmt.qtype, fmt.block_size).reshape(ours.shape)
    assert np.array_equal(bits(ours), bits(theirs))
    out = np.empty(ours.size, np.float32)
    fmt.decode_block(blocks.ravel(), out)
    assert np.array_equal(bits(out), bits(ours).ravel())
    assert (ours != 0).any()  # the draw is not all zeros: the bit comparison saw real values


@pytest.mark.parametrize("ours, theirs", [
    (iquants.IQ2XXS_GRID, gq.IQ2_XXS), (iquants.IQ2XS_GRID, gq.IQ2_XS), (iquants.IQ2S_GRID, gq.IQ2_S),
    (iquants.IQ3XXS_GRID, gq.IQ3_XXS), (iquants.IQ3S_GRID, gq.IQ3_S), (iquants.IQ1S_GRID, gq.IQ1_S),
], ids=["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S"])
def test_grids_equal_gguf_py_s(ours, theirs):
    theirs.init_grid()
    assert np.array_equal(ours, np.asarray(theirs.grid, np.float32).reshape(-1).astype(np.int64))


def test_ksigns_is_ggml_s_table():
    assert np.array_equal(iquants.KSIGNS, np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int64))


@pytest.mark.parametrize("fmt", LAYOUT_FORMATS, ids=IDS)
def test_every_code_and_index_is_reached(fmt):
    """The random draw exercises the whole layout: every weight position takes several distinct values, so a
    decoder that ignored a bit field would fail the bit comparisons above (guards the draw, not the decoder)."""
    w = fmt.dequantize_ref(random_blocks(fmt.qtype, 64, np.random.default_rng(7)))  # [64, QK]
    distinct = [len(np.unique(np.sign(w[:, k]) * 0 + w[:, k])) for k in range(fmt.block_size)]
    assert min(distinct) >= 8
