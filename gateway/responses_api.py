"""OpenAI's Responses API, the one its current SDKs and agent frameworks call first: a thin
translation onto the chat completions path (gateway/http_api.py), so a response is made, checked,
cancelled and limited exactly as a chat completion of the same turns is.

  POST   /v1/responses        a response: text and function calls, from text, image and audio in
  GET    /v1/responses/{id}   a stored response
  DELETE /v1/responses/{id}   forget one

What it takes (OpenAI's shapes; what differs is said here):
* `input`: a string (one user turn), or items: messages (`{role, content}`, `type` "message"
  or left out; roles user, assistant, system, developer) whose content is a string or parts
  `input_text`, `input_image {image_url}` (a `data:` URL: nothing is fetched), `input_audio
  {input_audio: {data, format}}`, and an assistant's `output_text` / `refusal`; `function_call`
  items (an earlier reply's calls: they join the assistant message before them in the input, as
  the model wrote them, in one turn; a call_id the conversation has already is a 400) and
  `function_call_output` items (each call answered once, after it; a list `output`'s parts are
  text: an image a tool returns is a 400 naming it, as the gateway takes media in user turns
  alone); `item_reference` (its `type` may be left out) to a stored response's output item
  (as the Vercel AI SDK sends earlier turns) stands for that item, each item once in a
  conversation, and its bytes count towards the body's limit. `instructions` is the
  system turn first. Other item types (`reasoning`, ...), `input_file` parts and images by
  `file_id` are a 400 naming them: this server has no file store.
* `previous_response_id`: that stored response's turns (its chain's inputs, without their
  instructions, and outputs) come before `input`, as OpenAI chains them; together they are held to
  `media.max_request_bytes`, as one body is. Responses are stored unless `store: false`, in this
  gateway process, each with its own turns and a link to the one it continued, for an hour since
  last made or continued (at most `STORE_CAPACITY` of them and `STORE_BYTES` of their turns; the
  least recently used go first): a chain that outlives a link gets a 400 saying to send the whole
  input. Behind several gateway replicas, a chain needs its client kept on one (session affinity).
* `tools`: function tools (the flat form), rendered by the checkpoint's template as chat's are;
  `strict` is taken, not enforced (there is no constrained decoding; the openai-agents SDK sends it
  by default); `tool_choice` auto, none, or `allowed_tools` in mode auto (the model is shown only
  those), `parallel_tool_calls` (`max_tool_calls` bounds calls to built-in
  tools, of which there are none here: taken, echoed). Other tool types, a forced
  call (`required`, a named function), a non-text `text.format`, `reasoning` settings,
  `truncation: auto`, `background`, `conversation` and `prompt` are a 400: this server cannot
  honour them, so it says so instead of a reply the client would misread.
* `max_output_tokens`, `temperature`, `top_p`; `include: ["message.output_text.logprobs"]` with
  `top_logprobs` gives the log-probability of each token of the message's text before any call
  (as chat's `logprobs`). `metadata` is echoed; `temperature` and `top_p` echo what the reply
  is drawn with (the request's, else the checkpoint's defaults; greedy: 0 and 1).
* Text out only: OpenAI's Responses API has no speech output (chat completions and Realtime do).
* Streamed (`stream: true`; each event named by its type, numbered from 0): `response.created`,
  `response.in_progress`, then the message item
  (`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` as
  each piece exists, `.done` events), then each call's item (`response.function_call_arguments.
  delta` / `.done`), then `response.completed` (or `response.incomplete` at `max_output_tokens`);
  a failure once the stream began is `response.failed`, its response holding what was said (it
  reads back, and cannot be continued); a client that leaves mid-stream cancels the request, and
  its response reads back as `cancelled` with what was said. As with chat, nothing is sent before
  the reply's first piece, so a refused request gets its status streamed or not. A stored
  response reads back whole (`GET ...?stream=true` is a 400: its events are not kept);
  `input_items` is not served.
Errors are chat's (an OpenAI error object with the status), naming this body's fields.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.http_api import (
    Body,
    ChatCompletions,
    ChatRequest,
    Replies,
    callable_names,
    chain,
    ended_well,
    first_error,
    from_gateway_error,
    read_json,
    sse_event,
    to_generate_request,
    whole_of,
)
from gateway.http_error import HttpError, unauthorized
from gateway.server import GatewayError
from gateway.tool_calls import NAME as TOOL_NAME
from gateway.tool_calls import OPEN, Call, CallStream, chat_tool, new_call_id
from gateway.tool_calls import parse as parse_calls
from omnistage.quoting import quoted
from omnistage.v1 import gateway_pb2, stage_pb2
from omnistage.wire import StageError
from services import edges

__all__ = ["STORE_BYTES", "STORE_CAPACITY", "STORE_TTL_S", "ResponseStore", "Responses", "ResponsesRequest", "to_chat"]

STORE_TTL_S = 3600
STORE_CAPACITY = 16384
STORE_BYTES = 256 << 20  # the stored turns (media included: a chain's images and audio are kept too)
LOGPROBS = "message.output_text.logprobs"
# what `include` may name (OpenAI's values); the others add nothing here (no such items or tools)
INCLUDABLE = frozenset({
    LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url", "computer_call_output.output.image_url",
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "code_interpreter_call.outputs",
})  # fmt: skip


# ---- the request body -----------------------------------------------------------------------


class InputText(Body):
    type: Literal["input_text"]
    text: str


class OutputText(Body):  # an earlier reply's text, sent back in its assistant message
    type: Literal["output_text"]
    text: str


class RefusalPart(Body):
    type: Literal["refusal"]
    refusal: str


class InputImage(Body):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None


class AudioData(Body):
    data: str
    format: str | None = None


class InputAudio(Body):
    type: Literal["input_audio"]
    input_audio: AudioData


class InputFile(Body):  # refused: there is no file store
    type: Literal["input_file"]


Part = Annotated[InputText | OutputText | RefusalPart | InputImage | InputAudio | InputFile,
                 Field(discriminator="type")]  # fmt: skip
_PART_TYPES = frozenset({"input_text", "output_text", "refusal", "input_image", "input_audio", "input_file"})


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class CallItem(Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=TOOL_NAME)  # (rendered into the prompt's JSON as it is)
    arguments: str


class CallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Part]


class OtherItem(Body):  # any other type: an item_reference (its type may be left out), or refused, named
    type: str | None = None
    id: str | None = None


_ITEM_TYPES = ("message", "function_call", "function_call_output")


def _item_kind(value: Any) -> str:
    if not isinstance(value, dict):
        return "message"
    if value.get("type") is None and "id" in value and "role" not in value:
        return "other"  # an item_reference, whose type may be left out
    kind = value.get("type", "message")
    return kind if kind in _ITEM_TYPES else "other"


Item = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[CallItem, Tag("function_call")]
    | Annotated[CallOutputItem, Tag("function_call_output")] | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]  # fmt: skip


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # taken, not enforced (as chat's)


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: true, as OpenAI's
    stream: bool | None = False
    max_output_tokens: int | None = Field(None, ge=1, le=1 << 20)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)  # each a FunctionTool
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1, le=1 << 20)
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    user: str | None = None


def _where(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the body's field path, without the tags pydantic adds for a
    union's branches (`input[0].message.content[1].input_image.image_url` is
    `input[0].content[1].image_url`)."""
    out = ""
    for i, item in enumerate(loc):
        if isinstance(item, int):
            out += f"[{item}]"
        elif i and isinstance(loc[i - 1], int) and (item in _PART_TYPES or item in (*_ITEM_TYPES, "other")):
            continue
        elif str(item).isidentifier() and item not in ("str", "int", "float", "bool"):
            out += ("." if out else "") + str(item)
    return out or "body"


