"""The tool-call formats of serve/tools.py against an oracle that is not the parser: the models' own chat templates.

For each of the five vendored templates (tests/data/templates: Qwen3 = hermes, Qwen3.5 = qwen-xml, GLM-4.6 = glm,
DeepSeek-V3.1, gpt-oss = harmony), pymoe's template engine renders an assistant turn that carries two tool calls
(string, number, boolean, array and object arguments); the text the template wrote for that turn (the conversation
rendered with the turn, less the conversation rendered up to the generation prompt) is what the model would have
generated, and the parser must recover exactly those calls. The format's forced-call grammar must accept the
template's own single-call text, and text a tiny random model generates under it must parse; streaming the same
text piece by piece must give the same content and calls as reading it whole. Then the server: a forced call
streamed with the official `openai` client assembles to the non-streamed call, a plain answer's content streams
before the end, and Anthropic's stream gives tool_use blocks (Qwen3.5's XML format, on the tiny model).
"""
import json
import os

import pytest

import pymoe
from pymoe.engine.chat_template import render
from pymoe.engine.grammar import Grammar
from pymoe.serve import tools

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "templates")
TEMPLATES = {  # format: (template file, bos, eos, extra variables)
    "hermes": ("Qwen-Qwen3-0.6B.jinja", "", "<|im_end|>", dict(enable_thinking=False)),
    "qwen-xml": ("Qwen3.5-4B.jinja", "", "<|im_end|>", dict(enable_thinking=False)),
    "glm": ("GLM-4.6.jinja", "", "<|endoftext|>", dict(enable_thinking=False)),
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1.jinja", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                      dict(thinking=False)),
    "harmony": ("openai-gpt-oss-120b.jinja", "<|startoftext|>", "<|return|>", dict(reasoning_effort="low")),
}
TURN_END = {"hermes": "<|im_end|>\n", "qwen-xml": "<|im_end|>\n", "glm": "", "deepseek-v3.1": "<｜end▁of▁sentence｜>",
            "harmony": "<|call|>"}  # what the template writes after a turn: the model's end-of-generation token
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 0, "maximum": 14},
                                     "metric": {"type": "boolean"}},
    "required": ["city", "days"], "additionalProperties": False}}
PLOT = {"name": "plot", "description": "A chart.", "parameters": {
    "type": "object", "properties": {"title": {"type": "string"}, "points": {"type": "array"},
                                     "style": {"type": "object"}},
    "required": ["title", "points", "style"]}}
SPECS = [WEATHER, PLOT]
CALLS = [("get_weather", {"city": "Zürich", "days": 3, "metric": True}),
         ("plot", {"title": "a <b> & \"c\"\nline two", "points": [1, 2.5, -3], "style": {"color": "red", "w": 2}})]


def source(fmt):
    return open(os.path.join(HERE, TEMPLATES[fmt][0]), encoding="utf-8").read()


def rendered(fmt, messages, generation_prompt):
    name, bos, eos, extra = TEMPLATES[fmt]
    tools_ = [{"type": "function", "function": s} for s in SPECS]
    return render(source(fmt), dict(messages=messages, tools=tools_, add_generation_prompt=generation_prompt,
                                    bos_token=bos, eos_token=eos, **extra))


def assistant_turn(fmt, content, calls):
    """The text the template writes for an assistant turn with `calls` (arguments as objects, as transformers
    passes them), cut at the model's end-of-generation token. gpt-oss's template writes one call per message, so
    there each call is a message of its own (after the first, the `<|start|>assistant` it begins with stays in)."""
    user = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"}]
    tc = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
          for i, (n, a) in enumerate(calls)]
    turns = [{"role": "assistant", "content": content, "tool_calls": tc}] if fmt != "harmony" else \
        [{"role": "assistant", "content": content if i == 0 else "", "tool_calls": [c]} for i, c in enumerate(tc)]
    head, full = rendered(fmt, user, True), rendered(fmt, user + turns, False)
    assert full.startswith(head), (head, full)
    text = full[len(head):]
    assert text.endswith(TURN_END[fmt]), text
    return text[:len(text) - len(TURN_END[fmt])] if TURN_END[fmt] else text


