"""gpt-oss's device-step kernels (cuda_kernels/gpt_oss.py) against their NumPy references, in Numba's CUDA simulator.

What this is: attention with a sliding window and sinks against reference.attention, the biased top-K-then-softmax
router against reference.route_softmax_weight on logits + bias, and the routed experts with biases and the clamped
SwiGLU (each read from its slot or the mapped file as the residency table says) against
gpt_oss.routed_experts_oai_reference on the same bytes. Each test also shows that what the kernel adds (the window,
the sinks, the bias, the clamp) changes the answer here, so a kernel that ignored it would fail. Shapes are tiny:
the simulator runs one Python thread per CUDA thread.
Tolerances: ids exact; the rest as tests/test_cuda_kernels.py and tests/test_cuda_step_kernels.py (float32 sums in
another order: a few u times the size of the terms summed), each said where it is used.
"""
import sys

from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import pymoe.quant as Q  # noqa: E402
from pymoe.backends.reference import attention, route_softmax_weight, swiglu_oai  # noqa: E402
from pymoe.quant import QType  # noqa: E402
from quant_helpers import random_rows  # noqa: E402

from pymoe.cuda_kernels import gpt_oss, step  # noqa: E402

pytestmark = pytest.mark.cuda
U = 2.0 ** -24  # float32 unit roundoff


@in_process
@pytest.mark.parametrize("given", ["int", "device"])  # the position: an int, or int32 [1] in device memory
@pytest.mark.parametrize("window, with_sinks", [(5, True), (5, False), (0, True)])
def test_decode_attention_with_window_and_sinks_matches_the_reference(window, with_sinks, given):
    """4 query heads over 2 KV heads, Dh 8, Dv 6, the query at position 12 of a 16-row cache (rows after it
    garbage); window 5 sees keys 8..12 only (the rows before are garbage too: a read would show). Tolerance as
    test_cuda_kernels' decode attention (rtol 1e-5, atol 1e-6: an 8-term dot, a 13-term softmax sum)."""
    rng = np.random.default_rng(7)
    H, G, Dh, Dv, S_max, pos = 4, 2, 8, 6, 16, 12
    q = rng.standard_normal((H, Dh)).astype(np.float32)
    k = rng.standard_normal((S_max, G, Dh)).astype(np.float32)
    v = rng.standard_normal((S_max, G, Dv)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32) + 1.0 if with_sinks else None  # [H]
    k[pos + 1:], v[pos + 1:] = 1e30, np.nan  # the future
    want = attention(q[None], k[:pos + 1], v[:pos + 1], pos, window, sinks)  # [1, H * Dv]
    kd, vd = k.copy(), v.copy()
    if window:
        kd[:pos - window + 1], vd[:pos - window + 1] = 1e30, np.nan  # out of the window: never read
    out, scores = cuda.device_array((H, Dv), np.float32), cuda.device_array((H, S_max), np.float32)
    gpt_oss.decode_attention_ws(cuda.to_device(q), cuda.to_device(kd), cuda.to_device(vd),
                                pos if given == "int" else cuda.to_device(np.array([pos], np.int32)), window,
                                None if sinks is None else cuda.to_device(sinks), out, scores)
    np.testing.assert_allclose(out.copy_to_host().reshape(1, -1), want, rtol=1e-5, atol=1e-6)
    plain = attention(q[None], k[:pos + 1], v[:pos + 1], pos)
    assert np.abs(want - plain).max() > 1e-2  # the window / the sinks change the answer here


