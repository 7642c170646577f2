"""The CUDA backend (pymoe/backends/cuda.py) in Numba's CUDA simulator, with the NumPy reference kernels.

What this is: everything of the backend but the kernels -- device memory and its budget, the slot pool and its
copies, the mapped model file, the miss paths (slot / spill / cpu / staged), auto-sizing, pre-fill verification,
the PCIe probe -- on tiny models, against the reference backend (backends/reference.py: float NumPy, the same math as the
GPU kernels). The simulator runs a kernel one Python thread per CUDA thread (a 256 x 256 mat-vec: ~7 s), so the
backend runs here with `kernels="reference"` (dequantize + NumPy); tests/test_cuda_kernels.py holds every real
kernel to the same references, tests/test_cuda_real_kernels_sim.py runs the backend with the real kernels on the
micro model (in the simulator too), and scripts/gpu-check runs it with the real kernels on a GPU.
"""
from cuda_sim import IN_PROCESS, IS_SIMULATOR, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pymoe  # noqa: E402
from conftest import ARCHS  # noqa: E402
from pymoe.demo.tinymodel import make_config  # noqa: E402
from pymoe.engine.attention import HOST_ATTENTION  # noqa: E402
from pymoe.errors import PymoeError  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 200, 31]  # 12 tokens: with --chunk 8, chunks of 8 and 4
N_NEW = 10
MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve


def _host_attention(arch):
    from pymoe.backends.cuda import CUDABackend

    on_host = HOST_ATTENTION - CUDABackend.device_attention_kinds
    return any(p.attention in on_host for p in make_config(arch).layer_plan())


# the families whose attention runs on the device (every family on one device today), from the registry, so a new
# family with a kind the device lacks drops out of it
DEVICE_ATTENTION_ARCHS = [a for a in ARCHS if not _host_attention(a)]
# the families with a kind of HOST_ATTENTION at all (run on the host side when a backend lacks its kernels)
HOST_ATTENTION_KIND_ARCHS = [a for a in ARCHS if any(p.attention in HOST_ATTENTION for p in make_config(a).layer_plan())]


def greedy(engine):
    return list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))


def load_cuda(path, free_bytes=SIM["free_bytes"], **options):
    return pymoe.load(path, backend="cuda", backend_options=dict(SIM, free_bytes=free_bytes), **options)


@pytest.fixture(scope="module")
def float_tokens(tiny_model):
    """Greedy tokens of the reference backend: the same math as the CUDA kernels."""
    return {mix: greedy(pymoe.load(tiny_model("qwen3moe", mix), backend="reference")) for mix in ("f32", "q2_k")}


