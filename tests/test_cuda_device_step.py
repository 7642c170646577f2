"""The device decode step (version 3, backends/cuda.py `begin_step` .. `end_step`) in Numba's CUDA simulator.

What this is: on each converted family's `micro` file (F32), a decode step runs on the device from the token id to the
greedy token: the counts per decoded token (exact in the simulator: backends/device_counts.py) are the issue's
targets -- host<->device bytes = the token id in with its position and KV row (int32 [3], 12 bytes: the kernels
read the position there, so that a CUDA graph replays every step, tests/test_cuda_graphs.py) and the token id plus
every MoE layer's K routing ids out (4 (1 + n_moe K) bytes), one host synchronisation -- and the greedy tokens equal
the reference backend's (the CPU float path's math, NumPy). With misses (one slot, pcie_frac 1: every miss read over PCIe and promoted) the expert
cache's counters equal version 2's on the same run (PYMOE_DEVICE_STEP=0): the step's lookups are made after it, in
the order version 2 makes them, so the telemetry and the simulator's replay (experts/simulate.py) keep their meaning;
with "cpu" misses (pcie_frac 0.5) each MoE layer's lookup is made inside the step, one more synchronisation each.
Speculation's verify forward (T = 1 + drafts rows) is one device step too on every family (VERIFY_FAMILIES; the
hybrids roll back to a device snapshot of their state): the position, KV row and T token ids in, the T argmax ids
and [n_moe, T, K] routing ids out, one synchronisation; its rows' logits, a rollback's next step, and `--spec mtp`'s
hidden states are held to the same bound.
The backend runs the reference kernels here (tests/test_cuda_backend.py says why); the real ones:
tests/test_cuda_step_kernels.py (each kernel) and tests/test_cuda_real_kernels_sim.py (end to end).

Tolerance of the logits: the same float32 operations in other orders only (the device step adds each token's K
experts in k order, the reference in ascending expert order; other reduction trees), so the logits differ by a few
roundings of their own size: measured on qwen3moe, qwen2moe, llama, olmoe and glm4moe (3 steps each, slots and
"cpu misses") at most 7.2e-7 = 3 ulp of s = max |logit| (2.5-3.2, where one ulp is 2.4e-7); on gpt-oss 3 ulp (slots,
"cpu misses") and 2 ulp past its window, version 2 the same; on deepseek2 at most 1.5 ulp (3.6e-7, "cpu misses";
s 2.7-3.8), its verify step 2 ulp (test_a_rollback_leaves_rows_that_no_query_reads); qwen3next and qwen35moe
(three Gated DeltaNet layers and a gated attention layer, each MoE): at most 2.25 ulp of s with the reference kernels,
and within the bound with the real Gated DeltaNet and gated attention kernels
(`test_the_hybrids_real_kernels_in_the_step`); the bound is 8 ulp of s (2.7x).
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pymoe  # noqa: E402
from pymoe.experts.profile import Profile  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [5, 17]
N_NEW = 5  # 4 decode steps
MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve
ULPS = 8  # of the logit scale s: see the module docstring


def every_expert_in_a_slot(path, speculation=False):
    """speculation: api.Engine's (`pymoe run --spec`: a hybrid's device KV cache gets its state's device snapshot)."""
    cfg = pymoe.load(path, backend="reference").config
    pairs = [(i, e) for i in range(len(cfg.moe_layers)) for e in range(cfg.n_expert)]
    profile = Profile(len(cfg.moe_layers), cfg.n_expert, pairs=pairs, counts=[1] * len(pairs))
    return pymoe.load(path, backend="cuda", cache_slots=len(pairs), profile=profile, pcie_frac=1.0,
                      backend_options=SIM, speculation=speculation)


def per_token(engine):
    from pymoe.backends.device_counts import per_token

    st = engine.last_stats
    return per_token({**st.device, "tokens": st.n_decoded})


FAMILIES = ["qwen3moe", "qwen2moe", "llama", "olmoe", "glm4moe", "dots1", "qwen3vlmoe", "gpt-oss",  # the converted
            "deepseek2", "qwen3next", "qwen35moe"]  # ones
# (model.device_step_possible; test_the_families_that_run_the_step_are_these holds the list to it)


@in_process
def test_the_families_that_run_the_step_are_these(micro):
    """Every family pymoe reads (config.ARCHS), on the CUDA backend: the step runs for FAMILIES and for no other, so
    a family that starts running it (a new one, or a block given device primitives) is in the tests below."""
    from pymoe.gguf.config import ARCHS

    runs = [a for a in ARCHS if pymoe.load(micro(a), backend="cuda", backend_options=SIM).model.step_on_device]
    assert runs == [a for a in ARCHS if a in FAMILIES]


@in_process
@pytest.mark.parametrize("arch", FAMILIES)
def test_a_device_step_moves_token_ids_and_routing_ids_only(micro, arch):
    path = micro(arch)
    want = list(pymoe.load(path, backend="reference").generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    engine = every_expert_in_a_slot(path)
    assert engine.model.step_on_device
    assert list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False)) == want
    cfg, m = engine.config, per_token(engine)
    ids_bytes = 4 * (1 + len(cfg.moe_layers) * cfg.n_expert_used)  # int32 token id + [n_moe, K] routing ids
    assert m["bytes_by_name"] == {"token id and position to device": 12, "token and routing ids to host": ids_bytes}
    assert m["synchronisations"] == 1
    assert engine.last_stats.decode["hits"] == (N_NEW - 1) * len(cfg.moe_layers) * cfg.n_expert_used


