"""`pymoe report`: the reference article's analysis of per-request telemetry, redone on pymoe's own telemetry files.

What this is: telemetry files (experts/telemetry.py, `pymoe run/serve --telemetry`) in, the article's tables out,
as Markdown (text only) or HTML, with plots when matplotlib is importable (the `plot` extra):

    rounds               one per file (or per value of --group-by KEY): slots, cache GiB, coverage, free memory at
                         sizing, pooled hit rate and spill share, decode tok/s            (article sections 1.3-3)
    hit-rate buckets     decode tok/s of the requests whose hit rate falls in each bucket          (section 4.2)
    spill-share buckets  the same by the share of lookups read over PCIe; the cliff located: the largest relative
                         drop between neighbouring non-empty buckets; and by miss share (the CPU backend's analogue:
                         there nothing crosses PCIe)                                                 (section 4.1)
    correlation          Pearson and Spearman of hit rate and of spill share against decode tok/s, with n (4.2)
    fit across rounds    round mean decode tok/s = intercept + slope x cache GiB (least squares; with two rounds the
                         line through them), the intercept marked as an extrapolation                (section 6.2)
    efficiency           tok/s per GiB of cache, marginal tok/s per GiB between rounds, joules per token where
                         power was sampled                                                           (section 6)
    concurrency          per round and in-flight level: per-request decode tok/s, TTFT, aggregate throughput
                         (the server's tokens per second while the level's requests were in flight)  (section 9.2)
    overload             requests turned away (429) and outcomes                                    (section 9.3)
    capacity             cache GiB -> slots -> tok/s from the fit, beside `pymoe plan`'s cost model calibrated on
                         the two rounds furthest apart in miss rate (plan.calibrate_two_points)     (section 10.2)

Every number says how many requests (or samples) it comes from. Statistics are NumPy only (no SciPy): `pearson`,
`spearman` (Pearson of average ranks), `linear_fit` (least squares with standard errors when n > 2).
What this is not: a measurement (that is `pymoe run`, `serve`, `bench --protocol article`) or the planner's model
(experts/plan.py, used here as it is).
"""
from __future__ import annotations

import base64
import html as html_lib
import io
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from pymoe.errors import PymoeError
from . import plan as planner
from .telemetry import load

GiB, MiB = 2**30, 2**20
# Bucket edges, in percent. Hit rate: the article's section 4.2 names 90-95% and 95-99%; the rest widen toward 0.
# Spill share: section 4.1's 0, 0.5%, 3% and 5% marks, with 1% between (its cliff is between 0 and 0.5%).
HIT_EDGES = (0.0, 50.0, 80.0, 90.0, 95.0, 99.0, 100.0)
SPILL_EDGES = (0.0, 0.5, 1.0, 3.0, 5.0, 100.0)  # the first bucket is exactly 0; then (a, b]
THIN_BUCKET = 10  # a cliff next to a bucket of fewer requests is flagged: its mean (and spread) rests on a handful