@in_process
@pytest.mark.parametrize("mix", ["f32", "q2_k"])
@pytest.mark.parametrize("policy, pcie_frac", [("lru", 1.0), ("lru", 0.0), ("lfu", 0.5)])
def test_cache_never_changes_results_on_cuda(tiny_model, float_tokens, mix, policy, pcie_frac):
    path = tiny_model("qwen3moe", mix)
    cfg = pymoe.load(path, backend="reference").config
    for slots in (cfg.n_layers, cfg.n_layers * cfg.n_expert // 2, cfg.n_layers * cfg.n_expert):
        engine = load_cuda(path, cache_slots=slots, policy=policy, pcie_frac=pcie_frac, chunk=8)
        assert greedy(engine) == float_tokens[mix], (slots, policy, pcie_frac)
        d, p = engine.cache.stats.counts["decode"], engine.cache.stats.counts["prefill"]
        assert d["lookups"] == d["hits"] + d["spill"] + d["cpu"] == (N_NEW - 1) * cfg.n_layers * cfg.n_expert_used
        assert p["lookups"] == p["hits"] + p["staged"] == len(PROMPT) * cfg.n_layers * cfg.n_expert_used
        if slots < cfg.n_layers * cfg.n_expert // 2:
            assert d["promoted"] > 0 and d["spill" if pcie_frac else "cpu"] > 0
        b = engine.backend
        assert b.mem.used <= b.mem.limit
        assert b.mem.by_what["expert slots"] == slots * engine.file.slot_bytes


@in_process
@pytest.mark.parametrize("arch", DEVICE_ATTENTION_ARCHS)
def test_attention_on_the_device_matches_the_host(tiny_model, monkeypatch, arch):
    """The device KV cache and attention block (q/k/v biases, q/k norms per head or whole, NEOX or normal RoPE,
    GQA, partial RoPE, gated attention; MLA over its compressed cache; beside Gated DeltaNet layers, whose state it keeps
    too) give the CPU float path's logits, prefill and decode; a second sequence while the first holds the device
    KV cache falls back to a host KV cache (attention on the CPU) with the same results."""
    from pymoe.backends.cuda import DeviceKVCache

    path = tiny_model(arch, "q2_k")
    cpu = pymoe.load(path, backend="reference")
    kv = cpu.model.new_kv(64)
    want = np.concatenate([cpu.model.prefill(PROMPT, kv), cpu.model.decode_one_token(9, kv)[None]])
    engine = load_cuda(path, cache_slots=4, pcie_frac=0.5, chunk=8)
    first, second = engine.model.new_kv(64), engine.model.new_kv(64)
    assert isinstance(first, DeviceKVCache) and not isinstance(second, DeviceKVCache)
    for kv in (first, second):
        got = np.concatenate([engine.model.prefill(PROMPT, kv), engine.model.decode_one_token(9, kv)[None]])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    del first, kv
    assert isinstance(engine.model.new_kv(64), DeviceKVCache)  # lent again once the first sequence is gone


@in_process
@pytest.mark.parametrize("arch", HOST_ATTENTION_KIND_ARCHS)
def test_host_attention_kinds_with_device_experts(tiny_model, monkeypatch, arch):
    """A kind of engine/attention.HOST_ATTENTION that the backend does not run itself (`device_attention_kinds`
    emptied here: every such kind has device kernels on one device now; several devices, backends/multi_device.py,
    run MLA this way) runs on the host side (its CPU backend, a host KV cache) while the experts go through the
    device slot pool.
    Logits (prefill and decode) and greedy tokens equal the reference backend's within the device tests' bound."""
    from pymoe.backends.cuda import CUDABackend, DeviceKVCache

    monkeypatch.setattr(CUDABackend, "device_attention_kinds", frozenset())

    path = tiny_model(arch, "q2_k")
    cpu = pymoe.load(path, backend="reference")
    kv = cpu.model.new_kv(64)
    want = np.concatenate([cpu.model.prefill(PROMPT, kv), cpu.model.decode_one_token(9, kv)[None]])
    engine = load_cuda(path, cache_slots=4, pcie_frac=0.5, chunk=8)
    kv = engine.model.new_kv(64)
    assert not isinstance(kv, DeviceKVCache)
    got = np.concatenate([engine.model.prefill(PROMPT, kv), engine.model.decode_one_token(9, kv)[None]])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    assert list(engine.generate(PROMPT, max_tokens=6, stop_at_eos=False)) == \
        list(cpu.generate(PROMPT, max_tokens=6, stop_at_eos=False))
    assert engine.cache.stats.counts["decode"]["lookups"] > 0


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_speculative_decoding_on_the_device(tiny_model, arch):
    """Verification forwards of several decode positions on the CUDA backend (device KV cache and attention, its
    rollback by kv.n; qwen3next: also the Gated DeltaNet state restored, on the device KV cache's host copy), experts
    through a small device slot pool: the greedy tokens of the reference backend's plain decoding."""
    from pymoe.engine.speculative import Speculator

    path = tiny_model(arch, "q2_k")
    want = list(pymoe.load(path, backend="reference").generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))

    class Drafter:  # the right tokens, the third of each draft wrong: keeps two, rejects one per step
        def propose(self, history, k):
            d = list(want[len(history) - len(PROMPT):][:k])
            if len(d) >= 3:
                d[2] = (d[2] + 1) % 256
            return d

    engine = load_cuda(path, cache_slots=4, pcie_frac=0.5, chunk=8)
    spec = Speculator(Drafter(), k=4)
    assert list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False, spec=spec)) == want
    assert spec.stats.steps > 0 and 0 < spec.stats.accepted < spec.stats.drafted


@in_process
def test_no_slots_reads_every_expert_over_pcie(tiny_model, float_tokens):
    engine = load_cuda(tiny_model("qwen3moe", "q2_k"), cache="none", pcie_frac=1.0, chunk=8)
    assert greedy(engine) == float_tokens["q2_k"]
    d = engine.cache.stats.counts["decode"]
    assert d["spill"] == d["lookups"] > 0 and d["hits"] == 0
    assert "expert slots" not in engine.backend.mem.by_what


