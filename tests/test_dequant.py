"""Dequantization oracles for every registered format (pymoe.quant.FORMATS), parametrised over the registry.

What this is: (1) `pymoe.quant.dequantize` (the NumPy references) bit-exact with `gguf.dequantize` on random raw
blocks (for a type gguf-py does not implement, Q2_0: with llama.cpp's own `dequantize_row_*`, tests/ggml_lib.py);
(2) each Numba `decode_block` bit-exact with its reference (np.array_equal, not "within 1 ulp": the twins perform
the same float32 operations in the same order, so any difference is a bug), also on blocks that start at an odd
byte address; (3) `f16_to_f32` exact over all 65536 half-precision patterns; (4) quantize -> dequantize
round trips within stated error bounds for the types that have a quantizer.
What this is not: the fused matrix kernels (tests/test_kernels.py) or hand-placed-bit layout checks
(tests/test_kquants_layout.py).
"""
import gguf
import numpy as np
import pytest

import pymoe.quant as Q
from pymoe.quant import QType
from pymoe.quant.floats import f16_to_f32
from ggml_lib import ggml_dequantize
from quant_helpers import random_blocks

FORMATS = sorted(Q.FORMATS.values(), key=lambda f: f.name)
IDS = [f.name for f in FORMATS]


def n_blocks_for(fmt, rows=7, weights_per_row=512):
    return rows * max(1, weights_per_row // fmt.block_size)


def oracle_dequantize(raw, fmt):
    """gguf-py's dequantizer; for a type it does not implement (NotImplementedError), llama.cpp's."""
    try:
        return gguf.dequantize(raw, fmt.qtype)
    except NotImplementedError:
        return ggml_dequantize(raw, fmt.qtype, fmt.block_size)


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_reference_is_bit_exact_with_gguf(fmt):
    rng = np.random.default_rng(1)
    raw = random_blocks(fmt.qtype, n_blocks_for(fmt), rng).reshape(7, -1)  # [rows, row_bytes]
    ours = Q.dequantize(raw, fmt.qtype)  # [rows, cols]
    oracle = oracle_dequantize(raw, fmt)
    assert ours.dtype == np.float32 and ours.shape == oracle.shape
    assert np.isfinite(ours).all()
    assert np.array_equal(ours.view(np.uint32), np.asarray(oracle, np.float32).view(np.uint32))  # bits, so -0 != +0


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_decode_block_is_bit_exact_with_reference(fmt):
    rng = np.random.default_rng(2)
    blocks = random_blocks(fmt.qtype, n_blocks_for(fmt), rng)  # [B, type_size]
    ref = fmt.dequantize_ref(blocks).ravel()  # [B * QK]

    out = np.full(ref.shape, np.nan, dtype=np.float32)  # [B * QK], NaN so a skipped weight is caught
    fmt.decode_block(blocks.ravel(), out)  # all B blocks in one call
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))

    # One block at a time, each copied to an odd byte address: decoders must not assume alignment.
    buffer = np.zeros(fmt.type_size + 1, dtype=np.uint8)
    for b in (0, 1, len(blocks) - 1):
        buffer[1:] = blocks[b]
        one = np.empty(fmt.block_size, dtype=np.float32)  # [QK]
        fmt.decode_block(buffer[1:], one)
        assert np.array_equal(one, ref[b * fmt.block_size:(b + 1) * fmt.block_size])


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_embedding_rows_are_the_references_bits(fmt):
    """Model.embed (the rows of the tokens asked for, through the compiled decode_block) == gguf-py's dequantization
    of those rows, bit for bit, for an embedding table of every type."""
    from types import SimpleNamespace

    from pymoe.engine.model import Model

    rng = np.random.default_rng(3)
    raw = random_blocks(fmt.qtype, n_blocks_for(fmt), rng).reshape(7, -1)  # [rows, row_bytes]: the table
    data = raw.view(np.float32) if fmt.qtype == QType.F32 else raw
    table = SimpleNamespace(qtype=fmt.qtype, data=data, rows=lambda: raw)  # what embed reads of a loader Tensor
    tokens = np.array([6, 0, 3, 3])
    got = Model.embed(None, tokens, table)  # [4, cols]
    want = np.asarray(oracle_dequantize(raw, fmt), np.float32)[tokens]
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_f16_to_f32_is_exact_for_every_half():
    bits = np.arange(1 << 16, dtype=np.uint16)  # [65536] every fp16 pattern
    expected = bits.view(np.float16).astype(np.float32)  # NumPy's (exact) widening
    got = np.array([f16_to_f32(b) for b in bits], dtype=np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))  # incl. -0, subnormals, inf
    assert np.isnan(got[nan]).all()  # NaN stays NaN (payload not kept, documented)


