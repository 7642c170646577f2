"""litellm against a live `pymoe serve` (issue 18: "one litellm call"), as a user of litellm points it at an
OpenAI-compatible server: model "openai/<anything>", api_base, api_key.

litellm is one of the clients that sits between applications and servers; what it does with a server's answer (its
own response objects, its stream assembler, its tool-call translation) is code pymoe does not control, so these
tests check that pymoe's answers survive it: the greedy text equals pymoe's own engine, a stream reassembles to the
same text, and a forced tool call arrives as litellm's `tool_calls` with arguments that follow the tool's schema.
"""
from __future__ import annotations

import json
import os

import pytest

# litellm fetches a model price list from the network when imported unless told to use the copy it ships
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")  # in the test extra: CI's strict mode turns a skip here into a failure

from test_server import KEY, WEATHER, model_path, reference, server, tools_server  # noqa: E402,F401 (fixtures)


def complete(srv, **kw):
    return litellm.completion(model="openai/tiny", api_base=srv.url + "/v1", api_key=KEY, timeout=60,
                              num_retries=0, **kw)


def test_litellm_chat_text_and_stream_equal_the_engine(server, reference):
    """Greedy: litellm's message content is pymoe's own greedy continuation of the same rendered chat; the stream
    reassembles to that text, with usage."""
    messages = [{"role": "user", "content": "Hello there"}]
    want = "".join(reference.stream("Hello there", max_tokens=12, chat=True))
    r = complete(server, messages=messages, max_tokens=12, temperature=0)
    assert want and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(reference.encode_prompt("Hello there", chat=True))
    stream = complete(server, messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want


def test_litellm_forced_tool_call(tools_server):
    """A named tool_choice through litellm: one call of get_weather whose arguments parse and follow its schema."""
    r = complete(tools_server, messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=150, seed=1,
                 temperature=1)
    msg = r.choices[0]
    assert msg.finish_reason == "tool_calls" and len(msg.message.tool_calls) == 1
    call = msg.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city"} and isinstance(args["city"], str)
    assert len(args["city"]) <= 12
