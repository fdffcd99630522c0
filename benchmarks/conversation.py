"""A spoken conversation (`omnistage bench conversation`): each turn's time to first text and audio
as the conversation grows, with and without what a stack keeps across requests, in one run.

A chat client sends its whole conversation with every turn: every earlier clip and reply comes
again. Three stacks of the same checkpoint serve the same conversations, one turn each in turn
(alternating, so the machine's noise falls on all three alike):
  * `nothing kept`: `media.decoded_cache_bytes: 0`, `thinker.prefix_cache_tokens: 0`;
  * `decoded media kept`: the gateway's default (`media.decoded_cache_bytes`);
  * `media and prefixes kept`: that and `thinker.prefix_cache_tokens`.
Each conversation's clips are new (a tone of its own), each turn's user message one clip, of
`clip_seconds` or, with `clip_spread`, drawn around it (seeded): the feature extractor pads a
request's clips to its longest, so a clip longer than every earlier one changes the earlier
longest's last frame and ends a cached prefix there (README, the thinker's prefix cache). The
replies are greedy; how many of the later arms' replies are the first arm's, id for id, is
reported (a prefix-cache hit changes the last bits of what follows it).
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import media
from benchmarks.common import machine_info, write_json
from benchmarks.stats import summarize

ARMS: dict[str, dict[str, Any]] = {
    "nothing kept": {"media.decoded_cache_bytes": 0, "thinker.prefix_cache_tokens": 0},
    "decoded media kept": {"thinker.prefix_cache_tokens": 0},
    "media and prefixes kept": {"thinker.prefix_cache_tokens": 65536},
}
SYSTEM = "You are a helpful voice assistant. Answer briefly."


def _start_stacks(model: Path | None, log: Any) -> dict[str, Any]:
    from benchmarks.harness import free_port_blocks
    from omnistage.cli.serve import start_stack
    from omnistage.config import apply_overrides, load_config
    from omnistage.topology import STAGES

    cfg = load_config(None)
    sizes = [cfg.gateway.replicas, *(cfg.stage(s).replicas for s in STAGES)]
    bases = free_port_blocks(sizes * len(ARMS), cfg.host, metrics_offset=cfg.metrics.port_offset)
    stacks: dict[str, Any] = {}
    try:
        for i, (arm, settings) in enumerate(ARMS.items()):
            mine = bases[i * len(sizes) : (i + 1) * len(sizes)]
            overrides: dict[str, Any] = {"gateway.port": mine[0], "gateway.http_port": None, **settings}
            overrides.update({f"{s}.base_port": b for s, b in zip(STAGES, mine[1:], strict=True)})
            if model is not None:
                overrides["model"] = str(model)
            log_dir = Path(tempfile.mkdtemp(prefix="omnistage-bench-conversation-"))
            log(f"starting the '{arm}' stack (gateway port {mine[0]}, logs in {log_dir}) ...")
            stacks[arm] = start_stack(apply_overrides(cfg, overrides), log_dir=log_dir)
    except BaseException:
        for stack in stacks.values():
            stack.stop()
        raise
    return stacks


async def _turn(target: str, history: list[Any], wav: bytes, kw: dict[str, Any]) -> Any:
    from gateway.client import generate

    return await generate(target, "", audio=[wav], messages=list(history), system=SYSTEM, timeout=600, **kw)


def main(model: Path | None, conversations: int, turns: int, clip_seconds: float, thinker_max_tokens: int,
         talker_max_tokens: int, json_out: Path | None, clip_spread: float = 0.0) -> dict[str, Any]:  # fmt: skip
    from gateway.client import user_message
    from omnistage.v1 import gateway_pb2

    def log(msg: str) -> None:
        print(msg, flush=True)

    kw = {"thinker_max_tokens": thinker_max_tokens, "talker_max_tokens": talker_max_tokens}
    stacks = _start_stacks(model, log)
    times: dict[str, dict[int, dict[str, list[float | None]]]] = {
        arm: {t: {"ttft": [], "ttfa": []} for t in range(1, turns + 1)} for arm in ARMS}
    same = {arm: [0, 0] for arm in ARMS}  # replies equal to the first arm's, replies
    try:
        for stack in stacks.values():  # warm-up: one short turn each
            asyncio.run(_turn(stack.gateway_address, [], media.encode_audio(media.tone(1.0, seed=999), 16_000), kw))
        for c in range(conversations):
            log(f"conversation {c + 1} of {conversations} ...")
            histories: dict[str, list[Any]] = {arm: [] for arm in ARMS}
            for t in range(1, turns + 1):
                seconds = clip_seconds * (1 + clip_spread * (2 * random.Random(1000 * c + t).random() - 1))
                clip = media.tone(seconds, 16_000, 200.0 + 37 * t, seed=1000 * c + t)
                wav = media.encode_audio(clip, 16_000)
                first: list[int] | None = None
                for arm, stack in stacks.items():
                    reply = asyncio.run(_turn(stack.gateway_address, histories[arm], wav, kw))
                    times[arm][t]["ttft"].append(reply.ttft_s)
                    times[arm][t]["ttfa"].append(reply.ttfa_s)
                    first = reply.token_ids if first is None else first
                    same[arm][0] += reply.token_ids == first
                    same[arm][1] += 1
                    histories[arm] += [user_message("", audio=[wav]),
                                       gateway_pb2.ChatMessage(role="assistant", content=reply.text)]  # fmt: skip
    finally:
        for stack in stacks.values():
            stack.stop()
    rows = []
    for arm in ARMS:
        for t in range(1, turns + 1):
            row: dict[str, Any] = {"arm": arm, "turn": t}
            for key in ("ttft", "ttfa"):
                row[key] = summarize(times[arm][t][key])
                base = summarize(times["nothing kept"][t][key])["median"]
                mine = row[key]["median"]
                row[f"{key}_ratio"] = None if mine is None or not base else mine / base
            rows.append(row)
    result = {"machine": machine_info(), "conversations": conversations, "turns": turns, "clip_s": clip_seconds,
              "clip_spread": clip_spread, **kw, "rows": rows,
              "replies_equal_first_arm": {a: f"{s[0]}/{s[1]}" for a, s in same.items()}}
    _print(result)
    write_json(json_out, result)
    return result


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def _print(result: dict[str, Any]) -> None:
    arms: Sequence[str] = list(ARMS)
    print("\n| turn | " + " | ".join(f"{a}: TTFT p50 / p99 ms (ratio)" for a in arms) + " |")
    print("|---|" + "---|" * len(arms))
    for t in range(1, result["turns"] + 1):
        cells = []
        for a in arms:
            r = next(r for r in result["rows"] if r["arm"] == a and r["turn"] == t)
            ratio = "" if r["ttft_ratio"] is None else f" ({r['ttft_ratio']:.2f})"
            cells.append(f"{_ms(r['ttft']['median'])} / {_ms(r['ttft']['p99'])}{ratio}")
        print(f"| {t} | " + " | ".join(cells) + " |")
    print("\nTTFA p50 ms per turn:")
    for a in arms:
        rows = [r for r in result["rows"] if r["arm"] == a]
        print(f"  {a}: " + ", ".join(_ms(r["ttfa"]["median"]) for r in rows))
    print("\nreplies equal the first arm's:", json.dumps(result["replies_equal_first_arm"]))
