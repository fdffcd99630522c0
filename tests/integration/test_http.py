"""The OpenAI-compatible HTTP front door against the real multi-process stack, with the official
`openai` client: chat with audio out (streamed and not), audio and image in, every output format,
the same samples as the gRPC path for the same greedy request; errors in OpenAI's shape with the
documented statuses; client disconnects cancel the chain; /metrics, /health, /v1/models."""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import media
from gateway.client import build_request, generate
from gateway.media import decode_audio
from omnistage.cli.serve import Stack, start_stack
from omnistage.config import MediaConfig
from omnistage.v1 import gateway_pb2_grpc, stage_pb2
from tests.integration.conftest import free_port_block, info, metric, run, stack_config

MAX_TOKENS, RATE = 12, 24_000
APP_ORIGIN = "http://app.example"
MAX_MODEL_LEN = 1024  # a browser page on another origin the stack lets in
QUESTION = "Can you explain how streaming works?"
STORY = "Tell me a short story about a robot who learns to sing."  # (greedy, its reply ends on <|im_end|>)
LONG = "Tell me about the sea."  # (greedy, its reply runs past MAX_TOKENS)
STREAM_TOL = 1e-5  # streamed code2wav against its full decode (tests/code2wav/test_streaming_exact.py)


@pytest.fixture(scope="module")
def http_stack(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # max_model_len: below the tiny checkpoint's positions, so a long spoken input meets it
    cfg = stack_config(gateway={"cors_allow_origins": [APP_ORIGIN]},
                       max_model_len=MAX_MODEL_LEN)  # fmt: skip
    with start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path_factory.mktemp("http-logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(http_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{http_stack.http_address}/v1", api_key="unused", max_retries=0,
                         timeout=120)  # fmt: skip


def _grpc_reply(stack: Stack, prompt: str = QUESTION, greedy_talker: bool = True, thinker_max_tokens: int = MAX_TOKENS,
                **kw: Any) -> Any:  # fmt: skip
    """The gRPC path's reply to the request temperature 0 makes over HTTP: greedy thinker and
    talker (the talker's other defaults kept; `greedy_talker` False: all of them), float32 PCM."""
    request = build_request(prompt, greedy=False, thinker_max_tokens=thinker_max_tokens, **kw)
    request.sampling["thinker"].do_sample = False
    if greedy_talker:
        request.sampling["talker"].do_sample = False

    async def go() -> Any:
        async with grpc.aio.insecure_channel(stack.gateway_address) as ch:
            text, pcm = [], []
            async for resp in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=120):
                if resp.WhichOneof("kind") == "text":
                    text.append(resp.text.text)
                elif resp.WhichOneof("kind") == "audio":
                    pcm.append(np.frombuffer(resp.audio.pcm_f32le, "<f4"))
            return "".join(text), np.concatenate(pcm) if pcm else np.zeros(0, np.float32)

    return run(go())


def _pcm16(samples: np.ndarray) -> np.ndarray:
    return (np.clip(samples, -1, 1) * 32767).round().astype("<i2")


def _same_pcm16(got: np.ndarray, pcm: np.ndarray) -> bool:
    """`got` (16-bit samples of one reply) is the 16-bit form of `pcm` (another request's float
    samples of the same greedy reply): the same length, each sample the float one rounded, to
    within the waveform's tolerance. The streamed waveform equals the full decode to 1e-5, not
    bitwise (tests/code2wav/test_streaming_exact.py), and how a reply is cut into decode chunks
    depends on timing (seen: the first requests on a fresh stack differ in the 7th digit), so now
    and then a sample rounds to the next 16-bit value. A lossy format moves far more than that."""
    exact = np.clip(pcm, -1, 1).astype(np.float64) * 32767
    return got.shape == pcm.shape and bool(np.all(np.abs(got - exact) <= 0.5 + 32767 * STREAM_TOL))


def _wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == RATE and w.getnchannels() == 1 and w.getsampwidth() == 2
        return np.frombuffer(w.readframes(w.getnframes()), "<i2")


