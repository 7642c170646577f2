"""Gated DeltaNet's and gated attention's device kernels (cuda_kernels/deltanet.py, gated_attention.py) against their
NumPy references, in Numba's CUDA simulator.

What this is: the conv step (state moved on exactly, output within float32 rounding of the K-tap sum), the gated
delta rule with its gated RMSNorm over several tokens in a row (grouped heads as qwen3next, tiled as qwen35moe;
dk and dv wider than its block's RULE_THREADS = 128 threads, so threads stride over them; the state in the device's
transposed layout), the query/gate split
(exact: a copy) and the output gate. Shapes are small: the simulator runs one Python thread per CUDA thread.
Tolerances (u = 2^-24, float32 unit roundoff): the conv output is a K-term sum of products, then silu: the kernel
adds the taps in the reference's order, so it differs by silu's exp only (4 u relative, absolute at the output's
size). The rule: every output is a dk-term dot product of a state row that was itself decayed and corrected by
dk-term dot products, then normalised by a dv-term sum of squares; the orders of those sums differ from NumPy's
(einsum, pairwise), each bounded by n u times the sum of the absolute terms (Higham); with |q|, |k| = 1 (l2-normed)
and the normalised outputs of size ~1, the bound taken is 4 (dk + dv) u per token and 3 tokens: 12 (dk + dv) u of
max |o|, and the same relative bound for the state M (measured: at most 7 u of either).
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

from pymoe.cuda_kernels import deltanet, gated_attention  # noqa: E402

pytestmark = pytest.mark.cuda
U = 2.0 ** -24  # float32 unit roundoff


@in_process
def test_conv_step_matches_the_reference():
    rng = np.random.default_rng(0)
    C, K = 37, 4  # C not a multiple of THREADS: the last block's idle threads
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    w = (rng.standard_normal((C, K)) / 2).astype(np.float32)
    ds, dw, out = cuda.to_device(state), cuda.to_device(w), cuda.device_array(C, np.float32)
    for _ in range(3):  # three tokens: the state moves on
        x = rng.standard_normal(C).astype(np.float32)
        want = deltanet.conv_step_reference(x, state, w)
        deltanet.conv_step(cuda.to_device(x), ds, dw, out)
        np.testing.assert_array_equal(ds.copy_to_host(), state)  # moved, not computed: exact
        np.testing.assert_allclose(out.copy_to_host(), want, rtol=0, atol=4 * U * np.abs(want).max())


@in_process
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped (qwen3next)", "tiled (qwen35moe)"])
def test_rule_step_matches_the_reference(tiled):
    rng = np.random.default_rng(1 + tiled)
    nk, nv, dk, dv = 2, 4, 136, 132  # r = 2 v heads per q/k head
    M = (rng.standard_normal((nv, dk, dv)) / 4).astype(np.float32)  # the state as the kernel keeps it: M^T per head
    dt = rng.standard_normal(nv).astype(np.float32)
    A = -np.exp(rng.standard_normal(nv) / 2).astype(np.float32)
    norm = (1 + rng.standard_normal(dv) / 4).astype(np.float32)
    dev = {name: cuda.to_device(a) for name, a in (("dt", dt), ("A", A), ("norm", norm))}
    dM, o = cuda.to_device(M), cuda.device_array(nv * dv, np.float32)
    for _ in range(3):
        qkvc = rng.standard_normal(2 * nk * dk + nv * dv).astype(np.float32)
        z = rng.standard_normal(nv * dv).astype(np.float32)
        b = rng.standard_normal(nv if tiled else 2 * nv).astype(np.float32)
        a = rng.standard_normal(b.shape).astype(np.float32) if tiled else b
        want = deltanet.rule_step_reference(qkvc, z, b, a, dt, A, norm, M, nk, tiled, 1e-6)
        db = cuda.to_device(b)
        deltanet.rule_step(cuda.to_device(qkvc), cuda.to_device(z), db, cuda.to_device(a) if tiled else db,
                           dev["dt"], dev["A"], dev["norm"], dM, o, nk, tiled, 1e-6)
        bound = 12 * (dk + dv) * U
        np.testing.assert_allclose(o.copy_to_host(), want, rtol=0, atol=bound * np.abs(want).max())
        np.testing.assert_allclose(dM.copy_to_host(), M, rtol=0, atol=bound * np.abs(M).max())
    assert np.abs(want).max() > 0.1  # (a bound relative to nothing would prove nothing)


@in_process
def test_conv_chunk_is_the_conv_step_token_after_token():
    """A prompt chunk's conv (T tokens in one launch) against the reference of T tokens at once (causal_conv), the
    state moved on by T; the output bound as the conv step's."""
    rng = np.random.default_rng(4)
    T, C, K = 5, 37, 4  # T > K - 1: the state comes wholly from the chunk
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    w = (rng.standard_normal((C, K)) / 2).astype(np.float32)
    x = rng.standard_normal((T, C)).astype(np.float32)
    ds, out = cuda.to_device(state), cuda.device_array((T, C), np.float32)
    want = deltanet.conv_chunk_reference(x, state, w)  # [T, C]; state moved on
    deltanet.conv_chunk(cuda.to_device(x), ds, cuda.to_device(w), out)
    np.testing.assert_array_equal(ds.copy_to_host(), state)
    np.testing.assert_array_equal(state, x[T - (K - 1):])
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=0, atol=4 * U * np.abs(want).max())


