"""Benchmark: how fast this machine gives a process fresh memory (the first write to each page), next to rewriting
memory the process already has.

What this is: the cost every engine pays to make weight copies in anonymous memory: pymoe's repacked experts (as
each expert first runs), llama.cpp's repacked buffers (in its load call). Writing a page for the first time is a
page fault: the kernel finds a free page and zeroes it. In a virtual machine whose host takes back the guest's free
memory (virtio-balloon free page reporting), that free page must first be handed back by the host, a fault of the
host's own, and memory freed a few seconds ago is taken back the same way. The script allocates --gib GiB (NumPy,
fresh anonymous pages), writes it, frees it, and allocates again after each wait of --waits seconds, printing GB/s
of first touch, and once the rate of writing the same memory again. On the project's 2-core VM (2026-12-07):
0.30-0.32 GB/s for memory freed 30 s or more before, 1.1-1.4 GB/s for memory freed 0-2 s before, 9.6-10.8 GB/s
rewriting (docs/performance.md, "Real shapes").
What this is not: a property of pymoe; a bare-metal Linux machine zeroes fresh pages at several GB/s.

    python bench/first_touch.py [--gib 1] [--waits 0,2,10,30]
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB allocated each time (default 1)")
    ap.add_argument("--waits", default="0,2,10,30", help="seconds between freeing and allocating again "
                    "(default 0,2,10,30)")
    args = ap.parse_args()
    n = int(args.gib * 2**30)
    t = time.perf_counter()
    a = np.ones(n, dtype=np.uint8)  # fresh pages, each written once
    first = time.perf_counter() - t
    t = time.perf_counter()
    a[...] = 2  # the same pages again: no fault
    again = time.perf_counter() - t
    print(f"first touch of {args.gib:g} GiB at start: {n / first / 1e9:.2f} GB/s; writing it again: "
          f"{n / again / 1e9:.2f} GB/s", flush=True)
    del a
    for wait in (float(w) for w in args.waits.split(",") if w):
        time.sleep(wait)
        t = time.perf_counter()
        a = np.ones(n, dtype=np.uint8)
        dt = time.perf_counter() - t
        del a
        print(f"first touch {wait:g} s after freeing as much: {n / dt / 1e9:.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
