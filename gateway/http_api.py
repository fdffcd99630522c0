"""The OpenAI-compatible HTTP front door, served by the gateway process next to its gRPC port
(Starlette on uvicorn, on the gateway's event loop). Every request goes through the same path as
`Gateway.Generate` (`GatewayService.serve`): this module only translates.

  POST /v1/chat/completions   chat with text, audio, image and video in; text and audio out
  POST /v1/completions        a raw prompt continued in text (gateway/completions_api.py)
  POST /v1/audio/speech       a given text spoken (the model's reply, given: `forced_ids`)
  POST /v1/audio/transcriptions, /v1/audio/translations
                              the text of an uploaded file (gateway/transcription.py)
  POST /v1/responses          OpenAI's Responses API, onto this path (gateway/responses_api.py)
  GET  /v1/realtime           OpenAI's Realtime API, a WebSocket (gateway/realtime.py)
  GET  /v1/models[/{id}]      the served model (and its voices)
  GET  /health                200 when every stage serves, else 503 naming the ones that do not
  GET  /metrics               the gateway's Prometheus metrics (404 with metrics.enabled false)
  GET  /                      the playground page

Chat completions (OpenAI's shapes; what differs is said here):
* `messages[].content`: a string or parts: `text`, `input_audio {data: base64, format}` (any
  format FFmpeg reads; `pcm16` is raw 16-bit mono at 24 kHz), `audio_url`, `image_url` and
  `video_url` `{url}` (or, as vLLM takes them, the URL string) as `data:` URLs (nothing is
  fetched). Roles system, developer (= system), user, assistant; an assistant turn may be
  `{"audio": {"id"}}` alone, an earlier spoken reply of this gateway (its transcript is kept an
  hour). `use_audio_in_video: true` (or vLLM's
  `mm_processor_kwargs`) interleaves each video's sound track.
* `modalities`: ["text"] (default) or ["text", "audio"]; `audio: {voice, format}` with voice one
  of the checkpoint's speakers (or one of OpenAI's own voice names, which stand for the default
  speaker) and format wav, mp3, flac, opus, aac or pcm16 (default wav).
* `temperature` 0 (or under 1e-5, as in vLLM) makes the whole reply deterministic (text and speech
  greedy, and a vocoder that samples its noise, Qwen2.5-Omni's, seeded as by `seed` 0 unless
  `seed` is set); unset keeps the checkpoint's defaults, but a `top_p` under 1 or a `top_k` above 0
  samples (the stage's rule: services/edges.py `sampling`). `max_tokens` / `max_completion_tokens`,
  `top_p`, `top_k`, `repetition_penalty`, `seed` (it seeds the speech too), `stop`, vLLM's
  `stop_token_ids`, `chat_template_kwargs` (gateway/chat_template.py), `logit_bias`,
  `presence_penalty` and `frequency_penalty` (the thinker's; omnistage/models/sampling.py); vLLM's fields with no
  counterpart that would change the reply (`ignore_eos`, `min_tokens`, ...) are refused. A field
  sent as null is unset.
  The legacy `functions` (but with `function_call: none`), a `function_call` other than
  none/auto and a non-text `response_format` are refused (400), not ignored; so are a field of
  the wrong JSON type (as OpenAI:
  `"stream": "true"`, `"max_tokens": 5.0`) and a string with a lone UTF-16 surrogate.
* `tools` (functions), where the checkpoint's chat template takes them (Qwen3-Omni's; not
  Qwen2.5-Omni's: a 400): rendered by the template as the client sent them; the reply's calls
  (Qwen's `<tool_call>` blocks, gateway/tool_calls.py) come as `message.tool_calls` with
  `finish_reason: "tool_calls"`, streamed as one `delta.tool_calls` at the end (the text before
  them streams as content). Earlier turns' `tool_calls` and `tool` messages (`tool_call_id`)
  are rendered back. `tool_choice` auto (the default), none (the tools go unread), or
  `allowed_tools` in mode auto (the model is shown only those: there is no constrained decoding;
  a reply that calls another calls nothing);
  `parallel_tool_calls: false` gives the first call alone; `strict` is taken, not enforced. With
  audio asked for, the speech is
  the text before the first call (the talker's input ends at the call's first token,
  `<tool_call>`: a checkpoint whose tokenizer has no such token takes tools with text alone);
  "required" or a named function is a 400 (there is no constrained decoding to make the model
  call one).
* `logprobs` (and `top_logprobs`, 0 to 20): each token's log-probability under the model (of its
  raw logits, before penalties and warpers, as vLLM gives them) in `choices[].logprobs.content`,
  streamed with the text that shows the token (gateway/logprobs.py).
* vLLM-Omni's `sampling_params_list`: each stage's own sampling, in stage order (`StageSampling`).
* Streamed: `chat.completion.chunk` events with `delta.content`, and `delta.audio {id, data,
  transcript}` (the id in the first alone) as soon as each piece exists (wav and flac come whole
  at the end; every `data` but the last holds whole base64 groups of whole samples, so joined
  strings decode too), then
  the finish, usage with `stream_options.include_usage`, and `[DONE]`. Nothing is sent before
  the reply's first piece, so a refused request gets its status streamed or not; an error after
  that is the stream's last event.
Errors are OpenAI error objects: 400 naming the field, 401 (with `--api-key`), 404 unknown
model or path, 405, 408 body stopped coming, 413 body too large (401, 408 and 413 close the
connection), 429 over max_in_flight or out of memory (a request too
large for a stage: 400), 499 client gone, 503 draining or a stage down, 504 deadline (header
`x-omnistage-timeout: SECONDS`, else `timeouts.request_timeout_s`). A client that disconnects
cancels its request down the whole chain. `gateway.cors_allow_origins` lets browser pages on
other origins call it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

import grpc
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import Message as AsgiMessage
from starlette.types import Send

from gateway.audio_out import FORMAT_NAMES, MIME
from gateway.chat_template import FIELD as CHAT_TEMPLATE_KWARGS
from gateway.http_error import HttpError, unauthorized
from gateway.logprobs import Held
from gateway.server import (
    MAX_REQUEST_ID_CHARS,
    REQUEST_ID_KEY,
    GatewayError,
    GatewayService,
    bad_request_id,
    fail_replies,
    internal_failure,
)
from gateway.tool_calls import NAME as TOOL_NAME
from gateway.tool_calls import CallStream, check_nesting, spoken
from gateway.tool_calls import parse as parse_calls
from gateway.transcription import check_form_type, read_form, to_transcription_request
from omnistage.models.sampling import MAX_LOGIT_BIAS_ENTRIES, greedy_temperature
from omnistage.quoting import quoted
from omnistage.topology import STAGES
from omnistage.v1 import gateway_pb2, stage_pb2

__all__ = ["ChatCompletions", "apply_temperature", "chat_usage", "data_url", "decode_b64", "from_gateway_error",
           "lone_surrogate", "pcm16_part", "refuse_unhonoured", "served_voices", "stt_usage", "thinker_sampling",
           "to_generate_request", "unknown_model", "voice_speaker", "whole_samples"]

log = logging.getLogger(__name__)

AUDIO_TTL_S = 3600  # a reply's audio id names its transcript this long (its `expires_at`)
# Streamed audio pieces hold whole base64 groups (3 bytes) of whole 16-bit samples, so a client
# that joins the `data` strings before decoding gets the same bytes as one that decodes each.
AUDIO_ALIGN = 6
TALKER_SEED_OFFSET = 0x5EED  # the talker's seed is the request's plus this (wrapped to int64)
CODE2WAV_SEED_OFFSET = 0xC0DE  # code2wav's (Qwen2.5-Omni's token2wav draws its noise from it), likewise
FORM_OVERHEAD = 256 * 1024  # a speech-to-text form's fields and part headers, beside its file
PCM16_RATE = 24_000  # `input_audio.format: pcm16` (as OpenAI's realtime audio)
TIMEOUT_HEADER = "x-omnistage-timeout"  # seconds the request may take (default: timeouts.request_timeout_s)
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
# A request refused over HTTP before it reached the gateway's service counts (metrics, access line)
# under the gRPC status name the same refusal has over gRPC, so that `outcome` is one vocabulary
# whatever the front door (it was `HTTP_400` here and `INVALID_ARGUMENT` there for one mistake).
REFUSAL_OUTCOMES = {status: code.name for code, (status, _) in STATUS.items()} | {
    405: "INVALID_ARGUMENT",  # a method the path does not take
    408: "DEADLINE_EXCEEDED",  # the body stopped coming
    413: "RESOURCE_EXHAUSTED",  # over the size limit, as gRPC's own max message size answers
    415: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
}


def refusal_outcome(status: int) -> str:
    return REFUSAL_OUTCOMES.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")


# ---- the request body -----------------------------------------------------------------------


class Body(BaseModel):
    # strict: a JSON type other than the field's is refused, as OpenAI does ("stream": "true",
    # "max_tokens": true, "temperature": "0.5"), not coerced; an integer is still a number
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class TextPart(Body):
    type: Literal["text"]
    text: str


class InputAudio(Body):
    data: str
    format: str | None = None  # None: wav


class RefusalPart(Body):  # an earlier reply's refusal, sent back in its assistant turn
    type: Literal["refusal"]
    refusal: str


class AudioPart(Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


class Url(Body):
    url: str


# vLLM also takes a part's URL as a plain string (`"image_url": "data:..."`)
class AudioUrlPart(Body):  # vLLM's audio part
    type: Literal["audio_url"]
    audio_url: Url | str


class ImagePart(Body):
    type: Literal["image_url"]
    image_url: Url | str


class VideoPart(Body):
    type: Literal["video_url"]
    video_url: Url | str


Part = Annotated[TextPart | RefusalPart | AudioPart | AudioUrlPart | ImagePart | VideoPart, Field(discriminator="type")]


class AudioRef(Body):
    id: str


class FunctionCall(Body):
    name: str = Field(pattern=TOOL_NAME)  # (rendered into the prompt's JSON as it is)
    arguments: str  # a JSON object's text, as the reply gave it


class ToolCall(Body):  # an earlier reply's call (assistant messages)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    audio: AudioRef | None = None  # an earlier reply's audio, by id (assistant messages)
    refusal: str | None = None  # an earlier reply's refusal (assistant messages): its text where content is empty
    tool_calls: list[ToolCall] | None = None  # an earlier reply's calls (assistant messages)
    tool_call_id: str | None = None  # the call a tool message gives the result of


class FunctionDef(Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # taken, not enforced: there is no constrained decoding (as vLLM without it)


class Tool(Body):
    """One of `tools` (each is checked against this, then rendered as the client sent it)."""

    type: Literal["function"]
    function: FunctionDef


class AudioOut(Body):
    voice: str | AudioRef | None = None
    format: Literal["wav", "mp3", "flac", "opus", "aac", "pcm16"] | None = None  # None: wav


class StreamOptions(Body):
    include_usage: bool | None = False


class ProcessorKwargs(Body):  # vLLM's `mm_processor_kwargs`
    use_audio_in_video: bool | None = None


# vLLM's SamplingParams fields that would change a stage's output and have no counterpart here,
# with the value that changes nothing (besides null, [] and {}): any other value is refused.
_NO_COUNTERPART: dict[str, Any] = {
    "presence_penalty": 0, "frequency_penalty": 0, "min_p": 0, "min_tokens": 0, "ignore_eos": False, "n": 1,
    "best_of": 1, "logprobs": None, "prompt_logprobs": None, "stop": None, "logit_bias": None,
    "allowed_token_ids": None, "bad_words": None, "logits_processors": None, "structured_outputs": None,
    "guided_decoding": None, "truncate_prompt_tokens": None,
}  # fmt: skip


# of those, the thinker's own (OpenAI's): a thinker entry's are taken (`_stage_sampling`)
_THINKER_FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias")


# vLLM's extra chat-completion fields with no counterpart here, sent at the body's top level (its
# own fields above are OpenAI's), with the value that changes nothing: any other value is refused
# (they were ignored, so `"ignore_eos": true` gave an ordinary reply).
_TOP_LEVEL_NO_COUNTERPART: dict[str, Any] = {
    **{k: v for k, v in _NO_COUNTERPART.items()
       if k not in ("presence_penalty", "frequency_penalty", "n", "logprobs", "stop", "logit_bias")},
    "use_beam_search": False, "length_penalty": 1.0, "include_stop_str_in_output": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "echo": False,
    "add_generation_prompt": True, "continue_final_message": False, "chat_template": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None, "return_tokens_as_token_ids": False,
}  # fmt: skip


def _changes_nothing(value: Any, neutral: Any) -> bool:
    if value is None or value == [] or value == {}:
        return True
    if isinstance(neutral, bool) or isinstance(value, bool):  # (True == 1, False == 0)
        return value is neutral
    return bool(value == neutral)


class StageSampling(Body):
    """One stage's entry of vLLM-Omni's `sampling_params_list` (its fields are vLLM's
    `SamplingParams`; ones that only shape vLLM's output objects, such as `detokenize`, are
    ignored)."""

    temperature: float | None = Field(None, ge=0)  # 0: greedy
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)  # -1 or 0: off
    max_tokens: int | None = Field(None, ge=1, le=1 << 20)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=1 << 62)]] | None = Field(None, max_length=1024)
    # the thinker's (OpenAI's; a talker entry's are refused unless they change nothing)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # the other fields of `_NO_COUNTERPART`, taken as sent to be refused unless they change nothing
    min_p: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    n: Any = None
    best_of: Any = None
    logprobs: Any = None
    prompt_logprobs: Any = None
    stop: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    truncate_prompt_tokens: Any = None


# Fields some clients send as null for "unset" are optional; None means the default.
class ChatRequest(Body):
    # other fields are kept (`model_extra`): vLLM's that would change the reply are refused
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1)  # None: ["text"]
    audio: AudioOut | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=1 << 20)
    max_completion_tokens: int | None = Field(None, ge=1, le=1 << 20)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)  # 0: only the most likely token (greedy text)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)  # -1 or 0: off (vLLM's)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=1 << 62)]] | None = Field(None, max_length=1024)  # vLLM's
    n: int | None = Field(1, ge=1, le=1)
    use_audio_in_video: bool | None = None
    mm_processor_kwargs: ProcessorKwargs | None = None
    # vLLM-Omni's per-stage sampling, in stage order (thinker, talker, code2wav): over the fields above
    sampling_params_list: list[StageSampling | None] | None = Field(None, max_length=len(STAGES))
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)  # each a `Tool`
    tool_choice: Any = None  # "auto" (the default with tools), "none" or allowed_tools in mode auto
    parallel_tool_calls: bool | None = None  # false: at most one call a reply
    # Asked for, these would change the reply's shape; this server has none of them, so it says so.
    functions: list[Any] | None = None  # the legacy form of tools
    function_call: Any = None  # (and of tool_choice)
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None


class SpeechRequest(Body):
    """OpenAI's `/v1/audio/speech` body."""

    model: str | None = None
    input: str = Field(min_length=1, max_length=4096)
    voice: str | AudioRef | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] | None = None  # None: mp3
    speed: float | None = Field(None, ge=0.25, le=4.0)
    instructions: str | None = Field(None, max_length=4096)
    stream_format: Literal["audio", "sse"] | None = None  # None: audio
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)  # not OpenAI's: the same seed, the same speech