# --- statistics --------------------------------------------------------------------------------------------------
def pearson(x, y) -> Optional[float]:
    """Pearson's r, or None with fewer than 3 points or a constant variable."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.size < 3:
        return None
    dx, dy = x - x.mean(), y - y.mean()
    den = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float(dx @ dy) / den if den > 0 else None


def ranks(a) -> np.ndarray:
    """Ranks 1..n, ties given their average rank (as scipy.stats.rankdata's default)."""
    a = np.asarray(a, float)
    order = np.argsort(a, kind="mergesort")
    r = np.empty(a.size)
    r[order] = np.arange(1, a.size + 1)
    _, inv, counts = np.unique(a, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=r)
    return sums[inv] / counts[inv]


def spearman(x, y) -> Optional[float]:
    """Spearman's rho: Pearson's r of the ranks."""
    return pearson(ranks(x), ranks(y)) if len(x) >= 3 else None


@dataclass(frozen=True)
class Fit:
    """y = intercept + slope * x by least squares; standard errors from the residuals when n > 2 (else None)."""

    slope: float
    intercept: float
    n: int
    slope_se: Optional[float] = None
    intercept_se: Optional[float] = None
    r2: Optional[float] = None

    def __call__(self, x):
        return self.intercept + self.slope * np.asarray(x, float)


def linear_fit(x, y) -> Optional[Fit]:
    """None with fewer than two distinct x."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.size < 2 or np.ptp(x) == 0:
        return None
    xm, ym = x.mean(), y.mean()
    sxx = float(((x - xm) ** 2).sum())
    slope = float(((x - xm) * (y - ym)).sum()) / sxx
    intercept = ym - slope * xm
    if x.size == 2:
        return Fit(slope, intercept, 2)
    resid = y - (intercept + slope * x)
    s2 = float(resid @ resid) / (x.size - 2)
    syy = float(((y - ym) ** 2).sum())
    return Fit(slope, intercept, int(x.size), math.sqrt(s2 / sxx), math.sqrt(s2 * (1 / x.size + xm * xm / sxx)),
               1 - float(resid @ resid) / syy if syy > 0 else None)


# --- the requests, per round -------------------------------------------------------------------------------------
def hit_rate(r: dict) -> Optional[float]:
    """A request's decode hit rate, or None: no slot pool (nothing can hit), or no decode lookups."""
    return r["hits"] / r["lookups"] if r.get("pool") and r.get("slots") and r.get("lookups") else None


def spill_share(r: dict) -> Optional[float]:
    """Share of a request's decode lookups read over PCIe ("spill"), with a slot pool; None without."""
    return r["misses"]["spill"] / r["lookups"] if hit_rate(r) is not None else None


def decoded(r: dict) -> bool:
    return r.get("status") == "ok" and r.get("decoded_tokens", 0) > 0 and r.get("decode_s", 0) > 0


@dataclass
class Round:
    name: str
    requests: list = field(default_factory=list)  # every request line (any status)
    rejected: list = field(default_factory=list)
    samples: list = field(default_factory=list)
    unit: int = GiB  # bytes of the unit cache sizes are shown and fitted in (MiB when every pool is under 1 GiB)

    @property
    def unit_name(self) -> str:
        return "GiB" if self.unit == GiB else "MiB"

    @property
    def cache(self) -> Optional[float]:
        """The round's cache in `unit`s (GiB, or MiB for small pools)."""
        v = self.values("cache_bytes")
        return float(np.mean(v)) / self.unit if v else None

    @property
    def ok(self) -> list:
        return [r for r in self.requests if decoded(r)]

    @property
    def pooled(self) -> list:
        return [r for r in self.ok if hit_rate(r) is not None]

    def values(self, key) -> list:
        return [r.get(key) for r in self.requests if r.get(key) is not None]

    @property
    def cache_gib(self) -> Optional[float]:
        v = self.values("cache_bytes")
        return float(np.mean(v)) / GiB if v else None

    @property
    def tok_s(self) -> Optional[float]:
        """The round's decode tok/s: the mean over its requests (the article's round figures are means)."""
        v = [r["decode_tok_s"] for r in self.ok]
        return float(np.mean(v)) if v else None

    def pooled_rate(self, counter) -> Optional[float]:
        """Σ counter / Σ lookups over the round's pooled requests (each lookup weighs the same)."""
        p = self.pooled
        n = sum(r["lookups"] for r in p)
        return sum(counter(r) for r in p) / n if n else None

    @property
    def hit(self) -> Optional[float]:
        return self.pooled_rate(lambda r: r["hits"])

    @property
    def spill(self) -> Optional[float]:
        return self.pooled_rate(lambda r: r["misses"]["spill"])


def group_rounds(paths: Sequence[str], group_by: str = "file") -> tuple[list, list]:
    """Telemetry files -> (rounds, notes). group_by "file": a round per file; else a round per value of that request
    field (slots, cache_bytes, backend, model, ...); a sample goes with the value of its file's last start line."""
    rounds: dict = {}
    notes = []
    for path in paths:
        t = load(path)
        if t.skipped:
            notes.append(f"{path}: its last line was cut short and is left out")
        current = {}
        for rec in t.lines:
            if rec["kind"] == "start":
                current = rec
                continue
            src = current if rec["kind"] == "sample" else rec
            key = os.path.basename(path) if group_by == "file" else src.get(group_by)
            if group_by != "file" and key is None and rec["kind"] != "sample":
                raise PymoeError(f"{path}: a {rec['kind']} line has no field {group_by!r} to group by")
            rnd = rounds.setdefault(key, Round(str(key) if group_by == "file" else f"{group_by}={key}"))
            {"request": rnd.requests, "rejected": rnd.rejected, "sample": rnd.samples}[rec["kind"]].append(rec)
    if not any(r.requests for r in rounds.values()):
        raise PymoeError(f"no request lines in {', '.join(paths)}: write some with `pymoe run/serve --telemetry FILE`")
    order = sorted(rounds.values(), key=lambda r: (r.cache_gib is None, r.cache_gib or 0.0, r.name))
    unit = GiB if max((r.cache_gib or 0.0) for r in order) >= 1 else MiB
    for r in order:
        r.unit = unit
    return order, notes


# --- the report as blocks (rendered to Markdown or HTML) ---------------------------------------------------------
@dataclass
class Report:
    blocks: list = field(default_factory=list)  # ("title", text) | ("h", text) | ("p", text) | ("table", header, rows)
    figures: dict = field(default_factory=dict)  # numbers the tests read: name -> value

    def h(self, text):
        self.blocks.append(("h", text))

    def p(self, text):
        self.blocks.append(("p", text))

    def table(self, header, rows):
        self.blocks.append(("table", list(header), [[_cell(c) for c in row] for row in rows]))


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def _pct(v, digits=1) -> str:
    return "-" if v is None else f"{100 * v:.{digits}f}%"


def _num(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _gib(v) -> str:
    """A size or a rate per size: two decimals, or four significant digits below 1."""
    return "-" if v is None else f"{v:.2f}" if abs(v) >= 1 else f"{v:.4g}"


def buckets(values, tok_s, edges, zero_bucket=False) -> list:
    """[(label, n, mean tok/s, median tok/s, mean share, standard error of the mean tok/s)] of `tok_s` by `values`
    (shares in [0, 1]) in `edges` (percent); the standard error is None below 2 requests.
    zero_bucket: the first bucket holds exactly 0, the others (a, b]; else [a, b) and the last [a, b]."""
    v, t = np.asarray(values, float) * 100, np.asarray(tok_s, float)
    out = []
    if zero_bucket:
        spans = [(0.0, 0.0, v == 0)] + [(lo, hi, (v > lo) & (v <= hi)) for lo, hi in zip(edges[:-1], edges[1:])]
    else:
        spans = [(lo, hi, (v >= lo) & ((v < hi) if i < len(edges) - 2 else (v <= hi)))
                 for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:]))]
    for i, (lo, hi, m) in enumerate(spans):
        label = "0%" if zero_bucket and i == 0 else (f"{lo:g}-{hi:g}%" if lo or not zero_bucket else f"0-{hi:g}%")
        n = int(m.sum())
        out.append((label, n, float(t[m].mean()) if n else None, float(np.median(t[m])) if n else None,
                    float(v[m].mean()) / 100 if n else None,
                    float(t[m].std(ddof=1) / math.sqrt(n)) if n > 1 else None))
    return out


