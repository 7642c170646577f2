"""Expert placement for expert parallelism (pymoe/experts/placement.py, `pymoe placement`): DeepSeek's EPLB
re-implemented in NumPy against the example its README publishes, the packing, replication and pymoe's swap
refinement worked by hand with the imbalance they predict, and the file SGLang's `--init-expert-location` reads.

vLLM and SGLang are not installed here (torch-based servers), so the file is checked against the schema their
loader code implies (sglang/srt/eplb/expert_location.py, compute_initial_expert_location_metadata: json.loads of the
file, the key physical_to_logical_map passed as the only keyword argument of init_by_mapping, a [num_hidden_layers,
num_physical_experts] integer tensor) rather than by their loader itself."""
import json

import numpy as np
import pytest

from conftest import run_pymoe_here
from pymoe.errors import PymoeError
from pymoe.experts.placement import (Placement, balanced_packing, gpu_loads, imbalance, placements, rebalance,
                                     replicate, trace_counts, write_sglang)
from pymoe.experts.trace import Trace

W8 = np.array([[90, 10, 30, 70, 20, 60, 40, 80]], dtype=float)  # one layer, 8 experts, 400 tokens


def test_deepseek_readme_example():
    """The oracle: github.com/deepseek-ai/EPLB README (commit d52c72d5), 2 layers x 12 experts, 16 replicas,
    4 groups, 2 nodes, 8 GPUs (hierarchical policy), printed output reproduced exactly."""
    w = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                  [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    p = rebalance(w, 16, groups=4, nodes=2, gpus=8)
    assert p.phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_packing_by_hand():
    """8 experts on 4 GPUs, no replicas. Heaviest first to the lightest GPU with room: 90 A, 80 B, 70 C, 60 D,
    40 D (100), 30 C (100), 20 B (100), 10 A (100): every GPU 100, imbalance 1.00. The uniform placement holds
    experts in blocks of two: 100, 100, 80, 120 -> max 120 / mean 100 = 1.20."""
    pack, rank = balanced_packing(W8, 4)
    assert pack.tolist() == [[0, 0, 2, 2, 1, 3, 3, 1]]
    uniform, eplb, pymoe = placements(W8, gpus=4)
    assert gpu_loads(uniform, W8).tolist() == [[100, 100, 80, 120]] and imbalance(uniform, W8) == pytest.approx(1.2)
    assert gpu_loads(eplb, W8).tolist() == [[100, 100, 100, 100]] and imbalance(pymoe, W8) == 1.0


def test_replication_by_hand():
    """4 redundant: each replica goes to the largest load per replica: 90 (-> 45 x 2), 80 (40 x 2), 70 (35 x 2),
    60 (30 x 2). Physical loads 45 45 40 40 40 35 35 30 30 30 20 10 packed 3 per GPU: A 45 + 35 + 20 = 100,
    B 45 + 30 + 30 = 105, C 40 + 40 + 10 = 90, D 40 + 35 + 30 = 105 -> 1.05. pymoe's swap: B's 45 for C's 40 ->
    100 / 95; then D (105) against C (95) has no pair closer than 10, so the max stays 105: 1.05."""
    phy2log, _, count = replicate(W8, 12)
    assert count.tolist() == [[2, 1, 1, 2, 1, 2, 1, 2]] and phy2log[0, 8:].tolist() == [0, 7, 3, 5]
    uniform, eplb, pymoe = placements(W8, gpus=4, redundant=4)
    assert gpu_loads(eplb, W8).tolist() == [[100, 105, 90, 105]]
    assert sorted(gpu_loads(pymoe, W8)[0].tolist()) == [95, 100, 100, 105]  # A, B, C, D: 100 100 95 105
    assert imbalance(eplb, W8) == pytest.approx(1.05) and imbalance(pymoe, W8) == pytest.approx(1.05)


def test_refinement_by_hand():
    """Where greedy packing is not optimal: 10 6 5 5 4 4 on 2 GPUs, 3 each. Greedy: 10 A, 6 B, 5 B (11), 5 A (15),
    4 B (15), 4 A (19, B is full): 19 / 15, imbalance 19 / 17 = 1.118. The swap of A's 5 with B's 4 gives 18 / 16:
    18 / 17 = 1.059, the optimum (10 + x + y = 17 has no solution among 6 5 5 4 4)."""
    w = np.array([[10, 6, 5, 5, 4, 4]], dtype=float)
    _, eplb, pymoe = placements(w, gpus=2)
    assert imbalance(eplb, w) == pytest.approx(19 / 17) and imbalance(pymoe, w) == pytest.approx(18 / 17)
    assert sorted(pymoe.phy2log[0].tolist()) == list(range(6))  # a permutation: every expert once


def test_hierarchical_keeps_groups_on_a_node():
    """W8 in 4 groups of 2 on 2 nodes x 2 GPUs. Group loads 100 100 80 120: 120 (g3) N0, 100 (g0) N1, 100 (g1) N1,
    80 (g2) N0 -> node 0 holds experts 4-7, node 1 experts 0-3; within each node the packing gives 100 per GPU."""
    p = rebalance(W8, 8, groups=4, nodes=2, gpus=4)
    assert sorted(p.phy2log[0, :4].tolist()) == [4, 5, 6, 7] and sorted(p.phy2log[0, 4:].tolist()) == [0, 1, 2, 3]
    assert gpu_loads(p, W8).tolist() == [[100, 100, 100, 100]]


def test_refine_never_worse_on_random_loads():
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.zipf(1.3, size=(3, 32)).astype(float)
        _, eplb, pymoe = placements(w, gpus=4, redundant=4)
        assert imbalance(pymoe, w) <= imbalance(eplb, w) + 1e-12
        assert (pymoe.logcnt(32) == eplb.logcnt(32)).all()


def hand_trace():
    """top-1, 1 MoE layer, 2 experts, 4 decode tokens routed 0 0 1 0."""
    e = np.array([0, 0, 1, 0], dtype=np.uint16)[:, None, None]
    meta = {"model": "hand", "n_layers": 1, "n_experts": 2, "k": 1, "prompt_lengths": [0], "n_requests": 1,
            "n_forwards": 4, "first_moe_layer": 2}
    return Trace(e, np.ones_like(e, dtype=np.float16), np.ones(4, np.uint8), np.zeros(4, np.int32),
                 np.arange(4, dtype=np.int32), meta)


def test_batched_loads_by_hand():
    """Per batch of 2 tokens, expert i on GPU i: batch 1 is 2 : 0 (max 2, mean 1), batch 2 is 1 : 1 (max 1, mean 1):
    imbalance (2 + 1) / (1 + 1) = 1.5; all four tokens at once, 3 : 1 -> 3 / 2 = 1.5 too; with a batch of 4 the same."""
    t = hand_trace()
    assert trace_counts(t, "decode", 2).tolist() == [[[2, 0]], [[1, 1]]]
    p = Placement("x", np.array([[0, 1]]), gpus=2)
    assert imbalance(p, trace_counts(t, "decode", 2)) == pytest.approx(1.5)
    assert imbalance(p, trace_counts(t, "decode")) == pytest.approx(1.5)


def sglang_load(path, num_hidden_layers, num_logical, ep_size, redundant):
    """What SGLang's loader requires of the file (python/sglang/srt/eplb/expert_location.py): the dict's keys become
    keyword arguments of init_by_mapping(server_args, model_config, physical_to_logical_map), so that must be the only
    key; the tensor is
    [num_layers, num_logical + redundant] (num_layers = num_hidden_layers, dense layers included), divisible by the
    EP size; _compute_logical_to_all_physical_map indexes every value as a logical expert."""
    data = json.loads(open(path).read())
    assert list(data) == ["physical_to_logical_map"]
    m = np.array(data["physical_to_logical_map"])
    assert m.dtype.kind == "i" and m.shape == (num_hidden_layers, num_logical + redundant)
    assert m.shape[1] % ep_size == 0 and m.min() >= 0 and m.max() < num_logical
    return m


def test_sglang_file_schema(tmp_path):
    t = hand_trace()  # its MoE layer is model layer 2: two dense layers lead
    path = tmp_path / "p.json"
    r = run_pymoe_here("placement", str(_save(t, tmp_path)), "--gpus", "2", "--redundant", "2", "-o", str(path))
    assert r.returncode == 0, r.stderr
    m = sglang_load(path, num_hidden_layers=3, num_logical=2, ep_size=2, redundant=2)
    assert m[:2].tolist() == [[0, 1, 0, 1]] * 2  # the dense layers: the trivial row
    assert sorted(set(m[2].tolist())) == [0, 1]  # every logical expert has a physical one
    write_sglang(tmp_path / "c.json", None, np.array([[3, 1]]), first_moe_layer=2, form="counts")
    assert json.loads((tmp_path / "c.json").read_text()) == {"logical_count": [[0, 0], [0, 0], [3, 1]]}


def _save(trace, tmp_path):
    path = tmp_path / "t.npz"
    trace.save(path)
    return path


def rows_of(out):
    return {ln.split()[0]: ln.split()[1:4] for ln in out.splitlines() if ln.strip().startswith(("in-", "held-"))}


def test_cli_placement_table_and_errors(tmp_path):
    """The hand trace (expert 0, 0, 1, 0) on 2 GPUs, one expert each: 3 : 1 -> max 3 / mean 2 = 1.500 whatever the
    placement. Held out: placed on tokens 0 0, measured on 1 0 -> 1 : 1 = 1.000. With 2 redundant: expert 0 gets two
    more replicas (3 -> 1.5 -> 1 per replica), four physical experts of load 1, two per GPU: 1.000; the uniform
    placement (0 1 0 1) gives each GPU one replica of each: 1.5 + 0.5 = 2 each, 1.000 too."""
    path = _save(hand_trace(), tmp_path)
    r = run_pymoe_here("placement", str(path), "--gpus", "2")
    assert r.returncode == 0, r.stderr
    assert "uniform" in r.stdout and "eplb" in r.stdout and "pymoe" in r.stdout
    assert rows_of(r.stdout) == {"in-sample": ["1.500"] * 3, "held-out": ["1.000"] * 3}
    r = run_pymoe_here("placement", str(path), "--gpus", "2", "--redundant", "2")
    assert rows_of(r.stdout)["in-sample"] == ["1.000"] * 3
    for args in (("--gpus", "3"), ("--gpus", "2", "--nodes", "4")):
        r = run_pymoe_here("placement", str(path), *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("pymoe: error:")
    with pytest.raises(PymoeError):
        placements(np.ones((1, 8)), gpus=3)


def test_placement_from_a_heat_file(tmp_path):
    """A routing-heat JSON (no order): in-sample only. W8's heat on 4 GPUs: uniform 1.200, EPLB and pymoe 1.000."""
    path = tmp_path / "heat.json"
    path.write_text(json.dumps({"heat": W8.astype(int).tolist()}))
    r = run_pymoe_here("placement", str(path), "--gpus", "4")
    assert r.returncode == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("in-sample")).split()
    assert row[1:] == ["1.200", "1.000", "1.000"] and "held-out" not in r.stdout
    r = run_pymoe_here("placement", str(path), "--gpus", "4", "--batch", "2")
    assert r.returncode == 2 and "--batch" in r.stderr
