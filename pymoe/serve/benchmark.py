"""`pymoe bench`: the reference article's load protocol against an OpenAI-compatible server (one it starts, or --url).

The protocol (article sections 7 and 9, appendix A), every request a streamed /v1/completions with a fixed number of
generated tokens (`ignore_eos`, greedy) and a prompt that starts with its own request number, so a request can reuse
no more than BOS and a leading digit of another's KV (the article's "cold prefix"; the JSON counts reused tokens):
  1. single stream, c = 1:  a short prompt, a ~4K and a ~16K prompt (at most 1/8 and 1/2 of the context, so a small
                            model's --ctx scales them down): prefill tok/s, decode tok/s, TTFT
  2. concurrency sweep:      c = 1, 2, 4, 8, 16 clients, each sending --requests short-prompt requests one after
                            another: aggregate throughput (all generated tokens / wall time), TTFT p50/p95
  3. overload:               c = 32 at once: with a bounded queue the excess gets 429 instead of waiting (article
                            9.3: without admission control every request queued and latency grew without bound)
  4. stall (--stall-prompt): --stall-streams clients stream long generations; after a steady stretch (the baseline)
                            one request with a --stall-prompt-token prompt arrives: the streams' worst and p99
                            inter-token gap while it is prefilled, against the same over the baseline stretch (the
                            cost of a long prompt to everyone else: what --prefill-chunk bounds). Needs a server
                            with --parallel >= streams + 1, or the long prompt just waits in the queue.
Per row: prefill and decode tok/s (medians of the server's `timings`, else client-side estimates), TTFT p50/p95
(client-side: request sent -> first streamed text), aggregate tok/s, the decode expert hit rate and spill share over
the row (from /v1/status, pymoe servers only), failures and 429s. A table on stdout, all of it as JSON in --out.
What this is not: a load generator for arbitrary traffic shapes, or a server (it starts `pymoe serve`).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from pymoe.errors import PymoeError

FILLER = ("An MoE model routes every token to a few of its experts. The expert cache keeps the hot experts in fast "
          "memory; a miss is read over PCIe or computed on the CPU. Throughput is set by how much of the routed "
          "traffic stays in the cache, and latency by how long a request waits in the queue. ")


@dataclass
class Outcome:
    """One request as the client saw it."""

    status: int  # HTTP status; 0 = no answer (connection error or timeout)
    ttft_s: Optional[float] = None  # None: not measured (no text came back)
    total_s: Optional[float] = None
    n_prompt: int = 0
    n_generated: int = 0
    n_reused: int = 0  # prompt tokens the server took from a slot's cached prefix
    prefill_tok_s: Optional[float] = None
    decode_tok_s: Optional[float] = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


# --- the server under test ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StartedServer:
    """`pymoe serve MODEL` in a subprocess on a free loopback port, until the `with` block ends."""

    def __init__(self, model: str, serve_args: list, start_timeout: float = 600.0):
        # start_timeout: loading, filling the slots and compiling the kernels take ~10-60 s on a quiet 2-core machine,
        # several minutes beside other busy processes (a load average of 29 once took the 120 s this was)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "pymoe", "serve", model, "--port", str(self.port), *serve_args]
        self.start_timeout = start_timeout
        self.log = tempfile.TemporaryFile(mode="w+")

    def __enter__(self) -> "StartedServer":
        import httpx

        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PymoeError(f"pymoe serve exited with status {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        last = self.tail()  # read before __exit__ closes the log
        self.__exit__()
        raise PymoeError(f"pymoe serve did not answer on {self.url} within {self.start_timeout:g} s: {last}")

    def tail(self) -> str:
        if self.log.closed:
            return "(log closed)"
        self.log.seek(0)
        lines = self.log.read().strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


# --- prompts ---------------------------------------------------------------------------------------------------

class Prompts:
    """Token-id prompts of exact lengths, each starting with its request number ("17: An MoE model ...")."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.filler = tokenizer.encode(FILLER, add_bos=False)
        self.count = 0

    def make(self, n: int) -> list:
        self.count += 1
        head = self.tokenizer.encode(f"{self.count}: ")
        body = self.filler * (n // max(1, len(self.filler)) + 1)
        return (head + body)[:max(n, 1)]


def scenario_lengths(n_ctx: int, gen: int, short: int = 26) -> dict:
    """Prompt tokens of the article's three prompts, scaled to the context: short, ~4K (<= ctx/8), ~16K (<= ctx/2)."""
    room = n_ctx - gen - 1
    if room < short:
        raise PymoeError(f"a context of {n_ctx} tokens has no room for {gen} generated tokens and a prompt")
    return {"short": short, "4k": min(4096, n_ctx // 8, room), "16k": min(16384, n_ctx // 2, room)}


# --- one request -------------------------------------------------------------------------------------------------

async def send(client, url: str, headers: dict, prompt: list, gen: int, on_text=None) -> Outcome:
    """One streamed completion of exactly `gen` tokens; -> what the client saw. on_text(t): called with the
    perf_counter time of every streamed chunk that carries text."""
    import httpx

    body = {"model": "bench", "prompt": prompt, "max_tokens": gen, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    out = Outcome(status=0, n_prompt=len(prompt))
    timings = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")[:200]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message", chunk["error"]))
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    out.ttft_s = now - t0 if out.ttft_s is None else out.ttft_s
                    if on_text is not None:
                        on_text(now)
                if chunk.get("usage"):
                    out.n_generated = chunk["usage"]["completion_tokens"]
                timings = chunk.get("timings") or timings
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.total_s = time.perf_counter() - t0
    if timings:  # the server's own clocks (pymoe and llama.cpp servers send them)
        out.prefill_tok_s, out.decode_tok_s = timings.get("prompt_per_second"), timings.get("predicted_per_second")
        out.n_reused = timings.get("cache_n", 0)
    elif out.n_generated > 1 and out.ttft_s is not None:
        out.prefill_tok_s = out.n_prompt / out.ttft_s
        out.decode_tok_s = (out.n_generated - 1) / (out.total_s - out.ttft_s)
    return out


# --- rows --------------------------------------------------------------------------------------------------------

def pct(values: list, q: float) -> Optional[float]:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def cache_counts(client_sync, url: str, headers: dict) -> Optional[dict]:
    """The server's decode expert-cache counters (pymoe's /v1/status), or None for other servers."""
    try:
        r = client_sync.get(url + "/v1/status", headers=headers, timeout=10)
        return r.json()["cache"]["counts"]["decode"] if r.status_code == 200 else None
    except Exception:  # not a pymoe server: no cache columns
        return None


def summarize(name: str, c: int, n_prompt: int, gen: int, outcomes: list, wall_s: float, before, after) -> dict:
    ok = [o for o in outcomes if o.ok]
    row = dict(phase=name, c=c, prompt_tokens=n_prompt, gen_tokens=gen, requests=len(outcomes), ok=len(ok),
               rejected_429=sum(o.status == 429 for o in outcomes),
               failures=sum(not o.ok and o.status != 429 for o in outcomes), reused_tokens=sum(o.n_reused for o in ok),
               prefill_tok_s=pct([o.prefill_tok_s for o in ok], 50), decode_tok_s=pct([o.decode_tok_s for o in ok], 50),
               ttft_p50_s=pct([o.ttft_s for o in ok], 50), ttft_p95_s=pct([o.ttft_s for o in ok], 95),
               aggregate_tok_s=sum(o.n_generated for o in ok) / wall_s if wall_s > 0 else None,
               hit_rate=None, spill_share=None)
    if before is not None and after is not None:
        d = {k: after[k] - before[k] for k in after}
        if d["lookups"] and not d.get("host"):  # "host": read in place with no slot pool: no cache, no hit rate
            row["hit_rate"], row["spill_share"] = d["hits"] / d["lookups"], d["spill"] / d["lookups"]
    return row


async def run_clients(url: str, headers: dict, prompts: list, c: int, gen: int, timeout: float, bar) -> tuple:
    """c clients share the prompts, each sending its next one when its last one is answered -> (outcomes, wall_s)."""
    import httpx

    todo = list(prompts)
    outcomes = []

    async def client_loop(client):
        while todo:
            outcomes.append(await send(client, url, headers, todo.pop(0), gen))
            bar.update(1)

    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(c)))
        return outcomes, time.perf_counter() - t0


