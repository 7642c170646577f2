"""`pymoe report` and the telemetry it reads (pymoe/experts/report.py, pymoe/experts/telemetry.py).

(a) synthetic telemetry from a known model (slope, intercept, cliff position, Gaussian noise) -> the report gives
    them back within bounds derived from the noise (each test says how);
(b) the reference article's published figures as telemetry (tests/article_telemetry.py) -> the report's slope,
    intercept, round comparison, cliff, concurrency sweep and calibration equal the article's (and
    docs/planning.md's) figures at their printed precision;
(c) end to end: `pymoe run --telemetry` on the demo model writes a line `pymoe report` reads; the server's
    scheduler writes request and 429 lines.
Plus the statistics against hand-computed values and the loader's one-line errors.
"""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

import article_telemetry as article
from conftest import run_pymoe_here
from pymoe.errors import PymoeError
from pymoe.experts import report as rp
from pymoe.experts import telemetry as tm


# --- statistics -------------------------------------------------------------------------------------------------
def test_pearson_spearman_and_fit_against_hand_values():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=50), rng.normal(size=50)
    assert rp.pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-12)
    # ties get their average rank: x ranks [1, 2.5, 2.5, 4], y ranks [1, 3, 2, 4] -> r = 4.5 / sqrt(4.5 * 5)
    assert rp.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(22.5), abs=1e-12)
    assert rp.spearman([1, 2, 3, 4], [1, 8, 27, 1000]) == pytest.approx(1.0)  # monotone, not linear
    assert rp.pearson([1, 2], [3, 4]) is None and rp.pearson([1, 1, 1], [1, 2, 3]) is None
    # by hand: x̄ 1.5, ȳ 4.125, Sxy 10.75, Sxx 5 -> slope 2.15, intercept 4.125 - 2.15 x 1.5 = 0.9
    fit = rp.linear_fit([0, 1, 2, 3], [1, 3, 5, 7.5])
    assert (fit.slope, fit.intercept) == pytest.approx((2.15, 0.9))
    assert rp.linear_fit([2, 2], [1, 3]) is None


# --- (a) synthetic telemetry from a known model -------------------------------------------------------------------
def synthetic(path, cache_gib, tok_s, spill=None, hit=0.9, slots=100):
    """One file of requests: cache_gib, tok_s, spill per request (arrays); the demo-sized model facts."""
    lookups = 16000
    with open(path, "w") as f:
        for i, (g, t) in enumerate(zip(cache_gib, tok_s)):
            s = 0.0 if spill is None else spill[i]
            h = 1 - s if spill is not None else hit
            rec = article.request(slots, g, h, s, float(t), t_start=1e9 + i)
            rec.update(lookups=lookups, hits=round(h * lookups),
                       misses=dict(spill=round(s * lookups), cpu=lookups - round(h * lookups) - round(s * lookups),
                                   host=0))
            f.write(json.dumps(rec) + "\n")
    return str(path)


