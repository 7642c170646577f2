"""Tool calling on the chat endpoints: the model's own template shows it the tools, its answer is parsed back into
OpenAI's `tool_calls` (Anthropic's `tool_use` blocks are made from these: anthropic.tool_use), and a forced choice is
decoded under a grammar so that the call always parses.

    name = call_format(tokenizer.chat_template)   # "hermes", "qwen-xml", "glm", "deepseek-v3.1", "harmony", "generic"
    fmt = FORMATS[name]
    prompt = template(messages, tools=[...])       # the template writes the tools into the prompt (jinja `tools`)
    grammar = fmt.grammar(specs, tokenizer)        # tool_choice required / a named function: the answer is a call
    content, calls = fmt.parse(text, specs)        # the answer -> its text, [{id, type, function: {name, arguments}}]
    stream = CallStream(fmt, specs)                # the same, piece by piece: stream.feed(piece) -> (text, new calls)

`specs` are the tools in play as [{name, parameters}] (parameters: the JSON schema). One class per format; each knows
how to find itself in a template's text (as llama.cpp's chat-format detection reads the template), how to read an
answer, and how to write the grammar of one call:

  hermes         Qwen2.5, Qwen3, Qwen3-MoE, Qwen3-Next. Detected: `<tool_call>` and `"arguments"` in the template.
                     <tool_call>
                     {"name": "get_weather", "arguments": {"city": "Paris"}}
                     </tool_call>
  qwen-xml       Qwen3.5, Qwen3-Coder. Detected: `<function=` and `<parameter=`.
                     <tool_call>
                     <function=get_weather>
                     <parameter=city>
                     Paris
                     </parameter>
                     </function>
                     </tool_call>
  glm            GLM-4.5, GLM-4.6. Detected: `<arg_key>`.
                     <tool_call>get_weather
                     <arg_key>city</arg_key>
                     <arg_value>Paris</arg_value>
                     </tool_call>
  deepseek-v3.1  DeepSeek-V3.1. Detected: `<｜tool▁calls▁begin｜>` without V3/R1's ```json fences.
                     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
                     <｜tool▁calls▁end｜>                                   (one line; the end of the turn follows)
  harmony        gpt-oss. Detected: `<|channel|>` and `to=`. An answer is a run of messages, each with a channel:
                     <|channel|>analysis<|message|>thinking...<|end|>
                     <|start|>assistant<|channel|>final<|message|>the answer   (content: the final channel's text)
                     <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}
                 (a call; the template writes history as `<|start|>assistant to=functions.NAME<|channel|>commentary
                 json<|message|>{...}<|call|>`: both orders are read). The analysis channel (reasoning) is dropped.
  generic        Any other template (ChatML, the demo model's), as llama.cpp's generic format: the tools are listed in a
                 system-prompt section, history is rewritten as JSON turns, and every answer is one JSON object
                 that the grammar forces (tool_choice auto included):
                     {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                     {"response": "It is sunny."}

Argument values in qwen-xml and glm are bare text. As llama.cpp does, a parameter whose schema type is number,
integer, boolean, null, object or array is read as JSON when it parses (Qwen3.5's template writes Python's
`True`/`False` for booleans: read too), and kept as a string otherwise; a string parameter, or one not declared,
stays a string. A block that does not parse (bad JSON, no name) stays in the text.

Forced calls: each format writes the grammar of exactly one call of one of the tools (llguidance Lark). JSON parts
(hermes' whole object, deepseek's and harmony's arguments, a non-string qwen-xml/glm value) are the schema's own
`%json`; a string value of qwen-xml/glm is text without `<` (its enum or maxLength kept). The format's marker
strings are written as the vocabulary's own special tokens where it has them (`<[id]>`: a real gpt-oss model's
`<|channel|>` is one token, as it was trained), as text otherwise (the tiny test models). Where a format's marker is
a control token (a converter may type DeepSeek's or GLM's markers so), its text would be left out of the answer, as
every control token's is; `preserved_tokens` lists those ids and the scheduler shows them (llama.cpp's server keeps a
chat format's `preserved_tokens` the same way).

Streaming (CallStream): the answer is re-read as it grows with `final=False`: text that is certainly content (not
a suffix that could still become a call's opening marker) goes out at once, each call as soon as its closing marker
is in; what is left is read whole at the end. Re-reading the whole answer per piece is quadratic, but answers are
short and a regex pass over a few kB is microseconds.
What this is not: the request schema (schemas.py), or the SSE and JSON shapes (app.py, anthropic.py).
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from gguf import TokenType

from pymoe.engine.grammar import JSON_OPTIONS, Grammar, admits_a_value
from pymoe.errors import PymoeError

JSON_TYPES = {"number", "integer", "boolean", "null", "object", "array"}  # bare-text values read as JSON


# --- shared pieces -------------------------------------------------------------------------------------------------

def new_call(name: str, arguments) -> dict:
    """One call in OpenAI's shape; arguments (an object) as JSON text."""
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def held_prefix(text: str, markers: tuple) -> int:
    """Where the longest suffix of `text` that is a proper prefix of one of `markers` starts (len(text): none).
    That suffix is held back while streaming: the next piece may complete the marker."""
    for start in range(max(0, len(text) - max(len(m) for m in markers) + 1), len(text)):
        if any(m.startswith(text[start:]) for m in markers):
            return start
    return len(text)


