"""``omnistage bench``: latency and throughput of the served pipeline, every headline figure a
ratio against a baseline measured in the same run.

System under test (SUT): a running stack (``--target HOST:PORT``), one started here
(``--serve``), or, with neither, the in-process pipeline (no gRPC).

Phases, in order:
  1. SUT sweep: a closed loop at each ``--concurrency`` level and open-loop Poisson arrivals at
     each ``--rate``, async_chunk mode, each bounded by ``--num-requests`` and ``--time-limit``;
  2. SUT at c=1 in full_payload mode (per request over gRPC; emulated in-process), for TTFA;
  (a started stack is stopped here, so the baselines have the machine to themselves)
  3. the in-process staged pipeline at c=1 (framework overhead; only when the SUT is gRPC);
  4. transformers' monolithic generate(), sequential;
  5. each stage's runner alone over the same request mix, batched as its service batches, at
     batch sizes 1-16 -> the bottleneck stage.

Baselines (2-5) run on the first ``--baseline-requests`` requests of the same sequence; the
latency ratios compare the SUT's c=1 figures on exactly those requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import shlex
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import machine_info
from benchmarks.drivers import (
    Access,
    BenchRequest,
    Driver,
    FullPayloadInProcessDriver,
    GrpcDriver,
    InProcessDriver,
    MonolithicDriver,
    SyncDriver,
)
from benchmarks.load import LevelResult, run_concurrency, run_poisson
from benchmarks.prompts import load_prompts, request_sequence
from benchmarks.report import level_line
from benchmarks.stage_load import endpoints, load_between, own_snapshot, snapshot
from benchmarks.stages import STAGES, batch_sizes_for, stage_summary, time_stages
from benchmarks.stats import RATIO_KEYS, RatioInputs, compute_ratios, percentile
from omnistage.models.onednn import widen_primitive_cache
from omnistage.models.sampling import SamplingParams
from omnistage.server.thread_cpu import ThreadCpuCollector

SCHEMA = "omnistage.bench/1"
BURST_FACTOR = 4  # a closed-loop level of fewer than this many times c requests is mostly one burst


@dataclass
class BenchOptions:
    target: str | None = None
    serve: bool = False
    config: Path | None = None
    model: Path | None = None
    replicas: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 8])
    rates: list[float] = field(default_factory=list)
    num_requests: int = 16
    time_limit: float | None = 120.0
    prompts: Path | None = None
    seed: int = 0
    thinker_max_tokens: int = 24
    talker_max_tokens: int = 48
    sampled_speech: bool = False  # the talker samples (its defaults, a seed per request), as an HTTP request's does
    baseline_requests: int | None = None  # None: as many as --num-requests
    monolithic: bool = True
    inprocess: bool = True
    full_payload: bool = True
    stages: bool = True
    stage_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    warmup: int = 1
    threads: int = 1
    request_timeout: float = 300.0
    http: bool = False  # compare the HTTP front door with gRPC (benchmarks/front_doors.py)
    realtime: bool = False  # likewise its Realtime WebSocket
    responses: bool = False  # likewise its Responses API (text alone, on both doors)
    completions: bool = False  # likewise its Completions API (raw prompts, text alone, on both doors)
    http_target: str | None = None  # HOST:PORT of a running gateway's HTTP port (with --target)
    api_key: str = ""  # a gateway's (--target)
    tls_ca: Path | None = None  # PEM roots of a TLS gateway (--target; --serve takes its config's)
    tls: bool = False  # a TLS gateway, its certificate verified with the default roots (--target)
    server_name: str | None = None  # the name to verify in its certificate (tls.server_name)
    json_out: Path | None = None
    plot_out: Path | None = None
    markdown_out: Path | None = None
    progress: bool = True
    quiet: bool = False


def _parse_list(spec: str, convert: Callable[[str], Any], valid: Callable[[Any], bool], kind: str, rule: str
                ) -> list[Any]:  # fmt: skip
    """A comma-separated option's values (empty -> []), each `valid`, or a ValueError saying so."""
    try:
        values = [convert(p) for p in (x.strip() for x in spec.split(",")) if p]
    except ValueError:
        raise ValueError(f"expected {kind} separated by commas, got {spec!r}") from None
    if not all(valid(v) for v in values):
        raise ValueError(f"every value must be {rule}, got {spec!r}")
    return values


def parse_int_list(spec: str) -> list[int]:
    """`1,4,8` -> [1, 4, 8]. Every value must be at least 1 (a level, a batch)."""
    return _parse_list(spec, int, lambda v: v >= 1, "whole numbers", "at least 1")


def parse_float_list(spec: str) -> list[float]:
    """`1,2.5` -> [1.0, 2.5]. Every value must be a finite number above 0 (a rate, seconds)."""
    return _parse_list(spec, float, lambda v: 0 < v < float("inf"), "numbers", "a number above 0")


def failed_levels(result: dict[str, Any]) -> list[str]:
    """The measured levels of a bench result where requests failed, each with how many and its
    first error: a level's latency figures cover only its requests that succeeded, so a level that
    lost its slowest ones (timed out) looks faster than it was."""
    out = []
    for level in result.get("configurations", []):
        records = level.get("requests", [])
        failed = [r for r in records if not r.get("ok")]
        if failed:
            first = next((r.get("error") for r in failed if r.get("error")), None)
            first = " ".join(str(first).split())[:300] if first else None  # an RPC error's repr spans lines
            count = f"all {len(records)}" if len(failed) == len(records) else f"{len(failed)} of {len(records)}"
            out.append(f"{level['name']}: {count} failed" + (f" (first: {first})" if first else ""))
    return out


