"""The forward pass against llama.cpp (llama-cpp-python) on the same tiny files: the whole-model oracle.

F32 files: same file on both sides. Q2_K-mix files: pymoe on the quantized file, llama.cpp on a copy dequantized to
F32 (llama.cpp quantizes activations to 8 bits for K-quant weights; the float copy has the same weights and float
math). llama.cpp's KV cache is F32 (type_k=0, type_v=0): its default F16 cache alone moves logits by up to 0.05.
Measured on these files: max |Δlogit| ~1e-6 (qwen/olmoe, logits of scale ~4) and ~1e-4 (llama, tied output, scale
~400), top-1 agreement 1.0.
"""
import numpy as np
import pytest

from conftest import ARCHS, MIXES
import pymoe
from pymoe.tinymodel import write_f32_copy

llama_cpp = pytest.importorskip("llama_cpp")

N_PROMPT = 50


@pytest.fixture(scope="module")
def oracle_file(tiny_model, tmp_path_factory):
    copies = {}

    def get(arch, mix):
        path = tiny_model(arch, mix)
        if mix == "f32":
            return path
        if path not in copies:
            copies[path] = str(tmp_path_factory.mktemp("f32copy") / f"{arch}-{mix}-as-f32.gguf")
            write_f32_copy(path, copies[path])
        return copies[path]

    return get


def llama(path, n_ctx=128):
    return llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=2, n_batch=128, verbose=False, logits_all=True,
                           type_k=0, type_v=0, seed=0)


def prompt_ids(n_vocab, n=N_PROMPT, seed=0):
    return np.random.default_rng(seed).integers(0, n_vocab, n)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mix", MIXES)
def test_logits_match_llamacpp(tiny_model, oracle_file, arch, mix):
    m = pymoe.load(tiny_model(arch, mix))
    ids = prompt_ids(m.config.n_vocab)
    ours = m.logits(ids)  # [50, V]
    ref_llm = llama(oracle_file(arch, mix))
    ref_llm.eval(ids.tolist())
    ref = np.asarray(ref_llm.scores[: len(ids)])
    assert ours.shape == ref.shape == (N_PROMPT, m.config.n_vocab)
    assert np.abs(ours - ref).max() <= 0.05
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.96


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_llamacpp(tiny_model, arch):
    path = tiny_model(arch, "f32")
    m = pymoe.load(path)
    ids = prompt_ids(m.config.n_vocab, n=12, seed=1)
    ours = list(m.generate(ids.tolist(), max_tokens=20, stop_at_eos=False))
    llm = llama(path)
    llm.eval(ids.tolist())
    ref = []
    for _ in range(20):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        ref.append(t)
        llm.eval([t])
    assert ours == ref
