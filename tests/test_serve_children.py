"""Children of ``omnistage serve`` die with their parent, even when it is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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


def test_child_dies_when_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
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


def test_start_up_stops_when_interrupted_even_if_no_keyboard_interrupt_surfaced(tiny_dir: object) -> None:
    """`start_stack` polls its `interrupted` flag while it waits for the children: once set, it
    stops every child it started and raises KeyboardInterrupt (the serve command sets the flag on
    Ctrl-C as well as raising, in case a library call swallows the exception)."""
    import pytest

    from omnistage.cli.serve import start_stack
    from omnistage.config import DeployConfig, apply_overrides, port_layout
    from tests.integration.test_operations import free_layout

    cfg = apply_overrides(DeployConfig(), port_layout(free_layout()))
    asked: list[float] = []

    def interrupted() -> bool:
        asked.append(time.monotonic())
        return len(asked) > 2  # after the children were spawned, before they can be healthy

    spawned: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)  # type: ignore[call-overload]
        spawned.append(proc)
        return proc

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "Popen", popen)
        with pytest.raises(KeyboardInterrupt):
            start_stack(cfg, model=str(tiny_dir), interrupted=interrupted)
    assert len(spawned) == 4  # thinker, talker, code2wav, gateway
    assert all(p.poll() is not None for p in spawned)  # every child stopped before it raised
