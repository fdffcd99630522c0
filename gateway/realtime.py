"""OpenAI's Realtime API on a WebSocket, `/v1/realtime` (what the `openai` SDK's
`client.realtime.connect()` opens): a conversation whose turns are spoken or typed, each answered
with speech and its transcript (or text) as they are made. Every `response.create` is one request
through the same path as `Gateway.Generate` (`GatewayService.serve`), whose chat turns are the
conversation so far; this module only translates. Nothing is kept once the connection closes.

Client events taken (a field this server cannot honour is refused with an `error` event naming
it, never ignored; the session goes on):
* `session.update`: `instructions` (the system turn), `output_modalities` ["audio"] (speech and its
  transcript, the default) or ["text"], `max_output_tokens` (1 to 4096, or "inf"),
  `temperature` (the API's beta field: 0 makes text and speech greedy, as chat's temperature 0),
  `audio.output.voice` (the checkpoint's speakers, or one of OpenAI's names for its default) and
  `.speed` (0.25 to 1.5), `audio.input.format` / `audio.output.format` `audio/pcm`: 16-bit mono
  little-endian (input at any rate from 8 to 192 kHz, output at the model's, 24 kHz). Turn
  detection is off (`turn_detection` must be null): the client says when a turn ends by committing
  its audio, then asks for a response (push-to-talk). No input transcription, tools or prompts.
* `input_audio_buffer.append` (base64 PCM), `.commit` (the buffer becomes a user item), `.clear`.
* `conversation.item.create` (a message: user `input_text`, `input_audio`, `input_image`;
  system `input_text`; assistant `output_text` or `output_audio` by its `transcript`), with
  `previous_item_id` ("root" or an item's id), `.delete`, `.retrieve`.
* `response.create` (`instructions`, `output_modalities`, `max_output_tokens`, `temperature`,
  `audio.output.voice`, `metadata`), `response.cancel`. One response at a time.

Server events sent: `session.created` / `.updated`, `input_audio_buffer.committed` / `.cleared`,
`conversation.item.added` / `.done` / `.deleted` / `.retrieved`, `response.created`,
`response.output_item.added`, `response.content_part.added`, then as each piece exists
`response.output_audio_transcript.delta` and `response.output_audio.delta` (or
`response.output_text.delta`), their `.done`s, `response.content_part.done`,
`response.output_item.done`, and `response.done` with its status (completed; incomplete at
max_output_tokens; cancelled; failed, with the error) and usage. `error` for a refused event.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.http_api import apply_temperature, from_gateway_error, served_voices, unknown_model, voice_speaker
from gateway.http_error import HttpError
from gateway.server import GatewayError, GatewayService, fail_replies, internal_failure
from omnistage.v1 import gateway_pb2, stage_pb2

__all__ = ["RealtimeError", "Settings", "realtime_route"]

log = logging.getLogger(__name__)

MIN_INPUT_RATE, MAX_INPUT_RATE = 8_000, 192_000
MAX_OUTPUT_TOKENS = 4096  # OpenAI's bound on `max_output_tokens`
SPEED_RANGE = (0.25, 1.5)  # OpenAI's Realtime `audio.output.speed`


class RealtimeError(Exception):
    """A client event refused: sent as an `error` event; the session goes on."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


# ---- what a client may send ---------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PcmFormat(_Strict):
    type: Literal["audio/pcm"]
    rate: int | None = None


class InputAudioConfig(_Strict):
    format: PcmFormat | None = None
    transcription: Any = None
    noise_reduction: Any = None
    turn_detection: Any = None


class OutputAudioConfig(_Strict):
    format: PcmFormat | None = None
    voice: str | None = None
    speed: float | None = None


class AudioConfig(_Strict):
    input: InputAudioConfig | None = None
    output: OutputAudioConfig | None = None


class ResponseAudioConfig(_Strict):
    output: OutputAudioConfig | None = None


MaxTokens = Annotated[int, Field(ge=1, le=MAX_OUTPUT_TOKENS)] | Literal["inf"]
Modalities = Annotated[list[Literal["audio", "text"]], Field(min_length=1, max_length=1)]


class _Common(_Strict):
    """Fields a session and a response share; those with no counterpart here must be unset."""

    instructions: str | None = None
    output_modalities: Modalities | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: float | None = Field(None, ge=0, le=2)  # (the Realtime API's beta field; 0: deterministic)
    tools: list[Any] | None = None
    tool_choice: Any = None
    prompt: Any = None


