"""The scheduler of `pymoe serve`: one engine thread, N parallel slots, a bounded queue, batched decode steps.

    job = Job(prompt_ids=[...], max_tokens=32, sampling=SamplingParams(temperature=0))
    scheduler.submit(job)                 # QueueFull (the queue is full) / EngineStopped, else queued
    for kind, value in job.events(): ...  # ("piece", text)* then ("done", "stop" | "length") or ("error", message);
                                          # with top_logprobs, ("logprobs", (id, logp, [(id, logp)])) before a piece
    job.cancel()                          # from any thread: the slot is freed at the next step
    job.deadline = time.perf_counter() + 600  # still running then: it ends as if at max_tokens

What this is, in the order a job meets it:
    submit: a bounded queue of jobs waiting for a slot; full -> QueueFull with a retry estimate (admission control)
    admit:  a free slot for each queued job; the slot whose cached tokens share the longest prefix with the prompt
            is chosen, and that prefix's KV is reused ("prompt 26 tokens = 20 reused + 6 read"); the rest is
            pending. A job with `id_slot` takes that slot, waiting beside the queue while it is busy; one with
            `cache_prompt` False reuses nothing
    share:  the n choices of one request (n > 1: `Job.sibling`, seeds seed + i) share one prefill (`Share`): the
            first sibling placed reads the prompt, siblings placed meanwhile wait in their slots, and after its last
            chunk each gets a copy of that slot's KV (KVCache.copy_from: K/V, MLA latent, Gated DeltaNet states) and
            samples its first token from the same logits with its own sampler; siblings still queued then (fewer
            free slots than n) copy a kept copy when they get a slot. A sibling that goes away mid-prefill hands the
            prompt to a waiting one
    step:   one batched decode of the slots that are decoding (batch.decode_batch: the projections of all slots as
            one matmul, attention per slot over its own cache, one MoE call so expert lookups are grouped per
            expert; on cuda the slots on device KV caches decode by device steps instead: one batched device step
            for them where engine/device_batch.py can run it, else one each) -> sample -> TextStream (UTF-8, stop
            strings) -> an event for the job; then one chunk
            (--prefill-chunk tokens) of the oldest pending prompt, whose first token is sampled after its last chunk
            (chunked prefill: a long prompt never stalls the others for more than a chunk; docs/server.md has the
            numbers). With --spec the step is a speculative one for every busy slot at once: each slot drafts, one
            batch.forward_batch verifies all slots' tokens, each slot keeps what its sampler accepts
            (`_spec_step`)
    forced: with a grammar, the tokens it forces after a sampled one (its fixed text: a tool call's markers, the
            function's name, JSON keys; llguidance's compute_ff_tokens) are taken at once, without sampling, and
            read with that token in the next step's forward (batch.forward_batch: [token, forced...] of that slot,
            its last row sampled), not one step each. Not with logprobs asked (each token has its own there)
    cancel: a job cancelled by its consumer (an HTTP client that went away) is dropped at the next step; a job past
            its deadline (app.py: request_timeout after the request came in) ends at the next step with
            ("done", "length"), keeping the text it has (llama.cpp's t_max_predict_ms ends the same way)
    fail:   whatever a job's own work raises (its sampler, its prompt's prefill, the first token) ends that job
            with ("error", message) and no other; an exception in a batched decode step ends the jobs of that
            batch; every job taken off the queue is answered, and the thread goes on serving
Why one engine thread and a queue: the model is one shared resource (its expert cache, its kernels); requests are
serialized into batched steps rather than run side by side. The reference article measured what happens without
a queue limit (9.3): at c = 32 every request waited and latency grew without bound. Here the queue is bounded
(--max-queue) and the excess is turned away at once.
What this is not: HTTP (app.py turns QueueFull into a 429, events into JSON or SSE; nothing here imports a web
framework), request validation (schemas.py), the model (engine/model.py), the batched step (engine/batch.py) or
the KV caches (engine/kv.py).
"""
from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

import numpy as np

from pymoe.engine.batch import decode_batch, forward_batch
from pymoe.engine.device_batch import batch_step_possible, decode_steps
from pymoe.engine.generate import RequestStats, TextStream
from pymoe.engine.grammar import Grammar
from pymoe.engine.kv import copy_kv, new_kv
from pymoe.engine.sampler import Sampler, SamplingParams
from pymoe.engine.speculative import SpecStats, Speculator, propose_all
from pymoe.errors import PymoeError
from pymoe.experts.cache import COUNTERS

FINAL = ("done", "error")  # the kinds of event that end a job's stream
# Chunked prefill: a prompt is read PREFILL_CHUNK tokens per engine step, between the decode steps of the other
# slots, so a long prompt delays their next token by one chunk's prefill instead of its whole prefill (llama.cpp's
# n_ubatch is 512 too). 0: each prompt in one piece.
PREFILL_CHUNK = 512


