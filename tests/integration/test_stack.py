"""The real multi-process stack on loopback: parity, streaming order, modes, routing,
cancellation, timeouts and bad input."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from gateway.client import build_request, generate, stream_generate
from omnistage.cli.serve import Stack, start_stack
from omnistage.models.sampling import SamplingParams
from omnistage.v1 import gateway_pb2_grpc, stage_pb2
from omnistage.wire.tensor_blob import encode_chunk
from services.pipeline import AudioEvent, PipelineRequest
from tests.integration.conftest import (
    assert_a_call_ends_speech,
    assert_all_idle,
    assert_stop_text_ends_speech,
    call_outputs,
    cancel_at_first_audio,
    info,
    metric,
    prompt_chunk,
    run,
    solo_reply,
    stack_config,
    stage_call,
)

PROMPT = "Tell me a short story about a robot who learns to sing."
THINKER_MAX, TALKER_MAX = 40, 80


def greedy_start(rid: str, want_audio: bool = True, mode: int = stage_pb2.ASYNC_CHUNK, **limits: int) -> Any:
    start = stage_pb2.Start(request_id=rid, want_audio=want_audio, mode=mode)
    start.sampling["thinker"].max_tokens = limits.get("thinker", THINKER_MAX)
    start.sampling["talker"].max_tokens = limits.get("talker", TALKER_MAX)
    start.sampling["talker"].do_sample = False
    start.sampling["talker"].repetition_penalty = 1.0
    return start


def test_stack_matches_pipeline_and_generate(stack: Stack, pipeline: Any, reference: Any) -> None:
    ids = pipeline.prompt_ids(PROMPT)
    ref_ids, ref_codes, ref_wav = reference.generate(ids, THINKER_MAX, TALKER_MAX, pipeline.spec.im_end_id)
    events = list(pipeline.run(PipelineRequest(ids, pipeline.thinker_defaults().with_overrides(max_tokens=THINKER_MAX),
                                               SamplingParams(max_tokens=TALKER_MAX))))
    in_process = events[-1]

    # Straight into the thinker: every stage's chunks come back up.
    out = run(stage_call(stack.addresses("thinker")[0], greedy_start("parity-1"), [prompt_chunk(ids)]))
    tokens, codes, audio = call_outputs(out)
    assert tokens == ref_ids == in_process.token_ids
    assert torch.equal(codes, ref_codes) and torch.equal(codes, in_process.codes)
    assert audio.shape == ref_wav.shape
    assert torch.allclose(audio, ref_wav, atol=1e-5, rtol=0)
    streamed = torch.cat([e.pcm for e in events if isinstance(e, AudioEvent)])
    assert torch.allclose(audio, streamed, atol=1e-5, rtol=0)
    # Alone in the stack, its first frame went down by itself (first_chunk_frames_idle: 1) and
    # came back as one frame's audio, ahead of the schedule's first chunk of 2 (on a loaded machine
    # the second frame may be in too when code2wav's step runs, and goes with it: seen once in
    # make test; tests/code2wav/test_worker_schedule.py checks decode_now without the timing).
    first_codes = next(c for c in out["talker"] if "codes" in c.tensors)
    first_audio = next(c for c in out["code2wav"] if "audio" in c.tensors)
    assert first_codes.length == 1 and first_codes.meta.get("decode_now") is True
    samples_for = pipeline.workers["code2wav"].code2wav.incremental.samples_for_frames
    assert first_audio.length in (samples_for(1), samples_for(2)), first_audio.length

    # With omit_codes (as the gateway asks): the same audio, and of the
    # talker only its finished chunk, at the frame count.
    start = greedy_start("parity-omit")
    start.omit_codes = True
    omitted = run(stage_call(stack.addresses("thinker")[0], start, [prompt_chunk(ids)]))
    assert [(c.offset, c.length, c.finished, dict(c.tensors)) for c in omitted["talker"]] == [
        (ref_codes.shape[1], 0, True, {})]
    assert torch.allclose(torch.cat([c.tensors["audio"] for c in omitted["code2wav"] if "audio" in c.tensors]), audio,
                          atol=1e-5, rtol=0)

    # Through the gateway: the same ids and the same audio.
    reply = run(generate(stack.gateway_address, PROMPT, thinker_max_tokens=THINKER_MAX,
                         talker_max_tokens=TALKER_MAX, timeout=60))
    assert reply.token_ids == ref_ids
    assert reply.sample_rate == 24000
    assert np.allclose(reply.pcm, ref_wav.numpy(), atol=1e-5, rtol=0)
    assert reply.usage["audio_frames"] == ref_codes.shape[1]


def test_a_stop_text_ends_the_speech_with_the_text(stack: Stack, pipeline: Any) -> None:
    """The thinker ends the reply at the token that completes a stop text, and every stage below
    ends with it (the gateway used to end the call at once, and the speech stopped wherever the
    talker was, short or empty)."""
    assert_stop_text_ends_speech(stack.gateway_address, pipeline.tokenizer, PROMPT, THINKER_MAX, TALKER_MAX)


def test_a_tool_call_ends_the_speech_not_the_text(stack: Stack, pipeline: Any) -> None:
    """With tools and audio, the talker's input ends at a call's first token; the thinker's
    text goes on to the call's end (tests/test_tool_calls.py reads the calls out)."""
    assert_a_call_ends_speech(stack.gateway_address, pipeline.tokenizer, PROMPT, TALKER_MAX)


