"""The decode step's kernels (cuda_kernels/step.py) against their NumPy references, in Numba's CUDA simulator.

What this is: the device router (softmax top-K) against reference.route, the embedding gather against
quant.dequantize's rows, argmax against np.argmax, the residual add against `+`, and the routed experts (each read
from its slot or from the mapped file as the residency table says) against reference.swiglu_expert on the same
bytes. Shapes are tiny: the simulator runs one Python thread per CUDA thread.
Tolerances: ids and argmax exact; float32 sums as tests/test_cuda_kernels.py (|got - ref| <= a few u times the sum
of the absolute terms).
"""
import sys

from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import pymoe.quant as Q  # noqa: E402
from pymoe.backends.reference import route, silu  # noqa: E402
from pymoe.quant import QType  # noqa: E402
from quant_helpers import random_rows  # noqa: E402

from pymoe.cuda_kernels import step  # noqa: E402

pytestmark = pytest.mark.cuda
U = 2.0 ** -24  # float32 unit roundoff


@in_process
@pytest.mark.parametrize("norm_topk", [True, False])
def test_route_softmax_matches_the_reference_router(norm_topk):
    """Same ids (ties to the lower id: two equal logits per row), weights within float32 rounding of a softmax over
    E terms (the sum's order differs from NumPy's pairwise sum: E u relative, doubled)."""
    rng = np.random.default_rng(1)
    T, E, K = 5, 9, 3
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[:, 4] = logits[:, 2]  # ties
    logits[0, :] = 0.5  # a row of ties only: ids 0, 1, 2
    ids, w = cuda.device_array((T, K), np.int32), cuda.device_array((T, K), np.float32)
    step.route_softmax(cuda.to_device(logits), K, norm_topk, ids, w, scale=1.0)
    want_ids, want_w = route(logits, K, norm_topk)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_allclose(w.copy_to_host(), want_w, rtol=2 * E * U, atol=0)
    step.route_softmax(cuda.to_device(logits), K, norm_topk, ids, w, scale=2.5)  # expert_weights_scale
    np.testing.assert_allclose(w.copy_to_host(), 2.5 * want_w, rtol=2 * E * U + U, atol=0)


@in_process
@pytest.mark.parametrize("norm_topk, with_bias", [(True, True), (False, False)])
def test_route_sigmoid_matches_the_reference_router(norm_topk, with_bias):
    """Same ids (the bias steers the choice: it is large enough here to pick experts the probabilities alone would
    not); weights: a sigmoid each (a few u: exp and a division), then a K-term sum and a division (rtol 8 u)."""
    from pymoe.backends.reference import route_sigmoid

    rng = np.random.default_rng(6)
    T, E, K = 5, 9, 3
    logits = rng.standard_normal((T, E)).astype(np.float32)
    bias = (0.5 * rng.standard_normal(E)).astype(np.float32) if with_bias else None
    ids, w = cuda.device_array((T, K), np.int32), cuda.device_array((T, K), np.float32)
    step.route_sigmoid(cuda.to_device(logits), K, None if bias is None else cuda.to_device(bias), norm_topk, ids, w,
                       scale=2.5)
    want_ids, want_w = route_sigmoid(logits, K, bias, norm_topk, 2.5)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_allclose(w.copy_to_host(), want_w, rtol=8 * U, atol=0)
    if with_bias:
        assert (route_sigmoid(logits, K, None, norm_topk, 2.5)[0] != want_ids).any()  # the bias matters here


@in_process
@pytest.mark.parametrize("qtype", [QType.F32, QType.Q8_0, QType.Q4_K])
def test_embed_gathers_the_dequantized_rows(qtype):
    """The rows of the token ids, decoded on the device: the references' values (one multiply-add per weight:
    d * q - m in float32, at most 2 u of the weight's size apart from dequantize's order)."""
    rng = np.random.default_rng(2)
    V, D = 7, 256
    w = random_rows(qtype, V, D, rng)  # [V, S]
    tokens = np.array([3, 0, 6, 3], np.int32)
    out = cuda.device_array((tokens.size, D), np.float32)
    step.embed(cuda.to_device(w), qtype, cuda.to_device(tokens), out)
    want = Q.dequantize(w, qtype)[tokens]
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=4 * U, atol=4 * U * np.abs(want).max())


@in_process
def test_argmax_and_add():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((2, 300)).astype(np.float32)  # V > THREADS: strided scan
    logits[1, 17] = logits[1, 250] = 9.0  # a tie: the first index wins, as np.argmax
    out = cuda.device_array(2, np.int32)
    step.argmax(cuda.to_device(logits), out)
    np.testing.assert_array_equal(out.copy_to_host(), np.argmax(logits, axis=1))
    a, b = rng.standard_normal((2, 150)).astype(np.float32), rng.standard_normal((2, 150)).astype(np.float32)
    Y = cuda.to_device(a)
    step.add(Y, cuda.to_device(b))
    np.testing.assert_array_equal(Y.copy_to_host(), a + b)  # one float32 addition: the same bits


