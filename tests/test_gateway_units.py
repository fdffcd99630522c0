"""The gateway's pieces on their own: the audio formats, the OpenAI request translation (its text
stream: tests/test_text_stream.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import time
import wave
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from benchmarks import media
from gateway.audio_out import FORMAT_NAMES, AudioEncoder, format_from_name
from gateway.media import decode_audio
from omnistage.config import MediaConfig
from omnistage.v1 import gateway_pb2

RATE = 24_000


def _encode(fmt: str, samples: np.ndarray, piece: int = 4800) -> list[bytes]:
    enc = AudioEncoder(format_from_name(fmt), RATE)
    parts = [enc.push(samples[i : i + piece]) for i in range(0, samples.size, piece)]
    return [*parts, enc.finish()]


@pytest.mark.parametrize("fmt", list(FORMAT_NAMES))
def test_every_format_carries_the_audio(fmt: str) -> None:
    samples = media.tone(1.5, RATE, 330.0, seed=5)
    parts = _encode(fmt, samples)
    data = b"".join(parts)
    pcm16 = (np.clip(samples, -1, 1) * 32767).round().astype("<i2")
    if fmt == "pcm_f32le":
        assert np.array_equal(np.frombuffer(data, "<f4"), samples)
    elif fmt == "pcm16":
        assert np.array_equal(np.frombuffer(data, "<i2"), pcm16)
    elif fmt == "wav":
        with wave.open(io.BytesIO(data)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
            assert np.array_equal(np.frombuffer(w.readframes(w.getnframes()), "<i2"), pcm16)
    else:
        decoded = decode_audio(data, RATE, MediaConfig()).samples
        if fmt == "flac":
            assert decoded.size == samples.size and np.abs(decoded - samples).max() < 2 / 32767
        else:
            assert abs(decoded.size - samples.size) < 0.08 * RATE
            # the sound itself, not silence of its length: its loudness survives the codec
            assert float(np.sqrt(np.mean(decoded**2))) > 0.3 * float(np.sqrt(np.mean(samples**2)))
    streamed = fmt in ("pcm_f32le", "pcm16", "mp3", "opus", "aac")
    nonempty = [i for i, p in enumerate(parts) if p]
    if streamed:  # pieces as the samples come, not one file at the end
        assert len(nonempty) >= len(parts) - 2 and nonempty[0] == 0
    else:
        assert nonempty == [len(parts) - 1]


@pytest.mark.parametrize("fmt", list(FORMAT_NAMES))
def test_the_same_audio_is_the_same_bytes(fmt: str) -> None:
    """As a greedy reply's samples are (opus's Ogg stream had a random serial number)."""
    samples = media.tone(0.5, RATE, 220.0, seed=3)
    assert b"".join(_encode(fmt, samples)) == b"".join(_encode(fmt, samples))


@pytest.mark.parametrize("fmt", list(FORMAT_NAMES))
def test_a_reply_with_no_audio_encodes(fmt: str) -> None:
    """A spoken reply whose talker made no frame (flac raised EOFError: the streamed reply was cut
    with no [DONE]); the whole-file formats are files of no samples."""
    import av

    enc = AudioEncoder(format_from_name(fmt), RATE)
    data = enc.push(np.zeros(0, np.float32)) + enc.finish()
    if fmt == "wav":
        with wave.open(io.BytesIO(data)) as w:
            assert w.getnframes() == 0 and w.getframerate() == RATE
    elif fmt == "flac":
        with av.open(io.BytesIO(data)) as container:
            assert container.streams.audio[0].sample_rate == RATE
            assert sum(f.samples for f in container.decode(audio=0)) == 0
    else:
        assert data == b""


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown audio format 'aiff'"):
        format_from_name("aiff")
    with pytest.raises(ValueError):
        AudioEncoder(99, RATE)


def _chat(**kw: Any) -> Any:
    from gateway.http_api import ChatRequest

    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def test_openai_request_becomes_the_gateway_request() -> None:
    from gateway.http_api import to_generate_request

    png = media.encode_image(media.image(8, 8))
    pcm = (np.arange(48) * 100).astype("<i2").tobytes()
    body = _chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(pcm).decode(), "format": "pcm16"}},
            ]},
        ],
        modalities=["text", "audio"], audio={"voice": "Ethan", "format": "mp3"}, temperature=0,
        max_completion_tokens=7, max_tokens=99, seed=3, stop="END",
    )  # fmt: skip
    req = to_generate_request(body, ["chelsie", "ethan"])
    assert req.want_audio and req.speaker == "Ethan" and req.audio_format == gateway_pb2.MP3
    assert [m.role for m in req.messages] == ["system", "user"]
    parts = req.messages[1].parts
    assert [p.WhichOneof("kind") for p in parts] == ["text", "image", "audio"]
    assert parts[1].image.file == png
    assert parts[2].audio.pcm.sample_rate == 24000
    assert np.allclose(np.frombuffer(parts[2].audio.pcm.f32le, "<f4"), np.arange(48) * 100 / 32768)
    thinker, talker = req.sampling["thinker"], req.sampling["talker"]
    assert (thinker.max_tokens, thinker.do_sample, thinker.seed) == (7, False, 3)
    assert talker.HasField("do_sample") and not talker.do_sample
    assert list(req.stop) == ["END"]
    sampled = to_generate_request(_chat(temperature=0.7, top_p=0.9), ["ethan"])
    assert sampled.sampling["thinker"].do_sample and abs(sampled.sampling["thinker"].temperature - 0.7) < 1e-9
    assert not sampled.want_audio and "talker" not in sampled.sampling


def test_openai_request_errors_name_the_field() -> None:
    from gateway.http_api import HttpError, to_generate_request

    cases = [
        (_chat(modalities=["text", "audio"], audio={"voice": "nobody"}), "audio.voice: unknown voice 'nobody'"),
        (_chat(modalities=["text", "audio"], audio={"voice": {"id": "nobody"}}), "audio.voice: unknown voice"),
        (_chat(tools=[{"type": "function", "function": {"name": "f b"}}]), "tools[0].function.name: String should"),
        (_chat(response_format={"type": "json_object"}), "response_format: only"),
        (_chat(top_logprobs=2), "top_logprobs: logprobs must be true"),
        (_chat(functions=[{"name": "f"}]), "functions: function calling is not supported"),
        (_chat(logit_bias={"x1": 5}), "logit_bias: key 'x1' is not a token id"),
        (_chat(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias: 1025 entries; at most 1024"),
        (_chat(stream_options={"include_usage": True}), "stream_options: only allowed when stream is true"),
        (_chat(stream_options={"include_usage": False}), "stream_options: only allowed when stream is true"),
        (_chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "audio": {"id": "audio_x"}}]),
         "messages[1].audio.id: unknown or expired audio id 'audio_x'"),
        (_chat(messages=[{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "https://a/b"}}]}]),
         "messages[0].content[0].audio_url.url: only data: URLs"),
        (_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://a/b"}}]}]),
         "messages[0].content[0].image_url.url: only data: URLs"),
        (_chat(messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:x,AAAA"}}]}]),
         "messages[0].content[0].video_url.url: expected data:"),
        (_chat(messages=[{"role": "user", "content": [{"type": "input_audio",
                                                        "input_audio": {"data": "AAAAA", "format": "pcm16"}}]}]),
         "messages[0].content[0].input_audio.data"),
    ]  # fmt: skip
    for body, message in cases:
        with pytest.raises(HttpError) as e:
            to_generate_request(body, ["ethan"])
        assert e.value.status == 400 and e.value.message.startswith(message), e.value.message
    # a client's string is quoted cut, as the gRPC front door cuts it (100,000 characters came back whole)
    for body in (_chat(modalities=["text", "audio"], audio={"voice": "v" * 100_000}),
                 _chat(messages=[{"role": "assistant", "audio": {"id": "a" * 100_000}}])):  # fmt: skip
        with pytest.raises(HttpError) as e:
            to_generate_request(body, ["ethan"])
        assert len(e.value.message) < 300 and "(cut; 100000 characters)" in e.value.message, e.value.message


def test_what_other_openai_clients_send_is_understood() -> None:
    """Shapes real clients send that OpenAI's own examples do not: nulls for unset fields, vLLM's
    parts and fields, OpenAI's stock voices, wrapped base64, an earlier spoken reply by id."""
    from gateway.http_api import CODE2WAV_SEED_OFFSET, TALKER_SEED_OFFSET, to_generate_request

    wav = media.encode_audio(media.tone(0.2, 16_000, seed=1), 16_000, "wav")
    wrapped = base64.encodebytes(wav).decode()  # MIME: a newline every 76 characters
    assert "\n" in wrapped.strip()
    body = _chat(
        messages=[
            {"role": "user", "content": [
                {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + wrapped}},
                {"type": "input_audio", "input_audio": {"data": wrapped, "format": None}},
            ]},
            {"role": "assistant", "content": None, "audio": {"id": "audio_1"}},
            {"role": "user", "content": "and then?"},
        ],
        modalities=None, stream=None, n=None, stream_options={}, audio=None,
        mm_processor_kwargs={"use_audio_in_video": True}, top_k=-1, repetition_penalty=1.1, seed=-5,
        tools=[], response_format={"type": "text"}, logprobs=False, functions=None, presence_penalty=0,
        frequency_penalty=0.0, logit_bias={},
    )  # fmt: skip
    req = to_generate_request(body, ["ethan"], {"audio_1": "It was a tone."}.get)
    assert not req.want_audio and req.use_audio_in_video and req.audio_format == gateway_pb2.WAV
    assert [p.audio.file for p in req.messages[0].parts] == [wav, wav]
    assert [(m.role, m.content) for m in req.messages[1:]] == [("assistant", "It was a tone."), ("user", "and then?")]
    thinker = req.sampling["thinker"]
    assert thinker.HasField("top_k") and thinker.top_k == 0  # vLLM's -1: off, the stage's 0
    assert abs(thinker.repetition_penalty - 1.1) < 1e-9 and thinker.seed == -5
    assert "talker" not in req.sampling  # no speech asked for: nothing to seed
    spoken = _chat(modalities=["text", "audio"], audio={"voice": "alloy"}, seed=-5, top_k=7)
    spoken = to_generate_request(spoken, ["ethan"])
    assert spoken.speaker == ""  # OpenAI's stock voice: the checkpoint's default speaker
    assert spoken.sampling["thinker"].top_k == 7 and spoken.sampling["talker"].seed == TALKER_SEED_OFFSET - 5
    # Qwen2.5-Omni's token2wav draws its noise from code2wav's seed: the request's seeds it too
    assert spoken.sampling["code2wav"].seed == CODE2WAV_SEED_OFFSET - 5
    wrap = to_generate_request(_chat(modalities=["text", "audio"], seed=(1 << 63) - 1), ["ethan"])
    assert wrap.sampling["talker"].seed == -(1 << 63) + TALKER_SEED_OFFSET - 1  # wrapped into int64
    assert wrap.sampling["code2wav"].seed == -(1 << 63) + CODE2WAV_SEED_OFFSET - 1
    assert to_generate_request(_chat(modalities=["text", "audio"], audio={"voice": {"id": "Ethan"}}),
                               ["ethan"]).speaker == "Ethan"  # fmt: skip
    # as in vLLM, a temperature under 1e-5 is greedy (sampling there overflows), in the body and in an entry
    tiny = to_generate_request(_chat(modalities=["text", "audio"], temperature=1e-6,
                                     sampling_params_list=[{"temperature": 9e-6}, {"temperature": 1e-7}]), ["ethan"])
    for stage in ("thinker", "talker"):
        assert tiny.sampling[stage].HasField("do_sample") and not tiny.sampling[stage].do_sample, stage
        assert tiny.sampling[stage].temperature == 0, stage
    tiny_body = to_generate_request(_chat(modalities=["text", "audio"], temperature=9.9e-6), ["ethan"]).sampling
    assert not tiny_body["thinker"].do_sample and not tiny_body["talker"].do_sample
    edge = to_generate_request(_chat(temperature=1e-5, sampling_params_list=[{"temperature": 1e-5}]), ["ethan"])
    assert edge.sampling["thinker"].do_sample and edge.sampling["thinker"].temperature > 0
    # OpenAI takes top_p 0 (only the most likely token): greedy text, whatever the temperature
    zero = to_generate_request(_chat(temperature=0.8, top_p=0), ["ethan"]).sampling["thinker"]
    assert zero.HasField("do_sample") and not zero.do_sample and zero.temperature == 0 and zero.top_p == 0


