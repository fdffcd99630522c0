"""First run and day-two operations, on `omnistage` processes started as a user starts them:
exclusive ports and a second stack refused at once, the default deploy file honoured, metrics
on every process, honest health and exit codes, request ids and the access log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from omnistage.config import HTTP_PORT_OFFSET, PORT_STRIDE
from omnistage.server.health_check import health_status
from omnistage.server.ports import port_free
from tests.integration.conftest import free_port_block, info, run

REPO = Path(__file__).resolve().parents[2]
STARTUP_S = 240


def omnistage(*args: str, cwd: Path | None = None, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "omnistage.cli", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_serving(proc: subprocess.Popen[str], address: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        if health_status(address, 1.0) == "SERVING":
            return
        time.sleep(0.5)
    raise AssertionError("stack did not come up")


def stack_ports(base: int) -> dict[str, int]:
    return {"gateway": base, "thinker": base + PORT_STRIDE, "talker": base + 2 * PORT_STRIDE,
            "code2wav": base + 3 * PORT_STRIDE}  # fmt: skip


def free_layout() -> int:
    """A base port whose whole --port layout (gRPC, metrics, HTTP) is free."""
    for _ in range(50):
        base = free_port_block(1)
        ports = [*stack_ports(base).values()]
        if base + 3 * PORT_STRIDE + 1000 < 65000 and all(port_free("127.0.0.1", p) for p in ports + [
            p + 1000 for p in ports
        ] + [base + HTTP_PORT_OFFSET]):  # fmt: skip
            return base
    raise RuntimeError("no free port layout")


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a changed deploy/omnistage.yaml, as a user's checkout would."""
    d = tmp_path_factory.mktemp("checkout")
    data = yaml.safe_load((REPO / "deploy" / "omnistage.yaml").read_text())
    data["served_model_name"] = "from-the-yaml"
    data["thinker"]["max_num_seqs"] = 3
    (d / "deploy").mkdir()
    (d / "deploy" / "omnistage.yaml").write_text(yaml.safe_dump(data))
    return d


