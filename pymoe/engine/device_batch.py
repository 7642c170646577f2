"""The decode tokens of B sequences as one device step: version 3 (engine/model.py `_device_step`) over B rows.

What this is: `decode_steps(model, tokens, kvs, draws, row_counts)`, the server's B slots on device KV caches decoded
in one step (serve/scheduler.py `_decode_step`), and `batch_step_possible(model, kvs)`, when it runs:
    one copy up     B token ids, RoPE positions, KV rows, sequence ids (and each row's random draw)
    x = embed(tokens)                                                        [B, D] on the device
    per layer:      x += attn_output( ragged_attention( rope_b(q), kv_b <- rope_b(k), v ) )   (row b: its sequence)
                    x += FFN( rmsnorm(x) )            the router's top-K and the routed experts on the B rows, each
                                                      expert read where the residency table says (slot or PCIe)
    logits = output( rmsnorm(x) ); argmax per row (or the row's draw)
    one copy back   B token ids + every MoE layer's [B, K] routing ids (+ the drawn ids): one synchronisation
Then the expert cache's lookups, row by row and, in a row, layer by layer: the sequence B single steps make one after
the other, so every counter, promotion and eviction is theirs and `pymoe simulate` replays it unchanged; the experts
were read where the table of the step's start said (a promotion made by row 0's lookups lands before the next
step, not before row 1's reads: only the PCIe bytes can differ from B single steps', never a result).
The families: those whose every layer attends by plain GQA (with or without a window and sinks: gpt-oss) and whose
decode step runs on the device; the attention of several sequences is one launch (cuda_kernels/ragged_attention.py),
RoPE and the KV write per row are cuda_kernels/batch_step.py; everything else is the single step's kernels on B rows.
What this is not: the single sequence's step (engine/model.py), a step with "cpu" misses (their lookups inside the
step would interleave the rows' layers differently from single steps: the scheduler then runs single steps), Gated
DeltaNet or MLA layers (a recurrent state or compressed row per sequence: not written), speculation's verify forwards.
Shapes: B rows (sequences), D n_embd, H query heads, G KV heads, Dh / Dv head sizes, K experts per token.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from pymoe.errors import PymoeError
from .moe import FFN


def _delta(kv) -> int:
    f = getattr(kv, "pos_delta", None)
    return f() if f is not None else 0


def batch_step_possible(model, kvs: list) -> bool:
    """The decode tokens of these sequences can run as one device step: each would run a device step of its own
    (`Model.steps_on_device`), every layer attends by GQA, the cache sends no miss to the CPU, the backend's batch
    buffers hold B rows (2 <= B), and PYMOE_BATCH_STEP is not 0 (0: one device step per sequence, for comparison)."""
    b = model.backend
    if len(kvs) < 2 or os.environ.get("PYMOE_BATCH_STEP", "1") == "0" or not hasattr(b, "begin_batch"):
        return False
    if not model.step_on_device or not all(la.plan.attention == "gqa" for la in model.layers):
        return False
    if not b.batch_ready(len(kvs)) or not model._misses_all_over_pcie() or len({id(kv) for kv in kvs}) != len(kvs):
        return False
    return all(model.steps_on_device(kv) for kv in kvs)


def attention_rows(b, layer, x, layer_i: int):
    """engine/attention.gqa_block on B rows of B sequences: x [B, D] (attn-normed, device) -> [B, D] (device)."""
    cfg, eps = layer.cfg, layer.cfg.rms_eps
    H, G, Dh, Dv = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v
    B = x.shape[0]
    x = b.to_device(x)  # (a device array stays; the arena starts again)
    q, k, v = b.linear_many([layer.attn_q, layer.attn_k, layer.attn_v], x)  # [B, H*Dh], [B, G*Dh], [B, G*Dv]
    if layer.bias:  # qwen2moe
        q, k, v = b.add(q, layer.bias["q"]), b.add(k, layer.bias["k"]), b.add(v, layer.bias["v"])
    if cfg.qk_norm == "full":  # olmoe
        q, k = b.rmsnorm(q, layer.q_norm, eps), b.rmsnorm(k, layer.k_norm, eps)
    q, k, v = b.view(q, (B, H, Dh)), b.view(k, (B, G, Dh)), b.view(v, (B, G, Dv))
    if cfg.qk_norm == "head":  # qwen3moe
        q, k = b.rmsnorm(q, layer.q_norm, eps), b.rmsnorm(k, layer.k_norm, eps)
    q, k = b.rope_batch(q, cfg.rope_neox), b.rope_batch(k, cfg.rope_neox)  # row b at its position
    b.kv_write_batch(layer_i, k, v)  # row b into its sequence's cache at its KV row
    out = b.attention_batch(layer_i, q, layer.plan.window, layer.sinks)  # [B, H * Dv]
    y = b.linear(layer.attn_output, out)  # [B, D]
    if layer.out_bias is not None:  # gpt-oss
        y = b.add(y, layer.out_bias)
    return y


def decode_steps(model, tokens, kvs: list, draws: Optional[list] = None,
                 row_counts: Optional[list] = None) -> list:
    """tokens [B], one per sequence, appended at kvs[b].n as one device step -> B logits rows (backends/cuda.py
    StepLogits [1, V], left on the device, each with its greedy token and its drawn token when draws[b] was handed);
    advances every kvs[b].n by 1. draws: each row's sampler draw (Model.device_draw) or None. row_counts: B dicts to
    add each sequence's expert-cache decode counters to."""
    cfg, b, cache = model.cfg, model.backend, model.cache
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)  # [B]
    B = len(kvs)
    if tokens.size != B or not batch_step_possible(model, kvs):
        raise PymoeError(f"a batched device step of {tokens.size} tokens for {B} sequences cannot run here")
    for kv in kvs:
        if kv.n + 1 > kv.n_ctx:
            raise PymoeError(f"context full: {kv.n} + 1 tokens exceed the context of {kv.n_ctx}")
    if tokens.min() < 0 or tokens.max() >= cfg.n_vocab:
        raise PymoeError(f"token id out of range 0..{cfg.n_vocab - 1}")
    b.share_cpu()
    b.counts.forward("decode", B)
    table = getattr(cache, "step_table", None)  # SlotCache: its residency table (force_spill masks)
    tok = b.begin_batch(tokens, [kv.n + _delta(kv) for kv in kvs], [kv.n for kv in kvs], kvs,
                        table() if table else None, draws or [None] * B)
    x = b.embed_batch(model.token_embd_dev, tok)  # [B, D] on the device
    eps = cfg.rms_eps
    for i, layer in enumerate(model.layers):
        x = b.add(x, attention_rows(b, layer, b.rmsnorm(x, layer.attn_norm, eps), i))
        y, _, _ = FFN[layer.plan.ffn](layer, b.rmsnorm(x, layer.ffn_norm, eps), cache, b, "decode")  # [B, D]
        x = b.add(x, y)
    x = b.rmsnorm(x, model.output_norm, eps)
    _, ids, logits = b.end_batch(b.linear(model.output, x))  # ids [B, n_moe, K]
    stats = cache.stats
    for j, kv in enumerate(kvs):  # the cache's lookups as B single steps make them: row by row, layer by layer
        before = stats.snapshot("decode") if row_counts is not None else None
        cache.lookup_step(list(cfg.moe_layers), np.asarray(ids[j]).reshape(len(cfg.moe_layers), 1, -1))  # [M, 1, K]
        if row_counts is not None:
            for name, n in stats.snapshot("decode").items():
                row_counts[j][name] = row_counts[j].get(name, 0) + n - before.get(name, 0)
        kv.n += 1
    return logits
