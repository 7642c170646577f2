"""`pymoe serve`: an OpenAI-compatible HTTP server with parallel slots, prefix reuse, admission control and metrics.

What this is, from the socket inwards:
    HTTP (FastAPI on uvicorn, one asyncio thread)
      /v1/chat/completions, /v1/completions   parse + validate the body (400 says what is wrong), tokenize
                                               (chat: the model's own template, in jinja2's sandbox), -> a Job
      /v1/models, /health, /v1/status, /metrics (Prometheus text, prometheus_client)
            |  EngineLoop.submit(job): a bounded queue; full -> 429 with Retry-After (admission control)
            v
    EngineLoop (ONE thread, the only code that touches the model)
      admit: a free slot for each queued job; the slot whose cached tokens share the longest prefix with the
             prompt is chosen, and that prefix's KV is reused ("prompt 26 tokens = 20 reused + 6 read")
      prefill the rest of the prompt on its own, then every step: one batched decode of all busy slots
             (batch.decode_batch: per-slot attention, one MoE call so expert lookups are grouped per expert)
      each new token -> TextStream (UTF-8, stop strings) -> an event on the job's asyncio queue
      a job whose client went away is cancelled at the next step, and its slot freed
Why one engine thread and a queue: the model is one shared resource (its expert cache, its kernels); requests are
serialized into batched steps rather than run side by side. The reference article measured what happens without
a queue limit (9.3): at c = 32 every request waited and latency grew without bound. Here the queue is bounded
(--max-queue) and the excess gets a 429 at once.
What this is not: the model (model.py), the batched step (batch.py), the KV caches (kvcache_int8.py), or a
multi-process / multi-GPU deployment. Security defaults: binds 127.0.0.1; --api-key protects every endpoint but
/health (Authorization: Bearer KEY, else 401); request bodies are capped (--max-body-mib, else 413).
"""
# No `from __future__ import annotations` here: FastAPI reads the `request: Request` annotations at runtime.
import asyncio
import contextlib
import hmac
import json
import math
import os
import queue
import socket
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .batch import decode_batch
from .cache import COUNTERS
from .errors import PymoeError
from .generate import RequestStats, TextStream
from .kvcache_int8 import kv_nbytes, new_kv
from .sampler import Sampler, SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape: {"error": {"message", "type", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 413: "invalid_request_error",
             429: "rate_limit_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"), "param": None,
                          "code": self.code}}


# --- the engine loop: slots, jobs, batched steps --------------------------------------------------------------

@dataclass
class Job:
    """One request on its way through the engine. The HTTP side reads `events` (an asyncio.Queue)."""

    prompt_ids: list
    max_tokens: int
    sampling: SamplingParams
    stop: tuple = ()
    ignore_eos: bool = False
    events: Optional[asyncio.Queue] = None
    aio_loop: Optional[asyncio.AbstractEventLoop] = None
    cancel: threading.Event = field(default_factory=threading.Event)
    stats: RequestStats = field(default_factory=RequestStats)
    t_submit: float = 0.0
    queue_s: float = 0.0
    done: bool = False
    # engine-side state
    sampler: Optional[Sampler] = None
    text: Optional[TextStream] = None
    history: list = field(default_factory=list)
    next_token: int = -1

    def emit(self, kind: str, value=None) -> None:
        """Hand an event ("piece", text) / ("done", finish_reason) / ("error", message) to the HTTP side."""
        if self.aio_loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is already closed: the server is stopping
                self.aio_loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclass
class Slot:
    """One sequence's place in the batch: a KV cache and the token ids whose keys/values it holds (len == kv.n)."""

    index: int
    kv: object
    tokens: list = field(default_factory=list)
    job: Optional[Job] = None
    last_used: float = 0.0