@pytest.fixture(scope="module")
def served(tiny_dir: Path, user_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = free_layout()
    run_dir = tmp_path_factory.mktemp("run")
    proc = omnistage("serve", str(tiny_dir), "--port", str(base), "--log-dir", str(run_dir), "--log-format", "json",
                     cwd=user_dir)  # fmt: skip
    try:
        wait_serving(proc, f"127.0.0.1:{base}")
        yield {"proc": proc, "base": base, "run_dir": run_dir, "ports": stack_ports(base)}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            finish(proc)


def test_the_default_deploy_file_is_read_and_flags_override_it(served: dict[str, Any]) -> None:
    thinker = run(info(f"127.0.0.1:{served['ports']['thinker']}"))
    assert thinker.model == "from-the-yaml"  # from deploy/omnistage.yaml under the current directory
    assert thinker.capacity.max_num_seqs == 3
    assert served["ports"]["thinker"] == served["base"] + PORT_STRIDE  # --port moved every stage


def test_a_second_stack_on_taken_ports_fails_at_once_and_the_first_serves_alone(
    served: dict[str, Any], tiny_dir: Path
) -> None:
    t0 = time.monotonic()
    code, out = finish(omnistage("serve", str(tiny_dir), "--port", str(served["base"]),
                                 "--served-model-name", "second"), timeout=60)  # fmt: skip
    assert code == 1, out
    assert time.monotonic() - t0 < 30  # refused before any child started
    assert f"{served['ports']['thinker']} (thinker[0])" in out and "taken" in out
    assert "Traceback" not in out
    models = {run(info(f"127.0.0.1:{served['ports']['thinker']}")).model for _ in range(20)}
    assert models == {"from-the-yaml"}
    # (the gateway's chain watch may have missed one poll while the second stack loaded the machine)
    deadline = time.monotonic() + 15
    while health_status(f"127.0.0.1:{served['base']}") != "SERVING" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert health_status(f"127.0.0.1:{served['base']}") == "SERVING"


def test_every_process_serves_its_metrics(served: dict[str, Any]) -> None:
    for name, port in served["ports"].items():
        with urllib.request.urlopen(f"http://127.0.0.1:{port + 1000}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert ("omnistage_gateway_" if name == "gateway" else "omnistage_stage_queue_depth") in body, name
        assert "process_cpu_seconds_total" in body, name


def test_the_bench_reads_each_process_load_over_a_request(served: dict[str, Any], tmp_path: Path) -> None:
    """`omnistage bench --serve` reads each process's steps, batch, busy share and CPU from these
    metrics around a level: one request shows up in every stage and in the CPU figures."""
    from benchmarks.stage_load import load_between, snapshot

    eps = {name: [f"http://127.0.0.1:{port + 1000}/metrics"] for name, port in served["ports"].items()}
    before = snapshot(eps)
    t = time.perf_counter()
    code, out = finish(omnistage("client", "Hello", "--target", f"127.0.0.1:{served['base']}", "--max-tokens", "6",
                                 "--max-frames", "6", "--out", str(tmp_path / "r.wav")))  # fmt: skip
    after = snapshot(eps)
    assert code == 0, out
    assert before is not None and after is not None
    load = load_between(before, after, time.perf_counter() - t)
    assert load["thinker"]["steps"] is not None and load["thinker"]["steps"] >= 6  # prefill + 5 decode steps at least
    for name in ("talker", "code2wav"):
        assert load[name]["steps"] and load[name]["mean_batch"] == 1.0, (name, load[name])
        assert 0 < load[name]["busy"] < 1 and load[name]["mean_step_ms"] > 0, (name, load[name])
        assert 0 < load[name]["step_on_cpu"] <= 1.05, (name, load[name])  # thread CPU time has coarse ticks
    assert all(f["cpu_cores"] is not None and f["cpu_cores"] > 0 for f in load.values()), load
    # gRPC messages: the thinker sent its 6 tokens up and down at least; the others took some in
    assert load["thinker"]["messages"] >= 12 and load["talker"]["messages"] >= 3, load
    assert load["code2wav"]["messages"] >= 3 and load["gateway"]["messages"] is None, load
    # the CPU by kind of thread (thread_cpu.py): the stages have an engine thread, the gateway none
    for name in ("thinker", "talker", "code2wav"):
        assert {"engine", "main", "grpc"} <= set(load[name]["thread_cpu_s"] or {}), (name, load[name])
    assert "engine" not in (load["gateway"]["thread_cpu_s"] or {}) and "main" in load["gateway"]["thread_cpu_s"], load
    assert all(f["context_switches"] > 0 for f in load.values()), load


def _json_log_lines(path: Path, wanted: Callable[[dict[str, Any]], bool], limit_s: float = 10) -> list[dict[str, Any]]:
    """The records of a JSON log that `wanted` picks, once there is one (or after `limit_s`)."""
    deadline = time.monotonic() + limit_s
    while True:
        records = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]
        lines = [r for r in records if wanted(r)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def test_client_json_has_the_text_and_request_id_and_the_access_log_has_a_line(
    served: dict[str, Any], tmp_path: Path
) -> None:
    code, out = finish(omnistage("client", "Hello", "--target", f"127.0.0.1:{served['base']}", "--json",
                                 "--max-tokens", "6", "--max-frames", "6", "--out", str(tmp_path / "r.wav"),
                                 "--speaker", "chelsie", "--system", "Be brief."))  # fmt: skip
    assert code == 0, out
    reply = json.loads(out[out.index("{") :])
    assert reply["request_id"] and isinstance(reply["text"], str) and len(reply["token_ids"]) == 6
    lines = _json_log_lines(served["run_dir"] / "gateway-0.log", lambda r: r.get("request_id") == reply["request_id"])
    assert lines, "no access-log line for the request"
    entry = lines[0]
    assert entry["logger"] == "omnistage.access" and entry["outcome"] == "ok"
    assert entry["completion_tokens"] == 6 and entry["ttft_ms"] is not None and entry["e2e_ms"] >= entry["ttft_ms"]
    # what the stages' logs call it: the client's id and a suffix of its own
    stage_id = entry["stage_request_id"]
    assert stage_id.startswith(reply["request_id"] + ".") and len(stage_id) == len(reply["request_id"]) + 9
    # --speed: the same (greedy) speech, time-stretched by the gateway
    code, out = finish(omnistage("client", "Hello", "--target", f"127.0.0.1:{served['base']}", "--json",
                                 "--max-tokens", "6", "--max-frames", "6", "--out", str(tmp_path / "fast.wav"),
                                 "--speaker", "chelsie", "--system", "Be brief.", "--speed", "2"))  # fmt: skip
    assert code == 0, out
    fast = json.loads(out[out.index("{") :])
    assert fast["token_ids"] == reply["token_ids"]
    # (atempo's length is off by up to about a window of 1024 samples, whatever the audio's)
    assert abs(fast["audio_samples"] * 2 - reply["audio_samples"]) < 0.05 * reply["audio_samples"] + 2048, (
        fast["audio_samples"], reply["audio_samples"])  # fmt: skip


def test_a_failed_requests_access_line_says_why(served: dict[str, Any], tmp_path: Path) -> None:
    """The stages log no request's error: the gateway's access line carries the status message."""
    code, out = finish(omnistage("client", "Hello", "--target", f"127.0.0.1:{served['base']}", "--max-tokens", "2",
                                 "--speaker", "nobody-here", "--out", str(tmp_path / "r.wav")))  # fmt: skip
    assert code != 0 and "nobody-here" in out, out
    log_path = served["run_dir"] / "gateway-0.log"
    lines = _json_log_lines(log_path, lambda r: r.get("logger") == "omnistage.access"
                            and "nobody-here" in (r.get("error") or ""))  # fmt: skip
    assert lines, "no access-log line naming the failed request's error"
    assert lines[0]["outcome"] == "INVALID_ARGUMENT", lines[0]
    # the client's error names the request, to find that line (it said only the status)
    assert f"(request id {lines[0]['request_id']})" in out, out
    code, out = finish(omnistage("client", "Hello", "--target", f"127.0.0.1:{served['base']}", "--max-tokens", "2",
                                 "--speaker", "nobody-here", "--out", str(tmp_path / "r2.wav"), "--request-id",
                                 "ops-named-1"))  # fmt: skip
    assert code != 0 and "(request id ops-named-1)" in out, out
    # refused before it started (its body): a line too, with the reason
    import httpx

    http = f"http://127.0.0.1:{served['base'] + HTTP_PORT_OFFSET}/v1/chat/completions"
    reply = httpx.post(http, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": "x"}, timeout=30)
    assert reply.status_code == 400
    refused = _json_log_lines(log_path, lambda r: r.get("logger") == "omnistage.access" and r.get("outcome")
                              == "INVALID_ARGUMENT" and "max_tokens" in (r.get("error") or ""))  # fmt: skip
    assert refused and refused[0]["api"] == "http", "no access-log line for a request refused at its body"


def test_health_prints_each_service(served: dict[str, Any]) -> None:
    targets = [arg for p in served["ports"].values() for arg in ("--target", f"127.0.0.1:{p}")]
    code, out = finish(omnistage("health", *targets))
    assert code == 0
    assert out.count("SERVING") == 4
    code, out = finish(omnistage("health", "--target", "127.0.0.1:1", "--timeout", "0.5"))
    assert code == 1 and "UNAVAILABLE" in out


def test_a_dead_child_is_restarted_and_serves_again(served: dict[str, Any]) -> None:
    """Runs last in this module: SIGKILL of a stage process; `serve` logs it, restarts it on
    its port, requests succeed again, and the stack stops only when told to: once, cleanly (exit
    0), however many Ctrl-Cs and SIGTERMs come."""
    proc = served["proc"]
    port = served["ports"]["talker"]
    talker = subprocess.run(["pgrep", "-f", f"stage talker --port {port}"],
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    os.kill(int(talker[0]), signal.SIGKILL)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        restarted = subprocess.run(["pgrep", "-f", f"stage talker --port {port}"], capture_output=True, text=True)
        pids = restarted.stdout.split()
        if pids and pids != talker and health_status(f"127.0.0.1:{port}", 1.0) == "SERVING":
            break
        assert proc.poll() is None, "serve stopped instead of restarting the talker"
        time.sleep(0.5)
    else:
        raise AssertionError("the talker was not restarted and serving again in time")
    # its callers dial it again within their reconnect backoff (2 s at most)
    for _ in range(3):
        code, out = finish(omnistage("client", "Hello", "--target", f"127.0.0.1:{served['base']}", "--max-tokens",
                                     "3", "--max-frames", "4", "--out", os.devnull))  # fmt: skip
        if code == 0:
            break
        time.sleep(1)
    assert code == 0, out
    # serve notices on its own pass (every 0.5 s); the loop above may have seen it serving first
    log = served["run_dir"] / "serve.log"
    deadline = time.monotonic() + 30
    while "serving again" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    for sig in (signal.SIGINT, signal.SIGTERM) * 10:  # Ctrl-C and a supervisor's SIGTERMs, as they come
        proc.send_signal(sig)
    code, out = finish(proc, timeout=60)
    assert code == 0 and out.count("stopping") == 1 and "Traceback" not in out, out  # one clean stop
    assert health_status(f"127.0.0.1:{served['base']}", 1.0) != "SERVING"
    assert "talker[0]" in out and "SIGKILL" in out and "restarting it in" in out and "serving again" in out
    # served with --log-format json: its supervision lines are JSON records too
    said = [line for line in out.splitlines() if "restarting it in" in line or "serving again" in line]
    assert said and all(json.loads(line)["logger"] == "omnistage.serve" for line in said), said
    # and they are kept in the run folder with the children's logs (they were only on the console)
    kept = (served["run_dir"] / "serve.log").read_text().splitlines()
    assert [json.loads(line)["message"] for line in kept if line in said] == [json.loads(line)["message"]
                                                                           for line in said], kept  # fmt: skip


def test_gateway_is_not_serving_while_its_thinker_is_unreachable(tiny_dir: Path) -> None:
    port = free_port_block(1)
    dead_thinker = free_port_block(1)
    proc = omnistage("gateway", str(tiny_dir), "--port", str(port), "--thinker", f"127.0.0.1:{dead_thinker}",
                     "--no-http")  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        status = ""
        while time.monotonic() < deadline:
            status = health_status(f"127.0.0.1:{port}", 1.0)
            if status in ("SERVING", "NOT_SERVING"):
                break
            time.sleep(0.3)
        time.sleep(2.5)  # a few polls of the thinker
        assert health_status(f"127.0.0.1:{port}", 1.0) == "NOT_SERVING"
        # a request meanwhile fails after its replays, saying why they were all it had: no thinker
        # served when its calls were made, so none was waited for (failover.replica_wait_s)
        import grpc

        from gateway.client import generate

        with pytest.raises(grpc.aio.AioRpcError) as err:
            run(generate(f"127.0.0.1:{port}", "hi", thinker_max_tokens=2, want_audio=False, timeout=30))
        detail = err.value.details() or ""
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and detail.startswith("thinker unavailable"), detail
        assert "failover.attempts); no replica served there when its calls were made" in detail, detail
    finally:
        proc.send_signal(signal.SIGTERM)
        finish(proc)


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["client", "hi", "--mode", "bogus"], 2, "'bogus' is not one of"),
        (["serve", "/no/such/checkpoint"], 2, "checkpoint directory not found"),
        (["serve", "Qwen/Qwen3-Omni-30B-A3B-Instruct"], 2, "never downloads"),
        (["serve", "--log-level", "loud"], 2, "'loud' is not one of"),
        (["serve", "--config", "MISSING.yaml"], 2, "deploy config not found"),
        (["serve", "--replicas", "talker=two"], 2, "--replicas: talker count must be an integer"),
        (["stage", "nobody", "--port", "1"], 2, "unknown stage 'nobody'"),
    ],
)
def test_bad_arguments_fail_with_one_line_and_a_usage_exit_code(args: list[str], code: int, needle: str) -> None:
    got, out = finish(omnistage(*args))
    assert got == code, out
    assert needle in out
    assert "Traceback" not in out


def test_a_bad_config_field_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("thinker:\n  max_num_seqs: 0\n  mystery: 1\n")
    got, out = finish(omnistage("serve", "--config", str(bad)))
    assert got == 2 and "thinker.max_num_seqs" in out and "thinker.mystery: unknown field" in out


def _read_until(proc: subprocess.Popen[str], needle: str) -> list[str]:
    """The process's output lines up to the one holding `needle`; fails, with what it printed,
    if it ends first."""
    assert proc.stdout is not None
    lines: list[str] = []
    while not lines or needle not in lines[-1]:
        line = proc.stdout.readline()
        if not line:
            code, rest = finish(proc)
            pytest.fail(f"exited ({code}) before printing {needle!r}:\n{''.join(lines)}{rest}")
        lines.append(line)
    return lines


def test_ctrl_c_stops_cleanly_during_start_up(tiny_dir: Path, tmp_path: Path) -> None:
    base = free_layout()
    starting = omnistage("serve", str(tiny_dir), "--port", str(base), "--log-dir", str(tmp_path / "a"))
    assert starting.stdout is not None
    lines = _read_until(starting, "starting omnistage")  # start-up has begun
    time.sleep(1)
    starting.send_signal(signal.SIGINT)
    code, out = finish(starting)
    out = "".join(lines) + out
    assert code == 130 and "interrupted" in out and "Traceback" not in out
    # Ctrl-C twice: the second exits at once, in clean-up or not; no child outlives it
    twice = omnistage("serve", str(tiny_dir), "--port", str(base), "--log-dir", str(tmp_path / "a2"))
    assert twice.stdout is not None
    _read_until(twice, "starting omnistage")
    time.sleep(1)
    twice.send_signal(signal.SIGINT)
    time.sleep(0.2)
    twice.send_signal(signal.SIGINT)
    code, out = finish(twice)
    # 130, or killed by the SIGINT itself if it came while the interpreter was exiting (a shell says 130)
    assert code in (130, -signal.SIGINT) and "Traceback" not in out, out
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-f", f"--port {base + PORT_STRIDE} "], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a child outlived serve"
        time.sleep(0.2)
    # (Ctrl-C once it serves: test_a_dead_child_is_restarted_and_serves_again, which stops its stack)


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1) to listen on")
def test_a_stack_on_ipv6_loopback_with_two_gateways_serves_through_each(tiny_dir: Path, tmp_path: Path) -> None:
    """`host: ::1` (stage targets as ipv6:[::1]:port lists) and `gateway.replicas: 2` (replica i
    on port + i): both gateways answer with the same greedy reply."""
    from gateway.client import generate
    from omnistage.cli.serve import start_stack
    from tests.integration.conftest import stack_config

    cfg = stack_config(host="::1", gateway={"replicas": 2}, talker={"replicas": 1})
    with start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path) as stack:
        gateways = stack.addresses("gateway")
        assert gateways == [f"[::1]:{cfg.gateway.port}", f"[::1]:{cfg.gateway.port + 1}"]
        replies = [run(generate(a, "hi", thinker_max_tokens=3, talker_max_tokens=4, timeout=60)) for a in gateways]
        assert replies[0].token_ids and replies[0].pcm.size > 0
        assert replies[1].token_ids == replies[0].token_ids
        import numpy as np

        np.testing.assert_allclose(replies[1].pcm, replies[0].pcm, atol=1e-5)


