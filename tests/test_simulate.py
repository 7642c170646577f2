"""The cache simulator: pools, counted / staged lookups, knee, table, plot, and the `pymoe simulate` command."""
import numpy as np
import pytest

from conftest import run_pymoe_here
from pymoe.errors import PymoeError
from pymoe.experts.profile import Profile
from pymoe.experts.simulate import (SimResult, format_table, knee, simulate, slots_for_coverage, split_slots, sweep)
from pymoe.experts.trace import synthetic_trace


def test_split_slots():
    assert split_slots(10, 4) == [3, 3, 2, 2]
    assert split_slots(3, 4) == [1, 1, 1, 0]
    assert sum(split_slots(5784, 48)) == 5784


def test_slots_for_coverage_floors_like_the_heat_readme():
    assert slots_for_coverage(10, 48, 128) == 614  # 614.4
    assert slots_for_coverage(23.5, 48, 512) == 5775  # 5775.36
    assert slots_for_coverage(30, 1, 10) == 3  # 0.3 * 10 is 2.9999999999999996 in floating point


def test_per_layer_pool_vs_global_pool():
    # 2 layers x 4 experts; keys 0-3 are layer 0, 4-7 layer 1. Layer 0 cycles 0 1 0 1..., layer 1 always 4.
    keys = np.array([0, 4, 1, 4, 0, 4, 1, 4])
    # per-layer, 2 slots = 1 per layer: layer 0 thrashes (0 hits), layer 1 hits 3 times.
    r = simulate(keys, 2, 4, "lru", 2, pool="per-layer", tokens=4, prefill=False)  # from empty slots
    assert (r.lookups, r.hits, r.misses_per_token) == (8, 3, 5 / 4)
    # global, 2 slots under LRU: 0 4 | 1 evicts 0 | 4 hit | 0 evicts 1 | 4 hit | 1 evicts 0 | 4 hit.
    r = simulate(keys, 2, 4, "lru", 2, pool="global", tokens=4, prefill=False)
    assert r.hits == 3 and r.coverage == 2 / 8 and r.hit_rate == 3 / 8
    # global, 3 slots: everything fits after the first use of each.
    assert simulate(keys, 2, 4, "lru", 3, pool="global", prefill=False).hits == 5


def test_counted_and_staged():
    keys = np.array([0, 1, 0, 1])
    staged = np.array([True, True, False, False])  # the first two are prefill lookups: their misses stay out
    r = simulate(keys, 1, 2, "lru", 2, pool="global", staged=staged, prefill=False)
    assert r.hits == 0  # nothing was let in during "prefill", so the decode lookups miss (and now enter)
    r = simulate(keys, 1, 2, "lru", 2, pool="global", counted=~staged, tokens=2, prefill=False)
    assert (r.lookups, r.hits) == (2, 2)


def test_static_needs_a_profile_and_keys_are_checked():
    with pytest.raises(PymoeError, match="needs a profile"):
        simulate(np.array([0, 1]), 1, 2, "static", 1)
    with pytest.raises(PymoeError, match="out of range"):
        simulate(np.array([0, 9]), 1, 2, "lru", 1)


def test_static_hit_rate_is_the_profiles_coverage_bound_in_sample():
    trace = synthetic_trace(120, 3, 16, 2, seed=3)
    profile = Profile.from_trace(trace)
    for slots in (3, 12, 24):
        r = simulate(trace.keys(), 3, 16, "static", slots, pool="global", profile=profile)
        assert r.hit_rate == pytest.approx(profile.coverage_hit_rate(slots))


def test_sweep_policies_order_and_belady_on_top():
    trace = synthetic_trace(150, 4, 16, 2, seed=1, prompt_len=10)
    results = sweep(trace, ["lru", "lfu", "lfru", "static", "pinned-lru", "belady"], [4, 8, 16, 32],
                    ["per-layer", "global"], phase="decode")
    assert len(results) == 2 * 6 * 4
    assert all(r.lookups == 140 * 4 * 2 for r in results)
    by = {(r.pool, r.policy, r.slots): r for r in results}
    for pool in ("per-layer", "global"):
        for slots in (4, 8, 16, 32):
            assert by[pool, "belady", slots].hits >= max(by[pool, p, slots].hits
                                                         for p in ("lru", "lfu", "lfru", "static"))
        rates = [by[pool, "lru", s].hit_rate for s in (4, 8, 16, 32)]
        assert rates == sorted(rates)  # LRU is a stack algorithm: more slots never hurt (per-layer split too)