class SessionBody(_Common):
    type: Literal["realtime"] | None = None  # ("transcription" sessions: no)
    model: str | None = None
    audio: AudioConfig | None = None
    include: list[Any] | None = None
    tracing: Any = None  # (OpenAI's dashboard: nothing is traced here)
    truncation: Any = None
    parallel_tool_calls: bool | None = None
    reasoning: Any = None


class ResponseBody(_Common):
    conversation: str | None = None
    input: Any = None
    audio: ResponseAudioConfig | None = None
    metadata: dict[str, str] | None = None


class InputTextPart(_Strict):
    type: Literal["input_text"]
    text: str


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    audio: str
    transcript: str | None = None


class InputImagePart(_Strict):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None


class OutputTextPart(_Strict):
    type: Literal["output_text", "text"]
    text: str


class OutputAudioPart(_Strict):
    type: Literal["output_audio", "audio"]
    transcript: str
    audio: str | None = None


Part = Annotated[InputTextPart | InputAudioPart | InputImagePart | OutputTextPart | OutputAudioPart,
                 Field(discriminator="type")]  # fmt: skip
ROLE_PARTS = {"user": ("input_text", "input_audio", "input_image"), "system": ("input_text",),
              "assistant": ("output_text", "text", "output_audio", "audio")}  # fmt: skip


class MessageItem(_Strict):
    id: str | None = Field(None, min_length=1, max_length=64)
    type: Literal["message"]
    object: Literal["realtime.item"] | None = None
    role: Literal["user", "system", "assistant"]
    status: str | None = None
    content: Annotated[list[Part], Field(min_length=1)]


ModelT = TypeVar("ModelT", bound=BaseModel)
Replies = AsyncGenerator[gateway_pb2.GenerateResponse, None]


def _where(loc: tuple[Any, ...], prefix: str) -> str:
    out = prefix
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif str(item).isidentifier() and not str(item).endswith("Part") and item not in ("str", "int", "list"):
            out += f".{item}"
    return out


def _parse(model: type[ModelT], data: Any, prefix: str) -> ModelT:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        where = _where(err["loc"], prefix)
        raise RealtimeError(f"{where}: {err['msg']}", where) from None


# ---- the session's state ------------------------------------------------------------------------


@dataclass
class Settings:
    """What a response is made with: the session's settings, or one response's own."""

    instructions: str = ""
    modality: str = "audio"  # "audio": speech and its transcript; "text"
    max_output_tokens: int | None = None  # None: "inf", the model's own limit
    voice: str = ""  # as the client named it ("": the checkpoint's default speaker)
    speaker: str = ""
    speed: float = 1.0
    input_rate: int = 24_000
    temperature: float | None = None  # None: the checkpoint's sampling

    def merged(self, body: _Common, voices: list[str], prefix: str, output: OutputAudioConfig | None,
               sample_rate: int) -> Settings:  # fmt: skip
        """These settings with `body`'s (None: unchanged); RealtimeError names a field it cannot honour."""
        _unsupported(body, prefix)
        out = Settings(**self.__dict__)
        if body.instructions is not None:
            out.instructions = body.instructions
        if body.output_modalities is not None:
            out.modality = body.output_modalities[0]
            if out.modality == "audio" and not voices:
                raise RealtimeError(f"{prefix}.output_modalities: this stack serves text only (no talker); "
                                    "ask for [\"text\"]", f"{prefix}.output_modalities")  # fmt: skip
        if body.max_output_tokens is not None:
            out.max_output_tokens = None if body.max_output_tokens == "inf" else body.max_output_tokens
        if body.temperature is not None:
            out.temperature = body.temperature
        if output is not None:
            where = f"{prefix}.audio.output"
            if output.format is not None and output.format.rate not in (None, sample_rate):
                raise RealtimeError(f"{where}.format.rate: this model speaks at {sample_rate} Hz",
                                    f"{where}.format.rate")  # fmt: skip
            if output.voice is not None:
                try:
                    out.speaker = voice_speaker(output.voice, voices, f"{where}.voice")
                except HttpError as e:
                    raise RealtimeError(e.message, e.param) from None
                out.voice = output.voice
            if output.speed is not None:
                if not SPEED_RANGE[0] <= output.speed <= SPEED_RANGE[1]:
                    raise RealtimeError(f"{where}.speed: {output.speed} is not within {SPEED_RANGE[0]} to "
                                        f"{SPEED_RANGE[1]}", f"{where}.speed")  # fmt: skip
                out.speed = output.speed
        return out

    def session_fields(self, sample_rate: int) -> dict[str, Any]:
        return ({"temperature": self.temperature} if self.temperature is not None else {}) | {
            "instructions": self.instructions, "output_modalities": [self.modality],
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
            "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": self.input_rate}, "transcription": None,
                          "noise_reduction": None, "turn_detection": None},
                "output": {"format": {"type": "audio/pcm", "rate": sample_rate}, "voice": self.voice or None,
                           "speed": self.speed},
            },
        }  # fmt: skip


