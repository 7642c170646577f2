"""POST /v1/responses (serve/responses.py) against the official openai client's client.responses.create,
.stream and .parse, on the demo model with its own template (tools: the generic format, serve/tools.py).

Covered: a plain answer equals the chat endpoint's greedy answer for the same conversation (instructions as the
system message), with its usage; streamed, the deltas assemble to the whole answer and the client's stream state
accepts every event; max_output_tokens gives status incomplete; a tool round trip (function_call out,
function_call_output back in, streamed and not); structured output (text.format json_schema through
client.responses.parse); previous_response_id continues the stored conversation (the prompt is the whole conversation:
its tokens are counted, and reused from the slot), an unknown id is a 400 naming it; GET of a stored response;
unsupported fields are 400s naming them.
"""
import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

import pymoe
from pymoe.demo import demo_model
from pymoe.serve.app import BackgroundServer, create_app

KEY = "test-key"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    engine = pymoe.load(demo_model(), n_ctx=1024)
    with BackgroundServer(create_app(engine, kv="f32", api_key=KEY)) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client, messages, **kw):
    return client.chat.completions.create(model="demo", messages=messages, temperature=0, **kw)


def test_plain_answer_is_the_chat_answer(client):
    r = client.responses.create(model="demo", instructions="Write Python.", input="def read_lines(path):",
                                max_output_tokens=24, temperature=0)
    want = chat(client, [{"role": "system", "content": "Write Python."},
                         {"role": "user", "content": "def read_lines(path):"}], max_tokens=24)
    assert r.object == "response" and r.id.startswith("resp_") and r.instructions == "Write Python."
    assert r.output_text == want.choices[0].message.content and r.output_text
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == want.usage.prompt_tokens and r.usage.output_tokens == want.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the demo model writes code until stopped: max_output_tokens ends it, as OpenAI's status says
    assert want.choices[0].finish_reason == "length" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"


def test_streamed_answer_assembles_to_the_whole_one(client):
    """A plain answer cut by max_output_tokens ends with response.incomplete (the client's final-response helper
    wants response.completed: a structured answer, which ends, is streamed in test_structured_output)."""
    kw = dict(model="demo", input=[{"role": "user", "content": [{"type": "input_text", "text": "import os"}]}],
              max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and len(deltas) > 1
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
              "response.content_part.done", "response.output_item.done"):
        assert kinds.count(k) == 1, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens == 20


