"""`omnistage serve`'s children forked from one process that has already imported them.

Every child of a stack imports the same torch, transformers and model family: about 6 s of
CPU each before it reads a weight, so a stack of five paid it five times over. Instead `serve`
starts one *forker* (``python -m omnistage.cli.forker MODULE...``), which imports all that once
and then forks each child on request; the child runs the same command line a fresh
``python -m omnistage.cli`` would.

The forker double-forks and `serve` makes itself the children's reaper for that moment
(PR_SET_CHILD_SUBREAPER), so each child is `serve`'s own child: it waits for it, signals it and
reads its exit status as for a process it started itself (`ForkedChild`), and the child dies
with `serve` (PR_SET_PDEATHSIG) as before.

`serve` starts the forker before it reads the checkpoint, with what every child imports
(`PRELOAD`), and names the model family's modules once it knows them (`Forker.need`): the two
import side by side. The forker lives as long as `serve`: it restarts children, and a process
that starts several stacks (the bench, the tests) starts the next ones from it too, of either
family (`shared_forker`).

Only where forking is safe: every stage on the CPU (a process that touched CUDA cannot fork a
child that uses it, and importing is not guaranteed to stay clear of it), and a forker with no
Python thread but its main one when it says it is ready. Anything else, or
``OMNISTAGE_FORK_CHILDREN=0``, starts each child by exec as before; so does a forker that dies
or stops answering.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import logging
import os
import pkgutil
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import setproctitle

log = logging.getLogger(__name__)

FORK_ENV = "OMNISTAGE_FORK_CHILDREN"  # "0": start every child by exec
# what every child imports: the command line, both kinds of process and the stages' workers
PRELOAD = ("omnistage.cli.main", "omnistage.cli.serve", "omnistage.server.process", "gateway.process",
           "services.thinker.worker", "services.talker.worker", "services.code2wav.worker")  # fmt: skip
READY_TIMEOUT_S = 120.0  # its imports; past this, children start by exec
FORK_TIMEOUT_S = 30.0  # one fork
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


def _set_subreaper(value: int) -> None:
    if _libc().prctl(PR_SET_CHILD_SUBREAPER, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _subreaper() -> int:
    value = ctypes.c_int(0)
    if _libc().prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return value.value


class ForkedChild:
    """A child the forker made, reparented to this process: what `serve` needs of a Popen."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def _reap(self) -> None:
        """Its exit status if it has exited (ChildProcessError: not this process's child)."""
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)

    def adopted(self) -> bool:
        """Whether it is this process's child (reparented here), keeping its status if it has
        already exited (the call reaps it)."""
        try:
            self._reap()
        except ChildProcessError:
            return False
        return True

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._reap()
            except ChildProcessError:  # reaped elsewhere: its status is gone
                self.returncode = 255
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a pid that was reaped and may be reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forker:
    """`serve`'s side: start the forker, ask it for children; `spawn` returns None whenever the
    child should be started by exec instead (the forker is gone, refused or too slow), and a
    forker that failed once is not asked again."""

    def __init__(self, modules: list[str], env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self.modules = list(modules)
        self._importing = 1  # imports it has not yet said were done (its first: those of its command line)
        self._failed = False
        self._read = b""  # what it wrote past the last line read
        command = [sys.executable, "-m", "omnistage.cli.forker", *modules]
        with open(log_path, "ab") as err:
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)

    def _reply(self, timeout: float, interrupted: Callable[[], bool]) -> dict | str:
        """The forker's next line (each is written whole, at once), or why there is none. Read
        from the descriptor into a buffer of its own: a buffered file's readline may take two
        lines (an import's reply and a fork's) and leave select nothing to see."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._read:
            if not select.select([fd], [], [], 0.2)[0]:
                if interrupted():
                    raise KeyboardInterrupt
                if time.monotonic() > deadline:
                    return f"it did not answer in {timeout:.0f} s"
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError as e:
                return str(e)
            if not chunk:
                return "it exited"
            self._read += chunk
        line, _, self._read = self._read.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            return f"it answered {line[:80]!r}"

    def need(self, modules: list[str]) -> None:
        """Have it import `modules` too (those it has not), before its next child: a stack's
        model family, named once its checkpoint is read, while the forker already imports the
        rest (`PRELOAD`)."""
        missing = [m for m in modules if m not in self.modules]
        if not missing or not self.usable():
            return
        try:
            self._send({"import": missing})
        except OSError as e:
            self._give_up(str(e))
            return
        self.modules += missing
        self._importing += 1

    def _send(self, request: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def _give_up(self, why: str) -> None:
        if not self._failed:
            log.warning("the forker (pid %d) is given up (%s): children start by exec", self.proc.pid, why)
        self._failed = True
        self.close()
        return None

    def spawn(self, args: list[str], log_path: Path, env: dict[str, str],
              interrupted: Callable[[], bool] = lambda: False) -> ForkedChild | None:  # fmt: skip
        """A child running `omnistage.cli` with `args`, `env` and its output to `log_path`; None:
        start it by exec. Waiting for a new forker's imports ends as soon as `interrupted()`
        (KeyboardInterrupt); a fork is not interrupted (a reply left unread would be taken for
        the next one's)."""
        if self._failed:
            return None
        while self._importing:
            done = self._reply(READY_TIMEOUT_S, interrupted)
            if isinstance(done, str):
                return self._give_up(done)
            if "error" in done:
                return self._give_up(f"it could not import: {done['error']}")
            if done.get("threads") != 1:  # forking a threaded process can deadlock the child
                return self._give_up(f"it runs {done.get('threads')} threads")
            self._importing -= 1
        if self.proc.poll() is not None:
            return self._give_up(f"it exited with code {self.proc.returncode}")
        request = {"args": args, "log": str(log_path), "env": env, "cwd": os.getcwd()}
        reply: dict | str = "no answer"
        try:
            was = _subreaper()
            try:
                _set_subreaper(1)  # the child, orphaned at once, is reparented here
                self._send(request)
                reply = self._reply(FORK_TIMEOUT_S, lambda: False)
            finally:
                _set_subreaper(was)
        except OSError as e:
            reply = str(e)
        finally:
            if not isinstance(reply, dict):  # (given up only here, with the subreaper flag restored)
                self._give_up(reply)
        if isinstance(reply, str):
            return None
        if "pid" not in reply:
            return self._give_up(f"it could not fork: {reply.get('error')}")
        child = ForkedChild(int(reply["pid"]), args)
        if not child.adopted():  # (it kills itself too: it finds another parent than serve)
            with contextlib.suppress(OSError):
                os.kill(child.pid, signal.SIGKILL)
            return self._give_up(f"its child {child.pid} was not reparented to serve")
        return child

    def usable(self) -> bool:
        return not self._failed and self.proc.poll() is None

    def close(self) -> None:
        """Stop it: the end of its input ends it; one still importing is terminated."""
        self._failed = True  # (a stack that still holds it starts its children by exec)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                with contextlib.suppress(OSError):  # (a dead forker's pipe)
                    pipe.close()
        if self._importing and self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_SHARED: list[Forker] = []  # this process's forker, if it started one
_NOT_FOR_THE_FORKER = ("OMNISTAGE_API_KEY",)  # a child gets it in its own environment; no import reads it


def shared_forker(modules: list[str], env: dict[str, str], log_path: Path) -> Forker:
    """A forker that imports `modules` (`Forker.need` adds more): the one an earlier stack of this
    process started, while it can still fork and `env` is the one it started with (the bench and
    the tests start many stacks, of either family: they import once), else a new one, logging to
    `log_path`. It lives as long as this process (it ends with its input, or with its parent);
    one it replaces is closed."""
    env = {k: v for k, v in env.items() if k not in _NOT_FOR_THE_FORKER}
    if _SHARED and _SHARED[0].usable() and _SHARED[0].env == env:
        _SHARED[0].need(modules)
        return _SHARED[0]
    if _SHARED:
        _SHARED.pop().close()
    else:
        atexit.register(lambda: [f.close() for f in _SHARED])
    _SHARED.append(Forker(modules, env, log_path))
    return _SHARED[0]


def forking_wanted(devices: list[str]) -> bool:
    """Whether a stack whose stages run on `devices` should fork its children."""
    return os.environ.get(FORK_ENV, "1") != "0" and all(d == "cpu" for d in devices)


def preload_modules(family_module: str) -> list[str]:
    """What a forker for a stack of this family imports: `PRELOAD` and every module of the
    family's folder (its parts import transformers' modeling code)."""
    import importlib.util

    spec = importlib.util.find_spec(family_module)
    where = list(spec.submodule_search_locations or []) if spec else []
    return [*PRELOAD, family_module, *(m.name for m in pkgutil.iter_modules(where, f"{family_module}."))]


# --- the forker process --------------------------------------------------------------------


def _read_line(fd: int) -> bytes:
    """One request line from the control pipe, unbuffered (a child must not inherit a buffer)."""
    out = bytearray()
    while not out.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            return b""
        out += chunk
    return bytes(out)


def _become_child(request: dict, middle: int, fds: tuple[int, ...]) -> None:
    """In the forked child: its own descriptors, environment, folder and command line; then run it."""
    for fd in fds:  # the forker's control pipes and the pipe to the middle
        os.close(fd)
    out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])  # serve's folder now, not the forker's when it started
    sys.argv = [str(Path(__file__).with_name("__main__.py")), *request["args"]]  # as `-m omnistage.cli` has it
    setproctitle.setproctitle(" ".join([sys.executable, "-m", "omnistage.cli", *request["args"]]))  # for ps, pkill -f
    # Python 3.11's fork hook keeps the forker's thread id as this thread's `native_id` (the
    # per-thread CPU figures map threads by it); 3.12 sets it again
    set_native_id = getattr(threading.current_thread(), "_set_native_id", None)
    if set_native_id is not None:
        set_native_id()
    while os.getppid() == middle:  # until the middle has exited and this is serve's own child (< 1 ms)
        time.sleep(0.0005)
    from omnistage.cli.__main__ import main

    signal.signal(signal.SIGINT, signal.default_int_handler)  # the forker ignores Ctrl-C; a child does not
    main()


