"""A real multi-process stack on loopback (random free ports), started once per module."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import pytest

from benchmarks.harness import free_port_blocks
from omnistage.cli.serve import Stack, start_stack
from omnistage.config import DeployConfig, parse_config
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from omnistage.wire.tensor_blob import ChunkAssembler, encode_chunk


def free_port_block(n: int, metrics_offset: int = 1000) -> int:
    """A base port with n consecutive free ports on 127.0.0.1, free at `metrics_offset` above
    each too (every process serves metrics there): the bench's picker."""
    return free_port_blocks([n], metrics_offset=metrics_offset)[0]


async def serve_stage(servicer: Any, name: str) -> tuple[grpc.aio.Server, int]:
    """`servicer` (a stand-in stage: Info and Stream) served on a free loopback port, SERVING in
    gRPC health as a stage is; the server and its port (stop it with `server.stop(None)`)."""
    from omnistage.server.grpc_common import STAGE_SERVICE, HealthState, add_stage_servicer, bind, new_server

    server = new_server(1 << 20)
    add_stage_servicer(servicer, server)
    health = HealthState(server, (STAGE_SERVICE,))
    port = bind(server, "127.0.0.1", free_port_block(1), name)
    await server.start()
    await health.set(True)
    return server, port


def metric(address: str, sample: str, **labels: str) -> float:
    """The sum of the samples named `sample` (with these labels, among others) that the process
    at `address` serves on its metrics port (its port + 1000)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    host, port = address.rsplit(":", 1)
    text = httpx.get(f"http://{host}:{int(port) + 1000}/metrics", timeout=10).text
    return sum(x.value for f in text_string_to_metric_families(text) for x in f.samples
               if x.name == sample and all(x.labels.get(k) == v for k, v in labels.items()))  # fmt: skip


def stack_config(**overrides: Any) -> DeployConfig:
    base = free_port_block(12)
    data: dict[str, Any] = {
        "gateway": {"port": base, "http_port": base + 10},  # never the default 8000: stacks run side by side
        "thinker": {"base_port": base + 2},
        "talker": {"base_port": base + 4, "replicas": 2},
        "code2wav": {"base_port": base + 8},
        "timeouts": {"input_wait_timeout_s": 5, "startup_timeout_s": 240, "drain_grace_s": 5},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return parse_config(data, "test")


@pytest.fixture(scope="module")
def stack(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("stack-logs")
    with start_stack(stack_config(), model=str(tiny_dir), log_dir=logs) as s:
        yield s


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def info(address: str) -> stage_pb2.InfoResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=5)


async def cancel_at_first_audio(gateway: str, never_stop_id: int) -> None:
    """A long spoken reply (its thinker stop id one it never makes), cancelled by the client as
    its first audio arrives."""
    from gateway.client import build_request
    from omnistage.v1 import gateway_pb2_grpc

    req = build_request("hi", thinker_max_tokens=300, talker_max_tokens=200, thinker_stop_ids=[never_stop_id])
    async with grpc.aio.insecure_channel(gateway) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60)
        async for resp in call:
            if resp.WhichOneof("kind") == "audio":
                call.cancel()
                break


def stage_is_idle(address: str) -> bool:
    """The stage at `address` holds nothing: no request running, waiting or waiting for input, no
    open stream, no shared-memory segment, no KV reserved, no pooled KV buffer."""
    load = run(info(address)).load
    return (load.running, load.waiting, load.waiting_for_input, load.open_streams, load.shm_segments,
            load.cache_usage, load.kv_pool_tokens) == (0,) * 7  # fmt: skip


def assert_all_idle(stages: list[str], seconds: float) -> None:
    """Every stage at `stages` holds nothing within `seconds` (calls end just after the client's reply)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(stage_is_idle(a) for a in stages):
        time.sleep(0.1)
    assert all(stage_is_idle(a) for a in stages), {a: str(run(info(a)).load) for a in stages}


async def stage_call(
    address: str,
    start: stage_pb2.Start,
    chunks: list[Any],
    timeout: float = 60,
    hold_open: float = 0.0,
) -> dict[str, list[Any]]:
    """Drive one Stage.Stream call directly; returns decoded chunks grouped by producing stage.
    `chunks` are Chunk messages (or StageRequests); `hold_open` keeps the request side open."""

    async def messages() -> Any:
        yield stage_pb2.StageRequest(start=start)
        for c in chunks:
            yield c if isinstance(c, stage_pb2.StageRequest) else stage_pb2.StageRequest(chunk=c)
        if hold_open:
            await asyncio.sleep(hold_open)

    out: dict[str, list[Any]] = {}
    asm: dict[str, ChunkAssembler] = {}
    async with grpc.aio.insecure_channel(address) as ch:
        call = stage_pb2_grpc.StageStub(ch).Stream(messages(), timeout=timeout)
        async for resp in call:
            if resp.HasField("failure"):  # (why the call fails: its status follows)
                continue
            d = asm.setdefault(resp.stage, ChunkAssembler()).push(resp.chunk)
            if d is not None:
                out.setdefault(resp.stage, []).append(d)
    return out


def prompt_chunk(ids: list[int]) -> Any:
    import torch

    return encode_chunk({"ids": torch.tensor(ids)}, offset=0, finished=True, meta={"n": len(ids)})


def call_outputs(out: dict[str, list[Any]]) -> tuple[list[int], Any, Any]:
    """What a direct thinker call (`stage_call`) brought back up: the text ids, the talker's codes
    `[groups, frames]` and code2wav's audio, each in order."""
    import torch

    tokens = [int(i) for c in out["thinker"] for i in c.tensors["ids"].tolist()]
    codes = torch.cat([c.tensors["codes"] for c in out["talker"] if "codes" in c.tensors], dim=1)
    audio = torch.cat([c.tensors["audio"] for c in out["code2wav"] if "audio" in c.tensors])
    return tokens, codes, audio


class Solo(NamedTuple):
    token_ids: list[int]
    pcm: Any  # float32 numpy samples (empty when it did not speak)
    frames: int


def solo_reply(pipeline: Any, prompt: str, thinker_max: int, talker_max: int, **request: Any) -> Solo:
    """One greedy request through the in-process pipeline alone: what a stack's reply to the same
    request must equal. `request`: further PipelineRequest fields (e.g. code2wav_seed)."""
    import numpy as np
    import torch

    from omnistage.models.sampling import SamplingParams
    from services.pipeline import AudioEvent, PipelineRequest

    thinker = pipeline.thinker_defaults().with_overrides(max_tokens=thinker_max)
    talker = SamplingParams(max_tokens=talker_max)
    events = list(pipeline.run(PipelineRequest(pipeline.prompt_ids(prompt), thinker, talker, **request)))
    audio = [e.pcm for e in events if isinstance(e, AudioEvent)]
    codes = events[-1].codes
    return Solo(events[-1].token_ids, torch.cat(audio).numpy() if audio else np.zeros(0, np.float32),
                0 if codes is None else int(codes.shape[1]))  # fmt: skip


def assert_stop_text_ends_speech(gateway: str, tokenizer: Any, prompt: str, thinker_max: int, talker_max: int,
                                 first: bool = False) -> str:  # fmt: skip
    """A stop text completed by a token of the greedy reply (its first with `first`, else one a
    third in) ends the text before it, and the speech is that of the reply cut there by
    max_tokens: the same samples, the same frames (none for a reply of one token, as generate()
    gives none: a split thinker's first token is its prefill role's, handed off as the last)."""
    import numpy as np

    from gateway.client import generate

    def reply(**options: Any) -> Any:
        return run(generate(gateway, prompt, talker_max_tokens=talker_max, timeout=60, **options))

    whole = reply(thinker_max_tokens=thinker_max)
    text, ids = whole.text, whole.token_ids
    stop = tokenizer.decode(ids[:1], skip_special_tokens=True) if first else text[len(text) // 3 : len(text) // 3 + 3]
    assert stop.strip(), (stop, text)
    # the token that completes the stop text: the first k whose decoded text holds it
    k = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))
    assert k < len(ids) and (k == 1) == first, (k, len(ids))
    cut = reply(thinker_max_tokens=thinker_max, stop=[stop])
    assert cut.text == text[: text.index(stop)] and cut.token_ids == ids[:k]
    at_k = reply(thinker_max_tokens=k)
    assert at_k.token_ids == cut.token_ids and (at_k.pcm.size > 0) != first  # (a one-token reply has no speech)
    assert cut.pcm.shape == at_k.pcm.shape and np.array_equal(cut.pcm, at_k.pcm)
    assert cut.usage["audio_frames"] == at_k.usage["audio_frames"]
    return stop