def test_a_tool_round_trip(client):
    ask = [{"role": "user", "content": "weather in Paris?"}]
    r = client.responses.create(model="demo", input=ask, tools=[WEATHER], tool_choice="required",
                                max_output_tokens=64, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather", r.output
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and len(args["city"]) <= 12 and calls[0].call_id.startswith("call_")
    with client.responses.stream(model="demo", input=ask, tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=64, temperature=0) as stream:
        argument_deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    assert [(o.name, o.arguments) for o in streamed.output if o.type == "function_call"] == [
        ("get_weather", calls[0].arguments)] and "".join(argument_deltas) == calls[0].arguments
    assert len(argument_deltas) > 1  # the arguments streamed as they were written
    back = ask + [{"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                   "arguments": calls[0].arguments},
                  {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}]
    r2 = client.responses.create(model="demo", input=back, tools=[WEATHER], max_output_tokens=64, temperature=0)
    assert r2.status in ("completed", "incomplete") and r2.output
    # the result reached the prompt: the same conversation on the chat endpoint has as many tokens
    want = chat(client, ask + [{"role": "assistant", "content": None, "tool_calls": [{
        "id": calls[0].call_id, "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=1)
    assert r2.usage.input_tokens == want.usage.prompt_tokens


def test_structured_output(client):
    """text.format json_schema (client.responses.parse sends a pydantic class's schema): the answer follows it and ends,
    streamed (responses.stream's final response, which wants response.completed) and not."""
    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)

    for temperature in (0.0, 1.0):
        r = client.responses.parse(model="demo", input="a person", text_format=Person, max_output_tokens=64,
                                   temperature=temperature)
        assert r.status == "completed", r.output
        person = r.output_parsed
        assert isinstance(person, Person) and len(person.name) <= 8 and 0 <= person.age <= 120
    with client.responses.stream(model="demo", input="a person", text_format=Person, max_output_tokens=64,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.output_parsed == client.responses.parse(
        model="demo", input="a person", text_format=Person, max_output_tokens=64, temperature=0).output_parsed


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(model="demo", input="import os", max_output_tokens=8, temperature=0)
    second = client.responses.create(model="demo", input="import sys", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    want = chat(client, [{"role": "user", "content": "import os"},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "import sys"}], max_tokens=8)
    assert second.output_text == want.choices[0].message.content
    assert second.usage.input_tokens == want.usage.prompt_tokens and second.previous_response_id == first.id
    got = httpx.get(f"{server.url}/v1/responses/{second.id}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert got.status_code == 200 and got.json()["output"][0]["content"][0]["text"] == second.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="demo", input="x", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and "resp_nope" in e.value.body["message"]
    unstored = client.responses.create(model="demo", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError, match=unstored.id):
        client.responses.create(model="demo", input="y", previous_response_id=unstored.id, max_output_tokens=2)
    assert httpx.get(f"{server.url}/v1/responses/resp_nope", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=30).status_code == 404


def test_the_store_is_bounded():
    from pymoe.serve.responses import ResponseStore

    store = ResponseStore(max_responses=3, max_chars=10**6)
    for i in range(5):
        store.put(f"r{i}", [{"role": "user", "content": "x"}], {"id": f"r{i}"})
    assert [k for k in ("r0", "r1", "r2", "r3", "r4") if store.get(k)] == ["r2", "r3", "r4"]
    store = ResponseStore(max_responses=10, max_chars=200)
    for i in range(5):
        store.put(f"r{i}", [{"role": "user", "content": "x" * 50}], {"id": f"r{i}"})
    assert store.get("r4") and not store.get("r0") and store.chars <= 200


@pytest.mark.parametrize("fields, param", [
    ({"reasoning": {"effort": "high"}}, "reasoning"), ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"background": True}, "background"), ({"truncation": "auto"}, "truncation"), ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format")])
def test_unsupported_fields_are_a_400_naming_them(server, fields, param):
    r = httpx.post(server.url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                   json={"model": "demo", "input": "hi", "max_output_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param.split("[")[0]), err
    assert "\n" not in err["message"]


def test_an_open_think_block_is_a_reasoning_item():
    """A template whose prompt opens <think> (as DeepSeek-R1's does): the demo model never closes it, so the whole
    answer is reasoning: one reasoning item (reasoning_text), no message, streamed and not, with the same text."""
    engine = pymoe.load(demo_model(), n_ctx=512)
    engine.use_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}<think>\n")
    with BackgroundServer(create_app(engine, kv="f32")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.responses.create(model="demo", input="import os", max_output_tokens=12, temperature=0)
        with client.responses.stream(model="demo", input="import os", max_output_tokens=12, temperature=0) as s:
            events = list(s)
    assert [o.type for o in r.output] == ["reasoning"] and r.output_text == "", r.output
    thought = r.output[0].content[0].text
    assert thought and "<think>" not in thought
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert [o.type for o in events[-1].response.output] == ["reasoning"]


def test_a_call_cut_by_max_output_tokens_stays_a_call(client):
    """A forced call cut short after its name (28 tokens of the demo's small vocabulary: 20 reach the arguments): a
    function_call item with the arguments written so far, status incomplete, and no message holding its text;
    streamed the same."""
    kw = dict(model="demo", input="weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=28,
              temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and [(o.type, o.status) for o in r.output] == [("function_call", "incomplete")]
    assert r.output[0].name == "get_weather" and '{"tool_call"' not in r.output[0].arguments
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert [(o.type, o.arguments) for o in events[-1].response.output] == [("function_call", r.output[0].arguments)]