BodyT = TypeVar("BodyT", bound=Body)
MadeT = TypeVar("MadeT")
# An endpoint's reading of its request: given the header check to call once its body is read, what
# it parsed (what the reply's shape needs) and the gateway request
Make = Callable[[Callable[[], object]], Awaitable[tuple[MadeT, gateway_pb2.GenerateRequest]]]


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


_MODELS = frozenset(c.__name__ for c in _subclasses(Body))  # union branches pydantic names in paths
Replies = AsyncGenerator[gateway_pb2.GenerateResponse, None]


_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]]*$")


# The gateway names gRPC fields; over HTTP the same things have the chat body's names.
_PART = re.compile(r"messages\[(\d+)\]\.parts\[(\d+)\](?: \(\w+\))?")
_HTTP_NAMES = (  # (what the message starts with, param, code)
    (re.compile(r"prompt: "), "messages", None),
    (re.compile(r"prompt: \d+ (?:characters|tokens)"), "messages", "context_length_exceeded"),
    (re.compile(r"want_audio: "), "modalities", None),
    (re.compile(r"thinker: sampling: max_tokens"), "max_tokens", None),
    # a thinker's refusal of a request too large for it (its scheduler's): the client shortens the
    # prompt or max_tokens (a talker's names its own limits: no OpenAI field to point at)
    (re.compile(r"thinker[\w-]*: request .*(?:tokens of cache|max_model_len=|max_num_batched_tokens=)"), "messages",
     "context_length_exceeded"),
)

_SAMPLING_FIELD = re.compile(r"(thinker|talker): sampling: (\w+)")  # a stage's refusal: its stage, the field
_ENTRY_NAMES = {"stop_ids": "stop_token_ids"}  # a stage's sampling field -> a `sampling_params_list` entry's
ResultT = TypeVar("ResultT")


async def _entry_named(call: Awaitable[ResultT], body: ChatRequest) -> ResultT:
    """A refusal of a thinker sampling field that the body's `sampling_params_list` entry set (it
    replaces the body's own) names that entry's field."""
    try:
        return await call
    except HttpError as e:
        entry = (body.sampling_params_list or [None])[0]
        field = _SAMPLING_FIELD.match(e.message)
        name = _ENTRY_NAMES.get(field[2], field[2]) if field else ""
        if entry is not None and field and field[1] == "thinker" and getattr(entry, name, None) is not None:
            e.param = f"sampling_params_list[{STAGES.index('thinker')}].{name}"
        elif e.param == "max_tokens" and body.max_completion_tokens is not None:  # the name the client used
            e.param = "max_completion_tokens"
            e.message = re.sub(r"\bmax_tokens\b", "max_completion_tokens", e.message)
        raise