def test_synthetic_slope_and_intercept_come_back_within_four_standard_errors(tmp_path):
    """tok/s = 50 + 6 x GiB + N(0, 10²), 40 requests at each of 2, 4, 8, 12 GiB, a file per round. The fit runs on
    round means, each with standard error sigma/sqrt(40), so the slope's standard error is
    (sigma/sqrt(n)) / sqrt(Σ(x - x̄)²) = 0.206 and the intercept's (sigma/sqrt(n)) sqrt(1/R + x̄²/Σ(x - x̄)²)
    = 1.55;
    the bounds are 4 of them (a 6e-5 chance of failing by noise, and the seed is fixed)."""
    a, b, sigma, n, xs = 50.0, 6.0, 10.0, 40, np.array([2.0, 4.0, 8.0, 12.0])
    rng = np.random.default_rng(1)
    paths = [synthetic(tmp_path / f"r{x:g}.jsonl", [x] * n, a + b * x + rng.normal(0, sigma, n)) for x in xs]
    rep, rounds, fit = rp.build(paths)
    sxx = float(((xs - xs.mean()) ** 2).sum())
    se_slope = sigma / math.sqrt(n) / math.sqrt(sxx)
    se_icpt = sigma / math.sqrt(n) * math.sqrt(1 / len(xs) + xs.mean() ** 2 / sxx)
    assert abs(fit.slope - b) < 4 * se_slope, (fit.slope, se_slope)
    assert abs(fit.intercept - a) < 4 * se_icpt, (fit.intercept, se_icpt)
    assert [r.cache_gib for r in rounds] == pytest.approx(list(xs), abs=1e-9)  # rounds ordered by cache size
    text = rp.to_markdown(rep)
    assert f"{fit.slope:.2f} tok/s per GiB" in text and "an extrapolation below the smallest measured cache" in text
    # the fit must move with the data: the same requests with the slope doubled
    rng = np.random.default_rng(1)
    paths = [synthetic(tmp_path / f"s{x:g}.jsonl", [x] * n, a + 2 * b * x + rng.normal(0, sigma, n)) for x in xs]
    assert abs(rp.build(paths)[2].slope - 2 * b) < 4 * se_slope


def test_synthetic_cliff_is_located_at_its_bucket_edge_and_its_depth_recovered(tmp_path):
    """tok/s = 200 for spill share <= 1%, 120 above, + N(0, 10²); 400 requests with spill uniform in (0, 4%]. The
    cliff sits on the 1% bucket edge, so the report must name the buckets either side of it (its resolution is the
    bucket edges). Depth 1 - 120/200 = 40%; its standard error, from the two buckets' means (delta method), is
    (m2/m1) sqrt((sigma/m1)²/n1 + (sigma/m2)²/n2) with the counts the report shows; the bound is 4 of them."""
    rng = np.random.default_rng(2)
    n, sigma = 400, 10.0
    spill = rng.uniform(0, 0.04, n)
    spill[spill == 0] = 1e-6
    tok = np.where(spill <= 0.01, 200.0, 120.0) + rng.normal(0, sigma, n)
    rep, _, _ = rp.build([synthetic(tmp_path / "cliff.jsonl", [4.0] * n, tok, spill=spill)])
    c = rep.figures["spill_cliff"]
    assert (c["frm"], c["to"]) == ("0.5-1%", "1-3%"), c
    n1, n2 = c["n"]
    se = (120 / 200) * math.sqrt((sigma / 200) ** 2 / n1 + (sigma / 120) ** 2 / n2)
    assert abs(c["drop"] - 0.4) < 4 * se, (c["drop"], se)
    # the report's own standard error of the fall, from the buckets' spreads, against sigma sqrt(1/n1 + 1/n2): a
    # standard deviation from n draws is off by about 1/sqrt(2(n - 1)) of itself, 10% for the smaller bucket
    # (n1 ~ 400 x 0.5/4 = 50, which dominates the sum); the bound is 4 of those
    assert n1 >= 30 and c["se"] == pytest.approx(sigma * math.sqrt(1 / n1 + 1 / n2), rel=4 / math.sqrt(2 * (n1 - 1)))
    # with the cliff moved to 3% the report moves with it
    tok = np.where(spill <= 0.03, 200.0, 120.0) + rng.normal(0, sigma, n)
    rep, _, _ = rp.build([synthetic(tmp_path / "cliff3.jsonl", [4.0] * n, tok, spill=spill)])
    assert (rep.figures["spill_cliff"]["frm"], rep.figures["spill_cliff"]["to"]) == ("1-3%", "3-5%")


def test_synthetic_correlation_matches_numpy_and_is_counted(tmp_path):
    rng = np.random.default_rng(3)
    spill = rng.uniform(0.001, 0.05, 60)
    tok = 200 - 2000 * spill + rng.normal(0, 5, 60)
    rep, _, _ = rp.build([synthetic(tmp_path / "c.jsonl", [1.0] * 60, tok, spill=spill)])
    hit = 1 - np.round(spill * 16000) / 16000  # the hit rate the lines carry (counts are integers)
    assert rep.figures["pearson_hit rate"] == pytest.approx(np.corrcoef(hit, tok)[0, 1], abs=1e-9)
    assert "| hit rate vs decode tok/s | 60 |" in rp.to_markdown(rep)


