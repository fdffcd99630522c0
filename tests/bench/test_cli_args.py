"""`omnistage bench` arguments: a value no run can use is a usage error (exit 2, naming the
option), not a traceback or a run that measures nothing; a run where requests failed exits 1;
each front door gets the request's limits."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.cli import bench_app
from benchmarks.drivers import BenchRequest, HttpDriver
from benchmarks.harness import failed_levels
from tests.integration.conftest import free_port_block


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--concurrency", "1,x"], "--concurrency"),
        (["--rate", "0"], "--rate"),
        (["--time-limit", "-5"], "--time-limit"),
        (["--num-requests", "0"], "--num-requests"),
        (["grpc-floor", "--messages", "0"], "--messages"),
        (["grpc-floor", "--repeats", "0"], "--repeats"),
        (["grpc-floor", "--payload", "-5"], "--payload"),
        (["handoff", "--batches", "0"], "--batches"),
        (["audio-in", "--clips", "-1"], "--clips"),
        (["conversation", "--turns", "0"], "--turns"),
        (["conversation", "--clip-seconds", "0.2"], "--clip-seconds"),
        (["conversation", "--clip-spread", "0.9"], "--clip-spread"),
        (["truncation", "--turns", "1"], "--turns"),
        (["truncation", "--ratio", "1.5"], "--ratio"),
        (["routing", "--long-share", "2"], "--long-share"),
        (["pd", "--long-every", "0"], "--long-every"),  # a ZeroDivisionError once both stacks had started
        (["batching", "--batch", "0"], "--batch"),
        # options no run takes together: a usage error too (a traceback, exit 1; or dropped silently)
        (["--target", "127.0.0.1:1", "--serve"], "--serve"),
        (["--http", "--target", "127.0.0.1:1"], "--http-target"),
        (["--http", "--serve", "--plot", "x.png"], "--plot"),
        (["--http", "--serve", "--rate", "2"], "--rate"),
        (["--realtime", "--http", "--serve"], "--realtime"),
        (["--realtime", "--target", "127.0.0.1:1"], "--http-target"),
        (["--realtime", "--serve", "--sampled-speech"], "--sampled-speech"),
        (["--realtime", "--serve", "--thinker-max-tokens", "5000"], "--thinker-max-tokens"),
        (["--responses", "--http", "--serve"], "--responses"),
        (["--responses", "--target", "127.0.0.1:1"], "--http-target"),
        (["--completions", "--responses", "--serve"], "--completions"),
        (["--completions", "--target", "127.0.0.1:1"], "--http-target"),
    ],
)
def test_a_value_no_run_can_use_is_a_usage_error(args: list[str], option: str) -> None:
    result = CliRunner().invoke(bench_app, args)
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert option in result.output and "Traceback" not in result.output


def test_a_config_no_bench_stack_can_run_is_one_line_and_exit_2_before_anything_runs(tmp_path: Path) -> None:
    """A text-only deploy file (the bench measures speech) is refused as `serve` refuses a bad
    config: one line naming the field, exit 2 (it was a traceback), and no baseline ran first."""
    (tmp_path / "text.yaml").write_text("audio_output: false\n")
    result = CliRunner().invoke(bench_app, ["--serve", "--config", str(tmp_path / "text.yaml"), "--concurrency", "1",
                                            "--num-requests", "2", "--no-progress"])  # fmt: skip
    assert result.exit_code == 2, (result.exit_code, result.output[-2000:])
    assert result.output.startswith("error: audio_output: false: the bench measures speech"), result.output[-2000:]
    assert "Traceback" not in result.output and "monolithic" not in result.output


def test_a_target_where_no_gateway_answers_fails_before_anything_runs() -> None:
    """Checked by one Info call at the start: every request of the target failed, and was said
    only after the baselines had all run."""
    port = free_port_block(1)  # nothing listens there
    result = CliRunner().invoke(bench_app, ["--target", f"127.0.0.1:{port}", "--concurrency", "1", "--num-requests",
                                            "2", "--no-progress", "--warmup", "0"])  # fmt: skip
    assert result.exit_code == 1, (result.exit_code, result.output[-2000:])
    assert f"--target 127.0.0.1:{port}: no omnistage gateway answers there (UNAVAILABLE" in result.output
    assert "monolithic" not in result.output  # (no baseline ran)


def test_an_http_target_where_no_front_door_answers_fails_before_anything_runs() -> None:
    """`--http`'s HTTP port is checked too: a wrong --http-target failed every HTTP request, said at the end."""
    port = free_port_block(1)
    result = CliRunner().invoke(bench_app, ["--http", "--target", f"127.0.0.1:{port}", "--http-target",
                                            f"127.0.0.1:{port}", "--concurrency", "1", "--num-requests", "1",
                                            "--no-progress", "--warmup", "0"])  # fmt: skip
    assert result.exit_code == 1, (result.exit_code, result.output[-2000:])
    assert f"--http-target 127.0.0.1:{port}: no omnistage HTTP front door answers there" in result.output


