"""The thinker split into a prefill and a decode role (`thinker.disaggregated`), as real
processes on loopback: greedy output equals monolithic `generate()` for text and audio in,
alone and under concurrency; cancelling frees both roles; a decode role that is gone fails the
request with UNAVAILABLE naming it."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from gateway.client import build_request, generate
from omnistage.cli.serve import Stack, start_stack
from omnistage.config import apply_overrides
from omnistage.v1 import gateway_pb2_grpc
from omnistage.wire.shm import DEFAULT_DIR
from tests.integration.conftest import (
    assert_a_call_ends_speech,
    assert_all_idle,
    assert_stop_text_ends_speech,
    call_outputs,
    info,
    prompt_chunk,
    run,
    solo_reply,
    stack_config,
    stage_call,
    stage_is_idle,
)
from tests.integration.test_multimodal import MEDIA_LIMITS, _case, _request_options, reference_output
from tests.integration.test_stack import PROMPT, TALKER_MAX, THINKER_MAX, greedy_start

ROLES = ("thinker-prefill", "thinker-decode")


@pytest.fixture(scope="module")
def pd_stack(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = stack_config(talker={"replicas": 1}, media=MEDIA_LIMITS)
    base = cfg.thinker.base_port  # the roles take the thinker's two ports of the block
    cfg = apply_overrides(cfg, {"thinker.disaggregated": True, "thinker.prefill.base_port": base,
                                "thinker.decode.base_port": base + 1})  # fmt: skip
    with start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path_factory.mktemp("pd-logs")) as s:
        yield s


def test_the_stack_runs_both_roles_and_no_thinker(pd_stack: Stack) -> None:
    assert not pd_stack.addresses("thinker")
    for role in ROLES:
        (address,) = pd_stack.addresses(role)
        assert run(info(address)).role == role


def test_pd_matches_generate(pd_stack: Stack, pipeline: Any, reference: Any) -> None:
    ids = pipeline.prompt_ids(PROMPT)
    ref_ids, ref_codes, ref_wav = reference.generate(ids, THINKER_MAX, TALKER_MAX, pipeline.spec.im_end_id)
    assert len(ref_ids) > 2 and ref_codes.shape[1] > 0

    # Straight into the prefill role: every part's chunks come back up through it.
    out = run(stage_call(pd_stack.addresses("thinker-prefill")[0], greedy_start("pd-1"), [prompt_chunk(ids)]))
    tokens, codes, audio = call_outputs(out)
    assert tokens == ref_ids
    assert torch.equal(codes, ref_codes)
    assert audio.shape == ref_wav.shape and torch.allclose(audio, ref_wav, atol=1e-5, rtol=0)

    reply = run(generate(pd_stack.gateway_address, PROMPT, thinker_max_tokens=THINKER_MAX,
                         talker_max_tokens=TALKER_MAX, timeout=60))  # fmt: skip
    assert reply.token_ids == ref_ids
    assert np.allclose(reply.pcm, ref_wav.numpy(), atol=1e-5, rtol=0)


def test_a_given_reply_crosses_the_split(pd_stack: Stack, pipeline: Any) -> None:
    """`forced_ids`: the prefill role emits the first given id and the decode role, counting on
    from the handoff, the rest, then the stop id."""
    given = pipeline.tokenizer.encode("Some other words", add_special_tokens=False)
    assert len(given) > 2
    reply = run(generate(pd_stack.gateway_address, PROMPT, want_audio=False, timeout=60,
                         sampling={"thinker": {"forced_ids": given, "max_tokens": len(given) + 1}}))  # fmt: skip
    assert reply.token_ids == [*given, pipeline.spec.im_end_id] and reply.text == "Some other words"


@pytest.mark.parametrize("first", [True, False], ids=["first-token", "later-token"])
def test_a_stop_text_ends_the_speech_across_the_split(pd_stack: Stack, pipeline: Any, first: bool) -> None:
    """A stop text completed by the first token (the prefill role's) or a later one (the decode
    role's, which reads on from the handoff's): the reply and its speech end there."""
    stop = assert_stop_text_ends_speech(pd_stack.gateway_address, pipeline.tokenizer, PROMPT, THINKER_MAX,
                                        TALKER_MAX, first=first)  # fmt: skip
    # the role that ended it says why (a one-token reply has no speech to tell the cut from the end)
    start = greedy_start(f"pd-stop-{first}")
    start.sampling["thinker"].stop_texts.append(stop)
    out = run(stage_call(pd_stack.addresses("thinker-prefill")[0], start, [prompt_chunk(pipeline.prompt_ids(PROMPT))]))
    assert [c.meta.get("finish_reason") for c in out["thinker"]][-1] == "stop_text"
    assert out["talker"][-1].finished  # (the talker ended too, not cut off)


def test_a_tool_call_ends_the_speech_across_the_split(pd_stack: Stack, pipeline: Any) -> None:
    """A call's first token ends the talker's input, as the prefill role's first token (a reply
    that only calls) or as a later one of the decode role's; the text goes on to the call's end."""
    assert_a_call_ends_speech(pd_stack.gateway_address, pipeline.tokenizer, PROMPT, TALKER_MAX)


def test_pd_audio_input_matches_generate(pd_stack: Stack, checkpoints: Any) -> None:
    pipeline, reference = checkpoints("published")
    ref = (pipeline, reference, pipeline.family.input_builder(pipeline.checkpoint, pipeline.tokenizer))
    request = _case("audio")
    _, _, (ref_ids, ref_codes, ref_wav) = reference_output(ref, request)
    reply = run(generate(pd_stack.gateway_address, "", timeout=120, **_request_options(request)))
    assert reply.token_ids == ref_ids
    assert reply.usage["audio_frames"] == ref_codes.shape[1]
    assert reply.pcm.shape == tuple(ref_wav.shape) and np.allclose(reply.pcm, ref_wav.numpy(), atol=1e-5, rtol=0)


def test_pd_concurrent_requests_match_their_solo_runs(pd_stack: Stack, pipeline: Any) -> None:
    """Requests at once (the decode role batches them; one ends at its first token) give what
    the single in-process thinker gives each alone."""
    prompts = [PROMPT, "Numbers one two three", "Where is the nearest train station from here?", "hi", "ok", "Sing!"]
    limits = [24, 24, 24, 24, 1, 24]  # max_tokens 1: the prefill's token is the last
    solo = [solo_reply(pipeline, p, limit, 40) for p, limit in zip(prompts, limits, strict=True)]

    async def together() -> list[Any]:
        return await asyncio.gather(*(generate(pd_stack.gateway_address, p, thinker_max_tokens=limit,
                                               talker_max_tokens=40, timeout=120)
                                      for p, limit in zip(prompts, limits, strict=True)))  # fmt: skip

    for reply, (ids, audio, _) in zip(run(together()), solo, strict=True):
        assert reply.token_ids == ids
        assert reply.pcm.shape == audio.shape and np.allclose(reply.pcm, audio, atol=1e-5, rtol=0)
    steps = run(info(pd_stack.addresses("thinker-decode")[0])).load
    assert steps.step_requests_total > steps.steps_total, "the decode role batched requests"


def test_a_decode_role_with_room_for_one_cache_serves_requests_in_turn(tiny_dir: Path, pipeline: Any,
                                                                        tmp_path: Path) -> None:  # fmt: skip
    """The decode role takes a request's KV cache in only once it has reserved room for it (the
    rest waits with the prefill role, gRPC flow control holding the stream), and the prefill
    role has room for one prompt too (it keeps a prompt's reservation until its KV has left):
    concurrent requests run one after another, each as it runs alone, and both roles end idle
    with nothing reserved, no reservation left held. (That a held request is not read on before
    its reservation, is not failed as starved of input meanwhile, and that the prefill role's
    reservation lasts until its stream has taken the last KV message: tests/test_engine.py,
    tests/wire/test_stage_server_units.py. On the tiny checkpoint a request's KV fits gRPC's
    window, so here the hold is short.)"""
    prompts = [PROMPT, "Numbers one two three", "Where is the nearest train station from here?", "Sing!"]
    limit, room = 24, 60
    lengths = [len(pipeline.prompt_ids(p)) for p in prompts]
    demands = [n + limit - 1 for n in lengths]  # prompt + the decode role's tokens
    assert all(room / 2 < d <= room for d in demands), demands  # one fits, no two do
    prefill_room = max(lengths) + 1  # a prompt and its first token
    assert sum(sorted(lengths)[:2]) + 2 > prefill_room, lengths  # one fits, no two do
    cfg = stack_config(talker={"replicas": 1})
    base = cfg.thinker.base_port
    cfg = apply_overrides(cfg, {"thinker.disaggregated": True, "thinker.prefill.base_port": base,
                                "thinker.decode.base_port": base + 1,
                                "thinker.prefill.cache_capacity_tokens": prefill_room,
                                "thinker.decode.cache_capacity_tokens": room})  # fmt: skip
    solo = [solo_reply(pipeline, p, limit, 20) for p in prompts]
    stack = start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path)
    try:
        async def together() -> list[Any]:
            return await asyncio.gather(*(generate(stack.gateway_address, p, thinker_max_tokens=limit,
                                                   talker_max_tokens=20, timeout=120) for p in prompts))  # fmt: skip

        for reply, (ids, audio, _) in zip(run(together()), solo, strict=True):
            assert reply.token_ids == ids
            assert reply.pcm.shape == audio.shape and np.allclose(reply.pcm, audio, atol=1e-5, rtol=0)
        for role in ROLES:
            load = run(info(stack.addresses(role)[0])).load
            assert load.steps_total > 0 and load.step_requests_total == load.steps_total, f"{role}: one at a time"
            assert _settles_idle(stack.addresses(role)[0]), str(run(info(stack.addresses(role)[0])).load)
        # a prompt the prefill role can never hold: refused, naming the id the client gave, not the
        # stages' own id for it (the client's id plus a suffix)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            run(generate(stack.gateway_address, PROMPT * 20, thinker_max_tokens=limit, request_id="mine", timeout=60))
        detail = refused.value.details() or ""
        assert "'mine'" in detail and "tokens of cache" in detail, detail
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # no retry helps: not RESOURCE_EXHAUSTED
    finally:
        stack.stop()


@pytest.mark.skipif(not (sys.platform.startswith("linux") and DEFAULT_DIR.is_dir() and os.access(DEFAULT_DIR, os.W_OK)),
                    reason="shared memory needs a writable /dev/shm (Linux)")
def test_long_prompts_cross_the_split_through_shared_memory_released_at_the_first_answer(
        tiny_dir: Path, pipeline: Any, tmp_path: Path) -> None:  # fmt: skip
    """Prompts long enough that the handoff's talker prompt (a row per prompt token) goes through
    the prefill role's shared memory: the prefill role releases each request's segments at the
    decode role's first answer, while the reply goes on, and reuses them for the next requests'
    (tests/wire/test_stage_server_units.py). Concurrent replies still equal their solo runs: the
    decode role kept no view of the released bytes."""
    prompts = ["Hello there, how are you? " * 105, "one two three four five " * 84, "Numbers one two three " * 106]
    lengths = [len(pipeline.prompt_ids(p)) for p in prompts]
    hidden = pipeline.spec.thinker_hidden
    # float32 rows over the pool's 256 KiB threshold, and room for the reply in the tiny's 2048 positions
    assert all(n * hidden * 4 >= 256 << 10 and n + 16 < 2048 for n in lengths), lengths
    limit = 8
    solo = [solo_reply(pipeline, p, limit, 30) for p in prompts]
    cfg = stack_config(talker={"replicas": 1}, shm=True)
    base = cfg.thinker.base_port
    cfg = apply_overrides(cfg, {"thinker.disaggregated": True, "thinker.prefill.base_port": base,
                                "thinker.decode.base_port": base + 1})  # fmt: skip
    stack = start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path)
    try:
        async def together() -> list[Any]:
            return await asyncio.gather(*(generate(stack.gateway_address, p, thinker_max_tokens=limit,
                                                   talker_max_tokens=30, timeout=120) for p in prompts))  # fmt: skip

        for _ in range(2):  # the second round reuses the segments the first released
            for reply, (ids, audio, _) in zip(run(together()), solo, strict=True):
                assert reply.token_ids == ids
                assert reply.pcm.shape == audio.shape and np.allclose(reply.pcm, audio, atol=1e-5, rtol=0)
        prefill = stack.addresses("thinker-prefill")[0]
        assert _settles(lambda: run(info(prefill)).load.open_streams == 0)  # its calls end after the replies
        load = run(info(prefill)).load
        assert 1 <= load.shm_segments <= 4, load  # used, then kept free for reuse
    finally:
        stack.stop()


def _settles(check: Any, timeout: float = 10.0) -> bool:
    """`check()` comes true within `timeout` (a role's calls end just after the client's reply)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _settles_idle(address: str) -> bool:
    return _settles(lambda: stage_is_idle(address))


def test_cancel_frees_both_roles(pd_stack: Stack, pipeline: Any) -> None:
    async def cancel_after(n: int) -> None:
        req = build_request("hi " * 40, thinker_max_tokens=300, talker_max_tokens=200,
                            thinker_stop_ids=[pipeline.spec.tts_pad_id])  # fmt: skip
        async with grpc.aio.insecure_channel(pd_stack.gateway_address) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60)
            seen = 0
            async for _ in call:
                seen += 1
                if seen >= n:
                    call.cancel()
                    break

    async def cancel_during_prefill(delay: float) -> None:
        """A long prompt, cancelled while the prefill role may still be computing and sending it."""
        req = build_request("lorem ipsum dolor sit amet, " * 50, thinker_max_tokens=8, talker_max_tokens=8)
        async with grpc.aio.insecure_channel(pd_stack.gateway_address) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60)
            await asyncio.sleep(delay)
            call.cancel()

    for n in (1, 5):  # at the first token (the KV just handed over) and mid-decode
        run(cancel_after(n))
    for delay in (0.0, 0.05, 0.1, 0.2):
        run(cancel_during_prefill(delay))
    stages = [a for name in (*ROLES, "talker", "code2wav") for a in pd_stack.addresses(name)]
    assert_all_idle(stages, 15)


