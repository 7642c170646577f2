"""The request bodies of the OpenAI API `pymoe serve` answers, as pydantic models, and its error shape.

Every field of /v1/chat/completions and /v1/completions is declared below as one of:
    implemented   typed, range-checked, with its default: messages / prompt, model, max_tokens,
                  max_completion_tokens, temperature, top_p, seed, stop, stream, stream_options.include_usage,
                  user, presence_penalty, frequency_penalty, logit_bias, echo, response_format (text,
                  json_object, json_schema), logprobs and top_logprobs, n; and llama.cpp's top_k, min_p,
                  repeat_penalty, ignore_eos, grammar (GBNF), json_schema, typical_p, top_n_sigma, xtc_*,
                  mirostat*, dry_*, min_tokens, n_probs, cache_prompt and id_slot
    unsupported   `unsupported(neutral...)`: absent, null or a value that asks for nothing (best_of: 1, tools: [],
                  tool_choice: "none", ...), else a 400 naming it
A field no model declares is a 400 naming it too (extra="forbid"): nothing is accepted and silently ignored.
JSON null means the field's default. Every 400 is one line in OpenAI's shape, {"error": {"message", "type",
"param", "code"}}: `parse` turns pydantic's first error into it ("'max_tokens' must be an integer >= 1, got 0").
What this is not: reading the body (app.py caps its size and parses the JSON), tokenization and the context check
(app.py), or anything the engine does (scheduler.py).
"""
# No `from __future__ import annotations`: the `unsupported(...)` annotations are calls, evaluated here.
import base64
import binascii
import json
from typing import Annotated, Any, Literal, Optional, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError, PydanticUndefined

from pymoe.engine.grammar import Grammar
from pymoe.engine.multimodal import MEDIA_MARKER
from pymoe.engine.sampler import DRY_MAX_BREAKER_BYTES, SamplingParams
from pymoe.errors import PymoeError

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES = get_args(Role)


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, code: Optional[str] = None, param: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.headers = status, message, code, param, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"), "param": self.param,
                          "code": self.code}}


# --- the two kinds of field ------------------------------------------------------------------------------------

def _same(value, neutral) -> bool:
    """Equal and of the same kind: 0.0 is 0, but False is not 0."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def unsupported(*neutral, why: str = ""):
    """The type of an OpenAI field pymoe does not implement: absent, null or one of `neutral`, else a 400."""
    allowed = " or ".join(["null", *(json.dumps(n) for n in neutral)])

    def check(value):
        if value is None or any(_same(value, n) for n in neutral):
            return None
        raise PydanticCustomError("unsupported_parameter", "'{param}' is not supported by this server{why}; "
                                  "only {allowed} is accepted", {"why": f" ({why})" if why else "", "allowed": allowed})

    return Annotated[Any, BeforeValidator(check)]


class Strict(BaseModel):
    """No coercion ("1" is not 1, true is not 1), no unknown fields, no infinite numbers (1e999), and null means
    the field's default."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _null_is_default(cls, value, info):
        default = cls.model_fields[info.field_name].default
        return default if value is None and default is not PydanticUndefined else value


# --- the fields both endpoints share ---------------------------------------------------------------------------

class StreamOptions(Strict):
    include_usage: bool = Field(False, description="a boolean")