def from_gateway_error(e: GatewayError) -> HttpError:
    """The gateway's error as OpenAI's: its status, and the field its message starts with."""
    status, kind = STATUS.get(e.code, (500, "server_error"))
    message = _PART.sub(r"messages[\1].content[\2]", e.message.removeprefix("gateway: "))
    head = message.split(": ", 1)[0]
    param = head if status == 400 and head != message and _FIELD.match(head) else None
    code = e.code.name.lower()
    for start, name, http_code in _HTTP_NAMES:
        if status == 400 and start.match(message):
            param, code = name, http_code or code
    # the body's field of a thinker's sampling field (`_entry_named`: an entry's, when it set it);
    # over HTTP only a `sampling_params_list` entry sets the talker's sampling fields
    if status == 400 and (field := _SAMPLING_FIELD.match(message)):
        name = _ENTRY_NAMES.get(field[2], field[2])
        param = name if field[1] == "thinker" else f"sampling_params_list[{STAGES.index('talker')}].{name}"
    # a request that ran out its whole deadline would again: the OpenAI SDK would run it twice more
    return HttpError(status, message, kind, param=param, code=code, retry=not e.deadline_passed)


def unknown_model(name: str, served: str) -> HttpError:
    return HttpError(404, f"model {quoted(name)} not found; this server serves {served!r}", "not_found_error",
                     param="model", code="model_not_found")  # fmt: skip


def sse_event(event: dict[str, Any]) -> str:
    """One server-sent event of JSON."""
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


def decode_b64(data: str, where: str) -> bytes:
    data = "".join(data.split())  # line-wrapped base64 (MIME, `base64` without -w0) is still base64
    try:  # and so is base64 whose padding was left off
        return base64.b64decode(data + "=" * (-len(data) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise HttpError(400, f"{where}: not valid base64", param=where) from None


def data_url(url: Url | str, where: str) -> bytes:
    if isinstance(url, Url):
        url, where = url.url, f"{where}.url"
    if url[:5].lower() != "data:":  # (a scheme, and the base64 token, are case-insensitive)
        raise HttpError(400, f"{where}: only data: URLs are taken (the server fetches nothing)", param=where)
    head, sep, data = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise HttpError(400, f"{where}: expected data:<mime>;base64,<data>", param=where)
    return decode_b64(data, where)


def whole_samples(data: bytes, where: str, name: str) -> bytes:
    """`data`, raw 16-bit samples (`name`: the format's, for the error of a half sample)."""
    if len(data) % 2:
        raise HttpError(400, f"{where}: {name} needs whole 16-bit samples", param=where)
    return data


def pcm16_part(data: bytes, rate: int, where: str, name: str) -> gateway_pb2.ContentPart:
    """Raw 16-bit little-endian mono samples at `rate` as an audio part (`name`: the format's, for
    the error of a half sample)."""
    whole_samples(data, where, name)
    f32 = (np.frombuffer(data, "<i2").astype(np.float32) / 32768).astype("<f4").tobytes()
    return gateway_pb2.ContentPart(audio=gateway_pb2.AudioPart(pcm=gateway_pb2.RawAudio(f32le=f32, sample_rate=rate)))


def _part(part: Any, where: str, role: str) -> gateway_pb2.ContentPart:
    if isinstance(part, TextPart):
        return gateway_pb2.ContentPart(text=part.text)
    if isinstance(part, RefusalPart):  # as OpenAI: an assistant's (what it said is its text)
        if role != "assistant":
            raise HttpError(400, f"{where}: a refusal part is for assistant messages only", param=where)
        return gateway_pb2.ContentPart(text=part.refusal)
    if isinstance(part, AudioUrlPart):
        data = data_url(part.audio_url, f"{where}.audio_url")
        return gateway_pb2.ContentPart(audio=gateway_pb2.AudioPart(file=data))
    if isinstance(part, AudioPart):
        data = decode_b64(part.input_audio.data, f"{where}.input_audio.data")
        if part.input_audio.format == "pcm16":
            return pcm16_part(data, PCM16_RATE, f"{where}.input_audio.data", "pcm16")
        return gateway_pb2.ContentPart(audio=gateway_pb2.AudioPart(file=data))
    if isinstance(part, ImagePart):
        return gateway_pb2.ContentPart(image=gateway_pb2.ImagePart(file=data_url(part.image_url,
                                                                                   f"{where}.image_url")))
    return gateway_pb2.ContentPart(video=gateway_pb2.VideoPart(file=data_url(part.video_url, f"{where}.video_url")))


# OpenAI's own voices: its SDK and examples always name one, so each stands for the checkpoint's
# default speaker (an OpenAI-written client works unchanged); any other unknown name is an error.
OPENAI_VOICES = frozenset({"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx",
                           "sage", "shimmer", "verse"})  # fmt: skip


def served_voices(service: GatewayService) -> list[str]:
    """The checkpoint's speakers a request may name (none: a stack that serves text only)."""
    return sorted(service.ckpt.spec.speakers) if service.cfg.audio_output else []


def voice_speaker(voice: str | AudioRef | None, voices: list[str], field: str = "audio.voice") -> str:
    """The gateway's speaker for the body's `field` ("" = the checkpoint's default)."""
    name = voice.id if isinstance(voice, AudioRef) else voice
    if not name:
        return ""
    if name.lower() in {v.lower() for v in voices}:
        return name
    if name.lower() in OPENAI_VOICES:
        return ""
    raise HttpError(400, f"{field}: unknown voice {quoted(name)}; this model has: {', '.join(voices)}",
                    param=field)  # fmt: skip


def _tool(tool: dict[str, Any], i: int) -> str:
    """One of `tools`, checked, as the JSON the template renders (the client's own, as a
    transformers user gives apply_chat_template its tools)."""
    try:
        Tool.model_validate(tool)
        check_nesting(tool, f"tools[{i}]")
    except ValidationError as e:
        where, message = first_error(e)
        field = f"tools[{i}]" + (f".{where}" if where else "")
        raise HttpError(400, f"{field}: {message}", param=field) from None
    except ValueError as e:
        raise HttpError(400, str(e), param=f"tools[{i}]") from None
    return json.dumps(tool, ensure_ascii=False)


def _tool_turn(m: Message, i: int, out: gateway_pb2.ChatMessage) -> None:
    """An assistant's earlier calls or a tool's result, checked, on the gateway's message `out`."""
    if m.tool_calls and m.role != "assistant":
        raise HttpError(400, f"messages[{i}].tool_calls: only assistant messages make tool calls",
                        param=f"messages[{i}].tool_calls")  # fmt: skip
    if m.role == "tool" and not m.tool_call_id:
        raise HttpError(400, f"messages[{i}].tool_call_id: a tool message names the call it answers",
                        param=f"messages[{i}].tool_call_id")  # fmt: skip
    out.tool_calls.extend(gateway_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                          for c in m.tool_calls or ())  # fmt: skip
    out.tool_call_id = m.tool_call_id or ""


def _allowed_tools(choice: Any) -> bool:
    """Whether `tool_choice` is OpenAI's `allowed_tools` (the model may call only these)."""
    return isinstance(choice, dict) and choice.get("type") == "allowed_tools"


def _allowed_names(choice: dict[str, Any], offered: Sequence[str]) -> set[str]:
    """The names `tool_choice: {"type": "allowed_tools", ...}` allows, each one of `offered`
    (HttpError naming the field): only mode auto, as there is no constrained decoding to make the
    model call one."""
    where = "tool_choice.allowed_tools"
    allowed = choice.get("allowed_tools")
    if not isinstance(allowed, dict) or not isinstance(allowed.get("tools"), list) or "mode" not in allowed:
        raise HttpError(400, f"{where}: expected {{mode, tools: [...]}}", param=where)
    if allowed["mode"] != "auto":
        raise HttpError(400, f"{where}.mode: auto only: this server cannot make the model call a tool (it has no "
                        "constrained decoding)", param=f"{where}.mode")  # fmt: skip
    names: set[str] = set()
    for i, tool in enumerate(allowed["tools"]):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in offered:
            raise HttpError(400, f"{where}.tools[{i}]: not a function of `tools`", param=f"{where}.tools[{i}]")
        names.add(name)
    return names


def callable_names(body: ChatRequest) -> frozenset[str] | None:
    """The functions a reply may call (`tool_choice: allowed_tools`, checked already): a reply
    that calls another calls nothing; None: whatever it calls."""
    if not _allowed_tools(body.tool_choice):
        return None
    return frozenset(_allowed_names(body.tool_choice, [t["function"]["name"] for t in body.tools or ()]))


def _most_calls(body: ChatRequest) -> int | None:
    """How many of a reply's tool calls it gives (`parallel_tool_calls: false`: the first)."""
    return 1 if body.parallel_tool_calls is False else None


def _template_kwargs(body: ChatRequest, req: gateway_pb2.GenerateRequest) -> None:
    """vLLM's `chat_template_kwargs` (Qwen3 clients send `{"enable_thinking": false}`), each value
    as JSON: the gateway renders the template with those it reads (gateway/chat_template.py)."""
    kwargs = (body.model_extra or {}).get(CHAT_TEMPLATE_KWARGS)
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise HttpError(400, f"{CHAT_TEMPLATE_KWARGS}: expected an object", param=CHAT_TEMPLATE_KWARGS)
    for key, value in kwargs.items():
        req.chat_template_kwargs[key] = json.dumps(value)


def _unsupported(body: ChatRequest) -> None:
    """Fields that would change the reply's shape, which this server cannot honour: a 400, not
    a reply the client would misread."""
    if body.tool_choice not in (None, "none", "auto") and not _allowed_tools(body.tool_choice):
        raise HttpError(400, "tool_choice: auto, none or allowed_tools in mode auto: this server cannot make the "
                        "model call a tool (it has no constrained decoding)", param="tool_choice")  # fmt: skip
    if body.top_logprobs and not body.logprobs:  # as OpenAI: the alternatives come with the tokens' own
        raise HttpError(400, "top_logprobs: logprobs must be true to use top_logprobs", param="top_logprobs")
    if body.functions and body.function_call != "none":  # as tools with tool_choice: none
        raise HttpError(400, "functions: function calling is not supported by this server (only with "
                        "function_call: none, which calls none)", param="functions")  # fmt: skip
    if body.function_call not in (None, "none", "auto"):
        raise HttpError(400, "function_call: only allowed with functions, which this server does not support",
                        param="function_call")  # fmt: skip
    if (body.model_extra or {}).get("web_search_options") is not None:  # ({} too: a search with its defaults)
        raise HttpError(400, "web_search_options: web search is not supported by this server",
                        param="web_search_options")  # fmt: skip
    refuse_unhonoured(body)


def refuse_unhonoured(body: Any) -> None:
    """What chat and completions bodies share that this server cannot honour (400 naming the
    field): a non-text `response_format` (no constrained decoding), `stream_options` without a
    stream (as OpenAI and vLLM refuse it; null or {} passes), and vLLM's fields with no
    counterpart here that would change the reply."""
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise HttpError(400, 'response_format: only {"type": "text"} is supported', param="response_format")
    if body.stream_options is not None and body.stream_options.model_fields_set and not body.stream:
        raise HttpError(400, "stream_options: only allowed when stream is true", param="stream_options")
    for name, value in (body.model_extra or {}).items():
        if name in _TOP_LEVEL_NO_COUNTERPART and not _changes_nothing(value, _TOP_LEVEL_NO_COUNTERPART[name]):
            raise HttpError(400, f"{name}: not supported by this server", param=name)


TranscriptLookup = Callable[[str], str | None]


def _seed_speech(req: gateway_pb2.GenerateRequest, seed: int) -> None:
    """The speech stages' seeds for a request's `seed` (the request's plus each stage's offset,
    wrapped into int64): the same seed gives the same speech."""
    for stage, offset in (("talker", TALKER_SEED_OFFSET), ("code2wav", CODE2WAV_SEED_OFFSET)):
        req.sampling[stage].seed = (seed + offset + (1 << 63)) % (1 << 64) - (1 << 63)


def _stage_sampling(entry: StageSampling, stop_ids: Sequence[int],
                    bias_name: str = "logit_bias") -> stage_pb2.SamplingParams:  # fmt: skip
    """A thinker or talker entry of `sampling_params_list` as that stage's sampling; its
    `stop_token_ids` stop the stage besides its own stop ids (`stop_ids`), as in vLLM. (A
    talker's bias and penalties are refused before, unless they change nothing.)"""
    msg = stage_pb2.SamplingParams()
    if entry.presence_penalty is not None:  # (0 too: it replaces the body's)
        msg.presence_penalty = entry.presence_penalty
    if entry.frequency_penalty is not None:
        msg.frequency_penalty = entry.frequency_penalty
    msg.logit_bias.update(_logit_bias(entry.logit_bias or {}, bias_name))
    if entry.temperature is not None:
        msg.do_sample = not greedy_temperature(entry.temperature)
        if msg.do_sample:
            msg.temperature = entry.temperature
    if entry.top_p is not None:
        msg.top_p = entry.top_p
    if entry.top_k is not None:
        msg.top_k = max(entry.top_k, 0)
    if entry.max_tokens is not None:
        msg.max_tokens = entry.max_tokens
    if entry.repetition_penalty is not None:
        msg.repetition_penalty = entry.repetition_penalty
    if entry.seed is not None:
        msg.seed = entry.seed
    if entry.stop_token_ids:
        msg.stop_ids.extend(dict.fromkeys([*stop_ids, *entry.stop_token_ids]))
    return msg


def _apply_sampling_list(req: gateway_pb2.GenerateRequest, entries: Sequence[StageSampling | None],
                         stop_ids: Mapping[str, Sequence[int]]) -> None:  # fmt: skip
    """vLLM-Omni's per-stage sampling over what the body's own fields set: each field an entry
    sets replaces theirs for its stage. The talker's and code2wav's count only when speech is
    asked for (they do not run otherwise); code2wav samples nothing, so only its `seed` counts
    (a sampled vocoder's noise), as vLLM-Omni's own example sends it other fields that do nothing."""
    for i, (stage, entry) in enumerate(zip(STAGES, entries, strict=False)):
        if entry is None:
            continue
        where = f"sampling_params_list[{i}]"
        for name, neutral in _NO_COUNTERPART.items():
            value = getattr(entry, name)
            if stage == "thinker" and name in _THINKER_FIELDS:
                continue
            # a vocoder samples nothing: vLLM-Omni's examples send it fields that change nothing
            if stage != "code2wav" and not _changes_nothing(value, neutral):
                raise HttpError(400, f"{where}.{name}: not supported by this server", param=f"{where}.{name}")
        if stage != "thinker" and not req.want_audio:
            continue
        if stage == "code2wav":
            if entry.seed is not None:
                req.sampling[stage].seed = entry.seed
            continue
        if entry.stop_token_ids:  # replaces the body's (MergeFrom would add to them)
            req.sampling[stage].ClearField("stop_ids")
        if stage == "thinker" and entry.logit_bias is not None:  # likewise (MergeFrom would merge the maps)
            req.sampling[stage].ClearField("logit_bias")
        req.sampling[stage].MergeFrom(_stage_sampling(entry, stop_ids.get(stage, ()), f"{where}.logit_bias"))


def _logit_bias(bias: Mapping[str, float], name: str = "logit_bias") -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as JSON keys) as ids; whether each is in the vocabulary
    is the thinker's check."""
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise HttpError(400, f"{name}: {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}", param=name)
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]+", key) or int(key) >= 1 << 62:
            raise HttpError(400, f"{name}: key {quoted(key)} is not a token id", param=name)
        if int(key) in out:  # ("7" and "07": which one was meant?)
            raise HttpError(400, f"{name}: token id {int(key)} is given twice", param=name)
        out[int(key)] = value
    return out


