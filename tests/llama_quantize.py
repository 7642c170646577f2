"""llama.cpp's own quantizer, every ftype, importance matrix included: the writer of the ftype test files.

What this is: `llama_quantize(src, dst, ftype_name)` runs `llama_cpp.llama_model_quantize` (llama-quantize's code)
on an F32 GGUF. The IQ1/IQ2 ftypes refuse to run without an importance matrix; llama.h takes one as a
NULL-terminated array of `llama_model_imatrix_data {name, data, size}` (one float per input column and expert:
ne[0] * ne[2] values per tensor), so `importance_matrix` builds a random positive one (a stand-in for the mean squared
activations llama-imatrix would measure; any positive weights give valid files) and passes it for every ftype that
uses one. `FTYPES` lists every ftype of the pinned llama.cpp by name.
What this is not: pymoe code (pymoe reads these files; it does not write IQ types).
"""
import ctypes
import os

import numpy as np
from gguf import GGUFReader

from oracle import require_llama_cpp

# llama.h's llama_ftype names (LLAMA_FTYPE_MOSTLY_<name>), all but ALL_F32 and the removed ones.
FTYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L",
          "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M",
          "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4_MOE", "Q1_0", "Q2_0")
# Not here: NVFP4 (ftype 39): the pinned llama_model_quantize answers "invalid output file type 39" (it reads NVFP4
# tensors but does not write them); the format itself is checked block by block against ggml (tests/test_iquants.py).
# Ftypes llama.cpp refuses to write without an importance matrix (llama-quant.cpp: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
# and IQ2_S/IQ2_M's IQ2_XS tensors). The others are quantized with the same matrix too, which is what llama-quantize
# users do with --imatrix; TQ/MXFP4/NVFP4/Q1_0/Q2_0 ignore it.
NEEDS_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M"}


def importance_matrix(src: str, seed: int = 0) -> dict:
    """{tensor name: float32 [ne0 * ne2]} for every weight matrix of the GGUF at src (random, positive)."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in GGUFReader(src).tensors:
        ne = [int(n) for n in t.shape]  # ggml order: ne[0] = columns
        if len(ne) >= 2:
            n_expert = ne[2] if len(ne) == 3 else 1
            out[t.name] = rng.uniform(0.5, 2.0, ne[0] * n_expert).astype(np.float32)
    return out


def quietly(fn, *args):
    """fn(*args) with the process's stderr (fd 2, where llama.cpp logs a line per tensor) sent to /dev/null."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            return fn(*args)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def llama_quantize(src: str, dst: str, ftype: str, imatrix: bool = True) -> None:
    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    keep = []  # the arrays and names must outlive the call
    if imatrix:
        entries = importance_matrix(src)
        table = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for i, (name, values) in enumerate(entries.items()):
            keep += [name.encode(), values]
            table[i].name = keep[-2]
            table[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            table[i].size = values.size
        table[len(entries)].name = None  # the terminator
        params.imatrix = ctypes.cast(table, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(table)
    rc = quietly(llama_cpp.llama_model_quantize, src.encode(), dst.encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) returned {rc}")
