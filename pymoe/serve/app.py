"""`pymoe serve`: the OpenAI-compatible HTTP face of the scheduler (FastAPI on uvicorn), and `serve()` the CLI calls.

The path of one request through the serve/ files:
    app.py        read the body (capped: 413), check the API key (401)
    schemas.py    parse: ChatRequest / CompletionRequest, or 400 naming the field that is wrong or not supported
    app.py        tokenize (chat: the model's own template, in jinja2's sandbox), check the prompt against the
                  context (400 context_length_exceeded) -> a Job whose events hop to this asyncio loop
    scheduler.py  submit: the bounded queue (full -> QueueFull -> 429 + Retry-After here), then slots and
                  batched decode steps on the engine thread -> events: ("piece", text)*, ("done", reason)
                  (n > 1: n jobs, their events tagged with the choice index on one queue)
    app.py        the events -> one JSON answer, or SSE chunks `data: {...}` ... `data: [DONE]`; a client that
                  goes away cancels its jobs
Also: Anthropic's /v1/messages (anthropic.py: its request and answer shapes, the same jobs), /v1/models,
/health (no key), /v1/status and /metrics (metrics.py), llama.cpp's /tokenize, /detokenize, /apply-template, and
the live monitor page at / (monitor.html: static HTML + JS polling /v1/status; no data in it, so no key).
Security defaults: binds 127.0.0.1; --api-key protects every endpoint but /health and the page (Authorization:
Bearer KEY, else 401); bodies are capped (--max-body-mib, else 413).
Hostile input (docs/server.md, "Limits"): every answer, errors included (404, 405, a bug's 500), is in OpenAI's shape
(Anthropic's under /v1/messages); a body must be JSON nested at most MAX_DEPTH deep with no lone UTF-16 surrogates
(else 400); parsing, templating and tokenizing run on worker threads, never on the event loop that answers /health;
a request still running request_timeout seconds after it came in ends as if at max_tokens; a client that leaves
sent data unread for CLIENT_STALL_S seconds is dropped by the kernel (TCP_USER_TIMEOUT on the listening socket).
What this is not: the scheduling (scheduler.py, no HTTP in it), the field-by-field validation (schemas.py), the
counters (metrics.py), or a multi-process / multi-GPU deployment.
"""
# No `from __future__ import annotations` here: FastAPI reads the `request: Request` annotations at runtime.
import asyncio
import contextlib
import hmac
import importlib.resources
import json
import math
import os
import re
import socket
import sys
import threading
import time
import uuid
from dataclasses import replace
from typing import Optional

from pymoe.engine.generate import RequestStats
from pymoe.engine.kv import default_ctx, kv_bytes, kv_nbytes
from pymoe.engine.sampler import dry_breaker_sequences
from pymoe.errors import PymoeError
from pymoe.serve import anthropic, reasoning, responses, tools
from pymoe.serve.metrics import model_id, registry_for, status_of
from pymoe.serve.middleware import JOBS_KEY, LOCALHOST, AccessLog, Cors
from pymoe.serve.scheduler import PREFILL_CHUNK, EngineStopped, Job, QueueFull, Scheduler
from pymoe.serve.slots import coverage as slot_coverage, default_parallel
from pymoe.serve.schemas import (DRY_BREAKERS, ApiError, ApplyTemplateRequest, ChatRequest, CompletionRequest,
                                 DetokenizeRequest, TokenizeRequest, parse)

OUTCOMES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "bad_method", 408: "timeout",
            413: "too_large", 429: "rejected"}  # /metrics labels
MAX_DEPTH = 128  # JSON nesting of a body: a schema 60 objects deep fits; Python's json gives up near 1,000
REQUEST_TIMEOUT_S = 600.0  # request_timeout: a request's wall time, from its arrival to its last token
CLIENT_STALL_S = 60.0  # TCP_USER_TIMEOUT: sent data left unacknowledged (a client that stopped reading) this long


# --- body -> JSON ------------------------------------------------------------------------------------------------

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a lone surrogate gets into JSON text (valid UTF-8 has none)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def load_body(data: bytes) -> dict:
    """A request body -> its JSON object, or a 400 saying why not: not JSON (NaN and Infinity are not JSON either),
    not an object, nested deeper than MAX_DEPTH, or a string holding a lone UTF-16 surrogate ("\\ud800" decodes
    to one; the tokenizer, like any UTF-8 encoder, cannot take it)."""
    try:
        body = json.loads(data, parse_constant=_refuse_constant)
    except RecursionError:  # the C parser's own guard, near 1,000 levels
        raise ApiError(400, f"request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    check_json(body, strings=SURROGATE_ESCAPE.search(data) is not None)
    return body


def check_json(body, strings: bool) -> None:
    """Walk the parsed body (iteratively): its depth is at most MAX_DEPTH; with `strings`, every key and string is
    valid Unicode (a 400 naming where one is not, as `param`: 'messages[0].content')."""
    stack = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"request body is nested deeper than {MAX_DEPTH} levels", code="invalid_json")
        for key, v in value.items() if isinstance(value, dict) else enumerate(value):
            where = "" if not strings else f"{path}[{key}]" if isinstance(value, list) else \
                f"{path}.{key}" if path else key
            if strings and not (_is_unicode(str(key)) and (not isinstance(v, str) or _is_unicode(v))):
                where = where.encode("utf-8", "backslashreplace").decode()  # a bad key: shown as its escape
                raise ApiError(400, f"'{where}' holds a lone UTF-16 surrogate (an escape \\ud800-\\udfff without its "
                                    "pair): not valid Unicode text", code="invalid_value", param=where)
            if isinstance(v, (dict, list)):
                stack.append((v, where, depth + 1))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# --- request -> job ----------------------------------------------------------------------------------------------

def chat_prompt(req, tokenizer) -> str:
    """messages (and the tools in play) -> the model's chat template (sandboxed) -> the prompt text (400 naming
    `messages` on a failure)."""
    extra, messages = {}, req.template_messages()
    choice = req.tool_choice_value() if getattr(req, "tools", None) else None
    if choice is not None:
        extra["tools"] = [t.model_dump(exclude_none=True) for t in req.function_tools()]  # as transformers does
        fmt = tools.call_format(tokenizer.chat_template)
        if fmt == "harmony":  # gpt-oss's template adds "// " + description
            for t in extra["tools"]:
                t["function"].setdefault("description", "")
        elif fmt == "generic":  # the template knows no tools: they go in the system prompt, calls as JSON text
            messages, extra = tools.Generic.rewrite(messages, extra["tools"], forced=choice != "auto"), {}
    try:
        return tokenizer.apply_chat_template(messages, **extra)
    except PymoeError as e:
        raise ApiError(400, str(e), code="invalid_value", param="messages") from None


