"""OpenAI's speech-to-text endpoints on an omni model: `POST /v1/audio/transcriptions` and
`POST /v1/audio/translations` (multipart/form-data, as OpenAI's clients send them).

The model hears the uploaded file and is asked, in the user's turn, to transcribe it (or to
translate it into English): the request is a chat turn `[audio, instruction]` with text out
only, served through the same path as every other request. What the fields do here:

* `file` (required): any audio (or video) FFmpeg reads; `model` as everywhere (optional).
* `language` (ISO-639-1, transcriptions) names the spoken language in the instruction
  ("Transcribe the German audio into text."); for translations it is the source language.
* `prompt` is context the instruction quotes (names, spellings, the text before this part).
* `response_format`: `json` (default: `{"text", "usage"}`) or `text`. `srt`, `vtt` and
  `verbose_json` need timestamps the model does not give: refused (400), as are
  `timestamp_granularities[]`, any other list field (`keywords[]`,
  `known_speaker_names[]`, ...: each would change the text) and a `chunking_strategy` other
  than `auto` (the SDK sends an object as `chunking_strategy[type]`, ...).
* `temperature`: 0 or unset is greedy (the same file, the same text); above 0 samples, with
  `seed` (not OpenAI's) to repeat a draw.
* `stream: true` (transcriptions): server-sent `transcript.text.delta` events as the text is
  made, then one `transcript.text.done` with the whole text and the usage.
* `include[]=logprobs` (transcriptions, json): the text's tokens with their log-probabilities
  (`logprobs: [{token, logprob, bytes}]`, in the reply and in each streamed event), as OpenAI's
  gpt-4o-transcribe gives them.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from python_multipart.multipart import parse_options_header
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from gateway.http_error import HttpError
from omnistage.models.sampling import greedy_temperature
from omnistage.v1 import gateway_pb2

__all__ = ["SpeechToText", "check_form_type", "instruction", "read_form", "to_transcription_request"]

# The form's fields other than the file: a few short strings (the prompt is the longest).
MAX_FIELD_BYTES = 64 * 1024
MAX_FIELDS = 32
# ISO-639-1 names for the instruction: the languages Qwen3-Omni's speech understanding covers and
# other common ones; another well-formed code is named by itself ("the 'xh' audio").
LANGUAGES = {
    "ar": "Arabic", "cs": "Czech", "da": "Danish", "de": "German", "el": "Greek", "en": "English",
    "es": "Spanish", "fa": "Persian", "fi": "Finnish", "fr": "French", "he": "Hebrew", "hi": "Hindi",
    "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean", "ms": "Malay",
    "nl": "Dutch", "no": "Norwegian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian",
    "sv": "Swedish", "th": "Thai", "tl": "Filipino", "tr": "Turkish", "uk": "Ukrainian", "ur": "Urdu",
    "vi": "Vietnamese", "yue": "Cantonese", "zh": "Chinese",
}  # fmt: skip
_LANGUAGE = re.compile(r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8})?$")  # "en", "yue", "pt-BR"


class SpeechToText(BaseModel):
    """The form's fields (strings in a form: "0.2", "true" are read as their types)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    language: str | None = Field(None, max_length=35)
    prompt: str | None = Field(None, max_length=4096)
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] | None = None  # None: json
    temperature: float | None = Field(None, ge=0, le=2)
    stream: bool | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    chunking_strategy: str | None = None


@dataclass
class Upload:
    """A parsed form: its fields, the file's bytes, and the list fields it sent."""

    form: SpeechToText
    audio: bytes
    lists: dict[str, list[str]]  # `name[]` and `name[key]` fields
    extra: dict[str, str]  # the form's other fields, unread


async def _once(raw: bytes) -> AsyncGenerator[bytes, None]:
    yield raw


def check_form_type(headers: Headers) -> bytes:
    """The form's boundary; a body that is not multipart/form-data is refused (415) before it
    is read."""
    kind = headers.get("content-type", "")
    media, options = parse_options_header(kind)
    boundary = options.get(b"boundary", b"")
    if media != b"multipart/form-data" or not boundary:
        raise HttpError(415, f"body: expected multipart/form-data with the audio as a file part `file`, got "
                             f"{kind or 'no content-type'}", code="unsupported_media_type")  # fmt: skip
    return boundary


