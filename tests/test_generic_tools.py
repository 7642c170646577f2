"""Tools on a template with no tool-call format of its own (serve/tools.py `Generic`, llama.cpp's generic format):
the demo model with its own ChatML-like template, through the official openai client and LangChain.

Covered: a forced call (a named function, and tool_choice required) parses and follows its tool's schema, streamed
the same; tool_choice auto answers with a call or text, never with the format's JSON showing; history (an assistant's
call, the tool's answer) is rewritten into JSON turns the template renders; LangChain's
with_structured_output(method="function_calling") at max_tokens 64; Anthropic's tool_use on the same format; a
call cut by max_tokens in a stream; forced tokens (serve/scheduler.py) against the reference engine; the parser and
its streaming on their own.
"""
import json

import httpx
import openai
import pytest

import pymoe
from pymoe.demo import demo_model
from pymoe.serve import tools
from pymoe.serve.app import BackgroundServer, create_app

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}}
BOUNDED = {"type": "integer", "minimum": -999, "maximum": 999}  # unbounded, the model can write digits to max_tokens
ADD = {"type": "function", "function": {"name": "add", "parameters": {
       "type": "object", "properties": {"a": BOUNDED, "b": BOUNDED}, "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    engine = pymoe.load(demo_model(), n_ctx=1024)
    assert tools.tool_format(engine.tokenizer.chat_template) is None  # the point: no format of its own
    with BackgroundServer(create_app(engine, kv="f32")) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def arguments(call, tool):
    """A call's arguments: they parse and follow the tool's schema (required keys, types, maxLength)."""
    args = json.loads(call.function.arguments)
    spec = tool["function"]["parameters"]
    assert call.type == "function" and call.id.startswith("call_") and set(args) == set(spec["required"]), args
    for key, prop in spec["properties"].items():
        assert isinstance(args[key], {"string": str, "integer": int}[prop["type"]]), args
        assert len(args[key]) <= prop.get("maxLength", 10**9) if prop["type"] == "string" else True
    return args


@pytest.mark.parametrize("choice, names", [({"type": "function", "function": {"name": "add"}}, {"add"}),
                                           ("required", {"get_weather", "add"})])
def test_a_forced_call_parses_on_the_demo_template(client, choice, names):
    for seed in (1, 2):
        r = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                           max_tokens=64, temperature=1, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0]
        assert call.function.name in names
        args = arguments(call, {"add": ADD, "get_weather": WEATHER}[call.function.name])
    chunks = list(client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                                                 max_tokens=64, temperature=1, seed=2, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == call.function.name
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args
    assert len([d for d in deltas if d.function.arguments]) > 1  # the arguments streamed as they were written
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)  # no JSON shows as text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        "tool_calls"]


def test_a_streamed_call_cut_by_max_tokens_stays_a_call(client):
    """Streamed, a call is announced once its name is written: cut by max_tokens, it stays that call with the
    arguments written so far (finish_reason length), and its JSON never shows as content (28 tokens: past the
    name, short of the end)."""
    chunks = list(client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER], tool_choice="required",
                                                 max_tokens=28, temperature=0, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].function.name == "get_weather" and {d.index for d in deltas} == {0}
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]


def test_auto_answers_with_a_call_or_text_and_the_json_never_shows(client):
    """tool_choice auto: over eight seeds the demo model answers both ways (two of them call, the others write
    text); a call follows its schema, a text answer is the response's string, never the JSON around it, and the
    stream gives the same content."""
    kinds = set()
    for seed in range(1, 9):
        r = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER], max_tokens=64,
                                           temperature=1, seed=seed)
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            arguments(c.message.tool_calls[0], WEATHER)
            kinds.add("call")
        elif c.finish_reason == "stop":  # {"response": ...} complete: its text is the content
            assert not (c.message.content or "").startswith("{"), c
            kinds.add("text")
            streamed = list(client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER],
                                                           max_tokens=64, temperature=1, seed=seed, stream=True))
            assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == \
                (c.message.content or "")
    assert kinds == {"call", "text"}