def _flac_samples(data: bytes) -> np.ndarray:
    """A FLAC file's 16-bit samples as they are stored (no float round trip)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        assert stream.rate == RATE and stream.channels == 1
        return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)]).astype("<i2")


def _chat(client: openai.OpenAI, fmt: str, content: Any = QUESTION, **kw: Any) -> Any:
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=[{"role": "user", "content": content}],
                                          modalities=["text", "audio"], audio={"voice": "ethan", "format": fmt},
                                          temperature=0, max_tokens=MAX_TOKENS, **kw)  # fmt: skip


def test_models_health_and_page(http_stack: Stack, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [http_stack.model_dir.name]
    assert models[0].model_extra["voices"] == ["aiden", "chelsie", "ethan"]
    # each stage learns the health of the one below it by polling (1 s), so right after start-up
    # the chain may not be known yet: ready within a few polls
    deadline = time.monotonic() + 15
    while (health := httpx.get(f"http://{http_stack.http_address}/health")).status_code != 200:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)
    assert [s["stage"] for s in health.json()["stages"]] == ["thinker", "talker", "code2wav"]
    page = httpx.get(f"http://{http_stack.http_address}/")
    assert page.status_code == 200 and "omnistage playground" in page.text
    assert client.models.retrieve(models[0].id).id == models[0].id
    base = f"http://{http_stack.http_address}"
    for method, path, status in [("GET", "/v1/models/other", 404), ("GET", "/v1/nothing", 404),
                                 ("GET", "/v1/chat/completions", 405)]:  # fmt: skip
        r = httpx.request(method, base + path)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    preflight = {"origin": APP_ORIGIN, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    r = httpx.options(base + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    other = httpx.options(base + "/v1/chat/completions", headers={**preflight, "origin": "http://elsewhere"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("fmt", ["wav", "flac", "pcm16"])
def test_lossless_formats_carry_the_grpc_samples(http_stack: Stack, client: openai.OpenAI, fmt: str) -> None:
    text, pcm = _grpc_reply(http_stack)
    reply = _chat(client, fmt)
    message = reply.choices[0].message
    data = base64.b64decode(message.audio.data)
    if fmt == "wav":
        got = _wav_samples(data)
    elif fmt == "pcm16":
        got = np.frombuffer(data, "<i2")
    else:
        got = _flac_samples(data)
    assert message.content == text == message.audio.transcript and text
    assert _same_pcm16(got, pcm)
    usage, details = reply.usage, reply.usage.completion_tokens_details
    tokens = details.text_tokens
    assert reply.choices[0].finish_reason == ("length" if tokens == MAX_TOKENS else "stop") and tokens > 0
    assert details.audio_tokens > 0 and usage.completion_tokens == tokens + details.audio_tokens  # OpenAI's sum


def _like(data: bytes, pcm: np.ndarray) -> None:
    """A lossy file of `pcm`'s sound: its length (but for the codec's padding and delay) and its loudness."""
    got = decode_audio(data, RATE, MediaConfig()).samples
    assert abs(got.size - pcm.size) / RATE < 0.08
    assert float(np.sqrt(np.mean(got**2))) > 0.3 * float(np.sqrt(np.mean(pcm**2)))


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
def test_compressed_formats_decode_to_the_right_length(http_stack: Stack, client: openai.OpenAI, fmt: str) -> None:
    _, pcm = _grpc_reply(http_stack)
    _like(base64.b64decode(_chat(client, fmt).choices[0].message.audio.data), pcm)


def test_streamed_chat_sends_pieces_as_they_exist(http_stack: Stack, client: openai.OpenAI) -> None:
    text, pcm = _grpc_reply(http_stack, LONG)
    stream = _chat(client, "pcm16", LONG, stream=True, stream_options={"include_usage": True})
    content, audio, pieces, finish, usage, audio_events = [], [], [], None, None, 0
    updates: list[Any] = []  # every audio update
    for event in stream:
        if event.usage is not None:
            usage = event.usage
        if not event.choices:
            continue
        delta = event.choices[0].delta
        content.append(delta.content or "")
        if delta.audio is not None:
            updates.append(delta.audio)
        if delta.audio is not None and delta.audio.data:
            audio.append(base64.b64decode(delta.audio.data))
            pieces.append(delta.audio.data)
            audio_events += 1
        finish = event.choices[0].finish_reason or finish
    assert "".join(content) == text
    got = np.frombuffer(b"".join(audio), "<i2")
    assert _same_pcm16(got, pcm)
    assert audio_events > 1  # streamed in pieces, not one file at the end
    # pieces of whole base64 groups and whole samples: joining the strings first decodes the same
    assert base64.b64decode("".join(pieces)) == b"".join(audio)
    assert all(len(piece) % 6 == 0 for piece in audio[:-1])
    assert finish == "length" and usage is not None and usage.completion_tokens_details.text_tokens == MAX_TOKENS
    assert usage.completion_tokens == MAX_TOKENS + usage.completion_tokens_details.audio_tokens
    # the last audio update holds only when its id expires (OpenAI's ChoiceDeltaAudio), the others none
    assert updates[-1].expires_at > time.time() + 3000 and not updates[-1].data and not updates[-1].transcript
    assert all(u.expires_at is None for u in updates[:-1])
    # the id once, in the first update: OpenAI's SDK joins the strings a stream repeats
    assert updates[0].id.startswith("audio_") and all(u.id is None for u in updates[1:])


def test_audio_and_image_in(http_stack: Stack, client: openai.OpenAI) -> None:
    wav = media.encode_audio(media.tone(1.5, 16_000, seed=3), 16_000, "wav")
    png = media.encode_image(media.image(40, 60, seed=4), "png")
    content = [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "text", "text": "What is this?"},
    ]
    text, pcm = _grpc_reply(http_stack, "What is this?", audio=[wav], images=[png])
    message = _chat(client, "pcm16", content).choices[0].message
    assert message.content == text
    assert _same_pcm16(np.frombuffer(base64.b64decode(message.audio.data), "<i2"), pcm)


def test_transcriptions_and_translations_are_the_chat_turn_they_stand_for(http_stack: Stack,
                                                                          client: openai.OpenAI) -> None:
    """OpenAI's speech-to-text endpoints, through the official client: the text of the chat turn
    [the file, the instruction], greedy, whole or streamed; a bad form is a 400 naming its field."""
    wav = media.encode_audio(media.tone(1.2, 16_000, seed=5), 16_000, "wav")
    model = client.models.list().data[0].id

    def chat(instruction: str) -> str:
        content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
                   {"type": "text", "text": instruction}]  # fmt: skip
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                               temperature=0)  # type: ignore[list-item]  # fmt: skip
        return reply.choices[0].message.content or ""

    text = chat("Transcribe the German audio into text.")
    assert text
    got = client.audio.transcriptions.create(model=model, file=("speech.wav", wav), language="de")
    assert got.text == text
    assert got.usage is not None and got.usage.type == "tokens" and got.usage.output_tokens > 0
    assert client.audio.transcriptions.create(model=model, file=("speech.wav", wav), language="de",
                                              response_format="text") == text  # fmt: skip
    events = list(client.audio.transcriptions.create(model=model, file=("speech.wav", wav), language="de",
                                                     stream=True))  # fmt: skip
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == text  # as it is made, not at the end
    assert events[-1].type == "transcript.text.done" and events[-1].text == text
    # include[]=logprobs: the tokens' own (OpenAI's {token, logprob, bytes}), whole and streamed alike,
    # the chat turn's logprobs for the same tokens
    scored = client.audio.transcriptions.create(model=model, file=("speech.wav", wav), language="de",
                                                include=["logprobs"])  # fmt: skip
    assert scored.text == text and scored.logprobs
    # (the SDK types these bytes as floats)
    assert b"".join(bytes(int(b) for b in e.bytes) for e in scored.logprobs).decode(errors="replace") == text
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
               {"type": "text", "text": "Transcribe the German audio into text."}]  # fmt: skip
    as_chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
                                             temperature=0, logprobs=True)  # fmt: skip
    assert [(e.token, e.logprob) for e in scored.logprobs] == [(e.token, e.logprob)
                                                               for e in as_chat.choices[0].logprobs.content]
    streamed = list(client.audio.transcriptions.create(model=model, file=("speech.wav", wav), language="de",
                                                       include=["logprobs"], stream=True))  # fmt: skip
    for e in streamed[:-1]:  # each delta's own tokens
        assert b"".join(bytes(int(b) for b in lp.bytes) for lp in e.logprobs).decode(errors="replace") == e.delta
    pieces = [lp for e in streamed if e.type == "transcript.text.delta" for lp in e.logprobs or []]
    assert [(e.token, e.logprob) for e in pieces] == [(e.token, e.logprob) for e in scored.logprobs]
    assert [(e.token, e.logprob) for e in streamed[-1].logprobs] == [(e.token, e.logprob) for e in scored.logprobs]
    translated = client.audio.translations.create(model=model, file=("speech.wav", wav))
    assert translated.text == chat("Translate the audio into English text.")
    url = f"http://{http_stack.http_address}/v1/audio/transcriptions"
    cases = [
        ({"model": model}, {"file": ("x.wav", b"not audio at all")}, 400, "file"),
        ({"model": model}, {"other": (None, "x")}, 400, "file"),
        ({"response_format": "srt"}, {"file": ("speech.wav", wav)}, 400, "response_format"),
        ({"model": "other"}, {"file": ("speech.wav", wav)}, 404, "model"),
    ]
    for data, files, status, param in cases:
        r = httpx.post(url, data=data, files=files, timeout=60)
        assert r.status_code == status and r.json()["error"]["param"] == param, (data, r.text)
        assert not r.json()["error"]["message"].startswith("messages"), r.text  # the form's terms, not chat's
    r = httpx.post(url, json={"file": "x"}, timeout=60)
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"], r.text
    # a file declared over the limit of one media part is refused before any of it is read
    host, port = http_stack.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: multipart/form-data; boundary=b\r\n"
                     + f"Content-Length: {MediaConfig().max_part_bytes + (1 << 20)}\r\n\r\n".encode())  # fmt: skip
        got = b""
        while piece := sock.recv(4096):  # to the end: the server closes the connection after its 413
            got += piece
    assert got.startswith(b"HTTP/1.1 413") and b"request_too_large" in got, got


def test_realtime_turns_are_the_chat_turns_they_stand_for(http_stack: Stack, client: openai.OpenAI) -> None:
    """OpenAI's Realtime API through the official client's WebSocket: a spoken turn (appended in
    pieces, committed) and a typed one, answered with speech and its transcript as they are made;
    each reply is the chat completion of the same turns (temperature 0): the same words, the same
    samples. A later turn sees the earlier reply's words; a text reply is chat's text reply."""
    spoken = _pcm16(media.tone(1.5, RATE, seed=11)).tobytes()
    model = client.models.list().data[0].id
    chat_turns: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "input_audio",
                                      "input_audio": {"data": base64.b64encode(spoken).decode(), "format": "pcm16"}}]},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}]},
    ]  # fmt: skip

    async def reply(conn: Any) -> tuple[str, bytes, int, Any]:
        text, audio, audio_deltas = "", b"", 0
        async for event in conn:
            if event.type in ("response.output_audio_transcript.delta", "response.output_text.delta"):
                text += event.delta
            elif event.type == "response.output_audio.delta":
                piece = base64.b64decode(event.delta)
                assert len(piece) % 2 == 0  # whole samples in each
                audio += piece
                audio_deltas += 1
            elif event.type == "error":
                raise AssertionError(event)
            elif event.type == "response.done":
                return text, audio, audio_deltas, event.response
        raise AssertionError("the connection ended before response.done")

    async def talk() -> list[tuple[str, bytes, int, Any]]:
        aclient = openai.AsyncOpenAI(base_url=f"http://{http_stack.http_address}/v1", api_key="unused", max_retries=0)
        async with aclient.realtime.connect(model=model) as conn:
            assert (await conn.recv()).type == "session.created"
            await conn.session.update(session={"type": "realtime", "temperature": 0, "max_output_tokens": MAX_TOKENS,
                                               "audio": {"input": {"turn_detection": None},  # push-to-talk
                                                         "output": {"voice": "ethan"}}})  # type: ignore[typeddict-unknown-key]  # fmt: skip
            assert (await conn.recv()).type == "session.updated"
            for i in range(0, len(spoken), 4800):
                await conn.input_audio_buffer.append(audio=base64.b64encode(spoken[i:i + 4800]).decode())
            await conn.input_audio_buffer.commit()
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "What is it?"}]})
            await conn.response.create()
            first = await reply(conn)
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "And then?"}]})
            await conn.response.create()
            second = await reply(conn)
            await conn.response.create(response={"output_modalities": ["text"]})
            third = await reply(conn)
            await conn.send({"type": "session.update", "session": {"audio": {"input": {
                "turn_detection": {"type": "semantic_vad"}}}}})  # fmt: skip
            refused = await conn.recv()
            assert refused.type == "error" and refused.error.param == "session.audio.input.turn_detection.type"
            # server_vad: the client streams; the server hears the turn end, commits it and answers
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
                "type": "server_vad", "silence_duration_ms": 300}}}})  # fmt: skip
            assert (await conn.recv()).type == "session.updated"
            quiet = bytes(2 * RATE)  # 1 s of silence, the spoken clip, 1 s of silence
            stream = quiet + spoken + quiet
            for i in range(0, len(stream), 4800):
                await conn.input_audio_buffer.append(audio=base64.b64encode(stream[i:i + 4800]).decode())
            async with asyncio.timeout(60):  # (a turn not heard fails here, not at the suite's timeout)
                heard = [(await conn.recv()).type for _ in range(3)]
            assert heard == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed"], heard  # fmt: skip
            fourth = await reply(conn)
            assert fourth[3].status in ("completed", "incomplete") and fourth[1]
            return [first, second, third]

    spoken_replies = run(talk())
    for (text, audio, deltas, response), later in zip(spoken_replies[:2], ("And then?", None), strict=True):
        assert response.status in ("completed", "incomplete") and response.usage.output_tokens > 0
        message = client.chat.completions.create(model=model, messages=chat_turns,  # type: ignore[arg-type]
                                                 modalities=["text", "audio"],
                                                 audio={"voice": "ethan", "format": "pcm16"}, temperature=0,
                                                 max_tokens=MAX_TOKENS).choices[0].message  # fmt: skip
        assert text == message.content and text, (text, message.content)
        want = np.frombuffer(base64.b64decode(message.audio.data), "<i2")
        got = np.frombuffer(audio, "<i2")
        assert got.shape == want.shape and deltas > 1  # the speech as it is made, in pieces
        assert int(np.abs(got.astype(np.int32) - want).max()) <= 1  # the same samples (16-bit rounding aside)
        chat_turns.append({"role": "assistant", "content": text})
        if later:
            chat_turns.append({"role": "user", "content": [{"type": "text", "text": later}]})
    text, audio, _, response = spoken_replies[2]
    assert audio == b"" and response.output[0].content[0].type == "output_text"
    chat_text = client.chat.completions.create(model=model, messages=chat_turns, temperature=0,  # type: ignore[arg-type]
                                               max_tokens=MAX_TOKENS).choices[0].message.content  # fmt: skip
    assert text == chat_text and text


def test_the_beta_realtime_client_gets_the_chat_reply(http_stack: Stack, client: openai.OpenAI) -> None:
    """The official client's beta Realtime connection (`OpenAI-Beta: realtime=v1`, beta's event
    and field names): a spoken and a typed turn, answered as chat completions answers them."""
    spoken = _pcm16(media.tone(1.0, RATE, seed=5)).tobytes()
    model = client.models.list().data[0].id

    async def talk() -> tuple[str, bytes, list[str]]:
        # (the beta connection takes wss:// from an http:// base URL; a plain socket is named)
        aclient = openai.AsyncOpenAI(base_url=f"http://{http_stack.http_address}/v1", api_key="unused", max_retries=0,
                                     websocket_base_url=f"ws://{http_stack.http_address}/v1")  # fmt: skip
        async with aclient.beta.realtime.connect(model=model) as conn, asyncio.timeout(120):
            assert (await conn.recv()).type == "session.created"
            assert (await conn.recv()).type == "conversation.created"
            await conn.session.update(session={"modalities": ["text", "audio"], "voice": "ethan", "temperature": 0,
                                               "input_audio_format": "pcm16", "output_audio_format": "pcm16",
                                               "max_response_output_tokens": MAX_TOKENS, "turn_detection": None})  # type: ignore[typeddict-item]  # fmt: skip
            updated = await conn.recv()
            assert updated.type == "session.updated" and updated.session.modalities == ["text", "audio"]
            await conn.input_audio_buffer.append(audio=base64.b64encode(spoken).decode())
            await conn.input_audio_buffer.commit()
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "What is it?"}]})
            await conn.response.create()
            text, audio, kinds = "", b"", []
            async for event in conn:
                kinds.append(event.type)
                if event.type == "response.audio_transcript.delta":
                    text += event.delta
                elif event.type == "response.audio.delta":
                    audio += base64.b64decode(event.delta)
                elif event.type == "error":
                    raise AssertionError(event)
                elif event.type == "response.done":
                    assert event.response.status in ("completed", "incomplete") and event.response.usage
                    assert event.response.output[0].content[0].type == "audio"
                    return text, audio, kinds
        raise AssertionError("the connection ended before response.done")

    text, audio, kinds = run(talk())
    assert "conversation.item.created" in kinds and "conversation.item.added" not in kinds
    turns = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(spoken).decode(), "format": "pcm16"}}]},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"}]}]  # (two items: two turns)
    message = client.chat.completions.create(model=model, messages=turns, modalities=["text", "audio"],  # type: ignore[arg-type]
                                             audio={"voice": "ethan", "format": "pcm16"}, temperature=0,
                                             max_tokens=MAX_TOKENS).choices[0].message  # fmt: skip
    assert text == message.content and text
    want, got = np.frombuffer(base64.b64decode(message.audio.data), "<i2"), np.frombuffer(audio, "<i2")
    assert got.shape == want.shape and int(np.abs(got.astype(np.int32) - want).max()) <= 1


def test_realtime_input_transcription_is_the_transcription_endpoints(http_stack: Stack, client: openai.OpenAI) -> None:
    """A committed turn, transcribed (audio.input.transcription): the words /v1/audio/transcriptions
    gives for the same samples."""
    spoken = _pcm16(media.tone(1.2, RATE, seed=7))
    model = client.models.list().data[0].id

    async def transcribe(kind: str, include: list[str] | None = None) -> Any:
        """The turn's words in a conversation (`realtime`: audio.input.transcription beside its
        responses) or a `transcription` session (live captions: no responses); with `include`,
        the .completed event and the deltas' logprobs."""
        aclient = openai.AsyncOpenAI(base_url=f"http://{http_stack.http_address}/v1", api_key="unused", max_retries=0)
        async with aclient.realtime.connect(model=model) as conn, asyncio.timeout(120):
            await conn.recv()
            extra = {"include": include} if include else {}
            await conn.session.update(session={"type": kind, "audio": {"input": {"turn_detection": None,  # type: ignore[misc, arg-type]
                "transcription": {"model": "whisper-1", "language": "en"}}}, **extra})  # fmt: skip
            updated = await conn.recv()
            assert updated.session.type == kind and updated.session.include == include
            await conn.input_audio_buffer.append(audio=base64.b64encode(spoken.tobytes()).decode())
            await conn.input_audio_buffer.commit()
            deltas = []
            async for event in conn:
                assert not event.type.startswith("response."), event  # (nothing asked a response)
                if event.type == "conversation.item.input_audio_transcription.delta":
                    deltas.extend(event.logprobs or [])
                if event.type == "conversation.item.input_audio_transcription.completed":
                    return (event, deltas) if include else event.transcript
                assert event.type != "conversation.item.input_audio_transcription.failed", event
        raise AssertionError("no transcript")

    wav = io.BytesIO()
    with wave.open(wav, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(spoken.tobytes())
    expected = client.audio.transcriptions.create(model=model, file=("turn.wav", wav.getvalue()), language="en").text
    assert run(transcribe("realtime")) == expected and expected
    assert run(transcribe("transcription")) == expected
    # include: the transcription's tokens with their log-probabilities, as the endpoint's include[]=logprobs
    scored = client.audio.transcriptions.create(model=model, file=("turn.wav", wav.getvalue()), language="en",
                                                include=["logprobs"]).logprobs  # fmt: skip
    assert scored
    for kind in ("realtime", "transcription"):
        completed, deltas = run(transcribe(kind, ["item.input_audio_transcription.logprobs"]))
        assert completed.transcript == expected
        want = [(e.token, e.logprob) for e in scored]
        assert [(e.token, e.logprob) for e in completed.logprobs] == want == [(e.token, e.logprob) for e in deltas]


def test_the_bench_drives_the_realtime_socket_against_grpc(http_stack: Stack) -> None:
    """`omnistage bench --realtime`: the same requests over the Realtime WebSocket (a pooled
    session, each turn deleted after) and gRPC give the same audio; the server's token count."""
    from benchmarks.front_doors import main
    from benchmarks.harness import BenchOptions, failed_levels

    opts = BenchOptions(target=http_stack.gateway_address, realtime=True, http_target=http_stack.http_address,
                        concurrency=[2], num_requests=4, thinker_max_tokens=5, warmup=1, progress=False,
                        quiet=True)  # fmt: skip
    result = main(opts)
    assert failed_levels(result) == [] and result["audio_samples_equal"] is True, result["failed"]
    assert result["door"] == "realtime" and result["levels"][0]["e2e"]["realtime_over_grpc"] > 0
    tokens = {lv["name"]: [r["text_tokens"] for r in lv["requests"]] for lv in result["configurations"]}
    assert tokens["realtime c=2"] == tokens["grpc c=2"] and all(t == 5 for t in tokens["grpc c=2"]), tokens


def test_the_bench_drives_the_responses_api_against_grpc(http_stack: Stack) -> None:
    """`omnistage bench --responses`: the same requests, text alone, as streamed responses and over
    gRPC: the same token counts (the server's), no audio on either door."""
    from benchmarks.front_doors import main
    from benchmarks.harness import BenchOptions, failed_levels

    opts = BenchOptions(target=http_stack.gateway_address, responses=True, http_target=http_stack.http_address,
                        concurrency=[2], num_requests=4, thinker_max_tokens=5, warmup=1, progress=False,
                        quiet=True)  # fmt: skip
    result = main(opts)
    assert failed_levels(result) == [], result["failed"]
    assert result["door"] == "responses" and result["levels"][0]["e2e"]["responses_over_grpc"] > 0
    assert result["levels"][0]["ttfa"]["responses_over_grpc"] is None  # (text alone: no audio to time)
    records = {lv["name"]: lv["requests"] for lv in result["configurations"]}
    tokens = {name: [r["text_tokens"] for r in rs] for name, rs in records.items()}
    assert tokens["responses c=2"] == tokens["grpc c=2"] and all(t == 5 for t in tokens["grpc c=2"]), tokens
    assert all(r["audio_samples"] == 0 for rs in records.values() for r in rs)


def test_the_bench_drives_the_completions_api_against_grpc(http_stack: Stack) -> None:
    """`omnistage bench --completions`: the same raw prompts (no chat template on either door),
    text alone, as streamed completions and over gRPC: the same token counts (the server's)."""
    from benchmarks.front_doors import main
    from benchmarks.harness import BenchOptions, failed_levels

    opts = BenchOptions(target=http_stack.gateway_address, completions=True, http_target=http_stack.http_address,
                        concurrency=[2], num_requests=6, thinker_max_tokens=40, warmup=1, progress=False,
                        quiet=True)  # fmt: skip
    result = main(opts)
    assert failed_levels(result) == [], result["failed"]
    assert result["door"] == "completions" and result["levels"][0]["e2e"]["completions_over_grpc"] > 0
    records = {lv["name"]: lv["requests"] for lv in result["configurations"]}
    tokens = {name: [r["text_tokens"] for r in rs] for name, rs in records.items()}
    assert tokens["completions c=2"] == tokens["grpc c=2"] and all(0 < t <= 40 for t in tokens["grpc c=2"]), tokens
    assert all(r["audio_samples"] == 0 for rs in records.values() for r in rs)


def test_a_later_turn_names_a_spoken_reply_by_its_audio_id(http_stack: Stack, client: openai.OpenAI) -> None:
    """OpenAI's multi-turn voice chat: the assistant turn is `{"audio": {"id"}}`, no text; the
    model then sees that reply's words, as if the client had sent them as content."""
    # streamed, through the SDK's own accumulator, which joins every string a delta repeats
    with client.chat.completions.stream(model=client.models.list().data[0].id,
                                        messages=[{"role": "user", "content": QUESTION}], modalities=["text", "audio"],
                                        audio={"voice": "ethan", "format": "pcm16"}, temperature=0,
                                        max_tokens=MAX_TOKENS) as stream:  # type: ignore[arg-type]  # fmt: skip
        for _ in stream:  # (its get_final_completion() refuses a reply cut by max_tokens, as this one is)
            pass
        first = stream.current_completion_snapshot.choices[0].message
    assert first.audio.transcript == first.content and first.content
    assert re.fullmatch(r"audio_[0-9a-f]{32}", first.audio.id), first.audio.id

    def follow_up(turn: dict[str, Any]) -> tuple[str, int]:
        messages = [{"role": "user", "content": QUESTION}, turn, {"role": "user", "content": "Say more."}]
        reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                               temperature=0, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]  # fmt: skip
        assert reply.usage is not None
        return reply.choices[0].message.content or "", reply.usage.prompt_tokens

    by_id = follow_up({"role": "assistant", "content": None, "audio": {"id": first.audio.id}})
    assert by_id == follow_up({"role": "assistant", "content": first.content})
    assert by_id[1] > follow_up({"role": "assistant", "content": ""})[1]  # the reply's words are in the prompt


