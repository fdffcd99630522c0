"""The `omnistage` command line. Each command imports its implementation lazily so that
`omnistage --help` stays fast, a broken optional piece cannot break the others, and the client
starts without torch.

Errors: one line on stderr (`error: ...`) and a non-zero exit code: 2 for a bad argument,
config or checkpoint, 1 for a failure at run time, 130 for Ctrl-C during start-up. With
`--log-level debug` the traceback is printed too.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
import yaml

from omnistage.cli import options

if TYPE_CHECKING:
    from omnistage.config import DeployConfig

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Staged serving for speech-output omni models.")
deploy_app = typer.Typer(no_args_is_help=True, help="Deployment files generated from the deploy YAML.")
app.add_typer(deploy_app, name="deploy")
supervisor = logging.getLogger("omnistage.serve")  # `serve`'s restarts of the processes it runs


class LogLevel(enum.StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class LogFormat(enum.StrEnum):
    text = "text"
    json = "json"


class Dtype(enum.StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    auto = "auto"


class Mode(enum.StrEnum):
    async_chunk = "async_chunk"
    full_payload = "full_payload"


class RenderTarget(enum.StrEnum):
    compose = "compose"
    k8s = "k8s"


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"omnistage {version('omnistage')}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Staged serving for speech-output omni models."""