def apply_temperature(req: gateway_pb2.GenerateRequest, thinker: stage_pb2.SamplingParams, temperature: float,
                      seeded: bool) -> None:  # fmt: skip
    """A request's `temperature`: the thinker's; 0 (or under 1e-5, as in vLLM) makes the whole reply
    deterministic: greedy text, greedy speech, and a sampled vocoder's noise (Qwen2.5-Omni's)
    drawn as for seed 0 unless the request is `seeded`."""
    if greedy_temperature(temperature):
        thinker.do_sample = False
        req.sampling["talker"].do_sample = False
        if req.want_audio and not seeded:
            req.sampling["code2wav"].seed = CODE2WAV_SEED_OFFSET
    else:
        thinker.do_sample = True
        thinker.temperature = temperature


def to_generate_request(
    body: ChatRequest, voices: list[str], transcripts: TranscriptLookup = lambda _id: None,
    stop_ids: Mapping[str, Sequence[int]] | None = None,
) -> gateway_pb2.GenerateRequest:
    """The chat request as the gateway's own request (HttpError naming the field).
    `transcripts(audio_id)` is the text of an earlier reply's audio, None when unknown;
    `stop_ids`: each stage's own stop ids, which a `sampling_params_list` entry's
    `stop_token_ids` add to."""
    _unsupported(body)
    want_audio = "audio" in (body.modalities or ["text"])
    audio = body.audio or AudioOut()
    in_video = body.use_audio_in_video
    if in_video is None and body.mm_processor_kwargs is not None:
        in_video = body.mm_processor_kwargs.use_audio_in_video
    req = gateway_pb2.GenerateRequest(want_audio=want_audio, use_audio_in_video=bool(in_video),
                                      audio_format=FORMAT_NAMES[audio.format or "wav"])  # type: ignore[arg-type]  # fmt: skip
    req.speaker = voice_speaker(audio.voice, voices) if want_audio else ""
    tools = [_tool(t, i) for i, t in enumerate(body.tools or ())]  # (checked whether read or not)
    names = [t["function"]["name"] for t in body.tools or ()]
    if _allowed_tools(body.tool_choice):  # the model is shown those it may call alone
        allowed = _allowed_names(body.tool_choice, names)
        req.tools.extend(t for t, name in zip(tools, names, strict=True) if name in allowed)
    elif body.tool_choice != "none":  # ("none": the client wants no call; the tools go unread)
        req.tools.extend(tools)
    for i, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else m.role
        if not m.content and m.audio is not None:  # a spoken earlier reply: its words (content null, "" or [])
            text = transcripts(m.audio.id) if role == "assistant" else None
            if text is None:
                where = f"messages[{i}].audio.id"
                raise HttpError(400, f"{where}: unknown or expired audio id {quoted(m.audio.id)} (this server keeps a "
                                     "reply's transcript for an hour; send its text as content instead)",
                                param=where)  # fmt: skip
            req.messages.append(gateway_pb2.ChatMessage(role=role, content=text))
        elif not m.content and m.refusal and role == "assistant":
            req.messages.append(gateway_pb2.ChatMessage(role=role, content=m.refusal))
        elif isinstance(m.content, list):
            parts = [_part(p, f"messages[{i}].content[{j}]", role) for j, p in enumerate(m.content)]
            req.messages.append(gateway_pb2.ChatMessage(role=role, parts=parts))
        else:
            req.messages.append(gateway_pb2.ChatMessage(role=role, content=m.content or ""))
        _tool_turn(m, i, req.messages[-1])
    if body.stop is not None:
        req.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    _template_kwargs(body, req)
    thinker = thinker_sampling(req, body, (stop_ids or {}).get("thinker", ()))
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None:
        thinker.max_tokens = max_tokens
    if body.logprobs:
        thinker.logprobs = body.top_logprobs or 0
    req.sampling["thinker"].CopyFrom(thinker)
    _apply_sampling_list(req, body.sampling_params_list or (), stop_ids or {})
    return req


