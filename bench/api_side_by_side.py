#!/usr/bin/env python3
"""The request features of pymoe's server and llama-cpp-python's, measured side by side (issue 18's table).

What this is: one script that starts both servers on the same GGUF file, on loopback ports, as subprocesses:
    pymoe:             python -m pymoe serve COPY --port P -np 2 --kv f32 -c CTX -t THREADS
    llama-cpp-python:  python -m llama_cpp.server --model COPY --port Q --n_ctx CTX --type_k 0 --type_v 0 ...
(COPY is the model with --chat-template written into its GGUF metadata, so both servers read the same template
from the same file; on a CPU that reports AMX, or with --llama-plain, llama-cpp-python's models load without ggml's
extra CPU buffer types, as tests/oracle.py loads the oracle: its AMX kernels die of SIGILL in this project's VMs),
then sends every feature's request to each with the official `openai` client (`anthropic` for /v1/messages, httpx
for the routes neither client knows) and judges the answer by its *effect*:
    works      200 and the effect is there (the JSON parses, the schema holds, the named tool was called, ...)
    ignored    200 and no effect: the field was dropped on the floor (what issue 18 is about)
    wrong      200 and an effect, but not the one asked for (e.g. the wrong number of top log-probabilities)
    error NNN  refused with that status
    timeout / failed   no answer in time / an answer the check could not read (the note says what)
Temperature 0 wherever the check needs the same tokens twice. The two servers are measured at the same time, each
by its own thread (each server has --threads CPU threads). It prints a markdown table (feature | pymoe |
llama-cpp-python) with the versions and the command, and writes the same as JSON with --out.

What this is not: a speed comparison (bench/compare_llamacpp.py), a check of the answers' numbers (tests/
test_server.py compares logprobs with the reference engine), or llama.cpp's own C++ `llama-server` (this is the
Python server of llama-cpp-python, the one pip installs; its routes and fields differ from llama-server's).

    python bench/api_side_by_side.py --out /tmp/side_by_side.json
"""
import argparse
import importlib.metadata
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time

import anthropic
import httpx
import openai

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEMO_MODEL = os.path.join(ROOT, "pymoe", "demo", "data", "demo-moe.gguf")
QWEN3_TEMPLATE = os.path.join(ROOT, "tests", "data", "templates", "Qwen-Qwen3-0.6B.jinja")
START_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 120.0
DISCONNECT_WAIT_S = 30.0  # how long the disconnect check waits for a server that does not stop abandoned requests

MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]
REPEATS = [{"role": "user", "content": "import os\nimport os\nimport os\nimport os\nimport os\n"}]
PROMPT = "def fibonacci(n):\n"
FLAG_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}  # additionalProperties unsaid, as tools often come: see tool_named
PENALTY_TOKENS = 30  # llama-cpp-python penalises generated tokens only (its sampler is fed no prompt): 10 are too few
BIASED_TEXT = "Z"  # a one-token string: logit_bias +100 on its id must make greedy output nothing else
END_TOKENS = ("<|endoftext|>", "<|im_end|>")  # biased away (-100) in the long requests of the disconnect check


# --- the two servers -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server subprocess (its own session, so stopping it stops nothing else), its log file and URL."""

    def __init__(self, name: str, command: list, port: int, log_path: str, log_kept: bool):
        self.name, self.command, self.log_path, self.log_kept = name, command, log_path, log_kept
        self.url = f"http://127.0.0.1:{port}"
        self.proc = None

    def start(self) -> "Server":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"api_side_by_side: {self.name} exited with status {self.proc.returncode} while "
                                 f"starting: {self.why()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise SystemExit(f"api_side_by_side: {self.name} did not answer GET /v1/models within "
                         f"{START_TIMEOUT_S:g} s: {self.why()}")

    def why(self) -> str:
        """The log's last line that mentions an error, with the two after it (a pydantic message's details), else
        its last line; and where the whole log is."""
        with open(self.log_path, "rb") as f:
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
        errors = [i for i, line in enumerate(lines) if re.search(r"error\b", line, re.IGNORECASE)]
        start = errors[-1] if errors else len(lines) - 1
        text = " ".join(lines[start:start + 3]) if lines else "(nothing in its log)"
        where = f"log: {self.log_path}" if self.log_kept else "--log-dir DIR keeps its log"
        return f"{text[:300]} ({where})"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # a generation the server does not cancel can hold its shutdown
            self.proc.kill()
            self.proc.wait(10)