def _add_plugins() -> None:
    """Command groups other packages register under the `omnistage.commands` entry point group
    (`omnistage bench` comes from the benchmarks package this way: the CLI never imports it)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="omnistage.commands"):
        app.add_typer(ep.load(), name=ep.name)


_add_plugins()


# ---- one way to fail ------------------------------------------------------------------------------


def _usage_errors() -> tuple[type[BaseException], ...]:
    from omnistage.cli.serve import ModelNotLocal
    from omnistage.config import ConfigError
    from omnistage.server.tls import TlsError

    # A CheckpointError exists only once its module is imported: not imported for it (torch and
    # transformers, seconds), so that a bad flag is refused before they load
    checkpoint = sys.modules.get("omnistage.models.checkpoint")
    return ConfigError, ModelNotLocal, TlsError, *((checkpoint.CheckpointError,) if checkpoint else ())


def _runtime_errors() -> tuple[type[BaseException], ...]:
    """Failures whose message says it all (no traceback hint)."""
    from omnistage.cli.serve import StartupError
    from omnistage.server.ports import PortTaken

    return PortTaken, StartupError


@contextlib.contextmanager
def known_errors(log_level: str | None = None, *, interrupted_code: int = 130) -> Iterator[None]:
    """Known failures as one line and an exit code; a traceback only at --log-level debug
    (`log_level` None: the command has no such flag)."""
    try:
        yield
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(interrupted_code) from None
    except Exception as e:
        if log_level == "debug":
            import traceback

            traceback.print_exc()
        usage = isinstance(e, _usage_errors())
        known = usage or isinstance(e, _runtime_errors())
        message = str(e) if known or isinstance(e, OSError | RuntimeError) else f"{type(e).__name__}: {e}"
        hint = "" if known or log_level in (None, "debug") else " (--log-level debug prints the traceback)"
        typer.echo(f"error: {message}{hint}", err=True)
        raise typer.Exit(2 if usage else getattr(e, "exit_code", 1)) from None  # (StartupError: its child's)


def _default_config() -> Path:
    """The deploy file read without --config; one that $OMNISTAGE_CONFIG names and is not there is
    refused saying so (the path alone points nowhere the user typed)."""
    from omnistage.config import ConfigError, default_config_path

    path = default_config_path()
    if os.environ.get("OMNISTAGE_CONFIG") and not path.is_file():
        raise ConfigError(f"deploy config not found: {path} (from OMNISTAGE_CONFIG; give --config, or unset it "
                          "for the default)")  # fmt: skip
    return path


def _load_cfg(config: Path | None, overrides: dict[str, object], *, default: bool = False) -> DeployConfig:
    """The deploy config: `config`, else (with `default`) the default file; then `overrides`."""
    from omnistage.config import apply_overrides, load_config

    cfg = load_config(config or (_default_config() if default else None))
    clean = {k: v for k, v in overrides.items() if v is not None}
    return apply_overrides(cfg, clean) if clean else cfg


def _stage_overrides(stages: tuple[str, ...], dtype: Dtype | None, device: str | None) -> dict[str, object]:
    from omnistage.config import config_path

    out: dict[str, object] = {}
    for name in stages:
        if dtype is not None:
            out[f"{config_path(name)}.dtype"] = dtype.value
        if device is not None:
            out[f"{config_path(name)}.device"] = device
    return out


StackPortOpt = Annotated[
    int | None, typer.Option("--port", help="Move the whole stack: gateway P (HTTP P + 50), stage k at P + 100k.")
]


def _port_overrides(config: Path | None, port: int | None) -> dict[str, object]:
    """`--port P`'s layout over the deploy config; HTTP moves to P + 50 only where the config
    serves it (`gateway.http_port: null` keeps it off)."""
    from omnistage.config import port_layout

    if port is None:
        return {}
    layout: dict[str, object] = dict(port_layout(port))
    cfg = _load_cfg(config, {}, default=True)
    if cfg.gateway.http_port is None:
        del layout["gateway.http_port"]
    if not cfg.thinker.disaggregated:  # the roles run nothing: not moved (near 65535 they would not fit)
        del layout["thinker.prefill.base_port"], layout["thinker.decode.base_port"]
    return layout


ModelArg = Annotated[
    str | None, typer.Argument(help="Checkpoint directory (default: the config's, else the built-in tiny one).")
]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="Deploy YAML (default: deploy/omnistage.yaml).")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Same as MODEL.")]
HostOpt = Annotated[str | None, typer.Option("--host", help="Address to listen on (default from config).")]
DtypeOpt = Annotated[Dtype | None, typer.Option("--dtype", help="Model dtype (all stages for serve).")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="cpu, cuda or cuda:N (all stages for serve).")]
NameOpt = Annotated[str | None, typer.Option("--served-model-name", help="Model name clients see.")]
TextOnlyOpt = Annotated[bool, typer.Option("--text-only", help="No talker or code2wav: text replies only "
                                           "(audio_output: false; a Thinking or Captioner checkpoint)")]  # fmt: skip
MaxLenOpt = Annotated[int | None, typer.Option("--max-model-len", help="Cap on prompt + generated tokens.")]
LogLevelOpt = Annotated[LogLevel, typer.Option("--log-level", help="Log level (debug prints tracebacks).")]
HttpPortOpt = Annotated[
    int | None, typer.Option("--http-port", min=1, max=65535,
                             help="OpenAI-compatible HTTP port of the gateway (default 8000).")
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option("--api-key", envvar="OMNISTAGE_API_KEY", callback=options.api_key,
                 help="Require 'Authorization: Bearer KEY' on the gateway (HTTP and gRPC)."),
]  # fmt: skip
LogFormatOpt = Annotated[LogFormat, typer.Option("--log-format", help="text, or one JSON object per line.")]


# ---- commands -------------------------------------------------------------------------------------


class Layout(enum.StrEnum):
    published = "published"
    fused = "fused"


class StorageDtype(enum.StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


@app.command("make-tiny")
def make_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")],
    family: Annotated[str, typer.Option("--family", help="Model family (config.json model_type).")] = "qwen3_omni_moe",
    layout: Annotated[
        Layout, typer.Option("--layout", help="published (sharded, experts one by one) or fused (one file).")
    ] = Layout.published,
    dtype: Annotated[StorageDtype, typer.Option("--dtype", help="Storage dtype.")] = StorageDtype.float32,
    settings: Annotated[
        list[str] | None,
        typer.Option("--set", help="A config value by dotted path, e.g. talker_config.text_config.num_hidden_layers=20 "
                     "(the real talker's depth at tiny widths); repeatable; the value is read as YAML."),
    ] = None,
) -> None:
    """Write a deterministic tiny checkpoint (Hugging Face layout) into OUT_DIR."""
    from omnistage.models import load_tokenizer, open_checkpoint
    from omnistage.models.family import UnknownFamily, family_for

    try:
        chosen = family_for(family)
    except UnknownFamily as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    from huggingface_hub.errors import StrictDataclassError

    made: Path | None = None  # the outermost folder this run makes (OUT_DIR or a parent): removed on failure
    try:
        made = next((p for p in (*reversed(out_dir.absolute().parents), out_dir.absolute()) if not p.exists()), None)
        if made is None and not out_dir.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        changes = _dotted_settings(settings or [])
        options: dict[str, Any] = {"settings": changes} if changes else {}
        summary = chosen.write_tiny(out_dir, layout=layout.value, dtype=dtype.value, **options)
        if changes:  # settings can make a checkpoint no stage would serve: refused now, as `serve` would
            load_tokenizer(open_checkpoint(out_dir))
    # an option this family's tiny checkpoint does not have, a --set value its config refuses
    # (transformers' strict configs raise their own error), OUT_DIR not writable or a file
    except (ValueError, StrictDataclassError, OSError) as e:  # (CheckpointError is a ValueError)
        if made is not None and made.is_dir():  # nothing half-written stays
            shutil.rmtree(made, ignore_errors=True)
        message = " ".join(str(e).split()) if not isinstance(e, OSError) else f"{out_dir}: {e.strerror or e}"
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(summary, indent=2))


def _dotted_settings(pairs: list[str]) -> dict[str, Any]:
    """`["a.b=3", "c=[1, 2]"]` -> `{"a.b": 3, "c": [1, 2]}` (values read as YAML)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
            raise ValueError(f"--set {pair!r}: expected KEY.PATH=VALUE")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ValueError(f"--set {pair!r}: the value is not YAML: {e}") from None
    return out


