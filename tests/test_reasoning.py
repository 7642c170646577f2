"""Reasoning split out of a chat answer (pymoe/serve/reasoning.py, `--reasoning-format`): a leading <think> block
(or one the prompt opened) becomes reasoning_content, streamed and whole alike; gpt-oss' analysis channel too.
The live tests force the model's text with a GBNF grammar, so the answer is known to the byte."""
import json

import httpx
import pytest

from pymoe.serve.reasoning import ThinkStream, opens_thinking, split
from pymoe.serve.tools import FORMATS

CASES = [  # (answer, prompt opened <think>, (reasoning, content)) worked out by hand
    ("<think>\nI think  \n</think>\n\nHello", False, ("I think", "Hello")),  # blanks around both dropped
    ("  <think>a</think>b<think>c</think>", False, ("a", "b<think>c</think>")),  # only a leading block
    ("Hello <think>x</think>", False, (None, "Hello <think>x</think>")),  # not leading: content, as llama.cpp
    ("plan</think> answer", True, ("plan", "answer")),  # the template opened it
    ("<thi", False, (None, "<thi")),  # a tag that never came
    ("<think>never closed  ", False, ("never closed", "")),  # unclosed: all reasoning
    ("<think></think>", False, (None, "")),
    ("no tags at all", False, (None, "no tags at all")),
]


@pytest.mark.parametrize("text, opened, want", CASES)
def test_split_and_its_stream_agree_in_pieces_of_any_size(text, opened, want):
    assert split(text, opened) == want
    for size in (1, 2, 3, 7):
        stream, reasoning, content = ThinkStream(opened), "", ""
        for i in range(0, len(text), size):
            r, c = stream.feed(text[i:i + size])
            reasoning, content = reasoning + r, content + c
        r, c = stream.close()
        assert ((reasoning + r) or None, content + c) == want, size


def test_opens_thinking():
    assert opens_thinking("<|im_start|>assistant\n<think>\n") and not opens_thinking("<think>\n\n</think>\n\n")


def test_harmony_analysis_channel_is_the_reasoning():
    text = ("<|channel|>analysis<|message|>think hard<|end|><|start|>assistant<|channel|>final<|message|>42")
    harmony = FORMATS["harmony"]
    assert harmony.reasoning(text) == "think hard" and harmony.parse(text)[0] == "42"
    assert harmony.reasoning("<|channel|>analysis<|message|>half<|e", final=False) == "half"  # <|end|> may follow


# --- live: the tiny model, its text forced by a grammar --------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tiny_model):
    import pymoe
    from pymoe.serve.app import BackgroundServer, create_app

    path = tiny_model("qwen3moe", "f32")
    plain = pymoe.load(path, n_ctx=256)
    opened = pymoe.load(path, n_ctx=256)
    opened.use_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}<think>\n")  # as DeepSeek-R1's does
    with BackgroundServer(create_app(plain, kv="f32")) as a, BackgroundServer(create_app(opened, kv="f32")) as b:
        yield a, b


def chat(url, grammar, **fields):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "grammar": grammar, **fields}
    if grammar is None:
        del body["grammar"]
    if not fields.get("stream"):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]
    reasoning, content = "", ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    return {"reasoning_content": reasoning or None, "content": content}


def test_a_think_block_becomes_reasoning_content(servers):
    url = servers[0].url
    grammar = 'root ::= "<think>" "Two steps." "</think>" "\\n\\nThe answer."'
    for stream in (False, True):
        msg = chat(url, grammar, stream=stream)
        assert (msg.get("reasoning_content"), msg["content"]) == ("Two steps.", "The answer."), stream
        kept = chat(url, grammar, stream=stream, reasoning_format="none")
        assert kept.get("reasoning_content") is None
        assert kept["content"] == "<think>Two steps.</think>\n\nThe answer.", stream
    plain = chat(url, 'root ::= "Just text."')
    assert plain["content"] == "Just text." and "reasoning_content" not in plain


def test_a_prompt_that_opens_thinking(servers):
    """The template ends in an open <think>: the random model's answer, which never closes it, is all reasoning
    (what reasoning_format none gives as content, its ends' blanks stripped), streamed and not. Under a grammar the
    answer is what the grammar makes it from its first token (a forced call, a format): no block is open then."""
    url = servers[1].url
    whole = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0,
        "reasoning_format": "none"}).json()["choices"][0]["message"]["content"]
    assert whole.strip() and "</think>" not in whole
    for stream in (False, True):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0, "stream": stream}
        if stream:
            msg = chat(url, None, **{k: v for k, v in body.items() if k != "messages"})
        else:
            msg = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert (msg.get("reasoning_content"), msg["content"]) == (whole.strip(), ""), stream
    forced = chat(url, 'root ::= "Planning." "</think>" "Done."')
    assert forced["content"] == "Planning.</think>Done." and "reasoning_content" not in forced


def test_a_bad_reasoning_format_is_a_400(servers):
    r = httpx.post(servers[0].url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "reasoning_format": "auto"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format"