def _unsupported(body: _Common, prefix: str) -> None:
    if body.tools:
        raise RealtimeError(f"{prefix}.tools: this server calls no tools", f"{prefix}.tools")
    if body.tool_choice not in (None, "auto", "none"):
        raise RealtimeError(f"{prefix}.tool_choice: this server calls no tools (auto or none)", f"{prefix}.tool_choice")
    if body.prompt is not None:
        raise RealtimeError(f"{prefix}.prompt: no stored prompts here; send the instructions", f"{prefix}.prompt")


def _session_only(body: SessionBody) -> None:
    """The session fields with no counterpart here: refused unless unset (or what they already are)."""
    audio_in = body.audio.input if body.audio is not None else None
    if audio_in is not None:
        where = "session.audio.input"
        if audio_in.turn_detection is not None:
            raise RealtimeError(f"{where}.turn_detection: this server does not detect the end of a turn; set it "
                                "null, then commit the input audio buffer and send response.create",
                                f"{where}.turn_detection", "unsupported_turn_detection")  # fmt: skip
        if audio_in.transcription is not None:
            raise RealtimeError(f"{where}.transcription: input audio is not transcribed here (null); "
                                "/v1/audio/transcriptions does it", f"{where}.transcription")  # fmt: skip
        if audio_in.noise_reduction is not None:
            raise RealtimeError(f"{where}.noise_reduction: no noise reduction here (null)",
                                f"{where}.noise_reduction")  # fmt: skip
    if body.include:
        raise RealtimeError("session.include: no input transcription logprobs here", "session.include")
    if body.truncation not in (None, "disabled"):
        raise RealtimeError("session.truncation: a conversation is never truncated here (disabled): one over "
                            "the model's length fails its response; delete items instead",
                            "session.truncation")  # fmt: skip
    if body.reasoning is not None:
        raise RealtimeError("session.reasoning: not configurable here", "session.reasoning")


@dataclass
class Item:
    """A conversation item: its chat turn, and what events say of it."""

    id: str
    role: str
    parts: list[gateway_pb2.ContentPart] = field(default_factory=list)  # user and system turns
    text: str = ""  # an assistant turn's words
    content: list[dict[str, Any]] = field(default_factory=list)  # as events show it (no audio data)
    status: str = "completed"
    nbytes: int = 0  # media it holds

    def event(self) -> dict[str, Any]:
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": self.content}  # fmt: skip

    def message(self) -> gateway_pb2.ChatMessage:
        if self.role == "assistant":
            return gateway_pb2.ChatMessage(role="assistant", content=self.text)
        return gateway_pb2.ChatMessage(role=self.role, parts=self.parts)


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RealtimeError(f"{where}: not valid base64", where) from None


def _pcm_part(pcm16: bytes, rate: int, where: str) -> gateway_pb2.ContentPart:
    if len(pcm16) % 2:
        raise RealtimeError(f"{where}: audio/pcm needs whole 16-bit samples", where)
    f32 = (np.frombuffer(pcm16, "<i2").astype(np.float32) / 32768).astype("<f4").tobytes()
    return gateway_pb2.ContentPart(audio=gateway_pb2.AudioPart(pcm=gateway_pb2.RawAudio(f32le=f32, sample_rate=rate)))


