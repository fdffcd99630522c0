"""The fault suite's short forms against the real multi-process stack (the long forms:
`omnistage bench faults`): malformed messages to every stage, cancels at random points."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from benchmarks import faults
from benchmarks.faults import Dims, malformed_probes, run_probes, stage_idle, summarize, valid_input
from gateway.client import build_request, generate
from omnistage.cli.serve import Stack, start_stack
from omnistage.models.checkpoint import open_checkpoint
from omnistage.topology import STAGES
from omnistage.v1 import gateway_pb2_grpc, stage_pb2, stage_pb2_grpc
from omnistage.wire.tensor_blob import ChunkAssembler, encode_chunk
from tests.integration.conftest import metric, prompt_chunk, run, stack_config

PROBES_PER_STAGE = 240  # the bench runs 10,000
# What bounds "at once" here: a hang, not a latency (the bench measures how soon, on a quiet machine)
HANG_S = 10.0


@pytest.fixture(scope="module")
def dims(tiny_dir: Path) -> Dims:
    return Dims.of(open_checkpoint(tiny_dir).spec)


@pytest.fixture(scope="module")
def replicated(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two replicas of every stage: one of each may be killed."""
    cfg = stack_config(thinker={"replicas": 2}, talker={"replicas": 2}, code2wav={"replicas": 2},
                       timeouts={"keepalive_s": 2})  # a frozen replica is lost within 4 s
    with start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path_factory.mktemp("replicated")) as s:
        yield s


