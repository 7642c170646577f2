"""The expert slot cache on the CPU backend: results never change, the accounting adds up, pre-fill and sizing."""
import numpy as np
import pytest

import pymoe
from conftest import run_pymoe
from pymoe.backends.cuda import cuda_available
from pymoe.cache import SlotCache
from pymoe.errors import PymoeError

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]
N_NEW = 12


def greedy(engine):
    return list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))


@pytest.fixture(scope="module")
def reference_tokens(tiny_model):
    return {mix: greedy(pymoe.load(tiny_model("qwen3moe", mix))) for mix in ("f32", "q2_k")}


@pytest.mark.parametrize("mix", ["f32", "q2_k"])
@pytest.mark.parametrize("policy, pcie_frac", [("lru", 1.0), ("lru", 0.0), ("lru", 0.4), ("lfu", 0.4),
                                               ("pinned-lru", 0.4), ("static", 0.4)])
def test_cache_never_changes_results(tiny_model, reference_tokens, mix, policy, pcie_frac):
    path = tiny_model("qwen3moe", mix)
    cfg = pymoe.load(path).config
    profile = None
    if policy in ("static", "pinned-lru"):
        from pymoe.profile import Profile

        profile = Profile.from_heat(np.arange(cfg.n_layers * cfg.n_expert).reshape(cfg.n_layers, cfg.n_expert))
    for slots in (cfg.n_layers, cfg.n_layers * cfg.n_expert // 2, cfg.n_layers * cfg.n_expert):
        engine = pymoe.load(path, cache_slots=slots, policy=policy, pcie_frac=pcie_frac, profile=profile)
        assert greedy(engine) == reference_tokens[mix], (policy, slots, pcie_frac)
        c = engine.cache.stats.counts["decode"]
        assert c["lookups"] == c["hits"] + c["spill"] + c["cpu"]
        assert c["lookups"] == (N_NEW - 1) * cfg.n_layers * cfg.n_expert_used
        if slots == cfg.n_layers * cfg.n_expert and policy != "static":
            assert c["evicted"] == 0
        misses = c["spill"] + c["cpu"]
        if misses:
            assert abs(c["spill"] - pcie_frac * misses) <= 1  # the split follows pcie_frac exactly


def test_slot_bytes_equal_host_bytes_after_promotion(tiny_model):
    engine = pymoe.load(tiny_model("qwen3moe", "q2_k"), cache_slots=3, policy="lru")
    greedy(engine)
    cache = engine.cache
    assert isinstance(cache, SlotCache)
    resident = np.argwhere(cache.residency >= 0)
    assert len(resident) == 3  # LRU fills every slot
    for layer, e in resident:
        slot = int(cache.residency[layer, e])
        ex_slot, ex_host = cache.pool.view(slot, int(layer), int(e)), engine.file.expert(int(layer), int(e))
        assert ex_slot.where == "slot" and ex_slot.slot == slot
        assert not np.shares_memory(ex_slot.gate, engine.file.reader.data)  # served from the pool
        for p in ("gate", "up", "down"):
            np.testing.assert_array_equal(getattr(ex_slot, p), getattr(ex_host, p))


def test_prefill_never_promotes(tiny_model):
    engine = pymoe.load(tiny_model("qwen3moe", "f32"), cache_slots=4, policy="lru")
    engine.logits(PROMPT)
    c = engine.cache.stats.counts["prefill"]
    assert c["staged"] == c["lookups"] and c["promoted"] == 0
    assert (engine.cache.residency < 0).all()


def test_lru_small_cache_evicts(tiny_model):
    engine = pymoe.load(tiny_model("qwen3moe", "f32"), cache_slots=2, policy="lru")
    greedy(engine)
    c = engine.cache.stats.counts["decode"]
    assert c["promoted"] > 2 and c["evicted"] == c["promoted"] - 2
    assert (engine.cache.residency >= 0).sum() == 2


def test_bad_cache_options(tiny_model):
    path = tiny_model("qwen3moe", "f32")
    with pytest.raises(PymoeError, match="cache slots"):
        pymoe.load(path, cache_slots=0)
    with pytest.raises(PymoeError, match="belady"):
        pymoe.load(path, cache_slots=4, policy="belady")
    with pytest.raises(PymoeError, match="pcie_frac"):
        pymoe.load(path, cache_slots=4, pcie_frac=1.5)


def test_run_reports_spill_cpu_and_promotions(tiny_model):
    r = run_pymoe("run", tiny_model("qwen3moe", "q2_k"), "-p", "def f(x):", "-n", "16", "--cache-slots", "4",
                  "--pcie-frac", "0.5")
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.startswith("pymoe run:")]
    assert any("expert cache: 4 slots" in l for l in lines)
    hit_line = [l for l in lines if "hit rate" in l][0]
    assert "read over PCIe" in hit_line and "computed on the CPU" in hit_line and "promoted" in hit_line


def test_miss_paths_are_tagged_for_the_backend(tiny_model):
    """expert() says where the bytes are: a slot, or the miss path this very lookup chose (a promoted expert is
    still served by its miss path this time; its slot copy is for the next lookup)."""
    engine = pymoe.load(tiny_model("qwen3moe", "q2_k"), cache_slots=2, policy="lru", pcie_frac=0.5)
    cache = engine.cache
    cache.lookup(0, np.array([[1, 2]]), "decode")  # two misses, both promoted
    assert {cache.expert(0, 1).where, cache.expert(0, 2).where} == {"spill", "cpu"}
    cache.lookup(0, np.array([[1, 3]]), "decode")  # 1 hits; 3 misses
    ex1 = cache.expert(0, 1)
    assert ex1.where == "slot" and ex1.slot == cache.residency[0, 1]
    assert cache.expert(0, 3).where in ("spill", "cpu")
    cache.lookup(1, np.array([[5]]), "prefill")
    assert cache.expert(1, 5).where == "staged"


@pytest.mark.skipif(cuda_available(), reason="a GPU is present")
def test_cuda_backend_without_a_gpu_is_a_one_line_error(tiny_model, monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")  # the CUDA test modules switch the simulator on for this process
    r = run_pymoe("run", tiny_model("qwen3moe", "q2_k"), "-p", "hi", "-n", "2", "--backend", "cuda")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("pymoe: error: backend 'cuda': no CUDA")
    assert "Traceback" not in r.stderr
    r = run_pymoe("probe", tiny_model("qwen3moe", "q2_k"), "--repeats", "1")
    assert r.returncode == 0 and "CPU expert rate:" in r.stdout and "PCIe probe: no CUDA GPU found" in r.stdout