async def read_form(headers: Headers, raw: bytes) -> Upload:
    """The multipart body (already read, within the size limit) as its fields and file, or an
    HttpError naming what is wrong."""
    boundary = check_form_type(headers)
    # (the parser takes a body cut short for a whole one: its last part would go missing; what
    # follows the close delimiter, an epilogue, is the body's to have)
    close = b"--" + boundary + b"--"
    if b"\r\n" + close not in raw and not raw.startswith(close):
        raise HttpError(400, "body: incomplete multipart/form-data (it does not end with its closing boundary)")
    parser = MultiPartParser(headers, _once(raw), max_files=1, max_fields=MAX_FIELDS, max_part_size=MAX_FIELD_BYTES)
    try:
        parsed = await parser.parse()
    except MultiPartException as e:  # malformed, over a limit, or more than one file
        raise HttpError(400, f"body: {e.message} (the audio goes as one file part, with a filename: "
                             "curl -F file=@speech.wav)") from None  # fmt: skip
    try:
        fields: dict[str, str] = {}
        lists: dict[str, list[str]] = {}
        audio: bytes | None = None
        for name, value in parsed.multi_items():
            if isinstance(value, UploadFile):
                if name != "file":
                    raise HttpError(400, f"{name}: a file where a field was expected (the audio goes in `file`)",
                                    param=name)  # fmt: skip
                audio = await value.read()
            elif name.endswith("]"):  # `include[]`; an object's keys: `chunking_strategy[type]`
                lists.setdefault(name, []).append(value)
            elif name in fields:  # (a form keeps the last: `include=words&include=logprobs` lost one)
                raise HttpError(400, f"{name}: sent more than once (a list goes as {name}[])", param=name)
            else:
                fields[name] = value
    finally:
        await parsed.close()
    if audio is None:
        why = ("sent as a plain field: send it as a file part, with a filename (curl -F file=@speech.wav)"
               if "file" in fields else "missing (the audio, as a file part of the form)")  # fmt: skip
        raise HttpError(400, f"file: {why}", param="file")
    if not audio:
        raise HttpError(400, "file: empty", param="file")
    try:
        form = SpeechToText.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = str(err["loc"][0]) if err["loc"] else "body"
        raise HttpError(400, f"{where}: {err['msg']}", param=where) from None
    return Upload(form, audio, lists, {k: v for k, v in fields.items() if k not in SpeechToText.model_fields})


def _language(code: str) -> str:
    if not _LANGUAGE.match(code):
        raise HttpError(400, f"language: expected an ISO-639-1 code such as 'en', got {code!r}", param="language")
    return LANGUAGES.get(code.split("-")[0].lower(), repr(code))


def instruction(translate: bool, language: str | None = None, prompt: str | None = None) -> str:
    """What the user's turn asks of the audio."""
    spoken = f"the {_language(language)} audio" if language else "the audio"
    text = f"Translate {spoken} into English text." if translate else f"Transcribe {spoken} into text."
    if prompt:
        text += f" Context (words it may contain, or the text before it): {prompt}"
    return text


def transcription_turn(audio: gateway_pb2.ContentPart, text: str) -> gateway_pb2.GenerateRequest:
    """What speech to text asks of the model: one user turn, the audio then the instruction, text out."""
    req = gateway_pb2.GenerateRequest(want_audio=False)
    req.messages.append(gateway_pb2.ChatMessage(role="user", parts=[audio, gateway_pb2.ContentPart(text=text)]))
    return req


def to_transcription_request(upload: Upload, translate: bool) -> gateway_pb2.GenerateRequest:
    """The form as the gateway's own request: one user turn, the audio then the instruction,
    text out only."""
    form = upload.form
    if form.response_format in ("srt", "vtt", "verbose_json"):
        raise HttpError(400, f"response_format: {form.response_format} needs timestamps, which this model does "
                             "not give; use json or text", param="response_format")  # fmt: skip
    # (every other list field would change the text, and none is taken: the model gives text only)
    # `include[]`, `include[0]`, ... or a hand-written `include`
    listed = [n for n in upload.lists if n.partition("[")[0] == "include"]
    includes = [*(v for n in listed for v in upload.lists[n]),
                *([upload.extra["include"]] if upload.extra.get("include") else [])]  # fmt: skip
    others = [n for n in upload.lists if n not in listed]
    for name in [*others, *(["timestamp_granularities"] if upload.extra.get("timestamp_granularities") else [])]:
        field = name.partition("[")[0]
        if field == "chunking_strategy":
            raise HttpError(400, "chunking_strategy: only auto (the file is heard whole)", param=field)
        raise HttpError(400, f"{field}: not supported (the model gives text only: no timestamps, keywords or "
                             "speakers)", param=field)  # fmt: skip
    if form.chunking_strategy not in (None, "auto"):
        raise HttpError(400, "chunking_strategy: only auto (the file is heard whole)", param="chunking_strategy")
    if translate and form.stream:
        raise HttpError(400, "stream: translations are not streamed (as OpenAI's)", param="stream")
    if includes:
        if set(includes) != {"logprobs"}:
            raise HttpError(400, f"include: only logprobs, got {sorted(set(includes) - {'logprobs'})}", param="include")
        if translate:
            raise HttpError(400, "include: translations give no logprobs (as OpenAI's)", param="include")
        if form.response_format == "text":
            raise HttpError(400, "include: logprobs need response_format json", param="include")
    audio = gateway_pb2.ContentPart(audio=gateway_pb2.AudioPart(file=upload.audio))
    req = transcription_turn(audio, instruction(translate, form.language, form.prompt))
    thinker = req.sampling["thinker"]
    if form.temperature is None or greedy_temperature(form.temperature):
        thinker.do_sample = False  # OpenAI's default 0: the same file, the same text
    else:
        thinker.do_sample = True
        thinker.temperature = form.temperature
    if form.seed is not None:
        thinker.seed = form.seed
    if includes:
        thinker.logprobs = 0  # the tokens' own, no alternatives (OpenAI's transcription logprobs have none)
    return req
