"""The capacity planner (pymoe/experts/plan.py, `pymoe plan`): the article's first hop reproduced from its inputs, the cost
model's calibration on the article's two measured points, monotonicity, the inverse, the static bound on real
routing heat, and the CLI on a tiny model. All arithmetic: runs in about a second plus two CLI subprocesses."""
import json
import os
import types

import numpy as np
import pytest

from pymoe.errors import PymoeError
from pymoe.experts.policies import DEFAULT_POLICY
from pymoe.experts.profile import Profile
from pymoe.experts.plan import (GiB, MiB, CostModel, ModelFacts, auto_line, calibrate_two_points, coverage,
                        decode_time_per_token, dense_bytes, facts_from_gguf, free_for_vram, overhead_for, parse_size,
                        parse_size_list, plan_table, profile_hit_model, slots_for, trace_hit_model,
                        uniform_hit_model, vram_for_slots, vram_for_target)

from conftest import run_pymoe_here

# shared/ lies beside the checkout (CI copies it there too): the real routing counts of Qwen3-Next-80B
HEAT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "shared", "data",
                    "routing-heat", "qwen3-next-80b-a3b.json")

# The article's model: 48 layers x 512 experts, top-10, 1.318 MiB per slot (rounded in the article).
ARTICLE_SLOT = round(1.318 * MiB)
ARTICLE = ModelFacts("article", n_layers=48, n_expert=512, k=10, slot_bytes=ARTICLE_SLOT)
ARTICLE_COST = CostModel(device_bw=1792e9, pcie_bw=13.9e9, fixed_s=3.46e-3)


def skewed_heat(L=4, E=16, seed=0):
    rng = np.random.default_rng(seed)
    return (1000 / np.arange(1, E + 1) ** 1.2)[rng.permuted(np.tile(np.arange(E), (L, 1)), axis=1)].astype(int)