def test_history_is_rewritten_into_json_turns(server):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    tok = server.engine.tokenizer
    req = pymoe.serve.schemas.ChatRequest.model_validate({"messages": history, "tools": [WEATHER]})
    from pymoe.serve.app import chat_prompt

    prompt = chat_prompt(req, tok)
    assert '"name": "get_weather"' in prompt and "Answer in JSON" in prompt  # the tools' system section
    assert '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}' in prompt
    assert '<|im_start|>user\n{"tool_response": {"tool": "get_weather", "content": "sunny, 21 C"}}' in prompt
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": history, "tools": [WEATHER], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": ASK, "tools": [WEATHER], "max_tokens": 8, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_langchain_structured_output_by_function_calling(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person."""
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="demo", max_tokens=64, temperature=1, seed=3,
                     max_retries=0, timeout=120)
    person = llm.with_structured_output(Person, method="function_calling").invoke("a person")
    assert isinstance(person, Person) and len(person.name) <= 8 and 0 <= person.age <= 120


def test_generic_parser_and_its_stream():
    g = tools.FORMATS["generic"]
    call = '{"tool_call":{"name":"add","arguments":{"a":1,"b":2}}}'
    content, calls = g.parse(call)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2})]
    assert g.parse('{"response":"Hi \\"you\\"\\n"}') == ('Hi "you"', [])
    assert g.parse("plain text") == ("plain text", [])
    assert g.parse('{"other": 1}') == ('{"other": 1}', [])
    answer = '{"response":"caf\\u00e9 \\\\ ok"}'
    stream, sent = tools.CallStream("generic"), ""
    for i in range(len(answer)):
        piece, found = stream.feed(answer[i])
        assert not found and '{' not in piece
        sent += piece
    piece, found = stream.close()
    assert sent + piece == "café \\ ok" and not found
    stream = tools.CallStream("generic")
    assert stream.feed(call[:20]) == ("", []) and [c["function"]["name"] for c in stream.close()[1]] == []
    stream = tools.CallStream("generic")
    stream.feed(call[:20])
    assert [c["function"]["name"] for c in stream.feed(call[20:])[1] + stream.close()[1]] == ["add"]


def test_forced_tokens_are_taken_without_sampling_and_greedy_still_holds(server):
    """serve/scheduler.py's fast-forward: a forced call samples only the free parts (the arguments' values); the
    fixed ones (JSON keys, the name) are taken as the grammar forces them and read in one forward with the token
    before them. Oracle: the reference engine reads prompt + the answer in one prefill, and at every sampled
    position the answer's token is the argmax of the grammar-masked logits (temperature 0), at every other the
    grammar forces exactly the answer's tokens."""
    import numpy as np

    from pymoe.engine.kv import new_kv
    from pymoe.engine.sampler import SamplingParams
    from pymoe.serve.app import chat_prompt
    from pymoe.serve.scheduler import Job, Scheduler
    from pymoe.serve.schemas import ChatRequest

    engine = pymoe.load(demo_model(), n_ctx=1024)
    tok = engine.tokenizer
    req = ChatRequest.model_validate({"messages": ASK, "tools": [WEATHER, ADD], "tool_choice": "required"})
    prompt = tok.encode(chat_prompt(req, tok))
    grammar = tools.call_grammar([{"name": t["function"]["name"], "parameters": t["function"]["parameters"]}
                                  for t in (WEATHER, ADD)], "generic", tok)
    stats = {}
    for fast in (True, False):
        with Scheduler(engine, kv="f32", fast_forward=fast) as sched:
            job = sched.submit(Job(prompt_ids=prompt, max_tokens=64, grammar=grammar,
                                   sampling=SamplingParams(temperature=0)))
            text = "".join(v for kind, v in job.events(timeout=300) if kind == "piece")
        stats[fast] = (job.stats.n_generated, job.stats.n_forced, job.history[len(prompt):], text)
    # beside a speculating slot (--spec ngram: the step is a speculative one, where the grammar's slot reads its
    # forced tokens in the verifying forward): the same tokens
    with Scheduler(engine, parallel=2, kv="f32", spec="ngram", spec_k=3) as sched:
        plain = sched.submit(Job(prompt_ids=tok.encode("import os\nimport os\nimport"), max_tokens=40,
                                 sampling=SamplingParams(temperature=0)))
        job = sched.submit(Job(prompt_ids=prompt, max_tokens=64, grammar=grammar,
                               sampling=SamplingParams(temperature=0)))
        list(job.events(timeout=300)), list(plain.events(timeout=300))
    assert job.history[len(prompt):] == stats[True][2] and sched.max_batch == 2
    n, n_forced, answer, text = stats[True]
    assert job.stats.stop_reason == "stop" and tools.parse_calls(text, "generic")[1], text
    assert stats[False][1] == 0 and n_forced >= n // 2, stats  # most of a call is fixed text
    kv = new_kv(engine.config, 1024, "f32")
    logits = engine.model.prefill(np.asarray(prompt + answer[:-1]), kv)[len(prompt) - 1:]  # [len(answer), V]
    c = grammar.constraint(tok)
    i, sampled = 0, 0
    while i < len(answer):
        masked = np.where(c.allowed(), logits[i], -np.inf)
        assert int(np.argmax(masked)) == answer[i], i
        c.accept(answer[i])
        sampled, i = sampled + 1, i + 1
        forced = c.forced()
        assert answer[i:i + len(forced)] == forced[:len(answer) - i], i
        for t in forced[:len(answer) - i]:
            c.accept(t)
        i += len(forced)
    assert sampled == n - n_forced and c.finished


def test_anthropic_tools_on_the_generic_format(server):
    """/v1/messages on the same machinery: tool_choice any gives a tool_use block whose input follows the schema."""
    anthropic = pytest.importorskip("anthropic", reason="anthropic is in the test extra")
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    m = claude.messages.create(model="demo", max_tokens=64, messages=ASK, tool_choice={"type": "any"},
                               tools=[{"name": "add", "input_schema": ADD["function"]["parameters"]}],
                               extra_body={"temperature": 0})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and [u.name for u in uses] == ["add"], m.content
    assert set(uses[0].input) == {"a", "b"} and all(isinstance(v, int) for v in uses[0].input.values())
    assert not [b for b in m.content if b.type == "text"]
