"""A Realtime session longer than the model takes (`omnistage bench truncation`): each turn's time
to first text and its prompt, with the session's `truncation` "auto" (OpenAI's default: as few of
the oldest turns left out as it takes) and a `retention_ratio` (down to that share of the limit at
once), and how much of the prompts the thinker's prefix cache served.

One stack (the default deploy file with the thinker's prefix cache on, a short `max_model_len` so
that a session of typed turns passes it in a few turns), its Realtime WebSocket; sessions of the
two settings alternate (the machine's noise falls on both), each turn a typed user message of
`words` words answered in text (`max_output_tokens` 8, temperature 0), each session's words its
own (no session hits another's prefixes), after one untimed warm-up session. A turn whose
prompt grew by less than half the session's first prompt (about a turn and its reply) is a
truncating one; a failed turn (no prompt counted) is counted apart. The cached share is the
thinker's `prompt_tokens_total{source=cached}` over all prompt tokens, read around each session.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, ms, write_json
from benchmarks.harness import free_port_blocks, start_stacks
from benchmarks.stats import summarize

MAX_OUTPUT_TOKENS = 8


def _prompt_tokens(metrics_url: str) -> dict[str, float]:
    """The thinker's prompt tokens so far, by source (prefilled, cached)."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("omnistage_stage_prompt_tokens_total{"):
                source = line.split('source="', 1)[1].split('"', 1)[0]
                out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _session(url: str, truncation: Any, tag: str, turns: int, words: int) -> list[dict[str, Any]]:
    """One session's turns: each one's prompt tokens, TTFT and status."""
    from websockets.asyncio.client import connect

    text = " ".join(f"{tag}{i % 37}" for i in range(words))
    rows: list[dict[str, Any]] = []
    async with connect(url, max_size=None, open_timeout=60) as ws:

        async def until(kind: str) -> dict[str, Any]:
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "error":
                    raise RuntimeError(f"error event: {event['error']}")
                if event["type"] == kind:
                    return event  # type: ignore[no-any-return]

        await until("session.created")
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "output_modalities": ["text"], "max_output_tokens": MAX_OUTPUT_TOKENS,
            "temperature": 0, "truncation": truncation, "instructions": "Answer briefly.",
            "audio": {"input": {"turn_detection": None}}}}))  # fmt: skip
        await until("session.updated")
        for turn in range(turns):
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{turn}: {text}"}]}}))
            await until("conversation.item.done")
            t0 = time.perf_counter()
            await ws.send(json.dumps({"type": "response.create"}))
            ttft = None
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "response.output_text.delta" and ttft is None:
                    ttft = time.perf_counter() - t0
                elif event["type"] == "response.done":
                    response = event["response"]
                    usage = response.get("usage") or {}
                    rows.append({"turn": turn + 1, "prompt_tokens": usage.get("input_tokens"), "ttft": ttft,
                                 "status": response["status"]})  # fmt: skip
                    break
                elif event["type"] == "error":
                    raise RuntimeError(f"error event: {event['error']}")
    return rows


def _arm_summary(sessions: list[list[dict[str, Any]]], tokens: dict[str, float]) -> dict[str, Any]:
    below, truncating, after = [], [], []
    for all_rows in sessions:
        rows = [r for r in all_rows if r["prompt_tokens"]]  # (a failed turn has none)
        past = False
        step = rows[0]["prompt_tokens"] / 2 if rows else 0
        for prev, row in zip([None, *rows], rows, strict=False):
            cut = prev is not None and row["prompt_tokens"] < prev["prompt_tokens"] + step
            past = past or cut
            (truncating if cut else after if past else below).append(row["ttft"])
    total = tokens.get("cached", 0.0) + tokens.get("prefilled", 0.0)
    return {"ttft_below_limit": summarize(below), "ttft_truncating_turns": summarize(truncating),
            "ttft_other_turns_past_limit": summarize(after), "prompt_tokens": tokens,
            "cached_share": tokens.get("cached", 0.0) / total if total else None,
            "failed_turns": sum(r["status"] == "failed" for rows in sessions for r in rows),
            "first_session": sessions[0] if sessions else []}  # fmt: skip


def main(model: Path | None, sessions: int, turns: int, words: int, max_model_len: int, ratio: float,
         json_out: Path | None) -> dict[str, Any]:  # fmt: skip
    def log(msg: str) -> None:
        print(msg, flush=True)

    from omnistage.config import load_config

    cfg = load_config(None)
    (http_port,) = free_port_blocks([1], cfg.host, metrics_offset=cfg.metrics.port_offset)
    settings = {"max_model_len": max_model_len, "thinker.prefix_cache_tokens": 65536, "gateway.http_port": http_port}
    stack = start_stacks({"truncation": settings}, model, log, "truncation")["truncation"]
    arms: dict[str, Any] = {"auto": "auto", f"retention_ratio {ratio:g}": {"type": "retention_ratio",
                                                                         "retention_ratio": ratio}}  # fmt: skip
    runs: dict[str, list[list[dict[str, Any]]]] = {arm: [] for arm in arms}
    tokens: dict[str, dict[str, float]] = {arm: {} for arm in arms}
    try:
        url = f"ws://{stack.http_address}/v1/realtime"
        host, port = stack.addresses("thinker")[0].rsplit(":", 1)
        metrics = f"http://{host}:{int(port) + cfg.metrics.port_offset}/metrics"
        log("warm-up session ...")
        asyncio.run(_session(url, "auto", "warm", 3, words))
        for s in range(sessions):
            for k, arm in enumerate(arms):
                arm = list(arms)[(s + k) % len(arms)]  # (rotated: neither always runs first)
                log(f"session {s + 1} of {sessions}: {arm} ...")
                before = _prompt_tokens(metrics)
                runs[arm].append(asyncio.run(_session(url, arms[arm], f"s{s}a{k}w", turns, words)))
                after = _prompt_tokens(metrics)
                for source, n in after.items():
                    tokens[arm][source] = tokens[arm].get(source, 0.0) + n - before.get(source, 0.0)
    finally:
        stack.stop()
    result = {"machine": machine_info(), "sessions": sessions, "turns": turns, "words": words,
              "max_model_len": max_model_len, "max_output_tokens": MAX_OUTPUT_TOKENS,
              "arms": {arm: _arm_summary(runs[arm], tokens[arm]) for arm in arms}}  # fmt: skip
    _print(result)
    write_json(json_out, result)
    return result


def _print(result: dict[str, Any]) -> None:
    print("\n| truncation | TTFT p50 / p99 ms below the limit | truncating turns | other turns past it | "
          "prompt tokens cached |")  # fmt: skip
    print("|---|---|---|---|---|")
    for arm, r in result["arms"].items():
        cells = [f"{ms(r[k]['median'])} / {ms(r[k]['p99'])} (n={r[k]['n']})"
                 for k in ("ttft_below_limit", "ttft_truncating_turns", "ttft_other_turns_past_limit")]  # fmt: skip
        share = "-" if r["cached_share"] is None else f"{100 * r['cached_share']:.1f} %"
        print(f"| {arm} | " + " | ".join(cells) + f" | {share} |")
    for arm, r in result["arms"].items():
        print(f"{arm}: prompt tokens per turn (first session): "
              + ", ".join(str(row["prompt_tokens"]) for row in r["first_session"]))  # fmt: skip
        if r["failed_turns"]:
            print(f"{arm}: {r['failed_turns']} failed turns")