def prompt_ids(req, tokenizer) -> list:
    """Chat (OpenAI's or Anthropic's): messages -> the model's chat template (sandboxed) -> token ids. Completion:
    the text's ids, or the ids."""
    if hasattr(req, "template_messages"):
        return tokenizer.encode(chat_prompt(req, tokenizer))
    return tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)


def preserved_markers(choice: Optional[str], tokenizer) -> frozenset:
    """With tools in play (or gpt-oss' channels), the template's call markers that are control tokens: shown in the
    answer's text so that its calls can be read back (tools.preserved_tokens)."""
    fmt = tools.tool_format(tokenizer.chat_template)
    return tools.preserved_tokens(fmt, tokenizer) if choice is not None or fmt == "harmony" else frozenset()


def tool_mode(req, tokenizer=None) -> Optional[str]:
    """A chat request's tool choice: None (no tools in play), "auto", "required" or a function's name. Every template
    takes tools: one without a format of its own gets the generic one (serve/tools.py)."""
    return req.tool_choice_value() if hasattr(req, "tool_choice_value") else None  # chat: OpenAI's, Anthropic's


def tool_specs(req) -> list:
    """The tools in play as serve/tools.py takes them: [{name, parameters}]."""
    return [{"name": t.function.name, "parameters": t.function.parameters} for t in req.function_tools()]


def forced_call_grammar(req, choice: Optional[str], job: Job, tokenizer=None):
    """tool_choice "required" or a named function -> the grammar of such a call in the template's format (the answer
    always parses; the format's markers as the vocabulary's special tokens where it has them). The generic format
    (a template without one of its own) has a grammar for tool_choice auto too: a call or {"response": text}.
    tokenizer None: Hermes' format, its markers as text."""
    fmt = "hermes" if tokenizer is None else tools.call_format(tokenizer.chat_template)
    if choice is None or (choice == "auto" and fmt != "generic"):
        return job.grammar
    if job.grammar is not None:
        raise ApiError(400, "'tool_choice' forces a tool call: it does not combine with response_format or "
                            "grammar" if choice != "auto" else "'tools' on this model's template (no tool-call format "
                            "of its own: the generic JSON one) do not combine with response_format or grammar",
                       code="invalid_value", param="tool_choice" if choice != "auto" else "tools")
    try:
        if choice == "auto":
            return tools.Generic().auto_grammar(tool_specs(req))
        return tools.call_grammar([s for s in tool_specs(req) if choice == "required" or s["name"] == choice],
                                  fmt, tokenizer)
    except PymoeError as e:  # a tool's `parameters` that is no JSON schema the grammar compiler takes
        raise ApiError(400, f"'tools': {e}", code="invalid_value", param="tools") from None


def make_job(req, prompt: list, n_ctx: int, n_vocab: int, defaults: Optional[dict] = None, tokenizer=None,
             parallel: int = 1) -> Job:
    """Check the prompt against the context and the vocabulary, the sampling fields against each other, id_slot
    against the slots -> a Job (400 on what is wrong). tokenizer: for DRY's breakers (their token ids)."""
    param = getattr(req, "PROMPT_PARAM", "messages" if isinstance(req, ChatRequest) else "prompt")
    req.check_logit_bias(n_vocab)
    req.check_sampling()
    if not -1 <= req.id_slot < parallel:
        raise ApiError(400, f"'id_slot' must be -1 (any slot) or a slot index 0..{parallel - 1} (--parallel "
                            f"{parallel}), got {req.id_slot}", code="invalid_value", param="id_slot")
    if req.id_slot >= 0 and getattr(req, "n", 1) > 1:
        raise ApiError(400, "'id_slot' names one slot, and 'n' > 1 choices run in several: give one of them",
                       code="invalid_value", param="id_slot")
    if not prompt:
        raise ApiError(400, "the prompt is empty", code="invalid_value", param=param)
    if min(prompt) < 0 or max(prompt) >= n_vocab:
        raise ApiError(400, f"prompt token ids must be in 0..{n_vocab - 1}", code="invalid_value", param=param)
    if len(prompt) >= n_ctx:
        raise ApiError(400, f"the prompt of {len(prompt)} tokens does not fit the context of {n_ctx} tokens "
                            "(room is needed for at least one generated token)", code="context_length_exceeded",
                       param=param)
    sampling = req.sampling(defaults)
    if sampling.dry_multiplier and tokenizer is not None:
        breakers = req.dry_sequence_breakers or DRY_BREAKERS  # Anthropic's request has none: llama.cpp's default
        sampling = replace(sampling, dry_breakers=dry_breaker_sequences(tokenizer, breakers))
    return Job(prompt_ids=prompt, max_tokens=req.max_new_tokens(n_ctx - len(prompt)), sampling=sampling,
               stop=req.stop_strings(), ignore_eos=req.ignore_eos, grammar=req.output_grammar(),
               top_logprobs=req.top_logprobs_n(), cache_prompt=req.cache_prompt, id_slot=req.id_slot)


def asyncio_sink(queue: asyncio.Queue, index: int = 0):
    """A Job sink for the engine thread: each event, tagged with the job's choice index, is put on `queue` as
    (index, kind, value) by this (the running) asyncio loop. The n jobs of one request share the queue."""
    loop = asyncio.get_running_loop()

    def put(event: tuple) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is already closed: the server is stopping
            loop.call_soon_threadsafe(queue.put_nowait, (index, *event))

    return put


DISCONNECT_POLL_S = 0.25  # a non-streaming client that hangs up is noticed within this (plus one engine step)


async def next_event(queue: asyncio.Queue, timeout: float):
    """queue.get() with a timeout -> the item, or None when none came within it. Not asyncio.wait_for: before Python
    3.12 it can swallow a cancellation that arrives just as the get completes (CPython gh-86296), and a consumer
    whose client has gone (Starlette cancels it) would then run on while events keep coming."""
    get = asyncio.ensure_future(queue.get())
    try:
        done, _ = await asyncio.wait((get,), timeout=timeout)
    finally:
        if not get.done():
            get.cancel()
    return get.result() if done else None