# --- (b) the article's own figures ------------------------------------------------------------------------------
def test_article_rounds_give_its_slope_intercept_and_round_comparison(tmp_path):
    """Section 6.2: slope (256.2 - 140.6) / (25.14 - 7.45) = 6.53 tok/s per GiB, intercept 91.9 (an
    extrapolation); sections 3 and 4.3: +82% decode, misses 13.5% vs 0.3% (45x); coverage 23.5% and 79.5%."""
    rep, rounds, fit = rp.build(article.rounds(tmp_path))
    assert round(fit.slope, 2) == 6.53 and round(fit.intercept, 1) == 91.9
    assert round(rep.figures["round_ratio"] - 1, 2) == 0.82
    text = rp.to_markdown(rep)
    assert "misses 0.3% vs 13.5% (45x fewer)" in text, text
    assert "| 23.5% |" in text and "| 79.5% |" in text and "8.31 GiB" in text and "26.01 GiB" in text
    assert "With two rounds the line passes through both" in text


def test_article_rounds_calibrate_plans_cost_model_as_planning_md_does(tmp_path):
    """docs/planning.md section 5: the two rounds calibrate the cost model to fixed 3.46 ms, 26.9 GB/s, and its
    ceiling at full coverage is 261.1 tok/s; the article's line there is 92 + 6.53 x 31.63 GiB."""
    rep, _, fit = rp.build(article.rounds(tmp_path))
    cal = rep.figures["calibration"]
    assert round(cal["fixed_ms"], 2) == 3.46 and round(cal["pcie_gbs"], 1) == 26.9
    full = [row for row in rep.figures["capacity"] if row["where"] == "extrapolated"][-1]
    assert round(full["gib"], 2) == 31.63 and round(full["plan"], 1) == 261.1
    assert full["fit"] == pytest.approx(fit.intercept + fit.slope * full["gib"])
    assert abs(full["fit"] - (92 + 6.53 * 31.63)) < 0.2  # planning.md rounds the slope and intercept it uses
    # kept beside the cache: (8.31 - 7.45 + 26.01 - 25.14) / 2 = 0.865 GiB (the article's 700 + 184 MiB = 0.863);
    # full coverage then needs 31.632 + 0.865 = 32.50 GiB free
    assert round(full["free"] / 2**30, 2) == 32.50


def test_article_buckets_and_cliff(tmp_path):
    """Section 4.1: 0% spill 231.8 tok/s -> (0, 0.5%] 141.4 is the cliff (-39%); 4.2: 90-95% hits 143, 95-99% 280."""
    spill = article.write(tmp_path / "spill.jsonl", [article.request(19530, 25.14, 1 - s, s, t)
                                                      for s, t in article.SPILL_BUCKETS])
    rep, _, _ = rp.build([spill])
    means = {label: mean for label, n, mean, *_ in rep.figures["spill_buckets"] if n}
    assert means == {"0%": 231.8, "0-0.5%": 141.4, "1-3%": 137.7, "5-100%": 72.0}
    c = rep.figures["spill_cliff"]
    assert (c["frm"], c["to"]) == ("0%", "0-0.5%") and round(100 * c["drop"]) == 39
    hits = article.write(tmp_path / "hits.jsonl", [article.request(5784, 7.45, h, 0.0, t)
                                                   for h, t in article.HIT_BUCKETS])
    rep, _, _ = rp.build([hits])
    means = {label: mean for label, n, mean, *_ in rep.figures["hit_buckets"] if n}
    assert means == {"90-95%": 143.0, "95-99%": 280.0}


