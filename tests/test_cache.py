"""The expert slot cache on the CPU backend: results never change, the accounting adds up, pre-fill and sizing."""
import numpy as np
import pytest

import pymoe
from conftest import ARCHS, run_pymoe, run_pymoe_here
from pymoe.backends.cuda import cuda_available
from pymoe.demo.tinymodel import make_config
from pymoe.experts.cache import SlotCache
from pymoe.errors import PymoeError

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]
N_NEW = 12


def greedy(engine):
    return list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))


@pytest.fixture(scope="module")
def reference_tokens(tiny_model):
    return {mix: greedy(pymoe.load(tiny_model("qwen3moe", mix))) for mix in ("f32", "q2_k")}


@pytest.mark.parametrize("mix", ["f32", "q2_k"])
@pytest.mark.parametrize("policy, pcie_frac", [("lru", 1.0), ("lru", 0.0), ("lru", 0.4), ("lfu", 0.4), ("lfru", 0.4),
                                               ("pinned-lru", 0.4), ("static", 0.4),
                                               ("llamacpp", 0.4), ("arc", 0.4), ("s3fifo", 0.4), ("s3fifo-c7", 0.4),
                                               ("lirs", 0.4), ("window", 0.4), ("window-profile", 0.4),
                                               ("cooc", 0.4), ("cooc-profile", 0.4), ("duel", 0.4),
                                               ("duel-profile", 0.4), ("reuse", 0.4), ("reuse-profile", 0.4),
                                               ("duel-reuse", 0.4), ("duel-reuse-profile", 0.4)])
def test_cache_never_changes_results(tiny_model, reference_tokens, mix, policy, pcie_frac):
    path = tiny_model("qwen3moe", mix)
    cfg = pymoe.load(path).config
    profile = None
    if policy.endswith("-profile") or policy in ("static", "pinned-lru"):  # -profile: with a prior
        from pymoe.experts.profile import Profile

        profile = Profile.from_heat(np.arange(cfg.n_layers * cfg.n_expert).reshape(cfg.n_layers, cfg.n_expert))
    policy = policy.removesuffix("-profile")
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
    before = engine.cache.residency.copy()  # filled at start-up
    engine.logits(PROMPT)
    c = engine.cache.stats.counts["prefill"]
    assert c["staged"] + c["hits"] == c["lookups"] and c["staged"] > 0 and c["promoted"] == c["evicted"] == 0
    np.testing.assert_array_equal(engine.cache.residency, before)


def test_lru_small_cache_evicts(tiny_model):
    engine = pymoe.load(tiny_model("qwen3moe", "f32"), cache_slots=2, policy="lru")
    greedy(engine)
    c = engine.cache.stats.counts["decode"]
    assert c["promoted"] > 2 and c["evicted"] == c["promoted"]  # the pool starts full: each promotion evicts
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
    r = run_pymoe_here("run", tiny_model("qwen3moe", "q2_k"), "-p", "def f(x):", "-n", "16", "--cache-slots", "4",
                  "--pcie-frac", "0.5")
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.startswith("pymoe run:")]
    assert any("expert cache: 4 slots" in l for l in lines)
    hit_line = [l for l in lines if "hit rate" in l][0]
    # the CPU backend: no PCIe anywhere; the misses are computed from host memory, split as a GPU would split them
    assert "PCIe" not in hit_line and "misses computed in place from host memory" in hit_line
    assert "spill, " in hit_line and " cpu)" in hit_line and "promoted" in hit_line


def test_no_pool_reports_no_cache(tiny_model):
    """With no slot pool there is no cache: no hit rate (it used to say 100%), every expert read in place from host
    memory (counted as "host", neither a hit nor a miss), and never PCIe on the CPU backend."""
    engine = pymoe.load(tiny_model("qwen3moe", "f32"))
    greedy(engine)
    c = engine.cache.stats.counts["decode"]
    n = (N_NEW - 1) * engine.config.n_layers * engine.config.n_expert_used
    assert c["lookups"] == c["host"] == n and c["hits"] == 0
    line = engine.last_stats.cache_line()
    assert line == f"decode expert cache: none ({n} routed experts read in place from host memory)"


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


