"""Benchmark: pymoe and llama.cpp (llama-cpp-python) on the same GGUF file and thread count, side by side.

What this is: for one model file, in one run, the median over --runs of
  - prefill tok/s for prompts of --prompt-tokens tokens (default 128 and 512),
  - decode tok/s for --gen-tokens greedy tokens after a 128-token prompt (`--feed random`: each step is given a
    fixed pseudo-random token id instead of the argmax, as llama-bench's text-generation test does; a random-weight
    model's greedy output soon repeats one or two tokens, and so does its routing: ~95% of a step's experts are
    the previous step's on the mid preset, which real text does not do),
for pymoe (CPU backend) and for llama.cpp, their ratios, and pymoe's achieved GB/s of weights read per decoded
token (dense weights + K experts per layer, from the file's real byte counts) next to the machine's measured
memory read bandwidth. Prompts are fixed pseudo-random token ids, so both engines see exactly the same tokens.
llama.cpp runs with its defaults (F16 KV cache, n_batch 512, its repacked CPU weight layouts) and the same thread
count; `--llama-plain` (or a CPU that reports AMX: in this project's VMs ggml's AMX kernels die of SIGILL) loads it
without the extra buffer types, as the tests do. Each engine lives in its
own worker process and the two are measured in turn (never at the same time): in one process, llama.cpp's
spinning OpenMP threads and Numba's would compete for the cores. They alternate run by run (pymoe, llama.cpp,
pymoe, ...), so that a shared host's drift reaches both alike. The load average is printed before and after.
What this is not: a correctness check (tests/test_model_vs_llamacpp.py).

    PYTHONPATH=. python bench/compare_llamacpp.py model.gguf --threads 2
"""
from __future__ import annotations

import argparse
import os
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
    experts = sum(f.expert(i, 0).nbytes for i in cfg.moe_layers) * cfg.n_expert_used  # dense layers: none
    return dense + experts


def time_pymoe(engine, prompt: np.ndarray, n_gen: int, feed=None) -> tuple[float, float]:
    """-> (prefill seconds, decode seconds for n_gen tokens) for one request: greedy, or the tokens of `feed`."""
    model = engine.model
    kv = model.new_kv(len(prompt) + n_gen + 1)
    t0 = time.perf_counter()
    logits = model.prefill(prompt, kv)[-1]
    t1 = time.perf_counter()
    for i in range(n_gen):
        logits = model.decode_one_token(int(np.argmax(logits)) if feed is None else int(feed[i]), kv)
    return t1 - t0, time.perf_counter() - t1


def time_llama(llm, prompt: np.ndarray, n_gen: int, feed=None) -> tuple[float, float]:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt.tolist())
    t1 = time.perf_counter()
    for i in range(n_gen):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1])) if feed is None else int(feed[i])])
    return t1 - t0, time.perf_counter() - t1


def median_rates(fn, prompt, n_gen, runs, feed=None) -> tuple[float, float]:
    fn(prompt[:8], 2)  # warm-up: compilation, page faults
    pre, dec = [], []
    for _ in range(runs):
        p, d = fn(prompt, n_gen, feed)
        pre.append(len(prompt) / p)
        if n_gen:
            dec.append(n_gen / d)
    return statistics.median(pre), statistics.median(dec) if dec else 0.0


def cpu_reports_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


def _worker(kind: str, model: str, threads: int, n_ctx: int, act_bits: int, plain: bool, conn) -> None:
    """One engine in its own process: load it, then answer (prompt, n_gen, runs) requests with median rates.

    Each engine runs in a process of its own so that the two thread pools never meet: llama.cpp's threads spin
    after each graph (and both use OpenMP), which, in one process, steals the cores Numba's threads wait on.
    """
    if kind == "pymoe":
        engine = pymoe.load(model, threads=threads, n_ctx=n_ctx, backend="cpu",
                            backend_options=dict(act_bits=act_bits))
        fn = lambda p, g, f=None: time_pymoe(engine, p, g, f)  # noqa: E731
        info = dict(arch=engine.config.arch, n_layers=engine.config.n_layers, n_expert=engine.config.n_expert,
                    k=engine.config.n_expert_used, per_token=bytes_per_decoded_token(engine),
                    act_bits=engine.backend.act_bits)
    else:
        import llama_cpp

        import sys
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from oracle import _plain_cpu_kernels

        if plain:
            _plain_cpu_kernels(llama_cpp)  # as the tests run it: without the AMX and repacked buffers
        llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              n_batch=512, verbose=False, logits_all=False)
        fn = lambda p, g, f=None: time_llama(llm, p, g, f)  # noqa: E731
        info = {}
    conn.send(info)
    while True:
        request = conn.recv()
        if request is None:
            return
        prompt, n_gen, runs, feed = request
        conn.send(median_rates(fn, prompt, n_gen, runs, feed))