# --- the protocol ------------------------------------------------------------------------------------------------

def plan(n_ctx: int, gen: int, requests: int, concurrency: list, overload: int) -> list:
    """[(phase name, c, prompt tokens, number of requests)] in the order they run."""
    lengths = scenario_lengths(n_ctx, gen)
    steps = [(f"single {name}", 1, n, requests) for name, n in lengths.items()]
    steps += [("sweep", c, lengths["short"], c * requests) for c in concurrency]
    if overload:
        steps.append(("overload", overload, lengths["short"], overload))
    return steps


def run_protocol(url: str, tokenizer, n_ctx: int, gen: int = 128, requests: int = 2,
                 concurrency: tuple = (1, 2, 4, 8, 16), overload: int = 32, api_key: Optional[str] = None,
                 timeout: float = 600.0, progress: bool = True) -> list:
    """Run every step of `plan` against the server at `url` -> the table rows (dicts)."""
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    steps = plan(n_ctx, gen, requests, list(concurrency), overload)
    prompts = Prompts(tokenizer)
    rows = []
    with httpx.Client() as sync, tqdm(total=sum(s[3] for s in steps), desc="bench", unit="req",
                                      disable=None if progress else True) as bar:
        for name, c, n_prompt, n_req in steps:
            bar.set_postfix_str(f"{name} c={c}")
            before = cache_counts(sync, url, headers)
            outcomes, wall = asyncio.run(run_clients(url, headers, [prompts.make(n_prompt) for _ in range(n_req)],
                                                     c, gen, timeout, bar))
            rows.append(summarize(name, c, n_prompt, gen, outcomes, wall, before, cache_counts(sync, url, headers)))
    return rows


