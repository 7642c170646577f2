"""Anthropic's Messages API on `pymoe serve`: POST /v1/messages (and /v1/messages/count_tokens), as the official
`anthropic` client calls it.

    request   MessagesRequest: model, max_tokens (required, as Anthropic's), messages [{role: user | assistant,
              content: a string or text blocks}], system, stop_sequences, stream, output_config.format (a JSON
              schema the answer follows), cache_control (accepted: prefix reuse is automatic), metadata.user_id;
              temperature, top_p, top_k (the 2.x client sends them through extra_body); tools [{name,
              description, input_schema}] and tool_choice {type: auto | any | tool | none, name,
              disable_parallel_tool_use}; tool_use blocks in assistant turns, tool_result blocks in user turns;
              every other field is a 400 naming it (thinking, output_config.effort... are not implemented)
    prompt    system + messages -> the model's own chat template, as the OpenAI chat endpoint does; tools go to
              the template as OpenAI function tools, tool_use blocks as an assistant's tool_calls, tool_result
              blocks as role "tool" messages (serve/tools.py: the formats pymoe parses back)
    answer    one message {id, type: "message", role, content: [{type: text, text}, {type: tool_use, id, name,
              input}...], stop_reason: end_turn | max_tokens | stop_sequence | tool_use, stop_sequence, usage:
              {input_tokens, output_tokens}}, or the SSE events message_start, content_block_start, ping,
              content_block_delta*, content_block_stop, message_delta, message_stop (with tools in play the
              answer is read as it streams, serve/tools.CallStream: text goes out as soon as it cannot be the
              start of a call, each call as a tool_use block once its closing marker is in, its input as one
              input_json_delta, so a call never leaks as text)
    errors    Anthropic's shape {"type": "error", "error": {"type", "message"}} with the same status codes
What this is not: the route and the job's way through the engine (app.py, shared with the OpenAI endpoints), or
authentication (app.py: `x-api-key` or `Authorization: Bearer`).
"""
# No `from __future__ import annotations`: the `unsupported(...)` annotations are calls, evaluated here.
import json
import uuid
from typing import ClassVar, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pymoe.engine.grammar import Grammar
from pymoe.engine.multimodal import MEDIA_MARKER
from pymoe.engine.sampler import SamplingParams
from pymoe.serve.schemas import (MAX_STOP_CHARS, MAX_TOKENS, ApiError, FunctionDef, StopString, Strict, Tool,
                                 base64_image, grammar_or_400, unsupported)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens"}  # the engine's "stop": end_turn, or stop_sequence when a stop string ended it


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class TextBlock(Strict):
    type: Literal["text"] = Field(description="'text' (only text blocks are supported)")
    text: str = Field(description="a string")
    cache_control: Optional[dict] = Field(None, description="an object (prefix reuse is automatic here: "
                                                            "every slot keeps its last prompt's KV)")
    citations: unsupported([]) = None


class ToolUseBlock(Strict):
    """An assistant's earlier tool call, as the API returned it."""

    type: Literal["tool_use"] = Field(description="'tool_use'")
    id: str = Field(description="a string")
    name: str = Field(description="a string")
    input: dict = Field(description="an object (the call's arguments)")
    cache_control: Optional[dict] = Field(None, description="an object (prefix reuse is automatic here)")


class ToolResultBlock(Strict):
    """The caller's answer to a tool call, in a user turn."""

    type: Literal["tool_result"] = Field(description="'tool_result'")
    tool_use_id: str = Field(description="a string (the tool_use block's id)")
    content: Union[str, list[TextBlock]] = Field("", description="a string or a list of text blocks")
    is_error: bool = Field(False, description="a boolean (the text is shown to the model either way)")
    cache_control: Optional[dict] = Field(None, description="an object (prefix reuse is automatic here)")


class ImageSource(Strict):
    type: Literal["base64", "url"] = Field(description="'base64' (a 'url' source is refused: pymoe fetches nothing)")
    media_type: Optional[str] = Field(None, description="a string, e.g. 'image/png'")
    data: Optional[str] = Field(None, description="base64 image data")
    url: Optional[str] = Field(None, description="(refused)")

    @model_validator(mode="after")
    def _base64_only(self):
        if self.type == "url":
            raise PydanticCustomError("invalid_value", "{param}: pymoe does not fetch URLs; send the image as a "
                                                       "base64 source")
        if not self.data:
            raise PydanticCustomError("invalid_value", "{param}: a base64 source needs 'data'")
        return self


