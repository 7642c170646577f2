"""Benchmark: decode tok/s with and without speculative decoding, side by side in one run, per prompt kind.

What this is: for one model (default: the embedded demo model) and each prompt (a code prompt and a prose prompt),
greedy generation of --tokens tokens without speculation, with prompt lookup (`ngram`) and, with --draft FILE, with
a draft model; per run the decode tok/s (median of --runs), the acceptance rate, tokens per verification step and
the distinct experts per forward (verification vs single-token steps). Every speculative run's tokens are checked
equal to the plain run's (greedy: they must be). CPU backend, no slot pool unless --cache-slots.
What this is not: a test (tests/test_speculative.py), or a measurement of a GPU's slot pool.

    PYTHONPATH=. python bench/speculative.py [model.gguf] [--draft small.gguf] --tokens 128
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import pymoe
from pymoe import demo

PROMPTS = {
    "code": 'def parse_header(line):\n    """Split a header line into name and value."""\n    name, _, value = '
            'line.partition(":")\n    return name.strip().lower(), value.strip()\n\n\ndef parse_headers(lines):\n'
            '    """Parse header lines into a dict."""\n',
    "prose": "The expert cache keeps the most used experts of every layer in fast memory and reads the others from "
             "host memory when a token needs them. This note explains",
}


def run_once(engine, ids, n, spec):
    engine.model.count_experts = True  # plain runs count experts per step too (a speculator turns it off at its end)
    t0 = time.perf_counter()
    out = list(engine.generate(ids, max_tokens=n, stop_at_eos=False, spec=spec))
    return out, engine.last_stats, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="GGUF file (default: the demo model)")
    ap.add_argument("--draft", default=None, help="a draft model (same vocabulary) to compare as well")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run (default 128)")
    ap.add_argument("-k", "--spec-k", type=int, default=4, help="drafted tokens per step (default 4)")
    ap.add_argument("--runs", type=int, default=3, help="runs per setting; the median tok/s (default 3)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-slots", type=int, default=None, help="an emulated slot pool of N slots")
    args = ap.parse_args()

    path = args.model or demo.demo_model()
    engine = pymoe.load(path, backend="cpu", threads=args.threads, cache_slots=args.cache_slots)
    specs = ["none", "ngram"] + ([f"draft:{args.draft}"] if args.draft else [])
    print(f"model {path}: {engine.config.arch}, {engine.config.n_layers} layers, {engine.config.n_expert} experts "
          f"top-{engine.config.n_expert_used}; greedy, {args.tokens} tokens, k={args.spec_k}, median of {args.runs}")
    print(f"{'prompt':<7} {'drafter':<20} {'tok/s':>8} {'speed-up':>8} {'accept':>7} {'tok/step':>8} "
          f"{'experts/step verify':>20} {'single':>7}")
    run_once(engine, engine.tokenizer.encode("warm up"), 8, None)  # compile, page in
    for kind, text in PROMPTS.items():
        ids = engine.tokenizer.encode(text)
        base = None
        for spec_name in specs:
            rates, stats = [], None
            for _ in range(args.runs):
                spec = None if spec_name == "none" else engine.speculator(spec_name, args.spec_k, threads=args.threads,
                                                                          backend="cpu")
                out, st, _ = run_once(engine, ids, args.tokens, spec)
                rates.append(st.decode_tok_s)
                stats = spec.stats if spec is not None else None
                if base is None:
                    base_out = out
                elif out != base_out:
                    raise SystemExit(f"{kind}/{spec_name}: speculative output differs from plain decoding")
            rate = statistics.median(rates)
            base = base or rate
            if stats is None:
                print(f"{kind:<7} {spec_name:<20} {rate:>8.1f} {1.0:>8.2f} {'-':>7} {'1.00':>8} {'-':>20} "
                      f"{engine.model.last_experts:>7}")
                continue
            per = (stats.accepted + stats.steps) / stats.steps if stats.steps else 0.0
            ve = stats.verify_experts / stats.steps if stats.steps else 0.0
            se = f"{stats.single_experts / stats.single_steps:.1f}" if stats.single_steps else "-"
            shown = spec_name if spec_name == "ngram" else "draft:" + os.path.basename(spec_name[6:])
            print(f"{kind:<7} {shown[:20]:<20} {rate:>8.1f} {rate / base:>8.2f} {100 * stats.acceptance:>6.1f}% "
                  f"{per:>8.2f} {ve:>20.1f} {se:>7}")


if __name__ == "__main__":
    main()