def thinker_sampling(req: gateway_pb2.GenerateRequest, body: Any, stop_ids: Sequence[int]) -> stage_pb2.SamplingParams:
    """The thinker's sampling from the fields chat and completions share: `temperature`, `top_p`,
    `top_k`, `repetition_penalty`, `seed`, the penalties, `logit_bias` and vLLM's `stop_token_ids`
    (besides the thinker's own `stop_ids`). With `req.want_audio`, a seed and temperature 0 set
    the speech stages' too."""
    thinker = stage_pb2.SamplingParams()
    if body.temperature is not None:
        apply_temperature(req, thinker, body.temperature, seeded=body.seed is not None)
    if body.top_p == 0:  # OpenAI takes 0..1; nothing but the most likely token is greedy
        thinker.do_sample = False
        thinker.ClearField("temperature")
    elif body.top_p is not None:
        thinker.top_p = body.top_p
    if body.top_k is not None:
        thinker.top_k = max(body.top_k, 0)  # -1 or 0 (vLLM's "off") is the stage's 0
    if body.repetition_penalty is not None:
        thinker.repetition_penalty = body.repetition_penalty
    if body.seed is not None:
        thinker.seed = body.seed
        if req.want_audio:  # the same seed gives the same speech too
            _seed_speech(req, body.seed)
    for name in ("presence_penalty", "frequency_penalty"):  # (0 changes nothing: left unset)
        if getattr(body, name):
            setattr(thinker, name, getattr(body, name))
    thinker.logit_bias.update(_logit_bias(body.logit_bias or {}))
    if body.stop_token_ids:  # besides the thinker's own stop ids, as in vLLM
        thinker.stop_ids.extend(dict.fromkeys([*stop_ids, *body.stop_token_ids]))
    return thinker


def to_speech_request(body: SpeechRequest, voices: list[str], tokenizer: Any,
                      max_words: int = 1 << 20) -> gateway_pb2.GenerateRequest:  # fmt: skip
    """Speech of a given text: the text is the user's turn and the model's reply, given (the
    thinker's `forced_ids`), so the talker speaks exactly these words; `instructions`, when set,
    is the system turn. `max_words`: the most tokens a reply may have (the gateway also refuses
    a prompt and reply together longer than the model takes)."""
    # special-token text in the input ("<|im_end|>") is spoken as text: it must not end the reply
    ids = [int(i) for i in tokenizer.encode(body.input, add_special_tokens=False, split_special_tokens=True)]
    if not ids or not body.input.strip():  # (only spaces: the user turn would be refused, naming messages)
        raise HttpError(400, "input: no text to speak", param="input")
    if len(ids) > max_words:
        raise HttpError(400, f"input: {len(ids)} tokens; at most {max_words} are spoken at once", param="input",
                        code="context_length_exceeded")  # fmt: skip
    fmt = "pcm16" if body.response_format == "pcm" else body.response_format or "mp3"
    req = gateway_pb2.GenerateRequest(want_audio=True, audio_format=FORMAT_NAMES[fmt])  # type: ignore[arg-type]
    req.speaker = voice_speaker(body.voice, voices, "voice")
    if body.speed is not None:
        req.speed = body.speed  # (the gateway time-stretches the speech: gateway/audio_out.py Tempo)
    if body.instructions:
        req.messages.append(gateway_pb2.ChatMessage(role="system", content=body.instructions))
    req.messages.append(gateway_pb2.ChatMessage(role="user", content=body.input))
    thinker = req.sampling["thinker"]
    thinker.forced_ids.extend(ids)
    thinker.max_tokens = len(ids) + 1  # the words, then the end of the reply
    thinker.do_sample = False
    if body.seed is not None:
        _seed_speech(req, body.seed)
    return req


def _audio_id() -> str:
    """A reply's audio id: the key its transcript is kept under, which a later turn sends back. The
    server's own token, never the request id, which a client may choose (`x-request-id`): it could
    then overwrite or read another client's transcript."""
    return f"audio_{uuid.uuid4().hex}"


def _request_id(raw: str | None) -> str:
    """The request's id: its client's `x-request-id` when usable, else the gateway's own (a
    refusal is named too; a bad header is refused by `_request_id_header`, never echoed)."""
    return raw if raw and not bad_request_id(raw) else uuid.uuid4().hex


def _request_id_header(value: str | None) -> str:
    """A client's own request id (`x-request-id`, as a proxy in front sets it), checked as the
    gRPC door checks `request_id`; "": the gateway makes one."""
    if value is not None and bad_request_id(value):
        raise HttpError(400, f"header {REQUEST_ID_KEY}: at most {MAX_REQUEST_ID_CHARS} printable ASCII characters",
                        param=REQUEST_ID_KEY)  # fmt: skip
    return value or ""


