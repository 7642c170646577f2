"""Several cards in one box (pymoe/experts/multi.py, `pymoe plan --devices`, `pymoe simulate --devices`): the layer
split, slots, coverage, hit rate and tok/s of two and four cards of different sizes worked out by hand, the per-card
replay counted by hand, and the commands on a tiny model. Arithmetic and tiny replays: about a second."""
import numpy as np
import pytest

from conftest import run_pymoe_here
from pymoe.experts.multi import (plan_devices, simulate_devices, split_count, split_layers, uniform_device_hits)
from pymoe.experts.plan import CostModel, ModelFacts, plan_row, uniform_hit_model
from pymoe.experts.trace import Trace

COST = CostModel(device_bw=1e11, pcie_bw=1e10, fixed_s=1e-3)  # 100 GB/s card, 10 GB/s PCIe, 1 ms fixed
HOP_S = 1000 * 4 / 1e10 + 10e-6  # n_embd 1000 float32 over PCIe (0.4 us) + the 10 us hop latency = 10.4 us


def test_split_layers_largest_remainder():
    # 48 layers by 22 : 14 usable GiB: quotas 29.33 / 18.67 -> floors 29 / 18, the one left to the larger fraction
    assert split_layers(48, [22, 14]) == [(0, 29), (29, 48)]
    assert split_layers(5, [1, 1, 1, 1]) == [(0, 2), (2, 3), (3, 4), (4, 5)]  # the tie goes to the first card
    assert split_layers(4, [100, 1, 1]) == [(0, 2), (2, 3), (3, 4)]  # every card gets a layer
    assert split_count(10, [2, 1]) == [7, 3] and sum(split_count(5784, [3, 2, 2])) == 5784


def test_two_cards_by_hand():
    """4 layers x 8 experts, top-2, slot 1e6 B, dense + KV 1e6 B per layer, 4e6 B dense read per token, n_embd 1000.
    Cards 14e6 and 7e6 B, runtime 1e6 B each, no reserve: usable 13e6 : 6e6 -> quotas 2.74 : 1.26 -> 3 : 1 layers.
    card 0: free 14 - 1 - 3 = 10e6 -> 10 slots of 24 (41.67%); card 1: free 7 - 1 - 1 = 5e6 -> 5 of 8 (62.5%).
    Uniform routing: hit = coverage.
    card 0: resident 6 lookups x 10/24 x 1e6 / 1e11 = 25 us; spill 6 x 14/24 x 1e6 / 1e10 = 350 us; dense 3e6 / 1e11
            = 30 us.  card 1: resident 2 x 5/8 x 1e6 / 1e11 = 12.5 us; spill 2 x 3/8 x 1e6 / 1e10 = 75 us; dense 10 us.
    t = 1000 fixed + 405 + 97.5 + 1 hop 10.4 = 1512.9 us -> 660.98 tok/s; whole hit (3 x 10/24 + 1 x 5/8) / 4."""
    facts = ModelFacts("m", n_layers=4, n_expert=8, k=2, slot_bytes=10**6, dense_resident_bytes=4 * 10**6,
                       dense_bytes_per_token=4 * 10**6, n_embd=1000)
    plan = plan_devices([14 * 10**6, 7 * 10**6], facts, 10**6, runtime=10**6, reserve=0,
                        hits=uniform_device_hits(8), cost=COST)
    a, b = plan.rows
    assert (a.layers, b.layers, a.slots, b.slots) == ((0, 3), (3, 4), 10, 5)
    assert a.coverage == pytest.approx(10 / 24) and b.coverage == pytest.approx(5 / 8)
    assert (a.resident_s, a.spill_s, a.dense_s) == pytest.approx((25e-6, 350e-6, 30e-6))
    assert (b.resident_s, b.spill_s, b.dense_s) == pytest.approx((12.5e-6, 75e-6, 10e-6))
    assert plan.hop_s == pytest.approx(HOP_S)
    assert plan.slots == 15 and plan.coverage == pytest.approx(15 / 32)
    assert plan.hit_rate == pytest.approx(0.46875)
    assert plan.total_s == pytest.approx(1512.9e-6) and plan.tok_s == pytest.approx(660.98, abs=0.01)