async def job_events(jobs: list, queue: asyncio.Queue, request=None):
    """The events (index, kind, value) of a request's jobs until each has ended (done/error). If the consumer stops
    (client gone) the jobs still running are cancelled. `request`: poll it for a disconnect every
    DISCONNECT_POLL_S, whether events are flowing or not (non-streaming answers; streaming ones are cancelled by
    Starlette when the client goes away)."""
    running = len(jobs)
    try:
        next_poll = time.monotonic() + DISCONNECT_POLL_S
        while running:
            event = await next_event(queue, DISCONNECT_POLL_S)
            index, kind, value = event if event is not None else (None, None, None)
            if request is not None and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    return
            if kind is None:
                continue
            yield index, kind, value
            running -= kind in ("done", "error")
    finally:
        for job in jobs:
            if not job.done:
                job.cancel()


# --- responses ---------------------------------------------------------------------------------------------------

def usage_of(st: RequestStats, n_generated: Optional[int] = None) -> dict:
    """OpenAI's usage; with n choices, the prompt counted once and `n_generated` their tokens together."""
    n_generated = st.n_generated if n_generated is None else n_generated
    return {"prompt_tokens": st.n_prompt, "completion_tokens": n_generated,
            "total_tokens": st.n_prompt + n_generated, "prompt_tokens_details": {"cached_tokens": st.n_reused}}


def timings_of(job: Job) -> dict:
    """llama.cpp server's `timings` object (pymoe bench reads it), plus the time spent in the queue."""
    st = job.stats
    return {"queue_ms": job.queue_s * 1e3, "cache_n": st.n_reused, "prompt_n": st.n_prompt - st.n_reused,
            "prompt_ms": st.prompt_s * 1e3, "prompt_per_second": st.prefill_tok_s, "predicted_n": st.n_generated,
            "predicted_ms": st.decode_s * 1e3, "predicted_per_second": st.decode_tok_s}


class Reply:
    """The JSON shapes of one answer: chat (chat.completion[.chunk]) or completion (text_completion)."""

    def __init__(self, kind: str, model: str, tokenizer=None):
        self.kind, self.model, self.tokenizer = kind, model, tokenizer
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text_offset = {}  # completions' logprobs: choice index -> where its next token's text starts
        self.calls = None  # chat with tools in play: "all" or "first" (parallel_tool_calls false) calls are kept
        self.fmt, self.specs = "hermes", []  # then: the template's tool format (serve/tools.py), the tools in play
        # chat with --reasoning-format deepseek: "think" (a leading <think> block, serve/reasoning.py) or "harmony"
        # (gpt-oss' analysis channel) becomes reasoning_content; think_open: the prompt ends inside <think>
        self.reasoning, self.think_open = None, False

    def choice(self, text: Optional[str], reason: Optional[str], stream: bool, role: bool = False,
               logprobs: Optional[list] = None, index: int = 0) -> dict:
        """logprobs: the scheduler's ("logprobs", ...) values of the tokens in `text` (None: not asked for). With
        tools in play and not streamed, `text` is a whole answer: its tool calls become `tool_calls` (finish_reason
        tool_calls); streamed, `text` is content already read out of the answer (tools.CallStream, call_deltas)."""
        lp = None if logprobs is None else self.logprobs(logprobs, index)
        if self.kind == "completion":
            return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": reason}
        msg = {"role": "assistant"} if role or not stream else {}
        calls, thought = [], None
        if self.reasoning == "think" and text is not None and not stream:
            thought, text = reasoning.split(text, self.think_open)
        elif self.reasoning == "harmony" and text is not None and not stream:
            thought = tools.FORMATS["harmony"].reasoning(text) or None
        if self.calls is not None and text is not None and not stream:
            text, calls = tools.parse_calls(text, self.fmt, self.specs)
            calls = calls[:1] if self.calls == "first" else calls
        if text is not None or calls:
            msg["content"] = text
        if thought is not None:
            msg["reasoning_content"] = thought
        if calls:
            msg["tool_calls"] = calls
            reason = "tool_calls" if reason == "stop" else reason
        return {"index": index, "delta" if stream else "message": msg, "logprobs": lp, "finish_reason": reason}

    def reasoning_delta(self, text: str, index: int = 0) -> list:
        """Streamed reasoning, as llama.cpp streams it: a chunk whose delta is {"reasoning_content": text}."""
        return [self.envelope([{"index": index, "delta": {"reasoning_content": text}, "logprobs": None,
                                "finish_reason": None}], stream=True)] if text else []

    def call_deltas(self, calls: list, first: int, index: int = 0, progress: tuple = ()) -> list:
        """Streamed tool calls, numbered from `first`, in OpenAI's chunk shape: per call, a delta with its index, id,
        type and name (arguments ""), then ones with its arguments' text, which clients append to that index's. A
        call announced while it was written (tools.CallStream live: `progress`, [(number, id, name or None, text)])
        has had its head and part of its arguments sent: only the rest of them go out when it is complete."""
        deltas = []
        for k, c in enumerate(calls, first):
            args = c["function"]["arguments"]
            if "streamed" not in c:
                deltas.append({"index": k, "id": c["id"], "type": "function",
                               "function": {"name": c["function"]["name"], "arguments": ""}})
            elif args.startswith(c["streamed"]):
                args = args[len(c["streamed"]):]
            if args:
                deltas.append({"index": k, "function": {"arguments": args}})
        for k, cid, name, text in progress:
            deltas.append({"index": k, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}
                          if name is not None else {"index": k, "function": {"arguments": text}})
        return [self.envelope([{"index": index, "delta": {"tool_calls": [d]}, "logprobs": None,
                                "finish_reason": None}], stream=True) for d in deltas]

    def logprobs(self, entries: list, index: int = 0) -> dict:
        """[(id, logp, [(id, logp)])] -> chat's {"content": [{token, logprob, bytes, top_logprobs}]}, or
        completions' {tokens, token_logprobs, top_logprobs: [{text: logp}], text_offset}."""
        def text(t):
            return self.tokenizer.token_bytes(t).decode("utf-8", errors="replace")

        if self.kind == "chat":
            def one(t, lp):
                return {"token": text(t), "logprob": lp, "bytes": list(self.tokenizer.token_bytes(t))}
            return {"content": [{**one(t, lp), "top_logprobs": [one(u, lu) for u, lu in top]} for t, lp, top in entries]}
        offsets = []
        for t, _, _ in entries:
            offsets.append(self.text_offset.get(index, 0))
            self.text_offset[index] = offsets[-1] + len(text(t))
        return {"tokens": [text(t) for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{text(u): lu for u, lu in top} for _, _, top in entries], "text_offset": offsets}

    def envelope(self, choices: list, stream: bool, **extra) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion" + (".chunk" if stream else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# --- the app -----------------------------------------------------------------------------------------------------

