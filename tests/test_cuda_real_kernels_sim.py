"""The CUDA backend with its real kernels (cuda_kernels/), end to end in Numba's CUDA simulator, on the micro model.

What this is: the one CI test where the real Numba CUDA kernels meet the backend's plumbing -- scratch buffers and
their shapes, the kernels' argument order, device views (`shaped` slices of scratch, slot parts of the pool, mapped
views of the model file, the device KV cache), the two streams, the miss paths -- instead of the NumPy reference
kernels tests/test_cuda_backend.py runs the backend with. Oracle: the reference backend (float NumPy, the
same math as the kernels), logits and greedy tokens.

Cost: the simulator runs a kernel as one Python thread per CUDA thread, a thread block of 32 at a time, and every
output row of a mat-vec is one block (~40 ms each). So the model is the `micro` preset (pymoe/demo/tinymodel.py: hidden
32, 1 layer, 4 experts, top-2, expert FFN 32, 2 query heads / 1 KV head of 16, 264-token vocabulary, F32), the prompt
is 2 tokens and one token is decoded after the prefill: the output projection alone is 3 x 264 blocks (a row per
block; the prefill's logits of both positions are compared). Measured on a quiet 2-core machine: 80 s (the model
written and the reference run included) with every simulator thread on one core, as tests/conftest.py pins the
`cuda`-marked tests; 241 s unpinned, the threads fighting for the GIL across the two cores (a 3-token prompt took
106-240 s unpinned). Lowering Python's thread switch interval (1e-6 s) halves the time too,
but it broke the simulator: a device function's `cuda` global is swapped to the simulator's fake module per call,
by whichever of the block's threads enters first, and restored by the first to leave, which races when threads are
preempted anywhere (`module 'numba.cuda' has no attribute 'syncthreads'` in reduce.py); at the default interval
threads hand over at barriers, as in tests/test_cuda_kernels.py.

Paths covered: prefill experts either hit the slot pre-filled from a profile (a slot read by the kernels) or are
read in place over "PCIe" (the mapped model file: `HostMapping.device_view`, the spill path's view); prefill and
decode attention on the device KV cache; in the decode step one expert hits its slot and the other misses, is
computed on the CPU (pcie_frac 0.5: the first miss goes to the CPU) and is promoted into the free slot (a copy on the
copy stream; its bytes on the device are checked). The launches the backend counts (backends/device_counts.py, by
backends/cuda.py's LAUNCHES table) equal the kernel launches the simulator saw, warm-up included. Not covered
here: staging (an expert given more than TOKEN_TILE tokens of a chunk: a longer prompt, twice the cost) --
tests/test_cuda_backend.py covers it with the reference kernels, and tests/test_cuda_kernels.py holds every kernel
to its reference on its own.

Tolerance: the measured max |logit difference| from the reference (then the CPU float path) is 1.07e-6 with this 2-token
prompt (7.15e-7 with the 3-token one before; the same in every run:
the simulator is deterministic; logits have std ~1; float32 sums in another order: 32-thread tree reductions
against NumPy's dot products); the bound, 2e-6, is 1.9x that.
"""
from cuda_sim import IN_PROCESS, IS_SIMULATOR, fresh_interpreter_test, in_process  # first: the simulator on

import contextlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pymoe  # noqa: E402
from pymoe.gguf.loader import EXPERT_PROJ  # noqa: E402
from pymoe.experts.profile import Profile  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [5, 17]
N_NEW = 2  # the first new token comes from the prefill's logits, the second from one decode step
MiB = 2**20
FREE = 700 * MiB + 64 * MiB  # the simulator has no device memory to report: a 64 MiB "device" beyond the reserve
ATOL = 2e-6  # 1.9x the measured max |diff| (1.07e-6): see the module docstring
ATOL_DS2 = 2e-6  # deepseek2's step with the real kernels: the same bound, 4.2x its measured max |diff| (4.77e-7)


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    from pymoe.demo.tinymodel import write_model

    path = str(tmp_path_factory.mktemp("micro") / "micro-qwen3moe-f32.gguf")
    write_model(path, "qwen3moe", "micro", "f32", seed=0)
    return path


def greedy_with_logits(engine):
    """engine.generate's greedy tokens, and the logits of each forward it ran: prefill [T, V], then decode [V]."""
    logits, model = [], engine.model
    prefill, decode = model.prefill, model.decode_one_token
    model.prefill = lambda *a: logits.append(prefill(*a)) or logits[-1]
    model.decode_one_token = lambda *a: logits.append(decode(*a)) or logits[-1]
    try:
        return list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False)), logits
    finally:
        del model.prefill, model.decode_one_token


