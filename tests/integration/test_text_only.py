"""A text-only checkpoint (Qwen3-Omni's Thinking and Captioner: no talker, no vocoder) served with
`audio_output: false`: the chain is the thinker alone, its greedy text equals transformers'
`generate()` on that checkpoint (and the full checkpoint's, whose thinker weights it has), and a
request for audio is refused by name at every door."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from gateway.client import build_request, generate
from omnistage.cli.serve import Stack, start_stack
from omnistage.config import DeployConfig
from services.pipeline import PipelineRequest
from tests.conftest import family_reference, staged_pipeline
from tests.integration.conftest import prompt_chunk, run, stack_config, stage_call
from tests.integration.test_stack import PROMPT, greedy_start

MAX = 12
STALL_S = 2


@pytest.fixture(scope="module")
def text_stack(thinking_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # (a short output_stall_timeout_s for the stalled-client test; every other test reads at once)
    cfg = stack_config(audio_output=False,
                       timeouts={"output_stall_timeout_s": STALL_S})  # fmt: skip
    with start_stack(cfg, model=str(thinking_dir), log_dir=tmp_path_factory.mktemp("text-only-logs")) as s:
        yield s


def _greedy(pipe: Any) -> Any:
    return pipe.thinker_defaults().with_overrides(do_sample=False, max_tokens=MAX)


def test_the_thinker_alone_matches_generate(thinking_dir: Path, pipeline: Any) -> None:
    text_only = staged_pipeline(thinking_dir, DeployConfig(audio_output=False))
    assert [s.name for s in text_only.chain] == ["thinker"]
    ids = text_only.prompt_ids(PROMPT)
    ref_ids, codes, wav = family_reference(thinking_dir).generate(ids, MAX, 8, text_only.spec.im_end_id, audio=False)
    assert len(ref_ids) > 2 and codes is None and wav is None
    done = list(text_only.run(PipelineRequest(ids, _greedy(text_only), want_audio=False)))[-1]
    assert done.token_ids == ref_ids
    full = list(pipeline.run(PipelineRequest(pipeline.prompt_ids(PROMPT), _greedy(pipeline), want_audio=False)))
    assert full[-1].token_ids == ref_ids  # the same thinker weights
    with pytest.raises(ValueError, match="want_audio: this pipeline serves text only"):
        text_only.run(PipelineRequest(ids, _greedy(text_only)))


def test_the_stack_is_the_thinker_alone_and_refuses_audio(text_stack: Stack, pipeline: Any) -> None:
    assert sorted(c.name for c in text_stack.children) == ["gateway", "thinker"]
    expected = list(pipeline.run(PipelineRequest(pipeline.prompt_ids(PROMPT), _greedy(pipeline), want_audio=False)))
    reply = run(generate(text_stack.gateway_address, PROMPT, want_audio=False, thinker_max_tokens=MAX, timeout=60))
    assert reply.token_ids == expected[-1].token_ids and reply.pcm.size == 0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run(generate(text_stack.gateway_address, PROMPT, want_audio=True, thinker_max_tokens=MAX, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "serves text only" in (e.value.details() or "")
    # a client bypassing the gateway: the thinker, with no stage below it, refuses too
    thinker, ids = text_stack.addresses("thinker")[0], pipeline.prompt_ids(PROMPT)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run(stage_call(thinker, greedy_start("text-1", want_audio=True), [prompt_chunk(ids)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "serves text only" in (e.value.details() or "")

    base = f"http://{text_stack.http_address}"
    deadline = time.monotonic() + 15  # the chain's health is learnt by polling
    while (health := httpx.get(base + "/health")).status_code != 200:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)
    assert [s["stage"] for s in health.json()["stages"]] == ["thinker"]
    card = httpx.get(base + "/v1/models").json()["data"][0]
    assert card["voices"] == [] and card["audio_output"] is False  # what the playground reads
    hi = [{"role": "user", "content": PROMPT}]
    chat = base + "/v1/chat/completions"
    for audio in ({}, {"audio": {"voice": "ethan"}}):  # the full checkpoint's voice: still modalities
        r = httpx.post(chat, json={"messages": hi, "modalities": ["text", "audio"], **audio}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "modalities", r.text
    r = httpx.post(chat, json={"messages": hi, "temperature": 0, "max_tokens": MAX}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == reply.text
    r = httpx.post(base + "/v1/audio/speech", json={"input": "Hello there"}, timeout=60)
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"], r.text
    # the bench measures speech: a text-only --target is refused before any request (each failed, exit 1)
    from typer.testing import CliRunner

    from benchmarks.cli import bench_app

    bench = CliRunner().invoke(bench_app, ["--target", text_stack.gateway_address, "--concurrency", "1",
                                           "--num-requests", "1", "--no-progress", "--warmup", "0"])  # fmt: skip
    assert bench.exit_code == 1 and "the stack serves text only (no talker in its chain: thinker)" in bench.output, (
        bench.output[-2000:])
    assert "monolithic" not in bench.output  # (no baseline ran)


def test_health_and_stage_commands_follow_the_text_only_chain(text_stack: Stack, tmp_path: Path) -> None:
    """`omnistage health --text-only` checks the gateway and the thinker alone (a stack served with
    `serve --text-only` from a config that speaks); a stage the chain has not is refused."""
    from typer.testing import CliRunner

    from omnistage.cli.main import app
    from omnistage.config import ConfigError, dump_config
    from omnistage.server.process import run_stage

    speaking = tmp_path / "speaking.yaml"
    speaking.write_text(dump_config(text_stack.cfg.model_copy(update={"audio_output": True})))
    runner = CliRunner()
    assert runner.invoke(app, ["health", "--config", str(speaking), "--timeout", "2"]).exit_code == 1
    result = runner.invoke(app, ["health", "--config", str(speaking), "--text-only", "--timeout", "5"])
    assert result.exit_code == 0, result.output
    assert sorted(line.split()[0].split("[")[0] for line in result.output.splitlines()) == ["gateway", "thinker"]
    with pytest.raises(ConfigError, match="not a stage of this deploy config's chain"):  # (`error:`, exit 2)
        run_stage("talker", text_stack.cfg, text_stack.model_dir, "127.0.0.1", 0, None)


def test_a_client_that_stops_reading_frees_its_request_at_the_stall_timeout(text_stack: Stack, pipeline: Any) -> None:
    """A client that takes none of its reply for output_stall_timeout_s (its window is full, so
    the gateway's write waits) fails DEADLINE_EXCEEDED, saying why, and its gateway slot and
    thinker are free then, not at its deadline: the thinker may be done with it long before."""
    from omnistage.v1 import gateway_pb2_grpc
    from tests.integration.conftest import assert_all_idle, metric

    gateway = text_stack.gateway_address
    # a reply of 300 short text pieces, and a stream window of 1 KiB it fills (no window growth)
    req = build_request("hi", want_audio=False, thinker_max_tokens=300, thinker_stop_ids=[pipeline.spec.tts_pad_id],
                        request_id="stalled-reader")  # fmt: skip
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    stalled = "DEADLINE_EXCEEDED"
    before = metric(gateway, "omnistage_gateway_requests_total", api="grpc", outcome=stalled)

    async def go() -> tuple[float, list[Any], grpc.aio.AioRpcError]:
        async with grpc.aio.insecure_channel(gateway, options=options) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120)
            got = [await call.read()]
            t0 = time.monotonic()
            while metric(gateway, "omnistage_gateway_requests_in_flight") and time.monotonic() - t0 < 30:
                await asyncio.sleep(0.2)  # reading nothing
            freed_in = time.monotonic() - t0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while (resp := await call.read()) is not grpc.aio.EOF:  # what was sent, then the status
                    got.append(resp)
            return freed_in, got, err.value

    freed_in, got, err = run(go())
    assert freed_in < 10 * STALL_S, f"the gateway held the stalled request {freed_in:.1f} s"
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert f"output_stall_timeout_s={STALL_S}" in err.details() and req.request_id in err.details(), err.details()
    assert 1 < len(got) < 300 and not any(r.HasField("final") for r in got)
    assert metric(gateway, "omnistage_gateway_requests_total", api="grpc", outcome=stalled) == before + 1
    assert_all_idle(text_stack.addresses("thinker"), 10)
    assert run(generate(gateway, "hi", want_audio=False, thinker_max_tokens=3, timeout=60)).token_ids