def test_concurrent_requests_match_their_solo_runs(stack: Stack, pipeline: Any) -> None:
    """Requests sharing the stages at once (code2wav decodes them in one batched step) give
    the tokens and audio each gives alone."""
    prompts = [PROMPT, "Numbers one two three", "Where is the nearest train station from here?", "hi"]
    solo = [solo_reply(pipeline, p, 24, 40) for p in prompts]

    async def together() -> list[Any]:
        return await asyncio.gather(*(generate(stack.gateway_address, p, thinker_max_tokens=24,
                                               talker_max_tokens=40, timeout=120) for p in prompts))

    for reply, (ids, audio, _) in zip(run(together()), solo, strict=True):
        assert reply.token_ids == ids
        assert reply.pcm.shape == audio.shape
        assert np.allclose(reply.pcm, audio, atol=1e-5, rtol=0)


def test_audio_starts_before_the_thinker_finishes(stack: Stack, pipeline: Any) -> None:
    """async_chunk: a long reply (stop id that never comes, 300 tokens) while the talker speaks."""

    async def go() -> tuple[float, float]:
        first_audio = last_text = None
        async for ev in stream_generate(stack.gateway_address, "hi", thinker_max_tokens=300, talker_max_tokens=20,
                                        thinker_stop_ids=[pipeline.spec.tts_pad_id], timeout=120):
            if ev.kind == "audio" and first_audio is None:
                first_audio = ev.t
            if ev.kind == "text":
                last_text = ev.t
        assert first_audio is not None and last_text is not None
        return first_audio, last_text

    first_audio, last_text = run(go())
    assert first_audio < last_text


def test_full_payload_gives_the_same_output(stack: Stack) -> None:
    kwargs = {"thinker_max_tokens": THINKER_MAX, "talker_max_tokens": TALKER_MAX, "timeout": 60}
    a = run(generate(stack.gateway_address, PROMPT, mode="async_chunk", **kwargs))
    f = run(generate(stack.gateway_address, PROMPT, mode="full_payload", **kwargs))
    assert a.token_ids == f.token_ids
    assert a.pcm.shape == f.pcm.shape and a.pcm.size > 0
    assert np.allclose(a.pcm, f.pcm, atol=1e-5, rtol=0)
    # full_payload: code2wav starts only once the talker has finished.
    assert f.timings["code2wav"]["first_output_s"] >= f.timings["talker"]["total_s"] - 1e-3
    # the gateway's first output is the reply's first piece (it was 0)
    first = min(f.timings[s]["first_output_s"] for s in ("thinker", "code2wav"))
    assert f.timings["gateway"]["first_output_s"] > 0 and abs(f.timings["gateway"]["first_output_s"] - first) < 0.05


