"""CUDA graphs for the device decode step (backends/cuda_graphs.py): what can be tested without a GPU, and the GPU test.

A CUDA graph replays the launches it captured: the same kernels, grids, blocks and argument values (device
pointers, shapes and strides of arrays, scalars). So the decode step can be captured once and replayed only if each
step makes exactly the launches of the one before, whatever the position, the token or the residency table holds:
those live in device arrays at fixed addresses (the step's `at` buffer, the residency table), uploaded before the
launches. In Numba's CUDA simulator (no CuPy, no graphs) the property itself is tested: `LaunchRecorder`
(backends/device_counts.py) records each step's launches with their arguments' fingerprints, and consecutive steps
must record identical lists, on every family that runs the step, with every expert in a slot and across
promotions that change the residency table; and backends/cuda_graphs.StepGraphs, given a stand-in capture with a
graph's semantics (the captured calls made again on launch), keeps every step's logits bit-equal. On a GPU (scripts/gpu-check), the step is captured and replayed for
real, and decoding with graphs on and off gives the same tokens and the same logits
(`test_graphs_on_and_off_decode_alike`).
"""
from cuda_sim import IN_PROCESS, IS_SIMULATOR, fresh_interpreter_test, in_process  # first: the simulator on

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pymoe  # noqa: E402
from pymoe.backends.device_counts import LaunchRecorder, first_difference  # noqa: E402
from pymoe.experts.profile import Profile  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = [5, 17]
N_NEW = 5  # 4 decode steps
MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve
FAMILIES = ["qwen3moe", "qwen2moe", "llama", "olmoe", "glm4moe", "dots1", "qwen3vlmoe", "gpt-oss", "deepseek2",
            "qwen3next", "qwen35moe"]  # tests/test_cuda_device_step.py's list (held to it below)


def load(path, setting: str, **options):
    """"slots": a slot for every expert, pre-filled; "promotions": one slot, LRU, pcie_frac 1: every miss read over
    PCIe and promoted, so the residency table changes at every step."""
    if setting == "promotions":
        return pymoe.load(path, backend="cuda", cache_slots=1, policy="lru", pcie_frac=1.0,
                          backend_options=dict(SIM, **options))
    cfg = pymoe.load(path, backend="reference").config
    pairs = [(i, e) for i in range(len(cfg.moe_layers)) for e in range(cfg.n_expert)]
    profile = Profile(len(cfg.moe_layers), cfg.n_expert, pairs=pairs, counts=[1] * len(pairs))
    return pymoe.load(path, backend="cuda", cache_slots=len(pairs), profile=profile, pcie_frac=1.0,
                      backend_options=dict(SIM, **options))


def test_the_families_are_the_device_steps():
    import test_cuda_device_step

    assert FAMILIES == test_cuda_device_step.FAMILIES


@in_process
@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("setting", ["slots", "promotions"])
def test_consecutive_steps_make_the_same_launches(micro, arch, setting):
    """Every decode step's launches (operation, arguments: device pointers, shapes, strides, scalars) equal the
    first step's: what one captured graph replays. "promotions": the residency table the kernels read changes
    between the steps (its rows are uploaded into the same device array)."""
    engine = load(micro(arch), setting)
    recorder = engine.backend.recorder = LaunchRecorder()
    tables = []
    engine.backend.begin_step = record_tables(engine.backend, tables)
    list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    assert len(recorder.steps) == N_NEW - 1 and len(recorder.steps[0]) > 0
    for step in recorder.steps[1:]:
        assert first_difference(recorder.steps[0], step) is None
    if setting == "promotions":  # the test is about a table that changed: it did
        assert engine.last_stats.decode["promoted"] > 0
        assert any(not np.array_equal(tables[0], t) for t in tables[1:])


SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, seed=1)  # pymoe run --temp 0.8 --top-k 40 --top-p 0.9 --seed 1


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen3next"])
def test_consecutive_sampled_steps_make_the_same_launches(micro, arch):
    """A seeded sampled request: each step draws its token on the device (the sampler's draw handed to the step:
    engine/model.Model.device_draw), the sample kernel reading the draw's settings and u from the step's `at`
    buffer, so every step's launches, the sample launch among them, equal the first step's though u changes."""
    engine = load(micro(arch), "slots")
    recorder = engine.backend.recorder = LaunchRecorder()
    list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False, **SAMPLED))
    assert len(recorder.steps) == N_NEW - 1
    assert [name for name, *_ in recorder.steps[0]].count("sample") == 1
    for step in recorder.steps[1:]:
        assert first_difference(recorder.steps[0], step) is None


