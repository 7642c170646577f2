"""`pymoe serve` against hostile input and long runs (issue 22): what an attacker found, each answered now.

Covered, against live servers on 127.0.0.1 (tiny model): seed -1 is llama.cpp's "random" and out-of-range seeds are a
400 naming `seed`; an exception in the engine for one request is answered to that request (500 in OpenAI's shape, or
an SSE error event) and to no other; a lone UTF-16 surrogate and JSON nested past MAX_DEPTH are 400s; chat templates
that loop without end or render 200 MB stop at their budgets (a 400, the CLI's one line) while /health answers; a
large prompt is tokenized off the event loop; 404 / 405 are in OpenAI's shape (Anthropic's under /v1/messages);
size bounds (max_tokens, stop, logit_bias, ...) are 400s naming the field; no hostile value of any field gives a 5xx;
a request past --request-timeout ends with finish_reason "length", a body never sent is a 408; a client that stops
reading a stream is dropped and its generation cancelled.
Every request has a timeout; every loop is bounded. The soak (many clients for a minute) is tests/test_soak.py.
"""
import json
import socket
import threading
import time

import httpx
import pytest

import pymoe
from conftest import run_pymoe
from pymoe.engine.sampler import SamplingParams
from pymoe.engine.tokenizer import Tokenizer
from pymoe.errors import PymoeError
from pymoe.serve import app as serve_app
from pymoe.serve.app import BackgroundServer, create_app
from pymoe.serve.scheduler import Job, Scheduler
from pymoe.serve.schemas import ApiError, ChatRequest

CTX = 256


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("qwen3moe", "f32")


@pytest.fixture(scope="module")
def server(model_path):
    """Two slots, no key, the default 4 MiB body cap (the big-prompt test sends 1.5 MB)."""
    logs = []
    engine = pymoe.load(model_path, n_ctx=CTX)
    with BackgroundServer(create_app(engine, parallel=2, max_queue=8, kv="f32", log=logs.append)) as srv:
        srv.engine, srv.logs = engine, logs
        yield srv


def post(srv, path, body=None, timeout=30, **kw):
    return httpx.post(srv.url + path, json=body, timeout=timeout, **kw)


def chat(**fields):
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def openai_error(r, status, param=None, code=None, match=""):
    """r is an error in OpenAI's shape with this status, param, code and a message containing `match`."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == ApiError.TYPES[status], err
    assert (err["param"], err["code"]) == (param, code) and match in err["message"], err
    return err


# --- seeds --------------------------------------------------------------------------------------------------------

def test_seed_minus_one_is_random_and_out_of_range_seeds_are_a_400(server):
    """llama.cpp's -1 once raised in the engine thread and the request was never answered."""
    for path, body in (("/v1/chat/completions", chat()), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
        r = post(server, path, {**body, "seed": -1, "temperature": 1, "n": 2}, timeout=10)
        assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
        for seed in (-2, 2**64):
            openai_error(post(server, path, {**body, "seed": seed}), 400, "seed", "invalid_value", "or -1 (random")
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**64 - 1, "n": 3, "temperature": 1})
    assert r.status_code == 200, r.text  # choices 1 and 2 draw with seeds 0 and 1 (seed + i wraps at 2**64)


# --- engine failures ----------------------------------------------------------------------------------------------

FAULT_TOKEN = 13  # a prompt holding this token id meets an engine that raises (fault injection below)


def test_an_engine_failure_is_answered_to_its_request_and_to_no_other(server, monkeypatch):
    prefill = server.engine.model.prefill

    def faulty(tokens, kv):
        if FAULT_TOKEN in list(tokens):
            raise RuntimeError("injected fault")
        return prefill(tokens, kv)

    monkeypatch.setattr(server.engine.model, "prefill", faulty)
    bad = {"prompt": [FAULT_TOKEN] * 5, "max_tokens": 4}
    good = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    answers = {}
    threads = [threading.Thread(target=lambda k=k, b=b: answers.__setitem__(k, post(server, "/v1/completions", b)))
               for k, b in (("good", good), ("bad", bad))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    openai_error(answers["bad"], 500, match="RuntimeError: injected fault")
    assert answers["good"].json()["usage"]["completion_tokens"] == 40  # batched beside the failure, unharmed
    r = post(server, "/v1/completions", {**bad, "stream": True})
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]", r.text
    assert json.loads(lines[-2][6:])["error"]["message"] == "RuntimeError: injected fault"
    assert any("engine error in slot" in line and "injected fault" in line for line in server.logs)
    assert post(server, "/v1/completions", good).status_code == 200  # and the engine goes on


