"""Expert parallelism on paper (pymoe/experts/scale.py): one node is the single-card planner, the network and
expert terms of two and four nodes worked by hand, and the --network parser. Arithmetic only."""
import pytest

from pymoe.errors import PymoeError
from pymoe.experts.plan import CostModel, ModelFacts, decode_time_per_token
from pymoe.experts.scale import Network, Node, distinct_experts, ep_row, parse_network

# 2 MoE layers x 8 experts, top-2, slot 1e6 B, n_embd 1000; one GPU per node: 10e6 B, 1e11 B/s, PCIe 1e10 B/s
MODEL = ModelFacts("m", n_layers=2, n_expert=8, k=2, slot_bytes=10**6, n_embd=1000, dense_bytes_per_token=10**6)
NODE = Node(1, 10 * 10**6, 1e11, 1e10, 2 * 10**6)
NET = Network(1e9, 5e-6, act_bytes=2)


def test_one_node_one_gpu_batch_one_is_the_planner():
    """8e6 B free -> 8 slots of 16 (50%), hit = coverage (uniform): the single-card cost model's terms exactly."""
    row = ep_row(MODEL, NODE, NET, 1, 1, fixed_s=1e-3)
    t = decode_time_per_token(0.5, MODEL, CostModel(1e11, 1e10, 1e-3))
    assert (row.slots_per_node, row.coverage, row.network_s) == (8, 0.5, 0.0)
    assert row.step_s == pytest.approx(t.total_s)


def test_two_and_four_nodes_by_hand():
    """Batch 4. Two nodes: each holds 8 of the 16 experts and has 8 slots: coverage 100%. Per layer a node touches
    8 / 2 x (1 - (6/8)^4) = 4 x 0.68359 = 2.734 experts -> 2.734e6 B / 1e11 = 27.34 us; x 2 layers = 54.69 us.
    Network per layer: each node sends 4 / 2 tokens x 2 copies x 1/2 off-node x 1000 x 2 B = 4000 B: 4 us + 5 us
    latency, twice (dispatch, combine) = 18 us; x 2 layers = 36 us. Dense 1e6 / 1e11 = 10 us; fixed 1 ms.
    Four nodes: 8 / 4 x 0.68359 = 1.367 experts per layer per node -> 13.67 us, 27.34 us for 2 layers;
    sent 1 x 2 x 3/4 x 2000 B = 3000 B:
    2 x (5 + 3) us x 2 layers = 32 us."""
    two = ep_row(MODEL, NODE, NET, 2, 4, fixed_s=1e-3)
    assert two.coverage == 1.0 and two.hit_rate == 1.0
    assert distinct_experts(8, 2, 4) == pytest.approx(8 * (1 - 0.75 ** 4))
    assert two.experts_s == pytest.approx(2 * 4 * (1 - 0.75 ** 4) * 1e6 / 1e11)
    assert two.network_s == pytest.approx(36e-6) and two.dense_s == pytest.approx(10e-6)
    assert two.tok_s_total == pytest.approx(4 / (1e-3 + 10e-6 + 36e-6 + 54.6875e-6))
    four = ep_row(MODEL, NODE, NET, 4, 4, fixed_s=1e-3)
    assert four.experts_s == pytest.approx(27.34375e-6) and four.network_s == pytest.approx(32e-6)


@pytest.mark.parametrize("text,bw,lat", [("400Gbit,5us", 50e9, 5e-6), ("3.2Tbit, 0.05ms", 400e9, 50e-6),
                                         ("25GB,10us", 25e9, 10e-6)])
def test_parse_network(text, bw, lat):
    n = parse_network(text)
    assert n.bw == pytest.approx(bw) and n.latency_s == pytest.approx(lat)


def test_parse_network_rejects_junk():
    with pytest.raises(PymoeError, match="--network"):
        parse_network("fast")