def finish(kept: list, calls: list, final: bool) -> tuple:
    """The content pieces -> (content, calls); content stripped as a whole answer's is (None when empty), or
    while streaming only left-stripped with its trailing blanks held (they may turn out to end the content)."""
    content = "".join(kept).lstrip()
    content = content.strip() if final else content.rstrip()
    return (content or None) if final else content, calls


def schema_types(schema) -> set:
    """The JSON types a parameter's schema allows: `type` (a name or a list), or its anyOf/oneOf members'."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = set(t) if isinstance(t, list) else {t} if isinstance(t, str) else set()
    for sub in schema.get("anyOf", []) + schema.get("oneOf", []):
        types |= schema_types(sub)
    return types


def typed_value(text: str, schema) -> object:
    """A bare-text argument -> its value by the parameter's schema (see the module docstring)."""
    types = schema_types(schema)
    if "string" in types or not types & JSON_TYPES:
        return text
    if "boolean" in types and text.strip() in ("True", "False"):  # jinja's `| string` of a Python bool
        return text.strip() == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text


def parameters_of(specs: Optional[list], name: str) -> dict:
    """The `properties` of the tool called `name` ({} when unknown)."""
    for s in specs or []:
        if s["name"] == name:
            return (s.get("parameters") or {}).get("properties") or {}
    return {}


def bare_arguments(pairs: list, properties: dict) -> dict:
    """qwen-xml / glm: [(key, bare text)] -> the arguments, each value by its parameter's schema."""
    return {k.strip(): typed_value(v, properties.get(k.strip())) for k, v in pairs}


def lark_text(text: str, tokenizer=None) -> str:
    """A literal of a grammar: its special tokens (when the vocabulary has them) as `<[id]>`, the rest as strings."""
    pieces = tokenizer.split_special(text) if tokenizer is not None else [text]
    return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p, ensure_ascii=False) for p in pieces)


def lark_json(schema: dict) -> str:
    return "%json " + json.dumps({**(schema or {"type": "object"}), "x-guidance": JSON_OPTIONS})