def common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class EngineLoop:
    """The thread that owns the model: a bounded queue in, N slots decoded together, events out."""

    def __init__(self, engine, parallel: int = 1, max_queue: int = 16, kv: str = "f16", log=lambda line: None):
        if parallel < 1:
            raise PymoeError(f"--parallel must be >= 1, got {parallel}")
        if max_queue < 1:
            raise PymoeError(f"--max-queue must be >= 1, got {max_queue}")
        self.engine, self.model, self.tokenizer = engine, engine.model, engine.tokenizer
        self.n_ctx, self.kv_kind, self.log = engine.n_ctx, kv, log
        self.slots = [Slot(i, new_kv(engine.config, engine.n_ctx, kv)) for i in range(parallel)]
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)  # jobs waiting for a slot
        self.max_queue = max_queue
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()  # requests by outcome: ok, cancelled, rejected, bad_request, ...
        self.totals: Counter = Counter()  # prompt/reused/generated tokens, prefill/decode seconds
        self.last = {"decode_tok_s": 0.0, "prefill_tok_s": 0.0, "batch": 0}
        self.max_batch = 0
        self.recent: deque = deque(maxlen=32)  # summaries of the last finished requests (/v1/status)
        self.avg_request_s = 1.0  # running mean of a request's engine time: the Retry-After estimate
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="pymoe-engine", daemon=True)

    # --- the HTTP side's calls (any thread) ----------------------------------------------------------------
    def count(self, outcome: str, n: int = 1) -> None:
        with self.lock:
            self.outcomes[outcome] += n

    def submit(self, job: Job) -> None:
        """Queue a job, or raise ApiError 429 (queue full) / 503 (engine stopped)."""
        if self._stop.is_set() or not self.thread.is_alive():
            raise ApiError(503, "the engine is not running")
        job.t_submit = time.perf_counter()
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            wait = self.retry_after()
            raise ApiError(429, f"server busy: {self.max_queue} requests queued (--max-queue) and all "
                                f"{len(self.slots)} slots busy; retry in about {wait} s",
                           code="queue_full", headers={"Retry-After": str(wait)}) from None

    def retry_after(self) -> int:
        """Seconds until a queue place is likely free: queued requests x mean request time / slots, in [1, 60]."""
        est = (self.queue.qsize() + 1) * self.avg_request_s / len(self.slots)
        return int(min(60, max(1, math.ceil(est))))

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def busy(self) -> int:
        return sum(s.job is not None for s in self.slots)

    # --- the engine thread --------------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drop_cancelled()
                self._admit()
                active = [s for s in self.slots if s.job is not None]
                if active:
                    self._decode_step(active)
            except Exception as e:  # a bug or a model error: fail the jobs in flight, keep serving
                msg = " ".join(str(e).split()) or type(e).__name__
                self.log(f"engine error: {type(e).__name__}: {msg}")
                for s in self.slots:
                    if s.job is not None:
                        self._finish(s, "error", f"{type(e).__name__}: {msg}")
        for s in self.slots:  # shutting down: nobody will decode these
            if s.job is not None:
                self._finish(s, "error", "server shutting down")
        with contextlib.suppress(queue.Empty):
            while True:
                self.queue.get_nowait().emit("error", "server shutting down")

    def _drop_cancelled(self) -> None:
        for s in self.slots:
            if s.job is not None and s.job.cancel.is_set():
                self._finish(s, "cancelled")

    def _admit(self) -> None:
        """Move queued jobs into free slots (blocking briefly when there is nothing else to do)."""
        idle = not any(s.job is not None for s in self.slots)
        while any(s.job is None for s in self.slots):
            try:
                job = self.queue.get(timeout=0.05) if idle else self.queue.get_nowait()
            except queue.Empty:
                return
            idle = False
            if job.cancel.is_set():
                job.done = True
                self.count("cancelled")
                continue
            slot = self._pick_slot(job.prompt_ids)
            try:
                self._start(slot, job)
            except PymoeError as e:
                slot.job = job
                self._finish(slot, "error", str(e))

    def _pick_slot(self, prompt: list) -> Slot:
        """The free slot sharing the longest prefix with the prompt; among equals, the least recently used."""
        free = [s for s in self.slots if s.job is None]
        return max(free, key=lambda s: (common_prefix(s.tokens, prompt), -s.last_used))

    def _start(self, slot: Slot, job: Job) -> None:
        """Prefill the job's prompt into the slot, reusing the cached prefix, and sample its first token."""
        prompt, st = job.prompt_ids, job.stats
        reused = min(common_prefix(slot.tokens, prompt), len(prompt) - 1)  # at least one token to get logits from
        job.queue_s = time.perf_counter() - job.t_submit
        job.sampler, job.text, job.history = Sampler(job.sampling), TextStream(self.tokenizer, job.stop), list(prompt)
        slot.job, slot.kv.n, slot.tokens = job, reused, slot.tokens[:reused]
        st.n_prompt, st.n_reused, st.stop_reason = len(prompt), reused, "length"
        st.decode = dict.fromkeys(COUNTERS, 0)
        st.note_cache(self.engine.cache)
        t0 = time.perf_counter()
        logits = self.model.prefill(np.asarray(prompt[reused:]), slot.kv)[-1]  # [V]
        st.prompt_s = time.perf_counter() - t0
        slot.tokens = list(prompt)
        with self.lock:
            self.totals["prompt_tokens"] += len(prompt)
            self.totals["reused_tokens"] += reused
            self.totals["prefill_seconds"] += st.prompt_s
            self.last["prefill_tok_s"] = st.prefill_tok_s
        self._advance(slot, logits)

    def _decode_step(self, active: list) -> None:
        """One batched forward: the last token of every busy slot -> their next logits."""
        counts = [s.job.stats.decode for s in active]
        t0 = time.perf_counter()
        logits = decode_batch(self.model, [s.job.next_token for s in active], [s.kv for s in active], counts)
        dt = time.perf_counter() - t0
        with self.lock:
            self.totals["decode_seconds"] += dt
            self.last["decode_tok_s"], self.last["batch"] = len(active) / dt if dt > 0 else 0.0, len(active)
            self.max_batch = max(self.max_batch, len(active))
        for s, row in zip(active, logits):
            s.tokens.append(s.job.next_token)
            s.job.stats.decode_s += dt
            s.job.stats.n_decoded += 1
            self._advance(s, row)

    def _advance(self, slot: Slot, logits: np.ndarray) -> None:
        """Sample the slot's next token and pass its text on; finish on end-of-generation, a stop string or length."""
        job, st = slot.job, slot.job.stats
        token = job.sampler(logits, job.history)
        job.history.append(token)
        st.n_generated += 1
        with self.lock:
            self.totals["generated_tokens"] += 1
        if self.tokenizer.is_eog(token) and not job.ignore_eos:
            return self._finish(slot, "stop")
        piece = job.text.put(token)
        if piece:
            job.emit("piece", piece)
        if job.text.stopped:
            return self._finish(slot, "stop")
        if st.n_generated >= job.max_tokens:
            return self._finish(slot, "length")
        job.next_token = token

    def _finish(self, slot: Slot, reason: str, error: str = "") -> None:
        """Free the slot (its KV cache and tokens stay, for prefix reuse) and tell the job how it ended."""
        job, st = slot.job, slot.job.stats
        slot.job, slot.last_used = None, time.perf_counter()
        if len(slot.tokens) != slot.kv.n:  # an error mid-step: the cache no longer matches, don't reuse it
            slot.tokens, slot.kv.n = [], 0
        job.done = True
        st.stop_reason = reason
        if reason in ("stop", "length"):
            tail = job.text.end() if not job.text.stopped else ""
            if tail:
                job.emit("piece", tail)
            if job.text.stopped:
                st.stop_reason = "stop"
            job.emit("done", st.stop_reason)
        elif reason == "error":
            job.emit("error", error)
        self.count({"stop": "ok", "length": "ok"}.get(reason, reason))
        engine_s = st.prompt_s + st.decode_s
        self.avg_request_s = 0.8 * self.avg_request_s + 0.2 * engine_s
        self.recent.append(dict(slot=slot.index, n_prompt=st.n_prompt, n_reused=st.n_reused,
                                n_generated=st.n_generated, stop_reason=st.stop_reason,
                                queue_ms=round(job.queue_s * 1e3, 1), prompt_line=st.prompt_line(),
                                cache_line=st.cache_line()))
        self.log(f"slot {slot.index}: {st.prompt_line()}, {st.stop_reason}")
        self.log(f"slot {slot.index}: {st.cache_line()}")

    # --- what /v1/status and /metrics show --------------------------------------------------------------------
    def status(self) -> dict:
        eng, cfg, cache = self.engine, self.engine.config, self.engine.cache
        n_experts = cfg.n_layers * cfg.n_expert
        counts = {p: dict(c) for p, c in cache.stats.counts.items()}
        with self.lock:
            return dict(
                model=model_id(eng), arch=cfg.arch, backend=eng.backend.name, n_ctx=self.n_ctx,
                kv=self.kv_kind, kv_bytes_per_slot=kv_nbytes(self.slots[0].kv), parallel=len(self.slots),
                max_queue=self.max_queue, queue_depth=self.queue.qsize(), max_batch=self.max_batch,
                slots=[dict(index=s.index, busy=s.job is not None, cached_tokens=len(s.tokens)) for s in self.slots],
                cache=dict(describe=cache.describe(), slots=cache.n_slots, experts=n_experts,
                           policy=cache.policy_name, pool=cache.n_slots > 0,
                           coverage=cache.n_slots / n_experts,  # of the slot pool: 0 with none
                           counts=counts),
                requests=dict(self.outcomes), tokens=dict(self.totals), last=dict(self.last),
                recent=list(self.recent),
            )