@contextlib.contextmanager
def simulator_launches():
    """-> the list of the kernels launched while inside (kernel[grid, block, stream] in the simulator), to hold the
    backend's launch count to; on a GPU the simulator's launcher is not used and the list stays empty."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    launched, configure = [], FakeCUDAKernel.__getitem__
    FakeCUDAKernel.__getitem__ = lambda k, c: launched.append(k) or configure(k, c)
    try:
        yield launched
    finally:
        FakeCUDAKernel.__getitem__ = configure


def reference_run(path):
    """The reference backend's greedy run of PROMPT on `path` -> (its config, tokens and logits; layer 0's two experts
    of the decode step, hit and miss; a profile that fills two slots, with hit and an expert the step does not use)."""
    cpu = pymoe.load(path, backend="reference")
    trace = cpu.record_trace()
    want_tokens, want_logits = greedy_with_logits(cpu)
    t = trace.trace()
    hit, miss = (int(e) for e in t.experts[t.rows("decode")][0, 0])  # layer 0's experts for the decode step
    cfg = cpu.config
    other = min(set(range(cfg.n_expert)) - {hit, miss})  # the second slot holds an expert the step does not use
    profile = Profile(cfg.n_layers, cfg.n_expert, pairs=[(0, hit), (0, other)], counts=[2, 1])  # fills both slots
    return cfg, want_tokens, want_logits, hit, miss, profile


def prefilled(path):
    """The reference backend and the CUDA backend (every layer-0 expert in a slot, pcie_frac 1, chunk 8, the
    reference kernels) on `path`, each with a KV cache after PROMPT's prefill -> (ref, engine, kv_ref, kv)."""
    ref = pymoe.load(path, backend="reference")
    cfg = ref.config
    pairs = [(0, e) for e in range(cfg.n_expert)]
    engine = pymoe.load(path, backend="cuda", cache_slots=len(pairs), pcie_frac=1.0, chunk=8,
                        profile=Profile(1, cfg.n_expert, pairs=pairs, counts=[1] * len(pairs)),
                        backend_options=dict(free_bytes=FREE, kernels="reference"))
    kv_ref, kv = ref.model.new_kv(64), engine.model.new_kv(64)
    ref.model.prefill(PROMPT, kv_ref)
    engine.model.prefill(PROMPT, kv)
    return ref, engine, kv_ref, kv


@in_process
def test_real_kernels_end_to_end_in_the_simulator(micro_model, monkeypatch):
    monkeypatch.setenv("PYMOE_DEVICE_STEP", "0")  # version 2's plumbing (the device step: the test below)
    cfg, want_tokens, want_logits, hit, miss, profile = reference_run(micro_model)
    with simulator_launches() as launched:  # every launch, warm-up included, against the backend's count
        engine = pymoe.load(micro_model, backend="cuda", cache_slots=2, policy="lru", profile=profile,
                            pcie_frac=0.5, chunk=8, backend_options=dict(free_bytes=FREE))  # kernels: the real ones
        assert engine.backend.k.name == "cuda_kernels"
        got_tokens, got_logits = greedy_with_logits(engine)

    assert got_tokens == want_tokens
    assert [a.shape for a in got_logits] == [a.shape for a in want_logits] == [(len(PROMPT), cfg.n_vocab),
                                                                               (cfg.n_vocab,)]
    diff = max(float(np.abs(g - w).max()) for g, w in zip(got_logits, want_logits))
    assert diff <= ATOL, f"max |logit diff| {diff:.3g} > {ATOL:.3g}"

    stats = engine.cache.stats.counts
    p, d = stats["prefill"], stats["decode"]
    assert p["lookups"] == p["hits"] + p["staged"] == len(PROMPT) * cfg.n_expert_used
    assert p["hits"] > 0 and p["staged"] > 0  # the staged ones read in place (2 tokens: <= TOKEN_TILE per expert)
    assert (d["lookups"], d["hits"], d["cpu"], d["spill"], d["promoted"], d["evicted"]) == (2, 1, 1, 0, 1, 1), d
    cache, b = engine.cache, engine.backend
    assert cache.residency[0, hit] >= 0 and cache.residency[0, miss] >= 0  # the miss was promoted
    host = engine.file.expert(0, miss)
    want = np.concatenate([getattr(host, name).reshape(-1) for name in EXPERT_PROJ])
    assert np.array_equal(cache.pool.read(int(cache.residency[0, miss]))[:want.size], want)
    assert b.mem.used <= b.mem.limit
    # backends/cuda.py LAUNCHES (what backends/device_counts.py counts) = the launches the real kernels made
    assert sum(c["launches"] for c in b.counts.phases.values()) == len(launched) > 0