def lark_bare_value(schema: dict, close: str, tokenizer=None) -> str:
    """A qwen-xml / glm argument value and the text that closes it: a boolean as JSON's or Python's word, a
    non-string type as its schema's JSON, a string as text without `<` (its enum or maxLength kept). Free text and
    its closing marker are one regex: llguidance's lexer is greedy, so `[^<]*` on its own would swallow the `\n`
    that begins qwen-xml's `\n</parameter>`."""
    types = schema_types(schema)
    if types == {"boolean"}:  # JSON's or Python's spelling (Qwen3.5's template writes `True`)
        value = '("true" | "false" | "True" | "False")'
    elif "string" not in types and types:
        value = lark_json(schema)
    elif isinstance(schema.get("enum"), list) and all(isinstance(v, str) and "<" not in v for v in schema["enum"]):
        value = "(" + " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"]) + ")"
    else:
        n = schema.get("maxLength")
        literal = "".join("\\n" if c == "\n" else re.escape(c).replace("/", "\\/") for c in close)
        return "/[^<]" + (f"{{0,{int(n)}}}" if isinstance(n, int) else "*") + literal + "/"
    return f"{value} {lark_text(close, tokenizer)}"


def one_of(rules: list) -> str:
    """`start` as one of the calls' rules (one rule per tool)."""
    body = "\n".join(f"call_{i}: {r}" for i, r in enumerate(rules))
    return "start: " + " | ".join(f"call_{i}" for i in range(len(rules))) + "\n" + body


class Format:
    """One tool-call format. Subclasses set `name` and `opener`, and write `detect`, `read_block` (or `parse`) and
    `call_rule`."""
    head: Optional[re.Pattern] = None  # a call's text up to its JSON arguments (group 1: the name), where the
    #                                    format writes them as JSON: they can be streamed as they are written
    name = ""
    opener = ""  # the text that starts a call: what a stream holds back a prefix of
    markers: tuple = ()  # the marker strings of a call: where the vocabulary has them as control tokens, they are
    #                      shown in the answer's text all the same (preserved_tokens), or no call could be read back
    block = re.compile("")  # one complete call, matched at an opener

    @staticmethod
    def detect(template: str) -> bool:
        raise NotImplementedError

    def read_block(self, m: re.Match, specs: Optional[list]) -> Optional[dict]:
        """A matched block -> its call, or None (it does not parse: it stays text)."""
        raise NotImplementedError

    def parse(self, text: str, specs: Optional[list] = None, final: bool = True) -> tuple:
        """An answer -> (content, [OpenAI call]). final=False (streaming): only the content certainly outside a
        call (a block still open and a possible opener at the end are held back) and the calls complete so far."""
        kept, calls, pos = [], [], 0
        while (i := text.find(self.opener, pos)) >= 0:
            m = self.block.match(text, i)
            if m is None:  # no closing marker yet: the rest is a call in progress, or (at the end) plain text
                if final:
                    break
                kept.append(text[pos:i])
                return finish(kept, calls, final)
            call = self.read_block(m, specs)
            kept.append(text[pos:i] if call else text[pos:m.end()])
            calls += [call] if call else []
            pos = m.end()
        tail = text[pos:]
        kept.append(tail if final else tail[:held_prefix(tail, (self.opener,))])
        return finish(kept, calls, final)

    def call_rule(self, spec: dict, tokenizer) -> str:
        """The Lark rule body of one call of `spec` ({name, parameters})."""
        raise NotImplementedError

    def grammar(self, specs: list, tokenizer=None) -> Grammar:
        """The grammar of one call of one of `specs`: what tool_choice required / a named function decodes under."""
        specs = [{**s, "parameters": closed(s.get("parameters"))} for s in specs]
        return Grammar.from_request("lark", one_of([self.call_rule(s, tokenizer) for s in specs]))