def test_a_job_that_fails_in_the_scheduler_fails_alone(model_path):
    """No HTTP: a job whose sampler raises (a logit bias on a token id past the vocabulary, which the schemas would
    have refused) ends with ("error", ...); the job batched beside it runs to its end; the next job is served."""
    engine = pymoe.load(model_path, n_ctx=CTX)
    bad_bias = SamplingParams(temperature=0, logit_bias=((10**6, 1.0),))
    with Scheduler(engine, parallel=2, kv="f32") as sched:
        good = sched.submit(Job(prompt_ids=[1, 2, 3], max_tokens=30, ignore_eos=True,
                                sampling=SamplingParams(temperature=0)))
        bad = sched.submit(Job(prompt_ids=[4, 5, 6], max_tokens=30, sampling=bad_bias))
        bad_seed = sched.submit(Job(prompt_ids=[4, 5], max_tokens=3, sampling=SamplingParams(seed=-5)))
        bad_events, seed_events = list(bad.events(timeout=30)), list(bad_seed.events(timeout=30))
        assert bad_events[-1][0] == "error" and "IndexError" in bad_events[-1][1]
        assert seed_events == [("error", "seed must be in [0, 2**64 - 1], or -1 (random)")]
        assert list(good.events(timeout=30))[-1] == ("done", "length") and len(good.generated) == 30
        after = sched.submit(Job(prompt_ids=[1, 2], max_tokens=3, ignore_eos=True))
        assert list(after.events(timeout=30))[-1] == ("done", "length")
    assert sched.outcomes["error"] == 2 and sched.outcomes["ok"] == 2


# --- bodies: surrogates, nesting ----------------------------------------------------------------------------------

def raw_post(srv, path, text: str):
    return httpx.post(srv.url + path, content=text.encode(), headers={"content-type": "application/json"},
                      timeout=30)


