"""Tests of the K-quant quantizers (pymoe/quant/quantize.py): float32 blocks -> raw Q2_K/Q3_K/Q4_K/Q6_K blocks.

Oracles, independent of pymoe's own dequantizers:
  - gguf-py's `gguf.dequantize` reads the bytes back (round-trip error bounds, exactly representable blocks);
  - llama.cpp's own `quantize_row_*_ref`, exported by llama-cpp-python's libggml-base, must produce the same bytes
    (skipped when llama-cpp-python is not installed).
All fast (well under a second each).
"""
import ctypes
import pathlib

import gguf
import numpy as np
import pytest

from oracle import require_llama_cpp
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from pymoe.quant.quantize import QUANTIZERS

K_TYPES = (QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q6_K)


def weights(kind: str, n_blocks: int = 256, seed: int = 0) -> np.ndarray:
    """Test weights float32 [n_blocks, 256]: 'gauss' (like trained weights) or 't3' (heavy tails, Student t, 3 dof)."""
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        return rng.standard_normal((n_blocks, 256)).astype(np.float32)
    return rng.standard_t(3, (n_blocks, 256)).astype(np.float32)


def round_trip(w: np.ndarray, qtype: QType) -> np.ndarray:
    """float32 [B, 256] -> our bytes -> gguf-py's dequantizer -> float32 [B, 256]."""
    raw = QUANTIZERS[qtype](w)  # [B, type_size]
    assert raw.dtype == np.uint8 and raw.shape == (w.shape[0], GGML_QUANT_SIZES[qtype][1])
    return gguf.dequantize(raw.reshape(-1), qtype).reshape(w.shape)


def rel_rmse(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(np.mean((approx - exact) ** 2) / np.mean(exact ** 2)))


# Relative RMS error bounds. Measured (seed 0, 256 blocks; identical to llama.cpp, whose bytes we reproduce):
#            gauss    t3
#   Q2_K     0.296    0.351
#   Q3_K     0.152    0.192
#   Q4_K     0.0715   0.0935
#   Q6_K     0.0178   0.0257
# The bounds leave 4-5% headroom; a layout bug (swapped nibbles, scale/min swapped, a misplaced high bit) gives
# errors of order 1, and Q2_K/Q4_K without the candidate scales of make_qkx2_quants land above them too. Subtler
# changes to the searches (no Q3_K coordinate descent, no Q6_K candidates, other rounding or summation order) are
# caught by the byte comparison with llama.cpp at the end of this file.
BOUNDS = {
    (QType.Q2_K, "gauss"): 0.31, (QType.Q2_K, "t3"): 0.37,
    (QType.Q3_K, "gauss"): 0.16, (QType.Q3_K, "t3"): 0.20,
    (QType.Q4_K, "gauss"): 0.075, (QType.Q4_K, "t3"): 0.097,
    (QType.Q6_K, "gauss"): 0.019, (QType.Q6_K, "t3"): 0.027,
}


@pytest.mark.parametrize("kind", ["gauss", "t3"])
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_round_trip_error(qtype, kind):
    w = weights(kind)
    err = rel_rmse(round_trip(w, qtype), w)
    assert err < BOUNDS[qtype, kind], f"{qtype.name} {kind}: relative RMSE {err:.4f}"


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_error_scales_with_weights(qtype):
    """Quantization is scale-free: weights x 1000 (or / 100) give the same relative error (fp16 stays normal)."""
    w = weights("gauss", 64)
    base = rel_rmse(round_trip(w, qtype), w)
    for factor in (1e3, 1e-2):
        assert rel_rmse(round_trip(w * np.float32(factor), qtype), w * np.float32(factor)) == pytest.approx(base,
                                                                                                         rel=0.02)


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_zero_and_constant_blocks(qtype):
    w = np.stack([np.zeros(256), np.full(256, 0.37), np.full(256, -0.37)]).astype(np.float32)  # [3, 256]
    back = round_trip(w, qtype)
    assert np.all(back[0] == 0)  # an all-zero block comes back exactly zero (no NaN from 0/0)
    # a constant block is one level (or the min alone); what is left is the fp16 rounding of the scales
    # (measured <= 3.2e-4 relative)
    np.testing.assert_allclose(back[1:], w[1:], rtol=1e-3)


def test_output_is_deterministic_and_rowwise():
    """Each block is quantized on its own: quantizing a subset gives the same bytes as the whole."""
    w = weights("t3", 32)
    for qtype in K_TYPES:
        whole = QUANTIZERS[qtype](w)
        np.testing.assert_array_equal(whole[5:9], QUANTIZERS[qtype](w[5:9]))


# ----------------------------------------------------------------------------------------------------------------
# Exactly representable blocks: the quantizer must find the exact levels and put every bit in its place
# ----------------------------------------------------------------------------------------------------------------
# Built as the format's own formula with a power-of-two super-scale (exact in fp16 and in float32 products) and
# random small-integer sub-scales and levels. Each sub-block contains its extreme level(s), so the first range /
# max-magnitude fit of the search is already exact; the largest sub-scale (and sub-min) is present so the
# super-scale comes out as d exactly. Because every position gets a random level, a bit stored one place off
# cannot survive the comparison.