def test_vllm_omni_sampling_params_list_sets_each_stage() -> None:
    """Entry i is stage i's sampling, over the body's own fields; stop_token_ids add to the
    stage's stop ids (vLLM's meaning); code2wav takes only a seed; a field with no counterpart
    that would change the output is refused."""
    from pydantic import ValidationError

    from gateway.http_api import HttpError, to_generate_request

    stages = [{"temperature": 0, "max_tokens": 5, "stop_token_ids": [7, 50], "detokenize": True, "n": 1, "stop": [],
               "logit_bias": {}, "bad_words": None},
              {"temperature": 0.9, "top_k": -1, "top_p": 0.8, "seed": 11, "stop_token_ids": [2150],
               "repetition_penalty": 1.05, "max_tokens": 4096},
              {"temperature": 0.0, "top_p": 1.0, "max_tokens": 65536, "seed": 42, "repetition_penalty": 1.1}]
    stops = {"thinker": (50, 51), "talker": (99,)}
    body = _chat(modalities=["text", "audio"], temperature=0.7, seed=3, max_tokens=50, sampling_params_list=stages)
    req = to_generate_request(body, ["ethan"], stop_ids=stops)
    thinker, talker, code2wav = (req.sampling[s] for s in ("thinker", "talker", "code2wav"))
    assert (thinker.do_sample, thinker.max_tokens, thinker.seed, list(thinker.stop_ids)) == (False, 5, 3, [50, 51, 7])
    assert (talker.do_sample, talker.top_k, talker.seed, list(talker.stop_ids)) == (True, 0, 11, [99, 2150])
    assert abs(talker.temperature - 0.9) < 1e-9 and abs(talker.top_p - 0.8) < 1e-9 and talker.max_tokens == 4096
    assert [f.name for f, _ in code2wav.ListFields()] == ["seed"] and code2wav.seed == 42
    text_only = to_generate_request(_chat(sampling_params_list=stages), ["ethan"], stop_ids=stops)
    assert set(text_only.sampling) == {"thinker"}  # the talker and code2wav do not run
    skipped = to_generate_request(_chat(modalities=["text", "audio"], temperature=0.5,
                                        sampling_params_list=[None, {"temperature": 0}]), ["ethan"])  # fmt: skip
    assert skipped.sampling["thinker"].do_sample and not skipped.sampling["talker"].do_sample
    for entry, field in (({"min_tokens": 2}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos"),
                         ({"stop": ["x"]}, "stop"), ({"n": 2}, "n"), ({"allowed_token_ids": [1]}, "allowed_token_ids"),
                         ({"structured_outputs": {"json": {}}}, "structured_outputs")):  # fmt: skip
        with pytest.raises(HttpError) as e:
            to_generate_request(_chat(sampling_params_list=[entry]), ["ethan"])
        assert e.value.status == 400 and e.value.param == f"sampling_params_list[0].{field}", e.value.message
    for entry, field in (({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias")):
        with pytest.raises(HttpError) as e:  # the thinker's alone (its entry takes them)
            to_generate_request(_chat(sampling_params_list=[{}, entry]), ["ethan"])
        assert e.value.status == 400 and e.value.param == f"sampling_params_list[1].{field}", e.value.message
    with pytest.raises(HttpError) as e:  # checked even where the talker will not run (text only)
        to_generate_request(_chat(sampling_params_list=[{}, {"ignore_eos": True}]), ["ethan"])
    assert e.value.param == "sampling_params_list[1].ignore_eos"
    for bad in ([{}, {}, {}, {}], [{"temperature": -1}], [{"stop_token_ids": [-3]}]):
        with pytest.raises(ValidationError):
            _chat(sampling_params_list=bad)


def test_vllm_fields_at_the_top_level_are_honoured_or_refused() -> None:
    """vLLM's clients send its extra fields at the body's top level: `stop_token_ids` stops the
    thinker there too, and the others that would change the reply are a 400 naming the field
    (all were ignored: `"ignore_eos": true` gave an ordinary reply)."""
    from gateway.http_api import HttpError, to_generate_request

    stops = {"thinker": (50, 51), "talker": (99,)}
    req = to_generate_request(_chat(stop_token_ids=[7, 50]), ["ethan"], stop_ids=stops)
    assert list(req.sampling["thinker"].stop_ids) == [50, 51, 7]
    # an entry's own replaces the body's (they were added together)
    req = to_generate_request(_chat(stop_token_ids=[7], sampling_params_list=[{"stop_token_ids": [8]}]), ["ethan"],
                              stop_ids=stops)  # fmt: skip
    assert list(req.sampling["thinker"].stop_ids) == [50, 51, 8]
    for field, value in (("ignore_eos", True), ("min_tokens", 20), ("min_p", 0.9), ("best_of", 2), ("echo", True),
                         ("include_stop_str_in_output", True), ("skip_special_tokens", False),
                         ("guided_json", {"type": "object"}),
                         ("add_generation_prompt", False), ("length_penalty", 0.5)):  # fmt: skip
        with pytest.raises(HttpError) as e:
            to_generate_request(_chat(**{field: value}), ["ethan"])
        assert e.value.status == 400 and e.value.param == field, e.value.message
    # chat_template_kwargs: each value goes to the gateway as JSON (it keeps those the template reads)
    sent = {"enable_thinking": False, "depth": 3, "names": ["a", "b"], "note": None}
    got = to_generate_request(_chat(chat_template_kwargs=sent), ["ethan"]).chat_template_kwargs
    assert {k: json.loads(v) for k, v in got.items()} == sent and isinstance(json.loads(got["depth"]), int)
    with pytest.raises(HttpError) as e:
        to_generate_request(_chat(chat_template_kwargs="x"), ["ethan"])
    assert e.value.param == "chat_template_kwargs", e.value.message
    # temperature 0: a sampled vocoder's noise is pinned too (as seed 0 pins it), unless a seed is set
    from gateway.http_api import CODE2WAV_SEED_OFFSET

    greedy = to_generate_request(_chat(modalities=["text", "audio"], temperature=0), ["ethan"]).sampling
    assert greedy["code2wav"].seed == CODE2WAV_SEED_OFFSET
    seeded = to_generate_request(_chat(modalities=["text", "audio"], temperature=0, seed=4), ["ethan"]).sampling
    assert seeded["code2wav"].seed == CODE2WAV_SEED_OFFSET + 4
    sampled = to_generate_request(_chat(modalities=["text", "audio"], temperature=0.7), ["ethan"]).sampling
    assert "code2wav" not in sampled  # (the gateway draws it)
    # what changes nothing is taken, and fields no one acts on stay ignored
    for field, value in (("ignore_eos", False), ("min_tokens", 0), ("min_p", 0.0), ("best_of", 1), ("echo", False),
                         ("skip_special_tokens", True), ("length_penalty", 1), ("chat_template_kwargs", {}),
                         ("user", "u-1"), ("metadata", {"a": "b"}), ("priority", 3)):  # fmt: skip
        taken = to_generate_request(_chat(**{field: value}), ["ethan"])
        assert taken == to_generate_request(_chat(), ["ethan"]), field


def test_stop_texts_are_the_thinkers_and_checked_as_the_gateways_stop() -> None:
    """`SamplingParams.stop_texts` (the gateway's `stop`, which the thinker ends its reply at):
    taken by the thinker, checked as `stop` is (count, empty, length), refused for any other
    stage, and carried through the proto both ways."""
    from omnistage.models import SamplingParams
    from omnistage.v1 import stage_pb2
    from omnistage.wire import StageError
    from services import edges

    def start_with(stage: str, texts: list[str]) -> Any:
        start = stage_pb2.Start(request_id="r")
        start.sampling[stage].stop_texts.extend(texts)
        return start

    got = edges.sampling("thinker", start_with("thinker", ["robot", "sing"]), SamplingParams())
    assert got.stop_texts == ("robot", "sing")
    assert list(edges.sampling_proto(got).stop_texts) == ["robot", "sing"]
    for texts, needle in ((["x"] * 17, "at most 16"), ([""], r"stop\[0\]: empty"), (["x" * 300], "longer than")):
        with pytest.raises(StageError, match="thinker: sampling: stop_texts: .*" + needle):
            edges.sampling("thinker", start_with("thinker", texts), SamplingParams())
    with pytest.raises(StageError, match=r"stop_texts are for the thinker only, not \['talker'\]"):
        edges.check_start("talker", start_with("talker", ["x"]))


def test_a_sampling_knob_without_do_sample_says_what_was_meant() -> None:
    """A stage's sampling with a temperature, a top_p under 1 or a top_k above 0 and no
    do_sample samples, on a checkpoint whose default is greedy (it stayed greedy: `top_p: 0.5`
    over HTTP, `{"temperature": 0.7}` over gRPC, changed nothing); a temperature of 0 is greedy."""
    from omnistage.models import SamplingParams
    from omnistage.v1 import stage_pb2
    from omnistage.wire import StageError
    from services import edges

    greedy = SamplingParams(do_sample=False, max_tokens=8)
    sampled = SamplingParams(do_sample=True, temperature=0.6, max_tokens=8)

    def resolved(defaults: SamplingParams, **fields: Any) -> SamplingParams:
        start = stage_pb2.Start()
        start.sampling["thinker"].CopyFrom(stage_pb2.SamplingParams(**fields))
        return edges.sampling("thinker", start, defaults)

    for fields in ({"temperature": 0.7}, {"top_p": 0.5}, {"top_k": 5}):
        assert resolved(greedy, **fields).do_sample, fields
    for fields in ({"top_p": 1.0}, {"top_k": 0}, {"seed": 3}, {"temperature": 0.7, "do_sample": False}):
        assert not resolved(greedy, **fields).do_sample, fields  # (off, or said)
    for bad in (-0.5, float("nan")):  # refused as before, not taken as greedy
        with pytest.raises(StageError, match="temperature must be a finite number > 0"):
            resolved(greedy, temperature=bad)
    zero = resolved(sampled, temperature=0.0)
    assert not zero.do_sample and zero.temperature == 0.6  # greedy; the default temperature stays (unused)
    assert resolved(sampled, top_p=0.9).do_sample and resolved(sampled, top_p=0.9).temperature == 0.6


def test_a_body_is_refused_where_its_json_is_not_what_the_field_takes() -> None:
    """Lone UTF-16 surrogates (JSON escapes them; protobuf would fail on them far from the field)
    and JSON types other than the field's (OpenAI refuses them; pydantic's lax mode coerced)
    are 400s naming the field; an integer is still a number."""
    from gateway.http_api import ChatRequest, HttpError, _parse_body

    def refused(raw: bytes) -> HttpError:
        with pytest.raises(HttpError) as e:
            _parse_body(raw, ChatRequest)
        assert e.value.status == 400, e.value.message
        return e.value

    hi = '"messages": [{"role": "user", "content": "hi"}]'
    for raw, where in ((b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
                       (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
                        "messages[0].content[0].text"),
                       (f'{{{hi}, "stop": ["ok", "\\udfff"]}}'.encode(), "stop[1]"),
                       (f'{{{hi}, "logit_bias": {{"\\ud800": 1}}}}'.encode(), "logit_bias"),
                       # its UTF-8 bytes, not an escape (json.loads decodes with surrogatepass)
                       (b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}',
                        "messages[0].content")):  # fmt: skip
        e = refused(raw)
        assert e.param == where and "surrogate" in e.message, (where, e.message)
    # UTF-16 or UTF-32 (json.loads alone would take them, and their escapes slip past the check)
    lone = '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    for encoding in ("utf-16", "utf-32", "utf-16-le"):
        assert refused(lone.encode(encoding)).message.startswith("body: not"), encoding
    assert _parse_body(b"\xef\xbb\xbf{" + hi.encode() + b"}", ChatRequest).messages  # a UTF-8 BOM is still UTF-8
    for field, value in (("stream", '"true"'), ("max_tokens", "true"), ("max_tokens", "5.0"),
                         ("temperature", '"0.5"'), ("seed", '"3"'), ("modalities", '"audio"')):  # fmt: skip
        e = refused(f"{{{hi}, {json.dumps(field)}: {value}}}".encode())
        assert e.param == field, (field, e.message)
    body = _parse_body(f'{{{hi}, "temperature": 1, "top_p": 1, "stream": false, "content": "\u00e9"}}'.encode(),
                       ChatRequest)  # fmt: skip
    assert body.temperature == 1.0 and isinstance(body.temperature, float) and body.stream is False
    paired = _parse_body(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}', ChatRequest)
    assert paired.messages[0].content == "\U0001f600"  # a whole pair is one character
    # a wrong type where an object is taken says so in JSON's words, not this module's class names
    for raw, where, message in ((f'{{{hi}, "audio": 5}}', "audio", "a JSON object"),
                                (f'{{{hi}, "audio": {{"voice": 5}}}}', "audio.voice", "a JSON object or a string"),
                                ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]}',
                                 "messages[0].content[0].image_url", "a JSON object or a string")):  # fmt: skip
        e = refused(raw.encode())
        assert (e.param, e.message) == (where, f"{where}: Input should be {message}"), e.message


def test_fields_that_ask_for_what_this_server_lacks_are_refused_and_harmless_ones_taken() -> None:
    from gateway.http_api import HttpError, to_generate_request

    for fields, param in (({"tool_choice": "required"}, "tool_choice"),
                          ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
                          ({"top_logprobs": 3}, "top_logprobs"),
                          ({"function_call": {"name": "f"}}, "function_call"),
                          ({"functions": [{"name": "f"}], "function_call": "auto"}, "functions"),
                          ({"web_search_options": {}}, "web_search_options")):  # fmt: skip
        with pytest.raises(HttpError) as e:
            to_generate_request(_chat(**fields), ["ethan"])
        assert e.value.status == 400 and e.value.param == param, e.value.message
    tools = [{"type": "function", "function": {"name": "f"}}]
    # tools the model may call go to the gateway (tests/test_tool_calls.py); with none, unread
    offered = to_generate_request(_chat(tools=tools, tool_choice="auto"), ["ethan"]).tools
    assert [json.loads(t) for t in offered] == tools
    assert not to_generate_request(_chat(tools=tools, tool_choice="none"), ["ethan"]).tools
    for fields in ({"tool_choice": "none"}, {"tool_choice": "auto"}, {"top_logprobs": 0}, {"tool_choice": None},
                   {"tools": tools, "tool_choice": "none"},  # (an agent's every turn: tools, none to be called)
                   {"functions": [{"name": "f"}], "function_call": "none"}, {"function_call": "auto"},
                   {"web_search_options": None}):
        assert to_generate_request(_chat(**fields), ["ethan"]).messages[0].content == "hi"


def test_an_assistant_refusal_reads_as_its_text() -> None:
    from gateway.http_api import to_generate_request

    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "refusal": "I cannot."},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}]  # fmt: skip
    req = to_generate_request(_chat(messages=turns), ["ethan"])
    assert req.messages[1].content == "I cannot." and req.messages[2].parts[0].text == "No."