def model_id(engine) -> str:
    return os.path.basename(engine.file.path)


# --- Prometheus ------------------------------------------------------------------------------------------------

class ServerCollector:
    """Reads the engine loop's and the expert cache's counters at scrape time (nothing is counted twice)."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        L = self.loop
        with L.lock:
            outcomes, totals, last = dict(L.outcomes), dict(L.totals), dict(L.last)
        req = CounterMetricFamily("pymoe_requests", "Requests by outcome (ok, cancelled, rejected = 429, "
                                  "bad_request = 400, unauthorized, too_large, error).", labels=["outcome"])
        for outcome, n in sorted(outcomes.items()):
            req.add_metric([outcome], n)
        yield req
        yield GaugeMetricFamily("pymoe_queue_depth", "Requests waiting for a slot.", value=L.queue.qsize())
        yield GaugeMetricFamily("pymoe_slots_busy", "Slots decoding a request.", value=L.busy())
        yield GaugeMetricFamily("pymoe_slots", "Parallel slots (--parallel).", value=len(L.slots))
        for name, doc in (("prompt_tokens", "Prompt tokens received."),
                          ("reused_tokens", "Prompt tokens whose KV was reused from a slot (prefix reuse)."),
                          ("generated_tokens", "Tokens generated."), ("prefill_seconds", "Seconds spent in prefill."),
                          ("decode_seconds", "Seconds spent in batched decode steps.")):
            yield CounterMetricFamily(f"pymoe_{name}", doc, value=totals.get(name, 0))
        yield GaugeMetricFamily("pymoe_decode_tokens_per_second", "Tokens per second of the last batched decode "
                                "step, all slots together.", value=last["decode_tok_s"])
        yield GaugeMetricFamily("pymoe_prefill_tokens_per_second", "Prompt tokens per second of the last prefill.",
                                value=last["prefill_tok_s"])
        yield from self._cache_metrics(CounterMetricFamily, GaugeMetricFamily)

    def _cache_metrics(self, CounterMetricFamily, GaugeMetricFamily):
        counts = {p: dict(c) for p, c in self.loop.engine.cache.stats.counts.items()}
        for name in COUNTERS:
            fam = CounterMetricFamily(f"pymoe_expert_{name}", f"Expert cache {name} by phase.", labels=["phase"])
            for phase, c in counts.items():
                fam.add_metric([phase], c[name])
            yield fam
        pool = self.loop.engine.cache.n_slots > 0
        rate = GaugeMetricFamily("pymoe_expert_hit_rate", "Expert cache hits / lookups (NaN with no slot pool: no "
                                 "cache, no hit rate).", labels=["phase"])
        for phase, c in counts.items():
            value = (c["hits"] / c["lookups"] if c["lookups"] else 0.0) if pool else math.nan
            rate.add_metric([phase], value)
        yield rate
        d = counts["decode"]
        for path in ("spill", "cpu"):
            yield GaugeMetricFamily(f"pymoe_expert_{path}_share", f"Share of decode expert lookups served by {path}.",
                                    value=d[path] / d["lookups"] if d["lookups"] else 0.0)


# --- request bodies -> jobs ------------------------------------------------------------------------------------

def _field(body: dict, name: str, kinds: tuple, default, ok=lambda v: True, what: str = ""):
    """body[name] checked for type and range; absent or null -> default; else a 400 naming the field."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds) or not ok(v):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(v)[:60]}", code="invalid_value")
    return v


