"""Q2_0 models end to end: pymoe's own Q2_0 tiny file, and the one llama.cpp's quantizer makes, against llama.cpp.

What this is, on the tiny qwen3moe (2 layers, 8 experts, every row a multiple of 64):
  - `make-tiny-model --quant q2_0` and `llama_cpp.llama_model_quantize(F32 file, LLAMA_FTYPE_MOSTLY_Q2_0)` write the
    same file: every tensor of the same type (llama.cpp's choice: Q2_0 experts and attention, Q8_0 attn_k/attn_v,
    Q4_K token_embd, Q6_K output, F32 norms and router) with the same bytes (pymoe's Q2_0, Q4_K, Q6_K and Q8_0
    quantizers against llama.cpp's, whole tensors at once);
  - pymoe's reference backend (float NumPy) on the Q2_0 file against llama.cpp on an F32 copy of it (same weights,
    float math, F32 KV cache: the oracle for quantized files in docs/testing.md);
  - llama.cpp on the Q2_0 file itself: logits within 3% of their scale and the same top-1 token wherever the
    difference cannot flip it (its Q2_0 kernel multiplies with Q8_0 activations, so logits move by ~1% of the scale);
  - greedy tokens with a small slot pool equal those without (Q2_0 experts through the expert cache).
What this is not: the format alone (tests/test_q2_0.py).
Runtime: about 10 s (Numba cache warm), mostly writing and loading files.
"""
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

import pymoe
from conftest import ROOT
from oracle import require_llama_cpp
from pymoe.demo.tinymodel import write_f32_copy
from pymoe.gguf.loader import load_gguf

N_LOGITS = 50
PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]
N_NEW = 12
# pymoe's reference backend vs llama.cpp on the F32 copy, relative to the logit scale max|logit| (3.96 here): the
# bound of tests/test_model_vs_llamacpp.py (float32 summation order only; a halved RoPE base moves logits by ~1e-2).
# Measured: 2.4e-6 absolute, 6.0e-7 of the scale.
EXACT_REL_BOUND = 1e-5
# llama.cpp on the Q2_0 file itself quantizes the activations to Q8_0 (ggml_vec_dot_q2_0_q8_0): measured max |diff|
# 0.047 = 1.2% of the scale. The 3% bound is 2.5x that; a wrong Q2_0 layout gives errors of the order of the logits.
# Top-1: no logit moves by more than the max |diff| e, so where pymoe's top two logits are more than 2e apart the
# argmax cannot differ (43 of the 50 positions; the closest pair is 0.020 apart, below e, so "all 50" would be luck:
# measured 50 of 50 on this machine, and llama.cpp's float order follows the CPU's SIMD width).
LLAMA_Q2_0_REL_BOUND = 0.03
MIN_DECIDED = 30  # positions whose top-1 the bound decides: 43 measured (32 even at the full 3% bound)


def llama(path):
    return require_llama_cpp().Llama(model_path=path, n_ctx=64, n_threads=2, n_batch=64, verbose=False,
                                     logits_all=True, type_k=0, type_v=0, seed=0)


