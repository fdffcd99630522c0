"""Decoded media kept across requests (gateway/media_cache.py): a part sent again is decoded once,
charged to its request alike, the same for the model; the cache stays within its bound."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import media
from gateway import media as media_module
from gateway.client import audio_part, build_request, frames_part, image_part, pcm_part, text_part, video_part
from gateway.media import MediaError, decode_messages
from gateway.media_cache import DecodedCache
from omnistage.config import MediaConfig
from omnistage.v1 import gateway_pb2

RATE = 16_000
LIMITS = MediaConfig()


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kinds of the media parts actually decoded, in order."""
    calls: list[str] = []
    real = media_module._decode_part

    def counted(part: gateway_pb2.ContentPart, *args: Any) -> dict[str, Any]:
        if part.WhichOneof("kind") != "text":
            calls.append(str(part.WhichOneof("kind")))
        return real(part, *args)

    monkeypatch.setattr(media_module, "_decode_part", counted)
    return calls


def _turn(*parts: gateway_pb2.ContentPart) -> gateway_pb2.ChatMessage:
    return gateway_pb2.ChatMessage(role="user", parts=list(parts))


def test_a_conversation_decodes_each_part_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chat client sends every earlier turn again: each turn's media are decoded only when new,
    and what a request gets from the cache equals its own decode, read-only."""
    calls = _counting(monkeypatch)
    wav = media.encode_audio(media.tone(1.0, RATE, 300.0, seed=1), RATE)
    png = media.encode_image(media.image(16, 24, seed=2))
    mp4 = media.encode_video(media.video(4, 32, 32, seed=3), 2, sound=media.tone(2.0, RATE, 500.0, seed=4))
    turns = [_turn(audio_part(wav), text_part("one")), _turn(image_part(png)),
             _turn(video_part(mp4)), _turn(pcm_part(media.tone(0.5, 8000, seed=5), 8000))]  # fmt: skip
    cache = DecodedCache(64 << 20)
    for k in range(1, len(turns) + 1):
        request = gateway_pb2.GenerateRequest(messages=turns[:k], use_audio_in_video=False)
        before = len(calls)
        cached, _ = decode_messages(request, LIMITS, RATE, cache=cache)
        assert calls[before:] == [str(turns[k - 1].parts[0].WhichOneof("kind"))], "only the new turn's part decodes"
        fresh, _ = decode_messages(request, LIMITS, RATE)
        for got, want in zip(cached, fresh, strict=True):
            for g, w in zip(got["content"], want["content"], strict=True):
                assert g.keys() == w.keys()
                for key, value in w.items():
                    if isinstance(value, np.ndarray):
                        assert np.array_equal(g[key], value) and g[key].dtype == value.dtype, key
                        assert not g[key].flags.writeable, f"a kept {key} could be changed by a request"
                    else:
                        assert g[key] == value, key
    assert len(cache) == 4


def test_what_a_part_decodes_to_besides_its_bytes_is_in_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bytes at another feature rate, or a video with its sound track asked for, decode
    again; the same samples said to be at another rate are another part."""
    calls = _counting(monkeypatch)
    cache = DecodedCache(64 << 20)
    tone = media.tone(0.5, 8000, seed=6)
    decode_messages(gateway_pb2.GenerateRequest(messages=[_turn(pcm_part(tone, 8000))]), LIMITS, RATE, cache=cache)
    decode_messages(gateway_pb2.GenerateRequest(messages=[_turn(pcm_part(tone, 8000))]), LIMITS, 24_000, cache=cache)
    decode_messages(gateway_pb2.GenerateRequest(messages=[_turn(pcm_part(tone, 12_000))]), LIMITS, RATE, cache=cache)
    other_limits = MediaConfig(max_audio_seconds=10.0)
    decode_messages(gateway_pb2.GenerateRequest(messages=[_turn(pcm_part(tone, 8000))]), other_limits, RATE,
                    cache=cache)  # fmt: skip
    assert len(calls) == 4
    decode_messages(gateway_pb2.GenerateRequest(messages=[_turn(pcm_part(tone, 12_000))]), LIMITS, RATE, cache=cache)
    assert len(calls) == 4, "the same part, decoded alike, is reused"
    mp4 = media.encode_video(media.video(4, 32, 32, seed=7), 2, sound=media.tone(2.0, RATE, 500.0, seed=8))
    silent, _ = decode_messages(gateway_pb2.GenerateRequest(messages=[_turn(video_part(mp4))]), LIMITS, RATE,
                                cache=cache)  # fmt: skip
    voiced, _ = decode_messages(gateway_pb2.GenerateRequest(messages=[_turn(video_part(mp4))], use_audio_in_video=True),
                                LIMITS, RATE, cache=cache)  # fmt: skip
    assert len(calls) == 6
    # an audio part's decode does not depend on use_audio_in_video: one entry serves both
    decode_messages(gateway_pb2.GenerateRequest(messages=[_turn(pcm_part(tone, 8000)), _turn(video_part(mp4))],
                                                use_audio_in_video=True), LIMITS, RATE, cache=cache)  # fmt: skip
    assert len(calls) == 6
    assert silent[0]["content"][0]["audio"] is None and voiced[0]["content"][0]["audio"] is not None