@deploy_app.command("render")
def deploy_render(
    config: ConfigOpt = None,
    target: Annotated[RenderTarget, typer.Option("--target", help="compose or k8s")] = RenderTarget.k8s,
    out: Annotated[Path, typer.Option("--out", help="Directory whose k8s/ (or compose/ and docker-compose.yaml) "
                                      "it writes; the checked-in ones under ./deploy by default.")] = Path("deploy"),
) -> None:
    """Render docker-compose or Kubernetes files from the deploy YAML that `serve` reads."""
    from omnistage.cli.deploy_render import render_to_dir

    with known_errors():
        for path in render_to_dir(config or _default_config(), target.value, out):
            typer.echo(str(path))


@app.command("health")
def health(
    target: Annotated[
        list[str] | None, typer.Option("--target", help="HOST:PORT to check (repeatable; default: the whole stack).")
    ] = None,
    config: ConfigOpt = None,
    port: StackPortOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for each answer.")] = 3.0,
    service: Annotated[str, typer.Option("--service", help="Health service name ('' = the server).")] = "",
    text_only: TextOnlyOpt = False,
) -> None:
    """grpc.health.v1 status of each service (exit 0 only when every one is SERVING): by default
    every process of the stack the deploy config describes (moved by `--port` as `serve --port`
    moves it). TLS as the deploy config's `tls` says."""
    from omnistage.server.health_check import health_status, stage_role
    from omnistage.server.tls import gateway_channel_credentials, name_override, stage_channel_credentials

    with known_errors():
        cfg = _load_cfg(config, {**_port_overrides(config, port), "audio_output": False if text_only else None},
                        default=True)  # fmt: skip
        tls = cfg.tls
        grpc_ports = {port: role for port, role in cfg.ports() if not role.endswith(("metrics", "http"))}

        def credentials(role: str) -> Any:
            return gateway_channel_credentials(tls) if role.startswith("gateway") else stage_channel_credentials(tls)

        def role_of(address: str) -> str:  # the process the config has on that port
            port = address.rpartition(":")[2]
            return grpc_ports.get(int(port), "stage") if port.isdigit() else "stage"

        if target:  # the role the config has on that port, where it has one
            checks = [(role_of(t) if role_of(t) != "stage" else "-", t, credentials(role_of(t))) for t in target]
        else:
            checks = [(role, cfg.address(port), credentials(role)) for port, role in grpc_ports.items()]
    ok = True
    for role, address, credentials in checks:
        status = health_status(address, timeout, service, credentials=credentials, options=name_override(tls))
        ok &= status == "SERVING"
        expected = None if target or role.startswith("gateway") else role.partition("[")[0]
        serving_stage = expected is not None and status == "SERVING"
        runs = stage_role(address, timeout, credentials, name_override(tls)) if serving_stage else None
        if runs is not None and runs != expected:  # another deploy config's stack (a split thinker, ...)
            ok = False
            status += (f", but it runs {runs}, not {expected}: the stack there was started from another deploy "
                       "config (give `health` the --config it was started with)")  # fmt: skip
        typer.echo(f"{role:<14} {address:<22} {status}")
    raise typer.Exit(0 if ok else 1)