def drops(rows: list) -> list:
    """Between neighbouring non-empty buckets: [(from row, to row, relative drop of mean tok/s, tok/s lost per
    percentage point of share)], the steepness measured between the buckets' mean shares."""
    full = [r for r in rows if r[1]]
    out = []
    for a, b in zip(full, full[1:]):
        dx = 100 * (b[4] - a[4])
        out.append((a, b, 1 - b[2] / a[2] if a[2] else 0.0, (a[2] - b[2]) / dx if dx > 0 else 0.0))
    return out


def cliff(rows: list) -> Optional[tuple]:
    """The cliff: the steepest fall of tok/s per percentage point of share between neighbouring buckets (the
    article's 4.1: -39% over the first half point of spill is its cliff; a later -48% over several points is its
    "second cliff", less steep) -> a `drops` entry, or None when nothing falls."""
    falling = [d for d in drops(rows) if d[3] > 0]
    return max(falling, key=lambda d: d[3]) if falling else None


def _bucket_section(rep, title, rows, what, key):
    rep.table([what, "requests", "decode tok/s, mean", "± (standard error)", "median", "mean share"],
              [[label, n, mean, se, med, _pct(x, 2)] for label, n, mean, med, x, se in rows])
    c = cliff(rows)
    if c is None:
        rep.p(f"{title}: no fall between neighbouring buckets (fewer than two non-empty buckets, or none falls).")
        return
    a, b, drop, steep = c
    se = math.hypot(a[5], b[5]) if a[5] is not None and b[5] is not None else None
    rep.figures[key] = dict(frm=a[0], to=b[0], drop=drop, per_point=steep, tok_s=(a[2], b[2]), n=(a[1], b[1]), se=se)
    others = [f"{x[0][0]} -> {x[1][0]} {-100 * x[2]:+.1f}%" for x in drops(rows) if x[:2] != c[:2]]
    rep.p(f"**Cliff** ({title}): the steepest fall is {a[0]} -> {b[0]}: {a[2]:.1f} -> {b[2]:.1f} tok/s "
          f"(-{100 * drop:.1f}%, {steep:.1f} tok/s per percentage point; means of {a[1]} and {b[1]} requests; the "
          + (f"fall {a[2] - b[2]:.1f} ± {se:.1f} tok/s, one standard error from the buckets' spreads"
             if se is not None else "fall's standard error needs two requests in each bucket")
          + "). Its position is known to the bucket edges, no finer."
          + (f" A bucket of {min(a[1], b[1])} request(s) is thin: read this as a hint, not a finding."
             if min(a[1], b[1]) < THIN_BUCKET else "")
          + (f" Other steps: {'; '.join(others)}." if others else ""))


def _span(reqs) -> tuple:
    return min(r["t_start"] for r in reqs), max(r["t_end"] for r in reqs)


