"""Benchmark: what each CPU technique gives on the current code, one technique turned off at a time.

What this is: the measurement behind docs/performance.md "The techniques, and what each gives". pymoe's CPU backend
on one file, once with everything on (the 8-bit path: `--act-bits 8`) and once per technique with only that one
turned off through its switch (an environment variable the code reads at import, so each variant is its own worker
process: the same fixed pseudo-random 128-token prompt, prefill tok/s, then decode tok/s of --gen-tokens greedy
tokens; the variants alternated run by run, --runs runs, medians). The ratio column is the variant's rate over the
everything-on rate: below 1.00, the technique gains that much. Every variant gives the same tokens: the switches
change speed, never a bit (each technique's test in docs/performance.md holds that).

    PYTHONPATH=. python bench/techniques.py /work/bigm/mid-Q4_K_M.gguf --threads 2 --runs 3
    PYTHONPATH=. python bench/techniques.py /work/bigm/mid-IQ2_XXS.gguf --variants decoded_tiles

Variants (name: what is turned off -> the switch):
    default_path: the 8-bit path itself -> the default 16-bit activations (act_bits 16)
    tiles: repacked 8-row tiles -> PYMOE_REPACK=0 (raw rows at 8 bits)
    vnni: VNNI (`vpdpbusd`) tile dots -> PYMOE_VNNI=0 (also drops the wide and pair forms, which need it)
    wide: two Q4_K chunks a 512-bit vector and the pair form -> PYMOE_WIDE=0
    pair: the pair form of the many-token tile dots -> PYMOE_PAIR=0
    stream_ahead: the one-token tile dot's hints 8 KiB ahead -> PYMOE_STREAM_AHEAD=0
    dense_q8_0_unhinted: Q8_0's dense dots without hints -> PYMOE_DENSE_AHEAD=8192 (every format's 8 KiB ahead)
    by_expert: one task per expert in decode -> PYMOE_BY_EXPERT=0 (the row tasks)
    q3_k_two_row, q8_0_two_row, mxfp4_two_row: the format's two-row dot (both planes, the tile unpacked once) ->
        PYMOE_TWICE=<format> (two one-token dots; switch-only: run them with --act-bits 15)
    huge_pages: repacked copies in 2 MiB pages -> PYMOE_HUGE=0
    decoded_tiles: IQ1-IQ3 experts decoded into tiles in prefill -> PYMOE_DECODE=0 (IQ files only)
    scaled: Q2_K and Q3_K tiles scaled into scratch in prefill -> PYMOE_SCALED=0 (the tile dots throughout)
--act-bits sets the width every variant but default_path runs at (8, the default; 15: the default width's two
planes).
What this is not: a side-by-side with llama.cpp (bench/compare_llamacpp.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pymoe  # noqa: E402

# name -> (activation bits, None: --act-bits; environment); "all_on" is the reference every other row is divided by
VARIANTS = {
    "all_on": (None, {}),
    "default_path": (16, {}),
    "tiles": (None, {"PYMOE_REPACK": "0"}),
    "vnni": (None, {"PYMOE_VNNI": "0"}),
    "wide": (None, {"PYMOE_WIDE": "0"}),
    "pair": (None, {"PYMOE_PAIR": "0"}),
    "stream_ahead": (None, {"PYMOE_STREAM_AHEAD": "0"}),
    "dense_q8_0_unhinted": (None, {"PYMOE_DENSE_AHEAD": "8192"}),
    "by_expert": (None, {"PYMOE_BY_EXPERT": "0"}),
    **{f"{q.lower()}_two_row": (None, {"PYMOE_TWICE": q}) for q in ("Q3_K", "Q8_0", "MXFP4")},
    "huge_pages": (None, {"PYMOE_HUGE": "0"}),
    "decoded_tiles": (None, {"PYMOE_DECODE": "0"}),
    "scaled": (None, {"PYMOE_SCALED": "0"}),
}
DEFAULT = "default_path,tiles,vnni,wide,pair,stream_ahead,by_expert,huge_pages"


def _worker(model: str, threads: int, n_ctx: int, act_bits: int, conn) -> None:
    """One engine in its own process (its switches were in the environment it was started with): load, then answer (prompt, n_gen) with (prefill s, decode s,
    the generated tokens)."""
    engine = pymoe.load(model, threads=threads, n_ctx=n_ctx, backend="cpu", backend_options=dict(act_bits=act_bits))
    model_ = engine.model
    conn.send(dict(arch=engine.config.arch))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone
            return
        if request is None:
            return
        prompt, n_gen = request
        kv = model_.new_kv(len(prompt) + n_gen + 1)
        t0 = time.perf_counter()
        logits = model_.prefill(prompt, kv)[-1]
        t1 = time.perf_counter()
        tokens = []
        for _ in range(n_gen):
            tokens.append(int(np.argmax(logits)))
            logits = model_.decode_one_token(tokens[-1], kv)
        conn.send((t1 - t0, time.perf_counter() - t1, tokens))


def main():
    import multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="runs per variant, alternated; medians (default 3)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--act-bits", type=int, default=8, help="the width of all_on and the switch-only variants "
                    "(default 8; 15: two planes)")
    ap.add_argument("--variants", default=DEFAULT,
                    help=f"comma-separated, each measured beside all_on (default {DEFAULT}; also: decoded_tiles, "
                    "scaled, dense_q8_0_unhinted and the *_two_row ones)")
    args = ap.parse_args()
    names = ["all_on"] + [v for v in args.variants.split(",") if v and v != "all_on"]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"techniques: unknown variant {unknown[0]!r} (known: {', '.join(VARIANTS)})")
    load_before = os.getloadavg()
    n_ctx = args.prompt_tokens + args.gen_tokens + 8
    ctx = mp.get_context("spawn")
    workers = {}
    for name in names:  # each started with its own switches in the environment, then the environment restored
        bits, env = VARIANTS[name]
        bits = args.act_bits if bits is None else bits
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(args.model, args.threads, n_ctx, bits, child))
        t0 = time.perf_counter()
        proc.start()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
        child.close()
        try:
            info = parent.recv()
        except EOFError:
            raise SystemExit(f"techniques: the {name} worker died while loading {args.model}")
        print(f"{name}: loaded and warmed in {time.perf_counter() - t0:.0f} s", flush=True)
        workers[name] = (proc, parent)
    n_vocab = pymoe.load_gguf(args.model).config.n_vocab
    prompt = np.random.default_rng(0).integers(0, n_vocab, args.prompt_tokens)
    pre = {n: [] for n in names}
    dec = {n: [] for n in names}
    outputs = {}
    for name in names:  # warm-up at full length (kernels' T>1 and decode forms compiled, the routed experts'
        workers[name][1].send((prompt, args.gen_tokens))  # repacked copies made): not timed
        workers[name][1].recv()
    for _ in range(args.runs):
        for name in names:
            time.sleep(0.3)
            workers[name][1].send((prompt, args.gen_tokens))
            p, d, tokens = workers[name][1].recv()
            pre[name].append(args.prompt_tokens / p)
            dec[name].append(args.gen_tokens / d)
            outputs.setdefault(name, tokens)
    for proc, conn in workers.values():
        conn.send(None)
        proc.join()
    print(f"model {args.model} ({info['arch']}); {args.threads} threads; median of {args.runs} runs, variants "
          f"alternated run by run; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    print(f"{'variant (turned off)':<22}{'prefill ' + str(args.prompt_tokens):>14}{'ratio':>8}"
          f"{'decode ' + str(args.gen_tokens):>12}{'ratio':>8}  same tokens")
    p0, d0 = statistics.median(pre["all_on"]), statistics.median(dec["all_on"])
    for name in names:
        p, d = statistics.median(pre[name]), statistics.median(dec[name])
        same = "yes" if outputs[name] == outputs["all_on"] else "NO"
        print(f"{name:<22}{p:>14.1f}{p / p0:>8.2f}{d:>12.1f}{d / d0:>8.2f}  {same}")
    if any(outputs[n] != outputs["all_on"] for n in names if VARIANTS[n][0] in (8, None)):
        raise SystemExit("techniques: a switch changed the tokens (it must change speed only)")


if __name__ == "__main__":
    main()
