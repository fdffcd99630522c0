"""`omnistage bench compare`: deploy files alternated (A B, B A, ...), every measured load's figures
per file, medians and spreads, ratios to the first file that say when the loads overlap."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compare
from benchmarks.compare import CompareOptions, against_first, format_report, summarize

REPO = Path(__file__).resolve().parents[2]
EXACT, FAST = REPO / "deploy" / "omnistage.yaml", REPO / "deploy" / "examples" / "fast.yaml"


def _load(rps: float, thinker_cpu: float | None = 20.0) -> dict[str, Any]:
    return {
        "requests": 10, "ok": 10, "failed": 0, "wall_s": 10 / rps, "requests_per_s": rps,
        "ttfa_p50_s": 0.2, "ttfa_p99_s": 0.4, "e2e_p50_s": 0.8, "e2e_p99_s": 1.2,
        "stack_cpu_ms_per_request": 100.0,
        "processes": {"thinker": {"cpu_ms_per_request": thinker_cpu, "messages_per_request": 50.0, "mean_batch": 3.0},
                      "gateway": {"cpu_ms_per_request": 10.0, "messages_per_request": None, "mean_batch": None}},
    }  # fmt: skip


def test_medians_spreads_and_ratios_say_when_the_loads_overlap() -> None:
    a = summarize([_load(10), _load(12), _load(11)])
    assert a["requests_per_s"] == {"n": 3, "median": 11, "min": 10, "max": 12}
    assert a["processes"]["gateway"]["messages_per_request"]["median"] is None  # the gateway counts none
    apart = summarize([_load(13), _load(14), _load(15, thinker_cpu=None)])
    within = summarize([_load(11.5), _load(12.5)])
    one = summarize([_load(20)])
    cmp = against_first({"a": a, "apart": apart, "within": within, "one": one})
    assert cmp["apart"]["requests_per_s"] == {"ratio": 14 / 11, "overlap": False}
    assert cmp["within"]["requests_per_s"] == {"ratio": 12 / 11, "overlap": True}
    assert cmp["one"]["requests_per_s"] == {"ratio": 20 / 11, "overlap": None}  # one load: no spread
    assert cmp["apart"]["processes"]["thinker"]["cpu_ms_per_request"]["ratio"] == 1.0  # the None load left out
    assert cmp["apart"]["processes"]["gateway"]["messages_per_request"]["ratio"] is None
    report = format_report({"summary": {"a.yaml": a, "b.yaml": apart, "c.yaml": within},
                            "against_first": {"b.yaml": cmp["apart"], "c.yaml": cmp["within"]},
                            "stack_order": ["a.yaml", "b.yaml", "c.yaml"],
                            "settings": {"rounds": 1, "warmup": 0, "loads": 3, "num_requests": 10,
                                         "concurrency": 4}})  # fmt: skip
    row = next(line for line in report.splitlines() if line.startswith("req/s"))
    assert row.split()[1:] == ["11.00", "(10.00-12.00)", "14.00", "(13.00-15.00)", "12.00", "(11.50-12.50)",
                               "1.273", "1.091", "~"]  # fmt: skip
    assert not any(line.startswith("gateway messages") for line in report.splitlines())  # no figure: no row


def test_stacks_alternate_their_order_every_round(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started: list[tuple[str, int]] = []

    async def fake(opts: CompareOptions, config: Path, checkout: Path | None, round_no: int, requests: Any,
                   warm: Any) -> list[Any]:  # fmt: skip
        started.append((config.name, round_no))
        assert len(requests) == opts.num_requests and len(warm) == opts.warmup
        return [_load(10 + round_no + i + (config == FAST)) for i in range(opts.loads)]

    monkeypatch.setattr(compare, "_stack_loads", fake)
    out = tmp_path / "cmp.json"
    result = compare.main(CompareOptions([EXACT, FAST], rounds=3, loads=2, num_requests=5, warmup=3, json_out=out,
                                         quiet=True))  # fmt: skip
    assert started == [("omnistage.yaml", 0), ("fast.yaml", 0), ("fast.yaml", 1), ("omnistage.yaml", 1),
                       ("omnistage.yaml", 2), ("fast.yaml", 2)]  # fmt: skip
    assert [ld["round"] for ld in result["loads"][str(FAST)]] == [1, 1, 2, 2, 3, 3]
    assert json.loads(out.read_text())["summary"][str(EXACT)]["requests_per_s"]["n"] == 6
    # round by round (loads 10 + r, 11 + r against one more each): the pairs the drift touches least
    assert result["per_round"][str(FAST)]["requests_per_s"] == [11.5 / 10.5, 12.5 / 11.5, 13.5 / 12.5]
    assert result["per_round"][str(FAST)]["stack_cpu_ms_per_request"] == [1.0, 1.0, 1.0]
    line = format_report(result).splitlines()[-1]
    assert line.startswith("fast.yaml / first, round by round: req/s 1.095 1.087 1.080 (above 1 in every round)")
    result["loads"][str(FAST)][1]["failed"] = 2  # a load with failures says so under the table
    assert format_report(result).splitlines()[-1] == ("fast.yaml: 2 request(s) failed over its loads (their "
                                                      "figures leave them out)")  # fmt: skip
    assert line.endswith("stack CPU ms/request 1.000 1.000 1.000 (not on one side of 1 in every round)")


def _tree(path: Path) -> Path:
    (path / "omnistage").mkdir(parents=True)
    (path / "omnistage" / "__init__.py").write_text("")
    return path


def test_a_checkout_is_first_on_the_stack_processes_path_while_it_starts(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """FILE@DIR: the stack's processes (children, started under running_stack) import DIR's code;
    this process's own path setting comes back after."""
    tree = _tree(tmp_path / "old")
    seen: list[tuple[Path | None, str | None, str | None]] = []

    @contextlib.contextmanager
    def fake_stack(bopts: Any, log: Any) -> Iterator[Any]:
        seen.append((bopts.config, os.environ.get("PYTHONPATH"), os.environ.get("PYTHONSAFEPATH")))
        raise RuntimeError("no stack here")
        yield

    monkeypatch.setattr(compare, "running_stack", fake_stack)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    # PYTHONSAFEPATH: `python -m` would put the children's working directory before the checkout
    for checkout, want in ((tree, (f"{tree.resolve()}{os.pathsep}/elsewhere", "1")), (None, ("/elsewhere", None))):
        with pytest.raises(RuntimeError, match="no stack here"):
            asyncio.run(compare._stack_loads(CompareOptions([EXACT, FAST]), FAST, checkout, 0, [], []))
        assert seen[-1] == (FAST, *want)
        assert os.environ["PYTHONPATH"] == "/elsewhere" and "PYTHONSAFEPATH" not in os.environ