@in_process
def test_swiglu_and_the_sigmoid_gate():
    """silu(g) * u: a few roundings of exp and two products (rtol 8 u); the gate: a D-term float32 dot in another
    order than NumPy's, through a sigmoid whose slope is <= 1/4 (2 D u sum |x g| absolute on z), then one product."""
    from pymoe.backends.reference import sigmoid

    rng = np.random.default_rng(5)
    g, u = rng.standard_normal((2, 150)).astype(np.float32), rng.standard_normal((2, 150)).astype(np.float32)
    G = cuda.to_device(g)
    step.swiglu(G, cuda.to_device(u))
    np.testing.assert_allclose(G.copy_to_host(), silu(g) * u, rtol=8 * U, atol=8 * U)
    Y, X = rng.standard_normal((2, 150)).astype(np.float32), rng.standard_normal((2, 150)).astype(np.float32)
    gate = rng.standard_normal(150).astype(np.float32)
    Yd = cuda.to_device(Y)
    step.sigmoid_gate(Yd, cuda.to_device(X), cuda.to_device(gate))
    want = sigmoid((X * gate).sum(axis=-1, keepdims=True)) * Y
    dz = 2 * 150 * U * (np.abs(X * gate).sum(axis=-1, keepdims=True))  # [T, 1] bound on z's rounding
    np.testing.assert_array_less(np.abs(Yd.copy_to_host() - want), np.abs(Y) * (dz / 4 + 4 * U) + 1e-12)


@in_process
def test_routed_experts_read_slots_and_the_mapped_file_as_the_table_says():
    """Four experts: two in slots (one of them in a slot whose bytes differ from the file's copy, so that reading
    the wrong place shows), two read from the "file"; mixed gate/up/down types. Against swiglu on the bytes the
    table points at, added in k order."""
    rng = np.random.default_rng(4)
    E, D, F, T, K = 4, 32, 5, 2, 2
    types = {"gate": QType.Q8_0, "up": QType.Q4_1, "down": QType.F16}
    mats = [[random_rows(types["gate"], F, D, rng), random_rows(types["up"], F, D, rng),
             random_rows(types["down"], D, F, rng)] for _ in range(E)]
    shapes = [m.shape for m in mats[0]]
    host = np.concatenate([m.reshape(-1) for ex in mats for m in ex])  # the "file": experts back to back
    sizes = [m.nbytes for m in mats[0]]
    offsets = np.array([[sum(sizes) * e + sum(sizes[:i]) for i in range(3)] for e in range(E)], np.int64)
    part_off = np.array([0, sizes[0], sizes[0] + sizes[1]], np.int64)
    slots = np.zeros((2, sum(sizes) + 8), np.uint8)
    slots[0, :sum(sizes)] = np.concatenate([m.reshape(-1) for m in mats[2]])  # expert 2 in slot 0
    other = [random_rows(types["gate"], F, D, rng), random_rows(types["up"], F, D, rng),
             random_rows(types["down"], D, F, rng)]
    slots[1, :sum(sizes)] = np.concatenate([m.reshape(-1) for m in other])  # expert 1 in slot 1: new bytes
    table = np.array([-1, 1, 0, -1], np.int32)
    ids = np.array([[1, 3], [2, 0]], np.int32)
    w = rng.random((T, K)).astype(np.float32)
    X = (0.01 * rng.standard_normal((T, D))).astype(np.float32)  # small: random blocks have big scales
    row_bytes = np.array([s[1] for s in shapes], np.int64)
    Y, H = cuda.device_array((T, D), np.float32), cuda.device_array((T * K, F), np.float32)
    dev = [cuda.to_device(a) for a in (slots, host, table, offsets, part_off, row_bytes)]
    step.routed_experts(*dev, types, (D, F), cuda.to_device(ids), cuda.to_device(w), cuda.to_device(X), Y, H)

    read = lambda e: step.expert_bytes(slots, host, table, offsets, part_off, shapes, e)  # noqa: E731
    want = step.routed_experts_reference(read, types, ids, w, X)
    scale = np.zeros((T, D))  # [T, D] the size of the terms summed
    for t in range(T):
        for k in range(K):
            g, u, d = (Q.dequantize(a, types[p]) for a, p in zip(read(int(ids[t, k])), ("gate", "up", "down")))
            scale[t] += w[t, k] * (np.abs(d) @ np.abs(silu(g @ X[t]) * (u @ X[t])))
    np.testing.assert_array_less(np.abs(Y.copy_to_host() - want), 1e-5 * scale + 1e-7)
    assert np.abs(step.expert_bytes(slots, host, table, offsets, part_off, shapes, 1)[0]
                  .astype(int) - mats[1][0]).max() > 0  # slot 1 differs from the file: the table choice matters
    # -2: expert 3 left out (a "cpu" miss, added by the host): its pair contributes nothing
    table[3] = -2
    dev[2] = cuda.to_device(table)
    step.routed_experts(*dev, types, (D, F), cuda.to_device(ids), cuda.to_device(w), cuda.to_device(X), Y, H)
    left_out = step.routed_experts_reference(read, types, ids, w, X)
    np.testing.assert_array_less(np.abs(Y.copy_to_host() - left_out), 1e-5 * scale + 1e-7)
    assert np.abs(left_out[0] - want[0]).max() > 1e-3 * np.abs(want[0]).max()  # expert 3 was a real term


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)

if __name__ == "__main__":
    sys.exit(0)
