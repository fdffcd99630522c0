"""Drivers: one way each of running a request, seen from the client.

Every driver turns a ``BenchRequest`` into a list of ``StreamEvent``s stamped with
``time.perf_counter()`` when the client saw them; the harness makes the figures from them.

* ``InProcessDriver``: ``services.pipeline.InProcessPipeline`` (streaming, no gRPC).
* ``FullPayloadInProcessDriver``: the same pipeline with every edge in full-payload mode
  (thinker to the end, then the talker, then one code2wav decode).
* ``MonolithicDriver``: transformers' monolithic ``generate()`` of the checkpoint's family; it
  does not stream, so text and audio are both seen when it returns.
* ``GrpcDriver``: a thin adapter over ``gateway.client.stream_generate``.
* ``HttpDriver``, ``RealtimeDriver``: the HTTP front door's streamed chat completions, and its
  Realtime WebSocket.

The in-process drivers are synchronous and run in one worker thread of their own, so several
outstanding requests queue for it as they would for a one-engine server without batching.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from benchmarks.stats import RequestRecord
from omnistage.models.sampling import SamplingParams

EventKind = Literal["text", "audio", "final"]


@dataclass(frozen=True)
class Access:
    """How the bench reaches a gateway that asks for more than plaintext: its API key, the PEM
    roots that signed its TLS certificate, the name to verify in it (tls.server_name)."""

    api_key: str = ""
    tls_ca: bytes | None = None
    server_name: str | None = None
    tls: bool = False  # TLS without tls_ca: verified with the client libraries' default roots

    @property
    def secure(self) -> bool:
        return self.tls or self.tls_ca is not None


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_index: int
    prompt: str
    thinker_max_tokens: int
    talker_max_tokens: int | None  # None: the stack's default (the Realtime API cannot set it)
    want_audio: bool = True
    mode: str | None = None  # "async_chunk" | "full_payload" (gRPC: per request)
    talker_seed: int | None = None  # set: the talker samples (its own defaults) with this seed; None: greedy
    raw: bool = False  # the prompt as the model's input, written (no chat template): text alone


@dataclass(frozen=True)
class StreamEvent:
    kind: EventKind
    t: float  # time.perf_counter() when the client saw it
    token_ids: tuple[int, ...] = ()
    samples: int = 0
    sample_rate: int = 0  # of the audio event
    info: dict[str, Any] = field(default_factory=dict)


class Driver(ABC):
    """Runs requests; ``streams`` says whether first token/audio are seen before the end."""

    name: str = "driver"
    streams: bool = True

    @abstractmethod
    async def run(self, req: BenchRequest) -> list[StreamEvent]: ...

    async def warmup(self, req: BenchRequest) -> None:
        await self.run(req)

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    async def aclose(self) -> None:
        self.close()


class SyncDriver(Driver):
    """A driver whose requests run one at a time in a worker thread of its own."""

    def __init__(self, threads: int = 1) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"bench-{self.name}", initializer=torch.set_num_threads,
                                        initargs=(threads,))

    @abstractmethod
    def stream(self, req: BenchRequest) -> Iterator[StreamEvent]: ...

    async def run(self, req: BenchRequest) -> list[StreamEvent]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: list(self.stream(req)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _sampling(pipe: Any, req: BenchRequest) -> tuple[SamplingParams, SamplingParams]:
    """Greedy thinker (the checkpoint's generation config, max_tokens set) and greedy talker, or
    the talker's own sampled defaults with the request's seed."""
    thinker = pipe.thinker_defaults().with_overrides(max_tokens=req.thinker_max_tokens)
    if thinker.do_sample:
        thinker = thinker.with_overrides(do_sample=False)
    if req.talker_seed is not None:
        return thinker, pipe.family.talker_defaults().with_overrides(max_tokens=req.talker_max_tokens,
                                                                     seed=req.talker_seed)  # fmt: skip
    return thinker, SamplingParams(max_tokens=req.talker_max_tokens)


class InProcessDriver(SyncDriver):
    name = "inprocess"
    full_payload = False

    def __init__(self, pipe: Any, threads: int = 1) -> None:
        super().__init__(threads)
        self.pipe = pipe

    def stream(self, req: BenchRequest) -> Iterator[StreamEvent]:
        from services.pipeline import AudioEvent, DoneEvent, PipelineRequest, TextEvent

        thinker, talker = _sampling(self.pipe, req)
        ids = self.pipe.prompt_ids(req.prompt)
        preq = PipelineRequest(ids, thinker=thinker, talker=talker, want_audio=req.want_audio,
                               full_payload=self.full_payload)  # fmt: skip
        # The pipeline hands out a round's events after the round's last stage: a token comes out with
        # the talker's and code2wav's steps after it. Each event is timed when its stage made it (ev.t,
        # from the request's start), as a served stack sends it then.
        start = time.perf_counter()
        for ev in self.pipe.run(preq):
            now = time.perf_counter()
            if isinstance(ev, TextEvent):
                yield StreamEvent("text", min(now, start + ev.t), token_ids=(ev.token_id,))
            elif isinstance(ev, AudioEvent):
                yield StreamEvent("audio", min(now, start + ev.t), samples=int(ev.pcm.shape[0]),
                                  sample_rate=self.pipe.checkpoint.sample_rate)  # fmt: skip
            elif isinstance(ev, DoneEvent):
                yield StreamEvent(
                    "final",
                    now,
                    info={
                        "thinker_stopped_on": ev.thinker_stopped_on,
                        "talker_stopped_on": ev.talker_stopped_on,
                        "frames": int(ev.codes.shape[1]),
                        "prompt_tokens": len(ids),
                        "timings": dict(ev.timings),
                    },
                )


class FullPayloadInProcessDriver(InProcessDriver):
    """Every edge full-payload: the talker starts when the thinker has finished, code2wav when
    the talker has; text streams, audio arrives once."""

    name = "inprocess-full"
    full_payload = True


@contextlib.contextmanager
def _no_frames_is_clear() -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:
        if "non-empty TensorList" in str(e):
            raise RuntimeError("generate() cannot return audio for a reply with no codec frames") from e
        raise


class MonolithicDriver(SyncDriver):
    """transformers' monolithic generate() on the same checkpoint (greedy, sequential): the
    checkpoint family's reference (`omnistage/models/<family>/reference.py`)."""

    name = "monolithic"
    streams = False

    def __init__(self, model_dir: Path, prompt_ids: Callable[[str], list[int]], eos_id: int, sample_rate: int,
                 threads: int = 1, device: str = "cpu", dtype: str = "float32") -> None:  # fmt: skip
        super().__init__(threads)
        from omnistage.models import open_checkpoint

        self.sample_rate = sample_rate
        self.prompt_ids = prompt_ids
        self.eos_id = eos_id
        ckpt = open_checkpoint(model_dir)
        # the stack's dtype as its stages resolve it (`auto`: the checkpoint's own)
        self.reference = ckpt.family.reference(model_dir, device, ckpt.resolve_dtype(dtype))

    def stream(self, req: BenchRequest) -> Iterator[StreamEvent]:
        ids = self.prompt_ids(req.prompt)
        with _no_frames_is_clear():
            generated, _, wav = self.reference.generate(ids, req.thinker_max_tokens, req.talker_max_tokens, self.eos_id,
                                                        audio=req.want_audio)  # fmt: skip
        now = time.perf_counter()
        yield StreamEvent("text", now, token_ids=tuple(generated))
        samples = int(wav.shape[0]) if isinstance(wav, torch.Tensor) else 0
        if samples:
            yield StreamEvent("audio", now, samples=samples, sample_rate=self.sample_rate)
        yield StreamEvent("final", now, info={"prompt_tokens": len(ids)})


class GrpcDriver(Driver):
    """A running stack's gateway, through ``gateway.client.stream_generate``, over one channel
    shared by all requests (as a real client keeps its connection). ``openai_greedy``: the
    sampling an HTTP request with temperature 0 gets (greedy text and speech, the talker's other
    defaults kept), so the two front doors do the same work (each with the request's limits)."""

    name = "grpc"

    def __init__(self, target: str, timeout: float | None = None, openai_greedy: bool = False,
                 access: Access | None = None) -> None:  # fmt: skip
        self.target = target
        self.timeout = timeout
        self.openai_greedy = openai_greedy
        self.access = access or Access()
        self._channel: Any = None

    async def run(self, req: BenchRequest) -> list[StreamEvent]:
        from gateway.client import stream_generate
        from omnistage.server.tls import gateway_channel

        if self._channel is None:
            access = self.access
            self._channel = gateway_channel(self.target, access.tls_ca, access.server_name, tls=access.tls)
        events: list[StreamEvent] = []
        options: dict[str, Any] = {"greedy": True}
        if self.openai_greedy:
            options = {"greedy": False, "sampling": {"thinker": {"do_sample": False}, "talker": {"do_sample": False}}}
        elif req.talker_seed is not None:  # the talker's own sampled defaults, seeded
            talker = {"seed": req.talker_seed}
            options = {"greedy": False, "sampling": {"thinker": {"do_sample": False}, "talker": talker}}
        async for ev in stream_generate(
            self.target,
            req.prompt,
            want_audio=req.want_audio,
            thinker_max_tokens=req.thinker_max_tokens,
            talker_max_tokens=req.talker_max_tokens,
            mode=req.mode,
            raw=req.raw,
            timeout=self.timeout,
            channel=self._channel,
            api_key=self.access.api_key,
            **options,
        ):
            now = time.perf_counter()
            if ev.kind == "text":
                events.append(StreamEvent("text", now, token_ids=tuple(int(i) for i in ev.token_ids)))
            elif ev.kind == "audio":
                n = int(ev.pcm.shape[0]) if ev.pcm is not None else 0
                events.append(StreamEvent("audio", now, samples=n, sample_rate=int(ev.sample_rate)))
            elif ev.kind == "final":
                events.append(StreamEvent("final", now, info={"usage": dict(ev.usage), "timings": dict(ev.timings)}))
        return events

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


class HttpDriver(Driver):
    """A running stack's OpenAI-compatible HTTP front door: streamed chat completions (SSE) with
    text and pcm16 audio, temperature 0, over one kept-alive connection pool."""

    name = "http"
    path = "chat/completions"  # the endpoint under /v1

    def __init__(self, address: str, timeout: float | None = None, access: Access | None = None) -> None:
        self.access = access or Access()
        scheme = "https" if self.access.secure else "http"
        self.base = f"{scheme}://{address}/v1"
        self.url = f"{self.base}/{self.path}"
        self.timeout = timeout
        self._client: Any = None

    def _http(self) -> Any:
        if self._client is None:
            import ssl

            import httpx

            verify: Any = True
            if self.access.tls_ca is not None:
                verify = ssl.create_default_context(cadata=self.access.tls_ca.decode())
            headers = {"authorization": f"Bearer {self.access.api_key}"} if self.access.api_key else None
            self._client = httpx.AsyncClient(timeout=self.timeout, verify=verify, headers=headers)
        return self._client

    @property
    def _named(self) -> dict[str, Any] | None:
        # (tls.server_name: the name the certificate is verified for, in place of the URL's host)
        return {"sni_hostname": self.access.server_name} if self.access.server_name else None

    async def check(self, timeout: float) -> None:
        """One GET /v1/models: raises unless an omnistage HTTP front door answers it (with the key)."""
        response = await self._http().get(f"{self.base}/models", timeout=timeout,
                                          extensions=self._named)  # fmt: skip
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]!r}")
        if not isinstance(response.json().get("data"), list):
            raise RuntimeError(f"no model list in {response.text[:200]!r}")

    @staticmethod
    def body(req: BenchRequest) -> dict[str, Any]:
        """The chat request: greedy, streamed, with the request's thinker and talker limits."""
        body: dict[str, Any] = {"messages": [{"role": "user", "content": req.prompt}], "stream": True,
                                "temperature": 0, "max_tokens": req.thinker_max_tokens,
                                "stream_options": {"include_usage": True},
                                "modalities": ["text", "audio"] if req.want_audio else ["text"],
                                "audio": {"format": "pcm16"}}  # fmt: skip
        if req.want_audio and req.talker_max_tokens is not None:
            # the talker's limit, as vLLM-Omni's clients send a stage's own (the gRPC driver's)
            body["sampling_params_list"] = [{}, {"max_tokens": req.talker_max_tokens}]
        return body

    async def _events(self, req: BenchRequest) -> AsyncIterator[tuple[str, float]]:
        """The streamed reply's SSE data, each with when it came."""
        async with self._http().stream("POST", self.url, json=self.body(req), extensions=self._named) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    yield line[5:].strip(), time.perf_counter()

    async def run(self, req: BenchRequest) -> list[StreamEvent]:
        import json

        events: list[StreamEvent] = []
        info: dict[str, Any] = {}
        async with contextlib.aclosing(self._events(req)) as stream:  # (a break closes the response)
            async for data, now in stream:
                if data == "[DONE]":
                    events.append(StreamEvent("final", now, info=info))
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                events.extend(self._read(event, now, info))
        return events

    @staticmethod
    def _read(event: dict[str, Any], now: float, info: dict[str, Any]) -> list[StreamEvent]:
        """A chat chunk's text and audio events; its usage's text tokens go to `info`."""
        import base64

        if event.get("usage"):  # the text's tokens: a text event is a delta, of any number of them
            details = event["usage"].get("completion_tokens_details") or {}
            if isinstance(details.get("text_tokens"), int):
                info["text_tokens"] = details["text_tokens"]
        if not event.get("choices"):
            return []
        out = []
        delta = event["choices"][0]["delta"]
        if delta.get("content"):
            out.append(StreamEvent("text", now, token_ids=(0,)))  # ids are not in the API
        audio = (delta.get("audio") or {}).get("data")
        if audio:
            out.append(StreamEvent("audio", now, samples=len(base64.b64decode(audio)) // 2, sample_rate=24000))
        return out

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class ResponsesDriver(HttpDriver):
    """A running stack's Responses API (`/v1/responses`): each request a streamed response,
    greedy, text alone (the API has no speech out), not stored, over the HTTP driver's pool."""

    name = "responses"
    path = "responses"

    @staticmethod
    def body(req: BenchRequest) -> dict[str, Any]:
        return {"input": req.prompt, "stream": True, "temperature": 0, "max_output_tokens": req.thinker_max_tokens,
                "store": False}  # fmt: skip

    async def run(self, req: BenchRequest) -> list[StreamEvent]:
        import json

        if req.want_audio:
            raise ValueError("the Responses API has no speech out: its requests are text alone")
        events: list[StreamEvent] = []
        async with contextlib.aclosing(self._events(req)) as stream:  # (a break closes the response)
            async for data, now in stream:
                event = json.loads(data)
                kind = event["type"]
                if kind == "response.output_text.delta" and event["delta"]:
                    events.append(StreamEvent("text", now, token_ids=(0,)))  # ids are not in the API
                elif kind in ("response.completed", "response.incomplete"):
                    usage = event["response"].get("usage") or {}
                    tokens = usage.get("output_tokens")
                    events.append(StreamEvent("final", now, info={"text_tokens": tokens} if isinstance(tokens, int)
                                              else {}))  # fmt: skip
                    break
                elif kind in ("response.failed", "error"):
                    error = event.get("response", {}).get("error") or event.get("error") or {}
                    raise RuntimeError(error.get("message", str(event)[:300]))
        return events


class CompletionsDriver(HttpDriver):
    """A running stack's Completions API (`/v1/completions`): each request's prompt raw (no chat
    template, as the gRPC driver sends it with `raw`), streamed, greedy, text alone."""

    name = "completions"
    path = "completions"

    @staticmethod
    def body(req: BenchRequest) -> dict[str, Any]:
        return {"prompt": req.prompt, "stream": True, "temperature": 0, "max_tokens": req.thinker_max_tokens,
                "stream_options": {"include_usage": True}}  # fmt: skip

    async def run(self, req: BenchRequest) -> list[StreamEvent]:
        if req.want_audio or not req.raw:
            raise ValueError("a completion's prompt is raw and its reply text alone")
        return await super().run(req)

    @staticmethod
    def _read(event: dict[str, Any], now: float, info: dict[str, Any]) -> list[StreamEvent]:
        if isinstance((event.get("usage") or {}).get("completion_tokens"), int):
            info["text_tokens"] = event["usage"]["completion_tokens"]
        if event.get("choices") and event["choices"][0]["text"]:
            return [StreamEvent("text", now, token_ids=(0,))]  # ids are not in the API
        return []


class RealtimeDriver(HttpDriver):
    """A running stack's Realtime WebSocket (`/v1/realtime`): each request is a typed turn and a
    response (temperature 0, `max_output_tokens` the thinker's limit, the talker's the stack's
    default: the API has no field for it) on an open session taken from a pool, as a voice client
    keeps its socket open; the turn and the reply are deleted after, so every request is a
    conversation's first. A session is opened when none is idle (the first request of each
    concurrent client: its handshake counts in that request's times)."""

    name = "realtime"

    def __init__(self, address: str, timeout: float | None = None, access: Access | None = None) -> None:
        super().__init__(address, timeout, access)
        self.ws_url = f"{self.base}/realtime".replace("http", "ws", 1)
        self._idle: list[Any] = []

    async def _session(self) -> Any:
        if self._idle:
            return self._idle.pop()
        import ssl

        from websockets.asyncio.client import connect

        options: dict[str, Any] = {"max_size": None, "open_timeout": self.timeout}
        if self.access.secure:
            options["ssl"] = (ssl.create_default_context(cadata=self.access.tls_ca.decode())
                              if self.access.tls_ca is not None else ssl.create_default_context())  # fmt: skip
            if self.access.server_name:
                options["server_hostname"] = self.access.server_name
        if self.access.api_key:
            options["additional_headers"] = {"authorization": f"Bearer {self.access.api_key}"}
        ws = await connect(self.ws_url, **options)
        try:
            await self._expect(ws, "session.created")
        except BaseException:
            await ws.close()
            raise
        return ws

    @staticmethod
    async def _expect(ws: Any, kind: str) -> dict[str, Any]:
        import json

        event = json.loads(await ws.recv())
        if event["type"] != kind:
            raise RuntimeError(f"expected {kind}, got {str(event)[:300]}")
        return event  # type: ignore[no-any-return]

    async def run(self, req: BenchRequest) -> list[StreamEvent]:
        ws = None
        try:
            async with asyncio.timeout(self.timeout):  # (the other drivers' deadline)
                ws = await self._session()
                events = await self._turn(ws, req)
        except BaseException:
            if ws is not None:
                await ws.close()  # (never back to the pool: events of this request may be left on it)
            raise
        self._idle.append(ws)
        return events

    async def _turn(self, ws: Any, req: BenchRequest) -> list[StreamEvent]:
        import base64
        import json

        session = {"temperature": 0, "max_output_tokens": req.thinker_max_tokens,
                   "output_modalities": ["audio" if req.want_audio else "text"]}  # fmt: skip
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.prompt}]}
        for event in ({"type": "session.update", "session": session},
                      {"type": "conversation.item.create", "item": item},
                      {"type": "response.create"}):  # (sent at once: the server takes them in order)
            await ws.send(json.dumps(event))
        events: list[StreamEvent] = []
        ids: list[str] = []
        while True:
            event = json.loads(await ws.recv())
            now = time.perf_counter()
            kind = event["type"]
            if kind == "error":
                raise RuntimeError(event["error"]["message"])
            if kind == "conversation.item.added":
                ids.append(event["item"]["id"])
            elif kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
                events.append(StreamEvent("text", now, token_ids=(0,)))  # ids are not in the API
            elif kind == "response.output_audio.delta":
                n = len(base64.b64decode(event["delta"])) // 2
                events.append(StreamEvent("audio", now, samples=n, sample_rate=24000))
            elif kind == "response.done":
                response = event["response"]
                if response["status"] not in ("completed", "incomplete"):
                    raise RuntimeError(f"response {response['status']}: {response.get('status_details')}")
                details = (response.get("usage") or {}).get("output_token_details") or {}
                info = {"text_tokens": details["text_tokens"]} if isinstance(details.get("text_tokens"), int) else {}
                events.append(StreamEvent("final", now, info=info))
                break
        for item_id in ids:  # (after the reply: not in its times)
            await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": item_id}))
        for _ in ids:
            await self._expect(ws, "conversation.item.deleted")
        return events

    async def aclose(self) -> None:
        for ws in self._idle:
            await ws.close()
        self._idle.clear()
        await super().aclose()