def closed(schema):
    """A tool's parameter schema with each object that lists its properties closed to other keys where it does not
    say otherwise, as llama.cpp's schema-to-grammar converter reads an absent additionalProperties. JSON Schema's
    own default lets the object go on: a weak model can add keys until max_tokens, and a call that never closes is
    no call (found by bench/api_side_by_side.py)."""
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({name: closed(sub) for name, sub in v.items()} if k in ("properties", "$defs", "definitions") and
               isinstance(v, dict) else closed(v)) for k, v in schema.items()}  # a property's name is no schema
    if "properties" in out and out.get("type", "object") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def bare_params_rule(spec: dict, tokenizer, before: str, between: str, after: str) -> str:
    """qwen-xml / glm: each parameter as `before` KEY `between` VALUE `after`, in the schema's order, the ones not
    required optional."""
    params = spec.get("parameters") or {}
    required = set(params.get("required") or [])
    out = []
    for key, schema in (params.get("properties") or {}).items():
        item = f"{lark_text(before + key + between, tokenizer)} {lark_bare_value(schema or {}, after, tokenizer)}"
        out.append(f"({item})" + ("" if key in required else "?"))
    return " ".join(out)


# --- the formats ---------------------------------------------------------------------------------------------------

class Hermes(Format):
    name, opener = "hermes", "<tool_call>"
    head = re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*')
    markers = ("<tool_call>", "</tool_call>")
    block = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

    @staticmethod
    def detect(template):
        return "<tool_call>" in template and '"arguments"' in template

    def read_block(self, m, specs):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return new_call(obj["name"], obj.get("arguments", {}))

    def call_rule(self, spec, tokenizer):
        schema = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": spec["name"]},
                                 "arguments": spec.get("parameters") or {"type": "object"}}}
        return f"{lark_text('<tool_call>', tokenizer)} \"\\n\" {lark_json(schema)} \"\\n\" " \
               f"{lark_text('</tool_call>', tokenizer)}"


class QwenXml(Format):
    name, opener = "qwen-xml", "<tool_call>"
    markers = ("<tool_call>", "</tool_call>")
    block = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
    param = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    @staticmethod
    def detect(template):
        return "<function=" in template and "<parameter=" in template

    def read_block(self, m, specs):
        name = m.group(1).strip()
        return new_call(name, bare_arguments(self.param.findall(m.group(2)), parameters_of(specs, name)))

    def call_rule(self, spec, tokenizer):
        return " ".join([lark_text(f"<tool_call>\n<function={spec['name']}>\n", tokenizer),
                         bare_params_rule(spec, tokenizer, "<parameter=", ">\n", "\n</parameter>\n"),
                         lark_text("</function>\n</tool_call>", tokenizer)])


class Glm(Format):
    name, opener = "glm", "<tool_call>"
    markers = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    block = re.compile(r"<tool_call>([^<\n]*)(.*?)</tool_call>", re.DOTALL)
    arg = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    @staticmethod
    def detect(template):
        return "<arg_key>" in template

    def read_block(self, m, specs):
        name = m.group(1).strip()
        if not name:
            return None
        return new_call(name, bare_arguments(self.arg.findall(m.group(2)), parameters_of(specs, name)))

    def call_rule(self, spec, tokenizer):
        return " ".join(['"\\n"?', lark_text(f"<tool_call>{spec['name']}\n", tokenizer),  # the template's \n
                         bare_params_rule(spec, tokenizer, "<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n"),
                         lark_text("</tool_call>", tokenizer)])