def create_app(engine, parallel: int = 1, max_queue: int = 16, kv: str = "f16", api_key: Optional[str] = None,
               max_body_bytes: int = 4 << 20, log=lambda line: None, spec: Optional[str] = None, spec_k: int = 4,
               prefill_chunk: int = PREFILL_CHUNK, request_timeout: Optional[float] = REQUEST_TIMEOUT_S,
               sampling_defaults: Optional[dict] = None, cors_origins: tuple = (), access_log=None,
               log_format: str = "text", reasoning_format: str = "deepseek", telemetry=None):
    """The FastAPI app and its Scheduler (started and stopped with the app's lifespan); -> app
    (the Scheduler in its `state.scheduler`). sampling_defaults: SamplingParams fields for requests that leave them out.
    request_timeout: seconds from a request's arrival after which its generation ends as if at max_tokens, and
    reading its body gives up (408); None: no limit. cors_origins: middleware.parse_origins' (): no CORS headers.
    access_log: a function taking each request's line (middleware.AccessLog, `log_format` text or json); None: none.
    reasoning_format: "deepseek" (a chat answer's <think> block, or gpt-oss' analysis channel, is reasoning_content)
    or "none" (kept in the content; gpt-oss' analysis left out); a request's own reasoning_format wins.
    The routes, by API family: openai_routes, anthropic_routes, responses_routes, llamacpp_routes, status_routes;
    what they share (the engine, the Scheduler, these settings, the steps before a job runs): one Server."""
    from fastapi import Depends, FastAPI

    if request_timeout is not None and not request_timeout > 0:
        raise PymoeError(f"the request time limit must be > 0 seconds, got {request_timeout}")
    if reasoning_format not in reasoning.FORMATS:
        raise PymoeError(f"--reasoning-format must be one of {', '.join(reasoning.FORMATS)}, got {reasoning_format!r}")
    if log_format not in ("text", "json"):
        raise PymoeError(f"--log-format must be text or json, got {log_format!r}")

    scheduler = Scheduler(engine, parallel=parallel, max_queue=max_queue, kv=kv, log=log, spec=spec, spec_k=spec_k,
                          prefill_chunk=prefill_chunk, telemetry=telemetry)
    srv = Server(engine, scheduler, parallel=parallel, max_body_bytes=max_body_bytes, request_timeout=request_timeout,
                 spec=spec, sampling_defaults=sampling_defaults, reasoning_format=reasoning_format, log=log)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        on_device = scheduler.device_slots()
        where = f"{on_device} with a float32 KV cache on the device, the others " if on_device else ""
        log(f"engine loop: {parallel} slot(s) of {engine.n_ctx} tokens ({where}{kv} KV, "
            f"{kv_nbytes(scheduler.slots[-1].kv) / 2**20:.1f} MiB each), queue of {max_queue}")
        yield
        scheduler.stop()

    app = FastAPI(title="pymoe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler
    app.add_middleware(Cors, origins=tuple(cors_origins))  # the last added is the outermost: the log sees all
    if access_log is not None:
        app.add_middleware(AccessLog, write=access_log, fmt=log_format)
    error_handlers(app, srv)
    guarded = [Depends(key_check(api_key))]
    openai_routes(app, srv, guarded)
    anthropic_routes(app, srv, guarded)
    responses_routes(app, srv, guarded)
    llamacpp_routes(app, srv, guarded)
    status_routes(app, srv, guarded)
    return app


class Server:
    """What the routes of every API family share: the engine, its Scheduler, create_app's settings, and the steps a
    request takes before its jobs run (read and parse the body, the template, the tokenizer, make and submit the
    jobs). `name`: the model's id in answers."""

    def __init__(self, engine, scheduler: Scheduler, parallel: int, max_body_bytes: int,
                 request_timeout: Optional[float], spec: Optional[str], sampling_defaults: Optional[dict],
                 reasoning_format: str, log):
        self.engine, self.scheduler, self.parallel, self.spec = engine, scheduler, parallel, spec
        self.max_body_bytes, self.request_timeout = max_body_bytes, request_timeout
        self.sampling_defaults, self.reasoning_format, self.log = sampling_defaults, reasoning_format, log
        self.name = model_id(engine)

    async def read_body(self, request) -> bytes:
        """The body's bytes: at most max_body_bytes (413), all of them within request_timeout (408)."""
        max_body_bytes, request_timeout = self.max_body_bytes, self.request_timeout
        declared = request.headers.get("content-length", "0")
        if not (declared.isascii() and declared.isdigit()) or int(declared) > max_body_bytes:
            raise ApiError(413, f"request body over the limit of {max_body_bytes} bytes", code="body_too_large")
        data = bytearray()

        async def read():
            nonlocal data
            async for chunk in request.stream():
                data += chunk
                if len(data) > max_body_bytes:
                    raise ApiError(413, f"request body over the limit of {max_body_bytes} bytes",
                                   code="body_too_large")

        try:
            await asyncio.wait_for(read(), request_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"request body not received within {request_timeout:g} s (the request time limit)",
                           code="timeout") from None
        return bytes(data)

    async def read_request(self, request, model: type):
        """The body parsed into `model` (schemas.py), the parsing on a worker thread: a large body's JSON is work."""
        data = await self.read_body(request)
        return await asyncio.to_thread(lambda: parse(model, load_body(data)))

    def deadline(self, arrived: float) -> float:
        return arrived + self.request_timeout if self.request_timeout is not None else math.inf

    def submit(self, job: Job) -> None:
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        except EngineStopped as e:
            raise ApiError(503, str(e)) from None

    def submit_all(self, jobs: list, queue: asyncio.Queue) -> None:
        """Submit a request's jobs, their events to `queue`; all or none (a full queue cancels those already in)."""
        for index, job in enumerate(jobs):
            job.sink = asyncio_sink(queue, index)
            try:
                self.submit(job)
            except ApiError:
                for submitted in jobs[:index]:
                    submitted.cancel()
                raise

    def chat_ids(self, req, text: str) -> list:
        """A rendered chat prompt -> token ids; with images (image_url parts, image blocks), ids that carry their
        encoded images (engine/multimodal.ImagePrompt) for the scheduler's prefill."""
        engine = self.engine
        images = req.images()
        if not images:
            return engine.tokenizer.encode(text)
        if engine.vision is None:
            raise ApiError(400, "this server's model takes no images (start it with --mmproj FILE)",
                           code="invalid_value", param="messages")
        if self.spec:
            raise ApiError(400, "images do not go with speculative decoding (--spec): its drafter reads token ids",
                           code="invalid_value", param="messages")
        try:
            return engine.prompt_with_images(text, images)
        except PymoeError as e:
            raise ApiError(400, str(e), code="invalid_value", param="messages") from None

    def prepare(self, kind: str, data: bytes) -> tuple:
        """A chat or completion body -> (request, its jobs, tool choice, echo): the JSON, the schema, the template,
        the tokenizer, a grammar's compilation, all the work before the engine's (run on a worker thread)."""
        req = parse(ChatRequest if kind == "chat" else CompletionRequest, load_body(data))
        return (req, *self.jobs_for(req, kind))

    def jobs_for(self, req, kind: str) -> tuple:
        """A parsed chat or completion request -> (its jobs, tool choice, echo, whether the answer starts inside
        <think>)."""
        engine = self.engine
        choice = tool_mode(req, engine.tokenizer)
        text = chat_prompt(req, engine.tokenizer) if kind == "chat" else None
        ids = self.chat_ids(req, text) if kind == "chat" else prompt_ids(req, engine.tokenizer)
        job = make_job(req, ids, engine.n_ctx, engine.config.n_vocab, self.sampling_defaults, engine.tokenizer,
                       self.parallel)
        job.grammar = forced_call_grammar(req, choice, job, engine.tokenizer)
        job.preserved = preserved_markers(choice, engine.tokenizer) if kind == "chat" else frozenset()
        thinking = kind == "chat" and (req.reasoning_format or self.reasoning_format) == "deepseek"
        if thinking and tools.tool_format(engine.tokenizer.chat_template) != "harmony":
            job.preserved |= reasoning.think_markers(engine.tokenizer)  # <think> as text, where it is a control token
        jobs = [job] + [job.sibling(i) for i in range(1, req.n)]  # n choices: seeds seed, seed + 1, ... when set
        # completions' echo: the prompt's text before the continuation (a token-id prompt decoded)
        echo = "" if kind == "chat" or not req.echo else (
            req.prompt if isinstance(req.prompt, str) else engine.tokenizer.decode(job.prompt_ids))
        # a prompt that opens <think> starts the answer in the reasoning, unless a grammar (a forced call, a format)
        # decides the answer from its first token
        return jobs, choice, echo, thinking and job.grammar is None and reasoning.opens_thinking(text)


def key_check(api_key: Optional[str]):
    """-> the dependency of every guarded route: the key as OpenAI's clients send it (Authorization: Bearer KEY) or
    Anthropic's (x-api-key: KEY), else 401; api_key None: every request passes."""
    from fastapi import Request

    async def authorized(request: Request):
        """The key as OpenAI's clients send it (Authorization: Bearer KEY) or Anthropic's (x-api-key: KEY)."""
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                           code="invalid_api_key")

    return authorized


