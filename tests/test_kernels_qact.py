"""The integer path (pymoe.quant.qact + the integer kernels in pymoe.quant.kernels) against the float reference.

What this is: the activation quantizer against its NumPy reference (bit for bit), at 16 and 8 bits; the LLVM-IR
row dots against their portable twins; every integer type's vec_dot via matvec/matmul and the fused MoE kernel
against float math.
Tolerances, derived from where the integer path rounds:
  - against the dequantized activations `dequantize(w) @ (d * q)`: the integer sums are exact, so only float32
    rounding remains (a few products and sums per 256-block): 4 C u sum|w x_q|, u = 2^-24.
  - against the float x, `dequantize(w) @ x`: rounding x moves each x_i by at most d_b / 2 (d_b = max|x| / QMAX
    over its 256-block), so |y_int - y_float| <= sum_b d_b / 2 * sum_{i in b} |w_i|, plus the float term.
  - whole models: tests/test_model_vs_llamacpp.py holds the reference backend (float NumPy) to llama.cpp; here the
    CPU backend (16-bit activations) is held to the reference on the tiny Q2_K-mix models: max |d logit| <= 2e-4 s,
    s = the reference's max |logit|. Measured (2026-11-30, 40 tokens): 6.6e-5 s (qwen2moe) to 9.4e-5 s (llama); the bound
    is 2.1x the worst. 8-bit activations (act_bits=8) move these logits by ~100x more, and so does a mutant that
    rounds to fewer bits (tests/mutants/run_mutants.py).
What this is not: the float kernels' test (tests/test_kernels.py).
"""
import numpy as np
import pytest

import pymoe
import pymoe.quant as Q
from pymoe.quant import QType, kernels, qact
from quant_helpers import random_rows

INT_TYPES = sorted(qact.ACT_DOTS, key=lambda q: q.name)
IDS = [q.name for q in INT_TYPES]
U = 2.0 ** -24


def act_ref(X, qtype, bits):
    """The NumPy reference of x in the layout a weight of this type takes (qact.act_group)."""
    if bits == qact.PLANES:
        return qact.quantize_planes_ref(X, qact.act_group(qtype, bits))
    return qact.quantize_act32_ref(X) if qact.act_group(qtype, bits) == 32 else qact.quantize_act_ref(X, bits)


def act_values(X, qtype, bits):
    """-> (the values the integer path multiplies float32 [T, C], each block's rounding step d float32 [T, nb])."""
    qs, d, _ = act_ref(X, qtype, bits)
    if bits == qact.PLANES:
        return qact.dequantize_planes(qs, d), d[1::2]  # the lo plane's scale: q's step
    return qact.dequantize_act(qs, d), d


def quant_error_bound(w_deq, X, bits, qtype=QType.Q4_K):
    """Max |y_int - y_float| per [T, R] entry from rounding X [T, C]: sum_b d_b / 2 * sum_{i in b} |w_i|. Per-32
    blocks of 8-bit x: q is rounded against the float32 d, the dot multiplies by its fp16 rounding d_b (|d - d_b| <=
    2^-11 d_b (1 + 2^-10)), so each value moves by d_b (1/2 + 127 2^-11) at most, times 1 + 2^-10 (two planes: a
    power-of-two d per 32, exact as per 256)."""
    _, d = act_values(X, qtype, bits)  # [T, nb]
    R, C = w_deq.shape
    abs_w_blocks = np.abs(w_deq).reshape(R, d.shape[1], -1).sum(-1)  # [R, nb]
    exact = d.shape[1] * 256 == C or bits == qact.PLANES
    step = 0.5 * (1 + 2.0 ** -20) if exact else (0.5 + 127 * 2.0 ** -11) * (1 + 2.0 ** -10)
    return step * d @ abs_w_blocks.T  # [T, R]


def float_bound(w_deq, X):
    return 4 * w_deq.shape[1] * U * (np.abs(X) @ np.abs(w_deq).T)  # [T, R]