class JsonSchemaFormat(Strict):
    """response_format.json_schema: {name, schema, strict, description} (OpenAI's structured outputs)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=False)
    name: str = Field(description="a string")
    schema_: dict = Field({}, alias="schema", description="a JSON schema object")
    strict: Optional[bool] = Field(None, description="a boolean (the output always follows the schema here)")
    description: Optional[str] = Field(None, description="a string")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="one of 'text', 'json_object', 'json_schema'")
    json_schema: Optional[JsonSchemaFormat] = Field(None, description="an object {name, schema, strict}")

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("invalid_value", "{param}: 'json_schema' goes with type 'json_schema', "
                                      "and only with it")
        return self


MAX_TOKENS = 2**31 - 1  # llama.cpp's n_predict is an int32; the context bounds what is generated anyway
MAX_STOP_CHARS = 1024  # one stop string: the text stream holds back that much text, and looks for it every token
MAX_SEED = 2**64 - 1  # numpy's generators take any non-negative integer; llama.cpp's seeds are 32 bits
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed", "presence_penalty",
                   "frequency_penalty", "typical_p", "top_n_sigma", "xtc_probability", "xtc_threshold", "mirostat",
                   "mirostat_tau", "mirostat_eta", "dry_multiplier", "dry_base", "dry_allowed_length",
                   "dry_penalty_last_n", "min_tokens")  # SamplingParams' names
# what mirostat replaces (llama.cpp's chain has none of them under mirostat), with the value that asks for nothing
MIROSTAT_REPLACES = (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("typical_p", 1.0), ("xtc_probability", 0.0))
DRY_BREAKERS = ["\n", ":", "\"", "*"]  # llama.cpp's default dry_sequence_breakers


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class Common(Strict):
    """What both endpoints accept: length, sampling (OpenAI's and llama.cpp's), stop strings, streaming."""

    model: Optional[str] = Field(None, description="a string (any name: the server serves one model)")
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS, description=f"an integer >= 1 (at most {MAX_TOKENS})")
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS,
                                                 description=f"an integer >= 1 (at most {MAX_TOKENS})")
    temperature: float = Field(1.0, ge=0, le=2, description="a number in [0, 2]")
    top_p: float = Field(1.0, gt=0, le=1, description="a number in (0, 1]")
    seed: Optional[int] = Field(None, ge=-1, le=MAX_SEED,
                                description=f"an integer in [0, {MAX_SEED}], or -1 (random, as llama.cpp's)")
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=4)], None] = Field(
        None, description=f"a string or a list of at most 4 strings of at most {MAX_STOP_CHARS} characters")
    stream: bool = Field(False, description="a boolean")
    stream_options: StreamOptions = Field(StreamOptions(), description="an object {include_usage}")
    user: Optional[str] = Field(None, description="a string (an id for the caller's logs; the engine ignores it)")
    # llama.cpp's extensions
    top_k: int = Field(40, ge=0, description="an integer >= 0")
    min_p: float = Field(0.05, ge=0, le=1, description="a number in [0, 1]")
    repeat_penalty: float = Field(1.0, ge=0.01, le=100, description="a number in [0.01, 100]")  # 1e-320: inf logits
    ignore_eos: bool = Field(False, description="a boolean")
    response_format: ResponseFormat = Field(ResponseFormat(type="text"),
                                            description="an object {type: text | json_object | json_schema}")
    grammar: Optional[str] = Field(None, description="a string (a GBNF grammar, llama.cpp's)")
    json_schema: Optional[dict] = Field(None, description="a JSON schema object (llama.cpp's)")
    n: int = Field(1, ge=1, le=16, description="an integer in [1, 16]")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="a number in [-2, 2]")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="a number in [-2, 2]")
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] = Field(
        {}, max_length=1024, description="an object of at most 1024 token ids (as strings) -> a bias in [-100, 100]")
    # llama.cpp's further samplers (engine/sampler.py; docs/server.md "Sampling"); each default is "off"
    typical_p: float = Field(1.0, ge=0, le=1, description="a number in [0, 1] (1: off)")
    top_n_sigma: float = Field(-1.0, description="a number (<= 0: off)")
    xtc_probability: float = Field(0.0, ge=0, le=1, description="a number in [0, 1]")
    xtc_threshold: float = Field(0.1, ge=0, le=1, description="a number in [0, 1]")
    mirostat: int = Field(0, ge=0, le=2, description="0 (off), 1 or 2")
    # tau is a surprise in bits: log2 of a vocabulary of 2^64 tokens is 64; eta 1 moves mu by the whole error
    mirostat_tau: float = Field(5.0, ge=0, le=64, description="a number in [0, 64] (bits)")
    mirostat_eta: float = Field(0.1, ge=0, le=1, description="a number in [0, 1]")
    dry_multiplier: float = Field(0.0, ge=0, le=100, description="a number in [0, 100] (0: off)")
    dry_base: float = Field(1.75, ge=1, le=100, description="a number in [1, 100]")
    dry_allowed_length: int = Field(2, ge=0, le=MAX_TOKENS, description="an integer >= 0")
    dry_penalty_last_n: int = Field(64, ge=0, le=MAX_TOKENS, description="an integer >= 0 (0: off)")
    dry_sequence_breakers: list[Annotated[str, Field(min_length=1)]] = Field(
        DRY_BREAKERS, min_length=1, max_length=64, description="a non-empty list of at most 64 non-empty strings of "
        f"at most {DRY_MAX_BREAKER_BYTES} bytes of UTF-8")
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="an integer >= 0")
    # llama.cpp's cache_prompt and id_slot (the scheduler's prefix reuse and slots)
    cache_prompt: bool = Field(True, description="a boolean (false: the prompt is read whole, no cached prefix)")
    id_slot: int = Field(-1, ge=-1, le=MAX_TOKENS, description="an integer: -1 (any slot) or a slot's index")

    @field_validator("dry_sequence_breakers")
    @classmethod
    def _breakers_fit(cls, breakers):
        if any(len(b.encode("utf-8")) > DRY_MAX_BREAKER_BYTES for b in breakers):
            raise PydanticCustomError("invalid_value", "{param}: each breaker is at most "
                                      f"{DRY_MAX_BREAKER_BYTES} bytes of UTF-8 (llama.cpp's limit)")
        return breakers

    def sampling(self, defaults: Optional[dict] = None) -> SamplingParams:
        """The request's sampling; a field the request does not set takes the server's default (`pymoe serve --temp
        ...`, llama.cpp's server flags) when there is one, else the API's."""
        defaults = defaults or {}
        value = {name: getattr(self, name) if name in self.model_fields_set or name not in defaults else defaults[name]
                 for name in SAMPLING_FIELDS}
        if value["seed"] == -1:  # llama.cpp's "random": no seed (n > 1 choices then draw independently too)
            value["seed"] = None
        # dry_breakers (token ids) are the app's to fill in: the strings' tokens need the tokenizer
        return SamplingParams(**value, logit_bias=tuple((int(t), float(b)) for t, b in self.logit_bias.items()))

    def check_sampling(self) -> None:
        """Mirostat replaces top-k, top-p, min-p, typical-p and XTC (llama.cpp's chain has none of them under
        mirostat): a request that sets one of them to a value that asks for something, with mirostat, is a 400 naming
        it rather than a field silently ignored."""
        if not self.mirostat:
            return
        for name, neutral in MIROSTAT_REPLACES:
            if name in self.model_fields_set and getattr(self, name) != neutral:
                raise ApiError(400, f"'{name}' does not combine with 'mirostat', which chooses its own candidates "
                                    f"(as on llama.cpp): leave it out or set it to {neutral}",
                               code="invalid_value", param=name)
        if "top_n_sigma" in self.model_fields_set and self.top_n_sigma > 0:
            raise ApiError(400, "'top_n_sigma' does not combine with 'mirostat', which chooses its own candidates "
                                "(as on llama.cpp): leave it out or set it to -1", code="invalid_value",
                           param="top_n_sigma")

    def check_logit_bias(self, n_vocab: int) -> None:
        """The keys of logit_bias are token ids of this model (a 400 naming logit_bias otherwise)."""
        for key in self.logit_bias:  # ASCII digits: "²".isdigit() is true, and int() refuses it
            if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) >= n_vocab:
                raise ApiError(400, f"logit_bias keys must be token ids 0..{n_vocab - 1} as strings, got {key!r}",
                               code="invalid_value", param="logit_bias")

    def output_grammar(self) -> Optional[Grammar]:
        """response_format, grammar or json_schema (at most one) -> the Grammar the output must follow, or None.
        A schema or grammar that does not compile is a 400 naming its field."""
        asked = [(param, kind, source) for param, kind, source in (
            ("response_format", self.response_format.type,
             self.response_format.json_schema.schema_ if self.response_format.json_schema else None),
            ("grammar", "gbnf", self.grammar), ("json_schema", "json_schema", self.json_schema))
            if source is not None or kind == "json_object"]
        if len(asked) > 1:
            raise ApiError(400, f"'{asked[0][0]}' and '{asked[1][0]}' both constrain the output: give one",
                           code="invalid_value", param=asked[1][0])
        if not asked:
            return None
        param, kind, source = asked[0]
        return grammar_or_400(kind, source, param)

    def stop_strings(self) -> tuple:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def max_new_tokens(self, room: int) -> int:
        """max_tokens (else max_completion_tokens, else all the room left), at most `room`."""
        asked = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        return min(asked or room, room)


# --- /v1/chat/completions --------------------------------------------------------------------------------------

class FunctionCall(Strict):
    name: str = Field(description="a string")
    arguments: str = Field(description="a string (the arguments as JSON text)")


class ToolCall(Strict):
    """An assistant message's earlier tool call, as the API returned it."""

    id: str = Field(description="a string")
    type: Literal["function"] = Field(description="'function'")
    function: FunctionCall = Field(description="an object {name, arguments}")


def image_bytes(url) -> bytes:
    """An image part's URL -> the image's bytes. Only data: URLs (base64): the server fetches nothing."""
    if not isinstance(url, str):
        raise PydanticCustomError("invalid_value", "{param}: an image URL must be a string")
    if url.startswith(("http://", "https://")):
        raise PydanticCustomError("invalid_value", "{param}: pymoe does not fetch URLs; send the image inline as a "
                                                   "data: URL (data:image/png;base64,...)")
    head, comma, data = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64") or not comma:
        raise PydanticCustomError("invalid_value", "{param}: an image must be a data: URL with base64 data "
                                                   "(data:image/png;base64,...)")
    return base64_image(data)


def base64_image(data) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise PydanticCustomError("invalid_value", "{param}: the image data is not valid base64") from None


class Message(Strict):
    """One chat message: a role and its text (a string, or a list of text and image_url parts: each image becomes
    a <__media__> marker in the text and its bytes go to `images`); an assistant's tool calls, a tool's answer to
    one (tool_call_id)."""

    role: Role
    content: Optional[str] = Field(None, description="a string or a list of text and image_url parts")
    images: list = Field([], exclude=True, description="(the images of image_url parts; not a request field)")
    name: unsupported() = None
    tool_calls: list[ToolCall] = Field([], description="a list of {id, type: function, function: {name, arguments}}")
    tool_call_id: Optional[str] = Field(None, description="a string (the call a tool message answers)")
    function_call: unsupported() = None
    refusal: unsupported() = None
    audio: unsupported() = None

    @model_validator(mode="before")
    @classmethod
    def _has_role(cls, m):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise PydanticCustomError("invalid_value", "{param} needs a 'role', one of {roles}",
                                      {"roles": ", ".join(ROLES)})
        if "images" in m:
            raise PydanticCustomError("invalid_value", "{param}: 'images' is not a message field (send image_url "
                                                       "parts in 'content')")
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            images, parts = [], []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image_url":
                    if set(p) != {"type", "image_url"}:
                        raise PydanticCustomError("invalid_value", "{param}: an image_url part is {type, image_url}")
                    url = p["image_url"]
                    url = url.get("url") if isinstance(url, dict) else url  # {"url", "detail"} or the URL
                    images.append(image_bytes(url))
                    parts.append({"type": "text", "text": MEDIA_MARKER})
                else:
                    parts.append(p)
            m = {**m, "content": parts, "images": images}
        return m

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content):
        if not isinstance(content, list):
            return content
        if not all(isinstance(p, dict) and p.keys() == {"type", "text"} and p["type"] == "text"
                   and isinstance(p["text"], str) for p in content):
            raise PydanticCustomError("invalid_value", "{param}: only text and image_url parts are supported")
        return "".join(p["text"] for p in content)


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="a function name (letters, digits, _ . -)")
    description: Optional[str] = Field(None, description="a string")
    parameters: dict = Field({"type": "object", "properties": {}}, description="a JSON schema object")
    strict: Optional[bool] = Field(None, description="a boolean (a forced call always follows the schema here)")


