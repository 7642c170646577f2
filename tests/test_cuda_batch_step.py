"""The batched device step (engine/device_batch.py: B sequences' decode tokens in one step) in Numba's CUDA simulator.

What this holds: its two kernels of its own (cuda_kernels/batch_step.py) against their NumPy twins and, bit for bit,
against the single step's kernels row by row; on every GQA family, a batched step's greedy tokens equal to B single
steps' and the CPU backend's float path's, its logits within float32 summation error of the single steps', and the
expert cache's lookups and counters those of the same single steps made one after the other, and the simulator's
replay of their trace; its cost counted per step (launches, bytes by name, one synchronisation for the B rows);
seeded draws per row; one step with the real kernels; and, for CUDA graphs, consecutive batched steps of one batch
size making the same launches (with the real kernels of the row-table readers too: one graph per batch size) and the
stand-in capture replaying them with bit-equal logits; the two kernels compiled to PTX.
"""
from cuda_sim import IN_PROCESS, IS_SIMULATOR, fresh_interpreter_test, in_process  # first: the simulator on


import numpy as np  # noqa: E402
import pytest  # noqa: E402
from numba import cuda  # noqa: E402

import pymoe  # noqa: E402
from pymoe.backends.device_counts import LaunchRecorder, difference, first_difference  # noqa: E402
from pymoe.engine.device_batch import batch_step_possible, decode_steps  # noqa: E402
from pymoe.experts.profile import Profile  # noqa: E402
from cuda_ptx import compile_kernel, ptx_target, ptx_test  # noqa: E402

pytestmark = pytest.mark.cuda

MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve
PROMPTS = ([5, 17], [9, 12, 40], [3])
GQA_FAMILIES = ["qwen3moe", "qwen2moe", "llama", "olmoe", "glm4moe", "dots1", "qwen3vlmoe", "gpt-oss"]
N_TICKS = 4
REAL_ATOL = 2e-6  # tests/test_cuda_real_kernels_sim.py's bound for the single step's real kernels against the reference


def load(path, setting: str, sequences: int = 3, **options):
    """"slots": a slot for every expert, pre-filled; "promotions": one slot, LRU, pcie_frac 1 (every miss read over
    PCIe and promoted: the residency table changes at every step)."""
    if setting == "promotions":
        return pymoe.load(path, backend="cuda", cache_slots=1, policy="lru", pcie_frac=1.0, sequences=sequences,
                          n_ctx=64, backend_options=dict(SIM, **options))
    cfg = pymoe.load(path, backend="reference").config
    pairs = [(i, e) for i in range(len(cfg.moe_layers)) for e in range(cfg.n_expert)]
    profile = Profile(len(cfg.moe_layers), cfg.n_expert, pairs=pairs, counts=[1] * len(pairs))
    return pymoe.load(path, backend="cuda", cache_slots=len(pairs), profile=profile, pcie_frac=1.0,
                      sequences=sequences, n_ctx=64, backend_options=dict(SIM, **options))


def prefilled(engine, prompts):
    """A device KV cache per prompt, the prompt prefilled -> (caches, each prompt's first greedy token)."""
    kvs = [engine.model.new_kv(64) for _ in prompts]
    firsts = [int(np.argmax(engine.model.prefill(p, kv)[-1])) for p, kv in zip(prompts, kvs)]
    return kvs, firsts


def recorded_lookups(cache) -> list:
    """The cache's decode lookups from now on, in order: [(layer, ids as lists)], those a device step makes in one
    call (SlotCache.lookup_step: ids [M, T, K]) layer by layer."""
    seen, lookup, step = [], cache.lookup, cache.lookup_step

    def recording(layer, ids, phase, **kw):
        if phase == "decode":
            seen.append((layer, np.asarray(ids).tolist()))
        return lookup(layer, ids, phase, **kw)

    def recording_step(layers, ids):
        seen.extend((layer, np.asarray(ids[m]).tolist()) for m, layer in enumerate(layers))
        return step(layers, ids)

    cache.lookup, cache.lookup_step = recording, recording_step
    return seen


