"""Where a process's CPU goes, by thread: a Prometheus collector of each kind of thread's CPU
time and context switches, read from Linux's /proc/self/task on each scrape.

The process's CPU alone (`process_cpu_seconds_total`) does not say whether a stage's time goes
to its model or to serving it. On this project's processes the threads are:

  engine     the engine thread (`<stage>-engine`): the scheduler and the model's forwards
  main       the main thread, which runs the process's event loop: the gRPC handlers, encoding,
             relaying, the gateway's HTTP
  grpc       gRPC's own threads: the asyncio completion-queue poller (a Python thread running
             grpc's `_poll_wrapper`) and the C core's named threads (event_engine, timers, ...)
  other      everything else: other Python threads (the metrics server, executor workers),
             unnamed native threads such as torch's intra-op pool

Each thread's figures are its own (`utime + stime`, `voluntary_ctxt_switches`,
`nonvoluntary_ctxt_switches`). A thread that has ended keeps what it had at the last reading
in its kind's total, so the counters never go down (what it did after that reading is lost:
at most one scrape interval of a short-lived thread). Elsewhere than Linux the collector
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


def kind_of(python_name: str | None, comm: str, process_comm: str) -> str:
    """A thread's kind from its Python name (None: a native thread Python did not start) and its
    OS name (`comm`): grpc's C threads name themselves, unnamed ones keep the process's."""
    if python_name is None:
        return "grpc" if comm != process_comm else "other"
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
    process_comm = (_read(Path("/proc/self/comm")) or "").strip()
    out: dict[int, ThreadReading] = {}
    for tid in tids:
        stat, status = _read(_TASKS / str(tid) / "stat"), _read(_TASKS / str(tid) / "status")
        if stat is None or status is None:
            continue
        # the name field (2) may hold spaces and parentheses: the fields after it follow the last ')'
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu_s = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime: fields 14 and 15
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        switches = {k: int(v) for k, _, v in (line.partition(":") for line in status.splitlines())
                    if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}  # fmt: skip
        out[tid] = ThreadReading(kind_of(names.get(tid), comm, process_comm), cpu_s,
                                 switches.get("voluntary_ctxt_switches", 0),
                                 switches.get("nonvoluntary_ctxt_switches", 0))  # fmt: skip
    return out


class ThreadCpuCollector(Collector):
    """`omnistage_thread_cpu_seconds_total{thread}` and
    `omnistage_thread_context_switches_total{thread, switch="voluntary"|"involuntary"}`, by kind
    of thread (KINDS)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # two scrapes at once must not both retire a thread
        self._last: dict[int, ThreadReading] = {}
        self._ended = {kind: ThreadReading(kind, 0.0, 0, 0) for kind in KINDS}
        self._seen: set[str] = set()

    def totals(self) -> dict[str, ThreadReading]:
        """Each kind's figures: its live threads' plus those of its threads that have ended; the
        kinds this process has had a thread of (a gateway has no engine thread: no engine figure)."""
        now = read_threads()
        with self._lock:
            for tid, last in self._last.items():
                reading = now.get(tid)
                if reading is None or reading.cpu_s < last.cpu_s or reading.voluntary < last.voluntary:
                    self._ended[last.kind] = _plus(self._ended[last.kind], last)  # ended (or its id reused)
                elif reading.kind != last.kind:  # a thread counts as what it was first seen as
                    now[tid] = ThreadReading(last.kind, reading.cpu_s, reading.voluntary, reading.involuntary)
            self._last = now
            self._seen.update(reading.kind for reading in now.values())
            totals = {kind: self._ended[kind] for kind in KINDS if kind in self._seen}
        for reading in now.values():
            totals[reading.kind] = _plus(totals[reading.kind], reading)
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


def _plus(a: ThreadReading, b: ThreadReading) -> ThreadReading:
    return ThreadReading(a.kind, a.cpu_s + b.cpu_s, a.voluntary + b.voluntary, a.involuntary + b.involuntary)