SERVED_AS = {"slot": "hits", "spill": "spill", "cpu": "cpu"}  # ExpertBytes.where -> the counter it belongs to


def test_each_batch_row_is_served_by_the_path_counted_for_it(tiny_model):
    """Batched decode (--parallel N): one lookup of N rows. Every row's experts must be served by the path counted
    for that row: a "cpu" expert handed to a GPU backend as a slot or as host bytes would go over PCIe while the
    telemetry says cpu. Checked on the CPU backend through the `where` tags of SlotCache.expert()."""
    from pymoe.engine.batch import RowCounts

    engine = pymoe.load(tiny_model("qwen3moe", "f32"), cache_slots=3, policy="lru", pcie_frac=0.5)
    rc = RowCounts(engine.cache, 2)
    ids = np.array([[1, 2], [3, 4]])  # [N=2, K]: 4 misses, 4 promotions into 3 slots (expert 1 evicted again)
    rc.lookup(0, ids, "decode")
    for j, row in enumerate(ids):
        served = [SERVED_AS[rc.expert(0, int(e)).where] for e in row]
        counted = [name for name in ("hits", "spill", "cpu") for _ in range(rc.rows[j][name])]
        assert sorted(served) == sorted(counted), (j, served, rc.rows[j])


def test_a_slot_is_not_overwritten_under_an_expert_served_from_it(tiny_model):
    """One slot, two rows: row 0 hits expert 1 in slot 0, row 1 misses expert 2, which the policy promotes into slot
    0 (evicting 1). Expert 1 is still served from slot 0, with its own bytes: the promotion's copy lands at
    finish(), after this call's experts are computed (on a GPU it waits for their kernels)."""
    engine = pymoe.load(tiny_model("qwen3moe", "q2_k"), cache_slots=1, policy="lru")
    cache, host = engine.cache, engine.file.expert
    cache.lookup(0, np.array([[1]]), "decode")
    cache.finish(0)
    cache.lookup(0, np.array([[1], [2]]), "decode")
    ex1 = cache.expert(0, 1)
    assert (ex1.where, ex1.slot) == ("slot", 0) and cache.expert(0, 2).where in ("spill", "cpu")
    np.testing.assert_array_equal(ex1.down, host(0, 1).down)
    cache.finish(0)
    assert cache.residency[0, 2] == 0 and cache.residency[0, 1] == -1
    np.testing.assert_array_equal(cache.pool.view(0, 0, 2).down, host(0, 2).down)


def test_decode_batch_serves_rows_as_counted(tiny_model):
    """The same over whole batched steps: for every row, the experts the backend computed (tagged slot / spill /
    cpu) add up to that row's counters (hits / spill / cpu)."""
    from pymoe.engine.batch import decode_batch

    engine = pymoe.load(tiny_model("qwen3moe", "f32"), cache_slots=3, policy="lru", pcie_frac=0.5)
    model = engine.model
    kvs = [model.new_kv(32) for _ in range(3)]
    tokens = [int(model.prefill(np.asarray(p), kv)[-1].argmax()) for p, kv in zip(([1, 2, 3], [40, 50], [7]), kvs)]
    served = [dict.fromkeys(SERVED_AS.values(), 0) for _ in kvs]
    inner = engine.backend.moe_experts

    def moe_experts(experts, types, x, ids, w, ffn=None):  # what the backend is handed, row by row
        for j, row in enumerate(ids):
            for e in row.tolist():
                served[j][SERVED_AS[experts[e].where]] += 1
        return inner(experts, types, x, ids, w, ffn)

    engine.backend.moe_experts = moe_experts
    rows = [{} for _ in kvs]
    for _ in range(4):
        tokens = decode_batch(model, tokens, kvs, rows).argmax(axis=1).tolist()
    for j in range(len(kvs)):
        assert served[j] == {name: rows[j][name] for name in served[j]}, (j, served[j], rows[j])
    assert sum(r["spill"] for r in rows) > 0 and sum(r["cpu"] for r in rows) > 0


