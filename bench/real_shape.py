"""Benchmark: a file of a real family's shapes (Qwen3-30B-A3B, Q4_K_M, random weights), pymoe beside llama.cpp.

What this is: two steps.
  make: write the `qwen3-30b-a3b` preset (pymoe/demo/tinymodel.py) as random Q2_K blocks (no float weights: an F32
        source would be 122 GB; tinymodel.write_random_quantized, `--jobs` processes), requantize it to Q4_K_M with
        llama.cpp's own quantizer (`llama_model_quantize`, allow_requantize, its per-tensor log on stderr as the
        progress), then delete the source. `--layers N` (default 6) writes and quantizes N layers only and repeats
        them to the preset's depth, each where a layer of its types belongs (`layer_sources`,
        tinymodel.write_repeated_layers): all 48 took ~90 s a layer on 2 busy cores. ~17 GB of Q4_K_M: out of git.
  run:  each engine in its own worker process, one after another (never two big engines at once: the file is ~17 GB
        and each engine maps it), in the same thread count: pymoe's default path (16-bit activations), pymoe
        --act-bits 8 (its experts repacked 8 rows at a time on first use, into anonymous memory: cpu.py
        `expert_row`), and llama.cpp (llama-cpp-python). For each: load-to-first-token (from the worker's load call
        to the first token of an 8-token prompt, the file's pages as the previous engine left them in the page
        cache), peak RSS split into anonymous and file-backed memory (the parent samples /proc/<pid>/status of the
        worker every 50 ms: VmRSS, RssAnon, RssFile; VmHWM at the end), prefill tok/s of 128 and 512 tokens (a
        prompt's first run on its own: pymoe makes the repacked copies of the experts it runs then, llama.cpp made
        all of its copies in its load call; then the median of --runs runs of the same prompt) and decode tok/s of
        --gen-tokens tokens after a 128-token prompt (fixed pseudo-random token ids fed, as llama-bench does: a
        random-weight model's greedy output repeats itself), medians of --runs.
        llama.cpp runs without its extra CPU buffer types (repacked layouts, AMX) on a CPU that reports AMX, as
        bench/compare_llamacpp.py does (in this project's VMs ggml's AMX kernels die of SIGILL), and with
        --llama-plain anywhere.
What this is not: an accuracy check (random weights; tests/test_real_shape.py checks a scaled-down file).

    PYTHONPATH=. python bench/real_shape.py make -o /work/bigm/qwen3-30b-a3b-q4_k_m.gguf --jobs 2
    PYTHONPATH=. python bench/real_shape.py run /work/bigm/qwen3-30b-a3b-q4_k_m.gguf --threads 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


# --- make --------------------------------------------------------------------------------------------------------

def llama_requantize(src: str, dst: str, ftype: str = "Q4_K_M", threads: int = 2) -> None:
    """llama.cpp's quantizer on a quantized source (allow_requantize: it dequantizes each tensor to F32 first)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) returned {rc}")


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp) for the layers whose attn_v and ffn_down a Q4_K_M file keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def layer_sources(part: str, n_layers: int) -> list:
    """For each layer of an n_layers-deep Q4_K_M file, a layer of the llama.cpp-quantized `part` that has the types
    llama.cpp gives that layer (Q6_K or Q4_K ffn_down and attn_v: `use_more_bits`), taken in turn."""
    from gguf import GGUFReader

    kinds = {}  # ffn_down type name -> layers of part
    for t in GGUFReader(part).tensors:
        if t.name.endswith("ffn_down_exps.weight"):
            kinds.setdefault(t.tensor_type.name, []).append(int(t.name.split(".")[1]))
    out = []
    for i in range(n_layers):
        layers = kinds.get("Q6_K" if use_more_bits(i, n_layers) else "Q4_K")
        if not layers:
            raise SystemExit(f"real_shape: {part} has no layer of the type layer {i} needs ({sorted(kinds)})")
        out.append(layers[sum(1 for j in range(i) if use_more_bits(j, n_layers) == use_more_bits(i, n_layers))
                          % len(layers)])
    return out


