"""What a Realtime client sends (gateway/realtime.py), checked, and a response's gateway request:
the session's settings, the conversation's items as chat turns. A field this server cannot honour
is a RealtimeError naming it, never ignored."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.g711 import G711_RATE, LAWS, g711_to_pcm16
from gateway.http_api import apply_temperature, data_url, decode_b64, pcm16_part, voice_speaker, whole_samples
from gateway.http_error import HttpError
from gateway.prompt_fit import PromptFit
from gateway.realtime_vad import VadSettings
from gateway.tool_calls import NAME as TOOL_NAME
from gateway.tool_calls import chat_tool, check_nesting
from gateway.transcription import instruction, transcription_turn
from omnistage.v1 import gateway_pb2, stage_pb2

__all__ = [
    "MAX_ITEMS",
    "TRANSCRIBING",
    "AudioConfig",
    "CallItem",
    "CallOutputItem",
    "Item",
    "MessageItem",
    "RealtimeError",
    "ResponseBody",
    "ServerVad",
    "SessionBody",
    "Settings",
    "b64",
    "input_format",
    "input_pcm16",
    "input_transcription",
    "parse",
    "pcm_part",
    "session_only",
    "to_call_item",
    "to_generate_request",
    "to_item",
    "transcription_instruction",
    "transcription_only",
    "transcription_request",
    "turn_detection",
    "turn_groups",
]

MIN_INPUT_RATE, MAX_INPUT_RATE = 8_000, 192_000
MAX_ITEMS = 4096  # a conversation's items (each goes into every request of it)
ITEM_BYTES = 256  # what an item counts towards media.max_request_bytes besides its text and media
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


class FormatBody(_Strict):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]  # 16-bit PCM; G.711 mu-law, A-law (8 kHz)
    rate: int | None = None


class ServerVad(_Strict):
    type: Literal["server_vad", "semantic_vad"]
    threshold: float | None = Field(None, ge=0, le=1)
    prefix_padding_ms: int | None = Field(None, ge=0, le=10_000)
    silence_duration_ms: int | None = Field(None, ge=10, le=10_000)
    create_response: bool | None = None
    interrupt_response: bool | None = None
    idle_timeout_ms: int | None = Field(None, ge=1000, le=600_000)
    eagerness: str | None = None  # (semantic_vad's)


class TranscriptionConfig(_Strict):
    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class InputAudioConfig(_Strict):
    format: FormatBody | None = None
    transcription: TranscriptionConfig | None = None
    noise_reduction: Any = None
    turn_detection: ServerVad | None = None


# OpenAI's transcription models: a client written for them names one; each stands for the served
# model, which transcribes (as OpenAI's voice names stand for the default speaker)
OPENAI_TRANSCRIBERS = frozenset({"whisper-1", "gpt-transcribe", "gpt-live-transcribe", "gpt-4o-mini-transcribe",
                                 "gpt-4o-mini-transcribe-2025-12-15", "gpt-4o-transcribe", "gpt-realtime-whisper"})
# (gpt-4o-transcribe-diarize: refused, the served model labels no speakers)


def input_transcription(audio_in: InputAudioConfig, now: dict[str, Any] | None,
                        served: str) -> dict[str, Any] | None:  # fmt: skip
    """The session's input transcription after `audio_in` (null: off; unset: as it was), as the
    session shows it: {model, language, prompt} (`transcription_instruction` makes its turn)."""
    if "transcription" not in audio_in.model_fields_set:
        return now
    given = audio_in.transcription
    if given is None:
        return None
    where = "session.audio.input.transcription"
    if given.model is not None and given.model != served and given.model not in OPENAI_TRANSCRIBERS:
        raise RealtimeError(f"{where}.model: {given.model[:100]!r}: the served model {served!r} transcribes "
                            "(or name one of OpenAI's transcription models for it)", f"{where}.model")  # fmt: skip
    out = {"model": given.model, "language": given.language, "prompt": given.prompt}
    transcription_instruction(out)  # (a bad language refused now)
    return out


def transcription_instruction(config: dict[str, Any]) -> str:
    try:
        return instruction(False, config["language"], config["prompt"])
    except HttpError as e:
        where = "session.audio.input.transcription.language"
        raise RealtimeError(f"{where}: {e.message.removeprefix('language: ')}", where) from None


def turn_detection(audio_in: InputAudioConfig, now: VadSettings | None) -> VadSettings | None:
    """The session's turn detection after `audio_in` (null: off; unset: as it was)."""
    if "turn_detection" not in audio_in.model_fields_set:
        return now
    given = audio_in.turn_detection
    if given is None:
        return None
    where = "session.audio.input.turn_detection"
    if given.type == "semantic_vad":
        raise RealtimeError(f"{where}.type: no semantic_vad here (no model of it): server_vad, on the audio's "
                            "level, or null", f"{where}.type", "unsupported_turn_detection")  # fmt: skip
    if given.eagerness is not None:
        raise RealtimeError(f"{where}.eagerness: semantic_vad's; server_vad takes none", f"{where}.eagerness")
    return VadSettings(**{f.name: value for f in dataclasses.fields(VadSettings)
                          if (value := getattr(given, f.name)) is not None})  # (unset: the default)