def test_text_only_request_never_reaches_the_talker(stack: Stack) -> None:
    before = [run(info(a)).load.requests_total for a in stack.addresses("talker")]
    reply = run(generate(stack.gateway_address, PROMPT, want_audio=False, thinker_max_tokens=8, timeout=30))
    assert reply.token_ids and reply.pcm.size == 0
    after = [run(info(a)).load.requests_total for a in stack.addresses("talker")]
    assert after == before


def test_both_talker_replicas_receive_requests(stack: Stack) -> None:
    for i in range(4):
        run(generate(stack.gateway_address, f"hi {i}", thinker_max_tokens=4, talker_max_tokens=4, timeout=30))
    totals = [run(info(a)).load.requests_total for a in stack.addresses("talker")]
    assert len(totals) == 2 and all(t > 0 for t in totals), totals


def test_cancellation_frees_every_stage(stack: Stack, pipeline: Any) -> None:
    run(cancel_at_first_audio(stack.gateway_address, pipeline.spec.tts_pad_id))
    assert_all_idle(stack.addresses("thinker") + stack.addresses("talker") + stack.addresses("code2wav"), 15)


def test_a_one_token_reply_with_speech_ends_cleanly(stack: Stack) -> None:
    """The talker cannot speak a reply of one token (neither can generate()): the reply has its
    token and no audio, no error, and every stage lets go of it; code2wav too, whose call the
    talker opened as its first step started and ends with no frames."""
    code2wav = stack.addresses("code2wav")
    before = sum(run(info(a)).load.requests_total for a in code2wav)
    reply = run(generate(stack.gateway_address, PROMPT, thinker_max_tokens=1, talker_max_tokens=20, timeout=30))
    assert len(reply.token_ids) == 1 and reply.pcm.size == 0
    assert sum(run(info(a)).load.requests_total for a in code2wav) == before + 1
    assert_all_idle(stack.addresses("thinker") + stack.addresses("talker") + code2wav, 10)


def test_deadline_exceeded_is_reported(stack: Stack, pipeline: Any) -> None:
    async def go() -> None:
        # connected first: a deadline spent dialing would end the call before the gateway counts it
        async with grpc.aio.insecure_channel(stack.gateway_address) as ch:
            await asyncio.wait_for(ch.channel_ready(), 30)
            async for _ in stream_generate(stack.gateway_address, "hi", channel=ch, thinker_max_tokens=300,
                                           talker_max_tokens=300, thinker_stop_ids=[pipeline.spec.tts_pad_id],
                                           timeout=0.5):  # fmt: skip
                pass

    def counted() -> float:  # the gateway's own count of deadlines (gRPC cancels a call past its deadline)
        return metric(stack.gateway_address, "omnistage_gateway_requests_total", api="grpc",
                      outcome="DEADLINE_EXCEEDED")

    before = counted()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(go())
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 15
    while counted() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counted() == before + 1  # it was counted CANCELLED


def test_a_stream_left_early_on_a_shared_channel_cancels_its_request(stack: Stack, pipeline: Any) -> None:
    """`stream_generate(channel=...)` (one channel for many requests, as the bench keeps it): a
    consumer that stops at the first text cancels the request down the chain; the call lived on
    and every stage made the whole reply."""

    def cancelled() -> float:
        return metric(stack.gateway_address, "omnistage_gateway_requests_total", api="grpc", outcome="CANCELLED")

    async def leave_early() -> None:
        async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
            events = stream_generate(stack.gateway_address, "hi", channel=channel, thinker_max_tokens=300,
                                     talker_max_tokens=300, thinker_stop_ids=[pipeline.spec.tts_pad_id])  # fmt: skip
            async for event in events:
                if event.kind == "text":
                    break
            await events.aclose()
            await asyncio.sleep(3)  # the channel stays open past the whole reply (about 1 s here)

    before = cancelled()
    run(leave_early())
    deadline = time.monotonic() + 5
    while cancelled() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cancelled() == before + 1  # it ran to its end: outcome ok
    assert_all_idle(stack.addresses("thinker") + stack.addresses("talker") + stack.addresses("code2wav"), 10)