def parse_body(raw: bytes) -> ResponsesRequest:
    data = read_json(raw)
    if not isinstance(data, dict):
        raise HttpError(400, "body: expected a JSON object")
    if "input" in data and not isinstance(data["input"], str | list):
        raise _refused("input", "expected a string or a list of input items")
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        deep = [err for err in errors if "str" not in err["loc"]] or errors  # (content: the parts' own error)
        err = max(deep, key=lambda x: len(x["loc"]))
        where = _where(err["loc"])
        raise HttpError(400, f"{where}: {err['msg']}", param=where) from None


# ---- onto a chat request --------------------------------------------------------------------


def _refused(where: str, why: str) -> HttpError:
    return HttpError(400, f"{where}: {why}", param=where)


def _unsupported(body: ResponsesRequest) -> None:
    """What this server cannot honour: a 400 naming it, not a reply the client would misread."""
    if body.background:
        raise _refused("background", "background responses are not supported; stream it, or wait for it")
    if body.conversation is not None:
        raise _refused("conversation", "conversations are not stored here; use previous_response_id, or send "
                                       "the whole input")  # fmt: skip
    if body.prompt is not None:
        raise _refused("prompt", "stored prompt templates are not supported; send instructions and input")
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise _refused("reasoning", "this model's replies take no reasoning settings")
    if body.truncation == "auto":
        raise _refused("truncation", "only disabled: a conversation over the model's length is refused, not cut")
    fmt = (body.text or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _refused("text.format", 'only {"type": "text"} is supported (there is no constrained decoding)')
    for i, name in enumerate(body.include or ()):
        if name not in INCLUDABLE:
            raise _refused(f"include[{i}]", f"unknown value {quoted(name)}")


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A flat function tool as chat's (`{"type": "function", "function": {...}}`), which the
    template renders as a chat client's."""
    where = f"tools[{i}]"
    if tool.get("type") != "function":
        kind = tool.get("type")
        raise _refused(f"{where}.type", f"{quoted(str(kind))} tools are not supported; function tools are"
                       if isinstance(kind, str) else "expected \"function\"")  # fmt: skip
    try:
        FunctionTool.model_validate(tool)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        raise _refused(f"{where}.{_where(err['loc'])}" if err["loc"] else where, err["msg"]) from None
    return chat_tool(tool)


def _nested(tool: Any) -> Any:
    """A flat function entry of `allowed_tools` as chat's (`{"type": "function", "function":
    {"name"}}`); anything else as it is, for chat's check to name."""
    if isinstance(tool, dict) and tool.get("type") == "function":
        return {"type": "function", "function": {"name": tool.get("name")}}
    return tool


def _part(part: Any, where: str) -> dict[str, Any]:
    if isinstance(part, InputText | OutputText):
        return {"type": "text", "text": part.text}
    if isinstance(part, RefusalPart):
        return {"type": "refusal", "refusal": part.refusal}
    if isinstance(part, InputImage):
        if part.image_url is not None:
            return {"type": "image_url", "image_url": part.image_url}  # (as a string: errors name `image_url`)
        if part.file_id is not None:
            raise _refused(f"{where}.file_id", "an image by file id is not supported (this server has no file "
                                               "store); send image_url, a data: URL")  # fmt: skip
        raise _refused(f"{where}.image_url", "required (a data: URL)")
    if isinstance(part, InputAudio):
        return {"type": "input_audio", "input_audio": part.input_audio.model_dump(exclude_none=True)}
    raise _refused(f"{where}.type", "input_file parts are not supported (this server has no file store)")


@dataclass(frozen=True)
class Origin:
    """Where a chat message came from in the body: `where` (`input[3]`, `instructions`,
    `previous_response_id`), and the field its parts are in there (`content`, or a call
    output's `output`; "" for a string, whose errors name the item)."""

    where: str
    parts: str = ""

    def name(self, content: bool) -> str:
        return f"{self.where}.{self.parts}" if content and self.parts else self.where


def _content(content: str | list[Any], origin: Origin) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [_part(p, f"{origin.name(True)}[{j}]") for j, p in enumerate(content)]


@dataclass
class Chat:
    """A Responses request as chat's: its `request`, where each of its messages came from
    (`origins`, to name the body's fields in errors) and its own turns, as a later response
    chains them (its input's, without the instructions or the turns it continues)."""

    request: ChatRequest
    origins: list[Origin]
    turns: list[dict[str, Any]]
    size: int = 0  # about the bytes of its turns: those it continues or refers to, and the body's own


_ITEMS: TypeAdapter[Any] = TypeAdapter(Item)


def _referenced(item: OtherItem, where: str, store: ResponseStore, seen: set[str]) -> Any:
    """The stored output item an `item_reference` names (a message or call of a stored response,
    as the Vercel AI SDK sends an earlier turn back when responses are stored); `seen`: the
    responses and items the conversation holds already (each once, as OpenAI's)."""
    if item.type not in (None, "item_reference"):
        raise _refused(f"{where}.type", f"{quoted(item.type)} items are not supported (message, function_call, "
                                        "function_call_output and item_reference to a stored response's output "
                                        "are)")  # fmt: skip
    if item.id is None:
        raise _refused(f"{where}.id", "required: the id of the stored item it stands for")
    owner = store.owner(item.id)
    found = store.item(item.id)
    if found is None or owner is None:
        raise _refused(f"{where}.id", f"no stored item {quoted(item.id)} to continue from (an item of a stored "
                                      f"response's output, kept {STORE_TTL_S // 60} minutes unless store is false, "
                                      "and not of one that failed or was cancelled; send the item itself "
                                      "instead)")  # fmt: skip
    if item.id in seen or owner in seen:
        raise _refused(f"{where}.id", f"item {quoted(item.id)} is in the conversation already")
    seen.add(item.id)
    return _ITEMS.validate_python(found)


def to_chat(body: ResponsesRequest, store: ResponseStore | None = None) -> Chat:
    """The request as chat's (HttpError naming the field), with the `store`'s responses it
    continues or refers to."""
    _unsupported(body)
    store = store if store is not None else ResponseStore()
    messages: list[dict[str, Any]] = []
    origins: list[Origin] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
        origins.append(Origin("instructions"))
    seen: set[str] = set()  # the responses continued, the items referred to
    if body.previous_response_id is not None:
        chain = store.continued(body.previous_response_id)
        if chain is None:
            raise HttpError(400, f"previous_response_id: no stored response {quoted(body.previous_response_id)} "
                                 f"to continue (one is kept {STORE_TTL_S // 60} minutes unless store is false, in "
                                 "the process that made it, and one that failed or was cancelled cannot be "
                                 "continued; send the whole input instead)",
                            param="previous_response_id", code="previous_response_not_found")  # fmt: skip
        ids, turns = chain
        seen.update(ids)
        messages.extend(turns)  # (never changed below: a call joins this request's own turns alone)
        origins.extend([Origin("previous_response_id")] * len(turns))
    own = len(messages)  # this request's own turns from here
    if isinstance(body.input, str) and not body.input:
        raise _refused("input", "no turn to respond to (an empty string)")
    # each call is answered once, by an output after it (OpenAI's rule; a call's own output left out
    # would render a prompt the model was never trained on)
    called = {c["id"] for m in messages for c in m.get("tool_calls") or ()}
    answered = {m["tool_call_id"] for m in messages if m["role"] == "tool"}
    items: list[Any] = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for k, item in enumerate(items):
        where = "input" if isinstance(body.input, str) else f"input[{k}]"
        if isinstance(item, OtherItem):
            item = _referenced(item, where, store, seen)
        if isinstance(item, MessageItem):
            origin = Origin(where, "content" if isinstance(item.content, list) else "")
            messages.append({"role": item.role, "content": _content(item.content, origin)})
        elif isinstance(item, CallItem):
            if item.call_id in called:
                raise _refused(f"{where}.call_id", f"call {quoted(item.call_id)} is in the conversation already")
            called.add(item.call_id)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if len(messages) > own else None
            if last is not None and last["role"] == "assistant":  # the words it came with: one turn
                last.setdefault("tool_calls", []).append(call)
                continue
            origin = Origin(where)
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if item.call_id not in called:
                raise _refused(f"{where}.call_id", f"no call {quoted(item.call_id)} before this output in the "
                                                   "conversation")  # fmt: skip
            if item.call_id in answered:
                raise _refused(f"{where}.call_id", f"call {quoted(item.call_id)} has an output already")
            answered.add(item.call_id)
            origin = Origin(where, "output" if isinstance(item.output, list) else "")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _content(item.output, origin)})
        origins.append(origin)
    if len(messages) == own:
        raise _refused("input", "no turn to respond to")
    if unanswered := sorted(called - answered):
        raise _refused("input", f"no function_call_output for call {quoted(unanswered[0])}: each call the "
                                "conversation holds needs its output")  # fmt: skip
    logprobs = LOGPROBS in (body.include or ()) or bool(body.top_logprobs)
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":  # (the flat form: as chat's)
        choice = {"type": "allowed_tools", "allowed_tools": {k: v for k, v in choice.items() if k != "type"}}
        if isinstance(tools := choice["allowed_tools"].get("tools"), list):
            choice["allowed_tools"]["tools"] = [_nested(t) for t in tools]
    fields = {
        "messages": messages, "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "tools": [_tool(t, i) for i, t in enumerate(body.tools or ())] or None,
        "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls,
        "logprobs": logprobs or None, "top_logprobs": body.top_logprobs if logprobs else None,
    }  # fmt: skip
    try:
        request = ChatRequest.model_validate(fields)
    except ValidationError as e:  # (what the body's own checks passed: a check of chat's alone)
        where, message = first_error(e)
        raise in_body_terms(HttpError(400, f"{where}: {message}", param=where), origins) from None
    return Chat(request, origins, messages[own:], _size(messages))