def sampling_from(body: dict) -> SamplingParams:
    """OpenAI's temperature / top_p / seed, and llama.cpp's top_k / min_p / repeat_penalty."""
    num = (int, float)
    return SamplingParams(
        temperature=float(_field(body, "temperature", num, 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_p=float(_field(body, "top_p", num, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=_field(body, "top_k", (int,), 40, lambda v: v >= 0, "an integer >= 0"),
        min_p=float(_field(body, "min_p", num, 0.05, lambda v: 0 <= v <= 1, "a number in [0, 1]")),
        repeat_penalty=float(_field(body, "repeat_penalty", num, 1.0, lambda v: v > 0, "a number > 0")),
        seed=_field(body, "seed", (int,), None, what="an integer"),
    )


def stop_from(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", code="invalid_value")
    return tuple(stop)


def chat_prompt(body: dict, tokenizer) -> list:
    """messages -> the model's chat template (sandboxed) -> token ids."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}", code="invalid_value")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] needs a 'role', one of {', '.join(ROLES)}", code="invalid_value")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", code="invalid_value")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           code="invalid_value")
        clean.append({"role": m["role"], "content": content or ""})
    try:
        return tokenizer.encode(tokenizer.apply_chat_template(clean))
    except PymoeError as e:
        raise ApiError(400, str(e), code="invalid_value") from None


def completion_prompt(body: dict, tokenizer) -> list:
    """prompt: a string, a list of token ids, or a list holding one of those."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return tokenizer.encode(p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                   code="invalid_value")


def make_job(body: dict, prompt: list, loop: EngineLoop) -> Job:
    """Check the prompt against the context and vocabulary, and max_tokens; -> a Job (400 on what is wrong)."""
    n_ctx, n_vocab = loop.n_ctx, loop.engine.config.n_vocab
    if not prompt:
        raise ApiError(400, "the prompt is empty", code="invalid_value")
    if min(prompt) < 0 or max(prompt) >= n_vocab:
        raise ApiError(400, f"prompt token ids must be in 0..{n_vocab - 1}", code="invalid_value")
    if len(prompt) >= n_ctx:
        raise ApiError(400, f"the prompt of {len(prompt)} tokens does not fit the context of {n_ctx} tokens "
                            "(room is needed for at least one generated token)", code="context_length_exceeded")
    room = n_ctx - len(prompt)
    asked = _field(body, "max_completion_tokens", (int,), None, lambda v: v >= 1, "an integer >= 1")
    asked = _field(body, "max_tokens", (int,), asked, lambda v: v >= 1, "an integer >= 1")
    _field(body, "n", (int,), 1, lambda v: v == 1, "1 (one choice per request)")
    if body.get("logprobs"):
        raise ApiError(400, "'logprobs' is not supported", code="invalid_value")
    return Job(prompt_ids=prompt, max_tokens=min(asked or room, room), sampling=sampling_from(body),
               stop=stop_from(body), ignore_eos=bool(_field(body, "ignore_eos", (bool,), False, what="a boolean")))


# --- responses ---------------------------------------------------------------------------------------------------

def usage_of(st: RequestStats) -> dict:
    return {"prompt_tokens": st.n_prompt, "completion_tokens": st.n_generated,
            "total_tokens": st.n_prompt + st.n_generated, "prompt_tokens_details": {"cached_tokens": st.n_reused}}


def timings_of(job: Job) -> dict:
    """llama.cpp server's `timings` object (pymoe bench reads it), plus the time spent in the queue."""
    st = job.stats
    return {"queue_ms": job.queue_s * 1e3, "cache_n": st.n_reused, "prompt_n": st.n_prompt - st.n_reused,
            "prompt_ms": st.prompt_s * 1e3, "prompt_per_second": st.prefill_tok_s, "predicted_n": st.n_generated,
            "predicted_ms": st.decode_s * 1e3, "predicted_per_second": st.decode_tok_s}


class Reply:
    """The JSON shapes of one answer: chat (chat.completion[.chunk]) or completion (text_completion)."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def choice(self, text: Optional[str], reason: Optional[str], stream: bool, role: bool = False) -> dict:
        if self.kind == "completion":
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        msg = {"role": "assistant"} if role or not stream else {}
        if text is not None:
            msg["content"] = text
        return {"index": 0, "delta" if stream else "message": msg, "logprobs": None, "finish_reason": reason}

    def envelope(self, choices: list, stream: bool, **extra) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion" + (".chunk" if stream else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def job_events(job: Job, request=None):
    """The job's events until done/error. If the consumer stops (client gone) the job is cancelled.
    `request`: poll it for a disconnect while waiting (non-streaming answers; streaming ones are cancelled by
    Starlette when the client goes away)."""
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    return
                continue
            yield kind, value
            if kind in ("done", "error"):
                return
    finally:
        if not job.done:
            job.cancel.set()


# --- the app -----------------------------------------------------------------------------------------------------

def create_app(engine, parallel: int = 1, max_queue: int = 16, kv: str = "f16", api_key: Optional[str] = None,
               max_body_bytes: int = 4 << 20, log=lambda line: None):
    """The FastAPI app and its EngineLoop (started and stopped with the app's lifespan); -> app (app.state.loop)."""
    from fastapi import Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    loop = EngineLoop(engine, parallel=parallel, max_queue=max_queue, kv=kv, log=log)
    registry = CollectorRegistry()
    registry.register(ServerCollector(loop))
    name = model_id(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        log(f"engine loop: {parallel} slot(s) of {engine.n_ctx} tokens ({kv} KV, "
            f"{kv_nbytes(loop.slots[0].kv) / 2**20:.1f} MiB each), queue of {max_queue}")
        yield
        loop.stop()

    app = FastAPI(title="pymoe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.loop = loop

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        loop.count({400: "bad_request", 401: "unauthorized", 413: "too_large", 429: "rejected"}.get(e.status, "error"))
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def authorized(request: Request):
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")

    guarded = [Depends(authorized)]

    async def read_json(request: Request) -> dict:
        declared = request.headers.get("content-length", "0")
        if not declared.isdigit() or int(declared) > max_body_bytes:
            raise ApiError(413, f"request body over the limit of {max_body_bytes} bytes", code="body_too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > max_body_bytes:
                raise ApiError(413, f"request body over the limit of {max_body_bytes} bytes", code="body_too_large")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        return body

    async def complete(request: Request, kind: str):
        body = await read_json(request)
        prompt = (chat_prompt if kind == "chat" else completion_prompt)(body, engine.tokenizer)
        job = make_job(body, prompt, loop)
        stream = bool(_field(body, "stream", (bool,), False, what="a boolean"))
        opts = _field(body, "stream_options", (dict,), {}, what="an object")
        job.aio_loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        loop.submit(job)
        reply = Reply(kind, name)
        if stream:
            return StreamingResponse(stream_reply(job, reply, bool(opts.get("include_usage"))),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        pieces, reason = [], None
        async for ev, value in job_events(job, request):
            if ev == "piece":
                pieces.append(value)
            elif ev == "error":
                raise ApiError(500, value)
            else:
                reason = value
        if reason is None:  # the client went away; nobody reads this
            return JSONResponse({}, status_code=499)
        return JSONResponse(reply.envelope([reply.choice("".join(pieces), reason, stream=False)], stream=False,
                                           usage=usage_of(job.stats), timings=timings_of(job)))

    async def stream_reply(job: Job, reply: Reply, include_usage: bool):
        if reply.kind == "chat":
            yield sse(reply.envelope([reply.choice("", None, stream=True, role=True)], stream=True))
        async for ev, value in job_events(job):
            if ev == "piece":
                yield sse(reply.envelope([reply.choice(value, None, stream=True)], stream=True))
            elif ev == "error":
                yield sse(ApiError(500, value).body())
            else:
                yield sse(reply.envelope([reply.choice(None, value, stream=True)], stream=True,
                                         timings=timings_of(job)))
                if include_usage:
                    yield sse(reply.envelope([], stream=True, usage=usage_of(job.stats)))
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request):
        return await complete(request, "completion")

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(os.path.getmtime(
            engine.file.path)), "owned_by": "pymoe", "meta": {"arch": engine.config.arch, "n_ctx": engine.n_ctx}}]}

    @app.get("/health")
    async def health():
        ok = loop.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/v1/status", dependencies=guarded)
    async def status():
        return loop.status()

    @app.get("/metrics", dependencies=guarded)
    async def metrics():
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def serve(model: str, host: str = "127.0.0.1", port: int = 8080, api_key: Optional[str] = None,
          parallel: int = 1, max_queue: int = 16, kv: str = "f16", max_body_bytes: int = 4 << 20,
          log=print, **engine_options) -> None:
    """Load MODEL and serve it until interrupted (`pymoe serve`). engine_options: api.load's (n_ctx, cache_slots...)."""
    import uvicorn

    from .api import load

    if not is_loopback(host) and not api_key:
        log(f"warning: listening on {host} without --api-key: anyone who can reach this port can use the model")
    engine = load(model, progress=True, log=log, **engine_options)
    app = create_app(engine, parallel=parallel, max_queue=max_queue, kv=kv, api_key=api_key,
                     max_body_bytes=max_body_bytes, log=log)
    log(f"listening on http://{host}:{port} (OpenAI API at /v1, metrics at /metrics)")
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


class BackgroundServer:
    """An app served by uvicorn in a thread on a loopback port the OS chooses (tests, tools); use as a context."""

    def __init__(self, app, host: str = "127.0.0.1"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise PymoeError(f"server at {self.url} did not start within {timeout:g} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