@pytest.mark.parametrize("bits", [16, 8])
def test_quantize_act_matches_reference(bits):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((4, 768)).astype(np.float32) * np.float32(3)
    X[1, 256:512] = 0  # an all-zero block: d = 0, q = 0
    X[2, 5] = 1e4  # one large value: the rest of its block rounds to 0
    ref, got = qact.quantize_act_ref(X, bits), qact.quantize_rows(X, bits)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # the block maximum at every position of a block, the other values a binade below it: a maximum that skipped
    # any position (the quantizer keeps 16 running maxima, one per lane) would halve d there
    P = np.full((qact.QK_K, qact.QK_K), 0.3, dtype=np.float32)
    P[np.arange(qact.QK_K), np.arange(qact.QK_K)] = -1.0  # row i: its largest |value| at position i
    for a, b in zip(qact.quantize_act_ref(P, bits), qact.quantize_rows(P, bits)):
        assert np.array_equal(a, b)
    qs, d, bsums = got
    assert qs.dtype == qact.ACT_DTYPES[bits] and np.abs(qs.astype(int)).max() <= 2 ** (bits - 1) - 1
    assert np.array_equal(bsums, qs.reshape(4, -1, 16).astype(np.int32).sum(-1))
    err = np.abs(qact.dequantize_act(qs, d) - X).reshape(4, 3, 256)
    # half a step, plus float32 rounding: at 16 bits none (d a power of two: x / d and d q are exact); at 8 bits
    # x * iscale and 1 / iscale are each rounded once, |q| <= 127: at most 2 * 127 * 2^-24 of d more
    slack = 1e-6 if bits == 16 else 2 * 127 * 2.0 ** -24
    assert (err <= d[:, :, None] * (0.5 + slack)).all()