def test_input_wait_timeout_names_the_stage(stack: Stack, pipeline: Any) -> None:
    """A talker request that gets its prompt but never a token fails after input_wait_timeout_s (5 s)."""
    ids = torch.tensor(pipeline.prompt_ids("hi"))
    embeds = torch.zeros((ids.shape[0], pipeline.spec.thinker_hidden))
    chunk = encode_chunk({"prompt_ids": ids, "prompt_embed": embeds}, offset=0, meta={"n": 0})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(stage_call(stack.addresses("talker")[0], greedy_start("starved"), [chunk], timeout=30, hold_open=20))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "talker" in err.value.details() and "input_wait_timeout_s" in err.value.details()


@pytest.mark.parametrize(
    ("start", "chunks", "needle"),
    [
        (stage_pb2.Start(request_id=""), [], "request_id"),
        (None, [], "first message must be Start"),
        (stage_pb2.Start(request_id="bad-name"), ["wrong-name"], "unexpected tensor(s) ['tokens']"),
        (stage_pb2.Start(request_id="bad-dtype"), ["float-ids"], "dtype"),
        (stage_pb2.Start(request_id="after-fin"), ["prompt", "prompt"], "after the finished chunk"),
        (stage_pb2.Start(request_id="offset"), ["offset"], "offset"),
        (stage_pb2.Start(request_id="empty"), ["empty-prompt"], "empty prompt"),
    ],
)
def test_malformed_input_is_invalid_argument_and_service_continues(
    stack: Stack, pipeline: Any, start: Any, chunks: list[str], needle: str
) -> None:
    ids = torch.tensor(pipeline.prompt_ids("hi"))
    made = {
        "wrong-name": encode_chunk({"tokens": ids}, offset=0, finished=True, meta={"n": len(ids)}),
        "float-ids": encode_chunk({"ids": ids.float()}, offset=0, finished=True, meta={"n": len(ids)}),
        "prompt": prompt_chunk(ids.tolist()),
        "offset": encode_chunk({"ids": ids}, offset=3, finished=True, meta={"n": len(ids)}),
        "empty-prompt": encode_chunk({"ids": ids[:0]}, offset=0, finished=True, meta={"n": 0}),
    }
    messages: list[Any] = [made[c] for c in chunks]
    if start is None:  # a chunk where Start belongs
        start_msg: Any = made["prompt"]
        messages = []
    else:
        start_msg = start

    async def go() -> None:
        async def gen() -> Any:
            if isinstance(start_msg, stage_pb2.Start):
                yield stage_pb2.StageRequest(start=start_msg)
            else:
                yield stage_pb2.StageRequest(chunk=start_msg)
            for m in messages:
                yield stage_pb2.StageRequest(chunk=m)
            await asyncio.sleep(5)

        from omnistage.v1 import stage_pb2_grpc

        async with grpc.aio.insecure_channel(stack.addresses("thinker")[0]) as ch:
            async for _ in stage_pb2_grpc.StageStub(ch).Stream(gen(), timeout=20):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(go())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert needle in err.value.details()
    assert "thinker" in err.value.details()
    # The service and its other requests continue.
    reply = run(generate(stack.gateway_address, "hi", thinker_max_tokens=4, talker_max_tokens=4, timeout=30))
    assert reply.token_ids


