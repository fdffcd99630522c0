"""`omnistage serve`: the whole stack as local processes on loopback, same topology as
production: one process per stage replica plus the gateway.

Children are started in dependency order (code2wav, talker, thinker, gateway) with each
upstream pointed at its downstream's replicas as an `ipv4:` address list (round_robin), and
the parent waits until every one answers grpc.health.v1 SERVING. Children get SIGTERM (drain)
when the parent stops and die with it if it is killed (PR_SET_PDEATHSIG), so no orphans.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from omnistage.config import DeployConfig
from omnistage.server.grpc_common import check
from omnistage.topology import PIPELINE


def cache_dir() -> Path:
    base = os.environ.get("OMNISTAGE_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "omnistage")
    return Path(base).expanduser()


def default_model_dir() -> Path:
    """The built-in tiny checkpoint, generated once into the cache dir (atomically)."""
    import hashlib

    from omnistage.models.qwen3_omni import tiny
    from omnistage.models.qwen3_omni.tiny import write_tiny_checkpoint

    # Keyed by the generator's source: an edited tiny.py never serves a stale cached copy.
    version = hashlib.sha256(Path(tiny.__file__).read_bytes()).hexdigest()[:12]
    target = cache_dir() / f"tiny-qwen3-omni-{version}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    write_tiny_checkpoint(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(cfg: DeployConfig, model: str | None = None) -> Path:
    """--model, then the config's `model`, then $OMNISTAGE_MODEL when it holds a checkpoint
    (the image sets it to an empty mount point when serving the tiny model), then tiny."""
    chosen = model or cfg.model
    env = os.environ.get("OMNISTAGE_MODEL")
    if not chosen and env and (Path(env) / "config.json").is_file():
        chosen = env
    return Path(chosen) if chosen else default_model_dir()


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


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen[bytes]


@dataclass
class Stack:
    cfg: DeployConfig
    model_dir: Path
    children: list[Child] = field(default_factory=list)
    log_dir: Path | None = None

    @property
    def gateway_address(self) -> str:
        return f"{self.cfg.host}:{self.cfg.gateway.port}"

    def addresses(self, name: str) -> list[str]:
        return [c.address for c in self.children if c.name == name]

    def child(self, name: str, index: int = 0) -> Child:
        return [c for c in self.children if c.name == name][index]

    def stop(self, timeout: float = 20.0) -> None:
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in self.children:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                c.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        self.children.clear()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


def _spawn(args: list[str], log_path: Path | None, env: dict[str, str]) -> subprocess.Popen[bytes]:
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "omnistage.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(env),
        )
    finally:
        if log_path and out is not subprocess.DEVNULL:
            out.close()  # type: ignore[union-attr]


def start_stack(
    cfg: DeployConfig, model: str | None = None, log_dir: Path | None = None, config_file: Path | None = None
) -> Stack:
    """Start every process and wait until all are healthy; raises (after cleanup) if one fails."""
    model_dir = resolve_model(cfg, model)
    from omnistage.models import open_checkpoint

    open_checkpoint(model_dir)  # fail here, with the checkpoint's problem, not in N children
    stack = Stack(cfg=cfg, model_dir=model_dir, log_dir=log_dir)
    env = dict(os.environ)
    cfg_path = config_file
    tmp_cfg = None
    if cfg_path is None:
        from omnistage.config import dump_config

        fd, name = tempfile.mkstemp(prefix="omnistage-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(dump_config(cfg))
        cfg_path = tmp_cfg = Path(name)
    common = ["--config", str(cfg_path), "--model", str(model_dir), "--host", cfg.host]
    try:
        for definition in reversed(PIPELINE):  # downstream first: each upstream finds its target up
            name = definition.name
            downstream = cfg.stage_target(definition.downstream) if definition.downstream else None
            for i, port in enumerate(cfg.stage_ports(name)):
                args = ["stage", name, "--port", str(port), *common]
                if downstream:
                    args += ["--downstream", downstream]
                log_path = log_dir / f"{name}-{i}.log" if log_dir else None
                stack.children.append(Child(name, f"{cfg.host}:{port}", _spawn(args, log_path, env)))
        args = ["gateway", "--port", str(cfg.gateway.port), "--thinker", cfg.stage_target("thinker"), *common]
        log_path = log_dir / "gateway.log" if log_dir else None
        stack.children.append(Child("gateway", stack.gateway_address, _spawn(args, log_path, env)))
        _wait_healthy(stack, cfg.timeouts.startup_timeout_s)
    except BaseException:
        stack.stop()
        raise
    finally:
        if tmp_cfg is not None:  # every child read it before it became healthy
            tmp_cfg.unlink(missing_ok=True)
    return stack


def _wait_healthy(stack: Stack, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(stack.children)
    while pending:
        for c in list(pending):
            code = c.proc.poll()
            if code is not None:
                where = f" (see {stack.log_dir}/)" if stack.log_dir else ""
                raise RuntimeError(f"{c.name} at {c.address} exited with code {code} during start-up{where}")
            if check(c.address, timeout=1.0):
                pending.remove(c)
        if pending and time.monotonic() > deadline:
            names = ", ".join(f"{c.name}@{c.address}" for c in pending)
            raise TimeoutError(f"not healthy after {timeout:.0f} s: {names}")
        if pending:
            time.sleep(0.2)