class DeepSeekV31(Format):
    name, opener = "deepseek-v3.1", "<｜tool▁calls▁begin｜>"
    head = re.compile(r"<｜tool▁call▁begin｜>\s*([^<]+?)\s*<｜tool▁sep｜>\s*")
    calls_end = "<｜tool▁calls▁end｜>"
    markers = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁calls▁end｜>")
    block = re.compile(r"(?!)")  # never: parse() reads the calls itself
    one = re.compile(r"<｜tool▁call▁begin｜>\s*([^<]+?)\s*<｜tool▁sep｜>\s*(.*?)\s*<｜tool▁call▁end｜>", re.DOTALL)

    @staticmethod
    def detect(template):
        return "<｜tool▁calls▁begin｜>" in template and "```json" not in template

    def parse(self, text, specs=None, final=True):
        """The calls sit in one <｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜> section, each complete at its
        <｜tool▁call▁end｜> (the section's own end may be cut by the end of the generation); the text before it is the
        content. A section in which no call parses stays text."""
        i = text.find(self.opener)
        calls = [] if i < 0 else [c for c in map(self.read_one, self.one.finditer(text, i)) if c]
        if i < 0 or (final and not calls):
            return super().parse(text, specs, final)
        return super().parse(text[:i], specs, final)[0], calls

    def read_one(self, m) -> Optional[dict]:
        try:
            args = json.loads(m.group(2))
        except ValueError:
            return None
        return new_call(m.group(1), args) if isinstance(args, dict) else None

    def call_rule(self, spec, tokenizer):
        return " ".join([lark_text(f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{spec['name']}<｜tool▁sep｜>", tokenizer),
                         lark_json(spec.get("parameters")),
                         lark_text("<｜tool▁call▁end｜><｜tool▁calls▁end｜>", tokenizer)])


class Harmony(Format):
    """gpt-oss: messages `[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY`
    ended by <|end|>, <|call|> or <|return|> (the last two end the generation, so an answer's text lacks them)."""
    name, opener = "harmony", "<|channel|>"
    head = re.compile(r"to=functions\.([^\s<]+)[^<]*(?:<\|(?:channel|constrain)\|>[^<]*)*<\|message\|>")
    ends = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
    markers = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>", "<|end|>")
    recipient = re.compile(r"to=functions\.([^\s<]+)")
    channel = re.compile(r"<\|channel\|>\s*(\w+)")

    @staticmethod
    def detect(template):
        return "<|channel|>" in template and "to=" in template

    def parse(self, text, specs=None, final=True):
        """Content: the final channel's text (and a commentary message to no one: a preamble); calls: the messages
        to functions.NAME; analysis: left out (`reasoning` reads it). Text with no harmony header at all is content
        as it stands."""
        kept, calls = [], []
        segments = text.split("<|start|>")
        for k, seg in enumerate(segments):
            last = k == len(segments) - 1  # a message still being written (while streaming)
            header, sep, body = seg.partition("<|message|>")
            if not sep:  # no body yet: a header in progress, or (first) text outside harmony: a model ignoring it
                plain = "<|channel|>" not in header and not header.lstrip().startswith("to=")
                if k == 0 and plain and (final or not "to=".startswith(header.lstrip())):  # ` to=` starts a header
                    kept.append(header if final or not last else
                                header[:held_prefix(header, (self.opener, "<|start|>"))])
                continue
            end = min([i for i in (body.find(e) for e in self.ends) if i >= 0], default=-1)
            closed = end >= 0 or final or not last
            body = body[:end] if end >= 0 else body
            channel, to = self.channel.search(header), self.recipient.search(header)
            if to:
                if closed:
                    try:
                        calls.append(new_call(to.group(1), json.loads(body)))
                    except ValueError:
                        kept.append(body)
            elif channel is None or channel.group(1) != "analysis":
                kept.append(body if closed else body[:held_prefix(body, self.ends)])
        return finish(kept, calls, final)

    def reasoning(self, text: str, final: bool = True) -> str:
        """The analysis channel's text (gpt-oss' reasoning), its messages joined, as far as it is written (while
        streaming, a suffix that may be the start of an end marker is held back)."""
        out = []
        segments = text.split("<|start|>")
        for k, seg in enumerate(segments):
            header, sep, body = seg.partition("<|message|>")
            channel = self.channel.search(header)
            if not sep or channel is None or channel.group(1) != "analysis" or self.recipient.search(header):
                continue
            end = min([i for i in (body.find(e) for e in self.ends) if i >= 0], default=-1)
            if end >= 0:
                body = body[:end]
            elif not final and k == len(segments) - 1:
                body = body[:held_prefix(body, self.ends)]
            out.append(body)
        return "".join(out)

    def call_rule(self, spec, tokenizer):
        return " ".join([lark_text(f"<|channel|>commentary to=functions.{spec['name']} <|constrain|>json<|message|>",
                                   tokenizer), lark_json(spec.get("parameters"))])


class Generic(Format):
    """Any template without a tool format of its own (the ChatML fallback, the demo model's): as llama.cpp's generic
    format, the tools are shown in a system-prompt section (`system_section`), history is rewritten into JSON turns
    (`rewrite`), and the whole answer is one JSON object the grammar forces, with or without a forced choice:
        {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}     a call
        {"response": "It is sunny."}                                              an answer (its text is the content)
    History: an assistant's calls are written as that object (several: {"tool_calls": [...], "content": "..."}); a
    tool's answer as a user turn {"tool_response": {"tool": NAME, "content": "..."}}."""
    name, opener = "generic", "{"
    head = re.compile(r'^\s*\{\s*"tool_call"\s*:\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*')
    block = re.compile(r"(?!)")  # parse() reads the whole answer itself
    reply = '{"response":"'  # the start of an answer's text, in the compact JSON the grammar writes

    @staticmethod
    def detect(template):
        return False  # never detected: the fallback (call_format)

    def parse(self, text, specs=None, final=True):
        """A whole answer: its JSON object's call(s) or response; text that is not such an object stays content. While
        streaming (final=False): an answer's `response` string as far as it decodes, a call only at the end."""
        body = text.strip()
        if not final:
            if not body.startswith("{") and not self.reply.startswith(body):
                return finish([text], [], final)  # plain text (no grammar: a client's own history, say)
            if not body.startswith(self.reply):
                return finish([], [], final)
            return finish([partial_json_string(body[len(self.reply):])], [], final)
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return finish([text], [], final)
        if not isinstance(obj, dict):
            return finish([text], [], final)
        if isinstance(obj.get("response"), str) and len(obj) == 1:
            return finish([obj["response"]], [], final)
        found = [obj["tool_call"]] if "tool_call" in obj else obj.get("tool_calls")
        calls = [new_call(c["name"], c.get("arguments", {})) for c in found or []
                 if isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments", {}), dict)]
        if not calls or (found and len(calls) != len(found)):
            return finish([text], [], final)
        return finish([obj.get("content") or ""] if isinstance(obj.get("content"), str) else [], calls, final)

    def call_schema(self, spec: dict) -> dict:
        return {"type": "object", "additionalProperties": False, "required": ["tool_call"], "properties": {
            "tool_call": {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                          "properties": {"name": {"const": spec["name"]},
                                         "arguments": spec.get("parameters") or {"type": "object"}}}}}

    def call_rule(self, spec, tokenizer):
        return lark_json(self.call_schema(spec))

    def auto_grammar(self, specs: list) -> Grammar:
        """tool_choice auto: a call of one of `specs`, or {"response": text}."""
        specs = [{**s, "parameters": closed(s.get("parameters"))} for s in specs]
        answer = {"type": "object", "additionalProperties": False, "required": ["response"],
                  "properties": {"response": {"type": "string"}}}
        return Grammar.from_request("lark", one_of([self.call_rule(s, None) for s in specs] + [lark_json(answer)]))

    @staticmethod
    def system_section(tools: list, forced: bool) -> str:
        """What the model is told (tools: OpenAI's [{type: function, function: {name, description, parameters}}])."""
        listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        shape = '{"tool_call": {"name": "<a tool\'s name>", "arguments": {<its arguments>}}}'
        return (f"You can call these tools (their parameters are JSON schemas):\n{listed}\n"
                + (f"Answer with a call, in JSON: {shape}" if forced else
                   f"Answer in JSON: {shape} to call a tool, or {{\"response\": \"<your answer>\"}} to answer "
                   "the user"))

    @staticmethod
    def rewrite(messages: list, tools: list, forced: bool) -> list:
        """Template messages ([{role, content, tool_calls?, tool_call_id?}]) -> ones a template without tools
        renders: the tools' section in the system prompt, calls and tool answers as JSON text."""
        section = Generic.system_section(tools, forced)
        names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}
        out = []
        for m in messages:
            if m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                         for c in m["tool_calls"]]
                obj = {"tool_call": calls[0]} if len(calls) == 1 and not m["content"] else \
                    {"tool_calls": calls, **({"content": m["content"]} if m["content"] else {})}
                out.append({"role": "assistant", "content": json.dumps(obj, ensure_ascii=False)})
            elif m["role"] == "tool":
                tool = names.get(m.get("tool_call_id"), m.get("tool_call_id") or "")
                out.append({"role": "user", "content": json.dumps(
                    {"tool_response": {"tool": tool, "content": m["content"]}}, ensure_ascii=False)})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + section}
        else:
            out.insert(0, {"role": "system", "content": section})
        return out


