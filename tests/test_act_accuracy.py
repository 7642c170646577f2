"""Each activation width against the float model, beside llama.cpp's own run of the same file (issue 50).

The float model is llama.cpp on an F32 copy of the quantized file (same weights, float math, F32 KV cache);
"llama.cpp" is llama.cpp on the file itself, with its own 8-bit activation blocks. bench/act_accuracy.py prints the
table for every family and format; this runs three of its files. Bounds are relative to llama.cpp's own figure on
the same file, not fixed numbers: tiny random-weight models have saturated routers that turn a rounding into an
expert flip, so the absolute distances say more about the model than about the engine.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

# Q4_K_M: x per 256 values (block_q8_K) for every product; MXFP4_MOE: MXFP4 experts and Q8_0 attention, x per 32
# values (block_q8_0)
CASES = [("qwen3moe", "Q4_K_M"), ("qwen3next", "Q4_K_M"), ("qwen3moe", "MXFP4_MOE")]
# pymoe's 8-bit activations are llama.cpp's blocks bit for bit (block_q8_K and block_q8_0 by the weight's type:
# tests/test_kernels_qact.py), so what is left between the two runs is the order of float32 sums, which can flip a
# saturated router's choice one way or the other: measured pymoe 8 / llama.cpp mean |Δ| 0.91-1.01 on these and the
# other files of bench/act_accuracy.py (docs/performance.md "Accuracy"). 1.25 is 3.5x the largest excess seen
# before per-32 blocks (1.07); a power-of-two scale measured 1.28-1.47, per-256 x for MXFP4 and Q2_0 1.2-1.5.
RATIO_8 = 1.25
# --act-bits -> bench/act_accuracy.py's column ("default": no --act-bits, the file's own width: backends/cpu.py
# `default_width`)
COLUMN = {"default": "pymoe default", "16": "pymoe 16", "15": "pymoe 15", "8": "pymoe 8", "auto": "pymoe auto"}


@pytest.mark.parametrize("arch, ftype", CASES)
def test_each_width_against_llama_cpps_own_distance_from_float(arch, ftype, tiny_model, tmp_path):
    from act_accuracy import CONFIGS, measure

    r = measure(tiny_model(arch, "f32"), ftype, str(tmp_path), {c: CONFIGS[c] for c in COLUMN.values()})
    llama, p16, p15, p8, auto = r["llama.cpp"], r["pymoe 16"], r["pymoe 15"], r["pymoe 8"], r["pymoe auto"]
    assert llama[0] > 0  # llama.cpp's 8-bit run does move off the float model: the comparison means something
    # what a user gets by default is at least as close to float as llama.cpp, and picks the same tokens or more
    default = r["pymoe default"]
    assert default[0] <= llama[0] and default[1] >= llama[1], r
    assert default == p15, r  # every expert matrix of these files has 8-row tiles: the default is two 8-bit planes
    assert p16[0] <= llama[0] and p16[1] >= llama[1], r  # the precise mode, whatever the default
    assert p15[0] <= llama[0] and p15[1] >= llama[1], r  # two 8-bit planes: 16 bits' accuracy on the 8-bit dots
    # auto (8-bit experts, the rest 16-bit) is nearer float than llama.cpp by its mean |Δ| (measured 0.60-0.65x);
    # its top-1 is not bounded here: one near-tied position of 50 went the other way on olmoe Q4_K_M
    assert auto[0] <= llama[0], r
    assert p8[0] <= RATIO_8 * llama[0], r