# ---------------------------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------------------------
@in_process
@pytest.mark.parametrize("neox", [False, True])
def test_rope_rows_matches_its_twin_and_the_single_steps_kernel(neox):
    """Each row rotated at its own position: against the twin (reference.apply_rope: the same float32 products
    and sums, so within an ulp or two of float32 where a fused multiply-add rounds once: rtol 1e-6), and bit for bit
    against norm_rope.rope_at_kernel run on that row alone at that position (the same device function)."""
    from pymoe.backends.reference import rope_tables
    from pymoe.cuda_kernels.batch_step import rope_rows, rope_rows_reference
    from pymoe.cuda_kernels.norm_rope import rope

    rng = np.random.default_rng(3)
    B, Hh, Dh, P = 3, 2, 8, 12
    cos, sin = (t.astype(np.float32) for t in rope_tables(6, 10000.0, np.arange(P)))  # [P, 3]: partial RoPE
    x = rng.standard_normal((B, Hh, Dh)).astype(np.float32)
    pos = np.array([7, 0, 11], np.int32)
    got = rope_rows(cuda.to_device(x), cuda.to_device(cos), cuda.to_device(sin), cuda.to_device(pos),
                    neox).copy_to_host()
    np.testing.assert_allclose(got, rope_rows_reference(x, cos, sin, pos, neox), rtol=1e-6, atol=1e-7)
    for b in range(B):
        alone = rope(cuda.to_device(x[b:b + 1].copy()), cuda.to_device(cos), cuda.to_device(sin), neox,
                     cuda.to_device(pos[b:b + 1].copy())).copy_to_host()
        assert np.array_equal(got[b:b + 1], alone)
    assert not np.array_equal(got[0], rope_rows_reference(x, cos, sin, pos[[1, 1, 1]], neox)[0])  # pos is read


@in_process
def test_kv_store_rows_writes_each_row_into_its_own_cache():
    """Row b lands in cache seqs[b] at row rows[b] and nowhere else (a copy: equal bits), as its twin writes it; a
    pool layer's view (kv_pool[:, layer row]: strided) is what it writes through."""
    from pymoe.cuda_kernels.batch_step import kv_store_rows, kv_store_rows_reference

    rng = np.random.default_rng(5)
    S, L, S_max, G, Dh, Dv = 3, 2, 6, 2, 4, 3
    k_pool = rng.standard_normal((S, L, S_max, G, Dh)).astype(np.float32)
    v_pool = rng.standard_normal((S, L, S_max, G, Dv)).astype(np.float32)
    k = rng.standard_normal((2, G, Dh)).astype(np.float32)
    v = rng.standard_normal((2, G, Dv)).astype(np.float32)
    seqs, rows = np.array([2, 0], np.int32), np.array([5, 1], np.int32)
    dk, dv = cuda.to_device(k_pool), cuda.to_device(v_pool)
    kv_store_rows(cuda.to_device(k), cuda.to_device(v), dk[:, 1], dv[:, 1], cuda.to_device(seqs),
                  cuda.to_device(rows))
    want_k, want_v = k_pool.copy(), v_pool.copy()
    kv_store_rows_reference(k, v, want_k[:, 1], want_v[:, 1], seqs, rows)
    assert np.array_equal(dk.copy_to_host(), want_k) and np.array_equal(dv.copy_to_host(), want_v)
    assert (want_k != k_pool).any(axis=(3, 4)).sum() == 2  # exactly the two rows changed


# ---------------------------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------------------------
@in_process
@pytest.mark.parametrize("arch, preset", [(a, "micro") for a in GQA_FAMILIES] + [("llama", "tiny"),
                                                                                 ("gpt-oss", "tiny")])