def partial_json_string(body: str) -> str:
    """The text of a JSON string cut anywhere (its opening quote already off): as far as it decodes; an escape cut
    in two waits for its rest, and the closing quote (and what follows it) ends it."""
    for cut in range(len(body), max(-1, len(body) - 12), -1):
        try:
            return json.loads('"' + body[:cut] + '"')
        except ValueError:
            continue
        except RecursionError:
            break
    # the closing quote is in: decode up to it
    try:
        return json.JSONDecoder().raw_decode('"' + body)[0]
    except ValueError:
        return ""


FORMATS = {f.name: f for f in (Harmony(), DeepSeekV31(), Glm(), QwenXml(), Hermes(), Generic())}  # detection order;
# Generic is never detected: the fallback of a template without a format (call_format)


def tool_format(template: Optional[str]) -> Optional[str]:
    """The tool-call format a chat template writes (a FORMATS key), or None (no tools in it, or a format not
    implemented). Read from the template's own text, as llama.cpp's chat-format detection does."""
    if not template or "tool" not in template:  # DeepSeek-V3.1's writes tool_calls and results, but no tool list
        return None
    return next((name for name, f in FORMATS.items() if f.detect(template)), None)


def call_format(template: Optional[str]) -> str:
    """The format calls are written in with tools in play: the template's own (tool_format), else "generic"."""
    return tool_format(template) or "generic"


