"""`omnistage bench compare A.yaml B.yaml ...`: deploy files against each other in the steady
state, alternated, so that a shared machine's drift falls on every file alike (this project's
2-core VM moved by a third in req/s within an hour; one run of each, one after the other, is not
a comparison).

Each round starts each file's stack in turn (the order reversed every other round: A B, B A,
...), warms it with `warmup` requests at the load's concurrency, then runs `loads` measured
closed-loop loads of `num_requests` requests, reading every process's own metrics over each
(stage_load.py): its CPU per request (and of which its engine thread, its main thread's event loop,
gRPC's threads and the others), context switches and gRPC messages per request, and mean batch. Per file, every
measured load's figures and their median; per figure, each file's median over the first file's,
and whether the two files' loads overlap (min to max): a difference inside that spread is noise
of this run, not a result."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, write_json
from benchmarks.drivers import BenchRequest, GrpcDriver
from benchmarks.harness import BenchOptions, Run, access, command_line, running_stack
from benchmarks.load import LevelResult, run_concurrency
from benchmarks.prompts import load_prompts, request_sequence
from benchmarks.report import aligned
from benchmarks.stage_load import endpoints
from benchmarks.stats import summarize as summarize_values
from omnistage.server.thread_cpu import KINDS

SCHEMA = "omnistage.bench.compare/1"
CLIENT = "bench client"  # stage_load's role for this process
# (figure, label, scale, format) of a load: the rows of the report
FIGURES = (
    ("requests_per_s", "req/s", 1, ".2f"),
    ("ttfa_p50_s", "TTFA p50 (ms)", 1000, ".0f"),
    ("ttfa_p99_s", "TTFA p99 (ms)", 1000, ".0f"),
    ("e2e_p50_s", "E2E p50 (ms)", 1000, ".0f"),
    ("e2e_p99_s", "E2E p99 (ms)", 1000, ".0f"),
    ("stack_cpu_ms_per_request", "stack CPU ms/request", 1, ".1f"),
)
PER_PROCESS = (
    ("cpu_ms_per_request", "CPU ms/request", ".1f"),
    # of which, by kind of thread (omnistage/server/thread_cpu.py)
    ("engine_cpu_ms_per_request", "engine thread CPU ms/request", ".1f"),
    ("main_cpu_ms_per_request", "event loop CPU ms/request", ".1f"),
    ("grpc_cpu_ms_per_request", "gRPC threads CPU ms/request", ".1f"),
    ("other_cpu_ms_per_request", "other threads CPU ms/request", ".1f"),
    ("switches_per_request", "context switches/request", ".0f"),
    ("messages_per_request", "messages/request", ".1f"),
    ("mean_batch", "mean batch", ".2f"),
)


@dataclass(frozen=True)
class CompareOptions:
    configs: list[Path]
    # per config, a source tree (a git worktree of another commit) whose packages its stack's
    # processes import instead of this one's (PYTHONPATH): code against code; None: this tree
    checkouts: list[Path | None] | None = None
    rounds: int = 3
    loads: int = 2  # measured loads per stack start
    num_requests: int = 400  # per measured load
    warmup: int = 400  # requests before the first measured load of each stack
    concurrency: int = 16
    time_limit: float | None = 120.0  # seconds per load at most
    model: Path | None = None
    seed: int = 0
    thinker_max_tokens: int = 24
    talker_max_tokens: int = 48
    request_timeout: float = 300.0
    json_out: Path | None = None
    quiet: bool = False


def load_figures(level: LevelResult) -> dict[str, Any]:
    """One measured load: its latency and rate, and per process its CPU and messages per finished
    request and its mean batch (None where the stack did not report one)."""
    s = level.summary()
    ok, wall = s["ok"], level.wall_s
    processes: dict[str, dict[str, float | None]] = {}
    for role, got in (level.stage_load or {}).items():
        cores, messages, switches = got.get("cpu_cores"), got.get("messages"), got.get("context_switches")
        threads = got.get("thread_cpu_s") or {}
        processes[role] = {
            "cpu_ms_per_request": 1000 * cores * wall / ok if cores is not None and ok and wall else None,
            **{f"{kind}_cpu_ms_per_request": 1000 * threads[kind] / ok if threads.get(kind) is not None and ok
               else None for kind in KINDS},  # fmt: skip  (None: the process has no such thread)
            "switches_per_request": switches / ok if switches is not None and ok else None,
            "messages_per_request": messages / ok if messages is not None and ok else None,
            "mean_batch": got.get("mean_batch"),
        }
    stack = [p["cpu_ms_per_request"] for role, p in processes.items() if role != CLIENT]
    return {
        "requests": s["requests"],
        "ok": ok,
        "failed": s["failed"],
        "wall_s": wall,
        "requests_per_s": s["requests_per_s"],
        "ttfa_p50_s": s["ttfa_s"]["median"],
        "ttfa_p99_s": s["ttfa_s"]["p99"],
        "e2e_p50_s": s["e2e_s"]["median"],
        "e2e_p99_s": s["e2e_s"]["p99"],
        "stack_cpu_ms_per_request": sum(stack) if stack and None not in stack else None,  # type: ignore[arg-type]
        "processes": processes,
    }


def _spread(values: Sequence[float | None]) -> dict[str, float | None]:
    got = summarize_values(values)
    return {k: got[k] for k in ("n", "median", "min", "max")}


def summarize(loads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max over a file's measured loads, of every figure and process figure."""
    out: dict[str, Any] = {key: _spread([ld[key] for ld in loads]) for key, *_ in FIGURES}
    roles = list(dict.fromkeys(role for ld in loads for role in ld["processes"]))  # the stack's order
    out["processes"] = {
        role: {key: _spread([ld["processes"].get(role, {}).get(key) for ld in loads]) for key, *_ in PER_PROCESS}
        for role in roles
    }
    return out


