"""Fault probes against a running stack: malformed messages straight to each stage's
Stage.Stream, requests cancelled at random points, and the checks after each (every call ended
with the right status in time, stage loads and shared-memory segments back to their baseline,
RSS growth). The tests run the short forms; `omnistage bench faults` the long ones.

Every malformed call is built to be invalid whatever the stage does with it: bytes that do not
parse (checked here with protobuf itself), or a message that parses but breaks a rule every
stage enforces (Start first and once, a request id, a known mode, finite sampling in range,
tensor names, dtypes, shapes and offsets its edge carries, input complete before the end).
Each must end INVALID_ARGUMENT within `call_limit_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError

from omnistage.topology import STAGES
from omnistage.v1 import stage_pb2, stage_pb2_grpc
from omnistage.wire import encode_chunk

STREAM = "/omnistage.v1.Stage/Stream"


@dataclass(frozen=True)
class Dims:
    """What a stage's input looks like for a checkpoint (from its spec)."""

    thinker_hidden: int
    num_code_groups: int
    vocab: int
    codebook_size: int
    media_id: int  # an audio/image/video placeholder id

    @classmethod
    def of(cls, spec: Any) -> Dims:
        return cls(int(spec.thinker_hidden), int(spec.num_code_groups), int(spec.thinker_vocab),
                   int(spec.codebook_size), int(spec.multimodal_ids[0]))  # fmt: skip


@dataclass(frozen=True)
class Probe:
    kind: str  # what is wrong with it
    messages: list[bytes]  # raw StageRequest bytes, in order; the caller then half-closes


def _start(rid: str, **fields: Any) -> stage_pb2.Start:
    start = stage_pb2.Start(request_id=rid, want_audio=True, **fields)
    start.sampling["thinker"].max_tokens = 4
    start.sampling["talker"].max_tokens = 4
    return start


def _req(start: stage_pb2.Start | None = None, chunk: Any = None) -> bytes:
    if start is not None:
        return stage_pb2.StageRequest(start=start).SerializeToString()
    if chunk is not None:
        return stage_pb2.StageRequest(chunk=chunk).SerializeToString()
    return stage_pb2.StageRequest().SerializeToString()


def valid_input(stage: str, dims: Dims, rng: random.Random) -> list[Any]:
    """Chunk messages a stage accepts as a whole request's input."""
    if stage == "thinker":
        ids = torch.tensor([rng.randrange(dims.vocab) for _ in range(rng.randint(2, 12))])
        return [encode_chunk({"ids": ids}, offset=0, length=len(ids), finished=True)]
    if stage == "talker":
        n = rng.randint(2, 8)
        prompt = encode_chunk({"prompt_ids": torch.zeros(n, dtype=torch.long),
                               "prompt_embed": torch.zeros(n, dims.thinker_hidden)}, offset=0, length=0)  # fmt: skip
        tokens = [encode_chunk({"ids": torch.tensor([1]), "embed": torch.zeros(1, dims.thinker_hidden)},
                               offset=i, length=1, finished=i == 2) for i in range(3)]  # fmt: skip
        return [prompt, *tokens]
    codes = torch.zeros(dims.num_code_groups, rng.randint(1, 4), dtype=torch.long)
    return [encode_chunk({"codes": codes}, offset=0, length=int(codes.shape[1])),
            encode_chunk({}, offset=int(codes.shape[1]), length=0, finished=True)]  # fmt: skip


def _undecodable(valid: bytes, rng: random.Random) -> bytes:
    """Bytes protobuf refuses to parse as a StageRequest, derived from `valid` or random."""
    for _ in range(100):
        how = rng.randrange(4)
        if how == 0 and len(valid) > 1:  # cut short
            data = valid[: rng.randrange(1, len(valid))]
        elif how == 1:  # a field announcing more bytes than follow
            data = valid + bytes([0x12, 0xFF, 0x7F]) + bytes(rng.randrange(16))
        elif how == 2:  # an invalid wire type (7) or field number 0
            data = valid + rng.choice([b"\x0f", b"\x00", b"\x07\x01"])
        else:  # random bytes
            data = rng.randbytes(rng.randint(1, 64))
        try:
            stage_pb2.StageRequest.FromString(data)
        except DecodeError:
            return data
    return valid + b"\x0f"  # always a DecodeError (wire type 7)