def _warn_without_media(model_dir: Path) -> None:
    """Say on the console what the gateway only logs: a checkpoint whose processor cannot be
    built (its preprocessor_config.json missing or damaged: a download cut short) is served for
    text alone."""
    from omnistage.models import load_tokenizer, media_inputs, open_checkpoint

    ckpt = open_checkpoint(model_dir)
    _, why = media_inputs(ckpt, load_tokenizer(ckpt))
    if why:
        supervisor.warning("%s (text is served)", why)


@app.command("serve")
def serve(
    model_arg: ModelArg = None,
    model: ModelOpt = None,
    config: ConfigOpt = None,
    host: HostOpt = None,
    port: StackPortOpt = None,
    replicas: Annotated[str | None, typer.Option("--replicas", help="e.g. talker=2,code2wav=2")] = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    served_model_name: NameOpt = None,
    max_model_len: MaxLenOpt = None,
    text_only: TextOnlyOpt = False,
    http_port: HttpPortOpt = None,
    api_key: ApiKeyOpt = None,
    log_dir: Annotated[
        Path | None, typer.Option("--log-dir", help="Run folder (default: a new one in the cache).")
    ] = None,
    log_level: LogLevelOpt = LogLevel.info,
    log_format: LogFormatOpt = LogFormat.text,
) -> None:
    """Run the whole stack locally: one process per stage replica plus the gateway, on loopback."""
    import signal

    from omnistage.cli.logs import setup_logging
    from omnistage.cli.serve import StartupError, start_stack
    from omnistage.config import check_replicas_run, default_config_path, parse_replicas
    from omnistage.topology import PROCESSES

    setup_logging("serve", log_level.value, log_format.value)
    stop = StopFlag()
    with known_errors(log_level.value):
        counts = parse_replicas(replicas) if replicas else {}
        overrides: dict[str, object] = dict(counts)
        overrides.update(_port_overrides(config, port))
        overrides.update(_stage_overrides(PROCESSES, dtype, device))
        flags = {"host": host, "served_model_name": served_model_name, "max_model_len": max_model_len,
                 "gateway.http_port": http_port, "audio_output": False if text_only else None}
        # only the flags given: an unset --http-port must not undo --port's HTTP port (P + 50)
        overrides.update({k: v for k, v in flags.items() if v is not None})
        cfg = _load_cfg(config, overrides, default=True)
        check_replicas_run(cfg, counts)
        typer.echo(f"config: {config or default_config_path()}" + (" + flags" if any(overrides.values()) else ""))
        shown = model_arg or model or cfg.model or "built-in tiny checkpoint"
        typer.echo(f"starting omnistage (model: {shown}) ...")

        def interrupt(*_: object) -> None:
            # Remembered as well as raised: once, under load, a Ctrl-C during start-up did not
            # stop it (its KeyboardInterrupt never surfaced); start-up also polls the flag.
            # Raised once, not into the clean-up the first started; another Ctrl-C exits at once
            # (the children, which die with this process, get SIGTERM).
            if stop.is_set():
                os.write(2, b"interrupted again: exiting now\n")  # not print: the handler may interrupt one
                os._exit(130)
            stop.set()
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, interrupt)
        stack = start_stack(cfg, model=model_arg or model, log_dir=log_dir, log_level=log_level.value,
                            log_format=log_format.value, api_key=api_key, interrupted=stop.is_set)  # fmt: skip
        for sig in (signal.SIGINT, signal.SIGTERM):  # from here on a signal only sets the flag
            signal.signal(sig, lambda *_: stop.set())
        if stop.is_set():
            stack.stop()
            raise KeyboardInterrupt
    code = 0
    kept: logging.Handler | None = None
    try:
        kept = _keep_supervisor_log(stack.run_dir / "serve.log")
        _warn_without_media(stack.model_dir)  # (once up: a Ctrl-C meanwhile only sets the flag)
        typer.echo(f"logs: {stack.run_dir}")
        typer.echo("\n".join(stack.status_lines()))
        tls = cfg.tls.gateway  # the hints dial it as its clients must: https, and the CA that signed it
        http = "https" if tls else "http"
        ca = cfg.tls.ca_file if tls else None
        # (no ca_file: a certificate the clients' own roots trust)
        tls_ca = ((f" --tls-ca {ca}" if ca else " --tls") + (f" --server-name {cfg.tls.server_name}"
                  if cfg.tls.server_name else "") if tls else "")  # fmt: skip
        typer.echo(f"omnistage gateway listening on {stack.gateway_address} (gRPC{', TLS' if tls else ''})"
                   + (f" and {http}://{stack.http_address} (OpenAI-compatible HTTP, playground at /)"
                      if stack.http_address else ""))  # fmt: skip
        if cfg.gateway.replicas > 1:
            typer.echo(f"  and {cfg.gateway.replicas - 1} more gateway(s): "
                       + ", ".join(f"{a} (gRPC)" for a in stack.addresses("gateway")[1:])
                       + "".join(f", {http}://{cfg.address(p)}" for p in cfg.http_ports()[1:]))  # fmt: skip
        text_only = "" if cfg.audio_output else " --no-audio"  # a text-only stack refuses audio
        # with a key, the hints say where it goes (never the key itself): the client reads it from
        # $OMNISTAGE_API_KEY, curl sends it as a header
        header = " -H \"authorization: Bearer $OMNISTAGE_API_KEY\"" if api_key else ""
        if api_key:
            typer.echo("with the API key in $OMNISTAGE_API_KEY (export OMNISTAGE_API_KEY=...):")
        typer.echo(f'try: omnistage client "Hello" --target {stack.gateway_address}{text_only}{tls_ca}')
        if stack.http_address:
            cacert = f" --cacert {ca}" if ca else ""
            typer.echo(f"     curl{cacert} {http}://{stack.http_address}/v1/chat/completions -H 'content-type: "
                       "application/json'" + header + """ -d '{"messages":[{"role":"user","content":"Hello"}]}'""")
        # every process of this stack, replicas and a split thinker included, as it was started
        typer.echo(f"     omnistage health --config {stack.run_dir / 'omnistage.yaml'}")
        # Self-healing: a process that dies is restarted (with backoff) on its port; the stack
        # stops on Ctrl-C/SIGTERM, or when a process keeps dying before it ever serves.
        while not stop.wait(0.5):
            try:
                stack.heal(supervisor.warning)  # log lines, so that --log-format json keeps them JSON
            except StartupError as e:
                supervisor.error("%s; stopping the stack", e)
                typer.echo("\n".join(stack.status_lines()), err=True)
                code = 1
                break
    finally:
        typer.echo("stopping ...")
        try:
            stack.stop()
        finally:
            if kept is not None:
                supervisor.removeHandler(kept)
                kept.close()
    raise typer.Exit(code)


