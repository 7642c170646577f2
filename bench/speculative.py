"""Benchmark: decode tok/s with and without speculative decoding, side by side in one run, per prompt kind.

What this is: for one model (default: the embedded demo model) and each prompt (a code prompt, a prose prompt, and
the opening of a Python file the demo model never saw: the first held-out file of pymoe/demo/train.py's split),
greedy generation of --tokens tokens without speculation, with prompt lookup (`ngram`), with the model's MTP block
(`mtp`: in the file, or its companion .mtp.gguf beside it, as the demo's trained head) and, with --draft FILE, with
a draft model, for each k of --spec-k; per run the decode tok/s (median of --runs), the acceptance rate, tokens per verification step and
the distinct experts per forward (verification vs single-token steps). Every speculative run's tokens are checked
equal to the plain run's (greedy: they must be). CPU backend, no slot pool unless --cache-slots.
What this is not: a test (tests/test_speculative.py), or a measurement of a GPU's slot pool.

    PYTHONPATH=. python bench/speculative.py [model.gguf] [--draft small.gguf] --tokens 128 [-k 2,4] [--no-backoff]
                                             [--slots 4]   # + the server's scheduler, 4 slots busy at once
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


def heldout_prompt(n_bytes: int = 600) -> str:
    """The opening of the first file of the demo corpus's held-out split (never trained on) with n_bytes of text."""
    return heldout_prompts(1, n_bytes)[0]


def has_mtp(engine) -> bool:
    from pymoe.engine.speculative import mtp_companion

    return engine.model.file.mtp_plan() is not None or os.path.exists(mtp_companion(engine.model.file.path))


def heldout_prompts(n: int, n_bytes: int = 400) -> list:
    """The openings of the first n held-out files (one prompt per server slot)."""
    import sysconfig

    from pymoe.demo.train import is_heldout, stdlib_files

    root = sysconfig.get_paths()["stdlib"]
    out = []
    for f in (f for f in stdlib_files(root) if is_heldout(f)):
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            text = fh.read(n_bytes)
        if len(text) == n_bytes:
            out.append(text)
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} held-out files of {n_bytes} bytes")


