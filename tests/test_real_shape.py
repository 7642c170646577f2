"""The real-shape preset's writer (tinymodel.write_random_quantized) and bench/real_shape.py's make step, on a
scaled-down preset of the same kind (2 layers, hidden 256, 8 experts, vocabulary padded to 1024): the full
qwen3-30b-a3b file (~17 GB) is never made here.

What is checked: the random Q2_K source is the same bytes for any number of processes; its weights have the
spread random_q2_k promises; the vocabulary is padded as llama.cpp's converter pads Qwen's; llama.cpp's quantizer
turns it into a Q4_K_M file that pymoe's default path runs as llama.cpp does (pymoe on the Q4_K_M file against
llama.cpp on a float copy of it, as tests/test_model_vs_llamacpp.py compares K-quant files).
"""
import hashlib
import os
import sys

import numpy as np
import pytest

import pymoe
from oracle import require_llama_cpp
from pymoe.demo import tinymodel as tm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

MINI = tm.Preset(n_layers=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_expert_used=2,
                 n_ff_exp=256, n_ctx=256, n_vocab=1024, pad_vocab=True)


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """-> dict of paths: the random source written with 1 and with 2 processes, its Q4_K_M requantization by
    llama.cpp, and that file's float copy."""
    require_llama_cpp()
    import real_shape

    root = tmp_path_factory.mktemp("realshape")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tm.PRESETS, "real-mini", MINI)
        paths = dict(j1=str(root / "j1.gguf"), j2=str(root / "j2.gguf"), q4km=str(root / "q4km.gguf"),
                     f32=str(root / "q4km-f32.gguf"))
        tm.write_random_quantized(paths["j1"], "real-mini", jobs=1)
        tm.write_random_quantized(paths["j2"], "real-mini", jobs=2)
        real_shape.make(paths["q4km"], "real-mini", jobs=2, threads=2, keep_source=False)
        tm.write_f32_copy(paths["q4km"], paths["f32"])
    return paths


def test_source_is_the_same_for_any_jobs(mini):
    assert sha(mini["j1"]) == sha(mini["j2"])
    assert not os.path.exists(mini["q4km"] + ".q2_k-source")  # make deletes its source