# ---- model directory ------------------------------------------------------------------------


def default_model_dir() -> Path:
    """The cached tiny checkpoint `omnistage serve` uses."""
    from omnistage.cli.serve import default_model_dir as serve_default

    return serve_default()


# ---- machine and command -------------------------------------------------------------------


SECRET = "<redacted>"  # what results say in place of an API key (they are committed, shared)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed, its API key (`--api-key K`, `--api-key=K`) redacted."""
    args = list(sys.argv if argv is None else argv)
    if args and Path(args[0]).name in ("omnistage", "__main__.py", "cli.py"):
        args[0] = "omnistage"
    for i, a in enumerate(args):
        if a.startswith("--api-key="):
            args[i] = f"--api-key={SECRET}"
        elif i and args[i - 1] == "--api-key":
            args[i] = SECRET
    return shlex.join(args)


def stack_config_json(opts: BenchOptions, cfg: Any) -> dict[str, Any] | None:
    """The deploy config the measured stack ran with: one this run started (or the in-process
    pipeline's); None for a --target, whose own config the bench does not know (a --config given
    with it configures the local baselines only: `settings.config`)."""
    if opts.target or cfg is None:
        return None
    return cfg.model_dump(mode="json")  # type: ignore[no-any-return]


def settings(opts: BenchOptions) -> dict[str, Any]:
    """The options as a result records them: paths as text, the API key redacted."""
    out = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()}
    if out.get("api_key"):
        out["api_key"] = SECRET
    return out


# ---- stack -------------------------------------------------------------------------------


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's source port."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_blocks(sizes: Sequence[int], host: str = "127.0.0.1", metrics_offset: int = 1000) -> list[int]:
    """Base ports of non-overlapping blocks of free consecutive ports on `host`, one block per
    size, each port's metrics port (`metrics_offset` above it) free too; a bounded search.
    Drawn below the kernel's ephemeral range where there is room: a port from that range can
    become any outgoing connection's source port between this check and the server's bind (a
    CI run lost a gateway's HTTP port that way)."""
    from omnistage.server.ports import port_free

    draw = random.Random()
    bases: list[int] = []
    taken: set[int] = set()
    for n in sizes:
        top = _ephemeral_low() - n - metrics_offset
        for _ in range(200):
            if top > 10_000:
                base = draw.randrange(10_000, top)
            else:  # no room below the ephemeral range: the kernel's choice
                with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                    s.bind((host, 0))
                    base = s.getsockname()[1]
            if base + n + metrics_offset >= 65535:
                continue
            wanted = [*range(base, base + n), *range(base + metrics_offset, base + metrics_offset + n)]
            if all(p not in taken and port_free(host, p) for p in wanted):
                bases.append(base)
                taken.update(wanted)
                break
        else:
            raise RuntimeError(f"no block of {n} free ports on {host} (and their metrics ports)")
    return bases


def start_stacks(settings: dict[str, dict[str, Any]], model: Path | None, log: Callable[[str], None],
                 prefix: str) -> dict[str, Any]:  # fmt: skip
    """One stack of the default deploy file per entry of `settings` (its overrides), named by
    its key: gRPC only, on free loopback ports drawn for all of them at once (so no two collide);
    the ones started are stopped again when a later one fails to start."""
    from omnistage.cli.serve import start_stack
    from omnistage.config import apply_overrides, load_config
    from omnistage.topology import STAGES

    cfg = load_config(None)
    sizes = [cfg.gateway.replicas, *(cfg.stage(s).replicas for s in STAGES)]
    bases = free_port_blocks(sizes * len(settings), cfg.host, metrics_offset=cfg.metrics.port_offset)
    stacks: dict[str, Any] = {}
    try:
        for i, (name, overrides) in enumerate(settings.items()):
            mine = bases[i * len(sizes) : (i + 1) * len(sizes)]
            ports: dict[str, Any] = {"gateway.port": mine[0], "gateway.http_port": None}
            ports.update({f"{s}.base_port": b for s, b in zip(STAGES, mine[1:], strict=True)})
            if model is not None:
                ports["model"] = str(model)
            log_dir = Path(tempfile.mkdtemp(prefix=f"omnistage-bench-{prefix}-"))
            log(f"starting the '{name}' stack (gateway port {mine[0]}, logs in {log_dir}) ...")
            stacks[name] = start_stack(apply_overrides(cfg, {**ports, **overrides}), log_dir=log_dir)
    except BaseException:
        for stack in stacks.values():
            stack.stop()
        raise
    return stacks


