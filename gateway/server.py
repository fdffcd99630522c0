"""Gateway: client requests in (`Gateway.Generate`), one thinker call per request, text and
audio streamed back as soon as the stages produce them.

The gateway holds the tokenizer and the checkpoint's processor: it decodes the audio, images and
video of a request (gateway/media.py, off the event loop), renders the chat prompt and builds the
model inputs, detokenizes the thinker's token ids incrementally, and turns code2wav's float32
chunks into AudioChunk messages. Each
request's id goes back to the client in the initial metadata (`x-request-id`) and into one
access-log line when it ends. Its health is NOT_SERVING while the thinker does not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.media import decode_messages
from omnistage.config import DeployConfig
from omnistage.engine import OutChunk
from omnistage.models import Checkpoint, CheckpointError, load_tokenizer
from omnistage.server.grpc_common import (
    HealthState,
    bind,
    channel_options,
    drain,
    new_server,
    stage_stream,
    wait_for_signal,
)
from omnistage.server.metrics import serve_metrics
from omnistage.topology import STAGES
from omnistage.v1 import gateway_pb2, gateway_pb2_grpc, stage_pb2
from omnistage.wire import ChunkAssembler, TensorBlobError, encode_chunks
from services import edges

log = logging.getLogger(__name__)
access_log = logging.getLogger("omnistage.access")

REQUEST_ID_KEY = "x-request-id"  # initial metadata of every Generate call
HEALTH_POLL_S = 1.0


class Detokenizer:
    """Incremental detokenization that never emits half a UTF-8 character."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters already emitted

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta = text[self.sent :]
        self.sent = len(text)
        return delta


