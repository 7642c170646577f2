"""The generation loop: prefill the prompt, then decode one token at a time until a stop, with telemetry.

What this is: `generate_tokens(...)`, a generator over new token ids, and `stream_text(...)`, the same turned into
text pieces with stop strings applied, both recording a `RequestStats` (the reference article's per-request lines:
    prompt 26 tokens = 0 reused + 26 read in 43 ms, 192 generated in 1367 ms (140.5 tok/s)
    decode expert cache hit rate: 86.3% (23414 hits / 27131 lookups); ...; Belady on the same lookups and slots: ...
), or, with no slot pool, `decode expert cache: none (...)`: no hit rate for a cache that does not exist. Timings
are wall-clock around the model calls (on a GPU backend the model call syncs before returning).
What this is not: the model (model.py) or the sampler (sampler.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from pymoe.errors import PymoeError
from .sampler import Sampler


@dataclass
class RequestStats:
    n_prompt: int = 0
    n_reused: int = 0
    prompt_s: float = 0.0
    n_generated: int = 0
    decode_s: float = 0.0  # time of the decode forward passes (the first new token comes from the prefill)
    n_decoded: int = 0  # tokens that came from decode steps (all but the first): decode tok/s counts these
    n_forced: int = 0  # of n_generated: tokens a grammar forced, taken without sampling (serve/scheduler.py)
    decode: dict = field(default_factory=dict)  # the expert cache's decode counters of this request
    stop_reason: str = ""
    pool: bool = True  # the engine has an expert slot pool (False: none; every expert read in place or over PCIe)
    gpu: bool = False  # the experts are computed on a GPU: what it reads from host memory crosses PCIe
    device: dict | None = None  # a device backend's decode counts of this request (backends/device_counts.py)
    gap: dict = field(default_factory=dict)  # this request's decode lookups replayed through Belady (experts/gap.py):
    # lookups, hits (the engine's), belady_hits; empty with no slot pool
    devices: list = field(default_factory=list)  # several devices (backends/multi_device.py): per device its decode
    # cache counters of this request, slots and layers (`per_device`), and its device counts (`counts`)

    def note_cache(self, cache) -> None:
        """Record what the cache line must know about the engine's expert cache: is there a pool, is it a GPU's."""
        self.pool, self.gpu = getattr(cache, "n_slots", 0) > 0, bool(getattr(cache, "gpu", False))

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

    @property
    def decode_lookups(self) -> int:
        return self.decode.get("lookups", 0)

    @property
    def decode_hits(self) -> int:
        return self.decode.get("hits", 0)

    def cache_line(self) -> str:
        """The article's appendix-B line: hit rate, then how the misses were served and what was promoted. Only a
        GPU reads over PCIe: on the CPU backend every miss is computed from host memory, and the spill / cpu split
        is the one a GPU would make. With no pool there is no hit rate: the line says so."""
        c = self.decode
        n = c.get("lookups", 0)
        if not self.pool:
            how = "read over PCIe from pinned host memory" if self.gpu else "read in place from host memory"
            return f"decode expert cache: none ({n} routed experts {how})"
        rate = 100.0 * c.get("hits", 0) / n if n else 0.0
        line = f"decode expert cache hit rate: {rate:.1f}% ({c.get('hits', 0)} hits / {n} lookups)"
        spill, cpu, promoted = c.get("spill", 0), c.get("cpu", 0), c.get("promoted", 0)
        if spill + cpu and self.gpu:
            line += (f"; {spill} more read over PCIe ({100.0 * spill / n:.2f}% of all {n} routed), "
                     f"{cpu} computed on the CPU, {promoted} promoted")
        elif spill + cpu:
            line += (f"; {spill + cpu} misses computed in place from host memory (split for a GPU: {spill} spill, "
                     f"{cpu} cpu), {promoted} promoted")
        if c.get("prefetched", 0):  # the router lookahead's copies (experts/prefetch.py)
            line += (f"; {c['prefetched']} prefetched by the router lookahead, {c.get('prefetch_hits', 0)} of the hits "
                     "on them")
        g = self.gap
        if g.get("lookups"):
            line += (f"; Belady on the same lookups and slots: {100.0 * g['belady_hits'] / g['lookups']:.1f}% "
                     f"({g['belady_hits']} hits / {g['lookups']})")
        if self.devices:
            line += "; per device: " + ", ".join(
                f"{d['device']} (layers {d['layers'][0]}-{d['layers'][1]}, {d['slots']} slots) "
                + (f"{100.0 * d['hits'] / d['lookups']:.1f}% ({d['hits']}/{d['lookups']})" if d["lookups"]
                   else "no lookups")  # (a device of dense layers only)
                for d in self.devices)
        return line

    def device_line(self) -> str:
        """`decode device per token: L launches, B host<->device bytes, S synchronisations`: means over the
        request's decoded tokens (speculation: per token kept, drafts and verification included)."""
        from pymoe.backends.device_counts import line

        out = "decode " + line({**self.device, "tokens": self.n_decoded})
        if self.devices and all("counts" in d for d in self.devices):
            out += "; per device: " + ", ".join(f"{d['device']} " + line({**d["counts"], "tokens": self.n_decoded})
                                                .replace("device per token: ", "") for d in self.devices)
        return out