def model_with_template(model: str, template: str, out_dir: str) -> str:
    """A copy of `model` with `template` (a Jinja file) as its tokenizer.chat_template, written by gguf-py's
    gguf_new_metadata: then both servers read the same template from the same file, with no option of their own."""
    copy = os.path.join(out_dir, os.path.basename(model).replace(".gguf", "") + "-template.gguf")
    r = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", model, copy,
                        "--chat-template-file", template, "--force"], capture_output=True, text=True)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines() or ["(no output)"]
        raise SystemExit(f"api_side_by_side: could not write {copy}: {lines[-1]}")
    return copy


def token_ids(model: str, texts) -> dict:
    """text -> its id in the file's vocabulary (both servers read the same one)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(model).fields["tokenizer.ggml.tokens"]
        vocab = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return {t: vocab.index(t) for t in texts}
    except Exception as e:  # not a GGUF file gguf-py reads, no vocabulary, or not this tokenizer's tokens
        raise SystemExit(f"api_side_by_side: cannot find the tokens {texts} in {model}: {type(e).__name__}: {e}")


# --- what every check gets ---------------------------------------------------------------------------------------

class Target:
    """One server as the checks see it: its clients, its model name, and what earlier checks left for later ones."""

    def __init__(self, server: Server, ids: dict, long_tokens: int):
        self.server, self.url, self.ids, self.long_tokens = server, server.url, ids, long_tokens
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                                    timeout=REQUEST_TIMEOUT_S)
        self.anthropic = anthropic.Anthropic(base_url=self.url, api_key="none", max_retries=0,
                                             timeout=REQUEST_TIMEOUT_S)
        self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        self.saved = {}

    def chat(self, messages=MESSAGES, **fields):
        return self.openai.chat.completions.create(model=self.model, messages=messages, **fields)

    def complete(self, prompt=PROMPT, **fields):
        return self.openai.completions.create(model=self.model, prompt=prompt, **fields)

    def post(self, path: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
        r = httpx.post(self.url + path, json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def greedy(self, messages=REPEATS, max_tokens: int = PENALTY_TOKENS) -> str:
        """The greedy answer to `messages` with no other field: the baseline the penalty and stop checks change."""
        key = json.dumps(messages) + str(max_tokens)
        if key not in self.saved:
            self.saved[key] = self.chat(messages, max_tokens=max_tokens, temperature=0).choices[0].message.content
        return self.saved[key]


def shown(text, n: int = 40) -> str:
    """A short repr of an answer, for a note."""
    return repr(text if text is None or len(text) <= n else text[:n] + "...")


def json_prefix(text: str) -> bool:
    """Is text the start of a JSON document? (A JSON-constrained answer cut short at max_tokens is one.) Closes
    its open string and brackets after a few short fillers (a dangling ':', ',', partial literal or number) and
    asks json.loads."""
    stack, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif ch in "]}" and (not stack or stack.pop() != ch):
            return False
    closers = "".join(reversed(stack))
    quote = ("n" if escaped else "") + '"' if in_string else ""
    fillers = ["", "0", "null", '"":null', "e", "ue", "rue", "alse", "lse", "se", "ull", "ll", "l"]
    for filler in fillers:
        for key_end in ("", ":null"):
            try:
                json.loads(text + quote + filler + key_end + closers)
                return True
            except ValueError:
                pass
    return False


# --- the checks: each -> (verdict, note) -------------------------------------------------------------------------

def json_object(t):
    r = t.chat(response_format={"type": "json_object"}, max_tokens=48, temperature=0)
    text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    try:
        return ("works", "") if isinstance(json.loads(text), dict) else ("wrong", f"JSON, not an object: {shown(text)}")
    except (TypeError, ValueError):
        if reason == "length" and text.lstrip().startswith("{") and json_prefix(text):
            return "works", "a JSON object cut at max_tokens"
        return "ignored", f"not JSON: {shown(text)}"


def flag_answer(text) -> tuple:
    """FLAG_SCHEMA's check: {"ok": true} or {"ok": false}, nothing else."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return "ignored", f"not JSON: {shown(text)}"
    if value in ({"ok": True}, {"ok": False}):
        return "works", ""
    return "wrong", f"JSON, not the schema: {shown(text)}"


