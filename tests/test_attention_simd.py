"""The register-blocked loops of CPU attention (pymoe/backends/attention_simd.py) against their NumPy twins.

What this is: `scores_into` and `weighted_into`, compiled, bit for bit against `scores_ref` / `weighted_ref` (the same
float32 multiplies and adds in the same order, one head at a time): every head count the kernel splits differently
(groups of 4 heads, then single heads; groups of up to 4 by the value row's width), key counts on and off the
16-key vectors and the 8-vector blocks, every supported value-row width class, strided value rows (a KV head's rows
of [S, G, Dv]). The whole attention (backends/cpu.py `attention_rows`, which calls them) is held to einsum and to
T-independence in tests/test_kernels_cpu_backend.py and to llama.cpp's logits in tests/test_model_vs_llamacpp.py.
What this is not: a speed test (docs/performance.md, "Attention").
"""
import numpy as np
import pytest
from numba import njit

from pymoe.backends.attention_simd import MAX_DV, scores_into, scores_ref, weighted_into, weighted_ref


@njit
def _scores(q, kt, n, out):
    scores_into(q, kt, n, out)


@njit
def _weighted(p, total, v, n, out):
    weighted_into(p, total, v, n, out)


@pytest.mark.parametrize("nh", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 128, 129, 300])
def test_scores_have_the_bits_of_the_numpy_twin(nh, n):
    rng = np.random.default_rng(nh * 1000 + n)
    Dh = 80  # not a power of two: the d loop is a run-time count
    nb = (n + 63) // 64  # tiles of 64 keys: no more than n needs (a 4-head run's 64 keys are one tile's)
    q = rng.standard_normal((nh, Dh)).astype(np.float32)
    kt = rng.standard_normal((nb, Dh, 64)).astype(np.float32)
    out = np.full((nh, (n + 15) // 16 * 16), np.nan, np.float32)
    _scores(q, kt, n, out)
    assert np.array_equal(out[:, :n], scores_ref(q, kt, n))
    # q rows with a stride (a task's heads q[t, h0:h1] of [T, H, Dh] are contiguous; a strided view must work too)
    wide = np.zeros((nh, 2 * Dh), np.float32)
    wide[:, ::2] = q
    out2 = np.empty_like(out)
    _scores(wide[:, ::2], kt, n, out2)
    assert np.array_equal(out2[:, :n], out[:, :n])


@pytest.mark.parametrize("nh", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("Dv", [16, 64, 80, 128, MAX_DV])
@pytest.mark.parametrize("n", [1, 17, 200])
def test_weighted_rows_have_the_bits_of_the_numpy_twin(nh, Dv, n):
    rng = np.random.default_rng(nh * 100 + Dv + n)
    G = 3
    v = rng.standard_normal((n + 5, G, Dv)).astype(np.float32)  # [S, G, Dv]: head 1's rows are strided
    p = rng.random((nh, n + 7)).astype(np.float32)
    total = (p[:, :n].sum(axis=1) + rng.random(nh)).astype(np.float32)
    out = np.full((nh, Dv), np.nan, np.float32)
    _weighted(p, total, v[:, 1], n, out)
    assert np.array_equal(out, weighted_ref(p, total, v[:, 1], n))