def error_handlers(app, srv: Server) -> None:
    """Every error answered in OpenAI's shape (Anthropic's under /v1/messages), counted by outcome for /metrics."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        srv.scheduler.count(OUTCOMES.get(e.status, "error"))
        body = anthropic.error_body(e.status, e.message) if request.url.path.startswith("/v1/messages") else e.body()
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    # Starlette's own errors (no such route: 404, a wrong method: 405), FastAPI's and a bug's: the same shapes
    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        what = {404: f"no route {request.url.path}", 405: f"{request.url.path} does not take {request.method}"}
        return await api_error(request, ApiError(e.status_code, what.get(e.status_code, str(e.detail)),
                                                 code={404: "not_found", 405: "method_not_allowed"}.get(e.status_code),
                                                 headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return await api_error(request, ApiError(400, f"invalid request: {e.errors()[:1]}", code="invalid_value"))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        msg = " ".join(str(e).split()) or type(e).__name__
        srv.log(f"internal error on {request.url.path}: {type(e).__name__}: {msg}")
        return await api_error(request, ApiError(500, f"internal error: {type(e).__name__}: {msg}"))


# --- OpenAI: chat completions, completions, models ---------------------------------------------------------------

def openai_routes(app, srv: Server, guarded: list) -> None:
    """/v1/chat/completions, /v1/completions (one JSON answer or SSE chunks: stream_reply) and /v1/models."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

    engine = srv.engine

    async def complete(request: Request, kind: str):
        arrived = time.perf_counter()
        req, jobs, choice, echo, think_open = await asyncio.to_thread(srv.prepare, kind, await srv.read_body(request))
        job = jobs[0]
        for j in jobs:
            j.deadline = srv.deadline(arrived)
        events: asyncio.Queue = asyncio.Queue()
        srv.submit_all(jobs, events)
        request.scope[JOBS_KEY] = jobs  # the access log's token counts
        reply = Reply(kind, srv.name, engine.tokenizer)
        fmt = (tools.call_format if choice is not None else tools.tool_format)(engine.tokenizer.chat_template) \
            if kind == "chat" else None
        if choice is not None or fmt == "harmony":  # answers are read for tool calls (harmony: for its channels too)
            reply.calls = "first" if not req.parallel_tool_calls else "all"
            reply.fmt, reply.specs = fmt, tool_specs(req) if choice is not None else []
        if kind == "chat" and (req.reasoning_format or srv.reasoning_format) == "deepseek":
            reply.reasoning, reply.think_open = "harmony" if fmt == "harmony" else "think", think_open
        reply.text_offset = dict.fromkeys(range(req.n), len(echo))
        if req.stream:
            return StreamingResponse(stream_reply(jobs, events, reply, req.stream_options.include_usage, echo),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        pieces, reasons = [[echo] for _ in jobs], [None] * len(jobs)
        logprobs = [[] if job.top_logprobs is not None else None for _ in jobs]
        async for index, ev, value in job_events(jobs, events, request):
            if ev == "piece":
                pieces[index].append(value)
            elif ev == "logprobs":
                logprobs[index].append(value)
            elif ev == "error":
                raise ApiError(500, value)
            else:
                reasons[index] = value
        if None in reasons:  # the client went away; nobody reads this
            return JSONResponse({}, status_code=499)
        choices = [reply.choice("".join(p), r, stream=False, logprobs=lp, index=i)
                   for i, (p, r, lp) in enumerate(zip(pieces, reasons, logprobs))]
        return JSONResponse(reply.envelope(choices, stream=False, timings=timings_of(job),
                                           usage=usage_of(job.stats, sum(j.stats.n_generated for j in jobs))))

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request):
        return await complete(request, "completion")

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [{"id": srv.name, "object": "model", "created": int(os.path.getmtime(
            engine.file.path)), "owned_by": "pymoe", "meta": {"arch": engine.config.arch, "n_ctx": engine.n_ctx}}]}