def test_one_file_from_two_source_trees_is_two_stacks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tree = _tree(tmp_path / "old")
    started: list[Path | None] = []

    async def fake(opts: CompareOptions, config: Path, checkout: Path | None, *_: Any) -> list[Any]:
        started.append(checkout)
        return [_load(10)]

    monkeypatch.setattr(compare, "_stack_loads", fake)
    result = compare.main(CompareOptions([FAST, FAST], [None, tree], rounds=2, loads=1, quiet=True))
    assert started == [None, tree, tree, None]
    assert list(result["loads"]) == [str(FAST), f"{FAST}@{tree}"]
    assert format_report(result).splitlines()[1].split()[1:] == ["fast.yaml", "fast.yaml@old", "fast.yaml@old", "/",
                                                                 "first"]  # fmt: skip


@pytest.mark.parametrize(
    ("configs", "change", "needle"),
    [
        ([EXACT], {}, "two deploy files"),
        ([EXACT, EXACT], {}, "the same deploy file twice"),
        ([EXACT, FAST], {"rounds": 0}, "--rounds must be >= 1"),
        ([EXACT, FAST], {"concurrency": 0}, "--concurrency must be >= 1"),
        ([EXACT, FAST], {"warmup": -1}, "--warmup must be >= 0"),
        ([EXACT, FAST], {"checkouts": [None]}, "1 checkouts for 2 deploy files"),
        ([EXACT, FAST], {"checkouts": [None, Path("/")]}, "no omnistage source tree"),
    ],
)
def test_bad_arguments_are_refused_before_any_stack_starts(configs: list[Path], change: dict[str, Any],
                                                           needle: str) -> None:  # fmt: skip
    with pytest.raises(ValueError, match=needle):
        compare.check(CompareOptions(configs, **change))


def test_a_bad_deploy_file_is_refused_with_its_field_before_any_stack_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("talker:\n  batching: quick\n")
    with pytest.raises(ValueError, match="batching"):
        compare.check(CompareOptions([EXACT, bad]))


def test_two_served_stacks_are_measured_from_their_own_metrics(tiny_dir: Path, tmp_path: Path) -> None:
    """The real thing, small: each file's stack started, warmed, loaded; every process's CPU and the
    stages' messages and batches read from its metrics."""
    result = compare.main(CompareOptions([EXACT, FAST], rounds=1, loads=1, num_requests=4, warmup=2, concurrency=2,
                                         model=tiny_dir, quiet=True))  # fmt: skip
    assert result["stack_order"] == [str(EXACT), str(FAST)]
    for name in (str(EXACT), str(FAST)):
        [load] = result["loads"][name]
        assert load["ok"] == 4 and load["failed"] == 0 and load["requests_per_s"] > 0, load
        procs = load["processes"]
        assert list(procs) == ["thinker", "talker", "code2wav", "gateway", "bench client"], procs
        assert all(p["cpu_ms_per_request"] > 0 for p in procs.values()), procs
        # per request: the thinker's text and tokens at least, the others some frames or audio
        assert procs["thinker"]["messages_per_request"] >= 2 * 1 and procs["code2wav"]["messages_per_request"] >= 2
        assert all(procs[s]["mean_batch"] >= 1 for s in ("thinker", "talker", "code2wav")), procs
        # the CPU by kind of thread: the stages' engine threads, every process's event loop; together
        # at most the process's CPU, give or take its clock ticks (10 ms a thread, before and after)
        assert all(procs[s]["engine_cpu_ms_per_request"] > 0 for s in ("thinker", "talker", "code2wav")), procs
        assert procs["gateway"]["engine_cpu_ms_per_request"] is None, procs  # no engine thread: no row
        for role, p in procs.items():
            split = sum(p[f"{kind}_cpu_ms_per_request"] or 0.0 for kind in ("engine", "main", "grpc", "other"))
            assert p["main_cpu_ms_per_request"] is not None and p["switches_per_request"] > 0, (role, p)
            assert split <= p["cpu_ms_per_request"] + 100 / 4, (role, p)
            if role in ("thinker", "talker", "code2wav"):  # most of a stage's CPU is its engine thread's
                assert p["engine_cpu_ms_per_request"] >= 0.5 * p["cpu_ms_per_request"] - 100 / 4, (role, p)
        assert load["stack_cpu_ms_per_request"] == pytest.approx(
            sum(p["cpu_ms_per_request"] for r, p in procs.items() if r != "bench client")
        )
    assert result["against_first"][str(FAST)]["requests_per_s"]["overlap"] is None  # one load each
