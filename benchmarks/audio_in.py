"""Audio in (`omnistage bench audio-in`): time to first text and first audio for requests that
carry a spoken-length clip, against transformers' monolithic `generate()` on the same model
inputs in the same run.

The clips are made here (`benchmarks.media.tone`, encoded as WAV), nothing is checked in. Per
clip length the served stack runs the requests one at a time and at each closed-loop
concurrency; a text-only request of the same question (c = 1) shows what the audio adds. The
monolithic baseline gets exactly the model inputs the gateway builds (its decoding and the
checkpoint's processor, timed as part of the request as they are in the stack), runs greedy
`generate(return_audio=True)` one request at a time, and its first text token is timed with a
`thinker_streamer` (it returns audio only at the end, so its TTFA is its end-to-end time).
Every served reply's ids are checked against the baseline's. The stack it starts keeps no
decoded media (`media.decoded_cache_bytes: 0`): every request sends the same clip, and each is
to be decoded as a new one is (a stack given with `--target` should be started so too).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import media
from benchmarks.common import machine_info, ms, write_json
from benchmarks.harness import start_stacks

QUESTION = "What do you hear?"


def _stats(values: Sequence[float | None]) -> dict[str, float | None]:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"n": 0, "median": None, "p99": None}
    return {"n": len(vals), "median": statistics.median(vals), "p99": float(np.percentile(vals, 99))}


async def _served(target: str, wav: bytes | None, n: int, concurrency: int, kw: dict[str, Any]) -> list[Any]:
    from gateway.client import generate

    queue = list(range(n))
    replies: list[Any] = []

    async def worker() -> None:
        while queue:
            queue.pop()
            replies.append(await generate(target, QUESTION, audio=[wav] if wav else [], timeout=600, **kw))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return replies


class _FirstToken:
    """A `thinker_streamer`: the time generate() produced its first new token."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # the first call carries the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _monolithic(model: Any, prepare: Any, eos: int, kw: dict[str, Any], n: int
                ) -> tuple[list[dict[str, float | None]], list[int]]:  # fmt: skip
    """`prepare()`: the encoded request -> (ids, model inputs), timed with the request (the
    served stack decodes and runs the processor inside its TTFT too)."""
    import torch

    runs = []
    generated: list[int] = []
    for _ in range(n):
        streamer = _FirstToken()
        t0 = time.perf_counter()
        ids, inputs = prepare()
        with torch.no_grad():
            seq, _wav = model.generate(
                input_ids=torch.tensor([ids]), **inputs, thinker_streamer=streamer,
                thinker_max_new_tokens=kw["thinker_max_tokens"], talker_max_new_tokens=kw["talker_max_tokens"],
                talker_do_sample=False, talker_repetition_penalty=1.0, thinker_eos_token_id=eos, return_audio=True,
            )  # fmt: skip
        end = time.perf_counter() - t0
        generated = seq[0, len(ids) :].tolist()
        runs.append({"ttft": None if streamer.first is None else streamer.first - t0, "ttfa": end, "e2e": end})
    return runs, generated