def test_engine_uses_the_pcie_frac_the_probe_reports_without_a_gpu(tiny_model):
    """No GPU: `pymoe probe` says pcie_frac 0 (every miss on the CPU); the engine, given no --pcie-frac, must split
    its misses the same way (it used 1: every miss "read over PCIe" on a machine with no PCIe link to a GPU)."""
    from pymoe.experts.probe import probe

    path = tiny_model("qwen3moe", "q2_k")
    engine = pymoe.load(path, backend="cpu", cache_slots=4)
    assert engine.cache.pcie_frac == probe(engine.file, engine.backend, repeats=1).pcie_frac == 0.0
    greedy(engine)
    c = engine.cache.stats.counts["decode"]
    assert c["spill"] == 0 and c["cpu"] > 0
    r = run_pymoe("probe", path, "--backend", "cpu", "--repeats", "1")
    assert r.returncode == 0 and "-> pcie_frac 0 " in r.stdout, r.stdout
    r = run_pymoe_here("run", path, "--backend", "cpu", "-p", "hi", "-n", "2", "--cache-slots", "4")
    assert r.returncode == 0 and "pcie_frac 0\n" in r.stderr, r.stderr


def test_unknown_policy_is_a_one_line_error(tiny_model):
    r = run_pymoe("run", tiny_model("qwen3moe", "f32"), "-p", "hi", "-n", "2", "--cache-slots", "4", "--policy", "foo")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pymoe: error: ") and "--policy" in lines[0], lines
    assert all(name in lines[0] for name in ("static", "lru", "lfu", "pinned-lru")) and "'foo'" in lines[0]
    with pytest.raises(PymoeError, match="--policy"):  # the library says the same, pool or not
        pymoe.load(tiny_model("qwen3moe", "f32"), policy="foo")


@pytest.mark.parametrize("slots", [0, 3])
def test_heat_counts_each_decode_lookup_of_each_expert(tiny_model, slots):
    """cache.heat [L, E]: every (token, expert) pair of a decode lookup counted at its expert, repeats across rows
    (a batched step) counted each time; prefill and the MTP block's layers (index >= L) left out."""
    engine = pymoe.load(tiny_model("qwen3moe", "q2_k"), cache_slots=slots or None, policy="lru")
    cache, cfg = engine.cache, engine.config
    E, L = cfg.n_expert, cfg.n_layers
    rng = np.random.default_rng(0)
    want = np.zeros((L, E), np.int64)
    for step in range(20):
        layer = int(rng.integers(0, L))
        ids = np.stack([rng.permutation(E)[:cfg.n_expert_used] for _ in range(int(rng.integers(1, 4)))])  # [T, K]
        phase = "prefill" if step % 5 == 0 else "decode"
        cache.lookup(layer, ids, phase)
        if phase == "decode":
            np.add.at(want[layer], ids.ravel(), 1)
    if not slots:  # (a slot cache sizes its tables for the MTP block's layers when the file has one)
        cache.lookup(L, ids, "decode")  # an MTP block's layer: not in the map
    np.testing.assert_array_equal(cache.heat, want)


@pytest.mark.parametrize("arch", [a for a in ARCHS if make_config(a).n_dense_lead])
def test_slot_limits_count_the_experts_of_moe_layers_only(tiny_model, arch):
    """glm4moe, deepseek2 and dots1 lead with a dense layer (no experts): the pool's limit and coverage are
    len(moe_layers) x n_expert experts, not n_layers x n_expert, which counted the dense layer's nonexistent experts
    (glm4moe's tiny file: 3 layers, 2 of them MoE, 8 experts each; a pool of all 16 was logged as '66.7% of 24
    experts', and 24 slots allowed)."""
    path = tiny_model(arch, "f32")
    cfg = pymoe.load(path).config
    n = len(cfg.moe_layers) * cfg.n_expert
    assert cfg.n_dense_lead > 0 and n < cfg.n_layers * cfg.n_expert  # the file this test is about
    lines = []
    engine = pymoe.load(path, cache_slots=n, log=lines.append)
    assert any(f"expert cache: {n} slots of " in x and f"(100.0% of {n} experts)" in x for x in lines), lines
    with pytest.raises(PymoeError, match=f"cache slots must be in 1..{n} "):
        pymoe.load(path, cache_slots=n + 1)
    assert pymoe.load(path, cache_gib=1024).cache.n_slots == n  # --cache-gib: capped at the experts there are
    r = run_pymoe_here("run", path, "-p", "hi", "-n", "2", "--cache-slots", str(n))
    assert r.returncode == 0 and f"(100.0% of {n} experts)" in r.stderr, r.stderr
    greedy(engine)
    assert engine.cache.stats.counts["decode"]["evicted"] == 0  # every expert fits: nothing is ever evicted