def _run_child(request: dict, middle: int, fds: tuple[int, ...]) -> None:
    """The child's whole life. It ends the process as a fresh one's `main` does: by `main`'s own
    exit, or by SystemExit (atexit, threads joined) when it fails before that; the forker's loop
    checks that it never comes back there."""
    try:
        _become_child(request, middle, fds)
    except SystemExit:
        raise
    except KeyboardInterrupt:  # Ctrl-C before its command took it over
        code = 130
        with contextlib.suppress(BaseException):
            print("interrupted", file=sys.stderr)
    except BaseException:
        code = 1
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    else:
        code = 0
    sys.exit(code)


def _fork(request: dict, control: tuple[int, int]) -> int:
    """Fork a child for `request` through a middle process that exits at once, so that the child
    is orphaned and reparented to serve (its subreaper); returns the child's pid."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        me = os.getpid()
        try:
            os.close(r)
            pid = os.fork()
        except BaseException:
            os._exit(1)
        if pid == 0:
            _run_child(request, me, (*control, w))
        try:
            os.write(w, str(pid).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 64):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(middle, 0)
    if not chunks:
        raise OSError("the middle process could not fork")
    return int(b"".join(chunks))


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is serve's to handle; EOF ends this
    # (set up here, with the environment still in place: it moves it to make room for a title)
    setproctitle.setproctitle(f"{sys.executable} -m omnistage.cli.forker")
    # the requests and replies on descriptors of their own; stdout to the log, stdin empty, so
    # that nothing an import prints can be taken for a reply
    control = (os.dup(0), os.dup(1))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    from omnistage.cli.serve import die_with_parent_if_asked

    die_with_parent_if_asked()

    def reply(message: dict) -> None:
        sys.stdout.flush()  # (a child must not inherit what an import printed, unflushed)
        sys.stderr.flush()
        os.write(control[1], json.dumps(message).encode() + b"\n")  # one write: serve reads whole lines

    def imported(names: list[str]) -> dict:
        """Import the modules its children import; its threads then (a native pool such as
        numpy's OpenBLAS stops its own threads at each fork, a Python thread does not)."""
        try:
            for name in names:
                importlib.import_module(name)
        except Exception as e:  # (a child started by exec says it in its own log)
            return {"error": f"{type(e).__name__}: {e}"}
        return {"threads": threading.active_count()}

    reply(imported(argv))
    forker = os.getpid()
    while line := _read_line(control[0]):
        request = json.loads(line)
        if "import" in request:  # more modules for the children to come (a model family)
            reply(imported(request["import"]))
            continue
        try:
            answer = {"pid": _fork(request, control)}
        except OSError as e:
            answer = {"error": str(e)}
        if os.getpid() != forker:  # a child or a middle that came back here: never answers
            os._exit(1)
        reply(answer)
    from omnistage.server.fast_exit import fast_exit

    fast_exit()  # (serve waits for it: the teardown of what it imported took a second)


if __name__ == "__main__":
    main(sys.argv[1:])