@pytest.mark.parametrize("stage", STAGES)
def test_malformed_messages_end_invalid_argument_at_once(replicated: Stack, dims: Dims, stage: str) -> None:
    """Every kind of malformed call, at every position: INVALID_ARGUMENT, never UNKNOWN,
    INTERNAL or a hang; the stage holds nothing afterwards and keeps serving. (How soon, within
    1 s, is `omnistage bench faults`'s to measure: here a loaded 2-core box only bounds it.)"""
    address = replicated.addresses(stage)[0]
    pid = replicated.child(stage, 0).proc.pid
    probes = malformed_probes(stage, dims, PROBES_PER_STAGE, seed=1)
    assert len({p.kind.split("@")[0] for p in probes}) >= 12, "the probes cover too few kinds"
    # a first round warms what any first call allocates (a fresh replica's first decode, gRPC's
    # threads and arenas), so the second measures what malformed calls leave behind
    run(run_probes(address, malformed_probes(stage, dims, PROBES_PER_STAGE // 4, seed=2), concurrency=16,
                   limit_s=10.0))  # fmt: skip
    rss0 = faults.rss_bytes(pid)
    results = run(run_probes(address, probes, concurrency=16, limit_s=10.0))
    summary = summarize(results, within_s=HANG_S)
    assert not summary.wrong, [vars(w) for w in summary.wrong[:5]]
    assert summary.codes == Counter({"INVALID_ARGUMENT": len(probes)})
    # the error names the stage and never echoes the payload bytes
    for r in results:
        assert r.details.startswith(f"{stage}:") or "does not parse" in r.details, r.details
    assert run(faults.wait_until(lambda: stage_idle(address), limit_s=HANG_S)) is not None
    # no growth beyond noise (the bench's 10,000 calls hold it under 2 %)
    assert faults.rss_bytes(pid) < rss0 * 1.10
    reply = run(generate(replicated.gateway_address, "hi", thinker_max_tokens=3, talker_max_tokens=4, timeout=60))
    assert reply.token_ids and reply.pcm.size > 0


def test_a_chunk_after_the_stage_finished_is_refused(replicated: Stack, dims: Dims) -> None:
    """A caller that sends one more chunk once the stage has delivered its whole output (its
    work is over, the call waits for the caller to half-close) gets INVALID_ARGUMENT, not OK."""
    stage = "code2wav"
    address = replicated.addresses(stage)[0]
    chunks = valid_input(stage, dims, random.Random(5))
    extra = encode_chunk({}, offset=10_000, length=0, finished=True)

    async def go() -> tuple[grpc.StatusCode, str, int]:
        delivered = asyncio.Event()

        async def messages() -> Any:
            yield stage_pb2.StageRequest(start=faults._start("late-chunk"))
            for c in chunks:
                yield stage_pb2.StageRequest(chunk=c)
            await asyncio.wait_for(delivered.wait(), 30)
            yield stage_pb2.StageRequest(chunk=extra)

        got = 0
        async with grpc.aio.insecure_channel(address) as ch:
            call = stage_pb2_grpc.StageStub(ch).Stream(messages(), timeout=30)
            asm: dict[str, ChunkAssembler] = {}
            try:
                async for resp in call:
                    if resp.HasField("failure"):  # (why the call fails: its status follows)
                        continue
                    d = asm.setdefault(resp.stage, ChunkAssembler()).push(resp.chunk)
                    if d is not None and d.finished:
                        got += 1
                        delivered.set()  # the stage's output is complete
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or "", got
        return grpc.StatusCode.OK, "", got

    code, details, finished = run(go())
    assert finished == 1, f"the stage's finished output never came: {code} {details}"
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(f"{stage}:") and "after the finished chunk" in details, details


def test_a_caller_that_closes_before_its_finished_chunk_is_refused(replicated: Stack, dims: Dims) -> None:
    """Half-closing without the finished chunk is a malformed stream: INVALID_ARGUMENT saying
    so (after the short wait that tells it from a cancel, which ends the messages the same way),
    counted as such, and the stage holds nothing after."""
    stage = "code2wav"
    address = replicated.addresses(stage)[0]
    chunks = valid_input(stage, dims, random.Random(7))
    before = metric(address, "omnistage_stage_requests_finished_total", outcome="INVALID_ARGUMENT")

    async def go() -> tuple[grpc.StatusCode, str]:
        async def messages() -> Any:
            yield stage_pb2.StageRequest(start=faults._start("closed-early"))
            yield stage_pb2.StageRequest(chunk=chunks[0])  # (not the finished one), then the close

        async with grpc.aio.insecure_channel(address) as ch:
            try:
                async for _ in stage_pb2_grpc.StageStub(ch).Stream(messages(), timeout=30):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    assert len(chunks) > 1 and not chunks[0].finished
    code, details = run(go())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith(f"{stage}: the caller closed its side before the finished chunk"), details
    # the engine thread counts it as it drops the request, which may be just after the status went out
    assert run(faults.wait_until(lambda: stage_idle(address), limit_s=HANG_S)) is not None
    assert metric(address, "omnistage_stage_requests_finished_total", outcome="INVALID_ARGUMENT") == before + 1


def test_one_request_id_may_be_open_twice_on_a_stage(replicated: Stack, dims: Dims) -> None:
    """A replay can reach a stage where the lost caller's call (frozen, not yet noticed) is
    still open with the same id: both calls run, each to its own end."""
    address = replicated.addresses("code2wav")[0]
    chunks = valid_input("code2wav", dims, random.Random(6))

    async def one(release: asyncio.Event, opened: asyncio.Event) -> int:
        async def messages() -> Any:
            yield stage_pb2.StageRequest(start=faults._start("same-id"))
            opened.set()
            await asyncio.wait_for(release.wait(), 30)  # both are open before either sends its input
            for c in chunks:
                yield stage_pb2.StageRequest(chunk=c)

        finished = 0
        async with grpc.aio.insecure_channel(address) as ch:
            asm = ChunkAssembler()
            async for resp in stage_pb2_grpc.StageStub(ch).Stream(messages(), timeout=30):
                if resp.HasField("failure"):  # (why the call fails: its status follows)
                    continue
                d = asm.push(resp.chunk)
                finished += d is not None and d.finished
        return finished

    async def go() -> list[int]:
        release, first, second = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(one(release, first)), asyncio.create_task(one(release, second))]
        await asyncio.wait_for(asyncio.gather(first.wait(), second.wait()), 30)
        await asyncio.sleep(0.3)  # both Starts are in
        release.set()
        return list(await asyncio.gather(*tasks))

    assert run(go()) == [1, 1]
    assert run(faults.wait_until(lambda: stage_idle(address), limit_s=HANG_S)) is not None


