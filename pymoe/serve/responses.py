"""OpenAI's Responses API on `pymoe serve`: POST /v1/responses and GET /v1/responses/{id}, as the official `openai`
client's `client.responses.create`, `.stream` and `.parse` call them.

    request   ResponsesRequest: input (a string, or items: messages {role, content: a string or input_text /
              output_text parts}, function_call {call_id, name, arguments}, function_call_output {call_id,
              output}), instructions (a system message in front, not carried to a follow-up, as OpenAI's),
              max_output_tokens, temperature, top_p, tools [{type: function, name, description, parameters,
              strict}], tool_choice (none | auto | required | {type: function, name}), parallel_tool_calls,
              text.format (text | json_object | json_schema {name, schema, strict}), stream, store,
              previous_response_id, metadata, user; every other field is a 400 naming it (reasoning, include,
              background, hosted tools... are not implemented)
    the job   the request becomes a ChatRequest (`to_chat`): the conversation (the stored one of
              previous_response_id, then `input`) as chat messages, and the same template, tool formats, grammar
              and scheduler as /v1/chat/completions
    answer    a response {id: resp_..., object: "response", status: completed | incomplete (max_output_tokens),
              output: [reasoning {content: [reasoning_text]} (a leading <think> block), message {content:
              [output_text]}, function_call {call_id, name, arguments}...], usage:
              {input_tokens, input_tokens_details.cached_tokens, output_tokens, total_tokens}}; streamed, the
              events response.created, response.in_progress, response.output_item.added,
              response.content_part.added, response.output_text.delta*, response.output_text.done,
              response.reasoning_text.delta* / .done,
              response.content_part.done, response.function_call_arguments.delta / .done,
              response.output_item.done, then response.completed (or response.incomplete), numbered by
              sequence_number
    store     ResponseStore: the last responses (their conversation and their JSON) for previous_response_id and
              GET, bounded by count and by characters (the oldest go first); an unknown id is a 400 naming
              previous_response_id (GET: 404)
What this is not: the route and the job's way through the engine (app.py), tool-call parsing (tools.py).
"""
# No `from __future__ import annotations`: the `unsupported(...)` annotations are calls, evaluated here.
import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Literal, Optional, Union

from pydantic import Field

from pymoe.serve.schemas import MAX_TOKENS, ApiError, ChatRequest, Strict, unsupported

STORE_RESPONSES = 1024  # previous_response_id: the last this many responses are kept ...
STORE_CHARS = 64 << 20  # ... and at most this many characters of them (a request body is capped at 4 MiB by default:
#                         16 such conversations; a long chat re-sends nothing, so a chain costs its own length once)


# --- the request ------------------------------------------------------------------------------------------------

class TextPart(Strict):
    type: Literal["input_text", "output_text"] = Field(description="'input_text' or 'output_text' (only text is "
                                                                   "supported)")
    text: str = Field(description="a string")
    annotations: unsupported([]) = None
    logprobs: unsupported([]) = None


class MessageItem(Strict):
    type: Optional[Literal["message"]] = Field(None, description="'message'")
    role: Literal["user", "system", "developer", "assistant"] = Field(
        description="'user', 'system', 'developer' or 'assistant'")
    content: Union[str, list[TextPart]] = Field(description="a string or a list of input_text parts")
    id: Optional[str] = Field(None, description="a string (an earlier output item's id)")
    status: Optional[str] = Field(None, description="a string (an earlier output item's status)")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    """An earlier call of the model's, sent back as input."""

    type: Literal["function_call"] = Field(description="'function_call'")
    call_id: str = Field(description="a string")
    name: str = Field(description="a string")
    arguments: str = Field(description="a string (the arguments as JSON text)")
    id: Optional[str] = Field(None, description="a string")
    status: Optional[str] = Field(None, description="a string")


class FunctionCallOutputItem(Strict):
    """The caller's answer to a call."""

    type: Literal["function_call_output"] = Field(description="'function_call_output'")
    call_id: str = Field(description="a string (the function_call's call_id)")
    output: Union[str, list[TextPart]] = Field(description="a string or a list of input_text parts")
    id: Optional[str] = Field(None, description="a string")
    status: Optional[str] = Field(None, description="a string")


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem]


