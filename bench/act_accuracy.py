#!/usr/bin/env python3
"""How close each activation width comes to the float model, beside llama.cpp's own run of the same file.

Usage:  PYTHONPATH=. python bench/act_accuracy.py [--archs A,B] [--ftypes F,G] [--preset tiny] [--columns C,D]

For each family x file type: the tiny random F32 model (make-tiny-model), quantized by llama.cpp's own quantizer
(`llama_model_quantize`), and
  - the float model: llama.cpp on an F32 copy of the quantized file (the same weights, float math, F32 KV cache);
  - "llama.cpp": llama.cpp on the quantized file itself (its own 8-bit activation blocks: Q8_K, Q8_0, Q8_1);
  - "pymoe 16", "pymoe 15", "pymoe 8", "pymoe auto": pymoe's CPU backend on the file with 16-bit activations, 15-bit
    ones as two 8-bit planes (qact.quantize_planes_ref), 8-bit ones, and with
    `--act-bits auto` (8-bit x for the routed experts, 16-bit for the rest); "auto, head 8": auto with the output
    head at 8 bits too (what the head's width costs).
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
# column -> the CPU backend's options (backends/cpu.py: act_bits, head_bits)
# ("pymoe default": no --act-bits, the width the file gets: backends/cpu.py `default_width`)
CONFIGS = {"pymoe default": dict(), "pymoe 16": dict(act_bits=16), "pymoe 15": dict(act_bits=15),
           "pymoe 8": dict(act_bits=8),
           "pymoe auto": dict(act_bits="auto"), "auto, head 8": dict(act_bits="auto", head_bits=8)}


def distance(logits: np.ndarray, ref: np.ndarray) -> tuple:
    """-> (mean |Δ| over every logit, share of positions with the reference's argmax)."""
    return float(np.abs(logits - ref).mean()), float((logits.argmax(-1) == ref.argmax(-1)).mean())


def quantized_files(f32_path: str, ftype: str, folder: str) -> tuple:
    """-> (the F32 file quantized to ftype by llama.cpp's own quantizer, an F32 copy of that file), made in folder
    once."""
    from llama_quantize import llama_quantize
    from pymoe.demo.tinymodel import write_f32_copy

    stem = os.path.basename(f32_path).replace(".gguf", "")
    path = os.path.join(folder, f"{stem}-{ftype}.gguf")
    copy = os.path.join(folder, f"{stem}-{ftype}-as-f32.gguf")
    if not os.path.exists(path):
        llama_quantize(f32_path, path, ftype)
    if not os.path.exists(copy):
        write_f32_copy(path, copy)
    return path, copy


def against_float(path: str, copy: str, n_vocab: int, columns: dict) -> dict:
    """{"llama.cpp": ..., column: ...}: (mean |Δ|, top-1) of llama.cpp on the file and of each column's logits
    (columns {name: function ids -> float32 [N_POS, V]}) against the float model, llama.cpp on the F32 copy, at
    N_POS random token ids (the same for every file of a vocabulary)."""
    from ftype_check import llama_logits

    ids = np.random.default_rng(0).integers(0, n_vocab, N_POS).tolist()
    ref = llama_logits(copy, ids)  # [50, V] float math on the file's weights
    out = {"llama.cpp": distance(llama_logits(path, ids), ref)}
    for c, logits in columns.items():
        out[c] = distance(logits(ids), ref)
    return out


def each_file(archs: str, ftypes: str, preset: str, measure_file) -> None:
    """For each family x file type: the tiny random F32 model written, then measure_file(arch, f32_path, ftype, folder)
    (which prints its row); a format the family's shapes cannot take (rows not a multiple of 256, ...) prints its
    error as the row."""
    from pymoe.demo.tinymodel import write_model

    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs.split(","):
            f32 = os.path.join(tmp, f"{preset}-{arch}-f32.gguf")
            write_model(f32, arch, preset, "f32", seed=0)
            for ftype in ftypes.split(","):
                try:
                    measure_file(arch, f32, ftype, tmp)
                except Exception as e:
                    print(f"| {arch} | {ftype} | {type(e).__name__}: {str(e)[:80]} |", flush=True)


def measure(f32_path: str, ftype: str, folder: str, configs=None) -> dict:
    """One file: {column: (mean |Δ|, top-1)} against the float model (llama.cpp on the F32 copy); configs: {column:
    CPU backend options} (default CONFIGS)."""
    import pymoe

    path, copy = quantized_files(f32_path, ftype, folder)
    configs = CONFIGS if configs is None else configs
    engines = {c: pymoe.load(path, backend="cpu", backend_options=o) for c, o in configs.items()}
    n_vocab = next(iter(engines.values())).config.n_vocab
    return against_float(path, copy, n_vocab, {c: e.logits for c, e in engines.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(FAMILIES))
    ap.add_argument("--ftypes", default=",".join(FTYPES))
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--columns", default=",".join(CONFIGS), help="pymoe's columns to run (of CONFIGS)")
    a = ap.parse_args()
    configs = {c: CONFIGS[c] for c in a.columns.split(",")}
    cols = ("llama.cpp", *configs)
    over = [c for c in configs if c != "pymoe 16"]  # the columns set beside llama.cpp's as a ratio
    print(f"| family | file | {' | '.join(cols)} | {' | '.join(f'{c} / llama.cpp' for c in over)} |")
    print("| --- | --- |" + " --- |" * (len(cols) + len(over)))
    ratios = {c: [] for c in over}
    within = {c: 0 for c in configs}  # files where the column is at or under llama.cpp's |Δ| with its top-1 or more
    n_files = 0

    def measure_file(arch, f32, ftype, tmp):
        nonlocal n_files
        r = measure(f32, ftype, tmp, configs)
        n_files += 1
        for c in configs:
            within[c] += r[c][0] <= r["llama.cpp"][0] and r[c][1] >= r["llama.cpp"][1]
        for c in over:
            ratios[c].append(r[c][0] / max(r["llama.cpp"][0], 1e-12))
        cells = " | ".join(f"{r[c][0]:.4f} ({r[c][1]:.2f})" for c in cols)
        print(f"| {arch} | {ftype} | {cells} | {' | '.join(f'{ratios[c][-1]:.2f}' for c in over)} |", flush=True)

    each_file(a.archs, a.ftypes, a.preset, measure_file)
    for c in over if n_files else ():
        print(f"\n{c} / llama.cpp mean |Δ|: median {np.median(ratios[c]):.2f}, max {max(ratios[c]):.2f} over "
              f"{n_files} files")
    for c in configs if n_files else ():
        print(f"{c}: at or under llama.cpp's |Δ| with top-1 >= llama.cpp's on {within[c]} of {n_files} files")


if __name__ == "__main__":
    main()