def test_a_call_that_sends_no_start_is_ended(replicated: Stack) -> None:
    """A caller that opens a stream and sends nothing holds it only for the input wait
    (timeouts.input_wait_timeout_s, 5 s in these stacks): then DEADLINE_EXCEEDED, and the
    stage has no open stream left."""
    address = replicated.addresses("code2wav")[0]

    async def go() -> tuple[grpc.StatusCode, str]:
        async def silent() -> Any:
            await asyncio.sleep(60)
            yield stage_pb2.StageRequest()

        async with grpc.aio.insecure_channel(address) as ch:
            call = stage_pb2_grpc.StageStub(ch).Stream(silent(), timeout=40)
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    code, details = run(go())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
    assert details.startswith("code2wav: no Start within 5 s"), details
    assert run(faults.wait_until(lambda: stage_idle(address), limit_s=HANG_S)) is not None


def test_errors_never_echo_payload_bytes(replicated: Stack) -> None:
    """A Start followed by bytes that do not parse: the error names the message and its size,
    not its contents."""
    secret = b"\x12\xff\x7fSECRET-PAYLOAD-0123456789"
    start = stage_pb2.StageRequest(start=stage_pb2.Start(request_id="echo")).SerializeToString()

    async def go() -> Any:
        async with grpc.aio.insecure_channel(replicated.addresses("thinker")[0]) as ch:
            call = ch.stream_stream("/omnistage.v1.Stage/Stream")

            async def messages() -> Any:
                yield start
                yield secret

            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call(messages(), timeout=10):
                    pass
            return err.value

    err = run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "message 2" in err.details() and f"{len(secret)} bytes" in err.details()
    assert "SECRET" not in err.details()


def test_a_cancel_message_ends_the_request_cancelled_on_every_stage(replicated: Stack, pipeline: Any) -> None:
    """A caller's Cancel mid-reply (the thinker's, here a direct one, at the talker's first frame):
    the call ends CANCELLED, the thinker's teardown asks the talker the same way, and it the
    code2wav, so each stage still at work counts one cancel, none a malformed stream, and all
    are idle soon after."""
    never = int(pipeline.spec.tts_pad_id)  # (a thinker stop id it never makes)
    everywhere = [a for name in STAGES for a in replicated.addresses(name)]

    def ended(outcome: str) -> dict[str, float]:
        return {name: sum(metric(a, "omnistage_stage_requests_finished_total", outcome=outcome)
                          for a in replicated.addresses(name)) for name in STAGES}  # fmt: skip

    refused_before, cancelled_before = ended("INVALID_ARGUMENT"), ended("CANCELLED")
    start = faults._start("cancel-message")
    start.sampling["thinker"].max_tokens = 300
    start.sampling["thinker"].stop_ids.append(never)
    start.sampling["talker"].max_tokens = 200
    # greedy: the talker's default sampling (unseeded) now and then draws its end code at the
    # first frame, and the call would end before a Cancel could be sent
    start.sampling["talker"].do_sample = False
    start.sampling["talker"].repetition_penalty = 1.0
    prompt = [prompt_chunk(pipeline.prompt_ids("Tell me a long story."))]

    async def go() -> tuple[grpc.StatusCode, str, set[str], set[str]]:
        framed = asyncio.Event()

        async def messages() -> Any:
            yield stage_pb2.StageRequest(start=start)
            for c in prompt:
                yield stage_pb2.StageRequest(chunk=c)
            await asyncio.wait_for(framed.wait(), 30)
            yield stage_pb2.StageRequest(cancel=stage_pb2.Cancel(reason="the test"))

        seen: set[str] = set()
        done_first: set[str] = set()  # stages whose whole output came before the Cancel was sent
        async with grpc.aio.insecure_channel(replicated.addresses("thinker")[0]) as ch:
            try:
                async for resp in stage_pb2_grpc.StageStub(ch).Stream(messages(), timeout=30):
                    seen.add(resp.stage)
                    if resp.chunk.finished and not framed.is_set():
                        done_first.add(resp.stage)
                    if resp.stage == "talker":  # (the code2wav call is open: the talker opens it as it starts)
                        framed.set()
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or "", seen, done_first
        return grpc.StatusCode.OK, "", seen, done_first

    code, details, seen, done_first = run(go())
    assert code == grpc.StatusCode.CANCELLED, (code, details, seen)
    assert details.startswith("thinker: request") and details.endswith("cancelled by its caller (the test)"), details
    assert run(faults.wait_until(lambda: _all_idle(everywhere), limit_s=HANG_S)) is not None
    assert ended("INVALID_ARGUMENT") == refused_before
    cancelled = ended("CANCELLED")
    assert "talker" not in done_first, "the talker ended before the cancel: give it more to do"
    # (the thinker may end its reply between the frame and the Cancel: then it counts ok)
    expected = {name: cancelled_before[name] + (name not in done_first) for name in STAGES}
    if cancelled["thinker"] == cancelled_before["thinker"]:
        expected["thinker"] = cancelled_before["thinker"]
    assert cancelled == expected, f"before {cancelled_before} after {cancelled} done first {done_first}"