def json_schema(t):
    r = t.chat(response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG_SCHEMA,
                                                                     "strict": True}},
               max_tokens=16, temperature=0)
    return flag_answer(r.choices[0].message.content)


def json_schema_field(t):
    r = t.chat(extra_body={"json_schema": FLAG_SCHEMA}, max_tokens=16, temperature=0)
    return flag_answer(r.choices[0].message.content)


def grammar(t):
    r = t.chat(extra_body={"grammar": 'root ::= "yes" | "no"'}, max_tokens=4, temperature=0)
    text = r.choices[0].message.content
    return ("works", "") if text in ("yes", "no") else ("ignored", f"answer {shown(text)}")


def tool_named(t):
    """The tool's parameters do not say additionalProperties. JSON Schema then allows any other key; llama.cpp's
    schema converter closes the object after the declared keys, and so does pymoe's forced-call grammar
    (serve/tools.closed; before it, the demo model wrote extra keys until max_tokens and no call came back)."""
    r = t.chat(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
               max_tokens=48, temperature=0)
    calls = r.choices[0].message.tool_calls or []
    if not calls:
        return "ignored", f"no tool_calls; content {shown(r.choices[0].message.content)}"
    call = calls[0].function
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return "wrong", f"arguments not JSON: {shown(call.arguments)}"
    if call.name == "get_weather" and arguments.get("city") in ("Paris", "Oslo"):
        return "works", f"finish_reason {r.choices[0].finish_reason}"
    return "wrong", f"{call.name}({shown(call.arguments)})"


def chat_logprobs(t):
    r = t.chat(logprobs=True, top_logprobs=3, max_tokens=3, temperature=0)
    lp = r.choices[0].logprobs
    if lp is None or not lp.content:
        return "ignored", "no logprobs"
    n = r.usage.completion_tokens
    counts = sorted({len(e.top_logprobs or []) for e in lp.content})
    if len(lp.content) == n and counts == [3] and all(e.logprob <= 0 for e in lp.content):
        return "works", ""
    return "wrong", f"{len(lp.content)} entries for {n} tokens, top_logprobs counts {counts}"


def completion_logprobs(t):
    r = t.complete(logprobs=2, max_tokens=3, temperature=0)
    lp = r.choices[0].logprobs
    if lp is None or not lp.tokens:
        return "ignored", "no logprobs"
    counts = sorted({len(d or {}) for d in lp.top_logprobs or []})
    n = r.usage.completion_tokens
    if len(lp.tokens) == n and counts and set(counts) <= {2, 3}:  # OpenAI: the 2 likeliest, and the chosen one
        return "works", ""
    return "wrong", f"{len(lp.tokens)} tokens for {n}, top_logprobs sizes {counts}"


def n_choices(t):
    r = t.chat(n=3, max_tokens=2, temperature=1.0)
    indices = sorted(c.index for c in r.choices)
    if indices == [0, 1, 2]:
        return "works", ""
    return ("ignored" if len(indices) == 1 else "wrong"), f"{len(indices)} choice(s)"