class OutputAudioConfig(_Strict):
    format: FormatBody | None = None
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
    tools: list[Any] | None = Field(None, max_length=128)  # (as the chat door's)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    prompt: Any = None


class TokenLimits(_Strict):
    post_instructions: int | None = Field(None, ge=1)


class RetentionRatio(_Strict):
    """`truncation`: when a conversation is over its limit, its oldest turns are left out until
    it is at this share of the limit (`token_limits.post_instructions`: a lower limit for the
    conversation after the instructions)."""

    type: Literal["retention_ratio"]
    retention_ratio: float = Field(ge=0, le=1)
    token_limits: TokenLimits | None = None


Truncation = Literal["auto", "disabled"] | RetentionRatio


class SessionBody(_Common):
    type: Literal["realtime", "transcription"] | None = None  # (None: the session's kind as it is)
    model: str | None = None
    audio: AudioConfig | None = None
    include: list[Any] | None = None
    tracing: Any = None  # (OpenAI's dashboard: nothing is traced here)
    truncation: Truncation | None = None
    reasoning: Any = None


class ResponseBody(_Common):
    conversation: str | None = None
    input: Any = None
    audio: ResponseAudioConfig | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None  # (OpenAI's bounds)


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
_PART_TYPES = frozenset(t for types in ROLE_PARTS.values() for t in types)


class _ItemBody(_Strict):
    """What every item a client creates may carry besides its own fields."""

    id: str | None = Field(None, min_length=1, max_length=64)
    object: Literal["realtime.item"] | None = None
    status: str | None = None


class MessageItem(_ItemBody):
    type: Literal["message"]
    role: Literal["user", "system", "assistant"]
    content: Annotated[list[Part], Field(min_length=1)]


class CallItem(_ItemBody):
    """A function call an earlier response made (the client's copy of it)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=64)
    name: str = Field(pattern=TOOL_NAME)  # (rendered into the prompt's JSON as it is)
    arguments: str


class CallOutputItem(_ItemBody):
    """A call's result, which the client's code made."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=64)
    output: str


class FunctionTool(_Strict):
    """One of a session's (or response's) `tools`: the Realtime API's flat form of a function."""

    type: Literal["function"] = "function"
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None


ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")


_BRANCHES = frozenset({"RetentionRatio"})  # (truncation's)


def _where(loc: tuple[Any, ...], prefix: str) -> str:
    """A pydantic error location as the event's field path, without the tags pydantic adds for
    a union's branch (`content[0].input_text.text` is `content[0].text`)."""
    out = prefix
    for i, item in enumerate(loc):
        if isinstance(item, int):
            out += f"[{item}]"
        elif i and isinstance(loc[i - 1], int) and item in _PART_TYPES:
            continue  # a content part's tag
        elif item in _BRANCHES:
            continue  # a union's branch, by its model's name
        elif str(item).isidentifier() and item not in ("str", "int", "list"):
            out += f".{item}"
    return out