# --- sizes --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,want", [
    ("700MiB", 700 * MiB), ("8.31GiB", round(8.31 * GiB)), ("184 MiB", 184 * MiB), ("1KiB", 1024),
    ("13.9GB", 13_900_000_000), ("5MB", 5_000_000), ("2kb", 2000), ("42B", 42), ("0", 0), ("1gib", GiB),
])
def test_parse_size(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("text", ["", "abc", "12 parsecs", "-5GiB", "1e3MiB", "1.2.3GiB", "nanGiB", "700"])
def test_parse_size_rejects_junk(text):
    with pytest.raises(PymoeError) as e:
        parse_size(text, what="--reserve")
    assert "--reserve" in str(e.value) and "\n" not in str(e.value)


def test_parse_size_list_unit_carries():
    assert parse_size_list("12,16,24GiB") == [12 * GiB, 16 * GiB, 24 * GiB]
    assert parse_size_list("12, 512MiB") == [12 * MiB, 512 * MiB]
    assert parse_size_list("8") == [8 * GiB]
    with pytest.raises(PymoeError):
        parse_size_list("12,,16GiB")


# --- the article's first hop: free bytes -> slots -------------------------------------------------------------------
@pytest.mark.parametrize("free_gib,article_slots", [(8.31, 5784), (26.01, 19530)])
def test_article_first_hop(free_gib, article_slots):
    """floor((free - 700 MiB - 184 MiB) / 1.318 MiB) lands within 0.1% of the engine's log line (1.318 is rounded,
    8.31 / 26.01 too: docs/planning.md shows the arithmetic: 5785.6 and 19537.4)."""
    free = round(free_gib * GiB)
    slots = slots_for(free, 700 * MiB, ARTICLE_SLOT, extra_reserve=184 * MiB, cap=ARTICLE.n_total)
    assert abs(slots - article_slots) / article_slots < 1e-3
    line = auto_line(free, 700 * MiB, slots, 184 * MiB)
    assert line == (f"expert cache auto: {free_gib} GiB free, 700 MiB reserved (+184 MiB for the draft head) -> "
                    f"{slots} slots")


def test_article_coverage():
    assert coverage(5784, ARTICLE.n_total) == pytest.approx(0.235, abs=5e-4)
    assert coverage(19530, ARTICLE.n_total) == pytest.approx(0.795, abs=5e-4)


def test_slots_floor_and_cap():
    assert slots_for(10 * MiB, 700 * MiB, MiB) == 0  # less free than reserved: no cache, not negative
    assert slots_for(10 * MiB + MiB - 1, 0, MiB) == 10  # floor
    assert slots_for(100 * GiB, 0, MiB, cap=24576) == 24576
    assert free_for_vram(4 * GiB, 6 * GiB) == 0


# --- the cost model ---------------------------------------------------------------------------------------------------
def test_calibration_of_the_article_points():
    """Two measured points (13.5% misses -> 140.6 tok/s, 0.3% -> 256.2) fix the two unknowns; the fitted fixed time
    is the --fixed-ms default, the fitted PCIe cost is an effective 26.9 GB/s (MTP, CPU misses: docs/planning.md).
    (That the fit passes through its own two points holds by construction and is not asserted.)"""
    fixed, pcie = calibrate_two_points((0.135, 140.6), (0.003, 256.2), ARTICLE.lookups_per_token, ARTICLE_SLOT,
                                       1792e9)
    assert fixed * 1e3 == pytest.approx(3.46, abs=0.005)
    assert pcie / 1e9 == pytest.approx(26.9, abs=0.05)


def test_cost_model_on_a_point_it_was_not_fitted_to():
    """Held out: the article's requests bucketed by hit rate (section 4.2; 2,890 requests over both rounds) give
    143 tok/s for hits of 90-95%. The model fitted on the two round averages predicts 160-198 tok/s across that
    bucket, 177 at its centre: 1.24x the measurement. The article names why (section 5): a miss costs a pipeline
    bubble, not just its bytes over PCIe, and the speed jumps past ~95% hits, which a model linear in the misses
    cannot follow. The bounds hold the model to what it does today, over-predicting by 1.1-1.3x (the article's
    own request-to-request spread is +-15%), so that a change to it shows here; docs/planning.md states the limit."""
    fixed, pcie = calibrate_two_points((0.135, 140.6), (0.003, 256.2), ARTICLE.lookups_per_token, ARTICLE_SLOT,
                                       1792e9)
    predicted = decode_time_per_token(0.925, ARTICLE, CostModel(1792e9, pcie, fixed)).tok_s
    assert 1.1 <= predicted / 143 <= 1.3, predicted


def test_cost_terms_by_hand():
    facts = ModelFacts("m", n_layers=2, n_expert=4, k=2, slot_bytes=1000, dense_bytes_per_token=500)
    t = decode_time_per_token(0.75, facts, CostModel(device_bw=1e6, pcie_bw=1e5, fixed_s=0.01))
    assert t.resident_s == pytest.approx(4 * 0.75 * 1000 / 1e6)
    assert t.spill_s == pytest.approx(4 * 0.25 * 1000 / 1e5)
    assert t.dense_s == pytest.approx(500 / 1e6)
    assert t.tok_s == pytest.approx(1 / (0.003 + 0.01 + 0.0005 + 0.01))


def test_prefetch_cost_by_hand():
    """plan.prefetch_time_per_token: 4 lookups per token, 1000-byte experts, PCIe 1e5 B/s, device 1e6 B/s. Without
    prefetch at hit rate 0.5: spill 2 x 1000 / 1e5 = 20 ms. A prefetch that removes 1 miss per token (hit rate 0.75)
    with 2 copies per token: spill (1 + 2) x 1000 / 1e5 = 30 ms, resident 3 x 1000 / 1e6 = 3 ms: slower (33 against
    22 ms beside the fixed and dense terms); with 0.5 copies per token: 15 + 3 = 18 ms, faster. Zero copies: the
    planner's decode_time_per_token exactly."""
    from pymoe.experts.plan import prefetch_time_per_token

    facts = ModelFacts("m", n_layers=2, n_expert=4, k=2, slot_bytes=1000)
    cost = CostModel(device_bw=1e6, pcie_bw=1e5, fixed_s=0.0)
    base = prefetch_time_per_token(0.5, 0.0, facts, cost)
    assert base == decode_time_per_token(0.5, facts, cost)
    assert base.total_s == pytest.approx(0.020 + 0.002)
    assert prefetch_time_per_token(0.75, 2.0, facts, cost).total_s == pytest.approx(0.030 + 0.003)
    assert prefetch_time_per_token(0.75, 0.5, facts, cost).total_s == pytest.approx(0.015 + 0.003)


# --- monotone in VRAM, and the inverse -------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["uniform", "profile"])
def test_monotone_in_vram(model):
    hit = uniform_hit_model(ARTICLE.n_total) if model == "uniform" else \
        profile_hit_model(Profile.from_heat(skewed_heat(48, 512)))
    vrams = [int(v * GiB) for v in np.linspace(4, 48, 23)]
    rows = plan_table(vrams, ARTICLE, int(5.8 * GiB), 700 * MiB, hit, ARTICLE_COST, 184 * MiB)
    for a, b in zip(rows, rows[1:]):
        assert a.slots <= b.slots and a.coverage <= b.coverage and a.hit_rate <= b.hit_rate
        assert a.spill_share >= b.spill_share and a.tok_s <= b.tok_s
    assert rows[0].slots == 0 and rows[-1].coverage == 1.0


@pytest.mark.parametrize("target", [50, 100, 150, 200, 250])
def test_inverse_meets_target_and_is_least(target):
    hit = profile_hit_model(Profile.from_heat(skewed_heat(48, 512)))
    overhead, reserve = int(5.8 * GiB), 700 * MiB
    plan = vram_for_target(target, ARTICLE, overhead, reserve, hit, ARTICLE_COST)
    assert plan.reachable
    # forward: plan the VRAM found, from scratch
    row = plan_table([plan.vram], ARTICLE, overhead, reserve, hit, ARTICLE_COST)[0]
    assert row.slots == plan.slots and row.tok_s >= target
    if plan.slots > 0:  # one slot fewer (the VRAM one slot smaller) would miss the target
        smaller = vram_for_slots(plan.slots - 1, ARTICLE, overhead, reserve)
        assert plan_table([smaller], ARTICLE, overhead, reserve, hit, ARTICLE_COST)[0].tok_s < target


def test_inverse_unreachable():
    plan = vram_for_target(1000, ARTICLE, int(5.8 * GiB), 700 * MiB, uniform_hit_model(ARTICLE.n_total),
                           ARTICLE_COST)
    assert not plan.reachable and plan.row.coverage == 1.0 and plan.row.tok_s < 1000
    with pytest.raises(PymoeError):
        vram_for_target(-1, ARTICLE, 0, 0, uniform_hit_model(ARTICLE.n_total), ARTICLE_COST)


# --- hit-rate predictors ---------------------------------------------------------------------------------------------
def test_static_bound_on_real_heat():
    """README numbers for qwen3-next-80b-a3b (48 x 512, top-10): 23.5% coverage -> 56.6%, 79.5% -> 98.4%, through
    the real Profile.from_heat; the article measured 86.5% / 99.7% with an adaptive engine (temporal locality)."""
    if not os.path.exists(HEAT):
        pytest.skip("routing-heat data not present")
    with open(HEAT) as f:
        heat = json.load(f)["heat"]
    hit = profile_hit_model(Profile.from_heat(heat))
    assert hit.rate(round(0.235 * ARTICLE.n_total)) == pytest.approx(0.566, abs=1e-3)
    assert hit.rate(round(0.795 * ARTICLE.n_total)) == pytest.approx(0.984, abs=1e-3)
    assert hit.rate(5784) < 0.865 and hit.rate(19530) < 0.997  # the measured adaptive rates sit above the bound


def test_uniform_is_a_lower_bound_of_the_static_bound():
    """The real Profile ranks hottest first, so a static cache of any size beats uniform routing on skewed heat."""
    profile = Profile.from_heat(skewed_heat(8, 64))
    for n in range(0, 513, 32):
        assert profile.coverage_hit_rate(n) >= uniform_hit_model(512).rate(n) - 1e-12


def test_trace_hit_model_calls_the_simulator(monkeypatch):
    """With a fake simulator: one global pool, decode lookups, the default policy, memoised per slot count."""
    import pymoe.experts.simulate

    calls = []

    def sweep(trace, policies, slots_list, pools, phase):
        calls.append((tuple(policies), tuple(slots_list), tuple(pools), phase))
        return [types.SimpleNamespace(hit_rate=min(1.0, slots_list[0] / 10))]

    monkeypatch.setattr(pymoe.experts.simulate, "sweep", sweep)
    facts = ModelFacts("m", n_layers=2, n_expert=8, k=2, slot_bytes=100)
    hit = trace_hit_model(object(), facts)
    assert hit.rate(5) == 0.5 and hit.rate(5) == 0.5 and hit.rate(16) == 1.0
    assert calls == [((DEFAULT_POLICY,), (5,), ("global",), "decode")]


def test_trace_hit_model_real_simulator():
    """End to end with the real trace + simulator: monotone in slots (LRU is a stack algorithm), and above the
    static bound of the same trace at low coverage (temporal locality)."""
    from pymoe.experts.profile import Profile
    from pymoe.experts.trace import synthetic_trace

    trace = synthetic_trace(300, 2, 16, 2, seed=1, prompt_len=10, locality=0.7)
    facts = ModelFacts("m", n_layers=2, n_expert=16, k=2, slot_bytes=100)
    hit = trace_hit_model(trace, facts, policy="lru")  # the claims below are about LRU (a stack algorithm)
    rates = [hit.rate(n) for n in range(0, 33, 4)]
    assert all(a <= b + 1e-12 for a, b in zip(rates, rates[1:])) and rates[-1] == 1.0
    static = Profile.from_trace(trace, "decode").coverage_hit_rate(4)
    assert hit.rate(4) > static


# --- the model file and the CLI ---------------------------------------------------------------------------------------
def test_facts_from_tiny_model(tiny_model):
    from pymoe.gguf.loader import load_gguf

    path = tiny_model("qwen3moe", "q2_k")
    m = load_gguf(path)
    facts = facts_from_gguf(path)
    resident, per_token = dense_bytes(m)
    assert resident + m.expert_bytes_total == sum(t.nbytes for t in m.tensors.values())
    assert 0 < per_token <= resident
    assert facts.slot_bytes == m.slot_bytes and facts.n_total == m.config.n_layers * m.config.n_expert


def test_cli_plan_table(tiny_model):
    r = run_pymoe_here("plan", tiny_model("qwen3moe", "q2_k"), "--vram", "0.52,0.53,1GiB", "--reserve", "1MiB",
                  "--target", "250", "--target", "1e6")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "VRAM" in out and "coverage" in out and "hit rate" in out and "spill share" in out
    assert "resident =" in out and "spill    =" in out and "dense    =" in out and "fixed    =" in out
    assert "uniform routing" in out and "lower bound" in out
    assert "target 250 tok/s: needs" in out and "target 1e+06 tok/s: unreachable" in out
    table = [ln for ln in out.splitlines() if ln.lstrip()[:1].isdigit() and "|" in ln]
    assert len(table) == 3 and table[-1].split("|")[4].strip() == "100.0%"


def test_cli_plan_free(tiny_model):
    r = run_pymoe_here("plan", tiny_model("qwen3moe", "q2_k"), "--free", "26.01GiB", "--extra-reserve", "184MiB")
    assert r.returncode == 0, r.stderr
    assert "expert cache auto: 26.01 GiB free, 700 MiB reserved (+184 MiB for the draft head) -> 16 slots" in r.stdout


def test_overhead_counts_the_recurrent_state_twice_for_speculation():
    """Per sequence: K/V of n_ctx positions plus the recurrent state, once; twice when planning for speculation (the
    state and its device snapshot, backends/cuda.py `sequence_bytes`)."""
    facts = ModelFacts("hybrid", n_layers=4, n_expert=8, k=2, slot_bytes=1000, kv_bytes_per_ctx_token=10,
                       state_bytes_per_seq=300)
    assert overhead_for(facts, 5, 0, 3).kv == 3 * (50 + 300)
    assert overhead_for(facts, 5, 0, 3, speculation=True).kv == 3 * (50 + 2 * 300)


def test_cli_plan_spec_counts_a_hybrids_state_twice(tiny_model):
    """`pymoe plan --spec` on qwen3next (--ctx 0: the KV term is the state alone): the state's bytes once, twice
    with --spec."""
    from pymoe.experts.plan import fmt_size

    path = tiny_model("qwen3next", "q2_k")
    state = facts_from_gguf(path).state_bytes_per_seq
    assert state > 0
    for flags, copies in (((), 1), (("--spec",), 2)):
        r = run_pymoe_here("plan", path, "--vram", "1GiB", "--ctx", "0", *flags)
        assert r.returncode == 0, r.stderr
        assert f"KV cache (0 positions, float32) {fmt_size(copies * state)} + runtime" in r.stdout
    assert "--spec: each sequence's recurrent state and its snapshot" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (("--vram", "12,lots"), "--vram"),
    (("--vram", "12,16furlongs"), "--vram"),
    (("--reserve", "a lot"), "--reserve"),
    (("--reserve", "700"), "--reserve"),
    (("--pcie", "0"), "--pcie"),
])
def test_cli_plan_bad_values(tiny_model, args, needle):
    r = run_pymoe_here("plan", tiny_model("qwen3moe", "q2_k"), *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pymoe: error:") and needle in lines[0]


def test_plan_plot(tiny_model, tmp_path):
    """`pymoe plan --plot`: the VRAM -> hit rate -> tok/s curves as an image, the --vram sizes marked."""
    from conftest import run_pymoe_here

    out = tmp_path / "plan.png"
    r = run_pymoe_here("plan", tiny_model("qwen3moe", "q2_k"), "--vram", "2MiB,4MiB", "--overhead", "1MiB",
                  "--reserve", "0", "--plot", str(out))
    assert r.returncode == 0, r.stderr
    assert f"plot: {out}" in r.stdout and out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 10_000