def test_speech_speaks_the_given_words(http_stack: Stack, client: openai.OpenAI) -> None:
    """/v1/audio/speech: the input is the model's reply, given (the thinker's forced ids), so the
    samples are the gRPC path's for that given reply and the same talker seed."""
    from gateway.http_api import TALKER_SEED_OFFSET
    from omnistage.models import load_tokenizer, open_checkpoint

    words = "Hello there, how are you today?"
    speech = client.audio.speech.create(model=client.models.list().data[0].id, voice="ethan", input=words,
                                        response_format="pcm", extra_body={"seed": 11})  # fmt: skip
    rate = client.models.list().data[0].model_extra["sample_rate"]
    assert speech.response.headers["content-type"] == f"audio/pcm;rate={rate}"  # little-endian: not audio/L16
    got = np.frombuffer(speech.read(), "<i2")
    ids = load_tokenizer(open_checkpoint(http_stack.model_dir)).encode(words, add_special_tokens=False)
    sampling = {"thinker": {"forced_ids": ids, "max_tokens": len(ids) + 1, "do_sample": False},
                "talker": {"seed": 11 + TALKER_SEED_OFFSET}}  # fmt: skip
    text, pcm = _grpc_reply(http_stack, words, greedy_talker=False, thinker_max_tokens=len(ids) + 1, speaker="ethan",
                            sampling=sampling)  # fmt: skip
    assert text == words  # it said exactly the given words
    assert got.size > 0 and _same_pcm16(got, pcm)
    aac = client.audio.speech.create(model=client.models.list().data[0].id, voice="ethan", input=words,
                                     response_format="aac", extra_body={"seed": 11})  # fmt: skip
    assert aac.response.headers["content-type"] == "audio/aac"
    _like(aac.read(), pcm)
    url = f"http://{http_stack.http_address}/v1/audio/speech"
    body = {"input": words, "voice": "ethan", "response_format": "pcm", "seed": 11, "stream_format": "sse"}
    sse = httpx.post(url, json=body, timeout=60)
    assert sse.headers["content-type"] == "text/event-stream; charset=utf-8"  # (no `;rate=` in an event stream's)
    events = [json.loads(line[5:]) for line in sse.text.splitlines() if line.startswith("data:")]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == got.tobytes()
    # as a chat reply's usage: the words and the end of the reply, then the speech's codec frames
    frames = events[-1]["usage"]["output_tokens"] - (len(ids) + 1)
    c2w = open_checkpoint(http_stack.model_dir).config.code2wav_config
    per_frame = math.prod(c2w.upsample_rates) * math.prod(c2w.upsampling_ratios)
    # (it may end inside its last frame)
    assert (frames - 1) * per_frame < got.size <= frames * per_frame, (frames, got.size)
    # `speed`: the same speech in half the time (time-stretched as it streams, its pitch kept: tested in units)
    fast = client.audio.speech.create(model=client.models.list().data[0].id, voice="ethan", input=words,
                                      response_format="pcm", speed=2.0, extra_body={"seed": 11})  # fmt: skip
    # (atempo's length is off by up to about a window of 1024 samples, whatever the audio's)
    assert abs(np.frombuffer(fast.read(), "<i2").size * 2 - got.size) < 0.05 * got.size + 2048
    for bad, field in [({"input": ""}, "input"), ({"input": words, "response_format": "aiff"}, "response_format"),
                       ({"input": words, "speed": 5}, "speed"), ({"input": words, "voice": "nobody"}, "voice"),
                       ({"input": "word " * 800}, "input"),  # more words than a reply may have
                       ({"input": "word " * 300}, "input")]:  # a reply that fits, but not with its prompt  # fmt: skip
        r = httpx.post(url, json=bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (bad, r.text)
    assert "given reply" in r.json()["error"]["message"]  # the gateway's own check: prompt and reply


def test_vllm_omni_per_stage_sampling_reaches_each_stage(http_stack: Stack, client: openai.OpenAI) -> None:
    """vLLM-Omni's clients send each stage's sampling as `sampling_params_list` (in `extra_body`),
    with no top-level temperature: greedy thinker and talker entries give the same reply as
    temperature 0 (the talker samples unless told), and a thinker entry's max_tokens ends the text."""
    text, pcm = _grpc_reply(http_stack)
    model = client.models.list().data[0].id
    stages = [{"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_TOKENS, "detokenize": True},
              {"temperature": 0.0, "top_k": 50, "repetition_penalty": 1.05, "detokenize": False},
              # what vLLM-Omni's own example sends its vocoder; only the seed means anything to one
              {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 65536, "seed": 42, "detokenize": True,
               "repetition_penalty": 1.1}]  # fmt: skip
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                           modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
                                           extra_body={"sampling_params_list": stages})  # fmt: skip
    message = reply.choices[0].message
    assert message.content == text and _same_pcm16(np.frombuffer(base64.b64decode(message.audio.data), "<i2"), pcm)
    short = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=MAX_TOKENS, extra_body={"sampling_params_list": [
                                               {"temperature": 0, "max_tokens": 2}]})  # fmt: skip
    assert short.usage.completion_tokens == 2 and short.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                       extra_body={"sampling_params_list": [{"min_tokens": 3}]})  # fmt: skip
    assert e.value.body["param"] == "sampling_params_list[0].min_tokens"
    with pytest.raises(openai.BadRequestError) as e:  # over the talker's limit: the gateway refuses it
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                       modalities=["text", "audio"],
                                       extra_body={"sampling_params_list": [{}, {"max_tokens": 1 << 20}]})  # fmt: skip
    assert e.value.body["param"] == "sampling_params_list[1].max_tokens" and "talker" in e.value.body["message"]
    for extra, param in (({"sampling_params_list": [{"max_tokens": 1 << 20}]}, "sampling_params_list[0].max_tokens"),
                         ({"max_tokens": 1 << 20, "sampling_params_list": [{"top_k": 5}]}, "max_tokens")):
        with pytest.raises(openai.BadRequestError) as e:  # the thinker's: named where the body set it
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                           extra_body=extra)  # fmt: skip
        assert e.value.body["param"] == param and "thinker" in e.value.body["message"], e.value.body