class Tool(Strict):
    type: Literal["function"] = Field(description="'function'")
    function: FunctionDef = Field(description="an object {name, description, parameters}")


class NamedFunction(Strict):
    name: str = Field(description="a string")


class NamedToolChoice(Strict):
    type: Literal["function"] = Field(description="'function'")
    function: NamedFunction = Field(description="an object {name}")


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1, description="a non-empty list of {role, content}")
    logprobs: bool = Field(False, description="a boolean")
    top_logprobs: Optional[int] = Field(None, ge=0, le=20, description="an integer in [0, 20]")
    n_probs: Optional[int] = Field(None, ge=0, le=20, description="an integer in [0, 20] (llama.cpp's top_logprobs)")
    tools: list[Tool] = Field([], max_length=128, description="a list of {type: function, function: {name, ...}}")
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="'none', 'auto', 'required' or {type: function, function: {name}}")
    parallel_tool_calls: bool = Field(True, description="a boolean (false: the first call only)")
    reasoning_format: Optional[Literal["none", "deepseek"]] = Field(
        None, description="'none' or 'deepseek' (llama.cpp's: <think> blocks in reasoning_content)")
    functions: unsupported([]) = None
    function_call: unsupported("none") = None
    modalities: unsupported(["text"]) = None
    audio: unsupported() = None
    prediction: unsupported() = None
    reasoning_effort: unsupported() = None
    store: unsupported(False) = None
    metadata: unsupported({}) = None

    def top_logprobs_n(self) -> Optional[int]:
        """None: no log-probabilities; else the number of alternatives per token. llama.cpp's n_probs N > 0 is
        logprobs: true with top_logprobs N (0: none asked, as on llama.cpp)."""
        if self.n_probs:
            if self.top_logprobs is not None and self.top_logprobs != self.n_probs:
                raise ApiError(400, f"'n_probs' ({self.n_probs}) and 'top_logprobs' ({self.top_logprobs}) are the "
                                    "same setting: give one", code="invalid_value", param="n_probs")
            return self.n_probs
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", code="invalid_value", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def images(self) -> list:
        """The bytes of the messages' images, in the order of their <__media__> markers in the prompt."""
        return [b for m in self.messages for b in m.images]

    def template_messages(self) -> list:
        """What the chat template reads: [{role, content}], an assistant's tool_calls with their arguments as
        objects (as transformers passes them; the JSON text when it does not parse), a tool's tool_call_id."""
        out = []
        for m in self.messages:
            msg = {"role": m.role, "content": m.content or ""}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out

    def function_tools(self) -> list:
        """The tools, as the template and the call grammar take them (Anthropic's request maps its own to these)."""
        return self.tools or []

    def tool_choice_value(self):
        """None (no tools in play), "auto", "required", or the name of the function the answer must call."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice == "none":
            return None
        if not self.tools:
            raise ApiError(400, "'tool_choice' needs 'tools'", code="invalid_value", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise ApiError(400, f"'tool_choice' names {choice.function.name!r}, which is not in 'tools'",
                               code="invalid_value", param="tool_choice")
            return choice.function.name
        return choice


# --- /v1/completions -------------------------------------------------------------------------------------------

def grammar_or_400(kind: str, source, param: str) -> Grammar:
    """engine/grammar.Grammar.from_request, its error a 400 naming the request field `param`."""
    try:
        return Grammar.from_request(kind, source)
    except PymoeError as e:
        raise ApiError(400, f"'{param}': {e}", code="invalid_value", param=param) from None


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested some 1,000 deep
        return text


def _one_prompt(p):
    """[prompt] -> prompt: a list holding one string or one list of token ids is that prompt."""
    return p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)) else p


class CompletionRequest(Common):
    prompt: Annotated[Union[str, Annotated[list[int], Field(min_length=1)]], BeforeValidator(_one_prompt)] = Field(
        description="a string or a list of token ids (one prompt per request)")
    echo: bool = Field(False, description="a boolean (the prompt's text before the completion)")
    logprobs: Optional[int] = Field(None, ge=0, le=5, description="an integer in [0, 5]")
    n_probs: Optional[int] = Field(None, ge=0, le=5, description="an integer in [0, 5] (llama.cpp's logprobs)")
    best_of: unsupported(1) = None
    suffix: unsupported("") = None

    def top_logprobs_n(self) -> Optional[int]:
        """llama.cpp's n_probs N > 0 is logprobs N (0: none asked, as on llama.cpp)."""
        if self.n_probs:
            if self.logprobs is not None and self.logprobs != self.n_probs:
                raise ApiError(400, f"'n_probs' ({self.n_probs}) and 'logprobs' ({self.logprobs}) are the same "
                                    "setting: give one", code="invalid_value", param="n_probs")
            return self.n_probs
        return self.logprobs