# Round trip on standard-normal data. RMS_BOUND: sqrt(mean((w' - w)^2) / mean(w^2)), with margin over what the
# quantizers reach (measured: F16 2e-4, BF16 1.7e-3, Q8_0 5.4e-3, Q4_0 .087, Q4_1 .078, Q5_0 .043, Q5_1 .038,
# Q2_K .30, Q3_K .15, Q4_K .071, Q6_K .018, Q2_0 .716: llama.cpp's Q2_0 quantizer is ternary with d = max|w|, see
# quant/q2_0.py). MAX_BOUND: the worst-case |w' - w| / max|w| within one block that
# round-to-nearest guarantees (half a step, a whole step where the extreme is clipped, plus fp16 rounding of the
# scale and offset: 2^-11 relative), for the formats simple enough to state one.
RMS_BOUND = {
    QType.F32: 0.0, QType.F16: 5e-4, QType.BF16: 4e-3, QType.Q8_0: 0.01,
    QType.Q4_0: 0.11, QType.Q4_1: 0.10, QType.Q5_0: 0.06, QType.Q5_1: 0.05,
    QType.Q2_K: 0.35, QType.Q3_K: 0.20, QType.Q4_K: 0.10, QType.Q5_K: 0.05, QType.Q6_K: 0.03, QType.Q2_0: 0.75,
}
MAX_BOUND = {
    QType.F32: 0.0,
    QType.F16: 2.0 ** -11,  # relative rounding of one value, at most relative to the block maximum
    QType.BF16: 2.0 ** -8,
    QType.Q8_0: 1 / 254 + 2.0 ** -11,  # d = max/127: half a step, plus 127 * d * 2^-11 from rounding d to fp16
    QType.Q4_0: 1 / 8 + 2.0 ** -9,  # d = max/-8: the code for -max is clipped from 8 to 7, a whole step d
    QType.Q4_1: 1 / 15 + 2.0 ** -8,  # d = (max - min)/15 <= 2 max/15: half a step
    QType.Q5_0: 1 / 16 + 2.0 ** -9,  # d = max/-16: one clipped step
    QType.Q5_1: 1 / 31 + 2.0 ** -8,  # d = (max - min)/31: half a step
    QType.Q2_0: 1 / 2 + 2.0 ** -11,  # d = max: |w| < d/2 -> 0, else +-d; half a step plus d's fp16 rounding
}


QUANTIZABLE = [f for f in FORMATS if f.quantize is not None]
# Formats pymoe reads but cannot write, by name, so that losing a quantizer fails here instead of skipping a test.
# The IQ family, MXFP4 and TQ are written by llama.cpp's own quantizer in the tests (tests/test_ftypes.py): IQ
# quantization searches codebooks with an importance matrix, which a readable reference quantizer would not add to.
NO_QUANTIZER = {"Q5_K", "MXFP4", "NVFP4", "Q1_0", "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S",
                "IQ1_M", "TQ1_0", "TQ2_0"}


def test_formats_without_a_quantizer_are_the_known_ones():
    assert {f.name for f in FORMATS if f.quantize is None} == NO_QUANTIZER


@pytest.mark.parametrize("fmt", QUANTIZABLE, ids=[f.name for f in QUANTIZABLE])
def test_quantize_round_trip(fmt):
    assert fmt.qtype in RMS_BOUND, f"add a round-trip bound for {fmt.name}"
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 1024)).astype(np.float32)  # [rows, cols]
    raw = Q.quantize(w, fmt.qtype)  # [rows, row_bytes]
    assert raw.dtype == np.uint8 and raw.shape == (8, fmt.row_bytes(1024))
    back = Q.dequantize(raw, fmt.qtype)  # [rows, cols]

    rms = np.sqrt(np.mean((back - w) ** 2) / np.mean(w ** 2))
    assert rms <= RMS_BOUND[fmt.qtype], rms
    if fmt.qtype in MAX_BOUND:
        qk = max(fmt.block_size, 32)  # floats: judge in groups of 32 values
        err = np.abs(back - w).reshape(-1, qk).max(axis=1)  # [groups]
        scale = np.abs(w).reshape(-1, qk).max(axis=1)  # [groups]
        assert (err <= MAX_BOUND[fmt.qtype] * scale).all(), (err / scale).max()