@in_process
@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("setting", ["slots", "cpu misses"])
def test_device_step_logits_match_the_float_path(micro, arch, setting):
    """The logits a step leaves on the device (fetched on demand: one more copy and sync) against the reference;
    "cpu misses": one slot, pcie_frac 0.5 (the lookups inside the step, the CPU's experts added on the device)."""
    path = micro(arch)
    ref = pymoe.load(path, backend="reference")
    engine = (every_expert_in_a_slot(path) if setting == "slots" else
              pymoe.load(path, backend="cuda", cache_slots=1, policy="lru", pcie_frac=0.5, backend_options=SIM))
    kv_ref, kv = ref.model.new_kv(64), engine.model.new_kv(64)
    ref.model.prefill(PROMPT, kv_ref)
    engine.model.prefill(PROMPT, kv)
    token = 9
    for _ in range(3):
        want = ref.model.decode_one_token(token, kv_ref)
        got = engine.model.decode_one_token(token, kv)
        assert got.greedy_token == int(np.argmax(want))
        before = engine.backend.counts.snapshot("decode")["synchronisations"]
        got = np.asarray(got)
        assert engine.backend.counts.snapshot("decode")["synchronisations"] == before + 1
        s = np.float32(np.abs(want).max())
        assert np.abs(got - want).max() <= ULPS * np.spacing(s)
        token = int(np.argmax(want))


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "glm4moe"])
@pytest.mark.parametrize("pcie_frac", [1.0, 0.5])
def test_misses_keep_the_caches_counters_of_version_2(micro, monkeypatch, arch, pcie_frac):
    """One slot, LRU: every step misses and promotes. pcie_frac 1: every miss read over PCIe, the lookups made after
    the step; pcie_frac 0.5: half the misses computed on the CPU, so each MoE layer's lookup is made inside the step
    (its routing ids and input row to the host: one more synchronisation per MoE layer, the CPU experts' output back).
    Either way the counters, the tokens and the slot copies are version 2's."""
    path = micro(arch)
    want = list(pymoe.load(path, backend="reference").generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    runs = {}
    for version in ("2", "3"):
        monkeypatch.setenv("PYMOE_DEVICE_STEP", "1" if version == "3" else "0")
        engine = pymoe.load(path, backend="cuda", cache_slots=1, policy="lru", pcie_frac=pcie_frac,
                            backend_options=SIM)
        assert engine.model.step_on_device == (version == "3")
        assert list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False)) == want
        runs[version] = (engine.last_stats.decode, per_token(engine))
    (d2, m2), (d3, m3) = runs["2"], runs["3"]
    assert d3 == d2 and d3["promoted"] > 0 and d3["spill"] > 0 and (d3["cpu"] > 0) == (pcie_frac < 1)
    n_moe = len(engine.config.moe_layers)
    assert m3["synchronisations"] == 1 + (n_moe if pcie_frac < 1 else 0) < m2["synchronisations"]
    promotions = "slot copies (promotions, prefetches) to device"
    assert m3["bytes_by_name"][promotions] == m2["bytes_by_name"][promotions]
    assert not any(name.startswith(("residual", "router", "output projection", "expert inputs"))
                   for name in m3["bytes_by_name"])


@in_process
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_simulator_replays_a_device_step_run_with_its_counts(micro, tmp_path, policy):
    """Plumbing (the engine and experts/simulate.py run the same SlotTable): a trace of the same greedy request,
    recorded on the reference backend (a trace needs each layer's routing on the host, so a traced run is version 2),
    replayed with the same profile, policy and slots, gives the device-step engine's decode hits and lookups: its
    lookups, made one step late, are the version 2 sequence the simulator replays."""
    from pymoe.experts.simulate import sweep
    from pymoe.experts.trace import Trace

    path = micro("qwen3moe")
    ref = pymoe.load(path, backend="reference")
    recorder = ref.record_trace()
    want = list(ref.generate(PROMPT, max_tokens=8, stop_at_eos=False))
    recorder.save(tmp_path / "t.npz")
    profile = Profile(1, 4, pairs=[(0, 3), (0, 1)], counts=[2, 1])
    engine = pymoe.load(path, backend="cuda", cache_slots=2, profile=profile, policy=policy, pcie_frac=1.0,
                        backend_options=SIM)
    assert list(engine.generate(PROMPT, max_tokens=8, stop_at_eos=False)) == want
    assert per_token(engine)["synchronisations"] == 1  # every step ran on the device
    d = engine.last_stats.decode
    (sim,) = sweep(Trace.load(tmp_path / "t.npz"), [policy], [2], ["global"], profile=profile, phase="decode")
    assert (sim.hits, sim.lookups) == (d["hits"], d["lookups"]) and 0 < d["hits"] < d["lookups"], (sim, d)


HYBRIDS = ["qwen3next", "qwen35moe"]  # Gated DeltaNet + gated attention: a recurrent state on the device


@in_process
@pytest.mark.parametrize("arch", HYBRIDS)
def test_the_recurrent_state_stays_coherent_across_versions(micro, arch):
    """A sequence whose decode alternates device steps (version 3: the Gated DeltaNet state advanced on the device)
    with a verify forward of 3 positions and its rollback, as speculation makes them (the state saved to and
    restored from the host copy; the forward's Gated DeltaNet blocks on the device, engine/deltanet.gdn_device),
    gives the reference's logits at every step: each copy of the state is brought over whole when the other side
    needs it (one copy each way, named in the counts), and the prefill leaves the state on the device (its upload a
    prefill cost, not a decode one)."""
    path = micro(arch)
    ref = pymoe.load(path, backend="reference")
    engine = every_expert_in_a_slot(path)
    kv_ref, kv = ref.model.new_kv(64), engine.model.new_kv(64)
    ref.model.prefill(PROMPT, kv_ref)
    engine.model.prefill(PROMPT, kv)
    counts = engine.backend.counts
    assert counts.snapshot("prefill")["bytes"]["recurrent state to device"] > 0
    assert kv.fresh == "device"

    def step(token):
        want, got = ref.model.decode_one_token(token, kv_ref), engine.model.decode_one_token(token, kv)
        s = np.float32(np.abs(want).max())
        assert np.abs(np.asarray(got) - want).max() <= ULPS * np.spacing(s)
        return int(np.argmax(want))

    token = step(step(9))
    assert "recurrent state to host" not in counts.snapshot("decode")["bytes"]
    for model, cache in ((ref.model, kv_ref), (engine.model, kv)):  # a verify forward, then its rollback
        saved, p0 = cache.save_recurrent(), cache.n
        model.forward([token, 3, 4], cache, "decode")
        cache.restore_recurrent(saved)
        cache.n = p0
    assert kv.fresh == "host" and counts.snapshot("decode")["bytes"]["recurrent state to host"] > 0
    step(step(token))
    assert kv.fresh == "device" and counts.snapshot("decode")["bytes"]["recurrent state to device"] > 0