_MESSAGE = re.compile(r"\bmessages\[(\d+)\](\.content\b)?")
_CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}


def in_body_terms(e: HttpError, origins: list[Origin]) -> HttpError:
    """A refusal of the chat request, naming this body's fields instead (`messages[3].content[1]`
    is where that message came from: `input[5].content[1]`, a call output's `input[6].output[1]`,
    `instructions`, `previous_response_id`)."""

    def origin(m: re.Match[str]) -> str:
        i = int(m[1])
        return origins[i].name(bool(m[2])) if i < len(origins) else "input"

    def rename(text: str) -> str:
        text = _MESSAGE.sub(origin, text)
        text = re.sub(r"^(tools\[\d+\])\.function\b", r"\1", text)
        text = re.sub(r"^tool_choice\.allowed_tools\b", "tool_choice", text)
        head, sep, rest = text.partition(":")
        return _CHAT_NAMES.get(head, head) + sep + rest

    e.message = rename(e.message)
    if e.param is not None:
        e.param = rename(e.param)
    if e.param == "max_output_tokens":  # (the thinker's own refusal says max_tokens)
        e.message = re.sub(r"\bmax_(?:completion_)?tokens\b", "max_output_tokens", e.message)
    return e


ResultT = TypeVar("ResultT")


async def _named(call: Awaitable[ResultT], origins: list[Origin]) -> ResultT:
    try:
        return await call
    except HttpError as e:
        raise in_body_terms(e, origins) from None


