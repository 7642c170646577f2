"""The CUDA backend on several devices (pymoe/backends/multi_device.py), in Numba's CUDA simulator.

The simulator has one device (`cuda.select_device(1)` raises), so the two "devices" are two CUDABackend instances
in its one context, each with its own memory budget, counters, KV rows and slot pool. The kernels are the NumPy
reference set (`kernels="reference"`, as tests/test_cuda_backend.py runs them: the real kernels take ~1 min per
micro-model forward in the simulator, and the micro preset's one-layer qwen3moe cannot be split in two), on the tiny
models, which have 2-4 layers: glm4moe and deepseek2 lead with a dense layer, qwen3next mixes Gated DeltaNet and
gated attention (both on the host side) with device experts.
Oracles: the CPU float path (backends/reference.py) and the one-device run for tokens and logits; the planner's
split (experts/multi.plan_devices) for the layer ranges; the simulator's one-pool-per-card replay
(experts/multi.simulate_devices) for each device's cache counters.
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pymoe  # noqa: E402
from pymoe.errors import PymoeError  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 200, 31]  # 12 tokens: with --chunk 8, chunks of 8 and 4
N_NEW = 8
MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve


def load(path, devices=None, free_bytes=SIM["free_bytes"], **options):
    options.setdefault("chunk", 8)
    return pymoe.load(path, backend="cuda", backend_options=dict(SIM, free_bytes=free_bytes), devices=devices,
                      **options)


def greedy(engine):
    return list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))


def logits(engine):
    """Prefill logits of PROMPT and one decode step's, from a fresh KV cache: [13, V]."""
    kv = engine.model.new_kv(64)
    return np.concatenate([engine.model.prefill(PROMPT, kv), engine.model.decode_one_token(9, kv)[None]])


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "glm4moe", "deepseek2", "qwen3next"])
def test_two_devices_give_the_tokens_of_one_device_and_of_the_cpu_float_path(tiny_model, arch):
    """Greedy tokens of two devices = one device = the CPU float path, with a small pool (misses: spill and cpu,
    promotions); logits of two devices = one device's bit for bit with every miss spilled (the same kernels on the
    same inputs: splitting changes where a layer runs, not its arithmetic), and within 1e-4 of the float path (the
    device path's bound in tests/test_cuda_backend.py)."""
    path = tiny_model(arch, "q2_k")
    ref = pymoe.load(path, backend="reference")
    want_tokens, want_logits = greedy(ref), logits(ref)
    cfg = ref.config
    slots = len(cfg.moe_layers)  # one slot per MoE layer (1/8 of the experts): misses and promotions on each device
    one = load(path, cache_slots=slots, pcie_frac=0.5, policy="lru")
    two = load(path, devices="2", cache_slots=slots, pcie_frac=0.5, policy="lru")
    assert greedy(one) == greedy(two) == want_tokens
    d = two.cache.stats.counts["decode"]
    assert d["lookups"] == (N_NEW - 1) * len(cfg.moe_layers) * cfg.n_expert_used
    assert d["promoted"] > 0 and d["spill"] > 0 and d["cpu"] > 0
    one = load(path, cache_slots=slots, pcie_frac=1.0, policy="lru")
    two = load(path, devices="2", cache_slots=slots, pcie_frac=1.0, policy="lru")
    got = logits(two)
    np.testing.assert_array_equal(got, logits(one))
    np.testing.assert_allclose(got, want_logits, rtol=0, atol=1e-4)