@in_process
@pytest.mark.parametrize("arch", HYBRIDS)
def test_speculation_gives_the_plain_tokens(micro, arch):
    """--spec ngram on a prompt that repeats itself (prompt lookup drafts what followed the first time): the verify
    forwards run version 2 on the sequence's host copy of the state, with rollbacks; the tokens are the reference's
    plain greedy ones. (Speculation counts each forward's experts, which keeps its plain steps on version 2 too:
    engine/model.py `_device_step`.)"""
    from pymoe.engine.speculative import NgramDrafter, Speculator

    path = micro(arch)
    ref = pymoe.load(path, backend="reference")
    prompt = PROMPT + list(ref.generate(PROMPT, max_tokens=6, stop_at_eos=False)) + PROMPT  # drafts: what followed
    want = list(ref.generate(prompt, max_tokens=10, stop_at_eos=False))
    spec = Speculator(NgramDrafter(), k=3)
    assert list(every_expert_in_a_slot(path).generate(prompt, max_tokens=10, stop_at_eos=False, spec=spec)) == want
    assert spec.stats.steps > 0 and spec.stats.drafted > 0


@in_process
@pytest.mark.parametrize("arch", HYBRIDS)
def test_the_hybrids_real_kernels_in_the_step(micro, monkeypatch, arch):
    """The real kernels of Gated DeltaNet and gated attention (cuda_kernels/deltanet.py, gated_attention.py) in the
    backend's plumbing (the state arrays of the device KV cache, arena views, argument order), the rest of the step
    on the reference kernels (the real ones of every other op cost minutes here: tests/test_cuda_real_kernels_sim.py):
    greedy tokens and step logits against the reference backend, within the bound above; one launch per call of
    each (backends/cuda.py LAUNCHES), as the simulator saw them."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    from pymoe.backends import cuda as cuda_backend

    new_ops = ("conv_step", "rule_step", "split_gate", "gate_output")
    calls = []

    class Mixed(cuda_backend.ReferenceKernels):
        name = "mixed"

    for op in new_ops:
        def real(self, *args, _op=op):
            calls.append(_op)
            return getattr(cuda_backend.DeviceKernels(), _op)(*args)
        setattr(Mixed, op, real)
    monkeypatch.setitem(cuda_backend.KERNEL_SETS, "mixed", Mixed)
    launched = []
    configure = FakeCUDAKernel.__getitem__
    monkeypatch.setattr(FakeCUDAKernel, "__getitem__", lambda k, c: launched.append(k) or configure(k, c))
    path = micro(arch)
    ref = pymoe.load(path, backend="reference")
    want = list(ref.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    cfg = ref.config
    pairs = [(i, e) for i in range(len(cfg.moe_layers)) for e in range(cfg.n_expert)]
    profile = Profile(len(cfg.moe_layers), cfg.n_expert, pairs=pairs, counts=[1] * len(pairs))
    engine = pymoe.load(path, backend="cuda", cache_slots=len(pairs), profile=profile, pcie_frac=1.0,
                        backend_options=dict(SIM, kernels="mixed"))
    assert engine.model.step_on_device
    assert list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False)) == want
    n_gdn = sum(cfg.recurrent)
    assert calls.count("conv_step") == calls.count("rule_step") == n_gdn * (N_NEW - 1)  # the decode steps'
    assert calls.count("split_gate") > (cfg.n_layers - n_gdn) * (N_NEW - 1)  # (and the prefill's)
    assert len(launched) == len(calls)
    kv_ref, kv = ref.model.new_kv(64), engine.model.new_kv(64)
    ref.model.prefill(PROMPT, kv_ref)
    engine.model.prefill(PROMPT, kv)
    token = 9
    for _ in range(3):
        want_logits = ref.model.decode_one_token(token, kv_ref)
        got = np.asarray(engine.model.decode_one_token(token, kv))
        s = np.float32(np.abs(want_logits).max())
        assert np.abs(got - want_logits).max() <= ULPS * np.spacing(s)
        token = int(np.argmax(want_logits))


@in_process
def test_deepseek_v2_lite_runs_the_step(tmp_path):
    """DeepSeek-V2-Lite's shape (make-tiny-model --variant lite, micro size: one q projection, no q_a / q_b;
    softmax routing without groups or choice bias; 27 layers): every decode step on the device, moving the token id
    and the routing ids only; tokens and logits the reference backend's. The logits' bound is 16 ulp of s: the same
    float32 operations in other orders as above, over 27 layers, measured at most 5.5 ulp (2 steps, slots and "cpu
    misses"): 2.9x."""
    from pymoe.demo.tinymodel import write_model

    path = str(tmp_path / "micro-deepseek2-lite.gguf")
    write_model(path, "deepseek2", "micro", "f32", seed=0, variant="lite")
    ref = pymoe.load(path, backend="reference")
    assert (ref.config.q_lora_rank, ref.config.gating, ref.config.n_expert_groups) == (0, "softmax", 1)
    want = list(ref.generate(PROMPT, max_tokens=3, stop_at_eos=False))
    engine = every_expert_in_a_slot(path)
    assert list(engine.generate(PROMPT, max_tokens=3, stop_at_eos=False)) == want
    m, cfg = per_token(engine), engine.config
    assert m["bytes_by_name"] == {"token id and position to device": 12,
                                  "token and routing ids to host": 4 * (1 + len(cfg.moe_layers) * cfg.n_expert_used)}
    assert m["synchronisations"] == 1
    kv_ref, kv = ref.model.new_kv(64), engine.model.new_kv(64)
    ref.model.prefill(PROMPT, kv_ref)
    engine.model.prefill(PROMPT, kv)
    want = ref.model.decode_one_token(9, kv_ref)
    got = np.asarray(engine.model.decode_one_token(9, kv))
    assert np.abs(got - want).max() <= 16 * np.spacing(np.float32(np.abs(want).max()))


@in_process
def test_speculation_runs_its_plain_steps_on_the_device(micro):
    """--spec ngram on deepseek2 (MLA over the device's compressed cache, expert groups): the verify forwards of
    several positions and the single steps between them each run as one device step (begin_step; the verify
    forwards' MLA blocks engine/mla.mla_device over T rows: no host-side MLA; speculation's expert count from the
    routing ids the step brings back); the greedy tokens are the reference backend's plain decoding. The prompt
    repeats, so ngram drafts."""
    from pymoe.engine import mla
    from pymoe.engine.speculative import Speculator, NgramDrafter

    path, prompt = micro("deepseek2"), [5, 17, 42, 5, 17, 42, 5, 17]
    want = list(pymoe.load(path, backend="reference").generate(prompt, max_tokens=12, stop_at_eos=False))
    engine = every_expert_in_a_slot(path)
    steps, begin = [], engine.backend.begin_step
    engine.backend.begin_step = lambda *a, **k: steps.append(1) or begin(*a, **k)
    rows, device = [], mla.mla_device
    mla.mla_device = lambda b, layer, x, *a: rows.append(x.shape[0]) or device(b, layer, x, *a)
    try:
        spec = Speculator(NgramDrafter(), k=4)
        assert list(engine.generate(prompt, max_tokens=12, stop_at_eos=False, spec=spec)) == want
    finally:
        mla.mla_device = device
    assert engine.backend.counts.snapshot("decode")["bytes"].get("MLA queries to device", 0) == 0
    assert any(1 < n <= 5 for n in rows)  # a verify forward's rows (k + 1 at most; the prompt's forward: 8 rows)
    st = spec.stats
    assert st.steps > 0 and st.accepted > 0 and st.single_steps > 0 and len(steps) == st.single_steps + st.steps
    assert st.single_experts == st.single_steps * len(engine.config.moe_layers) * engine.config.n_expert_used


@in_process
def test_families_not_converted_keep_version_2(micro):
    """A family without device primitives for all of its blocks runs version 2: its decode steps synchronise per
    layer (the first such family of config.ARCHS; none left: nothing to show)."""
    from pymoe.gguf.config import ARCHS

    others = [a for a in ARCHS if a not in FAMILIES]
    if not others:
        return
    engine = every_expert_in_a_slot(micro(others[0]))
    assert not engine.model.step_on_device
    list(engine.generate(PROMPT, max_tokens=3, stop_at_eos=False))
    assert per_token(engine)["synchronisations"] > 1


LONG = [int(t) for t in np.random.default_rng(5).integers(0, 250, 6)] * 3  # 18 tokens that repeat: prompt lookup
# finds drafts; past the micro gpt-oss's sliding window (8 positions)


@in_process
@pytest.mark.parametrize("arch", FAMILIES)
def test_prompt_lookup_speculation_keeps_the_cpu_float_paths_tokens(micro, monkeypatch, arch):
    """`--spec ngram` on the CUDA backend: the decode steps without a draft run version 3 (begin_step of one
    token), and so do the verify forwards (several positions: begin_step of T rows; VERIFY_FAMILIES: every
    family); the greedy tokens equal the CPU backend's float path's, as do plain decoding's; the speculation's counts
    (the distinct experts of each step: from the routing ids a step brings back) equal version 2's. A hybrid's
    (qwen3next, qwen35moe) rollbacks redo the kept tokens from the state's device snapshot: a device step too (one
    token where none was kept, else a verify step of the kept rows)."""
    from pymoe.engine.speculative import NgramDrafter, Speculator

    path = micro(arch)
    want = list(pymoe.load(path, backend="cpu", act_bits=0).generate(LONG, max_tokens=12, stop_at_eos=False))
    engine = every_expert_in_a_slot(path, speculation=True)
    assert list(engine.generate(LONG, max_tokens=12, stop_at_eos=False)) == want
    steps, verify = [], []
    begin = engine.backend.begin_step
    monkeypatch.setattr(engine.backend, "begin_step", lambda tokens, *a, **k: (
        verify if np.asarray(tokens).size > 1 else steps).append(1) or begin(tokens, *a, **k))
    spec = Speculator(NgramDrafter(), k=3)
    assert list(engine.generate(LONG, max_tokens=12, stop_at_eos=False, spec=spec)) == want
    st = spec.stats  # (a hybrid's rollback re-advances its state over the kept part: a device step of one token
    # where no draft was kept, else of the kept rows; other families have no rollbacks)
    assert st.steps > 0 and 0 < st.single_steps <= len(steps) <= st.single_steps + st.rollbacks, (st, len(steps))
    assert st.steps <= len(verify) <= st.steps + st.rollbacks, (st, len(verify))
    assert len(steps) + len(verify) == st.single_steps + st.steps + st.rollbacks
    monkeypatch.setenv("PYMOE_DEVICE_STEP", "0")  # version 2 throughout: the same speculation, experts counted alike
    v2 = Speculator(NgramDrafter(), k=3)
    assert list(every_expert_in_a_slot(path, speculation=True).generate(LONG, max_tokens=12, stop_at_eos=False,
                                                                          spec=v2)) == want
    assert v2.stats == spec.stats


@in_process
def test_gpt_oss_steps_past_its_window_keep_the_float_paths_logits(micro):
    """gpt-oss decoded past its sliding window (8 positions in the micro file), attention sinks and YaRN tables in
    every step: logits against the reference as test_device_step_logits_match_the_float_path."""
    path = micro("gpt-oss")
    ref, engine = pymoe.load(path, backend="reference"), every_expert_in_a_slot(path)
    assert {la.plan.window for la in engine.model.layers} == {8} and engine.config.rope_scaling == "yarn"
    kv_ref, kv = ref.model.new_kv(64), engine.model.new_kv(64)
    ref.model.prefill(LONG[:10], kv_ref)
    engine.model.prefill(LONG[:10], kv)
    token = LONG[10]
    for _ in range(3):
        want = ref.model.decode_one_token(token, kv_ref)
        got = engine.model.decode_one_token(token, kv)
        assert got.greedy_token == int(np.argmax(want))
        s = np.float32(np.abs(want).max())
        assert np.abs(np.asarray(got) - want).max() <= ULPS * np.spacing(s)
        token = int(np.argmax(want))
    assert engine.backend.counts.snapshot("decode")["synchronisations"] == 2 * 3  # one per step, one per fetch


SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, seed=1)  # pymoe run --temp 0.8 --top-k 40 --top-p 0.9 --seed 1


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_a_seeded_sampled_request_draws_the_cpu_backends_tokens_on_the_device(micro, arch):
    """A seeded random draw (SAMPLED) is made on the device (cuda_kernels/sample.py) for the sampler's own uniform
    number: the tokens equal the CPU backend's float path's for the seed (and are not the greedy ones), and per
    token the draw rides the step: its settings and u go up with the token id (13 int32 words, one copy), the drawn
    id (4 bytes) comes back in the step's one copy with the argmax and routing ids: one synchronisation, never the V
    logits.
    A draw the device does not make (typical-p) reads the logits (V floats, one more synchronisation): the same
    tokens for the same seed and typical-p on the CPU backend."""
    path, n = micro(arch), 12
    cpu = pymoe.load(path, backend="cpu", act_bits=0)
    want = list(cpu.generate(PROMPT, max_tokens=n, stop_at_eos=False, **SAMPLED))
    assert want != list(cpu.generate(PROMPT, max_tokens=n, stop_at_eos=False))  # the draw is not greedy here
    engine = every_expert_in_a_slot(path)
    assert engine.model.step_on_device
    assert list(engine.generate(PROMPT, max_tokens=n, stop_at_eos=False, **SAMPLED)) == want
    cfg, m = engine.config, per_token(engine)
    ids_bytes = 4 * (1 + len(cfg.moe_layers) * cfg.n_expert_used)
    assert m["bytes_by_name"] == {"token id, position and draw to device": 52,
                                  "token, routing and drawn ids to host": ids_bytes + 4}
    assert m["synchronisations"] == 1
    host_draw = dict(SAMPLED, typical_p=0.9)
    want = list(cpu.generate(PROMPT, max_tokens=n, stop_at_eos=False, **host_draw))
    assert list(engine.generate(PROMPT, max_tokens=n, stop_at_eos=False, **host_draw)) == want
    m = per_token(engine)
    assert m["synchronisations"] == 2 and m["bytes_by_name"]["logits to host"] == 4 * cfg.n_vocab