async def stream_reply(jobs: list, events: asyncio.Queue, reply: Reply, include_usage: bool, echo: str = ""):
    """A chat or completion answer's SSE chunks, `data: {...}` ... `data: [DONE]`: per choice, its reasoning,
    content and tool calls as they are read, then its finish_reason (and the usage, when asked for)."""
    for index in range(len(jobs)):
        if reply.kind == "chat":
            yield sse(reply.envelope([reply.choice("", None, stream=True, role=True, index=index)], stream=True))
        if echo:
            yield sse(reply.envelope([reply.choice(echo, None, stream=True, index=index)], stream=True))
    # per choice: the log-probabilities of the tokens whose text is not sent yet
    logprobs = [[] if job.top_logprobs is not None else None for job in jobs]
    # with tools in play: each answer read as it streams (tools.CallStream): its content goes out as soon as it
    # cannot be the start of a call, each call as soon as its closing marker is in
    reading = [None if reply.calls is None else tools.CallStream(reply.fmt, reply.specs, reply.calls, live=True)
               for _ in jobs]
    n_calls = [0] * len(jobs)
    # with reasoning split out: a leading <think> block read off first (reasoning.ThinkStream), or gpt-oss'
    # analysis channel re-read from the answer so far (`thought`: what was sent of it)
    thinking = [reasoning.ThinkStream(reply.think_open) if reply.reasoning == "think" else None for _ in jobs]
    thought = [""] * len(jobs)

    def answer(index: int, piece: str, final: bool = False) -> list:
        """A piece of the answer (final: its end) -> its chunks: reasoning, content, calls."""
        out = []
        if thinking[index] is not None:
            thought_piece, piece = thinking[index].feed(piece, final)
            out += [sse(c) for c in reply.reasoning_delta(thought_piece, index)]
        if reading[index] is None:
            return out + deltas(index, piece, [])
        text, calls = reading[index].feed(piece, final)
        if reply.reasoning == "harmony":
            so_far = tools.FORMATS["harmony"].reasoning(reading[index].text, final)
            new = so_far[len(thought[index]):] if so_far.startswith(thought[index]) else ""
            thought[index] += new
            out += [sse(c) for c in reply.reasoning_delta(new, index)]
        return out + deltas(index, text, calls)

    def deltas(index: int, text: str, calls: list) -> list:
        out = []
        if text:
            out.append(sse(reply.envelope([reply.choice(text, None, stream=True, logprobs=logprobs[index],
                                                         index=index)], stream=True)))
            logprobs[index] = [] if logprobs[index] is not None else None
        progress = reading[index].progress if reading[index] is not None else ()
        out += [sse(chunk) for chunk in reply.call_deltas(calls, n_calls[index], index, progress)]
        n_calls[index] += len(calls)
        return out

    async for index, ev, value in job_events(jobs, events):
        if ev == "logprobs":
            logprobs[index].append(value)
        elif ev == "piece":
            for chunk in answer(index, value):
                yield chunk
        elif ev == "error":
            yield sse(ApiError(500, value).body())
        else:
            if reading[index] is not None or thinking[index] is not None:
                for chunk in answer(index, "", final=True):
                    yield chunk
                value = "tool_calls" if n_calls[index] and value == "stop" else value
            yield sse(reply.envelope([reply.choice(None, value, stream=True, logprobs=logprobs[index] or None,
                                                   index=index)], stream=True, timings=timings_of(jobs[index])))
    if include_usage:
        yield sse(reply.envelope([], stream=True, usage=usage_of(jobs[0].stats,
                                                                 sum(j.stats.n_generated for j in jobs))))
    yield "data: [DONE]\n\n"


# --- Anthropic: messages -----------------------------------------------------------------------------------------