def record_tables(backend, tables: list):
    """begin_step, keeping a copy of the residency table each step's kernels read."""
    begin = backend.begin_step

    def begin_step(*args, **kw):
        tok = begin(*args, **kw)
        tables.append(backend._table_host.copy())
        return tok

    return begin_step


@in_process
@pytest.mark.parametrize("arch", ["qwen3moe", "glm4moe", "gpt-oss", "deepseek2"])
def test_the_real_kernels_launches_repeat(micro, monkeypatch, arch):
    """The Numba kernel launches themselves (kernel, grid, block, arguments), as the simulator sees them, of the
    kernels that take the step's position (RoPE, the KV store, attention: GQA, gpt-oss's window and sinks, MLA's
    cache row and query), of the routers, the norms, the adds and the argmax, and on qwen3moe a seeded random draw
    (the sample kernel, its settings and u read from the step's `at` buffer: SAMPLED); the products and the routed
    experts on the reference kernels (the real ones of every op cost minutes here: tests/test_cuda_real_kernels_sim.py).
    Tokens still the reference backend's (for the seed: the host sampler's draw)."""
    from pymoe.backends import cuda as cuda_backend

    real_ops = ("rope", "kv_store", "decode_attention", "decode_attention_ws", "mla_kv_row", "mla_query_q",
                "route_softmax", "route_sigmoid", "route_softmax_weight", "route_groups", "rmsnorm", "add", "argmax")

    class Mixed(cuda_backend.ReferenceKernels):
        name = "mixed"

    for op in real_ops + ("sample",):
        setattr(Mixed, op, lambda self, *args, _op=op: getattr(cuda_backend.DeviceKernels(), _op)(*args))
    monkeypatch.setitem(cuda_backend.KERNEL_SETS, "mixed", Mixed)
    path = micro(arch)
    draw = SAMPLED if arch == "qwen3moe" else {}  # one family draws on the device (the sample kernel), the rest greedy
    want = list(pymoe.load(path, backend="reference").generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False, **draw))
    engine = load(path, "promotions", kernels="mixed")
    recorder = engine.backend.recorder = LaunchRecorder()
    with recorder.kernels():
        assert list(engine.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False, **draw)) == want
    kernels = {name for name, grid, *_ in recorder.steps[0] if grid is not None}
    assert {"rope_at_kernel", "kv_store_kernel"} <= kernels or {"mla_kv_row_at_kernel"} <= kernels
    assert ("sample_kernel" in kernels) == bool(draw)
    for step in recorder.steps[1:]:
        assert first_difference(recorder.steps[0], step) is None


class ReplayCapture:
    """A stand-in for CuPy's capture (backends/cuda_graphs.CupyCapture) in the simulator, with a graph's semantics:
    capturing keeps the step's launch calls with the arguments they were made with, unrun; launching the "graph"
    makes those very calls again, whatever the step under way would have passed."""

    def numba_stream(self, cuda):
        return cuda.stream()

    def capture(self, launches):
        return list(launches)

    def launch(self, graph):
        for launch in graph:
            launch()