def preserved_tokens(fmt: Optional[str], tokenizer) -> frozenset:
    """The ids of the format's markers that are control tokens in this vocabulary: the scheduler shows their text in
    the answer (TextStream's `preserved`), as llama.cpp's server does with a chat format's preserved_tokens, since
    a control token's text is otherwise left out of what a model writes, and the calls could not be read back."""
    if fmt is None:
        return frozenset()
    ids = (p for m in FORMATS[fmt].markers for p in tokenizer.split_special(m) if isinstance(p, int))
    return frozenset(i for i in ids if tokenizer.types[i] != TokenType.USER_DEFINED)  # those are shown anyway


def parse_calls(text: str, fmt: str = "hermes", specs: Optional[list] = None) -> tuple[Optional[str], list]:
    """A whole answer in format `fmt` -> (its text outside the calls, or None when empty; [OpenAI tool call])."""
    return FORMATS[fmt].parse(text, specs)


def call_grammar(specs: list, fmt: str = "hermes", tokenizer=None) -> Grammar:
    """A forced call of one of `specs` ([{name, parameters}]) in format `fmt` (see Format.grammar). A tool whose
    parameters admit no finite value (grammar.admits_a_value) is refused here, before the grammar engine meets it."""
    for spec in specs:
        if isinstance(spec["parameters"], dict) and not admits_a_value(spec["parameters"]):
            raise PymoeError(f"the parameters of {spec['name']!r} admit no value (a part every value must have has "
                             "none: a $ref recursion with no base case, or a false schema)")
    return FORMATS[fmt].grammar(specs, tokenizer)