def _refusals(stack: Stack) -> str:
    """The last refusals each stage process logged (the engine says which request and why), for a
    failure's message."""
    out = []
    for log in sorted(stack.run_dir.glob("*.log")):
        out += [line for line in log.read_text().splitlines() if " refused: " in line][-5:]
    return "\n".join(out) or "(no refusal logged)"


async def _all_idle(addresses: list[str]) -> bool:
    for a in addresses:
        if not await stage_idle(a):
            return False
    return True


def test_cancels_at_random_points_leave_nothing_held(replicated: Stack) -> None:
    """Requests cancelled at random points through the gateway: every stage is idle and its
    shared-memory segments are back to the baseline soon after the last cancel (within 1 s is
    `omnistage bench faults`'s to measure; here a loaded 2-core box only bounds it)."""
    stages = [(name, a) for name in STAGES for a in replicated.addresses(name)]
    baseline = {a: run(faults.shm_segments(a)) for _, a in stages}
    rng = random.Random(3)

    def ended(outcome: str) -> dict[str, float]:
        return {name: sum(metric(a, "omnistage_stage_requests_finished_total", outcome=outcome)
                          for a in replicated.addresses(name)) for name in STAGES}  # fmt: skip

    refused_before, cancelled_before = ended("INVALID_ARGUMENT"), ended("CANCELLED")

    async def one(i: int) -> None:
        task = asyncio.create_task(generate(replicated.gateway_address, f"tell me about {i}", thinker_max_tokens=16,
                                            talker_max_tokens=32, timeout=60))  # fmt: skip
        await asyncio.sleep(rng.uniform(0.0, 1.5))
        task.cancel()
        # a request that finished before the cancel landed is fine too; either way nothing stays held
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await task

    async def go() -> None:
        for start in range(0, 24, 8):
            await asyncio.gather(*(one(i) for i in range(start, start + 8)))

    run(go())

    async def all_back() -> bool:
        for _, a in stages:
            if not await stage_idle(a) or await faults.shm_segments(a) > baseline[a]:
                return False
        return True

    took = run(faults.wait_until(all_back, limit_s=HANG_S))
    assert took is not None, f"a stage still holds a cancelled request {HANG_S:g} s after the last cancel"
    # a cancel reaches every stage below as one (the caller's call ended), not as a malformed
    # stream: the stages' teardown half-closed the call below before cancelling it
    assert ended("INVALID_ARGUMENT") == refused_before, _refusals(replicated)
    cancelled = ended("CANCELLED")
    assert all(cancelled[name] > cancelled_before[name] for name in STAGES), (cancelled_before, cancelled)


# ---- a replica killed under load ------------------------------------------------------------


PROMPTS = [f"Question {i}: tell me something about the number {i}." for i in range(16)]