class QueueFull(PymoeError):
    """Every slot is busy and the queue holds --max-queue jobs: try again in `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class EngineStopped(PymoeError):
    """The engine thread is not running (not started yet, stopped, or the server is shutting down)."""


class Share:
    """The prompt the n choices of one request share (n > 1: `Job.sibling`), prefilled once for all of them.

    The first sibling to reach a slot prefills it (`prefiller`); siblings placed meanwhile wait in their slots
    (`followers`) and, when the last chunk is read, each gets a copy of that slot's KV (engine/kv.py
    KVCache.copy_from: K/V, MLA's latent, a Gated DeltaNet's states) and samples its first token from the same
    logits with its own sampler. Siblings still queued then (fewer free slots than n, or not yet taken off the
    queue) find a copy kept in `kept` (KV, logits) until the last of them is placed. Engine thread only."""

    def __init__(self, n: int):
        self.waiting = n  # siblings not placed in a slot yet
        self.prefiller: Optional["Slot"] = None
        self.followers: list = []
        self.kept: Optional[tuple] = None  # (KV cache, logits [V]) of the prefilled prompt, while siblings wait


@dataclass
class Job:
    """One request on its way through the engine: what to generate, and where its events go.

    `sink(event)` is called on the engine thread with each event (kind, value); without one, the events wait in a
    thread-safe queue that `events()` reads. Only the engine thread writes the fields below `sink`."""

    prompt_ids: list
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple = ()
    ignore_eos: bool = False
    grammar: Optional[Grammar] = None  # the output stays inside it (engine/grammar.py): response_format, grammar
    preserved: frozenset = frozenset()  # control token ids shown in the text: a tool format's markers (tools.py)
    top_logprobs: Optional[int] = None  # None: no ("logprobs", ...) events; n: each token's and the n best's
    share: Optional[Share] = None  # the n > 1 choices of one request: their prompt is prefilled once (`sibling`)
    cache_prompt: bool = True  # False: the whole prompt is prefilled, no prefix of a slot's cache reused
    id_slot: int = -1  # >= 0: the job runs in that slot, waiting for it when busy (llama.cpp's id_slot)
    sink: Optional[Callable[[tuple], None]] = None
    stats: RequestStats = field(default_factory=RequestStats)
    t_submit: float = 0.0
    load_mark: tuple = (0, 0.0)  # (requests in the engine when it came, itself included; Scheduler.load_area then)
    deadline: float = math.inf  # perf_counter() time past which the job ends as if at max_tokens ("length")
    queue_s: float = 0.0
    done: bool = False
    ended: bool = False  # its final event (done / error) has been emitted
    # engine-side state
    sampler: Optional[Sampler] = None
    text: Optional[TextStream] = None
    history: list = field(default_factory=list)  # prompt + generated token ids
    next_token: int = -1
    forced: list = field(default_factory=list)  # the grammar's forced tokens after next_token, taken, not yet read
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    _inbox: queue.Queue = field(default_factory=queue.Queue, repr=False)

    # --- the consumer's side (any thread) -----------------------------------------------------------------------
    def sibling(self, i: int) -> "Job":
        """Choice i of a request with n > 1: the same prompt and settings, draws of its own (seed + i when the
        request gave a seed; greedy choices are all the same, as on OpenAI). The siblings share one `Share`: the
        engine prefills their prompt once and copies its KV into each sibling's slot."""
        seed = None if self.sampling.seed in (None, -1) else (self.sampling.seed + i) % 2**64  # -1: random
        if self.share is None:
            self.share = Share(1)
        self.share.waiting += 1
        return Job(prompt_ids=self.prompt_ids, max_tokens=self.max_tokens, sampling=replace(self.sampling, seed=seed),
                   stop=self.stop, ignore_eos=self.ignore_eos, grammar=self.grammar, top_logprobs=self.top_logprobs,
                   share=self.share, preserved=self.preserved, cache_prompt=self.cache_prompt)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def events(self, timeout: Optional[float] = None) -> Iterator[tuple]:
        """The job's events until the final one (only without a sink); `timeout` per event -> queue.Empty."""
        while True:
            event = self._inbox.get(timeout=timeout)
            yield event
            if event[0] in FINAL:
                return

    @property
    def generated(self) -> list:
        """The token ids generated so far (the end-of-generation token included when it ended the job)."""
        return self.history[len(self.prompt_ids):]

    # --- the engine's side ------------------------------------------------------------------------------------
    def emit(self, kind: str, value=None) -> None:
        """Pass an event on; a sink that raises (its consumer is gone) cancels the job, and the engine goes on."""
        self.ended = self.ended or kind in FINAL
        try:
            (self.sink or self._inbox.put)((kind, value))
        except Exception:
            self.cancel()


@dataclass
class Slot:
    """One sequence's place in the batch: a KV cache and the token ids whose keys/values it holds (len == kv.n)."""

    index: int
    kv: object
    tokens: list = field(default_factory=list)
    job: Optional[Job] = None
    last_used: float = 0.0
    spec: object = None  # engine/speculative.Speculator of this slot (`--spec`), its counters reset per job
    pending: list = field(default_factory=list)  # prompt ids not prefilled yet (chunked prefill); [] once decoding
    share: Optional[Share] = None  # set while the slot waits for a sibling's prefill of the same prompt


def cache_keys(prompt) -> list:
    """What prefix reuse compares: the token ids, where an image's pad tokens are replaced by a key of the image's
    bytes (engine/multimodal.py): two prompts with different images at one place share only the text before it."""
    media = getattr(prompt, "media", None)
    if media is None or not media.images:
        return list(prompt)
    keys = list(prompt)
    for start, img in zip(media.start_rows, media.images):
        key = -1 - int(img.key[:15], 16)  # negative: never a token id
        keys[start:start + img.n_tokens] = [key] * img.n_tokens
    return keys