def _image_part(url: str, where: str) -> gateway_pb2.ContentPart:
    head, sep, data = url.partition(",")
    if not (sep and head.startswith("data:") and head.endswith(";base64")):
        raise RealtimeError(f"{where}: a data URL (data:image/...;base64,...) is taken; nothing is fetched", where)
    return gateway_pb2.ContentPart(image=gateway_pb2.ImagePart(file=_b64(data, where)))


def to_item(body: MessageItem, item_id: str, input_rate: int, prefix: str = "item") -> Item:
    """A client's message item as a conversation item (RealtimeError naming a part it cannot be)."""
    item = Item(item_id, body.role)
    words: list[str] = []
    for j, part in enumerate(body.content):
        where = f"{prefix}.content[{j}]"
        if part.type not in ROLE_PARTS[body.role]:
            raise RealtimeError(f"{where}.type: a {body.role} message takes {', '.join(ROLE_PARTS[body.role])}",
                                f"{where}.type")  # fmt: skip
        if isinstance(part, InputTextPart):
            item.parts.append(gateway_pb2.ContentPart(text=part.text))
            item.content.append({"type": "input_text", "text": part.text})
        elif isinstance(part, InputAudioPart):
            item.parts.append(_pcm_part(_b64(part.audio, f"{where}.audio"), input_rate, f"{where}.audio"))
            item.content.append({"type": "input_audio", "transcript": part.transcript})
        elif isinstance(part, InputImagePart):
            item.parts.append(_image_part(part.image_url, f"{where}.image_url"))
            item.content.append({"type": "input_image"})
        elif isinstance(part, OutputTextPart):
            words.append(part.text)
            item.content.append({"type": "output_text", "text": part.text})
        else:
            words.append(part.transcript)
            item.content.append({"type": "output_audio", "transcript": part.transcript})
    item.text = "".join(words)
    item.nbytes = sum(len(p.audio.pcm.f32le) + len(p.image.file) for p in item.parts)
    return item


def to_generate_request(items: list[Item], settings: Settings) -> gateway_pb2.GenerateRequest:
    """One response's request: the conversation's turns, under the settings' instructions."""
    if not any(i.role != "assistant" for i in items) and not settings.instructions:
        raise RealtimeError("response.create: the conversation is empty; commit input audio or create an item "
                            "first", code="empty_conversation")  # fmt: skip
    audio = settings.modality == "audio"
    req = gateway_pb2.GenerateRequest(want_audio=audio, audio_format=gateway_pb2.AudioFormat.PCM16)
    if audio:
        req.speaker = settings.speaker
        if settings.speed != 1.0:
            req.speed = settings.speed
    if settings.instructions:
        req.messages.append(gateway_pb2.ChatMessage(role="system", content=settings.instructions))
    req.messages.extend(i.message() for i in items)
    thinker = stage_pb2.SamplingParams()
    if settings.max_output_tokens is not None:
        thinker.max_tokens = settings.max_output_tokens
    if settings.temperature is not None:
        apply_temperature(req, thinker, settings.temperature, seeded=False)
    req.sampling["thinker"].CopyFrom(thinker)
    return req


def _new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex[:24]}"


class _Gone(Exception):
    """The client stopped taking events (closed, or took none for output_stall_timeout_s)."""


# ---- one connection -----------------------------------------------------------------------------


