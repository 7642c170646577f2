"""Anthropic's Messages API on `pymoe serve`: POST /v1/messages (and /v1/messages/count_tokens), as the official
`anthropic` client calls it.

    request   MessagesRequest: model, max_tokens (required, as Anthropic's), messages [{role: user | assistant,
              content: a string or text blocks}], system, stop_sequences, stream, output_config.format (a JSON
              schema the answer follows), cache_control (accepted: prefix reuse is automatic), metadata.user_id;
              temperature, top_p, top_k (the 2.x client sends them through extra_body); every other field is a
              400 naming it (tools, thinking, output_config.effort... are not implemented)
    prompt    system + messages -> the model's own chat template, as the OpenAI chat endpoint does
    answer    one message {id, type: "message", role, content: [{type: text, text}], stop_reason: end_turn |
              max_tokens | stop_sequence, stop_sequence, usage: {input_tokens, output_tokens}}, or the SSE events
              message_start, content_block_start, ping, content_block_delta*, content_block_stop, message_delta,
              message_stop
    errors    Anthropic's shape {"type": "error", "error": {"type", "message"}} with the same status codes
What this is not: the route and the job's way through the engine (app.py, shared with the OpenAI endpoints), or
authentication (app.py: `x-api-key` or `Authorization: Bearer`).
"""
# No `from __future__ import annotations`: the `unsupported(...)` annotations are calls, evaluated here.
import json
import uuid
from typing import ClassVar, Literal, Optional, Union

from pydantic import Field, field_validator

from pymoe.engine.grammar import Grammar
from pymoe.engine.sampler import SamplingParams
from pymoe.serve.schemas import MAX_STOP_CHARS, MAX_TOKENS, StopString, Strict, grammar_or_400, unsupported

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


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


class AnthropicMessage(Strict):
    role: Literal["user", "assistant"] = Field(description="'user' or 'assistant'")
    content: Union[str, list[TextBlock]] = Field(description="a string or a list of text blocks")


class Metadata(Strict):
    user_id: Optional[str] = Field(None, description="a string (an id for the caller's logs; it changes nothing)")


class JsonOutputFormat(Strict):
    type: Literal["json_schema"] = Field(description="'json_schema'")
    schema_: dict = Field(alias="schema", description="a JSON schema object")


class OutputConfig(Strict):
    format: Optional[JsonOutputFormat] = Field(None, description="an object {type: json_schema, schema}")
    effort: unsupported(why="no reasoning-effort levels") = None


class MessagesRequest(Strict):
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
    tools: unsupported([]) = None
    tool_choice: unsupported() = None
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

    def template_messages(self) -> list:
        system = [{"role": "system", "content": _text(self.system)}] if self.system else []
        return system + [{"role": m.role, "content": _text(m.content)} for m in self.messages]

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


class CountTokensRequest(Strict):
    """POST /v1/messages/count_tokens: the prompt's length in tokens, without a model run."""

    model: str = Field(description="a string")
    messages: list[AnthropicMessage] = Field(min_length=1, description="a non-empty list of {role, content}")
    system: Union[str, list[TextBlock], None] = Field(None, description="a string or a list of text blocks")
    tools: unsupported([]) = None
    tool_choice: unsupported() = None
    thinking: unsupported() = None

    template_messages = MessagesRequest.template_messages


class MessageReply:
    """The JSON of one answer: the message, or its SSE events."""

    def __init__(self, model: str):
        self.model, self.id = model, "msg_" + uuid.uuid4().hex[:24]

    def message(self, text: str, stop_reason: Optional[str], stop_sequence: Optional[str], usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [{"type": "text", "text": text}] if text or stop_reason else [],
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

    def start_events(self, input_tokens: int) -> list:
        return [self.event("message_start", message=self.message("", None, None, usage(input_tokens, 0))),
                self.event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
                self.event("ping")]

    def delta_event(self, text: str) -> str:
        return self.event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})

    def end_events(self, stop_reason: str, stop_sequence: Optional[str], output_tokens: int) -> list:
        return [self.event("content_block_stop", index=0),
                self.event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                           usage={"output_tokens": output_tokens}),
                self.event("message_stop")]


def usage(input_tokens: int, output_tokens: int, cached: int = 0) -> dict:
    """Anthropic's usage: input_tokens counts the prompt tokens read, cache_read_input_tokens those reused."""
    return {"input_tokens": input_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
