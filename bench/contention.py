"""Benchmark: decode speed on a shared machine, alone and beside 1 and 2 CPU-bound processes, old and new defaults.

What this is: for each model file (the demo model when none is given) and each number of busy processes (`--busy`,
default 0,1,2), `pymoe run FILE -n N` in a fresh process per measurement, its decode tok/s read from the telemetry
line, median over `--rounds`. The busy processes are plain Python loops (one core each), started before the run
and ended after it; every one also ends by itself after --max-busy-s. Two configurations alternate run by run, so a
host's drift reaches both alike:
    old   PYMOE_ADAPT_THREADS=0: a fixed team of every core (the defaults before backends/threads.py)
    new   the defaults: the team shrinks to the cores the others leave free (backends/threads.py)
`--config` adds any other environment as NAME=VAR=VALUE[,VAR=VALUE] (e.g. passive=OMP_WAIT_POLICY=PASSIVE).
The table gives tok/s and each figure as a share of the same configuration's quiet figure (a fair share beside two
busy processes on 2 cores is 33%).
What this is not: a kernel benchmark (bench/bench_forward.py), or a measurement on a quiet machine: run it when
nothing else runs.

    PYTHONPATH=. python bench/contention.py [FILE ...] --rounds 3
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATE = re.compile(r"(\d+) generated in [\d.]+ ms \(([\d.]+) tok/s\)")
CONFIGS = {"old": {"PYMOE_ADAPT_THREADS": "0"}, "new": {}}


def spin(seconds: float) -> None:
    """One core busy until killed, or `seconds` at most."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def decode_rate(path, tokens, env_extra, threads=None) -> float:
    """One `pymoe run` -> its decode tok/s (the demo model when path is None)."""
    cmd = [sys.executable, "-m", "pymoe", "run", *([path] if path else []), "-n", str(tokens), "--temp", "0"]
    cmd += ["-p", "def main(argv):\n"] + (["-t", str(threads)] if threads else [])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, timeout=600)
    m = RATE.search(r.stderr)
    if r.returncode != 0 or m is None:
        raise SystemExit(f"contention: {' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return float(m.group(2))


def measure(path, busy, config, tokens, max_busy_s, threads=None) -> float:
    procs = [mp.Process(target=spin, args=(max_busy_s,), daemon=True) for _ in range(busy)]
    for p in procs:
        p.start()
    try:
        time.sleep(0.2 if busy else 0)  # the busy loops are running
        return decode_rate(path, tokens, CONFIGS[config], threads)
    finally:
        for p in procs:
            p.terminate()
            p.join()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="GGUF files (default: the demo model)")
    ap.add_argument("--busy", default="0,1,2", help="busy processes beside pymoe (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded per run")
    ap.add_argument("--configs", default="old,new", help="configurations to alternate (comma-separated)")
    ap.add_argument("--config", action="append", default=[], help="NAME=VAR=VALUE[,VAR=VALUE]: another one")
    ap.add_argument("--max-busy-s", type=float, default=300.0, help="a busy process ends by itself after this")
    a = ap.parse_args(argv)
    for spec in a.config:
        name, _, assigns = spec.partition("=")
        CONFIGS[name] = dict(kv.split("=", 1) for kv in assigns.split(","))
    configs = [c for c in a.configs.split(",") if c] + [s.partition("=")[0] for s in a.config]
    busy_levels = [int(b) for b in a.busy.split(",")]
    files = a.files or [None]
    print(f"contention: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    rates = {}  # (file, busy, config) -> [tok/s]
    for r in range(a.rounds):
        for path in files:
            for busy in busy_levels:
                for config in (configs if r % 2 == 0 else configs[::-1]):
                    rate = measure(path, busy, config, a.tokens, a.max_busy_s)
                    rates.setdefault((path, busy, config), []).append(rate)
                    print(f"  round {r + 1}: {os.path.basename(path or 'demo')} beside {busy} busy, {config}: "
                          f"{rate:.1f} tok/s", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end; median of {a.rounds} runs, decode of {a.tokens} tokens")
    head = "| file | busy processes | " + " | ".join(f"{c} tok/s (of quiet)" for c in configs) + " |"
    print(head)
    print("|" + " --- |" * (2 + len(configs)))
    for path in files:
        quiet = {c: statistics.median(rates[(path, 0, c)]) for c in configs if (path, 0, c) in rates}
        for busy in busy_levels:
            cells = []
            for c in configs:
                med = statistics.median(rates[(path, busy, c)])
                share = f" ({100 * med / quiet[c]:.0f}%)" if c in quiet and busy else ""
                runs = "/".join(f"{v:.0f}" for v in rates[(path, busy, c)])
                cells.append(f"{med:.1f}{share} [{runs}]")
            print(f"| {os.path.basename(path or 'demo')} | {busy} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
