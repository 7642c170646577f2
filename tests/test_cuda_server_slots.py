"""The server's parallel slots on the CUDA backend (Numba's CUDA simulator, the NumPy reference kernels).

What this is: two and three requests decoded at once by the server's scheduler (serve/scheduler.Scheduler,
`--parallel N`) on the CUDA backend, each answer equal to the same request decoded alone and to the reference
backend's greedy tokens (the float path: the same math as the device kernels). The engine is loaded for 3 sequences
(api.Engine `sequences`, `pymoe serve -np 3`), so every slot has its own device KV cache (K/V rows, MLA's compressed
rows, Gated DeltaNet's conv and recurrent states: backends/cuda.py `prepare`) and each slot's decode token is a
device step of its own (version 3, engine/model.py `_device_step`), with the experts through the device slot pool,
misses included (4 slots, pcie_frac 0.5: slot, spill and cpu paths all taken). Families: a plain GQA one, a Gated
DeltaNet hybrid (recurrent state per slot) and MLA with expert groups. Then a device that holds fewer KV caches
than slots: the rest keep host KV caches and decode in one batched version 2 forward beside the device steps.
"""
from cuda_sim import IN_PROCESS, fresh_interpreter_test, in_process  # first: the simulator on

import pytest  # noqa: E402

import pymoe  # noqa: E402
from pymoe.engine.sampler import SamplingParams  # noqa: E402
from pymoe.serve import scheduler  # noqa: E402
from pymoe.serve.scheduler import Job, Scheduler  # noqa: E402

pytestmark = pytest.mark.cuda

MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve
PROMPTS = ([5, 17, 42, 7, 99, 3, 250, 11], [64, 128, 200, 31, 9, 12], [1, 2, 3, 4, 5])
N_NEW = 8


def run(engine, prompts, parallel, sampling=None):
    """Each prompt's greedy tokens (or with sampling[i]: SamplingParams) through the scheduler with `parallel` slots,
    all submitted at once -> (tokens of each, the largest batch, how many slots had a device KV cache, device steps
    run)."""
    steps0 = engine.backend._steps
    with Scheduler(engine, parallel=parallel, kv="f32") as sched:
        own = sum(engine.backend.owns(s.kv) for s in sched.slots)
        jobs = [sched.submit(Job(prompt_ids=list(p), max_tokens=N_NEW, ignore_eos=True,
                                 sampling=SamplingParams(temperature=0) if sampling is None else sampling[i]))
                for i, p in enumerate(prompts)]
        for job in jobs:
            list(job.events(timeout=600))
        return [job.generated for job in jobs], sched.max_batch, own, engine.backend._steps - steps0


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next", "deepseek2"])
def test_two_and_three_server_slots_on_device_kv_caches_equal_their_solo_answers(tiny_model, arch):
    path = tiny_model(arch, "q2_k")
    ref = pymoe.load(path, backend="reference")
    want = [list(ref.generate(p, max_tokens=N_NEW, stop_at_eos=False)) for p in PROMPTS]
    engine = pymoe.load(path, backend="cuda", backend_options=SIM, cache_slots=4, pcie_frac=0.5, sequences=3)
    assert len(engine.backend._kvs) == 3  # a device KV cache per sequence asked for
    solo = [run(engine, [p], 1)[0][0] for p in PROMPTS]
    for n in (2, 3):
        got, max_batch, own, steps = run(engine, PROMPTS[:n], n)
        assert max_batch == n  # all n were decoded in one scheduler step at least once
        assert own == n  # every slot on a device KV cache
        assert steps == n * (N_NEW - 1)  # every decode token a device step (the first token: the prefill's)
        assert got == solo[:n] == want[:n]
    d = engine.cache.stats.counts["decode"]
    assert d["hits"] > 0 and d["spill"] > 0 and d["cpu"] > 0  # every miss path taken


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_two_server_slots_draw_their_seeded_tokens_inside_their_device_steps(tiny_model, arch):
    """Two seeded sampled requests (temperature 0.8, top-k 40, top-p 0.9; seeds 1 and 2) decoded at once, each slot's
    draw handed to its own device step (serve/scheduler.py `_device_decode`, engine/model.Model.device_draw): the
    tokens equal the CPU backend's float path's for each seed (and are not the greedy ones); every decode token's
    draw went up with its token id and came back in its step's copy (never the logits, never a copy of its own)."""
    path = tiny_model(arch, "f32")
    cpu = pymoe.load(path, backend="cpu", act_bits=0)
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=seed) for seed in (1, 2)]
    want = [list(cpu.generate(p, max_tokens=N_NEW, stop_at_eos=False, temperature=0.8, top_k=40, top_p=0.9,
                              seed=sp.seed)) for p, sp in zip(PROMPTS, params)]
    assert want[0] != list(cpu.generate(PROMPTS[0], max_tokens=N_NEW, stop_at_eos=False))  # not greedy here
    engine = pymoe.load(path, backend="cuda", backend_options=SIM, cache_slots=4, pcie_frac=0.5, sequences=3)
    counts, steps0 = engine.backend.counts, engine.backend._steps
    before = counts.snapshot("decode")["bytes"]
    with Scheduler(engine, parallel=2, kv="f32") as sched:
        jobs = [sched.submit(Job(prompt_ids=list(p), max_tokens=N_NEW, ignore_eos=True, sampling=sp))
                for p, sp in zip(PROMPTS, params)]
        for job in jobs:
            list(job.events(timeout=600))
        assert sched.max_batch == 2
    assert [job.generated for job in jobs] == want
    steps = engine.backend._steps - steps0
    assert steps == 2 * (N_NEW - 1)  # every decode token a device step (the first token: the prefill's)
    moved = {k: v - before.get(k, 0) for k, v in counts.snapshot("decode")["bytes"].items() if v != before.get(k, 0)}
    assert moved["token id, position and draw to device"] == 4 * 13 * steps
    assert "logits to host" not in moved and "sampled token id to host" not in moved


