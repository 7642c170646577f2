"""Q2_0 (ggml type 42), the format alone: gguf-py taught the type, the reference against llama.cpp's own code.

Oracles (llama.cpp 0.3.36's libggml-base through ctypes, tests/ggml_lib.py; gguf-py has no Q2_0 to compare with):
  - `ggml_blck_size` / `ggml_type_size` / `ggml_type_name` of id 42: the sizes pymoe registers in gguf-py;
  - `dequantize_row_q2_0` (ggml's `to_float` for the type): pymoe's reference bit for bit, on every byte value;
  - `quantize_row_q2_0_ref` (`from_float_ref`, what llama-quantize runs): pymoe's quantizer byte for byte, on the
    blocks tests/test_quantize.py gives the K-quant quantizers, plus ties and edge cases of its rounding;
  - gguf-py's own `GGUFReader` / `GGUFWriter` on a file with Q2_0 tensors, and pymoe's one-line error for a type id
    nobody knows (tests/test_bad_input.py's way of damaging a file in place).
The whole-model checks are in tests/test_q2_0_model.py. All fast (about 5 s, the subprocess included).
"""
import shutil

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter

import pymoe.quant as Q
from conftest import run_pymoe
from ggml_lib import ggml_dequantize, ggml_quantize_ref, ggml_type_info
from pymoe.quant import QType
from pymoe.quant.ggml_types import extend_ggml_type
from pymoe.quant.q2_0 import dequantize_q2_0, quantize_q2_0, roundf
from test_quantize import llama_cpp_test_cases, rel_rmse, weights

QK, TYPE_SIZE = 64, 18


# ----------------------------------------------------------------------------------------------------------------
# gguf-py knows the type

def test_q2_0_is_registered_as_ggml_defines_it():
    assert int(QType.Q2_0) == 42 and QType(42) is QType.Q2_0 and QType["Q2_0"] is QType.Q2_0
    assert GGML_QUANT_SIZES[QType.Q2_0] == (QK, TYPE_SIZE)
    assert ggml_type_info(QType.Q2_0) == (QK, TYPE_SIZE, "q2_0")
    fmt = Q.get_format(QType.Q2_0)
    assert (fmt.block_size, fmt.type_size, fmt.name) == (QK, TYPE_SIZE, "Q2_0")


def test_registration_is_idempotent_and_refuses_a_clash():
    assert extend_ggml_type("Q2_0", 42, QK, TYPE_SIZE) is QType.Q2_0
    with pytest.raises(RuntimeError, match="differs"):
        extend_ggml_type("Q2_0", 42, QK, 20)
    with pytest.raises(RuntimeError, match="is Q4_K in gguf-py"):
        extend_ggml_type("NOT_A_TYPE", int(QType.Q4_K), 256, 144)
    assert "NOT_A_TYPE" not in QType.__members__