def test_every_lookup_reaches_the_policys_count(tiny_model):
    """LFU counts every lookup as a use: prefill misses (served without a slot), misses refused by `--admit
    second-miss` and by `--max-inserts`, admitted misses and hits. Its counts after a request equal the number of
    times each (layer, expert) was looked up, which the trace records (before, only hits and admitted-or-asked
    misses counted: prefill and refused misses were lost)."""
    engine = pymoe.load(tiny_model("qwen3moe", "f32"), cache_slots=3, policy="lfu", admit="second-miss",
                        max_inserts=1)
    rec = engine.record_trace()
    greedy(engine)
    keys = rec.trace().keys()
    want = dict(zip(*(a.tolist() for a in np.unique(keys, return_counts=True))))
    assert engine.cache.table.policy.count == want
    c = engine.cache.stats.counts
    assert c["prefill"]["staged"] > 0 and c["decode"]["spill"] + c["decode"]["cpu"] > c["decode"]["promoted"]  # refused


def test_slots_never_sit_empty(tiny_model):
    """Without a profile the pool is filled at start-up in policies.fill_order (expert 0 of every MoE layer, then
    expert 1, ...); with a profile, from it, then in that order for the slots it leaves. On the demo model with a
    slot for every expert a fresh run hits on every decode lookup (it hit 417 of 496, 84.1%: the experts' first uses
    missed)."""
    from pymoe import demo
    from pymoe.experts.policies import fill_order
    from pymoe.experts.profile import Profile

    lines = []
    e = pymoe.load(demo.DEMO_MODEL, cache_slots=128, log=lines.append)
    assert len(e.config.moe_layers) * e.config.n_expert == 128 and (e.cache.residency >= 0).all()
    assert any(x.startswith("pre-filled 128 of 128 slots in expert order (no profile)") and x.endswith("verified")
               for x in lines), lines
    list(e.generate(demo.DEMO_PROMPT, max_tokens=32, stop_at_eos=False))
    c = e.cache.stats.counts["decode"]
    assert c["lookups"] == 31 * 4 * 4 and c["hits"] / c["lookups"] >= 0.99 and c["promoted"] == 0
    # a smaller pool, a profile of 2 pairs: those first, then the stated order (glm4moe: layer 0 is dense; a
    # profile's layers are the MoE layers, experts/trace.py, so its layer 1 is the model's layer 2)
    path = tiny_model("glm4moe", "f32")
    cfg = pymoe.load(path).config
    assert fill_order([1, 2], 8)[:5] == [8, 16, 9, 17, 10]  # (layer 1, 0), (2, 0), (1, 1), (2, 1), (1, 2)
    profile = Profile(2, 8, np.array([[1, 7], [1, 3]]), [9, 5])  # ranks two pairs: (2, 7), then (2, 3)
    lines = []
    e = pymoe.load(path, cache_slots=5, profile=profile, log=lines.append)
    assert sorted(map(tuple, np.argwhere(e.cache.residency >= 0).tolist())) == [(1, 0), (1, 1), (2, 0), (2, 3),
                                                                                 (2, 7)], cfg.moe_layers
    assert any(x.startswith("pre-filled 5 of 5 slots from the profile, 3 of them in expert order") for x in lines)
    e = pymoe.load(path, cache_slots=16, profile=Profile.from_heat(np.arange(16)[::-1].reshape(2, 8)))  # all MoE
    assert (e.cache.residency[1:] >= 0).all() and (e.cache.residency[0] < 0).all()


