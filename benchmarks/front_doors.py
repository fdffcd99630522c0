"""`omnistage bench --http` (`--realtime`, `--responses`, `--completions`): the OpenAI-compatible
HTTP front door's streamed chat completions (SSE) (its Realtime WebSocket; its Responses API; its
Completions API) against the gRPC front door of the same gateway, same run, same requests.

Both ask for the same work: greedy text and speech (`temperature: 0`; gRPC the same sampling),
text and audio out (pcm16 in base64 events; gRPC float32 chunks). The Realtime API cannot set the
talker's limit: with `--realtime` neither door sets it (the stack's default). The Responses API has
no speech out: with `--responses` both doors ask for text alone (no TTFA); with `--completions`
both send each prompt raw (no chat template: `raw_prompt` over gRPC) and ask for text alone. At each
`--concurrency` level (default 1 and 8) the two run the same request list one after the other,
in alternating order per level (gRPC first at odd levels) so drift on a shared machine hits both;
the ratios are HTTP (Realtime) over gRPC of the median TTFT, TTFA and E2E over the requests both
ran.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from benchmarks.common import machine_info, ms
from benchmarks.drivers import BenchRequest, CompletionsDriver, GrpcDriver, HttpDriver, RealtimeDriver, ResponsesDriver
from benchmarks.harness import (
    BenchOptions,
    Run,
    TargetError,
    _paired,
    access,
    check_gateway,
    command_line,
    running_stack,
    settings,
    stack_config_json,
    stacks_run,
)
from benchmarks.prompts import load_prompts, request_sequence

__all__ = ["main"]


def main(opts: BenchOptions, command: str | None = None) -> dict[str, Any]:
    levels = opts.concurrency  # the CLI's default here: 1 and 8
    prompts = load_prompts(opts.prompts)
    order = request_sequence(len(prompts), opts.num_requests, opts.seed)
    # the door the options name (each driver's `name` is its option's), else chat's
    kind = next((d for d in (RealtimeDriver, ResponsesDriver, CompletionsDriver) if getattr(opts, d.name)), HttpDriver)
    door_name = kind.name
    text_alone = opts.responses or opts.completions
    talker_limit = None if opts.realtime or text_alone else opts.talker_max_tokens
    requests = [BenchRequest(i, p, prompts[p], opts.thinker_max_tokens, talker_limit, want_audio=not text_alone,
                             raw=opts.completions) for i, p in enumerate(order)]  # fmt: skip
    run = Run(opts, requests, requests)
    rows: list[dict[str, Any]] = []

    async def go(grpc_addr: str, http_addr: str, cfg: Any) -> None:
        door = access(opts, cfg)
        front = kind(http_addr, timeout=opts.request_timeout, access=door)
        drivers = {"grpc": GrpcDriver(grpc_addr, timeout=opts.request_timeout, openai_greedy=True, access=door),
                   door_name: front}  # fmt: skip
        try:
            # both doors answer before anything is measured (a wrong --http-target failed every HTTP request)
            try:
                await front.check(min(30.0, opts.request_timeout))
            except Exception as e:
                where = f"--http-target {http_addr}" if opts.target else f"the HTTP port this run started ({http_addr})"
                raise TargetError(f"{where}: no omnistage HTTP front door answers there ({e})") from None
            await check_gateway(grpc_addr, door, min(30.0, opts.request_timeout), "--target" if opts.target else None)
            for d in drivers.values():
                await run.warm(d)
            for k, c in enumerate(levels):
                names = ["grpc", door_name] if k % 2 == 0 else [door_name, "grpc"]
                got = {}
                for name in names:
                    got[name] = await run.level_concurrency(drivers[name], f"{name} c={c}", "sut", requests, c,
                                                            "async_chunk", opts.time_limit)  # fmt: skip
                row: dict[str, Any] = {"concurrency": c}
                for key in ("ttft", "ttfa", "e2e"):
                    h, g = _paired(got[door_name], key, got["grpc"], key)
                    row[key] = {f"{door_name}_median_s": h, "grpc_median_s": g,
                                f"{door_name}_over_grpc": None if not (h and g) else h / g}  # fmt: skip
                row["requests_per_s"] = {n: got[n].summary()["requests_per_s"] for n in names}
                rows.append(row)
        finally:
            for d in drivers.values():
                await d.aclose()

    first_stack = len(stacks_run)
    with running_stack(opts, run.log) as (grpc_addr, http_addr, cfg):
        assert grpc_addr is not None and http_addr is not None
        asyncio.run(go(grpc_addr, http_addr, cfg))
    machine = machine_info()
    machine["load_average_end"] = list(os.getloadavg())
    failed = {lv.name: sum(not r.ok for r in lv.records) for lv in run.levels}
    same_audio = _same_audio(run)
    result = {"schema": "omnistage.bench.front_doors/1", "door": door_name, "command": command or command_line(),
              "machine": machine,
              "requests_per_level": len(requests), "levels": rows, "failed": failed,
              "audio_samples_equal": same_audio, "configurations": [lv.to_json() for lv in run.levels],
              "settings": settings(opts) | {"talker_max_tokens": talker_limit},  # (None: the stack's default)
              "stack_config": stack_config_json(opts, cfg),
              "stack_run_dirs": stacks_run[first_stack:],
              "total_seconds": time.perf_counter() - run.t0}  # fmt: skip
    table = _table(result)
    print(table)
    if opts.markdown_out is not None:
        opts.markdown_out.parent.mkdir(parents=True, exist_ok=True)
        opts.markdown_out.write_text(table)
    if opts.json_out is not None:
        opts.json_out.parent.mkdir(parents=True, exist_ok=True)
        opts.json_out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _same_audio(run: Run) -> bool:
    """Both front doors made the same amount of audio for every request (the same work)."""
    by_prompt: dict[int, set[int]] = {}
    for lv in run.levels:
        for r in lv.records:
            if r.ok:
                by_prompt.setdefault(r.prompt_index, set()).add(r.audio_samples)
    return all(len(v) == 1 for v in by_prompt.values())


def _table(result: dict[str, Any]) -> str:
    door = result["door"]
    lines = ["", f"| c | median TTFT {door} / grpc ms (ratio) | median TTFA {door} / grpc ms (ratio) | "
             f"median E2E {door} / grpc ms (ratio) |", "|---|---|---|---|"]  # fmt: skip
    for row in result["levels"]:
        cells = []
        for key in ("ttft", "ttfa", "e2e"):
            v = row[key]
            ratio = "-" if v[f"{door}_over_grpc"] is None else f"{v[f'{door}_over_grpc']:.3f}"
            cells.append(f"{ms(v[f'{door}_median_s'], 0)} / {ms(v['grpc_median_s'], 0)} ({ratio})")
        lines.append(f"| {row['concurrency']} | " + " | ".join(cells) + " |")
    lines += ["", f"failed requests: {result['failed']}; same audio on both front doors: "
              f"{result['audio_samples_equal']}", ""]  # fmt: skip
    return "\n".join(lines)