def test_failed_levels_names_every_level_that_lost_requests() -> None:
    """A level where some requests failed is named too: its latency figures cover only those that
    succeeded (7 of 12 timed out once, and the level's p99 sat just under the deadline, exit 0)."""
    ok, bad = {"ok": True, "error": None}, {"ok": False, "error": "AioRpcError:\n  UNAVAILABLE"}
    result = {"configurations": [{"name": "a", "requests": [ok, bad, ok]}, {"name": "b", "requests": [bad, bad]},
                                 {"name": "c", "requests": []}, {"name": "d", "requests": [ok]}]}  # fmt: skip
    assert failed_levels(result) == ["a: 1 of 3 failed (first: AioRpcError: UNAVAILABLE)",
                                     "b: all 2 failed (first: AioRpcError: UNAVAILABLE)"]  # fmt: skip


def test_the_http_driver_sends_the_talker_limit() -> None:
    """`--talker-max-tokens` bounds the HTTP front door too (it ran to the talker's 4,096 codes)."""
    body = HttpDriver.body(BenchRequest(0, 0, "hi", thinker_max_tokens=5, talker_max_tokens=7))
    assert body["max_tokens"] == 5 and body["temperature"] == 0
    assert body["sampling_params_list"] == [{}, {"max_tokens": 7}]
    text_only = HttpDriver.body(BenchRequest(0, 0, "hi", 5, 7, want_audio=False))
    assert "sampling_params_list" not in text_only and text_only["modalities"] == ["text"]


def test_a_served_split_thinker_gets_free_ports_for_both_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench --serve --config deploy/examples/pd.yaml`: every process on a port picked free, the
    thinker's two roles too (they stayed on the file's 7101 and 7151, `omnistage serve`'s own)."""
    from pathlib import Path

    from benchmarks import harness

    picked: list[list[int]] = []

    def free_blocks(sizes: list[int], *args: object, **kwargs: object) -> list[int]:
        picked.append(list(sizes))
        return [40_000 + 100 * k for k in range(len(sizes))]

    monkeypatch.setattr(harness, "free_port_blocks", free_blocks)
    example = Path(__file__).parents[2] / "deploy" / "examples" / "pd.yaml"
    cfg = harness.stack_config(harness.BenchOptions(serve=True, config=example))
    grpc = {role: port for port, role in cfg.ports() if "metrics" not in role}
    assert grpc == {"gateway[0]": 40_000, "thinker-prefill[0]": 40_100, "thinker-decode[0]": 40_200,
                    "talker[0]": 40_300, "code2wav[0]": 40_400, "gateway[0] http": 40_500}, cfg.ports()
    assert picked == [[1, 1, 1, 1, 1, 1]]


def test_replicas_of_a_process_the_served_config_does_not_run_are_refused() -> None:
    """`bench --serve --replicas thinker-decode=2` on an unsplit config was ignored, as serve's was."""
    from benchmarks.harness import BenchOptions, stack_config
    from omnistage.config import ConfigError

    with pytest.raises(ConfigError, match="runs no thinker-decode process"):
        stack_config(BenchOptions(serve=True, replicas="thinker-decode=2"))


def test_results_never_hold_the_api_key() -> None:
    """The JSON's settings and command, and the markdown's command, redact the key (results are
    committed; the key was written out as given)."""
    from benchmarks.harness import SECRET, BenchOptions, command_line, settings

    said = command_line(["omnistage", "bench", "--api-key", "s3cr3t-1", "--api-key=s3cr3t-2", "--target", "h:1"])
    assert "s3cr3t" not in said and said.count(SECRET) == 2 and "--target h:1" in said
    assert settings(BenchOptions(api_key="s3cr3t-3"))["api_key"] == SECRET
    assert settings(BenchOptions())["api_key"] == ""
