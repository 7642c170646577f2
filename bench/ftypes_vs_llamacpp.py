#!/usr/bin/env python3
"""Every llama.cpp ftype, quantized by llama.cpp, run by pymoe and by llama.cpp: the table of issue 14.

Usage:  python bench/ftypes_vs_llamacpp.py [--arch ARCH] [FTYPE ...]   (default: qwen3moe, all of FTYPES)

For each ftype, on the tiny random qwen3moe (2 layers, 8 experts, every row a multiple of 256):
  - the F32 file quantized by `llama_cpp.llama_model_quantize` (with a random importance matrix),
  - "exact": pymoe's reference backend on that file vs llama.cpp on an F32 copy of it (same weights, float math),
  - "llama.cpp": pymoe's default (CPU) backend on the file vs llama.cpp on the file itself (both quantize
    activations their own way for some types, so this is the everyday comparison),
  - "pool": greedy tokens with a 6-slot expert pool equal those without.
  - "drift": llama.cpp on the file vs llama.cpp on the F32 copy (its own 8-bit activation rounding).
Figures are max |difference| / max |logit| over 50 positions of the full vocabulary.
tests/test_ftypes.py runs the same comparison with bounds.
"""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ftype_check import check_ftype  # noqa: E402
from llama_quantize import FTYPES  # noqa: E402
from pymoe.demo.tinymodel import write_model  # noqa: E402


def main(names, arch="qwen3moe"):
    with tempfile.TemporaryDirectory() as tmp:
        f32 = os.path.join(tmp, f"tiny-{arch}-f32.gguf")
        write_model(f32, arch, "tiny", "f32", seed=0)
        print(f"{arch}: {'ftype':10} {'tensor types':58} {'exact':>9} {'llama.cpp':>9} {'drift':>9} {'top-1':>6} "
              f"{'pool':>5} {'s':>5}")
        for ftype in names:
            t0 = time.time()
            r = check_ftype(f32, ftype, tmp)
            types = " ".join(f"{k}:{v}" for k, v in sorted(r["types"].items()))
            print(f"{ftype:10} {types:58} {r['exact_rel']:9.1e} {r['llama_rel']:9.1e} {r['llama_drift']:9.1e} {r['top1']:6.2f} "
                  f"{'equal' if r['pool_equal'] else 'DIFF':>5} {time.time() - t0:5.1f}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    arch = "qwen3moe"
    if args[:1] == ["--arch"]:
        arch, args = args[1], args[2:]
    main(args or FTYPES, arch)