def main(
    target: str | None, model: Path | None, clips: Sequence[float], requests: int, concurrency: Sequence[int],
    baseline_requests: int, thinker_max_tokens: int, talker_max_tokens: int, json_out: Path | None,
) -> dict[str, Any]:  # fmt: skip
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from gateway.client import build_request
    from gateway.media import decode_messages
    from omnistage.cli.serve import resolve_model
    from omnistage.config import DeployConfig
    from omnistage.models import load_tokenizer, open_checkpoint

    def log(msg: str) -> None:
        print(msg, flush=True)

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    ckpt = open_checkpoint(resolve_model(DeployConfig(), model))
    builder = ckpt.family.input_builder(ckpt, load_tokenizer(ckpt))
    rate = builder.sampling_rate
    log(f"monolithic baseline: loading {ckpt.path} ...")
    mono = Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    kw = {"thinker_max_tokens": thinker_max_tokens, "talker_max_tokens": talker_max_tokens}
    # every request sends the same clip: each decodes it, as a conversation's new turn does
    stack = None if target else start_stacks({"audio-in": {"media.decoded_cache_bytes": 0}}, model, log,
                                             "audio-in")["audio-in"]  # fmt: skip
    address = target or stack.gateway_address
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    try:
        asyncio.run(_served(address, None, 1, 1, kw))  # warm-up
        for seconds in clips:
            wav = media.encode_audio(media.tone(seconds, rate, 330.0 + 20 * seconds, seed=int(seconds)), rate, "wav")
            request = build_request(QUESTION, audio=[wav], **kw)

            def prepare(request: Any = request) -> tuple[list[int], dict[str, Any]]:
                messages, _ = decode_messages(request, DeployConfig().media, rate)
                return builder.build(messages)  # type: ignore[no-any-return]

            asyncio.run(_served(address, wav, 1, 1, kw))  # warm-up at this size
            log(f"clip {seconds:g} s ({len(wav)} bytes WAV, {len(prepare()[0])} prompt tokens): monolithic ...")
            mono_runs, mono_ids = _monolithic(mono, prepare, ckpt.spec.im_end_id, kw, baseline_requests)
            base = {k: _stats([r[k] for r in mono_runs]) for k in ("ttft", "ttfa", "e2e")}
            rows.append({"clip_s": seconds, "driver": "monolithic generate()", "concurrency": 1, **base})
            text_only = asyncio.run(_served(address, None, requests, 1, kw))
            rows.append({"clip_s": seconds, "driver": "served, text only (same question)", "concurrency": 1,
                         **_reply_stats(text_only)})  # fmt: skip
            for c in concurrency:
                log(f"clip {seconds:g} s: served at concurrency {c} ...")
                replies = asyncio.run(_served(address, wav, requests, c, kw))
                row = {"clip_s": seconds, "driver": "served (gRPC stack)", "concurrency": c, **_reply_stats(replies)}
                for key in ("ttft", "ttfa"):
                    mine, theirs = row[key]["median"], base[key]["median"]
                    row[f"{key}_vs_monolithic"] = None if mine is None or not theirs else mine / theirs
                rows.append(row)
                checks.append({"clip_s": seconds, "concurrency": c,
                               "ids_equal_monolithic": all(r.token_ids == mono_ids for r in replies)})  # fmt: skip
    finally:
        if stack is not None:
            stack.stop()
    result = {"machine": machine_info(), "clips_s": list(clips), "requests": requests,
              "baseline_requests": baseline_requests, **kw, "rows": rows, "checks": checks}  # fmt: skip
    _print(result)
    write_json(json_out, result)
    return result


def _reply_stats(replies: Sequence[Any]) -> dict[str, Any]:
    return {"ttft": _stats([r.ttft_s for r in replies]), "ttfa": _stats([r.ttfa_s for r in replies]),
            "e2e": _stats([r.e2e_s for r in replies])}  # fmt: skip


def _print(result: dict[str, Any]) -> None:
    print("\n| clip | driver | c | TTFT p50 / p99 ms | TTFA p50 / p99 ms | e2e p50 ms | TTFT, TTFA vs monolithic |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        ratio = ""
        if "ttft_vs_monolithic" in r:
            keys = ("ttft_vs_monolithic", "ttfa_vs_monolithic")
            ratio = " / ".join("-" if r[k] is None else f"{r[k]:.2f}" for k in keys)
        print(f"| {r['clip_s']:g} s | {r['driver']} | {r['concurrency']} | {ms(r['ttft']['median'], 0)} / "
              f"{ms(r['ttft']['p99'], 0)} | {ms(r['ttfa']['median'], 0)} / {ms(r['ttfa']['p99'], 0)} | "
              f"{ms(r['e2e']['median'], 0)} | {ratio} |")  # fmt: skip
    print("\nids equal monolithic generate():", json.dumps(result["checks"]))