def assert_a_call_ends_speech(gateway: str, tokenizer: Any, prompt: str, talker_max: int) -> None:
    """With tools and audio, a reply (given: forced_ids) that says a few words, then calls a tool:
    its text is all of it, the call too, and its speech is that of the reply ended at the call's
    first token (a stop id there), sample for sample; a reply that only calls says nothing, as a
    reply of one token. Across the real processes: the thinker's stream to the talker ends before
    the thinker does."""
    import numpy as np

    from gateway.client import generate
    from tests.test_tool_calls import CALL, WEATHER

    eos, start = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<tool_call>")
    call = tokenizer.encode(CALL, add_special_tokens=False)
    for lead in ("Let me check the weather.", ""):
        given = tokenizer.encode(lead, add_special_tokens=False) + call

        def reply(stop_ids: list[int], given: list[int] = given) -> Any:
            sampling = {"thinker": {"forced_ids": given, "stop_ids": stop_ids, "max_tokens": len(given) + 1}}
            return run(generate(gateway, prompt, tools=[WEATHER], talker_max_tokens=talker_max, timeout=60,
                                sampling=sampling))  # fmt: skip

        gated, ended = reply([eos]), reply([start, eos])
        assert gated.text == lead + CALL and gated.token_ids == [*given, eos]
        assert ended.text == lead and ended.token_ids == given[: len(given) - len(call) + 1]
        assert gated.pcm.shape == ended.pcm.shape and np.array_equal(gated.pcm, ended.pcm)
        assert (gated.pcm.size > 0) == bool(lead) and gated.usage["audio_frames"] == ended.usage["audio_frames"]