def test_a_video_kept_without_its_sound_is_not_reused_where_its_sound_is_asked_for() -> None:
    """Frames have no sound track: kept from a request without use_audio_in_video, they are still
    refused, naming why, in a request with it."""
    cache = DecodedCache(64 << 20)
    frames = frames_part([media.encode_image(f) for f in media.video(2, 16, 16, seed=9)], 2.0)
    decode_messages(gateway_pb2.GenerateRequest(messages=[_turn(frames)]), LIMITS, RATE, cache=cache)
    with pytest.raises(MediaError, match="use_audio_in_video needs each video to be a file with a sound track"):
        decode_messages(gateway_pb2.GenerateRequest(messages=[_turn(frames)], use_audio_in_video=True), LIMITS, RATE,
                        cache=cache)  # fmt: skip


def test_a_kept_part_is_charged_to_the_request_that_reuses_it() -> None:
    """A hit costs its request's decoded-bytes budget what decoding it would: three copies of one
    small PNG that decodes to 48 MB are refused at max_decoded_bytes with the cache as without."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (4000, 4000)).save(buf, format="PNG", optimize=True)
    blank = buf.getvalue()
    limits = MediaConfig(max_decoded_bytes=100 << 20)  # two of them fit, the third does not
    cache = DecodedCache(1 << 30)
    messages, _ = decode_messages(build_request("what", images=[blank, blank]), limits, RATE, cache=cache)
    assert [p["image"].shape for p in messages[0]["content"] if p["type"] == "image"] == [(4000, 4000, 3)] * 2
    assert len(cache) == 1
    with pytest.raises(MediaError, match=r"^messages\[0\]\.parts\[2\] \(image\): .*media.max_decoded_bytes"):
        decode_messages(build_request("what", images=[blank] * 3), limits, RATE, cache=cache)


def test_refusals_are_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch)
    cache = DecodedCache(64 << 20)
    request = gateway_pb2.GenerateRequest(messages=[_turn(audio_part(b"not audio at all" * 8))])
    for _ in range(2):
        with pytest.raises(MediaError, match="cannot decode the audio"):
            decode_messages(request, LIMITS, RATE, cache=cache)
    assert len(calls) == 2 and len(cache) == 0


def test_the_cache_keeps_the_most_recently_used_within_its_bound() -> None:
    lookups: list[bool] = []
    cache = DecodedCache(3000, lookups.append)

    def entry(n: int) -> dict[str, Any]:
        return {"type": "audio", "audio": np.zeros(n, np.float32)}

    for name in (b"a", b"b"):
        cache.put(name, entry(250))  # 1000 bytes each
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"c", entry(500))  # 2000 bytes: b, the least recent, goes
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.get(b"c") is not None
    assert cache.bytes == 3000 and len(cache) == 2
    cache.put(b"huge", entry(1000))  # over the whole bound: not kept, nothing evicted for it
    assert cache.get(b"huge") is None and len(cache) == 2 and cache.bytes == 3000
    cache.put(b"a", entry(100))  # kept again: its old size is given back
    assert cache.bytes == 2400
    assert lookups == [True, False, True, True, False]
    got = cache.get(b"c")
    assert got is not None and got[1] == 2000 and not got[0]["audio"].flags.writeable


def test_the_gateway_reuses_a_conversations_media_and_counts_it(tiny_dir: Path) -> None:
    """Through the gateway's own prompt building: the second turn of a spoken conversation
    decodes only its new clip, gives the processor the same inputs as with the cache off, and
    the metrics count the lookups; `decoded_cache_bytes: 0` turns it off."""
    from gateway.server import GatewayService
    from omnistage.config import parse_config
    from omnistage.models import open_checkpoint

    ckpt = open_checkpoint(tiny_dir)
    first = _turn(audio_part(media.encode_audio(media.tone(1.0, RATE, 300.0, seed=9), RATE)))
    second = _turn(audio_part(media.encode_audio(media.tone(1.5, RATE, 600.0, seed=10), RATE)))
    reply = gateway_pb2.ChatMessage(role="assistant", content="a reply")
    conversation = [gateway_pb2.GenerateRequest(messages=[first]),
                    gateway_pb2.GenerateRequest(messages=[first, reply, second])]  # fmt: skip

    async def prompts(cfg: dict[str, Any]) -> tuple[list[Any], GatewayService]:
        service = GatewayService(parse_config(cfg), ckpt, "ipv4:127.0.0.1:1")
        return [service._prompt(r) for r in conversation], service

    cached, service = asyncio.run(prompts({}))
    plain, off = asyncio.run(prompts({"media": {"decoded_cache_bytes": 0}}))
    assert off.media_cache is None and service.media_cache is not None
    for got, want in zip(cached, plain, strict=True):
        assert got.ids == want.ids
        assert got.multimodal.keys() == want.multimodal.keys()
        for key, value in want.multimodal.items():
            assert np.array_equal(np.asarray(got.multimodal[key]), np.asarray(value)), key
    text = service.metrics.registry.get_sample_value
    assert text("omnistage_gateway_media_cache_lookups_total", {"result": "miss"}) == 2
    assert text("omnistage_gateway_media_cache_lookups_total", {"result": "hit"}) == 1
    assert text("omnistage_gateway_media_cache_bytes") == service.media_cache.bytes > 0
