"""CPU time and context switches by kind of thread (omnistage/server/thread_cpu.py), read from
/proc/self/task: a thread counts as its kind while it runs and after it ends."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from omnistage.server import thread_cpu
from omnistage.server.thread_cpu import ThreadCpuCollector, ThreadReading, kind_of, read_threads

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc/self/task")


@pytest.mark.parametrize(("python_name", "comm", "kind"), [
    ("MainThread", "python", "main"),
    ("thinker-engine", "python", "engine"),
    ("Thread-1 (_poll_wrapper)", "python", "grpc"),  # grpc.aio's completion-queue poller
    ("Thread-2 (serve_forever)", "python", "other"),  # the metrics server
    ("asyncio_0", "python", "other"),
    (None, "event_engine", "grpc"),  # gRPC's C threads name themselves
    (None, "grpc_global_tim", "grpc"),
    (None, "lifeguard", "grpc"),
    (None, "python", "other"),  # a native thread without a name of its own
    (None, "pt_thread_pool", "other"),  # torch's intra-op pool
    (None, "cuda-EvtHandlr", "other"),  # CUDA's driver
])  # fmt: skip
def test_a_thread_is_of_the_kind_its_names_say(python_name: str | None, comm: str, kind: str) -> None:
    assert kind_of(python_name, comm) == kind


def _spin_until(cpu_s: float) -> None:
    while time.thread_time() < cpu_s:
        sum(range(1000))


def test_a_busy_engine_thread_keeps_its_cpu_in_its_kind_after_it_ends() -> None:
    collector = ThreadCpuCollector()
    before = collector.totals()
    busy, done = threading.Event(), threading.Event()

    def engine() -> None:
        _spin_until(0.2)
        busy.set()
        done.wait(10)

    t = threading.Thread(target=engine, name="test-engine")
    t.start()
    assert busy.wait(30)
    live = read_threads()
    assert live[t.native_id].kind == "engine"  # type: ignore[index]
    assert live[t.native_id].cpu_s >= 0.15  # type: ignore[index]  (clock ticks: 10 ms)
    during = collector.totals()
    engine_before = before["engine"].cpu_s if "engine" in before else 0.0  # other tests' engines, if alive
    assert during["engine"].cpu_s - engine_before >= 0.15
    assert during["engine"].voluntary + during["engine"].involuntary >= 1
    done.set()
    t.join()
    deadline = time.monotonic() + 10  # join() returns a moment before the OS thread is gone
    while t.native_id in read_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.native_id not in read_threads()
    after = collector.totals()
    assert set(during) <= set(after)
    for kind in during:  # counters: nothing goes down when a thread ends
        assert after[kind].cpu_s >= during[kind].cpu_s, kind
        assert after[kind].voluntary >= during[kind].voluntary, kind
    assert after["engine"].cpu_s >= during["engine"].cpu_s >= 0.15


def test_a_reused_thread_id_and_a_renamed_thread_are_not_counted_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = [
        {5: ThreadReading("engine", 1.0, 10, 1), 6: ThreadReading("other", 0.5, 4, 0)},  # 6 not yet named
        # 5 ended and its id went to a new thread (its figures start again); 6 got its name
        {5: ThreadReading("main", 0.2, 2, 0), 6: ThreadReading("engine", 0.7, 5, 0)},
        {6: ThreadReading("engine", 0.9, 7, 1)},  # 5 ended
        {},  # 6 ended
    ]
    monkeypatch.setattr(thread_cpu, "read_threads", lambda: dict(readings.pop(0)))
    collector = ThreadCpuCollector()
    first = collector.totals()
    assert {k: t.cpu_s for k, t in first.items()} == {"engine": 1.0, "other": 0.5}  # kinds seen only
    second = collector.totals()
    assert second["main"].cpu_s == pytest.approx(0.2)  # the new thread on id 5
    assert second["other"].cpu_s == pytest.approx(0.5)  # 6 until it got its name
    assert second["engine"].cpu_s == pytest.approx(1.0 + 0.2)  # the ended engine thread's, and 6's since
    assert (second["engine"].voluntary, second["other"].voluntary) == (10 + 1, 4)
    third = collector.totals()
    assert {k: t.cpu_s for k, t in third.items()} == pytest.approx({"engine": 1.4, "main": 0.2, "other": 0.5})
    fourth = collector.totals()
    assert {k: t.cpu_s for k, t in fourth.items()} == pytest.approx({"engine": 1.4, "main": 0.2, "other": 0.5})
    assert (fourth["engine"].voluntary, fourth["engine"].involuntary, fourth["other"].voluntary) == (13, 2, 4)


def test_concurrent_scrapes_count_each_thread_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two scrapes at once (Prometheus and the bench): every total stays what the threads used."""
    ticks = iter(range(1, 10_000))
    lock = threading.Lock()

    def growing() -> dict[int, ThreadReading]:  # two threads, each a tick more at every reading
        with lock:
            n = next(ticks)
        time.sleep(0.001)  # let the other scrape in between
        return {1: ThreadReading("engine", n / 100, n, 0), 2: ThreadReading("main", n / 100, n, 0)}

    monkeypatch.setattr(thread_cpu, "read_threads", growing)
    collector = ThreadCpuCollector()
    scrapers = [threading.Thread(target=lambda: [collector.totals() for _ in range(50)]) for _ in range(4)]
    for s in scrapers:
        s.start()
    for s in scrapers:
        s.join()
    last = collector.totals()  # the 201st reading
    assert last["engine"].cpu_s == pytest.approx(2.01) and last["main"].cpu_s == pytest.approx(2.01)


def test_the_collector_exports_counters_by_kind_of_thread() -> None:
    registry = CollectorRegistry()
    collector = ThreadCpuCollector()
    registry.register(collector)
    _spin_until(time.thread_time() + 0.05)
    text = generate_latest(registry).decode()
    kinds = set(collector.totals())
    assert "main" in kinds and kinds <= set(thread_cpu.KINDS)
    for kind in kinds:
        assert f'omnistage_thread_cpu_seconds_total{{thread="{kind}"}}' in text, text
        for switch in ("voluntary", "involuntary"):
            assert f'omnistage_thread_context_switches_total{{switch="{switch}",thread="{kind}"}}' in text, text
    main = registry.get_sample_value("omnistage_thread_cpu_seconds_total", {"thread": "main"})
    assert main is not None and main > 0


def test_the_bench_reads_the_thread_figures_from_a_metrics_page() -> None:
    from benchmarks.stage_load import load_between, own_snapshot, parse_metrics

    registry = CollectorRegistry()
    registry.register(ThreadCpuCollector())
    before = parse_metrics(generate_latest(registry).decode())
    _spin_until(time.thread_time() + 0.1)
    after = parse_metrics(generate_latest(registry).decode())
    assert "thread_cpu_s:main" in after
    assert {k for k in after if k.startswith("thread_cpu_s:")} <= {f"thread_cpu_s:{k}" for k in thread_cpu.KINDS}
    assert after["switches"] >= before["switches"]  # every thread's, voluntary and not, summed
    load = load_between({"p": before}, {"p": after}, 1.0)["p"]
    assert load["thread_cpu_s"] is not None and load["thread_cpu_s"]["main"] >= 0.05
    assert load["context_switches"] is not None and load["context_switches"] >= 0
    own = own_snapshot(ThreadCpuCollector())  # the bench client's own: the same keys, and its process CPU
    assert own["cpu_s"] > 0 and own["thread_cpu_s:main"] > 0 and own["switches"] > 0
