"""Fused CPU kernels: quantized weights times activations, without ever dequantizing the whole matrix.

What this is: `matvec(w_raw, qtype, x)` (decode: one token) and `matmul(w_raw, qtype, X)` (prefill: T tokens), for
every format in the registry. Each output row walks its raw blocks in chunks of about CHUNK_WEIGHTS weights: the
format's Numba `decode_block` turns a chunk into float32 in a small per-thread scratch buffer (it stays in L1), and
the chunk is dotted with the matching slice of x (or of every token's row of X: each block is decoded once per
call, whatever T). Rows are spread over Numba's threads with `prange`; callers choose the count with
`numba.set_num_threads`, this module never sets it.
What this is not: the reference. The reference of `matvec(w, q, x)` is `dequantize(w, q) @ x` (NumPy, in
`pymoe.quant`); tests/test_kernels.py compares the two for every format. Nor is it a CUDA kernel (cuda_kernels/).

One kernel source, many formats. `_matvec_kernel` and `_matmul_kernel` below are written once, in terms of four
names they read as globals: DECODE_BLOCK, QK, TYPE_SIZE, CHUNK_BLOCKS. `_specialise` builds, per format, a fresh
Python function from the same code object with those names bound to the format's values, and compiles it. Numba
treats globals as compile-time constants, so each format gets straight-line code with its decoder inlined, and
unlike a closure (whose captured dispatcher pickles differently in every process, defeating `cache=True`) the
result is found again in Numba's on-disk cache by the next process. The cached function's name carries a hash of
the decoder's source files, because Numba's cache only watches this file: editing a decode_block must not
silently reuse a stale compiled kernel.

Numerics: each dot product accumulates in float32, like the float32 reference `dequantize(w) @ x` (BLAS sgemv).
The dot loop is compiled with fastmath {'reassoc', 'contract'} so LLVM may split the sum into SIMD lanes and use
FMA; the order of additions therefore differs from the reference's, and results agree within float32 summation
error (|error| <= C * 2^-24 * sum_i |w_i x_i| for C terms, the bound the tests check). The decoders are compiled
without fastmath, so decoded weights stay bit-exact with `dequantize`.

Shape legend: R rows, C cols (= n_blocks * QK), T tokens.
"""
from __future__ import annotations

import hashlib
import inspect
import os
import types
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from . import QType, QuantFormat, get_format

CHUNK_WEIGHTS = 256  # weights decoded per step (one K-quant block, 8 legacy blocks, 256 float values): 1 KiB
ROWS_PER_TASK = 8  # rows handled by one prange iteration; each iteration owns one scratch buffer
FASTMATH_DOT = {"reassoc", "contract"}  # allow SIMD partial sums and FMA in the dot product only


@njit(cache=True, fastmath=FASTMATH_DOT)
def dot(a, b):
    """sum_i a[i] * b[i] in float32 (a, b float32 [n]).

    The loop indexes from 0 over whole (sliced) arrays: Numba then can drop its negative-index wraparound test and
    LLVM turns the loop into SIMD fused multiply-adds (a loop over a[lo:hi] by absolute index would stay scalar).
    """
    acc = np.float32(0.0)
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


# ----------------------------------------------------------------------------------------------------------------
# The two kernel templates. DECODE_BLOCK, QK, TYPE_SIZE, CHUNK_BLOCKS are bound per format by _specialise; the
# placeholders below only make the templates readable (they are never compiled with these values).
# ----------------------------------------------------------------------------------------------------------------
DECODE_BLOCK = None
QK = TYPE_SIZE = CHUNK_BLOCKS = 0


def _matvec_kernel(w, x, y):
    # w uint8 [R, n_blocks * TYPE_SIZE], x float32 [C], y float32 [R] (written)
    n_rows = w.shape[0]
    n_blocks = w.shape[1] // TYPE_SIZE
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        scratch = np.empty(CHUNK_BLOCKS * QK, dtype=np.float32)  # [CHUNK_BLOCKS * QK] decoded weights
        for r in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            acc = np.float32(0.0)
            for b0 in range(0, n_blocks, CHUNK_BLOCKS):
                nb = min(CHUNK_BLOCKS, n_blocks - b0)
                w_chunk = scratch[:nb * QK]  # [nb * QK]
                DECODE_BLOCK(w[r, b0 * TYPE_SIZE:(b0 + nb) * TYPE_SIZE], w_chunk)
                acc += dot(w_chunk, x[b0 * QK:(b0 + nb) * QK])
            y[r] = acc


def _matmul_kernel(w, xs, y):
    # w uint8 [R, n_blocks * TYPE_SIZE], xs float32 [T, C], y float32 [T, R] (written)
    n_rows = w.shape[0]
    n_tokens = xs.shape[0]
    n_blocks = w.shape[1] // TYPE_SIZE
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in prange(n_tasks):
        scratch = np.empty(CHUNK_BLOCKS * QK, dtype=np.float32)  # [CHUNK_BLOCKS * QK] decoded weights
        acc = np.empty(n_tokens, dtype=np.float32)  # [T] one running dot product per token
        for r in range(task * ROWS_PER_TASK, min(n_rows, (task + 1) * ROWS_PER_TASK)):
            acc[:] = 0.0
            for b0 in range(0, n_blocks, CHUNK_BLOCKS):
                nb = min(CHUNK_BLOCKS, n_blocks - b0)
                w_chunk = scratch[:nb * QK]  # [nb * QK], decoded once, used by all T tokens
                DECODE_BLOCK(w[r, b0 * TYPE_SIZE:(b0 + nb) * TYPE_SIZE], w_chunk)
                for t in range(n_tokens):
                    acc[t] += dot(w_chunk, xs[t, b0 * QK:(b0 + nb) * QK])
            for t in range(n_tokens):
                y[t, r] = acc[t]