def recovered(calls):
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_format_is_detected_from_the_template(fmt):
    assert tools.tool_format(source(fmt)) == fmt
    assert tools.tool_format(None) is None and tools.tool_format("{{ messages }}") is None


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_parser_recovers_the_calls_the_template_wrote(fmt):
    """The oracle: the template's own rendering of two calls parses back to those calls, with and without text
    before them (gpt-oss: text before a call is an analysis message, not content)."""
    for content in ("", "Let me look that up."):
        text = assistant_turn(fmt, content, CALLS)
        got_content, calls = tools.parse_calls(text, fmt, SPECS)
        assert recovered(calls) == CALLS, text
        assert got_content == (content or None if fmt != "harmony" else None), text
        # streamed in pieces of 3 characters: the same content and calls, and each call out before the end
        stream, sent, streamed = tools.CallStream(fmt, SPECS), "", []
        for i in range(0, len(text), 3):
            piece, new = stream.feed(text[i:i + 3])
            sent, streamed = sent + piece, streamed + new
        piece, last = stream.close()
        assert sent + piece == (got_content or "") and recovered(streamed + last) == CALLS
        if fmt != "harmony":  # harmony's last call ends with the generation (its <|call|> is the EOG token)
            assert len(last) == 0, text
    plain = "No tools needed: 21 C and sunny."
    assert tools.parse_calls(plain, fmt, SPECS) == (plain, [])


@pytest.mark.parametrize("fmt", [f for f in TEMPLATES if tools.FORMATS[f].head is not None])
def test_live_stream_sends_each_call_as_it_is_written(fmt):
    """CallStream(live=True), the formats whose arguments are JSON: the template's own two calls, fed in pieces of 3
    characters, are announced (number, id, name) before their arguments are complete, their arguments go out in
    several pieces, and the pieces with a complete call's rest assemble to its arguments (the same id): the calls
    the parser reads from the whole text."""
    text = assistant_turn(fmt, "", CALLS)
    stream, args, ids, names, complete = tools.CallStream(fmt, SPECS, live=True), {}, {}, {}, []
    for i in range(0, len(text) + 3, 3):
        _, calls = stream.feed(text[i:i + 3]) if i < len(text) else stream.close()
        for k, cid, name, piece in stream.progress:
            if name is not None:
                assert k not in ids and len(complete) == k  # announced before its own end
                ids[k], names[k], args[k] = cid, name, []
            else:
                args[k].append(piece)
        for c in calls:
            k = len(complete)
            assert c["id"] == ids[k] and len(args[k]) > 1 and c["streamed"] == "".join(args[k])
            args[k].append(c["function"]["arguments"][len(c["streamed"]):])
            complete.append(c)
    assert [(names[k], json.loads("".join(args[k]))) for k in sorted(args)] == CALLS == recovered(complete)


def test_parser_edge_cases():
    """Blocks that do not parse stay text; bare-text values follow their parameter's type; the first call only."""
    assert tools.parse_calls("<tool_call>\n{not json}\n</tool_call>") == ("<tool_call>\n{not json}\n</tool_call>", [])
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\nsoon\n" \
           "</parameter>\n<parameter=metric>\nfalse\n</parameter>\n</function>\n</tool_call>"
    _, calls = tools.parse_calls(text, "qwen-xml", SPECS)
    assert recovered(calls) == [("get_weather", {"city": "42", "days": "soon", "metric": False})]
    _, calls = tools.parse_calls(text, "qwen-xml")  # no schemas: every value stays a string
    assert recovered(calls) == [("get_weather", {"city": "42", "days": "soon", "metric": "false"})]
    harmony = "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    assert tools.parse_calls(harmony, "harmony") == ("Hi!", [])
    stream = tools.CallStream("harmony")
    assert stream.feed(harmony[:-1]) == ("Hi", []) and stream.feed("!") == ("!", []) and stream.close() == ("", [])
    stream = tools.CallStream("hermes", keep="first")
    two = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}' \
          '\n</tool_call>'
    assert [c["function"]["name"] for c in stream.feed(two)[1] + stream.close()[1]] == ["a"]
    stream = tools.CallStream("hermes")
    assert stream.feed("Hello <tool") == ("Hello", [])  # a possible opener (and the blank before it) held back
    assert stream.feed("box> there") == (" <toolbox> there", [])