def generate_tokens(model, prompt_ids: Sequence[int], max_tokens: int, sampler: Sampler, is_stop=lambda t: False,
                    n_ctx: int | None = None, stats: RequestStats | None = None, spec=None) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids after `prompt_ids`; stops early on a token with is_stop(id).
    spec: a speculative.Speculator: each decode step then drafts and verifies several tokens (same output when
    greedy, same distribution when sampling); its counters are in spec.stats."""
    stats = stats if stats is not None else RequestStats()
    media = getattr(prompt_ids, "media", None)  # an ImagePrompt's images (engine/multimodal.py)
    if media is not None and spec is not None:
        raise PymoeError("speculative decoding does not take images (its drafter reads token ids only)")
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
    stats.note_cache(model.cache)
    if model.trace is not None:
        model.trace.start_request(len(prompt_ids))
    stats.n_prompt = len(prompt_ids)

    if spec is not None:
        spec.begin(model, kv)
    try:
        yield from _generate(model, kv, prompt_ids, max_tokens, sampler, is_stop, stats, spec, media)
    finally:
        if spec is not None:
            spec.end(model, kv)


def _generate(model, kv, prompt_ids, max_tokens, sampler, is_stop, stats, spec, media=None) -> Iterator[int]:
    t0 = time.perf_counter()
    logits = (model.prefill(np.asarray(prompt_ids), kv) if media is None
              else model.prefill(np.asarray(prompt_ids), kv, media))[-1]  # [V] of the last prompt position
    model.cache.end_prefill()  # the warm decode set, if one is asked for (experts/cache.py)
    stats.prompt_s = time.perf_counter() - t0
    gap = getattr(model.cache, "gap", None)  # experts/gap.py: Belady on this request's decode lookups
    gap_before = gap.totals() if gap is not None else None
    try:
        yield from _decode(model, kv, prompt_ids, max_tokens, sampler, is_stop, stats, spec, logits)
    finally:
        if gap is not None:
            gap.close()  # the request's last window
            stats.gap = {k: v - gap_before[k] for k, v in gap.totals().items()}


def _decode(model, kv, prompt_ids, max_tokens, sampler, is_stop, stats, spec, logits) -> Iterator[int]:
    cache_stats = model.cache.stats
    history = list(prompt_ids)
    before = cache_stats.snapshot("decode")
    counts = getattr(model.backend, "counts", None)  # a device backend's launches, bytes, syncs
    device_before = counts.snapshot("decode") if counts is not None else None
    per_device = getattr(model.cache, "per_device", None)  # several devices: each one's counters too
    per_counts = getattr(counts, "per_device", None)
    devices_before = (per_device("decode"), per_counts("decode") if per_counts else None) if per_device else None
    stats.stop_reason = "length"
    pending = [sampler(logits, history)] if max_tokens > 0 else []  # sampled, not yet yielded
    while pending:
        for token in pending:
            history.append(token)
            stats.n_generated += 1
            stats.n_decoded = stats.n_generated - 1  # every token after the first came from a decode step
            yield token
            if is_stop(token):
                stats.stop_reason = "stop"
                return
            if stats.n_generated == max_tokens:
                return
        t1 = time.perf_counter()
        if spec is not None:  # history[-1] is not in the KV cache yet: the speculator runs it with its drafts
            pending = spec.step(model, kv, history, sampler, max_tokens - stats.n_generated)
        else:
            draw = model.device_draw(sampler, kv)  # a draw made inside the step, or None
            pending = [sampler(model.decode_one_token(history[-1], kv, draw), history)]
        stats.decode_s += time.perf_counter() - t1
        stats.decode = {k: v - before[k] for k, v in cache_stats.snapshot("decode").items()}
        if counts is not None:
            from pymoe.backends.device_counts import difference

            stats.device = difference(counts.snapshot("decode"), device_before)
        if devices_before is not None:
            stats.devices = _per_device(per_device("decode"), per_counts("decode") if per_counts else None,
                                        *devices_before)


def _per_device(cache_now: list, counts_now, cache_before: list, counts_before) -> list:
    """Each device's cache counters (and device counts) of this request: now - before."""
    from pymoe.backends.device_counts import difference
    from pymoe.experts.cache import COUNTERS

    out = []
    for d, (now, before) in enumerate(zip(cache_now, cache_before)):
        row = {k: (v - before[k] if k in COUNTERS else v) for k, v in now.items()}  # (slots, layers: as they are)
        if counts_now is not None:
            row["counts"] = difference(counts_now[d], counts_before[d])
        out.append(row)
    return out


