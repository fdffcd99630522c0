"""Children of ``omnistage serve`` die with their parent, even when it is SIGKILLed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# The parent: starts a child the way ``omnistage serve`` does (its env from child_env, no
# preexec_fn), prints the child's pid, then waits to be killed.
PARENT = """
import os, subprocess, sys, time
from omnistage.cli.serve import child_env
child = subprocess.Popen(
    [sys.executable, "-c", "from omnistage.cli.serve import die_with_parent_if_asked as d; d(); "
     "print('armed', flush=True); import time; time.sleep(120)"],
    env=child_env(dict(os.environ)), stdout=subprocess.PIPE, text=True,
)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is dead: it waits for its reaper
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # reaped in between
        return False


# The same, its child forked by a forker (as `serve` starts a stack on the CPU); the child is a
# client waiting on the test's silent socket (argv[1]), which the test accepts once it runs.
FORKING_PARENT = """
import os, sys, tempfile, time
from pathlib import Path
from omnistage.cli.forker import Forker
from omnistage.cli.serve import child_env
logs = Path(tempfile.mkdtemp())
forker = Forker(["json"], child_env(dict(os.environ)), logs / "forker.log")
args = ["client", "hi", "--target", f"127.0.0.1:{sys.argv[1]}", "--out", str(logs / "r.wav")]
child = forker.spawn(args, logs / "child.log", child_env(dict(os.environ)))
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("parent_script", [PARENT, FORKING_PARENT], ids=["exec", "forked"])
def test_child_dies_when_parent_is_killed(parent_script: str) -> None:
    silent = socket.create_server(("127.0.0.1", 0))
    silent.settimeout(60)
    port = str(silent.getsockname()[1])
    parent = subprocess.Popen([sys.executable, "-c", parent_script, port], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        if parent_script is FORKING_PARENT:
            held = silent.accept()[0]  # it runs its command, so it is armed (it arms first); held open here
            held.settimeout(None)
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child_pid)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        silent.close()


def test_start_up_stops_when_interrupted_even_if_no_keyboard_interrupt_surfaced(
        tiny_dir: object, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`start_stack` polls its `interrupted` flag while it waits for the children: once set, it
    stops every child it started and raises KeyboardInterrupt (the serve command sets the flag on
    Ctrl-C as well as raising, in case a library call swallows the exception)."""
    import pytest

    from omnistage.cli.forker import ForkedChild
    from omnistage.cli.serve import start_stack
    from omnistage.config import DeployConfig, apply_overrides, port_layout
    from tests.integration.test_operations import free_layout

    monkeypatch.delenv("OMNISTAGE_FORK_CHILDREN", raising=False)
    cfg = apply_overrides(DeployConfig(), port_layout(free_layout()))
    asked: list[float] = []

    def interrupted() -> bool:
        asked.append(time.monotonic())
        return len(spawned) == 4  # after the children were spawned, before they can be healthy

    from omnistage.cli import serve

    spawned: list[Any] = []
    real_spawn = serve.Stack.spawn

    def spawn(self: serve.Stack, *args: Any) -> Any:
        proc = real_spawn(self, *args)
        spawned.append(proc)
        forkers.add(self.forker)
        return proc

    forkers: set[Any] = set()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve.Stack, "spawn", spawn)
        with pytest.raises(KeyboardInterrupt):
            start_stack(cfg, model=str(tiny_dir), interrupted=interrupted)
    assert len(spawned) == 4  # thinker, talker, code2wav, gateway
    assert all(isinstance(p, ForkedChild) for p in spawned)  # (all on the CPU: forked)
    assert all(p.poll() is not None for p in spawned)  # every child stopped before it raised
    assert len(forkers) == 1 and next(iter(forkers)).usable()  # kept for this process's next stack


