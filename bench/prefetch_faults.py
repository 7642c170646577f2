"""Benchmark: major page faults and decode tok/s with and without the router lookahead's WILLNEED prefetch, from a
cold page cache.

What this is: for each setting, the model file's pages are dropped from the page cache first
(`posix_fadvise(POSIX_FADV_DONTNEED)`, which needs no privileges: clean pages of a file this process can open), the
model is loaded, and one greedy request of --tokens tokens runs; the process's major page faults (getrusage
ru_majflt: pages read from disk on first touch) during the request and its decode tok/s are printed. With
`--lookahead`, each next layer's predicted experts are advised MADV_WILLNEED a layer ahead, so the kernel reads
them while the current layer computes: their first touch is then a minor fault or none.
What this is not: a model larger than RAM (this machine cannot bound a process's memory below the model here: no
cgroup v2 memory controller), so pages stay cached once read; the cold start is where the difference shows.

    PYTHONPATH=. python bench/prefetch_faults.py model.gguf --tokens 64
"""
from __future__ import annotations

import argparse
import os
import resource
import time

import pymoe
from pymoe.experts.prefetch import Lookahead


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(path: str, n: int, k: int, threads) -> tuple[int, float, str]:
    drop_cache(path)
    e = pymoe.load(path, backend="cpu", threads=threads)
    line = ""
    if k:
        e.model.lookahead = Lookahead(e.model, k=k)
    ids = e.tokenizer.encode("The expert cache keeps the most used experts of every layer")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    t0 = time.perf_counter()
    list(e.generate(ids, max_tokens=n, stop_at_eos=False))
    dt = time.perf_counter() - t0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - before
    if k:
        line = e.model.lookahead.line()
    return faults, e.last_stats.decode_tok_s, f"{dt:.2f} s; {line}"


def main():
    import subprocess
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--lookahead", type=int, default=0, help="experts predicted per token (0: the model's K)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a single run, in a fresh process
    args = ap.parse_args()
    if args.one is not None:
        faults, tok_s, extra = run(args.model, args.tokens, args.one, args.threads)
        name = f"lookahead {args.one}, WILLNEED" if args.one else "no prefetch"
        print(f"{name:<26} major faults {faults:>7}  decode {tok_s:7.1f} tok/s  ({extra})", flush=True)
        return
    k = args.lookahead or pymoe.load_gguf(args.model).config.n_expert_used
    for kk in (0, k, 0, k):  # each in its own process: a file mapped by a live process keeps its pages cached
        cmd = [sys.executable, __file__, args.model, "--tokens", str(args.tokens), "--one", str(kk)]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