# --- llama.cpp's utility endpoints -------------------------------------------------------------------------------

class TokenizeRequest(Strict):
    """POST /tokenize, as llama.cpp's server: text -> token ids (with their pieces when asked)."""

    content: str = Field(description="a string")
    add_special: bool = Field(False, description="a boolean (prepend BOS when the model adds one)")
    with_pieces: bool = Field(False, description="a boolean")


class DetokenizeRequest(Strict):
    """POST /detokenize: token ids -> text."""

    tokens: list[int] = Field(description="a list of token ids")


class ApplyTemplateRequest(Strict):
    """POST /apply-template: chat messages -> the prompt the chat endpoint would run (the model's template)."""

    messages: list[Message] = Field(min_length=1, description="a non-empty list of {role, content}")

    def template_messages(self) -> list:
        return ChatRequest.template_messages(self)


# --- pydantic's first error -> one line of OpenAI error ----------------------------------------------------------

def parse(model: type, body: dict):
    """body -> a `model` (ChatRequest, CompletionRequest), or ApiError 400 naming the first field that is wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _api_error(model, body, e.errors()[0]) from None


def _api_error(model: type, body: dict, err: dict) -> ApiError:
    path, param, declared = _locate(model, err["loc"])
    if err["type"] == "extra_forbidden":
        param = f"{param}.{err['loc'][-1]}" if param else str(err["loc"][-1])
        return ApiError(400, f"'{param}' is not supported by this server (an unknown parameter)",
                        code="unknown_parameter", param=param)
    if err["type"] in ("invalid_value", "unsupported_parameter"):  # ours: the message is written out
        return ApiError(400, err["msg"].replace("{param}", param), code=err["type"], param=param)
    what = declared.description if declared is not None and declared.description else err["msg"].lower()
    message = f"'{param}' must be {what}"
    if err["type"] != "missing":
        for key in path:
            body = body[key]
        message += f", got {json.dumps(body)[:60]}"
    return ApiError(400, message, code="invalid_value", param=param)


def _locate(model: type, loc: tuple) -> tuple:
    """pydantic's error location -> (keys into the body, the field's name as OpenAI writes it, its declaration).
    ('messages', 0, 'content') -> 'messages[0].content'; what lies below a plain field (a union member, a list
    item: ('stop', 'list[str]', 0)) is folded into that field."""
    path, param, declared = [], "", None
    for key in loc:
        if isinstance(key, int) and model is not None and declared is not None:  # an item of a list of models
            param += f"[{key}]"
        elif isinstance(key, str) and model is not None and key in model.model_fields:
            declared = model.model_fields[key]
            param += f".{key}" if param else key
            model = _model_in(declared.annotation)
        else:
            break
        path.append(key)
    return path, param, declared


def _model_in(annotation) -> Optional[type]:
    """The pydantic model inside a field's type (list[Message] -> Message), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, get_args(annotation)) if m is not None), None)
