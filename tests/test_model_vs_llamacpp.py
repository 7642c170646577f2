"""The forward pass against llama.cpp (llama-cpp-python) on the same tiny files: the whole-model oracle.

F32 files: same file on both sides. Q2_K-mix files: pymoe on the quantized file, llama.cpp on a copy dequantized to
F32 (llama.cpp quantizes activations to 8 bits for K-quant weights; the float copy has the same weights and float
math), with pymoe's reference backend (NumPy, float): the CPU backend multiplies K-quants with 16-bit activations,
which tests/test_kernels_qact.py holds to the reference. llama.cpp's KV cache is F32 (type_k=0, type_v=0): its default
F16 cache alone moves logits by up to 0.05.

The bound, relative to the logit scale s = max |llama.cpp logit| (3.5-13 on these files): max |Δlogit| <= 1e-5 s.
Measured (2026-11-30, prompt seed 0, 50 tokens): 2.4e-7 s to 8.1e-7 s on all 8 files (absolute 9.5e-7 to 1.0e-5),
top-1 agreement 1.0; dots1, added later (2026-12-06): 3.2e-7 s on F32, 6.2e-7 s on the Q2_K mix (scale 4.1, 4.2).
The bound is 12x the worst measured value: both engines sum float32 products in their own order, and
llama.cpp's order follows the CPU's SIMD width, so the same files on another CPU move by about as much again. What it catches: halving the RoPE base moves these logits by ~1e-2 s (mutant `rope_base_halved` in
tests/mutants/run_mutants.py), a dropped top-k renormalisation or a swapped gate/up by more.
"""
import numpy as np
import pytest

from conftest import ARCHS, MIXES
import pymoe
from oracle import require_llama_cpp
from pymoe.demo.tinymodel import write_f32_copy

N_PROMPT = 50
REL_BOUND = 1e-5  # of the logit scale: see the module docstring


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
    return require_llama_cpp().Llama(model_path=path, n_ctx=n_ctx, n_threads=2, n_batch=128, verbose=False, logits_all=True,
                           type_k=0, type_v=0, seed=0)


def prompt_ids(n_vocab, n=N_PROMPT, seed=0):
    return np.random.default_rng(seed).integers(0, n_vocab, n)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mix", MIXES)
def test_logits_match_llamacpp(tiny_model, oracle_file, arch, mix):
    path = tiny_model(arch, mix)
    # K-quants: the reference backend (float NumPy); F32 files: the CPU backend, float either way
    m = pymoe.load(path, backend="reference" if mix != "f32" else "cpu")
    ids = prompt_ids(m.config.n_vocab)
    ours = m.logits(ids)  # [50, V]
    ref_llm = llama(oracle_file(arch, mix))
    ref_llm.eval(ids.tolist())
    ref = np.asarray(ref_llm.scores[: len(ids)])
    assert ours.shape == ref.shape == (N_PROMPT, m.config.n_vocab)
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    assert err <= REL_BOUND * scale, (err, err / scale)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


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


@pytest.fixture(scope="module")
def soft_router_file(tiny_model, tmp_path_factory):
    """The tiny F32 file with every router (ffn_gate_inp) scaled by 0.1. The tiny files' routers are saturated on
    three of four archs: the top-2 experts get all but ~1e-10 of the probability, so a bug in the routing *weights*
    (a dropped or added top-k renormalisation) moves nothing there. Scaled, 24-27% of the mass (median) lies outside
    the top 2 (measured on qwen3moe, qwen2moe, olmoe; llama's router is unsaturated as written)."""
    from gguf_rewrite import rewrite_gguf

    def get(arch):
        path = str(tmp_path_factory.mktemp("soft") / f"soft-router-{arch}.gguf")
        rewrite_gguf(tiny_model(arch, "f32"), path, lambda name, qtype, data: (
            (data * np.float32(0.1)).astype(np.float32) if name.endswith("ffn_gate_inp.weight") else data, qtype))
        return path

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_llamacpp_with_a_soft_router(soft_router_file, arch):
    """The same bound as above on files whose routing weights matter (mutants `topk_renorm_dropped`,
    `olmoe_renorm_added`)."""
    path = soft_router_file(arch)
    m = pymoe.load(path, backend="cpu")
    ids = prompt_ids(m.config.n_vocab)
    ours = m.logits(ids)  # [50, V]
    llm = llama(path)
    llm.eval(ids.tolist())
    ref = np.asarray(llm.scores[: len(ids)])
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    assert err <= REL_BOUND * scale, (err, err / scale)
