"""Gateway: client requests in (`Gateway.Generate`), one thinker call per request, text and
audio streamed back as soon as the stages produce them.

The gateway holds only the tokenizer: it renders the chat prompt, detokenizes the thinker's
token ids incrementally, and turns code2wav's float32 chunks into AudioChunk messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from omnistage.config import DeployConfig
from omnistage.engine import OutChunk
from omnistage.models import Checkpoint, load_tokenizer
from omnistage.server.grpc_common import HealthState, channel_options, drain, new_server, stage_stream, wait_for_signal
from omnistage.topology import STAGES
from omnistage.v1 import gateway_pb2, gateway_pb2_grpc, stage_pb2
from omnistage.wire import ChunkAssembler, TensorBlobError, encode_chunk
from services import edges

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
        self.sample_rate = ckpt.sample_rate
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
        ids = self.ckpt.family.prompt_ids(self.tokenizer, messages)
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
            if name not in STAGES:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"gateway: sampling: unknown stage {name!r}")
            start.sampling[name].CopyFrom(params)
        remaining = context.time_remaining()
        timeout = remaining if remaining is not None else self.cfg.timeouts.request_timeout_s
        if timeout is not None and timeout > 1e6:
            timeout = self.cfg.timeouts.request_timeout_s
        start.deadline_unix_s = time.time() + timeout

        async def messages() -> AsyncIterator[stage_pb2.StageRequest]:
            yield stage_pb2.StageRequest(start=start)
            yield stage_pb2.StageRequest(chunk=_encode(edges.prompt_chunk(prompt_ids)))

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
                if edges.IDS in chunk.tensors:
                    ids = [int(i) for i in chunk.tensors[edges.IDS].tolist()]
                    completion += len(ids)
                    yield gateway_pb2.GenerateResponse(text=gateway_pb2.TextDelta(text=detok.push(ids), token_ids=ids))
                elif edges.CODES in chunk.tensors:
                    frames += int(chunk.tensors[edges.CODES].shape[1])
                elif edges.AUDIO in chunk.tensors:
                    pcm = chunk.tensors[edges.AUDIO].float().contiguous()
                    samples += int(pcm.shape[0])
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
            audio_seconds=samples / self.sample_rate,
        )
        final = gateway_pb2.Final(usage=usage)
        for name, timing in timings.items():
            final.timings[name].CopyFrom(timing)
        final.timings["gateway"].CopyFrom(gateway_pb2.StageTiming(total_s=time.perf_counter() - t0))
        yield gateway_pb2.GenerateResponse(final=final)


def _encode(chunk: OutChunk) -> stage_pb2.Chunk:
    return encode_chunk(chunk.tensors, offset=chunk.offset, length=chunk.length, finished=chunk.finished)


def run_gateway(cfg: DeployConfig, ckpt: Checkpoint, host: str, port: int, thinker_target: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s gateway:{port} %(levelname)s %(message)s")

    async def main() -> None:
        service = GatewayService(cfg, ckpt, thinker_target)
        server = new_server(cfg.max_message_bytes)
        gateway_pb2_grpc.add_GatewayServicer_to_server(service, server)
        health_state = HealthState(server, (gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,))
        if server.add_insecure_port(f"{host}:{port}") == 0:
            raise OSError(f"gateway: cannot listen on {host}:{port}")
        await server.start()
        await health_state.set(True)
        log.info("gateway serving on %s:%d -> thinker %s", host, port, thinker_target)
        await wait_for_signal()
        service.draining = True
        await drain(health_state, lambda: service.active > 0, cfg.timeouts.drain_grace_s, server)

    asyncio.run(main())
