"""Sampling: greedy, filters, temperature, repetition penalty, seeds; stop strings in the text stream; llama.cpp's
typical-p, top-n-sigma, XTC, mirostat v1/v2, DRY and min_tokens on small distributions worked out by hand (the
same cases as llama.cpp's test-sampling.cpp (in its tests folder) where it has them, whose expected values agree)."""
import math

import numpy as np
import pytest

from pymoe.errors import PymoeError
from pymoe.engine.sampler import (Sampler, SamplingParams, apply_repetition_penalty, dry_breaker_sequences,
                                  dry_penalties, filter_candidates, mirostat_v1, top_n_sigma, xtc, z_function)

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
                                 dict(repeat_penalty=0), dict(typical_p=1.5), dict(mirostat=3), dict(dry_base=0.5),
                                 dict(xtc_probability=2), dict(min_tokens=-1), dict(dry_penalty_last_n=-1)])
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


# --- llama.cpp's further samplers, by hand ---------------------------------------------------------------------------

def logits_of(*probs):
    return np.log(np.array(probs, dtype=np.float32))


def test_typical_p_by_hand():
    """p = [0.97, 0.01, 0.01, 0.01]: H = -(0.97 ln 0.97 + 3 * 0.01 ln 0.01) = 0.168; |surprise - H| is 0.137 for token
    0 and 4.44 for the others, so token 0 comes first and its 0.97 already exceeds 0.5: [0].
    p = [0.4, 0.2, 0.2, 0.2]: H = 1.332; |0.916 - H| = 0.416 for token 0, |1.609 - H| = 0.277 for the others: the
    three 0.2 tokens come first, 0.2 + 0.2 + 0.2 = 0.6 > 0.5: [1, 2, 3]. 1.0: all (off)."""
    def kept(z, p):
        return filter_candidates(z, top_k=0, top_p=1.0, min_p=0.0, typical_p=p)[0].tolist()

    assert kept(logits_of(0.97, 0.01, 0.01, 0.01), 0.5) == [0]
    assert kept(logits_of(0.4, 0.2, 0.2, 0.2), 0.5) == [1, 2, 3]
    assert kept(logits_of(0.4, 0.2, 0.2, 0.2), 1.0) == [0, 1, 2, 3]
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.5))
    ids, probs = s.distribution(logits_of(0.4, 0.2, 0.2, 0.2))
    np.testing.assert_allclose(probs, [1 / 3] * 3, rtol=1e-6)  # float32 logits of 0.2, renormalised


def test_top_n_sigma_by_hand():
    """logits ln [0.1, 0.2, 0.3, 0.4] = [-2.303, -1.609, -1.204, -0.916]: mean -1.508, std (over n) 0.521. n = 1 keeps
    logits >= -0.916 - 0.521 = -1.437: tokens 2 and 3, renormalised 0.3/0.7 and 0.4/0.7 (llama.cpp's 0.428571,
    0.571429). n = 3 cuts at -2.478: all kept; n <= 0: off."""
    z = logits_of(0.1, 0.2, 0.3, 0.4)
    assert np.isfinite(top_n_sigma(z, 1.0)).tolist() == [False, False, True, True]
    assert np.isfinite(top_n_sigma(z, 3.0)).all() and np.isfinite(top_n_sigma(z, 0.0)).all()
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, top_n_sigma=1.0))
    ids, probs = s.distribution(z)
    np.testing.assert_allclose(probs[:2], [0.4 / 0.7, 0.3 / 0.7], rtol=1e-6)
    assert ids[:2].tolist() == [3, 2] and probs[2:].sum() == 0


