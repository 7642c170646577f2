"""Routing traces and expert profiles: formats round-trip, bad files fail in one line, the routing-heat README's
static coverage numbers come out, and trace -> build-profile -> `pymoe run --profile` works on a tiny model (a
plumbing test: the simulator's replay of the trace gives the engine's hit count, which checks the trace and the
wiring; both run the same `policies.SlotTable`, so it is no oracle of the policies -- tests/test_policies.py holds
those to hand-made sequences and Belady to an exhaustive optimum)."""
import functools
import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, run_pymoe, run_pymoe_here
from pymoe.errors import PymoeError
from pymoe.experts.profile import HEADER, Profile, load_heat_json
from pymoe.experts.simulate import slots_for_coverage, sweep
from pymoe.experts.trace import Trace, TraceRecorder

# shared/ lies beside the checkout (CI copies it there too)
HEAT_DIR = os.path.join(os.path.dirname(ROOT), "shared", "data", "routing-heat")
META = {"model": "hand", "arch": "test", "n_layers": 2, "n_experts": 5, "k": 2}


def record_request(rec, prompt, decode_steps):
    """A prefill of len(prompt) tokens, then decode steps; ids of layer l, token t: (l + t, l + t + 1) mod 5."""
    rec.start_request(len(prompt))
    for T, phase in [(len(prompt), "prefill")] + [(1, "decode")] * decode_steps:
        for layer in range(2):
            t = np.arange(T)[:, None]
            rec.record(layer, (layer + t + np.array([[0, 1]])) % 5, np.full((T, 2), 0.5), phase)
        rec.end_forward()


def test_trace_round_trip_and_key_orders(tmp_path):
    rec = TraceRecorder(META)
    record_request(rec, [1, 2, 3], decode_steps=2)
    assert rec.n_tokens == 5
    rec.save(tmp_path / "t.npz")
    tr = Trace.load(tmp_path / "t.npz")
    assert tr.experts.shape == (5, 2, 2) and tr.experts.dtype == np.uint16 and tr.weights.dtype == np.float16
    assert tr.phase.tolist() == [0, 0, 0, 1, 1] and tr.request.tolist() == [0] * 5
    assert tr.forward.tolist() == [0, 0, 0, 1, 2]
    assert tr.meta["prompt_lengths"] == [3] and tr.meta["model"] == "hand" and tr.meta["n_forwards"] == 3
    assert tr.tokens("decode") == 2
    np.testing.assert_array_equal(tr.experts[1, 1], [2, 3])  # layer 1, token 1
    # token order: token 0 layer 0 (0, 1), token 0 layer 1 (1, 2) + 5, token 1 layer 0 (1, 2), ...
    assert tr.keys()[:6].tolist() == [0, 1, 6, 7, 1, 2]
    # engine order: the prefill forward layer by layer (all 3 tokens of layer 0 first), then each decode token
    assert tr.keys(order="engine")[:8].tolist() == [0, 1, 1, 2, 2, 3, 6, 7]
    keys, rows = tr.lookups(order="engine")
    assert sorted(keys.tolist()) == sorted(tr.keys().tolist()) and rows[:8].tolist() == [0, 0, 1, 1, 2, 2, 0, 0]
    assert tr.keys("decode").tolist() == tr.keys()[12:].tolist()


def test_trace_append(tmp_path):
    path = tmp_path / "t.npz"
    for prompt in ([1, 2], [4]):
        rec = TraceRecorder(META)
        record_request(rec, prompt, decode_steps=1)
        rec.save(path, append=True)
    tr = Trace.load(path)
    assert tr.n_tokens == 5 and tr.meta["prompt_lengths"] == [2, 1] and tr.meta["n_requests"] == 2
    assert tr.request.tolist() == [0, 0, 0, 1, 1] and tr.forward.tolist() == [0, 0, 1, 2, 3]
    other = TraceRecorder(dict(META, n_experts=6))
    record_request(other, [1], decode_steps=0)
    with pytest.raises(PymoeError, match="cannot append: n_experts"):
        other.save(path, append=True)