def server_slots(path: str, n: int, drafters: list, k: int, tokens: int, runs: int, threads, no_backoff: bool):
    """--slots N: the server's scheduler in-process, N greedy jobs at once (N held-out openings), one row per
    drafter: aggregate decode tok/s (generated tokens / engine decode seconds, median of runs), the acceptance and
    tokens per verification step over all slots; every job's tokens checked equal to the plain run's."""
    from pymoe.engine.sampler import SamplingParams
    from pymoe.engine.speculative import SpecStats
    from pymoe.serve.scheduler import Job, Scheduler

    engine = pymoe.load(path, backend="cpu", threads=threads)
    prompts = [engine.tokenizer.encode(p) for p in heldout_prompts(n)]
    print(f"\nserver scheduler, {n} slots busy at once (held-out openings, {tokens} tokens each, k={k}, median of "
          f"{runs}): aggregate decode tok/s")
    print(f"{'drafter':<10} {'tok/s':>8} {'speed-up':>8} {'accept':>7} {'tok/step':>8} {'max batch':>9}")
    base = base_out = None
    for name in ["none"] + drafters:
        rates = []
        for _ in range(runs):
            with Scheduler(engine, parallel=n, kv="f32", spec=None if name == "none" else name, spec_k=k) as sched:
                if no_backoff and name != "none":
                    for slot in sched.slots:
                        slot.spec.backoff, slot.spec.pause = False, 0
                jobs = [sched.submit(Job(prompt_ids=p, max_tokens=tokens, ignore_eos=True,
                                         sampling=SamplingParams(temperature=0))) for p in prompts]
                for job in jobs:
                    list(job.events(timeout=600))
            rates.append(sched.totals["generated_tokens"] / sched.totals["decode_seconds"])
            out = [job.generated for job in jobs]
            if base_out is None:
                base_out = out
            elif out != base_out:
                raise SystemExit(f"slots/{name}: speculative output differs from plain decoding")
        rate = statistics.median(rates)
        base = base or rate
        st = SpecStats()
        if name != "none":  # the last run's jobs: each slot's stats are its last job's
            for slot in sched.slots:
                for f in ("steps", "drafted", "accepted"):
                    setattr(st, f, getattr(st, f) + getattr(slot.spec.stats, f))
        per = f"{(st.accepted + st.steps) / st.steps:.2f}" if st.steps else "1.00"
        acc = f"{100 * st.acceptance:.1f}%" if st.steps else "-"
        print(f"{name:<10} {rate:>8.1f} {rate / base:>8.2f} {acc:>7} {per:>8} {sched.max_batch:>9}")


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
    ap.add_argument("-k", "--spec-k", default="4", help="drafted tokens per step, or a list: 2,4 (default 4)")
    ap.add_argument("--no-backoff", action="store_true", help="draft on every step (no pause when speculation is "
                    "slower than plain steps): the acceptance of every step, at its cost")
    ap.add_argument("--runs", type=int, default=3, help="runs per setting; the median tok/s (default 3)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-slots", type=int, default=None, help="an emulated slot pool of N slots")
    ap.add_argument("--slots", type=int, default=0, help="also: the server's scheduler with this many slots busy "
                    "at once, with and without each drafter (0: not run)")
    args = ap.parse_args()

    path = args.model or demo.demo_model()
    engine = pymoe.load(path, backend="cpu", threads=args.threads, cache_slots=args.cache_slots)
    ks = [int(k) for k in str(args.spec_k).split(",")]
    drafters = ["ngram"] + (["mtp"] if has_mtp(engine) else []) + ([f"draft:{args.draft}"] if args.draft else [])
    specs = [("none", 0)] + [(d, k) for d in drafters for k in ks]
    print(f"model {path}: {engine.config.arch}, {engine.config.n_layers} layers, {engine.config.n_expert} experts "
          f"top-{engine.config.n_expert_used}; greedy, {args.tokens} tokens, k={args.spec_k}, median of {args.runs}"
          + (", no back-off" if args.no_backoff else ""))
    print(f"{'prompt':<8} {'drafter':<20} {'k':>2} {'tok/s':>8} {'speed-up':>8} {'accept':>7} {'tok/step':>8} "
          f"{'experts/step verify':>20} {'single':>7}")
    run_once(engine, engine.tokenizer.encode("warm up"), 8, None)  # compile, page in
    for kind, text in {**PROMPTS, "held-out": heldout_prompt()}.items():
        ids = engine.tokenizer.encode(text)
        base = None
        for spec_name, k in specs:
            rates, stats = [], None
            for _ in range(args.runs):
                spec = None if spec_name == "none" else engine.speculator(spec_name, k, threads=args.threads,
                                                                          backend="cpu")
                if spec is not None and args.no_backoff:
                    spec.backoff, spec.pause = False, 0
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
                print(f"{kind:<8} {spec_name:<20} {'-':>2} {rate:>8.1f} {1.0:>8.2f} {'-':>7} {'1.00':>8} {'-':>20} "
                      f"{engine.model.last_experts:>7}")
                continue
            per = (stats.accepted + stats.steps) / stats.steps if stats.steps else 0.0
            ve = stats.verify_experts / stats.steps if stats.steps else 0.0
            se = f"{stats.single_experts / stats.single_steps:.1f}" if stats.single_steps else "-"
            shown = spec_name if not spec_name.startswith("draft:") else "draft:" + os.path.basename(spec_name[6:])
            print(f"{kind:<8} {shown[:20]:<20} {k:>2} {rate:>8.1f} {rate / base:>8.2f} {100 * stats.acceptance:>6.1f}% "
                  f"{per:>8.2f} {ve:>20.1f} {se:>7}")
    if args.slots:
        server_slots(path, args.slots, [d for d in drafters if not d.startswith("draft:")], ks[-1], args.tokens,
                     args.runs, args.threads, args.no_backoff)


if __name__ == "__main__":
    main()
