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
  `.speed` (0.25 to 1.5), `truncation` ("auto", the default: a conversation over the model's
  length less the output tokens leaves out its oldest turns, as few as it takes; a
  `retention_ratio`: down to that share of it; "disabled": its response fails; gateway/prompt_fit.py),
  `audio.input.format` / `audio.output.format`: `audio/pcm`, 16-bit mono
  little-endian (input at any rate from 8 to 192 kHz, 24 kHz unless `rate` says; output at the
  model's, 24 kHz), or G.711 `audio/pcmu` / `audio/pcma` at 8 kHz (gateway/g711.py: a phone
  bridge's; the reply resampled and encoded as it streams).
  `turn_detection`: `server_vad` (the default, as OpenAI's API has it; gateway/realtime_vad.py:
  on the audio's level; its
  `threshold`, `prefix_padding_ms`, `silence_duration_ms`, `create_response`,
  `interrupt_response`, `idle_timeout_ms`: a silence that long after a reply's speech has played,
  counted in the audio streamed, is committed as a turn and answered, announced by
  `input_audio_buffer.timeout_triggered`): the server hears a turn start (`input_audio_buffer.speech_started`; a
  response being made is cancelled) and end (`.speech_stopped`), commits it from its prefix
  padding to where its end was known, and answers it (what it never heard as speech is kept
  until the session's bound, then all but the padding's worth goes; a client's commit after it
  committed a turn in the same append is refused, as a turn of silence); or null: the client
  commits its audio, then asks for a response (push-to-talk). `transcription` ({model,
  language, prompt}; the model the served one,
  or one of OpenAI's transcription models standing for it): each committed turn is also asked of
  the model as /v1/audio/transcriptions asks it, beside its response, and its words come as
  `conversation.item.input_audio_transcription.delta`s, then `.completed` (or `.failed`); with
  `include: ["item.input_audio_transcription.logprobs"]` they carry the tokens' `logprobs`.
  `tools` (the API's flat functions), `tool_choice` auto or none, `parallel_tool_calls`: as the
  chat door's (gateway/tool_calls.py); a reply's calls come as function_call items after its
  message item (a reply that only calls has none). No semantic_vad, noise reduction or prompts.
  `type: transcription` (or connecting with `?intent=transcription`; beta's
  `transcription_session.update`): live captions. Each committed turn (by the client or heard by
  server_vad) is transcribed, on by default; no response is made and no turn is kept.
* `input_audio_buffer.append` (base64 PCM), `.commit` (the buffer becomes a user item), `.clear`.
* `conversation.item.create` (a message: user `input_text`, `input_audio`, `input_image`;
  system `input_text`; assistant `output_text` or `output_audio` by its `transcript`; a
  `function_call_output` {call_id, output}, or a `function_call` replayed), with
  `previous_item_id` ("root" or an item's id), `.delete`, `.retrieve`, `.truncate` (a spoken
  reply cut where the client's playback stopped: its words leave the conversation, as OpenAI's
  API drops them; a completed reply played to its end keeps them).
* `response.create` (`instructions`, `output_modalities`, `max_output_tokens`, `temperature`,
  `audio.output.voice`, `metadata`; `conversation: none`: out of band, its item joining no
  conversation, at most MAX_OUT_OF_BAND at once beside the conversation's, its context counted
  towards the session's bound while it runs; `input`: the items it
  answers in place of the conversation, given whole or as `item_reference`s), `response.cancel`
  (the conversation's response, or the one `response_id` names). One conversation response at a time.

Bounds: a conversation holds at most MAX_ITEMS items and media.max_request_bytes of text and
media (every item goes into each request). A browser page's socket must come from the server's
own origin or one in gateway.cors_allow_origins (CORS does not cover WebSockets). A client that
takes no event for output_stall_timeout_s fails its response and loses its socket (1008); a
hang-up cancels the response being made down the chain.

Server events sent: `session.created` / `.updated`, `input_audio_buffer.speech_started` /
`.speech_stopped` / `.committed` / `.cleared`, `conversation.item.added` / `.done` / `.deleted` /
`.retrieved` / `.truncated`, `conversation.item.input_audio_transcription.delta` / `.completed` /
`.failed`, `response.created`,
`response.output_item.added`, `response.content_part.added`, then as each piece exists
`response.output_audio_transcript.delta` and `response.output_audio.delta` (or
`response.output_text.delta`), their `.done`s, `response.content_part.done`,
`response.output_item.done`, for each tool call its function_call item's
`response.output_item.added`, `response.function_call_arguments.delta` / `.done` and
`.output_item.done`, and `response.done` with its status (completed; incomplete at
max_output_tokens; cancelled; failed, with the error) and usage. `error` for a refused event.

The beta dialect (`OpenAI-Beta: realtime=v1`: `client.beta.realtime.connect()` and the clients
written before GA) is served too, translated at the edge (gateway/realtime_beta.py). A browser,
which cannot set headers, offers `realtime`, `openai-insecure-api-key.<key>` and (for beta)
`openai-beta.realtime-v1` as subprotocols, as OpenAI's API takes them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.g711 import LAWS, G711Encoder
from gateway.http_api import from_gateway_error, lone_surrogate, served_voices, stt_usage, unknown_model
from gateway.http_error import HttpError, unauthorized
from gateway.logprobs import Held
from gateway.prompt_fit import PromptFit
from gateway.realtime_beta import GaFieldError, beta_error, is_beta, to_beta, to_ga
from gateway.realtime_turns import (
    INCLUDE_LOGPROBS,
    MAX_ITEMS,
    TRANSCRIBING,
    AudioConfig,
    CallItem,
    CallOutputItem,
    Item,
    MessageItem,
    RealtimeError,
    ResponseBody,
    SessionBody,
    Settings,
    b64,
    input_format,
    input_pcm16,
    input_transcription,
    parse,
    pcm_part,
    session_only,
    to_call_item,
    to_generate_request,
    to_item,
    transcription_only,
    transcription_request,
    turn_detection,
    turn_groups,
)
from gateway.realtime_vad import FRAME_MS, MIN_VOICED_MS, EnergyVad, VadEvent
from gateway.server import GatewayError, GatewayService, fail_replies, internal_failure
from gateway.tool_calls import Call, CallStream, new_call_id, tools_refusal
from omnistage.v1 import gateway_pb2

__all__ = ["realtime_route"]

log = logging.getLogger(__name__)

Replies = AsyncGenerator[gateway_pb2.GenerateResponse, None]
CLOSE_WAIT_S = 1.0  # a close frame's wait for a client that stopped reading (uvicorn's pings end it later)
MAX_OUT_OF_BAND = 2  # out-of-band responses of one session at once (each a request: a seat of the gateway's)


def _new_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex[:24]}"


class _Gone(Exception):
    """The client is gone (closed, cut off), or took no event for output_stall_timeout_s."""


# ---- one connection -----------------------------------------------------------------------------


class RealtimeSession:
    """One WebSocket's conversation: its settings, input audio buffer and items; one response of
    the conversation at a time (and up to MAX_OUT_OF_BAND beside it)."""

    def __init__(self, service: GatewayService, ws: WebSocket, voices: list[str], beta: bool = False,
                 transcription: bool = False) -> None:  # fmt: skip
        self.service, self.ws, self.voices = service, ws, voices
        self.beta = beta  # the client speaks the beta dialect (gateway/realtime_beta.py)
        self.id = _new_id("sess")
        self.settings = Settings(modality="audio" if voices else "text")
        if transcription:  # (?intent=transcription)
            self.settings.kind, self.settings.transcription = "transcription", dict(TRANSCRIBING)
        self.buffer = bytearray()
        self.buffer_start = 0  # where the buffer's first sample is in all the input audio appended
        self.vad: EnergyVad | None = None  # server_vad (settings.vad) on the input audio
        self.vad_item = ""  # the id the turn being spoken will have
        self.vad_committed = False  # server_vad committed a turn in the last append: what is left is its silence
        self.idle_from: int | None = None  # idle_timeout_ms: where the silence since the last reply starts
        self.turn_start = 0  # where it started in all the input audio
        self.respond_next = False  # a turn ended over a response: answer it after that one
        self.event_id: str | None = None  # the client's id of the event being handled
        self.transcribing: dict[str, asyncio.Task[None]] = {}  # committed turns' input transcriptions, by item
        self.last_transcription: asyncio.Task[None] | None = None  # the next one starts after it
        self.ms_base, self.rate_start = 0, 0  # `_ms`: input audio before the rate's last change
        self.items: dict[str, Item] = {}
        self.order: list[str] = []  # the items' ids in conversation order
        self.left_out: set[str] = set()  # items truncation has left out of the responses' context
        self.held = 0  # what the buffer and the items count towards max_bytes
        self.active: Response | None = None  # the response being made, and its task
        self.task: asyncio.Task[None] | None = None
        self.side: dict[str, tuple[Response, asyncio.Task[None]]] = {}  # out-of-band responses, by id
        self.lock = asyncio.Lock()  # one event on the wire at a time
        self.events = itertools.count()
        self.gone = False
        # every item goes into each request of the conversation: they are bounded as one request is
        self.max_bytes = service.cfg.media.max_request_bytes
        if self.settings.vad is not None:
            self.vad = EnergyVad(self.settings.vad, self.settings.input_rate, self._max_turn(self.settings))

    # -- sending
    async def send(self, event: dict[str, Any]) -> None:
        """One event out; _Gone once the client is (a send on a closed socket raises one of these)."""
        if self.gone:
            raise _Gone
        texts = [json.dumps({"type": e.pop("type"), "event_id": f"event_{next(self.events)}", **e})
                 for e in (to_beta(event) if self.beta else [event])]  # fmt: skip
        try:
            async with self.lock:
                for text in texts:
                    await self.ws.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError) as e:
            self.gone = True
            raise _Gone from e

    async def error(self, e: RealtimeError, event_id: str | None) -> None:
        translate = self.beta and not isinstance(e, GaFieldError)
        param, message = beta_error(e.param, e.message) if translate else (e.param, e.message)
        await self.send({"type": "error", "error": {"type": "invalid_request_error", "code": e.code,
                                                    "message": message, "param": param,
                                                    "event_id": event_id}})  # fmt: skip

    async def hang_up(self, code: int, reason: str) -> None:
        """Closes the socket (a client that stopped reading may not take the close frame: uvicorn's
        keepalive pings then end the connection), and the session with it."""
        self.gone = True
        with contextlib.suppress(TimeoutError, WebSocketDisconnect, RuntimeError, OSError):
            async with asyncio.timeout(CLOSE_WAIT_S):
                await self.ws.close(code, reason)

    def session_event(self, kind: str) -> dict[str, Any]:
        fields = self.settings.session_fields(self.service.sample_rate)
        if self.settings.kind == "transcription":
            return {"type": kind, "session": {"type": "transcription", "object": "realtime.transcription_session",
                                              "id": self.id, "audio": {"input": fields["audio"]["input"]},
                                              "include": list(self.settings.include) or None}}  # fmt: skip
        session = {"type": "realtime", "object": "realtime.session", "id": self.id, "model": self.service.model_name,
                   **fields, "tools": list(self.settings.tools), "tool_choice": self.settings.tool_choice,
                   "tracing": None,
                   "truncation": self.settings.truncation_event(),
                   "prompt": None, "include": list(self.settings.include) or None}  # fmt: skip
        return {"type": kind, "session": session}

    # -- the connection
    async def run(self) -> None:
        try:
            await self.send(self.session_event("session.created"))
            while not self.gone:
                try:
                    message = await self.ws.receive()
                except (WebSocketDisconnect, RuntimeError, OSError):
                    return
                if message["type"] == "websocket.disconnect":
                    return
                event: Any = None
                try:
                    event = self._event(message)
                    await self.handle(event, message["text"])
                except RealtimeError as e:
                    event_id = event.get("event_id") if isinstance(event, dict) else None
                    await self.error(e, event_id if isinstance(event_id, str) else None)
        except _Gone:
            return
        except Exception:  # a bug: this session ends (its state may be half changed), the server goes on
            log.exception("realtime session %s", self.id)
            await self.hang_up(1011, "internal error")
        finally:
            self.gone = True
            tasks = {*self.transcribing.values(), *([self.task] if self.task is not None else []),
                     *(task for _, task in self.side.values())}  # fmt: skip
            for task in tasks:  # the client is gone: its requests are cancelled down the chain
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)  # (not `await`: a cancel of this handler is its own)

    @staticmethod
    def _event(message: dict[str, Any]) -> Any:
        text = message.get("text")
        if text is None:
            raise RealtimeError("events are JSON in text frames, not binary ones", code="invalid_event")
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as e:
            raise RealtimeError(f"not valid JSON ({type(e).__name__})", code="invalid_json") from None

    async def handle(self, event: Any, text: str) -> None:
        """One client event (`text`, as it came)."""
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise RealtimeError("an event is a JSON object with a string `type`", "type", "invalid_event")
        # JSON may escape half of a UTF-16 pair; protobuf, which takes only UTF-8, would fail on it later
        if (where := lone_surrogate(text.encode("utf-8", "surrogatepass"), event)) is not None:
            raise RealtimeError(f"{where}: not valid Unicode (a lone UTF-16 surrogate)", where)
        if self.beta:
            event = to_ga(event)
        kind = event["type"]
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise RealtimeError(f"type: unknown or unsupported client event {kind[:100]!r}", "type",
                                "invalid_event")  # fmt: skip
        self.event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        body = {k: v for k, v in event.items() if k not in ("type", "event_id")}
        await handler(self, body)

    def _room(self, more: int, where: str, items: int = 0) -> None:
        if self.held + more > self.max_bytes:
            raise RealtimeError(f"{where}: the conversation would hold more than media.max_request_bytes "
                                f"({self.max_bytes}) of text and media; delete items first", where,
                                "conversation_too_large")  # fmt: skip
        if len(self.order) + items > MAX_ITEMS:
            raise RealtimeError(f"{where}: a conversation holds at most {MAX_ITEMS} items; delete items first",
                                where, "conversation_too_large")  # fmt: skip

    def insert(self, item: Item, previous: str | None) -> str | None:
        """Puts `item` after `previous` (None: last; "root": first); gives the id before it."""
        if previous is None:
            at = len(self.order)
        elif previous == "root":
            at = 0
        elif previous in self.items:
            at = self.order.index(previous) + 1
        else:
            raise RealtimeError(f"previous_item_id: no item {previous[:64]!r}", "previous_item_id", "item_not_found")
        self.order.insert(at, item.id)
        self.items[item.id] = item
        self.held += item.nbytes
        return self.order[at - 1] if at else None

    def leave_out(self, items: list[Item]) -> None:
        """Truncation left these turns out of a response's prompt: they stay out of every later one
        (whatever the setting then), in the conversation without their media (their words kept),
        which no longer count towards its bound (a long spoken session would reach it however it
        is truncated)."""
        for item in items:
            if item.id not in self.left_out:
                self.left_out.add(item.id)
                item.parts = [p for p in item.parts if p.WhichOneof("kind") == "text"]
                self.held -= item.nbytes - item.size()
                item.nbytes = item.size()

    def remove(self, item_id: str) -> None:
        self.order.remove(item_id)
        self.left_out.discard(item_id)
        self.held -= self.items.pop(item_id).nbytes

    async def _added(self, item: Item, previous: str | None) -> None:
        await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": item.event()})
        await self.send({"type": "conversation.item.done", "previous_item_id": previous, "item": item.event()})

    # -- client events
    async def session_update(self, body: dict[str, Any]) -> None:
        if set(body) != {"session"}:
            raise RealtimeError("session.update takes `session` alone", "session", "invalid_event")
        s = parse(SessionBody, body["session"], "session")
        if s.model is not None and s.model != self.service.model_name:
            raise RealtimeError(f"session.model: {unknown_model(s.model, self.service.model_name).message}",
                                "session.model", "model_not_found")  # fmt: skip
        session_only(s)
        kind = s.type or self.settings.kind
        if kind == "transcription":
            transcription_only(s)
        if kind != self.settings.kind and (self.active is not None or self.side):
            raise RealtimeError("session.type: a response is being made; cancel it or wait for response.done first",
                                "session.type")  # fmt: skip
        audio = s.audio or AudioConfig()
        settings = self.settings.merged(s, self.voices, "session", audio.output, self.service.sample_rate)
        self._check_tools(settings, "session")
        settings.kind = kind
        if s.truncation is not None:
            settings.truncation = s.truncation
        if s.parallel_tool_calls is not None:
            settings.parallel_tool_calls = s.parallel_tool_calls
        if "include" in s.model_fields_set:  # (null or [] clears it)
            settings.include = tuple(dict.fromkeys(s.include or ()))
        if audio.input is not None and audio.input.format is not None:
            fmt, rate = input_format(audio.input.format, "session.audio.input.format")
            if self.buffer and rate != settings.input_rate:
                raise RealtimeError("session.audio.input.format: the input audio buffer holds audio at "
                                    f"{settings.input_rate} Hz; clear it (input_audio_buffer.clear) first",
                                    "session.audio.input.format")  # fmt: skip
            settings.input_format, settings.input_rate = fmt, rate
        if audio.input is not None:
            settings.vad = turn_detection(audio.input, settings.vad)
            settings.transcription = input_transcription(audio.input, settings.transcription,
                                                         self.service.model_name)  # fmt: skip
        given = audio.input is not None and "transcription" in audio.input.model_fields_set
        if kind != self.settings.kind and not given:  # a new kind of session: its default (on for captions)
            settings.transcription = dict(TRANSCRIBING) if kind == "transcription" else None
        if kind == "transcription" and settings.transcription is None:
            raise RealtimeError("session.audio.input.transcription: a transcription session transcribes "
                                "(not null)", "session.audio.input.transcription")  # fmt: skip
        if settings.input_rate != self.settings.input_rate:  # (the buffer is empty)
            self.ms_base, self.rate_start = self._ms(self.buffer_start), self.buffer_start
        if _hearing(settings) != _hearing(self.settings):  # (create_response and the like: read as they act)
            self.vad = EnergyVad(settings.vad, settings.input_rate, self._max_turn(settings)) if settings.vad else None
            self.vad_item, self.idle_from = "", None
            if self.vad is not None:
                self.vad.fed = self.buffer_start + len(self.buffer) // 2  # (it hears what comes next)
        self.settings = settings
        await self.send(self.session_event("session.updated"))

    async def buffer_append(self, body: dict[str, Any]) -> None:
        audio = body.get("audio")
        if set(body) != {"audio"} or not isinstance(audio, str):
            raise RealtimeError("input_audio_buffer.append takes `audio`, base64 PCM", "audio")
        pcm = input_pcm16(b64(audio, "audio"), self.settings.input_format, "audio")
        self.vad_committed = False  # (new audio: the client's commit takes it, whatever server_vad made of it)
        if self.vad is not None and self.held + 2 * len(pcm) > self.max_bytes:
            # at the bound, what server_vad heard as no turn goes: all before the turn being spoken
            # (and its padding), or, between turns, all but what a turn's start would take (until
            # then a client that commits gets all it sent)
            self._drop_buffer(self.turn_start - self._padding() - self.buffer_start if self.vad.speaking
                              else len(self.buffer) // 2 - self._lead())  # fmt: skip
        self._room(2 * len(pcm), "audio")  # (float32 once committed)
        self.buffer += pcm
        self.held += 2 * len(pcm)
        if self.vad is None:
            return
        for event in self.vad.feed(pcm):
            try:
                await self._turn(event)
            except RealtimeError as e:  # a turn refused (its error now): the next ones are still heard
                await self.error(e, self.event_id)
        if self.idle_from is not None:
            try:
                await self._idle()
            except RealtimeError as e:  # (its response refused: the error now, the session goes on)
                await self.error(e, self.event_id)

    def _arm_idle(self, response: Response) -> None:
        """server_vad's idle_timeout_ms, counted in the audio the client streams: from where the
        conversation's last reply ends playing (response.done, then its speech's duration), as
        OpenAI's API counts it; not while the user speaks (their turn answers or ends it)."""
        if self.vad is None or self.vad.speaking:
            return
        rate, item = self.settings.input_rate, response.item
        playing = item.audio_samples * rate // item.audio_rate if item.audio_rate else 0
        self.idle_from = self.buffer_start + len(self.buffer) // 2 + playing

    async def _idle(self) -> None:
        """The idle timeout reached (as the settings say it now): the silence since the reply
        becomes a user turn, answered."""
        vad, now = self.settings.vad, self.buffer_start + len(self.buffer) // 2
        if self.idle_from is None or vad is None or vad.idle_timeout_ms is None or self.settings.kind != "realtime" \
                or self.active is not None or self.vad is None or self.vad.speaking \
                or now < self.idle_from + vad.idle_timeout_ms * self.settings.input_rate // 1000:  # fmt: skip
            return
        start, self.idle_from = self.idle_from, None
        self._drop_buffer(start - self.buffer_start)
        if not self.buffer:
            return
        item_id = _new_id("item")
        await self.send({"type": "input_audio_buffer.timeout_triggered", "audio_start_ms": self._ms(start),
                         "audio_end_ms": self._ms(now), "item_id": item_id})  # fmt: skip
        await self._commit(len(self.buffer) // 2, item_id)
        await self.response_create({})

    def _max_turn(self, settings: Settings) -> int:
        """A turn's most samples: server_vad ends one there (steady noise could hold it open for
        good: a buffer past the conversation's bound, every append refused), so that it and its
        padding are a clip the gateway takes (media_limits: the feature extractor's too)."""
        assert settings.vad is not None
        seconds = min(self.service.media_limits.max_audio_seconds, self.max_bytes / 4 / settings.input_rate / 2)
        lead = (settings.vad.prefix_padding_ms + MIN_VOICED_MS + 2 * FRAME_MS) / 1000
        return max(settings.input_rate // 10, int((seconds - lead) * settings.input_rate))

    def _padding(self) -> int:
        """server_vad's prefix_padding_ms, in samples: what a turn keeps from before its start."""
        assert self.settings.vad is not None
        return self.settings.vad.prefix_padding_ms * self.settings.input_rate // 1000

    def _lead(self) -> int:
        """Samples kept before a turn's first voiced frame: its prefix padding, and the frames that
        start it (the turn is known only after them) and the one being filled."""
        assert self.settings.vad is not None
        ms = self.settings.vad.prefix_padding_ms + MIN_VOICED_MS + 2 * FRAME_MS
        return ms * self.settings.input_rate // 1000

    def _drop_buffer(self, samples: int) -> None:
        """The buffer's first `samples` (no more than it has) forgotten."""
        samples = min(max(samples, 0), len(self.buffer) // 2)
        del self.buffer[:2 * samples]
        self.buffer_start += samples
        self.held -= 4 * samples

    def _ms(self, sample: int) -> int:
        """Where `sample` (of all the input audio) is, in ms (the rate may have changed before it)."""
        return self.ms_base + (sample - self.rate_start) * 1000 // self.settings.input_rate

    async def _turn(self, event: VadEvent) -> None:
        """server_vad: a turn started (a response being made is cancelled: the user speaks over
        it), or ended: its audio, from its prefix padding to now, is committed, then answered."""
        assert self.settings.vad is not None
        vad = self.settings.vad
        if event.kind == "started":
            self.vad_item, self.turn_start = _new_id("item"), event.sample
            self.vad_committed, self.idle_from = False, None
            if vad.interrupt_response and self.active is not None:
                self.active.cancel("turn_detected")
            await self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": self._ms(event.sample),
                             "item_id": self.vad_item})  # fmt: skip
            return
        item_id = self.vad_item or _new_id("item")
        self.vad_item, self.idle_from = "", None  # (a turn was spoken: its reply, if any, arms it again)
        self._drop_buffer(self.turn_start - self._padding() - self.buffer_start)
        turn = event.at - self.buffer_start
        await self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": self._ms(event.sample),
                         "item_id": item_id})  # fmt: skip
        self.vad_committed = True
        await self._commit(turn, item_id)  # (refused: the next turn's start, or the silence, drops its audio)
        if not vad.create_response or self.settings.kind == "transcription":
            return
        if self.active is not None:  # (being cut, or not interrupted): answered once it is done
            self.respond_next = True
            return
        await self.response_create({})

    async def buffer_commit(self, body: dict[str, Any]) -> None:
        if body:
            raise RealtimeError(f"input_audio_buffer.commit takes no fields (got {sorted(body)[:4]})")
        if not self.buffer:
            raise RealtimeError("the input audio buffer is empty: append audio first",
                                code="input_audio_buffer_commit_empty")  # fmt: skip
        if self.vad is not None and self.vad_committed and not self.vad.speaking:
            # (a client that appends a clip and commits it, with server_vad on: the turn was
            # committed and answered already; what is left would be a turn of silence)
            raise RealtimeError("server_vad committed the turn of the last audio appended already "
                                "(input_audio_buffer.committed); turn_detection: null lets the client commit its turns",
                                code="input_audio_buffer_commit_empty")  # fmt: skip
        item_id = self.vad_item or _new_id("item")  # (a turn server_vad heard start ends here)
        self._reset_turn()
        self.idle_from = None  # (the user's turn)
        await self._commit(len(self.buffer) // 2, item_id)

    async def _commit(self, samples: int, item_id: str) -> None:
        """The buffer's first `samples` as a user item (the rest stays). A transcription session
        keeps none: each turn is transcribed and let go (a live caption runs for hours)."""
        keep = self.settings.kind == "realtime"
        if keep:
            self._room(0, "input_audio_buffer", items=1)
        pcm = bytes(self.buffer[:2 * samples])
        item = Item(item_id, "user", [pcm_part(pcm, self.settings.input_rate, "audio")],
                    content=[{"type": "input_audio", "transcript": None}])  # fmt: skip
        self._drop_buffer(samples)
        item.nbytes = 2 * len(pcm)
        previous = self.insert(item, None) if keep else None
        await self.send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item.id})
        await self._added(item, previous)
        if self.settings.transcription is not None:  # (beside the turn's response: their steps are shared)
            # one turn's after another's, so that a client's captions come in order
            after = self.last_transcription
            # (its request made now: truncation may free the item's audio before its turn comes)
            req = transcription_request(item, self.settings.transcription, INCLUDE_LOGPROBS in self.settings.include)
            task = asyncio.create_task(self._transcribe(item, req, after))
            self.transcribing[item.id] = self.last_transcription = task
            waiting = 0 if keep else item.nbytes  # (a turn not kept counts towards the bound until transcribed)
            self.held += waiting

            def forget(done: asyncio.Task[None], item_id: str = item.id) -> None:
                if self.transcribing.get(item_id) is done:
                    del self.transcribing[item_id]
                self.held -= waiting

            task.add_done_callback(forget)

    async def _transcribe(self, item: Item, req: gateway_pb2.GenerateRequest, after: asyncio.Task[None] | None
                          ) -> None:  # fmt: skip
        """A committed turn's words, as `/v1/audio/transcriptions` would give them: sent as
        `conversation.item.input_audio_transcription.delta`s, then `.completed` (or `.failed`),
        once the turn before it (`after`) is done."""
        if after is not None:
            await asyncio.wait({after})  # (its end, however it ended: not its cancellation)
        req.request_id = _new_id("transcription")
        ids = {"item_id": item.id, "content_index": 0}
        replies = self.service.serve(req, None, "realtime")
        words: list[str] = []
        usage: dict[str, Any] | None = None
        # with `include` INCLUDE_LOGPROBS: each delta's tokens (one whose text is not out yet, with
        # the next), all of them on .completed
        scored = req.sampling["thinker"].HasField("logprobs")
        held = Held()
        try:
            try:
                ends = self.service.reply_ends(req) if scored else frozenset()
                async for resp in replies:
                    kind = resp.WhichOneof("kind")
                    if kind == "text" and scored:
                        held.add(self.service.pieces.plain(resp.text.logprobs, ends))
                    if kind == "text" and resp.text.text:
                        words.append(resp.text.text)
                        delta: dict[str, Any] = {"type": "conversation.item.input_audio_transcription.delta", **ids,
                                                 "delta": resp.text.text}  # fmt: skip
                        if scored:
                            delta["logprobs"] = held.take()
                        await self.deliver(delta, replies, req.request_id)
                    elif kind == "final":
                        usage = stt_usage(resp.final.usage)
            except GatewayError as e:
                error = from_gateway_error(e)
                log.warning("realtime transcription of %s failed: %s", item.id, error.message)
                await self._transcription_failed(ids, error.kind, error.code, error.message)
                return
            except _Gone:
                return
            except Exception:  # a bug: the request fails INTERNAL (closed, it would count CANCELLED)
                failure = internal_failure(req.request_id)
                await fail_replies(replies, failure)
                log.exception("realtime transcription of %s", item.id)
                await self._transcription_failed(ids, "server_error", "internal", failure.message)
                return
            transcript = "".join(words)
            item.content[0]["transcript"] = transcript
            with contextlib.suppress(_Gone):
                await self.send({"type": "conversation.item.input_audio_transcription.completed", **ids,
                                 "transcript": transcript, **({"logprobs": held.every} if scored else {}),
                                 "usage": usage})  # fmt: skip
        finally:
            await replies.aclose()

    async def _transcription_failed(self, ids: dict[str, Any], kind: str, code: str | None, message: str) -> None:
        with contextlib.suppress(_Gone):
            await self.send({"type": "conversation.item.input_audio_transcription.failed", **ids,
                             "error": {"type": kind, "code": code, "message": message, "param": None}})  # fmt: skip

    async def deliver(self, event: dict[str, Any], replies: Replies, request_id: str) -> None:
        """One event of a request's reply: a client that takes nothing more for
        output_stall_timeout_s fails the request (GatewayService.deliver) and loses its socket."""
        try:
            await self.service.deliver(self.send(event), replies, request_id)
        except GatewayError as e:
            log.warning("realtime session %s: %s", self.id, e.message)
            await self.hang_up(1008, "took no event for output_stall_timeout_s")
            raise _Gone from e

    def _reset_turn(self) -> None:
        self.vad_item, self.vad_committed = "", False
        if self.vad is not None:
            self.vad.reset()

    async def buffer_clear(self, body: dict[str, Any]) -> None:
        self._reset_turn()
        self._drop_buffer(len(self.buffer) // 2)
        await self.send({"type": "input_audio_buffer.cleared"})

    async def item_create(self, body: dict[str, Any]) -> None:
        if self.settings.kind == "transcription":
            raise RealtimeError("a transcription session keeps no conversation (session.type: realtime does)",
                                code="transcription_session")  # fmt: skip
        unknown = set(body) - {"item", "previous_item_id"}
        if unknown or "item" not in body:
            raise RealtimeError("conversation.item.create takes `item` and `previous_item_id`", "item")
        parsed = _item_body(body["item"], "item")
        if parsed.id is not None and parsed.id in self.items:
            raise RealtimeError(f"item.id: an item {parsed.id!r} is already in the conversation", "item.id")
        previous = body.get("previous_item_id")
        if previous is not None and not isinstance(previous, str):
            raise RealtimeError("previous_item_id: a string", "previous_item_id")
        item = _to_item(parsed, parsed.id or _new_id("item"), self.settings, "item")
        self._room(item.nbytes, "item", items=1)
        await self._added(item, self.insert(item, previous))

    async def item_delete(self, body: dict[str, Any]) -> None:
        item_id = self._item_id(body)
        if self.active is not None and self.active.item.id == item_id:
            raise RealtimeError("item_id: the response being made; cancel it first", "item_id")
        self.remove(item_id)
        if (task := self.transcribing.get(item_id)) is not None:  # (its words would name a gone item)
            task.cancel()
        await self.send({"type": "conversation.item.deleted", "item_id": item_id})

    async def item_truncate(self, body: dict[str, Any]) -> None:
        """An assistant reply cut where the client's playback stopped (the user spoke over it): its
        words go, as OpenAI's API drops them, since no one can say which of them were heard; a
        completed reply played to its end keeps them (one being made is judged as it settles)."""
        if set(body) != {"item_id", "content_index", "audio_end_ms"}:
            raise RealtimeError("conversation.item.truncate takes `item_id`, `content_index` and `audio_end_ms`",
                                "item_id")  # fmt: skip
        item_id, index, end_ms = body["item_id"], body["content_index"], body["audio_end_ms"]
        item = self.items.get(item_id) if isinstance(item_id, str) else None
        if item is None:
            raise RealtimeError(f"item_id: no item {str(item_id)[:64]!r}", "item_id", "item_not_found")
        if item.role != "assistant" or not item.audio_rate:
            raise RealtimeError("item_id: only an assistant reply this session spoke has audio to truncate", "item_id")
        if type(index) is not int or index != 0:
            raise RealtimeError("content_index: a reply here has one part, 0", "content_index")
        duration_ms = item.audio_ms()
        if not isinstance(end_ms, int) or isinstance(end_ms, bool) or not 0 <= end_ms <= duration_ms:
            raise RealtimeError(f"audio_end_ms: an integer from 0 to the audio's {duration_ms} ms", "audio_end_ms")
        item.truncated_at = end_ms
        if item.status != "in_progress" and not item.heard_whole(item.status):  # (else judged as it settles)
            self.held -= len(item.text.encode())
            item.nbytes -= len(item.text.encode())
            item.text = ""
            item.content = [{**part, "transcript": ""} for part in item.content]
        await self.send({"type": "conversation.item.truncated", "item_id": item.id, "content_index": 0,
                         "audio_end_ms": end_ms})  # fmt: skip

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
        if self.settings.kind == "transcription":
            raise RealtimeError("a transcription session makes no responses (session.type: realtime does)",
                                code="transcription_session")  # fmt: skip
        if set(body) - {"response"}:
            raise RealtimeError("response.create takes `response` alone", "response")
        r = parse(ResponseBody, {} if body.get("response") is None else body["response"], "response")
        if r.conversation not in (None, "auto", "none"):
            raise RealtimeError("response.conversation: auto (the response joins the conversation) or none "
                                "(out of band)", "response.conversation")  # fmt: skip
        in_band = r.conversation != "none"
        settings = self.settings.merged(r, self.voices, "response", r.audio.output if r.audio else None,
                                        self.service.sample_rate)  # fmt: skip
        self._check_tools(settings, "response")
        if in_band and self.active is not None:
            raise RealtimeError("a response is being made; cancel it or wait for response.done",
                                code="conversation_already_has_active_response")  # fmt: skip
        if not in_band and len(self.side) >= MAX_OUT_OF_BAND:
            raise RealtimeError(f"response.conversation: at most {MAX_OUT_OF_BAND} out-of-band responses at once",
                                "response.conversation", "too_many_responses")  # fmt: skip
        context = self._context(r.input) if r.input is not None else \
            [self.items[i] for i in self.order if i not in self.left_out]  # fmt: skip
        if r.input is not None and not context and not settings.instructions:
            raise RealtimeError("response.input: no items (and no instructions): nothing to answer", "response.input",
                                "empty_conversation")  # fmt: skip
        # an out-of-band response's context is a copy beside the conversation: it counts as its
        # items do until it is done
        charge = 0 if in_band else sum(i.nbytes for i in context)
        self._room(charge, "response.input" if r.input is not None else "response", items=1 if in_band else 0)
        req = to_generate_request(context, settings)
        fit = settings.fit(self.service.max_prompt_tokens)
        turns = turn_groups(context) if in_band and r.input is None else []  # (as the request's messages)
        response = Response(self, req, settings, r.metadata, in_band, fit, turns)
        response.charge = charge
        self.held += charge
        task = asyncio.create_task(self._respond(response))
        if in_band:
            self.active, self.task, self.idle_from = response, task, None  # (its end arms the idle timeout)
        else:
            self.side[response.id] = (response, task)

    def _check_tools(self, settings: Settings, where: str) -> None:
        """Tools a response could not be made with are refused where they are set (not by every
        response failing): a template that renders none, or speech that could not end at a call."""
        if not settings.tools or settings.tool_choice == "none" or settings.kind == "transcription":
            return
        audio = settings.modality == "audio"
        if why := tools_refusal(self.service.template_names, self.service.call_start, audio,
                                'ask for output_modalities ["text"]'):
            raise RealtimeError(f"{where}.tools: {why}", f"{where}.tools")

    def _context(self, given: Any) -> list[Item]:
        """response.input: the turns a response answers in place of the conversation: items given
        whole, or the conversation's by reference ({"type": "item_reference", "id"})."""
        if not isinstance(given, list):
            raise RealtimeError("response.input: a list of items", "response.input")
        if len(given) > MAX_ITEMS:
            raise RealtimeError(f"response.input: at most {MAX_ITEMS} items", "response.input")
        items = []
        for i, raw in enumerate(given):
            where = f"response.input[{i}]"
            if isinstance(raw, dict) and raw.get("type") == "item_reference":
                ref = raw.get("id")
                if not set(raw) <= {"type", "id", "object", "status"} or not isinstance(ref, str):
                    raise RealtimeError(f"{where}: an item_reference takes `id`", f"{where}.id")
                if ref not in self.items:
                    raise RealtimeError(f"{where}.id: no item {ref[:64]!r}", f"{where}.id", "item_not_found")
                items.append(self.items[ref])
                continue
            items.append(_to_item(_item_body(raw, where), _new_id("item"), self.settings, where))
        if sum(i.nbytes for i in items) > self.max_bytes:
            raise RealtimeError(f"response.input: more than media.max_request_bytes ({self.max_bytes}) of text and "
                                "media", "response.input", "conversation_too_large")  # fmt: skip
        return items

    async def response_cancel(self, body: dict[str, Any]) -> None:
        """The response being made in the conversation, or the one `response_id` names."""
        if set(body) - {"response_id"}:
            raise RealtimeError("response.cancel takes `response_id` alone", "response_id")
        response_id = body.get("response_id")
        response = self.active
        if response_id is not None and (response is None or response.id != response_id):
            response = self.side[response_id][0] if isinstance(response_id, str) and response_id in self.side else None
        if response is None:
            if response_id is None:
                raise RealtimeError("no response is being made", code="response_cancel_not_active")
            raise RealtimeError(f"response_id: no response {str(response_id)[:64]!r} is being made", "response_id",
                                "response_cancel_not_active")  # fmt: skip
        response.cancel()

    # -- a response
    async def _respond(self, response: Response) -> None:
        try:
            await response.run()
        except _Gone:
            pass  # (the receive loop ends with the session)
        except Exception:  # a bug past the request's own handling (_generate's): the session ends
            log.exception("realtime response %s", response.id)
            await self.hang_up(1011, "internal error")
        finally:
            if response is self.active:
                self.active, self.task = None, None
            self.side.pop(response.id, None)
            self.held -= response.charge
        if not response.in_band:
            return
        self._arm_idle(response)
        vad, pending, self.respond_next = self.settings.vad, self.respond_next, False
        if pending and not self.gone and vad is not None and vad.create_response:
            # a turn server_vad heard end while this response was made: answered now
            with contextlib.suppress(_Gone):
                try:
                    await self.response_create({})
                except RealtimeError as e:
                    await self.error(e, None)
                except Exception:  # (as the receive loop's own)
                    log.exception("realtime session %s", self.id)
                    await self.hang_up(1011, "internal error")


_ITEM_TYPES = {"message": MessageItem, "function_call": CallItem, "function_call_output": CallOutputItem}


def _item_body(raw: Any, where: str) -> MessageItem | CallItem | CallOutputItem:
    """A client's item, checked as its type reads: a message, a function call or a call's output."""
    kind = raw.get("type", "message") if isinstance(raw, dict) else "message"
    if kind not in _ITEM_TYPES:
        raise RealtimeError(f"{where}.type: message, function_call or function_call_output, got {str(kind)[:64]!r}",
                            f"{where}.type")  # fmt: skip
    return parse(_ITEM_TYPES[kind], raw, where)


def _to_item(body: MessageItem | CallItem | CallOutputItem, item_id: str, settings: Settings, where: str) -> Item:
    return to_item(body, item_id, settings, where) if isinstance(body, MessageItem) else to_call_item(body, item_id)


def _hearing(settings: Settings) -> tuple[object, ...] | None:
    """What server_vad's detector is made from (None: off)."""
    vad = settings.vad
    return None if vad is None else (vad.threshold, vad.silence_duration_ms, settings.input_rate)


_HANDLERS: dict[str, Callable[[RealtimeSession, dict[str, Any]], Awaitable[None]]] = {
    "session.update": RealtimeSession.session_update,
    "input_audio_buffer.append": RealtimeSession.buffer_append,
    "input_audio_buffer.commit": RealtimeSession.buffer_commit,
    "input_audio_buffer.clear": RealtimeSession.buffer_clear,
    "conversation.item.create": RealtimeSession.item_create,
    "conversation.item.delete": RealtimeSession.item_delete,
    "conversation.item.retrieve": RealtimeSession.item_retrieve,
    "conversation.item.truncate": RealtimeSession.item_truncate,
    "response.create": RealtimeSession.response_create,
    "response.cancel": RealtimeSession.response_cancel,
}


class Response:
    """One response: its assistant item joins the conversation (unless out of band), its pieces
    go out as they exist."""

    def __init__(self, session: RealtimeSession, req: gateway_pb2.GenerateRequest, settings: Settings,
                 metadata: dict[str, str] | None, in_band: bool = True, fit: PromptFit | None = None,
                 conversation: list[list[Item]] | None = None) -> None:  # fmt: skip
        self.session, self.req, self.settings, self.metadata = session, req, settings, metadata
        # truncation: the conversation's turns its prompt leaves out (the first `fit.dropped` of
        # `conversation`, its turns in the request's order) are left out of the next responses' too
        self.fit, self.conversation = fit, conversation or []
        self.in_band = in_band  # False: out of band (conversation: none), its item joins no conversation
        self.charge = 0  # what its context counts towards the session's bound while it runs
        self.status = ""  # as response.done said it
        self.id = _new_id("resp")
        self.req.request_id = self.id
        self.item = Item(_new_id("item"), "assistant", status="in_progress",
                         audio_rate=session.service.sample_rate if settings.modality == "audio" else 0)
        self.audio = settings.modality == "audio"
        # G.711 out: the model's 16-bit PCM resampled and encoded as it comes
        rate = session.service.sample_rate
        self.g711 = G711Encoder(settings.output_format, rate) if self.audio and settings.output_format in LAWS else None
        self.text: list[str] = []
        self.reading = CallStream() if req.tools else None  # the reply's text, read for tool calls
        self.calls: list[Item] = []  # its function_call items (after its message item), once read
        # its message item was announced: with tools, at its first words or audio (a reply that
        # only calls has none, as OpenAI's API gives it), else at once; the events saying so not
        # sent yet (a cancel can stop the announcing task between them: run() sends the rest)
        self.announced = False
        self.announcing: list[dict[str, Any]] = []
        # where its items join the conversation: after the item last when it started (as they
        # would have were they there from its start), then each after the one before
        self.place: str | None = None
        self.ids = {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}
        self.cancelled: dict[str, str] | None = None  # once cancelled: its status_details
        self.finished = False  # the request's final came
        self.generating: asyncio.Future[tuple[str, dict[str, Any] | None, dict[str, Any] | None]] | None = None

    def cancel(self, reason: str = "client_cancelled") -> None:
        """response.cancel (`reason` as response.done says it: "turn_detected" where server_vad
        heard the user speak over it): what is made so far stays, as an incomplete item, and the
        response is done (one whose request has ended is done already: it completes)."""
        if self.finished:
            return
        self.cancelled = {"type": "cancelled", "reason": reason}
        if self.generating is not None:
            self.generating.cancel()

    def part(self) -> dict[str, Any]:
        words = "".join(self.text) if self.item.status == "in_progress" else self.item.text
        return {"type": "audio", "transcript": words} if self.audio else {"type": "text", "text": words}

    def response(self, status: str, details: dict[str, Any] | None = None,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        return {"object": "realtime.response", "id": self.id, "status": status, "status_details": details,
                "output": [i.event() for i in self._output()] if status != "in_progress" else [],
                "conversation_id": self.session.id if self.in_band else None,
                "output_modalities": [self.settings.modality],
                "max_output_tokens": self.settings.max_output_tokens or "inf",
                "audio": {"output": {"format": self.settings.output_format_event(self.session.service.sample_rate),
                                     "voice": self.settings.voice or None}},
                "usage": usage, "metadata": self.metadata}  # fmt: skip

    def _output(self) -> list[Item]:
        return [self.item, *self.calls] if self.announced else self.calls

    def _join(self, item: Item) -> str | None:
        """`item` into the conversation at the response's place (the place gone: last); the id before it."""
        s = self.session
        place = self.place if self.place == "root" or self.place in s.items else None
        previous = s.insert(item, place)
        self.place = item.id
        return previous

    async def _announce(self) -> None:
        """The message item's start: in the conversation (in band), its output item and content part."""
        if not self.announced:
            self.announced = True
            self.announcing = [{"type": "response.output_item.added", "response_id": self.id, "output_index": 0,
                                "item": self.item.event()}]  # fmt: skip
            if self.in_band:
                self.announcing.append({"type": "conversation.item.added", "previous_item_id": self._join(self.item),
                                        "item": self.item.event()})  # fmt: skip
            self.announcing.append({"type": "response.content_part.added", **self.ids, "part": self.part()})
        while self.announcing:
            await self.session.send(self.announcing[0])
            del self.announcing[0]

    async def run(self) -> None:
        s = self.session
        self.place = s.order[-1] if s.order else "root"
        await s.send({"type": "response.created", "response": self.response("in_progress")})
        status = "incomplete"
        try:
            if self.reading is None:
                await self._announce()
            outcome = ("cancelled", self.cancelled, None) if self.cancelled else await self._outcome()
            status = outcome[0]
            if not self.calls:  # a reply that calls nothing has its message item, words or none
                await self._announce()
        finally:  # (the client gone too: the conversation keeps what was made)
            self.settle(status)
            if self.fit is not None and self.fit.dropped:  # (read once its prompt was made)
                left = [i for turn in self.conversation[: self.fit.dropped] for i in turn]
                s.leave_out([i for i in left if s.items.get(i.id) is i])
        if self.announced:  # (what a cancel cut off of its announcement)
            await self._announce()
        await self.done(*outcome)

    async def _outcome(self) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
        """The request run, its pieces sent as they come: the response's status, its details and usage."""
        replies = self.session.service.serve(self.req, None, "realtime", self.fit)
        generating = self.generating = asyncio.ensure_future(self._generate(replies))
        try:
            await asyncio.wait({generating})  # (not `await`: its cancellation is not this task's)
        finally:
            if not generating.done():  # this task was cancelled: the connection closed
                generating.cancel()
                await asyncio.wait({generating})
            if not generating.cancelled():  # read here too: a caller cancelled as it ended never reads it
                generating.exception()  # (asyncio logged "Task exception was never retrieved" for its _Gone)
            await replies.aclose()
        if generating.cancelled():  # (response.cancel, or the connection closed)
            return "cancelled", self.cancelled or _CANCELLED, None
        return generating.result()  # (_Gone: the client is)

    async def _generate(self, replies: Replies) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
        s = self.session

        async def send(event: dict[str, Any]) -> None:
            await s.deliver(event, replies, self.id)

        status, details, usage = "completed", None, None
        held = b""  # a byte past the last whole sample
        try:
            async for resp in replies:
                kind = resp.WhichOneof("kind")
                if kind == "text" and (piece := resp.text.text):
                    await self._words(send, piece if self.reading is None else self.reading.feed(piece))
                elif kind == "audio":
                    data = held + resp.audio.data
                    cut = len(data) - len(data) % 2
                    held = data[cut:]
                    self.item.audio_samples += cut // 2
                    piece = data[:cut] if self.g711 is None else self.g711.push(data[:cut])
                    if piece:
                        await self._announce()
                        await send({"type": "response.output_audio.delta", **self.ids,
                                    "delta": base64.b64encode(piece).decode()})  # fmt: skip
                elif kind == "final":
                    self.finished = True  # (a cancel now would cut the request's own ending, not its reply)
                    if self.reading is not None:  # the words held back, and the calls
                        rest, calls = self.reading.finish()
                        # (spoken, the speech ended where the first call starts: the words after it are unsaid)
                        await self._words(send, self.reading.spoken_rest() if self.audio else rest)
                        self.calls = [self._call(c) for c in calls[: None if self.settings.parallel_tool_calls else 1]]
                    if resp.final.finish_reason == "length":
                        status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
                    usage = _usage(resp.final.usage)
            if self.g711 is not None and (tail := self.g711.finish()):  # what its resampler held back
                await self._announce()
                await send({"type": "response.output_audio.delta", **self.ids,
                            "delta": base64.b64encode(tail).decode()})  # fmt: skip
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

    async def _words(self, send: Callable[[dict[str, Any]], Awaitable[None]], words: str) -> None:
        if words:
            await self._announce()
            self.text.append(words)
            name = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
            await send({"type": name, **self.ids, "delta": words})

    @staticmethod
    def _call(call: Call) -> Item:
        item = Item(_new_id("item"), "assistant", type="function_call", name=call.name, arguments=call.arguments,
                    call_id=new_call_id())  # fmt: skip
        item.nbytes = item.size()
        return item

    def settle(self, status: str) -> None:
        """The assistant item as the response left it: its words so far, the next turns' context."""
        words = "".join(self.text) if self.item.heard_whole(status) else ""
        self.item.text = words
        self.item.status = "completed" if status == "completed" else "incomplete"
        self.item.content = [{"type": "output_audio", "transcript": words} if self.audio
                             else {"type": "output_text", "text": words}]  # fmt: skip
        s = self.session
        if self.item.id in s.items:  # (counted towards the conversation's bound now that it has its words)
            s.held += len(words.encode())
            self.item.nbytes += len(words.encode())

    async def done(self, status: str, details: dict[str, Any] | None, usage: dict[str, Any] | None) -> None:
        self.status = status
        s, ids, words = self.session, self.ids, self.item.text
        if self.announced:
            if self.audio:
                await s.send({"type": "response.output_audio.done", **ids})
                await s.send({"type": "response.output_audio_transcript.done", **ids, "transcript": words})
            else:
                await s.send({"type": "response.output_text.done", **ids, "text": words})
            await s.send({"type": "response.content_part.done", **ids, "part": self.part()})
            await s.send({"type": "response.output_item.done", "response_id": self.id, "output_index": 0,
                          "item": self.item.event()})  # fmt: skip
            if self.in_band:
                await s.send({"type": "conversation.item.done", "item": self.item.event()})
        for index, call in enumerate(self.calls, 1 if self.announced else 0):  # (after the reply's words)
            at = {"response_id": self.id, "item_id": call.id, "output_index": index, "call_id": call.call_id}
            await s.send({"type": "response.output_item.added", "response_id": self.id, "output_index": index,
                          "item": {**call.event(), "status": "in_progress", "arguments": ""}})  # fmt: skip
            if self.in_band:
                await s.send({"type": "conversation.item.added", "previous_item_id": self._join(call),
                              "item": {**call.event(), "status": "in_progress", "arguments": ""}})  # fmt: skip
            await s.send({"type": "response.function_call_arguments.delta", **at, "delta": call.arguments})
            await s.send({"type": "response.function_call_arguments.done", **at, "name": call.name,
                          "arguments": call.arguments})  # fmt: skip
            await s.send({"type": "response.output_item.done", "response_id": self.id, "output_index": index,
                          "item": call.event()})  # fmt: skip
            if self.in_band and call.id in s.items:
                await s.send({"type": "conversation.item.done", "item": call.event()})
        await s.send({"type": "response.done", "response": self.response(status, details, usage)})


_CANCELLED = {"type": "cancelled", "reason": "client_cancelled"}


def _usage(u: gateway_pb2.Usage) -> dict[str, Any]:
    """OpenAI's Realtime usage: the output counts the speech's codec frames as audio tokens."""
    output = u.completion_tokens + u.audio_frames
    return {"total_tokens": u.prompt_tokens + output, "input_tokens": u.prompt_tokens, "output_tokens": output,
            "input_token_details": {"cached_tokens": 0},  # (each response's prompt is computed anew)
            "output_token_details": {"text_tokens": u.completion_tokens, "audio_tokens": u.audio_frames}}  # fmt: skip


def realtime_route(service: GatewayService) -> WebSocketRoute:
    voices = served_voices(service)

    allowed = service.cfg.gateway.cors_allow_origins

    async def endpoint(ws: WebSocket) -> None:
        refusal: HttpError | None = None
        origin = ws.headers.get("origin")
        offered: list[str] = list(ws.scope.get("subprotocols") or [])
        intent = ws.query_params.get("intent")
        if not service.check_api_key(ws.headers.get("authorization") or _subprotocol_key(offered)):
            refusal = unauthorized()
        elif (model := ws.query_params.get("model")) is not None and model != service.model_name:
            refusal = unknown_model(model, service.model_name)
        elif intent not in (None, "transcription"):
            refusal = HttpError(400, f"intent: {intent[:64]!r}: transcription, or none (a conversation)",
                                param="intent")  # fmt: skip
        elif offered and _SUBPROTOCOL not in offered:  # (a browser drops a socket that selects none it offered)
            refusal = HttpError(400, f"subprotocols {', '.join(offered)[:200]!r}: offer `{_SUBPROTOCOL}` (with "
                                "`openai-insecure-api-key.<key>` and `openai-beta.realtime-v1` as needed)",
                                param="subprotocols")  # fmt: skip
        elif origin is not None and not _origin_allowed(origin, ws.headers.get("host"), allowed):
            # a browser page's socket: CORS does not cover WebSockets, so a page on any site could
            # drive a stack on this machine (with no API key) were its origin not checked here
            refusal = HttpError(403, f"origin {origin[:200]!r} is not allowed; gateway.cors_allow_origins lets a "
                                "page on another origin in", "permission_error", code="origin_not_allowed")  # fmt: skip
        if refusal is not None:
            service.refused("realtime", _REFUSALS[refusal.status], refusal.message)
            if "websocket.http.response" in ws.scope.get("extensions", {}):
                await ws.send_denial_response(refusal.response())
            else:
                await ws.close(1008, refusal.message[:120])
            return
        # (a browser, which cannot set headers, offers `realtime` and its key and dialect as subprotocols)
        await ws.accept(subprotocol=_SUBPROTOCOL if offered else None)
        session = RealtimeSession(service, ws, voices, beta=is_beta(ws.headers.get("openai-beta"), offered),
                                  transcription=intent == "transcription")  # fmt: skip
        await session.run()
        await session.hang_up(1000, "")

    return WebSocketRoute("/v1/realtime", endpoint)


_REFUSALS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND"}
_SUBPROTOCOL = "realtime"
_KEY_SUBPROTOCOL = "openai-insecure-api-key."  # OpenAI's way for a browser to send its key


def _subprotocol_key(offered: list[str]) -> str | None:
    """A browser's API key, offered as a subprotocol, as the Authorization header would carry it."""
    keys = [p.removeprefix(_KEY_SUBPROTOCOL) for p in offered if p.startswith(_KEY_SUBPROTOCOL)]
    return f"Bearer {keys[0]}" if keys else None


def _origin_allowed(origin: str, host: str | None, allowed: list[str]) -> bool:
    """A browser page's origin: its own server's (the playground), or one the deploy config lets in."""
    return "*" in allowed or origin in allowed or urlsplit(origin).netloc == host
