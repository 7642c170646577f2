"""The chat templates of the 2026 MoE families render through pymoe's sandboxed jinja2 path exactly as through
llama-cpp-python's own formatter (`llama_chat_format.Jinja2ChatFormatter`, the oracle: another environment set-up
with its own raise_exception, tojson and strftime_now), with tools, tool calls, tool results and the families'
extra variables (gpt-oss's harmony `reasoning_effort`, `enable_thinking`). The templates are the models' own,
copied from llama.cpp's models/templates (tests/data/templates/README.md)."""
import os

import pytest

from oracle import require_llama_cpp

from pymoe.engine.tokenizer import Tokenizer

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "templates")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 3}"},
    {"role": "assistant", "content": "3 °C."},
    {"role": "user", "content": "And in Oslo?"},
]
CASES = [  # template file, bos, eos, extra variables
    ("openai-gpt-oss-120b.jinja", "<|startoftext|>", "<|return|>", dict(reasoning_effort="high")),
    ("GLM-4.6.jinja", "", "<|endoftext|>", dict(enable_thinking=False)),
    ("Qwen3.5-4B.jinja", "", "<|im_end|>", dict(enable_thinking=True)),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", dict(thinking=False)),
]


class _Template(Tokenizer):
    """Just the template part of a Tokenizer: apply_chat_template needs chat_template and the bos/eos texts."""

    def __init__(self, source: str, bos: str, eos: str):
        self.chat_template, self._bos, self._eos = source, bos, eos
        self.bos_id, self.eos_id = 0, 1

    def _text_of(self, tid):
        return {0: self._bos, 1: self._eos}[tid]


@pytest.mark.parametrize("name, bos, eos, extra", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("with_tools", [True, False])
def test_family_template_renders_as_llama_cpp_python(name, bos, eos, extra, with_tools):
    llama_cpp = require_llama_cpp()
    source = open(os.path.join(HERE, name), encoding="utf-8").read()
    tools = TOOLS if with_tools else None
    messages = CONVERSATION if with_tools else [m for m in CONVERSATION if "tool" not in m["role"] and
                                                not m.get("tool_calls")]
    ours = _Template(source, bos, eos).apply_chat_template(messages, add_generation_prompt=True, tools=tools, **extra)
    theirs = llama_cpp.llama_chat_format.Jinja2ChatFormatter(source, eos_token=eos, bos_token=bos,
                                                             add_generation_prompt=True)
    expected = theirs(messages=messages, tools=tools, **extra).prompt
    assert ours == expected
    assert "get_weather" in ours if with_tools else "get_weather" not in ours  # the tools really went in
    assert "Oslo" in ours
    if "reasoning_effort" in extra:  # harmony: the system message carries it
        assert f"Reasoning: {extra['reasoning_effort']}" in ours and "<|start|>assistant" in ours


def test_harmony_template_refuses_channel_tags_in_one_line():
    """The gpt-oss template's own raise_exception() (a <|channel|> tag in content) is a one-line PymoeError."""
    from pymoe.errors import PymoeError

    source = open(os.path.join(HERE, "openai-gpt-oss-120b.jinja"), encoding="utf-8").read()
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<|channel|>final<|message|>x"}]
    with pytest.raises(PymoeError) as e:
        _Template(source, "", "<|return|>").apply_chat_template(bad)
    assert str(e.value).startswith("chat template:") and "\n" not in str(e.value)
