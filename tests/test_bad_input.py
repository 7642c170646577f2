"""Bad model files: one line naming the file and what is wrong, exit status 2, no traceback, no hang.

Each broken file is made from a valid tiny model by editing its bytes in place through gguf-py's reader in
read-write mode (names, types, dims and strings are fields of the header), so each test breaks exactly one thing.
"""
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from conftest import run_pymoe


def check_one_line_error(path, *expected):
    r = run_pymoe("inspect", str(path), timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert str(path) in err
    for text in expected:
        assert text in err, err
    return err


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(tiny_model("qwen3moe", "f32"), path)
    return path


def tensor_field(reader, name):
    for t in reader.tensors:
        if t.name == name:
            return t.field
    raise KeyError(name)


def test_missing_file(tmp_path):
    check_one_line_error(tmp_path / "nope.gguf", "no such file")


def test_not_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("this is not a model\n" * 10)
    check_one_line_error(path, "not a GGUF file")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    check_one_line_error(path, "not a GGUF file")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.0005])
def test_truncated(model_copy, keep):
    data = model_copy.read_bytes()
    model_copy.write_bytes(data[: int(len(data) * keep)])
    check_one_line_error(model_copy, "truncated")


def test_unknown_architecture(model_copy):
    r = GGUFReader(model_copy, "r+")
    field = r.fields["general.architecture"]
    value = field.parts[field.data[0]]
    assert bytes(value) == b"qwen3moe"
    value[:] = np.frombuffer(b"qwen9moe", dtype=np.uint8)
    r.data.flush()
    del r
    check_one_line_error(model_copy, "unsupported architecture 'qwen9moe'")


def test_unsupported_tensor_type(model_copy):
    r = GGUFReader(model_copy, "r+")
    # F32 -> I32: same bytes per element, so the file stays well-formed; pymoe cannot compute with I32.
    tensor_field(r, "blk.1.ffn_norm.weight").parts[4][0] = int(GGMLQuantizationType.I32)
    r.data.flush()
    del r
    check_one_line_error(model_copy, "blk.1.ffn_norm.weight", "I32", "does not support")


def test_missing_tensor(model_copy):
    r = GGUFReader(model_copy, "r+")
    name = tensor_field(r, "blk.1.attn_q.weight").parts[1]
    name[:] = np.frombuffer(b"blk.1.attn_x.weight", dtype=np.uint8)
    r.data.flush()
    del r
    check_one_line_error(model_copy, "missing tensor blk.1.attn_q.weight")


def test_shape_disagrees_with_metadata(model_copy):
    r = GGUFReader(model_copy, "r+")
    dims = tensor_field(r, "blk.0.ffn_norm.weight").parts[3]
    dims[0] = dims[0] // 2  # a smaller tensor: still inside the file, but not n_embd long
    r.data.flush()
    del r
    check_one_line_error(model_copy, "blk.0.ffn_norm.weight", "shape", "metadata")


def test_missing_metadata_key(model_copy):
    r = GGUFReader(model_copy, "r+")
    key = r.fields["qwen3moe.block_count"].parts[1]
    key[:] = np.frombuffer(b"qwen3moe.block_xxxxx", dtype=np.uint8)
    r.data.flush()
    del r
    check_one_line_error(model_copy, "missing metadata key qwen3moe.block_count")


def test_directory(tmp_path):
    check_one_line_error(tmp_path, "directory")
