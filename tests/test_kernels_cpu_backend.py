"""The CPU backend's compiled helpers (pymoe/backends/cpu.py) and the whole-row integer dots, each against its twin.

What this is: the fast pieces that replaced NumPy code in the forward pass, each checked against the code it
replaced or a float reference:
  - the row_dot forms (every K type with one): the multi-row dot gives, per row, exactly the bits of the one-row
    dot (decode = prefill), and the kernels give the same bits for 1 or T tokens;
  - rmsnorm / rope hooks: bit for bit reference.rmsnorm / reference.apply_rope (NumPy);
  - exp_f32 against np.exp (float64): within 2 ulp;
  - attention_rows against reference.attention (einsum, float32 rounding bound), and T-independent bits;
  - f32_matmul against x @ w.T, T-independent bits; the compiled router against reference.route;
  - group_by_expert against np.nonzero per expert; moe_act_grouped with non-contiguous experts (the copy path).
What this is not: the integer path's accuracy against float math (tests/test_kernels_qact.py).
"""
import numpy as np
import pytest
from numba import njit

import pymoe.quant as Q
from pymoe.backends.cpu import CPUBackend, attention_rows, f32_matmul, group_by_expert
from pymoe.quant.kernels import exp_f32
from pymoe.backends.reference import apply_rope, attention, rmsnorm
from pymoe.quant import QType, kernels, qact
from quant_helpers import random_rows

ROWS_TYPES = sorted(qact.ACT_DOTS_ROWS, key=lambda q: q.name)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", ROWS_TYPES, ids=[q.name for q in ROWS_TYPES])
def test_multi_row_dot_has_the_bits_of_the_one_row_dot(qtype, bits):
    rng = np.random.default_rng(5)
    w = random_rows(qtype, 9, 768, rng)  # [R, row_bytes]
    X = rng.standard_normal((6, 768)).astype(np.float32) * np.float32(4)
    xq, xd, xbs = qact.quantize_for(X, qtype, bits)
    out = np.empty(6, np.float32)
    for r in range(w.shape[0]):
        qact.ACT_DOTS_ROWS[qtype](w[r], xq, xd, xbs, np.empty((6, 16), np.float32), out)
        one = [qact.ACT_DOTS[qtype](w[r], xq[t], xd[t], xbs[t]) for t in range(6)]
        assert np.array_equal(out, np.array(one, dtype=np.float32))
    Y = kernels.matmul_act(w, qtype, X, bits)  # [T, R]: the mat-mat kernel
    assert np.array_equal(Y, np.concatenate([kernels.matmul_act(w, qtype, X[t:t + 1], bits) for t in range(6)]))


def test_rmsnorm_and_rope_hooks_are_bit_identical_to_numpy():
    b = CPUBackend()
    rng = np.random.default_rng(6)
    for shape in ((1, 1024), (7, 1024), (3, 16, 64), (2, 5, 100), (4, 129), (1, 7), (2, 3000),
                  (100, 1024), (4, 41, 64)):  # the last two: >= RMSNORM_PARALLEL_ROWS rows, shared among threads
        x = (rng.standard_normal(shape) * rng.uniform(0.01, 50)).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        assert np.array_equal(b.rmsnorm(x, w, 1e-6), rmsnorm(x, w, 1e-6))
    x = rng.standard_normal((5, 4, 64)).astype(np.float32)
    theta = rng.uniform(0, 100, (5, 16))
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)  # rope_dim 32 of 64: a part
    for neox in (True, False):
        assert np.array_equal(b.rope(x, cos, sin, neox), apply_rope(x, cos, sin, neox))


def test_exp_f32_within_two_ulp():
    @njit
    def run(x, y):
        for i in range(x.shape[0]):
            y[i] = exp_f32(x[i])

    x = np.concatenate([np.linspace(-87, 88, 400001), [0.0, -1e-8, 1e-8, -86.99, 87.99]]).astype(np.float32)
    y = np.empty_like(x)
    run(x, y)
    ref = np.exp(x.astype(np.float64))
    assert (np.abs(y - ref) <= 2 * 2.0 ** -24 * ref).all()
    y2 = np.empty(3, np.float32)
    run(np.array([-1000, -np.inf, 0], np.float32), y2)  # clamped: tiny, not 0 (only ever scaled by a sum >= 1)
    assert 0 < y2[0] < 1e-37 and 0 < y2[1] < 1e-37 and y2[2] == 1