@pytest.fixture(scope="module")
def files(tiny_model, tmp_path_factory):
    """{'pymoe': tiny Q2_0 file by make-tiny-model, 'llama.cpp': the F32 tiny file quantized by llama.cpp to Q2_0,
    'f32 copy': the pymoe file dequantized to F32}."""
    llama_cpp = require_llama_cpp()
    root = tmp_path_factory.mktemp("q2_0")
    ours = tiny_model("qwen3moe", "q2_0")
    theirs = str(root / "tiny-qwen3moe-llama-q2_0.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_0
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(tiny_model("qwen3moe", "f32").encode(), theirs.encode(), params) == 0
    copy = str(root / "tiny-qwen3moe-q2_0-as-f32.gguf")
    write_f32_copy(ours, copy)
    return {"pymoe": ours, "llama.cpp": theirs, "f32 copy": copy}


def test_tinymodel_q2_0_mix_is_the_file_llama_cpp_quantizer_writes(files):
    ours, theirs = load_gguf(files["pymoe"]), load_gguf(files["llama.cpp"])
    assert set(ours.tensors) == set(theirs.tensors)
    types = {name: t.qtype.name for name, t in theirs.tensors.items()}
    assert {name: t.qtype.name for name, t in ours.tensors.items()} == types
    assert {types[f"blk.{i}.ffn_{p}_exps.weight"] for i in (0, 1) for p in ("gate", "up", "down")} == {"Q2_0"}
    assert (types["blk.0.attn_q.weight"], types["blk.0.attn_k.weight"], types["blk.0.attn_v.weight"],
            types["token_embd.weight"], types["output.weight"], types["blk.0.ffn_gate_inp.weight"]) == \
        ("Q2_0", "Q8_0", "Q8_0", "Q4_K", "Q6_K", "F32")
    for name, t in theirs.tensors.items():
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(ours.tensors[name].data).view(np.uint8)), \
            f"{name} ({types[name]}): bytes differ from llama.cpp's"


def test_cli_writes_the_same_file_with_worker_processes(files, tmp_path):
    """`make-tiny-model --quant q2_0 --jobs 2`: the CLI choice exists, and worker processes (which must see Q2_0 in
    gguf-py's enum to receive the type) write the same bytes as the one-process fixture."""
    out = tmp_path / "cli.gguf"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make-tiny-model"), "-o", str(out), "--arch",
                        "qwen3moe", "--quant", "q2_0", "--jobs", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "q2_0" in r.stdout
    sha = lambda p: hashlib.sha256(open(p, "rb").read()).hexdigest()  # noqa: E731
    assert sha(out) == sha(files["pymoe"])


def test_reference_logits_match_llamacpp_on_the_f32_copy(files):
    engine = pymoe.load(files["pymoe"], backend="reference")
    ids = np.random.default_rng(0).integers(0, engine.config.n_vocab, N_LOGITS)
    ours = engine.logits(ids)  # [50, V]
    llm = llama(files["f32 copy"])
    llm.eval(ids.tolist())
    ref = np.asarray(llm.scores[:N_LOGITS])  # [50, V]
    assert ours.shape == ref.shape == (N_LOGITS, engine.config.n_vocab)
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= EXACT_REL_BOUND * scale, np.abs(ours - ref).max() / scale
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_llamacpp_on_the_q2_0_file_itself_agrees_on_top1(files):
    engine = pymoe.load(files["pymoe"], backend="reference")
    ids = np.random.default_rng(0).integers(0, engine.config.n_vocab, N_LOGITS)
    ours = engine.logits(ids)  # [50, V]
    llm = llama(files["pymoe"])  # llama.cpp reads and runs the Q2_0 tensors pymoe wrote
    llm.eval(ids.tolist())
    ref = np.asarray(llm.scores[:N_LOGITS])  # [50, V]
    err = np.abs(ours - ref).max()
    assert err <= LLAMA_Q2_0_REL_BOUND * np.abs(ref).max(), err / np.abs(ref).max()
    top2 = np.sort(ours, axis=-1)[:, -2:]  # [50, 2]
    decided = top2[:, 1] - top2[:, 0] > 2 * err  # [50] positions where a difference of err cannot flip the argmax
    assert decided.sum() >= MIN_DECIDED, decided.sum()
    assert (ours.argmax(-1) == ref.argmax(-1))[decided].all()


def test_slot_pool_never_changes_greedy_tokens(files):
    path = files["llama.cpp"]
    want = list(pymoe.load(path).generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    engine = pymoe.load(path, cache_slots=6)
    assert list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False)) == want
    assert engine.cache.stats.counts["decode"]["promoted"] > 0  # Q2_0 experts went through the slot pool
    assert {int(layer) for layer, _ in np.argwhere(engine.cache.residency >= 0)} == {0, 1}