# --- speculation's verify forward as one device step (begin_step with T rows) --------------------------------------
VERIFY_FAMILIES = FAMILIES  # GQA, MLA, and the hybrids (their rollback from a device snapshot)
SEEDS = {"glm4moe": 2, "qwen3vlmoe": 5, "deepseek2": 1, "qwen3next": 17, "qwen35moe": 7}  # the repeated prompt
# per family whose drafts are partly rejected (else 0)


def repeating(arch) -> list:
    """Six random tokens three times: prompt lookup drafts what followed them, and, with this seed, the family's
    micro model keeps some drafts and rejects others (found by running the CPU backend over seeds 0..7)."""
    return [int(t) for t in np.random.default_rng(SEEDS.get(arch, 0)).integers(0, 250, 6)] * 3


def verify_counts(engine) -> list:
    """Hook the model's forward: the device counts of each verify forward (decode, several tokens) -> the list."""
    from pymoe.backends.device_counts import difference

    seen, forward, counts = [], engine.model.forward, engine.backend.counts

    def counted(tokens, kv, phase, *a, **k):
        before = counts.snapshot("decode")
        out = forward(tokens, kv, phase, *a, **k)
        if phase == "decode" and np.asarray(tokens).size > 1:
            seen.append((np.asarray(tokens).size, difference(counts.snapshot("decode"), before)))
        return out

    engine.model.forward = counted
    return seen