# --- the stall protocol ------------------------------------------------------------------------------------------

def gap_stats(gaps: list) -> dict:
    """Inter-token gaps (seconds) -> worst, p99 and median in milliseconds (None without gaps)."""
    ms = [1e3 * g for g in gaps]
    return dict(worst_ms=max(ms) if ms else None, p99_ms=pct(ms, 99), median_ms=pct(ms, 50), gaps=len(ms))


async def run_stall(url: str, headers: dict, prompts: "Prompts", streams: int, prompt_tokens: int, n_ctx: int,
                    baseline_s: float, timeout: float) -> dict:
    """`streams` streamed generations; after `baseline_s` of steady decoding (or half of a stream's tokens) one
    `prompt_tokens` prompt arrives.
    -> the streams' gaps over the baseline stretch and while the long prompt is read (from its arrival to its first
    token), its time to first token, and whether every stream was still decoding when it ended."""
    import httpx

    times = [[] for _ in range(streams)]  # per stream: arrival times of its text chunks (client clock)
    gen = n_ctx - 64  # the streams outlast the measurement; they are cancelled after it
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = [asyncio.create_task(send(client, url, headers, prompts.make(26), gen, times[i].append))
                 for i in range(streams)]
        deadline = time.perf_counter() + timeout
        while not all(len(t) >= 2 for t in times):  # every stream decoding
            if time.perf_counter() > deadline or any(task.done() for task in tasks):
                for task in tasks:
                    task.cancel()
                outcomes = [await task if task.done() and not task.cancelled() else None for task in tasks]
                errors = [o.error or f"HTTP {o.status}" for o in outcomes if o is not None and not o.ok]
                raise PymoeError(f"stall: the {streams} streams did not start decoding"
                                 + (f" ({errors[0]})" if errors else ""))
            await asyncio.sleep(0.005)
        t_base = time.perf_counter()
        while time.perf_counter() - t_base < baseline_s and max(map(len, times)) < gen // 2:  # (a small model is fast)
            await asyncio.sleep(0.005)
        t_submit = time.perf_counter()
        long = await send(client, url, headers, prompts.make(prompt_tokens), 1)
        t_first = t_submit + long.ttft_s if long.ttft_s is not None else time.perf_counter()
        alive = not any(task.done() for task in tasks)  # still decoding when the long prompt's answer came: the
        #                                                 measurement's window is covered (checked after a pause,
        #                                                 a small model's streams had run out: a flaky CI test)
        await asyncio.sleep(0.2)  # the chunks still in flight arrive
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    base, during = [], []
    for t in map(np.asarray, times):
        gaps, start, end = np.diff(t), t[:-1], t[1:]  # gap i: from chunk i to chunk i + 1
        base += list(gaps[(start >= t_base) & (end <= t_submit)])
        during += list(gaps[(end > t_submit) & (start < t_first)])  # overlapping the long prompt's prefill
    return dict(phase="stall", c=streams, prompt_tokens=prompt_tokens, long_ok=long.ok, long_error=long.error,
                long_ttft_s=long.ttft_s, streams_alive=alive, baseline_s=t_submit - t_base,
                baseline=gap_stats(base), during=gap_stats(during))