@in_process
def test_prefill_stages_experts_with_many_tokens_and_reads_the_rest_in_place(tiny_model, monkeypatch):
    """An expert given more than TOKEN_TILE tokens of a chunk is copied into a staging buffer (the two alternate);
    one with fewer is read in place over PCIe (every expert, with --chunk 3). The chunking changes no logits."""
    from pymoe.cuda_kernels.quant_matvec import TOKEN_TILE

    path = tiny_model("qwen3moe", "q2_k")
    prompt = list(range(3, 500, 13))  # 39 tokens
    whole = load_cuda(path, cache="none", pcie_frac=1.0, chunk=512).logits(prompt)
    for chunk in (16, 3):  # chunks of 16, 16, 7 tokens; of 3 tokens
        engine = load_cuda(path, cache="none", pcie_frac=1.0, chunk=chunk)
        b = engine.backend
        staged, in_place = [], []
        stage_in, device_expert = b._stage_in, b._device_expert
        monkeypatch.setattr(b, "_stage_in", lambda ex, i: staged.append(i) or stage_in(ex, i))
        monkeypatch.setattr(b, "_device_expert", lambda ex, n, i: (in_place.append(n) if n <= TOKEN_TILE else None)
                            or device_expert(ex, n, i))
        np.testing.assert_allclose(engine.logits(prompt), whole, rtol=0, atol=1e-5)
        if chunk == 16:
            assert set(staged) == {0, 1}  # both buffers in use
        else:
            assert not staged and len(in_place) > 0


@in_process
def test_spill_reads_the_mapped_model_file_without_a_copy(tiny_model):
    engine = load_cuda(tiny_model("qwen3moe", "q2_k"), cache_slots=2)
    ex = engine.file.expert(1, 3)
    view = engine.backend.host.device_view(ex.down)
    np.testing.assert_array_equal(view.copy_to_host(), ex.down)
    if IS_SIMULATOR:
        assert np.shares_memory(view._ary, engine.file.reader.data)  # the simulator's device array is the mmap
    with pytest.raises(ValueError, match="not inside the mapped model file"):
        engine.backend.host.device_view(np.zeros(4, np.uint8))


