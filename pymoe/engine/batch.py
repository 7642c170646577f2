"""Batched decode: one new token for each of N sequences in one forward step, each sequence with its own KV cache.

What this is: `decode_batch(model, tokens [N], kvs)`, the server's decode step with --parallel N, and `forward_batch`,
the same over several tokens per sequence (the server's speculative verification of several slots). Per layer:
    a = attention_block(rmsnorm(x), kvs)       the projections (Q/K/V/output, the gated-attention gate, the Gated
                                               DeltaNet and MLA projections) ONE matmul over the N rows; per
                                               sequence only what is its own: writing its KV (or advancing its
                                               recurrent state) and attending over its own cache
    y = moe_block(rmsnorm(x + a))              ONE call over all N tokens
The attention blocks (engine/attention.py, deltanet.py, mla.py) are written once as project all rows -> per-sequence
core -> output projection of all rows; a single sequence's forward is the N = 1 case of the same code, so a batched
step reads each attention weight once for N tokens instead of N times. RoPE runs over all rows too, each row at its
own sequence's position. The MoE call groups tokens per expert, so an expert chosen by several sequences is read once
for all of them, and the N * K expert lookups of a layer reach the expert cache together, in sequence order.
Logits are those of N separate `Model.decode_one_token` calls, bit for bit on the CPU backend (its kernels compute
each row in the same order whatever the row count: tests/test_batch.py, every family).
What this is not: prefill (a new prompt is prefilled on its own, `Model.prefill`), scheduling (serve/scheduler.py), a
fused attention kernel (the scores stay per sequence: the sequences have different lengths and caches), or a
routing trace recorder (`Model.trace` is per request; batched steps are not traced).

Shapes: N sequences in the batch, D n_embd, V n_vocab, K experts per token, L layers.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from pymoe.experts.cache import COUNTERS
from pymoe.errors import PymoeError
from .kv import KVCache, Seqs, segments
from .moe import FFN


class RowCounts:
    """Stands in for the expert cache inside moe_block and splits its counters per batch row (per sequence).

    The cache sees one lookup of all N rows, as without the split, so policy decisions and the path each expert is
    served by are unchanged; `rows[j]` collects the counters (lookups, hits, spill, ...) of sequence j's pairs,
    each under the path its expert is really served by.
    """

    def __init__(self, cache, n_rows: int):
        self.cache = cache
        self.rows = [dict.fromkeys(COUNTERS, 0) for _ in range(n_rows)]

    def lookup(self, layer: int, expert_ids: np.ndarray, phase: str) -> None:
        self.cache.lookup(layer, expert_ids, phase, rows=self.rows)  # expert_ids [N, K]

    def expert(self, layer: int, e: int):
        return self.cache.expert(layer, e)

    def finish(self, layer: int) -> None:
        self.cache.finish(layer)


def decode_batch(model, tokens: Sequence[int], kvs: Sequence[KVCache],
                 row_counts: Optional[list] = None) -> np.ndarray:
    """tokens [N], one per sequence, appended at kvs[j].n -> logits float32 [N, V]; advances every kvs[j].n by 1.

    row_counts: a list of N dicts to add each sequence's expert-cache decode counters to (None: don't split them).
    """
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)  # [N]
    if tokens.size == 0 or tokens.size != len(kvs):
        raise PymoeError(f"decode_batch needs one token per KV cache, got {tokens.size} tokens for {len(kvs)} caches")
    return forward_batch(model, [[t] for t in tokens.tolist()], kvs, row_counts)


def forward_batch(model, token_lists: Sequence[Sequence[int]], kvs: Sequence[KVCache],
                  row_counts: Optional[list] = None, experts: Optional[list] = None) -> np.ndarray:
    """token_lists[j] (T_j >= 1 tokens) appended at kvs[j].n -> logits float32 [sum T_j, V], sequence j's rows
    after sequence j - 1's; advances every kvs[j].n by T_j. One token each is `decode_batch`; several are the
    server's speculative verification of several slots in one forward (serve/scheduler.py). A sequence's logits are
    the bits of its own `Model.forward` (the CPU backend's row contract; per-sequence attention, engine/kv.py Seqs).

    row_counts: a list of N dicts to add each sequence's expert-cache decode counters to (None: don't split them).
    experts: a list of N ints to add the distinct (layer, expert) pairs each sequence's rows routed to (None: not
    counted): speculation's telemetry (engine/speculative.py SpecStats).
    """
    counts = [len(t) for t in token_lists]
    tokens = np.asarray([t for ts in token_lists for t in ts], dtype=np.int64)  # [T], T = sum T_j
    cfg = model.cfg
    if len(counts) != len(kvs) or min(counts, default=0) < 1:
        raise PymoeError(f"forward_batch needs >= 1 token for each of the {len(kvs)} KV caches, got {counts}")
    if len({id(kv) for kv in kvs}) != len(kvs):
        raise PymoeError("decode_batch: each sequence needs its own KV cache")
    for kv, c in zip(kvs, counts):
        if kv.n + c > kv.n_ctx:
            raise PymoeError(f"context full: {kv.n} + {c} tokens exceed the context of {kv.n_ctx}")
    if tokens.min() < 0 or tokens.max() >= cfg.n_vocab:
        raise PymoeError(f"token id out of range 0..{cfg.n_vocab - 1}")
    cache = RowCounts(model.cache, tokens.size) if row_counts is not None else model.cache

    model.backend.share_cpu()  # this call's threads (backends/threads.py)
    if getattr(model.backend, "counts", None) is not None:  # a device backend's cost (backends/device_counts.py)
        model.backend.counts.forward("decode", tokens.size)
    seqs = Seqs(kvs, counts)
    rows = [r for _, r in segments(seqs, tokens.size)]  # sequence j's rows of every [T, .] array below
    x = model.embed(tokens)  # [T, D]
    rope = model.rope_tables(model.positions(seqs, tokens.size))  # [T, rope_dim / 2] each row at its position
    rmsnorm = model.backend.rmsnorm
    for i, layer in enumerate(model.layers):
        a = rmsnorm(x, layer.attn_norm, cfg.rms_eps)  # [T, D]
        x = x + model.attention_block(layer, a, seqs, i, rope)  # projections over T rows, attention per sequence
        h = rmsnorm(x, layer.ffn_norm, cfg.rms_eps)  # [T, D]
        y, ids, _ = FFN[layer.plan.ffn](layer, h, cache, model.backend_for(i), "decode")  # experts grouped over T tokens
        x = x + y
        if experts is not None and ids is not None:
            for j, r in enumerate(rows):
                experts[j] += np.unique(ids[r]).size
    for kv, c in zip(kvs, counts):
        kv.n += c
    if row_counts is not None:
        for total, r in zip(row_counts, rows):
            for row in cache.rows[r]:
                for name, n in row.items():
                    total[name] = total.get(name, 0) + n
    x = rmsnorm(x, model.output_norm, cfg.rms_eps)
    for kv, r in zip(kvs, rows):
        tap = model.hidden_taps.get(id(kv))
        if tap is not None:  # the sequence's MTP drafter (engine/mtp.py) keeps its hidden states
            tap(kv.n - (r.stop - r.start), x[r])
    return model.backend.linear(model.output, x)  # [T, V]