def twin_caches(tiny_model, setting: str, max_inserts: int, window: int, spill_seed: int):
    """Two SlotCaches on the tiny qwen3moe Q2_K file under the default policy, pre-filled as the engine starts a
    pool, for the tests of the compiled paths: a setting starting "capped" has a per-step insert cap of max_inserts
    and forced spill 0.3 (seed spill_seed), "small" 5 slots and a profile's prior, others a third of the experts;
    live-gap windows of `window` lookups. -> (the file's config, [cache, cache])"""
    from pymoe.experts.policies import Admission
    from pymoe.experts.profile import Profile

    engine = pymoe.load(tiny_model("qwen3moe", "q2_k"))
    cfg = engine.config
    L, E = cfg.n_layers, cfg.n_expert
    kw = dict(policy="cooc", pcie_frac=0.4)
    slots = L * E // 3
    if setting.startswith("capped"):
        kw["admission"] = Admission(max_inserts=max_inserts)
    if setting.startswith("small"):
        slots = 5
        kw["profile"] = Profile.from_heat(np.arange(L * E).reshape(L, E))
    caches = [SlotCache(engine.file, slots, **kw) for _ in range(2)]
    for cache in caches:
        cache.fill(kw.get("profile"))  # as the engine starts a pool: full
        cache.gap.window = window
        if setting.startswith("capped"):
            cache.force_spill(0.3, seed=spill_seed)
    return cfg, caches