def make(out: str, preset: str, jobs: int, threads: int, keep_source: bool = False, layers: int = 0) -> None:
    """layers: quantize only this many random layers with llama.cpp and repeat them, each where a layer of its
    types belongs, to the preset's depth (0: quantize every layer; ~80 min on 2 busy cores for qwen3-30b-a3b)."""
    from pymoe.demo.tinymodel import PRESETS, write_random_quantized, write_repeated_layers

    depth = PRESETS[preset].n_layers
    src = out + ".q2_k-source"
    part = out + f".{layers}-layers" if layers and layers < depth else out
    t0 = time.perf_counter()
    cfg = write_random_quantized(src, preset, jobs=jobs, progress=True, n_layers=layers or None)
    t1 = time.perf_counter()
    print(f"source {src}: {os.path.getsize(src) / 1e9:.2f} GB in {t1 - t0:.0f} s", flush=True)
    llama_requantize(src, part, "Q4_K_M", threads)
    t2 = time.perf_counter()
    if not keep_source:
        os.remove(src)
    print(f"Q4_K_M by llama.cpp: {part}, {os.path.getsize(part) / 1e9:.2f} GB in {t2 - t1:.0f} s", flush=True)
    if part != out:
        sources = layer_sources(part, depth)
        write_repeated_layers(part, out, sources)
        os.remove(part)
        print(f"layers repeated to {depth} (source layer of each: {sources}) in {time.perf_counter() - t2:.0f} s")
    print(f"wrote {out}: {cfg.arch} {preset}, {depth} layers, {cfg.n_expert} experts (top-{cfg.n_expert_used}), "
          f"vocab {cfg.n_vocab}, {os.path.getsize(out) / 1e9:.2f} GB", flush=True)


# --- run ---------------------------------------------------------------------------------------------------------

