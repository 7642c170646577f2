"""llama.cpp's own ggml row functions, called through ctypes from the libggml-base that llama-cpp-python ships.

What this is: the oracle for GGML types gguf-py does not implement (Q2_0): `ggml_dequantize(raw, qtype)` runs ggml's
`dequantize_row_<type>` (the type's `to_float` in ggml.c's type traits), `ggml_quantize_ref(w, qtype)` its
`quantize_row_<type>_ref` (`from_float_ref`, what llama-quantize runs without an importance matrix), and
`ggml_type_info(qtype)` its `ggml_blck_size` / `ggml_type_size` / `ggml_type_name`. Every call resolves the library
through `require_llama_cpp()`, so a test that needs it skips (fails in CI) without the pinned oracle, like
tests/oracle.py's other users.
What this is not: pymoe code; nothing in pymoe/ links against ggml.
"""
import ctypes
import pathlib

import numpy as np
import pytest

from oracle import require_llama_cpp


def libggml_base() -> ctypes.CDLL:
    llama_cpp = require_llama_cpp()
    libs = sorted((pathlib.Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.*"))
    if not libs:
        pytest.skip("llama-cpp-python has no libggml-base in its lib folder")
    return ctypes.CDLL(str(libs[0]))


def _row_function(name: str):
    lib = libggml_base()
    if not hasattr(lib, name):
        pytest.skip(f"libggml-base does not export {name}")
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]  # (src, dst, number of weights)
    return fn


def _c_name(qtype) -> str:
    return qtype.name.lower().replace("_k", "_K")  # ggml spells K-quants q2_K ... q6_K


def ggml_type_info(qtype) -> tuple:
    """(block size, type size, type name) as libggml-base reports them for the type id."""
    lib = libggml_base()
    lib.ggml_blck_size.restype = ctypes.c_int64
    lib.ggml_type_size.restype = ctypes.c_size_t
    lib.ggml_type_name.restype = ctypes.c_char_p
    for fn in (lib.ggml_blck_size, lib.ggml_type_size, lib.ggml_type_name):
        fn.argtypes = [ctypes.c_int]
    return lib.ggml_blck_size(int(qtype)), lib.ggml_type_size(int(qtype)), lib.ggml_type_name(int(qtype)).decode()


def ggml_dequantize(raw: np.ndarray, qtype, block_size: int) -> np.ndarray:
    """uint8 [..., row_bytes] -> float32 [..., cols] by ggml's dequantize_row_<type>."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    blocks = raw.reshape(-1, raw.shape[-1])
    n = blocks.size // ggml_type_info(qtype)[1] * block_size  # weights in all
    out = np.empty(n, dtype=np.float32)
    _row_function(f"dequantize_row_{_c_name(qtype)}")(blocks.ctypes.data, out.ctypes.data, n)
    return out.reshape(*raw.shape[:-1], -1)


def ggml_quantize_ref(w: np.ndarray, qtype) -> np.ndarray:
    """float32 [B, block_size] -> uint8 [B, type_size] by ggml's quantize_row_<type>_ref."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    block_size, type_size, _ = ggml_type_info(qtype)
    out = np.zeros((w.size // block_size, type_size), np.uint8)
    _row_function(f"quantize_row_{_c_name(qtype)}_ref")(w.ctypes.data, out.ctypes.data, w.size)
    return out