class FixedDraw:
    """A stand-in random generator whose uniform draws are `u`."""

    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def test_xtc_by_hand():
    """p = [0.4, 0.3, 0.2, 0.1]: the tokens at or above the threshold, but the least likely of them, are removed:
    0.09 -> [0.1]; 0.19 -> [0.2, 0.1]; 0.29 -> [0.3, 0.2, 0.1]; 0.39 -> one token above: nothing (llama.cpp's
    cases). It acts when the uniform draw is <= probability, and not above it."""
    ids, cand = np.arange(4), np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    for threshold, left in ((0.09, [3]), (0.19, [2, 3]), (0.29, [1, 2, 3]), (0.39, [0, 1, 2, 3])):
        assert xtc(ids, cand, 0.99, threshold, FixedDraw(0.5))[0].tolist() == left
    assert xtc(ids, cand, 0.5, 0.19, FixedDraw(0.5))[0].tolist() == [2, 3]
    assert xtc(ids, cand, 0.5, 0.19, FixedDraw(0.51))[0].tolist() == [0, 1, 2, 3]
    assert xtc(ids, cand, 0.0, 0.19, FixedDraw(0.0))[0].tolist() == [0, 1, 2, 3]  # 0: off
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, xtc_probability=1.0,
                               xtc_threshold=0.19, seed=1))
    ids, probs = s.distribution(logits_of(0.4, 0.3, 0.2, 0.1))
    assert ids.tolist() == [2, 3]
    np.testing.assert_allclose(probs, [2 / 3, 1 / 3], rtol=1e-6)


def test_mirostat_v2_by_hand():
    """p = [0.5, 0.25, 0.15, 0.07, 0.03] has surprises -log2 p = [1, 2, 2.74, 3.84, 5.06] bits. tau 1.25 starts mu at
    2.5: tokens 0 and 1 are kept, renormalised [2/3, 1/3]; after the draw mu -= 0.1 (-log2 p(drawn) - 1.25), p in
    the renormalised distribution. Mirostat replaces the truncations: top_k 1 changes nothing."""
    params = SamplingParams(temperature=1.0, top_k=1, top_p=0.1, min_p=0.9, mirostat=2, mirostat_tau=1.25,
                            mirostat_eta=0.1, seed=3)
    s = Sampler(params)
    ids, probs = s.distribution(LOGITS)
    assert ids.tolist() == [0, 1]
    np.testing.assert_allclose(probs, [2 / 3, 1 / 3], rtol=1e-6)
    token = s(LOGITS)
    p = {0: 2 / 3, 1: 1 / 3}[token]
    assert s.mu == pytest.approx(2.5 - 0.1 * (-math.log2(p) - 1.25), rel=1e-6)
    s.mu = 0.5  # below every surprise: the likeliest token alone
    assert s.distribution(LOGITS)[0].tolist() == [0]


def test_mirostat_v1_by_hand():
    """A Zipf distribution p_i ~ 1 / (i + 1)^2 over V = 1000 tokens: b_i = ln(p_i / p_(i+1)) = 2 t_i exactly, so the
    fit gives s = 2, eps = 1, and k = (2^mu / (1 - 1000^-1))^(1/2); mu = 6 (tau 3): sqrt(64 / 0.999) = 8.004 -> 8."""
    probs = 1.0 / np.arange(1, 1001) ** 2
    probs /= probs.sum()
    assert mirostat_v1(np.arange(1000), probs, 6.0, 1000) == 8
    s = Sampler(SamplingParams(temperature=1.0, mirostat=1, mirostat_tau=3.0, seed=1))
    ids, p = s.distribution(np.log(probs).astype(np.float32))
    assert ids.tolist() == list(range(8))
    np.testing.assert_allclose(p, probs[:8] / probs[:8].sum(), rtol=1e-5)  # float32 logits


def test_dry_by_hand():
    """History [0, 1, 2, 0, 1], allowed length 2: the suffix (0 1) appeared before, followed by 2, so 2 would extend a
    repeat of length 2: penalty 1.0 * 1.1^(2 - 2) = 1. On 4 equal logits: p(2) = e^-1 / (3 + e^-1) = 0.109232, the
    others 0.296923 (llama.cpp's values).
    [0, 1, 2, 3, 0, 1, 2], base 2: the suffix (0 1 2) of length 3 was followed by 3: 1.0 * 2^(3 - 2) = 2, and no other
    token (the shorter suffixes' earlier occurrences are inside that one's, followed by the same 3).
    Breakers: a one-token breaker (3) is never penalised; a breaker (1 2) at the end leaves no repeat to extend;
    a window (last_n) of 3 holds no repeat."""
    assert dry_penalties([0, 1, 2, 0, 1], 1.0, 1.1, 2, 5) == {2: pytest.approx(1.0)}
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, dry_multiplier=1.0, dry_base=1.1,
                               dry_allowed_length=2, dry_penalty_last_n=5))
    ids, probs = s.distribution(np.zeros(4, np.float32), [0, 1, 2, 0, 1])
    np.testing.assert_allclose(probs[np.argsort(ids)], [0.296923, 0.296923, 0.109232, 0.296923], rtol=1e-5)
    history = [0, 1, 2, 3, 0, 1, 2]
    assert dry_penalties(history, 1.0, 2.0, 2, 7) == {3: pytest.approx(2.0)}
    assert dry_penalties(history, 1.0, 2.0, 2, 7, breakers=((3, ()),)) == {}
    assert dry_penalties(history, 1.0, 2.0, 2, 7, breakers=((1, (2,)),)) == {}
    assert dry_penalties(history, 1.0, 2.0, 2, 3) == {}
    assert dry_penalties(history, 1.0, 2.0, 4, 7) == {}  # a repeat of 3 is within an allowed length of 4
    # five 5s: the suffix (5 5 5 5) also ends one place earlier, followed by a 5: 2^(4 - 2)
    assert dry_penalties([5, 5, 5, 5, 5], 1.0, 2.0, 2, 5) == {5: pytest.approx(4.0)}
    assert z_function([1, 0, 2, 1, 0]) == [0, 0, 0, 2, 0]