class RealtimeSession:
    """One WebSocket's conversation: its settings, input audio buffer and items; one response at a time."""

    def __init__(self, service: GatewayService, ws: WebSocket, voices: list[str]) -> None:
        self.service, self.ws, self.voices = service, ws, voices
        self.id = _new_id("sess")
        self.settings = Settings(modality="audio" if voices else "text")
        self.buffer = bytearray()
        self.items: dict[str, Item] = {}  # in conversation order
        self.active: Response | None = None  # the response being made, and its task
        self.task: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()  # one event on the wire at a time
        self.events = itertools.count()
        # a request's media, all of it in one conversation (its every turn goes into each request)
        self.max_bytes = service.cfg.media.max_request_bytes

    # -- sending
    async def send(self, event: dict[str, Any]) -> None:
        text = json.dumps({"type": event.pop("type"), "event_id": f"event_{next(self.events)}", **event})
        async with self.lock:
            await self.ws.send_text(text)

    async def error(self, e: RealtimeError, event_id: str | None) -> None:
        await self.send({"type": "error", "error": {"type": "invalid_request_error", "code": e.code,
                                                    "message": e.message, "param": e.param,
                                                    "event_id": event_id}})  # fmt: skip

    def session_event(self, kind: str) -> dict[str, Any]:
        session = {"type": "realtime", "object": "realtime.session", "id": self.id, "model": self.service.model_name,
                   **self.settings.session_fields(self.service.sample_rate), "tools": [], "tool_choice": "auto",
                   "tracing": None, "truncation": "disabled", "prompt": None, "include": None}  # fmt: skip
        return {"type": kind, "session": session}

    # -- the connection
    async def run(self) -> None:
        await self.send(self.session_event("session.created"))
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                event: Any = None
                try:
                    event = self._event(message)
                    await self.handle(event)
                except RealtimeError as e:
                    event_id = event.get("event_id") if isinstance(event, dict) else None
                    await self.error(e, event_id if isinstance(event_id, str) else None)
        except (WebSocketDisconnect, _Gone):
            return
        finally:
            if self.task is not None:  # the client is gone: its response is cancelled down the chain
                self.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.task

    @staticmethod
    def _event(message: dict[str, Any]) -> Any:
        text = message.get("text")
        if text is None:
            raise RealtimeError("events are JSON in text frames, not binary ones", code="invalid_event")
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as e:
            raise RealtimeError(f"not valid JSON ({type(e).__name__})", code="invalid_json") from None

    async def handle(self, event: Any) -> None:
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise RealtimeError("an event is a JSON object with a string `type`", "type", "invalid_event")
        kind = event["type"]
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise RealtimeError(f"type: unknown or unsupported client event {kind[:100]!r}", "type",
                                "invalid_event")  # fmt: skip
        body = {k: v for k, v in event.items() if k not in ("type", "event_id")}
        await handler(self, body)

    def _held(self) -> int:
        return 2 * len(self.buffer) + sum(i.nbytes for i in self.items.values())  # (the buffer: float32 once committed)

    def _room(self, more: int, where: str) -> None:
        if self._held() + more > self.max_bytes:
            raise RealtimeError(f"{where}: the conversation would hold more than media.max_request_bytes "
                                f"({self.max_bytes}) of media; delete items first", where,
                                "conversation_too_large")  # fmt: skip

    def insert(self, item: Item, previous: str | None) -> str | None:
        """Puts `item` after `previous` (None: last; "root": first); gives the id before it."""
        ids = list(self.items)
        if previous is None:
            at = len(ids)
        elif previous == "root":
            at = 0
        elif previous in self.items:
            at = ids.index(previous) + 1
        else:
            raise RealtimeError(f"previous_item_id: no item {previous[:64]!r}", "previous_item_id", "item_not_found")
        pairs = [*((k, self.items[k]) for k in ids[:at]), (item.id, item), *((k, self.items[k]) for k in ids[at:])]
        self.items = dict(pairs)
        return ids[at - 1] if at else None

    async def _added(self, item: Item, previous: str | None) -> None:
        await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item.event()})
        await self.send({"type": "conversation.item.done", "previous_item_id": previous, "item": item.event()})

    # -- client events
    async def session_update(self, body: dict[str, Any]) -> None:
        if set(body) != {"session"}:
            raise RealtimeError("session.update takes `session` alone", "session", "invalid_event")
        s = _parse(SessionBody, body["session"], "session")
        if s.model is not None and s.model != self.service.model_name:
            raise RealtimeError(f"session.model: {unknown_model(s.model, self.service.model_name).message}",
                                "session.model", "model_not_found")  # fmt: skip
        _session_only(s)
        audio = s.audio or AudioConfig()
        settings = self.settings.merged(s, self.voices, "session", audio.output, self.service.sample_rate)
        if audio.input is not None and audio.input.format is not None and audio.input.format.rate is not None:
            rate = audio.input.format.rate
            if not MIN_INPUT_RATE <= rate <= MAX_INPUT_RATE:
                raise RealtimeError(f"session.audio.input.format.rate: {rate} Hz is not within {MIN_INPUT_RATE} to "
                                    f"{MAX_INPUT_RATE}", "session.audio.input.format.rate")  # fmt: skip
            if self.buffer and rate != settings.input_rate:
                raise RealtimeError("session.audio.input.format.rate: the input audio buffer holds audio at "
                                    f"{settings.input_rate} Hz; commit or clear it first",
                                    "session.audio.input.format.rate")  # fmt: skip
            settings.input_rate = rate
        self.settings = settings
        await self.send(self.session_event("session.updated"))

    async def buffer_append(self, body: dict[str, Any]) -> None:
        audio = body.get("audio")
        if set(body) != {"audio"} or not isinstance(audio, str):
            raise RealtimeError("input_audio_buffer.append takes `audio`, base64 PCM", "audio")
        pcm = _b64(audio, "audio")
        self._room(2 * len(pcm), "audio")
        self.buffer += pcm

    async def buffer_commit(self, body: dict[str, Any]) -> None:
        if body:
            raise RealtimeError(f"input_audio_buffer.commit takes no fields (got {sorted(body)[:4]})")
        if not self.buffer:
            raise RealtimeError("the input audio buffer is empty: append audio first",
                                code="input_audio_buffer_commit_empty")  # fmt: skip
        item = Item(_new_id("item"), "user", [_pcm_part(bytes(self.buffer), self.settings.input_rate, "audio")],
                    content=[{"type": "input_audio", "transcript": None}])  # fmt: skip
        item.nbytes = len(item.parts[0].audio.pcm.f32le)
        self.buffer.clear()
        previous = self.insert(item, None)
        await self.send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item.id})
        await self._added(item, previous)

    async def buffer_clear(self, body: dict[str, Any]) -> None:
        self.buffer.clear()
        await self.send({"type": "input_audio_buffer.cleared"})

    async def item_create(self, body: dict[str, Any]) -> None:
        unknown = set(body) - {"item", "previous_item_id"}
        if unknown or "item" not in body:
            raise RealtimeError("conversation.item.create takes `item` and `previous_item_id`", "item")
        raw = body["item"]
        if isinstance(raw, dict) and raw.get("type", "message") != "message":
            raise RealtimeError(f"item.type: only message items here (no tools), got {str(raw['type'])[:64]!r}",
                                "item.type")  # fmt: skip
        parsed = _parse(MessageItem, raw, "item")
        if parsed.id is not None and parsed.id in self.items:
            raise RealtimeError(f"item.id: an item {parsed.id!r} is already in the conversation", "item.id")
        previous = body.get("previous_item_id")
        if previous is not None and not isinstance(previous, str):
            raise RealtimeError("previous_item_id: a string", "previous_item_id")
        item = to_item(parsed, parsed.id or _new_id("item"), self.settings.input_rate)
        self._room(item.nbytes, "item")
        await self._added(item, self.insert(item, previous))

    async def item_delete(self, body: dict[str, Any]) -> None:
        item_id = self._item_id(body)
        if self.active is not None and self.items[item_id].status == "in_progress":
            raise RealtimeError("item_id: the response being made; cancel it first", "item_id")
        del self.items[item_id]
        await self.send({"type": "conversation.item.deleted", "item_id": item_id})

    async def item_retrieve(self, body: dict[str, Any]) -> None:
        await self.send({"type": "conversation.item.retrieved", "item": self.items[self._item_id(body)].event()})

    def _item_id(self, body: dict[str, Any]) -> str:
        item_id = body.get("item_id")
        if set(body) != {"item_id"} or not isinstance(item_id, str):
            raise RealtimeError("takes `item_id`", "item_id")
        if item_id not in self.items:
            raise RealtimeError(f"item_id: no item {item_id[:64]!r}", "item_id", "item_not_found")
        return item_id

    async def response_create(self, body: dict[str, Any]) -> None:
        if set(body) - {"response"}:
            raise RealtimeError("response.create takes `response` alone", "response")
        r = _parse(ResponseBody, body.get("response") or {}, "response")
        if r.conversation not in (None, "auto"):
            raise RealtimeError("response.conversation: responses here join the conversation (auto)",
                                "response.conversation")  # fmt: skip
        if r.input is not None:
            raise RealtimeError("response.input: a response here answers the conversation; create items instead",
                                "response.input")  # fmt: skip
        settings = self.settings.merged(r, self.voices, "response", r.audio.output if r.audio else None,
                                        self.service.sample_rate)  # fmt: skip
        if self.active is not None:
            raise RealtimeError("a response is being made; cancel it or wait for response.done",
                                code="conversation_already_has_active_response")  # fmt: skip
        self.active = Response(self, to_generate_request(list(self.items.values()), settings), settings, r.metadata)
        self.task = asyncio.create_task(self._respond(self.active))

    async def response_cancel(self, body: dict[str, Any]) -> None:
        if self.active is None:
            raise RealtimeError("no response is being made", code="response_cancel_not_active")
        self.active.cancel()

    # -- a response
    async def _respond(self, response: Response) -> None:
        try:
            await response.run()
        except _Gone:
            pass  # (the receive loop sees the connection end)
        finally:
            self.active = None
            self.task = None