@in_process
def test_the_families_that_verify_on_the_device_are_these(micro):
    """A verify forward runs as one device step on every converted family: GQA attention, MLA (deepseek2) and the
    hybrids (a recurrent state rolled back from its device snapshot)."""
    runs = [a for a in FAMILIES if every_expert_in_a_slot(micro(a)).model.verify_on_device(4)]
    assert runs == VERIFY_FAMILIES


@in_process
@pytest.mark.parametrize("arch", VERIFY_FAMILIES)
def test_a_verify_step_keeps_the_float_paths_tokens_with_rollbacks(micro, monkeypatch, arch):
    """`--spec ngram` (k 3, no back-off) on a prompt whose drafts are partly kept, partly rejected (so the sequence
    is rolled back to the accepted length after a verify step): the greedy tokens are the CPU float path's plain
    decoding's. Each verify forward of T rows costs: its position, KV row and T token ids up (4 (2 + T) bytes, one
    copy), its T argmax ids and every MoE layer's [T, K] routing ids back (4 T (1 + n_moe K) bytes, one copy), one
    synchronisation, and as many launches as a one-token step (each kernel takes the T rows). The speculation's
    counts and the expert cache's decode counters equal version 2's (PYMOE_DEVICE_STEP=0). The hybrids (qwen3next,
    qwen35moe) roll back to the device snapshot of their state taken before the verify forward
    (`DeviceKVCache.snapshot_recurrent`) and redo the kept rows as a device step (a verify step where more than one
    row is kept, counted among the verify forwards here): no recurrent state crosses to the host."""
    from pymoe.engine.speculative import NgramDrafter, Speculator

    path, prompt = micro(arch), repeating(arch)
    want = list(pymoe.load(path, backend="cpu", act_bits=0).generate(prompt, max_tokens=12, stop_at_eos=False))
    engine = every_expert_in_a_slot(path, speculation=True)
    list(engine.generate(PROMPT, max_tokens=2, stop_at_eos=False))  # one plain device step: its launches
    step_launches = engine.last_stats.device["launches"]
    seen = verify_counts(engine)
    spec = Speculator(NgramDrafter(), k=3, backoff=False)
    assert list(engine.generate(prompt, max_tokens=12, stop_at_eos=False, spec=spec)) == want
    st = spec.stats
    cfg = engine.config
    hybrid = cfg.has_recurrent_state
    assert 0 < st.accepted < st.drafted and (st.rollbacks > 0) == hybrid, st
    assert (st.steps <= len(seen) <= st.steps + st.rollbacks) if hybrid else len(seen) == st.steps, (st, len(seen))
    if hybrid:  # the rollbacks went back to the device snapshot: no state crossed PCIe
        assert not [w for w in engine.backend.counts.snapshot("decode")["bytes"] if "recurrent state" in w]
    n_ids = len(cfg.moe_layers) * cfg.n_expert_used
    for T, c in seen:
        assert c["bytes"] == {"verify token ids and position to device": 4 * (2 + T),
                              "verify argmax and routing ids to host": 4 * T * (1 + n_ids)}
        assert (c["synchronisations"], c["launches"]) == (1, step_launches)
    monkeypatch.setenv("PYMOE_DEVICE_STEP", "0")  # version 2: the same speculation and cache counters
    v2_engine = every_expert_in_a_slot(path, speculation=True)
    v2 = Speculator(NgramDrafter(), k=3, backoff=False)
    assert list(v2_engine.generate(prompt, max_tokens=12, stop_at_eos=False, spec=v2)) == want
    assert v2.stats == st and v2_engine.last_stats.decode == engine.last_stats.decode


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "deepseek2"])
def test_a_rollback_leaves_rows_that_no_query_reads(micro, arch):
    """A verify step's logits (each of its T rows) are the reference's for the same positions; rolled back to one
    kept token (kv.n = p0 + 1, as speculation does after rejecting every draft), the device cache still holds the
    rejected drafts' K/V in the rows past kv.n, yet the next step's logits are the reference's: a query attends to
    rows 0 .. its own position only, and each forward writes its rows before it attends. Tolerance: ULPS (the
    module docstring)."""
    path, prompt = micro(arch), repeating(arch)[:10]  # (gpt-oss: past its window of 8)
    ref, engine = pymoe.load(path, backend="reference"), every_expert_in_a_slot(path)
    kv_ref, kv = ref.model.new_kv(64), engine.model.new_kv(64)
    ref.model.prefill(prompt, kv_ref)
    engine.model.prefill(prompt, kv)
    p0, rows = kv.n, [9, 200, 31, 77]  # the last token and three drafts
    want = ref.model.forward(rows, kv_ref, "decode")  # [4, V]
    got = engine.model.forward(rows, kv, "decode")
    assert engine.backend.counts.snapshot("decode")["synchronisations"] == 1  # the verify step's one
    assert [got[t].greedy_token for t in range(4)] == [int(np.argmax(w)) for w in want]
    s = np.float32(np.abs(want).max())
    assert np.abs(np.asarray(got) - want).max() <= ULPS * np.spacing(s)
    kv_ref.n = kv.n = p0 + 1  # the rollback: every draft rejected
    layer = next(iter(kv.rows))
    stale = np.asarray(kv.k[kv.rows[layer], p0 + 1:p0 + 4].copy_to_host())
    assert np.abs(stale).max() > 0  # the rejected drafts' keys are there, past kv.n
    for token in (5, 6):
        want, got = ref.model.decode_one_token(token, kv_ref), engine.model.decode_one_token(token, kv)
        assert got.greedy_token == int(np.argmax(want))
        s = np.float32(np.abs(want).max())
        assert np.abs(np.asarray(got) - want).max() <= ULPS * np.spacing(s)