@pytest.mark.parametrize("group", [256, 32])
def test_two_planes_match_reference_and_hold_q(group):
    """x as two int8 planes (qact.quantize_planes_ref): the Numba quantizer's bits; hi and lo within -127..127 (the
    8-bit dots' range); 255 d hi + d lo = d q within d / 2 of x (d a power of two: exact, no float slack); q reaches
    +-32512 at a block's max (the top of the range is used)."""
    rng = np.random.default_rng(1)
    X = rng.standard_normal((4, 768)).astype(np.float32) * np.float32(3)
    X[1, 256:512] = 0  # an all-zero block: d = 2^-100, q = 0
    X[2, 5] = 1e4  # one large value: the rest of its block rounds to 0
    # max|x| just under 32512 d, d = 2^-7 (at exactly 32512 d the power of two above the ratio is 2 d)
    X[3, :group] = np.linspace(-1, 1, group, dtype=np.float32) * np.float32(32512 * 2.0 ** -7 * (1 - 2.0 ** -20))
    ref, got = qact.quantize_planes_ref(X, group), qact.quantize_rows(X, qact.PLANES, group)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    qs, d, bsums = ref
    assert qs.shape == (8, 768) and d.shape == (8, 768 // group) and bsums.shape == (8, 768 // 16)
    assert np.abs(qs.astype(int)).max() <= 127
    assert np.array_equal(d[0::2], d[1::2] * np.float32(qact.PLANE_BASE))  # hi's scale is 255 times lo's
    q = qact.PLANE_BASE * qs[0::2].astype(int) + qs[1::2].astype(int)  # [T, C]
    assert np.abs(q).max() == qact.PLANE_QMAX and q[3, 0] == -qact.PLANE_QMAX
    step = np.repeat(d[1::2], group, axis=1)  # [T, C] each value's d
    assert (np.abs(qact.dequantize_planes(qs, d) - X) <= step / 2).all()
    assert np.array_equal(bsums, qs.reshape(8, -1, 16).astype(np.int32).sum(-1))


def test_8bit_activations_are_llama_cpps_q8_k_blocks():
    """Independent oracle: ggml's own quantize_row_q8_K_ref (what llama.cpp's CPU path runs on x before a K-quant
    dot) gives the same blocks as pymoe's 8-bit activations. ggml divides by the *signed* maximum, so where the
    largest |x| of a block is positive its d and q are pymoe's negated; d * q, |d| and |q| are the same bits."""
    import ctypes

    from ggml_lib import _row_function

    rng = np.random.default_rng(1)
    X = (rng.standard_normal((6, 1024)) * rng.uniform(0.01, 50, (6, 1))).astype(np.float32)
    X[1, 256:512] = 0  # an all-zero block: d = 0
    X[2, 7] = -300.0  # a negative maximum: ggml's d is positive there
    X[3, 9] = 300.0  # a positive maximum: ggml's d negative
    qs, d, bsums = qact.quantize_rows(X, 8)
    Q8_K = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])  # ggml's block_q8_K, 292 bytes
    assert Q8_K.itemsize == 292
    blocks = np.zeros(X.size // 256, dtype=Q8_K)
    _row_function("quantize_row_q8_K_ref")(X.ctypes.data, blocks.ctypes.data, ctypes.c_int64(X.size))
    sign = np.where(blocks["d"] < 0, -1, 1)  # [B]
    assert np.array_equal(np.abs(blocks["d"]), d.reshape(-1))
    assert np.array_equal(blocks["qs"].astype(np.int32) * sign[:, None], qs.reshape(-1, 256).astype(np.int32))
    assert np.array_equal(blocks["bsums"].astype(np.int32) * sign[:, None], bsums.reshape(-1, 16))
    assert (sign < 0).any() and (sign > 0).any()  # both conventions met


def test_8bit_activations_per_32_are_llama_cpps_q8_0_blocks():
    """Independent oracle: ggml's quantize_row_q8_0_ref (what llama.cpp's reference quantizes x with before a dot
    with Q8_0, Q4_0, Q2_0, MXFP4, IQ4_NL weights: their vec_dot_type) gives pymoe's per-32 blocks: the same int8
    values and the same fp16 scale. The cases where its roundf (half away from zero) and rint differ, an fp16
    scale in the subnormals, and an all-zero block are all in X."""
    import ctypes

    from ggml_lib import _row_function

    rng = np.random.default_rng(7)
    X = (rng.standard_normal((5, 512)) * rng.uniform(0.01, 50, (5, 1))).astype(np.float32)
    X[1, 32:64] = 0  # an all-zero block: d = 0, q = 0
    X[2, :32] = np.arange(32, dtype=np.float32) - np.float32(15.5)  # id = 127 / 15.5: ties of roundf at x = ...
    X[2, 32:64] = 0.5 + np.arange(32, dtype=np.float32)  # ... and d = 31.5 / 127: x * id = k + 1/2 for some k
    X[2, 64] = 127.0  # d = 1, id = 1: the block's halves round away from zero, rint would round to even
    X[2, 65:96] = np.float32(2.5) * np.sign(rng.standard_normal(31)).astype(np.float32)
    X[3, :32] *= np.float32(1e-6)  # d = max / 127 below 2^-14: an fp16 subnormal scale
    qs, d, bsums = qact.quantize_rows(X, 8, 32)
    assert d.shape == (5, 16) and qs.dtype == np.int8
    Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", 32)])  # ggml's block_q8_0, 34 bytes
    assert Q8_0.itemsize == 34
    blocks = np.zeros(X.size // 32, dtype=Q8_0)
    _row_function("quantize_row_q8_0_ref")(X.ctypes.data, blocks.ctypes.data, ctypes.c_int64(X.size))
    assert np.array_equal(blocks["d"].astype(np.float32), d.reshape(-1))
    assert np.array_equal(blocks["qs"], qs.reshape(-1, 32))
    assert np.array_equal(bsums, qs.reshape(5, -1, 16).astype(np.int32).sum(-1))
    assert (np.abs(qs[2, 64:96]) == 3).sum() == 31  # 2.5 went to 3 (rint: 2): the ties case was met
    assert (d[3, 0] < 2.0 ** -14) and d[3, 0] > 0 and (d[1, 1] == 0)
    for a, b in zip(qact.quantize_act32_ref(X), (qs, d, bsums)):  # the NumPy reference: the same bits
        assert a.dtype == b.dtype and np.array_equal(a, b)
    # the scale rule by format: per 32 exactly for the formats llama.cpp pairs with Q8_0, at 8 bits
    assert {q for q in qact.ACT_DOTS if qact.act_group(q, 8) == 32} == {QType.Q8_0, QType.Q4_0, QType.Q2_0,
                                                                       QType.MXFP4, QType.IQ4_NL}
    assert all(qact.act_group(q, 16) == 256 for q in qact.ACT_DOTS)


@pytest.mark.parametrize("bits", [16, 8, qact.PLANES])
@pytest.mark.parametrize("qtype", INT_TYPES, ids=IDS)
def test_int_matvec_and_matmul(qtype, bits):
    rng = np.random.default_rng(2)
    for rows in (3, 17):
        for n_blocks in (1, 3):
            cols = 256 * n_blocks
            w = random_rows(qtype, rows, cols, rng)  # [R, row_bytes]
            w_deq = Q.dequantize(w, qtype)  # [R, C]
            for T in (1, 5):
                X = rng.standard_normal((T, cols)).astype(np.float32)  # [T, C]
                Y = kernels.matmul_act(w, qtype, X, bits)  # [T, R]
                assert Y.shape == (T, rows) and Y.dtype == np.float32
                Xq, d = act_values(X, qtype, bits)  # the activations the integer path multiplies
                assert d.shape[1] * qact.act_group(qtype, bits) == cols
                assert (np.abs(Y - Xq @ w_deq.T) <= float_bound(w_deq, Xq) + 1e-30).all()
                bound = quant_error_bound(w_deq, X, bits, qtype) + float_bound(w_deq, X) + float_bound(w_deq, Xq)
                assert (np.abs(Y - X @ w_deq.T) <= bound).all()


def _expert_ffn_ref(ex, qtypes, x):
    """float reference of one expert: down(silu(gate x) * up x), weights dequantized, x float32 [n, D]."""
    g, u, dn = (Q.dequantize(m, q) for m, q in zip(ex, qtypes))
    a, b = x @ g.T, x @ u.T
    with np.errstate(over="ignore"):  # exp(-a) = inf for very negative a: silu -> 0, as it should
        return (a / (1 + np.exp(-a)) * b) @ dn.T


def test_the_fused_kernels_phases_are_shared_by_the_triples_that_agree_on_their_types():
    """compile_moe with the standard constants of a triple (act_kernel's path) binds each phase once per process for
    the types it reads: two triples with the same gate and up share the gate/up phase and x's quantization, not the
    down or decode phase; a phase that read a constant naming no type could not be shared (ValueError)."""
    q4, q6, q2 = QType.Q4_K, QType.Q6_K, QType.Q2_K
    saved = dict(kernels._SHARED_PHASES)  # (dispatchers only: nothing is compiled until called)
    kernels._SHARED_PHASES.clear()
    try:
        a = kernels.compile_moe("test_share_a", kernels.moe_constants((q4, q4, q6)), (q4, q4, q6))
        b = kernels.compile_moe("test_share_b", kernels.moe_constants((q4, q4, q4)), (q4, q4, q4))
        c = kernels.compile_moe("test_share_c", kernels.moe_constants((q2, q2, q6)), (q2, q2, q6))
    finally:
        kernels._SHARED_PHASES.clear()
        kernels._SHARED_PHASES.update(saved)
    phase = lambda k, name: k.py_func.__globals__[name]  # noqa: E731
    assert phase(a, "GATE_UP_PHASE") is phase(b, "GATE_UP_PHASE") is not phase(c, "GATE_UP_PHASE")
    assert phase(a, "DOWN_PHASE") is phase(c, "DOWN_PHASE") is not phase(b, "DOWN_PHASE")
    assert phase(a, "QUANTIZE_X_PHASE") is phase(b, "QUANTIZE_X_PHASE") is phase(c, "QUANTIZE_X_PHASE")
    assert len({id(phase(k, "DECODE_PHASE")) for k in (a, b, c)}) == 3
    # why sharing is right: every constant a shared phase reads is the same in the triples that share it
    ca, cb = kernels.moe_constants((q4, q4, q6)), kernels.moe_constants((q4, q4, q4))
    read = set(kernels._moe_gate_up.__code__.co_names) & set(ca)
    assert read and all(ca[n] is cb[n] or ca[n] == cb[n] for n in read)
    assert any(ca[n] != cb[n] for n in set(kernels._moe_down.__code__.co_names) & set(ca))
    assert [kernels.phase_types(t, ca) for t in kernels._MOE_PHASES.values()] == [(), (0, 1, 2), (0, 1), (2,)]

    def reads_an_untyped_constant(x):
        return MOE_EXTRA + x  # noqa: F821

    with pytest.raises(ValueError, match="MOE_EXTRA"):
        kernels.phase_types(reads_an_untyped_constant, dict(ca, MOE_EXTRA=1))


@pytest.mark.parametrize("bits, qtypes", [(16, (QType.Q2_K, QType.Q2_K, QType.Q3_K)),
                                          (8, (QType.Q2_K, QType.Q2_K, QType.Q3_K)),
                                          (8, (QType.Q2_0, QType.Q2_0, QType.MXFP4)),
                                          (qact.PLANES, (QType.Q2_K, QType.Q2_K, QType.Q3_K)),
                                          (qact.PLANES, (QType.Q2_0, QType.Q2_0, QType.MXFP4))],
                         ids=["16-Q2_K", "8-Q2_K", "8-Q2_0-MXFP4", "15-Q2_K", "15-Q2_0-MXFP4"])
def test_fused_moe_kernel_against_per_expert_reference(bits, qtypes):
    """moe_act (all experts, all tokens, one call) = sum of w * expert(x), with x and h rounded to `bits` (Q2_0 and
    MXFP4 at 8 bits: per 32 values, qact.act_group, the kernel's x and h blocks)."""
    rng = np.random.default_rng(3)
    D, F, E, K, T = 256, 512, 6, 2, 5
    experts = [tuple(random_rows(q, r, c, rng) for q, r, c in zip(qtypes, (F, F, D), (D, D, F)))
               for _ in range(E)]
    x = rng.standard_normal((T, D)).astype(np.float32) * np.float32(0.5)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)])  # [T, K]
    w = rng.random((T, K)).astype(np.float32)  # [T, K]
    used = sorted(set(ids.ravel().tolist()))
    pairs = []
    for e in used:
        tok, slot = np.nonzero(ids == e)
        pairs.append((tok, w[tok, slot]))
    y = kernels.moe_act([experts[e] for e in used], qtypes, x, pairs, bits)  # [T, D]
    ref = np.zeros((T, D), dtype=np.float64)
    scale = np.zeros((T, D), dtype=np.float64)
    for e in used:
        tok, slot = np.nonzero(ids == e)
        ref[tok] += w[tok, slot][:, None] * _expert_ffn_ref(experts[e], qtypes, x[tok])
        scale[tok] += np.abs(w[tok, slot][:, None] * _expert_ffn_ref(experts[e], qtypes, x[tok]))
    # Two roundings (x, then h) on random weights, relative to the output's max: measured (2026-11-30, this seed)
    # 1.5e-2 at 8 bits and 2.1e-4 at 16 bits; bounds 2.5x those (the 2^8 ratio of the step sizes does not carry over
    # whole: h's rounding is relative to each block's max, and the sums average part of it out). Measured again
    # 2026-12-06 with llama.cpp's 8-bit scales: 2.6e-2 (Q2_K, per 256 values), 9.4e-3 (Q2_0 + MXFP4, per 32: each
    # block rounds against a nearer max). Two planes (15 bits, 2026-12-06): 2.1e-4 (Q2_K) and 7.0e-5 (Q2_0 + MXFP4),
    # held to the 16-bit bound (their q is 16 bits' wherever max|x| / 32512 and max|x| / 32767 share a power of two).
    rel = np.abs(y - ref).max() / np.abs(ref).max()
    assert rel < (0.04 if bits == 8 else 5e-4), rel
    # One token alone (decode) gets exactly its row of the batched result (prefill).
    t = 1
    sub = [(e, np.nonzero(ids[t] == e)[0]) for e in used if (ids[t] == e).any()]
    y1 = kernels.moe_act([experts[e] for e, _ in sub], qtypes, x[t:t + 1],
                         [(np.zeros(1, np.int64), w[t, k]) for _, k in sub], bits)
    assert np.array_equal(y1[0], y[t])


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama", "olmoe"])
def test_cpu_and_reference_backends_agree_on_q2_k_models(tiny_model, arch):
    path = tiny_model(arch, "q2_k")
    fast = pymoe.load(path)  # the file's default width (backends/cpu.py `default_width`)
    from pymoe.backends.cpu import default_width

    assert fast.backend.name == "cpu" and fast.backend.act_bits == int(default_width(fast.file))
    ids = np.random.default_rng(0).integers(0, fast.config.n_vocab, 40)
    ours = fast.logits(ids)
    from pymoe.api import Engine

    ref = Engine(path, backend="reference").logits(ids)  # [40, V]
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 2e-4 * scale, np.abs(ours - ref).max() / scale
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