@pytest.mark.parametrize("setting", ["plain", "capped, forced spill, batched rows", "small pool, profile"])
def test_compiled_decode_lookups_are_the_loops(tiny_model, setting):
    """SlotCache.lookup's decode calls under the default policy run in one compiled call (`_compiled_lookup`:
    compiled_cooc.decode_step over one layer). Two caches on one file, one of them held to the Python loop, get the
    same calls: 300 random lookup calls (decode of 1 or 3 rows, and prompt chunks, whose lookups never promote,
    with finish() and end_prefill() between) -> after every call the same counters (the cache's and each row's),
    heat map, residency, pending copies, served paths, slot table (slots, hits, evictions, this step's inserts), miss-path
    credit, live-gap totals and open window, and policy scores to the bit. The settings reach each branch: a
    per-step insert cap and forced spill with batched rows; a pool of 5 slots with a profile's prior; and the live
    gap's window closing (window 64: it closes within some calls, which the loop then makes, and at the end of
    others)."""
    cfg, caches = twin_caches(tiny_model, setting, max_inserts=2, window=64, spill_seed=1)
    L, E, K = cfg.n_layers, cfg.n_expert, cfg.n_expert_used
    caches[1]._compiled_lookup = lambda *a: False  # the reference: the loop, pair by pair
    rng = np.random.default_rng(7)
    fast_calls = 0
    for call in range(300):
        layer = int(rng.integers(L))
        phase = "prefill" if rng.random() < 0.1 else "decode"
        T = 3 if (setting.startswith("capped") and phase == "decode") else (4 if phase == "prefill" else 1)
        ids = np.stack([rng.choice(E, K, replace=False, p=np.r_[np.full(E // 4, 3.0), np.ones(E - E // 4)] /
                                   (3 * (E // 4) + E - E // 4)) for _ in range(T)]).astype(np.int64)  # [T, K]
        rows = [[{} for _ in range(T)] for _ in caches] if T > 1 and phase == "decode" else [None, None]
        state, end = [], phase == "prefill" and rng.random() < 0.5
        for cache, r in zip(caches, rows):
            cache.finish(layer)
            before = cache.table.lookups
            cache.lookup(layer, ids, phase, r)
            state.append((cache.stats.counts, r, cache.heat.tolist(), cache.residency.tolist(), dict(cache._pending),
                          dict(cache._served), dict(cache.table.slot_of), cache.table.lookups - before,
                          cache.table.hits, cache.table.evictions, cache.table._inserts, cache._pcie_credit,
                          cache.gap.totals(), list(cache.gap.keys), cache.clock))
            if end:
                cache.end_prefill()
        assert state[0] == state[1], (setting, call)
        fast_calls += phase == "decode" and caches[0]._fast is not None
    p0, p1 = (c.table.policy for c in caches)
    assert p0.sc[:p1.n_keys].tolist() == p1.sc[:p1.n_keys].tolist()
    assert caches[0]._fast is not None and caches[0].gap.totals()["lookups"] > 64  # it ran, and windows closed


@pytest.mark.parametrize("setting", ["plain", "capped, forced spill, lookahead", "small pool, profile"])
def test_a_compiled_step_is_its_layer_calls(tiny_model, setting, monkeypatch):
    """SlotCache.lookup_step (a device step's lookups after it, compiled_cooc.decode_step) against what it stands
    for, lookup(layer, ids[m], "decode") then finish(layer) for each MoE layer in turn, each call through the
    interpreter's loop: two caches on one file, 200 random steps (1 or 2 rows; prompt chunks between, with
    end_prefill; in the lookahead setting, prefetches before some steps, which take the layer by layer path), and
    after every step the same counters, heat map, residency, served paths, slot table, credit, live gap (window
    48: it closes within some steps), policy scores and the same sequence of copies into slots (slot, layer,
    expert), the pool's writes."""
    from pymoe.experts import compiled_cooc

    compiled_steps = []  # decode_step's calls over every layer (a step's; one layer's are _compiled_lookup's)
    decode_step = compiled_cooc.decode_step
    cfg, caches = twin_caches(tiny_model, setting, max_inserts=1, window=48, spill_seed=2)
    E, K = cfg.n_expert, cfg.n_expert_used
    layers = list(cfg.moe_layers)
    assert len(layers) > 1
    monkeypatch.setattr(compiled_cooc, "decode_step", lambda *a: (
        compiled_steps.append(1) if len(a[14]) == len(layers) else None, decode_step(*a))[1])  # a[14]: layers
    caches[1]._compiled_lookup = lambda *a: False  # the reference: each layer's call through the loop
    writes = [[], []]
    for cache, log in zip(caches, writes):
        write = cache.pool.write
        cache.pool.write = lambda slot, ex, write=write, log=log: (log.append((slot, ex.layer, ex.expert)),
                                                                  write(slot, ex))[1]
    rng = np.random.default_rng(11)
    p = np.r_[np.full(E // 4, 3.0), np.ones(E - E // 4)]
    p /= p.sum()
    for step in range(200):
        if rng.random() < 0.1:  # a prompt chunk: lookups that never promote
            ids = np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(4)])
            end = rng.random() < 0.5
            for cache in caches:
                layer = layers[step % len(layers)]
                cache.lookup(layer, ids, "prefill")
                cache.finish(layer)
                if end:
                    cache.end_prefill()
        T = int(rng.integers(1, 3))
        ids = np.stack([[rng.choice(E, K, replace=False, p=p) for _ in range(T)] for _ in layers])  # [M, T, K]
        ahead = setting.endswith("lookahead") and rng.random() < 0.2
        pick = rng.choice(E, K, replace=False).tolist()
        for i, cache in enumerate(caches):
            if ahead:
                cache.prefetch(layers[-1], pick)
            if i == 0:
                cache.lookup_step(layers, ids)
            else:
                for m, layer in enumerate(layers):
                    cache.lookup(layer, ids[m], "decode")
                    cache.finish(layer)
        a, b = ((c.stats.counts, c.heat.tolist(), c.residency.tolist(), c._served, dict(c.table.slot_of),
                 c.table.lookups, c.table.hits, c.table.evictions, c.table._step, c.table._inserts, c._pcie_credit,
                 c.gap.totals(), list(c.gap.keys), c.clock, c.steps, c._pending) for c in caches)
        assert a == b, (setting, step)
        assert writes[0] == writes[1], (setting, step)
    p0, p1 = (c.table.policy for c in caches)
    assert p0.sc[:p1.n_keys].tolist() == p1.sc[:p1.n_keys].tolist()
    assert 100 < len(compiled_steps) < 200 and writes[0] and caches[0].gap.totals()["lookups"] > 48  # both paths
