"""The deploy YAML: validated at start, errors name the field; CLI overrides apply."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from omnistage.config import (
    ConfigError,
    DeployConfig,
    apply_overrides,
    dump_config,
    load_config,
    parse_config,
    parse_replicas,
    port_layout,
)


def test_default_deploy_file_is_the_default_config() -> None:
    path = Path(__file__).resolve().parents[1] / "deploy" / "omnistage.yaml"
    assert load_config(path) == DeployConfig()


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"talker": {"replicas": 0}}, "talker.replicas"),
        ({"talker": {"replica": 2}}, "talker.replica: unknown field"),
        ({"bogus": 1}, "bogus: unknown field"),
        ({"code2wav": {"streaming": "magic"}}, "code2wav.streaming"),
        ({"edges": {"thinker_to_talker": "sometimes"}}, "edges.thinker_to_talker"),
        ({"thinker": {"dtype": "int3"}}, "thinker.dtype"),
        ({"thinker": {"device": "tpu"}}, "thinker.device"),
        ({"timeouts": {"input_wait_timeout_s": -1}}, "timeouts.input_wait_timeout_s"),
        ({"talker": {"base_port": 7101}}, "talker.base_port: port 7101"),
        ({"code2wav": {"first_chunk_frames_idle": 3}}, "first_chunk_frames_idle (3) must not exceed"),
        ({"code2wav": {"first_chunk_frames_idle": 0}}, "code2wav.first_chunk_frames_idle"),
        # YAML's .inf: rendered, these overflowed (terminationGracePeriodSeconds)
        ({"timeouts": {"drain_grace_s": float("inf")}}, "timeouts.drain_grace_s"),
        ({"timeouts": {"startup_timeout_s": float("inf")}}, "timeouts.startup_timeout_s"),
        ({"timeouts": {"drain_grace_s": 1e12}}, "timeouts.drain_grace_s"),
        ({"media": {"max_audio_seconds": float("nan")}}, "media.max_audio_seconds"),
        # "" served the tiny checkpoint under `serve` but rendered a model volume for containers
        ({"model": ""}, "model"),
        ({"served_model_name": ""}, "served_model_name"),
        ({"served_model_name": "   "}, "served_model_name: Value error, '   ' starts or ends with whitespace"),
        # a token cache is the thinker's: on these it bounded steps (code2wav's 2**30: every request refused)
        ({"talker": {"cache_capacity_tokens": 5}}, "talker: Value error, cache_capacity_tokens: only the thinker's"),
        ({"code2wav": {"cache_capacity_tokens": 10**6}}, "code2wav: Value error, cache_capacity_tokens: only"),
        # strict types: YAML's true is no count, 2.0 no integer, 1 or "yes" no switch
        ({"talker": {"replicas": True}}, "talker.replicas: Input should be a valid integer"),
        ({"talker": {"max_num_seqs": 2.0}}, "talker.max_num_seqs: Input should be a valid integer"),
        ({"thinker": {"chunked_prefill": 1}}, "thinker.chunked_prefill: Input should be a valid boolean"),
        ({"thinker": {"chunked_prefill": "yes"}}, "thinker.chunked_prefill: Input should be a valid boolean"),
        ({"model": 5}, "model: Input should be a valid string"),
    ],
)
def test_bad_fields_are_refused_by_name(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match="invalid deploy config") as err:
        parse_config(data, "x.yaml")
    assert needle in str(err.value)


def test_an_integer_is_a_number_of_seconds() -> None:
    cfg = parse_config({"timeouts": {"request_timeout_s": 30}}, "x.yaml")
    assert cfg.timeouts.request_timeout_s == 30.0 and isinstance(cfg.timeouts.request_timeout_s, float)


def test_yaml_round_trip_and_file_errors(tmp_path: Path) -> None:
    cfg = apply_overrides(DeployConfig(), {"talker.replicas": 3, "gateway.port": 6000})
    f = tmp_path / "d.yaml"
    f.write_text(dump_config(cfg))
    assert load_config(f) == cfg
    (tmp_path / "bad.yaml").write_text("talker: [1, 2")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    # a key given twice: plain YAML keeps the last (a second `talker:` block replaced the first)
    for text, key, line in (("talker:\n  replicas: 2\ntalker:\n  max_num_seqs: 3\n", "talker", 3),
                            ("talker:\n  replicas: 2\n  replicas: 3\n", "replicas", 3)):  # fmt: skip
        (tmp_path / "twice.yaml").write_text(text)
        with pytest.raises(ConfigError, match=rf"(?s)the key '{key}' is given twice.*line {line}") as err:
            load_config(tmp_path / "twice.yaml")
        assert "twice.yaml" in str(err.value)
    # an anchor merged in (`<<`) may still be overridden; a list as a key is an error, not a crash
    (tmp_path / "merged.yaml").write_text("x-stage: &stage\n  replicas: 2\n  max_num_seqs: 4\n"
                                          "talker:\n  <<: *stage\n  max_num_seqs: 8\n")
    with pytest.raises(ConfigError, match="x-stage: unknown field"):  # the anchor's own key is not a field
        load_config(tmp_path / "merged.yaml")
    (tmp_path / "merged.yaml").write_text("talker:\n  <<: {replicas: 2, max_num_seqs: 4}\n  max_num_seqs: 8\n")
    merged = load_config(tmp_path / "merged.yaml").talker
    assert (merged.replicas, merged.max_num_seqs) == (2, 8)
    (tmp_path / "listkey.yaml").write_text("? [1, 2]\n: 3\n")
    with pytest.raises(ConfigError, match="a key must be a plain value"):
        load_config(tmp_path / "listkey.yaml")


def test_cli_overrides() -> None:
    assert parse_replicas("talker=2, code2wav=3") == {"talker.replicas": 2, "code2wav.replicas": 3}
    for bad in ("talker", "painter=2", "talker=two"):
        with pytest.raises(ConfigError, match="--replicas"):
            parse_replicas(bad)
    with pytest.raises(ConfigError, match=r"--nothing\.replicas: unknown field"):
        apply_overrides(DeployConfig(), {"nothing.replicas": 2})
    cfg = apply_overrides(DeployConfig(), {"talker.replicas": 2})
    assert cfg.stage_target("talker") == "ipv4:127.0.0.1:7201,127.0.0.1:7202"


@pytest.mark.parametrize(("thinker", "message"), [
    ({"batching": "fast"}, "thinker.batching: 'fast' is not used with thinker.disaggregated"),
    ({"replicas": 2}, "set it in thinker.prefill and thinker.decode"),
    ({"prefill": {"batching": "fast"}}, "prefill.batching (fast) and thinker.decode.batching (exact) must agree"),
    ({"prefill": {"dtype": "float32"}, "decode": {"dtype": "bfloat16"}}, "thinker.decode.dtype (bfloat16) must agree"),
])  # fmt: skip
def test_a_split_thinker_refuses_what_its_roles_would_not_run(thinker: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"thinker": {"disaggregated": True, **thinker}})
    parse_config({"thinker": {"disaggregated": False, **thinker}})  # the single thinker runs them
    both = {"prefill": {"batching": "fast"}, "decode": {"batching": "fast"}}
    assert parse_config({"thinker": {"disaggregated": True, **both}}).stage("thinker-decode").batching == "fast"
    # what `serve --dtype/--device` gives: the same value in the thinker block and both roles
    everywhere = {"dtype": "bfloat16", "prefill": {"dtype": "bfloat16"}, "decode": {"dtype": "bfloat16"}}
    assert parse_config({"thinker": {"disaggregated": True, **everywhere}}).stage("thinker-prefill").dtype == "bfloat16"


def test_disaggregated_thinker_config() -> None:
    """`thinker.disaggregated` swaps the thinker for its two roles in the chain, ports, replicas
    and --port; a block given in part keeps its stage's defaults."""
    given = {"thinker": {"disaggregated": True, "decode": {"replicas": 2}}, "talker": {"replicas": 2}}
    cfg = parse_config(given)
    assert given == {"thinker": {"disaggregated": True, "decode": {"replicas": 2}}, "talker": {"replicas": 2}}
    assert cfg.stage_names() == ("thinker-prefill", "thinker-decode", "talker", "code2wav")
    assert cfg.stage("thinker-decode").replicas == 2 and cfg.stage("thinker-decode").base_port == 7151
    assert cfg.stage("talker").base_port == 7201
    assert cfg.stage_target("thinker-decode") == "ipv4:127.0.0.1:7151,127.0.0.1:7152"
    assert "thinker[0]" not in {role for _, role in cfg.ports()}
    assert cfg.edge_mode("thinker-decode", "talker") == cfg.edge_mode("thinker", "talker")
    assert parse_replicas("thinker-prefill=3") == {"thinker.prefill.replicas": 3}
    moved = apply_overrides(cfg, port_layout(9000))
    assert moved.stage_ports("thinker-prefill") == [9100] and moved.stage_ports("thinker-decode") == [9150, 9151]
    assert DeployConfig().stage_names() == ("thinker", "talker", "code2wav")
    with pytest.raises(ConfigError, match=r"port 7201 of talker\[0\] collides with thinker-decode\[0\]"):
        parse_config({"thinker": {"disaggregated": True, "decode": {"base_port": 7201}}})
    example = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "pd.yaml"
    assert load_config(example).thinker.disaggregated