_HANDLERS: dict[str, Callable[[RealtimeSession, dict[str, Any]], Awaitable[None]]] = {
    "session.update": RealtimeSession.session_update,
    "input_audio_buffer.append": RealtimeSession.buffer_append,
    "input_audio_buffer.commit": RealtimeSession.buffer_commit,
    "input_audio_buffer.clear": RealtimeSession.buffer_clear,
    "conversation.item.create": RealtimeSession.item_create,
    "conversation.item.delete": RealtimeSession.item_delete,
    "conversation.item.retrieve": RealtimeSession.item_retrieve,
    "response.create": RealtimeSession.response_create,
    "response.cancel": RealtimeSession.response_cancel,
}


class Response:
    """One response: its assistant item joins the conversation, its pieces go out as they exist."""

    def __init__(self, session: RealtimeSession, req: gateway_pb2.GenerateRequest, settings: Settings,
                 metadata: dict[str, str] | None) -> None:  # fmt: skip
        self.session, self.req, self.settings, self.metadata = session, req, settings, metadata
        self.id = _new_id("resp")
        self.req.request_id = self.id
        self.item = Item(_new_id("item"), "assistant", status="in_progress")
        self.audio = settings.modality == "audio"
        self.text: list[str] = []
        self.ids = {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}
        self.cancelled = False
        self.generating: asyncio.Future[tuple[str, dict[str, Any] | None, dict[str, Any] | None]] | None = None

    def cancel(self) -> None:
        """response.cancel: what is made so far stays, as an incomplete item, and the response is done."""
        self.cancelled = True
        if self.generating is not None:
            self.generating.cancel()

    def part(self) -> dict[str, Any]:
        words = "".join(self.text)
        return {"type": "audio", "transcript": words} if self.audio else {"type": "text", "text": words}

    def response(self, status: str, details: dict[str, Any] | None = None,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        return {"object": "realtime.response", "id": self.id, "status": status, "status_details": details,
                "output": [self.item.event()] if status != "in_progress" else [],
                "conversation_id": self.session.id, "output_modalities": [self.settings.modality],
                "max_output_tokens": self.settings.max_output_tokens or "inf",
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": self.session.service.sample_rate},
                                     "voice": self.settings.voice or None}},
                "usage": usage, "metadata": self.metadata}  # fmt: skip

    async def run(self) -> None:
        s = self.session
        await s.send({"type": "response.created", "response": self.response("in_progress")})
        previous = s.insert(self.item, None)
        await s.send({"type": "response.output_item.added", "response_id": self.id, "output_index": 0,
                      "item": self.item.event()})  # fmt: skip
        await s.send({"type": "conversation.item.added", "previous_item_id": previous, "item": self.item.event()})
        await s.send({"type": "response.content_part.added", **self.ids, "part": self.part()})
        if self.cancelled:
            await self.done("cancelled", _CANCELLED, None)
            return
        replies = s.service.serve(self.req, None, "realtime")
        self.generating = asyncio.ensure_future(self._generate(replies))
        try:
            await asyncio.wait({self.generating})  # (not `await`: its cancellation is not this task's)
        finally:
            if not self.generating.done():  # this task was cancelled: the connection closed
                self.generating.cancel()
                with contextlib.suppress(asyncio.CancelledError, _Gone):
                    await self.generating
            await replies.aclose()
        if self.generating.cancelled():
            await self.done("cancelled", _CANCELLED, None)
        else:
            await self.done(*self.generating.result())  # (_Gone: no more is sent)

    async def _generate(self, replies: Replies) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
        """The reply's pieces sent as they come: its status, status details and usage."""
        s = self.session

        async def send(event: dict[str, Any]) -> None:  # a client that takes nothing more fails the request
            try:
                await s.service.deliver(s.send(event), replies, self.id)
            except (GatewayError, WebSocketDisconnect, RuntimeError, OSError) as e:
                raise _Gone from e

        status, details, usage = "completed", None, None
        held = b""  # a byte past the last whole sample
        try:
            async for resp in replies:
                kind = resp.WhichOneof("kind")
                if kind == "text" and resp.text.text:
                    self.text.append(resp.text.text)
                    name = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
                    await send({"type": name, **self.ids, "delta": resp.text.text})
                elif kind == "audio":
                    data = held + resp.audio.data
                    cut = len(data) - len(data) % 2
                    held = data[cut:]
                    if cut:
                        await send({"type": "response.output_audio.delta", **self.ids,
                                    "delta": base64.b64encode(data[:cut]).decode()})  # fmt: skip
                elif kind == "final":
                    if resp.final.finish_reason == "length":
                        status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
                    usage = _usage(resp.final.usage)
        except GatewayError as e:
            error = from_gateway_error(e)
            log.warning("realtime response %s failed: %s", self.id, error.message)
            details = {"type": "failed", "error": {"type": error.kind, "code": error.code, "message": error.message}}
            return "failed", details, None
        except _Gone:
            raise
        except Exception:  # a bug: the request fails INTERNAL, as over the other doors (closed: CANCELLED)
            failure = internal_failure(self.id)
            await fail_replies(replies, failure)
            log.exception("realtime response %s", self.id)
            return "failed", {"type": "failed", "error": {"type": "server_error", "code": "internal",
                                                          "message": failure.message}}, None  # fmt: skip
        return status, details, usage

    async def done(self, status: str, details: dict[str, Any] | None, usage: dict[str, Any] | None) -> None:
        s, ids = self.session, self.ids
        words = "".join(self.text)
        self.item.text = words
        self.item.status = "completed" if status == "completed" else "incomplete"
        self.item.content = [{"type": "output_audio", "transcript": words} if self.audio
                             else {"type": "output_text", "text": words}]  # fmt: skip
        if self.audio:
            await s.send({"type": "response.output_audio.done", **ids})
            await s.send({"type": "response.output_audio_transcript.done", **ids, "transcript": words})
        else:
            await s.send({"type": "response.output_text.done", **ids, "text": words})
        await s.send({"type": "response.content_part.done", **ids, "part": self.part()})
        await s.send({"type": "response.output_item.done", "response_id": self.id, "output_index": 0,
                      "item": self.item.event()})  # fmt: skip
        await s.send({"type": "conversation.item.done", "item": self.item.event()})
        await s.send({"type": "response.done", "response": self.response(status, details, usage)})