def _timeout_header(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < 1e6:
        raise HttpError(400, f"header {TIMEOUT_HEADER}: expected seconds, above 0 and below 1e6, got {quoted(value)}",
                        param=TIMEOUT_HEADER)  # fmt: skip
    return seconds


def _field(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the body's field path (`messages[0].content[1].type`),
    without the names of union branches pydantic adds."""
    out = ""
    for i, item in enumerate(loc):
        if isinstance(item, int):
            out += f"[{item}]"
        elif i and item == loc[i - 1]:
            continue  # a content part's type tag, then its field of the same name: `image_url.url`
        elif str(item).isidentifier() and item not in ("str", "list", "int", "float", "bool", "none", *_MODELS):
            out += ("." if out else "") + str(item)
    return out or "body"


def first_error(e: ValidationError) -> tuple[str, str]:
    """The most useful error: for `content` (a string or parts) the parts' own, not "not a string"."""
    errors = e.errors()
    deep = [err for err in errors if "str" not in err["loc"]] or errors
    err = max(deep, key=lambda x: len(x["loc"]))
    where = _field(err["loc"])
    if err["type"] == "model_type":  # pydantic names this module's classes: say what JSON is taken
        kinds = {_JSON_KINDS[x["type"]] for x in errors if x["type"] in _JSON_KINDS and _field(x["loc"]) == where}
        return where, "Input should be " + " or ".join(sorted(kinds))
    return where, err["msg"]


_JSON_KINDS = {"model_type": "a JSON object", "string_type": "a string"}  # the union branches of one field


# In a JSON body, half of a UTF-16 pair: an escape (\ud800-\udfff) or its bytes (`json.loads`
# decodes UTF-8 with surrogatepass). Rare; only a body that holds one is walked.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


def _not_text(s: str) -> bool:
    if s.isascii():
        return False
    try:
        s.encode()
    except UnicodeEncodeError:
        return True
    return False


def _path(parts: tuple[str | int, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).removeprefix(".") or "body"


def lone_surrogate(raw: bytes, data: Any) -> str | None:
    """The path of a string (or key) in the parsed body that is not Unicode text, else None.
    JSON lets a string hold half of a UTF-16 pair; Python keeps it, and protobuf, which takes
    only UTF-8, would fail on it far from the field."""
    # (the regex scans a megabyte of base64 media in 3 ms; a byte search rules most bodies out in 1)
    if (b"\\u" not in raw and b"\xed" not in raw) or not _SURROGATE.search(raw):
        return None
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        where, value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(key, str) and _not_text(key):
                return _path(where)  # a key: named by the field that holds it
            if isinstance(item, str):
                if _not_text(item):
                    return _path((*where, key))
            elif isinstance(item, dict | list):
                stack.append(((*where, key), item))
    return None


def _parse_body(raw: bytes, model: type[BodyT]) -> BodyT:
    """The body as `model`, or HttpError naming what is wrong."""
    data = read_json(raw)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        where, msg = first_error(e)
        raise HttpError(400, f"{where}: {msg}", param=where) from None


def read_json(raw: bytes) -> Any:
    """A JSON body's value, or HttpError saying why it is not JSON text."""
    try:  # JSON between systems is UTF-8 (RFC 8259): json.loads would also take UTF-16 and UTF-32,
        # whose escapes the surrogate check below does not see (a surrogate's own bytes it names)
        text = raw.decode("utf-8-sig", errors="surrogatepass")
    except UnicodeDecodeError as e:
        raise HttpError(400, f"body: not UTF-8 (byte {e.start}); JSON bodies are UTF-8") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, a 5000-digit number, nesting past the stack
        raise HttpError(400, f"body: not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if (where := lone_surrogate(raw, data)) is not None:
        raise HttpError(400, f"{where}: not valid Unicode (a lone UTF-16 surrogate)", param=where)
    return data


async def _disconnect(request: Request) -> None:
    """Returns when the client closes its connection. Once the body is read, the ASGI server's
    `receive` answers only `http.disconnect` (or an empty trailing body part), so this notices a
    hang-up at once instead of at the next poll."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the app --------------------------------------------------------------------------------


class Transcripts:
    """The text of each recent spoken reply by its audio id, so a later turn can name the reply
    as OpenAI's `{"role": "assistant", "audio": {"id": ...}}` (bounded; ids live `ttl_s`, as
    the reply's `expires_at` says). Per gateway process: behind several gateway replicas a turn
    may land on one that does not know the id, and gets a 400 saying to send the text instead."""

    def __init__(self, ttl_s: float = AUDIO_TTL_S, capacity: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.ttl_s, self.capacity, self.clock = ttl_s, capacity, clock
        self._items: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def put(self, audio_id: str, text: str) -> None:
        self._items[audio_id] = (self.clock() + self.ttl_s, text)
        self._items.move_to_end(audio_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, audio_id: str) -> str | None:
        item = self._items.get(audio_id)
        if item is None or item[0] < self.clock():
            return None
        return item[1]


async def _read_body(request: Request, limit: int, wait_s: float) -> bytes:
    """The body, refused 413 as soon as it is known to pass `limit` bytes: by its Content-Length
    before any is read, else while it streams in (never held whole first); 408 when the client
    sends none of it for `wait_s` (timeouts.input_wait_timeout_s; 0: no limit)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, f"request body of {int(declared)} bytes is over the limit of {limit}",
                        code="request_too_large")  # fmt: skip
    parts: list[bytes] = []
    size = 0
    pieces = request.stream()
    try:
        while True:
            try:
                async with asyncio.timeout(wait_s or None):
                    part = await anext(pieces)
            except StopAsyncIteration:
                break
            size += len(part)
            if size > limit:
                raise HttpError(413, f"request body over the limit of {limit} bytes", code="request_too_large")
            parts.append(part)
    except ClientDisconnect:  # gone before its body was in: nobody reads the answer
        raise HttpError(499, "the client closed the connection while sending its body",
                        code="client_closed_request") from None  # fmt: skip
    except TimeoutError:
        raise HttpError(408, f"the client sent nothing more of its body for {wait_s:g} s "
                        "(timeouts.input_wait_timeout_s)", code="request_timeout") from None  # fmt: skip
    finally:
        await pieces.aclose()
    return b"".join(parts)


class ChatCompletions:
    """What one HTTP process knows: the gateway service, and the names it serves under."""

    def __init__(self, service: GatewayService) -> None:
        self.service = service
        self.voices = served_voices(service)
        self.stop_ids = {"thinker": service.thinker_defaults.stop_ids}  # what a stage stops on unless told
        if service.cfg.audio_output:
            self.stop_ids["talker"] = service.ckpt.spec.talker_stop_ids()
        self.transcripts = Transcripts()

    async def read(self, request: Request, limit: int, check: Callable[[], Any] | None = None) -> bytes:
        """The body of a request with the right key (if one is set), within `limit` bytes;
        `check()` runs first, before the body is read."""
        if not self.service.check_api_key(request.headers.get("authorization")):
            raise unauthorized()
        if check is not None:
            check()
        encoding = request.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):  # (read as JSON or a form, a gzip body failed as "not UTF-8")
            raise HttpError(415, f"content-encoding {quoted(encoding)}: not supported; send the body uncompressed",
                            param="content-encoding")  # fmt: skip
        return await _read_body(request, limit, self.service.cfg.timeouts.input_wait_timeout_s)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.service.model_name:
            raise unknown_model(name, self.service.model_name)

    async def parse(self, request: Request, model: type[BodyT]) -> BodyT:
        raw = await self.read(request, self.service.cfg.media.max_request_bytes * 4 // 3 + 4096)  # base64: 4/3
        body = _parse_body(raw, model)
        self.check_model(getattr(body, "model", None))
        return body

    async def admit(self, request: Request, make: Make[MadeT]
                    ) -> tuple[MadeT, gateway_pb2.GenerateRequest, float | None] | Response:  # fmt: skip
        """A request let in: `make(headers_checked)` reads and checks its body (the API key
        first, as over gRPC), calls `headers_checked()` once the body is read (the request-id
        header: refused before any work on the body's media), and gives what it parsed and the
        gateway request; then the timeout header. A refusal (HttpError) or a bug in reading it is
        counted, logged and answered: that Response is returned instead."""
        t0, rid = time.perf_counter(), ""
        try:
            raw = request.headers.get(REQUEST_ID_KEY)
            rid = _request_id(raw)
            made, req = await make(lambda: _request_id_header(raw))
            timeout = _timeout_header(request.headers.get(TIMEOUT_HEADER))
            req.request_id = rid
        except HttpError as e:
            return self._refused(e, t0, rid)
        except Exception:  # a bug in reading the body: INTERNAL, with an access line (it had none)
            return self._crashed(t0, rid)
        return made, req, timeout

    async def handle(self, request: Request) -> Response:
        """POST /v1/chat/completions"""

        async def make(headers_checked: Callable[[], object]) -> tuple[ChatRequest, gateway_pb2.GenerateRequest]:
            body = await self.parse(request, ChatRequest)
            headers_checked()
            if "audio" in (body.modalities or ()) and not self.service.cfg.audio_output:
                raise HttpError(400, "modalities: this stack serves text only (no talker); ask for [\"text\"]",
                                param="modalities")  # fmt: skip
            return body, to_generate_request(body, self.voices, self.transcripts.get, self.stop_ids)

        admitted = await self.admit(request, make)
        if isinstance(admitted, Response):
            return admitted
        body, req, timeout = admitted
        if not body.stream:
            return await self.serve(request, req, timeout,
                                    lambda responses: _entry_named(self._whole(req, body, responses), body))
        return await self.serve(request, req, timeout, lambda responses: _entry_named(self.first(responses), body),
                                lambda first, responses: self._stream(req, body, first, responses))  # fmt: skip

    async def speech(self, request: Request) -> Response:
        """POST /v1/audio/speech"""

        async def make(headers_checked: Callable[[], object]) -> tuple[SpeechRequest, gateway_pb2.GenerateRequest]:
            body = await self.parse(request, SpeechRequest)
            headers_checked()
            if not self.service.cfg.audio_output:
                raise HttpError(400, "this stack serves text only (no talker): it cannot speak", code="text_only")
            # the reply and its stop id within the thinker's limit, the prompt not counted yet (off the
            # event loop: the tokenizer encodes one call at a time, a long prompt's build may hold it)
            return body, await asyncio.to_thread(to_speech_request, body, self.voices, self.service.tokenizer,
                                                 self.service.max_prompt_tokens)  # fmt: skip

        admitted = await self.admit(request, make)
        if isinstance(admitted, Response):
            return admitted
        body, req, timeout = admitted
        sse = body.stream_format == "sse"
        media = "text/event-stream" if sse else MIME[req.audio_format]
        if req.audio_format == gateway_pb2.AudioFormat.PCM16 and not sse:  # raw samples: their rate is not in them
            media += f";rate={self.service.sample_rate}"
        # the status waits for the first audio: a stage that fails before it gets its own status
        return await self.serve(request, req, timeout, lambda responses: self.first(responses, audio=True),
                                lambda first, responses: _speech_stream(first, responses, sse, req.request_id),
                                media)  # fmt: skip

    async def transcriptions(self, request: Request) -> Response:
        """POST /v1/audio/transcriptions"""
        return await self._speech_to_text(request, translate=False)

    async def translations(self, request: Request) -> Response:
        """POST /v1/audio/translations"""
        return await self._speech_to_text(request, translate=True)

    async def _speech_to_text(self, request: Request, translate: bool) -> Response:
        """The text of an uploaded file (gateway/transcription.py)."""

        async def make(headers_checked: Callable[[], object]) -> tuple[tuple[bool, bool], gateway_pb2.GenerateRequest]:
            # the key, then the body's type, before any of it is read; the file is one media part
            media = self.service.cfg.media
            body = await self.read(request, min(media.max_request_bytes, media.max_part_bytes) + FORM_OVERHEAD,
                                   check=lambda: check_form_type(request.headers))  # fmt: skip
            upload = await read_form(request.headers, body)
            del body  # (a request holds its file once: in its gateway request)
            self.check_model(upload.form.model)
            headers_checked()
            shape = (bool(upload.form.stream), upload.form.response_format == "text")  # (not the form: its file)
            return shape, to_transcription_request(upload, translate)

        admitted = await self.admit(request, make)
        if isinstance(admitted, Response):
            return admitted
        (stream, text_only), req, timeout = admitted
        # `include[]=logprobs`: the tokens' entries as OpenAI's transcriptions give them (no alternatives)
        ends = self.service.reply_ends(req)
        scores = None if not req.sampling["thinker"].HasField("logprobs") else (
            lambda scored: self.service.pieces.plain(scored, ends))  # fmt: skip
        if stream:
            rid = req.request_id
            return await self.serve(request, req, timeout, lambda responses: _file_named(self.first(responses)),
                                     lambda first, rest: _transcript_events(first, rest, rid, scores))  # fmt: skip
        return await self.serve(request, req, timeout,
                                 lambda responses: _file_named(_transcript(responses, text_only, scores)))  # fmt: skip

    def _crashed(self, t0: float, request_id: str) -> Response:
        log.exception("http: internal error on request %s", request_id)
        error = HttpError(500, internal_failure(request_id).message, "server_error")
        response = self._refused(error, t0, request_id)
        response.headers["x-should-retry"] = "false"  # as `internal_error`'s
        return response

    def _refused(self, e: HttpError, t0: float, request_id: str) -> Response:
        """A request refused before it started: counted, logged with its reason, how long it took
        (a body that stopped coming: the wait) and its id (its client's, else the gateway's own,
        in the reply's header as any reply's), answered."""
        self.service.refused("http", refusal_outcome(e.status), e.message, time.perf_counter() - t0, request_id)
        response = e.response()
        if request_id:
            response.headers[REQUEST_ID_KEY] = request_id
        return response

    async def serve(self, request: Request, req: gateway_pb2.GenerateRequest, timeout: float | None,
                    start: Callable[[Replies], Awaitable[Any]],
                    stream: Callable[[Any, Replies], AsyncIterator[str | bytes]] | None = None,
                    media_type: str = "text/event-stream") -> Response:  # fmt: skip
        """Run `req`: `start(replies)` gives a whole Response or, with `stream`, the first piece
        that `stream(first, replies)` goes on from. Nothing is sent until `start` returns, so a
        request the gateway or a stage refuses gets its own status; a hang-up meanwhile cancels
        it down the chain."""
        req.request_id = req.request_id or uuid.uuid4().hex
        headers = {REQUEST_ID_KEY: req.request_id}
        responses = self._responses(req, timeout)
        task = asyncio.ensure_future(start(responses))
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            try:
                await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # this handler was cancelled: so is the request
                await _cancel(task, responses)
                raise
            if not task.done():  # the client went away: its request is cancelled down the chain
                await _cancel(task, responses)
                return Response(status_code=499)
            result = task.result()
        except HttpError as e:
            await responses.aclose()
            response = e.response()
            response.headers.update(headers)
            return response
        except Exception:  # a bug: the request's calls are not left to the generator's finalizer
            await fail_replies(responses, internal_failure(req.request_id))  # (closed, it would count CANCELLED)
            await responses.aclose()
            raise
        finally:
            gone.cancel()
            # This frame is in the traceback of the error `task` holds: a cycle, which would keep
            # the request (its decoded media: up to media.max_decoded_bytes) to a later GC pass.
            del task
        if stream is None:
            result.headers.update(headers)
            return result  # type: ignore[no-any-return]
        headers.update({"cache-control": "no-cache", "x-accel-buffering": "no"})
        # `stream` closes `responses` when it ends; a client gone before it ever ran leaves that
        # to the background task (the request is then cancelled down the chain at once)
        return _Delivered(stream(result, responses), media_type=media_type, headers=headers,
                          background=BackgroundTask(responses.aclose),
                          deliver=lambda write: self.service.deliver(write, responses, req.request_id))  # fmt: skip

    def _responses(self, req: gateway_pb2.GenerateRequest, timeout: float | None) -> Replies:
        return self.service.serve(req, timeout, "http")

    @staticmethod
    async def first(responses: Replies, audio: bool = False) -> list[gateway_pb2.GenerateResponse]:
        """The reply's pieces up to its first (`audio`: up to its first audio or its end); a
        refusal as an HttpError (`audio`: the speech endpoint's, whose text is `input`)."""
        pieces: list[gateway_pb2.GenerateResponse] = []
        try:
            async for resp in responses:
                pieces.append(resp)
                if not audio or resp.WhichOneof("kind") in ("audio", "final"):
                    break
        except GatewayError as e:
            error = from_gateway_error(e)
            if audio and error.param in ("messages", "prompt", "max_tokens"):
                error.param = "input"
            raise error from None
        return pieces

    async def _whole(self, req: gateway_pb2.GenerateRequest, body: ChatRequest, responses: Replies) -> Response:
        scored: list[gateway_pb2.TokenLogprob] = []
        return await whole_of(
            responses, lambda text, audio, final: self._whole_reply(req, body, text, audio, final, scored), scored)

    def _logprobs(self, req: gateway_pb2.GenerateRequest, scored: Iterable[gateway_pb2.TokenLogprob]) -> Any:
        """A choice's `logprobs`: null unless the request asked for them."""
        if not req.sampling["thinker"].HasField("logprobs"):
            return None
        return {"content": self.service.pieces.entries(scored, self.service.reply_ends(req)), "refusal": None}

    def _whole_reply(self, req: gateway_pb2.GenerateRequest, body: ChatRequest, text: str, audio: list[bytes],
                     final: gateway_pb2.Final,
                     scored: Iterable[gateway_pb2.TokenLogprob] = ()) -> Response:  # fmt: skip
        created = int(time.time())
        content, calls = parse_calls(text, callable_names(body)) if req.tools else (text, [])
        calls = calls[: _most_calls(body)]
        finish = "tool_calls" if calls else final.finish_reason or "stop"
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        said = spoken(text) if req.tools else text
        if req.want_audio and (said or not calls):  # (with tools, its talker input ended where the first call starts)
            audio_id = _audio_id()
            self.transcripts.put(audio_id, said)
            message["audio"] = {"id": audio_id, "data": base64.b64encode(b"".join(audio)).decode(),
                                "expires_at": created + AUDIO_TTL_S, "transcript": said}  # fmt: skip
        return JSONResponse({
            "id": f"chatcmpl-{req.request_id}", "object": "chat.completion", "created": created,
            "model": self.service.model_name,
            "choices": [{"index": 0, "message": message, "logprobs": self._logprobs(req, scored),
                         "finish_reason": finish}],
            "usage": chat_usage(final.usage),
        })  # fmt: skip

    def _stream(self, req: gateway_pb2.GenerateRequest, body: ChatRequest,
                first: list[gateway_pb2.GenerateResponse], responses: Replies) -> AsyncIterator[str]:  # fmt: skip
        created = int(time.time())
        rid = req.request_id
        audio_id = _audio_id()

        scores = req.sampling["thinker"].HasField("logprobs")
        ends = self.service.reply_ends(req)

        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            event = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
                     "model": self.service.model_name, "choices": [choice], **extra}  # fmt: skip
            return sse_event(event)

        named = False  # OpenAI's SDK joins a string a delta repeats: the audio's id is in the first delta alone

        def audio(**fields: Any) -> dict[str, Any]:
            nonlocal named
            if not named:
                named = True
                return {"id": audio_id, **fields}
            return fields

        def audio_chunk(data: bytes) -> str:
            return chunk({"audio": audio(data=base64.b64encode(data).decode())})

        async def pieces() -> AsyncGenerator[str, None]:
            text: list[str] = []
            held = b""  # audio bytes past the last whole AUDIO_ALIGN
            scored = Held()
            calls = CallStream() if req.tools else None  # the reply's text, read for tool calls
            # with tools, audio waits until something is said: a reply that only calls has none (its
            # audio is a whole-file format's empty file at most), as OpenAI gives it
            speaking = calls is None
            unsaid: list[bytes] = []

            def shown_logprobs() -> Any:  # (the entries of the tokens whose text goes out now)
                return {"content": scored.take(), "refusal": None} if scores else None

            def audio_out(data: bytes) -> list[str]:
                if not speaking:
                    unsaid.append(data)
                    return []
                out = [audio_chunk(piece) for piece in [*unsaid, data] if piece]
                unsaid.clear()
                return out

            yield chunk({"role": "assistant", "content": "", "refusal": None})
            async for resp in chain(first, responses):
                kind = resp.WhichOneof("kind")
                if kind == "text" and scores:
                    scored.add(self.service.pieces.entries(resp.text.logprobs, ends))
                shown = resp.text.text if calls is None or kind != "text" else calls.feed(resp.text.text)
                if kind == "text" and shown:
                    speaking = True
                    for out in audio_out(b""):
                        yield out
                    text.append(shown)
                    delta: dict[str, Any] = {"content": shown}
                    if req.want_audio:
                        delta["audio"] = audio(transcript=shown)
                    yield chunk(delta, logprobs=shown_logprobs())
                elif kind == "audio":
                    data = held + resp.audio.data
                    cut = len(data) - len(data) % AUDIO_ALIGN
                    held = data[cut:]
                    for out in audio_out(data[:cut]):
                        yield out
                elif kind == "final":
                    for out in audio_out(held):
                        yield out
                    held = b""
                    finish = resp.final.finish_reason or "stop"
                    if calls is not None:  # the content held back, and the calls
                        content, made = calls.finish(callable_names(body))
                        made = made[: _most_calls(body)]
                        rest: dict[str, Any] = {"content": content} if content else {}
                        if req.want_audio and (said := calls.spoken_rest()):  # (the words after a call: unsaid)
                            speaking = True
                            text.append(said)
                            rest["audio"] = audio(transcript=said)
                        if rest:  # (with the logprobs of the tokens that show it)
                            yield chunk(rest, logprobs=shown_logprobs())
                        if made:
                            yield chunk({"tool_calls": [c.openai(i) for i, c in enumerate(made)]})
                            finish = "tool_calls"
                        speaking = speaking or not made  # (a reply that calls nothing keeps its audio, said or not)
                        for out in audio_out(b""):
                            yield out
                    if req.want_audio and speaking:  # (its whole transcript: the words held back to the end too)
                        self.transcripts.put(audio_id, "".join(text))
                        # the last audio update holds only when its id expires (OpenAI's ChoiceDeltaAudio)
                        yield chunk({"audio": audio(expires_at=created + AUDIO_TTL_S)})
                    # (tokens whose text never showed: the part of a stop text held back, a call, say)
                    left = {"content": unsent, "refusal": None} if scores and (unsent := scored.take()) else None
                    yield chunk({}, finish, left)
                    if body.stream_options is not None and body.stream_options.include_usage:
                        event = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
                                 "model": self.service.model_name, "choices": [],
                                 "usage": chat_usage(resp.final.usage)}  # fmt: skip
                        yield sse_event(event)
            yield "data: [DONE]\n\n"

        # the status line went out already: an error is the stream's last event
        return ended_well(pieces(), responses, rid, lambda e: sse_event(from_gateway_error(e).body()))


class _Delivered(StreamingResponse):
    """A streamed reply whose pieces go out through `deliver` (GatewayService.deliver): a client
    that takes none of them for output_stall_timeout_s fails its request, and its connection is
    closed (uvicorn closes one whose reply did not complete)."""

    def __init__(self, content: AsyncIterator[str | bytes], *, deliver: Callable[[Awaitable[None]], Awaitable[None]],
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(content, **kwargs)
        self.deliver = deliver

    async def stream_response(self, send: Send) -> None:
        async def timed(message: AsgiMessage) -> None:
            await self.deliver(send(message))

        with contextlib.suppress(GatewayError):  # (the request's access line says why)
            await super().stream_response(timed)


async def _cancel(task: asyncio.Future[Any], responses: Replies) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, HttpError):
        await task
    await responses.aclose()


async def chain(first: list[gateway_pb2.GenerateResponse], rest: Replies) -> Replies:
    for resp in first:
        yield resp
    async for resp in rest:
        yield resp


PieceT = TypeVar("PieceT", bound=str | bytes)


async def ended_well(pieces: AsyncGenerator[PieceT, None], responses: Replies, request_id: str,
                     failed: Callable[[GatewayError], PieceT | None]) -> AsyncIterator[PieceT]:  # fmt: skip
    """A streamed reply's `pieces`, ended as every stream here ends: a failure once the status
    line is out is the stream's last piece, `failed(e)` (None: the connection is cut instead);
    a bug fails the request INTERNAL, as over gRPC (closed first, it would count CANCELLED); the
    replies are closed however it ends."""
    try:
        async for piece in pieces:
            yield piece
    except GatewayError as e:
        last = failed(e)
        if last is None:
            raise
        yield last
    except Exception:
        await fail_replies(responses, internal_failure(request_id))
        raise
    finally:
        try:
            await pieces.aclose()
        finally:
            await responses.aclose()


def _speech_stream(first: list[gateway_pb2.GenerateResponse], responses: Replies,
                   sse: bool, request_id: str) -> AsyncIterator[str | bytes]:  # fmt: skip
    """The speech's bytes as they are encoded, or OpenAI's speech events (`sse`). An error after
    the first audio ends the bytes early (an `error` event with `sse`)."""

    async def pieces() -> AsyncGenerator[str | bytes, None]:
        async for resp in chain(first, responses):
            kind = resp.WhichOneof("kind")
            if kind == "audio" and resp.audio.data:
                if not sse:
                    yield resp.audio.data
                    continue
                event = {"type": "speech.audio.delta", "audio": base64.b64encode(resp.audio.data).decode()}
                yield sse_event(event)
            elif kind == "final" and sse:
                u = chat_usage(resp.final.usage)  # the output counts the speech's frames, as a chat reply's does
                usage = _io_usage(u["prompt_tokens"], u["completion_tokens"])
                yield sse_event({"type": "speech.audio.done", "usage": usage})

    def failed(e: GatewayError) -> str | None:
        log.warning("speech ended early: %s", e.message)
        # raw bytes: the connection is cut, not closed as if the audio were whole
        return sse_event({"type": "error", **from_gateway_error(e).body()}) if sse else None

    return ended_well(pieces(), responses, request_id, failed)


async def _file_named(call: Awaitable[ResultT]) -> ResultT:
    """A refusal of what a speech-to-text request put in its chat turn names the form's `file`
    (the turn is the file and an instruction: a media or length error is the file's)."""
    try:
        return await call
    except HttpError as e:
        raise _of_file(e) from None


_TURN_PART = re.compile(r"^messages\[\d+\]\.content\[\d+\]")


def _of_file(e: HttpError) -> HttpError:
    """The gateway's refusal of the chat turn a speech-to-text form became, in the form's terms."""
    if e.param is not None and e.param.startswith("messages"):
        e.param = "file"
        e.message = _TURN_PART.sub("file", e.message)
        if e.message.startswith("prompt: "):  # the turn's length: the file's tokens and the instruction's
            e.message = "file: the audio and its instruction: " + e.message.removeprefix("prompt: ")
    return e


async def whole_of(responses: Replies, reply: Callable[[str, list[bytes], gateway_pb2.Final], Response],
                   scored: list[gateway_pb2.TokenLogprob] | None = None) -> Response:  # fmt: skip
    """A whole reply: `reply(text, audio pieces, final)`, made while `responses` waits at its
    final, so that a bug in making it fails the request INTERNAL (once it ended it counts OK).
    `scored` gets the tokens' log-probabilities, where the reply has them."""
    text: list[str] = []
    audio: list[bytes] = []
    made: Response | None = None
    try:
        async for resp in responses:
            kind = resp.WhichOneof("kind")
            if kind == "text":
                text.append(resp.text.text)
                if scored is not None:
                    scored.extend(resp.text.logprobs)
            elif kind == "audio":
                audio.append(resp.audio.data)
            else:
                made = reply("".join(text), audio, resp.final)
    except GatewayError as e:
        raise from_gateway_error(e) from None
    return made if made is not None else reply("".join(text), audio, gateway_pb2.Final())


Scores = Callable[[Iterable[gateway_pb2.TokenLogprob]], list[dict[str, Any]]]


async def _transcript(responses: Replies, text_only: bool, scores: Scores | None = None) -> Response:
    """The whole transcript: OpenAI's `{"text", "usage"}` (with `logprobs`, as `scores` writes
    them, where asked), or the text alone (`text_only`)."""
    scored: list[gateway_pb2.TokenLogprob] = []

    def reply(text: str, _audio: list[bytes], final: gateway_pb2.Final) -> Response:
        if text_only:
            return PlainTextResponse(text)
        logprobs = {"logprobs": scores(scored)} if scores is not None else {}
        return JSONResponse({"text": text, **logprobs, "usage": stt_usage(final.usage)})

    return await whole_of(responses, reply, scored)


def _transcript_events(first: list[gateway_pb2.GenerateResponse], responses: Replies,
                       request_id: str, scores: Scores | None = None) -> AsyncIterator[str]:  # fmt: skip
    """OpenAI's transcription events: a `transcript.text.delta` per piece of text as it is made,
    then `transcript.text.done` (an `error` event after a failure once the stream began); with
    `scores`, each carries its tokens' `logprobs` (a token whose text is not out yet, with the
    next text; one whose text never shows, as a special token before the end, in the last alone),
    the last all of them."""

    async def pieces() -> AsyncGenerator[str, None]:
        text: list[str] = []
        scored = Held()
        async for resp in chain(first, responses):
            kind = resp.WhichOneof("kind")
            if kind == "text" and scores is not None:
                scored.add(scores(resp.text.logprobs))
            if kind == "text" and resp.text.text:
                text.append(resp.text.text)
                event: dict[str, Any] = {"type": "transcript.text.delta", "delta": resp.text.text}
                if scores is not None:
                    event["logprobs"] = scored.take()
                yield sse_event(event)
            elif kind == "final":
                done: dict[str, Any] = {"type": "transcript.text.done", "text": "".join(text)}
                if scores is not None:
                    done["logprobs"] = scored.every
                yield sse_event({**done, "usage": stt_usage(resp.final.usage)})

    def failed(e: GatewayError) -> str:
        log.warning("transcript ended early: %s", e.message)
        return sse_event({"type": "error", **_of_file(from_gateway_error(e)).body()})

    return ended_well(pieces(), responses, request_id, failed)


def _io_usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """Usage as OpenAI's audio endpoints say it: input and output tokens."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}


def stt_usage(u: gateway_pb2.Usage) -> dict[str, Any]:
    """A transcription's usage as OpenAI gives a token-billed one (the input counts the audio's)."""
    return {"type": "tokens", **_io_usage(u.prompt_tokens, u.completion_tokens)}


def chat_usage(u: gateway_pb2.Usage) -> dict[str, Any]:
    """OpenAI's usage: its completion tokens count the audio's too (here the talker's codec
    frames, one per talker step), broken out in `completion_tokens_details`."""
    completion = u.completion_tokens + u.audio_frames
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
            "total_tokens": u.prompt_tokens + completion,
            "completion_tokens_details": {"text_tokens": u.completion_tokens,
                                          "audio_tokens": u.audio_frames}}  # fmt: skip