def test_random_q2_k_spread():
    """Mean 0 and std 1/sqrt(cols): 4 x 256 x 512 weights; the std of a sample std is ~1/sqrt(2n) = 0.1% here,
    fp16 rounding of d moves it by <= 0.05%, so 1% is ~7 sigma; the mean's standard error is std/sqrt(n) = 1e-4."""
    import gguf

    cols = 512
    raw = tm.random_q2_k((4, 256, cols), seed=(0, 7))  # [4, 256, 2 * 84]
    assert raw.shape == (4, 256, cols // 256 * 84)
    v = gguf.dequantize(raw, gguf.GGMLQuantizationType.Q2_K)  # [4, 256, 512]
    assert abs(v.std() * np.sqrt(cols) - 1) < 0.01
    assert abs(v.mean()) < 5 * v.std() / np.sqrt(v.size)
    assert (raw == tm.random_q2_k((4, 256, cols), seed=(0, 7))).all()
    assert not (raw == tm.random_q2_k((4, 256, cols), seed=(0, 8))).all()


def test_vocabulary_padded_as_the_converter_does(mini):
    from gguf import TokenType

    llama_cpp = require_llama_cpp()
    m = pymoe.load(mini["q4km"])
    assert m.config.n_vocab == MINI.n_vocab
    types = m.tokenizer.types
    assert types[-1] == TokenType.UNUSED and m.tokenizer.tokens[-1] == f"[PAD{MINI.n_vocab - 1}]"
    llm = llama_cpp.Llama(model_path=mini["q4km"], n_ctx=32, verbose=False)
    assert llm.n_vocab() == MINI.n_vocab
    text = "The quick brown fox: def forward(self, x) 混合专家"
    ids = m.tokenizer.encode(text)
    assert ids == llm.tokenize(text.encode(), add_bos=False, special=True)
    assert max(ids) < types.index(TokenType.UNUSED)  # the pads are never reached by merges


def test_requantized_file_matches_llamacpp(mini):
    """pymoe's default path (16-bit activations) on the Q4_K_M file against llama.cpp on its float copy (same
    weights, float math, F32 KV cache). Bound: 1e-3 of the logit scale; the 16-bit activations are within ~1e-4
    of float math per product (docs/performance.md "Accuracy"), two layers of them; a halved RoPE base moves tiny
    files' logits by ~1e-2 of the scale (tests/test_model_vs_llamacpp.py)."""
    llama_cpp = require_llama_cpp()
    m = pymoe.load(mini["q4km"], backend="cpu")
    ids = np.random.default_rng(0).integers(0, 300, 40)  # trained tokens, not pads
    ours = m.logits(ids)  # [40, V]
    llm = llama_cpp.Llama(model_path=mini["f32"], n_ctx=64, n_threads=2, verbose=False, logits_all=True,
                          type_k=0, type_v=0)
    llm.eval(ids.tolist())
    ref = np.asarray(llm.scores[: len(ids)])
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    assert err <= 1e-3 * scale, (err, err / scale)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


def test_large_presets_refuse_float_weights(tmp_path):
    with pytest.raises(ValueError, match="write_random_quantized"):
        tm.write_model(str(tmp_path / "x.gguf"), "qwen3moe", "qwen3-30b-a3b")


def test_repack_budget_keeps_the_bits(mini):
    """The 8-bit path with no room for experts' repacked copies (repack_mib 0: every expert read in place from the
    memory map) gives the same logits, bit for bit, as with every expert repacked; the budget is kept."""
    ids = np.random.default_rng(1).integers(0, 300, 24)
    runs = {}
    for mib in (None, 0):
        m = pymoe.load(mini["q4km"], backend="cpu", backend_options=dict(act_bits=8, repack_mib=mib))
        runs[mib] = (m.logits(ids), m.backend.expert_copies, m.backend.experts_in_place)
    assert runs[None][1] > 0 and runs[None][2] == 0
    assert runs[0][1] == 0 and runs[0][2] > 0
    assert np.array_equal(runs[None][0], runs[0][0])


def test_repeated_layers_have_the_types_of_a_whole_quantization(tmp_path):
    """make --layers 6 on a 16-layer preset: llama.cpp quantizes 6 random layers, write_repeated_layers repeats them
    to 16, each where a layer of its types belongs; every tensor's name and type equal those of llama.cpp's
    quantization of all 16 layers (Q4_K_M keeps ffn_down and attn_v in Q6_K in some layers: use_more_bits), layers
    of one source layer hold the same bytes, and pymoe runs the file. In 16 layers the Q6_K ones are 0, 1, 4, 7, 10,
    13, 14, 15; in the 6 quantized, 2 and 5; so layers 0 and 4 are both source layer 2, layer 1 source layer 5."""
    import gguf
    import real_shape

    require_llama_cpp()
    deep = tm.Preset(**{**MINI.__dict__, "n_layers": 16})
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tm.PRESETS, "real-deep", deep)
        real_shape.make(str(tmp_path / "part.gguf"), "real-deep", jobs=1, threads=2, layers=6)
        real_shape.make(str(tmp_path / "whole.gguf"), "real-deep", jobs=1, threads=2, layers=0)
    part = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "part.gguf")).tensors}
    whole = {t.name: t.tensor_type for t in gguf.GGUFReader(str(tmp_path / "whole.gguf")).tensors}
    assert {n: t.tensor_type for n, t in part.items()} == whole
    assert {t.tensor_type.name for n, t in part.items() if "ffn_down" in n} == {"Q4_K", "Q6_K"}
    down = lambda i: np.asarray(part[f"blk.{i}.ffn_down_exps.weight"].data)  # noqa: E731
    assert np.array_equal(down(0), down(4)) and not np.array_equal(down(0), down(1))
    m = pymoe.load(str(tmp_path / "part.gguf"))
    assert m.config.n_layers == 16 and np.isfinite(m.logits([1, 2, 3])).all()