def test_four_cards_with_dense_lead_layers_by_hand():
    """8 layers, the first 2 dense (6 MoE layers x 4 experts), top-1, slot 1e6 B, 1e6 B dense + KV per layer, 8e6 B
    dense read per token. Cards 10, 6, 6, 4 (e6 B), runtime 1e6: usable 9 : 5 : 5 : 3 -> quotas 3.27, 1.82, 1.82, 1.09
    -> floors 3, 1, 1, 1, the two left to the .82s -> layers 0-2, 3-4, 5-6, 7 -> MoE layers (model layer - 2):
    1, 2, 2, 1.  free 6, 3, 3, 2 (e6 B) -> slots min(6, 4) = 4, 3, 3, 2 -> coverage 100%, 37.5%, 37.5%, 50%.
    card 0: resident 1 x 1 x 1e6 / 1e11 = 10 us, spill 0, dense 3e6 / 1e11 = 30 us          = 40 us
    card 1: resident 2 x .375 x 1e6 / 1e11 = 7.5 us, spill 2 x .625 x 1e6 / 1e10 = 125, dense 20 = 152.5 us
    card 2: as card 1                                                                      = 152.5 us
    card 3: resident .5e6 / 1e11 = 5 us, spill .5e6 / 1e10 = 50 us, dense 10 us            = 65 us
    t = 1000 + 410 + 3 hops x 10.4 = 1441.2 us -> 693.87 tok/s; slots 12 of 24; hit (1 + .75 + .75 + .5) / 6 = .5"""
    facts = ModelFacts("m", n_layers=8, n_expert=4, k=1, slot_bytes=10**6, dense_bytes_per_token=8 * 10**6,
                       n_dense=2, n_embd=1000)
    plan = plan_devices([10 * 10**6, 6 * 10**6, 6 * 10**6, 4 * 10**6], facts, 10**6, runtime=10**6, reserve=0,
                        hits=uniform_device_hits(4), cost=COST)
    assert [r.layers for r in plan.rows] == [(0, 3), (3, 5), (5, 7), (7, 8)]
    assert [r.moe_layers for r in plan.rows] == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert [r.slots for r in plan.rows] == [4, 3, 3, 2]
    assert [r.coverage for r in plan.rows] == pytest.approx([1.0, 0.375, 0.375, 0.5])
    assert [r.time_s for r in plan.rows] == pytest.approx([40e-6, 152.5e-6, 152.5e-6, 65e-6])
    assert plan.slots == 12 and plan.hit_rate == pytest.approx(0.5)
    assert plan.total_s == pytest.approx(1441.2e-6) and plan.tok_s == pytest.approx(693.87, abs=0.01)


def test_one_card_is_the_single_card_planner():
    """--devices with one card and no hop is plan_row on the same card (the chain is the same formulas)."""
    facts = ModelFacts("m", n_layers=6, n_expert=16, k=4, slot_bytes=3 * 10**5, dense_resident_bytes=6 * 10**6,
                       dense_bytes_per_token=2 * 10**6, n_embd=64)
    plan = plan_devices([20 * 10**6], facts, 10**6, runtime=5 * 10**5, reserve=10**6, hits=uniform_device_hits(16),
                        cost=COST, extra_reserve=2 * 10**5)
    row = plan_row(20 * 10**6 - 5 * 10**5 - 6 * 10**6, facts, 10**6, uniform_hit_model(facts.n_total), COST,
                   2 * 10**5)
    assert plan.slots == row.slots and plan.tok_s == pytest.approx(row.tok_s)


def hand_trace(layer_experts):
    """A decode-only trace, top-1: layer_experts[l] = the expert of each token in MoE layer l."""
    e = np.array(layer_experts, dtype=np.uint16).T[:, :, None]  # [N, L, 1]
    n, L = e.shape[:2]
    meta = {"model": "hand", "n_layers": L, "n_experts": 2, "k": 1, "prompt_lengths": [0], "n_requests": 1,
            "n_forwards": n}
    return Trace(e, np.ones_like(e, dtype=np.float16), np.ones(n, np.uint8), np.zeros(n, np.int32),
                 np.arange(n, dtype=np.int32), meta)


def test_one_pool_per_card_counted_by_hand():
    """2 MoE layers x 2 experts, top-1, 4 decode tokens: layer 0 routes 0 1 0 1, layer 1 routes 0 0 0 0. LRU, pools
    pre-filled from the in-sample profile (hottest first, ties by the lower key).
    Two cards, 1 slot each: card 0 starts with expert 0: hit, miss (1 in), miss (0 in), miss -> 1 of 4; card 1 starts
    with expert 0 and hits 4 of 4: 5 of 8. Slots split 2 : 1: card 0 holds both experts -> 4 of 4; card 1 4 of 4."""
    trace = hand_trace([[0, 1, 0, 1], [0, 0, 0, 0]])
    a, b = simulate_devices(trace, [(0, 1), (1, 2)], [1, 1], "lru")
    assert (a.hits, a.lookups, b.hits, b.lookups) == (1, 4, 4, 4)
    a, b = simulate_devices(trace, [(0, 1), (1, 2)], [2, 1], "lru")
    assert (a.hits, b.hits) == (4, 4) and a.coverage == 1.0 and b.coverage == 0.5