def stall_line(r: dict, prefill_chunk=None) -> str:
    """The stall row in words."""
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    b, d = r["baseline"], r["during"]
    ttft = None if r["long_ttft_s"] is None else 1e3 * r["long_ttft_s"]
    chunk = "" if prefill_chunk is None else f" (--prefill-chunk {prefill_chunk})"
    return (f"stall{chunk}: {r['c']} streams, one {r['prompt_tokens']}-token prompt arrives: streams' gaps while it "
            f"is read worst {f(d['worst_ms'])} ms, p99 {f(d['p99_ms'])} ms, median {f(d['median_ms'])} ms "
            f"({d['gaps']} gaps); baseline (no long prompt, {r['baseline_s']:.1f} s) worst {f(b['worst_ms'])} ms, "
            f"p99 {f(b['p99_ms'])} ms, median {f(b['median_ms'])} ms; its TTFT {f(ttft)} ms"
            + ("" if r["long_ok"] else f"; the long request failed: {r['long_error']}")
            + ("" if r["streams_alive"] else "; a stream ended before the measurement did"))


COLUMNS = [  # (row key, header, format, width)
    ("phase", "phase", "{}", 12), ("c", "c", "{}", 3), ("prompt_tokens", "prompt", "{}", 6),
    ("gen_tokens", "gen", "{}", 4), ("ok", "ok", "{}", 4), ("rejected_429", "429", "{}", 4),
    ("failures", "fail", "{}", 4), ("prefill_tok_s", "prefill", "{:.1f}", 8), ("decode_tok_s", "decode", "{:.1f}", 7),
    ("ttft_p50_s", "TTFT50", "{:.2f}", 6), ("ttft_p95_s", "TTFT95", "{:.2f}", 6),
    ("aggregate_tok_s", "agg", "{:.1f}", 7), ("hit_rate", "hit", "{:.1%}", 6), ("spill_share", "spill", "{:.2%}", 6),
]


def table(rows: list) -> str:
    """The rows as an aligned text table (tok/s and seconds; '-' where a number is not available)."""
    def line(cells):
        widths = [w for _, _, _, w in COLUMNS]
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line([h for _, h, _, _ in COLUMNS])]
    for row in rows:
        out.append(line(["-" if row[k] is None else fmt.format(row[k]) for k, _, fmt, _ in COLUMNS]))
    return "\n".join(out)