@in_process
@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_a_hybrids_rollback_goes_back_to_the_device_snapshot(micro, arch):
    """Speculation's rollback on a hybrid, as engine/speculative.py makes it in an engine prepared for
    speculation (api.Engine `speculation`): the state snapshot on the device before a verify step of 4 rows (`DeviceKVCache.snapshot_recurrent`: a device copy, no PCIe), the step's logits
    the reference's, then every draft rejected: the snapshot copied back (`restore_recurrent`), the kept token
    redone, and the next steps' logits the reference's (which restored its host copy) -- had the state kept the
    rejected drafts, they would differ. No recurrent state crossed PCIe; a later snapshot voids the earlier token.
    Tolerance: ULPS (the module docstring)."""
    from pymoe.backends.cuda import DeviceSnapshot
    from pymoe.errors import PymoeError

    path, prompt = micro(arch), repeating(arch)[:10]
    ref, engine = pymoe.load(path, backend="reference"), every_expert_in_a_slot(path, speculation=True)
    kv_ref, kv = ref.model.new_kv(64), engine.model.new_kv(64)
    ref.model.prefill(prompt, kv_ref)
    engine.model.prefill(prompt, kv)
    p0, rows = kv.n, [9, 200, 31, 77]  # the last token and three drafts
    saved_ref, saved = kv_ref.save_recurrent(), kv.snapshot_recurrent()
    assert isinstance(saved, DeviceSnapshot)
    want, got = ref.model.forward(rows, kv_ref, "decode"), engine.model.forward(rows, kv, "decode")  # [4, V]
    assert engine.backend.counts.snapshot("decode")["synchronisations"] == 1  # the verify step's one
    s = np.float32(np.abs(want).max())
    assert np.abs(np.asarray(got) - want).max() <= ULPS * np.spacing(s)
    kv_ref.restore_recurrent(saved_ref)
    kv.restore_recurrent(saved)
    kv_ref.n = kv.n = p0  # every draft rejected: redo the kept token
    for token in (9, 5, 6):
        want, got = ref.model.decode_one_token(token, kv_ref), engine.model.decode_one_token(token, kv)
        assert got.greedy_token == int(np.argmax(want))
        s = np.float32(np.abs(want).max())
        assert np.abs(np.asarray(got) - want).max() <= ULPS * np.spacing(s)
    assert not [w for w in engine.backend.counts.snapshot("decode")["bytes"] if "recurrent state" in w]
    kv.snapshot_recurrent()
    with pytest.raises(PymoeError):
        kv.restore_recurrent(saved)