def test_text_only_and_stop_texts(http_stack: Stack, client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.audio is None
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = client.chat.completions.create(model=whole.model, temperature=0, max_tokens=24, stop=[stop],
                                         messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_come_with_their_tokens_streamed_or_not(http_stack: Stack, client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    ask: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": 24,
                           "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    plain = client.chat.completions.create(**ask)
    assert plain.choices[0].logprobs is None
    raw = _post(http_stack, ask).json()["choices"][0]  # OpenAI's keys, null where unused
    assert raw["logprobs"] is None and raw["message"]["refusal"] is None
    whole = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
    text = whole.choices[0].message.content
    assert text == plain.choices[0].message.content
    content = whole.choices[0].logprobs.content
    # the reply's tokens, the end aside (the tiny model's bytes need not be UTF-8: decoded as its text is)
    assert content and b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == text
    for e in content:  # greedy: each token is its position's most likely, the alternatives best first
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.logprob == e.top_logprobs[0].logprob < 0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    streamed, pieces = [], []
    for chunk in client.chat.completions.create(**ask, logprobs=True, top_logprobs=3, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.extend(choice.logprobs.content)
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == text
    assert [(e.token, e.logprob, e.bytes) for e in streamed] == [(e.token, e.logprob, e.bytes) for e in content]
    # cut by a stop text, with speech: the same entries streamed or not (those of the stop text's
    # tokens, whose text never shows, come with the finish)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = {**ask, "stop": [stop], "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "pcm16"},
           "logprobs": True, "top_logprobs": 0}  # fmt: skip
    whole_cut = client.chat.completions.create(**cut)
    assert whole_cut.choices[0].message.content == text[: text.index(stop)]
    entries = whole_cut.choices[0].logprobs.content
    assert entries and all(e.top_logprobs == [] for e in entries)
    spoken = b"".join(bytes(e.bytes) for e in entries).decode(errors="replace")  # up to the stop text's end
    assert spoken.startswith(whole_cut.choices[0].message.content) and stop in spoken
    streamed = [e for ch in client.chat.completions.create(**cut, stream=True) for c in ch.choices
                if c.logprobs is not None for e in c.logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert [e.logprob for e in entries] == [e.logprob for e in content[: len(entries)]]
    # the gRPC door: one per token id, in order (the end token's too)
    request = build_request(QUESTION, greedy=True, thinker_max_tokens=24, want_audio=False)
    request.sampling["thinker"].logprobs = 2

    async def go() -> list[Any]:
        async with grpc.aio.insecure_channel(http_stack.gateway_address) as ch:
            return [r async for r in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=120)
                    if r.WhichOneof("kind") == "text" and r.text.token_ids]  # fmt: skip

    deltas = run(go())
    assert all([lp.token_id for lp in d.text.logprobs] == list(d.text.token_ids) for d in deltas)
    scored = [lp for d in deltas for lp in d.text.logprobs]
    assert [lp.logprob for lp in scored][: len(content)] == pytest.approx([e.logprob for e in content])
    # a reply that ends on a stop id: the end token (<|im_end|>) has no entry, and neither has an
    # ordinary token a client names in stop_token_ids, whose text the content leaves out too
    story = {**ask, "max_tokens": 40, "messages": [{"role": "user", "content": STORY}], "logprobs": True}
    ended = client.chat.completions.create(**story)
    assert ended.choices[0].finish_reason == "stop"
    assert len(ended.choices[0].logprobs.content) == ended.usage.completion_tokens - 1
    request = build_request(STORY, greedy=True, thinker_max_tokens=40, want_audio=False)
    request.sampling["thinker"].logprobs = 0
    ids = [i for d in run(go()) for i in d.text.token_ids]
    assert len(ids) == ended.usage.completion_tokens and len(ids) > 5
    named = client.chat.completions.create(**story, extra_body={"stop_token_ids": [ids[3]]})
    assert named.choices[0].finish_reason == "stop" and named.usage.completion_tokens == 4
    entries = named.choices[0].logprobs.content
    assert [e.logprob for e in entries] == [e.logprob for e in ended.choices[0].logprobs.content[:3]]
    assert named.choices[0].message.content == b"".join(bytes(e.bytes) for e in entries).decode(errors="replace")
    request.sampling["thinker"].logprobs = 21
    with pytest.raises(grpc.RpcError) as e:
        run(go())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs must be from 0 to 20" in e.value.details()


def test_a_completion_continues_its_raw_prompt_as_generate_does(http_stack: Stack, client: openai.OpenAI,
                                                                   reference: Any, pipeline: Any) -> None:  # fmt: skip
    """/v1/completions: the prompt is the model's input as written (no chat template; special-token
    text is those tokens): greedy, its text is transformers' generate() on the tokenizer's ids, as
    the gRPC door's raw prompt gives them; a chat prompt's text written out is that chat's reply."""
    from gateway.client import Reply
    from omnistage.models import load_tokenizer, open_checkpoint

    model = client.models.list().data[0].id
    tok = load_tokenizer(open_checkpoint(http_stack.model_dir))
    prompt = "Once upon a time, in a quiet town by the sea,"
    ids = [int(i) for i in tok.encode(prompt)]
    ref_ids, _, _ = reference.generate(ids, MAX_TOKENS, 1, pipeline.spec.im_end_id, audio=False)
    reply: Reply = run(generate(http_stack.gateway_address, prompt, raw=True, thinker_max_tokens=MAX_TOKENS,
                                want_audio=False, timeout=60))  # fmt: skip
    assert reply.token_ids == ref_ids and len(ref_ids) == MAX_TOKENS
    done = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    assert done.object == "text_completion" and done.choices[0].text == reply.text
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), MAX_TOKENS)
    assert done.choices[0].finish_reason == "length"
    # 16 tokens when max_tokens is left out, as OpenAI's (the first 12 those above)
    first, default = (client.completions.create(model=model, prompt=prompt, temperature=0, logprobs=0, **kw)
                      for kw in ({"max_tokens": MAX_TOKENS}, {}))  # fmt: skip
    assert default.choices[0].logprobs.tokens[:MAX_TOKENS] == first.choices[0].logprobs.tokens
    ended = default.choices[0].finish_reason == "stop"  # (on a stop id before 16: it has no entry)
    assert default.usage.completion_tokens == len(default.choices[0].logprobs.tokens) + ended
    assert default.usage.completion_tokens == 16 or ended
    # each token's text stands at its offset, up to the first that is part of a character
    scored = first.choices[0].logprobs
    whole = next((i for i, t in enumerate(scored.tokens) if "\ufffd" in t), len(scored.tokens))
    assert all(reply.text[o : o + len(t)] == t for o, t in zip(scored.text_offset[:whole], scored.tokens, strict=False))
    # the chat door's prompt for QUESTION, written out: its reply
    written = tok.decode(pipeline.prompt_ids(QUESTION))
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=MAX_TOKENS,
                                          messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    same = client.completions.create(model=model, prompt=written, temperature=0, max_tokens=MAX_TOKENS)
    assert same.usage.prompt_tokens == chat.usage.prompt_tokens
    assert same.choices[0].text == chat.choices[0].message.content
    # the prompt as token ids (lm-eval's default): the same; echoed, their text
    by_ids = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=MAX_TOKENS, echo=True)
    assert by_ids.choices[0].text == tok.decode(ids) + reply.text and by_ids.usage.prompt_tokens == len(ids)


