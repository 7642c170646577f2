"""The cache simulator: replay a routing trace through the engine's own cache policies and count hits.

What this is:
    simulate(keys, n_layers, n_experts, policy, slots, pool, profile, tokens) -> SimResult   one replay
    sweep(trace, policies, slots_list, pools) -> [SimResult]                         every combination
    knee(results), format_table(results), plot(results, path)                        reading the results
    report(...)                                                                      what `pymoe simulate` prints
Every lookup goes through `policies.SlotTable.access`, the code the engine's slot cache runs, so a simulated hit rate
is what the engine would count on the same routing (with the same starting contents).
What this is not: timing. Misses cost PCIe bytes or CPU time in the engine; here they are only counted
(misses per token is the number that drives decode speed, see the reference article section 3.3).

Definitions
    key         layer * n_experts + expert (the cache's unit); a trace's access sequence is
                Trace.lookups(order="engine"): per forward, layer by layer (what the engine's cache sees)
    coverage    slots / (n_layers * n_experts): the share of all experts that fit in the pool
    pool        "global": one SlotTable of `slots` slots for every layer (layers compete for slots);
                "per-layer": slots split evenly across layers (the remainder to the first layers), one table each
    start       every policy starts with every slot filled as the engine fills its pool at load time
                (policies.start_keys): the profile's ranking, hottest first, then the experts the profile left out
                in policies.fill_order (layer-interleaved by expert index); `static` and `pinned-lru` also rank by
                the profile. Without --profile, the profile is built from the trace itself (in-sample): static is
                then an upper bound for a static cache, and the others start warm with knowledge of the future (a
                small effect on long traces); an empty profile replays an engine run without --profile. Belady is
                the optimum from the same starting contents (policies.py).
    knee        per (pool, policy), the smallest simulated coverage after which the next simulated coverage adds
                less than 1 point of hit rate per +10% coverage (the slope between neighbouring points)
    counted     the lookups that count (e.g. decode only); the cache still sees every lookup in time order, as
                the engine's does.
    call        the lookups of one layer-step (one layer of one forward) are one lookup call in the engine
                (SlotCache.lookup), which serves each expert by one path, decided at its first (row, expert) pair:
                a key looked up again by a later row of the call (a speculative verification forward, a batched
                decode step) counts as that first lookup did, hit or miss, although the table may have promoted or
                evicted it in between (a promotion's bytes land after the call's experts are computed). Every
                lookup still goes through the table. promoted counts the misses that took a slot, as the engine's.
    prefill     as in the engine (cache.py), a prefill lookup that misses is "staged": served without a slot and
                without asking the policy for one, so a long prompt cannot flush the decode working set; it is a
                use all the same (LFU / LFRU count it), and prefill hits refresh the policy. sweep() applies this
                rule to the trace's prefill rows.
    warm set    with a WarmRule (`--warm-set N`), at each prompt's end (prompt_ends: a request's last prefill row)
                the experts of its last N prompt tokens are placed (policies.WarmSet), as the engine's
                SlotCache.end_prefill() does.
    prefetch    with `--prefetch` (sweep(prefetch=True)), a trace recorded with the router lookahead
                (`pymoe run --lookahead N --trace`) has its prefetch requests replayed: before the first lookup of
                each layer-step the lookahead asked about, policies.prefetch_ranked places the predicted keys with
                that step's admission and insert cap, as the engine's SlotCache.prefetch does (prefetch_plan()).
                Counted: prefetched (keys placed) and prefetch_hits (hits of that step's lookups on them). Opt-in,
                so a replay of the same trace without it is the cache without the lookahead. Not with belady (its
                admit needs a position in the lookup sequence; a prefetch has none).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from pymoe.errors import PymoeError
from .policies import (DEFAULT_POLICY, POLICIES, PROFILE_POLICIES, Admission,  # noqa: F401 (DEFAULT_POLICY: plan.py)
                       NextUse, SlotTable, WarmRule, WarmSet, make_policy, prefetch_ranked, start_keys)
from .profile import Profile

POOLS = ("per-layer", "global")
KNEE_POINTS_PER_10 = 1.0  # a knee: the next +10% coverage buys less than this many points of hit rate


@dataclass
class SimResult:
    policy: str
    slots: int
    coverage: float  # slots / (n_layers * n_experts)
    pool: str
    lookups: int
    hits: int
    hit_rate: float
    misses_per_token: float
    prefetched: int = 0  # keys the replayed lookahead placed ahead of counted lookups (sweep(prefetch=True))
    prefetch_hits: int = 0  # counted hits on keys placed for their own layer-step (part of hits)
    promoted: int = 0  # counted misses that took a slot (the engine's "promoted")


def split_slots(slots: int, n_layers: int) -> list[int]:
    """Per-layer pool sizes: `slots` split evenly, the remainder one each to the first layers."""
    base, extra = divmod(int(slots), n_layers)
    return [base + (layer < extra) for layer in range(n_layers)]


def slots_for_coverage(coverage_pct: float, n_layers: int, n_experts: int) -> int:
    """floor(coverage * n_layers * n_experts): the convention of the routing-heat README tables."""
    return int(np.floor(coverage_pct / 100.0 * n_layers * n_experts + 1e-9))


def make_tables(policy: str, slots: int, pool: str, n_layers: int, n_experts: int, profile: Optional[Profile],
                future: Optional[NextUse], prefill: bool, admission: Admission = Admission(),
                layers: Optional[Sequence[int]] = None, k: Optional[int] = None) -> list[SlotTable]:
    """One SlotTable (global) or one per layer, each with its policy and, if asked (prefill), filled as the engine
    fills its pool (policies.start_keys: the profile's keys, then the experts of `layers`, the MoE layers, default
    all, in policies.fill_order) until full. k: experts per token per layer, which gives the policies that count in
    tokens (policies.TOKEN_CLOCK_POLICIES) their pool's lookups per token (k x the MoE layers, or k per layer), and
    those that cut a layer's uses into tokens (policies.LAYER_POLICIES) k and n_experts."""
    if pool not in POOLS:
        raise PymoeError(f"unknown pool {pool!r} (choose from {', '.join(POOLS)})")
    if policy in PROFILE_POLICIES and profile is None:
        raise PymoeError(f"the {policy} policy needs a profile")
    ranked = profile.keys() if profile is not None else None  # int64 [n_pairs], hottest first
    if pool == "global":
        parts = [(slots, ranked)]
    else:
        parts = [(n, None if ranked is None else ranked[ranked // n_experts == layer])
                 for layer, n in enumerate(split_slots(slots, n_layers))]
    layers = range(n_layers) if layers is None else layers
    per_token = None if k is None else (k * len(layers) if pool == "global" else k)
    tables = []
    for i, (capacity, keys) in enumerate(parts):
        table = SlotTable(capacity, make_policy(policy, capacity, profile_keys=keys, future=future,
                                                lookups_per_token=per_token, n_experts=n_experts, k=k), admission)
        if prefill:
            table.prefill(start_keys(keys, layers if pool == "global" else [i], n_experts))
        tables.append(table)
    return tables


def simulate(keys: np.ndarray, n_layers: int, n_experts: int, policy: str, slots: int, pool: str = "per-layer",
             profile: Optional[Profile] = None, tokens: Optional[int] = None, counted: Optional[np.ndarray] = None,
             future: Optional[NextUse] = None, prefill: bool = True, staged: Optional[np.ndarray] = None,
             admission: Admission = Admission(), steps: Optional[np.ndarray] = None, warm: WarmRule = WarmRule(),
             rows: Optional[np.ndarray] = None, warm_after: Optional[np.ndarray] = None,
             prefetch: Optional[dict] = None, layers: Optional[Sequence[int]] = None,
             k: Optional[int] = None) -> SimResult:
    """Replay the access sequence keys int64 [n] (time order) through `policy` with `slots` slots.

    tokens: how many tokens the counted lookups belong to (for misses per token). counted: bool [n], the lookups
    that count (None: all). future: a NextUse of `keys` to share between runs (belady; built here if None).
    prefill: start with every slot filled as the engine fills its pool: `profile`'s keys (if any), then the experts
    of `layers` (the MoE layers; None: all n_layers) in policies.fill_order; False: start empty.
    staged: bool [n], lookups whose misses do not enter the cache (SlotTable.access(insert=False): the engine's rule
    for prefill lookups); None: every miss may.
    admission: the tables' admission control; steps: int [n], the layer-step of each lookup (its insert cap, and
    its lookup call: a key's first lookup in a step decides how its later ones there count), as the engine's lookup
    calls number them (None: one step for the insert cap, each lookup its own call).
    warm: the warm decode set (policies.WarmSet, as the engine's SlotCache.end_prefill): the staged lookups feed it,
    rows int [n] names each lookup's token (trace row), and after each lookup with warm_after[t] (bool [n]: the
    end of a prompt) the set is placed.
    prefetch: {t: (keys, limit)}: before lookup t (the first of its layer-step), the router lookahead's prefetch of
    `keys` (most wanted first, at most `limit` placed, 0: no limit) into the step steps[t] (prefetch_plan()).
    k: experts per token per layer (make_tables: the lookups per token of the policies that count in tokens).
    """
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)  # [n]
    if keys.size and (keys.min() < 0 or keys.max() >= n_layers * n_experts):
        raise PymoeError(f"key out of range for {n_layers} layers x {n_experts} experts")
    if policy == "belady" and future is None:
        future = NextUse(keys)
    if prefetch and policy == "belady":
        raise PymoeError("belady cannot replay the lookahead's prefetch (its admit needs a lookup position); "
                         "leave it out of --policy")
    tables = make_tables(policy, slots, pool, n_layers, n_experts, profile, future, prefill, admission, layers, k)
    group = n_experts if pool == "per-layer" else n_layers * n_experts  # key // group = the key's table
    access = [table.access for table in tables]
    inserts = itertools.repeat(True) if staged is None else (~np.asarray(staged, dtype=bool)).tolist()
    hit = np.zeros(keys.size, dtype=bool)  # [n]
    step_of = itertools.repeat(None) if steps is None else np.asarray(steps).tolist()
    warm_set = None
    if warm and staged is not None and warm_after is not None:
        if rows is None:
            raise ValueError("simulate: a warm set needs the token row of each lookup (rows)")
        warm_set, row_of = WarmSet(warm, n_experts), np.asarray(rows).tolist()
        ends = set(np.flatnonzero(warm_after).tolist())  # positions after which a prompt has been read
    prefetch = prefetch or {}
    if prefetch and steps is None:
        raise ValueError("simulate: a prefetch replay needs the layer-step of each lookup (steps)")

    def table_of(k: int) -> SlotTable:
        return tables[k // group]

    promoted = np.zeros(keys.size, dtype=bool)  # [n]: a miss that took a slot
    served: dict = {}  # key -> hit, as the first lookup of the current layer-step decided (one path per call)
    placed = np.zeros(keys.size, dtype=np.int64)  # [n]: keys the lookahead placed just before lookup t
    pf_hit = np.zeros(keys.size, dtype=bool)  # [n]: a hit on a key placed for this lookup's layer-step
    for_step: set = set()  # keys placed for the current layer-step (the engine's SlotCache._prefetched[layer])
    prev_step = None
    for t, (key, insert, step) in enumerate(zip(keys.tolist(), inserts, step_of)):
        if step != prev_step or step is None:  # a new layer-step: what was placed for the last one is no longer
            for_step, served, prev_step = set(), {}, step  # counted, and its experts are decided afresh
        if t in prefetch:  # the engine's SlotCache.prefetch for this step, one layer early; the policies the
            want, limit = prefetch[t]  # engine runs ignore the clock's value, so every candidate is asked at t
            for k, _slot, evicted in prefetch_ranked(table_of, want, step, lambda: t, limit):
                for_step.discard(evicted)  # a later candidate evicted an earlier one (SlotCache.prefetch too)
                for_step.add(k)
                placed[t] += 1
        table_hit, slot, _ = access[key // group](key, t, insert, step)
        promoted[t] = slot is not None and not table_hit
        hit[t] = served.setdefault(key, table_hit)  # the engine's rule: the first lookup of a key in a call decides
        pf_hit[t] = hit[t] and key in for_step
        if warm_set is not None:
            if not insert:  # a prefill lookup
                warm_set.see(key, row_of[t], t)
            if t in ends:  # a prompt has been read: the engine's SlotCache.end_prefill()
                warm_set.apply(lambda k: tables[k // group])
    if counted is not None:
        mask = np.asarray(counted, dtype=bool)  # [n]
        hit, placed, pf_hit, promoted = hit[mask], placed[mask], pf_hit[mask], promoted[mask]
    lookups, hits = int(hit.size), int(hit.sum())
    return SimResult(policy=policy, slots=int(slots), coverage=slots / (n_layers * n_experts), pool=pool,
                     lookups=lookups, hits=hits, hit_rate=hits / lookups if lookups else 0.0,
                     misses_per_token=(lookups - hits) / tokens if tokens else float("nan"),
                     prefetched=int(placed.sum()), prefetch_hits=int(pf_hit.sum()), promoted=int(promoted.sum()))


def sweep(trace, policies: Sequence[str], slots_list: Sequence[int], pools: Sequence[str] = POOLS,
          profile: Optional[Profile] = None, phase: Optional[str] = None, progress: bool = False,
          admission: Admission = Admission(), warm: WarmRule = WarmRule(),
          prefetch: bool = False, layers: Optional[Sequence[int]] = None, prefill: bool = True) -> list[SimResult]:
    """simulate() for every pool x policy x slot count on one trace; counts the lookups of `phase` (None: all).
    Without a profile, one is built from the trace (in-sample). admission: as the engine's `--admit` /
    `--max-inserts` (a layer-step is one layer of one forward, as in the engine). warm: as the engine's
    `--warm-set` / `--warm-inserts`, placed at each prompt's end (prompt_ends()). prefetch: replay the router
    lookahead's prefetch requests the trace recorded (prefetch_plan()). layers: the MoE layers, whose experts fill
    the slots the profile leaves (None: every layer of the trace; a trace does not say which layers are dense).
    prefill False: start with empty slots (hand-worked examples; the engine never does)."""
    for name in policies:
        if name not in POLICIES:
            raise PymoeError(f"unknown cache policy {name!r} (choose from {', '.join(POLICIES)})")
    L, E = trace.n_layers, trace.n_experts
    if profile is None:
        profile = Profile.from_trace(trace, phase)
    elif (profile.n_layers, profile.n_experts) != (L, E):
        raise PymoeError(f"profile is for {profile.n_layers} layers x {profile.n_experts} experts, the trace has "
                         f"{L} x {E}")
    keys, row = trace.lookups(order="engine")  # [N * L * K] every lookup, as the engine's cache sees them
    rows = trace.rows(phase)  # [N]
    if not rows.any():
        raise PymoeError(f"the trace has no {phase or ''} tokens".replace("  ", " "))
    counted = rows[row]  # [N * L * K]
    staged = trace.rows("prefill")[row]  # [N * L * K]: prefill misses stay out of the cache, as in the engine
    future = NextUse(keys) if "belady" in policies else None
    from tqdm import tqdm

    runs = [(pool, name, n) for pool in pools for name in policies for n in slots_list]
    bar = tqdm(runs, desc="simulating", unit="run", disable=None if progress else True, leave=False)  # None: TTY only
    steps = trace.forward[row].astype(np.int64) * L + keys // E  # [N * L * K]: (forward, layer) of each lookup
    warm_after = prompt_ends(trace, row) if warm else None  # [N * L * K]
    plan = prefetch_plan(trace, steps) if prefetch else None
    return [simulate(keys, L, E, name, n, pool, profile, tokens=int(rows.sum()), counted=counted, future=future,
                     staged=staged if staged.any() else None, admission=admission, steps=steps, warm=warm, rows=row,
                     warm_after=warm_after, prefetch=plan, layers=layers, prefill=prefill, k=trace.k)
            for pool, name, n in bar]


def prefetch_plan(trace, steps: np.ndarray) -> dict:
    """{t: (keys most wanted first, limit)}: the router lookahead's prefetch requests the trace recorded
    (Trace.predicted), each at the position t of the first lookup of the layer-step it was made for, in the engine
    order sweep() replays (steps int [n]: forward * L + layer of each lookup, non-decreasing)."""
    if trace.predicted is None:
        raise PymoeError("the trace has no lookahead predictions to replay (record it with "
                         "`pymoe run --lookahead N --trace FILE` and a decode phase)")
    L, E = trace.n_layers, trace.n_experts
    first = dict(zip(*(a.tolist() for a in np.unique(steps, return_index=True))))  # step -> its first lookup
    plan = {}
    for f, layer in zip(*np.nonzero(trace.predicted_limit >= 0)):
        want, limit = trace.prefetches(int(f), int(layer))
        t = first.get(int(f) * L + int(layer))
        if t is not None:  # a layer-step with no lookup (not a MoE layer) has nothing to prefetch for
            plan[t] = ([int(layer) * E + e for e in want], limit)
    return plan


def prompt_ends(trace, row: np.ndarray) -> np.ndarray:
    """bool [n]: for the lookups of a trace in engine order (row int [n]: the trace row of each), True at the last
    lookup of each forward that ends a prompt: it holds a request's last prefill row of a run of prefill rows (the
    next row is another request's, or not prefill, or there is none). That is where the engine calls
    SlotCache.end_prefill(): once the whole prompt is read, all layers."""
    pre = trace.rows("prefill")  # [N]
    nxt_pre = np.append(pre[1:], False)  # [N]: is the next row prefill
    same_req = np.append(trace.request[1:] == trace.request[:-1], False)  # [N]: is the next row the same request
    end_row = pre & ~(nxt_pre & same_req)  # [N]: the last row of a prompt
    fwd = trace.forward[row]  # [n]
    last_of_fwd = np.append(fwd[1:] != fwd[:-1], True)  # [n]: the last lookup of its forward
    end_fwd = np.zeros(int(trace.forward.max()) + 1 if trace.n_tokens else 0, dtype=bool)
    end_fwd[trace.forward[end_row]] = True
    return last_of_fwd & end_fwd[fwd]


def grouped(results: Sequence[SimResult]) -> dict[tuple[str, str], list[SimResult]]:
    """{(pool, policy): results sorted by coverage}, in first-seen order."""
    groups: dict[tuple[str, str], list[SimResult]] = {}
    for r in results:
        groups.setdefault((r.pool, r.policy), []).append(r)
    return {g: sorted(rs, key=lambda r: r.slots) for g, rs in groups.items()}


def knee(results: Sequence[SimResult]) -> dict[tuple[str, str], Optional[SimResult]]:
    """{(pool, policy): the result at the knee, or None}: the first coverage from which the next simulated
    coverage adds less than KNEE_POINTS_PER_10 points of hit rate per +10% coverage."""
    knees = {}
    for g, rs in grouped(results).items():
        knees[g] = None
        for a, b in zip(rs, rs[1:]):
            points = 100.0 * (b.hit_rate - a.hit_rate)  # hit-rate points gained from a to b
            tens = 10.0 * (b.coverage - a.coverage)  # coverage added, in units of +10%
            if tens > 0 and points / tens < KNEE_POINTS_PER_10:
                knees[g] = a
                break
    return knees


def format_table(results: Sequence[SimResult]) -> str:
    """One table per pool: rows = slot counts, columns = policies, cells = hit rate % (misses per token)."""
    knees = knee(results)
    groups = grouped(results)
    lines = []
    for pool in dict.fromkeys(r.pool for r in results):
        policies = [p for (pl, p) in groups if pl == pool]
        lines.append(f"pool {pool}: hit rate % (misses per token); * = knee (beyond it +10% coverage adds "
                     f"< {KNEE_POINTS_PER_10:g} point)")
        lines.append(f"{'slots':>7} {'coverage':>8}  " + "  ".join(f"{p:>15}" for p in policies))
        for slots in sorted({r.slots for r in results if r.pool == pool}):
            cells = []
            for p in policies:
                r = next((r for r in groups[pool, p] if r.slots == slots), None)
                mark = "*" if r is not None and knees[pool, p] is r else " "
                cell = "" if r is None else f"{100 * r.hit_rate:.1f} ({r.misses_per_token:.2f})"
                cells.append(f"{cell:>14}{mark}")
            cov = next(r.coverage for r in results if r.pool == pool and r.slots == slots)
            lines.append(f"{slots:>7} {100 * cov:>7.1f}%  " + "  ".join(cells))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or a one-line PymoeError naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PymoeError("--plot needs matplotlib: pip install 'pymoe[plot]'") from None
    return plt


def plot(results: Sequence[SimResult], path, title: str = "expert cache hit rate") -> None:
    """Hit rate against coverage, one line per policy (solid per-layer, dashed global), knees circled and labelled
    (coverage: hit rate)."""
    plt = pyplot()
    knees = knee(results)
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {}
    for (pool, policy), rs in grouped(results).items():
        color = colors.setdefault(policy, f"C{len(colors)}")
        ax.plot([100 * r.coverage for r in rs], [100 * r.hit_rate for r in rs], "-" if pool == "per-layer" else "--",
                marker=".", color=color, label=f"{policy} ({pool})")
        k = knees[pool, policy]
        if k is not None:
            ax.plot([100 * k.coverage], [100 * k.hit_rate], "o", mfc="none", ms=12, color=color)
            ax.annotate(f"knee {100 * k.coverage:.0f}%: {100 * k.hit_rate:.0f}%", (100 * k.coverage, 100 * k.hit_rate),
                        textcoords="offset points", xytext=(8, -14), fontsize=7, color=color)
    ax.set_xlabel("coverage: slots / (layers x experts), %")
    ax.set_ylabel("hit rate, % of lookups")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_numbers(text: str, what: str, kind=float) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise PymoeError(f"--{what}: expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) < 0:
        raise PymoeError(f"--{what}: expected non-negative numbers, got {text!r}")
    return values


def slot_counts(slots: Optional[str], coverage: Optional[str], n_layers: int, n_experts: int) -> list[int]:
    """--slots N,... (totals) or --coverage P,... (percent of the n_layers x n_experts experts; default 10..90)."""
    if slots is not None and coverage is not None:
        raise PymoeError("give --slots or --coverage, not both")
    if slots is not None:
        return parse_numbers(slots, "slots", int)
    pcts = parse_numbers(coverage or "10,20,30,40,50,60,70,80,90", "coverage")
    if max(pcts) > 100:
        raise PymoeError(f"--coverage is in percent (0..100), got {coverage!r}")
    return [slots_for_coverage(c, n_layers, n_experts) for c in pcts]


def report(trace_path, policies: str = ",".join(POLICIES), slots: Optional[str] = None,
           coverage: Optional[str] = None, pool: str = "both", profile_path=None, phase: str = "all",
           plot_path=None, progress: bool = False, admit: str = "all", max_inserts: int = 0, warm_set: int = 0,
           warm_inserts: int = 0, prefetch: bool = False) -> str:
    """What `pymoe simulate` prints: trace summary, where the profile came from, one table per pool."""
    from .trace import Trace

    from .policies import make_admission, make_warm_rule

    admission = make_admission(admit, max_inserts)
    warm = make_warm_rule(warm_set, warm_inserts)
    trace = Trace.load(trace_path)
    slots_list = sorted(set(slot_counts(slots, coverage, trace.n_layers, trace.n_experts)))
    names = [p.strip() for p in policies.split(",") if p.strip()]
    left_out = ""
    if prefetch and "belady" in names:  # it cannot replay a prefetch (simulate()): the others still can
        names.remove("belady")
        left_out = " (belady left out: it cannot replay a prefetch)"
    pools = list(POOLS) if pool == "both" else [pool]
    phase = None if phase == "all" else phase
    if profile_path is not None:
        from .profile import load_profile_source

        profile = load_profile_source(profile_path)
        origin = f"profile: {profile_path} ({profile.n_pairs} ranked pairs)"
    else:
        profile = None
        origin = "profile: in-sample, built from this trace (static is an upper bound; all policies start pre-filled)"
    results = sweep(trace, names, slots_list, pools, profile=profile, phase=phase, progress=progress,
                    admission=admission, warm=warm, prefetch=prefetch)
    n_tok = int(trace.rows(phase).sum())
    head = [f"trace {trace_path}: {trace.summary()}",
            f"counted: {phase or 'all'} lookups ({n_tok} tokens x {trace.n_layers} layers x {trace.k}); {origin}; "
            f"admission: {admission}; warm decode set: {warm}; lookahead prefetch: "
            f"{'replayed' + left_out if prefetch else 'off'}", ""]
    if plot_path is not None:
        plot(results, plot_path, title=f"{trace.meta.get('model', '')} expert cache hit rate")
        head.insert(2, f"plot: {plot_path}")
    text = "\n".join(head) + "\n" + format_table(results)
    if prefetch:
        text += "\nprefetch: keys placed by the replayed lookahead, prefetch hits among the counted hits\n" + "\n".join(
            f"  {r.pool:>9} {r.policy:>10} {r.slots:>6} slots: {r.prefetched} prefetched, {r.prefetch_hits} prefetch "
            f"hits of {r.hits} hits" for r in results) + "\n"
    return text