def test_dry_breaker_sequences_follow_llamacpp():
    """Tokens a, b, b:, :, xa, ab!; breakers ':' and 'ab'. ':' is inside 'b:' and ':' (one-token breakers); 'ab' is
    inside 'ab!', and 'a' and 'xa' end with its start 'a', so each is a head whose tail is the tokens of 'b'."""
    class Vocab:
        words = [b"a", b"b", b"b:", b":", b"xa", b"ab!"]
        n_vocab = len(words)

        def token_bytes(self, t):
            return self.words[t]

        def encode(self, text, add_bos=False, special=False):
            return [self.words.index(c.encode()) for c in text]

    got = dry_breaker_sequences(Vocab(), [":", "ab"])
    assert set(got) == {(2, ()), (3, ()), (5, ()), (0, (1,)), (4, (1,))}


def test_min_tokens_masks_the_end_ids_until_reached():
    """Token 0 is the argmax and an end id: with min_tokens 2 the first two draws are token 1, the third is 0. A
    grammar that allows only the end keeps it (nothing else to draw)."""
    s = Sampler(SamplingParams(temperature=0.0, min_tokens=2), end_ids=(0,))
    assert [s(LOGITS) for _ in range(3)] == [1, 1, 0]

    class OnlyTheEnd:
        def allowed(self):
            return np.arange(5) == 0

        def accept(self, token):
            pass

    assert Sampler(SamplingParams(temperature=0.0, min_tokens=2), constraint=OnlyTheEnd(), end_ids=(0,))(LOGITS) == 0
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, min_tokens=1), end_ids=(0,))
    assert 0 not in s.distribution(LOGITS)[0][s.distribution(LOGITS)[1] > 0].tolist()


def test_a_draw_handed_to_a_device_step_keeps_the_seeds_tokens():
    """Sampler.device_draw takes the next uniform number of the generator ahead of the draw (for a device decode step
    to draw with: backends/cuda.py `begin_step`); the token the step brought back (`drawn_token`) is returned as it
    is, and logits that came without one are drawn from on the host for that very u (`choice_for`): either way the
    generator gives one number per token in order, so a seed's tokens are those of a sampler never asked."""
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3)
    logits = np.random.default_rng(0).standard_normal((20, 300)).astype(np.float32)
    plain = Sampler(params)
    want = [plain(row) for row in logits]
    handed = Sampler(params)
    got = []
    for row in logits:
        draw = handed.device_draw(lambda top_k: True)
        assert (draw.temperature, draw.top_k, draw.top_p, draw.min_p) == (0.8, 40, 0.9, params.min_p)
        got.append(handed(row))  # host logits: the step did not draw
    assert got == want and plain.rng.random() == handed.rng.random()

    class Drawn(np.ndarray):  # logits a device step brought back with its draw
        drawn_token = 7

    stepped = Sampler(params)
    stepped.device_draw(lambda top_k: True)
    assert stepped(logits[0].view(Drawn)) == 7 and stepped.n_drawn == 1
    assert stepped(logits[1]) == want[1]  # nothing held: drawn here from the next number, as a plain sampler would
    assert Sampler(params).device_draw(lambda top_k: False) is None  # a top-k the device does not take
    assert Sampler(SamplingParams(temperature=0.8, typical_p=0.9)).device_draw(lambda top_k: True) is None
