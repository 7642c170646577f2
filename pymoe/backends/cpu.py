"""The CPU backend: NumPy for float matrices (BLAS), pymoe's fused Numba kernels for quantized ones.

What this is: `linear(w, x)` = x @ W.T for a stored weight W of any supported type, without ever dequantizing a
quantized W as a whole (quant/kernels.py decodes one block at a time). F32 weights are used in place (a view into
the memory map) through BLAS. Small float vectors (norms, biases, the shared-expert gate) are read once as float32.
What this is not: a cache. Experts reach this backend as raw bytes chosen by the expert cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numba
import numpy as np

from .. import quant
from ..loader import Tensor


@dataclass(frozen=True)
class DenseWeight:
    """A 2-D weight ready to multiply: float32 [R, C] (F32 files) or raw rows uint8 [R, row_bytes] + qtype."""

    qtype: quant.QType
    raw: np.ndarray
    shape: tuple  # (R, C)


class CPUBackend:
    name = "cpu"

    def __init__(self, threads: Optional[int] = None):
        if threads:
            numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
        self.threads = numba.get_num_threads()

    def warm_up(self, qtypes, progress: bool = False) -> None:
        """Compile (or load from Numba's on-disk cache) the kernels of these types now, at load time, so the first
        request's telemetry measures the model, not the compiler. A zero 1-row matrix is enough to trigger it."""
        from tqdm import tqdm

        todo = sorted(set(qtypes) - {quant.QType.F32}, key=lambda q: q.name)
        for qtype in tqdm(todo, desc="kernels (compiled on first use, then cached)", disable=not progress,
                          leave=False):
            fmt = quant.get_format(qtype)
            w = np.zeros((1, fmt.type_size), dtype=np.uint8)  # [1, row_bytes]: one block
            w.flags.writeable = False  # like the read-only mmap views: Numba compiles per array type
            quant.matvec(w, qtype, np.zeros(fmt.block_size, dtype=np.float32))
            quant.matmul(w, qtype, np.zeros((2, fmt.block_size), dtype=np.float32))

    def dense(self, t: Tensor) -> DenseWeight:
        if t.qtype == quant.QType.F32:
            return DenseWeight(t.qtype, np.asarray(t.data, dtype=np.float32).reshape(t.shape), t.shape)
        return DenseWeight(t.qtype, t.rows(), t.shape)

    def vector(self, t: Tensor) -> np.ndarray:
        return t.floats().reshape(-1)

    def linear(self, w: DenseWeight, x: np.ndarray) -> np.ndarray:
        """x float32 [T, C] -> [T, R]."""
        return self.linear_raw(w.raw, w.qtype, x)

    def linear_raw(self, raw: np.ndarray, qtype: quant.QType, x: np.ndarray) -> np.ndarray:
        """x float32 [T, C] @ W.T where W is stored as `raw` (float32 [R, C], or uint8 rows [R, row_bytes])."""
        if qtype == quant.QType.F32:
            w = raw if raw.dtype == np.float32 else raw.view(np.float32)  # [R, C]
            return x @ w.T  # [T, R]
        if x.shape[0] == 1:
            return quant.matvec(raw, qtype, x[0])[None, :]  # [1, R]: decode, one token
        return quant.matmul(raw, qtype, x)  # [T, R]: prefill, each weight block decoded once for all T
