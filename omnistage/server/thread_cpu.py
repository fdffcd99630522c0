"""Where a process's CPU goes, by thread: a Prometheus collector of each kind of thread's CPU
time and context switches, read from Linux's /proc/self/task on each scrape.

The process's CPU alone (`process_cpu_seconds_total`) does not say whether a stage's time goes
to its model or to serving it. On this project's processes the threads are:

  engine     the engine thread (`<stage>-engine`): the scheduler and the model's forwards (with
             `threads` > 1, torch's intra-op workers do part of them, and count as `other`)
  main       the main thread, which runs the process's event loop: the gRPC handlers, encoding,
             relaying, the gateway's HTTP
  grpc       gRPC's own threads: the asyncio completion-queue poller (a Python thread running
             grpc's `_poll_wrapper`) and the C core's threads, by the names it gives them
             (event_engine, grpc_global_timer, ...)
  other      everything else: other Python threads (the metrics server, the gateway's executor
             workers: tokenizing, media decoding), torch's intra-op pool, CUDA's threads

Each thread's figures are its own (`utime + stime`, in clock ticks of 10 ms on most kernels;
`voluntary_ctxt_switches`, `nonvoluntary_ctxt_switches`). A thread that has ended
keeps what it had at the last reading in its kind's total, so the counters never go down; what
it did after that reading is lost, so the kinds add up to at most the process's CPU (a
short-lived thread's, between two scrapes, is missing). Elsewhere than Linux the collector
yields nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

__all__ = ["KINDS", "ThreadCpuCollector", "ThreadReading", "kind_of", "read_threads"]

KINDS = ("engine", "main", "grpc", "other")
_TASKS = Path("/proc/self/task")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True)
class ThreadReading:
    kind: str
    cpu_s: float
    voluntary: int
    involuntary: int


_ZERO = ThreadReading("", 0.0, 0, 0)


# the OS names gRPC's C core gives its threads (15 characters at most, as /proc shows them)
_GRPC_THREADS = ("grpc", "event_engine", "lifeguard", "default-executo", "resolver-execu", "timer_manager")


def kind_of(python_name: str | None, comm: str) -> str:
    """A thread's kind from its Python name (None: a native thread Python did not start, or one
    it has not registered yet) and its OS name (`comm`)."""
    if python_name is None:
        return "grpc" if comm.startswith(_GRPC_THREADS) else "other"
    if python_name == "MainThread":
        return "main"
    if python_name.endswith("-engine"):
        return "engine"
    if "(_poll_wrapper)" in python_name:  # grpc.aio's poller: threading.Thread(target=self._poll_wrapper)
        return "grpc"
    return "other"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the thread ended between the listing and the read
        return None


def read_threads() -> dict[int, ThreadReading]:
    """Every live thread of this process, by its OS id; empty where /proc/self/task is missing."""
    try:
        tids = [int(p.name) for p in _TASKS.iterdir()]
    except OSError:
        return {}
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, ThreadReading] = {}
    for tid in tids:
        stat, status = _read(_TASKS / str(tid) / "stat"), _read(_TASKS / str(tid) / "status")
        if stat is None or status is None:
            continue
        try:
            # the name field (2) may hold spaces and parentheses: the fields after it follow the last ')'
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu_s = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime: fields 14 and 15
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            switches = {k: int(v) for k, _, v in (line.partition(":") for line in status.splitlines())
                        if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}  # fmt: skip
        except (ValueError, IndexError):  # not the layout expected: that thread is left out, not the page
            continue
        out[tid] = ThreadReading(kind_of(names.get(tid), comm), cpu_s, switches.get("voluntary_ctxt_switches", 0),
                                 switches.get("nonvoluntary_ctxt_switches", 0))  # fmt: skip
    return out


class ThreadCpuCollector(Collector):
    """`omnistage_thread_cpu_seconds_total{thread}` and
    `omnistage_thread_context_switches_total{thread, switch="voluntary"|"involuntary"}`, by kind
    of thread (KINDS)."""

    def __init__(self) -> None:
        # one scrape at a time, reading included: a scrape that read before another but took the
        # lock after it would take that one's newer readings for threads that ended
        self._lock = threading.Lock()
        self._last: dict[int, ThreadReading] = {}
        # per live thread, what of its figures is already counted under an earlier kind (a thread
        # is seen nameless for a moment as it starts and as it ends)
        self._counted: dict[int, ThreadReading] = {}
        self._ended = {kind: ThreadReading(kind, 0.0, 0, 0) for kind in KINDS}
        self._seen: set[str] = set()

    def totals(self) -> dict[str, ThreadReading]:
        """Each kind's figures: its live threads' plus those of its threads that have ended; the
        kinds this process has had a thread of (a gateway has no engine thread: no engine figure)."""
        with self._lock:
            now = read_threads()
            for tid, last in self._last.items():
                reading, counted = now.get(tid), self._counted.pop(tid, _ZERO)
                if reading is None or reading.cpu_s < last.cpu_s or reading.voluntary < last.voluntary:
                    self._ended[last.kind] = _plus(self._ended[last.kind], last, counted)  # ended (or id reused)
                elif reading.kind != last.kind:  # from here on its figures count under its new kind
                    self._ended[last.kind] = _plus(self._ended[last.kind], last, counted)
                    self._counted[tid] = last
                elif counted is not _ZERO:
                    self._counted[tid] = counted
            self._last = now
            self._seen.update(reading.kind for reading in now.values())
            totals = {kind: self._ended[kind] for kind in KINDS if kind in self._seen}
            for tid, reading in now.items():
                totals[reading.kind] = _plus(totals[reading.kind], reading, self._counted.get(tid, _ZERO))
        return totals

    def collect(self) -> Iterator[CounterMetricFamily]:
        totals = self.totals()
        if not totals:  # no /proc here: nothing to say
            return
        cpu = CounterMetricFamily("omnistage_thread_cpu_seconds", "CPU time of this process's threads, by kind "
                                  "(engine, main: the event loop, grpc, other)", labels=["thread"])  # fmt: skip
        switches = CounterMetricFamily("omnistage_thread_context_switches", "Context switches of this process's "
                                       "threads, by kind", labels=["thread", "switch"])  # fmt: skip
        for kind, t in totals.items():
            cpu.add_metric([kind], t.cpu_s)
            switches.add_metric([kind, "voluntary"], float(t.voluntary))
            switches.add_metric([kind, "involuntary"], float(t.involuntary))
        yield cpu
        yield switches


def _plus(a: ThreadReading, b: ThreadReading, less: ThreadReading = _ZERO) -> ThreadReading:
    """`a + b - less`, under `a`'s kind."""
    return ThreadReading(a.kind, a.cpu_s + b.cpu_s - less.cpu_s, a.voluntary + b.voluntary - less.voluntary,
                         a.involuntary + b.involuntary - less.involuntary)  # fmt: skip