def _bad_chunks(stage: str, dims: Dims, rng: random.Random) -> list[tuple[str, Any]]:
    """Chunks that parse but that the stage's edge refuses."""
    h, g = dims.thinker_hidden, dims.num_code_groups
    if stage == "thinker":
        ids = torch.tensor([1, 2, 3])
        return [("wrong-name", encode_chunk({"tokens": ids}, offset=0, length=3, finished=True)),
                ("wrong-dtype", encode_chunk({"ids": ids.float()}, offset=0, length=3, finished=True)),
                ("wrong-shape", encode_chunk({"ids": ids.reshape(1, 3)}, offset=0, length=3, finished=True)),
                ("offset-gap", encode_chunk({"ids": ids}, offset=5, length=3, finished=True)),
                ("length-mismatch", encode_chunk({"ids": ids}, offset=0, length=7, finished=True)),
                ("empty-prompt", encode_chunk({"ids": ids[:0]}, offset=0, length=0, finished=True)),
                ("id-out-of-vocab", encode_chunk({"ids": torch.tensor([dims.vocab + 5])}, offset=0, length=1,
                                                 finished=True))]  # fmt: skip
    if stage == "talker":
        return [("wrong-name", encode_chunk({"prompt_ids": torch.zeros(2, dtype=torch.long)}, offset=0, length=0)),
                ("wrong-width", encode_chunk({"prompt_ids": torch.zeros(2, dtype=torch.long),
                                              "prompt_embed": torch.zeros(2, h + 1)}, offset=0, length=0)),
                ("rows-mismatch", encode_chunk({"prompt_ids": torch.zeros(2, dtype=torch.long),
                                                "prompt_embed": torch.zeros(3, h)}, offset=0, length=0)),
                ("float-ids", encode_chunk({"prompt_ids": torch.zeros(2), "prompt_embed": torch.zeros(2, h)},
                                           offset=0, length=0)),
                ("offset-gap", encode_chunk({"prompt_ids": torch.zeros(2, dtype=torch.long),
                                             "prompt_embed": torch.zeros(2, h)}, offset=4, length=0)),
                # refused as they arrive: in the step they would share, they failed every request in it
                ("nan-embed", encode_chunk({"prompt_ids": torch.zeros(2, dtype=torch.long),
                                            "prompt_embed": torch.full((2, h), math.nan)}, offset=0, length=0)),
                ("media-without-hidden", encode_chunk({"prompt_ids": torch.tensor([0, dims.media_id]),
                                                       "prompt_embed": torch.zeros(2, h)}, offset=0, length=0)),
                ("nan-seconds-per-grid", encode_chunk({"prompt_ids": torch.zeros(2, dtype=torch.long),
                                                       "prompt_embed": torch.zeros(2, h),
                                                       "video_second_per_grid": torch.tensor([math.nan])},
                                                      offset=0, length=0))]  # fmt: skip
    return [("wrong-groups", encode_chunk({"codes": torch.zeros(g + 1, 2, dtype=torch.long)}, offset=0, length=2)),
            ("float-codes", encode_chunk({"codes": torch.zeros(g, 2)}, offset=0, length=2)),
            ("offset-gap", encode_chunk({"codes": torch.zeros(g, 2, dtype=torch.long)}, offset=3, length=2)),
            ("length-mismatch", encode_chunk({"codes": torch.zeros(g, 2, dtype=torch.long)}, offset=0, length=5)),
            ("wrong-name", encode_chunk({"audio": torch.zeros(8)}, offset=0, length=8)),
            ("code-out-of-range", encode_chunk({"codes": torch.full((g, 2), dims.codebook_size)}, offset=0,
                                               length=2)),
            ("decode-now-not-a-bool", encode_chunk({"codes": torch.zeros(g, 2, dtype=torch.long)}, offset=0,
                                                   length=2, meta={"decode_now": 1}))]  # fmt: skip


