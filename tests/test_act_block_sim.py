"""bench/act_block_sim.py's pieces: the block rules it simulates and the backend that applies them (docs/performance.md
"Finer 8-bit blocks, simulated"). The bench's table itself needs llama.cpp and runs by hand."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

from act_block_sim import RULES, BlockSimBackend, blocks_q8k, llama_rule, q8_0_paired  # noqa: E402
from pymoe import quant  # noqa: E402
from pymoe.backends.reference import ReferenceBackend  # noqa: E402
from pymoe.quant import qact  # noqa: E402

Q = quant.QType


def activations(seed=0, T=3, C=512):
    """x float32 [T, C] with one large value per 256, as a layer's input has: what makes finer blocks matter."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, C)).astype(np.float32)
    x[:, ::256] *= 20
    return x


def test_the_256_rule_is_qacts_block_q8_k_bit_for_bit():
    x = activations()
    assert np.array_equal(blocks_q8k(x, 256), llama_rule(x, Q.Q4_K))
    assert np.array_equal(blocks_q8k(np.zeros((1, 256), np.float32), 16), np.zeros((1, 256), np.float32))


def test_each_block_is_within_half_a_step_of_x():
    # |x * iscale - rint(.)| <= 1/2, so |x' - x| <= d / 2 = max|block| / 254; the float32 operations (iscale, d, the
    # product) add a few ulp of max|block|: 2^-20 of it covers them
    x = activations(1)
    for group in (16, 32, 256):
        blocks = x.reshape(x.shape[0], -1, group)
        bound = np.abs(blocks).max(-1, keepdims=True) * (1 / 254 + 2.0 ** -20)
        err = np.abs(blocks_q8k(x, group).reshape(blocks.shape) - blocks)
        assert (err <= bound).all(), group
    # finer blocks are finer where one value dominates a block of 256
    e16, e256 = (np.abs(blocks_q8k(x, g) - x).mean() for g in (16, 256))
    assert e16 < e256 / 4


def test_the_pairing_is_ggml_cpus_vec_dot_type():
    assert all(q8_0_paired(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4, Q.Q2_0, Q.IQ4_NL))
    assert not any(q8_0_paired(t) for t in (Q.Q2_K, Q.Q4_K, Q.Q6_K, Q.IQ4_XS, Q.IQ2_XXS))
    x = activations(2)
    assert np.array_equal(RULES["per 16"](x, Q.MXFP4), llama_rule(x, Q.MXFP4))  # a Q8_0-paired type as llama.cpp
    assert np.array_equal(RULES["per 16"](x, Q.Q4_K), blocks_q8k(x, 16))


def test_the_backend_rounds_every_quantized_input_and_no_other():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 512)).astype(np.float32)  # [R, C]
    raw = quant.quantize(w, Q.Q4_K)
    x = activations(4)
    sim, ref = BlockSimBackend(), ReferenceBackend()
    assert np.array_equal(sim.linear_raw(raw, Q.Q4_K, x), ref.linear_raw(raw, Q.Q4_K, x))  # no rule: float x
    sim.rule = RULES["llama.cpp blocks"]
    want = ref.linear_raw(raw, Q.Q4_K, qact.dequantize_act(*qact.quantize_act_ref(x, 8)[:2]))
    assert np.array_equal(sim.linear_raw(raw, Q.Q4_K, x), want)
    assert np.array_equal(sim.linear_raw(w, Q.F32, x), ref.linear_raw(w, Q.F32, x))  # F32 weights: x as it is