def energy(rnd: Round) -> Optional[dict]:
    """Joules per generated token over the round's busy span: mean sampled GPU power x span / tokens. None without
    power samples inside the span."""
    ok = rnd.ok
    if not ok:
        return None
    t0, t1 = _span(ok)
    p = [s["gpu_power_w"] for s in rnd.samples if s.get("gpu_power_w") is not None and t0 <= s["time"] <= t1]
    if not p:
        return None
    tokens = sum(r["generated_tokens"] for r in ok)
    util = [s["gpu_util_pct"] for s in rnd.samples if s.get("gpu_util_pct") is not None and t0 <= s["time"] <= t1]
    return dict(power_w=float(np.mean(p)), n_samples=len(p), span_s=t1 - t0, tokens=tokens,
                j_per_token=float(np.mean(p)) * (t1 - t0) / tokens if tokens else None,
                util_pct=float(np.mean(util)) if util else None)


def concurrency_level(r: dict) -> int:
    """A request's load level: its mean in-flight count (else the count at its arrival) to the nearest power of two,
    the levels of a sweep (c = 1, 2, 4, 8, 16, 32), so the ramp-up and tail of each step join their step."""
    c = r.get("concurrency_mean")
    c = max(1.0, c if c is not None else r.get("concurrency_at_start", 1))
    return 2 ** int(round(math.log2(c)))