class ImageBlock(Strict):
    """An image in a user turn: a <__media__> marker where it stands in the turn's text (engine/multimodal.py)."""

    type: Literal["image"] = Field(description="'image'")
    source: ImageSource = Field(description="{type: base64, media_type, data}")
    cache_control: Optional[dict] = Field(None, description="an object (prefix reuse is automatic here)")

    def image(self) -> bytes:
        return base64_image(self.source.data)


Block = Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock]  # told apart by `type` (each allows its one)


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.text if b.type == "text" else MEDIA_MARKER for b in content if b.type in ("text", "image"))


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"] = Field(description="'user' or 'assistant'")
    content: Union[str, list[Block]] = Field(description="a string or a list of text, image, tool_use and "
                                                         "tool_result blocks")

    @model_validator(mode="before")
    @classmethod
    def _no_url_images(cls, m):
        """An image by URL is named here (inside the block union its error would be the union's)."""
        content = m.get("content") if isinstance(m, dict) else None
        for b in content if isinstance(content, list) else []:
            if isinstance(b, dict) and b.get("type") == "image" and isinstance(b.get("source"), dict) \
                    and b["source"].get("type") == "url":
                raise PydanticCustomError("invalid_value", "{param}: pymoe does not fetch URLs; send the image as a "
                                                           "base64 source")
        return m

    def images(self) -> list:
        """The bytes of this turn's image blocks, in order."""
        return [] if isinstance(self.content, str) else [b.image() for b in self.content if b.type == "image"]

    def template_messages(self) -> list:
        """This turn as the chat template reads OpenAI's messages: tool_result blocks become role "tool" messages
        (before the turn's text), tool_use blocks an assistant's tool_calls (arguments as objects)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
               for b in self.content if b.type == "tool_result"]
        text = _text(self.content)
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in self.content if b.type == "tool_use"]
        if text or calls or not out:
            out.append({"role": self.role, "content": text, **({"tool_calls": calls} if calls else {})})
        return out


class AnthropicTool(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,128}$", description="a tool name (letters, digits, _ -)")
    description: Optional[str] = Field(None, description="a string")
    input_schema: dict = Field(description="a JSON schema object")
    type: Optional[Literal["custom"]] = Field(None, description="'custom' (server tools are not implemented)")
    cache_control: Optional[dict] = Field(None, description="an object (prefix reuse is automatic here)")


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"] = Field(description="'auto', 'any', 'tool' or 'none'")
    name: Optional[str] = Field(None, description="a tool's name (with type 'tool')")
    disable_parallel_tool_use: bool = Field(False, description="a boolean (true: at most one call)")


class ToolsMixin:
    """tools / tool_choice in the terms app.py uses for OpenAI's (schemas.ChatRequest): OpenAI function tools, and
    a choice of None (no tools in play), "auto", "required" or a tool's name."""

    def function_tools(self) -> list:
        return [Tool(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                            parameters=t.input_schema)) for t in self.tools or []]

    def tool_choice_value(self):
        choice = self.tool_choice or ToolChoice(type="auto" if self.tools else "none")
        if choice.type == "none":
            return None
        if not self.tools:
            raise ApiError(400, "'tool_choice' needs 'tools'", code="invalid_value", param="tool_choice")
        if choice.type == "tool":
            if choice.name not in {t.name for t in self.tools}:
                raise ApiError(400, f"'tool_choice' names {choice.name!r}, which is not in 'tools'",
                               code="invalid_value", param="tool_choice")
            return choice.name
        return {"auto": "auto", "any": "required"}[choice.type]

    @property
    def parallel_tool_calls(self) -> bool:
        return not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)


class Metadata(Strict):
    user_id: Optional[str] = Field(None, description="a string (an id for the caller's logs; it changes nothing)")


class JsonOutputFormat(Strict):
    type: Literal["json_schema"] = Field(description="'json_schema'")
    schema_: dict = Field(alias="schema", description="a JSON schema object")


