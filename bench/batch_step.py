"""Benchmark: the time of one batched decode step (engine/batch.decode_batch) of N sequences on a model.

What this is: N sequences prefilled with prompts of different lengths, then 300 timed `decode_batch` steps; prints
the median and fastest step. Point PYTHONPATH at another checkout to time its code on the same model (how the
before/after of batched attention projections in docs/server.md was measured).
What this is not: a server measurement (`pymoe bench` is), or a test (tests/test_batch.py checks the logits).

    PYTHONPATH=. python bench/batch_step.py [N] [model.gguf]
"""
import sys
import time

import numpy as np

import pymoe
from pymoe import demo
from pymoe.engine.batch import decode_batch
from pymoe.engine.kv import new_kv

N = int(sys.argv[1]) if len(sys.argv) > 1 else 4
m = pymoe.load(sys.argv[2] if len(sys.argv) > 2 else demo.demo_model(), n_ctx=512, threads=1)
kvs = [new_kv(m.config, 512, "f16") for _ in range(N)]
rng = np.random.default_rng(0)
tokens = [int(m.model.prefill(rng.integers(10, 200, 20 + 7 * j), kv)[-1].argmax()) for j, kv in enumerate(kvs)]
for _ in range(3):  # warm-up
    tokens = decode_batch(m.model, tokens, kvs).argmax(axis=1).tolist()
ts = []
for _ in range(300):
    t0 = time.perf_counter()
    tokens = decode_batch(m.model, tokens, kvs).argmax(axis=1).tolist()
    ts.append(time.perf_counter() - t0)
print(f"{pymoe.__file__}: N={N}: decode step median {1e3 * np.median(ts):.2f} ms, min {1e3 * min(ts):.2f} ms")
