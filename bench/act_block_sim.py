#!/usr/bin/env python3
"""What a rule for 8-bit activation blocks would give in accuracy, before any kernel is written for it.

Usage:  PYTHONPATH=. python bench/act_block_sim.py [--archs A,B] [--ftypes F,G] [--rules R,S] [--preset tiny]

The reference backend (plain NumPy float math) is run with every quantized weight's input x replaced by what a
rule's 8-bit blocks hold, dequant(quant(x)): the error of that rule's activation rounding and nothing else (the
weights are the file's, the products float). Rules (`RULES`):
  - "llama.cpp blocks": llama.cpp's own (ggml-cpu's vec_dot_type of each weight type): block_q8_K, per 256
    values, for the K-quants and IQ1-IQ4_XS; block_q8_0, per 32 with an fp16 scale, for Q8_0, Q4_0, Q2_0, MXFP4
    and IQ4_NL (qact.quantize_act_ref at 8 bits and qact.quantize_act32_ref: checked against ggml's reference
    quantizers).
    Its column against llama.cpp's real run says how well the simulation stands for a real engine on that file;
  - "per 32", "per 16": the block_q8_K-paired types' x in blocks of 32 or 16 values (block_q8_K's rounding: scale
    127 / max|x| per block, float32), the block_q8_0-paired ones as llama.cpp;
  - "all per 16": every type's x per 16 values.
F16 weights take x rounded to fp16 (what ggml-cpu does); F32 weights take x as it is, under every rule.
Each cell is mean |logit - float logit| over 50 random positions x the vocabulary, (top-1: the share of positions
whose argmax is the float model's), and the ratio to llama.cpp's real run of the same file, marked "!" where the
top-1 is below llama.cpp's: issue 50's rule is ratio <= 1 and no "!" on every file. The float model and the tiny
random files are bench/act_accuracy.py's (llama.cpp on an F32 copy of the quantized file).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from pymoe import quant  # noqa: E402
from pymoe.backends.reference import ReferenceBackend  # noqa: E402
from pymoe.gguf.config import ARCHS  # noqa: E402
from pymoe.quant import qact  # noqa: E402

FTYPES = ("Q2_K", "Q4_K_M", "Q2_0", "MXFP4_MOE", "IQ4_XS")


def blocks_q8k(x: np.ndarray, group: int) -> np.ndarray:
    """x float32 [T, C] -> the values block_q8_K's rounding gives per `group` values: iscale = 127 / max|x| (float32),
    q = rint(x * iscale), x' = q / iscale (an all-zero block stays 0). group 256 is qact.quantize_act_ref's 8 bits."""
    T, C = x.shape
    b = x.reshape(T, C // group, group)  # [T, nb, group]
    amax = np.abs(b).max(axis=-1, keepdims=True)  # [T, nb, 1]
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    d = np.where(amax > 0, np.float32(1) / np.where(amax > 0, iscale, 1), np.float32(0)).astype(np.float32)
    return (np.rint(b * iscale) * d).astype(np.float32).reshape(T, C)


def q8_0_paired(qtype) -> bool:
    """Whether ggml-cpu dots this type with x per 32 values: qact.ACT32_TYPES (Q4_0, Q8_0, IQ4_NL, MXFP4, Q2_0:
    block_q8_0) and the other 32-weight block types (Q5_0 with block_q8_0; Q4_1 and Q5_1 with block_q8_1, whose
    values are block_q8_0's); the 256-weight ones (K-quants, IQ1-IQ4_XS) take block_q8_K."""
    return qtype in qact.ACT32_TYPES or quant.get_format(qtype).block_size == qact.QK8_0


def llama_rule(x: np.ndarray, qtype) -> np.ndarray:
    """llama.cpp's 8-bit x for a weight of this type, as float32 [T, C] (C a multiple of its block)."""
    if q8_0_paired(qtype):
        return qact.dequantize_act(*qact.quantize_act32_ref(x)[:2])
    return qact.dequantize_act(*qact.quantize_act_ref(x, 8)[:2])


RULES = {
    "llama.cpp blocks": llama_rule,
    "per 32": lambda x, qt: llama_rule(x, qt) if q8_0_paired(qt) else blocks_q8k(x, 32),
    "per 16": lambda x, qt: llama_rule(x, qt) if q8_0_paired(qt) else blocks_q8k(x, 16),
    "all per 16": lambda x, qt: blocks_q8k(x, 16),
}


class BlockSimBackend(ReferenceBackend):
    """The reference backend with each quantized weight's x rounded as `rule` rounds it (None: float x)."""

    rule = None

    def linear_raw(self, raw: np.ndarray, qtype: quant.QType, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)  # [T, C]
        if qtype == quant.QType.F16:
            x = x.astype(np.float16).astype(np.float32)
        elif qtype != quant.QType.F32 and self.rule is not None:
            x = self.rule(x, qtype)
        return super().linear_raw(raw, qtype, x)


def measure(f32_path: str, ftype: str, folder: str, rules: dict) -> dict:
    """One file: {column: (mean |Δ|, top-1)} against the float model, for llama.cpp's real run ("llama.cpp") and
    each rule (bench/act_accuracy.py's files, positions and float model)."""
    import pymoe
    from act_accuracy import against_float, quantized_files

    assert "llama.cpp" not in rules  # (against_float's own column: llama.cpp's real run)
    path, copy = quantized_files(f32_path, ftype, folder)
    engine = pymoe.load(path, backend="reference")
    engine.backend.__class__ = BlockSimBackend  # the same instance (the model holds it), its products now ruled

    def ruled(rule):
        def logits(ids):
            engine.backend.rule = rule
            return engine.logits(ids)
        return logits

    return against_float(path, copy, engine.config.n_vocab, {name: ruled(rule) for name, rule in rules.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--ftypes", default=",".join(FTYPES))
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--preset", default="tiny")
    a = ap.parse_args()
    rules = {r: RULES[r] for r in a.rules.split(",")}
    from act_accuracy import each_file

    print(f"| family | file | llama.cpp (real) | {' | '.join(rules)} |")
    print("| --- | --- | --- |" + " --- |" * len(rules))
    ratios = {r: [] for r in rules}
    within = {r: 0 for r in rules}
    n = 0

    def measure_file(arch, f32, ftype, tmp):
        nonlocal n
        m = measure(f32, ftype, tmp, rules)
        n += 1
        real = m["llama.cpp"]
        cells = []
        for r in rules:
            ratio = m[r][0] / max(real[0], 1e-12)
            ratios[r].append(ratio)
            within[r] += ratio <= 1 and m[r][1] >= real[1]
            cells.append(f"{m[r][0]:.4f} ({m[r][1]:.2f}) {ratio:.2f}{'' if m[r][1] >= real[1] else '!'}")
        print(f"| {arch} | {ftype} | {real[0]:.4f} ({real[1]:.2f}) | {' | '.join(cells)} |", flush=True)

    each_file(a.archs, a.ftypes, a.preset, measure_file)
    for r in rules if n else ():
        q = np.percentile(ratios[r], [0, 50, 100])
        print(f"{r}: mean |Δ| / llama.cpp's real run {q[0]:.2f}-{q[2]:.2f} (median {q[1]:.2f}); at or under it "
              f"with its top-1 or more on {within[r]} of {n} files")


if __name__ == "__main__":
    main()