def test_attention_rows_against_einsum_and_independent_of_T():
    rng = np.random.default_rng(7)
    T, H, G, Dh, p0 = 37, 8, 2, 64, 20
    S = p0 + T
    q = rng.standard_normal((T, H, Dh)).astype(np.float32)
    k = rng.standard_normal((S, G, Dh)).astype(np.float32)
    v = rng.standard_normal((S, G, Dh)).astype(np.float32)
    b = CPUBackend()
    out = b.attention(q, k, v, p0)  # [T, H * Dh]
    ref = attention(q, k, v, p0)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(v).max()  # float32 sums of <= 57 terms, exp within 2 ulp
    for t in (0, 5, T - 1):  # query t alone (decode) = its row of the T-query call (prefill)
        one = b.attention(q[t:t + 1], k[:p0 + t + 1], v[:p0 + t + 1], p0 + t)
        assert np.array_equal(one[0], out[t])
    direct = np.empty_like(out)  # the kernel itself, its key scratch as few tiles of 64 keys as hold S
    nb = (S + 63) // 64
    for threads in (1, 2, 16):  # heads per task: all of a KV head's (4 here), or fewer where tasks would be few
        attention_rows(q, k, np.empty((G, nb, Dh, 64), np.float32), v, p0, 0, np.zeros(0, np.float32), direct,
                       threads, False)
        assert np.array_equal(direct, out)
    with pytest.raises(ValueError, match="nb \\* 64 >= S"):  # a scratch too short for the keys
        attention_rows(q, k, np.empty((G, (S - 1) // 64, Dh, 64), np.float32), v, p0, 0, np.zeros(0, np.float32),
                       direct, 2, False)
    v24 = v[..., :24].copy()  # a value head size that is not a multiple of 16: the plain output loop
    out24 = b.attention(q, k, v24, p0)
    assert np.abs(out24 - attention(q, k, v24, p0)).max() <= 1e-5 * np.abs(v24).max()  # the bound above
    assert np.array_equal(b.attention(q[5:6], k[:p0 + 6], v24[:p0 + 6], p0 + 5)[0], out24[5])


def test_attention_reads_the_f32_caches_key_tiles_in_place():
    """The f32 KV cache stores keys in tiles of 64 positions (engine/kv.py KeyTiles): what it reads back is what was
    written, the CPU backend's kv_read hands the tiles over as they are (KeyBlocks) and its attention on them has
    the bits of the same keys as a plain [S, G, Dh] array, in a prefill and then in decode steps that cross tile
    edges; a copied prefix, an f16 cache and an MLA one (no V plane: K stays position-first) behave as before."""
    from types import SimpleNamespace
    from pymoe.backends.attention_simd import KeyBlocks
    from pymoe.engine.kv import Float16KVCache, KeyTiles, KVCache

    rng = np.random.default_rng(11)
    H, G, Dh, n_ctx = 8, 2, 64, 150
    cfg = SimpleNamespace(kv_layers=lambda: (0, 1), n_head_kv=G, head_dim=Dh, kv_v_width=Dh, head_dim_v=Dh)
    kv = KVCache(cfg, n_ctx)
    assert isinstance(kv.k, KeyTiles)
    k = rng.standard_normal((n_ctx, G, Dh)).astype(np.float32)
    v = rng.standard_normal((n_ctx, G, Dh)).astype(np.float32)
    q = rng.standard_normal((n_ctx, H, Dh)).astype(np.float32)
    b = CPUBackend()
    T = 70  # a prefill of T tokens (across a tile's edge), then decode steps one at a time
    kv.write(1, 0, k[:T], v[:T])
    kr, vr = b.kv_read(kv, 1, T)
    assert isinstance(kr, KeyBlocks) and kr.shape == (T, G, Dh) and np.array_equal(np.asarray(kr), k[:T])
    assert np.array_equal(kv.read(1, T)[0], k[:T]) and np.array_equal(vr, v[:T])
    assert np.array_equal(b.attention(q[:T], kr, vr, 0), b.attention(q[:T], k[:T], v[:T], 0))
    for p in range(T, n_ctx):
        kv.write(1, p, k[p:p + 1], v[p:p + 1])
        kr, vr = b.kv_read(kv, 1, p + 1)
        assert np.array_equal(b.attention(q[p:p + 1], kr, vr, p), b.attention(q[p:p + 1], k[:p + 1], v[:p + 1], p))
    assert np.array_equal(kv.read(1, n_ctx)[0], k) and not kv.read(0, n_ctx)[0].any()  # layer 0 untouched
    kv.write(1, 60, k[:10], v[:10])  # a rewrite across a tile's edge (speculation rolls back so)
    assert np.array_equal(kv.read(1, 80)[0][60:70], k[:10]) and np.array_equal(kv.read(1, 80)[0][70:], k[70:80])
    kv.n = n_ctx
    other = KVCache(cfg, n_ctx)
    other.copy_from(kv, 100)
    assert np.array_equal(other.read(1, 100)[0], kv.read(1, 100)[0])
    f16 = Float16KVCache(cfg, n_ctx)  # position-first: its keys go through attention_rows' scratch tiles
    f16.write(1, 0, k, v)
    k16, v16 = b.kv_read(f16, 1, n_ctx)
    assert isinstance(k16, np.ndarray)
    assert np.array_equal(b.attention(q[-1:], k16, v16, n_ctx - 1),
                          b.attention(q[-1:], k16.astype(np.float32), v16.astype(np.float32), n_ctx - 1))
    mla = KVCache(SimpleNamespace(kv_layers=lambda: (0,), n_head_kv=1, head_dim=Dh, kv_v_width=0, head_dim_v=48),
                  n_ctx)  # MLA: V is the first 48 values of each K row
    assert type(mla.k) is np.ndarray


def test_f32_matmul_against_numpy_and_independent_of_T():
    rng = np.random.default_rng(8)
    w = rng.standard_normal((64, 1024)).astype(np.float32)
    x = rng.standard_normal((9, 1024)).astype(np.float32)
    y = np.empty((9, 64), np.float32)
    f32_matmul(w, x, y)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert (np.abs(y - ref) <= 1024 * 2.0 ** -24 * (np.abs(x) @ np.abs(w).T)).all()
    y1 = np.empty((1, 64), np.float32)
    f32_matmul(w, x[4:5], y1)
    assert np.array_equal(y1[0], y[4])
    b = CPUBackend()
    assert np.array_equal(b.linear_raw(w, QType.F32, x), y)


def test_group_by_expert_matches_nonzero_per_expert():
    rng = np.random.default_rng(9)
    for T, E, K in ((1, 64, 8), (5, 6, 2), (300, 64, 8), (3, 4, 4)):
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)  # [T, K]
        w = rng.random((T, K)).astype(np.float32)
        used, start, tok, weight = group_by_expert(ids, w)
        assert used.tolist() == sorted(set(ids.ravel().tolist()))
        assert start[0] == 0 and start[-1] == T * K
        for i, e in enumerate(used):
            t, slot = np.nonzero(ids == e)
            assert np.array_equal(tok[start[i]:start[i + 1]], t)
            assert np.array_equal(weight[start[i]:start[i + 1]], w[t, slot])


def test_moe_kernel_takes_non_contiguous_experts():
    """Experts as strided views (not C-contiguous) are copied, not read at a wrong address: same result."""
    rng = np.random.default_rng(10)
    D, F = 256, 256
    qtypes = (QType.Q2_K, QType.Q2_K, QType.Q3_K)
    ex = tuple(random_rows(q, r, c, rng) for q, r, c in zip(qtypes, (F, F, D), (D, D, F)))
    strided = tuple(np.repeat(m, 2, axis=0)[::2] for m in ex)  # the same bytes, every other row of a copy
    assert not strided[0].flags.c_contiguous
    x = rng.standard_normal((3, D)).astype(np.float32)
    pairs = [(np.arange(3), np.ones(3, np.float32))]
    assert np.array_equal(kernels.moe_act([strided], qtypes, x, pairs), kernels.moe_act([ex], qtypes, x, pairs))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.moe_act([(ex[0][:5], ex[1], ex[2])], qtypes, x, pairs)
    assert Q.get_format(QType.Q2_K).row_bytes(D) == ex[0].shape[1]


def test_route_hook_matches_moe_route():
    """The compiled router (CPUBackend.route, for moe.py): the same experts in the same order, ties to the lower
    id, weights within float32 rounding (exp from libm, not NumPy's SIMD exp)."""
    from pymoe.backends.reference import route

    b = CPUBackend()
    rng = np.random.default_rng(11)
    for T in (1, 7, 64):
        logits = (rng.standard_normal((T, 64)) * 3).astype(np.float32)
        logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie at the top
        for norm in (True, False):
            ids, w = route(logits, 8, norm)
            ids2, w2 = b.route(logits, 8, norm)
            assert np.array_equal(ids, ids2) and ids2[0, 0] == 5 and ids2[0, 1] == 9
            assert np.allclose(w, w2, rtol=4 * 2.0 ** -24 * 64, atol=0)
