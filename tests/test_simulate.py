"""The cache simulator: pools, counted / staged lookups, knee, table, plot, and the `pymoe simulate` command."""
import numpy as np
import pytest

from conftest import run_pymoe_here
from pymoe.errors import PymoeError
from pymoe.experts.profile import Profile
from pymoe.experts.simulate import (SimResult, format_table, knee, simulate, slots_for_coverage, split_slots, sweep)
from pymoe.experts.trace import synthetic_trace


def test_split_slots():
    assert split_slots(10, 4) == [3, 3, 2, 2]
    assert split_slots(3, 4) == [1, 1, 1, 0]
    assert sum(split_slots(5784, 48)) == 5784


def test_slots_for_coverage_floors_like_the_heat_readme():
    assert slots_for_coverage(10, 48, 128) == 614  # 614.4
    assert slots_for_coverage(23.5, 48, 512) == 5775  # 5775.36
    assert slots_for_coverage(30, 1, 10) == 3  # 0.3 * 10 is 2.9999999999999996 in floating point


def test_per_layer_pool_vs_global_pool():
    # 2 layers x 4 experts; keys 0-3 are layer 0, 4-7 layer 1. Layer 0 cycles 0 1 0 1..., layer 1 always 4.
    keys = np.array([0, 4, 1, 4, 0, 4, 1, 4])
    # per-layer, 2 slots = 1 per layer: layer 0 thrashes (0 hits), layer 1 hits 3 times.
    r = simulate(keys, 2, 4, "lru", 2, pool="per-layer", tokens=4)
    assert (r.lookups, r.hits, r.misses_per_token) == (8, 3, 5 / 4)
    # global, 2 slots under LRU: 0 4 | 1 evicts 0 | 4 hit | 0 evicts 1 | 4 hit | 1 evicts 0 | 4 hit.
    r = simulate(keys, 2, 4, "lru", 2, pool="global", tokens=4)
    assert r.hits == 3 and r.coverage == 2 / 8 and r.hit_rate == 3 / 8
    # global, 3 slots: everything fits after the first use of each.
    assert simulate(keys, 2, 4, "lru", 3, pool="global").hits == 5


def test_counted_and_staged():
    keys = np.array([0, 1, 0, 1])
    staged = np.array([True, True, False, False])  # the first two are prefill lookups: their misses stay out
    r = simulate(keys, 1, 2, "lru", 2, pool="global", staged=staged)
    assert r.hits == 0  # nothing was let in during "prefill", so the decode lookups miss (and now enter)
    r = simulate(keys, 1, 2, "lru", 2, pool="global", counted=~staged, tokens=2)
    assert (r.lookups, r.hits) == (2, 2)


def test_static_needs_a_profile_and_keys_are_checked():
    with pytest.raises(PymoeError, match="needs a profile"):
        simulate(np.array([0, 1]), 1, 2, "static", 1)
    with pytest.raises(PymoeError, match="out of range"):
        simulate(np.array([0, 9]), 1, 2, "lru", 1)


def test_static_hit_rate_is_the_profiles_coverage_bound_in_sample():
    trace = synthetic_trace(120, 3, 16, 2, seed=3)
    profile = Profile.from_trace(trace)
    for slots in (3, 12, 24):
        r = simulate(trace.keys(), 3, 16, "static", slots, pool="global", profile=profile)
        assert r.hit_rate == pytest.approx(profile.coverage_hit_rate(slots))


def test_sweep_policies_order_and_belady_on_top():
    trace = synthetic_trace(150, 4, 16, 2, seed=1, prompt_len=10)
    results = sweep(trace, ["lru", "lfu", "lfru", "static", "pinned-lru", "belady"], [4, 8, 16, 32],
                    ["per-layer", "global"], phase="decode")
    assert len(results) == 2 * 6 * 4
    assert all(r.lookups == 140 * 4 * 2 for r in results)
    by = {(r.pool, r.policy, r.slots): r for r in results}
    for pool in ("per-layer", "global"):
        for slots in (4, 8, 16, 32):
            assert by[pool, "belady", slots].hits >= max(by[pool, p, slots].hits
                                                         for p in ("lru", "lfu", "lfru", "static"))
        rates = [by[pool, "lru", s].hit_rate for s in (4, 8, 16, 32)]
        assert rates == sorted(rates)  # LRU is a stack algorithm: more slots never hurt (per-layer split too)


def res(policy, slots, rate, pool="global"):
    return SimResult(policy, slots, slots / 100, pool, 100, int(rate * 100), rate, 0.0)


def test_knee_definition():
    # +10% coverage adds 30, 10, 2, 0.5 points: the knee is at 40% (the step from 40% to 50% adds < 1 point).
    results = [res("lru", 10, 0.40), res("lru", 20, 0.70), res("lru", 30, 0.80), res("lru", 40, 0.82),
               res("lru", 50, 0.825), res("lfu", 10, 0.5), res("lfu", 20, 0.9)]
    knees = knee(results)
    assert knees["global", "lru"].slots == 40
    assert knees["global", "lfu"] is None
    # the slope is per +10% coverage: a +20% step adding 1.5 points is below 1 point per 10%
    assert knee([res("a", 10, 0.5), res("a", 30, 0.515)])["global", "a"].slots == 10
    table = format_table(results)
    assert "82.0 (0.00)*" in table and "pool global" in table


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from pymoe.experts.simulate import plot

    path = tmp_path / "hit.png"
    plot([res("lru", 10, 0.4), res("lru", 20, 0.7), res("lru", 20, 0.6, pool="per-layer")], path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_cli_simulate(tmp_path):
    path = tmp_path / "syn.npz"
    synthetic_trace(200, 4, 16, 2, seed=0, prompt_len=8).save(path)
    r = run_pymoe_here("simulate", str(path), "--coverage", "10,25,50,75", "--phase", "decode")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "4 layers x 16 experts, top-2; 200 tokens (8 prefill, 192 decode)" in out
    assert "in-sample" in out and "pool per-layer" in out and "pool global" in out
    for name in ("static", "lru", "lfu", "pinned-lru", "belady"):
        assert name in out
    assert "     32    50.0%" in out  # 50% of 64 experts
    r = run_pymoe_here("simulate", str(path), "--slots", "8,16", "--policy", "lru,belady", "--pool", "global")
    assert r.returncode == 0 and "pool per-layer" not in r.stdout
    assert [line.split() for line in r.stdout.splitlines() if "coverage" in line][-1] == [
        "slots", "coverage", "lru", "belady"]


@pytest.mark.parametrize("content, args, expected", [
    (b"this is not a trace\n", (), "not a pymoe trace"),
    (b"PK\x03\x04 truncated zip", (), "not a pymoe trace"),
    (None, ("--policy", "fifo"), "unknown cache policy 'fifo'"),
    (None, ("--slots", "4", "--coverage", "10"), "--slots or --coverage"),
    (None, ("--coverage", "150"), "percent"),
    (None, ("--slots", "x"), "comma-separated numbers"),
])
def test_cli_simulate_errors(tmp_path, content, args, expected):
    path = tmp_path / "t.npz"
    if content is None:
        synthetic_trace(20, 2, 8, 2).save(path)
    else:
        path.write_bytes(content)
    r = run_pymoe_here("simulate", str(path), *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and expected in err, err