def test_a_completion_streams_echoes_and_scores_its_tokens(http_stack: Stack, client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    ask: dict[str, Any] = {"model": model, "prompt": "The weather today is", "temperature": 0,
                           "max_tokens": MAX_TOKENS}  # fmt: skip
    whole = client.completions.create(**ask, logprobs=3)
    text, lp, finish = whole.choices[0].text, whole.choices[0].logprobs, whole.choices[0].finish_reason
    n = whole.usage.completion_tokens - (finish == "stop")  # (the end token, <|im_end|>, has none)
    assert text and n > 2 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob == max(top.values())  # greedy: its position's most likely
        assert 1 <= len(top) <= 4  # the 3 most likely and the token (among them, greedy)
    events = list(client.completions.create(**ask, logprobs=3, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.text for e in events for c in e.choices) == text
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.finish_reason for e in events for c in e.choices][-1] == finish
    streamed = [c.logprobs for e in events for c in e.choices if c.logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [p for s in streamed for p in s.token_logprobs] == lp.token_logprobs
    # what vLLM's `bench serve` sends (its completions backend), fields that change nothing included
    vllm = {**ask, "repetition_penalty": 1.0, "logprobs": None, "stream": True, "best_of": 1, "ignore_eos": False,
            "use_beam_search": False, "stream_options": {"include_usage": True}}  # fmt: skip
    served = httpx.post(f"http://{http_stack.http_address}/v1/completions", json=vllm, timeout=60)
    chunks = [json.loads(line[5:]) for line in served.text.splitlines() if line.startswith("data: {")]
    assert served.status_code == 200 and "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    assert chunks[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    echoed = client.completions.create(**ask, echo=True)
    assert echoed.choices[0].text == ask["prompt"] + text and echoed.choices[0].logprobs is None
    pieces = [c.text for e in client.completions.create(**ask, echo=True, stream=True) for c in e.choices]
    assert pieces[0] == ask["prompt"] and "".join(pieces) == ask["prompt"] + text
    # cut by a stop text (whole characters: the tiny model's bytes need not be UTF-8): before it
    at = next(i for i in range(1, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    cut = client.completions.create(**ask, stop=[text[at : at + 2]])
    assert cut.choices[0].text == text[: text.index(text[at : at + 2])] and cut.choices[0].finish_reason == "stop"


def test_a_completion_it_cannot_serve_is_refused_by_name(http_stack: Stack, client: openai.OpenAI) -> None:
    """Several prompts, token ids, a suffix, a token standing for media, echo with logprobs, a
    prompt past the model's length, vLLM's fields with no counterpart: a 400 naming the field,
    streamed or not; the stack serves the next request."""
    url = f"http://{http_stack.http_address}/v1/completions"
    for body, param in (({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 1 << 40]}, "prompt"),  # past the vocabulary
                        ({"prompt": "a", "suffix": "b"}, "suffix"), ({"prompt": "a", "n": 2}, "n"),
                        ({"prompt": "a <|image_pad|> b"}, "prompt"), ({"prompt": "<|audio_start|>"}, "prompt"),
                        ({"prompt": ""}, "prompt"),
                        ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
                        ({"prompt": "a", "ignore_eos": True}, "ignore_eos"),
                        ({"prompt": "a", "logprobs": 21}, "logprobs"),
                        ({"prompt": "word " * MAX_MODEL_LEN}, "prompt"),
                        ({"prompt": "a", "max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
                        ({"prompt": "a", "max_tokens": 0, "echo": True}, "max_tokens"),
                        ({"prompt": "a", "response_format": {"type": "json_object"}}, "response_format")):  # fmt: skip
        for stream in (False, True):
            r = httpx.post(url, json={**body, "stream": stream}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(url, json={"prompt": "word " * MAX_MODEL_LEN}, timeout=60)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="another", prompt="a")
    done = client.completions.create(model=client.models.list().data[0].id, prompt="a", max_tokens=2)
    assert done.usage.completion_tokens == 2


def test_a_conversation_without_user_text_is_answered(http_stack: Stack, client: openai.OpenAI) -> None:
    """As OpenAI answers them (each was a 400 "no user message with content"): a system prompt
    alone, a user turn left empty, and an assistant turn holding a refusal part."""
    model = client.models.list().data[0].id
    for messages in ([{"role": "system", "content": "You are a poet. Write about the sea."}],
                     [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": ""}],
                     [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
                      {"role": "user", "content": "why"}]):  # fmt: skip
        reply = client.chat.completions.create(model=model, temperature=0, max_tokens=8, messages=messages,
                                               modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
        assert reply.choices[0].message.content and reply.choices[0].message.audio.data, messages
    # the refusal reads as that turn's text
    text = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "I cannot."},
            {"role": "user", "content": "why"}]
    a = client.chat.completions.create(model=model, temperature=0, max_tokens=8, messages=text)
    b = client.chat.completions.create(model=model, temperature=0, max_tokens=8, messages=messages)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_control_token_text_is_the_clients_text_at_every_door(http_stack: Stack, client: openai.OpenAI) -> None:
    """`<|audio_pad|>` or `<|im_end|>` in what a client writes is text (tests/test_control_tokens.py):
    chat, speech and a Realtime item are answered; it failed the request naming the thinker, and a
    Realtime session's every later response."""
    model = client.models.list().data[0].id
    text = "What does <|audio_pad|> mean? <|im_end|>"

    def prompt_tokens(content: str) -> int:
        chat = client.chat.completions.create(model=model, temperature=0, max_tokens=4,
                                              messages=[{"role": "user", "content": content}])  # fmt: skip
        assert chat.choices[0].message.content and chat.usage
        return chat.usage.prompt_tokens

    plain = prompt_tokens("What does  mean? ")
    for token in ("<|audio_pad|>", "<|im_end|>"):  # each token's text is several tokens (as a token: 1)
        assert prompt_tokens(f"What does {token} mean? ") > plain + 2, token
    # answered to its end (the talker samples: its first frame may be the codec's end, so no bytes
    # is a valid answer; the event stream shows the whole answer, or its error, either way)
    speech = httpx.post(f"http://{http_stack.http_address}/v1/audio/speech", timeout=60,
                        json={"input": "Say <|image_pad|> please", "instructions": "<|vision_start|> calmly",
                              "voice": "ethan", "response_format": "pcm", "stream_format": "sse"})  # fmt: skip
    assert speech.status_code == 200, speech.text[:300]
    events = [json.loads(line[5:]) for line in speech.text.splitlines() if line.startswith("data:")]
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"], events[-1:]
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1])

    async def talk() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"http://{http_stack.http_address}/v1", api_key="unused", max_retries=0)
        statuses = []
        async with aclient.realtime.connect(model=model) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "max_output_tokens": 4})  # type: ignore[typeddict-unknown-key]  # fmt: skip
            for said in (text, "and then?"):
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": said}]})
                await conn.response.create()
                async for event in conn:
                    assert event.type != "error", event
                    if event.type == "response.done":
                        statuses.append(event.response.status)
                        break
        return statuses

    statuses = run(talk())  # (cut at max_output_tokens: incomplete; it was failed)
    assert len(statuses) == 2 and set(statuses) <= {"completed", "incomplete"}, statuses


def test_a_realtime_conversation_past_the_model_length_leaves_out_its_oldest_turns(
        http_stack: Stack, client: openai.OpenAI) -> None:  # fmt: skip
    """Truncation "auto" (the default) through the real prompt build: each response's prompt stays
    within the model's length less its output tokens, as few turns left out as it takes (those
    left out stay out: the prompt grows again from the new start); "disabled" fails the response
    over the length instead."""
    model = client.models.list().data[0].id
    words = " ".join(f"word{i % 37}" for i in range(60))  # a few hundred tokens a turn
    limit = MAX_MODEL_LEN - 8  # (max_output_tokens: 8)

    async def talk(truncation: str) -> list[tuple[str, int, Any]]:
        aclient = openai.AsyncOpenAI(base_url=f"http://{http_stack.http_address}/v1", api_key="unused", max_retries=0)
        seen: list[tuple[str, int, Any]] = []
        async with aclient.realtime.connect(model=model) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "max_output_tokens": 8, "truncation": truncation})  # type: ignore[typeddict-unknown-key]  # fmt: skip
            for turn in range(6):
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": f"turn {turn}: {words}"}]})  # fmt: skip
                await conn.response.create()
                async for event in conn:
                    if event.type == "response.done":
                        usage = event.response.usage
                        seen.append((event.response.status or "", usage.input_tokens if usage else 0,
                                     event.response.status_details))  # fmt: skip
                        break
        return seen

    seen = run(talk("auto"))
    statuses, tokens = [s for s, _, _ in seen], [t for _, t, _ in seen]
    assert set(statuses) <= {"completed", "incomplete"} and all(0 < t <= limit for t in tokens), seen
    assert 6 * tokens[0] > limit, seen  # the sixth prompt whole would hold six turns: turns were left out
    assert tokens[-1] > limit - 2 * tokens[0], seen  # as few as it takes (a turn and its reply at most)
    refused = run(talk("disabled"))
    assert [s for s, _, _ in refused][:3] == statuses[:3] and refused[-1][0] == "failed", refused
    assert "exceeds the model maximum" in str(refused[-1][2]), refused