def test_one_card_replay_is_the_global_pool():
    """Plumbing (the same SlotTable): one card over every layer replays exactly as `--pool global`."""
    from pymoe.experts.simulate import sweep
    from pymoe.experts.trace import synthetic_trace

    trace = synthetic_trace(120, 4, 16, 2, seed=2, prompt_len=8)
    whole = sweep(trace, ["lfru"], [20], ["global"], phase="decode")[0]
    one = simulate_devices(trace, [(0, 4)], [20], "lfru")[0]
    assert (one.hits, one.lookups) == (whole.hits, whole.lookups)


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])  # deepseek2 leads with a dense layer
def test_cli_plan_devices(tiny_model, arch):
    from pymoe.experts.plan import facts_from_gguf

    path = tiny_model(arch, "q2_k")
    r = run_pymoe_here("plan", path, "--devices", "0.52,0.6GiB", "--reserve", "1MiB")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    cards = [ln.split("|") for ln in lines if ln.lstrip().startswith("cuda:")]
    assert len(cards) == 2
    facts = facts_from_gguf(path)
    assert sum(int(c[3]) for c in cards) == facts.n_moe_layers  # the MoE layers column adds up, dense lead aside
    assert any(ln.startswith("hops: 1 x") for ln in lines) and any(ln.startswith("whole model:") for ln in lines)


@pytest.mark.parametrize("args,needle", [(("--devices", "12,lots"), "--devices"),
                                         (("--devices", "12GiB", "--target", "100"), "--devices")])
def test_cli_plan_devices_bad_values(tiny_model, args, needle):
    r = run_pymoe_here("plan", tiny_model("qwen3moe", "q2_k"), *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("pymoe: error:") and needle in lines[0]


def test_cli_simulate_devices(tmp_path):
    trace = hand_trace([[0, 1, 0, 1], [0, 0, 0, 0]])
    path = tmp_path / "t.npz"
    trace.save(path)
    r = run_pymoe_here("simulate", str(path), "--devices", "2", "--slots", "2", "--policy", "lru")
    assert r.returncode == 0, r.stderr
    assert "cuda:0 layers 0-0: 1 slots, coverage 50.0%, hit 25.0% (1/4)" in r.stdout
    assert "cuda:1 layers 1-1: 1 slots, coverage 50.0%, hit 100.0% (4/4)" in r.stdout
    assert "total: hit 62.5% (5/8)" in r.stdout
    for args in (("--devices", "3", "--slots", "2"), ("--devices", "2", "--pool", "global")):
        r = run_pymoe_here("simulate", str(path), *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("pymoe: error: --devices")


def test_cli_plan_devices_with_a_trace(tiny_model, tmp_path):
    """--trace with --devices: each card's hit rate is the replay of its own layers (plumbing: the planner calls
    simulate_devices with the card's layers and slots, as printed)."""
    from pymoe.experts.plan import facts_from_gguf
    from pymoe.experts.policies import DEFAULT_POLICY
    from pymoe.experts.trace import synthetic_trace

    path = tiny_model("qwen3moe", "q2_k")
    facts = facts_from_gguf(path)
    trace = synthetic_trace(60, facts.n_moe_layers, facts.n_expert, facts.k, seed=4, prompt_len=5)
    trace.save(tmp_path / "t.npz")
    r = run_pymoe_here("plan", path, "--devices", "0.52,0.53GiB", "--reserve", "1MiB", "--trace",
                       str(tmp_path / "t.npz"))
    assert r.returncode == 0, r.stderr
    cards = [[c.strip() for c in ln.split("|")] for ln in r.stdout.splitlines() if ln.lstrip().startswith("cuda:")]
    for c in cards:
        lo, hi = (int(x) for x in c[2].split("-"))
        got = simulate_devices(trace, [(lo, hi + 1)], [int(c[6])], DEFAULT_POLICY)[0].hit_rate
        assert c[8] == f"{100 * got:.1f}%"