def build_record(
    config: str, req: BenchRequest, issued_at: float, t_submit: float, events: list[StreamEvent] | None,
    error: BaseException | None = None,
) -> RequestRecord:
    """Figures of one request from what the client saw. Times are relative to ``t_submit``."""
    rec = RequestRecord(
        config=config,
        index=req.index,
        prompt_index=req.prompt_index,
        prompt_chars=len(req.prompt),
        issued_at=issued_at,
    )
    if error is not None or events is None:
        rec.ok = False
        rec.error = f"{type(error).__name__}: {error}" if error is not None else "no events"
        return rec
    final = [e for e in events if e.kind == "final"]
    for e in events:
        rel = e.t - t_submit
        if e.kind == "text" and e.token_ids:
            rec.text_times.append(rel)
            rec.token_ids.extend(e.token_ids)
        elif e.kind == "audio" and e.samples:
            rec.audio_times.append(rel)
            rec.audio_chunk_samples.append(e.samples)
            rec.sample_rate = e.sample_rate
    rec.text_tokens = len(rec.token_ids)
    rec.audio_samples = sum(rec.audio_chunk_samples)
    rec.ttft = rec.text_times[0] if rec.text_times else None
    rec.ttfa = rec.audio_times[0] if rec.audio_times else None
    if final:
        rec.e2e = final[-1].t - t_submit
        rec.info = dict(final[-1].info)
        usage = rec.info.get("usage") or {}
        if isinstance(rec.info.get("text_tokens"), int):  # counted by the server (HTTP: its events are deltas)
            rec.text_tokens = rec.info["text_tokens"]
        elif not rec.text_tokens and isinstance(usage.get("completion_tokens"), int):
            rec.text_tokens = int(usage["completion_tokens"])
    else:
        rec.ok = False
        rec.error = "stream ended without a final event"
        rec.e2e = (events[-1].t - t_submit) if events else None
    return rec
