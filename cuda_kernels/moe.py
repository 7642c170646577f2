"""The MoE expert block on the GPU: one expert applied to the T tokens routed to it, output accumulated in place.

    H[t]  = silu(gate_w X[t]) * (up_w X[t])          (SwiGLU; gate_w, up_w uint8 [F, S_D], X float32 [T, D])
    Y[t] += wt[t] * (down_w H[t])                     (down_w uint8 [D, S_F], wt float32 [T], Y float32 [T, D])

What this is: two kernels and the host wrapper `expert_block`. The weights are an expert's raw GGUF rows, read
from a VRAM slot of the expert cache or from mapped pinned host memory (the kernels do not care, see
quant_matvec.py); gate, up and down may each have their own GGML type (llama.cpp's Q2_K mix stores down as Q3_K).
What this is not: routing or dispatch (pymoe/engine/moe.py chooses the experts, gathers the tokens routed to one expert
into X and scatters Y back), nor the shared expert (a plain gate/up/down: use this with wt = sigmoid gate).
The reference is pymoe.backends.reference: `Y += wt[:, None] * swiglu_expert(...)`, i.e. down(silu(gate X) * up X), in NumPy.

Versions (naive -> fast):
  1. three quant_matvec.matmul calls plus elementwise SwiGLU and axpy (three extra passes over [T, F] and [T, D];
     what the tests use as a second, structural reference).
  2. (these kernels) `gate_up_kernel`: one block per (row f, token tile) dots gate row f and up row f with the
     tile in one pass (the two rows are read together, X once per tile) and writes silu(g) * u: the [T, F]
     intermediates gate X and up X never exist. `down_kernel`: one block per (row d, token tile), the dot product
     scaled by the routing weight and added into Y[t, d]. Each block owns its (t, d) outputs, so no atomics are
     needed as long as the experts of one layer are launched one after another on one stream (they all add into
     the same Y; launching experts concurrently would need atomic adds or one Y per expert).
  Not done: a single persistent kernel for all of a layer's experts (grouped GEMM), int8 activations.

Test: NUMBA_ENABLE_CUDASIM=1 pytest -m cuda tests/test_cuda_kernels.py -k expert
Bench on a GPU: time `expert_block` like quant_matvec.bench (the weights of one expert: 3 * F * D weights).

Shape legend: T tokens routed to this expert, D model width (n_embd), F expert width (expert_feed_forward_length).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from pymoe.quant import get_format

from .quant_matvec import THREADS, TOKEN_TILE, check, kernel_for, n_tiles, on_device, tile_size, weight_cols
from .reduce import block_sum_rows

GATE_PARTIAL = UP_PARTIAL = DOWN_PARTIAL = None  # per-format row_partial device functions, bound by kernel_for


def gate_up_kernel(gate_w, up_w, X, H):
    """gate_w, up_w uint8 [F, S_D], X float32 [T, D] -> H float32 [T, F]; grid (F, n_tiles), block (THREADS,)."""
    f = cuda.blockIdx.x
    t0 = cuda.blockIdx.y * TOKEN_TILE
    tid = cuda.threadIdx.x
    nt = tile_size(X.shape[0] - t0)
    g = cuda.local.array(TOKEN_TILE, np.float32)  # [TOKEN_TILE] gate row f . X[t]
    u = cuda.local.array(TOKEN_TILE, np.float32)  # [TOKEN_TILE] up row f . X[t]
    for t in range(TOKEN_TILE):
        g[t] = 0.0
        u[t] = 0.0
    GATE_PARTIAL(gate_w[f], X, t0, nt, tid, THREADS, g)
    UP_PARTIAL(up_w[f], X, t0, nt, tid, THREADS, u)
    buf = cuda.shared.array((TOKEN_TILE, THREADS), np.float32)  # [TOKEN_TILE, THREADS]
    block_sum_rows(buf, tid, g, nt)
    block_sum_rows(buf, tid, u, nt)
    if tid < nt:
        a = g[tid]
        H[t0 + tid, f] = a / (np.float32(1.0) + math.exp(-a)) * u[tid]  # silu(gate) * up


def down_kernel(down_w, H, wt, Y):
    """down_w uint8 [D, S_F], H float32 [T, F], wt float32 [T]: Y[t, d] += wt[t] * (down row d . H[t]).
    grid (D, n_tiles), block (THREADS,)."""
    d = cuda.blockIdx.x
    t0 = cuda.blockIdx.y * TOKEN_TILE
    tid = cuda.threadIdx.x
    nt = tile_size(H.shape[0] - t0)
    acc = cuda.local.array(TOKEN_TILE, np.float32)  # [TOKEN_TILE]
    for t in range(TOKEN_TILE):
        acc[t] = 0.0
    DOWN_PARTIAL(down_w[d], H, t0, nt, tid, THREADS, acc)
    buf = cuda.shared.array((TOKEN_TILE, THREADS), np.float32)  # [TOKEN_TILE, THREADS]
    block_sum_rows(buf, tid, acc, nt)
    if tid < nt:
        Y[t0 + tid, d] += wt[t0 + tid] * acc[tid]


def expert_block(gate_w, up_w, down_w, types, X, wt, Y, H=None, stream=0):
    """Y += wt[:, None] * down(silu(gate X) * up X) for one expert; returns Y (device arrays throughout).

    gate_w, up_w uint8 [F, S_D]; down_w uint8 [D, S_F]; types: {"gate": qtype, "up": qtype, "down": qtype} (as
    pymoe.engine.model.Layer.expert_types); X float32 [T, D]; wt float32 [T] routing weights; Y float32 [T, D], updated in
    place; H float32 [T, F] optional scratch (allocated if None).
    """
    gate_w, up_w, down_w = on_device(gate_w, "gate_w"), on_device(up_w, "up_w"), on_device(down_w, "down_w")
    X, wt, Y = on_device(X, "X"), on_device(wt, "wt"), on_device(Y, "Y")
    D = weight_cols(gate_w, types["gate"], "gate_w")
    F = gate_w.shape[0]
    check(X, "X", np.float32, 2)
    check(Y, "Y", np.float32, 2)
    check(wt, "wt", np.float32, 1)
    T = X.shape[0]
    problems = []
    if weight_cols(up_w, types["up"], "up_w") != D or up_w.shape[0] != F:
        problems.append(f"up_w is {up_w.shape[0]}x{weight_cols(up_w, types['up'], 'up_w')}, gate_w is {F}x{D}")
    if weight_cols(down_w, types["down"], "down_w") != F or down_w.shape[0] != D:
        problems.append(f"down_w is {down_w.shape[0]}x{weight_cols(down_w, types['down'], 'down_w')}, "
                        f"must be {D}x{F}")
    if tuple(X.shape) != (T, D) or tuple(Y.shape) != (T, D) or tuple(wt.shape) != (T,):
        problems.append(f"X {tuple(X.shape)}, Y {tuple(Y.shape)}, wt {tuple(wt.shape)} must be (T, {D}), "
                        f"(T, {D}), (T,)")
    if problems:
        raise ValueError("expert_block: " + "; ".join(problems))
    if T == 0:
        return Y
    H = cuda.device_array((T, F), np.float32, stream=stream) if H is None else on_device(H, "H")  # [T, F]
    check(H, "H", np.float32, 2)
    if tuple(H.shape) != (T, F):
        raise ValueError(f"expert_block: H must have shape {(T, F)}, got {tuple(H.shape)}")
    gate_up = kernel_for(gate_up_kernel, GATE_PARTIAL=get_format(types["gate"]).qtype,
                         UP_PARTIAL=get_format(types["up"]).qtype)
    down = kernel_for(down_kernel, DOWN_PARTIAL=get_format(types["down"]).qtype)
    gate_up[(F, n_tiles(T)), THREADS, stream](gate_w, up_w, X, H)
    down[(D, n_tiles(T)), THREADS, stream](down_w, H, wt, Y)
    return Y
