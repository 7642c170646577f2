"""One llama.cpp ftype through pymoe and llama.cpp (shared by tests/test_ftypes.py and bench/ftypes_vs_llamacpp.py).

`check_ftype(f32_path, ftype, folder)` quantizes the F32 tiny model with llama.cpp's quantizer and measures:
  - `exact_rel`: pymoe's reference backend (NumPy float) on the quantized file vs llama.cpp on an F32 copy of it:
    the same weights in float math (docs/testing.md's oracle for quantized files), relative to max |logit|;
  - `llama_rel`, `top1`: pymoe's default CPU backend vs llama.cpp, both on the quantized file (each with its own
    activation quantization), relative error and the share of positions with the same argmax;
  - `pool_equal`: greedy tokens through a 6-slot expert pool == without a pool (CPU backend).
"""
import collections
import os

import numpy as np

import pymoe
from llama_quantize import llama_quantize
from oracle import require_llama_cpp
from pymoe.demo.tinymodel import write_f32_copy
from pymoe.gguf.loader import load_gguf

N_LOGITS = 50
PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]
N_NEW = 10


def llama_logits(path: str, ids) -> np.ndarray:
    llm = require_llama_cpp().Llama(model_path=path, n_ctx=64, n_threads=2, n_batch=64, verbose=False,
                                    logits_all=True, type_k=0, type_v=0, seed=0)
    llm.eval(list(ids))
    out = np.array(llm.scores[:len(ids)], dtype=np.float32)  # [T, V]
    llm.close()
    return out


def check_ftype(f32_path: str, ftype: str, folder: str) -> dict:
    stem = os.path.basename(f32_path).replace(".gguf", "")
    path = os.path.join(folder, f"{stem}-{ftype}.gguf")
    if not os.path.exists(path):
        llama_quantize(f32_path, path, ftype)
    copy = os.path.join(folder, f"{stem}-{ftype}-as-f32.gguf")
    write_f32_copy(path, copy)
    types = collections.Counter(t.qtype.name for t in load_gguf(path).tensors.values())

    reference = pymoe.load(path, backend="reference")
    ids = np.random.default_rng(0).integers(0, reference.config.n_vocab, N_LOGITS).tolist()
    exact = reference.logits(ids)  # [50, V]
    on_copy = llama_logits(copy, ids)
    ours = pymoe.load(path).logits(ids)  # [50, V] default (CPU) backend
    theirs = llama_logits(path, ids)

    want = list(pymoe.load(path).generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    pooled = pymoe.load(path, cache_slots=6)
    got = list(pooled.generate(PROMPT, max_tokens=N_NEW, stop_at_eos=False))
    return dict(
        types=dict(types), ids=ids, exact=exact, on_copy=on_copy, ours=ours, theirs=theirs,
        exact_rel=float(np.abs(exact - on_copy).max() / np.abs(on_copy).max()),
        llama_rel=float(np.abs(ours - theirs).max() / np.abs(theirs).max()),
        # llama.cpp's own distance between its run on the file and on the F32 copy: its activation quantization
        llama_drift=float(np.abs(theirs - on_copy).max() / np.abs(theirs).max()),
        # pymoe's CPU backend (16-bit activations on K-quants, float elsewhere) against its float reference
        cpu_rel=float(np.abs(ours - exact).max() / np.abs(exact).max()),
        top1=float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
        pool_equal=got == want, promoted=pooled.cache.stats.counts["decode"]["promoted"])
