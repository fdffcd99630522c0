"""Client of `Gateway.Generate`: streams text and audio, records when each arrived.

Imports only grpc, protobuf and numpy: a client process never loads torch or transformers."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from omnistage.server.tls import gateway_channel
from omnistage.v1 import gateway_pb2, gateway_pb2_grpc, stage_pb2


def sampling_proto(params: dict[str, Any]) -> stage_pb2.SamplingParams:
    """A stage's sampling message from plain values (None: the stage's default)."""
    msg = stage_pb2.SamplingParams()
    for key, value in params.items():
        if value is None:
            continue
        if key in ("stop_ids", "forced_ids"):
            getattr(msg, key).extend(int(i) for i in value)
        elif key == "stop_texts":
            msg.stop_texts.extend(str(t) for t in value)
        elif key == "logit_bias":
            msg.logit_bias.update({int(i): float(b) for i, b in value.items()})
        else:
            setattr(msg, key, value)
    return msg


REQUEST_ID_KEY = "x-request-id"  # the gateway's initial metadata: the request's id
MODES = {"async_chunk": stage_pb2.ASYNC_CHUNK, "full_payload": stage_pb2.FULL_PAYLOAD}


# ---- content parts (see gateway.proto: ContentPart) ------------------------------------------------


def text_part(text: str) -> gateway_pb2.ContentPart:
    return gateway_pb2.ContentPart(text=text)


def audio_part(data: bytes) -> gateway_pb2.ContentPart:
    """An encoded audio file (wav, flac, mp3, ogg/opus, ...)."""
    return gateway_pb2.ContentPart(audio=gateway_pb2.AudioPart(file=data))


def pcm_part(samples: np.ndarray, sample_rate: int) -> gateway_pb2.ContentPart:
    """Raw mono samples at `sample_rate` (sent as float32 little-endian)."""
    raw = gateway_pb2.RawAudio(f32le=np.asarray(samples, dtype="<f4").tobytes(), sample_rate=sample_rate)
    return gateway_pb2.ContentPart(audio=gateway_pb2.AudioPart(pcm=raw))


def image_part(data: bytes) -> gateway_pb2.ContentPart:
    """An encoded image (png, jpeg, webp, ...)."""
    return gateway_pb2.ContentPart(image=gateway_pb2.ImagePart(file=data))


def video_part(data: bytes) -> gateway_pb2.ContentPart:
    """A video file (mp4, webm, mkv, ...)."""
    return gateway_pb2.ContentPart(video=gateway_pb2.VideoPart(file=data))


def frames_part(images: list[bytes], fps: float) -> gateway_pb2.ContentPart:
    """A video as its frames (encoded images of one size) at `fps`."""
    return gateway_pb2.ContentPart(video=gateway_pb2.VideoPart(frames=gateway_pb2.VideoFrames(images=images, fps=fps)))


def user_message(prompt: str, *, audio: list[bytes] = (), images: list[bytes] = (),  # type: ignore[assignment]
                 videos: list[bytes] = ()) -> gateway_pb2.ChatMessage:  # type: ignore[assignment]  # fmt: skip
    """A user turn: the media first (audio, images, videos, each in order), then the text."""
    parts = [audio_part(a) for a in audio] + [image_part(i) for i in images] + [video_part(v) for v in videos]
    if prompt:
        parts.append(text_part(prompt))
    return gateway_pb2.ChatMessage(role="user", parts=parts)


@dataclass
class ClientEvent:
    kind: str  # "start" (request_id known) | "text" | "audio" | "final"
    t: float  # seconds since the call started
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    pcm: np.ndarray | None = None
    sample_rate: int = 0
    first_sample: int = 0
    usage: dict[str, float] = field(default_factory=dict)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)


def build_request(
    prompt: str,
    *,
    want_audio: bool = True,
    thinker_max_tokens: int | None = None,
    talker_max_tokens: int | None = None,
    greedy: bool = True,
    mode: str | None = None,
    speaker: str = "",
    system: str | None = None,
    request_id: str = "",
    thinker_stop_ids: list[int] | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    audio: list[bytes] = (),  # type: ignore[assignment]
    images: list[bytes] = (),  # type: ignore[assignment]
    videos: list[bytes] = (),  # type: ignore[assignment]
    use_audio_in_video: bool = False,
    messages: list[gateway_pb2.ChatMessage] | None = None,
    sampling: dict[str, dict[str, Any]] | None = None,
    audio_format: int = gateway_pb2.PCM_F32LE,
    stop: list[str] | None = None,
    speed: float = 0.0,
    tools: Sequence[Mapping[str, Any]] = (),
    raw: bool = False,
) -> gateway_pb2.GenerateRequest:
    """`greedy`: both stages greedy (what parity is checked on), unless `temperature` is set
    (and not under 1e-5, which is greedy): then the thinker samples at that temperature (the
    talker stays greedy). `audio`, `images`, `videos`: encoded files for the user turn, before
    its text. `messages`: the conversation so far (earlier turns, any media in them); the prompt
    and media become its last user turn.
    `sampling`: per-stage fields set last (e.g. {"talker": {"do_sample": False}}). `speed`: the
    speech's playback speed, time-stretched by the gateway (0: 1). `tools`: OpenAI tools the model
    may call (the reply's text holds its calls; the prompt goes as a user message). `raw`: the
    prompt is the model's input as written, with no chat template: text replies only (`want_audio`
    is ignored), and nothing that makes chat turns."""
    if raw and (system or messages or audio or images or videos or tools):
        raise ValueError("raw: a raw prompt goes alone (no system, messages, media or tools)")
    want_audio = want_audio and not raw
    req = gateway_pb2.GenerateRequest(want_audio=want_audio, speaker=speaker, request_id=request_id,
                                      use_audio_in_video=use_audio_in_video, audio_format=audio_format,  # type: ignore[arg-type]
                                      stop=stop or [], speed=speed,
                                      tools=[json.dumps(t) for t in tools])  # fmt: skip
    if system or messages or audio or images or videos or tools:
        if system:
            req.messages.add(role="system", content=system)
        req.messages.extend(messages or [])
        if prompt or audio or images or videos:
            req.messages.append(user_message(prompt, audio=audio, images=images, videos=videos))
    else:
        req.prompt, req.raw_prompt = prompt, raw
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        req.mode = MODES[mode]  # type: ignore[assignment]
    thinker: dict[str, Any] = {"max_tokens": thinker_max_tokens, "stop_ids": thinker_stop_ids, "seed": seed}
    talker: dict[str, Any] = {"max_tokens": talker_max_tokens}
    if temperature is not None:  # do_sample unset: the stage samples at it, or is greedy at 0 (as over HTTP)
        thinker["temperature"] = temperature
    elif greedy:
        thinker["do_sample"] = False
    if greedy:
        talker.update(do_sample=False, repetition_penalty=1.0)
    thinker.update((sampling or {}).get("thinker", {}))
    talker.update((sampling or {}).get("talker", {}))
    req.sampling["thinker"].CopyFrom(sampling_proto(thinker))
    req.sampling["talker"].CopyFrom(sampling_proto(talker))
    for stage, fields in (sampling or {}).items():  # other stages: e.g. {"code2wav": {"seed": 7}}
        if stage not in ("thinker", "talker"):
            req.sampling[stage].CopyFrom(sampling_proto(fields))
    return req


async def stream_generate(
    target: str,
    prompt: str,
    *,
    timeout: float | None = None,
    channel: grpc.aio.Channel | None = None,
    api_key: str = "",
    tls_ca: bytes | None = None,
    tls_server_name: str | None = None,
    tls: bool = False,
    **request_options: Any,
) -> AsyncIterator[ClientEvent]:
    """Yield ClientEvents as the gateway streams them. `request_options` go to `build_request`.
    `api_key` goes as `authorization: Bearer ...`; `tls_ca` (PEM roots) dials the gateway over TLS,
    verifying `tls_server_name` in its certificate (default: the target's host; the deploy
    config's `tls.server_name`); `tls` alone: over TLS verified with gRPC's default roots."""
    request = build_request(prompt, **request_options)
    own = channel is None
    ch = channel if channel is not None else gateway_channel(target, tls_ca, tls_server_name, tls=tls)
    metadata_out = [("authorization", f"Bearer {api_key}")] if api_key else None
    t0 = time.perf_counter()
    call = None
    try:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=timeout, metadata=metadata_out)
        metadata = await call.initial_metadata()
        rid = dict(metadata or ()).get(REQUEST_ID_KEY, "")
        yield ClientEvent("start", time.perf_counter() - t0, request_id=str(rid))
        async for resp in call:
            t = time.perf_counter() - t0
            kind = resp.WhichOneof("kind")
            if kind == "text":
                yield ClientEvent("text", t, text=resp.text.text, token_ids=list(resp.text.token_ids))
            elif kind == "audio":
                pcm = np.frombuffer(resp.audio.pcm_f32le, dtype="<f4")
                yield ClientEvent(
                    "audio", t, pcm=pcm, sample_rate=resp.audio.sample_rate, first_sample=resp.audio.first_sample
                )
            elif kind == "final":
                u = resp.final.usage
                yield ClientEvent(
                    "final",
                    t,
                    usage={
                        "prompt_tokens": u.prompt_tokens,
                        "completion_tokens": u.completion_tokens,
                        "audio_frames": u.audio_frames,
                        "audio_seconds": u.audio_seconds,
                    },
                    timings={k: {"first_output_s": v.first_output_s, "total_s": v.total_s}
                             for k, v in resp.final.timings.items()},
                )
    finally:
        # a consumer that stops early cancels the request down the chain (on a shared channel the
        # call lived on, and every stage made the whole reply)
        if call is not None and not call.done():
            call.cancel()
        if own:
            await ch.close()


@dataclass
class Reply:
    request_id: str
    text: str
    token_ids: list[int]
    pcm: np.ndarray
    sample_rate: int
    ttft_s: float | None
    ttfa_s: float | None
    e2e_s: float
    usage: dict[str, float]
    timings: dict[str, dict[str, float]]


async def generate(
    target: str, prompt: str, on_text: Callable[[str], None] | None = None, **options: Any
) -> Reply:
    """Collect one whole reply; `on_text` sees each text delta as it arrives."""
    text, ids, pcm_parts = [], [], []
    ttft = ttfa = None
    sr = 24000
    final = ClientEvent("final", 0.0)
    last = 0.0
    rid = ""
    async for ev in stream_generate(target, prompt, **options):
        last = ev.t
        if ev.kind == "start":
            rid = ev.request_id
        elif ev.kind == "text":
            ttft = ev.t if ttft is None else ttft
            text.append(ev.text)
            if on_text is not None:
                on_text(ev.text)
            ids.extend(ev.token_ids)
        elif ev.kind == "audio" and ev.pcm is not None:
            ttfa = ev.t if ttfa is None else ttfa
            pcm_parts.append(ev.pcm)
            sr = ev.sample_rate
        elif ev.kind == "final":
            final = ev
    pcm = np.concatenate(pcm_parts) if pcm_parts else np.zeros(0, dtype=np.float32)
    return Reply(rid, "".join(text), ids, pcm, sr, ttft, ttfa, last, final.usage, final.timings)


def write_wav(path: str, pcm: np.ndarray, sample_rate: int) -> None:
    """16-bit PCM WAV (stdlib `wave`), the format every player reads."""
    import wave

    data = (np.clip(pcm, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(data)