def _bad_starts(stage: str, rid: str) -> list[tuple[str, stage_pb2.Start]]:
    nan = stage_pb2.Start(request_id=rid)
    nan.sampling[stage].temperature = math.nan
    nan.sampling[stage].do_sample = True
    inf = stage_pb2.Start(request_id=rid)
    inf.sampling[stage].repetition_penalty = math.inf
    top_p = stage_pb2.Start(request_id=rid)
    top_p.sampling[stage].top_p = 1.5
    huge = stage_pb2.Start(request_id=rid)
    huge.sampling[stage].max_tokens = 2**31 - 1
    negative = stage_pb2.Start(request_id=rid)
    negative.sampling[stage].top_k = -3
    out = [("empty-request-id", stage_pb2.Start()), ("unknown-mode", stage_pb2.Start(request_id=rid, mode=7)),  # type: ignore[arg-type]
           ("negative-mode", stage_pb2.Start(request_id=rid, mode=-3)),  # type: ignore[arg-type]
           ("nan-deadline", stage_pb2.Start(request_id=rid, deadline_unix_s=math.nan)),
           ("unknown-sampling-stage", stage_pb2.Start(request_id=rid,
                                                      sampling={"vocoder": stage_pb2.SamplingParams()}))]  # fmt: skip
    if stage != "code2wav":  # code2wav samples nothing
        out += [("nan-temperature", nan), ("inf-repetition-penalty", inf), ("top-p-over-1", top_p),
                ("max-tokens-huge", huge), ("negative-top-k", negative)]  # fmt: skip
    return out


def malformed_probes(stage: str, dims: Dims, n: int, seed: int = 0) -> list[Probe]:
    """`n` calls, each with exactly one thing wrong, spread over every kind and position."""
    rng = random.Random(seed)
    probes: list[Probe] = []
    while len(probes) < n:
        i = len(probes)
        rid = f"fault-{stage}-{seed}-{i}"
        good = [_req(_start(rid)), *(_req(chunk=c) for c in valid_input(stage, dims, rng))]
        family = rng.randrange(6)
        if family == 0:  # an undecodable message at any position, the first included
            at = rng.randrange(len(good))
            probes.append(Probe(f"undecodable@{at}", [*good[:at], _undecodable(good[at], rng)]))
        elif family == 1:  # a chunk, or an empty message, where Start belongs
            first = rng.choice([good[1], _req()])
            probes.append(Probe("no-start" if first != _req() else "empty-first", [first, *good[1:]]))
        elif family == 2:  # a second Start, or an empty message, after some input
            at = rng.randrange(1, len(good) + 1)
            extra = rng.choice([good[0], _req()])
            probes.append(Probe("second-start" if extra == good[0] else "empty-later", [*good[:at], extra]))
        elif family == 3:  # a Start breaking a rule
            kind, start = rng.choice(_bad_starts(stage, rid))
            probes.append(Probe(kind, [_req(start), *good[1:]]))
        elif family == 4:  # a chunk the edge refuses, after the valid ones before it
            kind, chunk = rng.choice(_bad_chunks(stage, dims, rng))
            probes.append(Probe(kind, [good[0], _req(chunk=chunk)]))
        else:  # the input ends before the request is complete
            cut = rng.randrange(1, len(good))
            probes.append(Probe("input-incomplete", good[:cut]))
    return probes


@dataclass
class ProbeResult:
    kind: str
    code: str
    seconds: float
    details: str


async def send(channel: grpc.aio.Channel, probe: Probe, limit_s: float) -> ProbeResult:
    """One call with the probe's bytes as they are; half-closes after the last."""
    call = channel.stream_stream(STREAM, request_serializer=None, response_deserializer=None)

    async def messages() -> Any:
        for m in probe.messages:
            yield m

    t0 = time.perf_counter()
    try:
        async for _ in call(messages(), timeout=limit_s):
            pass
        return ProbeResult(probe.kind, "OK", time.perf_counter() - t0, "")
    except grpc.aio.AioRpcError as e:
        return ProbeResult(probe.kind, e.code().name, time.perf_counter() - t0, e.details() or "")


async def run_probes(address: str, probes: Sequence[Probe], *, concurrency: int = 16,
                     limit_s: float = 5.0) -> list[ProbeResult]:  # fmt: skip
    """Every probe against `address`, `concurrency` at a time; bounded by count and `limit_s` each."""
    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:

        async def one(p: Probe) -> ProbeResult:
            async with sem:
                return await send(channel, p, limit_s)

        return await asyncio.gather(*(one(p) for p in probes))


@dataclass
class Summary:
    calls: int
    codes: Counter[str]
    slowest_s: float
    p99_s: float
    wrong: list[ProbeResult] = field(default_factory=list)  # not INVALID_ARGUMENT, or slower than the limit

    def to_json(self) -> dict[str, Any]:
        return {"calls": self.calls, "codes": dict(self.codes), "slowest_s": self.slowest_s, "p99_s": self.p99_s,
                "wrong": [vars(w) for w in self.wrong[:20]]}  # fmt: skip


