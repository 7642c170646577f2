"""The backend contract (pymoe/backends/protocol.py): every backend provides every primitive, and the compiled CPU
backend's primitives give the reference backend's results -- bit for bit where the CPU backend promises it
(rmsnorm, rope, route), within float32 rounding where it sums in another order (attention, F32 products, float
kernels), and on one expert block through both of its paths (fused integer kernel, one expert at a time).

The CUDA backend is checked for the names here (no device needed); its arithmetic is held to the same reference in
the CUDA simulator (tests/test_cuda_backend.py, tests/test_cuda_real_kernels_sim.py).
"""
import numpy as np
import pytest

from pymoe.backends import get_backend
from pymoe.backends.cpu import CPUBackend
from pymoe.backends.protocol import PRIMITIVES, Backend
from pymoe.backends.reference import ReferenceBackend, experts_one_by_one
from pymoe.gguf.loader import ExpertBytes
from pymoe.quant import QType
from quant_helpers import random_rows

RNG = np.random.default_rng(11)


def test_the_contract_lists_the_primitives():
    assert {"linear", "linear_many", "linear_raw", "rmsnorm", "rope", "attention", "route", "moe_experts", "dense",
            "vector", "new_pool", "new_kv", "warm_up", "warm_up_experts", "to_device", "to_host", "add", "view",
            "kv_write", "kv_read"} <= set(PRIMITIVES)


@pytest.mark.parametrize("name", ["reference", "cpu"])
def test_host_backends_implement_the_contract(name):
    b = get_backend(name)
    assert isinstance(b, Backend)
    missing = [p for p in PRIMITIVES if not callable(getattr(b, p, None))]
    assert not missing, missing


def test_cuda_backend_implements_the_contract():
    from pymoe.backends.cuda import CUDABackend  # the class only: no device needed

    missing = [p for p in PRIMITIVES if not callable(getattr(CUDABackend, p, None))]
    assert not missing, missing


def test_unknown_backend_is_one_line():
    from pymoe.errors import PymoeError

    with pytest.raises(PymoeError, match="unknown backend 'tpu'"):
        get_backend("tpu")


def test_cpu_primitives_give_the_references_bits():
    """rmsnorm and rope: the CPU backend's compiled versions promise NumPy's bits exactly; route the same experts,
    and weights within the exp kernel's error (exp_f32: 2 ulp; tests/test_kernels_cpu_backend.py's bound)."""
    ref, cpu = ReferenceBackend(), CPUBackend()
    x = RNG.standard_normal((5, 3, 16)).astype(np.float32)  # [T, heads, Dh]
    w = RNG.standard_normal(16).astype(np.float32)
    np.testing.assert_array_equal(cpu.rmsnorm(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6))
    cos, sin = (RNG.standard_normal((5, 6)).astype(np.float32) for _ in range(2))  # [T, rope_dim / 2]
    for neox in (True, False):
        np.testing.assert_array_equal(cpu.rope(x, cos, sin, neox), ref.rope(x, cos, sin, neox))
    logits = RNG.standard_normal((7, 12)).astype(np.float32)  # [T, E]
    for norm in (True, False):
        (ids, w), (ids_ref, w_ref) = cpu.route(logits, 3, norm), ref.route(logits, 3, norm)
        np.testing.assert_array_equal(ids, ids_ref)
        assert np.allclose(w, w_ref, rtol=4 * 2.0 ** -24 * 64, atol=0)


def test_cpu_attention_and_f32_products_within_float32_rounding():
    """Another summation order: bounded by a few float32 ulps of the magnitudes summed (u = 2^-24, sums of <= 64
    terms: 64 u relative to the sum of |terms|, measured here ~1e-7)."""
    ref, cpu = ReferenceBackend(), CPUBackend()
    q = RNG.standard_normal((4, 4, 16)).astype(np.float32)  # [T, H, Dh]
    k, v = (RNG.standard_normal((9, 2, 16)).astype(np.float32) for _ in range(2))  # [S, G, Dh]
    got, want = cpu.attention(q, k, v, 5), ref.attention(q, k, v, 5)  # [T, H * Dv]
    assert np.abs(got - want).max() <= 64 * 2.0 ** -24 * np.abs(v).max() * 4
    W = RNG.standard_normal((8, 32)).astype(np.float32)  # [R, C]
    X = RNG.standard_normal((3, 32)).astype(np.float32)  # [T, C]
    bound = 64 * 2.0 ** -24 * (np.abs(X) @ np.abs(W).T)  # [T, R]
    assert (np.abs(cpu.linear_raw(W, QType.F32, X) - ref.linear_raw(W, QType.F32, X)) <= bound).all()