def test_a_batched_step_equals_single_steps(micro, arch, preset):
    """Three sequences of different lengths decoded N_TICKS tokens each, with one slot (LRU, pcie_frac 1: the
    residency table changes every step): by batched steps, and by single steps one sequence after the other.
    Greedy tokens equal to each other and to the CPU backend's float path; logits within float32 summation error
    of the single steps' (the reference kernels' products of B rows and of 1 row are NumPy matmuls that BLAS may sum
    in another order: a few ulps of the logits' scale, bounded by 1e-5 of it); the expert cache's decode counters
    and its residency table at the end equal, and so is the sequence of lookups the cache sees (row by row, layer by
    layer, as single steps make them); one synchronisation per batched step. The micro files route every token of these prompts to the same
    experts (so do most tiny ones); llama's and gpt-oss's tiny files route the rows apart, so a row's lookups made
    with another row's routing ids show there."""
    path = micro(arch, preset=preset)
    cpu = pymoe.load(path, backend="cpu", act_bits=0)
    want = [list(cpu.generate(p, max_tokens=N_TICKS + 1, stop_at_eos=False)) for p in PROMPTS]
    runs = {}
    for how in ("batched", "single"):
        engine = load(path, "promotions")
        kvs, tokens = prefilled(engine, PROMPTS)
        lookups = recorded_lookups(engine.cache)
        got, logits, syncs = [[t] for t in tokens], [], 0
        counts = engine.backend.counts
        for _ in range(N_TICKS):
            before = counts.snapshot("decode")
            if how == "batched":
                assert batch_step_possible(engine.model, kvs)
                rows = decode_steps(engine.model, tokens, kvs)
                syncs += difference(counts.snapshot("decode"), before)["synchronisations"]
                logits.append(np.stack([np.asarray(r).reshape(-1) for r in rows]))  # [B, V] (a sync each)
                tokens = [r.greedy_token for r in rows]
            else:
                out = []
                for t, kv in zip(tokens, kvs):
                    before = counts.snapshot("decode")
                    r = engine.model.decode_one_token(t, kv)
                    syncs += difference(counts.snapshot("decode"), before)["synchronisations"]
                    out.append((np.asarray(r).copy(), r.greedy_token))  # fetched before the next step
                logits.append(np.stack([row for row, _ in out]))  # [B, V]
                tokens = [t for _, t in out]
            for g, t in zip(got, tokens):
                g.append(t)
        runs[how] = (got, logits, engine.cache.stats.counts["decode"].copy(), engine.cache.residency.copy(), syncs,
                     lookups)
    (got_b, logits_b, stats_b, table_b, syncs_b, lookups_b), (got_s, logits_s, stats_s, table_s, syncs_s, lookups_s) \
        = runs["batched"], runs["single"]
    assert got_b == got_s == want
    assert lookups_b == lookups_s and len(lookups_b) == N_TICKS * len(PROMPTS) * len(engine.config.moe_layers)
    for a, b in zip(logits_b, logits_s):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    assert stats_b == stats_s and stats_b["promoted"] > 0
    assert np.array_equal(table_b, table_s)
    assert (syncs_b, syncs_s) == (N_TICKS, N_TICKS * len(PROMPTS))


