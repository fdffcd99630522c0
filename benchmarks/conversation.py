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
reported (a prefix-cache hit changes the last bits of what follows it); every arm's history
holds the first arm's replies, so the three serve the same prompts. A turn that fails (past the
model's length, ...) ends its conversation and is listed. Three stacks of the checkpoint are
loaded at once (on the CPU, as the default deploy file): a bench for small checkpoints.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import media
from benchmarks.common import machine_info, ms, write_json
from benchmarks.harness import start_stacks
from benchmarks.stats import summarize

ARMS: dict[str, dict[str, Any]] = {
    "nothing kept": {"media.decoded_cache_bytes": 0, "thinker.prefix_cache_tokens": 0},
    "decoded media kept": {"thinker.prefix_cache_tokens": 0},
    "media and prefixes kept": {"thinker.prefix_cache_tokens": 65536},
}
SYSTEM = "You are a helpful voice assistant. Answer briefly."


async def _conversations(stacks: dict[str, Any], conversations: int, turns: int, clip_seconds: float,
                         clip_spread: float, kw: dict[str, Any], log: Any) -> dict[str, Any]:  # fmt: skip
    """Each conversation's turns on every stack, the arms in a rotating order; every arm's history
    holds the first arm's replies, so all three serve the same prompts."""
    from gateway.client import gateway_channel, generate, user_message
    from omnistage.v1 import gateway_pb2

    arms = list(stacks)
    channels = {arm: gateway_channel(stack.gateway_address) for arm, stack in stacks.items()}  # one each: no
    times = {arm: {t: {"ttft": [], "ttfa": []} for t in range(1, turns + 1)} for arm in arms}  # dial in a TTFT
    same = {arm: [0, 0] for arm in arms[1:]}  # replies equal to the first arm's, replies
    failed: list[str] = []

    async def turn(arm: str, history: list[Any], wav: bytes) -> Any:
        return await generate(stacks[arm].gateway_address, "", audio=[wav], messages=list(history), system=SYSTEM,
                              timeout=600, channel=channels[arm], **kw)  # fmt: skip

    try:
        warm = [media.encode_audio(media.tone(1.0, 16_000, 300.0 + 50 * i, seed=900 + i), 16_000) for i in range(2)]
        for arm in arms:  # warm-up: a two-turn conversation each (its second turn hits what each keeps)
            first = await turn(arm, [], warm[0])
            await turn(arm, [user_message("", audio=[warm[0]]),
                             gateway_pb2.ChatMessage(role="assistant", content=first.text)], warm[1])  # fmt: skip
        for c in range(conversations):
            log(f"conversation {c + 1} of {conversations} ...")
            history: list[Any] = []
            for t in range(1, turns + 1):
                seconds = clip_seconds * (1 + clip_spread * (2 * random.Random(1000 * c + t).random() - 1))
                wav = media.encode_audio(media.tone(seconds, 16_000, 200.0 + 37 * t, seed=1000 * c + t), 16_000)
                replies: dict[str, Any] = {}
                for k in range(len(arms)):  # (rotated: no arm always runs right after another)
                    arm = arms[(c + t + k) % len(arms)]
                    try:
                        replies[arm] = await turn(arm, history, wav)
                    except Exception as e:  # a turn past the model's length, ...: the conversation ends here
                        failed.append(f"conversation {c + 1}, turn {t}, {arm}: {type(e).__name__}: {e}")
                if len(replies) < len(arms):
                    break
                for arm, reply in replies.items():
                    times[arm][t]["ttft"].append(reply.ttft_s)
                    times[arm][t]["ttfa"].append(reply.ttfa_s)
                    if arm in same:
                        same[arm][0] += reply.token_ids == replies[arms[0]].token_ids
                        same[arm][1] += 1
                history += [user_message("", audio=[wav]),
                            gateway_pb2.ChatMessage(role="assistant", content=replies[arms[0]].text)]  # fmt: skip
    finally:
        for channel in channels.values():
            await channel.close()
    return {"times": times, "same": same, "failed": failed}


def main(model: Path | None, conversations: int, turns: int, clip_seconds: float, thinker_max_tokens: int,
         talker_max_tokens: int, json_out: Path | None, clip_spread: float = 0.0) -> dict[str, Any]:  # fmt: skip
    def log(msg: str) -> None:
        print(msg, flush=True)

    kw = {"thinker_max_tokens": thinker_max_tokens, "talker_max_tokens": talker_max_tokens}
    stacks = start_stacks(ARMS, model, log, "conversation")
    try:
        ran = asyncio.run(_conversations(stacks, conversations, turns, clip_seconds, clip_spread, kw, log))
    finally:
        for stack in stacks.values():
            stack.stop()
    times, same = ran["times"], ran["same"]
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
              "clip_spread": clip_spread, **kw, "rows": rows, "failed": ran["failed"],
              "replies_equal_first_arm": {a: f"{s[0]}/{s[1]}" for a, s in same.items()}}
    _print(result)
    write_json(json_out, result)
    return result


def _print(result: dict[str, Any]) -> None:
    arms: Sequence[str] = list(ARMS)
    print("\n| turn | " + " | ".join(f"{a}: TTFT p50 / p99 ms (ratio)" for a in arms) + " |")
    print("|---|" + "---|" * len(arms))
    for t in range(1, result["turns"] + 1):
        cells = []
        for a in arms:
            r = next(r for r in result["rows"] if r["arm"] == a and r["turn"] == t)
            ratio = "" if r["ttft_ratio"] is None else f" ({r['ttft_ratio']:.2f})"
            cells.append(f"{ms(r['ttft']['median'])} / {ms(r['ttft']['p99'])}{ratio}")
        print(f"| {t} | " + " | ".join(cells) + " |")
    print("\nTTFA p50 ms per turn:")
    for a in arms:
        rows = [r for r in result["rows"] if r["arm"] == a]
        print(f"  {a}: " + ", ".join(ms(r["ttfa"]["median"]) for r in rows))
    print("\nreplies equal the first arm's:", json.dumps(result["replies_equal_first_arm"]))
    for line in result["failed"]:
        print("failed:", line)