def stack_config(opts: BenchOptions) -> Any:
    from omnistage.config import (
        ConfigError,
        apply_overrides,
        check_replicas_run,
        config_path,
        load_config,
        parse_replicas,
    )

    cfg = load_config(opts.config)
    overrides: dict[str, Any] = {}
    if opts.model is not None:
        overrides["model"] = str(opts.model)
    counts = parse_replicas(opts.replicas) if opts.replicas else {}
    overrides.update(counts)
    cfg = apply_overrides(cfg, overrides)
    check_replicas_run(cfg, counts)
    if not cfg.audio_output:
        raise ConfigError("audio_output: false: the bench measures speech (time to first audio, real-time "
                          "factor), which a text-only stack has none of")  # fmt: skip
    # Free ports, so a bench stack never collides with another stack on this machine: every
    # process the config runs (a split thinker's two roles too).
    names = cfg.stage_names()
    sizes = [cfg.gateway.replicas, *(cfg.stage(s).replicas for s in names), cfg.gateway.replicas]
    bases = free_port_blocks(sizes, cfg.host, metrics_offset=cfg.metrics.port_offset)
    port_overrides: dict[str, Any] = {"gateway.port": bases[0], "gateway.http_port": bases[-1]}
    for name, base in zip(names, bases[1:-1], strict=True):
        port_overrides[f"{config_path(name)}.base_port"] = base
    return apply_overrides(cfg, port_overrides)


@contextlib.contextmanager
def sut_target(opts: BenchOptions, log: Callable[[str], None]) -> Iterator[tuple[str | None, Any]]:
    """(gateway address or None for in-process, the deploy config used or None)."""
    with running_stack(opts, log) as (target, _, cfg):
        yield target, cfg


stacks_run: list[str] = []  # the run folders (logs, deploy file) of the stacks this process started


@contextlib.contextmanager
def running_stack(opts: BenchOptions, log: Callable[[str], None]
                  ) -> Iterator[tuple[str | None, str | None, Any]]:  # fmt: skip
    """(gateway gRPC address, its HTTP address, the deploy config) of `--target` or of a stack
    started for the run (`--serve`); (None, None, None) for neither."""
    if opts.target:
        yield opts.target, opts.http_target, None
        return
    if not opts.serve:
        yield None, None, None
        return
    from omnistage.cli.serve import start_stack

    cfg = stack_config(opts)
    log_dir = Path(tempfile.mkdtemp(prefix="omnistage-bench-logs-"))
    log(f"starting stack (gateway port {cfg.gateway.port}, logs in {log_dir}) ...")
    with start_stack(cfg, log_dir=log_dir) as stack:
        stacks_run.append(str(stack.run_dir))
        log(f"stack up at {stack.gateway_address} (HTTP {stack.http_address})")
        yield stack.gateway_address, stack.http_address, cfg
    log("stack stopped")


# ---- prompt encoding (monolithic) -----------------------------------------------------------


class PromptEncoder:
    """The chat template the pipeline uses, without loading the model parts."""

    def __init__(self, model_dir: Path) -> None:
        from omnistage.models.checkpoint import load_tokenizer, open_checkpoint

        ckpt = open_checkpoint(model_dir)
        self.spec = ckpt.spec
        self.family = ckpt.family
        self.tokenizer = load_tokenizer(ckpt)

    def __call__(self, prompt: str) -> list[int]:
        return self.family.prompt_ids(self.tokenizer, [{"role": "user", "content": prompt}])


# ---- the run -------------------------------------------------------------------------------