def representable_affine(rng, n_blocks, n_sub, sub_len, qmax, smax):
    """x = d*s*q - dmin*m (Q2_K, Q4_K): q in 0..qmax, s in 1..smax, m in 0..smax -> float32 [B, 256]."""
    d, dmin = np.float32(2.0 ** -6), np.float32(2.0 ** -7)
    s = rng.integers(1, smax + 1, (n_blocks, n_sub)).astype(np.float32)  # [B, S]
    m = rng.integers(0, smax + 1, (n_blocks, n_sub)).astype(np.float32)  # [B, S]
    s[:, 0], m[:, 1] = smax, smax  # the largest sub-scale and sub-min set the super-scales
    q = rng.integers(0, qmax + 1, (n_blocks, n_sub, sub_len)).astype(np.float32)  # [B, S, N]
    q[:, :, 0], q[:, :, 1] = 0, qmax  # both ends of the range in every sub-block
    q = rng.permuted(q, axis=2)
    x = (d * s)[..., None] * q - (dmin * m)[..., None]  # [B, S, N]
    return x.reshape(n_blocks, 256).astype(np.float32)


def representable_symmetric(rng, n_blocks, n_sub, lmin, smin, smax):
    """x = d*s*l (Q3_K, Q6_K): l in lmin..-lmin-1, s in smin..smax -> float32 [B, 256]."""
    d = np.float32(2.0 ** -8)
    s = rng.integers(smin + 1, smax + 1, (n_blocks, n_sub)).astype(np.float32)  # [B, S]
    s[:, 0] = smin  # the one sub-scale of largest magnitude: stored as the most negative value
    l = rng.integers(lmin + 1, -lmin, (n_blocks, n_sub, 16)).astype(np.float32)  # [B, S, 16]
    l[:, :, 0] = lmin  # the largest magnitude in each sub-block sits on the extra negative level
    l = rng.permuted(l, axis=2)
    return ((d * s)[..., None] * l).reshape(n_blocks, 256).astype(np.float32)


REPRESENTABLE = {
    QType.Q2_K: lambda rng: representable_affine(rng, 64, 16, 16, qmax=3, smax=15),
    QType.Q4_K: lambda rng: representable_affine(rng, 64, 8, 32, qmax=15, smax=63),
    QType.Q3_K: lambda rng: representable_symmetric(rng, 64, 16, lmin=-4, smin=-32, smax=31),
    QType.Q6_K: lambda rng: representable_symmetric(rng, 64, 16, lmin=-32, smin=-128, smax=127),
}


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_exactly_representable_blocks_round_trip_exactly(qtype):
    w = REPRESENTABLE[qtype](np.random.default_rng(1))
    np.testing.assert_array_equal(round_trip(w, qtype), w)


# ----------------------------------------------------------------------------------------------------------------
# Against llama.cpp itself
# ----------------------------------------------------------------------------------------------------------------

def llama_cpp_quantizer(qtype: QType):
    """llama.cpp's `quantize_row_<type>_ref` from llama-cpp-python's libggml-base -> fn(float32 [B, 256]) -> bytes."""
    llama_cpp = require_llama_cpp()
    libs = sorted((pathlib.Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.*"))
    if not libs:
        pytest.skip("llama-cpp-python has no libggml-base in its lib folder")
    lib = ctypes.CDLL(str(libs[0]))
    name = f"quantize_row_{qtype.name.lower().replace('_k', '_K')}_ref"
    if not hasattr(lib, name):
        pytest.skip(f"libggml-base does not export {name}")
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]

    def quantize(w):
        w = np.ascontiguousarray(w, dtype=np.float32)
        out = np.zeros((w.shape[0], GGML_QUANT_SIZES[qtype][1]), np.uint8)
        fn(w.ctypes.data, out.ctypes.data, w.size)
        return out

    return quantize


def llama_cpp_test_cases():
    """Ordinary, heavy-tailed, tiny (fp16 subnormal scales), large, sparse, one-hot, tie-rich and degenerate blocks."""
    rng = np.random.default_rng(7)
    g = rng.standard_normal((128, 256)).astype(np.float32)
    spike = np.zeros((16, 256), np.float32)
    spike[np.arange(16), rng.integers(0, 256, 16)] = rng.standard_normal(16) * 10
    special = np.stack([np.zeros(256), np.full(256, 0.5), np.full(256, -0.5), np.linspace(-1, 1, 256),
                        np.r_[np.zeros(128), rng.standard_normal(128)]])
    return {"gauss": g, "t3": weights("t3", 128, seed=3), "tiny": g * 1e-6, "large": g * 1e3,
            "sparse": g * (rng.random(g.shape) < 0.1), "spike": spike,
            "integers": rng.integers(-8, 8, (128, 256)), "halves": rng.integers(-16, 16, (128, 256)) / 2,
            "positive": np.abs(g), "special": special}


@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda t: t.name)
def test_bytes_identical_to_llama_cpp(qtype):
    """Same algorithm, same float32 operation order: the bytes are llama.cpp's, block for block."""
    reference = llama_cpp_quantizer(qtype)
    for name, w in llama_cpp_test_cases().items():
        w = np.asarray(w, dtype=np.float32)
        ours, theirs = QUANTIZERS[qtype](w), reference(w)
        differ = np.nonzero(np.any(ours != theirs, axis=1))[0]
        assert differ.size == 0, f"{qtype.name} {name}: blocks {differ[:10].tolist()} differ from llama.cpp"