_CANCELLED = {"type": "cancelled", "reason": "client_cancelled"}


def _usage(u: gateway_pb2.Usage) -> dict[str, Any]:
    """OpenAI's Realtime usage: the output counts the speech's codec frames as audio tokens."""
    output = u.completion_tokens + u.audio_frames
    return {"total_tokens": u.prompt_tokens + output, "input_tokens": u.prompt_tokens, "output_tokens": output,
            "output_token_details": {"text_tokens": u.completion_tokens, "audio_tokens": u.audio_frames}}  # fmt: skip


def realtime_route(service: GatewayService) -> WebSocketRoute:
    voices = served_voices(service)

    async def endpoint(ws: WebSocket) -> None:
        refusal: HttpError | None = None
        if not service.check_api_key(ws.headers.get("authorization")):
            refusal = HttpError(401, "missing or wrong API key (header Authorization: Bearer <key>)",
                                "authentication_error", code="invalid_api_key")  # fmt: skip
        elif (model := ws.query_params.get("model")) is not None and model != service.model_name:
            refusal = unknown_model(model, service.model_name)
        if refusal is not None:
            service.refused("realtime", "UNAUTHENTICATED" if refusal.status == 401 else "NOT_FOUND", refusal.message)
            if "websocket.http.response" in ws.scope.get("extensions", {}):
                await ws.send_denial_response(refusal.response())
            else:
                await ws.close(1008, refusal.message[:120])
            return
        await ws.accept()
        await RealtimeSession(service, ws, voices).run()
        with contextlib.suppress(RuntimeError):  # (closed by the client already)
            await ws.close()

    return WebSocketRoute("/v1/realtime", endpoint)
