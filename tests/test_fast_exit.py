"""`fast_exit`: a process ends as `sys.exit` and the interpreter would end it, without the teardown."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, logging, logging.handlers, sys, threading, time, weakref
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from omnistage.server.fast_exit import fast_exit

    out = Path(sys.argv[1])
    # held until logging's shutdown (an atexit handler) flushes it
    held = logging.handlers.MemoryHandler(1000, flushLevel=logging.CRITICAL, target=logging.StreamHandler(sys.stderr))
    logging.getLogger().addHandler(held)
    logging.getLogger().setLevel(logging.INFO)

    def late() -> None:
        time.sleep(0.3)
        (out / "thread").write_text("joined")

    class Held:
        pass

    obj = Held()
    weakref.finalize(obj, (out / "finalized").write_text, "unlinked")  # how ShmPool unlinks its segments
    atexit.register((out / "atexit").write_text, "ran")
    threading.Thread(target=late).start()
    # neither may hold the exit (joined for as long as that, the run times out): a daemon, and a
    # pool's idle worker, which the interpreter's shutdown tells to end
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    pool = ThreadPoolExecutor(1)
    pool.submit(int).result()
    print("buffered on a pipe")
    logging.info("a last log line")
    fast_exit({status}, join_s=600)
    (out / "after").write_text("fast_exit returned")
    """
)


def run(tmp_path: Path, status: str) -> subprocess.CompletedProcess[str]:
    script = SCRIPT.replace("{status}", status)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (its stdout buffered, as on a pipe)
    return subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[1], env=env)  # fmt: skip


def test_fast_exit_joins_threads_runs_atexit_and_flushes(tmp_path: Path) -> None:
    done = run(tmp_path, "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "buffered on a pipe\n"
    assert done.stderr.endswith("a last log line\n")
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "finalized").read_text() == "unlinked"
    assert not (tmp_path / "after").exists()


@pytest.mark.parametrize(("status", "code", "stderr"), [
    ("3", 3, ""), ("None", 0, ""), ("'no model'", 1, "no model\n"), ("1.5", 1, "1.5\n"), ("2**40", 1, ""),
])  # fmt: skip
def test_fast_exit_ends_as_sys_exit_would(tmp_path: Path, status: str, code: int, stderr: str) -> None:
    done = run(tmp_path, status)
    assert done.returncode == code and done.stderr.endswith(stderr + "a last log line\n"), done.stderr