@in_process
@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_hybrids_state_snapshot_is_allocated_for_speculation_only(micro, arch):
    """A hybrid's device KV cache holds its Gated DeltaNet state once; an engine prepared for speculation
    (api.Engine `speculation`, `pymoe run --spec`) gives it the device snapshot too, as large. The backend's
    `sequence_bytes` counts what `prepare` allocated, and `pymoe plan`'s overhead (`--spec` or not) agrees."""
    from pymoe.backends.reference import gdn_state_bytes
    from pymoe.experts.plan import facts_from_gguf, overhead_for

    path = micro(arch)
    facts = facts_from_gguf(path)
    for speculation, copies in ((False, 1), (True, 2)):
        engine = every_expert_in_a_slot(path, speculation)
        b, cfg = engine.backend, engine.config
        state = sum(cfg.recurrent) * gdn_state_bytes(cfg)  # conv + recurrent state of every Gated DeltaNet layer
        assert state > 0 and b.mem.by_what["recurrent state"] == copies * state
        per_seq = b.sequence_bytes(b.n_ctx)
        assert per_seq == b.kv_bytes(b.n_ctx) + copies * state == b.mem.by_what["KV cache"] + copies * state
        assert overhead_for(facts, b.n_ctx, 0, 1, speculation).kv == per_seq
        kv = b._kvs[0]
        assert len(kv.states) == sum(cfg.recurrent) and set(kv.snapshot) == (set(kv.states) if speculation else set())


@in_process
@pytest.mark.parametrize("arch", HYBRIDS)
def test_speculation_without_a_device_snapshot_saves_the_state_on_the_host(micro, arch):
    """`generate(spec=...)` on an engine not prepared for speculation (no device snapshot): the same tokens (the CPU
    float path's) and the same speculation counts as with the snapshot; each verify forward saves the state on the
    host instead (`DeviceKVCache.snapshot_recurrent` -> `save_recurrent`: one copy to the host, one more
    synchronisation), the verify forward copies it back to the device, and so does the redo after a rollback (the
    saved copy, made the present). With the snapshot no recurrent state crosses PCIe."""
    from pymoe.backends.reference import gdn_state_bytes
    from pymoe.engine.speculative import NgramDrafter, Speculator

    path, prompt = micro(arch), repeating(arch)
    want = list(pymoe.load(path, backend="cpu", act_bits=0).generate(prompt, max_tokens=12, stop_at_eos=False))
    runs = {}
    for speculation in (True, False):
        engine = every_expert_in_a_slot(path, speculation)
        spec = Speculator(NgramDrafter(), k=3, backoff=False)
        assert list(engine.generate(prompt, max_tokens=12, stop_at_eos=False, spec=spec)) == want
        runs[speculation] = spec.stats, engine.backend.counts.snapshot("decode")
    (st, device), (st_host, host) = runs[True], runs[False]
    assert st_host == st and st.steps > 0 and st.rollbacks > 0, st
    state = sum(engine.config.recurrent) * gdn_state_bytes(engine.config)
    assert not [w for w in device["bytes"] if "recurrent state" in w]
    assert host["bytes"]["recurrent state to host"] == st.steps * state
    assert host["bytes"]["recurrent state to device"] == (st.steps + st.rollbacks) * state
    assert host["synchronisations"] == device["synchronisations"] + st.steps


@in_process
def test_pymoe_run_prepares_the_engine_for_speculation_with_spec_only(micro, monkeypatch):
    """`pymoe run --spec ngram` loads the engine with `speculation` (a hybrid's device KV cache gets its state's
    snapshot); `pymoe run` without --spec does not."""
    from click.testing import CliRunner

    import pymoe.api
    from pymoe.cli import cli

    path, engines, real = micro("qwen3next"), [], pymoe.api.load
    monkeypatch.setattr(pymoe.api, "load", lambda *a, **k: engines.append(real(*a, **dict(k, backend_options=SIM)))
                        or engines[-1])
    for flags in ((), ("--spec", "ngram")):
        res = CliRunner().invoke(cli, ["run", path, "--backend", "cuda", "--cache-slots", "4", "--pcie-frac", "1",
                                       "-n", "3", "--temp", "0", "-p", "hello", *flags])
        assert res.exit_code == 0, res.output
    assert [bool(e.backend._kvs[0].snapshot) for e in engines] == [False, True]