def _keep_supervisor_log(path: Path) -> logging.Handler | None:
    """`serve`'s own lines (restarts, a process given up on) also go to the run folder, beside
    its children's logs, in the same format: they went only to its stderr. None when the file
    cannot be written (the console still has them)."""
    try:
        handler = logging.FileHandler(path)
    except OSError:
        return None
    shown = next((h.formatter for h in logging.getLogger().handlers if h.formatter is not None), None)
    handler.setFormatter(shown or logging.Formatter("%(asctime)s serve %(levelname)s %(name)s: %(message)s"))
    supervisor.addHandler(handler)
    return handler


class StopFlag:
    """Set from signal handlers, polled by `serve`'s loop. Not a `threading.Event`: its `set()`
    takes a lock, and a second signal whose handler runs while the first one's holds it waits on
    that lock forever (seen: `timeout` and `pkill` each sending SIGTERM, `serve` never stopped)."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """True once set; False after `timeout` seconds without."""
        deadline = time.monotonic() + timeout
        while not self._set and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
        return self._set


@app.command("stage")
def stage(
    name: Annotated[str, typer.Argument(help="thinker, thinker-prefill, thinker-decode, talker or code2wav")],
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to listen on.")],
    downstream: Annotated[str | None, typer.Option("--downstream", help="gRPC target of the next stage.")] = None,
    model_arg: ModelArg = None,
    model: ModelOpt = None,
    config: ConfigOpt = None,
    host: HostOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    served_model_name: NameOpt = None,
    max_model_len: MaxLenOpt = None,
    text_only: TextOnlyOpt = False,
    log_level: LogLevelOpt = LogLevel.info,
    log_format: LogFormatOpt = LogFormat.text,
) -> None:
    """Run one stage service (what compose and Kubernetes run)."""
    from omnistage.cli.logs import setup_logging
    from omnistage.cli.serve import check_devices, resolve_model
    from omnistage.topology import PROCESSES

    setup_logging(f"{name}:{port}", log_level.value, log_format.value)
    _stop_on_sigterm()
    with known_errors(log_level.value, interrupted_code=0):
        if name not in PROCESSES:
            typer.echo(f"error: unknown stage {name!r}; expected one of {', '.join(PROCESSES)}", err=True)
            raise typer.Exit(2)
        overrides = {**_stage_overrides((name,), dtype, device), "served_model_name": served_model_name,
                     "max_model_len": max_model_len, "host": host,
                     "audio_output": False if text_only else None}  # fmt: skip
        cfg = _load_cfg(config, overrides, default=True)
        check_devices(cfg, (name,))
        model_dir = resolve_model(cfg, model_arg or model)
        from omnistage.server.process import run_stage  # (torch and transformers: once the flags are checked)

        run_stage(name, cfg, model_dir, cfg.host, port, downstream)


def _stop_on_sigterm() -> None:
    """SIGTERM before the server runs (loading a checkpoint takes minutes) stops the process
    at once, as Ctrl-C would: as a container's PID 1 it would otherwise be ignored until the
    runtime's SIGKILL. The server installs its drain handler when it starts."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@app.command("gateway")
