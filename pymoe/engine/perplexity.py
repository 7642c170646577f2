"""Perplexity of a token sequence under a model: pymoe's `Engine`, or llama.cpp (llama-cpp-python) for comparison.

What this is: perplexity = exp(mean negative log-likelihood of each token given the tokens before it), computed over
windows of at most `n_ctx` tokens, each run from an empty KV cache:
    stride == n_ctx (the default): non-overlapping chunks; the first token of each chunk is context only, so a
                   sequence of C chunks scores C * (n_ctx - 1) tokens (what the demo model's trainer reports);
    stride <  n_ctx: sliding windows; each window scores only the tokens no earlier window scored, so every token
                   after the first is scored once, with at least n_ctx - stride tokens of context (but the first).
`windows()` is the one place that decides which token is scored where; both back ends use it, so on the same ids
they score exactly the same (position, target) pairs. Optionally the pymoe pass also counts the router's choices
per (layer, expert) ("heat"): one pass gives the perplexity and the routing skew of a text.
What this is not: a tokenizer (callers pass ids) or an evaluation harness; no batching beyond one window.

NLL in float64 from float32 logits: log_softmax(z)[t] = z[t] - max(z) - log(sum(exp(z - max(z)))).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np


@dataclass
class Perplexity:
    nll_sum: float = 0.0
    n_tokens: int = 0
    seconds: float = 0.0
    heat: Optional[np.ndarray] = None  # int64 [n_layers, n_expert]: how often each expert was in a token's top-k
    nll: list = field(default_factory=list)  # per scored token, in order

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.n_tokens) if self.n_tokens else float("nan")

    def add(self, nll: np.ndarray) -> None:
        self.nll_sum += float(nll.sum())
        self.n_tokens += int(nll.size)
        self.nll.extend(nll.tolist())


def windows(n: int, n_ctx: int, stride: Optional[int] = None) -> Iterator[tuple[int, int, int]]:
    """(start, end, first_target) of each window over n tokens: run ids[start:end], score targets
    ids[first_target:end] (the logits at position j predict ids[j + 1])."""
    stride = stride or n_ctx
    if not 0 < stride <= n_ctx:
        raise ValueError(f"stride must be in 1..n_ctx ({n_ctx}), got {stride}")
    prev_end, start = 0, 0
    while start + 1 < n:
        end = min(start + n_ctx, n)
        yield start, end, max(start + 1, prev_end)
        if end == n:
            break
        prev_end, start = end, start + stride


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """logits float [T, V], targets int [T] -> float64 [T]: -log softmax(logits)[target]."""
    z = logits.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)  # [T, 1]
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=-1))  # [T]
    return lse - z[np.arange(len(targets)), targets]


class _HeatCounter:
    """Wraps an expert cache: counts every (layer, expert) the router chooses, then forwards the call."""

    def __init__(self, inner, n_layers: int, n_expert: int):
        self.inner = inner
        self.heat = np.zeros((n_layers, n_expert), dtype=np.int64)

    def lookup(self, layer: int, expert_ids: np.ndarray, phase: str) -> None:
        np.add.at(self.heat[layer], np.asarray(expert_ids).reshape(-1), 1)
        self.inner.lookup(layer, expert_ids, phase)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def engine_perplexity(engine, ids: Sequence[int], n_ctx: int = 512, stride: Optional[int] = None,
                      heat: bool = False, progress: bool = False) -> Perplexity:
    """Perplexity of `ids` under a pymoe Engine (whatever its backend and cache). `heat`: also count routing."""
    from tqdm import tqdm

    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    res = Perplexity()
    model = engine.model
    counter = None
    if heat:
        counter = _HeatCounter(model.cache, engine.config.n_layers, engine.config.n_expert)
        model.cache = counter
    t0 = time.perf_counter()
    try:
        for start, end, first in tqdm(list(windows(ids.size, n_ctx, stride)), desc="pymoe perplexity",
                                      unit="window", disable=None if progress else True):
            logits = model.prefill(ids[start:end], model.new_kv(end - start))  # [T, V]
            res.add(token_nll(logits[first - 1 - start:end - 1 - start], ids[first:end]))
    finally:
        if counter is not None:
            model.cache = counter.inner
            res.heat = counter.heat
    res.seconds = time.perf_counter() - t0
    return res


def llamacpp_perplexity(model_path: str, ids: Sequence[int], n_ctx: int = 512, stride: Optional[int] = None,
                        n_threads: int = 2, progress: bool = False) -> Perplexity:
    """The same windows and targets under llama.cpp (llama-cpp-python), F32 KV cache (see docs/testing.md)."""
    from llama_cpp import Llama
    from tqdm import tqdm

    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    llm = Llama(model_path=model_path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                n_threads=n_threads, type_k=0, type_v=0, verbose=False)  # type 0 = GGML_TYPE_F32
    res = Perplexity()
    t0 = time.perf_counter()
    for start, end, first in tqdm(list(windows(ids.size, n_ctx, stride)), desc="llama.cpp perplexity",
                                  unit="window", disable=None if progress else True):
        llm.reset()
        llm.eval([int(t) for t in ids[start:end]])
        logits = np.asarray(llm.scores[:end - start], dtype=np.float32)  # [T, V]
        res.add(token_nll(logits[first - 1 - start:end - 1 - start], ids[first:end]))
    res.seconds = time.perf_counter() - t0
    return res


def top_share(heat: np.ndarray, frac: float) -> np.ndarray:
    """heat int [L, E] -> float [L]: the share of lookups served by the round(frac * E) most used experts of a layer
    (at least one: the top 10% of 32 experts are 3)."""
    E = heat.shape[-1]
    k = max(1, round(frac * E))
    hot = -np.sort(-heat, axis=-1)[:, :k]  # [L, k]
    return hot.sum(axis=-1) / np.maximum(1, heat.sum(axis=-1))