def res(policy, slots, rate, pool="global"):
    return SimResult(policy, slots, slots / 100, pool, 100, int(rate * 100), rate, 0.0)


def test_knee_definition():
    # +10% coverage adds 30, 10, 2, 0.5 points: the knee is at 40% (the step from 40% to 50% adds < 1 point).
    results = [res("lru", 10, 0.40), res("lru", 20, 0.70), res("lru", 30, 0.80), res("lru", 40, 0.82),
               res("lru", 50, 0.825), res("lfu", 10, 0.5), res("lfu", 20, 0.9)]
    knees = knee(results)
    assert knees["global", "lru"].slots == 40
    assert knees["global", "lfu"] is None
    # the slope is per +10% coverage: a +20% step adding 1.5 points is below 1 point per 10%
    assert knee([res("a", 10, 0.5), res("a", 30, 0.515)])["global", "a"].slots == 10
    table = format_table(results)
    assert "82.0 (0.00)*" in table and "pool global" in table


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from pymoe.experts.simulate import plot

    path = tmp_path / "hit.png"
    plot([res("lru", 10, 0.4), res("lru", 20, 0.7), res("lru", 20, 0.6, pool="per-layer")], path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_cli_simulate(tmp_path):
    path = tmp_path / "syn.npz"
    synthetic_trace(200, 4, 16, 2, seed=0, prompt_len=8).save(path)
    r = run_pymoe_here("simulate", str(path), "--coverage", "10,25,50,75", "--phase", "decode")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "4 layers x 16 experts, top-2; 200 tokens (8 prefill, 192 decode)" in out
    assert "in-sample" in out and "pool per-layer" in out and "pool global" in out
    for name in ("static", "lru", "lfu", "pinned-lru", "belady"):
        assert name in out
    assert "     32    50.0%" in out  # 50% of 64 experts
    r = run_pymoe_here("simulate", str(path), "--slots", "8", "--policy", "lru", "--warm-set", "2")
    assert r.returncode == 0 and "warm decode set: the last 2 prompt tokens' experts" in r.stdout, r.stderr
    r = run_pymoe_here("simulate", str(path), "--slots", "8,16", "--policy", "lru,belady", "--pool", "global")
    assert r.returncode == 0 and "pool per-layer" not in r.stdout
    assert [line.split() for line in r.stdout.splitlines() if "coverage" in line][-1] == [
        "slots", "coverage", "lru", "belady"]


@pytest.mark.parametrize("content, args, expected", [
    (b"this is not a trace\n", (), "not a pymoe trace"),
    (b"PK\x03\x04 truncated zip", (), "not a pymoe trace"),
    (None, ("--policy", "fifo"), "unknown cache policy 'fifo'"),
    (None, ("--slots", "4", "--coverage", "10"), "--slots or --coverage"),
    (None, ("--coverage", "150"), "percent"),
    (None, ("--slots", "x"), "comma-separated numbers"),
    (None, ("--warm-set", "-1"), "--warm-set and --warm-inserts must be >= 0"),
])
def test_cli_simulate_errors(tmp_path, content, args, expected):
    path = tmp_path / "t.npz"
    if content is None:
        synthetic_trace(20, 2, 8, 2).save(path)
    else:
        path.write_bytes(content)
    r = run_pymoe_here("simulate", str(path), *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and expected in err, err


def hand_trace(prompt, decode, more=()):
    """A made-up trace of 2 layers x 4 experts, top-2: prompt = [[layer-0 ids, layer-1 ids] per token] read in one
    forward, then one decode forward per token of `decode`; `more`: further (prompt, decode) requests."""
    from pymoe.experts.trace import TraceRecorder

    rec = TraceRecorder({"model": "hand", "arch": "test", "n_layers": 2, "n_experts": 4, "k": 2})
    for p, d in ((prompt, decode), *more):
        rec.start_request(len(p))
        for rows, phase in [(p, "prefill")] + [([row], "decode") for row in d]:
            for layer in range(2):
                ids = np.array([row[layer] for row in rows])  # [T, 2]
                rec.record(layer, ids, np.full(ids.shape, 0.5), phase)
            rec.end_forward()
    return rec.trace()


def test_warm_set_by_hand():
    """Oracle for the warm decode set (policies.WarmSet), worked by hand. Keys: layer 0 expert e -> e, layer 1 -> 4 + e.
    Prompt tokens t0 t1 t2 (layer 0; layer 1): t0 (0 1; 0 1), t1 (2 3; 1 2), t2 (2 0; 3 1).
    --warm-set 2 ranks the last two tokens' keys, t2 first, layer 0 first, router order, each key once:
        t2: 2 0 | 7 5    t1: 3 (2 seen) | 6 (5 seen)     -> 2 0 7 5 3 6
    A global LRU pool of 3 slots takes the first 3 (the cap: more would evict its own warm keys), placed lowest
    rank first: 7, 0, 2, so LRU order (oldest first) is 7 0 2.
    Decode d0 (2 0; 3 2) = keys 2 0 7 6: hit 2 (7 0 2), hit 0 (7 2 0), hit 7 (2 0 7), miss 6 evicts 2 (0 7 6).
                 d1 (0 1; 3 2) = keys 0 1 7 6: hit 0 (7 6 0), miss 1 evicts 7 (6 0 1), miss 7 evicts 6 (0 1 7),
                                               miss 6 evicts 0 (1 7 6).                        -> 4 hits of 8.
    Cold (no warm set: prefill misses are staged, nothing enters): d0 misses all 4, leaving 0 7 6 (2 evicted by
    6); d1 hits 0, then misses 1 7 6 as above                                                   -> 1 hit of 8.
    With --warm-inserts 2: 2 and 0 are placed (LRU 0 2, one slot free); d0: hit 2 (0 2), hit 0 (2 0), miss 7 takes
    the free slot (2 0 7), miss 6 evicts 2 (0 7 6); d1 as above                                 -> 3 hits of 8."""
    from pymoe.experts.policies import SlotTable, WarmRule, WarmSet, make_policy, make_warm_rule
    from pymoe.experts.simulate import prompt_ends

    prompt = [[(0, 1), (0, 1)], [(2, 3), (1, 2)], [(2, 0), (3, 1)]]
    trace = hand_trace(prompt, [[(2, 0), (3, 2)], [(0, 1), (3, 2)]])
    ws = WarmSet(WarmRule(2), 4)
    keys, row = trace.lookups(order="engine")
    for t in np.flatnonzero(trace.rows("prefill")[row]):
        ws.see(int(keys[t]), int(row[t]), int(t))
    assert [k for k, _ in ws.ranked()] == [2, 0, 7, 5, 3, 6]
    table = SlotTable(3, make_policy("lru", 3))
    assert [(k, s) for k, s, _ in ws.apply(lambda key: table)] == [(7, 0), (0, 1), (2, 2)]  # lowest rank first
    assert list(table.policy.order) == [7, 0, 2] and ws.ranked() == []  # LRU order, oldest first; the set is spent

    def run(tokens, inserts=0, policy="lru"):
        staged = trace.rows("prefill")[row]
        r = simulate(keys, 2, 4, policy, 3, pool="global", counted=~staged, staged=staged, prefill=False,
                     warm=make_warm_rule(tokens, inserts), rows=row, warm_after=prompt_ends(trace, row))
        return r.hits, r.lookups

    assert run(0) == (1, 8)
    assert run(2) == (4, 8)
    assert run(2, inserts=2) == (3, 8)
    assert run(2, policy="belady")[0] >= run(2)[0]  # the bound, from the same warm placements' offer


def test_prompt_ends_are_where_the_engine_warms():
    """Requests A (3 prompt tokens in one forward, 2 decode), B (1 prompt token, no decode), C (2 prompt tokens, 1
    decode); a forward of T tokens is T x 2 layers x 2 lookups. Positions: A's prompt 0-11, its decode 12-15 and
    16-19, B's prompt 20-23, C's prompt 24-31, its decode 32-35. The engine calls end_prefill() after each prompt:
    after 11, 23 (B's prompt ends where C's begins: another request) and 31."""
    from pymoe.experts.policies import make_warm_rule
    from pymoe.experts.simulate import prompt_ends

    tok = [(0, 1), (2, 3)]
    trace = hand_trace([tok] * 3, [tok] * 2, more=[([tok], []), ([tok] * 2, [tok])])
    keys, row = trace.lookups(order="engine")
    assert keys.size == 36
    assert np.flatnonzero(prompt_ends(trace, row)).tolist() == [11, 23, 31]
    # sweep() replays the same rule (from empty slots): warm, A's prompt experts are resident when its decode starts
    no, yes = (sweep(trace, ["lru"], [8], ["global"], prefill=False, phase="decode",
                     warm=make_warm_rule(n))[0].hits for n in (0, 1))
    assert (no, yes) == (12 - 4, 12)  # cold: A's first decode token misses its 4 experts; warm: nothing misses


def in_window(trace, window):
    """Share of decode picks whose expert was among the previous `window` tokens' picks of its layer and request."""
    E, found = trace.experts.astype(np.int64), []  # [N, L, K]
    for t in range(trace.n_tokens):
        same = np.flatnonzero(trace.request[:t] == trace.request[t])[-window:]  # this request's previous tokens
        if trace.phase[t] and same.size:
            for layer in range(trace.n_layers):
                found += np.isin(E[t, layer], E[same, layer]).tolist()
    return float(np.mean(found))


def test_fitted_trace_follows_the_heat_and_its_locality_knob():
    """trace.fitted_trace: per-layer skew from measured counts, temporal locality from a stated knob."""
    from pymoe.experts.simulate import prompt_ends
    from pymoe.experts.trace import fitted_trace, top_share

    rng = np.random.default_rng(0)
    heat = np.stack([rng.permutation((1000 / np.arange(1, 65) ** 0.7).astype(int)) for _ in range(3)])  # [3, 64]
    trace = fitted_trace(heat, 2, 8, 400, locality=0.0, window=4, seed=1, k=4)
    assert trace.summary().endswith("3 layers x 64 experts, top-4; 816 tokens (16 prefill, 800 decode) in 2 request(s)")
    E = trace.experts.astype(np.int64)
    assert all(len(set(E[t, l].tolist())) == 4 for t in range(trace.n_tokens) for l in range(3))  # k distinct
    keys, row = trace.lookups(order="engine")
    assert np.flatnonzero(prompt_ends(trace, row)).tolist() == [8 * 12 - 1, (8 + 400 + 8) * 12 - 1]  # 12 per token
    gen = np.stack([np.bincount(E[:, l].reshape(-1), minlength=64) for l in range(3)])  # [3, 64]
    # the top 10% of experts take 37.6% of the measured lookups; generated: 35-36%: drawing 4 distinct experts per
    # token flattens the hottest a little (measured at 3264 lookups per layer: 35.0, 36.0, 36.2), hence 3 points
    assert np.abs(top_share(gen) - top_share(heat)).max() < 0.03, (top_share(gen), top_share(heat))
    # locality p: a pick copies one of the last `window` tokens' picks with probability p, so about
    # p + (1 - p) * q0 of them are found in that window, q0 the share without locality (0.354 here; measured 0.709
    # against 0.742: a copy that repeats a pick of this token is redrawn from the popularity), hence 5 points
    q0 = in_window(trace, 4)
    q = in_window(fitted_trace(heat, 2, 8, 400, locality=0.6, window=4, seed=1, k=4), 4)
    assert abs(q - (0.6 + 0.4 * q0)) < 0.05, (q, q0)


def test_every_registered_policy_is_replayed_by_default():
    """`pymoe simulate`'s default list and bench/cache_policies.py's come from the registry (policies.POLICIES), so
    a policy added there is replayed with no other edit; every registered policy builds and replays a trace."""
    import importlib.util
    import os

    from conftest import ROOT
    from pymoe.cli import cli
    from pymoe.experts.policies import ENGINE_POLICIES, OFFLINE_POLICIES, POLICIES

    option = next(p for p in cli.commands["simulate"].params if p.name == "policies")
    assert option.default.split(",") == list(POLICIES)
    assert set(ENGINE_POLICIES) == set(POLICIES) - set(OFFLINE_POLICIES)
    spec = importlib.util.spec_from_file_location("cache_policies", os.path.join(ROOT, "bench", "cache_policies.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert tuple(bench.ONLINE) == ENGINE_POLICIES
    trace = synthetic_trace(60, 2, 8, 2, seed=0)
    results = sweep(trace, list(POLICIES), [4], ["per-layer"], profile=Profile.from_trace(trace))
    assert [r.policy for r in results] == list(POLICIES)


def test_slots_start_full_as_the_engines_do():
    """By default the tables start as the engine's pool does (policies.start_keys): the profile's keys, then
    policies.fill_order, expert 0 of every layer, then expert 1, ... 2 layers x 4 experts (layer 1's keys are 4-7)."""
    from pymoe.experts.policies import fill_order, start_keys

    assert fill_order(range(2), 4) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert start_keys([6, 2], range(2), 4)[:4] == [6, 2, 0, 4] and start_keys([6], [0], 4)[:2] == [0, 1]
    every = np.arange(8)  # each expert once
    for pool in ("global", "per-layer"):
        assert simulate(every, 2, 4, "lru", 8, pool=pool).hits == 8  # room for all: all resident from the start
        assert simulate(every, 2, 4, "lru", 8, pool=pool, prefill=False).hits == 0
    # 3 slots, no profile: 0, 4, 1 resident; with a profile ranking 7 first: 7, 0, 4
    assert simulate(np.array([0, 4, 1, 5, 7]), 2, 4, "lfu", 3, pool="global").hits == 3
    profile = Profile(2, 4, np.array([[1, 3]]), [1])
    assert simulate(np.array([7, 0, 4, 1]), 2, 4, "lfu", 3, pool="global", profile=profile).hits == 3
    # per-layer, 2 slots each: layer 0 holds 0 1, layer 1 holds 4 5
    assert simulate(np.array([0, 1, 4, 5, 2, 6]), 2, 4, "lru", 4, pool="per-layer").hits == 4


def test_live_gap_replay_compiled_is_the_slot_tables():
    """gap.belady_hits (compiled: the live gap's replay) against gap.belady_hits_ref (BeladyPolicy in a SlotTable,
    lookup by lookup): the same hits on 200 random windows (skewed keys, 0-60 slots, pre-filled with a random
    resident set, sometimes larger than the pool or holding keys never looked up), exact."""
    from pymoe.experts.gap import belady_hits, belady_hits_ref

    rng = np.random.default_rng(3)
    for _ in range(200):
        n_keys, cap = int(rng.integers(2, 120)), int(rng.integers(0, 61))
        keys = (rng.zipf(1.3, int(rng.integers(1, 400))) % n_keys).tolist()
        start = rng.permutation(n_keys + 5)[:int(rng.integers(0, cap + 8))].tolist()
        assert belady_hits(keys, start, cap) == belady_hits_ref(keys, start, cap), (n_keys, cap, len(keys))


def test_live_gap_by_hand_and_in_the_engine(tiny_model):
    """experts/gap.py. By hand: LRU, 1 slot, keys 1 2 1 from empty: LRU hits none; Belady (bypass) keeps 1 and serves
    2 without a slot: 1 hit. A window of 2 closes after 2 lookups, from the contents it opened with ({1} after t0's
    insert is not yet there: it opened empty), and the third opens a new one holding 2 (LRU evicted 1 for it).
    In the engine: the request's gap counts exactly its decode lookups and hits, Belady's hits are no fewer, and the
    cache line shows them."""
    import pymoe
    from pymoe.experts.gap import LiveGap
    from pymoe.experts.policies import SlotTable, make_policy

    for window, belady in ((10, 1), (2, 0)):
        table = SlotTable(1, make_policy("lru", 1))
        gap = LiveGap(table, window=window)
        for t, key in enumerate([1, 2, 1]):
            gap.before()
            hit, _, _ = table.access(key, t)
            gap.after(key, hit)
        gap.close()
        # window 2: [1 2] from {} -> Belady 0 hits (1 is not used again inside the window); [1] from {2}: 0
        assert gap.totals() == {"lookups": 3, "hits": 0, "belady_hits": belady}, window

    engine = pymoe.load(tiny_model("qwen3moe", "f32"), cache_slots=3, policy="lru")
    list(engine.generate("a prompt", max_tokens=12, stop_at_eos=False))
    st = engine.last_stats
    assert st.gap["lookups"] == st.decode["lookups"] > 0 and st.gap["hits"] == st.decode["hits"]
    assert st.gap["hits"] <= st.gap["belady_hits"] <= st.gap["lookups"]
    assert st.gap["belady_hits"] > st.gap["hits"]  # 3 slots, LRU: Belady does better on the tiny model's routing
    assert "Belady on the same lookups and slots" in st.cache_line()
    from pymoe.serve.metrics import gap_of  # /v1/status's cache.gap and /metrics' two gauges: the cache's totals

    g = gap_of(engine.cache)
    assert (g["lookups"], g["hits"], g["belady_hits"]) == (st.gap["lookups"], st.gap["hits"], st.gap["belady_hits"])
    assert g["belady_hit_rate"] == st.gap["belady_hits"] / st.gap["lookups"] > g["hit_rate"]
