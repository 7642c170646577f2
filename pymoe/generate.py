"""The generation loop: prefill the prompt, then decode one token at a time until a stop, with telemetry.

What this is: `generate_tokens(...)`, a generator over new token ids, and `stream_text(...)`, the same turned into
text pieces with stop strings applied, both recording a `RequestStats` (the reference article's per-request lines:
    prompt 26 tokens = 0 reused + 26 read in 43 ms, 192 generated in 1367 ms (140.5 tok/s)
    decode expert cache hit rate: 86.3% (23414 hits / 27131 lookups)
). Timings are wall-clock around the model calls (on a GPU backend the model call syncs before returning).
What this is not: the model (model.py) or the sampler (sampler.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .errors import PymoeError
from .sampler import Sampler


@dataclass
class RequestStats:
    n_prompt: int = 0
    n_reused: int = 0
    prompt_s: float = 0.0
    n_generated: int = 0
    decode_s: float = 0.0  # time of the decode forward passes (the first new token comes from the prefill)
    n_decoded: int = 0  # decode forward passes: n_generated - 1 when no stop cut it short
    decode_lookups: int = 0
    decode_hits: int = 0
    stop_reason: str = ""

    @property
    def decode_tok_s(self) -> float:
        return self.n_decoded / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return (self.n_prompt - self.n_reused) / self.prompt_s if self.prompt_s > 0 else 0.0

    def prompt_line(self) -> str:
        return (f"prompt {self.n_prompt} tokens = {self.n_reused} reused + {self.n_prompt - self.n_reused} read in "
                f"{self.prompt_s * 1e3:.0f} ms, {self.n_generated} generated in {self.decode_s * 1e3:.0f} ms "
                f"({self.decode_tok_s:.1f} tok/s)")

    def cache_line(self) -> str:
        rate = 100.0 * self.decode_hits / self.decode_lookups if self.decode_lookups else 0.0
        return (f"decode expert cache hit rate: {rate:.1f}% ({self.decode_hits} hits / {self.decode_lookups} "
                f"lookups)")


def generate_tokens(model, prompt_ids: Sequence[int], max_tokens: int, sampler: Sampler, is_stop=lambda t: False,
                    n_ctx: int | None = None, stats: RequestStats | None = None) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids after `prompt_ids`; stops early on a token with is_stop(id)."""
    stats = stats if stats is not None else RequestStats()
    prompt_ids = [int(t) for t in prompt_ids]
    n_ctx = n_ctx or model.cfg.n_ctx_train
    if not prompt_ids:
        raise PymoeError("empty prompt: give at least one token")
    if len(prompt_ids) >= n_ctx:
        raise PymoeError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {n_ctx} tokens "
                         "(it needs room for at least one generated token)")
    if max_tokens < 0:
        raise PymoeError("max tokens must be >= 0")
    max_tokens = min(max_tokens, n_ctx - len(prompt_ids))
    kv = model.new_kv(n_ctx)
    cache_stats = model.cache.stats
    stats.n_prompt = len(prompt_ids)

    t0 = time.perf_counter()
    logits = model.prefill(np.asarray(prompt_ids), kv)[-1]  # [V] of the last prompt position
    stats.prompt_s = time.perf_counter() - t0
    history = list(prompt_ids)
    lookups0, hits0 = cache_stats.lookups["decode"], cache_stats.hits["decode"]
    stats.stop_reason = "length"
    for i in range(max_tokens):
        token = sampler(logits, history)
        history.append(token)
        stats.n_generated += 1
        yield token
        if is_stop(token):
            stats.stop_reason = "stop"
            break
        if i + 1 == max_tokens:
            break
        t1 = time.perf_counter()
        logits = model.decode_one_token(token, kv)
        stats.decode_s += time.perf_counter() - t1
        stats.n_decoded += 1
        stats.decode_lookups = cache_stats.lookups["decode"] - lookups0
        stats.decode_hits = cache_stats.hits["decode"] - hits0


def stream_text(model, tokenizer, prompt_ids: Sequence[int], max_tokens: int, sampler: Sampler,
                stop: Sequence[str] = (), n_ctx: int | None = None, stats: RequestStats | None = None
                ) -> Iterator[str]:
    """Like generate_tokens, but yields text pieces: only complete UTF-8 characters (tokenizer.decode_stream), cut
    at the first stop string (which is not yielded); end-of-generation tokens end the stream and are not shown."""
    stats = stats if stats is not None else RequestStats()
    stop = [s for s in stop if s]
    hold = max((len(s) for s in stop), default=1) - 1  # chars kept back: a stop string may still be forming
    utf8 = tokenizer.decode_stream()
    text, shown = "", 0  # everything decoded so far; how much of it was yielded

    def first_stop() -> int:
        hits = [i for i in (text.find(s, max(0, shown - hold)) for s in stop) if i >= 0]
        return min(hits, default=-1)

    for token in generate_tokens(model, prompt_ids, max_tokens, sampler, tokenizer.is_eog, n_ctx, stats):
        if tokenizer.is_eog(token):
            break
        text += utf8.put(token)
        cut = first_stop()
        if cut >= 0:
            if cut > shown:
                yield text[shown:cut]
            stats.stop_reason = "stop"
            return
        if len(text) - hold > shown:
            yield text[shown:len(text) - hold]
            shown = len(text) - hold
    text += utf8.flush()
    cut = first_stop()
    if cut >= 0:
        stats.stop_reason = "stop"
    end = cut if cut >= 0 else len(text)
    if end > shown:
        yield text[shown:end]
