"""Router lookahead (experts/prefetch.py): the precision/recall bookkeeping on a hand-made case, results untouched
by it on every family (with and without a slot pool to prefetch into), its measured quality on the demo model against
chance, madvise over the right bytes, and the slot prefetch (cache.SlotCache.prefetch) by hand: budget, the insert
cap it shares with the layer's misses, second-miss admission, evictions, the bytes, the prefetch-hit counter. The
same prefetch on the CUDA backend's copy stream: tests/test_cuda_backend.py (the simulator)."""
import numpy as np
import pytest

import pymoe
from conftest import ARCHS
from pymoe.experts.prefetch import Lookahead

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]


def empty_pool(e, slots, admit="all", max_inserts=0, policy="lru"):
    """A slot pool for engine `e` that starts empty (the engine fills its own at start-up: SlotCache.fill), for the
    by-hand tests below."""
    from pymoe.experts.cache import SlotCache
    from pymoe.experts.policies import make_admission

    e.model.cache = SlotCache(e.file, slots, policy=policy, pcie_frac=1.0, admission=make_admission(admit, max_inserts))
    return e.model.cache


def test_scores_by_hand(tiny_model):
    """Two tokens, K = 2, K' = 3: token 0 predicted {1, 2, 3}, chose {2, 3}: 2 hits; token 1 predicted {4, 5, 6},
    chose {0, 6}: 1 hit. precision = 3 / 6, recall = 3 / 4."""
    e = pymoe.load(tiny_model("qwen3moe", "f32"))
    la = Lookahead(e.model, k=3, advise=False)
    la.predicted[1] = np.array([[1, 2, 3], [4, 5, 6]])
    la.chosen(1, np.array([[3, 2], [0, 6]]))
    assert la.per_layer() == [(1, 0.5, 0.75)]
    la.chosen(1, np.array([[0, 1]]))  # no prediction waiting for layer 1: nothing counted
    assert la.per_layer() == [(1, 0.5, 0.75)]


@pytest.mark.parametrize("arch", ARCHS)
def test_lookahead_never_changes_results(tiny_model, arch):
    path = tiny_model(arch, "q2_k")
    want = list(pymoe.load(path).generate(PROMPT, max_tokens=8, stop_at_eos=False))
    e = pymoe.load(path)
    e.model.lookahead = la = Lookahead(e.model)
    assert list(e.generate(PROMPT, max_tokens=8, stop_at_eos=False)) == want
    assert la.per_layer() and all(0.0 <= p <= 1.0 and 0.0 <= r <= 1.0 for _, p, r in la.per_layer())
    cfg = e.config  # the CPU backend's slot pool (a GPU's, emulated in RAM): the lookahead copies experts into it
    e = pymoe.load(path, cache_slots=cfg.n_layers, pcie_frac=1.0)  # (filled at start-up: small, so some miss)
    e.model.lookahead = la = Lookahead(e.model)
    assert list(e.generate(PROMPT, max_tokens=8, stop_at_eos=False)) == want
    assert e.cache.stats.counts["decode"]["prefetched"] > 0


def test_demo_model_is_predicted_far_above_chance():
    """The demo model, 128 sampled tokens: the next layer's router applied one layer early finds most of the experts
    it will choose. Measured 2026-12-01: recall 77.9% at K' = K = 4 (256 tokens, seed 0), chance K / E = 12.5%;
    bound 50%, 4x chance. Prefetch advice covers each predicted expert's three byte ranges, inside the file."""
    from pymoe import demo

    e = pymoe.load(demo.demo_model())
    e.model.lookahead = la = Lookahead(e.model)
    calls = []
    la._map = (type("Recorder", (), {"madvise": lambda self, *a: calls.append(a)})(), la._map[1])
    list(e.generate(demo.DEMO_PROMPT, max_tokens=128, stop_at_eos=False, temperature=0.7, seed=0))
    hits = sum(la.hits[i] for i, _, _ in la.per_layer())
    chosen = sum(la.n_chosen[i] for i, _, _ in la.per_layer())
    assert hits / chosen >= 0.5, la.line()
    import mmap
    import os

    size = os.path.getsize(demo.demo_model())
    assert calls and all(opt == mmap.MADV_WILLNEED and start % mmap.PAGESIZE == 0 and 0 <= start < start + n <= size
                         for opt, start, n in calls)
    assert 0 < la.advised_bytes <= sum(n for _, _, n in calls)  # the ranges grow to page starts, never shrink


def test_ranked_by_hand():
    """pred [T=2, K'=2] = [[1, 2], [2, 3]]: 2 is predicted twice; 1 and 3 once, 1 at rank 0 and 3 at rank 1."""
    assert Lookahead.ranked(np.array([[1, 2], [2, 3]])) == [2, 1, 3]
    assert Lookahead.ranked(np.array([[7, 4, 5]])) == [7, 4, 5]  # one token: the router's own order


