"""Benchmark: pymoe and llama.cpp (llama-cpp-python) on the same GGUF file and thread count, side by side.

What this is: for one model file, in one run, the median over --runs of
  - prefill tok/s for prompts of --prompt-tokens tokens (default 128 and 512),
  - decode tok/s for --gen-tokens greedy tokens after a 128-token prompt,
for pymoe (CPU backend) and for llama.cpp, their ratios, and pymoe's achieved GB/s of weights read per decoded
token (dense weights + K experts per layer, from the file's real byte counts) next to the machine's measured
memory read bandwidth. Prompts are fixed pseudo-random token ids, so both engines see exactly the same tokens.
llama.cpp runs with its defaults (F16 KV cache, n_batch 512) and the same thread count.
What this is not: a correctness check (tests/test_model_vs_llamacpp.py).

    PYTHONPATH=. python bench/compare_llamacpp.py model.gguf --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_matvec import memory_bandwidth

import pymoe


def bytes_per_decoded_token(engine) -> int:
    """Weight bytes one decode step reads: every dense tensor (the embedding row aside) + K experts per layer."""
    f, cfg = engine.file, engine.config
    dense = sum(t.nbytes for name, t in f.tensors.items() if "_exps." not in name and name != "token_embd.weight")
    if cfg.tied_output:
        dense += f.tensor("token_embd.weight").nbytes
    experts = sum(f.expert(i, 0).nbytes for i in range(cfg.n_layers)) * cfg.n_expert_used
    return dense + experts


def time_pymoe(engine, prompt: np.ndarray, n_gen: int) -> tuple[float, float]:
    """-> (prefill seconds, decode seconds for n_gen tokens) for one request, greedy."""
    model = engine.model
    kv = model.new_kv(len(prompt) + n_gen + 1)
    t0 = time.perf_counter()
    logits = model.prefill(prompt, kv)[-1]
    t1 = time.perf_counter()
    for _ in range(n_gen):
        logits = model.decode_one_token(int(np.argmax(logits)), kv)
    return t1 - t0, time.perf_counter() - t1


def time_llama(llm, prompt: np.ndarray, n_gen: int) -> tuple[float, float]:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt.tolist())
    t1 = time.perf_counter()
    for _ in range(n_gen):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return t1 - t0, time.perf_counter() - t1


def median_rates(fn, prompt, n_gen, runs) -> tuple[float, float]:
    fn(prompt[:8], 2)  # warm-up: compilation, page faults
    pre, dec = [], []
    for _ in range(runs):
        p, d = fn(prompt, n_gen)
        pre.append(len(prompt) / p)
        if n_gen:
            dec.append(n_gen / d)
    return statistics.median(pre), statistics.median(dec) if dec else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    ap.add_argument("--prompt-tokens", default="128,512", help="prefill prompt lengths (default 128,512)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="decoded tokens after a 128-token prompt (default 64)")
    ap.add_argument("--runs", type=int, default=3, help="runs per measurement; the median is reported (default 3)")
    args = ap.parse_args()

    import llama_cpp

    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    n_ctx = max(lengths + [128]) + args.gen_tokens + 8
    engine = pymoe.load(args.model, threads=args.threads, n_ctx=n_ctx)
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                          n_batch=512, verbose=False, logits_all=False)
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, engine.config.n_vocab, n) for n in sorted(set(lengths + [128]))}

    rows = []
    for n in lengths:
        ours, _ = median_rates(lambda p, g: time_pymoe(engine, p, g), prompts[n], 0, args.runs)
        ref, _ = median_rates(lambda p, g: time_llama(llm, p, g), prompts[n], 0, args.runs)
        rows.append((f"prefill {n} tok/s", ours, ref))
    _, ours = median_rates(lambda p, g: time_pymoe(engine, p, g), prompts[128], args.gen_tokens, args.runs)
    _, ref = median_rates(lambda p, g: time_llama(llm, p, g), prompts[128], args.gen_tokens, args.runs)
    rows.append((f"decode {args.gen_tokens} tok/s", ours, ref))

    per_token = bytes_per_decoded_token(engine)
    bw = memory_bandwidth(args.threads, 3)
    print(f"model {args.model}: {engine.config.arch}, {engine.config.n_layers} layers, {engine.config.n_expert} "
          f"experts top-{engine.config.n_expert_used}; {args.threads} threads; median of {args.runs} runs")
    print(f"{'measure':<20} {'pymoe':>10} {'llama.cpp':>10} {'ratio':>7}")
    for name, a, b in rows:
        print(f"{name:<20} {a:>10.1f} {b:>10.1f} {a / b:>7.2f}")
    print(f"pymoe decode reads {per_token / 2**20:.1f} MiB of weights per token -> {per_token * ours / 1e9:.2f} GB/s "
          f"(memory read bandwidth, {args.threads} threads: {bw:.1f} GB/s)")


if __name__ == "__main__":
    main()