def batched_steps(engine):
    """Counts the batched device steps (engine/device_batch.py) the engine's backend begins from now on."""
    b, n = engine.backend, [0]
    begin = b.begin_batch

    def counted(*args, **kw):
        n[0] += 1
        return begin(*args, **kw)

    b.begin_batch = counted
    return n


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_slots_decoding_at_once_share_one_device_step(tiny_model, arch):
    """No "cpu" misses (4 slots, pcie_frac 1: slot and spill paths): every scheduler step in which two or three slots
    decode on device KV caches is one batched device step for them (engine/device_batch.py, one synchronisation),
    and each answer equals its solo answer and the reference backend's greedy tokens; each request's decode
    Seeded sampled requests (temperature 0.8, top-k 40,
    top-p 0.9; seeds 1 and 2) draw inside the batched step, each equal to the CPU backend's tokens for its seed."""
    path = tiny_model(arch, "q2_k")
    ref = pymoe.load(path, backend="reference")
    want = [list(ref.generate(p, max_tokens=N_NEW, stop_at_eos=False)) for p in PROMPTS]
    engine = pymoe.load(path, backend="cuda", backend_options=SIM, cache_slots=4, pcie_frac=1.0, sequences=3)
    solo = [run(engine, [p], 1)[0][0] for p in PROMPTS]
    together = batched_steps(engine)
    assert together[0] == 0  # (one slot alone: single steps)
    for n in (2, 3):
        before = together[0]
        got, max_batch, own, steps = run(engine, PROMPTS[:n], n)
        assert (max_batch, own) == (n, n) and together[0] > before
        assert steps < n * (N_NEW - 1)  # fewer device steps than decode tokens: some decoded n at once
        assert got == solo[:n] == want[:n]
    if arch != "qwen3moe":
        return
    cpu = pymoe.load(path, backend="cpu", act_bits=0)
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=seed) for seed in (1, 2)]
    want = [list(cpu.generate(p, max_tokens=N_NEW, stop_at_eos=False, temperature=0.8, top_k=40, top_p=0.9,
                              seed=sp.seed)) for p, sp in zip(PROMPTS, params)]
    before = together[0]
    assert run(engine, PROMPTS[:2], 2, params)[0] == want
    assert together[0] > before


@in_process
def test_slots_beyond_the_device_kv_caches_keep_host_ones(tiny_model):
    """The device holds one KV cache (sequences=1): of 3 slots, the first decodes by device steps, the other two
    keep host KV caches and share a batched version 2 forward; every answer is still the reference's."""
    path = tiny_model("qwen3moe", "q2_k")
    ref = pymoe.load(path, backend="reference")
    want = [list(ref.generate(p, max_tokens=N_NEW, stop_at_eos=False)) for p in PROMPTS]
    engine = pymoe.load(path, backend="cuda", backend_options=SIM, cache_slots=4, pcie_frac=0.5)
    got, max_batch, own, steps = run(engine, PROMPTS, 3)
    assert (max_batch, own) == (3, 1)
    assert steps == N_NEW - 1  # the one device slot's decode tokens
    assert got == want