@in_process
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_simulator_replays_a_batched_run_with_its_counts(micro, tmp_path, policy):
    """Plumbing (the engine and experts/simulate.py run the same SlotTable): a trace of the three sequences decoded
    one token each in turn, recorded on the reference backend (version 2: a trace needs each layer's routing on the
    host), replayed with the same profile, policy and slots, gives the batched engine's decode hits and lookups
    and promotions (llama's tiny file: its rows route apart, so the replay's order matters)."""
    from pymoe.experts.simulate import sweep
    from pymoe.experts.trace import Trace

    SLOTS = 4  # (of 16: 37 hits of 48 lookups; a batch whose rows' lookups took row 0's ids makes 44)
    path = micro("llama", preset="tiny")
    ref = pymoe.load(path, backend="reference")
    recorder = ref.record_trace()
    kvs = [ref.model.new_kv(64) for _ in PROMPTS]
    tokens = [int(np.argmax(ref.model.prefill(p, kv)[-1])) for p, kv in zip(PROMPTS, kvs)]
    want = [[t] for t in tokens]
    for _ in range(N_TICKS):
        tokens = [int(np.argmax(ref.model.decode_one_token(t, kv))) for t, kv in zip(tokens, kvs)]
        for w, t in zip(want, tokens):
            w.append(t)
    recorder.save(tmp_path / "t.npz")
    cfg = ref.config
    pairs = [(m, e) for m in range(len(cfg.moe_layers)) for e in range(SLOTS // 2)]
    profile = Profile(len(cfg.moe_layers), cfg.n_expert, pairs=pairs, counts=list(range(len(pairs), 0, -1)))
    engine = pymoe.load(path, backend="cuda", cache_slots=SLOTS, profile=profile, policy=policy, pcie_frac=1.0,
                        sequences=3, n_ctx=64, backend_options=SIM)
    kvs, tokens = prefilled(engine, PROMPTS)
    got = [[t] for t in tokens]
    for _ in range(N_TICKS):
        tokens = [r.greedy_token for r in decode_steps(engine.model, tokens, kvs)]
        for g, t in zip(got, tokens):
            g.append(t)
    assert got == want
    d = engine.cache.stats.counts["decode"]
    (sim,) = sweep(Trace.load(tmp_path / "t.npz"), [policy], [SLOTS], ["global"], profile=profile, phase="decode")
    assert (sim.hits, sim.lookups, sim.promoted) == (d["hits"], d["lookups"], d["promoted"]), (sim, d)
    assert 0 < d["hits"] < d["lookups"] and d["promoted"] > 0


@in_process
def test_a_batched_step_costs_one_copy_each_way_and_one_synchronisation(micro):
    """qwen3moe micro (1 layer, K = 2, every expert in a slot), 2 then 3 rows: each step makes the single step's 22
    launches (tests/test_device_counts.py STEP_TOKEN: the embedding; per layer 2 norms, the q, k, v products, the
    q/k norms, RoPE of q and k (one launch each for all rows), the KV write (one for all rows), attention (one, ragged),
    the output product, 2 adds, the router's product and top-K, the routed experts (2); the output norm, logits and
    argmax), one copy up of 4 int32 per row (token id, position, KV row, sequence), one copy back of 1 + K int32
    per row (token id, routing ids), one synchronisation."""
    engine = load(micro("qwen3moe"), "slots")
    counts = engine.backend.counts
    kvs, tokens = prefilled(engine, PROMPTS)
    for B in (2, 3, 3):
        before = counts.snapshot("decode")
        rows = decode_steps(engine.model, tokens[:B], kvs[:B])
        tokens[:B] = [r.greedy_token for r in rows]
        d = difference(counts.snapshot("decode"), before)
        assert (d["forwards"], d["tokens"], d["launches"], d["synchronisations"]) == (1, B, 22, 1)
        assert d["bytes"] == {"token ids, positions and sequence table to device": 4 * 4 * B,
                              "token and routing ids to host (batch)": 4 * (1 + 2) * B}


@in_process
def test_seeded_draws_in_a_batched_step_are_the_cpu_backends(micro):
    """Two seeded sampled sequences (temperature 0.8, top-k 40, top-p 0.9; seeds 1 and 2), each row's draw handed
    to the batched step (one record per row in the one copy up, a sample launch per row reading it there): each
    sequence's tokens equal the CPU backend's float path's for its seed, the drawn ids come back in the step's copy
    (never the logits)."""
    from pymoe.engine.sampler import Sampler, SamplingParams

    path = micro("qwen3moe")
    cpu = pymoe.load(path, backend="cpu", act_bits=0)
    settings = dict(temperature=0.8, top_k=40, top_p=0.9)
    want = [list(cpu.generate(p, max_tokens=N_TICKS + 1, stop_at_eos=False, seed=s, **settings))
            for p, s in zip(PROMPTS[:2], (1, 2))]
    engine = load(path, "slots")
    counts = engine.backend.counts
    samplers = [Sampler(SamplingParams(seed=s, **settings)) for s in (1, 2)]
    kvs = [engine.model.new_kv(64) for _ in range(2)]
    tokens = [int(sm(engine.model.prefill(p, kv)[-1], list(p))) for sm, p, kv in zip(samplers, PROMPTS, kvs)]
    got = [[t] for t in tokens]
    before = counts.snapshot("decode")
    for _ in range(N_TICKS):
        draws = [engine.model.device_draw(sm, kv) for sm, kv in zip(samplers, kvs)]
        assert all(d is not None for d in draws)
        rows = decode_steps(engine.model, tokens, kvs, draws)
        tokens = [int(sm(r[0], g)) for sm, r, g in zip(samplers, rows, got)]
        for g, t in zip(got, tokens):
            g.append(t)
    assert got == want and want[0] != list(cpu.generate(PROMPTS[0], max_tokens=N_TICKS + 1, stop_at_eos=False))
    d = difference(counts.snapshot("decode"), before)
    assert d["synchronisations"] == N_TICKS and d["launches"] == N_TICKS * (22 + 2)  # a sample launch per row
    assert set(d["bytes"]) == {"token ids, positions, sequence table and draws to device",
                               "token, routing and drawn ids to host (batch)"}


@in_process
def test_real_kernels_of_a_batched_step_in_the_simulator(micro, monkeypatch):
    """qwen3moe micro, two sequences, one batched step with the real kernels (the prompts run with the reference
    kernels, then the backend takes cuda_kernels for the step, as tests/test_cuda_real_kernels_sim.py does for
    deepseek2): the embedding, products, norms, RoPE per row, the KV write per row, the ragged attention, the router,
    the routed experts of 2 rows, the argmax. Each row's greedy token and logits against the reference backend's
    single decode step of that sequence, within REAL_ATOL (float32 sums in other orders: thread-tree reductions
    against NumPy's dot products); the launches counted are the ones the simulator saw (22)."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    from pymoe.backends.cuda import DeviceKernels

    path = micro("qwen3moe")
    ref = pymoe.load(path, backend="reference")
    engine = load(path, "slots", sequences=2)
    kvs, tokens = prefilled(engine, PROMPTS[:2])
    want = []
    for p, t in zip(PROMPTS[:2], tokens):
        kv = ref.model.new_kv(64)
        ref.model.prefill(p, kv)
        want.append(ref.model.decode_one_token(t, kv))
    b = engine.backend
    b.k = DeviceKernels()
    launched = []
    configure = FakeCUDAKernel.__getitem__
    monkeypatch.setattr(FakeCUDAKernel, "__getitem__", lambda k, c: launched.append(k) or configure(k, c))
    before = b.counts.snapshot("decode")["launches"]
    rows = decode_steps(engine.model, tokens, kvs)
    assert b.counts.snapshot("decode")["launches"] - before == 22  # test_a_batched_step_costs_one_copy_each_way..
    assert len(launched) == (22 if IS_SIMULATOR else 0)  # (on a GPU the simulator's launcher is not used)
    for row, w in zip(rows, want):
        assert row.greedy_token == int(np.argmax(w))
        diff = float(np.abs(np.asarray(row).reshape(-1) - w).max())
        assert diff <= REAL_ATOL, f"max |logit diff| {diff:.3g} > {REAL_ATOL:.3g}"


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs: one per batch size
# ---------------------------------------------------------------------------------------------------------------
@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_consecutive_batched_steps_make_the_same_launches(micro, arch):
    """Batched steps of one batch size record identical launch lists (operation, arguments' pointers, shapes,
    strides, scalars) across promotions that change the residency table: one graph per batch size replays them; a
    step of another size is a list (a bucket) of its own."""
    engine = load(micro(arch), "promotions")
    kvs, tokens = prefilled(engine, PROMPTS)
    recorder = engine.backend.recorder = LaunchRecorder()
    for B in (2, 2, 2, 3, 3):
        rows = decode_steps(engine.model, tokens[:B], kvs[:B])
        tokens[:B] = [r.greedy_token for r in rows]
    steps = recorder.steps
    assert len(steps) == 5 and len(steps[0]) > 0
    assert first_difference(steps[0], steps[1]) is None and first_difference(steps[0], steps[2]) is None
    assert first_difference(steps[3], steps[4]) is None and first_difference(steps[0], steps[3]) is not None
    assert engine.cache.stats.counts["decode"]["promoted"] > 0


@in_process
def test_the_real_kernels_launches_of_batched_steps_repeat(micro, monkeypatch):
    """The Numba kernel launches themselves (kernel, grid, block, arguments), as the simulator sees them, of the
    batched step's row-table readers (RoPE per row, the KV write per row, the ragged attention, the sample kernel of
    each row reading its draw record), the router, the norms, the adds and the argmax, over consecutive batched steps
    of 2 seeded sampled rows: identical lists, what one graph per batch size replays (the products and the routed
    experts on the reference kernels, as tests/test_cuda_graphs.py's single-step form has them). The tokens are the
    CPU backend's for each seed."""
    from pymoe.backends import cuda as cuda_backend
    from pymoe.engine.sampler import Sampler, SamplingParams

    real_ops = ("rope_rows", "kv_store_rows", "ragged_attention", "route_softmax", "rmsnorm", "add", "argmax",
                "sample")

    class Mixed(cuda_backend.ReferenceKernels):
        name = "mixed"

    for op in real_ops:
        setattr(Mixed, op, lambda self, *args, _op=op: getattr(cuda_backend.DeviceKernels(), _op)(*args))
    monkeypatch.setitem(cuda_backend.KERNEL_SETS, "mixed", Mixed)
    path = micro("qwen3moe")
    settings = dict(temperature=0.8, top_k=40, top_p=0.9)
    cpu = pymoe.load(path, backend="cpu", act_bits=0)
    want = [list(cpu.generate(p, max_tokens=4, stop_at_eos=False, seed=s, **settings))
            for p, s in zip(PROMPTS[:2], (1, 2))]
    engine = load(path, "promotions", kernels="mixed")
    samplers = [Sampler(SamplingParams(seed=s, **settings)) for s in (1, 2)]
    kvs = [engine.model.new_kv(64) for _ in range(2)]
    got = [[int(sm(engine.model.prefill(p, kv)[-1], list(p)))] for sm, p, kv in zip(samplers, PROMPTS, kvs)]
    recorder = engine.backend.recorder = LaunchRecorder()
    with recorder.kernels():
        for _ in range(3):
            draws = [engine.model.device_draw(sm, kv) for sm, kv in zip(samplers, kvs)]
            rows = decode_steps(engine.model, [g[-1] for g in got], kvs, draws)
            for sm, r, g in zip(samplers, rows, got):
                g.append(int(sm(r[0], g)))
    assert got == want
    kernels = [name for name, grid, *_ in recorder.steps[0] if grid is not None]
    assert {"rope_rows_kernel", "kv_store_rows_kernel", "ragged_decode_attention_kernel"} <= set(kernels)
    assert kernels.count("sample_kernel") == 2
    for step in recorder.steps[1:]:
        assert first_difference(recorder.steps[0], step) is None


@in_process
def test_batched_graph_replay_keeps_the_logits(micro):
    """backends/cuda_graphs.StepGraphs with the stand-in capture (test_cuda_graphs.ReplayCapture: the captured calls
    made again on launch): batched steps of 2 rows, the first direct, the second captured, the rest replayed, give
    logits equal bit for bit to the same steps launched directly."""
    from test_cuda_graphs import ReplayCapture

    path = micro("qwen3moe")
    runs = {}
    for name, graphs in (("direct", None), ("graphs", ReplayCapture())):
        engine = load(path, "promotions", graphs=graphs)
        kvs, tokens = prefilled(engine, PROMPTS[:2])
        logits = []
        for _ in range(5):
            rows = decode_steps(engine.model, tokens, kvs)
            logits.append(np.stack([np.asarray(r).reshape(-1) for r in rows]))
            tokens = [r.greedy_token for r in rows]
        runs[name] = logits, engine.backend.graphs
    (direct, _), (replayed, g) = runs["direct"], runs["graphs"]
    assert (g.direct, g.captured, g.replayed) == (1, 1, 3)
    for a, b in zip(direct, replayed):
        assert np.array_equal(a, b)


def compile_to_ptx():
    """Run in a fresh interpreter without the simulator: type and compile both kernels for sm_75, the caches as a
    pool layer's strided view (kv_pool[:, row])."""
    from numba import types as nt

    if not ptx_target():
        return
    from pymoe.cuda_kernels.batch_step import kv_store_rows_kernel, rope_rows_kernel

    f2, f3 = (nt.Array(nt.float32, n, "C") for n in (2, 3))
    i1, planes = nt.Array(nt.int32, 1, "C"), nt.Array(nt.float32, 4, "A")
    compile_kernel(rope_rows_kernel, (f3, f2, f2, i1, nt.boolean))
    compile_kernel(kv_store_rows_kernel, (f3, f3, planes, planes, i1, i1))


test_the_kernels_compile_for_a_real_gpu = ptx_test(
    compile_to_ptx, 2, "What the simulator cannot check: that Numba's real CUDA target types and lowers both kernels.")


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)