# ---- the store ------------------------------------------------------------------------------


def _size(value: Any) -> int:
    """About the bytes of a JSON value: its strings' lengths, 8 for anything else (walked, not
    dumped: a turn may hold megabytes of base64 media, and this runs on the event loop)."""
    total, todo = 0, [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += 8 * len(item)
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
        else:
            total += 8
    return total


@dataclass
class _Stored:
    expires: float
    response: dict[str, Any]
    turns: list[dict[str, Any]] | None  # its own: its input's and its reply's (None: it failed)
    parent: str | None  # the response it continued (`previous_response_id`)
    size: int


class ResponseStore:
    """Recent responses by id: each one's object (GET), its own turns and the response it
    continued (so a chain's turns are its links' turns, each stored once), and its output items
    (`item_reference`). Bounded by count and bytes (the least recently used go first) and age
    (`ttl_s` since a response was made or continued: a chain in use keeps its links); per gateway
    process, as chat's audio transcripts are."""

    def __init__(self, ttl_s: float = STORE_TTL_S, capacity: int = STORE_CAPACITY, max_bytes: int = STORE_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.ttl_s, self.capacity, self.max_bytes, self.clock = ttl_s, capacity, max_bytes, clock
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._owners: dict[str, str] = {}  # an output item's id -> its response's
        self.bytes = 0

    def put(self, response: dict[str, Any], turns: list[dict[str, Any]] | None, parent: str | None = None) -> None:
        size = _size(turns) + _size(response)
        if size > self.max_bytes:
            return  # (it would push out every other)
        self._touch(self._links(parent) or [])  # (its chain is used now: it goes after it)
        self.delete(response["id"])
        self._items[response["id"]] = _Stored(self.clock() + self.ttl_s, response, turns, parent, size)
        self._owners.update((o["id"], response["id"]) for o in response["output"])
        self.bytes += size
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            self.delete(next(iter(self._items)))

    def _get(self, response_id: str) -> _Stored | None:
        item = self._items.get(response_id)
        if item is not None and item.expires < self.clock():
            self.delete(response_id)
            return None
        return item

    def response(self, response_id: str) -> dict[str, Any] | None:
        item = self._get(response_id)
        return None if item is None else item.response

    def _links(self, response_id: str | None) -> list[_Stored] | None:
        """The chain that ends at this response, newest first; None when it, or a link of its
        chain, is unknown or was cut short (failed, cancelled)."""
        links: list[_Stored] = []
        at = response_id
        while at is not None:
            item = self._get(at)
            if item is None or item.turns is None:
                return None
            links.append(item)
            at = item.parent
        return links

    def _touch(self, links: list[_Stored]) -> None:
        """These count as used now: their hour starts again, and they go out last."""
        expires = self.clock() + self.ttl_s
        for link in reversed(links):
            link.expires = expires
            self._items.move_to_end(link.response["id"])

    def continued(self, response_id: str) -> tuple[list[str], list[dict[str, Any]]] | None:
        """The ids and turns (oldest first) of the chain that ends at this response; None when it
        cannot be continued. Its links count as used now."""
        links = self._links(response_id)
        if links is None:
            return None
        self._touch(links)
        return [link.response["id"] for link in links], [turn for link in reversed(links) for turn in link.turns or ()]

    def turns(self, response_id: str) -> list[dict[str, Any]] | None:
        """The turns of `continued`'s chain."""
        chain = self.continued(response_id)
        return None if chain is None else chain[1]

    def owner(self, item_id: str) -> str | None:
        """The id of the response whose output holds this item."""
        return self._owners.get(item_id)

    def item(self, item_id: str) -> dict[str, Any] | None:
        """A stored response's output item by its id (None: unknown, or of a response that cannot
        be continued); its response counts as used now."""
        owner = self._get(self._owners.get(item_id, ""))
        if owner is None or owner.turns is None:
            return None
        self._touch([owner])
        return next(o for o in owner.response["output"] if o["id"] == item_id)

    def delete(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is None:
            return False
        self.bytes -= item.size
        for o in item.response["output"]:
            self._owners.pop(o["id"], None)
        return True


# ---- the response ---------------------------------------------------------------------------


def _id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def usage(u: gateway_pb2.Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}  # fmt: skip


def _message(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [part]}


def _call(item_id: str, call_id: str, call: Call, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": call.name,
            "arguments": call.arguments if status == "completed" else ""}  # fmt: skip


Scored = list[tuple[dict[str, Any], int]]  # a token's entry, and how many bytes of the text it shows


class _Scores:
    """A message's token entries, each given once the text shown so far reaches where its token
    starts: the message's logprobs are its text's tokens, not those of a call or of text after a
    call, streamed or not the same (`upto` the text's bytes). A special token shows no bytes
    (the text leaves it out); one that ends the text with the whitespace before a call (Qwen's
    `.\n\n`) starts in it, so it counts."""

    def __init__(self) -> None:
        self.entries: Scored = []
        self.given = 0
        self.covered = 0  # bytes of the text the entries given show

    def add(self, entries: Scored) -> None:
        self.entries.extend(entries)

    def upto(self, size: float) -> list[dict[str, Any]]:
        out = []
        while self.given < len(self.entries) and self.covered < size:
            entry, shows = self.entries[self.given]
            out.append(entry)
            self.covered += shows
            self.given += 1
        return out


def _scored_bytes(text: str, calls: list[Call]) -> int:
    """How many of a reply's text bytes its message's logprobs cover: those before its first call
    (as streamed: the whitespace before it is never shown), or all of them."""
    return len((text[: text.find(OPEN)].rstrip() if calls else text).encode())


@dataclass
class _Made:
    """One response being made: its fixed fields, and what it has output so far."""

    base: dict[str, Any]
    most_calls: int | None  # (`parallel_tool_calls: false`: 1)
    output: list[dict[str, Any]] = field(default_factory=list)

    def object(self, status: str, final: gateway_pb2.Final | None = None,
               error: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        out = {**self.base, "status": status, "output": list(self.output), "error": error,
               "usage": usage(final.usage) if final is not None else None}  # fmt: skip
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
        return out

    def calls(self, calls: list[Call]) -> list[Call]:
        return calls[: self.most_calls]


def _status(final: gateway_pb2.Final) -> str:
    return "incomplete" if final.finish_reason == "length" else "completed"


def _assistant_turn(text: str | None, output: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The reply as the next response in its chain renders it: its words and calls, one turn."""
    calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
             for o in output if o["type"] == "function_call"]  # fmt: skip
    turn: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


class Responses:
    """The Responses endpoints, on the chat door's path (`chat`: its service, checks and
    streaming) with a store of recent responses."""

    def __init__(self, chat: ChatCompletions) -> None:
        self.chat = chat
        self.service = chat.service
        self.store = ResponseStore()

    async def create(self, request: Request) -> Response:
        """POST /v1/responses"""

        async def make(headers_checked: Callable[[], object]
                       ) -> tuple[tuple[ResponsesRequest, Chat], gateway_pb2.GenerateRequest]:  # fmt: skip
            limit = self.service.cfg.media.max_request_bytes * 4 // 3 + 4096  # (base64: 4/3)
            raw = await self.chat.read(request, limit)
            body = parse_body(raw)
            self.chat.check_model(body.model)
            headers_checked()
            chat = to_chat(body, self.store)
            if chat.size > limit:  # (its earlier turns, by id, count as sent)
                where = "previous_response_id" if body.previous_response_id is not None else "input"
                raise _refused(where, f"the conversation with the earlier turns it names is over "
                                      f"media.max_request_bytes ({limit} bytes of base64): start a new "
                                      "one")  # fmt: skip
            try:
                req = to_generate_request(chat.request, [], self.chat.transcripts.get, self.chat.stop_ids)
            except HttpError as e:
                raise in_body_terms(e, chat.origins) from None
            return (body, chat), req

        admitted = await self.chat.admit(request, make)
        if isinstance(admitted, Response):
            return admitted
        (body, chat), req, timeout = admitted
        made = _Made(self._base(body, req), 1 if body.parallel_tool_calls is False else None)
        if not body.stream:
            return await self.chat.serve(request, req, timeout,
                                         lambda replies: _named(self._whole(req, body, chat, made, replies),
                                                                chat.origins))  # fmt: skip
        return await self.chat.serve(
            request, req, timeout, lambda replies: _named(self.chat.first(replies), chat.origins),
            lambda first, replies: self._events(req, body, chat, made, first, replies))

    async def get(self, request: Request) -> Response:
        """GET /v1/responses/{id}"""
        response_id = self._checked(request)
        if isinstance(response_id, Response):
            return response_id
        if request.query_params.get("stream", "false").lower() != "false":
            return _refused("stream", "a stored response is read whole; its events are not kept to replay").response()
        stored = self.store.response(response_id)
        if stored is None:
            return _not_found(response_id).response()
        return JSONResponse(stored)

    async def delete(self, request: Request) -> Response:
        """DELETE /v1/responses/{id}"""
        response_id = self._checked(request)
        if isinstance(response_id, Response):
            return response_id
        if not self.store.delete(response_id):
            return _not_found(response_id).response()
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def _checked(self, request: Request) -> str | Response:
        if not self.service.check_api_key(request.headers.get("authorization")):
            return unauthorized().response()
        return str(request.path_params["response_id"])

    def _base(self, body: ResponsesRequest, req: gateway_pb2.GenerateRequest) -> dict[str, Any]:
        """The response object's fields that do not change as it is made (the request's, echoed)."""
        return {
            "id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": self.service.model_name,
            "instructions": body.instructions, "previous_response_id": body.previous_response_id,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls,
            **self._drawn_with(req), "top_logprobs": body.top_logprobs,
            "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "store": body.store is not False,
            "text": {**(body.text or {}), "format": {"type": "text"}}, "truncation": "disabled", "reasoning": None,
            "metadata": body.metadata or {}, "user": body.user, "background": False, "incomplete_details": None,
        }  # fmt: skip

    def _drawn_with(self, req: gateway_pb2.GenerateRequest) -> dict[str, float]:
        """The `temperature` and `top_p` the reply is drawn with, as OpenAI echoes them: the
        request's, else the checkpoint's defaults (greedy: 0 and 1)."""
        start = stage_pb2.Start()
        start.sampling["thinker"].CopyFrom(req.sampling["thinker"])
        try:
            params = edges.sampling("thinker", start, self.service.thinker_defaults)
        except StageError:  # (the gateway refuses the request, naming why, as it starts it)
            params = self.service.thinker_defaults
        if not params.do_sample:
            return {"temperature": 0.0, "top_p": 1.0}
        return {"temperature": params.temperature, "top_p": params.top_p}

    def _scores(self, req: gateway_pb2.GenerateRequest) -> Callable[[list[gateway_pb2.TokenLogprob]], Scored] | None:
        """The request's tokens' entries, each with the bytes of text it shows (None: not asked for)."""
        if not req.sampling["thinker"].HasField("logprobs"):
            return None
        ends, pieces = self.service.reply_ends(req), self.service.pieces

        def scored(logprobs: list[gateway_pb2.TokenLogprob]) -> Scored:
            entries = pieces.entries(logprobs, ends)
            ids = [lp.token_id for lp in logprobs if lp.token_id not in ends]  # (as `entries` leaves them out)
            return [(e, 0 if i in pieces.special else len(e["bytes"])) for e, i in zip(entries, ids, strict=True)]

        return scored

    def _kept(self, body: ResponsesRequest, chat: Chat, response: dict[str, Any], text: str | None) -> None:
        if body.store is not False:
            turns = [*chat.turns, _assistant_turn(text, response["output"])]
            self.store.put(response, turns, body.previous_response_id)

    async def _whole(self, req: gateway_pb2.GenerateRequest, body: ResponsesRequest, chat: Chat, made: _Made,
                     replies: Replies) -> Response:  # fmt: skip
        scored: list[gateway_pb2.TokenLogprob] = []
        scores = self._scores(req)

        def reply(text: str, _audio: list[bytes], final: gateway_pb2.Final) -> Response:
            content, found = parse_calls(text, callable_names(chat.request)) if req.tools else (text, [])
            calls = made.calls(found)
            status = _status(final)
            if content or not calls:
                aligned = _Scores()
                aligned.add(scores(scored) if scores is not None else [])
                made.output.append(_message(_id("msg"), content or "", status,
                                            aligned.upto(_scored_bytes(text, found))))  # fmt: skip
            made.output.extend(_call(_id("fc"), new_call_id(), c) for c in calls)
            response = made.object(status, final)
            self._kept(body, chat, response, content)
            return JSONResponse(response)

        return await whole_of(replies, reply, scored)

    def _events(self, req: gateway_pb2.GenerateRequest, body: ResponsesRequest, chat: Chat, made: _Made,
                first: list[gateway_pb2.GenerateResponse], replies: Replies) -> AsyncIterator[str]:  # fmt: skip
        """The response's events as its pieces come (each with its type as the SSE event's name, and
        numbered from 0, as OpenAI's)."""
        number = -1
        scores = self._scores(req)
        text: list[str] = []  # the message's text so far
        message: dict[str, Any] | None = None

        def event(kind: str, **fields: Any) -> str:
            nonlocal number
            number += 1
            return f"event: {kind}\n" + sse_event({"type": kind, "sequence_number": number, **fields})

        async def pieces() -> AsyncGenerator[str, None]:
            nonlocal message
            calls = CallStream() if req.tools else None
            raw: list[str] = []  # the reply's text (calls too)
            aligned = _Scores()
            shown_bytes, cap = 0, float("inf")  # (cap: the bytes the logprobs cover, once known)

            def opened() -> list[str]:  # the message item, announced at its first words (a reply
                nonlocal message  # that only calls has none, as OpenAI's)
                if message is not None:
                    return []
                message = _message(_id("msg"), "", "in_progress", [])
                made.output.append(message)
                index = len(made.output) - 1
                part = message["content"][0]
                return [event("response.output_item.added", output_index=index, item={**message, "content": []}),
                        event("response.content_part.added", item_id=message["id"], output_index=index,
                              content_index=0, part=dict(part))]  # fmt: skip

            def delta(shown: str) -> list[str]:
                nonlocal shown_bytes
                out = opened()
                assert message is not None
                text.append(shown)
                shown_bytes += len(shown.encode())
                logprobs = aligned.upto(min(shown_bytes, cap))
                message["content"][0]["logprobs"].extend(logprobs)
                return [*out, event("response.output_text.delta", item_id=message["id"], output_index=0,
                                    content_index=0, delta=shown, logprobs=logprobs)]  # fmt: skip

            ended = False
            try:
                yield event("response.created", response=made.object("in_progress"))
                yield event("response.in_progress", response=made.object("in_progress"))
                async for resp in chain(first, replies):
                    kind = resp.WhichOneof("kind")
                    if kind == "text":
                        if scores is not None:
                            aligned.add(scores(list(resp.text.logprobs)))
                        raw.append(resp.text.text)
                        shown = resp.text.text if calls is None else calls.feed(resp.text.text)
                        if shown:
                            for out in delta(shown):
                                yield out
                    elif kind == "final":
                        status = _status(resp.final)
                        found: list[Call] = []
                        if calls is not None:
                            rest, found = calls.finish(callable_names(chat.request))
                            cap = _scored_bytes("".join(raw), found)
                            found = made.calls(found)
                            if rest:
                                for out in delta(rest):
                                    yield out
                        if message is None and not found:  # (a reply that says and calls nothing: an empty message)
                            for out in opened():
                                yield out
                        if message is not None:
                            whole = "".join(text)
                            part = message["content"][0]
                            part["text"] = whole
                            message["status"] = status
                            yield event("response.output_text.done", item_id=message["id"], output_index=0,
                                        content_index=0, text=whole, logprobs=part["logprobs"])  # fmt: skip
                            yield event("response.content_part.done", item_id=message["id"], output_index=0,
                                        content_index=0, part=part)  # fmt: skip
                            yield event("response.output_item.done", output_index=0, item=message)
                        for call in found:
                            item = _call(_id("fc"), new_call_id(), call, "in_progress")
                            made.output.append(item)
                            index = len(made.output) - 1
                            yield event("response.output_item.added", output_index=index, item=dict(item))
                            yield event("response.function_call_arguments.delta", item_id=item["id"],
                                        output_index=index, delta=call.arguments)  # fmt: skip
                            yield event("response.function_call_arguments.done", item_id=item["id"],
                                        output_index=index, name=call.name, arguments=call.arguments)  # fmt: skip
                            item.update(status="completed", arguments=call.arguments)
                            yield event("response.output_item.done", output_index=index, item=item)
                        response = made.object(status, resp.final)
                        self._kept(body, chat, response, "".join(text) if message is not None else None)
                        ended = True
                        yield event(f"response.{status}", response=response)
            except (GeneratorExit, asyncio.CancelledError):  # the client went away: the request is cancelled
                if not ended:
                    cut_short("cancelled")
                raise

        def cut_short(status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
            """The response of a reply cut short (failed, or cancelled: its client went away), with
            what it said; stored to read back, not to continue from."""
            if message is not None:
                message["content"][0]["text"] = "".join(text)
                message["status"] = "incomplete"
            response = made.object(status, error=error)
            if body.store is not False:
                self.store.put(response, None)
            return response

        def failed(e: GatewayError) -> str:
            error = in_body_terms(from_gateway_error(e), chat.origins)
            code = _ERROR_CODES.get(error.status, "server_error" if error.status >= 500 else "invalid_prompt")
            return event("response.failed", response=cut_short("failed", {"code": code, "message": error.message}))

        return ended_well(pieces(), replies, req.request_id, failed)


_ERROR_CODES = {429: "rate_limit_exceeded"}  # a failed response's `error.code` (OpenAI's few codes) by status


def _not_found(response_id: str) -> HttpError:
    return HttpError(404, f"no stored response {quoted(response_id)} (this server keeps one {STORE_TTL_S // 60} "
                          "minutes unless store is false)", "not_found_error",
                     param="response_id", code="response_not_found")  # fmt: skip