def _busiest(s: Stack, stage: str) -> Any:
    """The replica of `stage` with the most calls open now: one that holds requests when it is
    hit (a replica hit between its calls loses none, and nothing is replayed)."""

    def open_streams(address: str) -> int:
        with grpc.insecure_channel(address) as ch:  # blocking, briefly: called in the client's loop
            return int(stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=5).load.open_streams)

    counts = [open_streams(a) for a in s.addresses(stage)]
    return s.child(stage, max(range(len(counts)), key=counts.__getitem__))


def _replies_under_fault(s: Stack, prompts: list[str], concurrency: int, victims: dict[int, str],
                         hit: Callable[[Any], None], **limits: Any
                         ) -> tuple[dict[int, Any], dict[int, Any], list[Any]]:  # fmt: skip
    """The fault-free replies, then those of the same run in which `hit` lands on the busiest
    replica of stage `victims[n]` at the nth request's first audio; no request fails in either,
    and every victim was hit (returned, in order)."""
    baseline, errors = run(faults.closed_loop(s.gateway_address, prompts, concurrency, 120, **limits))
    assert not errors, errors
    seen: list[int] = []
    hits: list[Any] = []

    def on_audio(i: int) -> None:
        seen.append(i)
        stage = victims.get(len(seen))
        if stage is not None:
            victim = _busiest(s, stage)
            hit(victim)
            hits.append(victim)

    faulted, errors = run(faults.closed_loop(s.gateway_address, prompts, concurrency, 120, on_first_audio=on_audio,
                                             **limits))  # fmt: skip
    assert len(hits) == len(victims), "a victim was not hit during the run"
    assert not errors, f"{len(errors)} requests failed, e.g. {errors[0]}"
    return baseline, faulted, hits


def _assert_same_replies(faulted: dict[int, Any], baseline: dict[int, Any]) -> None:
    assert faulted.keys() == baseline.keys()
    for i, (base_ids, base_pcm) in baseline.items():
        ids, pcm = faulted[i]
        assert ids == base_ids, f"request {i}: text differs after failover"
        assert pcm.shape == base_pcm.shape, f"request {i}: {pcm.shape} samples, fault-free {base_pcm.shape}"
        np.testing.assert_allclose(pcm, base_pcm, atol=1e-5, err_msg=f"request {i}: audio differs after failover")


def _logs(s: Stack, name: str) -> str:
    return "".join(p.read_text(errors="replace") for p in s.run_dir.glob(f"{name}-*.log"))


def test_a_frozen_replica_under_load_loses_no_request(replicated: Stack) -> None:
    """SIGSTOP of one talker and one code2wav replica while 8 requests stream: a frozen process
    sends no reset, so only keepalive tells its callers it is gone. No request waits for its
    deadline (20 s here, against 4 s to notice); every reply equals the fault-free run's."""
    s = replicated
    victims = {2: "code2wav", 4: "talker"}  # at the nth first audio
    frozen: list[Any] = []

    def freeze(victim: Any) -> None:
        os.kill(victim.proc.pid, signal.SIGSTOP)
        frozen.append(victim)

    try:
        baseline, faulted, _ = _replies_under_fault(s, PROMPTS, 8, victims, freeze, thinker_max_tokens=12,
                                                    talker_max_tokens=24, timeout=20)  # fmt: skip
    finally:
        for victim in frozen:
            os.kill(victim.proc.pid, signal.SIGCONT)
    for caller, lost in (("thinker", "talker"), ("talker", "code2wav")):
        assert f"lost its {lost} call" in _logs(s, caller), f"no {caller} replayed a request on another {lost} replica"
    _assert_same_replies(faulted, baseline)