@in_process
@pytest.mark.parametrize("arch, sizes", [("qwen3next", (96, 32)), ("glm4moe", (64, 64))])
def test_the_split_is_the_planners_and_each_device_holds_its_layers(tiny_model, arch, sizes, monkeypatch):
    """Devices of 96 and 32 MiB beyond the reserve: the layers go 3 : 1, as `pymoe plan --devices` splits them
    (experts/multi.plan_devices, same usable bytes; qwen3next); each device's KV cache has rows for its own layers
    only (qwen3next: its gated attention layers'; Gated DeltaNet layers keep no K/V), the dense weights are split between
    the devices, and each slot pool holds experts of its device's layers only."""
    from pymoe.experts.multi import plan_devices, uniform_device_hits
    from pymoe.experts.plan import CostModel, facts_from_gguf

    path = tiny_model(arch, "q2_k")
    free = [700 * MiB + s * MiB for s in sizes]
    two = load(path, devices="2", free_bytes=free, cache_slots=4)
    b = two.backend
    facts = facts_from_gguf(path)
    plan = plan_devices(free, facts, 0, 0, 700 * MiB, uniform_device_hits(facts.n_expert),
                        CostModel.from_options())
    assert [(r.start, r.stop) for r in b.ranges] == [row.layers for row in plan.rows]
    assert [len(r) for r in b.ranges] == ([3, 1] if sizes == (96, 32) else [2, 1])
    kv_layers = () if two.model.host_attention else two.config.kv_layers()  # (a kind on the host side: KV there)
    for dev, r in zip(b.devices, b.ranges):
        assert sorted(dev._kv.rows) == [i for i in kv_layers if i in r]
    for dev, r, cache in zip(b.devices, b.ranges, two.cache.parts):
        layers = np.flatnonzero((cache.residency >= 0).any(axis=1))
        assert layers.size and set(layers.tolist()) <= set(r)
        assert cache.pool is dev.cache_pool and dev.mem.by_what["expert slots"] == cache.n_slots * two.file.slot_bytes
    # several devices run version 2 (the device step keeps a token on one device): the one-device run to compare
    # with is version 2 too (version 3 also uploads the embedding's rows)
    assert not two.model.step_on_device
    monkeypatch.setenv("PYMOE_DEVICE_STEP", "0")
    one = load(path, cache_slots=4)
    dense = [dev.mem.by_what["dense weights"] for dev in b.devices]
    assert sum(dense) == one.backend.mem.by_what["dense weights"] and min(dense) > 0


@in_process
def test_per_device_counters_equal_the_simulators_one_pool_per_card(tiny_model, monkeypatch):
    """A two-device run records its routing; `pymoe simulate --devices`'s replay (experts/multi.simulate_devices:
    one pool per card over its MoE layers, the engine's slots per device) counts each device's decode lookups,
    hits and promotions exactly. The device counts (launches, syncs) sum to the one-device run's; the bytes too, but
    for the RoPE tables the second device uploads once per forward call (its attention needs them)."""
    from pymoe.backends.device_counts import difference
    from pymoe.experts.multi import moe_range, simulate_devices
    from pymoe.experts.profile import Profile

    path = tiny_model("qwen3moe", "q2_k")
    two = load(path, devices="2", cache_slots=6, policy="lru", pcie_frac=1.0)
    rec = two.record_trace()
    out = list(two.generate(PROMPT, max_tokens=16, stop_at_eos=False))
    trace = rec.trace()
    n_dense = two.config.moe_layers.start
    ranges = [moe_range(r.start, r.stop, n_dense) for r in two.backend.ranges]
    empty = Profile(trace.n_layers, trace.n_experts, np.zeros((0, 2)), [])  # the engine had no --profile
    sims = simulate_devices(trace, ranges, [c.n_slots for c in two.cache.parts], "lru", phase="decode",
                            profile=empty)
    per = two.cache.per_device("decode")
    assert [(s.lookups, s.hits, s.promoted) for s in sims] == [(p["lookups"], p["hits"], p["promoted"]) for p in per]
    assert sum(p["lookups"] for p in per) == 15 * len(two.config.moe_layers) * two.config.n_expert_used
    assert all(0 < p["hits"] < p["lookups"] for p in per)  # neither pool trivially all-hit or all-miss
    line = two.last_stats.cache_line()
    assert "cuda:0 (layers 0-0, 3 slots)" in line and "cuda:1 (layers 1-1, 3 slots)" in line, line

    # full pools: the same hits on one device and two, so the device counts compare term by term
    n_all = len(two.config.moe_layers) * two.config.n_expert
    monkeypatch.setenv("PYMOE_DEVICE_STEP", "0")  # two devices run version 2: so does the one-device run compared
    one, two = load(path, cache_slots=n_all), load(path, devices="2", cache_slots=n_all)
    counts = []
    for e in (one, two):
        before = e.backend.counts.snapshot("decode")
        assert greedy(e) == out[:N_NEW]
        counts.append(difference(e.backend.counts.snapshot("decode"), before))
    c1, c2 = counts
    assert (c2["launches"], c2["synchronisations"], c2["tokens"]) == (c1["launches"], c1["synchronisations"],
                                                                       c1["tokens"])
    rope = "RoPE tables to device"
    assert {w: n for w, n in c2["bytes"].items() if w != rope} == {w: n for w, n in c1["bytes"].items() if w != rope}
    assert c2["bytes"][rope] == 2 * c1["bytes"][rope]  # each device uploads the step's tables once
    per_dev = two.backend.counts.per_device("decode")
    assert sum(p["launches"] for p in per_dev) == two.backend.counts.snapshot("decode")["launches"]
    assert "per device" in two.last_stats.device_line()


