"""Benchmark: predicted expert-parallel load imbalance of three placements (uniform, DeepSeek's EPLB, pymoe's EPLB +
swaps) on the synthetic 512-expert top-10 trace fitted to Qwen3-Next-80B's measured routing counts, at 8 and 16 GPUs.

What this is: the numbers behind docs/scaling-out.md's "When you outgrow one machine" table.
  trace      trace.fitted_trace on ../shared/data/routing-heat/qwen3-next-80b-a3b.json, all 48 layers, the locality
             docs/expert-cache.md calibrated (0.6, window 4), REQUESTS requests of TOKENS decode tokens each, rows
             reordered step-major (decode position, then request), so that REQUESTS consecutive rows are one decode
             step of REQUESTS concurrent requests: what one expert-parallel forward serves.
  placed by  the measured heat (24,963 tokens: what a deployment's recorded statistics give), so every measurement
             is held-out (the trace is a different sample of the same popularity).
  imbalance  placement.imbalance: sum over layers (and steps) of the max GPU load / sum of the mean GPU load; per
             decode step of REQUESTS tokens, and over all the trace's tokens at once.
What this is not: a test (tests/test_placement.py holds the algorithm to worked examples and DeepSeek's own).

    PYTHONPATH=. python bench/placement_imbalance.py [--requests 64] [--tokens 48]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from pymoe.experts.placement import imbalance, placements, trace_counts
from pymoe.experts.trace import Trace, fitted_trace

HEAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "routing-heat",
                    "qwen3-next-80b-a3b.json")
LOCALITY, WINDOW = 0.6, 4  # docs/expert-cache.md, "The synthetic 512-expert trace fitted to Qwen3-Next-80B"


def step_major(trace: Trace, n_requests: int) -> Trace:
    """Rows reordered decode position first, then request: consecutive n_requests rows are one decode step."""
    n = trace.n_tokens // n_requests
    order = np.arange(trace.n_tokens).reshape(n_requests, n).T.reshape(-1)  # [N]
    return Trace(trace.experts[order], trace.weights[order], trace.phase[order], trace.request[order],
                 trace.forward[order], trace.meta)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--save", default=None, help="also save the fitted trace here (.npz)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    heat = np.asarray(json.load(open(HEAT))["heat"], dtype=np.int64)  # [48, 512]
    trace = fitted_trace(heat, args.requests, 0, args.tokens, LOCALITY, WINDOW, seed=0, k=10,
                         model="fitted-qwen3-next")
    if args.save:
        trace.save(args.save)
    trace = step_major(trace, args.requests)
    steps = trace_counts(trace, "decode", args.requests)  # [steps, 48, 512]
    whole = trace_counts(trace, "decode")  # [48, 512]
    print(f"fitted trace: {trace.summary()} ({time.perf_counter() - t0:.0f} s)")
    print(f"placed by the measured heat; imbalance per decode step of {args.requests} concurrent requests "
          f"({steps.shape[0]} steps) and over all {trace.n_tokens} tokens\n")
    print("| GPUs | redundant | experts per GPU | measured on | uniform | EPLB | pymoe (EPLB + swaps) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for gpus in (8, 16):
        for red in (0, 32):
            ps = placements(heat, gpus, red)
            for name, c in ((f"a step of {args.requests}", steps), ("all tokens", whole),
                            ("the heat itself (in-sample)", heat)):
                print(f"| {gpus} | {red} | {(512 + red) // gpus} | {name} | "
                      + " | ".join(f"{imbalance(p, c):.3f}" for p in ps) + " |")
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
