"""`omnistage serve`: the whole stack as local processes on loopback, same topology as
production: one process per stage replica plus the gateway.

Before starting anything it checks that every port the stack needs (gRPC and metrics) is free.
Children are started in dependency order (code2wav, talker, thinker, gateway) with each
upstream pointed at its downstream's replicas as an `ipv4:` address list (round_robin), and
the parent waits until every one answers grpc.health.v1 SERVING. Each child logs into the run
folder (`<name>-<i>.log`), which also keeps the effective deploy config the children read.
Children get SIGTERM (drain) when the parent stops and die with it if it is killed
(PR_SET_PDEATHSIG), so no orphans.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from omnistage.cli.forker import PRELOAD, ForkedChild, Forker, forking_wanted, preload_modules, shared_forker
from omnistage.config import ConfigError, DeployConfig
from omnistage.server.health_check import check
from omnistage.server.ports import PortTaken, port_free, unusable_host
from omnistage.server.tls import gateway_channel_credentials, name_override, stage_channel_credentials

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    base = os.environ.get("OMNISTAGE_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "omnistage")
    return Path(base).expanduser()


TINY_GENERATOR = ("qwen3_omni/tiny.py", "tiny_files.py")  # the built-in checkpoint's generator, under omnistage/models


def default_model_dir() -> Path:
    """The built-in tiny checkpoint, generated once into the cache dir (atomically)."""
    import hashlib

    # Keyed by the generator's source: an edited generator never serves a stale cached copy. (Read
    # as files: importing them imports torch, which `serve` leaves to its forker until it must.)
    models = Path(__file__).resolve().parents[1] / "models"
    source = b"".join((models / f).read_bytes() for f in TINY_GENERATOR)
    version = hashlib.sha256(source).hexdigest()[:12]
    target = cache_dir() / f"tiny-qwen3-omni-{version}"
    if (target / "config.json").is_file():  # renamed into place whole: present means complete
        return target
    from omnistage.models.qwen3_omni.tiny import write_tiny_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    write_tiny_checkpoint(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


class ModelNotLocal(ValueError):
    """A model that is not a local checkpoint directory (omnistage never downloads)."""


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model(cfg: DeployConfig, model: str | None = None) -> Path:
    """MODEL / --model, then the config's `model`, then $OMNISTAGE_MODEL, then the built-in
    tiny checkpoint. The image sets $OMNISTAGE_MODEL to a mount point, empty when nothing is
    mounted: an empty directory there means the tiny checkpoint (said), while one that does not
    exist or holds no checkpoint is refused (a typo or a half-mounted volume served the tiny
    model's random weights in silence). A name that is not a local directory is refused clearly."""
    chosen = model or cfg.model
    env = os.environ.get("OMNISTAGE_MODEL")
    if not chosen and env:
        where = Path(env).expanduser()
        if not where.is_dir():
            raise ModelNotLocal(f"OMNISTAGE_MODEL={env}: no such checkpoint directory (unset it to serve the "
                                "built-in tiny checkpoint)")  # fmt: skip
        try:
            empty = not any(where.iterdir())
        except OSError as e:  # (an unreadable mount)
            raise ModelNotLocal(f"OMNISTAGE_MODEL={env}: cannot read it ({e.strerror})") from None
        if (where / "config.json").is_file():
            chosen = env
        elif not empty:
            raise ModelNotLocal(f"OMNISTAGE_MODEL={env}: no config.json there, so no checkpoint (a volume mounted "
                                "half, or the wrong directory)")  # fmt: skip
        else:
            log.warning("OMNISTAGE_MODEL=%s is empty (nothing mounted there): serving the built-in tiny checkpoint",
                        env)  # fmt: skip
    if not chosen:
        return default_model_dir()
    path = Path(chosen).expanduser()
    if not path.is_dir():
        if _HUB_ID.match(chosen) and not path.exists():
            raise ModelNotLocal(
                f"model {chosen!r} is not a local directory, and omnistage never downloads weights: fetch it once "
                f"(e.g. `hf download {chosen} --local-dir ./{chosen.split('/')[-1]}`) and pass that "
                "directory"
            )
        raise ModelNotLocal(f"checkpoint directory not found: {path}")
    return path


def check_devices(cfg: DeployConfig, names: tuple[str, ...] | None = None) -> None:
    """A stage on a CUDA device this machine's torch cannot use is a config error (exit 2),
    found before any process starts or any checkpoint loads: it was each child's
    "Torch not compiled with CUDA enabled" as it loaded, exit 1."""
    from omnistage.config import config_path

    cuda = {n: cfg.stage(n).device for n in (names or cfg.stage_names())}  # type: ignore[arg-type]
    cuda = {n: d for n, d in cuda.items() if d.startswith("cuda")}
    if not cuda:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for name, device in cuda.items():
        if int(device.partition(":")[2] or 0) >= count:
            have = f"{count} CUDA device{'s' * (count != 1)}" if count else "no CUDA device" + (
                "" if torch.version.cuda else f" (torch {torch.__version__} is a CPU-only build)")
            raise ConfigError(f"{config_path(name)}.device: {device}: this machine's torch sees {have}")  # type: ignore[arg-type]


PARENT_PID_ENV = "OMNISTAGE_PARENT_PID"


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child that should die with this process (see ``die_with_parent_if_asked``)."""
    return {**env, PARENT_PID_ENV: str(os.getpid())}


def die_with_parent_if_asked() -> None:
    """In a child of ``omnistage serve``: get SIGTERM when the parent dies (PR_SET_PDEATHSIG).

    The child sets this itself at start-up rather than in a ``preexec_fn``: a ``preexec_fn``
    makes Popen use fork() instead of vfork(), which runs gRPC's fork handlers; while the
    parent's gRPC threads are busy (pytest, ``bench --serve``) they leave a poller behind in the
    child, which then aborts on exec ("epoll_wait error: Bad file descriptor", exit -6).
    """
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent:
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # the parent died before prctl: nobody will signal us
        os.kill(os.getpid(), signal.SIGTERM)


RESTART_BACKOFF_S = (0.5, 30.0)  # first delay before a restart, and the cap as it doubles
PORTS_TAKEN_GRACE_S = 2.0  # a restart held up this long by a taken port says so, then every PORTS_TAKEN_SAY_S
PORTS_TAKEN_SAY_S = 30.0
RESTART_GIVE_UP = 5  # restarts in a row that never got healthy: the process cannot start at all
HEALTHY_RESET_S = 60.0  # healthy this long: the next failure starts the backoff over


@dataclass
class Child:
    name: str  # stage or "gateway"
    index: int  # replica
    address: str
    proc: subprocess.Popen[bytes] | ForkedChild
    log: Path
    args: list[str] = field(default_factory=list)  # how to start it again
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    failed_starts: int = 0  # restarts in a row that died before they were healthy
    quick_deaths: int = 0  # deaths in a row within HEALTHY_RESET_S of serving (a query of death)
    healthy_since: float | None = None
    restart_at: float | None = None  # when it is dead and a restart is due
    ports_taken_since: float | None = None  # since when a due restart has found its ports taken
    log_from: int = 0  # its log's size when this run of it started (the log is appended to)
    ports_taken_said: float | None = None  # when `heal` last said so

    @property
    def role(self) -> str:
        return f"{self.name}[{self.index}]"

    def status(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "running"
        return f"exited with code {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else "")

    def last_log_line(self) -> str:
        """Why it stopped: the last `error:` line of its log (what the CLI prints for a known
        failure; what an exit prints after it is noise), else the last line that says something."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_from)  # this run's lines: a reason an earlier run gave is not this one's
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return next((line for line in reversed(lines) if line.startswith("error:")), lines[-1] if lines else "")


class StartupError(RuntimeError):
    """The stack could not start; the message says which process and why. `exit_code` 2: the
    process refused a bad argument, config or checkpoint (its own exit code said so)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Stack:
    cfg: DeployConfig
    model_dir: Path
    run_dir: Path
    children: list[Child] = field(default_factory=list)
    forker: Forker | None = None  # starts the children by forking, where it can (see forker.py; it outlives the stack)

    def spawn(self, args: list[str], log_path: Path, env: dict[str, str],
              interrupted: Callable[[], bool] = lambda: False) -> subprocess.Popen[bytes] | ForkedChild:  # fmt: skip
        """A child running `omnistage.cli` with `args`: forked where the stack has a forker, else exec'd."""
        forked = None if self.forker is None else self.forker.spawn(args, log_path, child_env(env), interrupted)
        return forked if forked is not None else _spawn(args, log_path, env)

    @property
    def gateway_address(self) -> str:
        return self.cfg.address(self.cfg.gateway.port)

    @property
    def http_address(self) -> str | None:
        port = self.cfg.gateway.http_port
        return None if port is None else self.cfg.address(port)

    @property
    def log_dir(self) -> Path:
        return self.run_dir

    def addresses(self, name: str) -> list[str]:
        return [c.address for c in self.children if c.name == name]

    def child(self, name: str, index: int = 0) -> Child:
        return [c for c in self.children if c.name == name][index]

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def status_lines(self) -> list[str]:
        width = max((len(c.role) for c in self.children), default=0)  # (thinker-prefill[0] passed 12)
        return [f"  {c.role:<{width}}  {c.address:<22} pid {c.proc.pid:<8} {c.status()}" for c in self.children]

    @functools.cached_property
    def _credentials(self) -> dict[str, Any]:
        """What health checks dial the gateway and the stages with (TLS files read once)."""
        tls = self.cfg.tls
        return {"gateway": gateway_channel_credentials(tls), "stage": stage_channel_credentials(tls)}

    def healthy(self, c: Child, timeout: float) -> bool:
        """`c` answers SERVING (over TLS as the config says)."""
        creds = self._credentials["gateway" if c.name == "gateway" else "stage"]
        return check(c.address, timeout=timeout, credentials=creds, options=name_override(self.cfg.tls))

    def heal(self, say: Callable[[str], None]) -> None:
        """One supervision pass: restart each dead child with backoff (same port, same
        arguments), and note when restarted ones are healthy again. Raises StartupError when a
        child keeps dying before it is healthy (it cannot start at all)."""
        now = time.monotonic()
        for c in self.children:
            if c.proc.poll() is None:
                if c.healthy_since is None and self.healthy(c, 1.0):  # (0.3 s missed a busy 2-core box)
                    c.healthy_since, c.failed_starts = now, 0
                    if c.restarts:
                        say(f"{c.role} at {c.address} is serving again (pid {c.proc.pid}, restart {c.restarts})")
                continue
            if c.restart_at is None:
                reason = c.last_log_line() if (c.proc.returncode or 0) > 0 else ""  # a signal leaves none
                if c.healthy_since is None:
                    c.failed_starts += 1
                    if c.failed_starts >= RESTART_GIVE_UP:
                        raise StartupError(f"{c.role} at {c.address} {c.status()} {c.failed_starts} times in a row "
                                           f"before serving: it cannot start" + (f": {reason}" if reason else "")
                                           + f" (log: {c.log})")  # fmt: skip
                elif now - c.healthy_since > HEALTHY_RESET_S:
                    c.quick_deaths = 0
                else:  # it served, then died soon: backs off as a failed start does, never gives up
                    c.quick_deaths += 1
                first, cap = RESTART_BACKOFF_S
                delay = min(cap, first * 2 ** min(c.failed_starts + c.quick_deaths, 10))
                c.restart_at = now + delay
                say(f"{c.role} at {c.address} (pid {c.proc.pid}) {c.status()}" + (f": {reason}" if reason else "")
                    + f"; restarting it in {delay:.1f} s (log: {c.log})")  # fmt: skip
            elif now >= c.restart_at:
                taken = [p for p in self._ports_of(c) if not port_free(self.cfg.host, p)]
                if taken:  # its socket not released yet, or another process took it meanwhile
                    c.restart_at = now + 0.5
                    c.ports_taken_since = c.ports_taken_since or now
                    due = c.ports_taken_said is None or now - c.ports_taken_said >= PORTS_TAKEN_SAY_S
                    if due and now - c.ports_taken_since >= PORTS_TAKEN_GRACE_S:
                        c.ports_taken_said = now
                        say(f"{c.role} at {c.address}: cannot restart yet: port(s) {', '.join(map(str, taken))} "
                            "taken by another process; restarting it once they are free")  # fmt: skip
                    continue
                c.log_from = _size(c.log)
                c.proc = self.spawn(c.args, c.log, c.env)
                c.restarts += 1
                c.restart_at = c.healthy_since = c.ports_taken_since = c.ports_taken_said = None
                say(f"{c.role} at {c.address} restarted (pid {c.proc.pid}, restart {c.restarts})")

    def _ports_of(self, c: Child) -> list[int]:
        """The ports `c` listens on (gRPC, metrics, a gateway's HTTP), as the config lists them."""
        return [port for port, role in self.cfg.ports() if role.partition(" ")[0] == c.role]

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the gateways, and once they are gone (each drains its requests up to
        timeouts.drain_grace_s) the stages: a stage that drained with them would refuse the
        calls the requests still queued above it open on their first step. SIGKILL what is left
        after `timeout` per phase (default: the grace and 10 s: a gateway's HTTP server takes
        up to 5 s past its gRPC one)."""
        if timeout is None:
            timeout = self.cfg.timeouts.drain_grace_s + 10.0
        for phase in ([c for c in self.children if c.name == "gateway"],
                      [c for c in self.children if c.name != "gateway"]):  # fmt: skip
            for c in phase:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for c in phase:
                try:
                    c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


def new_run_dir(log_dir: Path | None) -> Path:
    """`log_dir`, or a fresh folder under the cache for this run (a new one, never another
    stack's: a process may start two within a second)."""
    stem = cache_dir() / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run = log_dir or stem
    for n in itertools.count(2):
        try:
            run.mkdir(parents=True, exist_ok=log_dir is not None)
            return run
        except OSError as e:
            if isinstance(e, FileExistsError) and log_dir is None:  # (another stack's)
                run = stem.with_name(f"{stem.name}-{n}")
                continue
            where = "--log-dir" if log_dir else "the run folder (give --log-dir)"
            raise ConfigError(f"{where} {run}: cannot make it: {e.strerror or e}") from None
    raise AssertionError("unreachable")


def check_ports(cfg: DeployConfig) -> None:
    """Refuse to start anything while a port of the stack is taken, naming each one (or when
    its host is no address this machine can listen on)."""
    why = unusable_host(cfg.host)
    if why:
        raise ConfigError(f"host {cfg.host}: nothing can listen there ({why}): give one of this machine's addresses "
                          "(127.0.0.1 by default; 0.0.0.0 for all)")  # fmt: skip
    taken = [f"{port} ({role})" for port, role in cfg.ports() if not port_free(cfg.host, port)]
    if taken:
        raise PortTaken(
            f"ports taken on {cfg.host}: {', '.join(taken)}; another stack or process listens there "
            "(move this stack with --port P, or stop the other one)"
        )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _spawn(args: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log_path, "ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "omnistage.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=child_env(env)
        )


def start_stack(
    cfg: DeployConfig,
    model: str | None = None,
    log_dir: Path | None = None,
    *,
    log_level: str = "info",
    log_format: str = "text",
    api_key: str | None = None,
    interrupted: Callable[[], bool] = lambda: False,
) -> Stack:
    """Start every process and wait until all are healthy; raises (after cleanup) if one fails,
    and KeyboardInterrupt (after cleanup) once `interrupted()` is true."""
    from omnistage.config import dump_config
    from omnistage.server.tls import check_files

    given = new_run_dir(log_dir) if log_dir is not None else None  # a --log-dir it cannot use: said first
    model_dir = resolve_model(cfg, model)  # (imports no torch)
    run_dir = given or new_run_dir(None)
    env = dict(os.environ)
    if api_key:  # to the gateway's environment, never on a command line
        env["OMNISTAGE_API_KEY"] = api_key
    forker = None
    if forking_wanted([cfg.stage(n).device for n in cfg.stage_names()]):  # type: ignore[arg-type]
        try:  # first: it imports what every child needs while this process reads the checkpoint
            forker = shared_forker(list(PRELOAD), child_env(env), run_dir / "forker.log")
        except OSError as e:
            log.warning("no forker (%s): children start by exec", e)
    try:
        from omnistage.models import open_checkpoint  # (torch and transformers: the forker's imports meanwhile)
        from omnistage.models.family import FAMILIES

        checkpoint = open_checkpoint(model_dir)
        checkpoint.check_serves(cfg.audio_output)  # fail here, with the problem, not in N children
        check_devices(cfg)
        check_files(cfg.tls, cfg.host)  # (its own health checks dial every process on host: before any starts)
        check_ports(cfg)
    except BaseException:
        if given is None:  # the folder made for this run: nothing ran (a forker that logs there is closed)
            if forker is not None and forker.log_path.parent == run_dir:
                forker.close()
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    stack = Stack(cfg=cfg, model_dir=model_dir, run_dir=run_dir, forker=forker)
    cfg_path = stack.run_dir / "omnistage.yaml"  # what the children read, kept with their logs
    cfg_path.write_text(dump_config(cfg))
    common = ["--config", str(cfg_path), "--model", str(model_dir), "--host", cfg.host,
              "--log-level", log_level, "--log-format", log_format]  # fmt: skip
    try:
        if forker is not None:  # and the modules of the checkpoint's family
            forker.need(preload_modules(FAMILIES[checkpoint.family.model_type]))

        def start(name: str, i: int, port: int, args: list[str]) -> None:
            log_path = stack.run_dir / f"{name}-{i}.log"
            log_from = _size(log_path)  # (its log is appended to)
            proc = stack.spawn(args, log_path, env, interrupted)
            stack.children.append(Child(name, i, cfg.address(port), proc, log_path, args, env, log_from=log_from))

        chain = cfg.chain()
        for definition in reversed(chain):  # downstream first: each upstream finds its target up
            name = definition.name
            below = cfg.downstream(name)
            downstream = cfg.stage_target(below) if below else None
            for i, port in enumerate(cfg.stage_ports(name)):
                args = ["stage", name, "--port", str(port), *common]
                start(name, i, port, [*args, "--downstream", downstream] if downstream else args)
        http_ports = cfg.http_ports()
        for i in range(cfg.gateway.replicas):  # replica i on port + i (and HTTP port + i)
            port = cfg.gateway.port + i
            args = ["gateway", "--port", str(port), "--thinker", cfg.stage_target(chain[0].name), *common]
            start("gateway", i, port, args + (["--http-port", str(http_ports[i])] if http_ports else ["--no-http"]))
        _wait_healthy(stack, cfg.timeouts.startup_timeout_s, interrupted)
    except BaseException:
        stack.stop()
        raise
    return stack


def _wait_healthy(stack: Stack, timeout: float, interrupted: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout
    pending = list(stack.children)
    while pending:
        if interrupted():
            raise KeyboardInterrupt
        for c in list(pending):
            if c.proc.poll() is not None:
                reason = c.last_log_line()
                raise StartupError(
                    f"{c.role} at {c.address} {c.status()} during start-up"
                    + (f": {reason}" if reason else "")
                    + f" (log: {c.log})",
                    exit_code=2 if c.proc.returncode == 2 else 1,
                )
            if stack.healthy(c, 1.0):
                c.healthy_since = time.monotonic()
                pending.remove(c)
        if pending and time.monotonic() > deadline:
            names = ", ".join(f"{c.role}@{c.address} (log: {c.log})" for c in pending)
            raise StartupError(f"not healthy after {timeout:.0f} s: {names}")
        if pending:
            time.sleep(0.2)