def _against(a: dict[str, float | None], b: dict[str, float | None]) -> dict[str, Any]:
    """b's median over a's, and whether their ranges overlap (the difference is then noise; None
    when either has one load: no spread to judge by)."""
    if a["median"] is None or b["median"] is None:
        return {"ratio": None, "overlap": None}
    ratio = b["median"] / a["median"] if a["median"] else None
    overlap = None
    if (a["n"] or 0) > 1 and (b["n"] or 0) > 1:
        overlap = not (b["min"] > a["max"] or b["max"] < a["min"])  # type: ignore[operator]
    return {"ratio": ratio, "overlap": overlap}


def against_first(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per file after the first: every figure's ratio to the first file's, with its overlap."""
    names = list(summaries)
    base = summaries[names[0]]
    out: dict[str, dict[str, Any]] = {}
    for name in names[1:]:
        s = summaries[name]
        row: dict[str, Any] = {key: _against(base[key], s[key]) for key, *_ in FIGURES}
        row["processes"] = {
            role: {key: _against(base["processes"][role][key], figs[key]) for key, *_ in PER_PROCESS}
            for role, figs in s["processes"].items() if role in base["processes"]
        }  # fmt: skip
        out[name] = row
    return out


PAIRED = ("requests_per_s", "stack_cpu_ms_per_request")  # figures also compared round by round


def per_round(first: Sequence[dict[str, Any]], other: Sequence[dict[str, Any]], key: str) -> list[float | None]:
    """`other`'s median over `first`'s in each round both ran: the pairs the drift touches least
    (a round's stacks run minutes apart, its rounds tens of minutes)."""
    out: list[float | None] = []
    for r in sorted({ld["round"] for ld in first} & {ld["round"] for ld in other}):
        a = _spread([ld[key] for ld in first if ld["round"] == r])["median"]
        b = _spread([ld[key] for ld in other if ld["round"] == r])["median"]
        out.append(b / a if a and b is not None else None)
    return out


def label(config: Path, checkout: Path | None) -> str:
    """How results name a stack: its deploy file, and `@` the source tree it runs, if another."""
    return str(config) if checkout is None else f"{config}@{checkout}"


def _shown(name: str) -> str:
    config, _, checkout = name.partition("@")
    return Path(config).name + (f"@{Path(checkout).name}" if checkout else "")


def _entries(opts: CompareOptions) -> list[tuple[Path, Path | None]]:
    return list(zip(opts.configs, opts.checkouts or [None] * len(opts.configs), strict=True))


@contextlib.contextmanager
def _source(checkout: Path | None) -> Iterator[None]:
    """The stack's processes (children of this one, started meanwhile) import from `checkout`:
    first on their path, and (PYTHONSAFEPATH) their working directory, which `python -m` would
    put before it, left off."""
    if checkout is None:
        yield
        return
    old = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONSAFEPATH")}
    os.environ["PYTHONPATH"] = os.pathsep.join([str(checkout.resolve()), *filter(None, [old["PYTHONPATH"]])])
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _stack_loads(opts: CompareOptions, config: Path, checkout: Path | None, round_no: int,
                       requests: list[BenchRequest], warm: list[BenchRequest]) -> list[dict[str, Any]]:  # fmt: skip
    """Start `config`'s stack (from `checkout`'s code, if given), warm it, run the measured loads;
    their figures."""
    bopts = BenchOptions(serve=True, config=config, model=opts.model, concurrency=[opts.concurrency],
                         num_requests=opts.num_requests, time_limit=opts.time_limit, seed=opts.seed,
                         thinker_max_tokens=opts.thinker_max_tokens, talker_max_tokens=opts.talker_max_tokens,
                         warmup=0, request_timeout=opts.request_timeout, progress=False, quiet=opts.quiet)  # fmt: skip
    run = Run(bopts, requests, requests)
    with _source(checkout), running_stack(bopts, run.log) as (target, _, cfg):
        assert target is not None
        run.metrics_endpoints = endpoints(cfg)
        driver = GrpcDriver(target, timeout=opts.request_timeout, access=access(bopts, cfg))
        try:
            if warm:
                level = LevelResult("warm-up", driver.name, "warm-up", {"type": "concurrency"}, "async_chunk")
                await run_concurrency(driver, level, warm, opts.concurrency, opts.time_limit)
                if failed := [r for r in level.records if not r.ok]:
                    run.log(f"warm-up: {len(failed)} request(s) failed, first: {failed[0].error}")
            for i in range(opts.loads):
                await run.level_concurrency(driver, f"{_shown(label(config, checkout))} round {round_no + 1} load "
                                            f"{i + 1}", "sut",
                                            requests, opts.concurrency, "async_chunk", opts.time_limit)  # fmt: skip
        finally:
            await driver.aclose()
    return [load_figures(level) for level in run.levels]


def _requests(opts: CompareOptions, n: int, seed: int) -> list[BenchRequest]:
    prompts = load_prompts(None)
    return [BenchRequest(i, p, prompts[p], opts.thinker_max_tokens, opts.talker_max_tokens, mode="async_chunk")
            for i, p in enumerate(request_sequence(len(prompts), n, seed))]  # fmt: skip


class BadArguments(ValueError):
    """Arguments or a deploy file that cannot be compared (found before any stack starts)."""


def check(opts: CompareOptions) -> None:
    from omnistage.config import load_config

    if len(opts.configs) < 2:
        raise BadArguments("compare needs two deploy files at least")
    if opts.checkouts is not None and len(opts.checkouts) != len(opts.configs):
        raise BadArguments(f"compare: {len(opts.checkouts)} checkouts for {len(opts.configs)} deploy files")
    runs = [(str(c.resolve()), str(t.resolve()) if t else None) for c, t in _entries(opts)]
    if len(set(runs)) != len(runs):
        raise BadArguments("compare: the same deploy file twice from the same source (compare it with another)")
    for _, checkout in _entries(opts):
        if checkout is not None and not (checkout / "omnistage" / "__init__.py").is_file():
            raise BadArguments(f"compare: {checkout} is no omnistage source tree (no omnistage/__init__.py)")
    for name, value, least in (("--rounds", opts.rounds, 1), ("--loads", opts.loads, 1),
                               ("--num-requests", opts.num_requests, 1), ("--warmup", opts.warmup, 0),
                               ("--concurrency", opts.concurrency, 1)):  # fmt: skip
        if value < least:
            raise BadArguments(f"{name} must be >= {least}, got {value}")
    for path in opts.configs:  # every file is read (and refused with its field) before any stack starts
        try:
            load_config(path)
        except ValueError as e:
            raise BadArguments(str(e)) from None


def main(opts: CompareOptions, command: str | None = None) -> dict[str, Any]:
    check(opts)
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    requests = _requests(opts, opts.num_requests, opts.seed)
    warm = _requests(opts, opts.warmup, opts.seed + 1)
    entries = _entries(opts)
    names = [label(c, t) for c, t in entries]
    loads: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    order: list[str] = []
    for r in range(opts.rounds):
        for config, checkout in entries if r % 2 == 0 else entries[::-1]:
            order.append(label(config, checkout))
            for figures in asyncio.run(_stack_loads(opts, config, checkout, r, requests, warm)):
                loads[order[-1]].append({"round": r + 1, **figures})
    summaries = {name: summarize(loads[name]) for name in names}
    result = {
        "schema": SCHEMA,
        "command": command if command is not None else command_line(),
        "started_at": started,
        "machine": machine_info(),
        "settings": _settings(opts),
        "stack_order": order,
        "loads": loads,
        "summary": summaries,
        "against_first": against_first(summaries),
        "per_round": {
            name: {key: per_round(loads[names[0]], loads[name], key) for key in PAIRED} for name in names[1:]
        },
    }
    if not opts.quiet:
        print(format_report(result))
    write_json(opts.json_out, result)
    return result


def _settings(opts: CompareOptions) -> dict[str, Any]:
    out = asdict(replace(opts, json_out=None))
    out["configs"] = [str(p) for p in opts.configs]
    out["checkouts"] = [None if t is None else str(t) for _, t in _entries(opts)]
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


def _cell(spread: dict[str, float | None], scale: float, fmt: str) -> str:
    if spread["median"] is None:
        return "-"
    m, lo, hi = (scale * spread[k] for k in ("median", "min", "max"))  # type: ignore[operator]
    return f"{m:{fmt}} ({lo:{fmt}}-{hi:{fmt}})"


def _ratio(cmp: dict[str, Any]) -> str:
    if cmp["ratio"] is None:
        return "-"
    return f"{cmp['ratio']:.3f}" + {True: " ~", False: "", None: " ?"}[cmp["overlap"]]


def format_report(result: dict[str, Any]) -> str:
    """One row per figure: each file's median (min-max over its loads), then each later file's
    ratio to the first, marked ~ where the loads overlap (within this run's noise), ? where a file
    had one load."""
    names = list(result["summary"])
    first = result["summary"][names[0]]
    shown = [_shown(n) for n in names]
    rows: list[list[str]] = [["figure", *shown, *(f"{n} / first" for n in shown[1:])]]
    for key, label, scale, fmt in FIGURES:
        rows.append([label, *(_cell(result["summary"][n][key], scale, fmt) for n in names),
                     *(_ratio(result["against_first"][n][key]) for n in names[1:])])  # fmt: skip
    for role in first["processes"]:
        for key, label, fmt in PER_PROCESS:
            cells = [_cell(result["summary"][n]["processes"].get(role, {}).get(key, _spread([])), 1, fmt)
                     for n in names]  # fmt: skip
            if all(c == "-" for c in cells):
                continue
            ratios = [_ratio(result["against_first"][n]["processes"].get(role, {}).get(key, {"ratio": None}))
                      for n in names[1:]]  # fmt: skip
            rows.append([f"{role} {label}", *cells, *ratios])
    lines = aligned(rows)
    for name, figures in result.get("per_round", {}).items():
        parts = []
        for key, ratios in figures.items():
            label = next(lab for k, lab, *_ in FIGURES if k == key)
            known = [r for r in ratios if r is not None]
            side = "not on one side of 1 in every round"
            if known and (min(known) > 1 or max(known) < 1):
                side = f"{'above' if known[0] > 1 else 'below'} 1 in every round"
            parts.append(f"{label} {' '.join('-' if r is None else f'{r:.3f}' for r in ratios)} ({side})")
        lines.append(f"{_shown(name)} / first, round by round: " + "; ".join(parts))
    for name, got in result.get("loads", {}).items():
        if failed := sum(ld["failed"] for ld in got):
            lines.append(f"{_shown(name)}: {failed} request(s) failed over its loads (their figures leave them out)")
    s = result["settings"]
    order = ", ".join(_shown(n) for n in result["stack_order"])
    lines.insert(0, f"{s['rounds']} round(s), stacks in the order {order}; "
                    f"each: {s['warmup']} warm-up, then {s['loads']} x {s['num_requests']} requests at "
                    f"c={s['concurrency']}; cells: median (min-max) over the loads; ~: the loads overlap (noise); "
                    "?: one load, no spread")  # fmt: skip
    return "\n".join(lines)