@in_process
def test_pymoe_run_and_the_server_status_per_device(tiny_model, monkeypatch, tmp_path):
    """`pymoe run FILE --backend cuda --devices 2` (the reference kernels put in through api.load): one memory line,
    pool and pre-fill line per device, and the request's cache and device lines per device (and its --telemetry
    record); /v1/status
    (serve/metrics.status_of) gives each device's slots, layers, counters and device counts."""
    from click.testing import CliRunner

    import pymoe.api
    from pymoe.cli import cli
    from pymoe.engine.sampler import SamplingParams
    from pymoe.serve.metrics import status_of
    from pymoe.serve.scheduler import Job, Scheduler

    path = tiny_model("qwen3moe", "q2_k")
    real = pymoe.api.load
    monkeypatch.setattr(pymoe.api, "load", lambda *a, **k: real(*a, **dict(k, backend_options=SIM)))
    res = CliRunner().invoke(cli, ["run", path, "--backend", "cuda", "--devices", "2", "--cache-slots", "4",
                                    "--pcie-frac", "1", "-n", "5", "--temp", "0", "-p", "hello",
                                    "--telemetry", str(tmp_path / "t.jsonl"), "--telemetry-interval", "0"])
    assert res.exit_code == 0, res.output
    out = res.output
    for d, layer in ((0, 0), (1, 1)):
        assert f"cuda:{d} layers {layer}-{layer}: device memory:" in out, out
        assert f"cuda:{d}: pre-filled 2 of 2 slots" in out, out
        assert f"cuda:{d} (layers {layer}-{layer}, 2 slots)" in out, out
    assert "decode device per token:" in out and "; per device: cuda:0 " in out, out
    import json

    (rec,) = [r for r in map(json.loads, open(tmp_path / "t.jsonl")) if r["kind"] == "request"]
    assert [(d["device"], d["slots"]) for d in rec["devices"]] == [("cuda:0", 2), ("cuda:1", 2)]
    assert sum(d["lookups"] for d in rec["devices"]) == rec["lookups"] > 0

    engine = load(path, devices="2", cache_slots=4, pcie_frac=1.0)
    with Scheduler(engine, parallel=1, kv="f32") as sched:
        job = sched.submit(Job(prompt_ids=PROMPT, max_tokens=N_NEW, ignore_eos=True,
                               sampling=SamplingParams(temperature=0)))
        list(job.events(timeout=120))
        status = status_of(sched)
    per = status["cache"]["per_device"]
    assert [(p["device"], p["layers"], p["slots"]) for p in per] == [("cuda:0", [0, 0], 2), ("cuda:1", [1, 1], 2)]
    cfg = engine.config
    assert sum(p["lookups"] for p in per) == status["cache"]["counts"]["decode"]["lookups"] == \
        (N_NEW - 1) * len(cfg.moe_layers) * cfg.n_expert_used
    dev = status["device"]["per_device"]
    assert len(dev) == 2 and all(d["launches"] > 0 for d in dev)
    assert sum(d["launches"] for d in dev) == pytest.approx(status["device"]["decode_per_token"]["launches"])