def test_openai_bias_and_penalties_reach_the_thinker() -> None:
    from gateway.http_api import HttpError, to_generate_request
    from omnistage.models import SamplingParams
    from omnistage.v1 import stage_pb2
    from omnistage.wire import StageError
    from services.edges import sampling

    req = to_generate_request(_chat(logit_bias={"42": 5, "7": -100}, presence_penalty=0.5, frequency_penalty=-1),
                              ["ethan"])  # fmt: skip
    start = stage_pb2.Start(request_id="r")
    start.sampling["thinker"].CopyFrom(req.sampling["thinker"])
    got = sampling("thinker", start, SamplingParams(), vocab=100)
    assert got.logit_bias == ((7, -100.0), (42, 5.0))
    assert (got.presence_penalty, got.frequency_penalty) == (0.5, -1.0)
    plain = to_generate_request(_chat(presence_penalty=0, frequency_penalty=0, logit_bias={}), ["ethan"])
    assert plain.sampling["thinker"] == stage_pb2.SamplingParams()  # nothing that changes nothing
    start.sampling["thinker"].logit_bias[100] = 1.0
    with pytest.raises(StageError, match=r"logit_bias ids outside the vocabulary \(0..99\): \[100\]"):
        sampling("thinker", start, SamplingParams(), vocab=100)
    many = stage_pb2.Start(request_id="r")
    many.sampling["thinker"].logit_bias.update({i: 1.0 for i in range(1025)})
    with pytest.raises(StageError, match="logit_bias has 1025 entries; at most 1024"):
        sampling("thinker", many, SamplingParams(), vocab=2000)
    from services.edges import check_start

    for name, value in (("presence_penalty", 1.0), ("frequency_penalty", -1.0), ("logit_bias", {1: 1.0})):
        talker = stage_pb2.Start(request_id="r")
        if name == "logit_bias":
            talker.sampling["talker"].logit_bias.update(value)  # type: ignore[arg-type]
        else:
            setattr(talker.sampling["talker"], name, value)
        with pytest.raises(StageError, match=f"{name} is for the thinker only"):
            check_start("talker", talker)
    # keys as OpenAI writes them: ASCII digits, each id once
    for bias, message in (({"\u0663": 1}, "is not a token id"), ({" 7": 1}, "is not a token id"),
                          ({"7": 1, "07": 2}, "token id 7 is given twice")):
        with pytest.raises(HttpError, match=message):
            to_generate_request(_chat(logit_bias=bias), ["ethan"])
    # vLLM-Omni's thinker entry takes them too (replacing the body's), a talker entry's are refused
    entry = to_generate_request(_chat(logit_bias={"5": 1}, modalities=["text", "audio"], sampling_params_list=[
        {"presence_penalty": 0.5, "logit_bias": {"9": -2}}, {"presence_penalty": 0}]), ["ethan"]).sampling["thinker"]
    assert entry.presence_penalty == 0.5 and dict(entry.logit_bias) == {9: -2.0}
    # a penalty of 0 in the entry replaces the body's too (vLLM-Omni's clients send every default)
    off = to_generate_request(_chat(frequency_penalty=2, presence_penalty=1, sampling_params_list=[
        {"frequency_penalty": 0.0, "presence_penalty": 0}]), ["ethan"]).sampling["thinker"]
    start.sampling["thinker"].CopyFrom(off)
    assert sampling("thinker", start, SamplingParams(), vocab=100).frequency_penalty == 0.0
    assert sampling("thinker", start, SamplingParams(), vocab=100).presence_penalty == 0.0
    with pytest.raises(HttpError) as e:
        to_generate_request(_chat(modalities=["text", "audio"], sampling_params_list=[None, {"logit_bias": {"1": 1}}]),
                            ["ethan"])
    assert e.value.param == "sampling_params_list[1].logit_bias"


def test_logprobs_ask_the_thinker_for_them() -> None:
    from gateway.http_api import to_generate_request

    def asked(**fields: Any) -> int | None:
        thinker = to_generate_request(_chat(**fields), ["ethan"]).sampling["thinker"]
        return thinker.logprobs if thinker.HasField("logprobs") else None

    assert asked() is None and asked(logprobs=False) is None and asked(logprobs=False, top_logprobs=0) is None
    assert asked(logprobs=True) == 0 and asked(logprobs=True, top_logprobs=7) == 7
    # vLLM-Omni's per-stage entry for the thinker keeps them (it merges over the body's fields)
    assert asked(logprobs=True, top_logprobs=2, sampling_params_list=[{"temperature": 0.5}]) == 2


