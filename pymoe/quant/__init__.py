"""Quantized weight formats: one registry, the reference dequantizers, the fused CPU kernels, the quantizers.

What this package is: every GGML tensor type pymoe reads (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K,
Q4_K, Q5_K, Q6_K, Q2_0), each described once in a `QuantFormat` with
  - `dequantize_ref`: a readable NumPy reference, bit-exact with `gguf.dequantize` (the oracle), or for a type
    gguf-py does not know (Q2_0) with llama.cpp's own `dequantize_row_*` (tests/test_q2_0.py);
  - `decode_block`: a Numba twin that decodes n consecutive blocks into a float32 scratch buffer, used by the fused kernels in
    `kernels.py` so a weight matrix is never dequantized as a whole;
  - `quantize`: float32 blocks -> raw blocks (gguf-py for the simple types, `quantize.py` for the K-quants,
    `q2_0.py` for Q2_0).
What it is not: a place for model logic. Callers pass raw bytes exactly as they sit in the GGUF mmap:
a weight matrix is `uint8 [rows, row_bytes]` with `row_bytes = cols // block_size * type_size`.

Shape legend: R rows (output features), C cols (input features), T tokens, B blocks, QK weights per block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import ggml_types  # noqa: F401  first: teaches gguf-py the types it lacks (Q2_0), see ggml_types.py

QType = GGMLQuantizationType


@dataclass(frozen=True)
class QuantFormat:
    qtype: QType
    block_size: int  # QK: weights per block
    type_size: int  # bytes per block
    dequantize_ref: Callable[[np.ndarray], np.ndarray]  # uint8 [B, type_size] -> float32 [B, QK]
    decode_block: object  # numba njit: (src uint8 [n * type_size], out float32 [n * QK]) -> None; n blocks
    quantize: Optional[Callable[[np.ndarray], np.ndarray]]  # float32 [B, QK] -> uint8 [B, type_size]
    layout: Optional[object] = None  # layout.Layout for formats described once as (scale, code); see layout.py

    @property
    def name(self) -> str:
        return self.qtype.name

    def row_bytes(self, cols: int) -> int:
        return cols // self.block_size * self.type_size


FORMATS: dict[QType, QuantFormat] = {}


def register(fmt: QuantFormat) -> QuantFormat:
    assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[fmt.qtype], fmt.qtype
    FORMATS[fmt.qtype] = fmt
    return fmt


def get_format(qtype) -> QuantFormat:
    """The format of a GGML type, or KeyError naming it if pymoe does not support it."""
    fmt = FORMATS.get(qtype)  # an int finds its QType key (IntEnum: equal hash and value); no enum call per matrix
    if fmt is not None:
        return fmt
    qtype = QType(qtype)
    if qtype not in FORMATS:
        raise KeyError(f"unsupported tensor type {qtype.name}")
    return FORMATS[qtype]


# The modules below fill FORMATS through register(); importing them is what makes a type supported.
from . import floats, legacy, kquants, q2_0, mxfp4, ternary, iquants  # noqa: E402,F401
from .kernels import matmul, matvec  # noqa: E402,F401


def dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    """Reference dequantization of raw rows: uint8 [..., row_bytes] -> float32 [..., cols] (NumPy, readable, slow)."""
    fmt = get_format(qtype)
    raw = np.ascontiguousarray(raw).view(np.uint8)
    lead, row_bytes = raw.shape[:-1], raw.shape[-1]
    blocks = raw.reshape(-1, fmt.type_size)  # [B, type_size]
    out = fmt.dequantize_ref(blocks)  # [B, QK]
    return out.reshape(*lead, row_bytes // fmt.type_size * fmt.block_size).astype(np.float32, copy=False)


def quantize(w: np.ndarray, qtype) -> np.ndarray:
    """float32 [..., cols] -> raw uint8 [..., row_bytes]; cols must be a multiple of the block size."""
    fmt = get_format(qtype)
    if fmt.quantize is None:
        raise KeyError(f"no quantizer for tensor type {fmt.name}")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.shape[-1] % fmt.block_size:
        raise ValueError(f"{fmt.name} needs rows of a multiple of {fmt.block_size} values, got {w.shape[-1]}")
    lead, cols = w.shape[:-1], w.shape[-1]
    out = fmt.quantize(w.reshape(-1, fmt.block_size))  # [B, type_size]
    return out.reshape(*lead, fmt.row_bytes(cols))