class OutputConfig(Strict):
    format: Optional[JsonOutputFormat] = Field(None, description="an object {type: json_schema, schema}")
    effort: unsupported(why="no reasoning-effort levels") = None


class MessagesRequest(ToolsMixin, Strict):
    PROMPT_PARAM: ClassVar[str] = "messages"  # what a prompt error names (app.make_job)

    model: str = Field(description="a string (any name: the server serves one model)")
    max_tokens: int = Field(ge=1, le=MAX_TOKENS, description=f"an integer >= 1 (at most {MAX_TOKENS})")
    messages: list[AnthropicMessage] = Field(min_length=1, description="a non-empty list of {role, content}")
    system: Union[str, list[TextBlock], None] = Field(None, description="a string or a list of text blocks")
    stop_sequences: list[StopString] = Field([], max_length=16, description=(
        f"a list of at most 16 strings of at most {MAX_STOP_CHARS} characters"))
    stream: bool = Field(False, description="a boolean")
    output_config: OutputConfig = Field(OutputConfig(), description="an object {format}")
    cache_control: Optional[dict] = Field(None, description="an object (prefix reuse is automatic here)")
    # sampling: the 2.x client no longer declares these; older clients, and extra_body, still send them
    temperature: float = Field(1.0, ge=0, le=1, description="a number in [0, 1]")
    top_p: float = Field(1.0, gt=0, le=1, description="a number in (0, 1]")
    top_k: int = Field(0, ge=0, description="an integer >= 0 (0: all)")
    metadata: Metadata = Field(Metadata(), description="an object {user_id}")
    tools: Optional[list[AnthropicTool]] = Field(None, max_length=128, description="a list of {name, description, "
                                                                                    "input_schema}")
    tool_choice: Optional[ToolChoice] = Field(None, description="an object {type, name, disable_parallel_tool_use}")
    thinking: unsupported() = None
    service_tier: unsupported("auto", "standard_only") = None
    container: unsupported() = None
    mcp_servers: unsupported([]) = None
    diagnostics: unsupported() = None
    inference_geo: unsupported() = None
    speed: unsupported() = None
    user_profile_id: unsupported() = None
    workspace_id: unsupported() = None

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, stops):
        return [s for s in stops if s]

    # what app.make_job asks of a request
    ignore_eos: ClassVar[bool] = False
    cache_prompt: ClassVar[bool] = True
    id_slot: ClassVar[int] = -1
    dry_sequence_breakers: ClassVar[tuple] = ()

    def check_sampling(self) -> None:
        pass

    def images(self) -> list:
        """The bytes of the turns' image blocks, in the order of their markers in the prompt."""
        return [b for m in self.messages for b in m.images()]

    def template_messages(self) -> list:
        system = [{"role": "system", "content": _text(self.system)}] if self.system else []
        return system + [msg for m in self.messages for msg in m.template_messages()]

    def sampling(self, defaults: Optional[dict] = None) -> SamplingParams:
        """temperature, top_p, top_k as asked (Anthropic's defaults: 1, 1, all); min-p off, as Anthropic has none;
        a field the request leaves out takes the server's default (`pymoe serve --temp ...`) when there is one."""
        defaults = defaults or {}
        value = {name: getattr(self, name) if name in self.model_fields_set or name not in defaults else defaults[name]
                 for name in ("temperature", "top_p", "top_k")}
        return SamplingParams(**value, min_p=defaults.get("min_p", 0.0), seed=defaults.get("seed"),
                              repeat_penalty=defaults.get("repeat_penalty", 1.0))

    def check_logit_bias(self, n_vocab: int) -> None:
        pass

    def max_new_tokens(self, room: int) -> int:
        return min(self.max_tokens, room)

    def stop_strings(self) -> tuple:
        return tuple(self.stop_sequences)

    def output_grammar(self) -> Optional[Grammar]:
        """output_config.format (structured outputs) -> the Grammar the answer follows (engine/grammar.py)."""
        fmt = self.output_config.format
        if fmt is None:
            return None
        return grammar_or_400("json_schema", fmt.schema_, "output_config.format")

    def top_logprobs_n(self):
        return None