def bench(model: str, url: Optional[str] = None, serve_args: tuple = (), n_ctx: Optional[int] = None,
          out: Optional[str] = "bench.json", log=print, stall_prompt: int = 0, stall_streams: int = 4,
          stall_only: bool = False, stall_baseline_s: float = 2.0, **protocol) -> dict:
    """`pymoe bench`: start a server (unless `url`), run the protocol, print the table, write the JSON -> report.
    stall_prompt > 0: the stall measurement too (step 4; stall_only: it alone)."""
    import httpx

    from pymoe.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(model)
    with (StartedServer(model, list(serve_args)) if url is None else _Given(url)) as server:
        headers = {"Authorization": f"Bearer {protocol['api_key']}"} if protocol.get("api_key") else {}
        status = {}
        try:
            r = httpx.get(server.url + "/v1/status", headers=headers, timeout=10)
        except httpx.HTTPError as e:
            raise PymoeError(f"{server.url}: cannot reach the server ({type(e).__name__}: {e})") from None
        if r.status_code == 401:
            raise PymoeError(f"{server.url}: 401, the server wants an API key (--api-key)")
        if r.status_code == 200:
            status = r.json()
        n_ctx = n_ctx or status.get("n_ctx")
        if not n_ctx:
            raise PymoeError(f"{server.url} does not say its context size (/v1/status): give --ctx")
        log(f"bench: {server.url}, context {n_ctx} tokens, {protocol.get('gen', 128)} generated tokens per request")
        rows = [] if stall_only else run_protocol(server.url, tokenizer, n_ctx, **protocol)
        stall = None
        if stall_prompt:
            if stall_prompt + 2 > n_ctx:
                raise PymoeError(f"--stall-prompt {stall_prompt} does not fit the context of {n_ctx} tokens: give "
                                 "a smaller one or a larger --ctx")
            if status.get("parallel") is not None and status["parallel"] < stall_streams + 1:
                log(f"bench: the server has {status['parallel']} slots, fewer than {stall_streams} streams + the long "
                    "prompt: it waits in the queue (serve with -np {stall_streams + 1})")
            stall = asyncio.run(run_stall(server.url, headers, Prompts(tokenizer), stall_streams, stall_prompt, n_ctx,
                                          stall_baseline_s, protocol.get("timeout", 600.0)))
    report = dict(model=os.path.basename(model), url=url or "(started)", n_ctx=n_ctx,
                  server={k: status.get(k) for k in ("arch", "backend", "kv", "parallel", "max_queue", "prefill_chunk",
                                                     "cache")},
                  protocol={k: v for k, v in protocol.items() if k != "api_key"}, rows=rows, stall=stall)
    if rows:
        log(table(rows))
    if stall is not None:
        log(stall_line(stall, status.get("prefill_chunk")))
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
        log(f"bench: wrote {out}")
    return report


class _Given:
    """A server someone else runs: nothing to start or stop."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


# --- the article protocol: the load protocol at several slot-pool sizes, with telemetry ----------------------------
ARTICLE_POOLS = "10,25,50,100"  # slot pools in percent of the model's experts (the article's rounds: 23.5%, 79.5%)


def pool_sizes(model: str, pools: str) -> list:
    """--pools "10,25,50,100" -> slot counts: that percentage of the model's experts (layers x experts), at least 1."""
    from pymoe.gguf.loader import load_gguf

    try:
        shares = [float(p) for p in pools.split(",") if p.strip()]
    except ValueError:
        raise PymoeError(f"--pools must be comma-separated percentages, got '{pools}'") from None
    if not shares or any(not 0 < p <= 100 for p in shares):
        raise PymoeError(f"--pools: each percentage must be in (0, 100], got '{pools}'")
    cfg = load_gguf(model).config
    n_total = cfg.n_layers * cfg.n_expert
    return sorted({max(1, round(p / 100 * n_total)) for p in shares})


def bench_article(model: str, out_dir: str, pools: str = ARTICLE_POOLS, serve_args: tuple = (), log=print,
                  telemetry_interval: float = 2.0, **bench_options) -> list:
    """`pymoe bench --protocol article`: for each slot pool of --pools, start `pymoe serve --cache-slots N
    --telemetry OUT_DIR/telemetry-slotsN.jsonl`, run the load protocol against it (short, ~4K, ~16K prompts, the
    concurrency sweep, the overload; every prompt a cold prefix), then write `pymoe report` of all of them to
    OUT_DIR/report.md. -> the telemetry files. Each pool is one round of the report (a file each)."""
    from pymoe.experts.report import report

    if any(a.startswith(("--cache-slots", "--cache-gib", "--telemetry")) for a in serve_args):
        raise PymoeError("--protocol article sets --cache-slots and --telemetry itself, one server per --pools entry")
    os.makedirs(out_dir, exist_ok=True)
    files = []
    for slots in pool_sizes(model, pools):
        path = os.path.join(out_dir, f"telemetry-slots{slots}.jsonl")
        if os.path.exists(path):
            os.remove(path)  # a round is one run: a file left from an earlier one would mix two
        log(f"bench: round of {slots} slots -> {path}")
        bench(model, serve_args=[*serve_args, f"--cache-slots={slots}", f"--telemetry={path}",
                                 f"--telemetry-interval={telemetry_interval:g}"],
              out=os.path.join(out_dir, f"bench-slots{slots}.json"), log=log, **bench_options)
        files.append(path)
    log(report(files, out=os.path.join(out_dir, "report.md")))
    return files