def test_article_concurrency_sweep(tmp_path):
    """Section 9.2: c = 1, 2, 4, 8, 16 -> 192, 220, 216, 213, 209 tok/s; TTFT 0.16, 0.80, 1.94, 3.54, 7.28 s."""
    rep, _, _ = rp.build([article.sweep(tmp_path)])
    got = {c: (round(v["aggregate"]), round(v["ttft_p50"], 2)) for (_, c), v in rep.figures["concurrency"].items()}
    assert got == {c: (thr, ttft) for c, (thr, ttft) in article.SWEEP.items()}


# --- the file format --------------------------------------------------------------------------------------------
def test_loader_reads_older_versions_and_refuses_newer_ones_in_one_line(tmp_path, monkeypatch):
    rec = article.request(1, 1.0, 0.9, 0.0, 100.0)
    path = article.write(tmp_path / "t.jsonl", [rec, {**rec, "version": 99}])
    with pytest.raises(PymoeError, match=r"t.jsonl:2: telemetry version 99 is newer"):
        tm.load(path)
    # an older version is upgraded step by step (UPGRADES): pretend the current one is 2
    monkeypatch.setattr(tm, "VERSION", 2)
    monkeypatch.setitem(tm.UPGRADES, 1, lambda r: {**r, "upgraded": True})
    t = tm.load(article.write(tmp_path / "old.jsonl", [rec]))
    assert t.requests[0]["upgraded"] and t.requests[0]["version"] == 2


