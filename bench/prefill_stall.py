"""Benchmark: how long one long prompt stalls the other slots' streams, with and without chunked prefill.

What this is: the scheduler of `pymoe serve` (no HTTP) with --streams + 1 slots on one model (default: the embedded
demo model). --streams jobs decode; once each has produced a token, one prompt of --prompt-tokens tokens arrives.
For each --prefill-chunk value (0: the whole prompt in one engine step) it reports the decoding streams' worst
inter-token gap while that prompt was read, their median gap, and the long prompt's time to its first token. The
issue's protocol: one 2,048-token prompt arriving during 4 streams' decoding.
What this is not: a test (tests/test_server.py checks the interleaving and the tokens), or an HTTP measurement
(`pymoe bench` is).

    PYTHONPATH=. python bench/prefill_stall.py [model.gguf] --streams 4 --prompt-tokens 2048 --chunks 0,512,128
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import pymoe
from pymoe import demo
from pymoe.engine.sampler import SamplingParams
from pymoe.serve.scheduler import Job, Scheduler


def run(engine, streams: int, prompt_tokens: int, chunk: int) -> dict:
    times = {i: [] for i in range(streams + 1)}  # job -> times of its tokens (perf_counter, on the engine thread)

    def sink(i):
        return lambda event: times[i].append(time.perf_counter()) if event[0] == "logprobs" else None

    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0)
    long_prompt = [int(t) for t in rng.integers(10, engine.config.n_vocab, prompt_tokens)]
    with Scheduler(engine, parallel=streams + 1, kv="f16", prefill_chunk=chunk) as sched:
        jobs = [sched.submit(Job(prompt_ids=[1 + i, 2, 3], max_tokens=100_000, sampling=greedy, ignore_eos=True,
                                 top_logprobs=0, sink=sink(i))) for i in range(streams)]
        while not all(times[i] for i in range(streams)):
            time.sleep(0.001)
        time.sleep(0.5)  # a steady decode rate first
        t_submit = time.perf_counter()
        long_job = sched.submit(Job(prompt_ids=long_prompt, max_tokens=1, sampling=greedy, top_logprobs=0,
                                    sink=sink(streams)))
        while not long_job.done:
            time.sleep(0.005)
        time.sleep(0.5)
        for job in jobs:
            job.cancel()
    t_first = times[streams][0]
    gaps_during, gaps_before = [], []
    for i in range(streams):
        t = np.asarray(times[i])
        gaps = np.diff(t)  # [n - 1] gap ending at t[1:]
        during = (t[1:] > t_submit) & (t[:-1] < t_first + 1e-9)
        gaps_during += list(gaps[during])
        gaps_before += list(gaps[t[1:] <= t_submit])
    return {"chunk": chunk, "worst_gap_ms": 1e3 * max(gaps_during), "median_gap_ms": 1e3 * statistics.median(
        gaps_before), "ttft_ms": 1e3 * (t_first - t_submit)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--chunks", default="0,512,128")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    model = args.model or demo.demo_model()
    engine = pymoe.load(model, n_ctx=max(4096, args.prompt_tokens + 16), threads=args.threads)
    print(f"model {model}: {args.streams} streams decoding, one {args.prompt_tokens}-token prompt arrives")
    print("| --prefill-chunk | streams' worst gap while it is read (ms) | streams' median gap before (ms) | "
          "its time to first token (ms) |")
    print("| --- | --- | --- | --- |")
    run(engine, args.streams, 64, 0)  # warm-up: compile the kernels
    for chunk in (int(c) for c in args.chunks.split(",")):
        r = run(engine, args.streams, args.prompt_tokens, chunk)
        print(f"| {chunk} | {r['worst_gap_ms']:.0f} | {r['median_gap_ms']:.1f} | {r['ttft_ms']:.0f} |")


if __name__ == "__main__":
    main()
