"""Sampling: greedy, filters, temperature, repetition penalty, seeds; stop strings in the text stream."""
import math

import numpy as np
import pytest

from pymoe.errors import PymoeError
from pymoe.engine.sampler import Sampler, SamplingParams, apply_repetition_penalty, filter_candidates

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], dtype=np.float32))


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0))(LOGITS) == 0


def test_top_k_top_p_min_p():
    ids, _ = filter_candidates(LOGITS, top_k=2, top_p=1.0, min_p=0.0)
    assert ids.tolist() == [0, 1]
    ids, _ = filter_candidates(LOGITS, top_k=0, top_p=0.8, min_p=0.0)  # 0.5 + 0.25 < 0.8 <= 0.9
    assert ids.tolist() == [0, 1, 2]
    ids, _ = filter_candidates(LOGITS, top_k=0, top_p=1.0, min_p=0.2)  # keep p >= 0.1
    assert ids.tolist() == [0, 1, 2]


def chi_square_p_value(counts, probs) -> float:
    """Pearson's chi-square test of observed counts against probabilities -> p-value. The survival function of the
    chi-square distribution in closed form for an even number of degrees of freedom k = 2m:
    P(X > x) = exp(-x/2) * sum_{i<m} (x/2)^i / i!  (no SciPy needed)."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    expected = counts.sum() * probs
    x = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    assert dof % 2 == 0, "closed form for even degrees of freedom only"
    return float(np.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(dof // 2)))


# A correct sampler fails a test at this level with probability 1e-6 (over the choice of seed): the false-failure rate.
FALSE_FAILURE = 1e-6


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    a = [Sampler(params)(LOGITS) for _ in range(3)]
    s1, s2 = Sampler(params), Sampler(params)
    assert [s1(LOGITS) for _ in range(50)] == [s2(LOGITS) for _ in range(50)]
    assert len(set(a)) == 1  # same seed, same first draw


def test_seed_minus_one_is_random():
    # llama.cpp's "random" (`pymoe run --seed -1`; the server maps it to no seed before it gets here): a fresh
    # generator, not numpy's default_rng(-1), which raises
    z = np.zeros(50, dtype=np.float32)
    draws = [Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=-1))(z) for _ in range(40)]
    assert all(0 <= t < 50 for t in draws) and len(set(draws)) > 1
    with pytest.raises(PymoeError, match="seed"):
        Sampler(SamplingParams(seed=-2))


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_sampling_follows_the_probabilities(seed):
    """4000 draws at temperature 1 against p = softmax(LOGITS) by a chi-square test (4 degrees of freedom) at a
    1e-6 false-failure rate, plus a one-sided binomial bound on the least likely token (p = 0.03, expected 120 draws):
    a sampler that never (or half as often) emits it fails both. Measured p-values: seeds 7/8/9 -> 0.72/0.058/0.71."""
    n, probs = 4000, np.array([0.5, 0.25, 0.15, 0.07, 0.03])
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
    counts = np.bincount([s(LOGITS) for _ in range(n)], minlength=5)
    assert chi_square_p_value(counts, probs) > FALSE_FAILURE, counts
    # Binomial(4000, 0.03): mean 120, sd 10.8; P(count < mean - 5.0 sd) < 1e-6 (normal tail; Chernoff gives 2e-6).
    assert counts[4] >= 120 - 5.0 * np.sqrt(n * 0.03 * 0.97), counts


def test_filters_renormalise_what_they_keep():
    """top_k = 2 keeps tokens 0 and 1 and samples them 2:1 (0.5 : 0.25), at the same false-failure rate."""
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=3))
    draws = np.array([s(LOGITS) for _ in range(3000)])
    assert set(draws.tolist()) == {0, 1}
    counts = np.bincount(draws, minlength=2)
    # one degree of freedom is odd: test token 0's count as a binomial (p = 2/3, sd = sqrt(3000 * 2/9) = 25.8)
    assert abs(counts[0] - 2000) <= 5.0 * np.sqrt(3000 * 2 / 9), counts


def test_low_temperature_concentrates():
    s = Sampler(SamplingParams(temperature=0.05, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    assert all(s(LOGITS) == 0 for _ in range(100))


def test_repetition_penalty():
    logits = np.array([2.0, -1.0, 1.0], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1], 2.0)
    np.testing.assert_allclose(out, [1.0, -2.0, 1.0])
    assert Sampler(SamplingParams(repeat_penalty=4.0))(logits, history=[0]) == 2


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(min_p=2), dict(top_k=-1),
                                 dict(repeat_penalty=0)])
def test_bad_params(bad):
    with pytest.raises(PymoeError):
        Sampler(SamplingParams(**bad))


def test_stop_string_cuts_the_stream(tiny_model):
    import pymoe

    m = pymoe.load(tiny_model("qwen3moe", "f32"))
    full = "".join(m.stream([5, 6, 7], max_tokens=30))
    assert len(full) >= 4, f"the seeded tiny model now ends after {full!r}: pick another prompt"
    stop = full[2:4]
    cut = "".join(m.stream([5, 6, 7], max_tokens=30, stop=[stop]))
    assert cut == full[: full.find(stop)]
    assert m.last_stats.stop_reason == "stop"


def test_logit_bias_and_presence_frequency_penalties_by_hand():
    """z = [1, 2, 3, 0]; bias +5 on token 3 -> [1, 2, 3, 5]; history [2, 2, 1] (token 2 twice, 1 once); presence 0.5,
    frequency 1.0: z[2] = 3 - 0.5 - 2 = 0.5, z[1] = 2 - 0.5 - 1 = 0.5 -> [1, 0.5, 0.5, 5]: greedy picks 3; without the
    bias, 0 (1.0 > 0.5)."""
    z = np.array([1.0, 2.0, 3.0, 0.0], np.float32)
    p = dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=1.0)
    s = Sampler(SamplingParams(**p, logit_bias=((3, 5.0),)))
    np.testing.assert_allclose(s._penalised(z, [2, 2, 1]), [1.0, 0.5, 0.5, 5.0])
    assert s(z, [2, 2, 1]) == 3
    assert Sampler(SamplingParams(**p))(z, [2, 2, 1]) == 0
    assert Sampler(SamplingParams(temperature=0.0))(z, [2, 2, 1]) == 2  # no penalties: the argmax