def test_a_lone_surrogate_is_a_400_naming_where_it_is(server):
    r = raw_post(server, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    openai_error(r, 400, "messages[0].content", "invalid_value", "lone UTF-16 surrogate")
    r = raw_post(server, "/v1/completions", '{"prompt": "\\udfff", "max_tokens": 2}')
    openai_error(r, 400, "prompt", "invalid_value", "lone UTF-16 surrogate")
    r = raw_post(server, "/tokenize", '{"content": "x", "\\ud801": 1}')
    openai_error(r, 400, "\\ud801", "invalid_value", "lone UTF-16 surrogate")  # escaped: JSON can't carry it
    r = raw_post(server, "/tokenize", '{"content": "\\ud83d\\ude00 \\\\ud800"}')  # a pair (an emoji), a backslash
    assert r.status_code == 200 and r.json()["tokens"], r.text


def test_json_nested_past_the_depth_limit_is_a_400(server):
    depth = serve_app.MAX_DEPTH
    for text in ("[" * 100_000 + "]" * 100_000, '{"a": ' * 100_000 + "1" + "}" * 100_000):
        openai_error(raw_post(server, "/v1/chat/completions", text), 400, None, "invalid_json",
                     f"nested deeper than {depth} levels")
    nested = lambda n: {"anyOf": [nested(n - 2)]} if n > 2 else {"type": "string"}  # noqa: E731  2 levels a step
    # the body's own object is level 1, json_schema level 2: a schema of depth - 1 levels passes the check (and meets
    # the grammar compiler's own limit, serde_json's 128 levels: a 400 naming json_schema), one more does not
    r = post(server, "/v1/chat/completions", chat(json_schema=nested(depth - 1)))
    openai_error(r, 400, "json_schema", "invalid_value", "recursion limit exceeded")
    assert post(server, "/v1/chat/completions", chat(json_schema=nested(depth - 9))).status_code == 200
    openai_error(post(server, "/v1/chat/completions", chat(json_schema=nested(depth + 1))), 400, None,
                 "invalid_json", "nested deeper")


# --- chat templates -----------------------------------------------------------------------------------------------

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE_OUTPUT = "{% for i in range(2000) %}{{ 'x' * 100000 }}{% endfor %}"  # 200 MB, 100 KB a piece


def health_while(srv, work) -> tuple:
    """Run work() in a thread, polling /health meanwhile -> (work's result, its seconds, the slowest /health)."""
    result, worst = [], 0.0
    thread = threading.Thread(target=lambda: result.append(work()))
    t0 = time.monotonic()
    thread.start()
    with httpx.Client(timeout=30) as c:
        while thread.is_alive():
            t = time.monotonic()
            assert c.get(srv.url + "/health").status_code == 200
            worst = max(worst, time.monotonic() - t)
            time.sleep(0.02)
    thread.join()
    return result[0], time.monotonic() - t0, worst


@pytest.mark.parametrize("template, why", [(NESTED_LOOPS, "budget of 4000000 steps"),
                                           (HUGE_OUTPUT, "output is over the limit")], ids=["loops", "output"])
def test_a_hostile_chat_template_stops_at_its_budget_and_the_server_answers_meanwhile(server, monkeypatch, template,
                                                                                      why):
    monkeypatch.setattr(server.engine.tokenizer, "chat_template", template)
    r, seconds, worst = health_while(server, lambda: post(server, "/v1/chat/completions", chat(), timeout=60))
    openai_error(r, 400, "messages", "invalid_value", why)
    assert seconds < 20 and worst < 1.0, (seconds, worst)  # 20 s: MAX_SECONDS (10) with room for a loaded machine


def test_template_budgets_bound_loops_without_output_and_single_expressions(monkeypatch):
    """The budgets at the tokenizer (what `pymoe run --chat` calls): a loop over the messages that outputs nothing,
    a string repeated past the size limit in one expression, a filter asked for a gigabyte, a macro doubling a
    string as it recurses: each a one-line PymoeError, fast."""
    from pymoe.engine import chat_template

    monkeypatch.setattr(chat_template, "MAX_STEPS", 100_000)
    tok = Tokenizer.__new__(Tokenizer)  # just what the template needs: no vocabulary
    tok.bos_id = tok.eos_id = None
    messages = [{"role": "user", "content": "x"}] * 1000
    cases = [("{% for a in messages %}{% for b in messages %}{% endfor %}{% endfor %}", "budget of 100000 steps"),
             ("{{ 'ab' * 100000000 }}", "repetition of 2 x 100000000"),
             ("{{ 'x'|center(1000000000) }}", "integer argument of 1000000000"),
             ("{{ 'x'.ljust(1000000000) }}", "integer argument of 1000000000"),
             ("{% macro d(s) %}{{ d(s ~ s) }}{% endmacro %}{{ d('x') }}", "a string of 33554432 characters"),
             ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
              "a string of 33554432 characters")]
    for source, why in cases:
        tok.chat_template = source
        t0 = time.monotonic()
        with pytest.raises(PymoeError) as e:
            tok.apply_chat_template(messages)
        assert str(e.value).startswith("chat template: TemplateBudgetError: ") and why in str(e.value), e.value
        assert "\n" not in str(e.value) and time.monotonic() - t0 < 5, source
    tok.chat_template = None  # ChatML: the budgets leave a real template alone
    assert tok.apply_chat_template(messages[:2]).count("<|im_start|>user\nx<|im_end|>") == 2


def test_pymoe_run_chat_with_a_hostile_template_is_one_line(model_path):
    r = run_pymoe("run", model_path, "--chat", "--chat-template", NESTED_LOOPS, "-p", "hi", "-n", "2", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if not line.startswith("pymoe run: ")]  # the info lines apart
    assert errors == ["pymoe: error: chat template: TemplateBudgetError: the template ran past its budget of 4000000 "
                      "steps"], r.stderr