def test_vllm_url_strings_unpadded_base64_and_an_empty_spoken_turn() -> None:
    """vLLM's `"image_url": "data:..."` (a string, not {url}); base64 without its padding; an
    assistant turn of `content: []` and an audio id is that reply's words (the id was dropped)."""
    from gateway.http_api import HttpError, to_generate_request

    png = media.encode_image(media.image(8, 8, seed=1), "png")
    wav = media.encode_audio(media.tone(0.1, 16_000, seed=2), 16_000, "wav")
    unpadded = base64.b64encode(wav).decode().rstrip("=")
    assert len(unpadded) % 4  # the test needs a body whose padding was cut
    body = _chat(messages=[
        {"role": "user", "content": [
            {"type": "image_url", "image_url": "data:image/png;base64," + base64.b64encode(png).decode()},
            {"type": "audio_url", "audio_url": "data:audio/wav;base64," + unpadded},
            {"type": "input_audio", "input_audio": {"data": unpadded}},
            {"type": "audio_url", "audio_url": "DATA:audio/wav;BASE64," + unpadded},  # case-insensitive, as URLs are
        ]},
        {"role": "assistant", "content": [], "audio": {"id": "audio_1"}},
    ])  # fmt: skip
    req = to_generate_request(body, ["ethan"], {"audio_1": "It was a tone."}.get)
    assert [p.image.file or p.audio.file for p in req.messages[0].parts] == [png, wav, wav, wav]
    assert (req.messages[1].role, req.messages[1].content) == ("assistant", "It was a tone.")
    with pytest.raises(HttpError) as e:
        to_generate_request(_chat(messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": "https://example.com/v.mp4"}]}]), ["ethan"])  # fmt: skip
    assert e.value.param == "messages[0].content[0].video_url" and "only data: URLs" in e.value.message


def test_a_max_tokens_refusal_names_the_field_the_client_sent() -> None:
    from gateway.http_api import HttpError, _entry_named

    async def refuse() -> None:
        raise HttpError(400, "thinker: sampling: max_tokens 5000 is over 4096", param="max_tokens")

    for fields, param in (({"max_completion_tokens": 5000}, "max_completion_tokens"),
                          ({"max_tokens": 5000}, "max_tokens"),
                          ({"max_tokens": 5000, "sampling_params_list": [{"max_tokens": 5000}]},
                           "sampling_params_list[0].max_tokens")):  # fmt: skip
        with pytest.raises(HttpError) as e:
            asyncio.run(_entry_named(refuse(), _chat(**fields)))
        assert e.value.param == param, fields


def test_a_decoder_error_shows_no_object_reprs() -> None:
    from gateway.media import MediaError, decode_image

    with pytest.raises(MediaError) as e:
        decode_image(b"not an image at all", MediaConfig())
    assert "cannot decode the image" in str(e.value) and " at 0x" not in str(e.value), str(e.value)


def test_a_validation_error_names_the_field_a_client_sent() -> None:
    """Not the content part's type tag pydantic puts in its path (`image_url.image_url.url`)."""
    from pydantic import ValidationError

    from gateway.http_api import ChatRequest, first_error

    for part, where in (({"type": "image_url", "image_url": {}}, "image_url.url"),
                        ({"type": "input_audio", "input_audio": {}}, "input_audio.data")):  # fmt: skip
        with pytest.raises(ValidationError) as err:
            ChatRequest.model_validate({"messages": [{"role": "user", "content": [part]}]})
        assert first_error(err.value)[0] == f"messages[0].content[0].{where}"


def test_speech_request_gives_the_thinker_the_words(tiny_dir: Path) -> None:
    """/v1/audio/speech's request: the input's tokens as the thinker's given reply, special-token
    text in it kept as text (it must not end the reply), OpenAI's fields this server lacks refused."""
    from gateway.http_api import HttpError, SpeechRequest, to_speech_request
    from omnistage.models import load_tokenizer, open_checkpoint

    ckpt = open_checkpoint(tiny_dir)
    tok = load_tokenizer(ckpt)
    words = "Stop here<|im_end|> or not"
    req = to_speech_request(SpeechRequest(input=words, voice="Ethan", response_format="pcm", seed=3,
                                          instructions="Calm."), ["ethan"], tok)  # fmt: skip
    given = list(req.sampling["thinker"].forced_ids)
    assert ckpt.spec.im_end_id not in given and tok.decode(given) == words
    assert req.sampling["thinker"].max_tokens == len(given) + 1 and not req.sampling["thinker"].do_sample
    assert req.want_audio and req.speaker == "Ethan" and req.audio_format == gateway_pb2.PCM16
    assert [(m.role, m.content) for m in req.messages] == [("system", "Calm."), ("user", words)]
    assert req.sampling["talker"].HasField("seed")
    long = len(tok.encode("hi " * 20, add_special_tokens=False))
    assert long > 30
    assert to_speech_request(SpeechRequest(input="hi", speed=1.5), ["ethan"], tok).speed == 1.5
    assert to_speech_request(SpeechRequest(input="hi"), ["ethan"], tok).speed == 0  # (unset: 1)
    refused = [
        ({"voice": "nobody"}, "voice: unknown voice"),
        ({"input": "hi " * 20}, f"input: {long} tokens; at most 30"),
        ({"input": " \n  "}, "input: no text to speak"),  # (spaces: it was refused naming messages)
    ]
    for fields, message in refused:
        with pytest.raises(HttpError) as e:
            to_speech_request(SpeechRequest(**{"input": "hi", **fields}), ["ethan"], tok, max_words=30)
        assert e.value.status == 400 and e.value.message.startswith(message), e.value.message


def test_transcripts_expire_and_stay_bounded() -> None:
    from gateway.http_api import Transcripts

    now = [100.0]
    kept = Transcripts(ttl_s=10, capacity=2, clock=lambda: now[0])
    kept.put("a", "one")
    kept.put("b", "two")
    assert (kept.get("a"), kept.get("b"), kept.get("c")) == ("one", "two", None)
    kept.put("c", "three")  # over capacity: the oldest goes
    assert (kept.get("a"), kept.get("c")) == (None, "three")
    now[0] += 10.5
    assert kept.get("b") is None and kept.get("c") is None


def test_playground_page_is_packaged() -> None:
    from importlib import resources

    page = resources.files("gateway").joinpath("static/playground.html").read_text()
    assert "/v1/chat/completions" in page and "AudioContext" in page and "getUserMedia" in page
    assert Path(__file__).resolve().parents[1].joinpath("gateway/static/playground.html").read_text() == page


def test_a_whole_file_comes_in_pieces_a_default_grpc_client_accepts() -> None:
    """A WAV of 60 s at 24 kHz (2.9 MB) and one of 120 s (5.8 MB, over gRPC's default 4 MiB
    receive limit) come as AudioChunks of at most 1 MiB whose data join to the file; the first
    counts the samples."""
    from types import SimpleNamespace

    from gateway.metrics import Outcome
    from gateway.server import AUDIO_PIECE_BYTES, GatewayService

    for seconds in (60, 120):
        encoder = AudioEncoder(gateway_pb2.WAV, 24_000)
        samples = seconds * 24_000
        encoder.push(np.zeros(samples, np.float32))
        data = encoder.finish()
        outcome = Outcome("r", 0.0, audio_samples=samples)
        pieces = GatewayService._audio(SimpleNamespace(sample_rate=24_000), encoder, data, outcome, 1.0)  # type: ignore[arg-type]
        chunks = [p.audio for p in pieces]
        assert len(chunks) == -(-len(data) // AUDIO_PIECE_BYTES) and all(len(c.data) <= 1 << 20 for c in chunks)
        assert b"".join(c.data for c in chunks) == data
        assert [c.samples for c in chunks] == [samples] + [0] * (len(chunks) - 1)
        assert all(c.first_sample == 0 and c.format == gateway_pb2.WAV for c in chunks)
        assert max(p.ByteSize() for p in pieces) < 4 << 20


def test_a_body_over_the_limit_is_refused_before_it_is_held() -> None:
    """413 from the declared Content-Length before anything is read; a body of no declared size
    (chunked) is refused as soon as what came passes the limit, the rest never taken; a body
    that stops coming is refused 408 after input_wait_timeout_s (it was waited for forever)."""
    import asyncio

    from starlette.requests import Request

    from gateway.http_api import HttpError, _read_body

    def request(pieces: list[bytes], declared: int | None) -> tuple[Request, list[int]]:
        taken: list[int] = []

        async def receive() -> dict[str, Any]:
            taken.append(len(taken))
            body = pieces[len(taken) - 1] if len(taken) <= len(pieces) else b""
            return {"type": "http.request", "body": body, "more_body": len(taken) < len(pieces)}

        headers = [] if declared is None else [(b"content-length", str(declared).encode())]
        return Request({"type": "http", "method": "POST", "headers": headers}, receive), taken

    req, taken = request([b"x" * 10] * 3, declared=4_000_000_000)
    with pytest.raises(HttpError) as err:
        asyncio.run(_read_body(req, 25, 60))
    assert err.value.status == 413 and "4000000000 bytes" in str(err.value) and taken == []
    # refused unread: the connection closes after the answer (the rest would be read as a request)
    assert err.value.response().headers["connection"] == "close"
    req, taken = request([b"x" * 10] * 100, declared=None)
    with pytest.raises(HttpError) as err:
        asyncio.run(_read_body(req, 25, 60))
    assert err.value.status == 413 and len(taken) == 3
    req, _ = request([b"ab", b"cd"], declared=4)
    assert asyncio.run(_read_body(req, 25, 60)) == b"abcd"

    async def stalls() -> dict[str, Any]:  # a client that sends a byte of its body, then nothing
        if not stalled:
            stalled.append(1)
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    stalled: list[int] = []
    slow = Request({"type": "http", "method": "POST", "headers": [(b"content-length", b"1000")]}, stalls)
    with pytest.raises(HttpError) as err:
        asyncio.run(asyncio.wait_for(_read_body(slow, 25_000, 0.2), 10))  # (input_wait_timeout_s)
    assert err.value.status == 408 and "input_wait_timeout_s" in str(err.value)
    assert err.value.response().headers["connection"] == "close"


def test_a_failure_nothing_answered_is_an_openai_error_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug while taking a request: a 500 OpenAI error object saying not to retry, not
    Starlette's plain text (which the OpenAI SDK retries twice); the process goes on."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from gateway.app import build_app
    from gateway.metrics import GatewayMetrics
    from omnistage.config import parse_config

    service = SimpleNamespace(model_name="m", cfg=parse_config({}), metrics=GatewayMetrics(),
                              ckpt=SimpleNamespace(spec=SimpleNamespace(speakers=[], default_speaker="",
                                                                        talker_stop_ids=lambda: ()), chat_template=""),
                              thinker_defaults=SimpleNamespace(stop_ids=()), check_api_key=lambda header: True,
                              sample_rate=24_000)  # fmt: skip

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug")

    client = TestClient(build_app(service), raise_server_exceptions=False)  # type: ignore[arg-type]
    with monkeypatch.context() as m:
        m.setattr(service, "check_api_key", broken)  # (a chat request's own bugs are its handler's: INTERNAL)
        r = client.get("/v1/models")
    assert r.status_code == 500 and r.headers["x-should-retry"] == "false"
    assert r.json()["error"] == {"message": "internal error: RuntimeError", "type": "server_error", "param": None,
                                 "code": None}  # fmt: skip
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"  # still serving


def test_a_clients_deadline_is_capped_at_the_request_timeout() -> None:
    """A far deadline (a day) would let a slow reader hold its request's cache reservation as
    long as it liked: it is request_timeout_s at most; none is request_timeout_s; a near one
    stays."""
    from types import SimpleNamespace

    from gateway.server import GatewayService
    from omnistage.config import parse_config

    service = SimpleNamespace(cfg=parse_config({"timeouts": {"request_timeout_s": 50}}))
    assert [GatewayService._timeout(service, t) for t in (86_400.0, None, 3.0)] == [50, 50, 3.0]  # type: ignore[arg-type]


@pytest.mark.parametrize("client_id", ["mine", "a\\b", "it's", 'say "hi"'])
def test_a_stage_error_names_the_request_by_the_clients_own_id(client_id: str) -> None:
    """The stages know a request as the client's id plus a suffix; an error they send up names the
    client's id, whether they wrote it plain or quoted (a backslash or quote is escaped in repr)."""
    from gateway.server import client_ids

    stage_id = f"{client_id}.1a2b3c4d"
    details = [f"thinker: request {stage_id!r}: needs 409 tokens of cache",  # the scheduler's
               f"talker: request {stage_id} passed its deadline"]  # the engine's  # fmt: skip
    shown = [client_ids(d, stage_id, client_id) for d in details]
    assert shown == [f"thinker: request {client_id!r}: needs 409 tokens of cache",
                     f"talker: request {client_id} passed its deadline"]  # fmt: skip
    assert all("1a2b3c4d" not in s for s in shown)


def test_the_thinkers_start_omits_the_talkers_codes_and_carries_the_stop_texts(tiny_dir: Path) -> None:
    """The gateway counts frames from the talker's finished chunk, so the codes stay below (a
    stop text ends the reply in the thinker: the talker ends too, and says the count)."""
    from types import SimpleNamespace

    from gateway.server import GatewayError, GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    ckpt = open_checkpoint(tiny_dir)
    service = SimpleNamespace(cfg=parse_config({}), ckpt=ckpt, thinker_defaults=ckpt.family.thinker_defaults(ckpt),
                              talker_defaults=ckpt.family.talker_defaults(), max_prompt_tokens=100)  # fmt: skip

    def start(**fields: Any) -> Any:
        request = gateway_pb2.GenerateRequest(**{"prompt": "hi", "want_audio": True, **fields})
        return GatewayService._start(service, request, 30.0)  # type: ignore[arg-type]

    assert start().omit_codes and start(want_audio=False).omit_codes
    # a stop text: the thinker ends the reply there (every stage below ends with it), so the talker's
    # finished chunk still counts the frames
    stopped = start(stop=["robot", "sing", "robot"])
    assert stopped.omit_codes and list(stopped.sampling["thinker"].stop_texts) == ["robot", "sing"]
    assert start(speed=0.25) and start(speed=4.0) and start(speed=0)  # (0: unset, 1)
    for speed in (0.2, 4.5, -1.0, float("nan")):
        with pytest.raises(GatewayError) as e:
            start(speed=speed)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "speed:" in e.value.message, e.value.message


def test_a_request_too_large_for_a_stage_is_a_400_no_retry_helps() -> None:
    """A stage's scheduler refuses a request it could never hold (its cache, its model length):
    INVALID_ARGUMENT, so HTTP 400 context_length_exceeded; it was RESOURCE_EXHAUSTED, a 429 the
    OpenAI SDK retried (three times the same hopeless request)."""
    import grpc

    from gateway.http_api import from_gateway_error
    from gateway.server import GatewayError
    from omnistage.engine import Request
    from omnistage.engine.scheduler import RequestRejected, Scheduler, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=2048,
                                          cache_capacity_tokens=600))  # fmt: skip
    with pytest.raises(RequestRejected) as refused:
        scheduler.add(Request("r", None), 498, 400)
    message = f"thinker-decode: {refused.value}"
    for detail in (message, "thinker: request 'r': input of 3000 tokens exceeds max_model_len=2048"):
        http = from_gateway_error(GatewayError(grpc.StatusCode.INVALID_ARGUMENT, detail))
        assert (http.status, http.param, http.code) == (400, "messages", "context_length_exceeded"), detail
    for other in ("talker: unknown speaker 'x'", "talker: request 'r': needs 900 tokens of cache (...)"):
        assert from_gateway_error(GatewayError(grpc.StatusCode.INVALID_ARGUMENT, other)).code == "invalid_argument"
    # a thinker's refusal of a sampling field names the body's field (it named "thinker")
    for detail, param in (("gateway: thinker: sampling: repetition_penalty must be a finite number >= 1e-05",
                           "repetition_penalty"),
                          ("gateway: thinker: sampling: stop_ids outside the vocabulary (0..151935): [999999]",
                           "stop_token_ids"),
                          ("gateway: talker: sampling: top_k must be >= 0", "sampling_params_list[1].top_k")):
        assert from_gateway_error(GatewayError(grpc.StatusCode.INVALID_ARGUMENT, detail)).param == param, detail


def test_a_call_cancelled_at_its_deadline_counts_as_deadline_exceeded(tiny_dir: Path) -> None:
    """gRPC cancels the handler of a call past the client's deadline: the gateway counts (and
    logs) it DEADLINE_EXCEEDED, not CANCELLED, as the client sees it; a call the client cancels
    earlier stays CANCELLED."""
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint
    from omnistage.v1 import gateway_pb2

    async def stuck(*args: Any) -> Any:  # a chain that never answers (a frozen stage)
        await asyncio.sleep(60)
        yield None

    async def calls() -> GatewayService:
        # (made in a running loop: its channel binds to it)
        service = GatewayService(parse_config({}), open_checkpoint(tiny_dir), "ipv4:127.0.0.1:1")
        service._generate = stuck  # type: ignore[method-assign]

        async def consume(timeout: float) -> None:
            async for _ in service.serve(gateway_pb2.GenerateRequest(prompt="hi"), timeout, "grpc"):
                pass

        for timeout, cancel_after in ((0.2, 0.25), (30, 0.05)):  # gRPC's cancel at the deadline; the client's own
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(consume(timeout), cancel_after)
        return service

    service = asyncio.run(calls())

    def count(outcome: str) -> float:
        return service.metrics.requests.labels("grpc", outcome)._value.get()

    assert (count("DEADLINE_EXCEEDED"), count("CANCELLED")) == (1, 1)


def test_the_grpc_health_follows_both_roles_of_a_split_thinker(tiny_dir: Path) -> None:
    """With the thinker split, a dead or frozen decode role makes the gateway NOT_SERVING, as the
    thinker does unsplit (it stayed SERVING, and requests hung until their replays ran out); the
    talker and code2wav stay out of it (HTTP /health has them)."""
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint
    from omnistage.v1 import stage_pb2

    def health(stage: str, serving: bool) -> Any:
        return stage_pb2.StageHealth(stage=stage, target="x", serving=serving, detail="" if serving else "frozen")

    ckpt = open_checkpoint(tiny_dir)

    async def service(cfg: dict[str, Any]) -> GatewayService:  # made in a running loop: its channel binds to it
        return GatewayService(parse_config(cfg), ckpt, "ipv4:127.0.0.1:1")

    split = asyncio.run(service({"thinker": {"disaggregated": True}}))
    up = [health("thinker-prefill", True), health("thinker-decode", True), health("talker", True),
          health("code2wav", True)]  # fmt: skip
    split.watcher.chain = up
    assert split.serving
    split.watcher.chain = [up[0], health("thinker-decode", False), *up[2:]]
    assert not split.serving
    split.watcher.chain = up[:1]  # the prefill role has not reported its decode role yet
    assert not split.serving
    split.watcher.chain = [*up[:2], health("talker", False), up[3]]
    assert split.serving
    single = asyncio.run(service({}))
    single.watcher.chain = [health("thinker", True), health("talker", False)]
    assert single.serving
    single.watcher.chain = [health("thinker", False)]
    assert not single.serving


def test_an_http_client_that_takes_none_of_a_streamed_reply_fails_it_at_the_stall_timeout(tiny_dir: Path) -> None:
    """A streamed HTTP reply whose send waits output_stall_timeout_s (the client reads nothing,
    its socket is full) ends its request DEADLINE_EXCEEDED and frees its slot, leaving the
    response incomplete (uvicorn then closes the connection); with the timeout 0 a slow send
    only waits."""
    from gateway.http_api import _Delivered
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    async def chain(*args: Any) -> Any:  # a reply of many pieces
        for i in range(100):
            yield gateway_pb2.GenerateResponse(text=gateway_pb2.TextDelta(text=f"{i} "))

    async def reply(stall_s: float, send_s: float) -> tuple[GatewayService, list[dict[str, Any]]]:
        service = GatewayService(parse_config({"timeouts": {"output_stall_timeout_s": stall_s}}),
                                 open_checkpoint(tiny_dir), "ipv4:127.0.0.1:1")  # fmt: skip
        service._generate = chain  # type: ignore[method-assign]
        responses = service.serve(gateway_pb2.GenerateRequest(prompt="hi"), 30, "http")

        async def pieces() -> Any:
            async for resp in responses:
                yield resp.text.text

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            if len(sent) == 3:  # the status line and two pieces go out; then the client's socket is full
                await asyncio.sleep(send_s)
            sent.append(message)

        async def receive() -> dict[str, Any]:  # the client stays connected
            await asyncio.sleep(60)
            return {"type": "http.disconnect"}

        response = _Delivered(pieces(), deliver=lambda write: service.deliver(write, responses, "r1"))
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await asyncio.wait_for(response(scope, receive, send), 10)
        return service, sent

    def count(service: GatewayService, outcome: str) -> float:
        return service.metrics.requests.labels("http", outcome)._value.get()

    service, sent = asyncio.run(reply(stall_s=0.2, send_s=30))
    assert (count(service, "DEADLINE_EXCEEDED"), count(service, "ok"), service.active) == (1, 0, 0)
    assert len(sent) == 3 and sent[-1].get("more_body") is True  # incomplete: never a clean end
    service, sent = asyncio.run(reply(stall_s=0, send_s=0.3))
    assert (count(service, "DEADLINE_EXCEEDED"), count(service, "ok"), service.active) == (0, 1, 0)
    assert len(sent) == 102 and sent[-1]["more_body"] is False


class _GrpcContext:
    """What `GatewayService.Generate` uses of grpc.aio.ServicerContext; each test adds its own
    write, abort and cancelled."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def time_remaining(self) -> float:
        return 30.0

    async def send_initial_metadata(self, metadata: Any) -> None:
        pass

    async def write(self, message: Any) -> None:
        pass

    def cancelled(self) -> bool:
        return False


def test_a_write_that_fails_as_the_client_hangs_up_is_a_cancel_not_a_bug(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc fails a Generate write that meets the client's cancel: the request counts as
    CANCELLED, with no error logged and no INTERNAL status sent to a call that is gone; a
    write that fails on a live call is still the gateway's bug (INTERNAL, logged and counted);
    a status that cannot go out (queued behind pieces the client never takes) ends the handler
    after ABORT_WAIT_S (it waited until the client went away)."""
    import gateway.server
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    async def chain(*args: Any) -> Any:
        for i in range(3):
            yield gateway_pb2.GenerateResponse(text=gateway_pb2.TextDelta(text=f"{i} "))

    class Context(_GrpcContext):
        def __init__(self, gone: bool, stuck: bool = False) -> None:
            self.gone, self.stuck = gone, stuck
            self.aborted: list[Any] = []

        async def write(self, message: Any) -> None:
            raise RuntimeError('Failed "execute_batch"')  # as grpc's ExecuteBatchError says it

        def cancelled(self) -> bool:
            return self.gone

        async def abort(self, code: Any, details: str, trailing_metadata: Any = ()) -> None:
            assert dict(trailing_metadata).get("x-request-id")  # the request's id goes with its status
            self.aborted.append(code)
            if self.stuck:
                await asyncio.sleep(60)
            raise RuntimeError("aborted")  # (grpc's AbortError ends the handler)

    async def call(gone: bool, stuck: bool = False) -> tuple[GatewayService, Context]:
        service = GatewayService(parse_config({}), open_checkpoint(tiny_dir), "ipv4:127.0.0.1:1")
        service._generate = chain  # type: ignore[method-assign]
        context = Context(gone, stuck)
        with contextlib.suppress(RuntimeError, asyncio.CancelledError):
            await asyncio.wait_for(service.Generate(gateway_pb2.GenerateRequest(prompt="hi"), context), 10)  # type: ignore[arg-type]
        return service, context

    def count(service: GatewayService, outcome: str) -> float:
        return service.metrics.requests.labels("grpc", outcome)._value.get()

    with caplog.at_level("ERROR", logger="gateway.server"):
        service, context = asyncio.run(call(gone=True))
    assert (count(service, "CANCELLED"), context.aborted, service.active) == (1, [], 0)
    assert not caplog.records
    with caplog.at_level("ERROR", logger="gateway.server"):
        service, context = asyncio.run(call(gone=False))
    assert context.aborted == [grpc.StatusCode.INTERNAL] and service.active == 0
    assert (count(service, "INTERNAL"), count(service, "CANCELLED")) == (1, 0)
    assert "request" in caplog.text and "failed" in caplog.text
    monkeypatch.setattr(gateway.server, "ABORT_WAIT_S", 0.1)
    t0 = time.monotonic()
    service, context = asyncio.run(call(gone=False, stuck=True))
    assert time.monotonic() - t0 < 5 and context.aborted == [grpc.StatusCode.INTERNAL]


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_a_refused_requests_decoded_media_are_freed_as_it_ends(tiny_dir: Path, api: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The media a request decoded before it was refused are freed when it ends, not at some later
    garbage-collection pass: its refusal held them in a reference cycle (a gateway grew by 1 GB
    per request refused at media.max_decoded_bytes: 1 GiB). With the decoded-media cache off: the
    cache keeps what requests decoded on purpose, within its own bound (test_media_cache.py)."""
    import gc
    import weakref

    import httpx
    from PIL import Image

    from gateway import media as media_module
    from gateway.app import build_app
    from gateway.client import image_part, text_part
    from gateway.server import GatewayError, GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    decoded: list[weakref.ref[Any]] = []
    real = media_module.decode_image

    def recording(*args: Any, **kwargs: Any) -> Any:
        image = real(*args, **kwargs)
        decoded.append(weakref.ref(image.pixels))
        return image

    monkeypatch.setattr(media_module, "decode_image", recording)
    png = io.BytesIO()
    Image.new("RGB", (400, 400), "white").save(png, format="PNG")  # 480 KB decoded: the third is past 1 MiB
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    ckpt = open_checkpoint(tiny_dir)

    async def refused() -> str:
        cfg = parse_config({"media": {"max_decoded_bytes": 1 << 20, "decoded_cache_bytes": 0}})
        service = GatewayService(cfg, ckpt, "ipv4:127.0.0.1:1")
        if api == "grpc":
            parts = [image_part(png.getvalue())] * 3 + [text_part("hi")]
            request = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", parts=parts)])
            try:
                async for _ in service.serve(request, 30, "grpc"):
                    pass
            except GatewayError as e:
                return e.message
            return "served"
        content = [{"type": "image_url", "image_url": {"url": url}}] * 3 + [{"type": "text", "text": "hi"}]
        transport = httpx.ASGITransport(app=build_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
        return f"{r.status_code} {r.text}"

    gc.collect()
    gc.disable()  # what a request leaves behind it, before any collection
    try:
        said = asyncio.run(refused())
        assert "max_decoded_bytes" in said and not said.startswith(("served", "200")), said
        alive = [ref() is not None for ref in decoded]
        assert alive == [False, False], f"{alive.count(True)} of the refused request's images are still held"
    finally:
        gc.enable()


def test_only_a_request_past_its_own_deadline_says_do_not_retry() -> None:
    """The OpenAI SDK retries a 504 twice: one that ran out its whole deadline would again
    (x-should-retry: false); a hop that waited too long on its peer may not."""
    import grpc

    from gateway.http_api import from_gateway_error
    from gateway.server import GatewayError

    def headers(message: str) -> dict[str, str]:
        error = from_gateway_error(GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, message))
        assert error.status == 504
        return dict(error.response().headers)

    assert headers("gateway: request r1 passed its deadline")["x-should-retry"] == "false"
    assert headers("talker: request r1 passed its deadline waiting to be admitted")["x-should-retry"] == "false"
    assert "x-should-retry" not in headers("code2wav: no input for request r1 in 60 s (its upstream starved it)")


def test_a_refusal_over_http_counts_under_the_grpc_status_of_the_same_refusal() -> None:
    """`outcome` is one vocabulary whatever the front door: a body refused over HTTP counted
    `HTTP_400` while the same mistake found by the gateway counted `INVALID_ARGUMENT`."""
    import grpc

    from gateway.http_api import refusal_outcome

    for status, name in ((400, "INVALID_ARGUMENT"), (401, "UNAUTHENTICATED"), (404, "NOT_FOUND"),
                         (405, "INVALID_ARGUMENT"), (408, "DEADLINE_EXCEEDED"), (413, "RESOURCE_EXHAUSTED"),
                         (429, "RESOURCE_EXHAUSTED"), (499, "CANCELLED"), (500, "INTERNAL"), (503, "UNAVAILABLE"),
                         (504, "DEADLINE_EXCEEDED"), (418, "INVALID_ARGUMENT")):  # fmt: skip
        assert refusal_outcome(status) == name and name in grpc.StatusCode.__members__


def test_service_faults_are_warnings_in_the_access_log(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A request's access line is a WARNING when the outcome is the service's fault (INTERNAL,
    UNAVAILABLE, ...), INFO when it is the client's (log-level alerts saw no 5xx)."""
    import logging

    import grpc

    from gateway.server import GatewayError, GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint
    from omnistage.v1 import gateway_pb2

    async def run_all() -> None:
        service = GatewayService(parse_config({}), open_checkpoint(tiny_dir), "ipv4:127.0.0.1:1")

        async def going_on(*args: Any) -> Any:
            yield gateway_pb2.GenerateResponse()
            await asyncio.sleep(60)

        async def failing(code: grpc.StatusCode) -> Any:
            raise GatewayError(code, f"gateway: {code.name.lower()}")
            yield  # (an async generator)

        service._generate = going_on  # type: ignore[method-assign]
        replies = service.serve(gateway_pb2.GenerateRequest(prompt="hi"), 30, "grpc")
        await replies.__anext__()
        await replies.aclose()  # the client cancels
        for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT):
            service._generate = lambda *a, c=code: failing(c)  # type: ignore[method-assign]
            with contextlib.suppress(GatewayError):
                async for _ in service.serve(gateway_pb2.GenerateRequest(prompt="hi"), 30, "grpc"):
                    pass

    with caplog.at_level(logging.INFO, logger="omnistage.access"):
        asyncio.run(run_all())
    levels = {r.fields["outcome"]: r.levelname for r in caplog.records if r.name == "omnistage.access"}
    assert levels == {"CANCELLED": "INFO", "INTERNAL": "WARNING", "UNAVAILABLE": "WARNING",
                      "INVALID_ARGUMENT": "INFO"}, levels  # fmt: skip


def test_a_bug_in_the_http_door_counts_internal_not_cancelled(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash while the HTTP door makes a reply (whole or streamed) fails the request INTERNAL,
    as the gRPC door's does (its access line a WARNING); it was counted CANCELLED at INFO."""
    import httpx

    import gateway.http_api as http_api
    from gateway.app import build_app
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    async def broken_whole(self: Any, req: Any, body: Any, responses: Any) -> Any:
        async for _ in responses:
            raise RuntimeError("a bug")

    def broken_sse(event: Any) -> str:  # the real streamer's events: a bug in making one
        raise RuntimeError("a bug")

    monkeypatch.setattr(http_api.ChatCompletions, "_whole", broken_whole)
    monkeypatch.setattr(http_api, "sse_event", broken_sse)
    ckpt = open_checkpoint(tiny_dir)

    async def go() -> GatewayService:
        service = GatewayService(parse_config({}), ckpt, "ipv4:127.0.0.1:1")

        async def chain(*args: Any) -> Any:  # a reply that goes on
            for _ in range(20):
                yield gateway_pb2.GenerateResponse(text=gateway_pb2.TextDelta(text="x", token_ids=[1]))

        service._generate = chain  # type: ignore[method-assign]
        transport = httpx.ASGITransport(app=build_app(service), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            for stream in (False, True):
                with contextlib.suppress(httpx.HTTPError):
                    await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                     "stream": stream})  # fmt: skip
        return service

    service = asyncio.run(go())

    def count(outcome: str) -> float:
        return service.metrics.requests.labels("http", outcome)._value.get()

    assert (count("INTERNAL"), count("CANCELLED")) == (2, 0)


def test_a_bug_before_or_after_the_reply_runs_counts_internal(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A crash in making the whole reply once the stages are done, or in reading the body before
    they start: INTERNAL with an access line, a JSON 500. The first counted OK (the reply's
    generator had ended) while its client got a 500; the second had no access line and no count."""
    import httpx

    import gateway.http_api as http_api
    from gateway.app import build_app
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    ckpt = open_checkpoint(tiny_dir)
    body = {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text"]}

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    async def go() -> tuple[GatewayService, list[httpx.Response]]:
        service = GatewayService(parse_config({}), ckpt, "ipv4:127.0.0.1:1")

        async def chain(*args: Any) -> Any:  # a whole reply: text, then its end
            yield gateway_pb2.GenerateResponse(text=gateway_pb2.TextDelta(text="x", token_ids=[1]))
            yield gateway_pb2.GenerateResponse(final=gateway_pb2.Final(finish_reason="stop"))

        service._generate = chain  # type: ignore[method-assign]
        transport = httpx.ASGITransport(app=build_app(service), raise_app_exceptions=False)
        got = []
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            got.append(await client.post("/v1/chat/completions", json=body))  # as it is: OK
            with monkeypatch.context() as m:
                m.setattr(http_api, "chat_usage", broken)  # the reply's usage, made after the stages are done
                got.append(await client.post("/v1/chat/completions", json=body))
            with monkeypatch.context() as m:
                m.setattr(http_api, "to_generate_request", broken)  # before any stage is asked
                got.append(await client.post("/v1/chat/completions", json=body, headers={"x-request-id": "r-9"}))
        return service, got

    with caplog.at_level(logging.INFO, logger="omnistage.access"):
        service, got = asyncio.run(go())
    assert [r.status_code for r in got] == [200, 500, 500] and got[2].headers["x-should-retry"] == "false"
    assert got[2].json()["error"]["type"] == "server_error" and "r-9" in got[2].json()["error"]["message"]
    count = service.metrics.requests.labels
    assert (count("http", "ok")._value.get(), count("http", "INTERNAL")._value.get()) == (1, 2)
    lines = [r for r in caplog.records if r.name == "omnistage.access"]
    assert [r.fields["outcome"] for r in lines] == ["ok", "INTERNAL", "INTERNAL"], lines  # type: ignore[attr-defined]


def test_http_metrics_follow_the_metrics_switch(tiny_dir: Path) -> None:
    """`metrics.enabled: false` turns off the HTTP door's /metrics too (it showed the gateway's
    metrics while the metrics ports were off)."""
    import httpx

    from gateway.app import build_app
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    ckpt = open_checkpoint(tiny_dir)

    async def scrape(enabled: bool) -> httpx.Response:
        service = GatewayService(parse_config({"metrics": {"enabled": enabled}}), ckpt, "ipv4:127.0.0.1:1")
        transport = httpx.ASGITransport(app=build_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.get("/metrics")

    on, off = asyncio.run(scrape(True)), asyncio.run(scrape(False))
    assert on.status_code == 200 and "omnistage_gateway_requests" in on.text
    assert off.status_code == 404 and off.json()["error"]["type"], off.text


def test_a_stage_out_of_memory_tells_a_grpc_client_when_to_retry(tiny_dir: Path) -> None:
    """RESOURCE_EXHAUSTED from a stage's out of memory (the same request may fit later) carries
    gRPC's retry pushback, as the gateway's own shed does and as HTTP's 429 says retry-after: 1;
    it had none. gRPC's own RESOURCE_EXHAUSTED (a message over a limit: no retry passes) and
    other failures carry none."""
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint
    from omnistage.v1 import stage_pb2
    from tests.integration.conftest import serve_stage

    class Thinker:  # a thinker whose calls fail as `code`, `detail`
        def __init__(self) -> None:
            self.code, self.detail = grpc.StatusCode.INTERNAL, ""

        async def Info(self, request: Any, context: Any) -> Any:
            return stage_pb2.InfoResponse(role="thinker")

        async def Stream(self, request_iterator: Any, context: Any) -> Any:
            async for _ in request_iterator:
                break
            await context.abort(self.code, self.detail)

    class Context(_GrpcContext):
        def __init__(self) -> None:
            self.trailing: dict[str, str] = {}

        async def abort(self, code: Any, details: str, trailing_metadata: Any = ()) -> None:
            self.trailing = dict(trailing_metadata)
            raise RuntimeError("aborted")  # (grpc's AbortError ends the handler)

    ckpt = open_checkpoint(tiny_dir)

    async def go() -> list[dict[str, str]]:
        thinker = Thinker()
        server, port = await serve_stage(thinker, "thinker")
        service = GatewayService(parse_config({}), ckpt, f"ipv4:127.0.0.1:{port}")
        seen = []
        try:
            for code, detail in ((grpc.StatusCode.RESOURCE_EXHAUSTED, "talker: out of memory in a step of 4 requests"),
                                 (grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)"),
                                 (grpc.StatusCode.INTERNAL, "talker: a bug")):  # fmt: skip
                thinker.code, thinker.detail = code, detail
                context = Context()
                with contextlib.suppress(RuntimeError):
                    await service.Generate(gateway_pb2.GenerateRequest(prompt="hi"), context)  # type: ignore[arg-type]
                seen.append(context.trailing)
        finally:
            await server.stop(None)
        return seen

    memory, too_big, bug = asyncio.run(go())
    assert memory.get("grpc-retry-pushback-ms") == "1000" and memory.get("x-request-id"), memory
    assert too_big.get("x-request-id") and "grpc-retry-pushback-ms" not in too_big, too_big
    assert bug.get("x-request-id") and "grpc-retry-pushback-ms" not in bug, bug


def test_the_thinker_ends_its_reply_at_the_token_that_completes_a_stop_text(tiny_dir: Path) -> None:
    """`ThinkerWorker.end_at_stop_text`: the token whose text completes a stop text is the last
    (a decode role, whose first check comes with the prefill role's token in its history, reads
    that token too); a token already last for another reason keeps it."""
    from types import SimpleNamespace

    from omnistage.models import SamplingParams, load_tokenizer, open_checkpoint
    from services.thinker.worker import ThinkerWorker

    tokenizer = load_tokenizer(open_checkpoint(tiny_dir))
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    worker = SimpleNamespace(tokenizer=tokenizer)

    def run_to_stop(stop: str, decode_role: bool) -> int | None:
        state = SimpleNamespace(sampling=SamplingParams(stop_texts=(stop,)), prompt_ids=[1, 2], history=[1, 2],
                                text=None, finished=False)  # fmt: skip
        for k, token in enumerate(ids):
            state.history.append(token)
            if decode_role and k == 0:  # the prefill role's token: the decode role never checks it
                continue
            tok = SimpleNamespace(token_id=token, is_last=False, stopped_on=None)
            ThinkerWorker.end_at_stop_text(worker, state, tok)  # type: ignore[arg-type]
            if tok.stopped_on:
                assert tok.stopped_on == "stop_text" and state.finished
                return k
        return None

    for stop in ("three", "one two"):  # (the second spans the prefill role's token)
        k = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]))
        assert 0 < k < len(ids) - 1, (stop, k)
        assert run_to_stop(stop, decode_role=False) == run_to_stop(stop, decode_role=True) == k, stop
    # the token completing "three", already the last for its limit: its reason stays the limit's
    k = next(k for k in range(len(ids)) if "three" in tokenizer.decode(ids[: k + 1]))
    last = SimpleNamespace(token_id=ids[k], is_last=True, stopped_on="max_tokens")
    state = SimpleNamespace(sampling=SamplingParams(stop_texts=("three",)), prompt_ids=[], history=ids[: k + 1],
                            text=None, finished=True)  # fmt: skip
    ThinkerWorker.end_at_stop_text(worker, state, last)  # type: ignore[arg-type]
    assert last.stopped_on == "max_tokens"
    # (the same token, not yet last, would end on the stop text: the check above can fail)
    fresh = SimpleNamespace(token_id=ids[k], is_last=False, stopped_on=None)
    state.finished = False
    ThinkerWorker.end_at_stop_text(worker, state, fresh)  # type: ignore[arg-type]
    assert fresh.stopped_on == "stop_text"


def test_a_thinker_that_reads_on_past_a_stop_text_is_ended_there_by_the_gateway(
        tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A thinker that does not know stop_texts (an older one) streams past the stop text without a
    finish reason: the gateway cuts its text there, ends the thinker call, says `stop` and warns."""
    from types import SimpleNamespace

    import torch

    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import load_tokenizer, open_checkpoint
    from services import edges

    ckpt = open_checkpoint(tiny_dir)
    ids = load_tokenizer(ckpt).encode("hello END world and more", add_special_tokens=False)
    sent: list[int] = []
    closed = []

    async def reads_on(*args: Any) -> Any:  # the thinker's chunks, one token each, no finish reason
        try:
            for k, token in enumerate(ids):
                sent.append(token)
                yield "thinker", SimpleNamespace(tensors={edges.IDS: torch.tensor([token])}, meta={}, offset=k,
                                                 length=1, finished=False)  # fmt: skip
        finally:
            closed.append(True)

    async def call() -> list[gateway_pb2.GenerateResponse]:
        service = GatewayService(parse_config({}), ckpt, "ipv4:127.0.0.1:1")
        service._outputs = reads_on  # type: ignore[method-assign]
        request = gateway_pb2.GenerateRequest(prompt="hi", want_audio=False, stop=["END"])
        return [resp async for resp in service.serve(request, 30.0, "grpc")]

    with caplog.at_level(logging.WARNING, logger="gateway"):
        replies = asyncio.run(call())
    assert "".join(r.text.text for r in replies) == "hello "
    assert [r.final.finish_reason for r in replies if r.HasField("final")] == ["stop"]
    assert closed and len(sent) < len(ids)  # the call ended at the stop text, not read to its end
    assert "did not end its reply at the stop text" in caplog.text


def test_chat_template_kwargs_reach_the_variables_the_template_reads(tiny_dir: Path) -> None:
    """vLLM's `chat_template_kwargs`: a variable the checkpoint's template reads is rendered with
    the request's value, in text and media prompts alike; one it never names changes nothing; the
    renderer's own (the generation prompt, special tokens) and values it cannot render are refused
    by name, as INVALID_ARGUMENT would say them."""
    from gateway.chat_template import template_names
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    async def make() -> GatewayService:  # (made in a running loop: its channel binds to it)
        return GatewayService(parse_config({}), open_checkpoint(tiny_dir), "ipv4:127.0.0.1:1")

    service = asyncio.run(make())
    # the tiny checkpoint's template reads no variable of its own: one that does, as Qwen3's enable_thinking
    template = "{%- if greeting %}{{- greeting + '!' }}{%- endif %}" + service.ckpt.chat_template
    service.tokenizer.chat_template = template
    assert service.inputs is not None
    service.inputs.processor.chat_template = template
    service.template_names = template_names(template)
    png = media.encode_image(media.image(32, 32, seed=2), "png")
    image = gateway_pb2.ChatMessage(role="user", parts=[gateway_pb2.ContentPart(image=gateway_pb2.ImagePart(file=png)),
                                                        gateway_pb2.ContentPart(text="What is it?")])  # fmt: skip
    greeting = service.tokenizer.encode("Hello!", add_special_tokens=False)

    def ids(message: gateway_pb2.ChatMessage, **kwargs: str) -> list[int]:
        return service._prompt(gateway_pb2.GenerateRequest(messages=[message], chat_template_kwargs=kwargs)).ids

    for message in (gateway_pb2.ChatMessage(role="user", content="hi"), image):
        plain = ids(message)
        assert plain[: len(greeting)] != greeting
        assert ids(message, greeting='"Hello"') == greeting + plain  # rendered with it
        assert ids(message, enable_thinking="false") == plain  # a variable the template never names
    for kwargs, message in (({"add_generation_prompt": "false"}, "add_generation_prompt: set by this server's"),
                            ({"eos_token": '"x"'}, "eos_token: set by this server's"),
                            ({"greeting": "Hello"}, "greeting: not a JSON value"),
                            ({"greeting": "[" * 5000 + "]" * 5000}, "greeting: not a JSON value"),  # (too deep)
                            ({"greeting": "5"}, "cannot render the chat template: TypeError")):  # 5 + '!'  # fmt: skip
        with pytest.raises(ValueError, match=f"^chat_template_kwargs: .*{message}"):
            ids(gateway_pb2.ChatMessage(role="user", content="hi"), **kwargs)

    def refuses(*args: Any) -> Any:
        raise ValueError("videos at different frame rates")  # the processor's own refusal, not the template's

    service.inputs.build = refuses  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"^messages: cannot build the model inputs: ValueError: videos"):
        ids(image, greeting='"Hello"')  # the media's fault, though variables came along


