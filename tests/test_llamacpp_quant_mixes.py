"""Files made by llama.cpp's own quantizer: every K-quant file type (and Q8_0) of the tiny qwen3moe model.

What this is: the F32 tiny model quantized by `llama_cpp.llama_model_quantize` (what `llama-quantize` does, so the
type of every tensor is llama.cpp's choice, not pymoe's), then for each file type
  - the types llama.cpp chose for the experts, pinned (the _M mixes change ffn_down from layer to layer);
  - greedy tokens with a small slot pool equal those with none (each layer's experts in slots with their own types);
  - pymoe's reference backend (float NumPy) on the file against llama.cpp on an F32 copy of it (same weights, float math, F32
    KV cache: llama.cpp quantizes activations to 8 bits for K-quant weights, docs/testing.md, "The oracles").
The tiny preset's rows are all multiples of 256, so no K-quant falls back to another type; it has 2 layers and 8
experts, which is enough for llama.cpp's per-layer rules: for Q4_K_M / Q5_K_M, ffn_down takes Q6_K where
use_more_bits(i, n) = i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2 holds, i.e. in layer 1 of 2 (and with 8 experts,
attn_k / attn_v take Q8_0 in every K-quant type).
What this is not: the Q2_K-mix files pymoe writes itself (tests/test_model_vs_llamacpp.py).
"""
import numpy as np
import pytest

import pymoe
from oracle import require_llama_cpp
from pymoe.gguf.loader import load_gguf
from pymoe.demo.tinymodel import write_f32_copy

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]
N_NEW = 12
N_LOGITS = 50

# file type -> gate, up, down types of the experts in layers 0 and 1, as llama.cpp 0.3.36 (llama-cpp-python) chose
# them for the tiny preset.
EXPERT_TYPES = {
    "Q2_K": [("Q2_K", "Q2_K", "Q3_K")] * 2,
    "Q3_K_S": [("Q3_K", "Q3_K", "Q3_K")] * 2,
    "Q3_K_M": [("Q3_K", "Q3_K", "Q4_K")] * 2,
    "Q3_K_L": [("Q3_K", "Q3_K", "Q5_K")] * 2,
    "Q4_K_S": [("Q4_K", "Q4_K", "Q4_K")] * 2,
    "Q4_K_M": [("Q4_K", "Q4_K", "Q4_K"), ("Q4_K", "Q4_K", "Q6_K")],
    "Q5_K_S": [("Q5_K", "Q5_K", "Q5_K")] * 2,
    "Q5_K_M": [("Q5_K", "Q5_K", "Q5_K"), ("Q5_K", "Q5_K", "Q6_K")],
    "Q6_K": [("Q6_K", "Q6_K", "Q6_K")] * 2,
    "Q8_0": [("Q8_0", "Q8_0", "Q8_0")] * 2,
}
FTYPES = tuple(EXPERT_TYPES)

# pymoe's reference backend vs llama.cpp on the F32 copy, max |diff| over 50 positions x 512 logits, measured per file
# type (logit scale max |logit| 3.6-3.9): 9.5e-7 for all but Q2_K and Q5_K_S, 1.19e-6 for those two (float32
# rounding: 2.5e-7 to 3.3e-7 of the scale). The bound is 1e-6 of the scale, ~3x the largest measured.
EXACT_REL_BOUND = 1e-6


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory):
    """quantized(ftype) -> path of the tiny F32 qwen3moe quantized to that llama.cpp file type (made once)."""
    llama_cpp = require_llama_cpp()
    src = tiny_model("qwen3moe", "f32")
    root = tmp_path_factory.mktemp("llamacpp-quant")
    made = {}

    def get(ftype):
        if ftype not in made:
            dst = str(root / f"tiny-qwen3moe-{ftype}.gguf")
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            params.nthread = 2
            assert llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) == 0, ftype
            made[ftype] = dst
        return made[ftype]

    return get


@pytest.mark.parametrize("ftype", FTYPES)
def test_llamacpp_chose_these_expert_types(quantized, ftype):
    m = load_gguf(quantized(ftype))
    got = [tuple(m.expert_types(i)[p].name for p in ("gate", "up", "down")) for i in range(m.config.n_layers)]
    assert got == EXPERT_TYPES[ftype]


@pytest.mark.parametrize("ftype", FTYPES)
def test_slot_pool_never_changes_greedy_tokens(quantized, ftype):
    path = quantized(ftype)
    want = list(pymoe.load(path).generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    engine = pymoe.load(path, cache_slots=6)
    assert list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False)) == want
    assert engine.cache.stats.counts["decode"]["promoted"] > 0  # the pool was used, by experts of both layers
    assert {int(layer) for layer, _ in np.argwhere(engine.cache.residency >= 0)} == {0, 1}


@pytest.mark.parametrize("ftype", FTYPES)
def test_reference_logits_match_llamacpp_on_the_f32_copy(quantized, tmp_path, ftype):
    llama_cpp = require_llama_cpp()
    path = quantized(ftype)
    copy = str(tmp_path / "as-f32.gguf")
    write_f32_copy(path, copy)
    engine = pymoe.load(path, backend="reference")  # float math, like llama.cpp on the F32 copy
    ids = np.random.default_rng(0).integers(0, engine.config.n_vocab, N_LOGITS)
    ours = engine.logits(ids)  # [50, V]
    llm = llama_cpp.Llama(model_path=copy, n_ctx=64, n_threads=2, n_batch=64, verbose=False, logits_all=True,
                          type_k=0, type_v=0, seed=0)
    llm.eval(ids.tolist())
    ref = np.asarray(llm.scores[:N_LOGITS])  # [50, V]
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= EXACT_REL_BOUND * np.abs(ref).max()