def test_loader_skips_only_a_cut_last_line(tmp_path):
    line = json.dumps(article.request(1, 1.0, 0.9, 0.0, 100.0))
    (tmp_path / "cut.jsonl").write_text(line + "\n" + line[:40])
    assert tm.load(str(tmp_path / "cut.jsonl")).skipped == 1
    (tmp_path / "bad.jsonl").write_text(line[:40] + "\n" + line + "\n")
    with pytest.raises(PymoeError, match="bad.jsonl:1: not a JSON line"):
        tm.load(str(tmp_path / "bad.jsonl"))
    (tmp_path / "other.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(PymoeError, match="not a pymoe-telemetry line"):
        tm.load(str(tmp_path / "other.jsonl"))


def test_energy_per_token_from_power_samples(tmp_path):
    """300 W sampled over a 10 s busy span in which 1000 tokens were generated: 3 J per token."""
    reqs = [article.request(1, 1.0, 0.9, 0.0, 100.0, t_start=1e9 + 5 * i, life_s=5.0) for i in range(2)]
    for r in reqs:
        r["generated_tokens"] = 500
    samples = [dict(format=tm.FORMAT, version=tm.VERSION, kind="sample", time=1e9 + t, gpu_power_w=300.0,
                    gpu_util_pct=90.0, cpu_pct=100.0, rss_bytes=1) for t in (1, 4, 8)]
    samples.append({**samples[0], "time": 1e9 + 60, "gpu_power_w": 50.0})  # idle, after the span: left out
    rep, _, _ = rp.build([article.write(tmp_path / "e.jsonl", reqs + samples)])
    e = rep.figures["energy"]["e.jsonl"]
    assert e["n_samples"] == 3 and e["j_per_token"] == pytest.approx(3.0)


# --- (c) end to end ---------------------------------------------------------------------------------------------
def test_pymoe_run_telemetry_on_the_demo_model_and_report_it(tmp_path):
    path = str(tmp_path / "run.jsonl")
    r = run_pymoe_here("run", "-n", "6", "--cache-slots", "40", "--telemetry", path, "--telemetry-interval", "0")
    assert r.returncode == 0, r.stderr
    t = tm.load(path)
    assert len(t.starts) == 1 and len(t.requests) == 1
    q = t.requests[0]
    per_token = q["n_moe_layers"] * q["k"]
    assert q["model"] == "demo-moe.gguf" and q["slots"] == 40 and q["source"] == "run" and q["status"] == "ok"
    assert q["lookups"] == q["decoded_tokens"] * per_token and q["lookups"] > 0  # decode lookups: k per MoE layer
    assert q["hits"] + sum(q["misses"].values()) == q["lookups"]
    assert q["decode_tok_s"] == pytest.approx(q["decoded_tokens"] / q["decode_s"], rel=1e-3)
    assert f"decode expert cache hit rate: {100 * q['hits'] / q['lookups']:.1f}%" in r.stderr  # the log line agrees
    out = str(tmp_path / "report.md")
    r = run_pymoe_here("report", path, "-o", out)
    assert r.returncode == 0, r.stderr
    text = open(out).read()
    assert "| run.jsonl | 1 / 1 | cpu | 40 |" in text
    r = run_pymoe_here("report", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and r.stderr.startswith("pymoe: error:") and len(r.stderr.strip().splitlines()) == 1


def test_the_scheduler_writes_request_and_rejected_lines(tiny_model, tmp_path):
    import pymoe
    from pymoe.engine.sampler import SamplingParams
    from pymoe.serve.scheduler import Job, QueueFull, Scheduler

    engine = pymoe.load(tiny_model("qwen3moe", "f32"), n_ctx=256, cache_slots=8)
    path = str(tmp_path / "serve.jsonl")
    writer = tm.TelemetryWriter(path, tm.engine_facts(engine, "serve"), interval=0.05)

    def job(n):
        return Job(prompt_ids=[1, 2, 3], max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True)

    with Scheduler(engine, parallel=1, max_queue=1, kv="f32", telemetry=writer) as sched:
        first = sched.submit(job(60))
        deadline = time.monotonic() + 30
        while not sched.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        second = sched.submit(job(5))
        with pytest.raises(QueueFull):
            sched.submit(job(5))
        for j in (first, second):
            assert list(j.events(timeout=60))[-1] == ("done", "length")
    writer.close()
    t = tm.load(path)
    assert len(t.requests) == 2 and len(t.rejected) == 1 and t.rejected[0]["max_queue"] == 1
    a, b = sorted(t.requests, key=lambda r: r["t_start"])
    assert (a["concurrency_at_start"], b["concurrency_at_start"]) == (1, 2)
    assert 1.0 <= b["concurrency_mean"] <= 2.0 and b["queue_s"] > 0 and b["ttft_s"] >= b["queue_s"]
    assert a["generated_tokens"] == 60 and b["generated_tokens"] == 5 and a["slots"] == 8
    assert all(r["hits"] + sum(r["misses"].values()) == r["lookups"] > 0 for r in (a, b))
    assert t.samples and all(s["rss_bytes"] > 0 for s in t.samples)


def test_outputs_with_and_without_matplotlib_and_group_by(tmp_path, monkeypatch):
    """-o .html puts the plots inside, -o .md beside it; without matplotlib the report is text only; --group-by
    slots makes a round per slot count out of one file."""
    pytest.importorskip("matplotlib")
    paths = article.rounds(tmp_path)
    assert rp.report(paths, out=str(tmp_path / "r.html")).endswith("and 2 plot(s)")
    page = (tmp_path / "r.html").read_text()
    assert page.count("data:image/png;base64,") == 2 and "<h1>pymoe report</h1>" in page
    rp.report(paths, out=str(tmp_path / "r.md"))
    assert (tmp_path / "r-1.png").exists() and "![" in (tmp_path / "r.md").read_text()
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    line = rp.report(paths, out=str(tmp_path / "t.md"))
    assert "no plots" in line and "![" not in (tmp_path / "t.md").read_text()
    both = article.write(tmp_path / "both.jsonl", [json.loads(open(p).read()) for p in paths])
    rep, rounds, fit = rp.build([both], group_by="slots")
    assert [r.name for r in rounds] == ["slots=5784", "slots=19530"] and round(fit.slope, 2) == 6.53
    with pytest.raises(PymoeError, match="no field 'nope'"):
        rp.build([both], group_by="nope")
    with pytest.raises(PymoeError, match="give a .md or .html file"):
        rp.report(paths, out=str(tmp_path / "r.txt"))


def test_busy_seconds_and_concurrency_levels():
    assert rp.busy_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)  # [0, 3] and [5, 6]
    levels = [rp.concurrency_level({"concurrency_mean": c}) for c in (0.4, 1.4, 1.5, 2.9, 3.0, 11.0, 12.0, 17.0)]
    assert levels == [1, 1, 2, 4, 4, 8, 16, 16]  # nearest power of two in log scale: the split is at c·√2


def test_tokens_within_spreads_a_request_over_its_decode_phase():
    r = {"t_end": 10.0, "decode_s": 4.0, "generated_tokens": 100}  # decodes over [6, 10]
    assert rp.tokens_within([r], [[0.0, 7.0]]) == pytest.approx(25.0)
    assert rp.tokens_within([r], [[0.0, 7.0], [9.0, 20.0]]) == pytest.approx(50.0)
    assert rp.tokens_within([{**r, "decode_s": 0.0}], [[9.0, 10.0]]) == 100
    assert rp.union([(0, 2), (1, 3), (5, 6)]) == [[0, 3], [5, 6]]


def test_bench_protocol_article_end_to_end(tiny_model, tmp_path):
    """`pymoe bench --protocol article` on a tiny model, scaled down: a server per pool, its telemetry (every request
    the client sent, the 429s of the overload), and report.md over them."""
    model = tiny_model("qwen3moe", "f32")
    out = tmp_path / "art"
    r = run_pymoe_here("bench", model, "--protocol", "article", "--pools", "50,100", "--gen", "4", "--requests", "1",
                       "--concurrency", "1,2", "--overload", "4", "--max-queue", "1", "--out-dir", str(out))
    assert r.returncode == 0, r.stderr + r.stdout
    files = sorted(out.glob("telemetry-slots*.jsonl"))
    assert len(files) == 2
    for f in files:
        t = tm.load(str(f))
        # 3 single-stream + 1 + 2 sweep + 4 overload requests; the overload's 4 meet 1 slot + a queue of 1
        assert len(t.requests) + len(t.rejected) == 10 and len(t.rejected) >= 1
        assert all(q["generated_tokens"] == 4 for q in t.requests)
    text = (out / "report.md").read_text()
    assert "2 round(s)" in text and "## Capacity" in text
    r = run_pymoe_here("bench", model, "--protocol", "article", "--cache-slots", "4", "--out-dir", str(out))
    assert r.returncode == 2 and "sets --cache-slots and --telemetry itself" in r.stderr


def test_round_hit_rate_is_pooled_over_lookups(tmp_path):
    """A round's hit rate weighs every lookup the same: 90/100 and 10/1000 hits pool to 100/1100 = 9.1%, where the
    mean of the two requests' rates would say 45.5%."""
    reqs = []
    for hits, lookups in ((90, 100), (10, 1000)):
        r = article.request(8, 1.0, 0.5, 0.0, 100.0)
        r.update(hits=hits, lookups=lookups, misses=dict(spill=0, cpu=lookups - hits, host=0))
        reqs.append(r)
    rep, rounds, _ = rp.build([article.write(tmp_path / "p.jsonl", reqs)])
    assert rounds[0].hit == pytest.approx(100 / 1100)
    assert "| 9.1% (2) |" in rp.to_markdown(rep)


def test_speculative_acceptance_is_pooled_per_round(tmp_path):
    """Drafted 100 and 300 tokens, accepted 80 and 120: 200 / 400 = 50.0% (not the 60% mean of 80% and 40%)."""
    reqs = [{**article.request(8, 1.0, 0.9, 0.0, 100.0), "spec_drafted": d, "spec_accepted": a}
            for d, a in ((100, 80), (300, 120))]
    rep, _, _ = rp.build([article.write(tmp_path / "s.jsonl", reqs)])
    assert rep.figures["acceptance"]["s.jsonl"] == pytest.approx(0.5)
    assert "200 of 400 drafted tokens accepted (50.0%, 2 requests)" in rp.to_markdown(rep)