def test_health_with_the_split_stacks_config_checks_both_roles_and_another_config_says_so(
        pd_stack: Stack, tmp_path: Path) -> None:  # fmt: skip
    """`omnistage health --config` of the stack's own file checks both roles; the unsplit file
    with the same ports found the prefill role SERVING as `thinker` and passed, never asking the
    decode role."""
    import yaml
    from typer.testing import CliRunner

    from omnistage.cli.main import app
    from omnistage.config import dump_config

    own = tmp_path / "own.yaml"
    own.write_text(dump_config(pd_stack.cfg))
    result = CliRunner().invoke(app, ["health", "--config", str(own)])
    assert result.exit_code == 0 and "thinker-decode[0]" in result.output, result.output
    other = yaml.safe_load(dump_config(pd_stack.cfg))
    other["thinker"] |= {"disaggregated": False, "base_port": pd_stack.cfg.thinker.prefill.base_port}
    unsplit = tmp_path / "unsplit.yaml"
    unsplit.write_text(yaml.safe_dump(other))
    result = CliRunner().invoke(app, ["health", "--config", str(unsplit)])
    assert result.exit_code == 1, result.output
    assert "but it runs thinker-prefill, not thinker" in result.output and "--config" in result.output


def test_a_dead_decode_role_is_unavailable_naming_it(pd_stack: Stack) -> None:
    """Last in the module: it kills the decode role."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def gateway_health() -> int:
        async with grpc.aio.insecure_channel(pd_stack.gateway_address) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return int(reply.status)

    assert run(gateway_health()) == health_pb2.HealthCheckResponse.SERVING
    decode = pd_stack.child("thinker-decode")
    decode.proc.kill()
    decode.proc.wait(10)
    # the gateway's gRPC health follows the decode role too (seen through the prefill role's Info)
    deadline, seen = time.monotonic() + 10, None
    while time.monotonic() < deadline and seen != health_pb2.HealthCheckResponse.NOT_SERVING:
        seen = run(gateway_health())
        time.sleep(0.1)
    assert seen == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(generate(pd_stack.gateway_address, PROMPT, thinker_max_tokens=8, talker_max_tokens=8, timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "thinker-decode" in (err.value.details() or "")
    assert pd_stack.child("thinker-prefill").proc.poll() is None
    assert _settles_idle(pd_stack.addresses("thinker-prefill")[0])