def test_the_gateway_goes_by_the_thinkers_failure_not_by_the_status_grpc_put_in_its_place(tiny_dir: Path) -> None:
    """A thinker that failed a request while the gateway was still writing its prompt: grpc gives
    the gateway its own INTERNAL ("Internal error from Core", a lost peer's) in place of the
    status, and the gateway replayed the request and said UNAVAILABLE. It goes by the Failure the
    thinker sent in band first: the thinker's status and words, and no replay."""
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint
    from omnistage.server.grpc_common import CORE_WRITE_FAILED
    from omnistage.v1 import stage_pb2
    from omnistage.wire.wire_view import failure_response
    from tests.integration.conftest import serve_stage

    class Thinker:
        calls = 0

        async def Info(self, request: Any, context: Any) -> Any:
            return stage_pb2.InfoResponse(role="thinker")

        async def Stream(self, request_iterator: Any, context: Any) -> Any:
            Thinker.calls += 1
            async for _ in request_iterator:
                break
            yield failure_response("thinker", "INVALID_ARGUMENT", "thinker: prompt chunk 2 is bad")
            await context.abort(grpc.StatusCode.INTERNAL, CORE_WRITE_FAILED)

    class Context(_GrpcContext):
        said: tuple[Any, str] | None = None

        async def abort(self, code: Any, details: str, trailing_metadata: Any = ()) -> None:
            self.said = (code, details)
            raise RuntimeError("aborted")  # (grpc's AbortError ends the handler)

    ckpt = open_checkpoint(tiny_dir)

    async def go() -> tuple[Any, str] | None:
        server, port = await serve_stage(Thinker(), "thinker")
        service = GatewayService(parse_config({}), ckpt, f"ipv4:127.0.0.1:{port}")
        context = Context()
        try:
            with contextlib.suppress(RuntimeError):
                await service.Generate(gateway_pb2.GenerateRequest(prompt="hi"), context)  # type: ignore[arg-type]
        finally:
            await server.stop(None)
        return context.said

    said = asyncio.run(go())
    assert said is not None and said[0] == grpc.StatusCode.INVALID_ARGUMENT, said
    assert said[1].startswith("thinker: prompt chunk 2 is bad"), said
    assert Thinker.calls == 1  # not replayed