def test_a_child_that_dies_soon_after_serving_is_restarted_later_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that serves, then dies within HEALTHY_RESET_S (a request that kills it): each
    restart waits twice as long as the one before, as for a process that cannot start, but the
    stack never gives up on it; serving longer than HEALTHY_RESET_S starts the backoff over."""
    from types import SimpleNamespace

    from omnistage.cli import serve
    from omnistage.config import parse_config

    mp = monkeypatch
    clock = [1000.0]
    mp.setattr(serve.time, "monotonic", lambda: clock[0])
    mp.setattr(serve, "port_free", lambda host, port: True)
    proc = SimpleNamespace(code=None, pid=1)
    proc.poll = lambda: proc.code
    proc.returncode = 0
    mp.setattr(serve, "_spawn", lambda args, log, env: proc)
    child = serve.Child("talker", 0, "127.0.0.1:9", proc, Path("/dev/null"))  # type: ignore[arg-type]
    stack = serve.Stack(parse_config({}), Path("."), Path("."), [child])
    mp.setattr(stack, "healthy", lambda c, timeout: True)

    def life(serving_s: float) -> float:
        """It serves `serving_s`, dies, and is restarted: the delay before the restart."""
        proc.code = None
        stack.heal(lambda line: None)  # healthy now
        clock[0] += serving_s
        proc.code = -9
        stack.heal(lambda line: None)
        assert child.restart_at is not None
        delay = child.restart_at - clock[0]
        clock[0] = child.restart_at
        stack.heal(lambda line: None)  # restarted
        return delay

    delays = [life(2.0) for _ in range(serve.RESTART_GIVE_UP + 2)]  # past the give-up count: never raises
    first, cap = serve.RESTART_BACKOFF_S
    assert delays == [min(cap, first * 2.0**n) for n in range(1, len(delays) + 1)]  # 1, 2, 4, ... up to the cap
    assert delays[-1] == cap
    assert life(serve.HEALTHY_RESET_S + 1) == serve.RESTART_BACKOFF_S[0]  # a long life: the backoff starts over


def test_the_stop_flag_wakes_its_waiter_soon_after_a_signal_sets_it() -> None:
    """`serve`'s stop flag polls: a wait ends soon after a signal handler sets it, and runs to
    its timeout otherwise. (That it takes no lock, which a second signal could wait on forever,
    is what test_operations' signal storm on a running `serve` exercises.)"""
    import signal
    import time

    from omnistage.cli.main import StopFlag

    flag = StopFlag()
    t0 = time.monotonic()
    assert not flag.wait(0.3) and time.monotonic() - t0 >= 0.3
    previous = signal.signal(signal.SIGALRM, lambda *_: flag.set())
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        assert flag.wait(10) and time.monotonic() - t0 < 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_restart_held_up_by_a_taken_port_says_which_and_goes_once_it_is_free(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:  # fmt: skip
    """A dead child whose gRPC or metrics port another process holds: `heal` waits, says so
    (after a short grace, then every 30 s), and restarts it once the port is free; it waited
    silently, and a taken metrics port was not looked at (the child died on it again). The
    reason given for a death is the child's `error:` line, not what its exit printed after it."""
    from types import SimpleNamespace

    from omnistage.cli import serve
    from omnistage.config import parse_config

    mp = monkeypatch
    clock = [1000.0]
    mp.setattr(serve.time, "monotonic", lambda: clock[0])
    held = {7201 + 1000}  # the talker's metrics port
    mp.setattr(serve, "port_free", lambda host, port: port not in held)
    proc = SimpleNamespace(code=1, pid=1)
    proc.poll = lambda: proc.code
    proc.returncode = 1
    spawned: list[int] = []
    mp.setattr(serve, "_spawn", lambda args, log, env: spawned.append(1) or proc)
    log = tmp_path / "talker-0.log"
    log.write_text("error: talker metrics: cannot listen on 127.0.0.1:8201: the port is taken\n"
                   "sys:1: RuntimeWarning: coroutine 'AioServer.shutdown' was never awaited\n")  # fmt: skip
    child = serve.Child("talker", 0, "127.0.0.1:7201", proc, log)  # type: ignore[arg-type]
    child.healthy_since = 0.0  # it had served
    stack = serve.Stack(parse_config({}), Path("."), Path("."), [child])
    said: list[str] = []
    stack.heal(said.append)
    assert "8201: the port is taken" in said[-1] and "RuntimeWarning" not in said[-1]
    for _ in range(20):  # 10 s of passes every 0.5 s
        clock[0] += 0.5
        stack.heal(said.append)
    waits = [line for line in said if "cannot restart yet" in line]
    assert len(waits) == 1 and "port(s) 8201 taken by another process" in waits[0]
    assert not spawned
    held.clear()
    clock[0] += 0.5
    stack.heal(said.append)
    assert spawned and child.restarts == 1
    # this run dies for another reason, printing no error: line: the last run's is not given as its own
    proc.code = None
    stack.heal(said.append)
    with log.open("a") as f:
        f.write("RuntimeError: boom\n")
    proc.code = 1
    stack.heal(said.append)
    assert "RuntimeError: boom" in said[-1] and "8201" not in said[-1], said[-1]