def test_text_only_ends_the_chain_at_the_thinker() -> None:
    """`audio_output: false` (a checkpoint without a talker): the thinker, or its two roles, alone;
    no ports or downstream for the talker and code2wav."""
    cfg = parse_config({"audio_output": False})
    assert cfg.stage_names() == ("thinker",) and cfg.downstream("thinker") is None
    assert {role.split("[")[0] for _, role in cfg.ports()} == {"gateway", "thinker"}
    split = parse_config({"audio_output": False, "thinker": {"disaggregated": True}})
    assert split.stage_names() == ("thinker-prefill", "thinker-decode")
    assert split.downstream("thinker-prefill") == "thinker-decode" and split.downstream("thinker-decode") is None
    assert DeployConfig().downstream("thinker") == "talker" and DeployConfig().downstream("code2wav") is None
    with pytest.raises(ConfigError, match="audio_output"):
        parse_config({"audio_output": "sometimes"})


def test_the_fast_example_sets_fast_batching_on_every_stage() -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "deploy" / "examples" / "fast.yaml")
    assert [cfg.stage(name).batching for name in cfg.stage_names()] == ["fast"] * 3
    assert DeployConfig().stage("talker").batching == "exact"  # the default stays exact


def test_the_cuda_example_puts_every_stage_on_the_gpu() -> None:
    cfg = load_config(Path(__file__).resolve().parents[1] / "deploy" / "examples" / "cuda.yaml")
    assert [cfg.stage(name).device for name in cfg.stage_names()] == ["cuda"] * 3
    assert DeployConfig().stage("thinker").device == "cpu"