def union(intervals) -> list:
    """[start, end] intervals -> their union as disjoint sorted intervals."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def busy_seconds(intervals) -> float:
    """The length of the union of [start, end] intervals: the time at least one of them was running."""
    return sum(b - a for a, b in union(intervals))


def tokens_within(requests, spans) -> float:
    """Tokens the requests generated inside `spans` (disjoint intervals), each request's tokens spread evenly over
    its decode phase [t_end - decode_s, t_end] (a one-token request's at t_end)."""
    total = 0.0
    for r in requests:
        d1 = r["t_end"]
        d0 = d1 - r.get("decode_s", 0.0)
        if d1 <= d0:
            total += r["generated_tokens"] * any(a <= d1 <= b for a, b in spans)
            continue
        inside = sum(max(0.0, min(b, d1) - max(a, d0)) for a, b in spans)
        total += r["generated_tokens"] * inside / (d1 - d0)
    return total


# --- the sections ------------------------------------------------------------------------------------------------
def rounds_section(rep: Report, rounds: list):
    rep.h("Rounds: cache size, coverage, hit rate, speed")
    rows = []
    for r in rounds:
        first = r.requests[0]
        free = r.values("free_bytes_at_sizing")
        rows.append([r.name, f"{len(r.ok)} / {len(r.requests)}", first.get("backend"), first.get("slots"),
                     _gib(r.cache), _pct(first.get("coverage")),
                     planner.fmt_size(free[0]) if free else "-", f"{_pct(r.hit)} ({len(r.pooled)})",
                     _pct(r.spill, 2), _num(r.tok_s),
                     _num(float(np.median([x["decode_tok_s"] for x in r.ok])) if r.ok else None),
                     _num(float(np.median([x["prefill_tok_s"] for x in r.ok])) if r.ok else None)])
    rep.table(["round", "requests (ok / all)", "backend", "slots", f"cache {rounds[0].unit_name}", "coverage",
               "free at sizing",
               "hit rate (pooled requests)", "spill share", "decode tok/s mean", "median", "prefill tok/s median"],
              rows)
    rep.p("Hit rate and spill share are pooled over a round's requests with a slot pool (Σ hits / Σ lookups: each "
          "lookup weighs the same); tok/s are over its requests that finished ok and decoded at least one token. "
          "\"free at sizing\" is the device memory `--cache auto` sized the pool from (CUDA only).")
    for r in rounds:  # speculative decoding: pooled acceptance (the article's MTP: 63.5%-64.0% per round)
        spec = [x for x in r.ok if x.get("spec_drafted")]
        if spec:
            drafted, accepted = sum(x["spec_drafted"] for x in spec), sum(x["spec_accepted"] for x in spec)
            rep.figures.setdefault("acceptance", {})[r.name] = accepted / drafted
            rep.p(f"Speculative decoding in {r.name}: {accepted} of {drafted} drafted tokens accepted "
                  f"({_pct(accepted / drafted)}, {len(spec)} requests).")
    if len(rounds) == 2 and all(r.tok_s and r.hit is not None for r in rounds):
        a, b = rounds
        rep.figures["round_ratio"] = b.tok_s / a.tok_s
        miss = [1 - r.hit for r in rounds]
        rep.p(f"Round comparison: {b.name} decodes {b.tok_s / a.tok_s:.2f}x as fast as {a.name} "
              f"({b.tok_s:.1f} vs {a.tok_s:.1f} tok/s, {len(b.ok)} and {len(a.ok)} requests); misses "
              f"{_pct(miss[1])} vs {_pct(miss[0])}"
              + (f" ({miss[0] / miss[1]:.0f}x fewer)" if miss[1] > 0 else "") + ".")


def bucket_sections(rep: Report, rounds: list):
    pooled = [r for rnd in rounds for r in rnd.pooled]
    rep.h("Hit rate -> decode tok/s")
    if not pooled:
        rep.p("No request had a slot pool (no hit rates): run with `--cache-slots N` or `--cache-gib X` "
              "(the CPU backend has no pool by default).")
        return
    hits = [hit_rate(r) for r in pooled]
    spills = [spill_share(r) for r in pooled]
    tok = [r["decode_tok_s"] for r in pooled]
    rep.p(f"{len(pooled)} requests with a slot pool, from {len(rounds)} round(s).")
    rows = buckets(hits, tok, HIT_EDGES)
    rep.figures["hit_buckets"] = rows
    rep.table(["hit rate", "requests", "decode tok/s, mean", "± (standard error)", "median"],
              [[r[0], r[1], r[2], r[5], r[3]] for r in rows])
    rep.h("Spill share -> decode tok/s (the cliff)")
    if any(s > 0 for s in spills):
        rows = buckets(spills, tok, SPILL_EDGES, zero_bucket=True)
        rep.figures["spill_buckets"] = rows
        _bucket_section(rep, "spill share", rows, "spill share", "spill_cliff")
    else:
        rep.p(f"No request read an expert over PCIe (spill share 0 in all {len(pooled)}): on the CPU backend a miss is "
              "computed from host memory, and with pcie_frac 0 none is counted as spill. The table by miss share "
              "below is the analogue.")
    misses = [1 - h for h in hits]
    rep.p("By miss share (1 - hit rate: spill + computed on the CPU):")
    rows = buckets(misses, tok, SPILL_EDGES, zero_bucket=True)
    rep.figures["miss_buckets"] = rows
    _bucket_section(rep, "miss share", rows, "miss share", "miss_cliff")
    rep.h("Correlation")
    rows = []
    for name, xs in (("hit rate", hits), ("spill share", spills), ("miss share", misses)):
        pr, sr = pearson(xs, tok), spearman(xs, tok)
        rep.figures[f"pearson_{name}"], rep.figures[f"spearman_{name}"] = pr, sr
        rows.append([f"{name} vs decode tok/s", len(xs), _num(pr, 3), _num(sr, 3)])
    rep.table(["pair", "n (requests)", "Pearson r", "Spearman rho"], rows)
    rep.p("Correlation, not cause: prompt length, context length and concurrency move both (the article's 10.4). "
          "'-': fewer than 3 requests, or one variable constant.")


def fit_section(rep: Report, rounds: list) -> Optional[Fit]:
    u = rounds[0].unit_name
    rep.h(f"Decode tok/s on cache {u} across rounds (linear fit)")
    pts = [(r.cache, r.tok_s, len(r.ok)) for r in rounds if r.cache is not None and r.tok_s is not None]
    fit = linear_fit([p[0] for p in pts], [p[1] for p in pts])
    if fit is None:
        rep.p(f"Needs rounds at two or more cache sizes; these have {len({p[0] for p in pts})}.")
        return None
    rep.figures["fit"], rep.figures["unit"] = fit, u
    se = lambda v: "" if v is None else f" ± {v:.2f} (standard error)"  # noqa: E731
    lo = min(p[0] for p in pts)
    rep.p(f"From {fit.n} rounds ({sum(p[2] for p in pts)} requests; each round's mean decode tok/s against its cache "
          f"{u}):\n\n- slope: **{_gib(fit.slope)} tok/s per {u}** of cache{se(fit.slope_se)}\n"
          f"- intercept: **{fit.intercept:.1f} tok/s** at 0 {u}{se(fit.intercept_se)}"
          + (" — an extrapolation below the smallest measured cache "
             f"({_gib(lo)} {u}), not a measurement" if lo > 0 else "")
          + ("" if fit.r2 is None else f"\n- R² {fit.r2:.3f}")
          + ("\n\nWith two rounds the line passes through both: nothing tests it being a line." if fit.n == 2 else ""))
    return fit


def efficiency_section(rep: Report, rounds: list):
    u = rounds[0].unit_name
    rep.h(f"Efficiency: per {u}, marginal, per joule")
    rows, prev = [], None
    for r in rounds:
        e = energy(r)
        marg = None
        if prev is not None and r.cache is not None and prev.cache is not None and r.tok_s and prev.tok_s \
                and r.cache != prev.cache:
            marg = (r.tok_s - prev.tok_s) / (r.cache - prev.cache)
        per_gib = r.tok_s / r.cache if r.tok_s and r.cache else None
        rows.append([r.name, _gib(per_gib), _gib(marg),
                     "-" if e is None else f"{e['power_w']:.0f} W ({e['n_samples']} samples)",
                     "-" if e is None or e["util_pct"] is None else f"{e['util_pct']:.1f}%",
                     "-" if e is None or e["j_per_token"] is None else f"{e['j_per_token']:.3f}"])
        if e is not None:
            rep.figures.setdefault("energy", {})[r.name] = e
        if r.cache is not None:
            prev = r
    rep.table(["round", f"tok/s per {u} of cache", f"marginal tok/s per {u} (from the previous round)",
               "GPU power, mean", "GPU utilisation", "J per token"], rows)
    rep.p(f"tok/s per {u} divides by the cache alone (not the dense weights' fixed VRAM: the article's 6.1 shows why "
          "that denominator misleads); J per token = mean sampled power over the round's busy span x the span / the "
          "tokens generated in it ('-': no power samples, e.g. no NVML or no GPU).")
    cpu = [s for r in rounds for s in r.samples if s.get("cpu_pct") is not None]
    if cpu:
        rep.p(f"Process CPU over {len(cpu)} samples: mean {np.mean([s['cpu_pct'] for s in cpu]):.0f}% of one core; "
              f"RSS at most {planner.fmt_size(max(s['rss_bytes'] or 0 for s in cpu))}.")


def concurrency_section(rep: Report, rounds: list):
    rep.h("Concurrency -> throughput and TTFT")
    rows = []
    for rnd in rounds:
        levels = sorted({concurrency_level(r) for r in rnd.ok})
        for c in levels:
            reqs = [r for r in rnd.ok if concurrency_level(r) == c]
            spans = union([(r["t_start"], r["t_end"]) for r in reqs])
            busy = sum(b - a for a, b in spans)
            agg = tokens_within(rnd.ok, spans) / busy if busy > 0 else None
            ttft = [r["ttft_s"] for r in reqs]
            rows.append([rnd.name, c, len(reqs), _num(agg), _num(float(np.mean([r["decode_tok_s"] for r in reqs]))),
                         _num(float(np.percentile(ttft, 50)), 2), _num(float(np.percentile(ttft, 95)), 2)])
            rep.figures.setdefault("concurrency", {})[(rnd.name, c)] = dict(n=len(reqs), aggregate=agg,
                                                                            ttft_p50=float(np.percentile(ttft, 50)))
    rep.table(["round", "in flight (~c)", "requests", "aggregate tok/s",
               "decode tok/s per request", "TTFT p50 s", "TTFT p95 s"], rows)
    rep.p("A request's level c is the mean number of requests in the engine (queued or in a slot, itself included) "
          "over its lifetime, to the nearest power of two. Aggregate throughput is the server's while the level's "
          "requests were in flight: the tokens all requests generated in the union of their lifetimes (each "
          "request's tokens spread evenly over its decode phase) over that time; for a sweep step, its tokens over "
          "its duration. TTFT is the engine's: queue wait + prompt read, without HTTP.")


def overload_section(rep: Report, rounds: list):
    rep.h("Overload: requests turned away")
    rows = []
    for rnd in rounds:
        status = {}
        for r in rnd.requests:
            status[r.get("status", "ok")] = status.get(r.get("status", "ok"), 0) + 1
        mq = {x.get("max_queue") for x in rnd.rejected}
        rows.append([rnd.name, len(rnd.requests) + len(rnd.rejected), len(rnd.rejected),
                     ", ".join(f"{k} {v}" for k, v in sorted(status.items())), ", ".join(map(str, sorted(mq))) or "-"])
    rep.figures["rejected"] = {rnd.name: len(rnd.rejected) for rnd in rounds}
    rep.table(["round", "requests offered", "rejected (429)", "answered, by outcome", "--max-queue"], rows)


def capacity_section(rep: Report, rounds: list, fit: Optional[Fit], device_bw_gbs: float):
    unit, u = rounds[0].unit, rounds[0].unit_name
    rep.h(f"Capacity: cache {u} -> slots -> decode tok/s")
    if fit is None:
        rep.p("Needs the fit above (rounds at two or more cache sizes).")
        return
    first = rounds[0].requests[0]
    slot_bytes, n_total = first.get("slot_bytes"), first.get("experts")
    lookups_per_token = first.get("n_moe_layers", 0) * first.get("k", 0)
    pts = sorted((r.cache, r.hit, r.tok_s) for r in rounds if r.cache is not None and r.tok_s is not None)
    measured = [p for p in pts if p[1] is not None]
    cost, why = None, "it needs two rounds with a slot pool and different miss rates"
    if len(measured) >= 2 and slot_bytes and lookups_per_token:
        a, b = max(measured, key=lambda p: 1 - p[1]), min(measured, key=lambda p: 1 - p[1])
        try:
            cost = planner.calibrate_two_points((1 - a[1], a[2]), (1 - b[1], b[2]), lookups_per_token, slot_bytes,
                                                device_bw_gbs * planner.GB)
        except PymoeError as e:  # e.g. the rounds with more misses were faster: no PCIe cost to fit
            why = str(e)
    full = n_total * slot_bytes / unit if slot_bytes and n_total else None
    lo, hi = pts[0][0], pts[-1][0]
    # the device memory kept beside the cache when --cache auto sized it: free at sizing - cache, over the requests
    # that know it (CUDA); the article's 700 MiB + 184 MiB
    reserve = [r["free_bytes_at_sizing"] - r["cache_bytes"] for rnd in rounds for r in rnd.requests
               if r.get("free_bytes_at_sizing") is not None and r.get("cache_bytes") is not None]
    reserve = float(np.mean(reserve)) if reserve else None
    same = lambda a, b: abs(a - b) <= 1e-6 * max(abs(a), abs(b))  # noqa: E731  (sizes from float arithmetic)
    sizes = [p[0] for p in pts]  # the measured rounds, then full coverage and a step toward it (or past the last)
    for extra in ([full] + ([(hi + full) / 2] if hi < full else [])) if full else [1.5 * hi, 2 * hi]:
        if not any(same(extra, x) for x in sizes):
            sizes.append(extra)
    sizes.sort()
    cov_pts = [(0.0, 0.0)] + [(p[0] / full, p[1]) for p in measured] + [(1.0, 1.0)] if full else []
    rows = []
    for gib in sizes:
        slots = int(gib * unit // slot_bytes) if slot_bytes else None
        cov = min(1.0, gib / full) if full else None
        where = "measured" if any(same(gib, p[0]) for p in pts) else (
            "interpolated" if lo <= gib <= hi else "extrapolated")
        hit = next((p[1] for p in measured if same(gib, p[0])), None)
        hit_note = ""
        if hit is None and cov_pts:
            xs, ys = zip(*sorted(cov_pts))
            hit, hit_note = float(np.interp(cov, xs, ys)), " (interp.)"
        plan_tok = None
        if cost is not None and hit is not None:  # plan.py's own cost model (its dense term inside `fixed`)
            facts = planner.ModelFacts("telemetry", first["n_layers"], first["n_expert"], first["k"], slot_bytes,
                                       n_dense=first["n_layers"] - first["n_moe_layers"])
            model = planner.CostModel(device_bw_gbs * planner.GB, cost[1], cost[0])
            plan_tok = planner.decode_time_per_token(hit, facts, model).tok_s
        free = "-" if reserve is None else planner.fmt_size(gib * unit + reserve)
        rows.append([_gib(gib), free, slots, _pct(cov), f"{_pct(hit)}{hit_note}", _num(float(fit(gib))),
                     _num(plan_tok), where])
        rep.figures.setdefault("capacity", []).append(dict(gib=gib, slots=slots, fit=float(fit(gib)),
                                                           plan=plan_tok, where=where,
                                                           free=None if reserve is None else gib * unit + reserve))
    rep.table([f"cache {u}", "free memory needed at sizing", "slots", "coverage", "hit rate", "tok/s, linear fit",
               "tok/s, plan's cost model",
               "row"], rows)
    note = ("The fit's column is the line above: past the measured range it is an extrapolation, and past 100% "
            "coverage more VRAM buys nothing it can see. ")
    if reserve is not None:
        note += (f"Free memory needed = cache + {planner.fmt_size(reserve)}, what the measured rounds kept beside "
                 "their caches when `--cache auto` sized them (free at sizing - cache); add the model's dense "
                 "weights, KV cache and runtime for a card size (`pymoe plan`). ")
    if cost is not None:
        fixed, pcie = cost
        rep.figures["calibration"] = dict(fixed_ms=fixed * 1e3, pcie_gbs=pcie / planner.GB)
        note += (f"The cost model is `pymoe plan`'s (experts/plan.py), calibrated on the two rounds furthest apart in "
                 f"miss rate (plan.calibrate_two_points, device bandwidth {device_bw_gbs:g} GB/s): fixed "
                 f"{fixed * 1e3:.2f} ms per token, effective miss bandwidth {pcie / planner.GB:.1f} GB/s; unmeasured "
                 "rows take a hit rate interpolated over (coverage, hit rate) between the measured rounds, (0, 0) and "
                 "(100%, 100%). It is linear in misses, so it has no cliff.")
    else:
        note += f"No cost model column: {why}."
    rep.p(note)


# --- plots -------------------------------------------------------------------------------------------------------
def plots(rounds: list, fit: Optional[Fit]) -> list:
    """[(png bytes, caption)]: tok/s against hit rate per request, the fit across rounds, concurrency. [] without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []

    def save(fig, caption):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        out.append((buf.getvalue(), caption))

    pooled = [(rnd.name, r) for rnd in rounds for r in rnd.pooled]
    if pooled:
        fig, ax = plt.subplots(figsize=(6, 4))
        for rnd in rounds:
            xs = [100 * hit_rate(r) for r in rnd.pooled]
            ax.scatter(xs, [r["decode_tok_s"] for r in rnd.pooled], s=10, label=rnd.name)
        ax.set_xlabel("decode hit rate, %")
        ax.set_ylabel("decode tok/s")
        ax.legend(fontsize=7)
        save(fig, f"decode tok/s against hit rate, {len(pooled)} requests")
    pts = [(r.cache, r.tok_s) for r in rounds if r.cache is not None and r.tok_s is not None]
    u = rounds[0].unit_name
    if fit is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = np.linspace(0, max(p[0] for p in pts) * 1.2, 50)
        ax.plot(xs, fit(xs), "--", label=f"{fit.intercept:.1f} + {fit.slope:.2f} x {u}")
        ax.scatter(*zip(*pts), color="k", zorder=3, label="round means")
        ax.set_xlabel(f"expert cache, {u}")
        ax.set_ylabel("decode tok/s")
        ax.legend(fontsize=7)
        save(fig, f"round mean decode tok/s against cache {u}, {len(pts)} rounds")
    return out


# --- rendering ---------------------------------------------------------------------------------------------------
def to_markdown(rep: Report, images: Sequence[tuple] = ()) -> str:
    """images: [(relative path, caption)] placed at the end."""
    out = []
    for b in rep.blocks:
        if b[0] == "title":
            out.append(f"# {b[1]}\n")
        elif b[0] == "h":
            out.append(f"## {b[1]}\n")
        elif b[0] == "p":
            out.append(b[1] + "\n")
        else:
            _, header, rows = b
            out.append("| " + " | ".join(header) + " |")
            out.append("| " + " | ".join("---" for _ in header) + " |")
            out += ["| " + " | ".join(row) + " |" for row in rows]
            out.append("")
    for path, caption in images:
        out.append(f"![{caption}]({path})\n")
    return "\n".join(out)


def to_html(rep: Report, pngs: Sequence[tuple] = ()) -> str:
    esc = html_lib.escape
    out = ["<!doctype html><meta charset='utf-8'><title>pymoe report</title>",
           "<style>body{font-family:sans-serif;max-width:70em;margin:auto}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}</style>"]
    for b in rep.blocks:
        if b[0] == "title":
            out.append(f"<h1>{esc(b[1])}</h1>")
        elif b[0] == "h":
            out.append(f"<h2>{esc(b[1])}</h2>")
        elif b[0] == "p":
            out.append("<p>" + esc(b[1]).replace("\n\n", "</p><p>").replace("\n- ", "<br>• ")
                       .replace("**", "") + "</p>")
        else:
            _, header, rows = b
            out.append("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
                       + "</table>")
    for png, caption in pngs:
        out.append(f"<figure><img src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
                   f"<figcaption>{esc(caption)}</figcaption></figure>")
    return "\n".join(out) + "\n"


def build(paths: Sequence[str], group_by: str = "file", device_bw_gbs: float = planner.DEFAULT_DEVICE_BW_GBS
          ) -> tuple[Report, list, Optional[Fit]]:
    """Telemetry files -> (the report's blocks and figures, the rounds, the fit)."""
    rounds, notes = group_rounds(paths, group_by)
    rep = Report()
    n_req = sum(len(r.requests) for r in rounds)
    rep.blocks.append(("title", "pymoe report"))
    rep.p(f"{n_req} requests in {len(rounds)} round(s) from {len(paths)} telemetry file(s) "
          f"({', '.join(os.path.basename(p) for p in paths)}), rounds by {group_by}."
          + "".join(f"\n\nNote: {n}" for n in notes))
    rounds_section(rep, rounds)
    bucket_sections(rep, rounds)
    fit = fit_section(rep, rounds)
    efficiency_section(rep, rounds)
    concurrency_section(rep, rounds)
    overload_section(rep, rounds)
    capacity_section(rep, rounds, fit, device_bw_gbs)
    return rep, rounds, fit


def report(paths: Sequence[str], out: Optional[str] = None, group_by: str = "file",
           device_bw_gbs: float = planner.DEFAULT_DEVICE_BW_GBS) -> str:
    """`pymoe report`: -> the Markdown text (when `out` is None or .md) or a line saying what was written."""
    if out is not None and not out.endswith((".md", ".html", ".htm")):
        raise PymoeError(f"-o {out}: give a .md or .html file")
    rep, rounds, fit = build(paths, group_by, device_bw_gbs)
    figs = plots(rounds, fit) if out is not None else []
    if out is None:
        return to_markdown(rep)
    if out.endswith((".html", ".htm")):
        text = to_html(rep, figs)
    else:
        stem, images = os.path.splitext(out)[0], []
        for i, (png, caption) in enumerate(figs):
            path = f"{stem}-{i + 1}.png"
            with open(path, "wb") as f:
                f.write(png)
            images.append((os.path.basename(path), caption))
        text = to_markdown(rep, images)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return f"report: wrote {out}" + (f" and {len(figs)} plot(s)" if figs else " (no plots: matplotlib is not "
                                     "installed, or there was nothing to plot)")