def test_gateway_rejects_an_empty_prompt(stack: Stack) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(generate(stack.gateway_address, "   ", timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "empty prompt" in err.value.details()


@pytest.fixture(scope="module")
def spare_stack(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A second stack the fault tests may break; its messages are small and never in shared
    memory, so large chunks (audio of 16 frames and more) cross every hop in parts."""
    cfg = stack_config(talker={"replicas": 1}, timeouts={"drain_grace_s": 60}, max_message_bytes=64 << 10, shm=False)
    with start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path_factory.mktemp("spare")) as s:
        yield s


def test_chunks_split_into_parts_cross_every_hop_whole(spare_stack: Stack, pipeline: Any) -> None:
    """Audio chunks over the message limit go up from code2wav in parts, relayed by the talker
    and the thinker between their own chunks: the reply equals the in-process pipeline's."""
    ids = pipeline.prompt_ids(PROMPT)
    events = list(pipeline.run(PipelineRequest(ids, pipeline.thinker_defaults().with_overrides(max_tokens=THINKER_MAX),
                                               SamplingParams(max_tokens=TALKER_MAX))))  # fmt: skip
    audio = [e.pcm for e in events if isinstance(e, AudioEvent)]
    assert max(a.numel() * 4 for a in audio) > 64 << 10  # some chunk must be split
    reply = run(generate(spare_stack.gateway_address, PROMPT, thinker_max_tokens=THINKER_MAX,
                         talker_max_tokens=TALKER_MAX, timeout=60))  # fmt: skip
    assert reply.token_ids == events[-1].token_ids
    expected = torch.cat(audio).numpy()  # within float rounding: the stage processes run other thread counts
    assert reply.pcm.shape == expected.shape and np.allclose(reply.pcm, expected, atol=1e-5, rtol=0)


def test_downstream_down_is_unavailable_naming_the_stage(spare_stack: Stack) -> None:
    """code2wav is gone, then the talker: audio requests fail fast with UNAVAILABLE naming the
    stage that is gone (a stage between passes its error up as it is: it said "talker
    unavailable at ...: code2wav unavailable at ...", with the talker serving)."""
    s = spare_stack
    code2wav = s.child("code2wav")
    code2wav.proc.kill()
    code2wav.proc.wait()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(generate(s.gateway_address, PROMPT, thinker_max_tokens=8, talker_max_tokens=8, timeout=20))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (err.value.details() or "").startswith("code2wav unavailable at "), err.value.details()
    talker = s.child("talker")
    talker.proc.kill()
    talker.proc.wait()
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(generate(s.gateway_address, PROMPT, thinker_max_tokens=8, talker_max_tokens=8, timeout=20))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "talker" in err.value.details()
    # no request lost it: no wait for a replica (failover.replica_wait_s), the replays alone, and
    # the failure says which (not only that the replays failed: more of them would not help)
    detail = err.value.details() or ""
    assert "failover.attempts" in detail, detail
    assert "no replica served there when its calls were made, so none was waited for" in detail, detail
    assert time.monotonic() - t0 < 20
    # Text-only requests do not need the talker and still work.
    assert run(generate(s.gateway_address, "hi", want_audio=False, thinker_max_tokens=4, timeout=20)).token_ids


def _heal_until_serving(s: Stack, child: Any, restarts: int, said: list[str], limit_s: float = 90) -> None:
    """`serve`'s supervision passes, on this thread (a child dies with the thread that started
    it: PDEATHSIG), until `child` has been restarted past `restarts` and serves."""
    deadline = time.monotonic() + limit_s
    while not (child.restarts > restarts and child.healthy_since is not None):
        assert time.monotonic() < deadline, f"{child.role} was not restarted and serving in time: {said}"
        s.heal(said.append)
        time.sleep(0.2)


def test_a_request_outlives_the_restart_of_its_only_replica(spare_stack: Stack) -> None:
    """The only talker replica dies mid-request and comes back on its port (`serve` restarts
    it; here its supervision passes run beside the request): the thinker's replay waits for it
    (failover.replica_wait_s) and the reply is whole, as it is undisturbed. Without the wait the
    three replays ended within 2 s, long before the restart, and the request failed UNAVAILABLE.
    (After the test above, whose talker and code2wav stay down: they are restarted first.)"""
    import os
    import signal

    s = spare_stack
    talker = s.child("talker")
    said: list[str] = []
    down = [(c, c.restarts) for c in (s.child("code2wav"), talker) if c.proc.poll() is not None]
    for child, restarts in down:  # (one supervision pass restarts both)
        _heal_until_serving(s, child, restarts, said)
    # ...and the thinker has dialled it again, and it code2wav (their channels back off up to 2 s)
    deadline = time.monotonic() + 30

    def chain_serves() -> bool:
        chain = run(info(s.addresses("thinker")[0])).chain
        return {h.stage for h in chain if h.serving} >= {"talker", "code2wav"}

    while not chain_serves():
        assert time.monotonic() < deadline, "the thinker does not see its talker and code2wav serve"
        time.sleep(0.2)
    options = {"thinker_max_tokens": THINKER_MAX, "talker_max_tokens": TALKER_MAX, "timeout": 60}
    baseline = run(generate(s.gateway_address, PROMPT, **options))
    restarts = talker.restarts

    async def supervise() -> None:
        while not (talker.restarts > restarts and talker.healthy_since is not None):
            s.heal(said.append)
            await asyncio.sleep(0.2)

    async def go() -> tuple[list[int], np.ndarray]:
        ids, pcm, healer = [], [], None
        async for ev in stream_generate(s.gateway_address, PROMPT, **options):
            ids.extend(ev.token_ids)
            if ev.pcm is not None:
                pcm.append(ev.pcm)
            if ev.kind == "audio" and healer is None:  # speaking: its talker call is open
                os.kill(talker.proc.pid, signal.SIGKILL)
                healer = asyncio.ensure_future(asyncio.wait_for(supervise(), 90))
        assert healer is not None
        await healer
        return ids, np.concatenate(pcm)

    ids, pcm = run(go())
    assert talker.restarts == restarts + 1 and any("serving again" in line for line in said), said
    assert "lost its talker call" in s.child("thinker").log.read_text()  # (it was lost mid-request)
    assert ids == baseline.token_ids
    # the replay's audio is recomputed in other chunks: equal within float rounding
    assert pcm.shape == baseline.pcm.shape and np.allclose(pcm, baseline.pcm, atol=1e-5, rtol=0)


def test_sigterm_drains_the_stage(spare_stack: Stack, pipeline: Any) -> None:
    """SIGTERM: health goes NOT_SERVING, new calls are refused, the in-flight request finishes,
    then the process exits."""
    import signal
    import threading

    from omnistage.server.health_check import check

    s = spare_stack
    thinker = s.child("thinker")
    results: dict[str, Any] = {}
    first_text = threading.Event()

    async def long_request() -> None:
        ids: list[int] = []
        async for ev in stream_generate(s.gateway_address, "hi", want_audio=False, thinker_max_tokens=600,
                                        thinker_stop_ids=[pipeline.spec.tts_pad_id], timeout=120):
            ids.extend(ev.token_ids)
            if ev.kind == "text":
                first_text.set()
        results["ids"] = ids

    worker = threading.Thread(target=lambda: run(long_request()))
    worker.start()
    assert first_text.wait(60)
    thinker.proc.send_signal(signal.SIGTERM)
    saw_not_serving = False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and thinker.proc.poll() is None:
        if not check(thinker.address, timeout=0.5):
            saw_not_serving = True
            break
        time.sleep(0.05)
    assert saw_not_serving and thinker.proc.poll() is None, "NOT_SERVING while the request is still running"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(generate(s.gateway_address, "hi", want_audio=False, thinker_max_tokens=2, timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    worker.join(120)
    assert len(results.get("ids", [])) == 600, "the in-flight request completed"
    assert thinker.proc.wait(timeout=30) == 0


def test_parity_under_load_eight_concurrent_requests(stack: Stack, pipeline: Any) -> None:
    """Eight different greedy requests at once give exactly the ids and codes each gives alone,
    and they really shared forward steps (mean batch > 1 in the thinker and the talker)."""
    prompts = [
        "hi",
        "Tell me about the sea.",
        "What is two plus two?",
        "Describe a red house on a hill in autumn.",
        "ok",
        "Name three colours.",
        "Why is the sky blue? Answer briefly, please.",
        "Sing!",
    ]
    ids = [pipeline.prompt_ids(p) for p in prompts]
    thinker = stack.addresses("thinker")[0]

    def unpack(out: dict[str, list[Any]]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        tokens = [int(i) for c in out["thinker"] for i in c.tensors["ids"].tolist()]
        frames = [c.tensors["codes"] for c in out.get("talker", []) if "codes" in c.tensors]
        audio = [c.tensors["audio"] for c in out.get("code2wav", []) if "audio" in c.tensors]
        codes = torch.cat(frames, dim=1) if frames else torch.zeros((16, 0), dtype=torch.long)
        return tokens, codes, torch.cat(audio) if audio else torch.zeros(0)

    limits = {"thinker": 24, "talker": 40}
    solo = [unpack(run(stage_call(thinker, greedy_start(f"solo-{i}", **limits), [prompt_chunk(x)])))
            for i, x in enumerate(ids)]
    assert sum(codes.shape[1] > 0 for _, codes, _ in solo) >= 4  # most of them speak

    def load(stage: str) -> tuple[int, int]:
        loads = [run(info(a)).load for a in stack.addresses(stage)]
        return sum(x.steps_total for x in loads), sum(x.step_requests_total for x in loads)

    before = {s: load(s) for s in ("thinker", "talker")}

    async def together() -> list[Any]:
        calls = (stage_call(thinker, greedy_start(f"load-{i}", **limits), [prompt_chunk(x)], timeout=180)
                 for i, x in enumerate(ids))
        return await asyncio.gather(*calls)

    for i, (out, (ids_alone, codes_alone, audio_alone)) in enumerate(zip(run(together()), solo, strict=True)):
        tokens, codes, audio = unpack(out)
        assert tokens == ids_alone, f"request {i}: text ids differ under load"
        assert torch.equal(codes, codes_alone), f"request {i}: codec codes differ under load"
        assert audio.shape == audio_alone.shape
        assert torch.allclose(audio, audio_alone, atol=1e-5, rtol=0)
    for stage in ("thinker", "talker"):
        steps, requests = (a - b for a, b in zip(load(stage), before[stage], strict=True))
        assert steps > 0 and requests / steps > 1.5, f"{stage}: mean batch {requests / max(steps, 1):.2f}"


def test_grpc_api_edges_a_client_meets(stack: Stack) -> None:
    """What a client written from gateway.proto alone runs into: audio cut by the talker's
    max_tokens says finish_reason "length" (the text ended on its own: "stop"); a request_id
    that metadata cannot carry, and code2wav sampling beyond a seed, are INVALID_ARGUMENT
    naming the field; `prompt` is ignored, and not counted, when `messages` is set."""
    from omnistage.v1 import gateway_pb2

    async def final(request: Any) -> Any:
        async with grpc.aio.insecure_channel(stack.gateway_address) as ch:
            return [r async for r in gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=60)][-1].final

    whole = run(final(build_request("Tell me a story", thinker_max_tokens=40)))
    assert whole.finish_reason == "stop" and whole.usage.completion_tokens < 40  # the text ended by itself
    cut = run(final(build_request("Tell me a story", thinker_max_tokens=40, talker_max_tokens=5)))
    assert 0 < cut.usage.audio_frames <= 5 < whole.usage.audio_frames
    assert cut.usage.completion_tokens == whole.usage.completion_tokens
    assert cut.finish_reason == "length"

    def refused(request: Any) -> str:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            run(final(request))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        return e.value.details() or ""

    for rid in ("h\u00e9llo", "a\nb"):
        assert "request_id" in refused(build_request("hi", thinker_max_tokens=2, request_id=rid))
    bad = build_request("hi", thinker_max_tokens=2)
    bad.sampling["code2wav"].temperature = 0.5
    assert "code2wav samples nothing" in refused(bad)
    # stop ids out of the vocabulary, or a talker's that drop its codec end (it streamed ~20 s of
    # speech, then code2wav refused the end code as a frame), are refused before anything streams
    for stage, stops, reason in (("talker", [-1], "outside the vocabulary"), ("thinker", [1 << 40], "outside the "
                                 "vocabulary"), ("talker", [5], "must keep")):  # fmt: skip
        wrong = build_request("hi", thinker_max_tokens=2)
        wrong.sampling[stage].stop_ids.extend(stops)
        assert f"{stage}: sampling: stop_ids" in (detail := refused(wrong)) and reason in detail, detail
    # a client's string is not repeated whole in an error (past 16 KiB gRPC refused the status itself)
    loud = build_request("hi", thinker_max_tokens=2, speaker="x" * 20_000)
    assert "unknown speaker" in (detail := refused(loud)) and len(detail) < 1000
    seeded = build_request("hi", thinker_max_tokens=2, talker_max_tokens=2)
    seeded.sampling["code2wav"].seed = 7
    assert run(final(seeded)).usage.completion_tokens == 2
    both = gateway_pb2.GenerateRequest(prompt="x" * 3_000_000, want_audio=False,
                                       messages=[gateway_pb2.ChatMessage(role="user", content="hi")])  # fmt: skip
    both.sampling["thinker"].max_tokens = 2
    assert run(final(both)).usage.completion_tokens == 2
