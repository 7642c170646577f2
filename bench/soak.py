"""Soak test of `pymoe serve`: mixed concurrent clients for a stated time, the server process watched for leaks.

What this is: `pymoe serve` on a model (default: the embedded demo model) in a subprocess on a free loopback port,
and --clients clients (asyncio + httpx), each sending requests back to back for --minutes:
    mix      streamed and whole answers, chat and completion, random max_tokens (8..48), greedy or sampled with a
             seed; about 10% are streams the client hangs up on after the first chunks (their jobs must be cancelled)
    burst    every --burst-every minutes, 32 more requests at once (the article's overload step): those the bounded
             queue turns away get a 429, which counts as an answer, not a failure
    watch    once a second, the server process from /proc/PID: RSS (VmRSS), open fds (fd/), threads (Threads);
             idle (no request in flight) after a warm-up burst and again after the load
It prints one row per --window seconds (requests ok / 429 / cancelled / failed, latency p50/p95/p99 of the whole
requests that finished in it, RSS, fds, threads) and a summary, and writes it all as JSON to --out when asked.
Exit status 1 (else 0) when any answer was a 5xx, any request the server accepted (not a 429) failed (an error
status, an error event, a connection error or timeout, an answer without a finish_reason), RSS grew past
--rss-growth-mib between the end of the warm-up (the first window) and the end, or the idle fds / threads after the
load (the clients gone, 2 s to settle) exceed those before it by more than --fd-growth / --thread-growth.
What this is not: a throughput benchmark (`pymoe bench` is), or a fuzzer of request bodies
(tests/test_server_hostile.py).

    PYTHONPATH=. python bench/soak.py [--model M.gguf] --minutes 10 [--clients 6 --burst-every 2 --window 30]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pymoe.serve.benchmark import FILLER, StartedServer  # noqa: E402

BURST = 32  # the overload step's clients (pymoe bench's --overload)
CANCEL_SHARE = 0.10


@dataclass
class Request:
    kind: str  # chat | completion, + "-stream"; "cancel" for a stream hung up on; "burst"
    t_end: float  # seconds since the load started
    latency_s: float
    status: int  # HTTP status; 0: no answer (connection error, timeout)
    outcome: str  # ok | rejected (429) | cancelled | failed
    error: str = ""


def body_of(kind: str, rng: random.Random, n: int) -> tuple:
    """(path, JSON body) of a request of this kind."""
    fields = {"max_tokens": rng.randint(8, 48), "temperature": rng.choice([0.0, 0.7]), "seed": rng.randrange(2**32)}
    text = f"{n}: {FILLER[:rng.randint(40, len(FILLER))]}"
    if kind.startswith("chat"):
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], **fields}
    return "/v1/completions", {"prompt": text, **fields}


async def one(client, kind: str, rng: random.Random, n: int, t0: float, timeout: float) -> Request:
    """Send one request and judge its answer."""
    stream = kind.endswith("stream") or kind == "cancel"
    path, body = body_of(rng.choice(["chat", "completion"]) if kind in ("cancel", "burst") else kind, rng, n)
    start, status, error, outcome = time.monotonic(), 0, "", "failed"
    try:
        if not stream:
            r = await client.post(path, json={**body, "stream": False}, timeout=timeout)
            status = r.status_code
            if status == 200:
                finish = r.json()["choices"][0]["finish_reason"]
                outcome, error = ("ok", "") if finish else ("failed", "no finish_reason")
        else:
            async with client.stream("POST", path, json={**body, "stream": True}, timeout=timeout) as r:
                status, finish, chunks = r.status_code, None, 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event, chunks = json.loads(line[6:]), chunks + 1
                    if "error" in event:
                        error = event["error"]["message"]
                        break
                    if kind == "cancel" and chunks >= 3:  # hang up mid-stream: the server must cancel the job
                        outcome = "cancelled"
                        break
                    finish = (event.get("choices") or [{}])[0].get("finish_reason") or finish
                if status == 200 and outcome != "cancelled" and not error:
                    outcome, error = ("ok", "") if finish else ("failed", "no finish_reason")
        if status == 429:
            outcome = "rejected"
        elif status != 200 and not error:
            error = f"HTTP {status}"
    except Exception as e:  # noqa: BLE001  a connection error or a timeout: the request failed
        error = f"{type(e).__name__}: {e}"
    end = time.monotonic()
    return Request(kind, end - t0, end - start, status, outcome, error)


def proc_sample(pid: int) -> dict:
    """RSS (MiB), open fds and threads of a process, from /proc."""
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"])}


async def soak(url: str, pid: int, seconds: float, clients: int, burst_every_s: float, seed: int,
               timeout: float) -> tuple:
    """Run the load -> (requests, samples [(t, {rss_mib, fds, threads})], the idle samples before and after)."""
    import httpx

    limits = httpx.Limits(max_connections=clients + BURST + 8, max_keepalive_connections=clients + BURST)
    requests, samples, count = [], [], iter(range(10**9))
    # warm-up, outside the count: one burst starts what the server starts on first use (the kernels' compiled code,
    # the worker threads that parse and tokenize, the kernels' thread pool); its connections closed, 2 s to settle
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        warm = random.Random(seed - 1)
        await asyncio.gather(*[one(client, "burst", warm, 0, time.monotonic(), timeout) for _ in range(BURST)])
    await asyncio.sleep(2.0)
    idle_before = proc_sample(pid)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        t0 = time.monotonic()
        stop = t0 + seconds

        async def client_loop(i: int):
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < stop:
                kind = "cancel" if rng.random() < CANCEL_SHARE else rng.choice(
                    ["chat", "chat-stream", "completion", "completion-stream"])
                requests.append(await one(client, kind, rng, next(count), t0, timeout))

        async def bursts():
            rng = random.Random(seed)
            while time.monotonic() + burst_every_s < stop:
                await asyncio.sleep(burst_every_s)
                requests.extend(await asyncio.gather(*[one(client, "burst", rng, next(count), t0, timeout)
                                                       for _ in range(BURST)]))

        async def watch():
            while time.monotonic() < stop:
                samples.append((time.monotonic() - t0, proc_sample(pid)))
                await asyncio.sleep(1.0)

        await asyncio.gather(watch(), bursts(), *[client_loop(i) for i in range(clients)])
    await asyncio.sleep(2.0)  # the connections closed, the cancelled jobs dropped
    return requests, samples, idle_before, proc_sample(pid)


def windows(requests: list, samples: list, window_s: float) -> list:
    """One row per window: counts by outcome, latency percentiles of the finished requests, the process's state."""
    rows, last = [], max([r.t_end for r in requests] + [t for t, _ in samples] + [0.0])
    for w in range(int(np.ceil(last / window_s)) or 1):
        lo, hi = w * window_s, (w + 1) * window_s
        reqs = [r for r in requests if lo <= r.t_end < hi]
        lat = [r.latency_s for r in reqs if r.outcome == "ok"]
        procs = [s for t, s in samples if lo <= t < hi] or [samples[-1][1]]
        p50, p95, p99 = (float(p) for p in np.percentile(lat, [50, 95, 99])) if lat else (None,) * 3
        rows.append(dict(t0=lo, ok=sum(r.outcome == "ok" for r in reqs),
                         rejected=sum(r.outcome == "rejected" for r in reqs),
                         cancelled=sum(r.outcome == "cancelled" for r in reqs),
                         failed=sum(r.outcome == "failed" for r in reqs), p50_s=p50, p95_s=p95, p99_s=p99,
                         rss_mib=max(p["rss_mib"] for p in procs), fds=procs[-1]["fds"],
                         threads=procs[-1]["threads"]))
    return rows