class TextStream:
    """Token ids in, text pieces out, with stop strings applied: the push-style core of `stream_text`, also used by
    the server's engine loop, which advances many requests one token at a time.

    `put(token)` returns the text now safe to show: only complete UTF-8 characters (tokenizer.decode_stream), and
    never the last len(longest stop) - 1 characters, which might still become a stop string. When a stop string
    appears, the text before it is returned, `stopped` turns True and the stop string is not shown. `end()` returns
    what was held back once the generation is over.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), preserved: frozenset = frozenset()):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars kept back while a stop may be forming
        self.utf8 = tokenizer.decode_stream(preserved=preserved)  # preserved: control tokens shown as text
        self.text, self.shown = "", 0  # everything decoded so far; how much of it was returned
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (the earliest one found)

    def put(self, token: int) -> str:
        self.text += self.utf8.put(token)
        return self._release(final=False)

    def end(self) -> str:
        self.text += self.utf8.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hits = [(i, s) for i, s in ((self.text.find(s, max(0, self.shown - self.hold)), s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self.matched = min(hits)[1]
        end = min(hits)[0] if hits else len(self.text) - (0 if final else self.hold)
        piece = self.text[self.shown:end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return piece


def stream_text(model, tokenizer, prompt_ids: Sequence[int], max_tokens: int, sampler: Sampler,
                stop: Sequence[str] = (), n_ctx: int | None = None, stats: RequestStats | None = None, spec=None
                ) -> Iterator[str]:
    """Like generate_tokens, but yields text pieces: only complete UTF-8 characters (tokenizer.decode_stream), cut
    at the first stop string (which is not yielded); end-of-generation tokens end the stream and are not shown."""
    stats = stats if stats is not None else RequestStats()
    out = TextStream(tokenizer, stop)
    for token in generate_tokens(model, prompt_ids, max_tokens, sampler, tokenizer.is_eog, n_ctx, stats, spec):
        if tokenizer.is_eog(token):
            break
        piece = out.put(token)
        if piece:
            yield piece
        if out.stopped:
            stats.stop_reason = "stop"
            return
    piece = out.end()
    if out.stopped:
        stats.stop_reason = "stop"
    if piece:
        yield piece