@dataclass(frozen=True)
class _Kernels:
    matvec: object  # (w uint8 [R, row_bytes], x float32 [C], y float32 [R]) -> None
    matmul: object  # (w uint8 [R, row_bytes], xs float32 [T, C], y float32 [T, R]) -> None


_KERNELS: dict[QType, _Kernels] = {}


def _decoder_fingerprint(fmt: QuantFormat) -> str:
    """A short hash of the source files the format's decoder is compiled from (its module and floats.py)."""
    paths = {inspect.getsourcefile(fmt.decode_block.py_func), os.path.join(os.path.dirname(__file__), "floats.py")}
    digest = hashlib.sha1()
    for path in sorted(paths):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def _specialise(template, fmt: QuantFormat):
    """Compile `template` for one format: its globals DECODE_BLOCK/QK/TYPE_SIZE/CHUNK_BLOCKS bound to fmt's."""
    constants = dict(
        DECODE_BLOCK=fmt.decode_block,
        QK=fmt.block_size,
        TYPE_SIZE=fmt.type_size,
        CHUNK_BLOCKS=max(1, CHUNK_WEIGHTS // fmt.block_size),
    )
    name = f"{template.__name__}_{fmt.name}_{_decoder_fingerprint(fmt)}"  # the on-disk cache key
    fn = types.FunctionType(template.__code__, {**template.__globals__, **constants}, name)
    fn.__qualname__ = name
    return njit(parallel=True, cache=True)(fn)


def kernels_for(fmt: QuantFormat) -> _Kernels:
    """The compiled (lazily, on first call) kernels of one format, built once per process."""
    if fmt.qtype not in _KERNELS:
        _KERNELS[fmt.qtype] = _Kernels(_specialise(_matvec_kernel, fmt), _specialise(_matmul_kernel, fmt))
    return _KERNELS[fmt.qtype]


# ----------------------------------------------------------------------------------------------------------------
# Public entry points: validate, view the weights as raw bytes, call the format's kernel.
# ----------------------------------------------------------------------------------------------------------------
def weight_rows(w_raw: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """Weights as GGUFReader gives them -> uint8 [R, row_bytes], C-contiguous, no copy when already contiguous.

    Quantized tensors arrive as uint8 [R, row_bytes]; F32 as float32 [R, C] and F16 as float16 [R, C] (values,
    one "block" each), which are viewed as their bytes.
    """
    w_raw = np.asarray(w_raw)
    if w_raw.ndim != 2:
        raise ValueError(f"{fmt.name} weights must be 2-D [rows, row_bytes or cols], got shape {w_raw.shape}")
    if w_raw.dtype != np.uint8 and not (fmt.block_size == 1 and w_raw.dtype.itemsize == fmt.type_size):
        raise ValueError(f"{fmt.name} weights must be raw uint8 bytes, got dtype {w_raw.dtype}")
    w = np.ascontiguousarray(w_raw).view(np.uint8)  # [R, row_bytes]
    if w.shape[1] % fmt.type_size:
        raise ValueError(f"{fmt.name} rows must be whole blocks of {fmt.type_size} bytes, got {w.shape[1]} bytes")
    return w


def cols_of(w: np.ndarray, fmt: QuantFormat) -> int:
    """Number of weights per row of raw rows w (uint8 [R, row_bytes])."""
    return w.shape[1] // fmt.type_size * fmt.block_size


def matvec(w_raw: np.ndarray, qtype, x: np.ndarray) -> np.ndarray:
    """y = W x with W given as raw rows of `qtype`: w_raw [R, row_bytes], x float32 [C] -> float32 [R]."""
    fmt = get_format(qtype)
    w = weight_rows(w_raw, fmt)  # [R, row_bytes]
    x = np.ascontiguousarray(x, dtype=np.float32)  # [C]
    if x.ndim != 1 or x.shape[0] != cols_of(w, fmt):
        raise ValueError(f"matvec: x must have shape ({cols_of(w, fmt)},) for {fmt.name} weights "
                         f"{w.shape[0]}x{cols_of(w, fmt)}, got {x.shape}")
    y = np.empty(w.shape[0], dtype=np.float32)  # [R]
    kernels_for(fmt).matvec(w, x, y)
    return y


def matmul(w_raw: np.ndarray, qtype, X: np.ndarray) -> np.ndarray:
    """Y = X W^T with W given as raw rows of `qtype`: w_raw [R, row_bytes], X float32 [T, C] -> float32 [T, R]."""
    fmt = get_format(qtype)
    w = weight_rows(w_raw, fmt)  # [R, row_bytes]
    X = np.ascontiguousarray(X, dtype=np.float32)  # [T, C]
    if X.ndim != 2 or X.shape[1] != cols_of(w, fmt):
        raise ValueError(f"matmul: X must have shape (T, {cols_of(w, fmt)}) for {fmt.name} weights "
                         f"{w.shape[0]}x{cols_of(w, fmt)}, got {X.shape}")
    Y = np.empty((X.shape[0], w.shape[0]), dtype=np.float32)  # [T, R]
    kernels_for(fmt).matmul(w, X, Y)
    return Y