@in_process
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_simulator_replays_a_speculative_device_run_with_its_counts(micro, tmp_path, policy):
    """As test_the_simulator_replays_a_device_step_run_with_its_counts, with `--spec ngram`: the trace of the same
    speculative greedy request (recorded on the reference backend, version 2: its verify forwards marked "verify"),
    replayed with the same profile, policy and two slots (misses read over PCIe and promoted), gives the engine's
    decode hits and lookups, its verify forwards run as device steps (one lookup call per MoE layer for the T rows
    after each, as version 2's verify forward makes it)."""
    from pymoe.engine.speculative import NgramDrafter, Speculator
    from pymoe.experts.simulate import sweep
    from pymoe.experts.trace import Trace

    path, prompt = micro("qwen3moe"), repeating("qwen3moe")
    ref = pymoe.load(path, backend="reference")
    recorder = ref.record_trace()
    spec = Speculator(NgramDrafter(), k=3, backoff=False)
    want = list(ref.generate(prompt, max_tokens=12, stop_at_eos=False, spec=spec))
    recorder.save(tmp_path / "t.npz")
    profile = Profile(1, 4, pairs=[(0, 3), (0, 1)], counts=[2, 1])
    engine = pymoe.load(path, backend="cuda", cache_slots=2, profile=profile, policy=policy, pcie_frac=1.0,
                        backend_options=SIM)
    seen = verify_counts(engine)
    spec3 = Speculator(NgramDrafter(), k=3, backoff=False)
    assert list(engine.generate(prompt, max_tokens=12, stop_at_eos=False, spec=spec3)) == want
    assert len(seen) == spec3.stats.steps > 0 and all(c["synchronisations"] == 1 for _, c in seen)
    d = engine.last_stats.decode
    (sim,) = sweep(Trace.load(tmp_path / "t.npz"), [policy], [2], ["global"], profile=profile, phase="decode")
    assert (sim.hits, sim.lookups) == (d["hits"], d["lookups"]) and 0 < d["hits"] < d["lookups"], (sim, d)


@in_process
def test_sampled_verification_reads_the_logits_on_the_host(micro):
    """Speculation at temperature > 0 (SAMPLED at temperature 0.2, low enough that the output repeats and prompt
    lookup drafts): the verify step runs on the device, and Sampler.verify's draws are made on the host from its
    logits [T, V], brought over once per verify forward (4 T V bytes, one more synchronisation); the tokens are the
    CPU float path's for the seed."""
    from pymoe.engine.speculative import NgramDrafter, Speculator

    path, prompt, sampled = micro("qwen3moe"), repeating("qwen3moe"), dict(SAMPLED, temperature=0.2)
    spec = Speculator(NgramDrafter(), k=3, backoff=False)
    want = list(pymoe.load(path, backend="cpu", act_bits=0).generate(prompt, max_tokens=12, stop_at_eos=False,
                                                                     spec=spec, **sampled))
    from pymoe.backends.device_counts import difference

    engine = every_expert_in_a_slot(path)
    spec3 = Speculator(NgramDrafter(), k=3, backoff=False)
    seen, step, counts, st = [], spec3.step, engine.backend.counts, spec3.stats

    def counted(*a, **k):  # the device counts of each speculation step that verified (its forward and its draws)
        before, n, drafted = counts.snapshot("decode"), st.steps, st.drafted
        out = step(*a, **k)
        if st.steps > n:
            seen.append((1 + st.drafted - drafted, difference(counts.snapshot("decode"), before)))
        return out

    spec3.step = counted
    assert list(engine.generate(prompt, max_tokens=12, stop_at_eos=False, spec=spec3, **sampled)) == want
    assert st == spec.stats and len(seen) == st.steps > 0
    V = engine.config.n_vocab
    for T, c in seen:
        assert c["synchronisations"] == 2 and c["bytes"]["logits to host"] == 4 * T * V



@in_process
def test_mtp_speculation_runs_its_steps_on_the_device(micro, monkeypatch):
    """`--spec mtp` (glm4moe's micro file with an MTP block, k 3, no back-off): the MTP drafter's tap takes the normed
    last hidden states [T, D] of every forward of its sequence; a device step (plain or verify) brings them back
    before its ids, in its one synchronisation (4 T D bytes more), so the plain steps and the verify forwards run on
    the device. The tokens are the CPU float path's plain decoding's, the speculation's counts the CPU backend's
    (the micro block is random: every draft is rejected, each verify step rolled back), and the hidden states the
    drafter was handed are the CPU's within the module's bound (ULPS of their largest magnitude: the same float32
    operations in other orders)."""
    from pymoe.demo.tinymodel import write_model
    from pymoe.engine.mtp import MtpDrafter

    handed, keep = {}, MtpDrafter._keep  # each drafter's hidden state of every position, as its tap was handed it

    def kept(self, p0, h):
        for j, row in enumerate(np.asarray(h)):
            handed.setdefault(id(self), {})[p0 + j] = row.copy()
        return keep(self, p0, h)

    monkeypatch.setattr(MtpDrafter, "_keep", kept)

    path = micro("glm4moe").replace(".gguf", "-mtp.gguf")
    write_model(path, "glm4moe", "micro", "f32", seed=0, mtp=True)
    prompt = repeating("glm4moe")
    cpu = pymoe.load(path, backend="cpu", act_bits=0)
    want = list(cpu.generate(prompt, max_tokens=10, stop_at_eos=False))
    spec_cpu = cpu.speculator("mtp", 3)
    spec_cpu.backoff, spec_cpu.pause = False, 0
    assert list(cpu.generate(prompt, max_tokens=10, stop_at_eos=False, spec=spec_cpu)) == want
    engine = every_expert_in_a_slot(path)
    steps, begin = [], engine.backend.begin_step
    engine.backend.begin_step = lambda tokens, *a, **k: steps.append(np.asarray(tokens).size) or begin(tokens, *a,
                                                                                                       **k)
    seen = verify_counts(engine)
    spec = engine.speculator("mtp", 3)
    spec.backoff, spec.pause = False, 0
    assert list(engine.generate(prompt, max_tokens=10, stop_at_eos=False, spec=spec)) == want
    st = spec.stats
    assert st == spec_cpu.stats and st.steps > 0 and st.drafted > st.accepted
    assert sorted(steps) == sorted([1] * st.single_steps + [T for T, _ in seen]) and len(seen) == st.steps
    D = engine.config.n_embd
    for T, c in seen:
        assert c["synchronisations"] == 1 and c["bytes"]["hidden states to host (mtp)"] == 4 * T * D
    got, ref = handed[id(spec.drafter)], handed[id(spec_cpu.drafter)]
    assert got.keys() == ref.keys() and len(got) > len(prompt)
    for p, h in ref.items():
        assert np.abs(got[p] - h).max() <= ULPS * np.spacing(np.float32(np.abs(h).max()))


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