def test_gguf_reader_and_writer_handle_q2_0_tensors(tmp_path):
    """gguf-py's own writer and reader, no pymoe code in between: shape, type, byte count and bytes survive."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 5, 128)).astype(np.float32)  # NumPy order: 2 blocks per row
    raw = Q.quantize(w, QType.Q2_0)  # [3, 5, 36]
    path = str(tmp_path / "q2_0.gguf")
    writer = GGUFWriter(path, "test")
    writer.add_tensor("experts", raw, raw_dtype=QType.Q2_0)
    writer.add_tensor("after", np.arange(7, dtype=np.float32))  # a tensor placed after the Q2_0 bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t, after = GGUFReader(path).tensors
    assert t.tensor_type is QType.Q2_0 and t.tensor_type.name == "Q2_0"
    assert t.shape.tolist() == [128, 5, 3] and t.n_elements == w.size and t.n_bytes == raw.nbytes
    assert np.array_equal(np.asarray(t.data), raw)
    assert np.array_equal(after.data, np.arange(7, dtype=np.float32))
    np.testing.assert_array_equal(Q.dequantize(np.asarray(t.data), QType.Q2_0), dequantize_q2_0(
        raw.reshape(-1, TYPE_SIZE)).reshape(w.shape))


# ----------------------------------------------------------------------------------------------------------------
# The reference dequantizer against llama.cpp's dequantize_row_q2_0

def special_blocks() -> np.ndarray:
    """uint8 [B, 18]: every byte value at every code position, under scales of both signs, zeros, subnormals and the
    largest fp16; -0 and 0 * -d make signed zeros, which the bit comparison sees."""
    scales = np.array([1.0, -1.0, 0.0, -0.0, 2.0 ** -24, -(2.0 ** -20), 65504.0, -0.3333, 7.25e-3], np.float16)
    codes = np.arange(256, dtype=np.uint8)  # byte values, each in every one of the 16 positions below
    qs = (codes[:, None] + np.arange(16, dtype=np.uint8) * 17).astype(np.uint8)  # [256, 16]
    blocks = np.zeros((len(scales), 256, TYPE_SIZE), np.uint8)
    blocks[:, :, :2] = scales.astype("<f2").view(np.uint8).reshape(-1, 1, 2)
    blocks[:, :, 2:] = qs
    return blocks.reshape(-1, TYPE_SIZE)


def test_reference_is_bit_exact_with_llama_cpp():
    blocks = special_blocks()
    ours = dequantize_q2_0(blocks).ravel()  # [B * 64]
    theirs = ggml_dequantize(blocks, QType.Q2_0, QK).ravel()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    out = np.full(ours.shape, np.nan, np.float32)
    Q.get_format(QType.Q2_0).decode_block(blocks.ravel(), out)  # the Numba twin too
    assert np.array_equal(out.view(np.uint32), ours.view(np.uint32))


def test_layout_by_hand():
    """Code k of byte i is weight 4i + k, at bits 2k..2k+1; w = (q - 1) d: codes 0..3 -> -d, 0, d, 2d."""
    block = np.zeros((1, TYPE_SIZE), np.uint8)
    block[0, :2] = np.array([0.5], np.float16).view(np.uint8)
    block[0, 2 + 5] = 0b11_10_01_00  # weights 20, 21, 22, 23: codes 0, 1, 2, 3
    block[0, 2 + 15] = 0b00_00_00_11  # weight 60: code 3; 61..63: code 0
    w = dequantize_q2_0(block)[0]
    expected = np.full(QK, -0.5, np.float32)  # code 0 everywhere else
    expected[20:24] = [-0.5, 0.0, 0.5, 1.0]
    expected[60] = 1.0
    np.testing.assert_array_equal(w, expected)


# ----------------------------------------------------------------------------------------------------------------
# The quantizer against llama.cpp's quantize_row_q2_0_ref

def test_roundf_rounds_halves_away_from_zero():
    v = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49999997, -0.49999997, 0.50000006, 1.0, -1.0, 0.0],
                 np.float32)
    np.testing.assert_array_equal(roundf(v), [-3, -2, -1, 1, 2, 3, 0, 0, 1, 1, -1, 0])


def q2_0_test_cases() -> dict:
    """test_quantize's K-quant cases, cut into blocks of 64, plus cases aimed at Q2_0's own rounding."""
    cases = {name: np.asarray(w, np.float32).reshape(-1, QK) for name, w in llama_cpp_test_cases().items()}
    rng = np.random.default_rng(11)
    # ties: w / d exactly +-0.5 (roundf -> +-1; round-half-even would give 0), and the floats next to them
    tie = np.zeros((4, QK), np.float32)
    tie[:, 0] = [1.0, -1.0, 3.0, -0.375]  # the block maximum d
    tie[:, 1:4] = (np.array([0.5, -0.5, 0.25], np.float32) * tie[:, :1])
    tie[:, 4] = np.nextafter(tie[:, 1], np.float32(0))
    tie[:, 5] = np.nextafter(tie[:, 1], np.float32(10) * tie[:, 1])
    # d not representable in fp16: the codes follow the float32 d, the stored scale is its fp16 rounding
    off = rng.standard_normal((64, QK)).astype(np.float32)
    off[:, 0] = np.float32(1.0004) * np.sign(off[:, 0])
    off[:, 1:9] = np.float32(0.5002)
    big = rng.standard_normal((8, QK)).astype(np.float32)
    big *= np.float32(6e4) / np.abs(big).max(axis=1, keepdims=True)  # d = 6e4: near the largest fp16, 65504
    cases.update({"ties": tie, "fp16-rounded-d": off, "huge": big,
                  "one-value": np.full((2, QK), -3.0, np.float32)})
    return cases


def test_bytes_identical_to_llama_cpp():
    for name, w in q2_0_test_cases().items():
        ours, theirs = quantize_q2_0(w), ggml_quantize_ref(w, QType.Q2_0)
        differ = np.nonzero(np.any(ours != theirs, axis=1))[0]
        assert differ.size == 0, f"Q2_0 {name}: blocks {differ[:10].tolist()} differ from llama.cpp"


# Relative RMS error of the round trip, measured (seed 0, 256 x 256 weights as in tests/test_quantize.py; the bytes
# are llama.cpp's): gauss 0.7195, t3 0.6855. The bounds leave ~4-5% headroom. The error is large because llama.cpp's
# reference quantizer is ternary with d = max|w| (quant/q2_0.py); a wrong code offset or bit position gives errors
# above 1, and the subtler mistakes (rounding halves to even, the fp16 d in the division) are caught above.
BOUNDS = {"gauss": 0.75, "t3": 0.72}


@pytest.mark.parametrize("kind", ["gauss", "t3"])
def test_round_trip_error(kind):
    w = weights(kind).reshape(-1, QK)  # [1024, 64]
    err = rel_rmse(dequantize_q2_0(quantize_q2_0(w)), w)
    assert err < BOUNDS[kind], f"Q2_0 {kind}: relative RMSE {err:.4f}"
    for factor in (1e3, 1e-2):  # scale-free while d stays a normal fp16
        scaled = w * np.float32(factor)
        assert rel_rmse(dequantize_q2_0(quantize_q2_0(scaled)), scaled) == pytest.approx(err, rel=1e-3)


def test_ternary_blocks_round_trip_exactly_and_code_3_is_never_written():
    """x = d * l, l in {-1, 0, 1}, d a power of two, +-d present: the quantizer finds d and every code exactly."""
    rng = np.random.default_rng(5)
    d = np.exp2(rng.integers(-12, 8, (128, 1))).astype(np.float32)  # [B, 1]
    levels = rng.integers(-1, 2, (128, QK)).astype(np.float32)
    levels[:, 0] = rng.choice([-1.0, 1.0], 128)
    w = d * levels
    raw = quantize_q2_0(w)
    np.testing.assert_array_equal(dequantize_q2_0(raw), w)
    codes = (raw[:, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
    assert not (codes == 3).any()
    zero = quantize_q2_0(np.zeros((1, QK), np.float32))
    assert zero[0, :2].tolist() == [0, 0] and (zero[0, 2:] == 0b01010101).all()  # d = 0, every code "0"
    assert np.array_equal(dequantize_q2_0(zero).view(np.uint32), np.zeros((1, QK), np.uint32))  # +0, no NaN


# ----------------------------------------------------------------------------------------------------------------
# A type id nobody knows: one line naming the id and the tensor, exit status 2

def test_unknown_tensor_type_id_is_named_with_its_tensor(tiny_model, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(tiny_model("qwen3moe", "f32"), path)
    r = GGUFReader(path, "r+")
    (field,) = [t.field for t in r.tensors if t.name == "blk.1.ffn_up_exps.weight"]
    field.parts[4][0] = 57  # the type id, in place: no GGML type has it
    r.data.flush()
    del r
    with pytest.raises(ValueError):  # gguf-py alone: a bare "57 is not a valid GGMLQuantizationType"
        GGUFReader(path)
    result = run_pymoe("inspect", str(path), timeout=60)
    err = result.stderr.strip()
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.endswith(f"{path}: unsupported tensor type 57 in blk.1.ffn_up_exps.weight"), err
    assert "corrupt" not in err