def common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class Scheduler:
    """The thread that owns the model: a bounded queue in, N slots decoded together, events out.

    What it counts (read under `lock` by metrics.py): `outcomes` (requests by outcome: ok, cancelled, error, and
    what the HTTP side adds with `count`), `totals` (prompt / reused / generated tokens, prefill / decode
    seconds), `last` (the last step's rates and batch size), `max_batch`, `recent` (the last finished jobs),
    `in_flight` and `load_area` (requests in the engine, and their integral over time: the telemetry's concurrency).
    With `telemetry` (experts/telemetry.TelemetryWriter) each job that ends, and each 429, writes a line."""

    def __init__(self, engine, parallel: int = 1, max_queue: int = 16, kv: str = "f16", log=lambda line: None,
                 spec: Optional[str] = None, spec_k: int = 4, prefill_chunk: int = PREFILL_CHUNK, telemetry=None,
                 fast_forward: bool = True):
        if parallel < 1:
            raise PymoeError(f"--parallel must be >= 1, got {parallel}")
        if prefill_chunk < 0:
            raise PymoeError(f"--prefill-chunk must be >= 0 (0: a whole prompt at once), got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.fast_forward = fast_forward  # a grammar's forced tokens taken without sampling (`_take`)
        if max_queue < 1:
            raise PymoeError(f"--max-queue must be >= 1, got {max_queue}")
        self.engine, self.model, self.tokenizer = engine, engine.model, engine.tokenizer
        self.n_ctx, self.kv_kind, self.log = engine.n_ctx, kv, log
        self.slots = [Slot(i, self._slot_kv()) for i in range(parallel)]
        self.spec = spec
        if spec:  # a Speculator per slot (its counters, its back-off timing) and a drafter per slot: a draft
            # model's or an MTP block's own KV cache (`fork`: the weights are loaded once); prompt lookup is shared
            drafter = engine.speculator(spec, spec_k, backend="cpu").drafter
            for slot in self.slots:
                slot.spec = Speculator(drafter.fork() if hasattr(drafter, "fork") else drafter, spec_k)
            self.model.count_experts = True  # distinct experts per step, for the request line
        self.queue: queue.Queue = queue.Queue(maxsize=max_queue)  # jobs waiting for a slot
        self.pinned: list = []  # jobs off the queue waiting for the busy slot their id_slot names (engine thread)
        self.max_queue = max_queue
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.totals: Counter = Counter()
        self.last = {"decode_tok_s": 0.0, "prefill_tok_s": 0.0, "batch": 0}
        self.max_batch = 0
        self.recent: deque = deque(maxlen=32)  # summaries of the last finished requests (/v1/status)
        self.avg_request_s = 1.0  # running mean of a request's engine time: the retry estimate
        # Load, for the telemetry lines (experts/telemetry.py): requests in the engine (queued or in a slot) and its
        # integral over time, so a job's mean concurrency over its lifetime is (area at its end - at its start) / age
        self.telemetry = telemetry
        self.in_flight, self.load_area, self._load_t = 0, 0.0, time.perf_counter()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="pymoe-engine", daemon=True)

    def _slot_kv(self):
        """A slot's KV cache: one the backend lends while it has one free (CUDA: a device KV cache, so the slot's
        attention and decode steps run on the device; `pymoe serve -np N` asks for N at load, api.Engine
        `sequences`), else a host one of --kv's kind. Not with several devices (backends/multi_device.py): their
        slots keep host caches."""
        b = self.model.backend
        own = (b.new_kv(self.n_ctx) if hasattr(b, "owns") and not hasattr(b, "shards") and not self.model.host_attention
               else None)
        return own if own is not None else new_kv(self.engine.config, self.n_ctx, self.kv_kind)

    def _owns(self, kv) -> bool:
        owns = getattr(self.model.backend, "owns", None)
        return owns is not None and owns(kv)

    def device_slots(self) -> int:
        """Slots whose KV cache is on the device (float32; the others: host caches of --kv's kind)."""
        return sum(self._owns(s.kv) for s in self.slots)

    # --- the consumers' calls (any thread) ----------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        """Queue a job -> the job; raise QueueFull (queue full) or EngineStopped (engine not running)."""
        if not self.running():
            raise EngineStopped("the engine is not running")
        job.t_submit = time.perf_counter()
        job.load_mark = self._load(+1)
        try:
            if self.waiting() >= self.max_queue:  # a pinned job still waits: it counts
                raise queue.Full
            self.queue.put_nowait(job)
        except queue.Full:
            self._load(-1)
            if self.telemetry is not None:
                self.telemetry.rejected(self.queue.qsize(), self.max_queue)
            wait = self.retry_after()
            raise QueueFull(f"server busy: {self.max_queue} requests queued (--max-queue) and all "
                            f"{len(self.slots)} slots busy; retry in about {wait} s", wait) from None
        return job

    def retry_after(self) -> int:
        """Seconds until a queue place is likely free: queued requests x mean request time / slots, in [1, 60]."""
        est = (self.waiting() + 1) * self.avg_request_s / len(self.slots)
        return int(min(60, max(1, math.ceil(est))))

    def _load(self, delta: int) -> tuple:
        """Requests in the engine change by `delta` -> (requests now, load area now: request-seconds so far)."""
        with self.lock:
            now = time.perf_counter()
            self.load_area += self.in_flight * (now - self._load_t)
            self._load_t, self.in_flight = now, self.in_flight + delta
            return self.in_flight, self.load_area

    def waiting(self) -> int:
        """Jobs waiting for a slot: queued, or off the queue waiting for the busy slot their id_slot names."""
        return self.queue.qsize() + len(self.pinned)

    def count(self, outcome: str, n: int = 1) -> None:
        with self.lock:
            self.outcomes[outcome] += n

    def start(self) -> "Scheduler":
        self.thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def running(self) -> bool:
        return not self._stop.is_set() and self.thread.is_alive()

    def busy(self) -> int:
        return sum(s.job is not None for s in self.slots)

    def __enter__(self) -> "Scheduler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the engine thread --------------------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drop_ended()
                self._admit()
                decoding = [s for s in self.slots if s.job is not None and not s.pending and s.share is None]
                if decoding:
                    self._decode_step(decoding)
                prefilling = [s for s in self.slots if s.job is not None and s.pending]  # (waiting ones: no pending)
                if prefilling:  # one chunk of one prompt per step: the oldest job's first
                    slot = min(prefilling, key=lambda s: s.job.t_submit)
                    self._for_job(slot, self._prefill_chunk, slot)
            except Exception as e:  # a bug or a model error in a batched step: fail the jobs in flight, keep serving
                for s in self.slots:
                    if s.job is not None:
                        self._fail(s, s.job, e)
        for s in self.slots:  # shutting down: nobody will decode these
            if s.job is not None:
                self._finish(s, "error", "server shutting down")
        for job in self.pinned:
            job.emit("error", "server shutting down")
        with contextlib.suppress(queue.Empty):
            while True:
                self.queue.get_nowait().emit("error", "server shutting down")

    def _for_job(self, slot: Slot, work: Callable, *args) -> None:
        """work(*args) for the slot's job; whatever it raises ends that job, and only it, with an error."""
        job = slot.job
        try:
            work(*args)
        except Exception as e:
            self._fail(slot, job, e)

    def _fail(self, slot: Slot, job: Job, e: Exception) -> None:
        """End the job with ("error", message): a PymoeError's own line (a bad input), else the exception's type and
        text (a bug or a model error, logged). A job that failed on its way out of the slot is still answered."""
        msg = " ".join(str(e).split()) or type(e).__name__
        if not isinstance(e, PymoeError):
            msg = f"{type(e).__name__}: {msg}"
            self.log(f"engine error in slot {slot.index}: {msg}")
        if slot.job is job:
            self._finish(slot, "error", msg)
        elif not job.ended:
            job.emit("error", msg)

    def _drop_ended(self) -> None:
        """Free the slots of cancelled jobs; end those past their deadline as if at max_tokens."""
        now = time.perf_counter()
        for job in [j for j in self.pinned if j.cancelled]:
            self.pinned.remove(job)
            job.done = True
            job.emit("done", "cancelled")
            self.count("cancelled")
        for s in self.slots:
            if s.job is not None and s.job.cancelled:
                self._finish(s, "cancelled")
            elif s.job is not None and now > s.job.deadline:
                self._finish(s, "timeout")

    def _admit(self) -> None:
        """Move queued jobs into free slots (blocking briefly when there is nothing else to do). A job whose id_slot
        names a busy slot waits beside the queue (`pinned`) and goes first once that slot is free."""
        for job in list(self.pinned):
            slot = self.slots[job.id_slot]
            if slot.job is None:
                self.pinned.remove(job)
                slot.job = job
                self._for_job(slot, self._start, slot, job)
        idle = not any(s.job is not None for s in self.slots)
        while any(s.job is None for s in self.slots):
            try:
                job = self.queue.get(timeout=0.05) if idle else self.queue.get_nowait()
            except queue.Empty:
                return
            idle = False
            if job.cancelled:  # cancelled while it waited: it never reaches a slot
                self._placed(job.share)
                self._load(-1)
                job.done = True
                job.emit("done", "cancelled")
                self.count("cancelled")
                continue
            if job.id_slot >= 0 and self.slots[job.id_slot].job is not None:
                self.pinned.append(job)
                continue
            slot = self.slots[job.id_slot] if job.id_slot >= 0 else self._pick_slot(job.prompt_ids)
            slot.job = job  # before _start: a job that fails there is still answered
            self._for_job(slot, self._start, slot, job)

    def _pick_slot(self, prompt: list) -> Slot:
        """The free slot sharing the longest prefix with the prompt; among equals, the least recently used."""
        free = [s for s in self.slots if s.job is None]
        keys = cache_keys(prompt)
        return max(free, key=lambda s: (common_prefix(s.tokens, keys), -s.last_used))

    def _start(self, slot: Slot, job: Job) -> None:
        """Give the job the slot: reuse the cached prefix; the rest of the prompt is pending, prefilled a chunk per
        step by `_prefill_chunk`, which samples the first token after the last chunk. A sibling of a job whose
        prompt is being prefilled (or was: `Share.kept`) waits for it, or copies it, instead (`Share`)."""
        prompt, st, share = job.prompt_ids, job.stats, job.share
        job.queue_s = time.perf_counter() - job.t_submit
        if slot.spec is not None:
            slot.spec.stats = SpecStats()
        constraint = job.grammar.constraint(self.tokenizer) if job.grammar is not None else None
        job.sampler = Sampler(job.sampling, constraint=constraint, top_logprobs=job.top_logprobs,
                              end_ids=self.tokenizer.eog_ids)  # min_tokens masks them
        job.text, job.history = TextStream(self.tokenizer, job.stop, job.preserved), list(prompt)
        slot.job = job
        st.n_prompt, st.n_reused, st.stop_reason = len(prompt), 0, "length"
        st.decode = dict.fromkeys(COUNTERS, 0)
        st.note_cache(self.engine.cache)
        with self.lock:
            self.totals["prompt_tokens"] += len(prompt)
        if share is not None:
            self._placed(share, keep=True)
            if share.kept is not None:  # prefilled before this sibling got a slot: copy it, no prefill at all
                return self._copy_prompt(slot, *share.kept)
            if share.prefiller is not None:  # being prefilled: wait for it (neither decoding nor prefilling)
                slot.pending, slot.share = [], share
                share.followers.append(slot)
                return
            share.prefiller = slot
        self._place_prompt(slot)
        if not self.prefill_chunk:
            self._prefill_chunk(slot)

    def _place_prompt(self, slot: Slot) -> None:
        """The prompt's tokens not in the slot's cache become its pending tokens (prefix reuse)."""
        prompt, st = slot.job.prompt_ids, slot.job.stats
        reused = min(common_prefix(slot.tokens, cache_keys(prompt)), len(prompt) - 1)  # >= 1 token for logits
        if not slot.job.cache_prompt:  # the request asked for the whole prompt to be read
            reused = 0
        if self.model.cfg.has_recurrent_state and reused < slot.kv.n:  # a recurrent state cannot be cut back
            reused = 0
        if reused == 0:
            slot.kv.clear()
        slot.kv.n, slot.tokens = reused, slot.tokens[:reused]
        if hasattr(slot.kv, "shifts"):  # the rope shifts of images in the reused prefix only (engine/kv.py)
            slot.kv.shifts = [(i, d) for i, d in slot.kv.shifts if i <= reused]
        st.n_reused = reused
        self._follow(slot, reused)
        slot.pending = list(prompt[reused:])
        with self.lock:
            self.totals["reused_tokens"] += reused

    def _follow(self, slot: Slot, reused: int) -> None:
        """A drafter that reads the slot's hidden states (mtp) follows its KV cache from here; `reused` positions
        of it were computed for an earlier job (engine/mtp.py MtpDrafter.attach)."""
        if slot.spec is not None and hasattr(slot.spec.drafter, "attach"):
            slot.spec.drafter.attach(self.model, slot.kv, reused)

    def _placed(self, share: Optional[Share], keep: bool = False) -> None:
        """One sibling fewer waiting to be placed (taken off the queue: placed in a slot, or dropped); the kept
        copy of the prompt's KV goes once none is left to use it."""
        if share is not None:
            share.waiting -= 1
            if share.waiting <= 0 and not keep:
                share.kept = None

    def _copy_prompt(self, slot: Slot, kv, logits: np.ndarray) -> None:
        """The prompt's KV, prefilled in a sibling's slot (or kept from it), into this slot; then the first token,
        sampled from the prompt's last logits with this job's own sampler."""
        job = slot.job
        copy_kv(self.model.backend, self.engine.config, slot.kv, kv, kv.n)
        slot.tokens, slot.pending, slot.share = cache_keys(job.prompt_ids), [], None
        self._follow(slot, 0)  # the prompt's hidden states are the sibling's: an MTP drafter starts after them
        job.stats.n_reused = kv.n
        with self.lock:
            self.totals["reused_tokens"] += kv.n
        if job.share is not None and job.share.waiting <= 0:
            job.share.kept = None
        self._for_job(slot, self._advance, slot, logits.copy())

    def _prompt_read(self, slot: Slot, logits: np.ndarray) -> None:
        """A prompt's last chunk is read: the siblings waiting for it copy it (and one copy is kept for those not
        placed yet), then its own first token."""
        share = slot.job.share
        if share is not None and share.prefiller is slot:
            share.prefiller = None
            followers, share.followers = share.followers, []
            if share.waiting > 0:
                kept = new_kv(self.engine.config, self.n_ctx, "f32" if self._owns(slot.kv) else self.kv_kind)
                copy_kv(self.model.backend, self.engine.config, kept, slot.kv, slot.kv.n)
                share.kept = (kept, logits.copy())
            for f in followers:
                self._for_job(f, self._copy_prompt, f, slot.kv, logits)
        self._advance(slot, logits)

    def _prefill_chunk(self, slot: Slot) -> None:
        """Prefill the next `prefill_chunk` pending prompt tokens (all of them with 0); after the last chunk,
        sample the job's first token."""
        st = slot.job.stats
        n = len(slot.pending) if not self.prefill_chunk else min(self.prefill_chunk, len(slot.pending))
        chunk, slot.pending = slot.pending[:n], slot.pending[n:]
        t0 = time.perf_counter()
        media, start = getattr(slot.job.prompt_ids, "media", None), slot.kv.n  # the prompt starts at position 0
        if media is None:
            logits = self.model.prefill(np.asarray(chunk), slot.kv)[-1]  # [V] the chunk's last position
        else:  # this chunk's rows of the prompt's images and M-RoPE positions (engine/multimodal.py)
            logits = self.model.prefill(np.asarray(chunk), slot.kv, media.from_start().slice(start, start + n))[-1]
        dt = time.perf_counter() - t0
        st.prompt_s += dt
        slot.tokens.extend(chunk if media is None else cache_keys(slot.job.prompt_ids)[start:start + n])
        with self.lock:
            self.totals["prefill_seconds"] += dt
            self.totals["prefilled_tokens"] += n
            if not slot.pending:
                self.last["prefill_tok_s"] = st.prefill_tok_s
        if not slot.pending:
            self.model.cache.end_prefill()  # the warm decode set, if one is asked for (experts/cache.py)
            self._prompt_read(slot, logits)

    def _decode_step(self, active: list) -> None:
        """One decode step of every busy slot: the last token of each -> its next logits. A slot whose sequence
        runs the device step (a device KV cache: engine/model.Model.steps_on_device) decodes on the device: two or
        more such slots in one batched device step (`_device_decode_together`, engine/device_batch.py) where it can
        run, else each in its own step, its token sampled before the next slot's step begins (`_device_decode`);
        the others share one batched forward.
        With --spec, a speculative step instead (`_spec_step`). Batching shares the expert reads between slots,
        speculation between the positions of one sequence; the two combine in one forward."""
        if any(s.spec is not None and s.job.grammar is None for s in active):
            return self._spec_step(active)
        t0 = time.perf_counter()
        stepped = [s for s in active if not s.job.forced and self.model.steps_on_device(s.kv)]
        if batch_step_possible(self.model, [s.kv for s in stepped]):
            self._device_decode_together(stepped)
        else:
            for s in stepped:
                self._for_job(s, self._device_decode, s)
        batched = [s for s in active if s not in stepped]
        n_tokens = len(stepped)
        if batched:
            n_tokens += self._batched_decode(batched)
        self._account_step(time.perf_counter() - t0, n_tokens, len(active))

    def _device_decode(self, s: Slot) -> None:
        """One slot's decode token as a device step (engine/model.py `_device_step`: one synchronisation), then its
        next token sampled at once (the step's logits stay on the device until the next step begins: a greedy
        draw reads the argmax that came back with the token, a plain random draw handed to the step its drawn id,
        others bring the logits over); the expert cache's
        counters of the step go to the job's."""
        job, cache_stats = s.job, self.model.cache.stats
        before = cache_stats.snapshot("decode")
        t0 = time.perf_counter()
        draw = self.model.device_draw(job.sampler, s.kv)  # the slot's draw made inside its step, or None
        logits = self.model.forward([job.next_token], s.kv, "decode", draw=draw)[0]  # [V] (cuda.py StepLogits)
        job.stats.decode_s += time.perf_counter() - t0
        for name, n in cache_stats.snapshot("decode").items():
            job.stats.decode[name] = job.stats.decode.get(name, 0) + n - before.get(name, 0)
        s.tokens.append(job.next_token)
        job.stats.n_decoded += 1
        self._advance(s, logits)

    def _device_decode_together(self, stepped: list) -> None:
        """These slots' decode tokens as one device step (engine/device_batch.decode_steps: one synchronisation for
        all), each row's plain random draw handed to it; then each slot's next token from its row, and the expert
        cache's counters of each row to its job. A failure of the step ends each of these jobs with an error."""
        t0 = time.perf_counter()
        try:
            draws = [self.model.device_draw(s.job.sampler, s.kv) for s in stepped]
            rows = decode_steps(self.model, [s.job.next_token for s in stepped], [s.kv for s in stepped], draws,
                                [s.job.stats.decode for s in stepped])  # B StepLogits [1, V]
        except Exception as e:
            for s in stepped:
                self._fail(s, s.job, e)
            return
        dt = time.perf_counter() - t0
        for s, row in zip(stepped, rows):
            s.job.stats.decode_s += dt
            s.tokens.append(s.job.next_token)
            s.job.stats.n_decoded += 1
            self._for_job(s, self._advance, s, row[0])

    def _batched_decode(self, active: list) -> int:
        """One batched forward of these slots (engine/batch.py) and each one's next token -> the tokens read."""
        counts = [s.job.stats.decode for s in active]
        lists = [[s.job.next_token] + s.job.forced for s in active]
        t0 = time.perf_counter()
        if all(len(t) == 1 for t in lists):
            logits = decode_batch(self.model, [t[0] for t in lists], [s.kv for s in active], counts)
        else:  # a grammar's forced tokens read in the same forward; each slot samples from its last row
            last = np.cumsum([len(t) for t in lists]) - 1  # each slot's last row
            logits = forward_batch(self.model, lists, [s.kv for s in active], counts)[last]
        dt = time.perf_counter() - t0
        for s, row, tokens in zip(active, logits, lists):
            s.tokens.extend(tokens)
            s.job.forced = []
            s.job.stats.decode_s += dt
            s.job.stats.n_decoded += len(tokens)
            self._for_job(s, self._advance, s, row)
        return sum(map(len, lists))

    def _spec_step(self, active: list) -> None:
        """engine/speculative.Speculator.step for several slots around one forward: each speculating slot drafts
        (Speculator.draft_count, then all slots' drafters together: engine/speculative.propose_all; none: its plain
        token), one `forward_batch` verifies every slot's [pending token] +
        drafts, each slot judges its own rows with its own sampler (Speculator.judge) and cuts its KV cache back to
        what it kept; the hybrids' slots that rejected a draft get their recurrent state restored and re-advanced in
        one more batched forward. Not with a grammar: a draft would move the grammar's position before it is
        verified (such a slot takes a plain token in the same forward). Each slot yields 1 .. k + 1 tokens."""
        hybrid = self.model.cfg.has_recurrent_state
        t0 = time.perf_counter()
        drafting = [s for s in active if s.spec is not None and s.job.grammar is None]
        ks = [s.spec.draft_count(s.kv, s.job.max_tokens - s.job.stats.n_generated) for s in drafting]
        try:  # all slots' drafts (MTP: one block forward for all slots per drafted position)
            proposed = propose_all([s.spec.drafter for s in drafting], [s.job.history for s in drafting], ks)
        except Exception as e:  # a drafter's failure ends the jobs it drafted for, as a failed batched step does
            for s in drafting:
                self._fail(s, s.job, e)
            proposed = [[] for _ in drafting]
        by_slot = {s.index: d for s, d in zip(drafting, proposed)}
        alive = [(s, by_slot.get(s.index, [])) for s in active if s.job is not None]
        if not alive:
            return
        lists = [[s.job.next_token] + (d or s.job.forced) for s, d in alive]  # no drafts with forced tokens
        p0 = [s.kv.n for s, _ in alive]
        saved = [s.kv.save_recurrent() if hybrid and d else None for s, d in alive]
        counts = [s.job.stats.decode for s, _ in alive]
        experts = [0] * len(alive)
        logits = forward_batch(self.model, lists, [s.kv for s, _ in alive], counts, experts)  # [sum T_j, V]
        outs, redo, r = [], [], 0
        for j, (s, d) in enumerate(alive):
            rows, r = logits[r:r + len(lists[j])], r + len(lists[j])
            out: list = []
            self._for_job(s, self._judge, s, d, rows if d else rows[-1:], experts[j], out)
            if out and not d:  # one sampled token after [pending token, forced...]: all of those are kept
                out[:0] = lists[j][1:]
            outs.append(out)
            if not out:
                continue
            s.kv.n = p0[j] + len(out)  # the pending token and the drafts kept (out[-1] is the next pending one)
            if saved[j] is not None and len(out) - 1 < len(d):  # the state holds rejected drafts: redo the kept
                s.kv.restore_recurrent(saved[j])
                s.kv.n = p0[j]
                redo.append((s, lists[j][:len(out)], counts[j]))
                s.spec.stats.rollbacks += 1
        if redo:
            forward_batch(self.model, [t for _, t, _ in redo], [s.kv for s, _, _ in redo], [c for _, _, c in redo])
        dt = time.perf_counter() - t0
        self._account_step(dt, sum(len(o) for o in outs), len(alive))
        for (s, d), lst, out in zip(alive, lists, outs):
            if not out:
                continue
            job = s.job
            s.tokens.extend(lst[:len(out)])  # in the KV cache now: the pending token and the kept drafts
            job.stats.decode_s += dt
            if s.spec is not None and job.grammar is None:
                s.spec.timed("verify" if d else "single", out, t0)
            n_forced, job.forced = (0 if d else len(lst) - 1), []
            job.stats.n_decoded += n_forced  # taken already (`_take`): only the sampled token is passed on
            for token in out[n_forced:]:
                job.stats.n_decoded += 1
                self._for_job(s, self._take, s, token)
                if s.job is not job:  # finished (stop, length, error): the tokens after it are dropped
                    break

    def _judge(self, s: Slot, drafts: list, rows: np.ndarray, experts: int, out: list) -> None:
        """A slot's rows of a speculative step -> its tokens in `out`: the drafts kept and the model's own next
        token (Speculator.judge), or, without drafts, the token sampled from its one row."""
        job = s.job
        if drafts:
            out.extend(s.spec.judge(rows, drafts, job.history, job.sampler, experts))
            return
        if s.spec is not None and job.grammar is None:
            s.spec.plain(experts)
        out.append(job.sampler(rows[0], job.history))

    def _account_step(self, dt: float, n_tokens: int, batch: int) -> None:
        """A decode step's share of the server's counters: seconds, tokens per second, batch size."""
        with self.lock:
            self.totals["decode_seconds"] += dt
            self.last["decode_tok_s"], self.last["batch"] = n_tokens / dt if dt > 0 else 0.0, batch
            self.max_batch = max(self.max_batch, batch)

    def _advance(self, slot: Slot, logits: np.ndarray) -> None:
        """Sample the slot's next token and pass it on (`_take`)."""
        self._take(slot, slot.job.sampler(logits, slot.job.history))

    def _take(self, slot: Slot, token: int) -> None:
        """Pass a sampled token's text on; finish on end-of-generation, a stop string or length. Then, with a
        grammar (and fast_forward), the tokens it forces next are taken too, without sampling: they wait in
        `job.forced` for the next forward, which reads them with this token."""
        if not self._pass_on(slot, token):
            return
        job = slot.job
        job.next_token, job.forced = token, []
        if not (self.fast_forward and job.grammar is not None and job.top_logprobs is None):
            return
        constraint = job.sampler.constraint
        for forced in constraint.forced():
            constraint.accept(forced)
            job.stats.n_forced += 1
            if not self._pass_on(slot, forced):
                return
            job.forced.append(forced)

    def _pass_on(self, slot: Slot, token: int) -> bool:
        """A token taken: its text passed on; False when that ends the job (end-of-generation, a stop string, the
        grammar's end, length)."""
        job, st = slot.job, slot.job.stats
        job.history.append(token)
        st.n_generated += 1
        with self.lock:
            self.totals["generated_tokens"] += 1
        if self.tokenizer.is_eog(token) and not job.ignore_eos:
            self._finish(slot, "stop")
            return False
        if job.sampler.last_logprobs is not None:  # before the token's text, which may be held back (UTF-8, stop)
            job.emit("logprobs", (token, *job.sampler.last_logprobs))
        piece = job.text.put(token)
        if piece:
            job.emit("piece", piece)
        if job.text.stopped or (job.grammar is not None and job.sampler.constraint.finished):
            self._finish(slot, "stop")
            return False
        if st.n_generated >= job.max_tokens:
            self._finish(slot, "length")
            return False
        return True

    def _finish(self, slot: Slot, reason: str, error: str = "") -> None:
        """Free the slot (its KV cache and tokens stay, for prefix reuse) and tell the job how it ended."""
        job, st = slot.job, slot.job.stats
        share = job.share
        if slot.share is not None:  # waiting for a sibling's prefill: no longer
            slot.share.followers.remove(slot)
            slot.share = None
        elif share is not None and share.prefiller is slot:  # its prompt not read yet: a waiting sibling takes over
            share.prefiller = share.followers.pop(0) if share.followers else None
            if share.prefiller is not None:
                share.prefiller.share = None
                self._place_prompt(share.prefiller)
        slot.job, slot.last_used, slot.pending = None, time.perf_counter(), []
        if slot.spec is not None and hasattr(slot.spec.drafter, "detach"):
            slot.spec.drafter.detach(self.model, slot.kv)
        if len(slot.tokens) != slot.kv.n:  # an error mid-step: the cache no longer matches, don't reuse it
            slot.tokens = []
            slot.kv.clear()
        job.done = True
        st.stop_reason = reason
        if reason in ("stop", "length", "timeout"):
            tail = job.text.end() if not job.text.stopped else ""
            if tail:
                job.emit("piece", tail)
            if job.text.stopped:
                st.stop_reason = "stop"
            job.emit("done", "length" if st.stop_reason == "timeout" else st.stop_reason)
        elif reason == "error":
            job.emit("error", error)
        else:  # cancelled: its consumer has gone, or is told so
            job.emit("done", "cancelled")
        self.count({"stop": "ok", "length": "ok"}.get(reason, reason))  # timeout: counted apart
        engine_s = st.prompt_s + st.decode_s
        self.avg_request_s = 0.8 * self.avg_request_s + 0.2 * engine_s
        entry = dict(slot=slot.index, n_prompt=st.n_prompt, n_reused=st.n_reused, n_generated=st.n_generated,
                     stop_reason=st.stop_reason, queue_ms=round(job.queue_s * 1e3, 1), prompt_line=st.prompt_line(),
                     cache_line=st.cache_line(), time=round(time.time(), 3))  # time: when it ended (Unix seconds)
        spec = ""
        if slot.spec is not None and slot.spec.stats.steps:
            entry["spec_line"] = slot.spec.stats.line(self.spec, slot.spec.k)
            spec = f"; {entry['spec_line']}"
        # one line per request, the article's two lines joined: prompt and speed, then the expert cache; the same
        # line is kept in `recent` (/v1/status, the monitor page's request log)
        entry["line"] = f"slot {slot.index} {st.stop_reason}: {st.prompt_line()}; {st.cache_line()}{spec}"
        self.recent.append(entry)
        self.log(entry["line"])
        self._account_end(job, slot, reason)

    def _account_end(self, job: Job, slot: Slot, reason: str) -> None:
        """The job leaves the engine: the load falls by one, and its telemetry line is written (with --telemetry)."""
        _, area = self._load(-1)
        if self.telemetry is None:
            return
        age = time.perf_counter() - job.t_submit
        n0, area0 = job.load_mark
        spec = slot.spec.stats if slot.spec is not None and slot.spec.stats.steps else None
        status = {"stop": "ok", "length": "ok"}.get(reason, reason)
        self.telemetry.request(job.stats, t_start=time.time() - age, t_end=time.time(), queue_s=job.queue_s,
                               concurrency_at_start=n0, concurrency_mean=(area - area0) / age if age > 0 else n0,
                               spec=spec, status=status)
