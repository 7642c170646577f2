"""The CUDA backend's cost, counted (backends/device_counts.py) in Numba's CUDA simulator: launches, host<->device
bytes by name and host synchronisations per decoded token, held to numbers worked out from the code's structure, so
that the counters (and the design they measure) cannot drift unnoticed; and `pymoe run --backend cuda` end to end
in the simulator.

Model: the `micro` preset of qwen3moe (pymoe/demo/tinymodel.py: hidden D = 32, 1 layer, E = 4 experts, top K = 2,
expert FFN F = 32, 2 query heads / 1 KV head of 16 with q/k norms, RoPE over 16 dims, vocabulary V = 264, F32). One
expert is 3 matrices of 32 x 32 float32: 3 x 4096 = 12,288 bytes.
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: switches the simulator on

import pytest  # noqa: E402

import pymoe  # noqa: E402
from pymoe.backends.device_counts import per_token  # noqa: E402
from pymoe.experts.profile import Profile  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [5, 17]
N_NEW = 4  # 3 decode steps
MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # the counts do not depend on the kernel set
D, E, K, V, ROPE_PAIRS = 32, 4, 2, 264, 8
EXPERT_BYTES = 3 * 32 * 32 * 4
F32 = 4

# One decode token of version 2, every expert in a slot, worked out from backends/cuda.py and engine/:
#   attention block (engine/attention.py): to_device of the normed residual [1, D]; q, k, v projections (3 matmul
#     launches); q and k norms (2 rmsnorm); RoPE on q and k (2 rope; the token's cos and sin rows uploaded once per
#     forward, 8 + 8 floats); the KV write (device to device: not counted); 1 decode_attention; the output
#     projection (1 matmul); to_host of [1, D] (1 sync)                              -> 9 launches, 1 sync
#   router (engine/moe.py, ffn_gate_inp on the host residual): linear_raw: [1, D] in, 1 matmul, [1, E] out, 1 sync
#   experts: the K pairs' inputs [K, D], router weights [K], zeroed outputs [K, D] in; expert_block per expert
#     (gate_up + down: 2 launches each, K experts); outputs [K, D] back, 1 sync                -> 2K launches
#   logits: the output projection on the host's normed residual: [1, D] in, 1 matmul, [1, V] out, 1 sync
SLOT_TOKEN = dict(launches=9 + 1 + 2 * K + 1, synchronisations=4, bytes_by_name={
    "residual to device (attention block)": D * F32,
    "RoPE tables to device": 2 * ROPE_PAIRS * F32,
    "attention block to host": D * F32,
    "router: input to device": D * F32, "router: output to host": E * F32,
    "expert inputs to device": K * D * F32, "expert weights to device": K * F32,
    "expert output zeros to device": K * D * F32, "expert outputs to host": K * D * F32,
    "output projection: input to device": D * F32, "output projection: output to host": V * F32})

# One decode token of version 3 (the device step, backends/cuda.py `begin_step`), every expert in a slot:
#   the token id, its position and its KV row in (int32 [3], one copy) and 1 embed launch; per layer: rmsnorm (1),
#     the attention block as above but on the normed residual already there and the context's RoPE tables already
#     there (3 matmul, 2 rmsnorm, 2 rope, the KV write as a kernel reading its row on the device (1 kv_store),
#     1 decode_attention, 1 matmul), the residual add (1), rmsnorm (1), the router (1 matmul), its top-K (1
#     route_softmax), the routed experts through the residency table (2: gate_up, down), the residual add (1)
#                                                                                     -> 18 launches, nothing copied
#   the output norm (1), the output projection (1 matmul), argmax (1); the token id and the K routing ids back in
#     one copy: the step's one synchronisation
STEP_TOKEN = dict(launches=1 + 18 + 3, synchronisations=1, bytes_by_name={
    "token id and position to device": 12, "token and routing ids to host": 4 * (1 + K)})


@pytest.fixture(scope="module")
def micro_model(tmp_path_factory):
    from pymoe.demo.tinymodel import write_model

    path = str(tmp_path_factory.mktemp("micro") / "micro-qwen3moe-f32.gguf")
    write_model(path, "qwen3moe", "micro", "f32", seed=0)
    return path


def decode(engine):
    list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    return engine.last_stats


@in_process
@pytest.mark.parametrize("version", [2, 3])
def test_one_decode_token_with_every_expert_in_a_slot(micro_model, monkeypatch, version):
    monkeypatch.setenv("PYMOE_DEVICE_STEP", "1" if version == 3 else "0")
    want = SLOT_TOKEN if version == 2 else STEP_TOKEN
    profile = Profile(1, E, pairs=[(0, e) for e in range(E)], counts=[1] * E)  # pre-fills all 4 slots
    engine = pymoe.load(micro_model, backend="cuda", cache_slots=E, profile=profile, pcie_frac=1.0,
                        backend_options=SIM)
    st = decode(engine)
    assert st.decode["hits"] == st.decode["lookups"] == (N_NEW - 1) * K
    m = per_token({**st.device, "tokens": st.n_decoded})
    assert st.device["forwards"] == st.device["tokens"] == N_NEW - 1
    assert (m["launches"], m["synchronisations"]) == (want["launches"], want["synchronisations"])
    assert m["bytes_by_name"] == want["bytes_by_name"]
    total = sum(want["bytes_by_name"].values())  # 2,424 (version 2), 16 (version 3)
    assert st.device_line() == (f"decode device per token: {want['launches']:.1f} launches, {total:,} "
                                f"host<->device bytes, {want['synchronisations']:.1f} synchronisations")


@in_process
def test_a_sampled_decode_token_brings_back_a_token_id_not_the_logits(micro_model, monkeypatch):
    """Version 3, temperature 0.8, top-k 40, top-p 0.9, seed 1: the draw rides the step (cuda_kernels/sample.py,
    backends/cuda.py `begin_step`): its settings and u go up in the token id's copy (13 int32 words in place of 3),
    1 sample launch more, and the drawn id comes back in the step's one copy (4 bytes more): one synchronisation.
    A draw the device does not make (typical-p 0.9) brings the V logits over (V * 4 bytes, a second
    synchronisation)."""
    monkeypatch.setenv("PYMOE_DEVICE_STEP", "1")
    profile = Profile(1, E, pairs=[(0, e) for e in range(E)], counts=[1] * E)
    engine = pymoe.load(micro_model, backend="cuda", cache_slots=E, profile=profile, pcie_frac=1.0,
                        backend_options=SIM)
    sampled = dict(temperature=0.8, top_k=40, top_p=0.9, seed=1)
    got = {}
    for name, extra in (("device", {}), ("host", dict(typical_p=0.9))):
        list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False, **sampled, **extra))
        st = engine.last_stats
        got[name] = per_token({**st.device, "tokens": st.n_decoded})
    ids_back = STEP_TOKEN["bytes_by_name"]["token and routing ids to host"]
    assert got["device"]["bytes_by_name"] == {"token id, position and draw to device": 4 * 13,
                                              "token, routing and drawn ids to host": ids_back + 4}
    assert got["device"]["synchronisations"] == STEP_TOKEN["synchronisations"]
    assert got["device"]["launches"] == STEP_TOKEN["launches"] + 1
    assert got["host"]["bytes_by_name"] == {**STEP_TOKEN["bytes_by_name"], "logits to host": V * F32}
    assert got["host"]["synchronisations"] == STEP_TOKEN["synchronisations"] + 1
    assert got["host"]["launches"] == STEP_TOKEN["launches"]


@in_process
@pytest.mark.parametrize("version", [2, 3])
def test_prefill_attention_is_one_launch_per_chunk(micro_model, monkeypatch, version):
    """A prompt of 3 tokens (one chunk) over the device KV cache: one chunk_attention launch for the 1 layer and no
    decode-attention launch; then a decode token: one decode_attention launch, no chunk_attention."""
    monkeypatch.setenv("PYMOE_DEVICE_STEP", "1" if version == 3 else "0")
    engine = pymoe.load(micro_model, backend="cuda", cache_slots=E, pcie_frac=1.0, backend_options=SIM)
    b, ops = engine.backend, []
    launch = b._launch
    monkeypatch.setattr(b, "_launch", lambda op, *a: ops.append(op) or launch(op, *a))
    kv = engine.model.new_kv(16)
    engine.model.prefill(PROMPT + [9], kv)
    assert (ops.count("chunk_attention"), ops.count("decode_attention")) == (1, 0), ops
    ops.clear()
    engine.model.decode_one_token(3, kv)
    assert (ops.count("chunk_attention"), ops.count("decode_attention")) == (0, 1), ops


@in_process
def test_misses_add_their_pcie_bytes_and_the_cpu_ones_no_launches(micro_model, monkeypatch):
    """One slot, pcie_frac 0.5: the slot starts with the first expert of the start-up fill (experts/cache.py
    SlotCache.fill), so a step may hit it once, and at least one of a step's K = 2 experts misses (one slot serves one
    of them). The misses alternate between a read over PCIe by the expert's kernels (one token: one token tile, so
    its bytes once) and the CPU (no launch; the error diffusion of pcie_frac 0.5 keeps the two within one); every
    miss is promoted into the one slot, which keeps the last (one copy per slot per call). "cpu" misses need the
    host: version 2 (PYMOE_DEVICE_STEP=0), whose counts these are (version 3 with "cpu" misses:
    tests/test_cuda_device_step.py)."""
    monkeypatch.setenv("PYMOE_DEVICE_STEP", "0")
    engine = pymoe.load(micro_model, backend="cuda", cache_slots=1, policy="lru", pcie_frac=0.5, backend_options=SIM)
    st = decode(engine)
    c, dev, steps = st.decode, st.device, N_NEW - 1
    assert c["hits"] + c["spill"] + c["cpu"] == c["lookups"] == K * steps and abs(c["spill"] - c["cpu"]) <= 1, c
    assert c["promoted"] == c["spill"] + c["cpu"] and c["cpu"] >= steps - 1, c
    assert dev["bytes"]["expert spill reads over PCIe"] == c["spill"] * EXPERT_BYTES
    assert dev["bytes"]["slot copies (promotions, prefetches) to device"] == steps * EXPERT_BYTES
    assert dev["launches"] == steps * SLOT_TOKEN["launches"] - 2 * c["cpu"]  # a CPU expert's expert_block: none
    assert dev["synchronisations"] == steps * SLOT_TOKEN["synchronisations"]
    others = {w: b for w, b in dev["bytes"].items() if not w.startswith(("expert spill", "slot copies"))}
    assert others == {w: steps * b for w, b in SLOT_TOKEN["bytes_by_name"].items()}  # the CPU expert's rows too


@in_process
def test_the_server_status_gives_the_counts_by_name(micro_model, monkeypatch):
    """/v1/status (serve/metrics.status_of): the decode counts per decoded token since start. The server's slots
    keep their own KV caches (the attention may run on the host), so only what does not depend on that is held to
    SLOT_TOKEN's numbers: the router's and the experts' bytes, and the tokens counted (version 2, which
    PYMOE_DEVICE_STEP=0 selects: version 3 moves none of these)."""
    from pymoe.engine.sampler import SamplingParams
    from pymoe.serve.metrics import status_of
    from pymoe.serve.scheduler import Job, Scheduler

    monkeypatch.setenv("PYMOE_DEVICE_STEP", "0")
    profile = Profile(1, E, pairs=[(0, e) for e in range(E)], counts=[1] * E)
    engine = pymoe.load(micro_model, backend="cuda", cache_slots=E, profile=profile, pcie_frac=1.0,
                        backend_options=SIM, n_ctx=64)
    with Scheduler(engine, parallel=1, kv="f32") as sched:
        job = sched.submit(Job(prompt_ids=PROMPT, max_tokens=N_NEW, ignore_eos=True,
                               sampling=SamplingParams(temperature=0)))
        list(job.events(timeout=120))
        m = status_of(sched)["device"]["decode_per_token"]
    assert m["tokens"] == N_NEW - 1 and m["launches"] > 0 and m["synchronisations"] > 0
    for name in ("router: output to host", "expert inputs to device", "expert outputs to host"):
        assert m["bytes_by_name"][name] == SLOT_TOKEN["bytes_by_name"][name], name


@in_process
@pytest.mark.parametrize("together", [False, True])
def test_two_server_slots_on_device_kv_caches_cost_one_step_per_tick(micro_model, monkeypatch, together):
    """Two requests decoded at once by the server's scheduler, each slot on a device KV cache of its own (the engine
    loaded for 2 sequences). PYMOE_BATCH_STEP=0: each slot's decode token is a device step of its own, so the counts
    per decoded token in /v1/status are one step's, STEP_TOKEN exactly (one synchronisation per token, B per
    scheduler step of B slots). By default the ticks where both decode run one batched step for the two
    (engine/device_batch.py): the single step's 22 launches and one synchronisation for 2 tokens, 4 int32 per row
    up (token id, position, KV row, sequence) and 1 + K per row back; a tick with one slot decoding is a single step.
    Each request's cache counters are its own tokens' lookups either way."""
    from pymoe.engine.sampler import SamplingParams
    from pymoe.serve.metrics import status_of
    from pymoe.serve.scheduler import Job, Scheduler

    monkeypatch.setenv("PYMOE_BATCH_STEP", "1" if together else "0")
    profile = Profile(1, E, pairs=[(0, e) for e in range(E)], counts=[1] * E)
    engine = pymoe.load(micro_model, backend="cuda", cache_slots=E, profile=profile, pcie_frac=1.0,
                        backend_options=SIM, n_ctx=64, sequences=2)
    steps0 = engine.backend._steps
    with Scheduler(engine, parallel=2, kv="f32") as sched:
        jobs = [sched.submit(Job(prompt_ids=p, max_tokens=N_NEW, ignore_eos=True,
                                 sampling=SamplingParams(temperature=0))) for p in (PROMPT, [9, 12])]
        for job in jobs:
            list(job.events(timeout=120))
        m = status_of(sched)["device"]["decode_per_token"]
        assert sched.max_batch == 2 and sched.device_slots() == 2
    n = 2 * (N_NEW - 1)
    assert m["tokens"] == n
    steps = engine.backend._steps - steps0
    together_steps = n - steps  # a batched step of 2 rows decodes one token more than a single step
    assert (together_steps > 0) == together
    single = steps - together_steps
    assert (m["launches"], m["synchronisations"]) == (STEP_TOKEN["launches"] * steps / n, steps / n)
    want = {name: b * single / n for name, b in STEP_TOKEN["bytes_by_name"].items()}
    if together:
        want.update({"token ids, positions and sequence table to device": 4 * 4 * 2 * together_steps / n,
                     "token and routing ids to host (batch)": 4 * (1 + K) * 2 * together_steps / n})
    assert m["bytes_by_name"] == want
    for job in jobs:
        assert job.stats.decode["hits"] == job.stats.decode["lookups"] == (N_NEW - 1) * K


@in_process
def test_pymoe_run_in_the_simulator(micro_model):
    """`NUMBA_ENABLE_CUDASIM=1 pymoe run FILE --backend cuda`, the real kernels (cuda_kernels/), a subprocess: the
    stated device size, then the device line last. --pcie-frac 1 (no probe): the auto-sized pool holds every expert
    from the start (slots never sit empty), so the decode step's 2 experts hit and it runs on the device: only
    STEP_TOKEN's bytes move (the device step's real kernels, cuda_kernels/step.py, end to end).
    ~2 min on a busy 2-core machine (the simulator runs each kernel block as Python threads)."""
    from conftest import run_pymoe

    p = run_pymoe("run", micro_model, "--backend", "cuda", "-n", "2", "-p", "hi", "--pcie-frac", "1", "--temp", "0",
                  timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert "pymoe run: simulated device: 8 GiB (NUMBA_ENABLE_CUDASIM=1; times are not a GPU's)" in lines
    total = sum(STEP_TOKEN["bytes_by_name"].values())  # every expert in a slot: no spill, no promotion
    assert lines[-1] == (f"pymoe run: decode device per token: {STEP_TOKEN['launches']:.1f} launches, {total:,} "
                         f"host<->device bytes, {STEP_TOKEN['synchronisations']:.1f} synchronisations"), lines[-4:]


@in_process
@pytest.mark.parametrize("value, gib", [("", 8.0), ("0.5", 0.5), ("abc", None), ("0", None), ("inf", None)])
def test_the_simulated_device_size(monkeypatch, value, gib):
    from pymoe.backends.cuda import simulated_device_gib
    from pymoe.errors import PymoeError

    monkeypatch.setenv("PYMOE_SIM_DEVICE_GIB", value)
    if gib is not None:
        assert simulated_device_gib() == gib
    else:
        with pytest.raises(PymoeError, match=r"^PYMOE_SIM_DEVICE_GIB must be a positive number of GiB, got '.*'$"):
            simulated_device_gib()


@in_process
@pytest.mark.parametrize("version", [2, 3])
def test_forced_spill_reads_the_masked_lookups_over_pcie(micro_model, monkeypatch, version):
    """SlotCache.force_spill (bench/gpu_check.py's spill cliff) with every expert in a slot: decode forward n masks
    the (layer, expert) pairs where default_rng((seed, n)).random([L, E]) < share, and each lookup of a masked expert
    is served over PCIe. Replayed here from the lookups the engine made (a spy on cache.lookup): the spill count is
    exactly the masked lookups, the device counters read exactly those experts' bytes over PCIe, version 2 (served
    by the lookup) and version 3 (the device step reads the masked table) alike, with one synchronisation per token
    on version 3 still, and the greedy tokens are those of the run with no forcing (the cache never changes
    results). share 0.5 over 15 decode steps: 30 lookups, so an error in the mask's draw or its use changes the
    count."""
    import numpy as np

    monkeypatch.setenv("PYMOE_DEVICE_STEP", "1" if version == 3 else "0")
    share, steps = 0.5, 15
    profile = Profile(1, E, pairs=[(0, e) for e in range(E)], counts=[1] * E)  # pre-fills all 4 slots

    def run(forced: float):
        engine = pymoe.load(micro_model, backend="cuda", cache_slots=E, profile=profile, pcie_frac=1.0,
                            backend_options=SIM)
        engine.cache.force_spill(forced, seed=3)
        calls, lookup, step = [], engine.cache.lookup, engine.cache.lookup_step
        monkeypatch.setattr(engine.cache, "lookup", lambda layer, ids, phase, rows=None: calls.append(
            (layer, np.array(ids), phase)) or lookup(layer, ids, phase, rows))
        monkeypatch.setattr(engine.cache, "lookup_step", lambda layers, ids: calls.extend(  # a device step's
            (layer, np.array(ids[m]), "decode") for m, layer in enumerate(layers)) or step(layers, ids))
        tokens = list(engine.generate(PROMPT, max_tokens=steps + 1, stop_at_eos=False))
        return tokens, engine.last_stats, calls

    plain, _, _ = run(0.0)
    tokens, st, calls = run(share)
    assert tokens == plain
    decode_calls = [(layer, ids) for layer, ids, phase in calls if phase == "decode"]
    assert len(decode_calls) == steps  # one MoE layer: one lookup per decode forward
    want = distinct = 0
    for n, (layer, ids) in enumerate(decode_calls):
        mask = np.random.default_rng((3, n)).random((1, E)) < share  # [L, E]: forward n's mask
        want += int(mask[layer, ids.reshape(-1)].sum())
        distinct += int(mask[layer, np.unique(ids)].sum())
    c, dev = st.decode, st.device
    assert c["lookups"] == K * steps and c["spill"] == want and c["hits"] == K * steps - want, (c, want)
    assert 0 < want < K * steps
    assert dev["bytes"]["expert spill reads over PCIe"] == distinct * EXPERT_BYTES
    if version == 3:
        assert dev["synchronisations"] == steps  # the mask travels in the table rows: no more syncs


def test_gpu_check_dry_run_in_the_simulator(tmp_path):
    """scripts/gpu-check --dry-run: bench/gpu_check.py's every stage in the simulator (reference kernels, the micro
    preset, 7 decode steps per request), its report read back from --report: the probes' table; caches of 0, 1, 2,
    4 slots (0: no pool, every expert read over PCIe: STEP_TOKEN's bytes plus the K experts; 4: STEP_TOKEN's
    counts exactly) beside plan's prediction (uniform routing: plan hit % = the share of experts in slots); forced
    spill 0, 50, 100% at 4 slots: the spill column is what the cache served over PCIe (0: none, 100: every lookup),
    every row one synchronisation per token (version 3: the mask travels in the residency table), and at 100% the
    step's PCIe bytes are both experts of every token; the time table.
    --pcie-frac 1: every miss over PCIe, so every step is version 3 with its lookups after it. (Runs in its own
    process: no in_process mark needed.)"""
    import os
    import subprocess
    import sys

    from cuda_sim import ROOT

    out = tmp_path / "report.md"
    env = dict(os.environ, PYTHON=sys.executable, PYMOE_DEVICE_STEP="1")
    p = subprocess.run(["bash", "scripts/gpu-check", "--dry-run", "--pcie-frac", "1", "--spill", "0,50,100",
                        "--report", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    text = out.read_text()
    assert text in p.stdout and text.startswith("# pymoe GPU check: simulator, ")
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections == ["## Probes", "## Cache sizes", "## Forced spill", "## Bandwidth", "## Memory", "## Time"]

    def rows(section):  # the markdown table under `## section`, as lists of cells (header first)
        lines = text.split(f"## {section}\n\n", 1)[1].splitlines()
        body = [line for line in lines[:next((i for i, x in enumerate(lines) if not x.startswith("|")), None)]]
        return [[cell.strip() for cell in line.strip("|").split("|")] for line in body if "---" not in line]

    assert [r[0] for r in rows("Probes")[1:]] == ["PCIe host->device", "CPU expert rate", "device memory"]
    head, *sizes = rows("Cache sizes")
    col = {name: i for i, name in enumerate(head)}
    assert [(r[0], r[1]) for r in sizes] == [("0", "0"), ("25", "1"), ("50", "2"), ("100", "4")]
    assert [float(r[col["plan hit %"]]) for r in sizes] == [0.0, 25.0, 50.0, 100.0]
    step_bytes = sum(STEP_TOKEN["bytes_by_name"].values())
    for r in sizes:
        assert float(r[col["syncs/tok"]]) == 1.0 and float(r[col["launches/tok"]]) == STEP_TOKEN["launches"], r
    assert float(sizes[0][col["spill %"]]) == 100.0 and int(sizes[0][col["bytes/tok"]]) == step_bytes + K * EXPERT_BYTES
    assert float(sizes[-1][col["hit %"]]) == 100.0 and int(sizes[-1][col["bytes/tok"]]) == step_bytes
    head, *spill = rows("Forced spill")
    col = {name: i for i, name in enumerate(head)}
    assert [r[0] for r in spill] == ["0", "50", "100"]
    n = [int(r[col["lookups"]]) for r in spill]
    got = [int(r[col["spill"]]) for r in spill]
    assert n == [7 * K] * 3 and got[0] == 0 and 0 <= got[1] <= n[1] and got[2] == n[2], (n, got)
    for r, k, m in zip(spill, got, n):
        assert r[col["spill %"]] == f"{100 * k / m:.2f}" and float(r[col["syncs/tok"]]) == 1.0, r
    assert int(spill[0][col["bytes/tok"]]) == step_bytes
    # 100%: the device step read both experts of every token over PCIe (the masked table), and the table's one row
    # went up when the mask changed it (at most once a step: E int32)
    assert 0 <= int(spill[2][col["bytes/tok"]]) - (step_bytes + K * EXPERT_BYTES) <= E * 4, spill[2]
    assert [r[0] for r in rows("Time")[1:]] == ["model", "probes", "cache sizes", "forced spill", "total"]


if not IN_PROCESS:  # numba.cuda is in the other mode in this process (tests/cuda_sim.py)
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