@in_process
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped (qwen3next)", "tiled (qwen35moe)"])
def test_rule_chunk_matches_both_forms_of_the_rule(tiled):
    """A prompt chunk's rule (T tokens in one launch): against the recurrent reference with the rule step's bound
    per token (4 (dk + dv) u of max |o| per token, T tokens), and against engine/deltanet.py's chunked form (what
    the host runs for long prompts) with test_deltanet.py's FORMS_REL between the two forms."""
    rng = np.random.default_rng(5 + tiled)
    T, nk, nv, dk, dv = 5, 2, 4, 136, 132
    M = (rng.standard_normal((nv, dk, dv)) / 4).astype(np.float32)
    dt = rng.standard_normal(nv).astype(np.float32)
    A = -np.exp(rng.standard_normal(nv) / 2).astype(np.float32)
    norm = (1 + rng.standard_normal(dv) / 4).astype(np.float32)
    qkvc = rng.standard_normal((T, 2 * nk * dk + nv * dv)).astype(np.float32)
    z = rng.standard_normal((T, nv * dv)).astype(np.float32)
    b = rng.standard_normal((T, nv if tiled else 2 * nv)).astype(np.float32)
    a = rng.standard_normal(b.shape).astype(np.float32) if tiled else b
    M_rec, M_chunk = M.copy(), M.copy()
    want = deltanet.rule_chunk_reference(qkvc, z, b, a, dt, A, norm, M_rec, nk, tiled, 1e-6)  # [T, nv dv]
    forms = deltanet.rule_chunk_reference(qkvc, z, b, a, dt, A, norm, M_chunk, nk, tiled, 1e-6, chunked=True)
    dM, o, db = cuda.to_device(M), cuda.device_array((T, nv * dv), np.float32), cuda.to_device(b)
    deltanet.rule_chunk(cuda.to_device(qkvc), cuda.to_device(z), db, cuda.to_device(a) if tiled else db,
                        cuda.to_device(dt), cuda.to_device(A), cuda.to_device(norm), dM, o, nk, tiled, 1e-6)
    got, got_M = o.copy_to_host(), dM.copy_to_host()
    bound = 4 * T * (dk + dv) * U
    np.testing.assert_allclose(got, want, rtol=0, atol=bound * np.abs(want).max())
    np.testing.assert_allclose(got_M, M_rec, rtol=0, atol=bound * np.abs(M_rec).max())
    forms_rel = 1e-4  # tests/test_deltanet.py FORMS_REL
    assert np.abs(got - forms).max() <= forms_rel * np.abs(forms).max()
    assert np.abs(got_M - M_chunk).max() <= forms_rel * np.abs(M_chunk).max()
    assert np.abs(want).max() > 0.1 and not np.allclose(got_M, M)  # (the state moved)

@in_process
def test_rule_step_refuses_wrong_shapes():
    M = cuda.device_array((4, 8, 8), np.float32)
    v = lambda n: cuda.device_array(n, np.float32)  # noqa: E731
    with pytest.raises(ValueError, match="rule_step: shapes do not fit"):
        deltanet.rule_step(v(2 * 2 * 8 + 32), v(32), v(4), v(4), v(4), v(4), v(8), M, v(32), 2, False, 1e-6)


@in_process
def test_split_gate_and_gate_output_match_the_reference():
    rng = np.random.default_rng(3)
    T, H, Dh = 2, 3, 24
    qg = rng.standard_normal((T, 2 * H * Dh)).astype(np.float32)
    q, gate = cuda.device_array((T, H * Dh), np.float32), cuda.device_array((T, H * Dh), np.float32)
    gated_attention.split_gate(cuda.to_device(qg), q, gate, Dh)
    want_q, want_gate = gated_attention.split_gate_reference(qg, Dh)
    np.testing.assert_array_equal(q.copy_to_host(), want_q)
    np.testing.assert_array_equal(gate.copy_to_host(), want_gate)
    assert not np.array_equal(want_q, want_gate)
    out = rng.standard_normal((T, H * Dh)).astype(np.float32)
    d = cuda.to_device(out)
    gated_attention.gate_output(d, gate)
    want = gated_attention.gate_output_reference(out, want_gate)
    np.testing.assert_allclose(d.copy_to_host(), want, rtol=4 * U, atol=0)  # an exp, a division, a product


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