def accepts(grammar: Grammar, tokenizer, text: str) -> bool:
    """The grammar takes `text` (as the tokenizer splits it) to completion."""
    c = grammar.constraint(tokenizer)
    for t in tokenizer.encode(text, add_bos=False, special=False):
        if not c.allowed()[t]:
            return False
        c.accept(t)
    return bool(c.allowed()[sorted(tokenizer.eog_ids)].any())


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return pymoe.load(tiny_model("qwen3moe", "f32"), n_ctx=512)


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_forced_grammar_accepts_the_template_text_and_generates_calls(fmt, tiny):
    """The grammar of one forced call takes the template's own single-call text (hermes' JSON written compactly,
    as the grammar writes JSON; qwen-xml/glm: a string value without `<`), and the tiny random model's text under
    it parses to a call of that tool whose arguments follow the schema."""
    call = ("get_weather", {"city": "Zürich", "days": 3, "metric": True})
    text = assistant_turn(fmt, "", [call])
    if fmt == "hermes":
        text = text.replace(json.dumps({"name": call[0], "arguments": call[1]}, ensure_ascii=False),
                            json.dumps({"name": call[0], "arguments": call[1]}, ensure_ascii=False,
                                       separators=(",", ":")))
    elif fmt in ("deepseek-v3.1", "harmony"):
        text = text.replace(json.dumps(call[1], ensure_ascii=False), json.dumps(call[1], ensure_ascii=False,
                                                                                separators=(",", ":")))
    if fmt == "harmony":  # the template writes history as ` to=functions.X<|channel|>commentary json`; a model
        text = "<|channel|>commentary to=functions.get_weather <|constrain|>json" + text[text.index("<|message|>"):]
    grammar = tools.call_grammar(SPECS, fmt, tiny.tokenizer)
    assert accepts(grammar, tiny.tokenizer, text), text
    assert not accepts(grammar, tiny.tokenizer, text.replace("get_weather", "get_whether"))
    for seed in (1,):
        out = "".join(tiny.stream("weather?", max_tokens=150, chat=True, temperature=1.0, seed=seed,
                                  grammar=tools.call_grammar([WEATHER], fmt, tiny.tokenizer)))
        content, calls = tools.parse_calls(out, fmt, SPECS)
        assert len(calls) == 1 and content is None, out
        name, args = recovered(calls)[0]
        assert name == "get_weather" and {"city", "days"} <= set(args) <= {"city", "days", "metric"}, out
        assert isinstance(args["city"], str) and len(args["city"]) <= 12 and isinstance(args["days"], int), out


# --- the server: streaming -------------------------------------------------------------------------------------------

KEY = "test-key"
OPENAI_TOOLS = [{"type": "function", "function": s} for s in SPECS]


@pytest.fixture(scope="module")
def xml_server(tiny_model):
    """The tiny model with Qwen3.5's chat template (the qwen-xml format)."""
    from pymoe.serve.app import BackgroundServer, create_app

    engine = pymoe.load(tiny_model("qwen3moe", "f32"), n_ctx=2048)  # the tools' text is ~1,000 tiny-vocab tokens
    engine.use_chat_template(os.path.join(HERE, TEMPLATES["qwen-xml"][0]))
    with BackgroundServer(create_app(engine, kv="f32", api_key=KEY, sampling_defaults={"seed": 1})) as srv:
        yield srv


