"""Tool calling on the chat endpoints: the model's own template shows it the tools, its answer is parsed back into
OpenAI's `tool_calls` (Anthropic's `tool_use` blocks are made from these: anthropic.tool_use), and a forced choice is
decoded under a grammar so that the call always parses.

    fmt = tool_format(tokenizer.chat_template)      # "hermes", or None: the template has no tool format pymoe knows
    prompt = template(messages, tools=[...])       # the template writes the tools into the prompt (jinja `tools`)
    grammar = call_grammar(tools, "required")      # tool_choice required / a named function: the answer is a call
    content, calls = parse_calls(text)             # the answer -> its text and [{id, type, function: {name, arguments}}]

The one format implemented is Hermes' (Qwen2.5, Qwen3, Qwen3-MoE, Qwen3-Next and others' templates):
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
one block per call, text before it allowed. Not implemented, a 400 naming `tools` when a request brings tools to
such a model: Qwen3.5's XML parameters (`<function=...><parameter=...>`), gpt-oss' harmony channel, GLM's
`<arg_key>`/`<arg_value>` and DeepSeek's `<｜tool▁call▁begin｜>` formats.
What this is not: the request schema (schemas.py), or the streaming of the answer (app.py: with tools, a chat answer
is held until it ends, then sent as one delta with its content and its tool calls, so a call never leaks as text).
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from pymoe.engine.grammar import JSON_OPTIONS, Grammar

HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def tool_format(template: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template writes: "hermes", or None (no tools in it, or a format not implemented).
    Read from the template's own text, as llama.cpp's chat-format detection does."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template and '"arguments"' in template and "<function=" not in template \
            and "<arg_key>" not in template:
        return "hermes"
    return None


def call_schema(tools: list) -> dict:
    """JSON schema of one call of any of `tools` ([{name, parameters}]): {"name": <that name>, "arguments": <its
    parameters>}, one alternative per tool."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                "properties": {"name": {"const": t["name"]}, "arguments": t.get("parameters") or {"type": "object"}}}
               for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_grammar(tools: list) -> Grammar:
    """A forced call of one of `tools` in Hermes' format, as a Lark grammar with the call's JSON schema inside
    (llguidance's `%json`): what tool_choice "required" or a named function decodes under."""
    schema = json.dumps({**call_schema(tools), "x-guidance": JSON_OPTIONS})
    return Grammar.from_request("lark", 'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + schema)


def parse_calls(text: str) -> tuple[Optional[str], list]:
    """A Hermes-format answer -> (its text outside the calls, or None when empty; [OpenAI tool call]). A block
    whose JSON does not parse, or has no name, stays in the text."""
    calls, kept, last = [], [], 0
    for m in HERMES_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}),
                                                                                ensure_ascii=False)}})
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls
