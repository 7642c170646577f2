"""The group-limited router (DeepSeek-V2/V3) on the device: the top-K experts chosen among the best expert groups.

What this is: `route_groups(logits, k, bias, softmax, groups, groups_used, norm_topk, ids, w, scale)`, one kernel and
its host wrapper, taking and returning device arrays. Its NumPy twin is the host's router, reference.route_sigmoid
with `groups` > 1 (tests/test_cuda_mla_kernels.py compares them):

    probs  = softmax(logits) (gating "softmax": DeepSeek-V2) or sigmoid(logits) (DeepSeek-V3)    [T, E]
    choose = probs + bias (the bias only chooses; none for V2)                                   [T, E]
    score  = per group of E / groups experts, the sum of its two best `choose` values             [T, groups]
    keep   = the `groups_used` best groups, highest first, ties to the lower group
    ids    = top-K of choose among the kept groups' experts, highest first, ties to the lower id  [T, K]
    w      = probs[ids] (/ max(their sum, 2^-14) if norm_topk) * scale                           [T, K]
(every expert outside the kept groups counts as -inf, as the twin masks it: with fewer than K experts in the kept
groups the rest are the lowest ids outside them, as the twin's stable argsort picks them).

Versions: 1 (this): one thread per token, like step.route_softmax (E a few hundred: the group scores, the group
choice and the K passes are a few loops over E). At most MAX_GROUPS groups (DeepSeek's files have 8).
Shape legend: T tokens, E experts, K experts per token.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .quant_matvec import check, on_device
from .step import _chosen, _normalise_weights

MAX_GROUPS = 64  # the kernel's per-thread table of kept groups


@cuda.jit(device=True)
def _prob(logits, t, e, softmax, m, s):
    """The routing probability of expert e of row t: softmax (m the row's max logit, s its sum of exp) or sigmoid."""
    if softmax:
        return math.exp(logits[t, e] - m) / s
    return np.float32(1.0) / (np.float32(1.0) + math.exp(-logits[t, e]))


@cuda.jit
def route_groups_kernel(logits, bias, has_bias, softmax, groups, groups_used, k, norm_topk, scale, ids, w):
    """logits float32 [T, E], bias float32 [E] -> ids int32 [T, K], w float32 [T, K]; grid (T,), block (1,)."""
    t = cuda.blockIdx.x
    E = logits.shape[1]
    n = E // groups  # experts per group
    m = logits[t, 0]
    s = np.float32(0.0)
    if softmax:
        for e in range(1, E):
            if logits[t, e] > m:
                m = logits[t, e]
        for e in range(E):
            s += math.exp(logits[t, e] - m)
    neg_inf = np.float32(-np.inf)
    keep = cuda.local.array(MAX_GROUPS, np.int32)
    for g in range(groups):
        keep[g] = 0
    for j in range(groups_used):  # the groups_used best groups, one pass each
        best_g = -1
        best_score = np.float32(0.0)
        for g in range(groups):
            if keep[g] == 0:
                first = neg_inf
                second = neg_inf
                for e in range(g * n, (g + 1) * n):
                    c = _prob(logits, t, e, softmax, m, s)
                    if has_bias:
                        c += bias[e]
                    if c > first:
                        second = first
                        first = c
                    elif c > second:
                        second = c
                score = first + second if n >= 2 else first
                if best_g < 0 or score > best_score:
                    best_g = g
                    best_score = score
        keep[best_g] = 1
    total = np.float32(0.0)
    for j in range(k):
        best = -1
        bc = np.float32(0.0)
        bp = np.float32(0.0)
        for e in range(E):
            if not _chosen(ids, t, j, e):
                p = _prob(logits, t, e, softmax, m, s)
                c = p + bias[e] if has_bias else p
                if keep[e // n] == 0:
                    c = neg_inf
                if best < 0 or c > bc:
                    best = e
                    bc = c
                    bp = p
        ids[t, j] = best
        w[t, j] = bp
        total += bp
    _normalise_weights(w, t, k, total, norm_topk, scale)


def route_groups(logits, k: int, bias, softmax: bool, groups: int, groups_used: int, norm_topk: bool, ids, w,
                 scale: float = 1.0, stream=0):
    """Group-limited routing (see the module docstring): logits [T, E], bias float32 [E] (device) or None ->
    ids int32 [T, K], weights float32 [T, K] written into ids, w; returns them."""
    logits, ids, w = on_device(logits, "logits"), on_device(ids, "ids"), on_device(w, "w")
    check(logits, "logits", np.float32, 2)
    check(ids, "ids", np.int32, 2)
    check(w, "w", np.float32, 2)
    T, E = logits.shape
    if tuple(ids.shape) != (T, k) or tuple(w.shape) != (T, k) or not 1 <= k <= E:
        raise ValueError(f"route_groups: ids {tuple(ids.shape)}, w {tuple(w.shape)} must be ({T}, {k}), k <= E = {E}")
    if not (1 <= groups <= MAX_GROUPS and E % groups == 0 and 1 <= groups_used <= groups):
        raise ValueError(f"route_groups: {groups} groups ({groups_used} used) must divide E = {E}, at most "
                         f"{MAX_GROUPS}")
    has_bias = bias is not None
    bias = (on_device(bias, "bias") if has_bias else logits[0] if T  # (a row standing in, unread: no
            else cuda.device_array(E, np.float32))  # allocation, so that a CUDA graph replays the launch)
    if T:
        route_groups_kernel[(T,), 1, stream](logits, bias, has_bias, bool(softmax), groups, groups_used, k,
                                             bool(norm_topk), np.float32(scale), ids, w)
    return ids, w


__all__ = ["route_groups", "MAX_GROUPS"]