def anthropic_routes(app, srv: Server, guarded: list) -> None:
    """Anthropic's /v1/messages (anthropic.py's shapes; SSE: stream_message) and /v1/messages/count_tokens."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

    engine = srv.engine

    @app.post("/v1/messages", dependencies=guarded)
    async def messages(request: Request):
        """Anthropic's Messages API (anthropic.py): the same job as a chat completion, in its shapes."""
        arrived = time.perf_counter()
        req = await srv.read_request(request, anthropic.MessagesRequest)

        def prepare():
            choice = tool_mode(req, engine.tokenizer)
            ids = srv.chat_ids(req, chat_prompt(req, engine.tokenizer))
            job = make_job(req, ids, engine.n_ctx, engine.config.n_vocab, srv.sampling_defaults, engine.tokenizer,
                           srv.parallel)
            job.grammar = forced_call_grammar(req, choice, job, engine.tokenizer)
            job.preserved = preserved_markers(choice, engine.tokenizer)
            return job, choice

        job, choice = await asyncio.to_thread(prepare)
        job.deadline = srv.deadline(arrived)
        events: asyncio.Queue = asyncio.Queue()
        srv.submit_all([job], events)
        request.scope[JOBS_KEY] = [job]
        reply = anthropic.MessageReply(srv.name)
        fmt = (tools.call_format if choice is not None else tools.tool_format)(engine.tokenizer.chat_template)
        calls = None if choice is None and fmt != "harmony" else ("all" if req.parallel_tool_calls else "first")
        # with tools in play (or gpt-oss' channels), the answer is read for calls: tools.CallStream
        reading = None if calls is None else tools.CallStream(fmt, tool_specs(req) if choice else [], calls)
        if req.stream:
            return StreamingResponse(stream_message(job, events, reply, reading), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        pieces, reason = [], None
        async for _, ev, value in job_events([job], events, request):
            if ev == "piece":
                pieces.append(value)
            elif ev == "error":
                raise ApiError(500, value)
            elif ev == "done":
                reason = value
        if reason is None:  # the client went away; nobody reads this
            return JSONResponse({}, status_code=499)
        stop_reason, stop_sequence = reply.stop_reason(reason, job.text.matched)
        text, found = ("".join(pieces), []) if reading is None else reading.feed("".join(pieces), final=True)
        if found:
            stop_reason = "tool_use" if stop_reason == "end_turn" else stop_reason
        st = job.stats
        return JSONResponse(reply.message(text or "", stop_reason, stop_sequence,
                                          anthropic.usage(st.n_prompt, st.n_generated, st.n_reused),
                                          calls=None if calls is None else found))

    @app.post("/v1/messages/count_tokens", dependencies=guarded)
    async def count_tokens(request: Request):
        req = await srv.read_request(request, anthropic.CountTokensRequest)
        ids = await asyncio.to_thread(lambda: srv.chat_ids(req, chat_prompt(req, engine.tokenizer)))
        return {"input_tokens": len(ids)}


async def stream_message(job: Job, events: asyncio.Queue, reply, reading: Optional[tools.CallStream]):
    """SSE events; with tools in play (`reading`), text blocks and tool_use blocks open as the answer is read:
    text as soon as it cannot be the start of a call, each call once its closing marker is in."""
    for event in reply.start_events(len(job.prompt_ids), text_block=reading is None):
        yield event
    n_calls = 0
    async for _, ev, value in job_events([job], events):
        if ev == "piece" and reading is not None:
            text, found = reading.feed(value)
            n_calls += len(found)
            for event in reply.block_events(text, found):
                yield event
        elif ev == "piece":
            yield reply.delta_event(value)
        elif ev == "error":
            yield reply.event("error", error={"type": "api_error", "message": value})
        elif ev == "done":
            stop_reason, stop_sequence = reply.stop_reason(value, job.text.matched)
            if reading is not None:
                text, found = reading.close()
                n_calls += len(found)
                for event in reply.block_events(text, found) + reply.close_events():
                    yield event
                if n_calls and stop_reason == "end_turn":
                    stop_reason = "tool_use"
            for event in reply.end_events(stop_reason, stop_sequence, job.stats.n_generated,
                                          close_text=reading is None):
                yield event


# --- OpenAI: Responses -------------------------------------------------------------------------------------------

def responses_routes(app, srv: Server, guarded: list) -> None:
    """OpenAI's /v1/responses (responses.py's shapes) and /v1/responses/{id} (the answers kept with store)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse

    engine, reasoning_format = srv.engine, srv.reasoning_format
    store = responses.ResponseStore()

    @app.post("/v1/responses", dependencies=guarded)
    async def create_response(request: Request):
        """OpenAI's Responses API (responses.py): the request runs as a chat completion; its answer is read through
        the same pipeline whether streamed or not (the events of a whole answer are dropped)."""
        arrived = time.perf_counter()
        req = await srv.read_request(request, responses.ResponsesRequest)

        def prepare_response():
            previous = store.conversation(req.previous_response_id)
            chat = req.to_chat(previous)
            jobs, choice, _, think_open = srv.jobs_for(chat, "chat")
            return chat, req.messages(previous), jobs[0], choice, think_open

        chat, conversation, job, choice, think_open = await asyncio.to_thread(prepare_response)
        job.deadline = srv.deadline(arrived)
        events: asyncio.Queue = asyncio.Queue()
        srv.submit_all([job], events)
        request.scope[JOBS_KEY] = [job]
        reply = responses.ResponseReply(srv.name, req)
        fmt = (tools.call_format if choice is not None else tools.tool_format)(engine.tokenizer.chat_template)
        reading = None if choice is None and fmt != "harmony" else tools.CallStream(
            fmt, tool_specs(chat) if choice is not None else [], "all" if req.parallel_tool_calls else "first",
            live=True)
        thinking = reasoning.ThinkStream(think_open) if reasoning_format == "deepseek" and fmt != "harmony" else None

        def answer(piece: str, final: bool = False) -> list:
            """A piece of the answer (final: its end) -> its events: reasoning, text, calls."""
            out = []
            if thinking is not None:
                thought, piece = thinking.feed(piece, final)
                out += reply.text_events(thought, "reasoning_text")
            text, calls = (piece, []) if reading is None else reading.feed(piece, final)
            return out + reply.text_events(text) + reply.call_events(calls, () if reading is None else reading.progress)

        async def run():
            for event in reply.start():
                yield event
            async for _, ev, value in job_events([job], events, None if req.stream else request):
                if ev == "piece":
                    for event in answer(value):
                        yield event
                elif ev == "error":
                    raise ApiError(500, value)
                elif ev == "done":
                    for event in answer("", final=True):
                        yield event
                    st = job.stats
                    closing, final = reply.end(value, responses.usage(st.n_prompt, st.n_generated, st.n_reused))
                    if req.store:
                        store.put(reply.id, conversation + responses.chat_turn(final["output"]), final)
                    reply.final = final
                    for event in closing:
                        yield event

        if req.stream:
            async def stream():
                try:
                    async for event in run():
                        yield event
                except ApiError as e:
                    yield reply.event("error", code=e.code or "server_error", message=e.message, param=e.param)
            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        reply.final = None
        async for _ in run():
            pass
        if reply.final is None:  # the client went away; nobody reads this
            return JSONResponse({}, status_code=499)
        return JSONResponse(reply.final)

    @app.get("/v1/responses/{rid}", dependencies=guarded)
    async def get_response(rid: str):
        found = store.get(rid)
        if found is None:
            raise ApiError(404, f"no stored response {rid!r}", code="not_found", param="response_id")
        return found[1]


# --- llama.cpp's utilities; health, status, the monitor page, metrics --------------------------------------------

def llamacpp_routes(app, srv: Server, guarded: list) -> None:
    """llama.cpp's server utilities: what the tokenizer and the chat template make of an input, without a model run
    (/tokenize, /detokenize, /apply-template)."""
    from fastapi import Request

    engine = srv.engine

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request):
        req = await srv.read_request(request, TokenizeRequest)

        def tokens():
            ids = engine.tokenizer.encode(req.content, add_bos=None if req.add_special else False)  # None: the file's
            return ids if not req.with_pieces else [{"id": t, "piece": engine.tokenizer.decode([t])} for t in ids]

        return {"tokens": await asyncio.to_thread(tokens)}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request):
        req = await srv.read_request(request, DetokenizeRequest)
        n = engine.config.n_vocab
        if any(not 0 <= t < n for t in req.tokens):
            raise ApiError(400, f"token ids must be in 0..{n - 1}", code="invalid_value", param="tokens")
        return {"content": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}

    @app.post("/apply-template", dependencies=guarded)
    async def apply_template(request: Request):
        req = await srv.read_request(request, ApplyTemplateRequest)
        return {"prompt": await asyncio.to_thread(chat_prompt, req, engine.tokenizer)}


def status_routes(app, srv: Server, guarded: list) -> None:
    """/health (no key), /v1/status, the monitor page at / (no key: it holds no data) and /metrics (Prometheus)."""
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
    from prometheus_client import generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    scheduler = srv.scheduler
    registry = registry_for(scheduler)

    @app.get("/health")
    async def health():
        ok = scheduler.thread.is_alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, status_code=200 if ok else 503)

    @app.get("/v1/status", dependencies=guarded)
    async def status(experts: bool = False):
        """?experts=1 adds the per-expert map: residency and heat per MoE layer (the monitor page's heat map)."""
        return status_of(scheduler, experts=experts)

    monitor_page = (importlib.resources.files("pymoe.serve") / "monitor.html").read_text(encoding="utf-8")

    @app.api_route("/", methods=["GET", "HEAD"])  # HEAD too: link checkers and uptime probes ask that way
    async def monitor():
        """The live monitor page (monitor.html: static HTML + JS that polls /v1/status; it holds no data, so no key)."""
        return HTMLResponse(monitor_page)

    @app.get("/metrics", dependencies=guarded)
    async def metrics():
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


# --- serving it ----------------------------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def listening_socket(host: str, port: int, client_stall_s: float = CLIENT_STALL_S) -> socket.socket:
    """A bound TCP socket for uvicorn. The connections it accepts inherit its TCP_USER_TIMEOUT (Linux): the kernel
    drops one whose sent data stays unacknowledged for client_stall_s, such as a client that stopped reading a
    stream (its receive window stays zero). uvicorn has no send timeout, and a close() still waits for the unsent
    data, so without this such a connection, and the response waiting on it, would stay forever."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(client_stall_s * 1000))
        sock.bind((host, port))
    except OSError as e:  # a port in use, an address not on this machine, a name that does not resolve
        raise PymoeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(model: str, host: str = "127.0.0.1", port: int = 8080, api_key: Optional[str] = None,
          parallel: Optional[int] = None, max_queue: int = 16, kv: str = "f16", max_body_bytes: int = 4 << 20,
          log=print, spec: Optional[str] = None, spec_k: int = 4, prefill_chunk: int = PREFILL_CHUNK,
          chat_template: Optional[str] = None, request_timeout: Optional[float] = REQUEST_TIMEOUT_S,
          sampling_defaults: Optional[dict] = None, cors_origins: tuple = (LOCALHOST,), log_format: str = "text",
          reasoning_format: str = "deepseek", telemetry: Optional[str] = None, telemetry_interval: float = 10.0,
          mmproj: Optional[str] = None,
          **engine_options) -> None:
    """Load MODEL and serve it until interrupted (`pymoe serve`). engine_options: api.load's (n_ctx, cache_slots...).
    parallel None: the default slot rule (serve/slots.py default_parallel), printed with its reason.
    The access log (one line per request) goes to stderr. telemetry: append a line per request, and a resource
    sample every `telemetry_interval` s, to that file (experts/telemetry.py)."""
    import uvicorn

    from pymoe.api import load

    def access_log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if not is_loopback(host) and not api_key:
        log(f"warning: listening on {host} without --api-key: anyone who can reach this port can use the model")
    if spec:
        from pymoe.engine.speculative import parse_spec

        parse_spec(spec)  # a bad --spec is refused before the model loads
    rule, given_ctx = [], engine_options.get("n_ctx")
    if not given_ctx:  # no -c: the default context rule (engine/kv.py default_ctx), for the slots there will be
        def fitted(cfg):  # (-np not given: the most the slot rule gives before it knows the backend and the cache)
            slots = parallel or default_parallel(cfg, "cpu", None, kv)[0]
            n, why = default_ctx(cfg, kv, slots)
            rule.append(why)
            return n

        engine_options["n_ctx"] = fitted
    # -np N: N device KV caches where the backend has them (CUDA), sized before the expert slot pool; without -np the
    # slot rule runs after loading (it reads the pool's coverage), and the first slot alone gets one. No device
    # snapshot of a hybrid's state for --spec (api.Engine `speculation` False): the slots verify in one batched
    # forward and save the state on the host (serve/scheduler.py `_spec_step`), so a snapshot would go unused
    engine = load(model, progress=True, log=log, **{"sequences": parallel or 1, **engine_options})
    if parallel is None:
        parallel, why = default_parallel(engine.config, engine.backend.name, slot_coverage(engine), kv, given_ctx)
        log(f"{parallel} slot(s): {why}; -np overrides")
    log(f"context: {engine.n_ctx} tokens per slot ({rule[0] + '; -c overrides' if rule else '-c'}): {parallel} x "
        f"{kv_bytes(engine.config, engine.n_ctx, kv) / 2**20:,.1f} MiB of {kv} KV cache")
    if chat_template is not None:
        engine.use_chat_template(chat_template)
    if mmproj or engine.config.rope_sections:  # images: --mmproj, or the one mmproj*.gguf beside the model
        from pymoe.vision.mmproj import find_mmproj
        try:
            found = mmproj or find_mmproj(model)
        except PymoeError as e:  # two candidates: serve text, say why
            found = None
            log(f"images off: {e}")
        if found:
            engine.attach_mmproj(found, log)
    writer = None
    if telemetry:
        from pymoe.experts.telemetry import TelemetryWriter, engine_facts

        writer = TelemetryWriter(telemetry, engine_facts(engine, "serve"), interval=telemetry_interval)
        log(f"telemetry: a line per request to {telemetry}"
            + (f", a resource sample every {telemetry_interval:g} s" if telemetry_interval else ""))
    app = create_app(engine, parallel=parallel, max_queue=max_queue, kv=kv, api_key=api_key,
                     max_body_bytes=max_body_bytes, log=log, spec=spec, spec_k=spec_k, prefill_chunk=prefill_chunk,
                     request_timeout=request_timeout, sampling_defaults=sampling_defaults, cors_origins=cors_origins,
                     access_log=access_log, log_format=log_format, reasoning_format=reasoning_format, telemetry=writer)
    sock = listening_socket(host, port)
    log(f"CORS: Access-Control-Allow-Origin for {', '.join(cors_origins)}" if cors_origins else "CORS: off")
    log(f"listening on http://{host}:{port} (OpenAI API at /v1, metrics at /metrics, the monitor page at /)")
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    finally:
        if writer is not None:
            writer.close()


class BackgroundServer:
    """An app served by uvicorn in a thread on a loopback port the OS chooses (tests, tools); use as a context."""

    def __init__(self, app, host: str = "127.0.0.1", client_stall_s: float = CLIENT_STALL_S):
        import uvicorn

        self.sock = listening_socket(host, 0, client_stall_s)
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