def test_recorder_misuse():
    rec = TraceRecorder(META)
    with pytest.raises(ValueError, match="out of order"):
        rec.record(1, np.zeros((1, 2)), np.zeros((1, 2)), "decode")
    rec.record(0, np.zeros((1, 2)), np.zeros((1, 2)), "decode")
    with pytest.raises(ValueError, match="expected"):
        rec.record(1, np.zeros((2, 2)), np.zeros((2, 2)), "decode")  # T changed within a forward
    with pytest.raises(ValueError, match="1 of 2 MoE layers"):
        rec.end_forward()
    with pytest.raises(ValueError, match="lacks"):
        TraceRecorder({"n_layers": 2})


def test_recorder_holds_the_moe_layers_after_the_dense_ones():
    """glm4moe / deepseek2 lead with dense layers: the trace's layer 0 is the model's first MoE layer."""
    rec = TraceRecorder(dict(META, first_moe_layer=1))
    with pytest.raises(ValueError, match="out of order"):
        rec.record(0, np.zeros((1, 2)), np.zeros((1, 2)), "decode")  # a dense layer routes nothing
    rec.record(1, np.array([[3, 1]]), np.ones((1, 2)), "decode")
    rec.predict(2, [4, 3], 2)
    rec.record(2, np.array([[0, 2]]), np.ones((1, 2)), "decode")
    rec.end_forward()
    t = rec.trace()
    assert (t.n_layers, t.first_moe_layer) == (2, 1)
    assert t.experts[0].tolist() == [[3, 1], [0, 2]] and t.prefetches(0, 1) == ([4, 3], 2)
    E = META["n_experts"]
    assert t.keys().tolist() == [3, 1, E + 0, E + 2]  # trace layer * n_experts + expert


