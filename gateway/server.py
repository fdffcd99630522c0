"""Gateway: client requests in (`Gateway.Generate`), one thinker call per request, text and
audio streamed back as soon as the stages produce them.

The gateway holds only the tokenizer: it renders the chat prompt, detokenizes the thinker's
token ids incrementally, and turns code2wav's float32 chunks into AudioChunk messages.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from omnistage.families.qwen3_omni import SAMPLE_RATE, build_prompt_ids
from omnistage.loader import Checkpoint, load_tokenizer
from omnistage.v1 import gateway_pb2, gateway_pb2_grpc, stage_pb2
from services.runtime.config import DeployConfig
from services.runtime.server import channel_options
from services.runtime.tensor_blob import ChunkAssembler, TensorBlobError, encode_chunk
from services.runtime.wire_view import stage_stream

log = logging.getLogger(__name__)


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


class GatewayService(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, cfg: DeployConfig, ckpt: Checkpoint, thinker_target: str) -> None:
        self.cfg = cfg
        self.ckpt = ckpt
        self.tokenizer = load_tokenizer(ckpt)
        self.thinker_target = thinker_target
        self.channel = grpc.aio.insecure_channel(thinker_target, options=channel_options(cfg.max_message_bytes))
        self.stream = stage_stream(self.channel)  # Stage.Stream; responses parsed without copying tensors
        self.active = 0
        self.draining = False

    def _prompt_ids(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        if request.messages:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            bad = [m["role"] for m in messages if m["role"] not in ("system", "user", "assistant")]
            if bad:
                raise ValueError(f"messages: unknown role(s) {bad}")
            if not any(m["content"].strip() for m in messages if m["role"] == "user"):
                raise ValueError("messages: no user message with content")
        else:
            if not request.prompt.strip():
                raise ValueError("prompt: empty prompt")
            messages = [{"role": "user", "content": request.prompt}]
        ids = build_prompt_ids(self.tokenizer, messages)
        limit = self.ckpt.spec.max_positions - 1
        if len(ids) > limit:
            raise ValueError(f"prompt: {len(ids)} tokens exceeds the model maximum of {limit}")
        return ids

    async def Info(self, request: stage_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> stage_pb2.InfoResponse:
        return stage_pb2.InfoResponse(
            model=str(self.ckpt.path),
            arch=(self.ckpt.config.architectures or [""])[0],
            role="gateway",
            load=stage_pb2.Load(running=self.active, open_streams=self.active),
        )

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "gateway: draining, not accepting new requests")
        try:
            prompt_ids = self._prompt_ids(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"gateway: {e}")
        if request.speaker and request.want_audio:
            try:
                self.ckpt.spec.speaker_id(request.speaker)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"gateway: speaker: {e}")
        t0 = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex
        start = stage_pb2.Start(
            request_id=rid, want_audio=request.want_audio, mode=request.mode, speaker=request.speaker
        )
        for name, params in request.sampling.items():
            if name not in ("thinker", "talker", "code2wav"):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"gateway: sampling: unknown stage {name!r}")
            start.sampling[name].CopyFrom(params)
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None else self.cfg.timeouts.request_timeout_s
        if timeout is not None and timeout > 1e6:
            timeout = self.cfg.timeouts.request_timeout_s
        start.deadline_unix_s = time.time() + timeout

        async def messages() -> AsyncIterator[stage_pb2.StageRequest]:
            yield stage_pb2.StageRequest(start=start)
            ids = torch.tensor(prompt_ids)
            chunk = encode_chunk({"ids": ids}, offset=0, finished=True, meta={"n": len(prompt_ids)})
            yield stage_pb2.StageRequest(chunk=chunk)

        self.active += 1
        call = self.stream(messages(), timeout=timeout)
        assemblers: dict[str, ChunkAssembler] = {}
        detok = Detokenizer(self.tokenizer)
        timings: dict[str, gateway_pb2.StageTiming] = {}
        completion = 0
        frames = 0
        samples = 0
        try:
            async for received in call:
                resp = received.message
                now = time.perf_counter() - t0
                timing = timings.setdefault(resp.stage, gateway_pb2.StageTiming(first_output_s=now))
                timing.total_s = now
                chunk = assemblers.setdefault(resp.stage, ChunkAssembler()).push(resp.chunk, received.views)
                if chunk is None:
                    continue
                if resp.stage == "thinker" and "ids" in chunk.tensors:
                    ids = [int(i) for i in chunk.tensors["ids"].tolist()]
                    completion += len(ids)
                    yield gateway_pb2.GenerateResponse(text=gateway_pb2.TextDelta(text=detok.push(ids), token_ids=ids))
                elif resp.stage == "talker" and "codes" in chunk.tensors:
                    frames += int(chunk.tensors["codes"].shape[1])
                elif resp.stage == "code2wav" and "audio" in chunk.tensors:
                    pcm = chunk.tensors["audio"].float().contiguous()
                    samples += int(pcm.shape[0])
                    yield gateway_pb2.GenerateResponse(
                        audio=gateway_pb2.AudioChunk(
                            pcm_f32le=pcm.numpy().astype("<f4").tobytes(),
                            sample_rate=SAMPLE_RATE,
                            first_sample=chunk.offset,
                        )
                    )
        except grpc.aio.AioRpcError as e:
            code = e.code()
            detail = e.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE and not detail.startswith(("thinker", "talker", "code2wav")):
                detail = f"thinker unavailable at {self.thinker_target}: {detail}"
            await context.abort(code, detail)
        except TensorBlobError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"gateway: bad chunk from a stage: {e}")
        finally:
            self.active -= 1
            if not call.done():
                call.cancel()
        usage = gateway_pb2.Usage(
            prompt_tokens=len(prompt_ids),
            completion_tokens=completion,
            audio_frames=frames,
            audio_seconds=samples / SAMPLE_RATE,
        )
        final = gateway_pb2.Final(usage=usage)
        for name, timing in timings.items():
            final.timings[name].CopyFrom(timing)
        final.timings["gateway"].CopyFrom(gateway_pb2.StageTiming(total_s=time.perf_counter() - t0))
        yield gateway_pb2.GenerateResponse(final=final)


def run_gateway(cfg: DeployConfig, ckpt: Checkpoint, host: str, port: int, thinker_target: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s gateway:{port} %(levelname)s %(message)s")

    async def main() -> None:
        service = GatewayService(cfg, ckpt, thinker_target)
        server = grpc.aio.server(options=channel_options(cfg.max_message_bytes)[:2])
        gateway_pb2_grpc.add_GatewayServicer_to_server(service, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names = (
            gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
        if server.add_insecure_port(f"{host}:{port}") == 0:
            raise OSError(f"gateway: cannot listen on {host}:{port}")
        await server.start()
        for name in ("", "omnistage.v1.Gateway"):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("gateway serving on %s:%d -> thinker %s", host, port, thinker_target)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        service.draining = True
        for name in ("", "omnistage.v1.Gateway"):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + cfg.timeouts.drain_grace_s
        while service.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await server.stop(grace=1.0)

    asyncio.run(main())