def summarize(results: Sequence[ProbeResult], within_s: float) -> Summary:
    times = sorted(r.seconds for r in results)
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else 0.0
    wrong = [r for r in results if r.code != "INVALID_ARGUMENT" or r.seconds > within_s]
    return Summary(len(results), Counter(r.code for r in results), times[-1] if times else 0.0, p99, wrong)


async def wait_until(predicate: Callable[[], Any], limit_s: float, poll_s: float = 0.02) -> float | None:
    """Seconds until `predicate()` (awaited when a coroutine) holds, or None after `limit_s`."""
    t0 = time.perf_counter()
    while True:
        got = predicate()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > limit_s:
            return None
        await asyncio.sleep(poll_s)


async def stage_idle(address: str) -> bool:
    """No request held by the stage at `address`: nothing running, waiting or open."""
    async with grpc.aio.insecure_channel(address) as ch:
        info = await stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=5)
    load = info.load
    return load.running == 0 and load.waiting == 0 and load.waiting_for_input == 0 and load.open_streams == 0


async def shm_segments(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        info = await stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=5)
    return int(info.load.shm_segments)


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ---- `omnistage bench faults`: the long forms --------------------------------------------------


def _log(msg: str) -> None:
    print(f"[faults] {msg}", flush=True)


async def request(address: str, prompt: str, on_first_audio: Callable[[], None] | None = None,
                  timeout: float = 300, **kw: Any) -> tuple[list[int], Any]:  # fmt: skip
    """One greedy request's token ids and audio samples; `on_first_audio()` as its audio starts."""
    import numpy as np

    from gateway.client import stream_generate

    ids: list[int] = []
    pcm: list[Any] = []
    async for ev in stream_generate(address, prompt, timeout=timeout, **kw):
        ids.extend(ev.token_ids)
        if ev.kind == "audio" and ev.pcm is not None:
            if not pcm and on_first_audio is not None:
                on_first_audio()
            pcm.append(ev.pcm)
    return ids, (np.concatenate(pcm) if pcm else np.zeros(0, np.float32))


async def closed_loop(address: str, prompts: list[str], concurrency: int, limit_s: float,
                      on_done: Callable[[int], None] | None = None,
                      on_first_audio: Callable[[int], None] | None = None, **kw: Any
                      ) -> tuple[dict[int, Any], list[str]]:  # fmt: skip
    """Every prompt (greedy), `concurrency` at a time, none started after `limit_s`:
    ({index: (ids, samples)}, errors). `on_first_audio(i)` as request i's audio starts."""
    sem = asyncio.Semaphore(concurrency)
    out: dict[int, Any] = {}
    errors: list[str] = []
    t_end = time.monotonic() + limit_s

    async def one(i: int) -> None:
        async with sem:
            if time.monotonic() > t_end:
                return
            first = None if on_first_audio is None else (lambda: on_first_audio(i))
            try:
                out[i] = await request(address, prompts[i], first, **kw)
            except grpc.aio.AioRpcError as e:
                errors.append(f"{e.code().name}: {e.details()}")
            if on_done is not None:
                on_done(len(out) + len(errors))

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return out, errors


def _prompts(n: int) -> list[str]:
    return [f"Question {i % 64}: tell me about {i % 64}." for i in range(n)]