def test_host_must_be_an_ip_address() -> None:
    from omnistage.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"host: .*'localhost' is not an IP address"):
        parse_config({"host": "localhost"}, "test")
    assert parse_config({"host": "::1"}, "test").stage_target("talker").startswith("ipv6:[::1]:")


def test_port_moves_health_and_keeps_http_off_where_the_config_has_none(tmp_path: Path) -> None:
    """`--port P` means the same stack for `health` as for `serve`; HTTP moves to P + 50 only
    where the deploy config serves HTTP at all."""
    from typer.testing import CliRunner

    from omnistage.cli.main import _port_overrides, app

    base = free_layout()  # nothing listens there: every process is reported down, at its moved port
    result = CliRunner().invoke(app, ["health", "--port", str(base), "--timeout", "0.2"])
    assert result.exit_code == 1, result.output
    for role, port in stack_ports(base).items():
        assert any(line.startswith(role) and f"127.0.0.1:{port} " in line for line in result.output.splitlines()), \
            result.output  # fmt: skip
    off = tmp_path / "no-http.yaml"
    off.write_text("gateway:\n  http_port: null\n")
    assert "gateway.http_port" not in _port_overrides(off, base)
    assert _port_overrides(None, base)["gateway.http_port"] == base + HTTP_PORT_OFFSET


def test_a_checkpoint_a_stage_refuses_as_it_loads_ends_serve_with_exit_2(tiny_dir: Path, tmp_path: Path) -> None:
    """A stage that refuses the checkpoint as it loads its weights (exit 2: a bad checkpoint)
    makes the stack's start-up fail with that exit code and its one line, not exit 1."""
    import json
    import shutil

    import typer

    from omnistage.cli.main import known_errors
    from omnistage.cli.serve import StartupError, start_stack
    from omnistage.config import DeployConfig, apply_overrides, port_layout

    bad = tmp_path / "half-loaded"
    shutil.copytree(tiny_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["thinker_config"]["text_config"]["num_hidden_layers"] += 1  # one layer more than its weights have
    (bad / "config.json").write_text(json.dumps(config))
    cfg = apply_overrides(DeployConfig(), port_layout(free_layout()))
    with pytest.raises(StartupError) as err:
        start_stack(cfg, model=str(bad), log_dir=tmp_path / "logs")
    assert err.value.exit_code == 2 and "during start-up" in str(err.value), str(err.value)
    assert "missing weight" in str(err.value), str(err.value)
    with pytest.raises(typer.Exit) as ended, known_errors():
        raise err.value
    assert ended.value.exit_code == 2
