"""Tensor shapes as llama.cpp's converter writes them: extra trailing size-1 dimensions (GGML order) are accepted.

convert_hf_to_gguf.py writes qwen2moe's shared-expert gate `blk.N.ffn_gate_inp_shexp.weight` as a 2-D tensor,
GGML ne = [n_embd, 1] (a [1, n_embd] matrix in NumPy order), where the metadata implies a vector of n_embd.
llama.cpp accepts it: `llama_model_loader::check_tensor_dims` requires every dimension past the expected ones to
be 1. pymoe must load such a file and compute what llama.cpp computes on it.
"""
import numpy as np
import pytest

import pymoe
from gguf_rewrite import rewrite_gguf
from oracle import require_llama_cpp
from pymoe.errors import PymoeError
from pymoe.gguf.loader import load_gguf

GATE = "ffn_gate_inp_shexp.weight"


def reshaped_copy(src, dst, shape_of):
    """src with every shared-expert gate reshaped by shape_of(n_embd) (NumPy order)."""
    def change(name, qtype, data):
        return (data.reshape(shape_of(data.size)), qtype) if name.endswith(GATE) else (data, qtype)

    rewrite_gguf(src, dst, change)
    return dst


@pytest.fixture(scope="module")
def gate_2d(tiny_model, tmp_path_factory):
    """The tiny qwen2moe F32 file with the shared-expert gates 2-D, GGML ne [n_embd, 1], as the converter writes."""
    dst = str(tmp_path_factory.mktemp("conv") / "tiny-qwen2moe-gate2d.gguf")
    return reshaped_copy(tiny_model("qwen2moe", "f32"), dst, lambda n: (1, n))


def test_trailing_unit_dims_load(gate_2d):
    m = load_gguf(gate_2d)
    raw = next(t for t in m.reader.tensors if t.name == "blk.0." + GATE)
    assert [int(n) for n in raw.shape] == [m.config.n_embd, 1]  # GGML order: 2-D in the file
    t = m.tensor("blk.0." + GATE)
    assert t.shape == (m.config.n_embd,) and t.data.shape == (m.config.n_embd,)  # the shape the forward expects


def test_other_extra_dims_are_still_refused(tiny_model, tmp_path):
    """Only size-1 dimensions past the expected ones are accepted (llama.cpp's rule): [2, n/2] is not a vector."""
    bad = reshaped_copy(tiny_model("qwen2moe", "f32"), str(tmp_path / "bad.gguf"), lambda n: (2, n // 2))
    with pytest.raises(PymoeError, match=r"ffn_gate_inp_shexp.weight has shape \[2, 128\]"):
        load_gguf(bad)


def test_gate_2d_logits_equal_the_1d_files_and_llamacpp(tiny_model, gate_2d):
    """pymoe on the 2-D file: the same logits, bit for bit, as on the original 1-D file; and llama.cpp's on it
    (F32 file and F32 KV cache: measured max |diff| ~1e-6 at a logit scale of ~4, as for the 1-D file)."""
    ids = np.random.default_rng(0).integers(0, 500, 24)
    ours = pymoe.load(gate_2d).logits(ids)  # [24, V]
    np.testing.assert_array_equal(ours, pymoe.load(tiny_model("qwen2moe", "f32")).logits(ids))
    llama_cpp = require_llama_cpp()
    llm = llama_cpp.Llama(model_path=gate_2d, n_ctx=64, n_threads=2, n_batch=64, verbose=False, logits_all=True,
                          type_k=0, type_v=0, seed=0)
    llm.eval(ids.tolist())
    ref = np.asarray(llm.scores[: len(ids)])  # [24, V]
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()