def test_the_truncation_bench_sorts_its_turns(http_stack: Stack) -> None:
    """`omnistage bench truncation`'s session loop on this stack: a retention ratio's session comes
    down at once and grows again; its summary counts those turns as truncating, the rest by side."""
    from benchmarks.truncation import _arm_summary, _session

    ratio = {"type": "retention_ratio", "retention_ratio": 0.5}
    rows = run(_session(f"ws://{http_stack.http_address}/v1/realtime", ratio, "t", 7, 60))
    tokens = [r["prompt_tokens"] for r in rows]
    assert len(rows) == 7 and all(r["status"] != "failed" and r["ttft"] > 0 for r in rows), rows
    cuts = [i for i in range(1, 7) if tokens[i] < tokens[i - 1]]
    assert cuts and max(tokens) <= MAX_MODEL_LEN - 8, tokens
    summary = _arm_summary([rows], {"cached": 1.0, "prefilled": 3.0})
    assert summary["ttft_truncating_turns"]["n"] == len(cuts) and summary["cached_share"] == 0.25
    counted = sum(summary[k]["n"] for k in ("ttft_below_limit", "ttft_truncating_turns", "ttft_other_turns_past_limit"))
    assert counted == 7 and summary["ttft_below_limit"]["n"] == cuts[0]


def _post(stack: Stack, body: Any, raw: bytes | None = None, **headers: str) -> httpx.Response:
    url = f"http://{stack.http_address}/v1/chat/completions"
    if raw is not None:
        return httpx.post(url, content=raw, headers={"content-type": "application/json", **headers}, timeout=60)
    return httpx.post(url, json=body, headers=headers, timeout=60)