def test_a_failure_after_a_streamed_reply_began_is_its_last_event(tiny_dir: Path) -> None:
    """Once the status line is out, a stage's failure ends each streamed reply as its endpoint
    says: chat's error object, the speech and transcription error events, raw speech bytes cut
    short (not closed as if whole); the request counts the failure's status either way."""
    import httpx

    from gateway.app import build_app
    from gateway.server import GatewayError, GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    ckpt = open_checkpoint(tiny_dir)
    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16_000), w.writeframes(b"\0\0" * 1600)

    async def go() -> tuple[GatewayService, dict[str, httpx.Response | str]]:
        service = GatewayService(parse_config({}), ckpt, "ipv4:127.0.0.1:1")

        async def chain(*args: Any) -> Any:  # a first piece of text and of audio, then a stage fails
            yield gateway_pb2.GenerateResponse(text=gateway_pb2.TextDelta(text="x", token_ids=[1]))
            yield gateway_pb2.GenerateResponse(audio=gateway_pb2.AudioChunk(data=b"\1\0" * 6))
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "talker: lost")

        service._generate = chain  # type: ignore[method-assign]
        transport = httpx.ASGITransport(app=build_app(service), raise_app_exceptions=False)
        got: dict[str, httpx.Response | str] = {}
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            got["chat"] = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True})  # fmt: skip
            got["speech sse"] = await client.post("/v1/audio/speech", json={"input": "hi", "stream_format": "sse"})
            got["completion"] = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
            got["transcript"] = await client.post("/v1/audio/transcriptions", data={"stream": "true"},
                                                  files={"file": ("a.wav", wav.getvalue())})  # fmt: skip
            try:
                await client.post("/v1/audio/speech", json={"input": "hi", "response_format": "pcm"})
                got["speech"] = "closed as if whole"
            except AssertionError as e:  # httpx's ASGI transport: the app never completed the response
                got["speech"] = f"cut: {type(e).__name__}"
        return service, got

    service, got = asyncio.run(go())
    events = {k: [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
              for k, r in got.items() if isinstance(r, httpx.Response)}  # fmt: skip
    assert all(got[k].status_code == 200 for k in events)  # type: ignore[union-attr]
    assert events["chat"][-1]["error"]["type"] == "service_unavailable", events["chat"]
    assert "data: [DONE]" not in got["chat"].text  # type: ignore[union-attr]
    assert events["speech sse"][-1]["type"] == "error" and events["speech sse"][0]["type"] == "speech.audio.delta"
    assert [e.get("object") for e in events["completion"]] == ["text_completion", None], events["completion"]
    assert events["completion"][-1]["error"]["type"] == "service_unavailable"
    assert "data: [DONE]" not in got["completion"].text  # type: ignore[union-attr]
    assert [e["type"] for e in events["transcript"]] == ["transcript.text.delta", "error"], events["transcript"]
    assert events["transcript"][-1]["error"]["message"] == "talker: lost"
    assert str(got["speech"]).startswith("cut"), got["speech"]
    assert service.metrics.requests.labels("http", "UNAVAILABLE")._value.get() == 5


@pytest.mark.parametrize("speed", [0.25, 0.6, 1.5, 4.0])
def test_tempo_changes_the_speed_as_it_streams_and_keeps_the_pitch(speed: float) -> None:
    """Speech `speed`: fed as code2wav streams (a short first chunk, then 25-frame ones), each
    piece comes back stretched at once, not a chunk later (atempo holds back what fills its
    output buffer: fed whole chunks, it held each until the next); in all the audio lasts
    1/speed as long, at the same pitch (atempo keeps it; resampling would not)."""
    from gateway.audio_out import Tempo

    rate, hz = 24_000, 440.0
    tone = np.sin(2 * np.pi * hz * np.arange(3840 + 3 * 48_000) / rate).astype(np.float32)
    tempo = Tempo(speed, rate)
    pieces = [tempo.push(p) for p in np.split(tone, [3840, 3840 + 48_000, 3840 + 96_000])]
    for got in pieces[1:]:  # (the first: less a window or two held back)
        assert abs(got.size * speed / 48_000 - 1) < 0.05, [p.size for p in pieces]
    out = np.concatenate([*pieces, tempo.finish()])
    assert out.dtype == np.float32 and abs(out.size * speed / tone.size - 1) < 0.03, out.size
    spectrum = np.abs(np.fft.rfft(out * np.hanning(out.size)))
    assert abs(np.argmax(spectrum) * rate / out.size - hz) < 2.0
    # pieces of any size (16 samples here): as long (slowed down, atempo's overlap points move with
    # its input frames: the samples may differ a little)
    one_by_one = Tempo(speed, rate)
    small = np.concatenate([*(one_by_one.push(p) for p in np.array_split(tone[:9600], 600)), one_by_one.finish()])
    whole = Tempo(speed, rate)
    assert abs(small.size - np.concatenate([whole.push(tone[:9600]), whole.finish()]).size) <= 1
    with pytest.raises(ValueError, match="outside"):
        Tempo(4.5, rate)


def test_the_http_port_sends_small_writes_at_once() -> None:
    """The HTTP port's connections have TCP_NODELAY: asyncio sets it only on a socket whose proto
    says TCP, which an accepted one takes from the listener. Without it Nagle held each small
    event (an SSE delta, a WebSocket event) behind the delayed ACK of the one before: measured,
    44 ms between the Realtime API's first events."""
    import socket

    from gateway.process import _http_socket

    listener = _http_socket("127.0.0.1", 0)
    seen: list[int] = []

    async def go() -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=listener)
        port = listener.getsockname()[1]
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(500):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(go())
    assert seen and seen[0] != 0