@in_process
def test_real_kernels_of_the_device_step_in_the_simulator(micro_model):
    """The decode step on the device (version 3: pcie_frac 1, so every miss is read over PCIe) with the real kernels
    of cuda_kernels/step.py: the embedding row, norms and adds, the router's top-K, the routed experts -- one read
    from its slot, the other from the mapped model file, as the residency table says -- and the argmax. Greedy tokens
    and logits against the reference backend (the bound of the version 2 test above: the same float32 operations in
    other orders); one synchronisation in the decode step; the miss promoted after it; the counted launches are the
    simulator's."""
    _, want_tokens, want_logits, hit, miss, profile = reference_run(micro_model)
    with simulator_launches() as launched:
        engine = pymoe.load(micro_model, backend="cuda", cache_slots=2, policy="lru", profile=profile,
                            pcie_frac=1.0, chunk=8, backend_options=dict(free_bytes=FREE))  # kernels: the real ones
        assert engine.backend.k.name == "cuda_kernels" and engine.model.step_on_device
        got_tokens, got_logits = greedy_with_logits(engine)
    assert got_tokens == want_tokens
    diff = max(float(np.abs(np.asarray(g) - w).max()) for g, w in zip(got_logits, want_logits))
    assert diff <= ATOL, f"max |logit diff| {diff:.3g} > {ATOL:.3g}"
    d, b = engine.cache.stats.counts["decode"], engine.backend
    assert (d["lookups"], d["hits"], d["spill"], d["promoted"]) == (2, 1, 1, 1), d
    assert b.counts.phases["decode"]["synchronisations"] == 2  # the step's, and the logits fetched above
    assert b.counts.phases["decode"]["bytes"]["expert spill reads over PCIe"] > 0  # the miss read the mapped file
    assert engine.cache.residency[0, miss] >= 0
    assert sum(c["launches"] for c in b.counts.phases.values()) == len(launched) > 0



@in_process
def test_real_kernels_of_a_deepseek2_step_in_the_simulator(tmp_path):
    """deepseek2's decode step (MLA over the device's compressed cache, the group-limited router) with the real
    kernels: cuda_kernels/mla.py's on device views of the cache (a layer's rows, V a view of K), route_groups.py,
    and the generic ones around them. The prompt runs with the reference kernels (the real ones would take minutes
    here; version 2's MLA is held to the reference in tests/test_cuda_backend.py), then the backend takes the real
    kernel set for one step. Greedy token and logits against the reference backend: the bound of the tests above
    (float32 sums in other orders; measured: see ATOL_DS2); the launches counted are those the simulator saw.
    Measured: 364 s on the 2-core machine at a load average near 40 (the simulator runs ~2,000 thread blocks)."""
    from pymoe.backends.cuda import DeviceKernels
    from pymoe.demo.tinymodel import write_model

    path = str(tmp_path / "micro-deepseek2-f32.gguf")
    write_model(path, "deepseek2", "micro", "f32", seed=0)
    ref, engine, kv_ref, kv = prefilled(path)
    want = ref.model.decode_one_token(9, kv_ref)
    b = engine.backend
    b.k = DeviceKernels()
    before = b.counts.snapshot("decode")["launches"]
    with simulator_launches() as launched:
        got = engine.model.decode_one_token(9, kv)
    assert got.greedy_token == int(np.argmax(want))
    diff = float(np.abs(np.asarray(got) - want).max())
    assert diff <= ATOL_DS2, f"max |logit diff| {diff:.3g} > {ATOL_DS2:.3g}"
    assert b.counts.snapshot("decode")["launches"] - before == 43  # expert-cache.md's row
    assert len(launched) == (43 if IS_SIMULATOR else 0)  # (on a GPU the simulator's launcher is not used)



@in_process
def test_real_kernels_of_a_verify_step_in_the_simulator(micro_model):
    """Speculation's verify forward as one device step (begin_step with T = 3 rows: the last token and two drafts)
    with the real kernels: the T embedding rows, RoPE and the KV write from the step's device `at` (rope_at_kernel,
    kv_store_kernel over T rows), chunk attention over the device cache, the router and the routed experts on T
    rows, the argmax of each row. The prompt runs with the reference kernels (as the deepseek2 test above), then
    the real kernel set takes the verify step. Each row's argmax and logits against the reference backend's forward
    of the same rows (the bound ATOL: float32 sums in other orders); one synchronisation; the launches counted are
    the simulator's."""
    from pymoe.backends.cuda import DeviceKernels

    ref, engine, kv_ref, kv = prefilled(micro_model)
    rows = [9, 200, 31]
    want = ref.model.forward(rows, kv_ref, "decode")  # [3, V]
    b = engine.backend
    assert engine.model.verify_on_device(len(rows))
    b.k = DeviceKernels()
    before = b.counts.snapshot("decode")
    with simulator_launches() as launched:
        got = engine.model.forward(rows, kv, "decode")
    after = b.counts.snapshot("decode")
    assert after["synchronisations"] - before["synchronisations"] == 1
    assert [got[t].greedy_token for t in range(len(rows))] == [int(np.argmax(w)) for w in want]
    diff = float(np.abs(np.asarray(got) - want).max())
    assert diff <= ATOL, f"max |logit diff| {diff:.3g} > {ATOL:.3g}"
    n = after["launches"] - before["launches"]
    assert n > 0 and len(launched) == (n if IS_SIMULATOR else 0)  # (on a GPU the simulator's launcher is not used)


if not IN_PROCESS:  # numba.cuda is in the other mode in this process (tests/cuda_sim.py)
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