def test_slot_prefetch_by_hand(tiny_model):
    """Tiny model (2 layers x 8 experts), 3 slots, LRU, at most 1 insertion per layer-step. Prefetching [3, 5] for
    layer 1 places 3 in slot 0 (the lowest free) and spends layer 1's next step's one insertion, so 5 is refused;
    layer 1's lookup of [3, 5] then hits 3 (a prefetch hit) and misses 5 without promoting it (the cap is spent);
    the next lookup's hit on 3 is a plain hit. Slot 0 holds expert 3's bytes exactly."""
    from pymoe.gguf.loader import EXPERT_PROJ

    e = pymoe.load(tiny_model("qwen3moe", "f32"))
    c = empty_pool(e, 3, max_inserts=1)
    assert c.prefetch(1, [3, 5]) == 1
    assert (c.residency[1, 3], c.residency[1, 5]) == (0, -1)
    host = e.file.expert(1, 3)
    assert np.array_equal(c.pool.read(0), np.concatenate([getattr(host, p).reshape(-1) for p in EXPERT_PROJ]))
    c.lookup(1, np.array([[3, 5]]), "decode")
    c.finish(1)
    d = c.stats.counts["decode"]
    assert (d["lookups"], d["hits"], d["prefetch_hits"], d["spill"], d["promoted"], d["prefetched"]) == (2, 1, 1, 1, 0, 1)
    c.lookup(1, np.array([[3, 6]]), "decode")  # a new step: 6 is promoted into slot 1
    assert (d["hits"], d["prefetch_hits"], d["promoted"], c.residency[1, 6]) == (2, 1, 1, 1)
    assert c.prefetch(1, [3, 6, 5], limit=1) == 1  # 3 and 6 are resident: the one copy goes to 5, in slot 2
    assert c.residency[1, 5] == 2 and d["evicted"] == 0
    c.lookup(1, np.array([[5, 6]]), "decode")  # the step the copy was for: 5 is a prefetch hit
    assert (d["hits"], d["prefetch_hits"]) == (4, 2)
    assert c.prefetch(0, [0]) == 1  # the pool is full: LRU's victim is 3, the least recently used
    assert (c.residency[0, 0], c.residency[1, 3], d["evicted"], d["prefetched"]) == (0, -1, 1, 3)


def test_prefetch_admission_second_miss(tiny_model):
    """--admit second-miss: a prediction is taken only if its next miss would be (it missed lately), and a refused
    prediction is not remembered as a miss."""
    e = pymoe.load(tiny_model("qwen3moe", "f32"))
    c = empty_pool(e, 4, admit="second-miss")
    assert c.prefetch(1, [3]) == 0 and c.key(1, 3) not in c.table.missed
    c.lookup(1, np.array([[3, 4]]), "decode")  # both miss for the first time: refused, remembered
    assert c.stats.counts["decode"]["promoted"] == 0 and c.key(1, 3) in c.table.missed
    assert c.prefetch(1, [3]) == 1 and c.key(1, 3) not in c.table.missed
    c.lookup(1, np.array([[3, 4]]), "decode")  # 3 hits (prefetched), 4 misses a second time: promoted
    d = c.stats.counts["decode"]
    assert (d["hits"], d["prefetch_hits"], d["promoted"]) == (1, 1, 1)


def test_no_slot_pool_no_prefetch(tiny_model):
    """The CPU backend's default (no slot pool): nothing to copy into; the lookahead only advises the memory map."""
    e = pymoe.load(tiny_model("qwen3moe", "f32"))
    e.model.lookahead = la = Lookahead(e.model)
    list(e.generate(PROMPT, max_tokens=4, stop_at_eos=False))
    assert e.cache.prefetch(1, [0, 1]) == 0 and e.cache.stats.counts["decode"]["prefetched"] == 0
    assert "prefetched" not in la.line() and la.advised_bytes > 0


def test_prefill_never_prefetches(tiny_model):
    """A prompt's lookups never promote (they would flush the decode working set), nor does the lookahead then."""
    e = pymoe.load(tiny_model("qwen3moe", "f32"), cache_slots=8, pcie_frac=1.0)
    before = e.cache.residency.copy()  # filled at start-up
    e.model.lookahead = la = Lookahead(e.model)
    e.model.prefill(PROMPT, e.model.new_kv(64))
    assert la.per_layer()  # predicted and scored ...
    assert (e.cache.residency == before).all() and e.cache.stats.counts["decode"]["prefetched"] == 0  # ... not copied