def parse(model: type[ModelT], data: Any, prefix: str) -> ModelT:
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

    kind: str = "realtime"  # "transcription": committed turns are transcribed; no responses
    instructions: str = ""
    modality: str = "audio"  # "audio": speech and its transcript; "text"
    max_output_tokens: int | None = None  # None: "inf", the model's own limit
    voice: str = ""  # as the client named it ("": the checkpoint's default speaker)
    speaker: str = ""
    speed: float = 1.0
    input_format: str = "audio/pcm"  # what appended audio is (the buffer holds it as 16-bit PCM)
    input_rate: int = 24_000
    output_format: str = "audio/pcm"  # audio/pcm: the model's rate; G.711: 8 kHz
    temperature: float | None = None  # None: the checkpoint's sampling
    # server_vad turn detection, on by default as OpenAI's API has it (a client written for it
    # streams its microphone and waits); None: the client commits (push-to-talk)
    vad: VadSettings | None = field(default_factory=VadSettings)
    transcription: dict[str, Any] | None = None  # input audio transcribed: {model, language, prompt}
    include: tuple[str, ...] = ()  # INCLUDE_LOGPROBS: the transcriptions' tokens with their log-probabilities
    # a conversation over the model's length: its oldest turns left out ("auto", OpenAI's default:
    # as few as it takes; RetentionRatio), or its response fails ("disabled")
    truncation: Truncation = "auto"
    tools: tuple[dict[str, Any], ...] = ()  # functions the model may call, as the client gave them
    tool_choice: str = "auto"  # or "none": the tools go unread
    parallel_tool_calls: bool = True  # False: a response's first call alone

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
        if body.tools is not None:
            out.tools = tuple(parse(FunctionTool, t, f"{prefix}.tools[{i}]").model_dump(exclude_none=True)
                              for i, t in enumerate(body.tools))  # fmt: skip
            for i, tool in enumerate(out.tools):
                try:
                    check_nesting(tool, f"{prefix}.tools[{i}]")
                except ValueError as e:
                    raise RealtimeError(str(e), f"{prefix}.tools[{i}]") from None
        if body.tool_choice is not None:
            out.tool_choice = body.tool_choice
        if body.parallel_tool_calls is not None:
            out.parallel_tool_calls = body.parallel_tool_calls
        if output is not None:
            where = f"{prefix}.audio.output"
            if output.format is not None:
                rate = G711_RATE if output.format.type in LAWS else sample_rate
                if output.format.rate not in (None, rate):
                    raise RealtimeError(f"{where}.format.rate: {output.format.type} from this model is at {rate} Hz",
                                        f"{where}.format.rate")  # fmt: skip
                out.output_format = output.format.type
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
                "input": {"format": _format(self.input_format, self.input_rate),
                          "transcription": self.transcription,
                          "noise_reduction": None, "turn_detection": self.vad.event() if self.vad else None},
                "output": {"format": self.output_format_event(sample_rate), "voice": self.voice or None,
                           "speed": self.speed},
            },
        }  # fmt: skip

    def truncation_event(self) -> Any:
        return self.truncation if isinstance(self.truncation, str) else self.truncation.model_dump()

    def fit(self, max_prompt_tokens: int) -> PromptFit | None:
        """How a response's prompt is kept within the model's length (None: truncation disabled),
        as OpenAI's API keeps it: the model's length less the response's output tokens (at most
        half of it: "inf" keeps MAX_OUTPUT_TOKENS), or `post_instructions` past the instructions
        (counted where the prompt is built: prompt_fit.PromptFit.resolve)."""
        if self.truncation == "disabled":
            return None
        length = max_prompt_tokens + 1
        fit = PromptFit(limit=length - min(self.max_output_tokens or MAX_OUTPUT_TOKENS, length // 2),
                        fixed=1 if self.instructions else 0, instructions=self.instructions)  # fmt: skip
        if isinstance(self.truncation, RetentionRatio):
            fit.ratio = self.truncation.retention_ratio
            limits = self.truncation.token_limits
            fit.post_instructions = limits.post_instructions if limits is not None else None
        return fit

    def output_format_event(self, sample_rate: int) -> dict[str, Any]:
        return _format(self.output_format, sample_rate)


def _format(fmt: str, rate: int) -> dict[str, Any]:
    return {"type": fmt} if fmt in LAWS else {"type": fmt, "rate": rate}


def input_format(given: FormatBody, where: str) -> tuple[str, int]:
    """An input format as (type, rate): audio/pcm at its rate (OpenAI's 24 kHz unless it says),
    G.711 at 8 kHz."""
    if given.type in LAWS:
        if given.rate not in (None, G711_RATE):
            raise RealtimeError(f"{where}.rate: {given.type} is at {G711_RATE} Hz", f"{where}.rate")
        return given.type, G711_RATE
    rate = 24_000 if given.rate is None else given.rate
    if not MIN_INPUT_RATE <= rate <= MAX_INPUT_RATE:
        raise RealtimeError(f"{where}.rate: {rate} Hz is not within {MIN_INPUT_RATE} to {MAX_INPUT_RATE}",
                            f"{where}.rate")  # fmt: skip
    return given.type, rate


def input_pcm16(data: bytes, fmt: str, where: str) -> bytes:
    """Input audio in the session's format as 16-bit PCM (at its rate)."""
    if fmt in LAWS:
        return g711_to_pcm16(data, fmt)
    return _realtime(lambda: whole_samples(data, where, "audio/pcm"))


def _unsupported(body: _Common, prefix: str) -> None:
    if body.tool_choice not in (None, "auto", "none"):
        raise RealtimeError(f"{prefix}.tool_choice: auto or none: this server cannot make the model call a tool "
                            "(it has no constrained decoding)", f"{prefix}.tool_choice")  # fmt: skip
    if body.prompt is not None:
        raise RealtimeError(f"{prefix}.prompt: no stored prompts here; send the instructions", f"{prefix}.prompt")


TRANSCRIBING = {"model": None, "language": None, "prompt": None}  # a transcription session's default
INCLUDE_LOGPROBS = "item.input_audio_transcription.logprobs"  # (the one `include` OpenAI's sessions take)
_TRANSCRIPTION_FIELDS = frozenset({"type", "audio", "include"})


def transcription_only(body: SessionBody) -> None:
    """A transcription session's update: its input audio alone (it makes no responses)."""
    extra = sorted(body.model_fields_set - _TRANSCRIPTION_FIELDS)
    if body.audio is not None and body.audio.output is not None:  # (named by its field: beta names it so)
        extra.insert(0, ".".join(["audio.output", *sorted(body.audio.output.model_fields_set)[:1]]))
    if extra:
        raise RealtimeError(f"session.{extra[0]}: a transcription session makes no responses; it takes its "
                            "input audio's settings alone", f"session.{extra[0]}")  # fmt: skip


def session_only(body: SessionBody) -> None:
    """The session fields with no counterpart here: refused unless unset (or what they already are)."""
    audio_in = body.audio.input if body.audio is not None else None
    if audio_in is not None:
        where = "session.audio.input"
        if audio_in.noise_reduction is not None:
            raise RealtimeError(f"{where}.noise_reduction: no noise reduction here (null)",
                                f"{where}.noise_reduction")  # fmt: skip
    if body.include and any(value != INCLUDE_LOGPROBS for value in body.include):
        raise RealtimeError(f"session.include: only {INCLUDE_LOGPROBS}", "session.include")
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
    nbytes: int = 0  # what it counts towards the conversation's bound (media.max_request_bytes)
    audio_samples: int = 0  # an assistant reply's speech sent, at audio_rate
    audio_rate: int = 0
    truncated_at: int | None = None  # conversation.item.truncate's audio_end_ms (ms), once truncated
    # "function_call" (role assistant: `call_id`, `name`, `arguments`) or "function_call_output"
    # (role tool: `call_id`, `output`)
    type: str = "message"
    call_id: str = ""
    name: str = ""
    arguments: str = ""
    output: str = ""

    def audio_ms(self) -> int:
        return -(-self.audio_samples * 1000 // self.audio_rate) if self.audio_rate else 0

    def heard_whole(self, status: str) -> bool:
        """Truncated (if at all) where a reply that completed ends: its words were all heard. (A
        cut reply's words run ahead of its speech: some were never spoken.)"""
        return self.truncated_at is None or (status == "completed" and self.truncated_at >= self.audio_ms())

    def event(self) -> dict[str, Any]:
        head = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "function_call":
            return {**head, "call_id": self.call_id, "name": self.name, "arguments": self.arguments}
        if self.type == "function_call_output":
            return {**head, "call_id": self.call_id, "output": self.output}
        return {**head, "role": self.role, "content": self.content}

    def size(self) -> int:
        """What it counts towards the conversation's bound: its words, text, audio and images."""
        calls = len(self.name.encode()) + len(self.arguments.encode()) + len(self.output.encode())
        return ITEM_BYTES + len(self.text.encode()) + calls + sum(
            len(p.text.encode()) + len(p.audio.pcm.f32le) + len(p.image.file) for p in self.parts)

    @property
    def turn(self) -> bool:
        """It is a turn of a request (an assistant turn with no words, cancelled before any or
        truncated, is nothing heard of it)."""
        return self.role != "assistant" or bool(self.text) or self.type == "function_call"

    def message(self) -> gateway_pb2.ChatMessage:
        if self.type == "function_call":
            call = gateway_pb2.ToolCall(id=self.call_id, name=self.name, arguments=self.arguments)
            return gateway_pb2.ChatMessage(role="assistant", tool_calls=[call])
        if self.type == "function_call_output":
            return gateway_pb2.ChatMessage(role="tool", content=self.output, tool_call_id=self.call_id)
        if self.role == "assistant":
            return gateway_pb2.ChatMessage(role="assistant", content=self.text)
        return gateway_pb2.ChatMessage(role=self.role, parts=self.parts)


def _realtime(call: Callable[[], T]) -> T:
    """`call()` of the HTTP door's shared decoding, its HttpError as this API's refusal."""
    try:
        return call()
    except HttpError as e:
        raise RealtimeError(e.message, e.param) from None


def b64(data: str, where: str) -> bytes:
    return _realtime(lambda: decode_b64(data, where))


def pcm_part(pcm16: bytes, rate: int, where: str) -> gateway_pb2.ContentPart:
    return _realtime(lambda: pcm16_part(pcm16, rate, where, "audio/pcm"))


def _image_part(url: str, where: str) -> gateway_pb2.ContentPart:
    return gateway_pb2.ContentPart(image=gateway_pb2.ImagePart(file=_realtime(lambda: data_url(url, where))))


def to_item(body: MessageItem, item_id: str, settings: Settings, prefix: str = "item") -> Item:
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
            pcm = input_pcm16(b64(part.audio, f"{where}.audio"), settings.input_format, f"{where}.audio")
            item.parts.append(pcm_part(pcm, settings.input_rate, f"{where}.audio"))
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
    item.nbytes = item.size()
    return item


def to_call_item(body: CallItem | CallOutputItem, item_id: str) -> Item:
    """A client's function_call or function_call_output item as a conversation item."""
    if isinstance(body, CallItem):
        item = Item(item_id, "assistant", type="function_call", call_id=body.call_id, name=body.name,
                    arguments=body.arguments)  # fmt: skip
    else:
        item = Item(item_id, "tool", type="function_call_output", call_id=body.call_id, output=body.output)
    item.nbytes = item.size()
    return item


def transcription_request(item: Item, config: dict[str, Any], logprobs: bool = False) -> gateway_pb2.GenerateRequest:
    """A committed turn's transcription: its audio and the instruction, greedy, text out (as
    /v1/audio/transcriptions asks it); `logprobs`: its tokens' own (no alternatives)."""
    (audio,) = item.parts
    req = transcription_turn(audio, transcription_instruction(config))
    req.sampling["thinker"].do_sample = False
    if logprobs:
        req.sampling["thinker"].logprobs = 0
    return req


def turn_groups(items: list[Item]) -> list[list[Item]]:
    """The items each chat turn of a request is made of, in order: a turn item alone, or an
    assistant's words with the calls after them (a response's calls go with its words, one turn;
    truncation counts turns: `fit.dropped` of these)."""
    groups: list[list[Item]] = []
    for item in (i for i in items if i.turn):
        if item.type == "function_call" and groups and groups[-1][0].role == "assistant" \
                and groups[-1][0].type in ("message", "function_call"):  # fmt: skip
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


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
    for group in turn_groups(items):
        message = group[0].message()
        for call in group[1:]:
            message.tool_calls.extend(call.message().tool_calls)
        req.messages.append(message)
    if settings.tools and settings.tool_choice != "none":  # (as the chat door takes them)
        req.tools.extend(json.dumps(chat_tool(t)) for t in settings.tools)
    thinker = stage_pb2.SamplingParams()
    if settings.max_output_tokens is not None:
        thinker.max_tokens = settings.max_output_tokens
    if settings.temperature is not None:
        apply_temperature(req, thinker, settings.temperature, seeded=False)
    req.sampling["thinker"].CopyFrom(thinker)
    return req