@in_process
def test_auto_sizing_from_free_device_memory(tiny_model):
    path = tiny_model("qwen3moe", "q2_k")
    lines = []
    engine = load_cuda(path, free_bytes=700 * MiB + 16 * MiB, log=lines.append, pcie_frac=1.0)
    b, slot = engine.backend, engine.file.slot_bytes
    before_pool = b.mem.used - b.mem.by_what["expert slots"]  # dense weights, activations, KV cache, the device
    # step's residency table and expert offsets
    assert before_pool == sum(b.mem.by_what[k] for k in ("dense weights", "activations", "KV cache",
                                                         "residency table and expert offsets"))
    left = b.free_at_start - before_pool - 700 * MiB
    cfg = engine.config
    want = min(left // slot, cfg.n_layers * cfg.n_expert)
    assert engine.cache.n_slots == want
    line = next(x for x in lines if x.startswith("expert cache auto:"))
    assert line.endswith(f"700 MiB reserved -> {want} slots"), line
    # Less room than one slot: a one-line error, not a pool of zero slots.
    need = before_pool
    with pytest.raises(PymoeError, match="no room on the device for one expert slot"):
        load_cuda(path, free_bytes=700 * MiB + need + slot // 2, pcie_frac=1.0)


@in_process
def test_device_budget_is_enforced(tiny_model):
    with pytest.raises(PymoeError, match="device memory budget exceeded"):
        load_cuda(tiny_model("qwen3moe", "q2_k"), free_bytes=700 * MiB + 64 * 1024, pcie_frac=1.0)
    path = tiny_model("qwen3moe", "q2_k")
    b = load_cuda(path, cache_slots=1, pcie_frac=1.0).backend
    room = 700 * MiB + b.mem.used + 7 * b.mem.by_what["expert slots"]  # 8 slots fit, 16 do not
    assert load_cuda(path, cache_slots=8, free_bytes=room, pcie_frac=1.0).cache.n_slots == 8
    with pytest.raises(PymoeError, match="device memory budget exceeded: expert slots"):
        load_cuda(path, cache_slots=16, free_bytes=room, pcie_frac=1.0)


@in_process
def test_profile_prefill_verifies_device_bytes(tiny_model):
    from pymoe.experts.profile import Profile

    path = tiny_model("qwen3moe", "q2_k")
    cfg = pymoe.load(path, backend="reference").config
    profile = Profile.from_heat(np.arange(cfg.n_layers * cfg.n_expert).reshape(cfg.n_layers, cfg.n_expert))
    lines = []
    engine = load_cuda(path, cache_slots=5, policy="static", profile=profile, log=lines.append, pcie_frac=1.0)
    assert any(x.startswith("pre-filled 5 of 5 slots from the profile") and x.endswith("verified") for x in lines)
    cache = engine.cache
    for layer, e in np.argwhere(cache.residency >= 0):
        host = engine.file.expert(int(layer), int(e))
        got = cache.pool.read(int(cache.residency[layer, e]))
        np.testing.assert_array_equal(got[:host.nbytes], np.concatenate([host.gate.ravel(), host.up.ravel(),
                                                                         host.down.ravel()]))


class EventLog:
    """Stands in for numba.cuda.event, recording which stream records or waits on which event, in order."""

    def __init__(self, streams):
        self.ops, self.names = [], streams
        self.events = []  # every event made, kept alive: their id()s name them in `ops` and must not be reused

    def __call__(self, *args, **kwargs):
        log = self

        class Event:
            def record(self, stream=0):
                log.ops.append(("record", log.names.get(id(stream), "?"), id(self)))

            def wait(self, stream=0):
                log.ops.append(("wait", log.names.get(id(stream), "?"), id(self)))

            def synchronize(self):
                pass

        self.events.append(Event())
        return self.events[-1]


@in_process
@pytest.mark.parametrize("lookahead", [False, True], ids=["misses", "lookahead"])
def test_slot_copies_are_ordered_by_events(monkeypatch, lookahead):
    """A slot's copy (copy stream) waits for the event recorded after the last kernels that read it (compute
    stream); a kernel reading a freshly written slot waits for that copy's event first. The same for the copies
    the router lookahead starts one layer early (experts/prefetch.py), which go through the same pool.write."""
    from pymoe.demo import demo_model
    from pymoe.experts.prefetch import Lookahead

    engine = load_cuda(demo_model(), cache_slots=32, policy="lru", pcie_frac=1.0)  # trained: routing varies
    if lookahead:
        engine.model.lookahead = Lookahead(engine.model)
    b, pool = engine.backend, engine.cache.pool
    log = EventLog({id(b.compute): "compute", id(b.copy): "copy"})
    monkeypatch.setattr(pool, "_event", log)
    monkeypatch.setattr(b.cuda, "event", log)
    writes, reads = [], []
    write, before_read = pool.write, pool.before_read
    monkeypatch.setattr(pool, "write", lambda s, ex: writes.append((s, len(log.ops))) or write(s, ex))
    monkeypatch.setattr(pool, "before_read", lambda s: reads.append((s, len(log.ops))) or before_read(s))
    greedy(engine)
    d = engine.cache.stats.counts["decode"]
    assert d["evicted"] > 0 and d["hits"] > 0 and reads
    assert (d["prefetched"] > 0 and d["prefetch_hits"] > 0) == lookahead  # prefetch copies are among the writes
    recorded_on = {ev: stream for op, stream, ev in log.ops if op == "record"}
    for slot, at in writes:
        if any(s == slot and r < at for s, r in reads):  # overwriting a slot kernels have read
            op, stream, ev = log.ops[at]
            assert (op, stream, recorded_on[ev]) == ("wait", "copy", "compute"), (slot, log.ops[at])
    for slot, at in reads:
        last_write = max((w for s, w in writes if s == slot and w < at), default=-1)
        last_read = max((r for s, r in reads if s == slot and r < at), default=-1)
        if last_write > last_read:  # the first read since a copy into the slot
            op, stream, ev = log.ops[at]
            assert (op, stream, recorded_on[ev]) == ("wait", "compute", "copy"), (slot, log.ops[at])


@in_process
@pytest.mark.parametrize("slots", [32, 128], ids=["quarter", "all"])
def test_lookahead_prefetch_turns_misses_into_hits(slots):
    """`--lookahead`: after layer l, the predicted experts of layer l + 1 that are not resident are placed through
    the policy and copied into slots on the copy stream, so layer l + 1's lookup hits them. Demo model (trained:
    the prediction is right ~70% of the time), 4 MoE layers x 32 experts, LRU, 9 decode lookups per layer:
      - the greedy tokens are the same with and without it;
      - with room for every expert (128 slots) the pool starts full (SlotCache.fill): every lookup hits, and
        there is nothing to prefetch;
      - at 32 slots a wrong guess may evict a useful expert; measured 2026-12-06 (the pool filled at start-up):
        69 -> 91 hits of 144 (59 prefetched, 36 hit at the next lookup), asserted as "more hits";
      - every resident expert's slot holds its host bytes, the prefetched ones included (read back from the device).
    """
    from pymoe.demo import demo_model
    from pymoe.experts.prefetch import Lookahead
    from pymoe.gguf.loader import EXPERT_PROJ

    runs = {}
    for on in (False, True):
        engine = load_cuda(demo_model(), cache_slots=slots, policy="lru", pcie_frac=1.0, chunk=8)
        if on:
            engine.model.lookahead = Lookahead(engine.model)
        runs[on] = greedy(engine), dict(engine.cache.stats.counts["decode"]), engine
    (tokens, off, _), (tokens_on, on, engine) = runs[False], runs[True]
    assert tokens_on == tokens
    assert off["prefetched"] == off["prefetch_hits"] == 0
    if slots == 128:
        assert on == off and on["hits"] == on["lookups"] and on["prefetched"] == on["evicted"] == 0, on
    else:
        assert on["lookups"] == off["lookups"] and on["prefetched"] > 0 and on["prefetch_hits"] > 0
        assert on["prefetch_hits"] <= on["hits"]
        assert on["evicted"] > 0 and on["hits"] > off["hits"], (off, on)
    cache = engine.cache
    resident = np.argwhere(cache.residency >= 0)  # [n, 2] (layer, expert)
    assert len(resident) == cache.table.n_resident
    for layer, e in resident.tolist():
        host = engine.file.expert(layer, e)
        want = np.concatenate([getattr(host, name).reshape(-1) for name in EXPERT_PROJ])
        assert np.array_equal(cache.pool.read(int(cache.residency[layer, e]))[:want.size], want), (layer, e)


@in_process
def test_pcie_probe_line_and_split(tiny_model):
    from pymoe.experts.probe import ProbeResult, probe

    r = ProbeResult(pcie_gbs=[13.8, 13.9, 13.8, 13.9], cpu_gbs=22.7, threads=2)
    assert r.line() == "PCIe probe: 13.9 GB/s host->device (best of 13.8 13.8 13.9 13.9) -> pcie_frac 0.38"
    assert ProbeResult(None, 5.0, 2).line().endswith("pcie_frac 0 (every miss on the CPU)")
    engine = load_cuda(tiny_model("qwen3moe", "q2_k"), cache_slots=2, pcie_frac=1.0)
    measured = probe(engine.file, engine.backend, repeats=2)  # the simulator's "PCIe" is a memcpy: only the form
    assert len(measured.pcie_gbs) == 2 and measured.cpu_gbs > 0 and 0 < measured.pcie_frac < 1


@in_process
@pytest.mark.skipif(IS_SIMULATOR, reason="GPU only: the real kernels on the tiny models (~7 s per 256 x 256 mat-vec "
                    "in the simulator; tests/test_cuda_real_kernels_sim.py runs them on the micro model): "
                    "scripts/gpu-check")
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama", "olmoe"])
@pytest.mark.parametrize("mix", ["f32", "q2_k"])
def test_real_kernels_end_to_end_match_the_cpu_float_path(tiny_model, monkeypatch, arch, mix):
    path = tiny_model(arch, mix)
    cpu = pymoe.load(path, backend="reference")
    want_logits, want_tokens = cpu.logits(PROMPT), greedy(cpu)
    cfg = cpu.config
    engine = pymoe.load(path, backend="cuda", cache_slots=cfg.n_layers * cfg.n_expert // 2, pcie_frac=0.5,
                        chunk=8)  # every path: slots, spill, cpu, staged and in-place prefill
    np.testing.assert_allclose(engine.logits(PROMPT), want_logits, rtol=0, atol=1e-3)
    assert greedy(engine) == want_tokens


@in_process
def test_the_gpu_check_script_runs(tiny_model, monkeypatch, capsys, tmp_path):
    """bench/gpu_check.py (scripts/gpu-check's model part) end to end, here on the simulator with the reference
    kernels: so the one script a GPU session runs is known to work before it costs device time."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import gpu_check

    load = pymoe.load
    monkeypatch.setattr(pymoe, "load", lambda *a, **k: load(*a, **(dict(k, backend_options=SIM)
                                                                  if k.get("backend") == "cuda" else k)))
    report = tmp_path / "report.md"
    rc = gpu_check.main(["--model", tiny_model("qwen3moe", "q2_k"), "--fractions", "0,25,100", "--tokens", "6",
                         "--prompt-tokens", "12", "--spill", "100", "--report", str(report)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "expert cache auto" not in out and "PCIe probe:" in out and "host RAM for experts: the mmap alone" in out
    assert report.read_text() in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    sizes = [r for r in rows if r[0] in ("0", "25", "100") and len(r) == 13]  # the cache sizes' table
    assert [r[0] for r in sizes] == ["0", "25", "100"] and float(sizes[0][7]) == 100.0  # no pool: all spill
    forced = [r for r in rows if len(r) == 10 and r[0] == "100"]  # forced spill 100%: every lookup over PCIe
    assert len(forced) == 1 and int(forced[0][1]) == int(forced[0][2]) > 0, forced


if not IN_PROCESS:  # numba.cuda is in the other mode in this process (tests/cuda_sim.py)
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