def main(model: Any, malformed: int, cancels: int, kill_requests: int, soak_requests: int, time_limit_s: float,
         json_out: Any) -> dict[str, Any]:  # fmt: skip
    """Start a stack with two replicas of every stage and run each fault probe against it."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from benchmarks.common import machine_info, write_json
    from benchmarks.harness import free_port_blocks
    from omnistage.cli.serve import start_stack
    from omnistage.config import parse_config
    from omnistage.models.checkpoint import open_checkpoint

    base = free_port_blocks([12])[0]
    cfg = parse_config({"gateway": {"port": base, "http_port": None}, "thinker": {"base_port": base + 2, "replicas": 2},
                        "talker": {"base_port": base + 4, "replicas": 2},
                        "code2wav": {"base_port": base + 8, "replicas": 2},
                        "timeouts": {"input_wait_timeout_s": 10}}, "bench faults")  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="omnistage-faults-"))
    result: dict[str, Any] = {"schema": "omnistage.bench.faults/1", "machine": machine_info()}
    t0 = time.monotonic()
    with start_stack(cfg, model=str(model) if model else None, log_dir=log_dir) as stack:
        spec = open_checkpoint(stack.model_dir).spec
        dims = Dims.of(spec)
        unreached = int(spec.tts_pad_id)  # an id of the vocabulary the thinker does not emit
        stages = [(c.role, c.address) for c in stack.children if c.name != "gateway"]
        _log(f"stack up (logs in {log_dir})")

        # 1. malformed messages, per stage
        rows = {}
        for name in STAGES:
            child = stack.child(name, 0)
            probes = malformed_probes(name, dims, malformed, seed=7)
            # RSS from the end of the first tenth (the first calls warm allocators and the model
            # up: a valid prefix may run a forward) to the last call
            warm = max(1, len(probes) // 10)
            results = asyncio.run(run_probes(child.address, probes[:warm], concurrency=32, limit_s=10.0))
            rss0 = rss_bytes(child.proc.pid)
            results += asyncio.run(run_probes(child.address, probes[warm:], concurrency=32, limit_s=10.0))
            s = summarize(results, within_s=1.0)
            idle = asyncio.run(wait_until(lambda a=child.address: stage_idle(a), limit_s=5.0))
            rss1 = rss_bytes(child.proc.pid)
            # A second pass of as many new calls: growth that goes on per call shows here, a
            # one-off warm-up (native caches and heap high-water marks filling) does not.
            again = malformed_probes(name, dims, malformed, seed=8)
            s2 = summarize(asyncio.run(run_probes(child.address, again, concurrency=32, limit_s=10.0)), within_s=1.0)
            growth, growth2 = rss1 / rss0 - 1, rss_bytes(child.proc.pid) / rss1 - 1
            rows[name] = {**s.to_json(), "kinds": len({p.kind.split("@")[0] for p in probes}),
                          "rss_growth_after_first_tenth": growth, "second_pass": s2.to_json(),
                          "rss_growth_over_second_pass": growth2, "idle_after_s": idle,
                          "alive": child.proc.poll() is None}  # fmt: skip
            idle_text = "never idle (5 s)" if idle is None else f"idle {1000 * idle:.0f} ms after"
            _log(f"malformed {name}: {s.calls} calls, codes {dict(s.codes)}, p99 {1000 * s.p99_s:.0f} ms, "
                 f"slowest {1000 * s.slowest_s:.0f} ms, RSS growth after the first tenth {100 * growth:+.2f} %, "
                 f"{idle_text}; a second pass of {s2.calls}: codes {dict(s2.codes)}, "
                 f"RSS growth over it {100 * growth2:+.2f} %")  # fmt: skip
        result["malformed"] = rows

        # 2. cancels at random points
        rng = random.Random(11)
        baseline_shm = {a: asyncio.run(shm_segments(a)) for _, a in stages}

        async def cancel_one(i: int) -> None:
            task = asyncio.create_task(request(stack.gateway_address, f"tell me about {i}",
                                                thinker_max_tokens=16, talker_max_tokens=32))  # fmt: skip
            await asyncio.sleep(rng.uniform(0.0, 2.0))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await task

        async def cancels_run() -> float | None:
            t_end = time.monotonic() + time_limit_s
            for start in range(0, cancels, 16):
                if time.monotonic() > t_end:
                    break
                await asyncio.gather(*(cancel_one(i) for i in range(start, min(cancels, start + 16))))

            async def back() -> bool:
                for _, a in stages:
                    if not await stage_idle(a) or await shm_segments(a) > baseline_shm[a]:
                        return False
                return True

            return await wait_until(back, limit_s=10.0)

        back_s = asyncio.run(cancels_run())
        result["cancels"] = {"requests": cancels, "back_to_baseline_s": back_s}
        _log(f"cancels: {cancels} requests; loads and shm back to baseline after "
             f"{'never (10 s)' if back_s is None else f'{1000 * back_s:.0f} ms'}")

        # 3. eight clients that take their first audio and then read nothing for 20 s
        live = [c for c in stack.children if c.proc.poll() is None]
        rss_before = {c.role: rss_bytes(c.proc.pid) for c in live}

        async def stalled_clients() -> tuple[dict[str, int], list[str]]:
            from omnistage.v1 import gateway_pb2, gateway_pb2_grpc

            peak: dict[str, int] = dict(rss_before)
            outcomes: list[str] = []

            async def one(i: int) -> None:
                request = gateway_pb2.GenerateRequest(prompt=f"talk about {i}", want_audio=True)
                request.sampling["thinker"].max_tokens = 400
                request.sampling["thinker"].stop_ids.append(unreached)  # no reachable stop id: all 400 tokens
                request.sampling["talker"].max_tokens = 1500
                async with grpc.aio.insecure_channel(stack.gateway_address) as ch:
                    call = gateway_pb2_grpc.GatewayStub(ch).Generate(request, timeout=300)
                    await call.read()
                    await asyncio.sleep(20)
                    try:
                        while await call.read() is not grpc.aio.EOF:
                            pass
                        outcomes.append("OK")
                    except grpc.aio.AioRpcError as e:
                        outcomes.append(e.code().name)

            async def watch() -> None:
                for _ in range(40):
                    await asyncio.sleep(0.5)
                    for c in live:
                        peak[c.role] = max(peak[c.role], rss_bytes(c.proc.pid))

            await asyncio.gather(watch(), *(one(i) for i in range(8)))
            return peak, outcomes

        peak, outcomes = asyncio.run(stalled_clients())
        growth_mb = {r: (peak[r] - rss_before[r]) / 2**20 for r in peak}
        result["stalled_clients"] = {"clients": 8, "stall_s": 20, "peak_rss_growth_mib": growth_mb,
                                     "outcomes": dict(Counter(outcomes))}  # fmt: skip
        grown = ", ".join(f"{r} {g:+.1f} MiB" for r, g in growth_mb.items())
        _log(f"8 stalled clients for 20 s: peak RSS growth {grown}; then {dict(Counter(outcomes))}")

        # 4. one replica of each stage killed under c=8 load
        kw = {"thinker_max_tokens": 12, "talker_max_tokens": 24}
        kill_prompts = _prompts(kill_requests)
        clean, clean_errors = asyncio.run(closed_loop(stack.gateway_address, kill_prompts, 8, time_limit_s, **kw))
        victims = {kill_requests // 8: stack.child("code2wav", 1), kill_requests // 4: stack.child("talker", 1),
                   kill_requests // 2: stack.child("thinker", 1)}  # fmt: skip
        firsts: list[int] = []

        def on_first_audio(i: int) -> None:
            firsts.append(i)
            victim = victims.get(len(firsts))
            if victim is not None:
                _log(f"SIGKILL {victim.role} (pid {victim.proc.pid}) after {len(firsts)} first audios")
                victim.proc.kill()

        faulted, errors = asyncio.run(closed_loop(stack.gateway_address, kill_prompts, 8, time_limit_s,
                                                   on_first_audio=on_first_audio, **kw))  # fmt: skip
        same = sum(1 for i, (ids, pcm) in faulted.items() if i in clean and ids == clean[i][0]
                   and pcm.shape == clean[i][1].shape and np.allclose(pcm, clean[i][1], atol=1e-5))  # fmt: skip
        replays = sum(p.read_text(errors="replace").count("replaying it") for p in log_dir.glob("*.log"))
        result["kill"] = {"requests": kill_requests, "fault_free_errors": len(clean_errors), "failed": len(errors),
                          "completed": len(faulted), "equal_to_fault_free": same, "replays": replays,
                          "errors": errors[:10]}  # fmt: skip
        _log(f"kill one replica of each stage at c=8: {len(faulted)}/{kill_requests} completed, {len(errors)} failed, "
             f"{same} equal to the fault-free run, {replays} replays")

        # 5. soak at c=16 on what is left (one replica of each stage), RSS from request 200 to the end
        rss_at: dict[str, int] = {}
        survivors = {c.role: c.proc.pid for c in stack.children if c.proc.poll() is None}

        def on_done(count: int) -> None:
            if count == min(200, soak_requests // 2) and not rss_at:
                rss_at.update({r: rss_bytes(p) for r, p in survivors.items()})

        soak, soak_errors = asyncio.run(closed_loop(stack.gateway_address, _prompts(soak_requests), 16, time_limit_s,
                                                     on_done=on_done, **kw))  # fmt: skip
        growth = {r: rss_bytes(p) / rss_at[r] - 1 for r, p in survivors.items() if r in rss_at}
        result["soak"] = {"requests": soak_requests, "completed": len(soak), "errors": len(soak_errors),
                          "rss_growth_from": min(200, soak_requests // 2), "rss_growth": growth}  # fmt: skip
        _log(f"soak c=16: {len(soak)}/{soak_requests} completed, {len(soak_errors)} errors, RSS growth from request "
             f"{min(200, soak_requests // 2)}: " + ", ".join(f"{r} {100 * g:+.2f} %" for r, g in growth.items()))
    result["total_seconds"] = time.monotonic() - t0
    if json_out is not None:
        write_json(json_out, result)
    return result