@dataclass
class _Outcome:
    """What the access log and the metrics say of one request."""

    request_id: str
    t0: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    audio_samples: int = 0
    ttft: float | None = None
    ttfa: float | None = None
    status: str = "ok"
    fields: dict[str, Any] = field(default_factory=dict)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("omnistage_gateway_requests", "Generate requests by outcome", ["outcome"],
                                registry=self.registry)  # fmt: skip
        self.in_flight = Gauge("omnistage_gateway_requests_in_flight", "Generate requests in flight",
                               registry=self.registry)  # fmt: skip


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, cfg: DeployConfig, ckpt: Checkpoint, thinker_target: str) -> None:
        self.cfg = cfg
        self.ckpt = ckpt
        self.tokenizer = load_tokenizer(ckpt)
        self.inputs: Any = None  # the family's input builder (the checkpoint's processor)
        self.no_media_reason = ""
        try:
            self.inputs = ckpt.family.input_builder(ckpt, self.tokenizer)
        except CheckpointError as e:  # text still works; media requests get this reason
            self.no_media_reason = ("this checkpoint's processor cannot be used, so audio, images and video are "
                                    f"not accepted: {e}")
            log.warning("%s", self.no_media_reason)
        self.media_limits = cfg.media
        if self.inputs is not None:  # never more audio than the feature extractor takes whole
            seconds = min(cfg.media.max_audio_seconds, self.inputs.max_audio_seconds)
            self.media_limits = cfg.media.model_copy(update={"max_audio_seconds": seconds})
        self.sample_rate = ckpt.sample_rate
        self.model_name = cfg.served_model_name or ckpt.path.name
        self.thinker_target = thinker_target
        self.channel = grpc.aio.insecure_channel(thinker_target, options=channel_options(cfg.max_message_bytes))
        self.stream = stage_stream(self.channel)  # Stage.Stream; responses parsed without copying tensors
        self.metrics = GatewayMetrics()
        self.active = 0
        self.draining = False
        self.thinker_serving = False

    def _prompt(self, request: gateway_pb2.GenerateRequest) -> edges.Prompt:
        """The request as the thinker's prompt: ids, and the model inputs of its media (run in a
        worker thread: decoding and the processor take a while). ValueError names the field."""
        if request.messages:
            messages, has_media = decode_messages(request, self.media_limits, self._audio_rate())
            # (media come in user messages only; without media every content is text)
            if not has_media and not any(m["content"].strip() for m in messages if m["role"] == "user"):
                raise ValueError("messages: no user message with content")
        else:
            if not request.prompt.strip():
                raise ValueError("prompt: empty prompt")
            messages, has_media = [{"role": "user", "content": request.prompt}], False
        if has_media:
            if self.inputs is None:
                raise ValueError(f"messages: {self.no_media_reason}")
            try:
                ids, tensors = self.inputs.build(messages, request.use_audio_in_video)
            except (ValueError, TypeError) as e:
                raise ValueError(f"messages: cannot build the model inputs: {e}") from None
            prompt = edges.Prompt(ids, tensors, request.use_audio_in_video)
        else:
            prompt = edges.Prompt(self.ckpt.family.prompt_ids(self.tokenizer, messages))
        limit = min(self.ckpt.spec.max_positions, self.cfg.max_model_len or self.ckpt.spec.max_positions) - 1
        if len(prompt.ids) > limit:
            raise ValueError(f"prompt: {len(prompt.ids)} tokens exceeds the model maximum of {limit}")
        return prompt

    def _audio_rate(self) -> int:
        # without a processor media are refused after decoding (any rate will do until then)
        return int(self.inputs.sampling_rate) if self.inputs is not None else 16_000

    async def Info(self, request: stage_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> stage_pb2.InfoResponse:
        return stage_pb2.InfoResponse(
            model=self.model_name,
            arch=(self.ckpt.config.architectures or [""])[0],
            role="gateway",
            load=stage_pb2.Load(running=self.active, open_streams=self.active),
        )

    # ---- thinker health -----------------------------------------------------------------------

    async def watch_thinker(self, health_state: HealthState) -> None:
        """Keep the gateway's health in step with the thinker's: NOT_SERVING while it does not
        answer SERVING (or while the gateway drains)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_POLL_S)
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                serving = False
            if serving != self.thinker_serving:
                log.info("thinker at %s is %s", self.thinker_target, "serving" if serving else "not serving")
            self.thinker_serving = serving
            await health_state.set(serving and not self.draining)
            await asyncio.sleep(HEALTH_POLL_S)

    # ---- Generate -----------------------------------------------------------------------------

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        rid = request.request_id or uuid.uuid4().hex
        outcome = _Outcome(rid, time.perf_counter())
        await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))
        self.active += 1
        self.metrics.in_flight.inc()
        try:
            async for resp in self._generate(request, context, outcome):
                yield resp
        except asyncio.CancelledError:
            outcome.status = "CANCELLED"
            raise
        except Exception:
            if outcome.status == "ok":  # not one of ours (those set their status first)
                outcome.status = "ERROR"
            raise
        finally:
            self.active -= 1
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(outcome.status).inc()
            self._access_log(outcome)

    async def _abort(self, context: grpc.aio.ServicerContext, outcome: _Outcome, code: grpc.StatusCode,
                     message: str) -> None:  # fmt: skip
        outcome.status = code.name
        await context.abort(code, message)

    async def _generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext, outcome: _Outcome
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        if self.draining:
            await self._abort(context, outcome, grpc.StatusCode.UNAVAILABLE,
                              "gateway: draining, not accepting new requests")  # fmt: skip
        try:
            prompt = await asyncio.to_thread(self._prompt, request)
        except ValueError as e:
            await self._abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, f"gateway: {e}")
        prompt_ids = prompt.ids
        outcome.prompt_tokens = len(prompt_ids)
        if request.speaker and request.want_audio:
            try:
                self.ckpt.spec.speaker_id(request.speaker)
            except ValueError as e:
                await self._abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT, f"gateway: speaker: {e}")
        t0 = outcome.t0
        start = stage_pb2.Start(
            request_id=outcome.request_id, want_audio=request.want_audio, mode=request.mode, speaker=request.speaker
        )
        for name, params in request.sampling.items():
            if name not in STAGES:
                await self._abort(context, outcome, grpc.StatusCode.INVALID_ARGUMENT,
                                  f"gateway: sampling: unknown stage {name!r}")  # fmt: skip
            start.sampling[name].CopyFrom(params)
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None else self.cfg.timeouts.request_timeout_s
        if timeout is not None and timeout > 1e6:
            timeout = self.cfg.timeouts.request_timeout_s
        start.deadline_unix_s = time.time() + timeout

        chunk = edges.prompt_chunk(prompt.ids, prompt.multimodal, prompt.use_audio_in_video)
        del prompt  # the media tensors are in `chunk` now

        async def messages() -> AsyncIterator[stage_pb2.StageRequest]:
            yield stage_pb2.StageRequest(start=start)
            for piece in _encode(chunk, self.cfg.max_message_bytes - 1024):  # large prompts span messages
                yield stage_pb2.StageRequest(chunk=piece)

        call = self.stream(messages(), timeout=timeout)
        assemblers: dict[str, ChunkAssembler] = {}
        detok = Detokenizer(self.tokenizer)
        timings: dict[str, gateway_pb2.StageTiming] = {}
        frames = 0
        try:
            async for received in call:
                resp = received.message
                now = time.perf_counter() - t0
                timing = timings.setdefault(resp.stage, gateway_pb2.StageTiming(first_output_s=now))
                timing.total_s = now
                chunk = assemblers.setdefault(resp.stage, ChunkAssembler()).push(resp.chunk, received.views)
                if chunk is None:
                    continue
                if edges.IDS in chunk.tensors:
                    ids = [int(i) for i in chunk.tensors[edges.IDS].tolist()]
                    outcome.completion_tokens += len(ids)
                    outcome.ttft = now if outcome.ttft is None else outcome.ttft
                    yield gateway_pb2.GenerateResponse(text=gateway_pb2.TextDelta(text=detok.push(ids), token_ids=ids))
                elif edges.CODES in chunk.tensors:
                    frames += int(chunk.tensors[edges.CODES].shape[1])
                elif edges.AUDIO in chunk.tensors:
                    pcm = chunk.tensors[edges.AUDIO].float().contiguous()
                    outcome.audio_samples += int(pcm.shape[0])
                    outcome.ttfa = now if outcome.ttfa is None else outcome.ttfa
                    yield gateway_pb2.GenerateResponse(
                        audio=gateway_pb2.AudioChunk(
                            pcm_f32le=pcm.numpy().astype("<f4").tobytes(),
                            sample_rate=self.sample_rate,
                            first_sample=chunk.offset,
                        )
                    )
        except grpc.aio.AioRpcError as e:
            code = e.code()
            detail = e.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE and not detail.startswith(STAGES):
                detail = f"thinker unavailable at {self.thinker_target}: {detail}"
            await self._abort(context, outcome, code, detail)
        except TensorBlobError as e:
            await self._abort(context, outcome, grpc.StatusCode.INTERNAL, f"gateway: bad chunk from a stage: {e}")
        finally:
            if not call.done():
                call.cancel()
        usage = gateway_pb2.Usage(
            prompt_tokens=len(prompt_ids),
            completion_tokens=outcome.completion_tokens,
            audio_frames=frames,
            audio_seconds=outcome.audio_samples / self.sample_rate,
        )
        final = gateway_pb2.Final(usage=usage)
        for name, timing in timings.items():
            final.timings[name].CopyFrom(timing)
        final.timings["gateway"].CopyFrom(gateway_pb2.StageTiming(total_s=time.perf_counter() - t0))
        yield gateway_pb2.GenerateResponse(final=final)

    def _access_log(self, o: _Outcome) -> None:
        def ms(x: float | None) -> int | None:
            return None if x is None else round(1000 * x)

        fields = {
            "request_id": o.request_id,
            "outcome": o.status,
            "ttft_ms": ms(o.ttft),
            "ttfa_ms": ms(o.ttfa),
            "e2e_ms": ms(time.perf_counter() - o.t0),
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens,
            "audio_s": round(o.audio_samples / self.sample_rate, 3),
        }
        text = " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())
        access_log.info("request %s", text, extra={"fields": fields})


def _encode(chunk: OutChunk, max_bytes: int) -> list[stage_pb2.Chunk]:
    pieces = encode_chunks(chunk.tensors, max_bytes=max_bytes, offset=chunk.offset, length=chunk.length,
                           finished=chunk.finished, meta=chunk.meta)  # fmt: skip
    return [p.message() for p in pieces]


def run_gateway(cfg: DeployConfig, ckpt: Checkpoint, host: str, port: int, thinker_target: str) -> None:
    async def main() -> None:
        service = GatewayService(cfg, ckpt, thinker_target)
        # clients send their media in the request: the receive limit is the media request limit
        server = new_server(max(cfg.max_message_bytes, cfg.media.max_request_bytes))
        gateway_pb2_grpc.add_GatewayServicer_to_server(service, server)
        health_state = HealthState(server, (gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,))
        await health_state.set(False)  # until the thinker answers
        bind(server, host, port, "gateway")
        metrics_port = cfg.metrics_port(port)
        if metrics_port is not None:
            serve_metrics(service.metrics.registry, host, metrics_port, f"gateway at {host}:{port}")
        await server.start()
        watcher = asyncio.create_task(service.watch_thinker(health_state))
        log.info("gateway serving on %s:%d -> thinker %s (metrics on %s)", host, port, thinker_target,
                 metrics_port or "off")  # fmt: skip
        await wait_for_signal()
        service.draining = True
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await drain(health_state, lambda: service.active > 0, cfg.timeouts.drain_grace_s, server)

    asyncio.run(main())