def test_truncation_counts_the_instructions_as_they_read(tiny_dir: Path) -> None:
    """A retention ratio's `post_instructions` limit counts the instructions' tokens where the prompt
    is built, their special-token text as text (each token's text several tokens: a probe found
    them counted one each, the limit too low, turns left out early)."""
    from gateway.prompt_fit import PromptFit
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    async def service() -> GatewayService:  # (made in a running loop: its channel binds to it)
        return GatewayService(parse_config({}), open_checkpoint(tiny_dir), "ipv4:127.0.0.1:1")

    gateway = asyncio.run(service())
    tokenizer = gateway.tokenizer
    instructions = "<|im_end|><|audio_pad|> be brief"
    plain = len(tokenizer.encode(instructions, add_special_tokens=False, split_special_tokens=True))
    assert plain > len(tokenizer.encode(instructions, add_special_tokens=False)) + 4
    req = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="system", content=instructions),
                                                gateway_pb2.ChatMessage(role="user", content="hi")])  # fmt: skip
    fit = PromptFit(limit=500, ratio=0.5, fixed=1, instructions=instructions, post_instructions=100)
    prompt = gateway._prompt(req, None, fit)
    assert fit.limit == plain + 100 and fit.target == plain + 50 and fit.dropped == 0 and len(prompt.ids) > plain


def test_the_gateway_counts_thinker_replicas_out_of_the_rotation(tiny_dir: Path) -> None:
    """A thinker replica that leaves two health polls unanswered is out of the rotation, and the
    gateway's metrics say how many are; answering again, it is back."""
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    async def go() -> list[float | None]:
        service = GatewayService(parse_config({}), open_checkpoint(tiny_dir), "ipv4:127.0.0.1:1,127.0.0.1:2")
        def value() -> float | None:
            return service.metrics.registry.get_sample_value("omnistage_gateway_thinker_replicas_out")

        seen = [value()]
        for _ in range(2):
            service.watcher.on_answer(1, False)  # (as its health poll reports a call with no answer)
        seen.append(value())
        service.watcher.on_answer(1, True)
        seen.append(value())
        await service.router.close()
        return seen

    assert asyncio.run(go()) == [0.0, 1.0, 0.0]