def gateway(
    thinker: Annotated[str, typer.Option("--thinker", help="gRPC target of the thinker stage.")],
    port: Annotated[int | None, typer.Option("--port", min=1, max=65535, help="Port to listen on (default: the "
                                             "config's gateway.port, 50051).")] = None,
    model_arg: ModelArg = None,
    model: ModelOpt = None,
    config: ConfigOpt = None,
    host: HostOpt = None,
    served_model_name: NameOpt = None,
    max_model_len: MaxLenOpt = None,
    http_port: HttpPortOpt = None,
    no_http: Annotated[bool, typer.Option("--no-http", help="Serve gRPC only.")] = False,
    text_only: TextOnlyOpt = False,
    api_key: ApiKeyOpt = None,
    log_level: LogLevelOpt = LogLevel.info,
    log_format: LogFormatOpt = LogFormat.text,
) -> None:
    """Run the gateway (gRPC Gateway.Generate and the OpenAI-compatible HTTP API) in front of a
    thinker target."""
    from omnistage.cli.logs import setup_logging
    from omnistage.cli.serve import resolve_model
    from omnistage.config import ConfigError

    setup_logging(f"gateway:{port or 'config'}", log_level.value, log_format.value)
    _stop_on_sigterm()
    with known_errors(log_level.value, interrupted_code=0):
        # (the host checked as serve's is: an IP address; it took a name)
        cfg = _load_cfg(config, {"served_model_name": served_model_name, "max_model_len": max_model_len,
                                 "host": host, "audio_output": False if text_only else None}, default=True)  # fmt: skip
        http = None if no_http else (http_port or cfg.gateway.http_port)
        port = port or cfg.gateway.port  # (it was 50051 whatever the config said)
        if http == port:  # (it was "taken by another process": its own gRPC server)
            raise ConfigError(f"--http-port {http}: the gateway's gRPC port too (--port); give them apart")
        model_dir = resolve_model(cfg, model_arg or model)
        from gateway.process import run_gateway  # (torch and transformers: once the flags are checked)
        from omnistage.models import open_checkpoint

        ckpt = open_checkpoint(model_dir)
        run_gateway(cfg, ckpt, cfg.host, port, thinker, http_port=http, api_key=api_key or "")


