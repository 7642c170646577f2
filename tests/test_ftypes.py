"""Every llama.cpp ftype, written by llama.cpp's own quantizer, loaded and run by pymoe, compared with llama.cpp.

What this is, for each ftype of the pinned llama.cpp (tests/llama_quantize.py FTYPES: F16 ... Q6_K, the IQ mixes
IQ1_S ... IQ4_XS, TQ1_0, TQ2_0, MXFP4_MOE, Q1_0, Q2_0), on the tiny random qwen3moe quantized by
`llama_model_quantize` (IQ1/IQ2 with a random importance matrix, which llama.cpp requires):
  - the file loads, and its tensor types are the ones the ftype promises (the main type is present);
  - pymoe's reference backend on it equals llama.cpp on an F32 copy of it within float32 summation error
    (EXACT_REL_BOUND): every dequantizer of the mix, and the model, are right;
  - pymoe's default CPU backend on it agrees with llama.cpp on the same file within LLAMA_REL_BOUND, with the same
    top-1 token wherever the difference cannot flip it;
  - greedy tokens through a 6-slot expert pool equal those without, and experts did go through the pool.
What this is not: the formats block by block (tests/test_dequant.py, tests/test_iquants.py).
Runtime: 40 s for the 24 ftypes once Numba's cache is warm (llama.cpp's IQ1_S search is the slowest, ~8 s).
"""
import numpy as np
import pytest

from ftype_check import check_ftype
from llama_quantize import FTYPES
from test_llamacpp_quant_mixes import EXPERT_TYPES

# The K-quant ftypes and Q8_0 have their own test with each layer's expert types pinned
# (tests/test_llamacpp_quant_mixes.py); bench/ftypes_vs_llamacpp.py measures every ftype.
TESTED_HERE = [f for f in FTYPES if f not in EXPERT_TYPES]

# Reference backend vs llama.cpp on the F32 copy, relative to max |logit|: float32 summation order only, the bound of
# tests/test_model_vs_llamacpp.py. Measured: at most 9.3e-7 over all ftypes (bench/ftypes_vs_llamacpp.py).
EXACT_REL_BOUND = 1e-5
# pymoe's CPU backend vs llama.cpp, both on the quantized file. llama.cpp multiplies K/IQ/TQ weights by Q8_K
# activations and legacy/MXFP4 ones by Q8_0 (8-bit: relative error up to 2^-8 per activation), pymoe by 16-bit
# activations for the types with an integer dot (qact.ACT_DOTS) and by float ones for the rest (TQ, Q1_0, ...),
# so logits differ by ~1% of the scale: measured 0.04% (F16) to 1.7% (TQ1_0, TQ2_0). The bound is 3x the worst; a
# wrong layout gives errors of the order of the logits (>= 30%).
LLAMA_REL_BOUND = 0.05
MIN_DECIDED = 25  # of 50 positions, those whose top-1 the measured difference decides: fewest measured 30 (IQ2_XXS)
MAIN_TYPE = {"MXFP4_MOE": "MXFP4", "IQ2_M": "IQ2_S", "IQ3_XS": "IQ3_XXS", "IQ3_M": "IQ3_S", "Q2_K_S": "Q2_K",
             "IQ2_S": "IQ2_XS"}  # ftype -> the type llama.cpp gives the experts (where the names differ)


@pytest.fixture(scope="module")
def f32_model(tiny_model):
    return tiny_model("qwen3moe", "f32")


@pytest.mark.parametrize("ftype", TESTED_HERE)
def test_ftype_loads_runs_and_agrees_with_llama_cpp(ftype, f32_model, tmp_path):
    r = check_ftype(f32_model, ftype, str(tmp_path))
    main = MAIN_TYPE.get(ftype, ftype.split("_K_")[0] + "_K" if "_K_" in ftype else ftype)
    assert main in r["types"], r["types"]

    assert r["exact_rel"] <= EXACT_REL_BOUND, r["exact_rel"]

    ours, theirs = r["ours"], r["theirs"]
    err = np.abs(ours - theirs).max()
    assert err <= LLAMA_REL_BOUND * np.abs(theirs).max(), r["llama_rel"]
    top2 = np.sort(ours, axis=-1)[:, -2:]  # [50, 2]
    decided = top2[:, 1] - top2[:, 0] > 2 * err  # positions where a difference of err cannot flip the argmax
    assert decided.sum() >= MIN_DECIDED, decided.sum()
    assert (ours.argmax(-1) == theirs.argmax(-1))[decided].all()

    assert r["pool_equal"]
    assert r["promoted"] > 0
