"""DeepSeek-V2/V3's device kernels (cuda_kernels/mla.py, cuda_kernels/route_groups.py) against their NumPy twins, in
Numba's CUDA simulator.

What this is: the compressed cache row (rmsnorm + RoPE), the absorbed query, the value up-projection and the
attention over the compressed cache (attention.decode_attention with V a view of K's first C values) against
engine/mla.py's math written in NumPy (`*_reference`, reference.attention); the group-limited router against the
host's router (reference.route_sigmoid with groups). Shapes are tiny: the simulator runs one Python thread per CUDA
thread.
Tolerances: ids exact; a float32 sum of n products differs from NumPy's (pairwise) order by at most ~n u of the sum
of the absolute terms (u = 2^-24), doubled; single multiply-adds (RoPE, scaling, the norm's scale) a few u of the
value's size.
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

from pymoe.backends.reference import attention, rope_tables, route_sigmoid  # noqa: E402
from pymoe.cuda_kernels import mla, route_groups  # noqa: E402
from pymoe.cuda_kernels.attention import chunk_attention, decode_attention  # noqa: E402

pytestmark = pytest.mark.cuda
U = 2.0 ** -24  # float32 unit roundoff
H, C, R, N, V = 3, 40, 8, 6, 5  # heads, kv_lora_rank, rope dims, nope dims, value dims (C > THREADS: strided)


def at(p: int, given: str):
    """A position as the kernels take it: an int, or ("device") int32 [1] in device memory (the `_at_kernel` forms)."""
    return cuda.to_device(np.array([p], np.int32)) if given == "device" else p


def tables(n_pos: int):
    return rope_tables(R, 10_000.0, np.arange(n_pos))  # [n_pos, R / 2] each


@in_process
@pytest.mark.parametrize("given", ["int", "device"])  # p0 and r0: ints, or int32 [1] each in device memory
@pytest.mark.parametrize("neox", [False, True])
def test_kv_row_is_the_normed_latent_and_the_roped_key(neox, given):
    rng = np.random.default_rng(1)
    T, p0, r0 = 2, 3, 5
    ckv = rng.standard_normal((T, C + R)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    cos, sin = tables(8)
    cache = cuda.to_device(np.full((9, 1, C + R), 7.0, np.float32))
    mla.mla_kv_row(cuda.to_device(ckv), cuda.to_device(w), 1e-6, cuda.to_device(cos), cuda.to_device(sin),
                   at(p0, given), neox, cache, at(r0, given))
    got = cache.copy_to_host()
    want = mla.mla_kv_row_reference(ckv, w, 1e-6, cos[p0:p0 + T], sin[p0:p0 + T], neox)  # [T, C + R]
    # the norm: a C-term sum of squares (2 C u relative, doubled), then one multiply each
    np.testing.assert_allclose(got[r0:r0 + T, 0], want, rtol=4 * C * U, atol=4 * U * np.abs(want).max())
    assert (got[:r0] == 7.0).all() and (got[r0 + T:] == 7.0).all()  # only rows r0 .. r0 + T - 1 written
    assert not np.allclose(want[:, C:], ckv[:, C:])  # the rope part really turned


@in_process
@pytest.mark.parametrize("given", ["int", "device"])
@pytest.mark.parametrize("neox", [False, True])
def test_query_is_absorbed_roped_and_scaled(neox, given):
    rng = np.random.default_rng(2)
    T, p0, scale = 2, 4, 1.7
    q = rng.standard_normal((T, H, N + R)).astype(np.float32)
    k_b = rng.standard_normal((H, C, N)).astype(np.float32)
    cos, sin = tables(8)
    Q = cuda.device_array((T, H, C + R), np.float32)
    mla.mla_query(cuda.to_device(q), cuda.to_device(k_b), cuda.to_device(cos), cuda.to_device(sin), at(p0, given),
                  neox, scale, Q)
    want = mla.mla_query_reference(q, k_b, cos[p0:p0 + T], sin[p0:p0 + T], neox, scale)  # [T, H, C + R]
    terms = np.abs(np.einsum("thn,hcn->thcn", q[..., :N], k_b)).sum(-1) * scale  # [T, H, C] sums of |terms|
    got = Q.copy_to_host()
    assert (np.abs(got[..., :C] - want[..., :C]) <= 2 * (N + 1) * U * terms).all()
    np.testing.assert_allclose(got[..., C:], want[..., C:], rtol=0, atol=8 * U * np.abs(want[..., C:]).max())


@in_process
def test_value_up_projection():
    rng = np.random.default_rng(3)
    T = 2
    a = rng.standard_normal((T, H, C)).astype(np.float32)
    v_b = rng.standard_normal((H, V, C)).astype(np.float32)
    out = cuda.device_array((T, H, V), np.float32)
    mla.mla_value(cuda.to_device(a), cuda.to_device(v_b), out)
    terms = np.einsum("thc,hvc->thv", np.abs(a), np.abs(v_b))  # [T, H, V]
    assert (np.abs(out.copy_to_host() - mla.mla_value_reference(a, v_b)) <= 2 * C * U * terms).all()


@in_process
def test_attention_over_the_compressed_cache_reads_v_from_k():
    """decode_attention with one KV head, V = the first C values of each cached row (a view: no second copy)
    against reference.attention over the same rows; sums of S scores and S weighted values (2 S u, plus the C + R
    term dot products: 2 (C + R) u of the scores' size through exp)."""
    rng = np.random.default_rng(4)
    S, pos = 7, 5
    cache = rng.standard_normal((S, 1, C + R)).astype(np.float32)
    q = (0.2 * rng.standard_normal((H, C + R))).astype(np.float32)
    dev = cuda.to_device(cache)
    out = cuda.device_array((H, C), np.float32)
    scores = cuda.device_array((H, S), np.float32)
    decode_attention(cuda.to_device(q), dev, dev[:, :, :C], pos, out=out, scores=scores)
    want = attention(q[None], cache[:pos + 1], cache[:pos + 1, :, :C], pos)  # [1, H * C]
    tol = 4 * (S + C + R) * U * np.abs(cache).max()
    np.testing.assert_allclose(out.copy_to_host().reshape(1, -1), want, rtol=0, atol=tol)


@in_process
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("given", ["int", "device"])
def test_query_reads_k_b_in_its_stored_type(qtype, given):
    """mla_query_q (k_b as its stored rows [H * C, S]) against mla_query_reference on the dequantized rows; the bound
    as test_query_is_absorbed_roped_and_scaled's (an N-term dot product per value; the decoded weights are exact:
    tests/test_cuda_kernels.py)."""
    from quant_helpers import random_rows

    from pymoe.quant import QType

    rng = np.random.default_rng(6)
    T, p0, scale, Hq, Cq, Nq = 2, 4, 1.7, 2, 33, 32  # N: one Q8_0 block; C > THREADS: strided
    rows = random_rows(QType[qtype], Hq * Cq, Nq, rng)  # uint8 [H * C, S]
    q = rng.standard_normal((T, Hq, Nq + R)).astype(np.float32)
    cos, sin = tables(p0 + T)
    Q = cuda.device_array((T, Hq, Cq + R), np.float32)
    mla.mla_query_q(cuda.to_device(q), cuda.to_device(rows), QType[qtype], cuda.to_device(cos), cuda.to_device(sin),
                    at(p0, given), False, scale, Q)
    want = mla.mla_query_q_reference(q, rows, QType[qtype], cos[p0:p0 + T], sin[p0:p0 + T], False, scale)
    k_b = mla.head_floats(rows, QType[qtype], Hq)  # [H, C, N]
    terms = np.abs(np.einsum("thn,hcn->thcn", q[..., :Nq], k_b)).sum(-1) * scale  # [T, H, C]
    got = Q.copy_to_host()
    np.testing.assert_array_less(np.abs(got[..., :Cq] - want[..., :Cq]), 2 * Nq * U * terms + 1e-30)
    np.testing.assert_allclose(got[..., Cq:], want[..., Cq:], rtol=4 * U, atol=4 * U * np.abs(want).max())


@in_process
@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_K"])
def test_value_up_projection_reads_v_b_in_its_stored_type(qtype):
    """mla_value_q (v_b as its stored rows [H * V, S]) against mla_value_reference on the dequantized rows: a C-term
    dot product per value, within 2 C u of the sum of |terms|."""
    from quant_helpers import random_rows

    from pymoe.quant import QType, get_format

    rng = np.random.default_rng(7)
    T, Hv, Vv = 2, 2, 3
    Cv = get_format(QType[qtype]).block_size * (1 if qtype == "Q4_K" else 2)
    rows = random_rows(QType[qtype], Hv * Vv, Cv, rng)  # uint8 [H * V, S]
    a = rng.standard_normal((T, Hv, Cv)).astype(np.float32)
    out = cuda.device_array((T, Hv, Vv), np.float32)
    mla.mla_value_q(cuda.to_device(a), cuda.to_device(rows), QType[qtype], out)
    want = mla.mla_value_q_reference(a, rows, QType[qtype])
    terms = np.einsum("thc,hvc->thv", np.abs(a), np.abs(mla.head_floats(rows, QType[qtype], Hv)))  # [T, H, V]
    np.testing.assert_array_less(np.abs(out.copy_to_host() - want), 2 * Cv * U * terms + 1e-30)

@in_process
def test_chunk_attention_over_the_compressed_cache_reads_v_from_k():
    """A prompt chunk's MLA attention (engine/mla.mla_device, T > 1): chunk_attention with one KV head and V the
    first C values of each row (a strided view), causal within the chunk (token t sees rows 0..p0 + t), against
    reference.attention over the same rows; the bound as the decode test's."""
    rng = np.random.default_rng(5)
    S, p0, T = 9, 3, 4
    cache = rng.standard_normal((S, 1, C + R)).astype(np.float32)
    q = (0.2 * rng.standard_normal((T, H, C + R))).astype(np.float32)
    dev = cuda.to_device(cache)
    out = chunk_attention(cuda.to_device(q), dev, dev[:, :, :C], p0)  # [T, H, C]
    want = attention(q, cache[:p0 + T], cache[:p0 + T, :, :C], p0)  # [T, H * C]
    tol = 4 * (S + C + R) * U * np.abs(cache).max()
    np.testing.assert_allclose(out.copy_to_host().reshape(T, -1), want, rtol=0, atol=tol)

@in_process
@pytest.mark.parametrize("gating, with_bias, norm_topk", [("sigmoid", True, True), ("softmax", False, False),
                                                         ("softmax", False, True)])
def test_group_limited_router_matches_the_host_router(gating, with_bias, norm_topk):
    """Same ids (rows where the group limit changes the choice: checked), weights within the rounding of an exp and
    a division (sigmoid), an E-term sum (softmax), then a K-term sum and a division: rtol 2 (E + K + 4) u."""
    rng = np.random.default_rng(5)
    T, E, K, G, G_used = 6, 16, 4, 4, 2
    logits = (2 * rng.standard_normal((T, E))).astype(np.float32)
    logits[0, :] = 0.25  # a row of ties only: the lowest groups, then the lowest ids
    bias = (0.1 * rng.standard_normal(E)).astype(np.float32) if with_bias else None
    ids, w = cuda.device_array((T, K), np.int32), cuda.device_array((T, K), np.float32)
    route_groups.route_groups(cuda.to_device(logits), K, None if bias is None else cuda.to_device(bias),
                              gating == "softmax", G, G_used, norm_topk, ids, w, scale=2.5)
    want_ids, want_w = route_sigmoid(logits, K, bias, norm_topk, 2.5, G, G_used, gating)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_allclose(w.copy_to_host(), want_w, rtol=2 * (E + K + 4) * U, atol=0)
    ungrouped = route_sigmoid(logits, K, bias, norm_topk, 2.5, 1, 1, gating)[0]
    assert (np.sort(ungrouped, axis=1) != np.sort(want_ids, axis=1)).any(axis=1).sum() >= 2  # the groups matter


@in_process
def test_group_limited_router_with_groups_of_one_expert():
    """One expert per group (the micro deepseek2 file: 4 experts, 4 groups): a group's score is its one value."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((3, 4)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(4)).astype(np.float32)
    ids, w = cuda.device_array((3, 2), np.int32), cuda.device_array((3, 2), np.float32)
    route_groups.route_groups(cuda.to_device(logits), 2, cuda.to_device(bias), False, 4, 2, True, ids, w)
    want_ids, want_w = route_sigmoid(logits, 2, bias, True, 1.0, 4, 2)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    np.testing.assert_allclose(w.copy_to_host(), want_w, rtol=2 * (4 + 2 + 4) * U, atol=0)


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