@pytest.mark.parametrize("make, expected", [
    (lambda p: None, "no such file"),
    (lambda p: p.write_text("hello"), "not a NumPy .npz"),
    (lambda p: p.write_bytes(b"PK\x03\x04" + b"\0" * 30), "not a pymoe trace"),
    (lambda p: np.savez(open(p, "wb"), experts=np.zeros(3)), "missing"),
    (lambda p: np.savez(open(p, "wb"), meta=np.array(json.dumps({"format": "other"})),
                        **{a: np.zeros(1) for a in ("experts", "weights", "phase", "request", "forward")}),
     "format 'other'"),
])
def test_trace_bad_files(tmp_path, make, expected):
    path = tmp_path / "t.npz"
    make(path)
    with pytest.raises(PymoeError, match=expected) as e:
        Trace.load(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_trace_inconsistent_arrays(tmp_path):
    rec = TraceRecorder(META)
    record_request(rec, [1], decode_steps=1)
    tr = rec.trace()
    tr.experts[0, 0, 0] = 7  # expert 7 of 5
    tr.save(tmp_path / "t.npz")
    with pytest.raises(PymoeError, match="out of range"):
        Trace.load(tmp_path / "t.npz")


def test_profile_ranking_round_trip(tmp_path):
    heat = np.array([[3, 0, 5], [5, 1, 0]])
    p = Profile.from_heat(heat)
    assert p.pairs.tolist() == [[0, 2], [1, 0], [0, 0], [1, 1], [0, 1], [1, 2]]  # ties by global key
    assert p.counts.tolist() == [5, 5, 3, 1, 0, 0]
    assert p.keys().tolist() == [2, 3, 0, 4, 1, 5] and p.keys(2).tolist() == [2, 3]
    assert p.top(2).tolist() == [[0, 2], [1, 0]]
    assert p.coverage_hit_rate(2) == pytest.approx(10 / 14) and p.coverage_hit_rate(0) == 0.0
    np.testing.assert_array_equal(p.heat(), heat)
    path = tmp_path / "expert-profile.bin"
    p.save(path, built_for_slots=4)
    assert os.path.getsize(path) == 32 + 6 * 12
    q = Profile.load(path)
    assert (q.n_layers, q.n_experts, q.built_for_slots) == (2, 3, 4)
    np.testing.assert_array_equal(q.pairs, p.pairs)
    np.testing.assert_array_equal(q.counts, p.counts)
    assert q.log_line("expert-profile.bin") == "profile expert-profile.bin: 6 ranked pairs, built for 4 slots"
    p2 = Profile.from_heat(heat)
    p2.save(path)
    assert Profile.load(path).built_for_slots == 6  # default: every pair


def test_profile_from_trace_counts_lookups():
    rec = TraceRecorder(META)
    record_request(rec, [1, 2], decode_steps=1)
    tr = rec.trace()
    p = Profile.from_trace(tr)
    assert p.counts.sum() == tr.n_tokens * 2 * 2
    np.testing.assert_array_equal(p.heat().reshape(-1), np.bincount(tr.keys(), minlength=10))
    assert Profile.from_trace(tr, "decode").counts.sum() == 1 * 2 * 2


@pytest.mark.parametrize("corrupt, expected", [
    (lambda b: b"", "bad magic"),
    (lambda b: b"NOTPRFL!" + b[8:], "bad magic"),
    (lambda b: b[:-5], "truncated"),
    (lambda b: b[:20], "bad magic"),  # shorter than the header
    (lambda b: b[:8] + struct.pack("<I", 9) + b[12:], "version 9"),
    (lambda b: b[:HEADER.size] + struct.pack("<HH", 7, 0) + b[HEADER.size + 4:], "out of range"),
    (lambda b: b[:HEADER.size + 12] + b[HEADER.size:HEADER.size + 12] + b[HEADER.size + 24:], "twice"),
])
def test_profile_bad_files(tmp_path, corrupt, expected):
    path = tmp_path / "p.bin"
    Profile.from_heat(np.arange(6).reshape(2, 3)).save(path)
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(PymoeError, match=expected) as e:
        Profile.load(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PymoeError, match="no such file"):
        Profile.load(tmp_path / "missing.bin")


@pytest.mark.parametrize("name, table", [
    ("qwen3-30b-a3b", {10: 36.0, 23.5: 63.0, 50: 89.0, 79.5: 98.6, 90: 99.7}),
    ("qwen3-next-80b-a3b", {10: 32.5, 23.5: 56.6, 50: 84.9, 79.5: 98.4, 90: 99.8}),
])
def test_routing_heat_readme_static_coverage(name, table):
    """The README ranks all (layer, expert) pairs globally and gives the top floor(coverage * L * E) of them."""
    path = os.path.join(HEAT_DIR, f"{name}.json")
    if not os.path.exists(path):
        pytest.skip("routing-heat data not present")
    p = load_heat_json(path)
    for coverage, expected in table.items():
        rate = 100 * p.coverage_hit_rate(slots_for_coverage(coverage, p.n_layers, p.n_experts))
        assert abs(rate - expected) <= 0.05, (coverage, rate)  # the README rounds to 0.1 points: half a step


def run_tool(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build-profile"), *args], capture_output=True,
                          text=True, timeout=120)


def test_build_profile_tool(tmp_path):
    paths = []
    for i in range(2):
        rec = TraceRecorder(META)
        record_request(rec, [1, 2, 3], decode_steps=i + 1)
        paths.append(str(tmp_path / f"t{i}.npz"))
        rec.save(paths[-1])
    out = tmp_path / "expert-profile.bin"
    r = run_tool(*paths, "-o", str(out), "--slots", "4")
    assert r.returncode == 0, r.stderr
    assert f"profile {out}: 10 ranked pairs, built for 4 slots" in r.stdout
    p = Profile.load(out)
    assert p.counts.sum() == (4 + 5) * 2 * 2  # both traces counted
    r = run_tool(str(tmp_path / "nope.npz"), "-o", str(out))
    assert r.returncode == 2 and "no such file" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    pytest.importorskip("matplotlib")
    r = run_tool(paths[0], "-o", str(out), "--plot", str(tmp_path / "heat.png"), "--slots", "3")
    assert r.returncode == 0 and (tmp_path / "heat.png").read_bytes()[:4] == b"\x89PNG"


def decode_hits(stderr):
    m = re.search(r"decode expert cache hit rate: [\d.]+% \((\d+) hits / (\d+) lookups\)", stderr)
    assert m, stderr
    return int(m.group(1)), int(m.group(2))


def test_trace_profile_run_round_trip_plumbing(tiny_model, tmp_path):
    """pymoe run --trace -> build-profile -> pymoe run --profile (--trace again). Plumbing, not an oracle: the engine
    and the simulator run the same SlotTable, so replaying the second trace with the same profile, policy and slots
    must give the engine's decode hit count exactly -- unless the trace lost, reordered or mislabelled a lookup, or
    the engine's cache is wired to the policy differently from the simulator."""
    model = tiny_model("qwen3moe", "f32")
    trace1, profile_path = tmp_path / "t1.npz", tmp_path / "expert-profile.bin"
    for prompt in ("hello world", "the cat sat"):  # two runs appended into one trace
        r = run_pymoe_here("run", model, "-p", prompt, "-n", "6", "--trace", str(trace1))
        assert r.returncode == 0, r.stderr
    tr = Trace.load(trace1)
    assert tr.meta["n_requests"] == 2 and tr.meta["arch"] == "qwen3moe" and tr.tokens("decode") == 10
    r = run_tool(str(trace1), "-o", str(profile_path), "--slots", "3")
    assert r.returncode == 0, r.stderr
    profile = Profile.load(profile_path)
    from pymoe.experts.policies import ENGINE_POLICIES, make_admission, make_warm_rule

    warm_mattered = []
    runs = (("lru", "all", 0, (0, 0)), ("lfu", "all", 0, (0, 0)), ("lfru", "all", 0, (0, 0)),
            ("lfru", "second-miss", 0, (0, 0)), ("lru", "all", 1, (0, 0)), ("lfru", "second-miss", 1, (0, 0)),
            ("lru", "all", 1, (2, 0)), ("lfru", "second-miss", 1, (3, 2)), ("lfru", "all", 0, (1, 0)),
            ("llamacpp", "all", 0, (0, 0)), ("arc", "all", 0, (0, 0)), ("s3fifo", "all", 0, (0, 0)),
            ("lirs", "all", 0, (0, 0)), ("window", "all", 0, (0, 0)), ("window", "second-miss", 1, (2, 0)),
            ("cooc", "all", 0, (0, 0)), ("cooc", "second-miss", 1, (2, 0)), ("duel", "second-miss", 1, (2, 0)))
    runs += tuple((name, "all", 0, (0, 0)) for name in ENGINE_POLICIES if name not in {r[0] for r in runs})
    for policy, admit, max_inserts, warm in runs:  # every engine policy (the registry); some with admission, warm set
        trace2 = tmp_path / f"t2-{policy}-{admit}-{max_inserts}-{warm[0]}.npz"
        r = run_pymoe_here("run", model, "-p", "a new prompt", "-n", "8", "--profile", str(profile_path),
                      "--cache-slots", "3", "--policy", policy, "--trace", str(trace2), "--admit", admit,
                      "--max-inserts", str(max_inserts), "--warm-set", str(warm[0]), "--warm-inserts", str(warm[1]))
        assert r.returncode == 0, r.stderr
        assert f"profile {profile_path}: {profile.n_pairs} ranked pairs, built for 3 slots" in r.stderr
        hits, lookups = decode_hits(r.stderr)
        assert 0 < hits < lookups, (policy, admit, max_inserts, warm, hits, lookups)  # 3 slots are too few for the tiny model's routing: a real test of the policy
        replay = functools.partial(sweep, Trace.load(trace2), [policy], [3], ["global"], profile=profile,
                                   phase="decode", admission=make_admission(admit, max_inserts))
        (sim,) = replay(warm=make_warm_rule(*warm))
        assert (sim.hits, sim.lookups) == (hits, lookups), (policy, admit, max_inserts, warm)
        if warm[0]:
            copied = int(re.search(r"warm decode set \(.*\): (\d+) experts copied", r.stderr).group(1))
            assert copied > 0, r.stderr
            warm_mattered.append(replay()[0].hits != hits)  # the replay without the warm set counts otherwise
    assert any(warm_mattered)  # the warm set changed the count at least once: the comparison above can fail


def prefetch_counts(stderr):
    """(prefetched, prefetch hits) from `pymoe run --lookahead N`'s decode cache line, (0, 0) when none."""
    m = re.search(r"(\d+) prefetched by the router lookahead, (\d+) of the hits on them", stderr)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def test_lookahead_prefetch_replay_plumbing(tiny_model, tmp_path):
    """pymoe run --lookahead N --cache-slots S --trace -> the trace holds the lookahead's ranked predictions and
    budget per decode layer-step -> sweep(prefetch=True) replays them through the same policies.prefetch_ranked and
    SlotTable.prefetch: decode hits, lookups, prefetched and prefetch hits equal the engine's exactly. Replaying the
    same trace without the predictions must count otherwise (so the equality is not the replay ignoring them).
    The engine starts with an empty pool (no --profile): the replay gets an empty profile (nothing pre-filled).
    Measured 2026-12-01 (tiny qwen3moe, 2 layers x 8 experts, top-2, 11 decode tokens = 44 lookups): lru/3 slots/
    N=2: 22 hits, 22 prefetched, 22 prefetch hits, 0 hits without; lfu/second-miss/max 1/4 slots/N=2: 36 hits, 2
    prefetched, 2 prefetch hits, 34 without; lru/max 1/5 slots/N=3: 40 hits, 3 prefetched, 2 prefetch hits, 38
    without."""
    from pymoe.experts.policies import make_admission

    model = tiny_model("qwen3moe", "f32")
    differs = []
    for policy, admit, max_inserts, n, slots in (("lru", "all", 0, 2, 3), ("lfu", "second-miss", 1, 2, 4),
                                                 ("lru", "all", 1, 3, 5)):
        path = tmp_path / f"t-{policy}-{admit}-{max_inserts}.npz"
        r = run_pymoe_here("run", model, "-p", "a new prompt", "-n", "12", "--cache-slots", str(slots), "--policy",
                           policy, "--admit", admit, "--max-inserts", str(max_inserts), "--lookahead", str(n),
                           "--trace", str(path))
        assert r.returncode == 0, r.stderr
        hits, lookups = decode_hits(r.stderr)
        prefetched, prefetch_hits = prefetch_counts(r.stderr)
        assert prefetched > 0 and 0 < hits < lookups, r.stderr  # the prefetch ran, and the pool is too small
        trace = Trace.load(path)
        steps = int((trace.predicted_limit >= 0).sum())
        assert steps == trace.tokens("decode") and set(trace.predicted_limit[trace.predicted_limit >= 0]) == {n}
        empty = Profile(trace.n_layers, trace.n_experts, np.zeros((0, 2)), [])
        replay = functools.partial(sweep, trace, [policy], [slots], ["global"], profile=empty, phase="decode",
                                   admission=make_admission(admit, max_inserts))
        (sim,) = replay(prefetch=True)
        assert (sim.hits, sim.lookups, sim.prefetched, sim.prefetch_hits) == (hits, lookups, prefetched,
                                                                              prefetch_hits), policy
        (plain,) = replay()
        assert plain.prefetched == plain.prefetch_hits == 0
        differs.append(plain.hits != hits)
    # the API, with a budget below the predictions (Lookahead(budget=1) of k=3): the recorded limit binds
    import pymoe
    from pymoe.experts.prefetch import Lookahead

    e = pymoe.load(model, cache_slots=4, policy="lru", pcie_frac=1.0)
    e.model.lookahead = Lookahead(e.model, k=3, budget=1, advise=False)
    trace_of = e.record_trace()
    list(e.generate([5, 17, 42, 7], max_tokens=12, stop_at_eos=False))
    d, trace = e.cache.stats.counts["decode"], trace_of.trace()
    assert set(trace.predicted_limit[trace.predicted_limit >= 0]) == {1} and (trace.predicted[..., 2] >= 0).any()
    empty = Profile(trace.n_layers, trace.n_experts, np.zeros((0, 2)), [])
    (sim,) = sweep(trace, ["lru"], [4], ["global"], profile=empty, phase="decode", prefetch=True)
    assert 0 < d["prefetched"] <= trace.tokens("decode")  # at most one per decode layer-step (1 predicted layer)
    assert (sim.hits, sim.lookups, sim.prefetched, sim.prefetch_hits) == (d["hits"], d["lookups"], d["prefetched"],
                                                                          d["prefetch_hits"])
    differs.append(sweep(trace, ["lru"], [4], ["global"], profile=empty, phase="decode")[0].hits != d["hits"])
    assert all(differs)  # each time the predictions changed the count: the comparison above can fail
    r = run_pymoe_here("simulate", str(path), "--prefetch", "--slots", "5", "--pool", "global", "--phase", "decode",
                       "--policy", "lru,belady", "--max-inserts", "1", "--profile", str(path))
    assert r.returncode == 0, r.stderr
    assert "lookahead prefetch: replayed (belady left out" in r.stdout and "prefetch hits of" in r.stdout, r.stdout


def test_trace_predictions_round_trip_and_append(tmp_path):
    """The lookahead's predictions (TraceRecorder.predict) are saved and loaded; appending a trace without any to
    one with them (or the reverse) pads with "none asked" (-1); an old file without the arrays loads with None."""
    rec = TraceRecorder(META)
    record_request(rec, [1, 2], 1)  # forward 0 prefill, forward 1 decode: no predictions asked
    rec.start_request(1)
    rec.record(0, [[0, 1]], [[0.5, 0.5]], "prefill")
    rec.predict(1, [4, 2, 3], 2)  # asked during the forward, before layer 1 is recorded
    rec.record(1, [[2, 4]], [[0.5, 0.5]], "prefill")
    rec.end_forward()
    path = tmp_path / "p.npz"
    rec.save(path)
    tr = Trace.load(path)
    assert tr.predicted.shape == (3, 2, 3) and tr.predicted_limit.tolist() == [[-1, -1], [-1, -1], [-1, 2]]
    assert tr.prefetches(2, 1) == ([4, 2, 3], 2) and tr.prefetches(1, 1) is None
    plain = TraceRecorder(META)
    record_request(plain, [3], 2)
    plain.save(tmp_path / "old.npz")
    with np.load(tmp_path / "old.npz") as z:
        assert "predicted" not in z.files  # no lookahead: the file is as before
    assert Trace.load(tmp_path / "old.npz").predicted is None
    plain.save(path, append=True)
    tr = Trace.load(path)
    assert tr.predicted.shape == (6, 2, 3) and (tr.predicted_limit[3:] == -1).all() and tr.prefetches(2, 1)[1] == 2
    rec.save(tmp_path / "old.npz", append=True)
    assert Trace.load(tmp_path / "old.npz").prefetches(5, 1) == ([4, 2, 3], 2)