@dataclass
class Run:
    opts: BenchOptions
    requests: list[BenchRequest]
    baseline: list[BenchRequest]
    levels: list[LevelResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stage_baseline: dict[str, Any] | None = None
    t0: float = field(default_factory=time.perf_counter)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    metrics_endpoints: dict[str, list[str]] = field(default_factory=dict)  # of a stack this run started
    client_threads: ThreadCpuCollector = field(default_factory=ThreadCpuCollector)  # this process's, by kind

    def log(self, msg: str) -> None:
        if not self.opts.quiet:
            tqdm.write(f"[bench {time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[name] = time.perf_counter() - t

    def bar(self, desc: str, total: int) -> Any:
        return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=not self.opts.progress,
                    leave=True, dynamic_ncols=True)

    async def warm(self, driver: Driver) -> None:
        for i in range(self.opts.warmup):
            req = self.requests[i % len(self.requests)]
            try:
                await driver.warmup(req)
            except Exception as e:  # the timed requests will show it; do not stop the run
                self.log(f"warm-up on {driver.name} failed: {type(e).__name__}: {e}")

    async def level_concurrency(self, driver: Driver, name: str, role: str, reqs: Sequence[BenchRequest],
                                c: int, mode: str | None, time_limit: float | None) -> LevelResult:
        level = LevelResult(name=name, driver=driver.name, role=role, load={"type": "concurrency", "value": c},
                            mode=mode)
        if c > len(reqs):  # its name says c: say it never had that many
            level.notes.append(f"{len(reqs)} request(s): at most {len(reqs)} in flight, not {c}")
        elif c > 1 and len(reqs) < BURST_FACTOR * c and not isinstance(driver, SyncDriver):
            # its rate counts the ramp down, fewer than c in flight (a SyncDriver runs one at a time anyway)
            level.notes.append(f"{len(reqs)} request(s) at concurrency {c}: mostly one burst, its requests/s "
                               f"includes the ramp down (give {BURST_FACTOR * c}+ for a steady c)")  # fmt: skip
        with self.bar(name, len(reqs)) as bar:
            async with self._stage_load(level):
                await run_concurrency(driver, level, reqs, c, time_limit, bar.update)
        self._finish_level(level)
        return level

    async def level_rate(self, driver: Driver, name: str, reqs: Sequence[BenchRequest], rate: float) -> LevelResult:
        level = LevelResult(name=name, driver=driver.name, role="sut", load={"type": "poisson", "value": rate},
                            mode="async_chunk")
        with self.bar(name, len(reqs)) as bar:
            async with self._stage_load(level):
                await run_poisson(driver, level, reqs, rate, self.opts.time_limit, self.opts.seed, bar.update)
        self._finish_level(level)
        return level

    @contextlib.asynccontextmanager
    async def _stage_load(self, level: LevelResult) -> AsyncIterator[None]:
        """Each stack process's steps, batch, busy share and CPU over the level (a stack this run
        started; `--target` stacks may not expose their metrics ports here)."""
        if not self.metrics_endpoints or level.role != "sut":
            yield
            return
        before = await asyncio.to_thread(snapshot, self.metrics_endpoints)
        t, client = time.perf_counter(), own_snapshot(self.client_threads)
        yield
        wall, client_end = time.perf_counter() - t, own_snapshot(self.client_threads)
        # over the window the level's requests/s is over (an open loop's starts at its first arrival:
        # the wait for it, idle, would lower every share)
        wall = level.wall_s or wall
        after = await asyncio.to_thread(snapshot, self.metrics_endpoints)
        if before is not None and after is not None:
            # the load generator shares the machine too: this process, all of its threads
            before["bench client"], after["bench client"] = client, client_end
            level.stage_load = load_between(before, after, wall)

    def _finish_level(self, level: LevelResult) -> None:
        failed = [r for r in level.records if not r.ok]
        if failed:
            level.notes.append(f"{len(failed)} request(s) failed, first: {failed[0].error}")
            self.log(f"{level.name}: {len(failed)} failed; first error: {failed[0].error}")
        if level.stopped_by_time_limit:
            level.notes.append(f"time limit reached after {len(level.records)} request(s)")
        self.levels.append(level)
        self.log(level_line(level.name, level.summary()))


def _with_mode(reqs: Sequence[BenchRequest], mode: str) -> list[BenchRequest]:
    return [BenchRequest(**{**asdict(r), "mode": mode}) for r in reqs]


def access(opts: BenchOptions, cfg: Any) -> Access:
    """How the drivers reach the gateway: the options' key and TLS roots, else (a stack this run
    started) its deploy config's TLS."""
    tls_ca = opts.tls_ca.read_bytes() if opts.tls_ca is not None else None
    server_name = opts.server_name
    tls = opts.tls
    if tls_ca is None and cfg is not None and cfg.tls.gateway:  # (cfg: a stack it started)
        tls, server_name = True, server_name or cfg.tls.server_name
        tls_ca = Path(cfg.tls.ca_file).read_bytes() if cfg.tls.ca_file else None
    return Access(api_key=opts.api_key, tls_ca=tls_ca, server_name=server_name, tls=tls)


class TargetError(Exception):
    """The --target is no gateway that answers: said before any figure is measured."""


async def check_gateway(target: str, door: Access, timeout: float, option: str | None = "--target") -> None:
    """One Gateway.Info call: a refused port, a stage's port or an HTTP port fails here, at once,
    not after every baseline has run (each of the target's requests failed, reported at the end)."""
    import grpc

    from omnistage.server.tls import gateway_channel
    from omnistage.v1 import gateway_pb2_grpc, stage_pb2

    key = [("authorization", f"Bearer {door.api_key}")] if door.api_key else None
    where = f"{option} {target}" if option else f"the gateway this run started ({target})"
    async with gateway_channel(target, door.tls_ca, door.server_name, tls=door.tls) as channel:
        try:
            info = await gateway_pb2_grpc.GatewayStub(channel).Info(stage_pb2.InfoRequest(), timeout=timeout,
                                                                     metadata=key)  # fmt: skip
        except grpc.aio.AioRpcError as e:
            raise TargetError(f"{where}: no omnistage gateway answers there "
                              f"({e.code().name}: {e.details()})") from None  # fmt: skip
    # a serving chain with no talker is a text-only stack (audio_output: false), as --serve refuses
    if info.serving and not any(h.stage == "talker" for h in info.chain):
        raise TargetError(f"{where}: the stack serves text only (no talker in its chain: "
                          f"{', '.join(h.stage for h in info.chain)}); the bench measures speech")  # fmt: skip


async def _sut_phase(run: Run, target: str | None, pipe: Any, cfg: Any = None) -> None:
    opts = run.opts
    if target is not None:
        await check_gateway(target, access(opts, cfg), min(30.0, opts.request_timeout),
                            "--target" if opts.target else None)
        driver: Driver = GrpcDriver(target, timeout=opts.request_timeout, access=access(opts, cfg))
        sut = "grpc"
    else:
        driver = InProcessDriver(pipe, opts.threads)
        sut = "inprocess"
    try:
        await run.warm(driver)
        for c in opts.concurrency:
            await run.level_concurrency(driver, f"{sut} c={c}", "sut", _with_mode(run.requests, "async_chunk"), c,
                                        "async_chunk", opts.time_limit)
        for rate in opts.rates:
            await run.level_rate(driver, f"{sut} rate={rate:g}/s", _with_mode(run.requests, "async_chunk"), rate)
        if opts.full_payload:
            full_driver = driver if target is not None else FullPayloadInProcessDriver(pipe, opts.threads)
            try:
                if full_driver is not driver:
                    await run.warm(full_driver)
                level = await run.level_concurrency(full_driver, f"{sut} full_payload c=1", "sut",
                                                    _with_mode(run.baseline, "full_payload"), 1, "full_payload",
                                                    opts.time_limit)  # fmt: skip
                if target is None:
                    level.notes.append("in-process full_payload is emulated: the thinker runs to the end, then the "
                                       "talker, then one code2wav decode")
            finally:
                if full_driver is not driver:
                    await full_driver.aclose()
    finally:
        await driver.aclose()


MONOLITHIC = "monolithic sequential"


def monolithic_halves(baseline: Sequence[BenchRequest]) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """The sequential generate() baseline's requests run before the system under test and after
    it: the machine's drift over a run (a shared VM's neighbours) weighs on both sides of the
    throughput ratio alike, not on the baseline's end of the run alone."""
    half = len(baseline) // 2
    return list(baseline[:half]), list(baseline[half:])


async def _monolithic(run: Run, model_dir: Path, cfg: Any, reqs: Sequence[BenchRequest], name: str) -> LevelResult:
    """generate(), one request at a time, where and in what precision the stack's thinker runs
    (`cfg`: the deploy config; None: the CPU in float32)."""
    opts = run.opts
    enc = PromptEncoder(model_dir)
    place = cfg.stage("thinker") if cfg is not None else None
    device, dtype = (place.device, place.dtype) if place is not None else ("cpu", "float32")
    mono = MonolithicDriver(model_dir, enc, enc.spec.im_end_id, enc.family.sample_rate, opts.threads, device, dtype)
    try:
        await run.warm(mono)
        return await run.level_concurrency(mono, name, "baseline", reqs, 1, None, opts.time_limit)
    finally:
        await mono.aclose()


def _merge_monolithic(run: Run, before: LevelResult | None, after: LevelResult) -> None:
    """The two halves as the one baseline level: their requests, over their summed time."""
    halves = [lv for lv in (before, after) if lv is not None]
    merged = LevelResult(name=MONOLITHIC, driver=after.driver, role="baseline", load=after.load, mode=None,
                         records=[r for lv in halves for r in lv.records],
                         wall_s=sum(lv.wall_s or 0.0 for lv in halves),
                         stopped_by_time_limit=any(lv.stopped_by_time_limit for lv in halves),
                         notes=[n for lv in halves for n in lv.notes])  # fmt: skip
    if before is not None:
        rates = [lv.summary()["requests_per_s"] for lv in halves]
        said = [f"{len(lv.records)} request{'s' * (len(lv.records) != 1)}" + (f" at {r:.3g} req/s" if r else "")
                for lv, r in zip(halves, rates, strict=True)]  # fmt: skip
        merged.notes.append(f"run in two halves, before and after the system under test: {' and '.join(said)} "
                            "(other requests in each: their rates differ by their prompts as well)")
    merged.notes.append("generate() does not stream: its first token and first audio arrive at the end")
    run.levels = [lv for lv in run.levels if lv not in halves] + [merged]
    run.log(level_line(merged.name, merged.summary()))


async def _baseline_phase(run: Run, target: str | None, model_dir: Path, pipe: Any, mono_cfg: Any,
                          before: LevelResult | None = None) -> None:  # fmt: skip
    """The baselines after the system under test: the in-process pipeline, and generate()'s
    requests that `before` (its first half, if it ran) did not take (`mono_cfg`: the deploy
    config whose thinker placement it takes)."""
    opts = run.opts
    if opts.inprocess and target is not None:
        driver = InProcessDriver(pipe, opts.threads)
        try:
            await run.warm(driver)
            await run.level_concurrency(driver, "inprocess c=1", "baseline", run.baseline, 1, "async_chunk",
                                        opts.time_limit)  # fmt: skip
        finally:
            await driver.aclose()
    if opts.monolithic:
        reqs = monolithic_halves(run.baseline)[1] if before is not None else run.baseline
        after = await _monolithic(run, model_dir, mono_cfg, reqs,
                                  f"{MONOLITHIC} (after)" if before is not None else MONOLITHIC)  # fmt: skip
        _merge_monolithic(run, before, after)


def _stage_phase(run: Run, pipe: Any) -> None:
    opts = run.opts
    ids = [pipe.prompt_ids(r.prompt) for r in run.baseline]
    thinker = pipe.thinker_defaults().with_overrides(max_tokens=opts.thinker_max_tokens)
    if thinker.do_sample:
        thinker = thinker.with_overrides(do_sample=False)
    talker = SamplingParams(max_tokens=opts.talker_max_tokens)
    if ids:  # warm-up, not timed
        time_stages(pipe, ids[:1], thinker, talker, [1])
    runs = len(STAGES) * len(batch_sizes_for(len(ids), opts.stage_batch_sizes))
    with run.bar("stages alone", runs) as bar:
        times = time_stages(pipe, ids, thinker, talker, opts.stage_batch_sizes, progress=bar.update)
    summary = stage_summary(times, len(ids))
    summary["note"] = (
        "each stage alone over the request mix in batches of "
        f"{batch_sizes_for(len(ids), opts.stage_batch_sizes)} requests run to their ends together "
        "(thinker and talker: packed steps, code2wav: batched decode); its best batch size counts"
    )
    run.stage_baseline = summary


def _median(records: Sequence[Any], key: str, indices: set[int] | None = None) -> float | None:
    xs = [getattr(r, key) for r in records if r.ok and (indices is None or r.index in indices)]
    return percentile([x for x in xs if x is not None], 50)


def _paired(a: LevelResult | None, a_key: str, b: LevelResult | None, b_key: str) -> tuple[float | None, float | None]:
    """Medians of a.a_key and b.b_key over the requests both measured (same prompts, same order),
    so a ratio of them compares the same work."""
    if a is None or b is None:
        return None, None

    def measured(lv: LevelResult, key: str) -> set[int]:
        return {r.index for r in lv.records if r.ok and getattr(r, key) is not None}

    common = measured(a, a_key) & measured(b, b_key)
    if not common:
        return None, None
    return _median(a.records, a_key, common), _median(b.records, b_key, common)


def _find(levels: Sequence[LevelResult], pred: Callable[[LevelResult], bool]) -> LevelResult | None:
    return next((lv for lv in levels if pred(lv)), None)


# The bottleneck stage's work per request, as the stage baseline records it (one list entry per
# baseline request, in order): what its time over a request mix grows with.
_STAGE_WORK = {"thinker": "tokens", "talker": "frames", "code2wav": "audio_samples"}


def _same_mix(rate: float | None, cost: dict[int, float], base: Sequence[int], mix: Sequence[int], what: str
              ) -> tuple[float | None, str]:  # fmt: skip
    """`rate`, requests/s over the prompts `base` (prompt indices, one per request), for the
    system under test's prompts `mix` (none: no level to compare), and how it was had. A baseline
    that ran fewer requests (--baseline-requests) ran another mix: its rate is scaled by what each
    prompt costs (`cost`, named `what`; greedy: the same every time), unless a prompt has no cost."""
    if not mix:
        return rate, ""
    if sorted(base) == sorted(mix):
        return rate, "same requests"
    if rate is not None and base and all(p in cost for p in (*base, *mix)):
        mix_cost = sum(cost[p] for p in mix) / len(mix)
        if mix_cost > 0:
            scaled = rate * (sum(cost[p] for p in base) / len(base)) / mix_cost
            return scaled, f"its rate over its {len(base)} requests scaled to these {len(mix)} by each prompt's {what}"
    return rate, (f"its {len(base)} requests against these {len(mix)}, not scaled: it did not run every prompt "
                  "(raise --baseline-requests)")


def ratio_inputs(run: Run, sut: str) -> tuple[RatioInputs, dict[str, str]]:
    lv = run.levels
    sweep = [x for x in lv if x.role == "sut" and x.load["type"] == "concurrency" and x.mode == "async_chunk"]
    c1 = _find(sweep, lambda x: x.load["value"] == 1)
    cmax = max(sweep, key=lambda x: x.load["value"]) if sweep else None
    full = _find(lv, lambda x: x.role == "sut" and x.mode == "full_payload")
    inproc = _find(lv, lambda x: x.role == "baseline" and x.driver == "inprocess")
    mono = _find(lv, lambda x: x.driver == "monolithic")
    ttfa_async, ttfa_full = _paired(c1, "ttfa", full, "ttfa")
    ttfa_sut, mono_e2e = _paired(c1, "ttfa", mono, "e2e")
    grpc_e2e, inproc_e2e = _paired(c1 if sut == "grpc" else None, "e2e", inproc, "e2e")
    # the throughput baselines for the prompts cmax ran (its rate counts those requests)
    mix = [r.prompt_index for r in cmax.records if r.ok] if cmax else []
    mono_rate, mono_how = None, ""
    if mono is not None:
        per_prompt: dict[int, list[float]] = {}
        for r in mono.records:
            if r.ok and r.e2e is not None:
                per_prompt.setdefault(r.prompt_index, []).append(r.e2e)
        e2e = {p: statistics.median(v) for p, v in per_prompt.items()}
        mono_rate, mono_how = _same_mix(mono.summary()["requests_per_s"], e2e,
                                        [r.prompt_index for r in mono.records if r.ok], mix, "median E2E")  # fmt: skip
    st = run.stage_baseline or {}
    bn = st.get("bottleneck")
    stage_rate, stage_how = st.get("bottleneck_requests_per_s"), ""
    if bn is not None:
        work = st["stages"][bn].get(_STAGE_WORK.get(bn, ""))
        base = [r.prompt_index for r in run.baseline]
        cost = dict(zip(base, map(float, work), strict=True)) if work and len(work) == len(base) else {}
        stage_rate, stage_how = _same_mix(stage_rate, cost, base, mix, _STAGE_WORK.get(bn, "work"))
    x = RatioInputs(
        ttfa_median_async_c1=ttfa_async,
        ttfa_median_full_c1=ttfa_full,
        ttfa_median_c1_vs_monolithic=ttfa_sut,
        monolithic_e2e_median=mono_e2e,
        monolithic_requests_per_s=mono_rate,
        grpc_e2e_median_c1=grpc_e2e,
        inprocess_e2e_median_c1=inproc_e2e,
        requests_per_s_cmax=cmax.summary()["requests_per_s"] if cmax else None,
        # (a level over itself is no ratio: null when c=1 is the only level)
        requests_per_s_c1=c1.summary()["requests_per_s"] if c1 and c1 is not cmax else None,
        bottleneck_stage_requests_per_s=stage_rate,
    )
    cm = f"{sut} c={cmax.load['value']}" if cmax else "(no concurrency level)"
    basis = {
        "ttfa_async_over_full": f"median TTFA, {sut} c=1 async_chunk / {sut} full_payload c=1 (requests both ran)",
        "ttfa_over_monolithic_e2e": f"median TTFA {sut} c=1 / median E2E monolithic generate() (requests both ran)",
        "e2e_grpc_over_inprocess_c1": "median E2E grpc c=1 / in-process pipeline c=1 (requests both ran)"
        + ("" if sut == "grpc" else "; null: the system under test is the in-process pipeline"),
        "throughput_cmax_over_sequential_monolithic": f"requests/s {cm} / monolithic generate() sequential"
        + (f" ({mono_how})" if mono_how else ""),
        "throughput_cmax_over_c1": f"requests/s {cm} / {sut} c=1",
        "pipeline_over_bottleneck_stage": f"requests/s {cm} / slowest stage alone ({bn or 'not run'}"
        + (f"; {stage_how})" if stage_how else ")"),
    }
    return x, basis


def consistency(levels: Sequence[LevelResult], eos_id: int | None, by_request: bool = False) -> dict[str, Any]:
    """Greedy everywhere: every configuration should produce the same text ids and the same
    number of audio samples per prompt, so the ratios compare the same work. `by_request`
    (sampled speech, a seed per request): per request instead, as two requests of one prompt
    sample different speech."""
    seen: dict[int, dict[str, tuple[tuple[int, ...], int]]] = {}
    for lv in levels:
        for r in lv.records:
            if not r.ok:
                continue
            ids = list(r.token_ids)
            if eos_id is not None and ids and ids[-1] == eos_id:
                ids = ids[:-1]
            seen.setdefault(r.index if by_request else r.prompt_index, {})[lv.name] = (tuple(ids), r.audio_samples)
    mismatches: list[dict[str, Any]] = []
    for p, by_cfg in sorted(seen.items()):
        variants = {v for v in by_cfg.values()}
        if len(variants) > 1:
            mismatches.append({
                "request_index" if by_request else "prompt_index": p,
                "text_tokens": {k: len(v[0]) for k, v in by_cfg.items()},
                "audio_samples": {k: v[1] for k, v in by_cfg.items()},
                "text_ids_differ": len({v[0] for v in by_cfg.values()}) > 1,
            })
    return {"prompts_compared": len(seen), "compared_by": "request" if by_request else "prompt",
            "mismatches": mismatches}


async def _run_async(run: Run, model_dir: Path, pipe_box: dict[str, Any], log: Callable[[str], None]) -> str:
    opts = run.opts
    before = None
    first, _ = monolithic_halves(run.baseline)
    mono_cfg = _load_config(opts) if opts.monolithic else None  # (where the stack's thinker runs, and how)
    if opts.target and mono_cfg is not None and first:  # a target that is no gateway fails before anything runs
        await check_gateway(opts.target, access(opts, None), min(30.0, opts.request_timeout))
    if mono_cfg is not None and first:
        with run.phase("baseline_before"):
            # the checkpoint the system under test will run: a started stack's config may name it
            served = opts.serve and not opts.target and mono_cfg.model and opts.model is None
            model = Path(mono_cfg.model) if served else model_dir
            before = await _monolithic(run, model, mono_cfg, first, f"{MONOLITHIC} (before)")
    with run.phase("system_under_test"), sut_target(opts, log) as (target, cfg):
        if cfg is not None and cfg.model and opts.model is None:
            pipe_box["model_dir"] = Path(cfg.model)
        if opts.config is not None or cfg is not None:
            pipe_box["cfg"] = cfg or _load_config(opts)
        if target is None:
            pipe_box["pipe"] = _load_pipe(pipe_box)
        if cfg is not None and opts.serve and not opts.target:
            run.metrics_endpoints = endpoints(cfg)
        await _sut_phase(run, target, pipe_box.get("pipe"), cfg)
        sut = "grpc" if target is not None else "inprocess"
    need_pipe = (opts.inprocess and sut == "grpc") or opts.stages
    with run.phase("baselines"):
        if need_pipe and "pipe" not in pipe_box:
            pipe_box["pipe"] = _load_pipe(pipe_box)
        await _baseline_phase(run, target, pipe_box["model_dir"], pipe_box.get("pipe"), mono_cfg, before)
    if opts.stages:
        with run.phase("stages_alone"):
            _stage_phase(run, pipe_box["pipe"])
    return sut


def _load_config(opts: BenchOptions) -> Any:
    """The deploy config a run's stack or in-process pipeline takes (--config, else the default)."""
    from omnistage.config import load_config

    return load_config(opts.config)


def _load_pipe(box: dict[str, Any]) -> Any:
    """The in-process pipeline with the stack's settings (batching mode and all)."""
    from services.pipeline import InProcessPipeline

    return InProcessPipeline(box["model_dir"], box.get("cfg"))


def check_options(opts: BenchOptions) -> None:
    """Options no run can use together, before anything starts (ValueError: the CLI's usage error)."""
    if opts.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if any(c < 1 for c in opts.concurrency):
        raise ValueError(f"--concurrency levels must be >= 1, got {opts.concurrency}")
    if opts.target and opts.serve:
        raise ValueError("--target and --serve are exclusive: drive a running stack or start one")
    doors = [name for name, on in (("--http", opts.http), ("--realtime", opts.realtime),
                                   ("--responses", opts.responses), ("--completions", opts.completions))
             if on]  # fmt: skip
    if len(doors) > 1:
        raise ValueError(f"{' and '.join(doors)} are exclusive: each compares one door with gRPC")
    door = doors[0] if doors else "--http"
    front = bool(doors)
    if opts.realtime and opts.thinker_max_tokens > 4096:  # (the Realtime API's max_output_tokens)
        raise ValueError("--thinker-max-tokens: at most 4096 with --realtime (its max_output_tokens)")
    if front and opts.sampled_speech:
        raise ValueError(f"--sampled-speech with {door}: the comparison sends temperature 0 (greedy) "
                         "to both front doors")
    if front and not (opts.serve or (opts.target and opts.http_target)):
        raise ValueError(f"{door} needs a stack: --serve, or --target HOST:PORT with --http-target HOST:PORT")
    if front and (opts.rates or opts.plot_out is not None):  # (dropped without a word)
        raise ValueError(f"{door} compares the front doors at --concurrency levels: it takes no --rate and "
                         "draws no --plot")


def main(opts: BenchOptions, command: str | None = None) -> dict[str, Any]:
    """Runs the benchmark, prints the table, writes --json/--plot/--markdown; returns the result."""
    check_options(opts)
    if opts.http or opts.realtime or opts.responses or opts.completions:
        from benchmarks.front_doors import main as front_doors

        return front_doors(opts, command)
    torch.set_num_threads(opts.threads)
    widen_primitive_cache()  # as a stage process does: the in-process baselines get the same cache
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    machine = machine_info()
    prompts = load_prompts(opts.prompts)
    order = request_sequence(len(prompts), opts.num_requests, opts.seed)
    if opts.sampled_speech and (opts.monolithic or opts.stages):
        opts = replace(opts, monolithic=False, stages=False)
        skipped = ["sampled speech: generate() and the stage baselines run greedy speech, skipped"]
    else:
        skipped = []
    requests = [
        BenchRequest(i, p, prompts[p], opts.thinker_max_tokens, opts.talker_max_tokens,
                     talker_seed=i if opts.sampled_speech else None)
        for i, p in enumerate(order)
    ]
    nb = opts.num_requests if opts.baseline_requests is None else max(1, min(opts.baseline_requests, len(requests)))
    run = Run(opts, requests, requests[:nb], notes=skipped)
    if opts.serve and not opts.target:  # a config no bench stack can run is refused (ConfigError) before
        stack_config(opts)  # anything runs (the built-in checkpoint's first generation too)
    model_dir = Path(opts.model) if opts.model is not None else default_model_dir()
    box: dict[str, Any] = {"model_dir": model_dir}
    first_stack = len(stacks_run)
    sut = asyncio.run(_run_async(run, model_dir, box, run.log))
    model_dir = box["model_dir"]

    if opts.concurrency and 1 not in opts.concurrency:
        run.notes.append("no c=1 level: the TTFA/E2E ratios against baselines are null")
    inputs, basis = ratio_inputs(run, sut)
    ratios = compute_ratios(inputs)
    assert tuple(ratios) == RATIO_KEYS
    if run.stage_baseline:
        run.notes.append("stage baseline: " + run.stage_baseline["note"])
    run.notes += [f"{lv.name}: {n}" for lv in run.levels for n in lv.notes]
    machine["load_average_end"] = list(os.getloadavg())
    eos = PromptEncoder(model_dir).spec.im_end_id if run.levels else None
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "command": command if command is not None else command_line(),
        "started_at": started,
        "machine": machine,
        "model": str(model_dir),
        "system_under_test": sut,
        "target": opts.target,
        "settings": settings(opts),
        # the deploy config the stack (or in-process pipeline) ran with, and its logs' folder
        "stack_config": stack_config_json(opts, box.get("cfg")),
        "stack_run_dirs": stacks_run[first_stack:],
        "prompts": prompts,
        "request_prompt_indices": order,
        "baseline_request_indices": [r.index for r in run.baseline],
        "configurations": [lv.to_json() for lv in run.levels],
        "stage_baseline": run.stage_baseline,
        "ratios": ratios,
        "ratio_inputs": asdict(inputs),
        "ratio_basis": basis,
        "consistency": consistency(run.levels, eos, by_request=opts.sampled_speech),
        "notes": run.notes,
        "phase_seconds": run.phase_seconds,
        "total_seconds": time.perf_counter() - run.t0,
    }
    from benchmarks.report import format_report, markdown_summary, plot, saturation

    result["saturation"] = saturation(result)
    if not opts.quiet:
        print(format_report(result))
    if opts.json_out is not None:
        opts.json_out.parent.mkdir(parents=True, exist_ok=True)
        opts.json_out.write_text(json.dumps(result, indent=1) + "\n")
    if opts.plot_out is not None:
        opts.plot_out.parent.mkdir(parents=True, exist_ok=True)
        plot(result, opts.plot_out)
    if opts.markdown_out is not None:
        opts.markdown_out.parent.mkdir(parents=True, exist_ok=True)
        opts.markdown_out.write_text(
            markdown_summary(
                result,
                opts.json_out.name if opts.json_out else None,
                opts.plot_out.name if opts.plot_out else None,
            )
        )
    return result
