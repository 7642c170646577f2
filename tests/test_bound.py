"""pymoe/experts/bound.py: the misses no online cache policy can expect to go below on a generated trace.

Three things can be wrong with such a bound: the probabilities it is built on (a sampler that does not draw as the
generator draws), the arithmetic from probabilities to misses, and the argument itself. The tests take them in that
order: calibration against the generator's own draws, an exact case by hand, and every registered policy replayed
on traces where the bound must hold.
"""
import numpy as np
import pytest

from pymoe.experts import bound
from pymoe.experts.policies import ENGINE_POLICIES
from pymoe.experts.profile import Profile
from pymoe.experts.simulate import sweep
from pymoe.experts.trace import fitted_trace, synthetic_heat, synthetic_trace


def _calibration_errors(trace, p, rows, min_keys=300):
    """Per bin of predicted probability (with >= min_keys (token, layer, expert) cells), apart for the cells whose
    expert was among its layer's picks at the token before and the others: (observed share of cells whose expert
    was picked - mean predicted p) / its binomial sd. A sampler that draws as the generator does gives values of a
    standard normal's size. (Apart, because the generators' locality keeps each expert's overall share: a sampler
    that ignored the past would still match the share of all cells in a bin, not of those just used.)"""
    T, L, E = p.shape
    picked = np.zeros((T, L, E), dtype=bool)
    recent = np.zeros((T, L, E), dtype=bool)
    for i, t in enumerate(rows):
        for layer in range(L):
            picked[i, layer, trace.experts[t, layer].astype(np.int64)] = True
            recent[i, layer, trace.experts[t - 1, layer].astype(np.int64)] = True
    edges = np.array([0.0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 1.01])
    z = []
    for group in (recent, ~recent):
        for lo, hi in zip(edges[:-1], edges[1:]):
            cell = group & (p >= lo) & (p < hi)
            n = int(cell.sum())
            if n < min_keys:
                continue
            mean = float(p[cell].mean())
            sd = np.sqrt(max(mean * (1 - mean), 1e-4) / n)
            z.append((float(picked[cell].mean()) - mean) / sd)
    return np.array(z)


def test_the_pick_probabilities_match_the_generators_draws():
    """Binned by predicted probability, the share of picked cells equals the mean prediction (|z| <= 4.5: the bins'
    binomial sd, with room for the estimates' own noise at 3000 draws and the bins' dependence); and the same check
    catches a sampler told the wrong locality (tests/mutants: one that never copies the past, too)."""
    syn = synthetic_trace(240, 4, 64, 4, seed=3, zipf=1.1, locality=0.5, prompt_len=8)
    rows, p = bound.pick_probabilities(syn, samples=3000)
    z = _calibration_errors(syn, p, rows)
    assert len(z) >= 5 and np.abs(z).max() <= 4.5, z

    heat = np.random.default_rng(0).integers(0, 1000, size=(6, 48)) ** 2  # [L_all, E] skewed counts
    fit = fitted_trace(heat, n_requests=3, prompt_len=6, decode_len=60, locality=0.6, window=4, seed=5, k=4,
                       layers=[1, 3, 5])
    rows, p = bound.pick_probabilities(fit, heat=heat, samples=3000)
    z = _calibration_errors(fit, p, rows)
    assert len(z) >= 5 and np.abs(z).max() <= 4.5, z

    wrong = synthetic_trace(240, 4, 64, 4, seed=3, zipf=1.1, locality=0.5, prompt_len=8)
    wrong.meta["locality"] = 0.2  # the sampler now repeats the last token's picks less often than the trace did
    rows, p = bound.pick_probabilities(wrong, samples=3000)
    assert np.abs(_calibration_errors(wrong, p, rows)).max() > 10


def test_an_iid_one_pick_trace_has_the_bound_by_hand():
    """k = 1, no locality: each token's one pick per layer is drawn from the popularity alone, so P(e) is the
    popularity and the bound is, per decode token, L - (the C largest popularities over all (layer, expert)).
    Tolerance: 5 sd of the estimate (each token-layer's top-set sum is a mean of 20000 Bernoulli draws, variance
    <= 0.25 / 20000), the ranks' popularities being far enough apart that the set itself is not in doubt."""
    L, E, C, S = 3, 12, 10, 20000
    tr = synthetic_trace(60, L, E, 1, seed=4, zipf=1.1, locality=0.0, prompt_len=4)
    rows, p = bound.pick_probabilities(tr, samples=S)
    heat = synthetic_heat(L, E, seed=4, zipf=1.1).astype(np.float64)
    pop = heat / heat.sum(axis=1, keepdims=True)  # [L, E]
    per_token = L - np.sort(pop.reshape(-1))[::-1][:C].sum()
    b = bound.online_bound(p, C, 1)
    assert b.lookups == rows.size * L
    assert b.misses == pytest.approx(rows.size * per_token, abs=5 * np.sqrt(rows.size * L * 0.25 / S))
    with pytest.raises(ValueError, match="neither zipf nor window"):
        bound.pick_probabilities(type(tr)(tr.experts, tr.weights, tr.phase, tr.request, tr.forward,
                                          {"n_layers": L, "n_experts": E, "k": 1}))


@pytest.mark.parametrize("seed", [0, 1])
def test_no_online_policy_goes_below_the_bound_and_belady_does(seed):
    """Every registered policy, pre-filled from the generator's popularity (synthetic_heat), misses at least the
    bound less 3 sd (the scale of a policy's chance shortfall, bound.Bound.sd), at three pool sizes; Belady, who
    knows the future, misses fewer than the bound."""
    L, E, K = 4, 64, 4
    tr = synthetic_trace(300, L, E, K, seed=seed, zipf=1.1, locality=0.5, prompt_len=8)
    rows, p = bound.pick_probabilities(tr, samples=2000)
    prof = Profile.from_heat(synthetic_heat(L, E, seed=seed, zipf=1.1))
    slots = [32, 64, 128]
    res = sweep(tr, list(ENGINE_POLICIES) + ["belady"], slots, ["global"], profile=prof, phase="decode")
    for n in slots:
        b = bound.online_bound(p, n, K)
        misses = {r.policy: r.lookups - r.hits for r in res if r.slots == n}
        assert misses["belady"] < b.misses - 3 * b.sd, (n, misses["belady"], b)
        for name in ENGINE_POLICIES:
            assert misses[name] >= b.misses - 3 * b.sd, (n, name, misses[name], b)
