"""The speech-to-text form (gateway/transcription.py): multipart bodies as OpenAI's clients send
them, read into the chat turn the model hears; every bad form a 400 naming its field."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from starlette.datastructures import Headers

from gateway.http_error import HttpError
from gateway.transcription import Upload, instruction, read_form, to_transcription_request

AUDIO = b"RIFF\x00\x00\x00\x00WAVEfmt not really a wav"  # the form carries bytes; the gateway decodes them


def _form(data: dict[str, Any] | None = None, files: Any = None) -> tuple[Headers, bytes]:
    """A body and its headers as httpx (the OpenAI SDK's transport) encodes them."""
    request = httpx.Request("POST", "http://127.0.0.1/v1/audio/transcriptions", data=data,
                            files=files if files is not None else {"file": ("a.wav", AUDIO, "audio/wav")})  # fmt: skip
    return Headers(raw=[(k.lower(), v) for k, v in request.headers.raw]), request.read()


def _read(data: dict[str, Any] | None = None, files: Any = None) -> Upload:
    return asyncio.run(read_form(*_form(data, files)))


def _refused(param: str, data: dict[str, Any] | None = None, files: Any = None, translate: bool = False) -> HttpError:
    with pytest.raises(HttpError) as e:
        to_transcription_request(_read(data, files), translate)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value


def test_the_file_and_an_instruction_are_one_user_turn_with_text_out() -> None:
    req = to_transcription_request(_read({"model": "m", "language": "de"}), translate=False)
    assert not req.want_audio
    [turn] = req.messages
    assert turn.role == "user"
    assert [p.WhichOneof("kind") for p in turn.parts] == ["audio", "text"]
    assert turn.parts[0].audio.file == AUDIO
    assert turn.parts[1].text == "Transcribe the German audio into text."
    assert req.sampling["thinker"].HasField("do_sample") and not req.sampling["thinker"].do_sample  # greedy


def test_instructions_name_the_language_the_task_and_the_prompt() -> None:
    assert instruction(False) == "Transcribe the audio into text."
    assert instruction(True) == "Translate the audio into English text."
    assert instruction(True, "fr") == "Translate the French audio into English text."
    assert instruction(False, "pt-BR") == "Transcribe the Portuguese audio into text."
    assert instruction(False, "xh") == "Transcribe the 'xh' audio into text."  # a code with no name here
    said = instruction(False, None, "Omnistage, Qwen")
    assert said.startswith("Transcribe the audio into text.") and said.endswith("Omnistage, Qwen")


def test_form_strings_are_read_as_their_types() -> None:
    upload = _read({"temperature": "0.4", "seed": "7", "stream": "true", "response_format": "text"})
    assert upload.form.temperature == 0.4 and upload.form.seed == 7 and upload.form.stream
    thinker = to_transcription_request(upload, translate=False).sampling["thinker"]
    assert thinker.do_sample and thinker.temperature == pytest.approx(0.4) and thinker.seed == 7
    assert not to_transcription_request(_read({"temperature": "0"}), False).sampling["thinker"].do_sample


def test_include_logprobs_asks_the_thinker_for_the_tokens_own() -> None:
    for data in ({"include[]": ["logprobs"]}, {"include": "logprobs"}, {"include[]": ["logprobs"], "stream": "true"},
                 {"include[0]": "logprobs"}):
        thinker = to_transcription_request(_read(data), translate=False).sampling["thinker"]
        assert thinker.HasField("logprobs") and thinker.logprobs == 0
    assert not to_transcription_request(_read({}), translate=False).sampling["thinker"].HasField("logprobs")


def test_a_bad_form_is_refused_naming_its_field() -> None:
    _refused("response_format", {"response_format": "srt"})
    _refused("response_format", {"response_format": "verbose_json"})
    _refused("response_format", {"response_format": "mp3"})
    _refused("timestamp_granularities", {"timestamp_granularities[]": ["word"]})
    _refused("include", {"include[]": ["logprobs", "words"]})  # (logprobs alone is taken)
    _refused("include", {"include": "timestamps"})  # (hand-written, without the brackets)
    _refused("include", {"include": ["words", "logprobs"]})  # (a field twice: a form would keep the last)
    _refused("include", {"include[]": ["logprobs"]}, translate=True)
    _refused("include", {"include[]": ["logprobs"], "response_format": "text"})
    _refused("known_speaker_names", {"known_speaker_names[]": ["ann"]})  # any list field: each changes the text
    # an object, as the OpenAI SDK sends one: a field per key
    _refused("chunking_strategy", {"chunking_strategy[type]": "server_vad", "chunking_strategy[threshold]": "0.5"})
    _refused("temperature", {"temperature": "warm"})
    _refused("temperature", {"temperature": "nan"})
    _refused("stream", {"stream": "maybe"})
    _refused("language", {"language": "english please"})
    _refused("chunking_strategy", {"chunking_strategy": "server_vad"})
    _refused("chunking_strategy", {"chunking_strategy": '{"type": "server_vad"}'})
    assert to_transcription_request(_read({"chunking_strategy": "auto"}), False).messages
    _refused("stream", {"stream": "true"}, translate=True)  # (OpenAI's translations do not stream)
    _refused("other", {"model": "m"}, files={"other": ("a.wav", AUDIO)})  # a file under another name
    _refused("file", files={"file": ("a.wav", b"")})
    with pytest.raises(HttpError) as e:  # a form with no file at all
        _read(files={"model": (None, "m")})
    assert e.value.param == "file" and "missing" in e.value.message
    with pytest.raises(HttpError) as e:  # the audio as a plain field (no filename: curl -F 'file=<a.wav')
        _read(files={"file": (None, "RIFF....WAVE")})
    assert e.value.param == "file" and "plain field" in e.value.message
    with pytest.raises(HttpError) as e:  # two files
        _read(files=[("file", ("a.wav", AUDIO)), ("file", ("b.wav", AUDIO))])
    assert e.value.status == 400 and "Too many files" in e.value.message


def test_a_body_that_is_not_a_whole_form_is_refused() -> None:
    for kind in ("application/json", "application/x-www-form-urlencoded", "multipart/form-data"):  # (no boundary)
        with pytest.raises(HttpError) as e:
            asyncio.run(read_form(Headers({"content-type": kind}), b'{"file": "x"}'))
        assert e.value.status == 415 and "multipart/form-data" in e.value.message
    headers, body = _form({"model": "m"})
    for cut in (len(body) // 2, len(body) - 8):  # cut off mid-part, and just before the closing boundary's end
        with pytest.raises(HttpError) as e:
            asyncio.run(read_form(headers, body[:cut]))
        assert e.value.status == 400 and "incomplete" in e.value.message
    assert asyncio.run(read_form(headers, body)).audio == AUDIO  # (whole, it is read)
    assert asyncio.run(read_form(headers, body + b"an epilogue, which RFC 2046 allows\r\n")).audio == AUDIO


def test_a_refused_turn_is_said_in_the_forms_terms() -> None:
    """The gateway refuses the chat turn the form became; the client sent a form."""
    from gateway.http_api import _of_file

    media = _of_file(HttpError(400, "messages[0].content[0]: cannot decode the audio", param="messages[0].content[0]"))
    assert (media.param, media.message) == ("file", "file: cannot decode the audio")
    long = _of_file(HttpError(400, "prompt: 2000 tokens, over max_model_len=1024", param="messages"))
    assert long.param == "file" and long.message.startswith("file: the audio and its instruction: 2000 tokens")
    other = _of_file(HttpError(400, "language: bad", param="language"))
    assert (other.param, other.message) == ("language", "language: bad")