class CountTokensRequest(ToolsMixin, Strict):
    """POST /v1/messages/count_tokens: the prompt's length in tokens, without a model run."""

    model: str = Field(description="a string")
    messages: list[AnthropicMessage] = Field(min_length=1, description="a non-empty list of {role, content}")
    system: Union[str, list[TextBlock], None] = Field(None, description="a string or a list of text blocks")
    tools: Optional[list[AnthropicTool]] = MessagesRequest.model_fields["tools"]
    tool_choice: Optional[ToolChoice] = MessagesRequest.model_fields["tool_choice"]
    thinking: unsupported() = None

    template_messages = MessagesRequest.template_messages
    images = MessagesRequest.images


class MessageReply:
    """The JSON of one answer: the message, or its SSE events."""

    def __init__(self, model: str):
        self.model, self.id = model, "msg_" + uuid.uuid4().hex[:24]
        self.n_blocks, self.text_open = 1, True  # streaming: blocks started so far; is the last a text block, open

    def message(self, text: str, stop_reason: Optional[str], stop_sequence: Optional[str], usage: dict,
                calls: Optional[list] = None) -> dict:
        """calls: the answer's tool calls (OpenAI's shape, serve/tools.parse_calls), or None without tools in play:
        then the content is the one text block."""
        if calls is None:
            content = [{"type": "text", "text": text}] if text or stop_reason else []
        else:
            content = ([{"type": "text", "text": text}] if text else []) + [tool_use(c) for c in calls]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    @staticmethod
    def stop_reason(reason: str, matched: Optional[str]) -> tuple:
        """The engine's finish reason and the stop string that matched -> (stop_reason, stop_sequence)."""
        if reason == "stop" and matched is not None:
            return "stop_sequence", matched
        return STOP_REASONS.get(reason, "end_turn"), None

    @staticmethod
    def event(kind: str, **data) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"

    def start_events(self, input_tokens: int, text_block: bool = True) -> list:
        """message_start, and (without tools in play) the text block the deltas go into."""
        block = [self.event("content_block_start", index=0, content_block={"type": "text", "text": ""})]
        self.n_blocks, self.text_open = (1, True) if text_block else (0, False)
        return [self.event("message_start", message=self.message("", None, None, usage(input_tokens, 0))),
                *(block if text_block else []), self.event("ping")]

    def block_events(self, text: Optional[str], calls: list) -> list:
        """An answer read as it streams (tools in play): its new text into the open text block (started when
        there is none), then each new call as a tool_use block of its own, its input as one input_json_delta."""
        out = []
        if text:
            if not self.text_open:
                out.append(self.event("content_block_start", index=self.n_blocks,
                                      content_block={"type": "text", "text": ""}))
                self.n_blocks, self.text_open = self.n_blocks + 1, True
            out.append(self.delta_event(text))
        for c in calls:
            out += self.close_events()
            i, block = self.n_blocks, tool_use(c)
            out += [self.event("content_block_start", index=i, content_block={**block, "input": {}}),
                    self.event("content_block_delta", index=i, delta={"type": "input_json_delta", "partial_json":
                                                                      json.dumps(block["input"], ensure_ascii=False)}),
                    self.event("content_block_stop", index=i)]
            self.n_blocks += 1
        return out

    def close_events(self) -> list:
        """content_block_stop of the text block still open, if one is."""
        if not self.text_open:
            return []
        self.text_open = False
        return [self.event("content_block_stop", index=self.n_blocks - 1)]

    def delta_event(self, text: str) -> str:
        return self.event("content_block_delta", index=self.n_blocks - 1, delta={"type": "text_delta", "text": text})

    def end_events(self, stop_reason: str, stop_sequence: Optional[str], output_tokens: int,
                   close_text: bool = True) -> list:
        return [*([self.event("content_block_stop", index=0)] if close_text else []),
                self.event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                           usage={"output_tokens": output_tokens}),
                self.event("message_stop")]


def tool_use(call: dict) -> dict:
    """An OpenAI tool call (serve/tools.parse_calls) -> Anthropic's tool_use block (its arguments as an object)."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict:
    """Anthropic's usage: input_tokens counts the prompt tokens read, cache_read_input_tokens those reused."""
    return {"input_tokens": input_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