def table(rows: list) -> str:
    head = f"{'t (s)':>6} {'ok':>5} {'429':>5} {'cancel':>6} {'fail':>5} {'p50 s':>7} {'p95 s':>7} {'p99 s':>7} " \
           f"{'RSS MiB':>8} {'fds':>5} {'thr':>4}"
    lines = [head]
    for r in rows:
        p = " ".join(f"{r[k]:7.2f}" if r[k] is not None else f"{'-':>7}" for k in ("p50_s", "p95_s", "p99_s"))
        lines.append(f"{r['t0']:6.0f} {r['ok']:5d} {r['rejected']:5d} {r['cancelled']:6d} {r['failed']:5d} {p} "
                     f"{r['rss_mib']:8.1f} {r['fds']:5d} {r['threads']:4d}")
    return "\n".join(lines)


def verdict(requests: list, rows: list, before: dict, after: dict, args) -> list:
    """What went wrong -> a list of lines (empty: the soak passed)."""
    problems = []
    five = [r for r in requests if r.status >= 500]
    failed = [r for r in requests if r.outcome == "failed"]
    if five:
        problems.append(f"{len(five)} answers were 5xx, e.g. {five[0].kind}: {five[0].error}")
    if failed:
        problems.append(f"{len(failed)} accepted requests failed, e.g. {failed[0].kind}: {failed[0].error}")
    growth = rows[-1]["rss_mib"] - rows[0]["rss_mib"] if len(rows) > 1 else 0.0
    if growth > args.rss_growth_mib:
        problems.append(f"RSS grew {growth:.1f} MiB after the warm-up (bound {args.rss_growth_mib:g} MiB)")
    for what, bound in (("fds", args.fd_growth), ("threads", args.thread_growth)):
        if after[what] - before[what] > bound:
            problems.append(f"idle {what}: {before[what]} before the load, {after[what]} after (bound +{bound})")
    return problems