@in_process
@pytest.mark.parametrize("arch", FAMILIES)
def test_graph_replay_keeps_the_tokens(micro, arch):
    """backends/cuda_graphs.StepGraphs with the stand-in capture, across promotions: the first step's launches run
    directly, the second's are captured, the rest replay the captured calls; every step's logits equal, bit for bit,
    those of the same launches made directly (the same kernels on the same arguments), and the greedy tokens the
    reference backend's. A step whose position reached a kernel as a scalar would not repeat its launch list, so
    it would never be captured (the counts of direct, captured and replayed steps say so)."""
    path = micro(arch)
    runs = {}
    for name, graphs in (("direct", None), ("graphs", ReplayCapture())):
        engine = load(path, "promotions", graphs=graphs)
        kv = engine.model.new_kv(64)
        engine.model.prefill(PROMPT, kv)
        token, logits = 9, []
        for _ in range(6):
            out = engine.model.decode_one_token(token, kv)
            logits.append(np.asarray(out).copy())
            token = out.greedy_token
        runs[name] = logits, engine.backend.graphs
    (direct, none), (replayed, g) = runs["direct"], runs["graphs"]
    assert none is None and (g.direct, g.captured, g.replayed) == (1, 1, 4)
    for a, b in zip(direct, replayed):
        assert np.array_equal(a, b)
    ref = pymoe.load(path, backend="reference")
    want = list(ref.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    assert list(load(path, "promotions", graphs=ReplayCapture()).generate(PROMPT, max_tokens=N_NEW,
                                                                          stop_at_eos=False)) == want


def test_step_graphs_choose_direct_capture_replay_flush():
    """StepGraphs on its own, launches standing as calls that log their name: a list's first sight runs directly,
    its second is captured then launched, later ones launch the graph; another list starts over; `flush` (the host
    reading the device inside a step) runs what is held, in order, before the read, and the rest directly; a
    capture that raises leaves every later step direct, its launches run all the same."""
    from pymoe.backends.cuda_graphs import StepGraphs

    ran = []

    def step(graphs, names, read_after=None):
        graphs.begin()
        for name in names:
            launch = (lambda n=name: ran.append(n))
            if not graphs.defer(name, (len(name),), launch):
                launch()
            if name == read_after:
                graphs.flush()
                ran.append("read")
        graphs.run()

    g = StepGraphs(ReplayCapture())
    for _ in range(3):
        step(g, ["a", "b"])
    assert (g.direct, g.captured, g.replayed) == (1, 1, 1) and ran == ["a", "b"] * 3
    ran.clear()
    step(g, ["a", "c"])  # a new list: direct first
    step(g, ["a", "b", "c"], read_after="b")  # held a, b run before the read, c after it
    assert ran == ["a", "c", "a", "b", "read", "c"] and (g.direct, g.captured, g.replayed) == (3, 1, 1)

    class Refusing(ReplayCapture):
        def capture(self, launches):
            raise RuntimeError("capture refused")

    ran.clear()
    g = StepGraphs(Refusing())
    for _ in range(3):
        step(g, ["a", "b"])
    assert ran == ["a", "b"] * 3 and g.failed == "RuntimeError: capture refused" and g.captured == 0


@in_process
def test_graphs_are_off_in_the_simulator(micro, monkeypatch):
    """PYMOE_CUDA_GRAPHS unset: off in the simulator (CuPy cannot run there); 1: a one-line error saying why not."""
    path = micro("qwen3moe")
    assert load(path, "slots").backend.graphs is None
    monkeypatch.setenv("PYMOE_CUDA_GRAPHS", "1")
    with pytest.raises(pymoe.PymoeError, match="PYMOE_CUDA_GRAPHS=1 needs a GPU"):
        load(path, "slots")


@pytest.mark.skipif(IS_SIMULATOR, reason="GPU only: CUDA graphs need CuPy and a real device")
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "deepseek2", "qwen3next"])
def test_graphs_on_and_off_decode_alike(micro, monkeypatch, arch):
    """On a GPU: greedy tokens and every step's logits with the step captured into a CUDA graph and replayed
    (PYMOE_CUDA_GRAPHS=1) equal those of the same launches made directly (0), bit for bit (a replay runs the very
    kernels on the very arguments); across promotions too. With graphs on, the steps after the first replay."""
    path = micro(arch)
    runs = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("PYMOE_CUDA_GRAPHS", graphs)
        engine = load(path, "promotions", kernels="cuda_kernels")
        kv = engine.model.new_kv(64)
        engine.model.prefill(PROMPT, kv)
        token, tokens, logits = 9, [], []
        for _ in range(6):
            out = engine.model.decode_one_token(token, kv)
            logits.append(np.asarray(out).copy())
            token = out.greedy_token
            tokens.append(token)
        runs[graphs] = tokens, logits, engine.backend.graphs
    (t0, l0, off), (t1, l1, on) = runs["0"], runs["1"]
    assert off is None and (on.direct, on.captured, on.replayed) == (1, 1, 4)
    assert t0 == t1
    for a, b in zip(l0, l1):
        assert np.array_equal(a, b)


if not IN_PROCESS:
    test_this_file_in_a_fresh_interpreter = fresh_interpreter_test(__file__)