def test_bad_requests_get_the_documented_status_and_shape(http_stack: Stack) -> None:
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": []}, None, 400, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, None, 400, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, None, 400, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "@@"}}]}]}, None,
         400, "messages[0].content[0].input_audio.data"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
         None, 400, "messages[0].content[0].image_url.url"),
        ({"messages": hi, "modalities": ["text", "audio"], "audio": {"voice": "nobody"}}, None, 400, "audio.voice"),
        ({"messages": [*hi, {"role": "assistant", "audio": {"id": "audio_none"}}]}, None, 400,
         "messages[1].audio.id"),
        ({"messages": hi, "max_tokens": 1 << 20}, None, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi " * 20_000}]}, None, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}]},
         None, 400, "messages[0].content[0]"),
        ({"messages": hi, "audio": {"format": "aiff"}}, None, 400, "audio.format"),
        ({"messages": hi, "chat_template_kwargs": {"add_generation_prompt": False}}, None, 400, "chat_template_kwargs"),
        ({"messages": hi, "n": 2}, None, 400, "n"),
        ({"messages": hi, "max_tokens": 0}, None, 400, "max_tokens"),
        ({"messages": hi, "stop": [""]}, None, 400, "stop[0]"),
        (None, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
        (None, b"{not json", 400, "body"),
        (None, b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"1" * 5000 + b"}", 400, "body"),
        (None, b"[" * 100_000, 400, "body"),  # nesting past the parser's stack (was a plain-text 500)
        ({"model": "other", "messages": hi}, None, 404, "model"),
        # JSON escapes half of a UTF-16 pair; protobuf takes only UTF-8 (each was a 500)
        (None, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "messages[0].content"),
        (None, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', 400,
         "messages[0].content[0].text"),
        (None, b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["x", "\\ud800"]}', 400, "stop[1]"),
        # the wrong JSON type is refused, not coerced (each was a 200)
        ({"messages": hi, "max_tokens": True}, None, 400, "max_tokens"),
        ({"messages": hi, "temperature": "0.5"}, None, 400, "temperature"),
        ({"messages": hi, "tool_choice": "required"}, None, 400, "tool_choice"),
        ({"messages": hi, "top_logprobs": 3}, None, 400, "top_logprobs"),
        ({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, None, 400,
         "messages[0].content[0]"),  # (an assistant's part)
        ({"messages": hi, "max_completion_tokens": 1 << 20}, None, 400, "max_completion_tokens"),
    ]  # fmt: skip
    # streamed or not, the same status: nothing is sent before the reply's first piece exists
    for stream in (False, True):
        for body, raw, status, field in cases:
            if body is not None:
                body = {**body, "stream": stream}
            elif stream:
                continue
            r = _post(http_stack, body, raw)
            assert r.status_code == status, (body or raw, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["message"].startswith(field) or error["param"] == field, (field, error)
            if field == "max_completion_tokens":  # the name the client used, in the message too
                assert "max_tokens" not in error["message"].replace("max_completion_tokens", ""), error
    # a compressed body: refused by its encoding, not read as JSON ("not UTF-8")
    r = _post(http_stack, None, gzip.compress(json.dumps({"messages": hi}).encode()), **{"content-encoding": "gzip"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "content-encoding", r.text
    # a trailing slash: an unknown path, an OpenAI error (was a bare redirect)
    r = httpx.post(f"http://{http_stack.http_address}/v1/chat/completions/", json={"messages": hi}, timeout=60)
    assert r.status_code == 404 and "error" in r.json(), r.text
    # a deadline no reply can meet (a whole greedy reply with speech takes several times longer here;
    # streamed, not even its first piece): 504
    for stream, seconds in ((False, "0.05"), (True, "0.001")):
        body = {"messages": hi, "max_tokens": 400, "modalities": ["text", "audio"], "temperature": 0, "stream": stream}
        r = _post(http_stack, body, **{"x-omnistage-timeout": seconds})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
        assert r.headers["x-should-retry"] == "false"  # (the OpenAI SDK would run it twice more)
        # whichever call ran out first, the message names the request (was gRPC's own "Stream removed")
        assert "passed its deadline" in r.json()["error"]["message"], r.text
    assert _post(http_stack, {"messages": hi}, **{"x-omnistage-timeout": "soon"}).status_code == 400
    # a body declared over the limit is refused before any of it is sent (never held whole first)
    host, port = http_stack.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4000000000\r\n\r\n")  # fmt: skip
        got = b""
        while piece := sock.recv(4096):  # to the end: the server closes the connection after its 413
            got += piece
    assert got.startswith(b"HTTP/1.1 413") and b"request_too_large" in got, got
    assert b"connection: close" in got.lower(), got


def _loads(stack: Stack, stages: tuple[str, ...] = ("thinker", "talker", "code2wav")) -> list[tuple[int, ...]]:
    out = []
    for stage in stages:
        for address in stack.addresses(stage):
            load = run(info(address)).load
            out.append((load.running, load.waiting, load.waiting_for_input, load.open_streams))
    return out


def _wait_until(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def _wait_zero(stack: Stack, seconds: float = 10.0) -> bool:
    return _wait_until(lambda: not any(any(load) for load in _loads(stack)), seconds)


def _cancelled(stack: Stack) -> float:
    text = httpx.get(f"http://{stack.http_address}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "omnistage_gateway_requests"
               for s in f.samples if s.labels == {"api": "http", "outcome": "CANCELLED"})  # fmt: skip


def test_a_client_that_disconnects_cancels_the_chain(http_stack: Stack) -> None:
    """A deterministic reply (temperature 0: greedy text and speech) the client hangs up on while
    it is being made: once audio flows (streamed), or once a talker holds it (not streamed: a raw
    connection closed before any reply byte, so the check does not hang on how fast the machine
    is). The gateway counts it cancelled and every stage lets go of it at once."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500, "modalities": ["text", "audio"],
            "audio": {"format": "pcm16"}, "temperature": 0}  # fmt: skip
    url = f"http://{http_stack.http_address}/v1/chat/completions"
    for stream in (True, False):
        before = _cancelled(http_stack)
        body["stream"] = stream
        if stream:
            with httpx.Client(timeout=60) as c, c.stream("POST", url, json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and '"data"' in line:
                        break  # hang up once audio flows
        else:
            host, port = http_stack.http_address.rsplit(":", 1)
            data = json.dumps(body).encode()
            head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(data)}\r\n\r\n").encode()  # fmt: skip
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(head + data)
                held = _wait_until(lambda: any(load[0] for load in _loads(http_stack, ("talker",))), 30)
                assert held, "the request never reached a talker"
                sock.settimeout(0)
                with pytest.raises(BlockingIOError):  # nothing answered yet: the reply is still being made
                    sock.recv(1)
        assert _wait_zero(http_stack, 15.0), f"stream={stream}: a stage still holds the request"
        counted = _wait_until(lambda b=before: _cancelled(http_stack) == b + 1, 15)  # type: ignore[misc]
        assert counted, f"stream={stream}: not counted as cancelled"


def test_a_client_request_id_is_kept_and_a_bad_one_refused(http_stack: Stack) -> None:
    """A client's own `x-request-id` (as a proxy in front sets it) names the request in the reply
    and the access line, as gRPC's `request_id` does; it was replaced by the gateway's own."""
    url = f"http://{http_stack.http_address}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = httpx.post(url, json=body, headers={"x-request-id": "proxy-7f3a"}, timeout=60)
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "proxy-7f3a"
    log = http_stack.log_dir / "gateway-0.log"
    assert _wait_until(lambda: "request_id=proxy-7f3a " in log.read_text(), 5)
    made = httpx.post(url, json=body, timeout=60).headers["x-request-id"]  # none sent: the gateway's own
    assert len(made) == 32 and made != "proxy-7f3a"
    bad = httpx.post(url, json=body, headers={"x-request-id": "x" * 300}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-id"
    # on every endpoint, and before the body's media is looked at (this file would be refused too)
    stt = httpx.post(url.replace("chat/completions", "audio/transcriptions"), files={"file": ("a.wav", b"junk")},
                     headers={"x-request-id": "x" * 300}, timeout=60)  # fmt: skip
    assert stt.status_code == 400 and stt.json()["error"]["param"] == "x-request-id", stt.text
    # a request refused at its body is named by its id too (reply header, access line)
    refused = httpx.post(url, json={**body, "max_tokens": 0}, headers={"x-request-id": "proxy-refused"}, timeout=60)
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "proxy-refused"
    assert _wait_until(lambda: "request_id=proxy-refused " in log.read_text(), 5)
    # ... and one refused without an id gets the gateway's own, as any reply does (it had none)
    for headers in ({}, {"x-request-id": "x" * 300}):  # (a bad one is not echoed)
        named = httpx.post(url, json={**body, "max_tokens": 0}, headers=headers, timeout=60).headers["x-request-id"]
        assert len(named) == 32 and named != "x" * 32
        assert _wait_until(lambda: f"request_id={named} " in log.read_text(), 5)  # noqa: B023
    # so is one refused at the gRPC door (trailing metadata: it had no first message)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(generate(http_stack.gateway_address, "hi", thinker_max_tokens=2, request_id="x" * 300, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    named = dict(err.value.trailing_metadata() or ()).get("x-request-id", "")
    assert len(named) == 32 and named != "x" * 32, named
    assert _wait_until(lambda: f"request_id={named} " in log.read_text(), 5)
    # a reply's audio id (its transcript's key) is the server's own: a client naming two requests
    # alike, or after another client's id, must not reach the other's transcript
    spoken = {**body, "modalities": ["text", "audio"], "audio": {"format": "pcm16"}, "temperature": 0,
              "sampling_params_list": [{}, {"max_tokens": 3}]}  # fmt: skip
    ids = [httpx.post(url, json=spoken, headers={"x-request-id": "proxy-same"}, timeout=60).json()["choices"][0]
           ["message"]["audio"]["id"] for _ in range(2)]  # fmt: skip
    assert ids[0] != ids[1] and "proxy-same" not in ids[0] + ids[1]


def test_metrics_count_the_requests(http_stack: Stack, client: openai.OpenAI) -> None:
    def families() -> dict[str, Any]:
        text = httpx.get(f"http://{http_stack.http_address}/metrics").text
        return {f.name: f for f in text_string_to_metric_families(text)}

    def count(fams: dict[str, Any], name: str) -> float:
        return sum(s.value for s in fams[name].samples if s.name == name + "_count")

    def made(stage: str, unit: str) -> float:
        return sum(metric(a, f"omnistage_stage_output_{unit}_total") for a in http_stack.addresses(stage))

    def finished_ok(stage: str) -> float:
        return sum(metric(a, "omnistage_stage_requests_finished_total", outcome="ok")
                   for a in http_stack.addresses(stage))  # fmt: skip

    before = families()
    frames0, samples0 = made("talker", "frames"), made("code2wav", "samples")
    ended0 = {s: finished_ok(s) for s in ("thinker", "talker", "code2wav")}
    replies = [_chat(client, "pcm16") for _ in range(2)]
    after = families()
    # what the talker and code2wav count made is what the replies carry (the talker's count stayed
    # 0: it counted only frames sent up, and the gateway asks for none unless it stops on text)
    frames = sum(r.usage.completion_tokens_details.audio_tokens for r in replies)
    samples = sum(len(base64.b64decode(r.choices[0].message.audio.data)) // 2 for r in replies)
    assert frames > 0 and made("talker", "frames") - frames0 == frames
    assert made("code2wav", "samples") - samples0 == samples
    # each stage counts how its requests ended (as its engine lets each go: just after its last output)
    ended = {"thinker": 2, "talker": 2, "code2wav": 2}
    assert _wait_until(lambda: {s: finished_ok(s) - ended0[s] for s in ended0} == ended, 5), \
        {s: finished_ok(s) - ended0[s] for s in ended0}  # fmt: skip
    for name in ("omnistage_gateway_time_to_first_token_seconds", "omnistage_gateway_time_to_first_audio_seconds",
                 "omnistage_gateway_request_duration_seconds", "omnistage_gateway_real_time_factor"):  # fmt: skip
        assert count(after, name) - count(before, name) == 2, name
    ok = [s for s in after["omnistage_gateway_requests"].samples
          if s.name.endswith("_total") and s.labels == {"api": "http", "outcome": "ok"}]  # fmt: skip
    assert ok and ok[0].value >= 2
    # (exported; one thinker here, so none can be left out: test_gateway_units drives it)
    assert [x.value for x in after["omnistage_gateway_thinker_replicas_out"].samples] == [0.0]
    # a stage's own metrics port: batches, steps, produced tokens
    port = int(http_stack.addresses("thinker")[0].rsplit(":", 1)[1]) + 1000
    stage = {f.name: f for f in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics").text)}
    assert count(stage, "omnistage_stage_batch_size") > 0 and count(stage, "omnistage_stage_step_seconds") > 0
    tokens = [s.value for s in stage["omnistage_stage_output_tokens"].samples if s.name.endswith("_total")]
    text_tokens = sum(r.usage.completion_tokens - r.usage.completion_tokens_details.audio_tokens for r in replies)
    assert text_tokens > 0 and tokens and tokens[0] >= text_tokens  # (and earlier tests' tokens)
    assert "omnistage_stage_kv_cache_usage_ratio" in stage and "omnistage_stage_shm_segments" in stage
    assert [x.value for x in stage["omnistage_stage_kv_held_tokens"].samples] == [0.0]  # the thinker holds none
    assert [x.value for x in stage["omnistage_stage_kv_pool_tokens"].samples] == [0.0]  # exact mode: no pool
    assert "omnistage_stage_shm_inline_fallbacks" in stage and "omnistage_stage_replay_bytes" in stage
    assert [x.value for x in stage["omnistage_stage_replay_memory_full"].samples if x.name.endswith("_total")] == [0]
    assert [x.value for x in stage["omnistage_stage_downstream_replicas_out"].samples] == [0.0]

    thinker = http_stack.addresses("thinker")[0]

    def replay_bytes() -> float:  # what the thinker keeps to replay to a talker: handed back as each call ends
        return metric(thinker, "omnistage_stage_replay_bytes")

    def open_streams() -> float:
        return metric(thinker, "omnistage_stage_open_streams")

    during = None  # while a reply streams, the thinker keeps what it sent the talker
    streams = None
    for event in _chat(client, "pcm16", stream=True):
        if during is None and event.choices and event.choices[0].delta.audio is not None:
            during, streams = replay_bytes(), open_streams()
    assert during is not None and during > 0
    assert streams is not None and streams >= 1  # this reply's thinker call (an earlier one may be closing)
    deadline = time.monotonic() + 10
    while (replay_bytes() or open_streams()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert replay_bytes() == 0 and open_streams() == 0


# ---- a gateway of its own: API key, and a thinker that is down ---------------------------------------


def _gateway(stack: Stack, thinker: str, tmp: Path, *args: str, env: dict[str, str] | None = None
             ) -> tuple[subprocess.Popen[bytes], str, str]:  # fmt: skip
    base = free_port_block(2)
    grpc_port, http_port = base, base + 1
    log = open(tmp / f"gateway-{grpc_port}.log", "wb")  # noqa: SIM115 - the child keeps it
    command = [sys.executable, "-m", "omnistage.cli", "gateway", "--port", str(grpc_port), "--http-port",
               str(http_port), "--thinker", thinker, "--model", str(stack.model_dir), *args]  # fmt: skip
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 120
    while not httpx_ok(f"http://127.0.0.1:{http_port}/v1/models"):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp / f"gateway-{grpc_port}.log").read_text()
        time.sleep(0.3)
    return proc, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"


def httpx_ok(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
        return True
    except httpx.HTTPError:
        return False


def test_api_key_is_required_on_both_front_doors(http_stack: Stack, tmp_path: Path) -> None:
    proc, grpc_addr, http_addr = _gateway(http_stack, http_stack.addresses("thinker")[0], tmp_path,
                                          env={"OMNISTAGE_API_KEY": "s3cret"})  # fmt: skip
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        url = f"http://{http_addr}/v1/chat/completions"
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.post(url, json=body, headers={"authorization": "Bearer wrong"}, timeout=60).status_code == 401
        ok = httpx.post(url, json=body, headers={"authorization": "Bearer s3cret"}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
        # the auth scheme is case-insensitive (RFC 9110); the key is not
        assert httpx.post(url, json=body, headers={"authorization": "bearer s3cret"}, timeout=60).status_code == 200
        assert httpx.post(url, json=body, headers={"authorization": "Bearer S3CRET"}, timeout=60).status_code == 401
        # /health stays open for probes, but names the stages' addresses only with the key (as Info does)
        deadline = time.monotonic() + 15  # (503 until this new gateway's first poll of the thinker)
        while (probe := httpx.get(f"http://{http_addr}/health", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, probe.text
            time.sleep(0.1)
        assert probe.status_code == 200 and all(set(h) == {"stage", "serving"} for h in probe.json()["stages"])
        inside = httpx.get(f"http://{http_addr}/health", headers={"authorization": "Bearer s3cret"}, timeout=10)
        assert inside.json()["stages"][0]["target"].endswith(http_stack.addresses("thinker")[0])
        with pytest.raises(grpc.aio.AioRpcError) as e:
            run(generate(grpc_addr, "hi", thinker_max_tokens=4, want_audio=False, timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

        async def with_key() -> Any:
            async with grpc.aio.insecure_channel(grpc_addr) as ch:
                request = build_request("hi", thinker_max_tokens=4, want_audio=False)
                key = (("authorization", "Bearer s3cret"),)
                call = gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=30, metadata=key)
                return [r async for r in call]

        assert run(with_key())[-1].WhichOneof("kind") == "final"

        async def gateway_info(metadata: Any) -> Any:  # it names the stages' internal addresses
            async with grpc.aio.insecure_channel(grpc_addr) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                return await stub.Info(stage_pb2.InfoRequest(), timeout=10, metadata=metadata)

        with pytest.raises(grpc.aio.AioRpcError) as e:
            run(gateway_info(None))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert run(gateway_info((("authorization", "Bearer s3cret"),))).role == "gateway"

        # `bench --http`'s check of its HTTP door: the key and the port are both checked before it measures
        from benchmarks.drivers import Access, HttpDriver

        async def check(address: str, key: str | None) -> str | None:
            driver = HttpDriver(address, access=Access(api_key=key))
            try:
                await driver.check(10)
            except Exception as e:
                return str(e)
            finally:
                await driver.aclose()
            return None

        assert run(check(http_addr, "s3cret")) is None
        assert "HTTP 401" in (run(check(http_addr, "wrong")) or "")
        assert run(check(grpc_addr, "s3cret")) is not None  # the gRPC port is no HTTP front door
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_stage_down_is_503(http_stack: Stack, tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port_block(1)}"  # nothing listens there
    proc, _, http_addr = _gateway(http_stack, f"ipv4:{dead}", tmp_path)
    try:
        health = httpx.get(f"http://{http_addr}/health", timeout=10)
        assert health.status_code == 503
        assert health.json()["stages"][0]["serving"] is False
        r = httpx.post(f"http://{http_addr}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})  # fmt: skip
        assert r.status_code == 503 and "thinker" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- the playground page in a real browser ----------------------------------------------------------

NO_CHROMIUM = ("no Chromium: none of chromium, chromium-browser, google-chrome is on PATH; `make test` installs "
               "Debian's chromium package when it runs as root with apt-get, and could not here")  # fmt: skip


def test_playground_streams_text_and_audio_in_a_browser(http_stack: Stack) -> None:
    import shutil

    exe = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if exe is None:
        pytest.skip(NO_CHROMIUM)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is missing (`make test` installs it with the dev extras)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe,
                                    args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required"])  # fmt: skip
        try:
            page = browser.new_page()
            page.goto(f"http://{http_stack.http_address}/")
            page.wait_for_function("document.getElementById('voice').options.length > 0", timeout=30_000)
            page.fill("#question", QUESTION)
            page.fill("#maxTokens", "16")
            page.fill("#temperature", "0")  # greedy: a sampled reply may be too short to stream in pieces
            page.click("#send")
            page.wait_for_function("window.omnistage.done", timeout=120_000)
            state = page.evaluate("window.omnistage")
            shown = page.inner_text("#reply")
            player_shown = page.is_visible("#player")
        finally:
            browser.close()
    assert state["error"] is None, state["error"]
    assert state["text"] and shown == state["text"]
    assert state["chunks"] > 1 and state["samples"] > RATE // 4  # audio arrived in pieces, playing as it came
    rms = (state["sumSquares"] / state["samples"]) ** 0.5
    assert state["peak"] > 0.01 and rms > 0.001, state  # not silence
    assert state["firstAudioMs"] is not None and player_shown


def test_every_reply_validates_against_the_sdk_s_types(http_stack: Stack, client: openai.OpenAI) -> None:
    """The HTTP door's bodies and stream events, read as raw JSON, validate against the official
    SDK's types (the SDK itself reads them unchecked; clients generated from OpenAI's spec check)."""
    from openai.types import Model
    from openai.types.audio import Transcription, TranscriptionTextDeltaEvent, TranscriptionTextDoneEvent
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.shared import ErrorObject

    base = f"http://{http_stack.http_address}/v1"
    model = client.models.list().data[0].id
    turn = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}}
    with httpx.Client(timeout=120) as http:
        for m in http.get(f"{base}/models").json()["data"]:
            Model.model_validate(m)
        reply = ChatCompletion.model_validate(http.post(f"{base}/chat/completions", json=turn).json())
        assert reply.choices[0].message.audio is not None and reply.usage is not None
        with http.stream("POST", f"{base}/chat/completions",
                         json={**turn, "stream": True, "stream_options": {"include_usage": True}}) as r:
            lines = [line[5:] for line in r.iter_lines() if line.startswith("data:")]
        assert lines[-1].strip() == "[DONE]"
        events = [json.loads(line) for line in lines[:-1]]
        chunks = [ChatCompletionChunk.model_validate(e) for e in events]
        assert chunks[-1].usage is not None and any(c.choices and c.choices[0].delta.content for c in chunks)
        wav = io.BytesIO()
        with wave.open(wav, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(RATE)
            w.writeframes(_pcm16(media.tone(0.5, RATE, seed=3)).tobytes())
        files = {"file": ("a.wav", wav.getvalue())}
        Transcription.model_validate(http.post(f"{base}/audio/transcriptions", data={"model": model},
                                               files=files).json())  # fmt: skip
        with http.stream("POST", f"{base}/audio/transcriptions", data={"model": model, "stream": "true"},
                         files=files) as r:  # fmt: skip
            streamed = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        assert streamed and streamed[-1]["type"] == "transcript.text.done"
        for e in streamed:
            (TranscriptionTextDoneEvent if e["type"] == "transcript.text.done" else TranscriptionTextDeltaEvent
             ).model_validate(e)  # fmt: skip
        bad = http.post(f"{base}/chat/completions", json={**turn, "temperature": 9})
        assert bad.status_code == 400
        ErrorObject.model_validate(bad.json()["error"])


def _history_generated(tiny_dir: Path, reference: Any) -> tuple[list[int], list[int], str, int]:
    """tests/test_tool_calls.py's HISTORY with its tools as apply_chat_template renders it, the
    monolithic generate()'s greedy reply to it (MAX_TOKENS at most), that reply's text, and the
    id that ends a reply."""
    from omnistage.models import load_tokenizer, open_checkpoint
    from omnistage.models.checkpoint import chat_template
    from tests.test_tool_calls import HISTORY, TIME, WEATHER

    ckpt = open_checkpoint(tiny_dir)
    tokenizer, eos = load_tokenizer(ckpt), ckpt.spec.im_end_id
    rendered = tokenizer.apply_chat_template(HISTORY, tools=[WEATHER, TIME], add_generation_prompt=True, tokenize=True,
                                             chat_template=chat_template(tiny_dir), return_dict=True)  # fmt: skip
    ids = list(rendered["input_ids"])
    want, _, _ = reference.generate(ids, MAX_TOKENS, 0, eos, audio=False)
    return ids, want, tokenizer.decode([i for i in want if i != eos], skip_special_tokens=True), eos


def test_tools_and_earlier_calls_reach_the_model_as_generate_sees_them(
        http_stack: Stack, client: openai.OpenAI, tiny_dir: Path, reference: Any) -> None:  # fmt: skip
    """A chat with tools, an earlier call and its result (tests/test_tool_calls.py reads calls
    out of replies): the thinker's prompt is apply_chat_template's with the tools, and the reply
    is the monolithic generate()'s on it (greedy), streamed or not."""
    from tests.test_tool_calls import HISTORY, TIME, WEATHER

    model = client.models.list().data[0].id
    ids, want, text, _ = _history_generated(tiny_dir, reference)
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=MAX_TOKENS, messages=HISTORY,
                                           tools=[WEATHER, TIME])  # type: ignore[arg-type]  # fmt: skip
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(want)
    assert reply.choices[0].message.content == text and text
    stream = client.chat.completions.create(model=model, temperature=0, max_tokens=MAX_TOKENS, messages=HISTORY,
                                            tools=[WEATHER, TIME], stream=True, logprobs=True)  # type: ignore[arg-type]  # fmt: skip
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    # every token's logprobs once, streamed as whole (the text the calls are read from is held back)
    whole = client.chat.completions.create(model=model, temperature=0, max_tokens=MAX_TOKENS, messages=HISTORY,
                                           tools=[WEATHER, TIME], logprobs=True)  # type: ignore[arg-type]  # fmt: skip
    streamed = [e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in whole.choices[0].logprobs.content] and streamed


def test_realtime_tools_and_calls_are_the_chat_doors(http_stack: Stack, client: openai.OpenAI) -> None:
    """A Realtime session's tools, a call it replays and the call's output are the chat turns
    they stand for (the official client): the same prompt, the same greedy reply."""
    from tests.test_tool_calls import WEATHER

    model = client.models.list().data[0].id
    tool = {"type": "function", **WEATHER["function"]}  # (the Realtime API's flat form)
    args = '{"city": "Paris"}'
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=MAX_TOKENS, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "sunny"}])  # type: ignore[arg-type,list-item]  # fmt: skip

    async def talk() -> Any:
        aclient = openai.AsyncOpenAI(base_url=f"http://{http_stack.http_address}/v1", api_key="unused", max_retries=0)
        async with aclient.realtime.connect(model=model) as conn:
            await conn.session.update(session={"type": "realtime", "temperature": 0, "max_output_tokens": MAX_TOKENS,
                                               "output_modalities": ["text"], "tools": [tool],
                                               "audio": {"input": {"turn_detection": None}}})  # type: ignore[typeddict-unknown-key,list-item]  # fmt: skip
            for item in ({"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                          "text": "Weather in Paris?"}]},
                         {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": args},
                         {"type": "function_call_output", "call_id": "call_7", "output": "sunny"}):  # fmt: skip
                await conn.conversation.item.create(item=item)  # type: ignore[arg-type]
            await conn.response.create()
            async for event in conn:
                if event.type == "error":
                    raise AssertionError(event)
                if event.type == "response.done":
                    return event.response
        raise AssertionError("the connection ended before response.done")

    response = run(talk())
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output[0].content[0].text == chat.choices[0].message.content and chat.choices[0].message.content


def test_the_responses_api_gives_the_chat_doors_reply(
        http_stack: Stack, client: openai.OpenAI, tiny_dir: Path, reference: Any) -> None:  # fmt: skip
    """OpenAI's Responses API over the real stack (gateway/responses_api.py), through the official
    SDK: instructions, tools, an earlier reply's words and calls and the calls' outputs give the
    chat door's prompt and the monolithic generate()'s greedy reply, streamed or not, with every
    token's logprob once; a response chained to it (`previous_response_id`) is the chat of the
    whole conversation."""
    from tests.test_responses_api import FLAT, ITEMS
    from tests.test_tool_calls import HISTORY, TIME, WEATHER

    model = client.models.list().data[0].id
    ids, want, text, eos = _history_generated(tiny_dir, reference)
    kw: dict[str, Any] = {"model": model, "temperature": 0, "max_output_tokens": MAX_TOKENS, "tools": FLAT,
                          "instructions": "Be brief.", "include": ["message.output_text.logprobs"]}  # fmt: skip
    whole = client.responses.create(input=ITEMS, **kw)
    assert whole.usage is not None and (whole.usage.input_tokens, whole.usage.output_tokens) == (len(ids), len(want))
    assert whole.output_text == text and text and [o.type for o in whole.output] == ["message"]
    tokens = [e.token for e in whole.output[0].content[0].logprobs]  # type: ignore[union-attr]
    assert "".join(tokens) == text
    with client.responses.stream(input=ITEMS, **kw) as stream:  # type: ignore[arg-type]
        events = list(stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == text and len(deltas) > 1
    assert [lp.token for e in deltas for lp in e.logprobs] == tokens
    assert events[-1].type == ("response.incomplete" if len(want) == MAX_TOKENS and want[-1] != eos
                               else "response.completed")  # fmt: skip
    # chained: the stored turns, the reply's words, then the new turn (the instructions again: they
    # are not carried over, as OpenAI's)
    more = {"role": "user", "content": "And tomorrow?"}
    chained = client.responses.create(input=[more], previous_response_id=whole.id, **kw)  # type: ignore[list-item]
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=MAX_TOKENS, tools=[WEATHER, TIME],
                                          messages=[*HISTORY, {"role": "assistant", "content": text}, more])  # type: ignore[arg-type,list-item]  # fmt: skip
    assert chained.usage is not None and chained.usage.input_tokens == chat.usage.prompt_tokens > len(ids)
    assert chained.output_text == (chat.choices[0].message.content or "")