def main():
    import multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    ap.add_argument("--prompt-tokens", default="128,512", help="prefill prompt lengths (default 128,512)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="decoded tokens after a 128-token prompt (default 64)")
    ap.add_argument("--feed", choices=("greedy", "random"), default="greedy",
                    help="decode's tokens: each step's argmax (default), or fixed pseudo-random ids (as llama-bench)")
    ap.add_argument("--runs", type=int, default=3, help="runs per measurement; the median is reported (default 3)")
    ap.add_argument("--exact", action="store_true", help="pymoe's CPU float kernels (act_bits 0) instead of the integer path")
    ap.add_argument("--act-bits", default=None,
                    help="pymoe's activation widths on the integer path, comma-separated (e.g. 16,8: one pymoe "
                         "column each, one llama.cpp column); default: the backend's (16 unless PYMOE_ACT_BITS "
                         "says otherwise)")
    ap.add_argument("--llama-plain", action="store_true",
                    help="llama.cpp without its extra CPU buffer types (repacked layouts, AMX); the default on a CPU "
                         "that reports AMX")
    args = ap.parse_args()
    plain = args.llama_plain or cpu_reports_amx()
    widths = [0] if args.exact else [int(b) for b in args.act_bits.split(",")] if args.act_bits else [None]
    if any(b not in (0, 8, 15, 16, None) for b in widths):
        raise SystemExit(f"compare_llamacpp: --act-bits takes 8, 15 (two 8-bit planes) and/or 16, got {args.act_bits}")

    load_before = os.getloadavg()
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    n_ctx = max(lengths + [128]) + args.gen_tokens + 8
    ctx = mp.get_context("spawn")
    engines = {}  # name -> (process, pipe, info); pymoe's names are ("pymoe", width)
    for kind, bits in [("pymoe", b) for b in widths] + [("llama", None)]:  # started and measured one after another
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(kind, args.model, args.threads, n_ctx, bits, plain, child))
        proc.start()
        child.close()  # so that a worker that dies is an EOFError here, not a wait for ever
        try:
            info = parent.recv()
        except EOFError:
            raise SystemExit(f"compare_llamacpp: the {kind} worker died while loading {args.model} "
                             f"(exit code {proc.join() or proc.exitcode})")
        engines[(kind, info.get("act_bits"))] = (proc, parent, info)
    ours = [name for name in engines if name[0] == "pymoe"]
    info = engines[ours[0]][2]
    n_vocab = pymoe.load_gguf(args.model).config.n_vocab
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, n_vocab, n) for n in sorted(set(lengths + [128]))}

    feed = rng.integers(0, n_vocab, args.gen_tokens) if args.feed == "random" else None

    def measure(name, prompt, n_gen):
        time.sleep(0.5)  # let the other engine's spinning threads go to sleep
        engines[name][1].send((prompt, n_gen, 1, feed if n_gen else None))
        return engines[name][1].recv()

    def row(prompt, n_gen, which):  # which: 0 prefill, 1 decode -> ([pymoe median per width], llama.cpp median)
        rates = {name: [] for name in ours + [("llama", None)]}
        for _ in range(args.runs):  # the engines alternate run by run, so the host's drift (on a shared VM the
            for name in rates:  # same decode run varies 1.5x from minute to minute) reaches them alike
                rates[name].append(measure(name, prompt, n_gen)[which])
        return [statistics.median(rates[name]) for name in ours], statistics.median(rates[("llama", None)])

    rows = []  # (measure, [pymoe rate per width], llama.cpp rate)
    for n in lengths:
        rows.append((f"prefill {n} tok/s", *row(prompts[n], 0, 0)))
    decode = f"decode {args.gen_tokens}{' random' if feed is not None else ''} tok/s"
    rows.append((decode, *row(prompts[128], args.gen_tokens, 1)))
    for proc, conn, _ in engines.values():
        conn.send(None)
        proc.join()

    per_token = info["per_token"]
    bw = memory_bandwidth(args.threads, 3)
    label = lambda bits: "float" if bits == 0 else f"{bits}-bit"  # noqa: E731
    print(f"model {args.model}: {info['arch']}, {info['n_layers']} layers, {info['n_expert']} "
          f"experts top-{info['k']}; {args.threads} threads; median of {args.runs} runs; pymoe path: "
          f"{', '.join('float kernels' if b == 0 else f'integer ({b}-bit activations)' for _, b in ours)}; "
          f"each engine in its own process, the engines alternating run by run; llama.cpp "
          f"{'without its extra buffer types (plain kernels)' if plain else 'with its defaults (repacked layouts)'}")
    from llvmlite import binding

    feats = binding.get_host_cpu_features()
    have = [f for f in ("avx2", "avx512f", "avx512bw", "avx512vnni", "avxvnni") if feats.get(f)]
    print(f"cpu: {binding.get_host_cpu_name()} ({', '.join(have) or 'no AVX2'}), {os.cpu_count()} cores")
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}".format(
        *load_before, *os.getloadavg()))
    head = "".join(f"{'pymoe ' + label(b):>13}" for _, b in ours) + f"{'llama.cpp':>11}"
    head += "".join(f"{'ratio ' + label(b):>13}" for _, b in ours)
    print(f"{'measure':<24}{head}")
    for name, mine, ref in rows:
        print(f"{name:<24}" + "".join(f"{a:>13.1f}" for a in mine) + f"{ref:>11.1f}"
              + "".join(f"{a / ref:>13.2f}" for a in mine))
    for (_, b), rate in zip(ours, rows[-1][1]):
        print(f"pymoe {label(b)} decode reads {per_token / 2**20:.1f} MiB of weights per token -> "
              f"{per_token * rate / 1e9:.2f} GB/s (memory read bandwidth, {args.threads} threads: {bw:.1f} GB/s)")


if __name__ == "__main__":
    main()