def json_value_end(text: str, start: int) -> Optional[int]:
    """Where the JSON object or array that starts at text[start] ends (the index after it), or None: not closed
    yet, or not an object or array."""
    if start >= len(text) or text[start] not in "{[":
        return None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            escaped, in_string = (not escaped and c == "\\"), in_string and (escaped or c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class CallStream:
    """An answer read as it streams: feed(piece) -> (new content text, [new complete calls]); close() -> the rest.
    keep: "all" calls, or "first" (parallel_tool_calls false).
    live (formats whose arguments are JSON: `Format.head`): a call is announced as soon as its name is written, and
    its arguments go out as they are written: after each feed, `progress` holds [(call number, id, name or None,
    arguments text)] (the name only with a call's first entry); a complete call that was announced keeps its id, its
    `arguments` are the text as written, and its `streamed` says how much of that went out already. A call announced
    but never closed (the answer cut by max_tokens) stays what was sent of it: its text is not content."""

    def __init__(self, fmt: str, specs: Optional[list] = None, keep: str = "all", live: bool = False):
        self.fmt, self.specs, self.keep = FORMATS[fmt], specs, keep
        self.live = live and self.fmt.head is not None
        self.text, self.sent, self.n_calls = "", "", 0
        self.heads: list = []  # live: the calls announced, in order: [start, id, name, arguments sent]
        self.progress: list = []

    def feed(self, piece: str, final: bool = False) -> tuple[str, list]:
        self.text += piece
        content, calls = self.fmt.parse(self.text, self.specs, final)
        calls = calls[:1] if self.keep == "first" else calls
        if final and self.live and len(self.heads) > len(calls):  # announced, never closed (max_tokens): it stays
            content = self.fmt.parse(self.text[:self.heads[len(calls)][0]], self.specs, final)[0]  # a call, not text
        content = content or ""
        new = content[len(self.sent):] if content.startswith(self.sent) else ""  # always a prefix (see parse)
        self.sent += new
        fresh, self.n_calls = calls[self.n_calls:], max(self.n_calls, len(calls))
        self.progress = []
        if self.live:
            fresh = [self._complete(k, c) for k, c in enumerate(fresh, self.n_calls - len(fresh))]
            if not final:
                self._follow()
        return new, fresh

    def _complete(self, k: int, call: dict) -> dict:
        """Call number k, complete: the announced one's id and its arguments as written (when they are the same
        JSON), with how much of them was sent."""
        if k >= len(self.heads) or self.heads[k][2] != call["function"]["name"]:
            return call
        start, cid, name, sent = self.heads[k]
        m = self.fmt.head.match(self.text, start)
        end = json_value_end(self.text, m.end()) if m else None
        raw = self.text[m.end():end] if end else None
        try:
            same = raw is not None and json.loads(raw) == json.loads(call["function"]["arguments"])
        except ValueError:
            same = False
        if not same or not raw.startswith(sent):
            return {**call, "id": cid, "streamed": sent}  # sent text the final one does not continue: shown anyway
        return {**call, "id": cid, "function": {"name": name, "arguments": raw}, "streamed": sent}

    def _follow(self) -> None:
        """The calls written so far beyond the complete ones: announce new ones, send their arguments' new text."""
        limit = 1 if self.keep == "first" else None
        for k, m in enumerate(self.fmt.head.finditer(self.text)):
            if limit is not None and k >= limit:
                break
            if k == len(self.heads):
                self.heads.append([m.start(), "call_" + uuid.uuid4().hex[:24], m.group(1).strip(), ""])
                self.progress.append((k, self.heads[k][1], self.heads[k][2], ""))
            if k < self.n_calls:  # complete already
                continue
            end = json_value_end(self.text, m.end())
            raw = self.text[m.end():end] if end else self.text[m.end():]
            head = self.heads[k]
            if raw.startswith(head[3]) and len(raw) > len(head[3]) and raw[:1] in "{[":
                self.progress.append((k, head[1], None, raw[len(head[3]):]))
                head[3] = raw

    def close(self) -> tuple[str, list]:
        return self.feed("", final=True)