@app.command("client")
def client(
    prompt: Annotated[str, typer.Argument(help="What to ask.")],
    target: Annotated[str, typer.Option("--target", help="Gateway HOST:PORT.")] = "localhost:50051",
    out: Annotated[Path, typer.Option("--out", help="WAV file to write.")] = Path("reply.wav"),
    no_audio: Annotated[bool, typer.Option("--no-audio", help="Text only (the talker is not used).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print request id, text, ids, timings as JSON.")] = False,
    system: Annotated[str | None, typer.Option("--system", help="A system message before the prompt.")] = None,
    speaker: Annotated[str, typer.Option("--speaker", help="Voice (default: the model's).")] = "",
    speed: Annotated[float | None, typer.Option("--speed", min=0.25, max=4.0,
                                                help="Speech speed, 0.25 to 4 (time-stretched, pitch kept).")] = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", help="Sample the text at this temperature (default: greedy).")
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed for sampled text.")] = None,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Thinker token limit.")] = None,
    max_frames: Annotated[int | None, typer.Option(
        "--max-frames", help="Talker code-0 limit (Qwen3-Omni: N - 1 frames, as generate()).")] = None,
    mode: Annotated[Mode | None, typer.Option("--mode", help="Edge mode between stages.")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", min=0.001, help="Deadline in seconds.")] = None,
    audio: Annotated[list[Path] | None, typer.Option("--audio", help="An audio file to send (repeatable).")] = None,
    image: Annotated[list[Path] | None, typer.Option("--image", help="An image file to send (repeatable).")] = None,
    video: Annotated[list[Path] | None, typer.Option("--video", help="A video file to send (repeatable).")] = None,
    use_audio_in_video: Annotated[
        bool, typer.Option("--use-audio-in-video", help="Each video's sound track goes in with its frames.")
    ] = False,
    api_key: Annotated[str, typer.Option("--api-key", envvar="OMNISTAGE_API_KEY", callback=options.api_key,
                                         help="Sent as authorization: Bearer KEY.")] = "",
    request_id: Annotated[str, typer.Option("--request-id", help="Name the request (the gateway's access line, "
                                            "its errors); default: the gateway makes one.")] = "",
    tls: Annotated[bool, typer.Option("--tls", help="Dial the gateway over TLS, its certificate verified with "
                                      "gRPC's default roots ($GRPC_DEFAULT_SSL_ROOTS_FILE_PATH, or those grpcio "
                                      "ships); --tls-ca names the roots instead.")] = False,
    tls_ca: Annotated[Path | None, typer.Option("--tls-ca", help="PEM roots: dial the gateway over TLS.")] = None,
    server_name: Annotated[str | None, typer.Option(
        "--server-name", help="With --tls or --tls-ca: the name to verify in the gateway's certificate instead of the "
        "target's host (the deploy config's tls.server_name).")] = None,
) -> None:
    """Send one request to the gateway: print text as it streams, write a WAV. Audio, images and
    video go in the user turn before the prompt, in the order given."""
    import asyncio

    import grpc

    from gateway.client import REQUEST_ID_KEY, generate, write_wav

    def read(paths: list[Path] | None, what: str) -> list[bytes]:
        out = []
        for path in paths or []:
            try:
                out.append(path.read_bytes())
            except OSError as e:
                typer.echo(f"error: --{what} {path}: {e.strerror or e}", err=True)
                raise typer.Exit(2) from None
        return out

    media = {"audio": read(audio, "audio"), "images": read(image, "image"), "videos": read(video, "video")}
    ca = read([tls_ca], "tls-ca")[0] if tls_ca is not None else None
    if not no_audio:
        _check_writable(out)
    try:
        reply = asyncio.run(generate(
            target, prompt, on_text=None if as_json else (lambda t: typer.echo(t, nl=False)),
            want_audio=not no_audio, thinker_max_tokens=max_tokens, talker_max_tokens=max_frames,
            greedy=True, mode=mode.value if mode else None, timeout=timeout, system=system, speaker=speaker,
            temperature=temperature, seed=seed, use_audio_in_video=use_audio_in_video, api_key=api_key, tls_ca=ca,
            tls_server_name=server_name, tls=tls, request_id=request_id, speed=speed or 0.0, **media,
        ))  # fmt: skip
    except grpc.aio.AioRpcError as e:
        # the id the gateway gave it, to find its access line (none when refused before it started)
        rid = dict((*(e.initial_metadata() or ()), *(e.trailing_metadata() or ()))).get(REQUEST_ID_KEY) or request_id
        typer.echo(f"\nerror: {e.code().name}: {e.details()}" + (f" (request id {rid})" if rid else ""), err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from None
    if not no_audio:
        write_wav(str(out), reply.pcm, reply.sample_rate)
    seconds = reply.pcm.shape[0] / reply.sample_rate if reply.sample_rate else 0.0
    summary: dict[str, Any] = {
        "request_id": reply.request_id, "text": reply.text, "token_ids": reply.token_ids, "ttft_s": reply.ttft_s,
        "ttfa_s": reply.ttfa_s, "e2e_s": reply.e2e_s, "usage": reply.usage, "timings": reply.timings,
        "audio_samples": int(reply.pcm.shape[0]), "audio_seconds": seconds, "wav": None if no_audio else str(out),
    }  # fmt: skip
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    typer.echo("")
    ttft, ttfa = reply.ttft_s, reply.ttfa_s
    typer.echo(f"request id: {reply.request_id}")
    typer.echo(f"time to first token: {ttft * 1000:.0f} ms" if ttft is not None else "no text")
    if not no_audio:
        typer.echo(f"time to first audio: {ttfa * 1000:.0f} ms" if ttfa is not None else "no audio")
        typer.echo(f"wrote {out} ({seconds:.2f} s at {reply.sample_rate} Hz)")


def _check_writable(out: Path, flag: str = "--out") -> None:
    """Before the work: `out` can be written (its folder exists and takes files), or a usage
    error naming it (it was a traceback once the reply had been made)."""
    folder = out.parent if str(out.parent) else Path(".")
    why = ("is a directory" if out.is_dir() else "" if folder.is_dir() and os.access(folder, os.W_OK)
           else f"its folder {folder} does not exist" if not folder.exists() else f"cannot write into {folder}")
    if why:
        typer.echo(f"error: {flag} {out}: {why}", err=True)
        raise typer.Exit(2)


@app.command("demo")
def demo(
    prompt: Annotated[str, typer.Argument(help="What to ask.")] = "Hello! Tell me a short story.",
    model: ModelOpt = None,
    out: Annotated[Path, typer.Option("--out", help="WAV file to write.")] = Path("reply.wav"),
    text_only: TextOnlyOpt = False,
) -> None:
    """Run the in-process staged pipeline (no gRPC) once and write a WAV (--text-only: the text alone)."""
    import numpy as np

    from gateway.client import write_wav
    from omnistage.cli.serve import resolve_model
    from omnistage.config import DeployConfig
    from omnistage.models.text_stream import TextStream
    from services.pipeline import AudioEvent, InProcessPipeline, PipelineRequest, TextEvent

    if not text_only:
        _check_writable(out)
    with known_errors():
        cfg = DeployConfig(audio_output=not text_only)
        pipe = InProcessPipeline(resolve_model(cfg, model), cfg)
        req = PipelineRequest(pipe.prompt_ids(prompt), pipe.thinker_defaults().with_overrides(max_tokens=64),
                              want_audio=not text_only)  # fmt: skip
        pcm = []
        text = TextStream(pipe.tokenizer)  # the reply's text as the gateway sends it (whole characters, no <|im_end|>)
        try:
            for ev in pipe.run(req):
                if isinstance(ev, TextEvent):
                    typer.echo(text.push([ev.token_id]), nl=False)
                elif isinstance(ev, AudioEvent):
                    pcm.append(ev.pcm.numpy())
        except BaseException:
            if text.sent:  # the error's line after the text, not on it
                typer.echo("")
            raise
        typer.echo(text.flush(), nl=False)
    if text_only:
        typer.echo("")
        return
    audio = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
    rate = pipe.checkpoint.sample_rate
    write_wav(str(out), audio, rate)
    typer.echo(f"\nwrote {out} ({audio.shape[0] / rate:.2f} s at {rate} Hz)")


def run() -> None:
    """The console script: typer's app, with Ctrl-C before any command runs kept quiet."""
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