def logit_bias(t):
    r = t.chat(logit_bias={str(t.ids[BIASED_TEXT]): 100}, max_tokens=3, temperature=0)
    text = r.choices[0].message.content
    if text == BIASED_TEXT * r.usage.completion_tokens:
        return "works", ""
    return ("wrong" if BIASED_TEXT in (text or "") else "ignored"), f"answer {shown(text)}"


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def penalty(field):
    def check(t):
        base = t.greedy()
        text = t.chat(REPEATS, max_tokens=PENALTY_TOKENS, temperature=0, **{field: 2.0}).choices[0].message.content
        if text == base:
            return "ignored", f"the same {PENALTY_TOKENS} greedy tokens as without"
        return "works", f"differs from character {first_difference(text, base)}"
    check.__name__ = field
    return check


def echo(t):
    r = t.complete(echo=True, max_tokens=2, temperature=0)
    text = r.choices[0].text
    return ("works", "") if text.startswith(PROMPT) and len(text) > len(PROMPT) else ("ignored", f"text {shown(text)}")


def stream_usage(t):
    chunks = list(t.chat(stream=True, stream_options={"include_usage": True}, max_tokens=3, temperature=0))
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if usage and usage[-1].completion_tokens > 0:
        return "works", ""
    return "ignored", f"{len(chunks)} chunks, text {shown(text)}, no usage"


def seed(t):
    texts = [t.chat(seed=s, max_tokens=6, temperature=1.0).choices[0].message.content for s in (7, 7, 8)]
    if texts[0] != texts[1]:
        return "ignored", "seed 7 twice: two different answers"
    return "works", "" if texts[2] != texts[0] else "seed 8 gave the same answer too"


def stop(t):
    base = t.greedy()
    middle = len(base) // 2
    cut = base[middle:middle + 3]
    if len(cut) < 3:
        return "failed", f"greedy answer too short to cut: {shown(base)}"
    want = base[:base.index(cut)]
    r = t.chat(REPEATS, max_tokens=PENALTY_TOKENS, temperature=0, stop=[cut])
    text = r.choices[0].message.content
    if text == want:
        return "works", ""
    return ("ignored" if text == base else "wrong"), f"stop {shown(cut)}: {shown(text)}, want {shown(want)}"


def llama_route(t, path, body, extras_path, extras_body):
    """POST llama.cpp's route; if it is not there, the same under /extras (llama-cpp-python's name) -> the answer
    and a note naming the route that answered."""
    try:
        return t.post(path, body), ""
    except httpx.HTTPStatusError as e:
        if e.response.status_code != 404:
            raise
    return t.post(extras_path, extras_body), f"{path}: 404; {extras_path} instead"


def tokenize(t):
    answer, note = llama_route(t, "/tokenize", {"content": PROMPT}, "/extras/tokenize", {"input": PROMPT})
    tokens = answer.get("tokens")
    t.saved["tokens"] = tokens
    ok = isinstance(tokens, list) and tokens and all(isinstance(i, int) for i in tokens)
    return ("works" if ok else "wrong"), note or ("" if ok else f"answer {shown(json.dumps(answer))}")


def detokenize(t):
    tokens = t.saved.get("tokens") or []
    if not tokens:
        return "n/a", "no tokens from the tokenize check"
    answer, note = llama_route(t, "/detokenize", {"tokens": tokens}, "/extras/detokenize", {"tokens": tokens})
    text = answer.get("content", answer.get("text"))
    return ("works" if text == PROMPT else "wrong"), note or ("" if text == PROMPT else f"text {shown(text)}")


def apply_template(t):
    prompt = t.post("/apply-template", {"messages": MESSAGES}).get("prompt", "")
    if MESSAGES[0]["content"] in prompt and prompt.endswith("<|im_start|>assistant\n"):
        return "works", ""
    return "wrong", f"prompt {shown(prompt)}"


def anthropic_messages(t):
    r = t.anthropic.messages.create(model=t.model, max_tokens=3, messages=MESSAGES)
    if r.content and r.content[0].type == "text" and r.usage.output_tokens > 0:
        return "works", ""
    return "wrong", f"content {shown(str(r.content))}"


