"""`serve`'s forker: children forked from one preloaded process are this process's own, run
their command line with their own log, environment, title and signals, and anything the forker
cannot do safely falls back to exec."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from omnistage.cli import forker as forker_module
from omnistage.cli.forker import ForkedChild, Forker, forking_wanted, shared_forker
from omnistage.cli.serve import child_env


def _forker(tmp_path: Path, modules: tuple[str, ...] = ("json",), env: dict[str, str] | None = None) -> Forker:
    return Forker(list(modules), child_env(env or dict(os.environ)), tmp_path / "forker.log")


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _catches_sigint(pid: int) -> bool:
    caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGINT - 1)))


def test_a_forked_child_runs_its_command_as_a_child_of_this_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    listener = socket.create_server(("127.0.0.1", 0))  # never answers: the client waits on it
    port = listener.getsockname()[1]
    forker = _forker(tmp_path)
    was = forker_module._subreaper()
    try:
        args = ["client", "hi", "--target", f"127.0.0.1:{port}", "--out", str(tmp_path / "r.wav")]
        waiting = forker.spawn(args, tmp_path / "client.log", child_env(dict(os.environ)))
        assert waiting is not None
        assert _parent_of(waiting.pid) == os.getpid()  # reparented here: waited for, signalled, reaped here
        title = f"{sys.executable} -m omnistage.cli client hi".encode()  # what ps shows of an exec'd one
        deadline = time.monotonic() + 20
        while title not in (shown := Path(f"/proc/{waiting.pid}/cmdline").read_bytes().replace(b"\0", b" ")):
            assert time.monotonic() < deadline, shown  # (the child sets it as it starts)
            time.sleep(0.01)
        while not _catches_sigint(waiting.pid):  # (and takes Ctrl-C as it runs its command)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert waiting.poll() is None
        waiting.send_signal(signal.SIGINT)  # Ctrl-C: the forker ignores it, its children do not
        assert waiting.wait(20) == 130
        assert "interrupted" in (tmp_path / "client.log").read_text()

        # its own environment, its exit code and its log
        missing = tmp_path / "missing.yaml"
        render = ["deploy", "render", "--target", "compose", "--out", str(tmp_path / "out")]
        env = child_env({**os.environ, "OMNISTAGE_CONFIG": str(missing)})
        refused = forker.spawn(render, tmp_path / "render.log", env)
        assert refused is not None and refused.wait(20) == 2
        said = (tmp_path / "render.log").read_text()
        assert str(missing) in said and "OMNISTAGE_CONFIG" in said

        forker_module._set_subreaper(1)  # a host process that is a subreaper itself stays one
        killed = forker.spawn(args, tmp_path / "client.log", child_env(dict(os.environ)))
        assert killed is not None and forker_module._subreaper() == 1
        killed.kill()
        assert killed.wait(20) == -signal.SIGKILL and killed.poll() == -signal.SIGKILL
        signalled: list[int] = []
        monkeypatch.setattr(forker_module.os, "kill", lambda pid, sig: signalled.append(pid))
        killed.send_signal(signal.SIGTERM)  # reaped: never signals a pid that may be reused
        assert signalled == []
    finally:
        monkeypatch.undo()
        forker_module._set_subreaper(was)
        forker.close()
        listener.close()
    assert forker.proc.returncode == 0  # the end of its input ends it


def test_a_forker_with_a_python_thread_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "threaded_module.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    forker = _forker(tmp_path, ("threaded_module",), env)
    with caplog.at_level(logging.WARNING):
        assert forker.spawn(["--version"], tmp_path / "v.log", child_env(env)) is None
    assert "it runs 2 threads" in caplog.text and "children start by exec" in caplog.text
    assert forker.proc.poll() is not None  # given up: stopped
    assert forker.spawn(["--version"], tmp_path / "v.log", child_env(env)) is None


def test_children_start_by_exec_once_the_forker_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    from omnistage.cli import serve
    from omnistage.config import parse_config

    forker = _forker(tmp_path)
    stack = serve.Stack(parse_config({}), Path("."), tmp_path, forker=forker)
    first = stack.spawn(["--version"], tmp_path / "v.log", dict(os.environ))
    assert first.wait(20) == 0 and first.pid != forker.proc.pid
    assert "omnistage" in (tmp_path / "v.log").read_text()
    forker.proc.kill()
    forker.proc.wait()
    execs: list[list[str]] = []
    monkeypatch.setattr(serve, "_spawn", lambda args, log, env: execs.append(args) or "exec'd")
    with caplog.at_level(logging.WARNING):
        assert stack.spawn(["--version"], tmp_path / "v.log", dict(os.environ)) == "exec'd"
    assert execs == [["--version"]] and "it exited" in caplog.text
    stack.stop()


def test_only_a_stack_wholly_on_the_cpu_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNISTAGE_FORK_CHILDREN", raising=False)
    assert forking_wanted(["cpu", "cpu"])
    assert not forking_wanted(["cpu", "cuda:0"])  # a process that touched CUDA cannot fork a CUDA user
    monkeypatch.setenv("OMNISTAGE_FORK_CHILDREN", "0")
    assert not forking_wanted(["cpu"])


def test_a_child_that_exited_before_it_was_adopted_keeps_its_exit_code() -> None:
    """The check that a forked child is this process's own reaps one that has already exited:
    its exit code is kept, not lost (it read as 255)."""
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # until it has exited, left unreaped
    child = ForkedChild(pid, [])
    assert child.adopted() and child.poll() == 3 and child.wait(1) == 3
    assert not ForkedChild(1, []).adopted()  # init is no child of this process


def test_an_interrupt_while_the_forker_imports_stops_it_at_once(tmp_path: Path) -> None:
    (tmp_path / "slow_module.py").write_text("import time\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    asked: list[float] = []
    forker = Forker(["slow_module"], child_env(env), tmp_path / "forker.log")
    with pytest.raises(KeyboardInterrupt):
        forker.spawn(["--version"], tmp_path / "v.log", child_env(env),
                     interrupted=lambda: bool(asked.append(time.monotonic())) or len(asked) > 3)  # fmt: skip
    forker.close()
    assert forker.proc.returncode == -signal.SIGTERM  # terminated, not left to finish its imports


def test_the_stacks_of_one_process_share_a_forker_while_it_can_fork(tmp_path: Path) -> None:
    env = child_env(dict(os.environ))
    first = shared_forker(["json"], env, tmp_path / "forker.log")
    assert shared_forker(["json"], env, tmp_path / "other.log") is first  # the next stack's: no new imports
    assert shared_forker(["json"], {**env, "OMNISTAGE_API_KEY": "k"}, tmp_path / "forker.log") is first  # (unread)
    assert shared_forker(["json", "csv"], env, tmp_path / "forker.log") is first  # (it imports csv too)
    assert first.modules == ["json", "csv"]
    child = first.spawn(["--version"], tmp_path / "v.log", env)
    assert child is not None and child.wait(20) == 0
    other_env = shared_forker(["json"], {**env, "OMNISTAGE_PROBE": "1"}, tmp_path / "forker.log")
    assert other_env is not first and not first.usable()  # what its imports saw differs: replaced, closed
    other_env.close()
    again = shared_forker(["json"], env, tmp_path / "forker.log")
    assert again is not other_env and again.usable()  # one that cannot fork any more is replaced
    again.close()


def test_a_forker_imports_the_modules_a_stack_needs_before_its_next_child(tmp_path: Path) -> None:
    """`serve` starts the forker before it reads the checkpoint, then names the model family:
    the forker imports it itself, before it forks the next child; one it cannot import is given
    up (its children start by exec and say why in their own logs)."""
    marker = "import os, pathlib\npathlib.Path(__file__).with_suffix('.pid').write_text(str(os.getpid()))\n"
    (tmp_path / "family_a.py").write_text(marker)
    (tmp_path / "broken_family.py").write_text("raise ImportError('no model code here')\n")
    env = child_env({**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    forker = Forker(["json"], env, tmp_path / "forker.log")
    try:
        forker.need(["json", "family_a"])
        assert forker.modules == ["json", "family_a"]
        child = forker.spawn(["--version"], tmp_path / "v.log", env)
        assert child is not None and child.wait(20) == 0
        assert (tmp_path / "family_a.pid").read_text() == str(forker.proc.pid)  # imported there, once
        forker.need(["broken_family"])
        assert forker.spawn(["--version"], tmp_path / "v2.log", env) is None and not forker.usable()
    finally:
        forker.close()


def test_a_child_that_cannot_start_exits_1_and_the_forker_goes_on(tmp_path: Path) -> None:
    """A child that fails before its command runs (here: no folder for its log) exits 1 with
    the reason in the forker's log, and the forker answers the next request for itself."""
    forker = _forker(tmp_path)
    try:
        failed = forker.spawn(["--version"], tmp_path / "no" / "such" / "v.log", child_env(dict(os.environ)))
        assert failed is not None and failed.wait(20) == 1
        assert "FileNotFoundError" in (tmp_path / "forker.log").read_text()
        ok = forker.spawn(["--version"], tmp_path / "v.log", child_env(dict(os.environ)))
        assert ok is not None and ok.pid != failed.pid and ok.wait(20) == 0
        assert "omnistage" in (tmp_path / "v.log").read_text()
    finally:
        forker.close()


def test_serve_starts_its_forker_before_it_imports_torch(tmp_path: Path, tiny_dir: Path) -> None:
    """The forker imports torch, transformers and the workers (the most of a stack's start-up)
    while `serve` reads the checkpoint, which imports them too: `serve` must not import them
    before it starts the forker (they overlap on two cores)."""
    import subprocess

    from tests.integration.conftest import free_port_block

    code = "\n".join([
        "import sys",
        "from omnistage.cli import serve",
        "from omnistage.config import DeployConfig, apply_overrides, port_layout",
        "def started(*args):",
        "    print('torch' in sys.modules, 'transformers' in sys.modules)",
        "    raise SystemExit(0)",
        "serve.shared_forker = started",
        f"cfg = apply_overrides(DeployConfig(), port_layout({free_port_block(400)}))",
        f"serve.start_stack(cfg, model={str(tiny_dir)!r}, log_dir=__import__('pathlib').Path({str(tmp_path)!r}))",
    ])  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != forker_module.FORK_ENV})  # fmt: skip
    assert done.stdout == "False False\n", (done.stdout, done.stderr)
