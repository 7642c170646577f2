"""The CPU backend: NumPy for float matrices (BLAS), pymoe's fused Numba kernels for quantized ones.

What this is: `linear(w, x)` = x @ W.T for a stored weight W of any supported type, without ever dequantizing a
quantized W as a whole (quant/kernels.py decodes one block at a time). F32 weights are used in place (a view into
the memory map) through BLAS. Small float vectors (norms, biases, the shared-expert gate) are read once as float32.
Two paths for quantized weights:
  - fast (the default): K-quant weights (Q2_K..Q6_K, rows of whole 256-blocks) take the integer path, as
    llama.cpp does: x is quantized per 256 values (to 16 bits; `act_bits=8` or PYMOE_ACT_BITS=8 for llama.cpp's
    8) and each block is dotted in integer arithmetic (quant/qact.py); the routed experts of a layer run in one
    fused kernel (`moe_experts`: gate + up + SwiGLU, then down with the routing weights, all chosen experts and
    tokens in one parallel call);
  - exact (`CPUBackend(exact=True)`, or the environment variable PYMOE_EXACT=1): every quantized weight goes
    through the float kernels (decode a block to float32, dot with float x), and moe.py runs one expert at a
    time. This is the reference the fast path is tested against.
What this is not: a cache. Experts reach this backend as raw bytes chosen by the expert cache.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numba
import numpy as np
from numba import njit, prange

from .. import quant
from ..loader import Tensor
from ..quant import kernels
from ..quant.kernels import dot
from ..quant.qact import ACT_DTYPES, QK_K, has_int_dot


@njit(parallel=True, cache=True)
def attention_rows(q, k, v, p0, out):
    """Causal GQA attention, each (query, head) on its own: q [T, H, Dh], k [S, G, Dh], v [S, G, Dv] (S = p0 + T)
    -> out float32 [T, H * Dv] (written). The math of model.attention, in an order that depends only on the query's
    position, not on T: query t gives the same bits in a prefill of T tokens as alone in decode_one_token. The
    integer path needs that: it rounds activations, which would turn float-order noise (~1e-7) into rounding
    flips (~1e-4 in the logits of the tiny test models)."""
    T, H, Dh = q.shape
    S, G, Dv = v.shape
    sqrt_dh = np.float32(np.sqrt(Dh))
    for task in prange(T * H):
        t, h = task // H, task % H
        g = h // (H // G)  # the KV head query head h reads
        n = p0 + t + 1  # keys 0 .. p0 + t: causal
        scores = np.empty(n, dtype=np.float32)  # [n]
        top = np.float32(-np.inf)
        for s in range(n):
            scores[s] = dot(q[t, h], k[s, g]) / sqrt_dh
            top = max(top, scores[s])
        total = np.float32(0.0)
        for s in range(n):
            scores[s] = np.exp(scores[s] - top)
            total += scores[s]
        o = out[t, h * Dv:(h + 1) * Dv]  # [Dv]
        o[:] = 0.0
        for s in range(n):
            p = scores[s] / total
            vs = v[s, g]
            for d in range(Dv):
                o[d] += p * vs[d]


@dataclass(frozen=True)
class DenseWeight:
    """A 2-D weight ready to multiply: float32 [R, C] (F32 files) or raw rows uint8 [R, row_bytes] + qtype."""

    qtype: quant.QType
    raw: np.ndarray
    shape: tuple  # (R, C)


class CPUBackend:
    name = "cpu"

    def __init__(self, threads: Optional[int] = None, exact: Optional[bool] = None, act_bits: Optional[int] = None):
        if threads:
            numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
        self.threads = numba.get_num_threads()
        self.exact = os.environ.get("PYMOE_EXACT", "0") not in ("", "0") if exact is None else bool(exact)
        self.act_bits = int(act_bits or os.environ.get("PYMOE_ACT_BITS", 16))  # 16 or 8: see quant/qact.py
        if self.act_bits not in ACT_DTYPES:
            raise ValueError(f"act_bits must be 8 or 16, got {self.act_bits}")

    def warm_up(self, qtypes, progress: bool = False) -> None:
        """Compile (or load from Numba's on-disk cache) the kernels of these types now, at load time, so the first
        request's telemetry measures the model, not the compiler. A zero 1-row matrix is enough to trigger it."""
        from tqdm import tqdm

        skip = {quant.QType.F32} if self.exact else set()  # exact mode: F32 goes through BLAS, nothing to compile
        todo = sorted(set(qtypes) - skip, key=lambda q: q.name)
        for qtype in tqdm(todo, desc="kernels (compiled on first use, then cached)", disable=not progress,
                          leave=False):
            fmt = quant.get_format(qtype)
            w = np.zeros((1, fmt.type_size), dtype=np.uint8)  # [1, row_bytes]: one block
            w.flags.writeable = False  # like the read-only mmap views: Numba compiles per array type
            quant.matvec(w, qtype, np.zeros(fmt.block_size, dtype=np.float32))
            quant.matmul(w, qtype, np.zeros((2, fmt.block_size), dtype=np.float32))
            if not self.exact and has_int_dot(qtype, QK_K):
                w = np.zeros((1, fmt.row_bytes(QK_K)), dtype=np.uint8)  # [1, row_bytes]: one 256-block
                w.flags.writeable = False
                for T in (1, 2):
                    kernels.matmul_act(w, qtype, np.zeros((T, QK_K), dtype=np.float32), self.act_bits)
        if not self.exact:  # the row-by-row attention of the fast path
            self.attention(np.zeros((2, 2, 2), np.float32), np.zeros((2, 1, 2), np.float32),
                           np.zeros((2, 1, 2), np.float32), 0)

    def warm_up_experts(self, expert_types: dict) -> None:
        """Compile (or load) the fused expert kernel of one gate/up/down type triple."""
        qtypes = tuple(expert_types[p] for p in ("gate", "up", "down"))
        if self.exact or not all(has_int_dot(q, QK_K) for q in qtypes):
            return
        gate, up, down = (np.zeros((QK_K, quant.get_format(q).row_bytes(QK_K)), dtype=np.uint8) for q in qtypes)
        ex = (gate, up, down)  # a 256 x 256 expert (D = F = 256)
        x = np.zeros((1, QK_K), dtype=np.float32)
        kernels.moe_act([ex], qtypes, x, [(np.zeros(1, np.int64), np.ones(1, np.float32))], self.act_bits)

    def dense(self, t: Tensor) -> DenseWeight:
        if t.qtype == quant.QType.F32:
            return DenseWeight(t.qtype, np.asarray(t.data, dtype=np.float32).reshape(t.shape), t.shape)
        return DenseWeight(t.qtype, t.rows(), t.shape)

    def vector(self, t: Tensor) -> np.ndarray:
        return t.floats().reshape(-1)

    def linear(self, w: DenseWeight, x: np.ndarray) -> np.ndarray:
        """x float32 [T, C] -> [T, R]."""
        return self.linear_raw(w.raw, w.qtype, x)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, p0: int) -> np.ndarray:
        """model.attention's contract (q [T, H, Dh], k [S, G, Dh], v [S, G, Dv] -> [T, H * Dv]). Exact mode: that
        function (NumPy einsum); fast mode: `attention_rows`, whose bits do not depend on T."""
        if self.exact:
            from ..model import attention

            return attention(q, k, v, p0)
        out = np.empty((q.shape[0], q.shape[1] * v.shape[2]), dtype=np.float32)  # [T, H * Dv]
        f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731  (a KV cache may store f16)
        attention_rows(f32(q), f32(k), f32(v), p0, out)
        return out

    def linear_raw(self, raw: np.ndarray, qtype: quant.QType, x: np.ndarray) -> np.ndarray:
        """x float32 [T, C] @ W.T where W is stored as `raw` (float32 [R, C], or uint8 rows [R, row_bytes])."""
        if qtype == quant.QType.F32 and not self.exact:  # fast path: per-row order independent of T (as above)
            return quant.matmul(raw, qtype, x) if x.shape[0] > 1 else quant.matvec(raw, qtype, x[0])[None, :]
        if qtype == quant.QType.F32:
            w = raw if raw.dtype == np.float32 else raw.view(np.float32)  # [R, C]
            return x @ w.T  # [T, R]
        if not self.exact and has_int_dot(qtype, x.shape[1]):
            return kernels.matmul_act(raw, qtype, x, self.act_bits)  # [T, R]: x quantized once, integer dots
        if x.shape[0] == 1:
            return quant.matvec(raw, qtype, x[0])[None, :]  # [1, R]: decode, one token
        return quant.matmul(raw, qtype, x)  # [T, R]: prefill, each weight block decoded once for all T

    def moe_experts(self, experts: dict, expert_types: dict, x: np.ndarray, ids: np.ndarray, w: np.ndarray):
        """The routed experts of one layer, fused: experts {e: ExpertBytes} (every e in ids), x float32 [T, D],
        ids int [T, K], w float32 [T, K] -> y float32 [T, D] = sum_k w[t, k] * expert_{ids[t, k]}(x[t]).
        None when this backend has no fused path for these types (exact mode, a non-K type, odd widths): the caller
        then runs the experts one by one."""
        qtypes = tuple(expert_types[p] for p in ("gate", "up", "down"))
        any_ex = next(iter(experts.values()))
        F = any_ex.gate.shape[0]
        if self.exact or not (has_int_dot(qtypes[0], x.shape[1]) and has_int_dot(qtypes[1], x.shape[1])
                              and has_int_dot(qtypes[2], F)):
            return None
        order = sorted(experts)  # ascending expert id: the order moe.py's plain loop adds them in
        pairs = []
        for e in order:
            tok, slot = np.nonzero(ids == e)  # tokens routed to e, and at which of their K positions
            pairs.append((tok, w[tok, slot]))
        ex = [(experts[e].gate, experts[e].up, experts[e].down) for e in order]
        return kernels.moe_act(ex, qtypes, x, pairs, self.act_bits)