@in_process
def test_speculation_and_shared_prompts_on_device_kv_caches(tiny_model, monkeypatch):
    """Gated DeltaNet (a recurrent state per slot) on device KV caches: two slots speculating at once (--spec
    ngram: verify forwards of version 2 over the device caches, the state restored and re-advanced after a
    rejection), and the n = 3 choices of one request over 2 slots (one prefill; its KV copied device to device into
    the other slot, and kept on the host for the third choice, which copies it back into a device cache when a slot
    frees): every answer the reference's greedy tokens."""
    path = tiny_model("qwen3next", "q2_k")
    prompts = ([5, 17, 42, 7, 5, 17, 42, 7, 5, 17], [9, 12, 9, 12, 9, 12, 9])
    ref = pymoe.load(path, backend="reference")
    want = [list(ref.generate(p, max_tokens=N_NEW, stop_at_eos=False)) for p in prompts]
    engine = pymoe.load(path, backend="cuda", backend_options=SIM, cache_slots=4, pcie_frac=0.5, sequences=2)
    with Scheduler(engine, parallel=2, kv="f32", spec="ngram") as sched:
        assert sched.device_slots() == 2
        jobs = [sched.submit(Job(prompt_ids=list(p), max_tokens=N_NEW, ignore_eos=True,
                                 sampling=SamplingParams(temperature=0))) for p in prompts]
        for job in jobs:
            list(job.events(timeout=600))
        stats = [s.spec.stats for s in sched.slots]
    assert [job.generated for job in jobs] == want
    assert sum(st.drafted for st in stats) > 0 and sum(st.rollbacks for st in stats) > 0  # (drafts rejected too)
    del sched  # its slots give their device KV caches back (backends/cuda.py `new_kv`)
    copies, copy_kv = [], scheduler.copy_kv
    monkeypatch.setattr(scheduler, "copy_kv", lambda b, cfg, dst, src, n: copies.append(
        (type(dst).__name__, type(src).__name__)) or copy_kv(b, cfg, dst, src, n))
    with Scheduler(engine, parallel=2, kv="f16") as sched:
        assert sched.device_slots() == 2
        first = Job(prompt_ids=list(prompts[0]), max_tokens=N_NEW, ignore_eos=True,
                    sampling=SamplingParams(temperature=0))
        jobs = [first, first.sibling(1), first.sibling(2)]
        for job in jobs:
            sched.submit(job)
        for job in jobs:
            list(job.events(timeout=600))
    assert [job.generated for job in jobs] == [want[0]] * 3
    assert copies == [("KVCache", "DeviceKVCache"), ("DeviceKVCache", "DeviceKVCache"), ("DeviceKVCache", "KVCache")]


@in_process
@pytest.mark.parametrize("arch", ["qwen3next", "deepseek2"])
def test_device_kv_caches_are_sized_before_the_pool_and_pymoe_plan_counts_them(tiny_model, arch):
    """Each sequence's device bytes (K/V rows, MLA's compressed rows, Gated DeltaNet's states) are what `pymoe plan
    -np N` puts in its overhead; a device with room for 2 of 4 caches beside the pool asked for makes 2 and says so
    in one start-up line."""
    from pymoe.experts.plan import facts_from_gguf, overhead_for

    path = tiny_model(arch, "q2_k")
    one = pymoe.load(path, backend="cuda", backend_options=SIM, cache="none", sequences=1)
    b, n_ctx = one.backend, one.n_ctx
    per_seq = b.sequence_bytes(n_ctx)
    kv = b.mem.by_what["KV cache"] + b.mem.by_what.get("recurrent state", 0)  # what prepare allocated for one
    assert per_seq == kv and overhead_for(facts_from_gguf(path), n_ctx, 0, 4).kv == 4 * per_seq
    if arch == "qwen3next":
        assert b.mem.by_what["recurrent state"] > 0
    before_pool = b.mem.used
    slots = 4
    free = 700 * MiB + before_pool + 1 * per_seq + slots * one.file.slot_bytes + per_seq // 2  # 2 caches, the pool
    lines = []
    engine = pymoe.load(path, backend="cuda", backend_options=dict(SIM, free_bytes=free), cache_slots=slots,
                        pcie_frac=1.0, sequences=4, log=lines.append)
    assert len(engine.backend._kvs) == 2 and engine.cache.n_slots == slots
    said = [ln for ln in lines if ln.startswith("device KV caches:")]
    assert said == [f"device KV caches: 2 of the 4 sequences asked for fit beside the expert slots "
                    f"({per_seq / MiB:.1f} MiB each); the others keep host KV caches and decode with attention on "
                    "the CPU (version 2)"]


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
