"""What relaying audio costs the thinker (`omnistage bench relay`).

Every frame the talker makes and every audio chunk code2wav makes travels up through the
thinker (and the talker) to the gateway. Two measurements:

* load: the same closed-loop load (concurrency c, greedy) against a stack, text-only (the
  talker is never called) and with audio, reading the thinker's mean engine step time from its
  `Info` (step_seconds_total / steps_total) over each run; the levels alternate (text, audio,
  text, audio) so drift on a shared machine hits both. The mean batch differs between the two
  (with audio, requests stay open longer and reach the thinker spread out), so the step times
  are not the relay's cost alone; they are reported with the batch sizes.
* per message: the exact responses one audio request sends up through the thinker, captured as
  bytes, and the time a stage spends relaying them: parsed into messages and serialized again
  (`parse_response` + `serialize`, what stages did before), or passed on as the bytes they came
  in (what they do now: gRPC hands the relaying stage bytes and takes bytes back).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from gateway.client import generate
from omnistage.v1 import stage_pb2, stage_pb2_grpc

PROMPTS = [
    "Tell me a short story about a robot who learns to sing.",
    "What is the weather like in the city this afternoon?",
    "Can you explain how streaming works?",
    "Where is the nearest train station from here?",
]


async def _load(address: str) -> stage_pb2.Load:
    async with grpc.aio.insecure_channel(address) as ch:
        return (await stage_pb2_grpc.StageStub(ch).Info(stage_pb2.InfoRequest(), timeout=10)).load


async def _level(target: str, thinker: str, want_audio: bool, requests: int, concurrency: int) -> dict[str, Any]:
    before = await _load(thinker)
    queue = list(range(requests))
    t0 = time.perf_counter()

    async def worker() -> None:
        while queue:
            i = queue.pop()
            await generate(target, PROMPTS[i % len(PROMPTS)], want_audio=want_audio, thinker_max_tokens=24,
                           talker_max_tokens=48, timeout=300)  # fmt: skip

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    after = await _load(thinker)
    steps = after.steps_total - before.steps_total
    return {
        "audio": want_audio,
        "requests": requests,
        "wall_s": wall,
        "steps": steps,
        "mean_batch": (after.step_requests_total - before.step_requests_total) / steps if steps else None,
        "mean_step_ms": 1000 * (after.step_seconds_total - before.step_seconds_total) / steps if steps else None,
    }


async def _capture(thinker: str, prompt_ids: list[int]) -> list[bytes]:
    """The raw StageResponses of one greedy audio request sent straight into the thinker."""
    import torch

    from omnistage.wire import encode_chunk

    ids = prompt_ids
    start = stage_pb2.Start(request_id=f"relay-{time.time_ns()}", want_audio=True)
    start.sampling["thinker"].max_tokens = 24
    start.sampling["talker"].max_tokens = 48
    start.sampling["talker"].do_sample = False
    start.sampling["talker"].repetition_penalty = 1.0

    async def messages() -> Any:
        yield stage_pb2.StageRequest(start=start)
        chunk = encode_chunk({"ids": torch.tensor(ids)}, finished=True, meta={"n": len(ids)})
        yield stage_pb2.StageRequest(chunk=chunk)

    async with grpc.aio.insecure_channel(thinker) as ch:
        call = ch.stream_stream("/omnistage.v1.Stage/Stream", request_serializer=lambda m: m.SerializeToString(),
                                response_deserializer=None)  # fmt: skip
        return [b async for b in call(messages(), timeout=120)]


def relay_cost(wire: list[bytes], reps: int = 20) -> dict[str, Any]:
    from omnistage.wire.wire_view import parse_response, serialize

    def timed(fn: Any) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for b in wire:
                fn(b)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    parsed = timed(lambda b: serialize(parse_response(b)))
    passed = timed(serialize)
    return {"messages": len(wire), "bytes": sum(map(len, wire)), "parse_and_serialize_ms": 1000 * parsed,
            "pass_bytes_ms": 1000 * passed, "ratio": parsed / passed if passed else None}  # fmt: skip


def _prompt_ids(model_dir: Path | None) -> list[int]:
    from omnistage.cli.serve import default_model_dir
    from omnistage.models import load_tokenizer, open_checkpoint

    ckpt = open_checkpoint(model_dir or default_model_dir())
    return ckpt.family.prompt_ids(load_tokenizer(ckpt), [{"role": "user", "content": PROMPTS[0]}])


def run(target: str, thinker: str, requests: int = 48, concurrency: int = 16, rounds: int = 2,
        model_dir: Path | None = None) -> dict[str, Any]:  # fmt: skip
    levels = []
    for _ in range(rounds):
        for audio in (False, True):
            levels.append(asyncio.run(_level(target, thinker, audio, requests, concurrency)))
    text = [lv["mean_step_ms"] for lv in levels if not lv["audio"] and lv["mean_step_ms"]]
    audio = [lv["mean_step_ms"] for lv in levels if lv["audio"] and lv["mean_step_ms"]]
    ratio = statistics.median(audio) / statistics.median(text) if text and audio else None
    per_message = relay_cost(asyncio.run(_capture(thinker, _prompt_ids(model_dir))))
    audio_levels = [lv for lv in levels if lv["audio"]]
    rate = statistics.median(lv["requests"] / lv["wall_s"] for lv in audio_levels)
    per_message["relay_core_share_parsed"] = per_message["parse_and_serialize_ms"] / 1000 * rate
    return {"levels": levels, "concurrency": concurrency, "thinker_step_ms_text": statistics.median(text),
            "thinker_step_ms_audio": statistics.median(audio), "audio_over_text": ratio,
            "audio_requests_per_s": rate, "per_request_relay": per_message}  # fmt: skip


def main(target: str, thinker: str, requests: int, concurrency: int, json_out: Path | None = None) -> dict[str, Any]:
    res = run(target, thinker, requests, concurrency)
    for lv in res["levels"]:
        kind = "audio" if lv["audio"] else "text "
        print(f"{kind}  c={concurrency}  {lv['requests']} req  {lv['wall_s']:6.1f} s  steps {lv['steps']:5d}  "
              f"mean batch {lv['mean_batch']:.2f}  thinker step {lv['mean_step_ms']:.2f} ms")  # fmt: skip
    print(f"thinker mean step, median of rounds: text {res['thinker_step_ms_text']:.2f} ms, "
          f"audio {res['thinker_step_ms_audio']:.2f} ms, audio/text {res['audio_over_text']:.3f}")  # fmt: skip
    r = res["per_request_relay"]
    print(f"relaying one audio request's {r['messages']} responses ({r['bytes'] / 1e6:.2f} MB): parsed and "
          f"serialized {r['parse_and_serialize_ms']:.3f} ms, passed as bytes {r['pass_bytes_ms']:.4f} ms "
          f"({r['ratio']:.0f}x); at {res['audio_requests_per_s']:.2f} req/s parsing would take "
          f"{100 * r['relay_core_share_parsed']:.2f}% of a core per relaying stage")  # fmt: skip
    if json_out is not None:
        json_out.write_text(json.dumps(res, indent=2))
    return res
