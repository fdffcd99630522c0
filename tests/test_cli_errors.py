"""The command line's refusals: one `error:` line naming the argument and exit 2, before any
work, never a traceback (each of these was a traceback, a wrong reason or exit 1)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from omnistage.cli.main import app
from omnistage.server.ports import unusable_host


@pytest.fixture(autouse=True)
def _own_process_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`serve` and `stage` set up the process's logging and signal handlers: this test process
    keeps its own."""
    import omnistage.cli.logs
    import omnistage.cli.main

    monkeypatch.setattr(omnistage.cli.logs, "setup_logging", lambda *a, **k: None)
    monkeypatch.setattr(omnistage.cli.main, "_stop_on_sigterm", lambda: None)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _refused(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output, result.output
    return result.output


def test_an_output_file_that_cannot_be_written_is_refused_before_the_request(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "r.wav"
    assert "--out" in _refused(["client", "hi", "--target", "127.0.0.1:1", "--out", str(missing)])
    assert "is a directory" in _refused(["client", "hi", "--target", "127.0.0.1:1", "--out", str(tmp_path)])
    assert "its folder" in _refused(["demo", "hi", "--out", str(missing)])
    assert "--timeout" in _refused(["client", "hi", "--target", "127.0.0.1:1", "--timeout", "-1"])
    assert "--speed" in _refused(["client", "hi", "--target", "127.0.0.1:1", "--speed", "5"])


def test_make_tiny_refusals_leave_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "new" / "tiny"
    message = _refused(["make-tiny", str(out), "--set", "talker_config.text_config.num_hidden_layers=abc"])
    assert "num_hidden_layers" in message and not (tmp_path / "new").exists()  # an empty folder stayed
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "not a directory" in _refused(["make-tiny", str(afile)])
    under = _refused(["make-tiny", str(afile / "sub")])  # a folder under a file
    assert str(afile / "sub") in under and "not a directory" in under.lower(), under


def test_serve_names_a_log_dir_or_host_it_cannot_use(tmp_path: Path, tiny_dir: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "--log-dir" in _refused(["serve", "--model", str(tiny_dir), "--log-dir", str(afile / "run")])
    assert "--log-dir" in _refused(["serve", "--model", str(tiny_dir), "--log-dir", str(afile)])
    # TEST-NET-1 (RFC 5737): never an address of this machine; it was "ports taken" by another stack
    if unusable_host("192.0.2.1") is None:
        pytest.skip("this machine lets a socket bind addresses it does not have (net.ipv4.ip_nonlocal_bind)")
    message = _refused(["serve", "--model", str(tiny_dir), "--host", "192.0.2.1", "--log-dir", str(tmp_path / "r")])
    assert "host 192.0.2.1: nothing can listen there" in message and "taken" not in message


def test_a_stage_without_its_downstream_is_a_usage_error(tiny_dir: Path) -> None:
    assert "error: talker: --downstream TARGET is required" in _refused(
        ["stage", "talker", "--model", str(tiny_dir), "--port", "1"])


def test_serve_says_on_the_console_when_the_checkpoint_can_take_no_media(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint whose processor cannot be built is served for text alone: `serve` says so once
    the stack is up (only the gateway's log said it)."""
    import shutil

    from omnistage.cli.main import _warn_without_media
    no_processor = tmp_path / "no-processor"
    shutil.copytree(tiny_dir, no_processor)
    (no_processor / "preprocessor_config.json").unlink()
    with caplog.at_level("WARNING", logger="omnistage.serve"):
        _warn_without_media(no_processor)
    assert "audio, images and video are not accepted" in caplog.text and "preprocessor_config.json" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="omnistage.serve"):
        _warn_without_media(tiny_dir)
    assert not caplog.records


def test_an_api_key_is_taken_without_its_trailing_newline_and_one_no_header_can_carry_is_refused() -> None:
    """A key read from a file or a Kubernetes secret ends in a newline: kept, no client could
    ever match it (every request 401, no warning). One with a space inside is refused."""
    import typer

    from omnistage.cli import options

    assert options.api_key("s3cret\n") == "s3cret" and options.api_key(None) is None and options.api_key("") == ""
    for bad in ("two words", "tab\there", "  \n", "caf\u00e9"):
        with pytest.raises(typer.BadParameter):
            options.api_key(bad)
    for command in (["serve"], ["gateway", "--port", "1", "--thinker", "127.0.0.1:2"], ["client", "hi"]):
        out = CliRunner().invoke(app, command, env={"OMNISTAGE_API_KEY": "two words"}).output
        assert "--api-key" in out and "printable ASCII without spaces" in out, (command, out)
    flag = _refused(["serve", "--api-key", "a b"])
    assert "--api-key" in flag and "printable ASCII without spaces" in flag, flag


def test_omnistage_model_that_names_no_checkpoint_is_refused_and_an_empty_mount_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """$OMNISTAGE_MODEL (the image's mount point): a typo or a half-mounted volume served the
    built-in tiny checkpoint's random weights in silence. Only an empty directory (nothing
    mounted) still means the tiny one, and that is said."""
    from omnistage.cli import serve
    from omnistage.config import DeployConfig

    monkeypatch.setattr(serve, "default_model_dir", lambda: Path("TINY"))
    cfg = DeployConfig()
    monkeypatch.setenv("OMNISTAGE_MODEL", str(tmp_path / "typo"))
    with pytest.raises(serve.ModelNotLocal, match=r"OMNISTAGE_MODEL=.*typo: no such checkpoint directory"):
        serve.resolve_model(cfg)
    half = tmp_path / "half"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("OMNISTAGE_MODEL", str(half))
    with pytest.raises(serve.ModelNotLocal, match=r"no config\.json there"):
        serve.resolve_model(cfg)
    (half / "config.json").write_text("{}")
    assert serve.resolve_model(cfg) == half
    monkeypatch.setenv("OMNISTAGE_MODEL", str(tmp_path / "typo"))
    assert serve.resolve_model(cfg, str(half)) == half  # a model given wins; the variable is not read
    empty = tmp_path / "mount"
    empty.mkdir()
    monkeypatch.setenv("OMNISTAGE_MODEL", str(empty))
    with caplog.at_level("WARNING"):
        assert serve.resolve_model(cfg) == Path("TINY")
    assert "is empty (nothing mounted there): serving the built-in tiny checkpoint" in caplog.text
    monkeypatch.setenv("OMNISTAGE_MODEL", "")
    assert serve.resolve_model(cfg) == Path("TINY")  # (what compose and the manifests set for the tiny one)


def test_a_cuda_device_this_torch_cannot_use_is_refused_before_anything_starts(tiny_dir: Path) -> None:
    """It was each child's "Torch not compiled with CUDA enabled" as it loaded, and exit 1."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine's torch has a CUDA device: the refusal is for one without")
    from tests.integration.conftest import free_port_block

    out = _refused(["serve", str(tiny_dir), "--device", "cuda", "--port", str(free_port_block(400))])
    assert "thinker.device: cuda: this machine's torch sees no CUDA device" in out, out
    out = _refused(["stage", "talker", "--port", "1", "--device", "cuda:1", "--model", str(tiny_dir),
                    "--downstream", "127.0.0.1:2"])  # fmt: skip
    assert "talker.device: cuda:1: this machine's torch sees no CUDA device" in out, out


def test_a_missing_config_named_by_the_environment_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`$OMNISTAGE_CONFIG` naming no file: the refusal says where the path came from (a
    container's environment, not the command line the user sees)."""
    monkeypatch.setenv("OMNISTAGE_CONFIG", str(tmp_path / "gone.yaml"))
    for command in (["serve"], ["health"], ["deploy", "render", "--target", "compose", "--out", str(tmp_path)]):
        out = _refused(command)
        assert "gone.yaml (from OMNISTAGE_CONFIG" in out, (command, out)
    assert "(from OMNISTAGE_CONFIG" not in _refused(["serve", "--config", str(tmp_path / "other.yaml")])


def test_a_checkpoint_refused_before_any_child_starts_leaves_no_run_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """`serve` makes its run folder, and starts its forker there, before it reads the checkpoint
    (the forker imports meanwhile): a checkpoint it then refuses leaves no run folder in the
    cache, nor a forker logging into the one removed; a --log-dir given is the user's and stays."""
    from omnistage.cli import forker as forker_module
    from tests.integration.conftest import free_port_block

    monkeypatch.delenv(forker_module.FORK_ENV, raising=False)
    monkeypatch.setenv("OMNISTAGE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no_such_family"}')
    port = str(free_port_block(400))
    assert "no_such_family" in _refused(["serve", str(bad), "--port", port])
    assert not any((tmp_path / "cache" / "runs").iterdir())
    assert not [f for f in forker_module._SHARED if f.usable() and tmp_path in f.log_path.parents]
    assert "no_such_family" in _refused(["serve", str(bad), "--port", port, "--log-dir", str(tmp_path / "mine")])
    assert (tmp_path / "mine").is_dir()


def test_two_runs_of_one_process_in_one_second_get_folders_of_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The default run folder is named by the second and the pid: a second stack of the same
    process in that second appended to the first one's logs."""
    from omnistage.cli import serve

    monkeypatch.setenv("OMNISTAGE_CACHE", str(tmp_path))
    monkeypatch.setattr(serve.time, "strftime", lambda fmt: "20261128-080000")
    first, second, third = (serve.new_run_dir(None) for _ in range(3))
    assert len({first, second, third}) == 3 and all(p.is_dir() for p in (first, second, third))
    assert serve.new_run_dir(first) == first  # a folder given is used as it is


@pytest.mark.parametrize("args", [
    ["serve", "--config", "MISSING.yaml"],
    ["serve", "--replicas", "talker=two"],
    ["stage", "nobody", "--port", "1"],
    ["stage", "talker", "--port", "1", "--config", "MISSING.yaml"],
    ["gateway", "--thinker", "x:1", "--port", "5", "--http-port", "5"],
])  # fmt: skip
def test_a_bad_flag_is_refused_before_torch_loads(args: list[str]) -> None:
    """`serve`, `stage` and `gateway` check their flags and config before they import torch (with
    the model code, seconds): the refusal comes at once, and classifying it does not import it."""
    import subprocess
    import sys

    probe = ("import sys\nfrom omnistage.cli.main import run\ntry:\n    run()\nexcept SystemExit as e:\n"
             "    print('exit', e.code, 'torch' in sys.modules)\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "exit 2 False", (done.stdout, done.stderr)
    assert "error:" in done.stderr and "Traceback" not in done.stderr, done.stderr
