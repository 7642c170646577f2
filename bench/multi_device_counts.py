"""One device against two (pymoe/backends/multi_device.py), counted in Numba's CUDA simulator: per decoded token, the
kernel launches, host<->device bytes and host synchronisations of each device and of the whole run, and the greedy
tokens of both.

    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=. python bench/multi_device_counts.py [--families qwen3moe,glm4moe] [--tokens 8]

Each family's `tiny` preset (pymoe/demo/tinymodel.py, the q2_k mix, seed 0; 2-4 layers, so that two devices get
layers each) is decoded greedily from a 12-token prompt with a slot for every expert (every lookup hits on every
device, so one device and two make the same copies), the reference kernels standing in for the real ones (the
counts do not depend on them: backends/cuda.py LAUNCHES). Prints one Markdown row per family and setting
(docs/scaling-out.md, "The engine on several devices").
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pymoe  # noqa: E402
from pymoe.backends.device_counts import difference, per_token  # noqa: E402
from pymoe.demo.tinymodel import write_model  # noqa: E402

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 128, 200, 31]
MiB = 2**20
SIM = dict(kernels="reference", free_bytes=700 * MiB + 64 * MiB)  # a 64 MiB "device" beyond the reserve


def run(path: str, devices, tokens: int):
    cfg = pymoe.load(path, backend="reference").config
    e = pymoe.load(path, backend="cuda", backend_options=SIM, devices=devices, chunk=8,
                   cache_slots=len(cfg.moe_layers) * cfg.n_expert)
    before = e.backend.counts.snapshot("decode")
    per_before = e.backend.counts.per_device("decode") if devices else None
    out = list(e.generate(PROMPT, max_tokens=tokens, stop_at_eos=False))
    whole = difference(e.backend.counts.snapshot("decode"), before)
    per = ([difference(a, b) for a, b in zip(e.backend.counts.per_device("decode"), per_before)]
           if devices else [])
    ranges = [f"{r.start}-{r.stop - 1}" for r in e.backend.ranges] if devices else [f"0-{cfg.n_layers - 1}"]
    return out, whole, per, ranges


def cells(c: dict) -> str:
    m = per_token(c)
    return f"{m['launches']:.1f} | {m['bytes']:,.0f} | {m['synchronisations']:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="qwen3moe,glm4moe,qwen3next")
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args(argv)
    print("| family | devices | layers | launches / token | bytes / token | syncs / token | tokens equal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.families.split(","):
            path = os.path.join(tmp, f"tiny-{arch}.gguf")
            write_model(path, arch, "tiny", "q2_k", seed=0)
            t1, c1, _, r1 = run(path, None, args.tokens)
            t2, c2, per, r2 = run(path, "2", args.tokens)
            print(f"| {arch} | 1 | {r1[0]} | {cells(c1)} | |")
            print(f"| {arch} | 2, total | {' / '.join(r2)} | {cells(c2)} | {t1 == t2} |")
            for d, (r, c) in enumerate(zip(r2, per)):
                print(f"| {arch} | cuda:{d} | {r} | {cells(c)} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