def test_streamed_forced_call_assembles_to_the_non_streamed_one(xml_server):
    """tool_choice names a function: the same seeded call, streamed (an id, type and name first, then the
    arguments, under one index; finish_reason tool_calls) and not, with the official openai client."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=xml_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "weather in Paris?"}], tools=OPENAI_TOOLS,
               tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=150,
               temperature=1, seed=3)
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1, whole
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert {d.index for d in deltas} == {0} and deltas[0].function.name == "get_weather" and deltas[0].id
    assert deltas[0].function.arguments == "" and deltas[0].type == "function"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == \
        json.loads(whole.message.tool_calls[0].function.arguments)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert reasons == ["tool_calls"]


def test_plain_answer_streams_live_with_tools_in_play(xml_server):
    """tool_choice auto and an answer with no call: its content comes in many chunks as it is generated (only a
    possible `<tool_call>` opener is held back), and assembles to the non-streamed content. (Qwen3.5's prompt opens
    a <think> block, which the random model never closes: reasoning_format none keeps its answer in the content.)"""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=xml_server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], tools=OPENAI_TOOLS, max_tokens=24,
               temperature=0, extra_body={"reasoning_format": "none"})
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.message.tool_calls is None and whole.message.content, whole
    chunks = list(client.chat.completions.create(**ask, stream=True))
    texts = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(texts) > 3 and "".join(texts) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason and not chunks[-1].choices[0].delta.content


def test_anthropic_stream_gives_tool_use_blocks(xml_server):
    """Anthropic's stream with tool_choice any: a tool_use block (content_block_start, input_json_delta, stop) that
    the official client assembles into the input the non-streamed message has."""
    anthropic = pytest.importorskip("anthropic", reason="anthropic is in the test extra")
    claude = anthropic.Anthropic(base_url=xml_server.url, api_key=KEY, max_retries=0, timeout=60)
    ask = dict(model="tiny", max_tokens=150, messages=[{"role": "user", "content": "weather in Paris?"}],
               tools=[{"name": s["name"], "description": s["description"], "input_schema": s["parameters"]}
                      for s in SPECS], tool_choice={"type": "tool", "name": "get_weather"},
               extra_body={"temperature": 1})
    whole = claude.messages.create(**ask)
    with claude.messages.stream(**ask) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in whole.content]
    assert "content_block_start" in kinds and "input_json" in kinds and kinds[-1] == "message_stop", kinds


def test_harmony_vocabulary_is_patched_as_llama_cpp_does():
    """gpt-oss: the message markers are always in the decoded text (so the channels can be read back), and <|end|>,
    which closes an analysis message in the middle of an answer, does not end the generation (llama.cpp's
    llama_vocab::impl::load does the same)."""
    from types import SimpleNamespace

    from pymoe.engine.tokenizer import TokenType, Tokenizer

    tok = SimpleNamespace(tokens=["<|start|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>", "a"],
                          types=[TokenType.CONTROL] * 5 + [TokenType.NORMAL], eog_ids=frozenset({2, 3, 4}))
    Tokenizer._harmony_tokens(tok)
    assert tok.eog_ids == {3, 4} and tok.types[:3] == [TokenType.USER_DEFINED] * 3
    assert tok.types[3:] == [TokenType.CONTROL, TokenType.CONTROL, TokenType.NORMAL]


def test_markers_that_are_control_tokens_are_shown_so_the_call_is_read(tiny_model, monkeypatch):
    """A converter may type a format's markers as control tokens (DeepSeek's and GLM's can be), and a control token's
    text is left out of a generated answer, so the call could not be read back. As llama.cpp's server keeps a chat
    format's preserved_tokens, the scheduler shows them (tools.preserved_tokens -> TextStream). The tiny vocabulary
    has no such tokens, so two of its merge tokens are made `<tool_call>` and `</tool_call>`, CONTROL, in memory:
    a forced call, whose grammar writes those markers as the special tokens, then parses; with nothing preserved
    (the step this test is about, removed) it comes back as text with no call."""
    openai = pytest.importorskip("openai")
    from pymoe.engine.tokenizer import TokenType
    from pymoe.serve.app import BackgroundServer, create_app

    engine = pymoe.load(tiny_model("qwen3moe", "f32"), n_ctx=1024)
    engine.use_chat_template(os.path.join(HERE, TEMPLATES["hermes"][0]))
    tok = engine.tokenizer
    ids = [tok.n_vocab - 1, tok.n_vocab - 2]  # the last merges of the tiny BPE: rare pieces
    for i, text in zip(ids, ("<tool_call>", "</tool_call>")):
        tok.tokens[i], tok.types[i] = text, TokenType.CONTROL
    tok._specials = sorted(tok._specials + ids, key=lambda i: (-len(tok.tokens[i].encode()), i))
    assert tools.preserved_tokens("hermes", tok) == frozenset(ids)
    assert tools.lark_text("<tool_call>", tok) == f"<[{ids[0]}]>"  # the grammar writes the control token

    def forced_call():
        with BackgroundServer(create_app(engine, kv="f32", api_key=KEY)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
            return client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[OPENAI_TOOLS[0]],
                tool_choice="required", max_tokens=150, temperature=1, seed=1).choices[0]

    got = forced_call()
    assert got.finish_reason == "tool_calls" and got.message.tool_calls[0].function.name == "get_weather", got
    monkeypatch.setattr(tools, "preserved_tokens", lambda fmt, tokenizer: frozenset())
    lost = forced_call()
    assert lost.finish_reason != "tool_calls" and not lost.message.tool_calls and "<tool_call>" not in \
        (lost.message.content or "")


def test_a_forced_call_closes_when_the_schema_leaves_other_keys_open(tiny):
    """A tool whose parameters do not say additionalProperties: JSON Schema lets the object take more keys, and a
    weak model (the demo, greedy, in bench/api_side_by_side.py) added keys until max_tokens: no call. The forced
    grammar closes such objects, as llama.cpp's converter reads the absent key; nested objects too, and a property
    named like a keyword is not taken for a schema."""
    open_schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "where": {"type": "object", "properties": {"north": {"type": "boolean"}}},
                                                    "properties": {"type": "string", "maxLength": 8}},
                   "required": ["city"]}
    got = tools.closed(open_schema)
    assert got["additionalProperties"] is False and got["properties"]["where"]["additionalProperties"] is False
    assert "additionalProperties" not in got["properties"] and got["properties"]["properties"] == {"type": "string", "maxLength": 8}
    assert tools.closed({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"]
    spec = {"name": "get_weather", "parameters": open_schema}
    for fmt in ("hermes", "deepseek-v3.1", "harmony"):  # the formats whose arguments are one JSON object
        out = "".join(tiny.stream("weather?", max_tokens=300, chat=True, temperature=0,
                                  grammar=tools.call_grammar([spec], fmt, tiny.tokenizer)))
        content, calls = tools.parse_calls(out, fmt, [spec])
        assert len(calls) == 1 and set(json.loads(calls[0]["function"]["arguments"])) <= {"city", "where",
                                                                                           "properties"}, out