class FunctionTool(Strict):
    type: Literal["function"] = Field(description="'function' (hosted tools are not implemented)")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="a function name (letters, digits, _ . -)")
    description: Optional[str] = Field(None, description="a string")
    parameters: Optional[dict] = Field(None, description="a JSON schema object")
    strict: Optional[bool] = Field(None, description="a boolean (a forced call always follows the schema here)")


class NamedFunction(Strict):
    type: Literal["function"] = Field(description="'function'")
    name: str = Field(description="a string")


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="one of 'text', 'json_object', 'json_schema'")
    name: Optional[str] = Field(None, description="a string (json_schema's)")
    schema_: Optional[dict] = Field(None, alias="schema", description="a JSON schema object (json_schema's)")
    strict: Optional[bool] = Field(None, description="a boolean (the output always follows the schema here)")
    description: Optional[str] = Field(None, description="a string")


class TextConfig(Strict):
    format: TextFormat = Field(TextFormat(type="text"), description="an object {type: text | json_object | "
                                                                    "json_schema, name, schema, strict}")
    verbosity: unsupported("medium") = None


class ResponsesRequest(Strict):
    model: Optional[str] = Field(None, description="a string (any name: the server serves one model)")
    input: Union[str, list[InputItem]] = Field(description="a string or a list of message, function_call and "
                                                           "function_call_output items")
    instructions: Optional[str] = Field(None, description="a string (a system message before the input)")
    max_output_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS,
                                             description=f"an integer >= 1 (at most {MAX_TOKENS})")
    temperature: Optional[float] = Field(None, ge=0, le=2, description="a number in [0, 2]")
    top_p: Optional[float] = Field(None, gt=0, le=1, description="a number in (0, 1]")
    tools: list[FunctionTool] = Field([], max_length=128, description="a list of {type: function, name, "
                                                                      "description, parameters}")
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunction, None] = Field(
        None, description="'none', 'auto', 'required' or {type: function, name}")
    parallel_tool_calls: bool = Field(True, description="a boolean (false: the first call only)")
    text: TextConfig = Field(TextConfig(), description="an object {format}")
    stream: bool = Field(False, description="a boolean")
    store: bool = Field(True, description="a boolean (false: not kept for previous_response_id)")
    previous_response_id: Optional[str] = Field(None, description="a string (a stored response's id)")
    metadata: dict[str, str] = Field({}, max_length=16, description="an object of at most 16 string values")
    user: Optional[str] = Field(None, description="a string (an id for the caller's logs; the engine ignores it)")
    truncation: unsupported("disabled", why="a conversation longer than the context is a 400") = None
    include: unsupported([]) = None
    reasoning: unsupported() = None
    background: unsupported(False) = None
    max_tool_calls: unsupported() = None
    prompt: unsupported() = None
    prompt_cache_key: unsupported() = None
    safety_identifier: unsupported() = None
    service_tier: unsupported("auto", "default") = None
    top_logprobs: unsupported(0) = None
    stream_options: unsupported() = None
    conversation: unsupported() = None

    def messages(self, previous: list) -> list:
        """The conversation as chat messages ([{role, content, tool_calls?, tool_call_id?}], ChatRequest's): the
        stored `previous` ones, then `input`; consecutive function_call items are one assistant turn's calls (added
        to the assistant message just before them, if any)."""
        out = [dict(m) for m in previous]
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_call_id") is None:
                    out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif item.type == "function_call_output":
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": MessageItem(role="user", content=item.output).text()})
            else:
                out.append({"role": item.role, "content": item.text()})
        return out

    def to_chat(self, previous: list) -> ChatRequest:
        """The chat request this is (app.py runs it as /v1/chat/completions runs its own)."""
        fmt = self.text.format
        if (fmt.type == "json_schema") != (fmt.schema_ is not None):
            raise ApiError(400, "'text.format': 'schema' goes with type 'json_schema', and only with it",
                           code="invalid_value", param="text.format")
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + \
            self.messages(previous)
        if not messages:
            raise ApiError(400, "'input' is empty", code="invalid_value", param="input")
        body = {"messages": messages, "parallel_tool_calls": self.parallel_tool_calls,
                "max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "tools": [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                          for t in self.tools],
                "tool_choice": self.tool_choice if not isinstance(self.tool_choice, NamedFunction) else
                {"type": "function", "function": {"name": self.tool_choice.name}},
                "response_format": {"type": fmt.type} if fmt.type != "json_schema" else {
                    "type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}}
        return ChatRequest.model_validate({k: v for k, v in body.items() if v is not None})

    def echo(self) -> dict:
        """The request's settings, as a response object repeats them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p,  # None: the server's default was used
                "tools": [t.model_dump(exclude_none=True) for t in self.tools],
                "tool_choice": (self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction) else
                                self.tool_choice or "auto"),
                "parallel_tool_calls": self.parallel_tool_calls,
                "text": {"format": self.text.format.model_dump(exclude_none=True, by_alias=True)},
                "previous_response_id": self.previous_response_id, "metadata": self.metadata, "store": self.store,
                "user": self.user, "truncation": "disabled", "reasoning": None}


# --- the store ----------------------------------------------------------------------------------------------------

class ResponseStore:
    """The last responses (id -> (conversation as chat messages, the response's JSON)), bounded by STORE_RESPONSES
    and STORE_CHARS (the oldest go first). Thread-safe: requests are prepared on worker threads."""

    def __init__(self, max_responses: int = STORE_RESPONSES, max_chars: int = STORE_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self.items: OrderedDict = OrderedDict()  # id -> (messages, response, size)
        self.chars, self.lock = 0, threading.Lock()

    def put(self, rid: str, messages: list, response: dict) -> None:
        size = len(json.dumps(messages, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        with self.lock:
            self.items[rid] = (messages, response, size)
            self.chars += size
            while self.items and (len(self.items) > self.max_responses or self.chars > self.max_chars):
                _, (_, _, gone) = self.items.popitem(last=False)
                self.chars -= gone

    def get(self, rid: str) -> Optional[tuple]:
        """(messages, response) or None (never stored, or no longer)."""
        with self.lock:
            found = self.items.get(rid)
        return None if found is None else found[:2]

    def conversation(self, rid: Optional[str]) -> list:
        """previous_response_id -> its conversation (a 400 naming it when it is not here)."""
        if rid is None:
            return []
        found = self.get(rid)
        if found is None:
            raise ApiError(400, f"'previous_response_id': no stored response {rid!r} (this server keeps the last "
                                f"{self.max_responses} responses in memory, and none across restarts)",
                           code="previous_response_not_found", param="previous_response_id")
        return found[0]


# --- the answer ---------------------------------------------------------------------------------------------------

def output_message(text: str, mid: Optional[str] = None, status: str = "completed") -> dict:
    return {"type": "message", "id": mid or "msg_" + uuid.uuid4().hex[:24], "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def output_call(call: dict, status: str = "completed") -> dict:
    """An OpenAI chat tool call (tools.py's) -> a function_call output item."""
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def chat_turn(output: list) -> list:
    """A response's output items -> the chat messages they are in the conversation (what a follow-up sees)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


class ResponseReply:
    """The JSON of one response, and its SSE events (numbered by sequence_number)."""

    def __init__(self, model: str, req: ResponsesRequest):
        self.id, self.model, self.req = "resp_" + uuid.uuid4().hex[:24], model, req
        self.created = int(time.time())
        self.seq = 0
        self.output: list = []  # the items so far
        self.open_text: Optional[str] = None  # the text of the item still open (None: none) ...
        self.open_kind = "output_text"  # ... a message (output_text) or a reasoning item (reasoning_text)
        self.calls: dict = {}  # call id -> output index of a function_call item added and not done yet

    def response(self, status: str, usage: Optional[dict] = None, reason: Optional[str] = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": reason} if reason else None, "model": self.model,
                "output": list(self.output), "usage": usage, **self.req.echo()}

    def finish(self, reason: str) -> tuple:
        """The engine's finish reason -> (status, incomplete reason)."""
        return ("incomplete", "max_output_tokens") if reason == "length" else ("completed", None)

    # streaming
    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        data = json.dumps({"type": kind, "sequence_number": self.seq - 1, **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def start(self) -> list:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def text_events(self, text: str, kind: str = "output_text") -> list:
        """A piece of the answer's text (kind output_text) or of its reasoning (reasoning_text): the item it goes in
        (a message, a reasoning item) is opened first when it is not the one open."""
        if not text:
            return []
        out = self.close_text() if self.open_text is not None and self.open_kind != kind else []
        if self.open_text is None:
            self.open_text, self.open_kind = "", kind
            item = ({**output_message(""), "content": []} if kind == "output_text" else
                    {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [], "content": []})
            self.output.append({**item, "status": "in_progress"})
            index = len(self.output) - 1
            out.append(self.event("response.output_item.added", output_index=index, item=self.output[-1]))
            if kind == "output_text":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
        self.open_text += text
        out.append(self.event(f"response.{kind}.delta", item_id=self.output[-1]["id"],
                              output_index=len(self.output) - 1, content_index=0, delta=text,
                              **({"logprobs": []} if kind == "output_text" else {})))
        return out

    def close_text(self) -> list:
        if self.open_text is None:
            return []
        index, text, item = len(self.output) - 1, self.open_text, self.output[-1]
        self.open_text = None
        if self.open_kind == "reasoning_text":
            self.output[-1] = {**item, "status": "completed", "content": [{"type": "reasoning_text", "text": text}]}
            return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text),
                    self.event("response.output_item.done", output_index=index, item=self.output[-1])]
        self.output[-1] = output_message(text, item["id"])
        part = self.output[-1]["content"][0]
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=self.output[-1])]

    def call_events(self, calls: list, progress: tuple = ()) -> list:
        """Complete calls (tools.CallStream's), then the calls in progress (its live `progress`: [(number, id, name
        or None, arguments text)]): a function_call item is added when a call is announced (or, not announced, when
        it is complete), its arguments go out as they come, and it is done when complete."""
        out = self.close_text() if calls or progress else []
        for call in calls:
            item = output_call(call)
            streamed = call.get("streamed")
            if streamed is None:
                self.output.append({**item, "arguments": "", "status": "in_progress"})
                self.calls[call["id"]] = len(self.output) - 1
                out.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                      item=self.output[-1]))
            index = self.calls.pop(call["id"])
            rest = item["arguments"][len(streamed or ""):]
            if rest:
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=rest))
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
            self.output[index] = item
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        for _, cid, name, text in progress:
            if name is not None:
                item = output_call({"id": cid, "function": {"name": name, "arguments": ""}}, "in_progress")
                self.output.append(item)
                self.calls[cid] = len(self.output) - 1
                out.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=item))
            else:
                index = self.calls[cid]
                self.output[index] = {**self.output[index],
                                      "arguments": self.output[index]["arguments"] + text}
                out.append(self.event("response.function_call_arguments.delta", item_id=self.output[index]["id"],
                                      output_index=index, delta=text))
        return out

    def end(self, reason: str, usage: dict) -> tuple:
        """-> (the events that close the response, the final response). A call announced and never completed (cut
        by max_output_tokens) is done as it stands, status incomplete."""
        out = self.close_text()
        for index in self.calls.values():
            self.output[index] = {**self.output[index], "status": "incomplete"}
            out.append(self.event("response.output_item.done", output_index=index, item=self.output[index]))
        self.calls = {}
        status, why = self.finish(reason)
        final = self.response(status, usage, why)
        out.append(self.event("response.completed" if status == "completed" else "response.incomplete",
                              response=final))
        return out, final


def usage(n_prompt: int, n_generated: int, n_reused: int) -> dict:
    return {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": n_reused},
            "output_tokens": n_generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_prompt + n_generated}