@in_process
def test_route_softmax_weight_matches_the_reference_router():
    """Same ids as a stable argsort of logits + bias (ties to the lower id: equal biased logits in a row; the bias
    large enough to pick experts the logits alone would not); weights: K exps, a K-term sum and a division
    (rtol (K + 4) u)."""
    rng = np.random.default_rng(8)
    T, E, K = 5, 9, 3
    logits = rng.standard_normal((T, E)).astype(np.float32)
    bias = (0.8 * rng.standard_normal(E)).astype(np.float32)
    logits[:, 4] = logits[:, 2] + bias[2] - bias[4]  # ties after the bias (exact in these rows: checked below)
    ids, w = cuda.device_array((T, K), np.int32), cuda.device_array((T, K), np.float32)
    gpt_oss.route_softmax_weight(cuda.to_device(logits), cuda.to_device(bias), K, ids, w)
    biased = logits + bias
    want_ids, want_w = route_softmax_weight(biased, K)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_allclose(w.copy_to_host(), want_w, rtol=(K + 4) * U, atol=0)
    assert (biased[:, 4] == biased[:, 2]).any()  # a tie took place
    assert (route_softmax_weight(logits, K)[0] != want_ids).any()  # the bias matters here
    gpt_oss.route_softmax_weight(cuda.to_device(logits), None, K, ids, w)  # no bias
    np.testing.assert_array_equal(ids.copy_to_host(), route_softmax_weight(logits, K)[0])


@in_process
def test_routed_oai_experts_read_slots_and_the_mapped_file_as_the_table_says():
    """Four experts (two in slots, one of them with bytes unlike the file's, two from the "file"; mixed types),
    each with gate/up/down biases big enough that the clamp of swiglu_oai bites (gate above 7, up outside +-7).
    Against the reference on the bytes the table points at, added in k order; then expert 3 left out (-2)."""
    rng = np.random.default_rng(9)
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
    biases = ((6.0 * rng.standard_normal((E, F))).astype(np.float32), (6.0 * rng.standard_normal((E, F))).astype(
        np.float32), rng.standard_normal((E, D)).astype(np.float32))  # gate, up [E, F], down [E, D]
    row_bytes = np.array([s[1] for s in shapes], np.int64)
    Y, H = cuda.device_array((T, D), np.float32), cuda.device_array((T * K, F), np.float32)
    dev = [cuda.to_device(a) for a in (slots, host, table, offsets, part_off, row_bytes)]
    dbias = tuple(cuda.to_device(b) for b in biases)

    def run():
        gpt_oss.routed_experts_oai(*dev, types, (D, F), cuda.to_device(ids), cuda.to_device(w), cuda.to_device(X),
                                   Y, H, dbias)
        return Y.copy_to_host()

    read = lambda e: step.expert_bytes(slots, host, table, offsets, part_off, shapes, e)  # noqa: E731
    want = gpt_oss.routed_experts_oai_reference(read, types, ids, w, X, biases)
    # the size of the terms summed, [T, D]: down's F products and its bias; h's own rounding (an exp, three
    # products) is relative. (D + F) u ~ 2e-6 of it, so 1e-5 of it is 5x that.
    scale = np.zeros((T, D))
    gates, ups = [], []
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            g, u, d = (Q.dequantize(a, types[p]) for a, p in zip(read(e), ("gate", "up", "down")))
            gates.append(g @ X[t] + biases[0][e])
            ups.append(u @ X[t] + biases[1][e])
            scale[t] += w[t, k] * (np.abs(d) @ np.abs(swiglu_oai(gates[-1], ups[-1])) + np.abs(biases[2][e]))
    gates, ups = np.concatenate(gates), np.concatenate(ups)
    assert (gates > 7).any() and (np.abs(ups) > 7).any() and (np.abs(ups) < 7).any()  # the clamp bites
    np.testing.assert_array_less(np.abs(run() - want), 1e-5 * scale + 1e-7)
    no_bias = tuple(np.zeros_like(b) for b in biases)
    assert np.abs(gpt_oss.routed_experts_oai_reference(read, types, ids, w, X, no_bias) - want).max() > 1e-2
    table[3] = -2  # expert 3 left out (a "cpu" miss, computed and added by the host, its biases too)
    dev[2] = cuda.to_device(table)
    left_out = gpt_oss.routed_experts_oai_reference(read, types, ids, w, X, biases)
    np.testing.assert_array_less(np.abs(run() - left_out), 1e-5 * scale + 1e-7)
    assert np.abs(left_out[0] - want[0]).max() > 1e-3 * np.abs(want[0]).max()  # expert 3 was a real term


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)

if __name__ == "__main__":
    sys.exit(0)