def unknown_field(t):
    try:
        r = t.chat(max_tokens=1, temperature=0, extra_body={"no_such_field": 1})
    except openai.BadRequestError:
        return "works", "400"
    return "ignored", f"200: {shown(r.choices[0].message.content)}"


def timed_post(t, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> float:
    """POST /v1/completions -> its seconds."""
    t0 = time.monotonic()
    t.post("/v1/completions", body, timeout=timeout)
    return time.monotonic() - t0


def disconnect(t):
    """Two non-streaming requests of t.long_tokens tokens (end tokens biased away) whose client gives up after 1 s,
    then a 1-token request: works when it waits at most max(2 s, 3 x its time on the idle server), i.e. the server
    stopped the abandoned generations. Only said when running them on would have taken twice that at least (from
    the idle server's time for 32 such tokens); else the check is inconclusive (a larger --ctx helps)."""
    bias = {str(t.ids[e]): -100 for e in END_TOKENS}
    short = {"model": t.model, "prompt": PROMPT, "max_tokens": 1}
    long = {"model": t.model, "prompt": PROMPT, "max_tokens": t.long_tokens, "temperature": 0, "logit_bias": bias}
    allowed = max(2.0, 3 * timed_post(t, short))
    ran_on = timed_post(t, {**long, "max_tokens": 32}) / 32 * t.long_tokens - 1.0  # s, if not stopped
    if ran_on < 2 * allowed:
        return "failed", f"inconclusive: the abandoned requests would end in ~{ran_on:.1f} s anyway"
    answered = []  # the long requests that did not run for 1 s (a 400 for a context too small, say)

    def abandon():
        try:
            answered.append(httpx.post(t.url + "/v1/completions", json=long,
                                       timeout=httpx.Timeout(10.0, read=1.0)).status_code)
        except httpx.TimeoutException:
            pass
    threads = [threading.Thread(target=abandon) for _ in range(2)]  # 2: pymoe's slots, so both are taken
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if answered:
        return "failed", f"a long request was answered within 1 s (status {answered[0]}): see --long-tokens"
    try:
        waited = timed_post(t, short, timeout=DISCONNECT_WAIT_S)
    except httpx.TimeoutException:
        return "ignored", f"a 1-token request was still waiting {DISCONNECT_WAIT_S:g} s later"
    if waited <= allowed:
        return "works", f"the next 1-token request answered in {waited:.1f} s"
    return "ignored", f"the next 1-token request waited {waited:.1f} s: the abandoned generation ran on"


FEATURES = [  # (row label, the request in short, check)
    ("`response_format` json_object", "chat, max_tokens 48", json_object),
    ("`response_format` json_schema", '`{"ok": boolean}`, strict', json_schema),
    ("llama.cpp `json_schema` field", "the same schema, extra_body", json_schema_field),
    ("llama.cpp `grammar` (GBNF)", '`root ::= "yes" | "no"`, extra_body', grammar),
    ("`tools` + named `tool_choice`", "one tool, its city an enum", tool_named),
    ("chat `logprobs` + `top_logprobs`", "top_logprobs 3, 3 tokens", chat_logprobs),
    ("completions `logprobs`", "logprobs 2, 3 tokens", completion_logprobs),
    ("`n` > 1", "n 3", n_choices),
    ("`logit_bias`", f'+100 on the id of "{BIASED_TEXT}", greedy', logit_bias),
    ("`presence_penalty`", "2.0 vs none, greedy, repetitive prompt", penalty("presence_penalty")),
    ("`frequency_penalty`", "2.0 vs none, greedy, repetitive prompt", penalty("frequency_penalty")),
    ("completions `echo`", "echo true", echo),
    ("`stream_options.include_usage`", "stream, include_usage", stream_usage),
    ("`seed`", "temperature 1, seed 7 twice (and 8)", seed),
    ("`stop`", "3 characters from the middle of the greedy answer", stop),
    ("`/tokenize`", "llama.cpp's route, else /extras/tokenize", tokenize),
    ("`/detokenize`", "round trip of the tokenize answer", detokenize),
    ("`/apply-template`", "llama.cpp's route", apply_template),
    ("Anthropic `POST /v1/messages`", "the anthropic client", anthropic_messages),
    ("unknown request field", "extra_body `no_such_field`", unknown_field),
    ("client disconnect frees the slot", "2 long requests abandoned after 1 s", disconnect),
]


def refused(status: int, body) -> tuple:
    """-> ("error NNN", the server's message, shortened; of a pydantic error dump, its 'msg')."""
    message = body
    if isinstance(body, dict):
        inner = body.get("error", body)
        message = inner.get("message", inner.get("detail", body)) if isinstance(inner, dict) else inner
    message = " ".join(str(message).split())
    pydantic = re.search(r"""'msg': (?:"([^"]*)"|'([^']*)')""", message)
    return f"error {status}", shown(pydantic.group(1) or pydantic.group(2) if pydantic else message, 60)


def measure(check, t) -> tuple:
    try:
        return check(t)
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        return refused(e.status_code, e.body)
    except httpx.HTTPStatusError as e:
        try:
            body = e.response.json()
        except ValueError:
            body = e.response.text
        return refused(e.response.status_code, body)
    except (openai.APITimeoutError, anthropic.APITimeoutError, httpx.TimeoutException):
        return "timeout", f"no answer in {REQUEST_TIMEOUT_S:g} s"
    except Exception as e:  # an answer of a shape the check did not expect: say so, measure the rest
        return "failed", shown(f"{type(e).__name__}: {e}", 60)


def measure_all(t: Target, into: dict) -> None:
    for label, _, check in FEATURES:
        t0 = time.monotonic()
        verdict, note = measure(check, t)
        into[label] = {"verdict": verdict, "note": note, "seconds": round(time.monotonic() - t0, 2)}


# --- report ------------------------------------------------------------------------------------------------------

def versions() -> dict:
    def of(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
    git = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return {"pymoe": f"{of('pymoe')} (git {git.stdout.strip() or '?'})", "llama-cpp-python": of("llama_cpp_python"),
            "openai": of("openai"), "anthropic": of("anthropic"), "httpx": of("httpx"),
            "python": platform.python_version()}


def cell(text: str) -> str:
    return text.replace("|", "\\|")  # GitHub's tables split on a | even inside `code`


def verdict(result: dict) -> str:
    return result["verdict"] + (f" ({result['note']})" if result["note"] else "")


def markdown(report: dict) -> str:
    names = list(report["servers"])
    lines = [f"| feature | request | {' | '.join(names)} |", "| --- | --- |" + " --- |" * len(names)]
    for row in report["rows"]:
        cells = [row["feature"], row["request"]] + [verdict(row[n]) for n in names]
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    v = report["versions"]
    lines += ["", f"Measured {report['date']} by `{report['command']}` in {report['seconds']:.0f} s: "
              + ", ".join(f"{k} {val}" for k, val in v.items()) + f"; model {report['model']} with the chat "
              f"template {report['template']}; " + "; ".join(f"{n}: `{c}`" for n, c in report["servers"].items())]
    return "\n".join(lines)


# llama_cpp.server with every model loaded without ggml's extra CPU buffer types (llama.cpp's --no-repack), as
# tests/oracle.py loads the oracle: on a CPU that reports AMX inside a VM that does not enable the AMX tile state,
# ggml's AMX matmul dies of SIGILL (`tilezero`) at the first request. The server's own options follow.
PLAIN_LLAMA_SERVER = """
import runpy, llama_cpp.llama_cpp as lib
default = lib.llama_model_default_params
def plain():
    params = default()
    params.use_extra_bufts = False
    return params
lib.llama_model_default_params = plain
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEMO_MODEL, help="GGUF file both servers load (default: the demo model)")
    ap.add_argument("--chat-template", default=QWEN3_TEMPLATE,
                    help="Jinja chat template written into a copy of the model for both servers; 'model' keeps the "
                         "file's own (default: tests/data/templates/Qwen-Qwen3-0.6B.jinja, which takes tools)")
    ap.add_argument("--ctx", type=int, default=2048, help="context per sequence on both servers (default 2048)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per server (default 1)")
    ap.add_argument("--long-tokens", type=int, default=1500,
                    help="max_tokens of the abandoned requests of the disconnect check, at most --ctx - 64 "
                         "(default 1500)")
    ap.add_argument("--llama-plain", action="store_true",
                    help="llama.cpp without its extra CPU buffer types (AMX, repacked layouts); the default on a CPU "
                         "that reports AMX, whose kernels die of SIGILL in this project's VMs (tests/oracle.py)")
    ap.add_argument("--out", help="also write the results as JSON to this file")
    ap.add_argument("--log-dir", help="keep the model copy and the servers' logs here (default: a temporary folder)")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.model):
        raise SystemExit(f"api_side_by_side: no such model file: {args.model}")

    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work, kept = args.log_dir or tmp, args.log_dir is not None
        os.makedirs(work, exist_ok=True)
        model = args.model if args.chat_template == "model" else model_with_template(args.model, args.chat_template,
                                                                                    work)
        ids = token_ids(model, (BIASED_TEXT,) + END_TOKENS)
        py = sys.executable
        p, q = free_port(), free_port()
        from compare_llamacpp import cpu_reports_amx  # bench/ is on sys.path when this runs as a script

        plain = args.llama_plain or cpu_reports_amx()
        servers = [
            Server("pymoe", [py, "-m", "pymoe", "serve", model, "--port", str(p), "-np", "2", "--kv", "f32",
                             "-c", str(args.ctx), "-t", str(args.threads)], p, os.path.join(work, "pymoe.log"), kept),
            Server("llama-cpp-python", [py, *(["-c", PLAIN_LLAMA_SERVER] if plain else ["-m", "llama_cpp.server"]),
                                        "--model", model, "--port", str(q),
                                        "--n_ctx", str(args.ctx), "--type_k", "0", "--type_v", "0",  # 0: GGML F32
                                        "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                                        "--verbose", "False"], q, os.path.join(work, "llama-cpp-python.log"), kept),
        ]
        results = {s.name: {} for s in servers}
        try:
            for s in servers:
                s.start()
            long_tokens = min(args.long_tokens, args.ctx - 64) if args.ctx > 64 else args.long_tokens
            targets = [Target(s, ids, long_tokens) for s in servers]
            threads = [threading.Thread(target=measure_all, args=(t, results[t.server.name])) for t in targets]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            for s in servers:
                s.stop()

    def shown_command(command):  # the copy's name, not its temporary folder; PORT, not this run's port
        shown = shlex.join(os.path.basename(a) if a in (py, model) else "PORT" if a in (str(p), str(q)) else a
                           for a in command)
        return shown.replace(f"-c {shlex.quote(PLAIN_LLAMA_SERVER)}", "-m llama_cpp.server") + (
            " (ggml's extra CPU buffer types off: --llama-plain)" if PLAIN_LLAMA_SERVER in command else "")
    report = {
        "date": time.strftime("%Y-%m-%d"), "command": shlex.join(["python", "bench/api_side_by_side.py"]
                                                                 + (argv if argv is not None else sys.argv[1:])),
        "seconds": round(time.monotonic() - t_start, 1), "versions": versions(),
        "model": os.path.relpath(args.model, ROOT) if args.model.startswith(ROOT) else args.model,
        "template": "of the file" if args.chat_template == "model" else os.path.basename(args.chat_template),
        "servers": {s.name: shown_command(s.command) for s in servers},
        "rows": [{"feature": label, "request": request, **{name: results[name][label] for name in results}}
                 for label, request, _ in FEATURES],
    }
    print(markdown(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
