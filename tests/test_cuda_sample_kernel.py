"""Sampling on the device (cuda_kernels/sample.py) against its NumPy twin and the host Sampler, in Numba's CUDA
simulator.

What this is: the facts the device draw rests on, each checked here: NumPy's Generator.choice(n, p=p) takes one
`random()` double u and returns searchsorted(cumsum(p) / cumsum(p)[-1], u, side='right'); np.sum of float64 is the
pairwise summation `sample.pairwise_sum_reference` writes out (and the device's `pairwise_sum` gives the same bits);
the host Sampler's draw equals `sample_reference` given the u its generator yields; and the kernel's token equals the
twin's over many random rows, with ties, top-k 0 (the whole vocabulary), top-p, min-p and a temperature so small the
largest logit overflows.
Bound on disagreements: 0. The kernel runs the twin's float64 operations in the same order (the simulator's
math.exp is the C library's, NumPy's exp may differ from it by an ulp); such a difference moves a boundary by ~1e-16,
and a token changes only if u, top_p or min_p p[0] falls within that of a boundary: over the ~350 draws here, a
chance below 1e-12.
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

from pymoe.cuda_kernels import sample  # noqa: E402
from pymoe.engine.sampler import Sampler, SamplingParams, choice_for  # noqa: E402

pytestmark = pytest.mark.cuda


def test_numpy_choice_is_one_uniform_and_a_search():
    """Generator.choice(n, p=p) == searchsorted(cdf / cdf[-1], rng.random(), 'right') (written out, and as the
    sampler's `choice_for`, its draw for a u handed to a device step that did not make it), and it leaves the
    generator where one random() does (the next numbers agree)."""
    for seed in range(300):
        a, b, c = np.random.default_rng(seed), np.random.default_rng(seed), np.random.default_rng(seed)
        n = 1 + seed % 50
        p = np.exp(np.random.default_rng(10_000 + seed).standard_normal(n) * 3)
        p /= p.sum()
        cdf = p.cumsum()
        cdf /= cdf[-1]
        pick = a.choice(n, p=p)
        assert pick == int(cdf.searchsorted(b.random(), side="right")) == choice_for(p, c.random())
        assert a.random() == b.random() == c.random()


def test_pairwise_sum_reference_is_numpys_sum():
    rng = np.random.default_rng(2)
    for n in list(range(1, 300)) + [511, 512, 513, 1000, 1023, 1024]:
        a = np.exp(3 * rng.standard_normal(n))
        assert sample.pairwise_sum_reference(a) == float(a.sum())


@cuda.jit
def _pairwise_kernel(a, n, out):
    out[0] = sample.pairwise_sum(a, n)


@in_process
def test_device_pairwise_sum_gives_numpys_bits():
    rng = np.random.default_rng(3)
    out = cuda.device_array(1, np.float64)
    for n in (1, 7, 8, 9, 127, 128, 129, 130, 250, 255, 256, 257, 700, 1024):
        a = np.exp(3 * rng.standard_normal(n))
        _pairwise_kernel[1, 1](cuda.to_device(a), n, out)
        assert out.copy_to_host()[0] == float(a.sum()), n


SETTINGS = [  # temperature, top_k, top_p, min_p
    (0.8, 40, 0.9, 0.05), (1.0, 0, 1.0, 0.0), (0.7, 0, 0.95, 0.0), (1.3, 20, 1.0, 0.1), (0.5, 3, 0.5, 0.0),
    (2.0, 264, 0.99, 0.01), (1e-308, 40, 0.9, 0.05)]


def random_rows(rng, T, V):
    """Logits float32 [T, V] of a few scales, with exact ties (some rows have many equal values)."""
    x = (rng.standard_normal((T, V)) * rng.choice([0.5, 2.0, 6.0], size=(T, 1))).astype(np.float32)
    x[::3, V // 2:] = x[::3, :V - V // 2]  # a third of the rows: every value twice
    x[1::5] = np.round(x[1::5])  # a fifth: integers, many ties at the cuts
    return x


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_host_sampler_is_the_twin_given_its_uniform(setting):
    """The Sampler's draw (rng.choice) == sample_reference with u = the same generator's random(): 0 disagreements
    (the same float64 operations on the same values)."""
    temp, top_k, top_p, min_p = setting
    rng = np.random.default_rng(4)
    logits = random_rows(rng, 200, 264)
    params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=7)
    host, twin = Sampler(params), np.random.default_rng(7)
    for row in logits:
        assert host(row) == int(sample.sample_reference(row[None], temp, top_k, top_p, min_p, twin.random())[0])


@in_process
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the simulator's z0 = l / 1e-308: inf
@pytest.mark.parametrize("setting", SETTINGS)
def test_the_kernel_draws_the_twins_token(setting):
    """T rows per launch, u from a seeded generator per launch: tokens equal the twin's (bound 0, module docstring)."""
    temp, top_k, top_p, min_p = setting
    rng = np.random.default_rng(5)
    T, V, launches = 16, 200, 3  # V = 200: top-k 0 ranks all 200 (O(V^2) compares, slow in the simulator)
    out = cuda.device_array(T, np.int32)
    disagree = 0
    for _ in range(launches):
        logits, u = random_rows(rng, T, V), float(rng.random())
        sample.sample(cuda.to_device(logits), temp, top_k, top_p, min_p, u, out, threads=32)
        disagree += int(np.sum(out.copy_to_host() != sample.sample_reference(logits, temp, top_k, top_p, min_p, u)))
    assert disagree == 0


@in_process
def test_a_wide_vocabulary_and_the_largest_top_k():
    """V = 3000 (radix select over more values than threads x bins), top-k = K_MAX, and u near 1 (the last
    candidate's interval): one block of THREADS threads."""
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((2, 3000)) * 4).astype(np.float32)
    logits[1, 1500:] = logits[1, :1500]
    out = cuda.device_array(2, np.int32)
    for u in (0.0, 0.37, 1 - 2.0**-53):
        sample.sample(cuda.to_device(logits), 1.5, sample.K_MAX, 1.0, 0.0, u, out)
        np.testing.assert_array_equal(out.copy_to_host(), sample.sample_reference(logits, 1.5, sample.K_MAX, 1.0, 0.0,
                                                                                   u))


def test_fits_names_the_draws_the_kernel_takes():
    assert sample.fits(40, 151_936) and sample.fits(0, 264) and sample.fits(sample.K_MAX, 151_936)
    assert not sample.fits(0, 151_936) and not sample.fits(sample.K_MAX + 1, 151_936)


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