ROW_DOT_TYPES = sorted(qact.ROW_DOTS, key=lambda q: q.name)


@pytest.mark.parametrize("qtype", ROW_DOT_TYPES, ids=[q.name for q in ROW_DOT_TYPES])
def test_portable_row_dots_equal_the_x86_ones(qtype):
    """The path of CPUs without AVX2 / AVX-512 (the codebook by 16 compares and selects, a grid row's signs by a
    select, pairs summed without the pmaddwd intrinsic), compiled here on purpose: the same integers, the same float
    operations in the same order, so bit for bit the row dots this machine runs, one row and many rows."""
    from numba import njit

    one, rows = {**qact._k_row_dots(portable=True), **qact._row_dots_for(portable=True),
                 **qact._iq_grid_dots(portable=True)}[qtype][:2]

    @njit
    def portable(w, xq, xd, xbs, acc, out, single):
        rows(w, xq, xd, xbs, acc, out)
        for t in range(xq.shape[0]):
            single[t] = one(w, xq[t], xd[t], xbs[t])

    rng = np.random.default_rng(5)
    w = random_rows(qtype, 4, 512, rng)  # [4, row_bytes]
    X = rng.standard_normal((3, 512)).astype(np.float32)
    for bits in (16, 8):
        xq, xd, xbs = qact.quantize_for(X, qtype, bits)
        acc = np.empty((3, 16), np.float32)
        for r in range(4):
            out, single, here = np.empty(3, np.float32), np.empty(3, np.float32), np.empty(3, np.float32)
            portable(w[r], xq, xd, xbs, acc, out, single)
            qact.ACT_DOTS_ROWS[qtype](w[r], xq, xd, xbs, acc, here)
            assert np.array_equal(out, here) and np.array_equal(single, here)
            assert np.array_equal(here, [qact.ACT_DOTS[qtype](w[r], xq[t], xd[t], xbs[t]) for t in range(3)])