# --- the event loop -----------------------------------------------------------------------------------------------

def test_a_big_prompt_is_tokenized_off_the_event_loop(server):
    """3 MB of text: seconds of tokenizing (once on the event loop, stalling every other request, /health too)."""
    text = ("def forward(self, tokens): return self.norm(tokens) @ W\n" * 60_000)[:3_000_000]
    r, seconds, worst = health_while(server, lambda: post(server, "/v1/completions", {"prompt": text}, timeout=120))
    openai_error(r, 400, "prompt", "context_length_exceeded", "does not fit the context")
    assert worst < seconds / 4, (seconds, worst)  # on the event loop, /health waited about the whole request


# --- routes and shapes --------------------------------------------------------------------------------------------

def test_404_and_405_are_in_openai_shape_and_anthropic_shape_under_v1_messages(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        openai_error(c.get("/v1/nope"), 404, None, "not_found", "no route /v1/nope")
        openai_error(c.post("/v1/chat/completion"), 404, None, "not_found")
        r = c.get("/v1/chat/completions")
        openai_error(r, 405, None, "method_not_allowed", "/v1/chat/completions does not take GET")
        assert r.headers["allow"] == "POST"
        openai_error(c.put("/health"), 405, None, "method_not_allowed")
        r = c.get("/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error" and r.json()["error"]["type"] == \
            "invalid_request_error", r.text
        r = c.post("/v1/messages/nope")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text


BOUNDS = [  # (path, fields, param, a piece of the message)
    ("/v1/chat/completions", {"max_tokens": 2**31}, "max_tokens", "at most 2147483647"),
    ("/v1/completions", {"max_completion_tokens": 2**31}, "max_completion_tokens", "at most 2147483647"),
    ("/v1/chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 strings"),
    ("/v1/chat/completions", {"stop": "x" * 1025}, "stop", "at most 1024 characters"),
    ("/v1/completions", {"stop": ["x" * 1025]}, "stop", "at most 1024 characters"),
    ("/v1/chat/completions", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
    ("/v1/chat/completions", {"logit_bias": {"²": 1}}, "logit_bias", "token ids"),
    ("/v1/chat/completions", {"logit_bias": {"9" * 5000: 1}}, "logit_bias", "token ids"),
    ("/v1/chat/completions", {"repeat_penalty": 1e-320}, "repeat_penalty", "in [0.01, 100]"),
    ("/v1/chat/completions", {"temperature": 1e999}, "temperature", "in [0, 2]"),
    ("/v1/messages", {"stop_sequences": ["x"] * 17}, "stop_sequences", "at most 16 strings"),
    ("/v1/messages", {"max_tokens": 2**31}, "max_tokens", "at most 2147483647"),
]


@pytest.mark.parametrize("path, fields, param, why", BOUNDS, ids=[f"{p}-{k}" for p, f, k, _ in BOUNDS])
def test_size_bounds_are_a_400_naming_the_field(server, path, fields, param, why):
    base = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
            "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}}
    body = json.dumps({**base.get(path, chat()), **fields}).replace("Infinity", "1e999")  # 1e999: JSON's way to inf
    r = raw_post(server, path, body)
    if path == "/v1/messages":  # Anthropic's shape: no param; the message names the field
        assert r.status_code == 400 and f"'{param}'" in r.json()["error"]["message"], r.text
        return
    err = openai_error(r, 400, param, "invalid_value")
    assert why in err["message"], err


def test_nan_and_infinity_are_not_json(server):
    for literal in ("NaN", "Infinity", "-Infinity"):
        r = raw_post(server, "/v1/chat/completions", json.dumps(chat(temperature=0.5)).replace("0.5", literal))
        openai_error(r, 400, None, "invalid_json", f"{literal} is not JSON")


HOSTILE = [-1, 2**64, 1e308, 5e-324, "x", [None], {"a": [1]}]
FIELDS = ["max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "top_k", "min_p",
          "repeat_penalty", "ignore_eos", "response_format", "grammar", "json_schema", "n", "presence_penalty",
          "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
          "user", "model", "messages", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "mirostat",
          "mirostat_tau", "mirostat_eta", "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
          "dry_sequence_breakers", "min_tokens", "n_probs", "cache_prompt", "id_slot", "reasoning_format"]


def test_no_hostile_value_of_any_field_gives_a_5xx(server):
    """Every field of a chat request set to each of a list of odd values: a 200 or a 4xx in OpenAI's shape, never a
    5xx (an unexpected exception answers 500: the handler in app.py keeps even that in shape, and this fails)."""
    with httpx.Client(timeout=30) as c:
        for field in FIELDS:
            for value in HOSTILE:
                r = c.post(server.url + "/v1/chat/completions", json=chat(**{field: value}))
                assert r.status_code < 500, (field, value, r.text)
                if r.status_code != 200:
                    assert r.json()["error"]["message"], (field, value, r.text)


def test_a_forced_tool_call_whose_schema_does_not_compile_is_a_400_naming_tools():
    """app.forced_call_grammar (tool_choice "required" on a template with a tool format): the call's grammar embeds
    each tool's `parameters`; one the grammar compiler refuses was a PymoeError out of the route, a 500."""
    req = ChatRequest.model_validate(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nope"}}}], tool_choice="required"))
    with pytest.raises(ApiError) as e:
        serve_app.forced_call_grammar(req, "required", Job(prompt_ids=[1], max_tokens=1))
    assert (e.value.status, e.value.param, e.value.code) == (400, "tools", "invalid_value")


# --- time limits --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def timed_server(model_path):
    """A request may take 1 s (--request-timeout 1); a context long enough that generation would outlast it."""
    app = create_app(pymoe.load(model_path, n_ctx=4096), parallel=1, kv="f32", request_timeout=1.0)
    with BackgroundServer(app) as srv:
        yield srv


def test_a_request_past_its_time_limit_ends_with_length(timed_server):
    long = {"prompt": "hi", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    t0 = time.monotonic()
    r = post(timed_server, "/v1/completions", long)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert 0 < r.json()["usage"]["completion_tokens"] < 4000 and time.monotonic() - t0 < 5
    r = post(timed_server, "/v1/completions", {**long, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["timings"]["predicted_n"] < 4000
    status = httpx.get(timed_server.url + "/v1/status", timeout=10).json()
    assert status["requests"]["timeout"] == 2 and status["recent"][-1]["stop_reason"] == "timeout"


def test_a_body_never_sent_is_a_408(timed_server):
    host, port = timed_server.sock.getsockname()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\"")
        answer = b""
        while b"}}" not in answer:  # the headers, then the JSON error (maybe in another segment)
            answer += s.recv(65536) or b"}}"
        answer = answer.decode()
    assert answer.startswith("HTTP/1.1 408") and "request body not received within 1 s" in answer, answer


def test_a_client_that_stops_reading_is_dropped_and_its_generation_cancelled(model_path):
    """A stream whose client never reads: once the socket buffers are full (made small here: 4 KB each way instead
    of megabytes) the server's send waits; after CLIENT_STALL_S (1 s here) of unacknowledged data the kernel drops
    the connection (TCP_USER_TIMEOUT) and the job is cancelled. Without the bound the job runs on to max_tokens and
    the response waits on the socket forever."""
    app = create_app(pymoe.load(model_path, n_ctx=4096), parallel=1, kv="f32")
    with BackgroundServer(app, client_stall_s=1.0) as srv:
        srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # inherited by the connections it accepts
        body = json.dumps({"prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True,
                           "logprobs": 5}).encode()  # ~1 KB of SSE per token
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(srv.sock.getsockname())
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = httpx.get(srv.url + "/v1/status", timeout=10).json()
            if status["recent"]:
                break
            time.sleep(0.2)
        client.close()
    last = status["recent"][-1]
    assert last["stop_reason"] == "cancelled" and last["n_generated"] < 3000, last
