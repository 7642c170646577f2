#!/usr/bin/env python3
"""How close each activation width comes to the float model, beside llama.cpp's own run of the same file.

Usage:  PYTHONPATH=. python bench/act_accuracy.py [--archs A,B] [--ftypes F,G] [--preset tiny]

For each family x file type: the tiny random F32 model (make-tiny-model), quantized by llama.cpp's own quantizer
(`llama_model_quantize`), and
  - the float model: llama.cpp on an F32 copy of the quantized file (the same weights, float math, F32 KV cache);
  - "llama.cpp": llama.cpp on the quantized file itself (its own 8-bit activation blocks: Q8_K, Q8_0, Q8_1);
  - "pymoe 16", "pymoe 8": pymoe's CPU backend on the file with 16- and 8-bit activations.
Each column is mean |logit - float logit| over 50 random positions x the whole vocabulary, and (in brackets) the
share of positions whose argmax equals the float model's. Tiny random-weight models have saturated routers, so
one rounding can flip an expert and move a position's logits far: the absolute figures are large, the ratio
between columns is what to read (docs/performance.md "Accuracy").
tests/test_act_accuracy.py checks the default width against llama.cpp's figure on a few of these files.
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from pymoe.gguf.config import ARCHS  # noqa: E402

FAMILIES = tuple(ARCHS)  # every family pymoe reads
FTYPES = ("Q2_K", "Q4_K_M", "Q2_0", "MXFP4_MOE", "IQ4_XS")
N_POS = 50


def distance(logits: np.ndarray, ref: np.ndarray) -> tuple:
    """-> (mean |Δ| over every logit, share of positions with the reference's argmax)."""
    return float(np.abs(logits - ref).mean()), float((logits.argmax(-1) == ref.argmax(-1)).mean())


def measure(f32_path: str, ftype: str, folder: str, widths=(16, 8)) -> dict:
    """One file: {column: (mean |Δ|, top-1)} against the float model (llama.cpp on the F32 copy)."""
    import pymoe
    from ftype_check import llama_logits
    from llama_quantize import llama_quantize
    from pymoe.demo.tinymodel import write_f32_copy

    stem = os.path.basename(f32_path).replace(".gguf", "")
    path = os.path.join(folder, f"{stem}-{ftype}.gguf")
    copy = os.path.join(folder, f"{stem}-{ftype}-as-f32.gguf")
    if not os.path.exists(path):
        llama_quantize(f32_path, path, ftype)
    if not os.path.exists(copy):
        write_f32_copy(path, copy)
    first = pymoe.load(path, backend="cpu", act_bits=widths[0])
    ids = np.random.default_rng(0).integers(0, first.config.n_vocab, N_POS).tolist()
    ref = llama_logits(copy, ids)  # [50, V] float math on the file's weights
    out = {"llama.cpp": distance(llama_logits(path, ids), ref)}
    for bits in widths:
        engine = first if bits == widths[0] else pymoe.load(path, backend="cpu", act_bits=bits)
        out[f"pymoe {bits}"] = distance(engine.logits(ids), ref)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(FAMILIES))
    ap.add_argument("--ftypes", default=",".join(FTYPES))
    ap.add_argument("--preset", default="tiny")
    a = ap.parse_args()
    from pymoe.demo.tinymodel import write_model

    cols = ("llama.cpp", "pymoe 16", "pymoe 8")
    print(f"| family | file | {' | '.join(cols)} | pymoe 8 / llama.cpp |")
    print("| --- | --- |" + " --- |" * (len(cols) + 1))
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in a.archs.split(","):
            f32 = os.path.join(tmp, f"{a.preset}-{arch}-f32.gguf")
            write_model(f32, arch, a.preset, "f32", seed=0)
            for ftype in a.ftypes.split(","):
                try:
                    r = measure(f32, ftype, tmp)
                except Exception as e:  # a format the family's shapes cannot take (rows not a multiple of 256, ...)
                    print(f"| {arch} | {ftype} | {type(e).__name__}: {str(e)[:80]} |", flush=True)
                    continue
                ratio = r["pymoe 8"][0] / max(r["llama.cpp"][0], 1e-12)
                ratios.append(ratio)
                cells = " | ".join(f"{r[c][0]:.4f} ({r[c][1]:.2f})" for c in cols)
                print(f"| {arch} | {ftype} | {cells} | {ratio:.2f} |", flush=True)
    if ratios:
        print(f"\npymoe 8 / llama.cpp mean |Δ|: median {np.median(ratios):.2f}, max {max(ratios):.2f} over "
              f"{len(ratios)} files")


if __name__ == "__main__":
    main()