def test_killing_one_replica_of_each_stage_under_load_loses_no_request(replicated: Stack) -> None:
    """SIGKILL of one replica of the thinker, the talker and code2wav while 8 requests stream:
    no request fails, and every reply equals the fault-free run's (failover with replay)."""
    s = replicated
    victims = {2: "code2wav", 5: "talker", 8: "thinker"}  # at the nth first audio
    baseline, faulted, hits = _replies_under_fault(s, PROMPTS, 8, victims, lambda v: v.proc.kill(),
                                                   thinker_max_tokens=12, talker_max_tokens=24)  # fmt: skip
    assert len(faulted) == len(PROMPTS)
    assert all(v.proc.poll() is not None for v in hits), "a victim was not killed during the run"
    # each hop did replay (the victims held requests when they died)
    for caller, lost in (("gateway", "thinker"), ("thinker", "talker"), ("talker", "code2wav")):
        assert f"lost its {lost} call" in _logs(s, caller), f"no {caller} replayed a request on another {lost} replica"
    _assert_same_replies(faulted, baseline)


def test_a_request_too_big_to_replay_on_a_hop_is_replayed_by_the_gateway(tiny_dir: Path, tmp_path: Path) -> None:
    """With `failover.replay_budget_bytes: 0` (what one request may keep) no stage keeps what it
    sent, so none can replay a lost call itself: it fails the request as its own loss, and the
    gateway, which holds the whole request, replays it from the top. SIGKILL of a talker and a
    code2wav replica loses no request, and every reply equals the fault-free run's. (A process's
    bound, `failover.replay_memory_bytes`, ends a request's replay the same way:
    tests/wire/test_stage_server_units.py; one stack for both doubled this test's time.)"""
    why = "the request sent more than failover.replay_budget_bytes (0)"
    cfg = stack_config(thinker={"replicas": 1}, talker={"replicas": 2}, code2wav={"replicas": 2},
                       failover={"replay_budget_bytes": 0})  # fmt: skip
    with start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path) as s:
        victims = {1: "code2wav", 3: "talker"}  # at the nth first audio
        baseline, faulted, hits = _replies_under_fault(s, PROMPTS[:8], 4, victims, lambda v: v.proc.kill(),
                                                       thinker_max_tokens=12, talker_max_tokens=24)  # fmt: skip
        assert all(v.proc.poll() is not None for v in hits), "a victim was not killed during the run"
        gateway_log = _logs(s, "gateway")
    assert f"cannot replay it: {why}" in gateway_log
    assert "lost its thinker call" in gateway_log, "the gateway replayed no request"
    _assert_same_replies(faulted, baseline)


def test_requests_past_the_gateways_limit_are_refused_at_once(tiny_dir: Path, tmp_path: Path) -> None:
    """`gateway.max_in_flight` requests run; one more is refused RESOURCE_EXHAUSTED at once (with
    gRPC's retry pushback; HTTP 429 with retry-after), not queued to its deadline; once they end, requests run again."""
    import httpx

    cfg = stack_config(gateway={"max_in_flight": 2}, talker={"replicas": 1})
    with start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path) as s:

        async def go() -> tuple[grpc.StatusCode, float, httpx.Response]:
            async with grpc.aio.insecure_channel(s.gateway_address) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                held = [stub.Generate(build_request(f"tell me a long story {i}", thinker_max_tokens=200,
                                                    talker_max_tokens=400), timeout=120) for i in range(2)]  # fmt: skip
                for call in held:
                    await call.read()  # running: its first reply is out
                t0 = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Generate(build_request("one more", thinker_max_tokens=4), timeout=60).read()
                refused_in = time.monotonic() - t0
                # gRPC's retry pushback, as HTTP's retry-after (a client with a retry policy waits it)
                assert ("grpc-retry-pushback-ms", "1000") in tuple(err.value.trailing_metadata() or ())
                async with httpx.AsyncClient() as http:
                    r = await http.post(f"http://{s.http_address}/v1/chat/completions", timeout=60,
                                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                for call in held:
                    call.cancel()
                return err.value.code(), refused_in, r

        code, refused_in, r = run(go())
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused_in < 20  # (not queued to its 60 s deadline)
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert "gateway.max_in_flight" in r.json()["error"]["message"]
        reply = run(generate(s.gateway_address, "hi", thinker_max_tokens=3, talker_max_tokens=4, timeout=60))
        assert reply.token_ids