def test_auto_width_is_8_bits_for_the_experts_and_16_for_the_rest():
    """--act-bits auto (backends/cpu.py ACT_MODES): the routed experts give CPUBackend(act_bits=8)'s bits, a dense
    product CPUBackend(act_bits=16)'s, the one-expert-at-a-time path (ffn, gpt-oss) the experts' width too; a bad
    mode is a one-line error naming the field."""
    from pymoe.backends.cpu import _AtExpertBits
    from pymoe.backends.reference import DenseWeight

    D, F, E, T = 256, 256, 3, 2
    types = {"gate": QType.Q2_0, "up": QType.Q2_0, "down": QType.MXFP4}  # x per 32 values at 8 bits
    experts = {e: ExpertBytes(0, e, random_rows(QType.Q2_0, F, D, RNG), random_rows(QType.Q2_0, F, D, RNG),
                              random_rows(QType.MXFP4, D, F, RNG)) for e in range(E)}
    x = (RNG.standard_normal((T, D)) * 0.5).astype(np.float32)  # [T, D]
    ids, w = np.array([[0, 2], [2, 1]]), RNG.random((T, 2)).astype(np.float32)  # [T, K]
    auto, b8, b16 = (CPUBackend(act_bits=a) for a in ("auto", 8, 16))
    assert (auto.act_bits, auto.dense_bits, auto.expert_bits) == ("auto", 16, 8)
    got = auto.moe_experts(experts, types, x, ids, w)
    assert np.array_equal(got, b8.moe_experts(experts, types, x, ids, w))
    assert not np.array_equal(got, b16.moe_experts(experts, types, x, ids, w))  # (the widths do differ here)
    assert np.array_equal(experts_one_by_one(_AtExpertBits(auto), experts, types, x, ids, w),
                          experts_one_by_one(b8, experts, types, x, ids, w))
    raw = random_rows(QType.Q8_0, 16, D, RNG)
    dense = DenseWeight(QType.Q8_0, raw, (16, D))
    assert np.array_equal(auto.linear(dense, x), b16.linear(dense, x))
    with pytest.raises(ValueError, match="act_bits"):
        CPUBackend(act_bits="7")


@pytest.mark.parametrize("act_bits", [0, 16, 15])
def test_cpu_experts_against_the_reference(act_bits):
    """One MoE layer's experts (Q2_K gate/up, Q3_K down; 256 wide so the integer path applies): the CPU backend's
    fused integer kernel (act_bits 16, and 15: two 8-bit planes) and its float kernels one expert at a time
    (act_bits 0) against the reference's dequantize-and-multiply. Bounds: float kernels, float32 rounding (measured
    2e-7 of the output's max); 16-bit activations, tests/test_kernels_qact.py's measured 2.1e-4, here 5e-4 as there
    (two planes: the same measured 2.1e-4 there, the same bound)."""
    D, F, E, K, T = 256, 256, 4, 2, 3
    types = {"gate": QType.Q2_K, "up": QType.Q2_K, "down": QType.Q3_K}
    experts = {e: ExpertBytes(0, e, random_rows(QType.Q2_K, F, D, RNG), random_rows(QType.Q2_K, F, D, RNG),
                              random_rows(QType.Q3_K, D, F, RNG)) for e in range(E)}
    x = (RNG.standard_normal((T, D)) * 0.5).astype(np.float32)  # [T, D]
    ids = np.array([[0, 2], [2, 1], [3, 0]])  # [T, K]
    w = RNG.random((T, K)).astype(np.float32)  # [T, K]
    used = {e: experts[e] for e in np.unique(ids).tolist()}
    ref = ReferenceBackend()
    want = ref.moe_experts(used, types, x, ids, w)  # [T, D]
    np.testing.assert_array_equal(want, experts_one_by_one(ref, used, types, x, ids, w))
    got = CPUBackend(act_bits=act_bits).moe_experts(used, types, x, ids, w)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel <= (1e-6 if act_bits == 0 else 5e-4), rel