@in_process
def test_micro_glm4moe_on_two_devices_with_the_real_kernels(tmp_path, monkeypatch):
    """The real kernels (cuda_kernels/) in the simulator, on the micro glm4moe (a dense layer, then an MoE layer:
    device 0 runs the dense layer and has no slot pool, device 1 the MoE layer with its pool, pre-filled): greedy
    tokens of two devices = one device = the CPU float path; logits of two devices = one device's bit for bit (the
    same kernels on the same inputs) and within 1e-4 of the float path (the device path's bound in
    tests/test_cuda_backend.py). 460 s on 2 busy cores (each kernel block runs as 32 Python threads: the cost of
    holding the real kernels to this)."""
    from pymoe.demo.tinymodel import write_model

    path = str(tmp_path / "micro-glm4moe-f32.gguf")
    write_model(path, "glm4moe", "micro", "f32", seed=0)
    prompt, opts = [5, 17], dict(cache_slots=2, policy="lru", pcie_frac=0.5, chunk=8, n_ctx=64)

    def run(engine):
        out, model = [], engine.model
        kv = model.new_kv(64)
        out.append(model.prefill(prompt, kv))
        out.append(model.decode_one_token(int(np.argmax(out[-1][-1])), kv)[None])
        return [int(np.argmax(a[-1])) for a in out], np.concatenate(out)

    want_tokens, want_logits = run(pymoe.load(path, backend="reference", n_ctx=64))
    free = dict(free_bytes=700 * MiB + 64 * MiB)
    monkeypatch.setenv("PYMOE_DEVICE_STEP", "0")  # several devices run version 2: so does the one device compared
    one = run(pymoe.load(path, backend="cuda", backend_options=free, **opts))
    engine = pymoe.load(path, backend="cuda", backend_options=free, devices="2", **opts)
    assert engine.backend.devices[0].k.name == "cuda_kernels" and engine.cache.parts[0] is None
    assert not engine.model.step_on_device
    two = run(engine)
    assert two[0] == one[0] == want_tokens
    np.testing.assert_array_equal(two[1], one[1])
    np.testing.assert_allclose(two[1], want_logits, rtol=0, atol=1e-4)
    assert [p["slots"] for p in engine.cache.per_device("decode")] == [0, 2]
    assert engine.cache.per_device("decode")[1]["lookups"] == engine.config.n_expert_used


@in_process
def test_bad_device_requests_are_one_line_errors(tiny_model, monkeypatch):
    """Errors name what is wrong in one line: too many devices, bad indices, a budget too small (and on which
    device), PYMOE_SIM_DEVICE_GIB, a backend other than cuda. PYMOE_SIM_DEVICE_GIB sizes each simulated device."""
    from pymoe.backends.multi_device import MultiDeviceBackend

    path = tiny_model("qwen3moe", "q2_k")
    with pytest.raises(PymoeError, match="--devices"):
        load(path, devices="3")  # 3 devices for 2 layers
    with pytest.raises(PymoeError, match="device indices"):
        load(path, devices="0,x")
    with pytest.raises(PymoeError, match="^cuda:1: device memory budget exceeded"):  # which device, named
        load(path, devices="2", free_bytes=[700 * MiB + 64 * MiB, 700 * MiB + MiB])
    monkeypatch.setenv("PYMOE_SIM_DEVICE_GIB", "1,0.75")  # the simulated devices' sizes, one per device
    b = MultiDeviceBackend([0, 1], kernels="reference")
    assert [d.free_at_start for d in b.devices] == [2**30, 3 * 2**28] and "cuda:1 0.75 GiB" in b.note
    for bad in ("1,0", "1,x", "1,1,1"):
        monkeypatch.setenv("PYMOE_SIM_DEVICE_GIB", bad)
        with pytest.raises(PymoeError, match="PYMOE_SIM_DEVICE_GIB"):
            MultiDeviceBackend([0, 1], kernels="reference")
    with pytest.raises(PymoeError, match="--devices runs the cuda backend"):
        pymoe.load(path, backend="cpu", devices="2")


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
