"""Each activation width against the float model, beside llama.cpp's own run of the same file (issue 50).

The float model is llama.cpp on an F32 copy of the quantized file (same weights, float math, F32 KV cache);
"llama.cpp" is llama.cpp on the file itself, with its own 8-bit activation blocks. bench/act_accuracy.py prints the
table for every family and format; this runs two of its files. Bounds are relative to llama.cpp's own figure on
the same file, not fixed numbers: tiny random-weight models have saturated routers that turn a rounding into an
expert flip, so the absolute distances say more about the model than about the engine.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

CASES = [("qwen3moe", "Q4_K_M"), ("qwen3next", "Q4_K_M")]
# pymoe's 8-bit activations are llama.cpp's block_q8_K values bit for bit (tests/test_kernels_qact.py), so what is
# left between the two runs is the order of float32 sums, which can flip a saturated router's choice one way or
# the other: measured pymoe 8 / llama.cpp mean |Δ| 1.00-1.07 over these and the Q2_K files (bench/act_accuracy.py).
# 1.25 is 3.5x that excess. A power-of-two scale (a bit fewer of the 8) measured 1.28-1.47 on the same files.
RATIO_8 = 1.25


@pytest.mark.parametrize("arch, ftype", CASES)
def test_each_width_against_llama_cpps_own_distance_from_float(arch, ftype, tiny_model, tmp_path):
    from act_accuracy import measure

    r = measure(tiny_model(arch, "f32"), ftype, str(tmp_path))
    llama, p16, p8 = r["llama.cpp"], r["pymoe 16"], r["pymoe 8"]
    assert llama[0] > 0  # llama.cpp's 8-bit run does move off the float model: the comparison means something
    # the default (16-bit activations) is at least as close to float as llama.cpp, and picks the same tokens
    assert p16[0] <= llama[0] and p16[1] >= llama[1], r
    assert p8[0] <= RATIO_8 * llama[0], r