def test_mxfp4_int_dot_at_the_extreme_scales():
    """E8M0 bytes 0 and 1 are float32 subnormal scales (2^-128, 2^-127: ggml's bit patterns 0x00200000 << e), 2 the
    first normal one, 240 a large one (2^112: a row of 256 products stays finite); each block's scale through the integer dot =
    the dequantized weights times the rounded activations."""
    rng = np.random.default_rng(6)
    w = random_rows(QType.MXFP4, 4, 256, rng)  # [4, 8 blocks of 17 bytes]
    blocks = w.reshape(4, 8, 17)
    for e in (0, 1, 2, 3, 127, 128, 200, 240):
        blocks[:, :, 0] = e
        X = rng.standard_normal((1, 256)).astype(np.float32)
        xq, xd, xbs = qact.quantize_rows(X, 16)
        ref = Q.dequantize(w, QType.MXFP4).astype(np.float64) @ qact.dequantize_act(xq, xd)[0].astype(np.float64)
        got = np.array([qact.ACT_DOTS[QType.MXFP4](w[r], xq[0], xd[0], xbs[0]) for r in range(4)], dtype=np.float64)
        # float32 products and sums of 8 group terms: a few units of the last place of the terms' magnitudes
        scale = np.abs(Q.dequantize(w, QType.MXFP4)).astype(np.float64) @ np.abs(qact.dequantize_act(xq, xd)[0])
        assert (np.abs(got - ref) <= 16 * U * scale + 64 * 2.0 ** -149).all(), e  # + subnormal steps