def test_exact_batching_splits_prompts_in_fixed_chunks() -> None:
    """Exact batching: a prompt's prefill chunks are fixed (the budget less a token per other
    request a step may hold), so where it is split does not depend on the other requests."""
    cfg = parse_config({"thinker": {"max_num_batched_tokens": 512, "max_num_seqs": 16}})
    assert cfg.thinker.prefill_chunk == 497
    assert cfg.thinker.engine_limits()["prefill_chunk"] == 497
    assert parse_config({"thinker": {"batching": "fast"}}).thinker.prefill_chunk is None
    assert parse_config({"thinker": {"chunked_prefill": False}}).thinker.prefill_chunk is None
    # a budget below max_num_seqs: half of it (not 1 token a step)
    assert parse_config({"thinker": {"max_num_batched_tokens": 8, "max_num_seqs": 16}}).thinker.prefill_chunk == 4


@pytest.mark.parametrize("command", [["stage", "talker", "--port", "7201"], ["gateway", "--thinker", "x:1"],
                                     ["stage", "thinker", "--port", "7101", "--text-only"],
                                     ["gateway", "--thinker", "x:1", "--text-only"]])  # fmt: skip
def test_stage_and_gateway_read_the_deploy_file_serve_reads(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no --config, `omnistage stage` and `omnistage gateway` read `$OMNISTAGE_CONFIG` (then
    deploy/omnistage.yaml) as `serve` does; they ran on the built-in defaults."""
    from typer.testing import CliRunner

    import gateway.process
    import omnistage.cli.logs
    import omnistage.cli.main
    import omnistage.cli.serve
    import omnistage.models
    import omnistage.server.process
    from omnistage.cli.main import app

    mine = tmp_path / "mine.yaml"
    mine.write_text("talker:\n  max_num_seqs: 3\n")
    monkeypatch.setenv("OMNISTAGE_CONFIG", str(mine))
    seen: list[DeployConfig] = []
    # this test process keeps its own logging and signal handlers
    monkeypatch.setattr(omnistage.cli.logs, "setup_logging", lambda *a, **k: None)
    monkeypatch.setattr(omnistage.cli.main, "_stop_on_sigterm", lambda: None)
    monkeypatch.setattr(omnistage.cli.serve, "resolve_model", lambda cfg, model: tmp_path)
    monkeypatch.setattr(omnistage.models, "open_checkpoint", lambda path: None)
    monkeypatch.setattr(omnistage.server.process, "run_stage", lambda name, cfg, *a: seen.append(cfg))
    monkeypatch.setattr(gateway.process, "run_gateway", lambda cfg, *a, **k: seen.append(cfg))
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert [cfg.talker.max_num_seqs for cfg in seen] == [3]
    # `--text-only`, as serve's: a text-only thinker needs no --downstream and no deploy file of its own
    assert [cfg.audio_output for cfg in seen] == ["--text-only" not in command]


@pytest.mark.parametrize(("args", "message"), [
    (["--replicas", "thinker-decode=2"], "this stack runs no thinker-decode process (thinker.disaggregated is false"),
    (["--replicas", "talker=2,thinker-prefill=1"], "--replicas thinker-prefill=1: this stack runs no"),
    # near the top of the port range the unused roles are not moved (their ports were named)
    (["--port", "65400"], "talker.base_port"),
])  # fmt: skip
def test_serve_refuses_flags_for_processes_it_does_not_run(args: list[str], message: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`--replicas thinker-decode=2` without the split was ignored: one thinker ran."""
    from typer.testing import CliRunner

    import omnistage.cli.logs
    from omnistage.cli.main import app

    monkeypatch.setattr(omnistage.cli.logs, "setup_logging", lambda *a, **k: None)  # the test process keeps its own

    result = CliRunner().invoke(app, ["serve", *args, "--log-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "thinker.decode.base_port" not in result.output, result.output


def test_the_gateway_command_takes_its_port_from_the_config_and_checks_host_and_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`omnistage gateway` listened on 50051 whatever gateway.port said, took a host name the
    config refuses, and reported --http-port equal to --port as a port taken by another process."""
    from typer.testing import CliRunner

    import gateway.process
    import omnistage.cli.logs
    import omnistage.cli.main
    import omnistage.cli.serve
    import omnistage.models
    import omnistage.server.process
    from omnistage.cli.main import app

    mine = tmp_path / "mine.yaml"
    mine.write_text("gateway:\n  port: 36001\n  http_port: 36081\n")
    monkeypatch.setenv("OMNISTAGE_CONFIG", str(mine))
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(omnistage.cli.logs, "setup_logging", lambda *a, **k: None)
    monkeypatch.setattr(omnistage.cli.main, "_stop_on_sigterm", lambda: None)
    monkeypatch.setattr(omnistage.cli.serve, "resolve_model", lambda cfg, model: tmp_path)
    monkeypatch.setattr(omnistage.models, "open_checkpoint", lambda path: None)
    monkeypatch.setattr(omnistage.server.process, "run_stage", lambda *a: seen.append(a))
    monkeypatch.setattr(gateway.process, "run_gateway", lambda cfg, ckpt, host, port, thinker, **k:
                        seen.append((host, port, k["http_port"])))  # fmt: skip
    runner = CliRunner()
    assert runner.invoke(app, ["gateway", "--thinker", "x:1"]).exit_code == 0
    assert runner.invoke(app, ["gateway", "--thinker", "x:1", "--port", "36002", "--host", "::1"]).exit_code == 0
    assert seen == [("127.0.0.1", 36001, 36081), ("::1", 36002, 36081)]
    for args, needle in [
        (["gateway", "--thinker", "x:1", "--host", "localhost"], "host"),
        (["stage", "talker", "--port", "7201", "--host", "localhost"], "host"),
        (["gateway", "--thinker", "x:1", "--port", "36081"], "--http-port 36081: the gateway's gRPC port too"),
        (["gateway", "--thinker", "x:1", "--http-port", "0"], "--http-port"),
    ]:
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and needle in result.output, (args, result.output)
    assert len(seen) == 2
    with pytest.raises(ConfigError, match="talker given twice"):  # (the last one won in silence)
        parse_replicas("talker=2,talker=3")


def test_a_stage_process_runs_with_its_failover_settings(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`failover.*` reaches the stage's service as configured (a dropped keyword would leave a
    default in place, silently: the process-bound replay limit is checked end to end nowhere)."""
    import omnistage.server.process as process
    from omnistage.server.stage_server import StageService

    built: list[StageService] = []

    class Built(Exception):
        pass

    def capture(service: StageService, *args: object) -> None:
        built.append(service)
        raise Built

    monkeypatch.setattr(process, "StageServer", capture)
    monkeypatch.setattr(process.torch, "set_num_threads", lambda n: None)  # (this test process keeps its own)
    monkeypatch.setattr(process, "widen_primitive_cache", lambda: None)
    cfg = parse_config({"failover": {"attempts": 2, "replica_wait_s": 7.5, "replay_budget_bytes": 4096,
                                     "replay_memory_bytes": 65536}}, "test")  # fmt: skip
    with pytest.raises(Built):
        process.run_stage("talker", cfg, tiny_dir, "127.0.0.1", 1, "127.0.0.1:2")
    [service] = built
    service.engine.stop()  # (its thread)
    assert (service.failover_attempts, service.replica_wait_s, service.replay_budget_bytes,
            service.replay_memory.budget) == (2, 7.5, 4096, 65536)  # fmt: skip