ENGINES = {"pymoe": ("pymoe", None), "pymoe8": ("pymoe", 8), "llama": ("llama", None)}
STATUS_KEYS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def memory_status(pid) -> dict:
    """{VmRSS, RssAnon, RssFile, VmHWM: bytes} of a process, from /proc/<pid>/status ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in STATUS_KEYS:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


class PeakSampler:
    """The peaks of VmRSS, RssAnon and RssFile of process `pid`, sampled every `every` seconds in a thread (each
    peak taken on its own: the anonymous and the file-backed peaks may fall at different moments)."""

    def __init__(self, pid: int, every: float = 0.05):
        self.pid, self.every, self.peak = pid, every, dict.fromkeys(STATUS_KEYS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        for key, value in memory_status(self.pid).items():
            self.peak[key] = max(self.peak[key], value)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.every)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.sample()
        return self.peak


def _worker(kind: str, act_bits, model: str, threads: int, n_ctx: int, first: list, plain: bool, conn) -> None:
    """One engine in its own process: load it and produce the first token of `first` (timed from the load call),
    then answer (prompt, n_gen, feed) requests with (prefill seconds, decode seconds)."""
    from compare_llamacpp import time_llama, time_pymoe

    t0 = time.perf_counter()
    if kind == "pymoe":
        import pymoe

        engine = pymoe.load(model, threads=threads, n_ctx=n_ctx, backend="cpu",
                            backend_options=dict(act_bits=act_bits))
        t_load = time.perf_counter()
        kv = engine.model.new_kv(len(first) + 1)
        token = int(np.argmax(engine.model.prefill(np.asarray(first), kv)[-1]))
        def fn(p, g, f=None):  # (prefill s, decode s, s of it spent making experts' copies on their first run)
            before = engine.backend.copy_seconds if engine.backend.repack else 0.0
            return (*time_pymoe(engine, p, g, f),
                    (engine.backend.copy_seconds if engine.backend.repack else 0.0) - before)

        extra = lambda: dict(expert_copies=engine.backend.expert_copies,  # noqa: E731
                             experts_in_place=engine.backend.experts_in_place,
                             budget=engine.backend.expert_budget) if engine.backend.repack else {}
    else:
        import llama_cpp
        from oracle import _plain_cpu_kernels

        if plain:
            _plain_cpu_kernels(llama_cpp)  # as the tests run it: without the AMX and repacked buffers
        llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              n_batch=512, verbose=False, logits_all=False)
        t_load = time.perf_counter()
        llm.eval(list(first))
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        fn = lambda p, g, f=None: (*time_llama(llm, p, g, f), 0.0)  # noqa: E731  (its copies: in the load call)
        extra = dict
    t1 = time.perf_counter()
    conn.send(dict(load_s=t_load - t0, first_token_s=t1 - t0, token=token, at_first=memory_status("self")))
    while True:
        request = conn.recv()
        if request is None:
            conn.send(extra())
            return
        prompt, n_gen, feed = request
        conn.send(fn(prompt, n_gen, feed))


def measure_engine(name: str, args, prompts: dict, feed, plain: bool) -> dict:
    """Start one engine's worker, time its first token, its prefills and decode (median of args.runs each), and
    sample its memory all along; the worker is gone when this returns."""
    import multiprocessing as mp

    kind, bits = ENGINES[name]
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    n_ctx = max(lengths + [128]) + args.gen_tokens + 16
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(kind, bits, args.model, args.threads, n_ctx, prompts[8].tolist(),
                                             plain, child))
    proc.start()
    child.close()
    sampler = PeakSampler(proc.pid)
    try:
        out = parent.recv()
    except EOFError:
        sampler.stop()
        proc.join()
        raise SystemExit(f"real_shape: the {name} worker died while loading {args.model} (exit code {proc.exitcode})")
    def ask(prompt, n_gen, f):  # -> (prefill seconds, decode seconds, copy seconds) of one request
        parent.send((prompt, n_gen, f))
        return parent.recv()

    for n in lengths:  # the first run of a prompt apart: pymoe makes its experts' repacked copies as they first run
        # (llama.cpp makes all of its copies in its load call); the median is of the runs after it
        out[f"prefill {n} first"] = n / ask(prompts[n], 0, None)[0]
        out[f"prefill {n}"] = statistics.median(n / ask(prompts[n], 0, None)[0] for _ in range(args.runs))
        print(f"  {name} prefill {n}: first run {out[f'prefill {n} first']:.2f} tok/s, then {out[f'prefill {n}']:.2f}",
              flush=True)
    decodes = [ask(prompts[128], args.gen_tokens, feed) for _ in range(args.runs)]
    out["decode"] = statistics.median(args.gen_tokens / d for _, d, _ in decodes)
    out["decode copies"] = (sum(c for _, _, c in decodes), sum(p + d for p, d, _ in decodes))  # (s, of s in all)
    sampler.sample()
    parent.send(None)
    out.update(parent.recv())
    out["peak"] = sampler.stop()  # VmHWM read before the worker exits (sampled above)
    proc.join()
    return out


def run(args) -> None:
    from compare_llamacpp import cpu_reports_amx
    import pymoe

    plain = args.llama_plain or cpu_reports_amx()
    load_before = os.getloadavg()
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    cfg = pymoe.load_gguf(args.model).config
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, 300, n) for n in sorted(set(lengths + [8, 128]))}  # trained tokens, not pads
    feed = rng.integers(0, 300, args.gen_tokens)
    results = {}
    for name in args.engines.split(","):
        print(f"{name}: loading ({time.strftime('%H:%M:%S')}, load average {os.getloadavg()[0]:.1f})", flush=True)
        results[name] = measure_engine(name, args, prompts, feed, plain)
        r = results[name]
        print(f"  {name}: first token {r['first_token_s']:.1f} s (load {r['load_s']:.1f} s)", flush=True)
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    why = "--llama-plain" if args.llama_plain else "the CPU reports AMX"
    how_llama = f"without its extra buffer types (plain kernels: {why})" if plain else "with its defaults"
    print(f"model {args.model}: {cfg.arch}, {cfg.n_layers} layers, {cfg.n_expert} experts top-{cfg.n_expert_used}, "
          f"hidden {cfg.n_embd}, expert width {cfg.n_ff_exp}, vocab {cfg.n_vocab}, "
          f"{os.path.getsize(args.model) / 2**30:.2f} GiB; {args.threads} threads; a prompt's first run, then the median "
          f"of {args.runs} run(s) after it; "
          f"engines one after another, each in its own process; llama.cpp "
          f"{how_llama}")
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}, after: {:.2f} {:.2f} {:.2f}".format(
        *load_before, *os.getloadavg()))
    names = list(results)
    rows = [("load to first token, s", lambda r: f"{r['first_token_s']:.1f}"),
            ("  of which load, s", lambda r: f"{r['load_s']:.1f}"),
            *[row for n in lengths for row in (
                (f"prefill {n} tok/s, first run", lambda r, n=n: f"{r[f'prefill {n} first']:.2f}"),
                (f"prefill {n} tok/s, runs after", lambda r, n=n: f"{r[f'prefill {n}']:.2f}"))],
            (f"decode {args.gen_tokens} tok/s", lambda r: f"{r['decode']:.2f}"),
            ("peak RSS (VmHWM), GiB", lambda r: gib(r["peak"]["VmHWM"])),
            ("peak RssAnon, GiB", lambda r: gib(r["peak"]["RssAnon"])),
            ("peak RssFile, GiB", lambda r: gib(r["peak"]["RssFile"])),
            ("RssAnon at first token, GiB", lambda r: gib(r["at_first"].get("RssAnon", 0))),
            ("RssFile at first token, GiB", lambda r: gib(r["at_first"].get("RssFile", 0)))]
    print(f"{'measure':<30}" + "".join(f"{n:>12}" for n in names))
    for label, cell in rows:
        print(f"{label:<30}" + "".join(f"{cell(results[n]):>12}" for n in names))
    for name, r in results.items():
        if "expert_copies" in r:
            print(f"{name}: experts' repacked copies {gib(r['expert_copies'])} GiB (budget {gib(r['budget'])} GiB), "
                  f"{r['experts_in_place']} experts read in place once the budget was spent; the decode requests "
                  f"spent {r['decode copies'][0]:.1f} s of their {r['decode copies'][1]:.1f} s making copies of "
                  f"experts on their first run")


# --- main --------------------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write the real-shape Q4_K_M file")
    mk.add_argument("-o", "--output", required=True, help="the Q4_K_M GGUF to write (keep it out of git)")
    mk.add_argument("--preset", default="qwen3-30b-a3b", help="a preset of pymoe/demo/tinymodel.py (default "
                    "qwen3-30b-a3b)")
    mk.add_argument("--jobs", type=int, default=2, help="processes drawing the random source (default 2)")
    mk.add_argument("--threads", type=int, default=2, help="llama.cpp quantizer threads (default 2)")
    mk.add_argument("--keep-source", action="store_true", help="keep the random Q2_K source (deleted by default)")
    mk.add_argument("--layers", type=int, default=6, help="layers quantized by llama.cpp, then repeated to the "
                    "preset's depth where a layer of their types belongs (default 6; 0: all)")
    rn = sub.add_parser("run", help="measure pymoe and llama.cpp on the file, side by side")
    rn.add_argument("model", help="GGUF file")
    rn.add_argument("--threads", type=int, default=2, help="threads for every engine (default 2)")
    rn.add_argument("--prompt-tokens", default="128,512", help="prefill prompt lengths (default 128,512)")
    rn.add_argument("--gen-tokens", type=int, default=32, help="decoded tokens after a 128-token prompt (default 32)")
    rn.add_argument("--runs", type=int, default=3, help="runs of each measurement after a prompt's first run; the median "
                    "is reported (default 3)")
    rn.add_argument("--llama-plain", action="store_true", help="llama.cpp without its extra CPU buffer types (its "
                    "plain kernels reading the memory map; the default on a CPU that reports AMX)")
    rn.add_argument("--engines", default="pymoe,pymoe8,llama",
                    help="engines in the order run (default pymoe,pymoe8,llama): pymoe (default path), pymoe8 "
                         "(--act-bits 8), llama (llama.cpp)")
    args = ap.parse_args(argv)
    if args.cmd == "make":
        make(args.output, args.preset, args.jobs, args.threads, args.keep_source, args.layers)
    else:
        run(args)


if __name__ == "__main__":
    main()