def main(argv=None) -> int:
    from pymoe import demo

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file to serve (default: the embedded demo model)")
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    ap.add_argument("--clients", type=int, default=6, help="clients sending requests back to back")
    ap.add_argument("--burst-every", type=float, default=2.0, help="minutes between overload bursts of 32")
    ap.add_argument("--window", type=float, default=30.0, help="seconds per row of the table")
    ap.add_argument("--parallel", type=int, default=2, help="the server's slots (-np)")
    ap.add_argument("--max-queue", type=int, default=16, help="the server's queue (--max-queue)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take")
    ap.add_argument("--rss-growth-mib", type=float, default=64.0, help="RSS growth allowed after the warm-up")
    ap.add_argument("--fd-growth", type=int, default=8, help="idle open fds allowed above those before the load")
    ap.add_argument("--thread-growth", type=int, default=2, help="idle threads allowed above those before the load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the rows, the summary and every request as JSON here")
    args = ap.parse_args(argv)

    model = args.model or demo.demo_model()
    serve_args = ["--parallel", str(args.parallel), "--max-queue", str(args.max_queue), "--ctx", "512"]
    with StartedServer(model, serve_args) as server:
        requests, samples, before, after = asyncio.run(soak(
            server.url, server.proc.pid, args.minutes * 60, args.clients, args.burst_every * 60, args.seed,
            args.timeout))
        alive = server.proc.poll() is None
    rows = windows(requests, samples, args.window)
    problems = verdict(requests, rows, before, after, args) + ([] if alive else ["the server exited"])
    ok = [r.latency_s for r in requests if r.outcome == "ok"]
    summary = dict(model=os.path.basename(model), minutes=args.minutes, clients=args.clients, requests=len(requests),
                   ok=len(ok), rejected=sum(r.outcome == "rejected" for r in requests),
                   cancelled=sum(r.outcome == "cancelled" for r in requests),
                   failed=sum(r.outcome == "failed" for r in requests),
                   five_xx=sum(r.status >= 500 for r in requests),
                   p50_s=float(np.percentile(ok, 50)) if ok else None,
                   p99_s=float(np.percentile(ok, 99)) if ok else None,
                   rss_warm_mib=rows[0]["rss_mib"], rss_end_mib=rows[-1]["rss_mib"],
                   idle_before=before, idle_after=after, problems=problems)
    print(table(rows))
    print(f"\n{summary['requests']} requests: {summary['ok']} ok, {summary['rejected']} 429, "
          f"{summary['cancelled']} cancelled by their clients, {summary['failed']} failed, {summary['five_xx']} 5xx; "
          f"RSS {summary['rss_warm_mib']:.1f} -> {summary['rss_end_mib']:.1f} MiB; idle fds {before['fds']} -> "
          f"{after['fds']}, threads {before['threads']} -> {after['threads']}")
    print("\n".join(f"FAIL: {p}" for p in problems) or "PASS")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(summary=summary, rows=rows, requests=[asdict(r) for r in requests]), f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
