"""Benchmark: major page faults and decode tok/s with and without the router lookahead's WILLNEED prefetch, from a
cold page cache.

What this is: for each setting, the model file's pages are dropped from the page cache first
(`posix_fadvise(POSIX_FADV_DONTNEED)`, which needs no privileges: clean pages of a file this process can open), the
model is loaded, and one greedy request of --tokens tokens runs; the process's major page faults (getrusage
ru_majflt: pages read from disk on first touch) during the request and its decode tok/s are printed. With
`--lookahead`, each next layer's predicted experts are advised MADV_WILLNEED a layer ahead, so the kernel reads
them while the current layer computes: their first touch is then a minor fault or none.
With `--memory-mib M` each run's process is put in a memory cgroup of its own bounded to M MiB (cgroup v2's
memory.max where the machine has the v2 memory controller, else v1's memory.limit_in_bytes; root needed): with M
below the process's own memory plus the model file, the file's pages are reclaimed as decoding goes on and come back
from disk, as for a model larger than RAM. The mapped file's pages are charged to the cgroup that faults them in.
What this is not: a disk benchmark (the file sits on whatever /tmp is), or a GPU measurement.

    PYTHONPATH=. python bench/prefetch_faults.py model.gguf --tokens 64 [--memory-mib 600]
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


CGROUP_V2, CGROUP_V1 = "/sys/fs/cgroup", "/sys/fs/cgroup/memory"


def memory_cgroup(name: str, mib: int) -> str:
    """A fresh memory cgroup bounded to `mib` MiB -> the path of its cgroup.procs (a process writes its pid there to
    join). v2 where the unified hierarchy has the memory controller, else v1."""
    v2 = os.path.join(CGROUP_V2, "cgroup.controllers")
    if os.path.exists(v2) and "memory" in open(v2).read().split():
        root, limit = CGROUP_V2, "memory.max"
    elif os.path.isdir(CGROUP_V1):
        root, limit = CGROUP_V1, "memory.limit_in_bytes"
    else:
        raise SystemExit("prefetch_faults: no memory cgroup controller here (neither v2 nor v1)")
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, limit), "w") as f:
        f.write(str(mib << 20))
    return os.path.join(path, "cgroup.procs")


def main():
    import subprocess
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--lookahead", type=int, default=0, help="experts predicted per token (0: the model's K)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--memory-mib", type=int, default=0, help="bound each run's memory (a cgroup; 0: unbounded)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a single run, in a fresh process
    args = ap.parse_args()
    if args.one is not None:
        faults, tok_s, extra = run(args.model, args.tokens, args.one, args.threads)
        name = f"lookahead {args.one}, WILLNEED" if args.one else "no prefetch"
        print(f"{name:<26} major faults {faults:>7}  decode {tok_s:7.1f} tok/s  ({extra})", flush=True)
        return
    k = args.lookahead or pymoe.load_gguf(args.model).config.n_expert_used
    procs = memory_cgroup(f"pymoe-bench-{os.getpid()}", args.memory_mib) if args.memory_mib else None
    if procs:
        print(f"each run bounded to {args.memory_mib} MiB ({os.path.dirname(procs)}); the model file is "
              f"{os.path.getsize(args.model) >> 20} MiB", flush=True)

    def join():  # in the child, before exec: the run and everything it maps is charged to the cgroup
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    try:
        for kk in (0, k, 0, k):  # each in its own process: a file mapped by a live process keeps its pages cached
            cmd = [sys.executable, __file__, args.model, "--tokens", str(args.tokens), "--one", str(kk)]
            cmd += ["--threads", str(args.threads)] if args.threads else []
            r = subprocess.run(cmd, preexec_fn=join if procs else None)
            if r.returncode:
                print(f"{'lookahead ' + str(kk) if kk else 'no prefetch'}: exit status {r.returncode}"
                      + (" (killed: the bound is below what the process needs)" if r.returncode < 0 else ""))
    finally:
        if procs:
            os.rmdir(os.path.dirname(procs))


if __name__ == "__main__":
    main()
