"""The `omnistage` command line. Each command imports its implementation lazily so that
`omnistage --help` stays fast and a broken optional piece cannot break the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from omnistage.config import DeployConfig

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Staged serving for speech-output omni models.")
deploy_app = typer.Typer(no_args_is_help=True, help="Deployment files generated from the deploy YAML.")
app.add_typer(deploy_app, name="deploy")


def _add_plugins() -> None:
    """Command groups other packages register under the `omnistage.commands` entry point group
    (`omnistage bench` comes from the benchmarks package this way: the CLI never imports it)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="omnistage.commands"):
        app.add_typer(ep.load(), name=ep.name)


_add_plugins()


@app.command("make-tiny")
def make_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")],
    family: Annotated[str, typer.Option("--family", help="Model family (config.json model_type).")] = "qwen3_omni_moe",
) -> None:
    """Write a deterministic tiny checkpoint (Hugging Face layout) into OUT_DIR."""
    from omnistage.models.family import UnknownFamily, family_for

    try:
        chosen = family_for(family)
    except UnknownFamily as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(chosen.write_tiny(out_dir), indent=2))


@deploy_app.command("render")
def deploy_render(
    config: Annotated[Path | None, typer.Option("--config", help="Deploy YAML (default: built-in defaults).")] = None,
    target: Annotated[str, typer.Option("--target", help="compose or k8s")] = "k8s",
    out: Annotated[Path, typer.Option("--out", help="Directory to write into.")] = Path("deploy"),
) -> None:
    """Render docker-compose or Kubernetes files from the deploy YAML that `serve` reads."""
    from omnistage.cli.deploy_render import render_to_dir

    for path in render_to_dir(config, target, out):
        typer.echo(str(path))


@app.command("health")
def health(
    target: Annotated[str, typer.Option("--target", help="HOST:PORT of any omnistage service.")] = "127.0.0.1:50051",
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for an answer.")] = 3.0,
) -> None:
    """grpc.health.v1 check (exit 0 when SERVING): the container and probe health check."""
    from omnistage.server.grpc_common import check

    raise typer.Exit(0 if check(target, timeout) else 1)


def _load_cfg(config: Path | None, overrides: dict[str, object]) -> DeployConfig:
    from omnistage.config import ConfigError, apply_overrides, load_config

    try:
        cfg = load_config(config)
        clean = {k: v for k, v in overrides.items() if v is not None}
        return apply_overrides(cfg, clean) if clean else cfg
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


ConfigOpt = Annotated[Path | None, typer.Option("--config", help="Deploy YAML (see deploy/omnistage.yaml).")]
ModelOpt = Annotated[str | None, typer.Option("--model", help="Checkpoint directory (default: built-in tiny).")]
HostOpt = Annotated[str | None, typer.Option("--host", help="Address to listen on (default from config).")]


@app.command("serve")
def serve(
    config: ConfigOpt = None,
    model: ModelOpt = None,
    replicas: Annotated[str | None, typer.Option("--replicas", help="e.g. talker=2,code2wav=2")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Gateway port (default 50051).")] = None,
    log_dir: Annotated[Path | None, typer.Option("--log-dir", help="Write each process's log here.")] = None,
) -> None:
    """Run the whole stack locally: one process per stage replica plus the gateway, on loopback."""
    import signal
    import threading

    from omnistage.cli.serve import start_stack
    from omnistage.config import ConfigError, parse_replicas

    try:
        overrides: dict[str, object] = dict(parse_replicas(replicas)) if replicas else {}
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    overrides["gateway.port"] = port
    cfg = _load_cfg(config, overrides)
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    typer.echo("starting omnistage (model: %s) ..." % (model or cfg.model or "built-in tiny checkpoint"))
    stack = start_stack(cfg, model=model, log_dir=log_dir, config_file=config)
    try:
        for c in stack.children:
            typer.echo(f"  {c.name:<9} {c.address}  pid {c.proc.pid}")
        typer.echo(f"omnistage gateway listening on {stack.gateway_address}")
        typer.echo(f'try: omnistage client "Hello" --target {stack.gateway_address}')
        while not stop.wait(0.5):
            dead = [c for c in stack.children if c.proc.poll() is not None]
            if dead:
                typer.echo(f"error: {dead[0].name} at {dead[0].address} exited; stopping", err=True)
                break
    finally:
        typer.echo("stopping ...")
        stack.stop()


@app.command("stage")
def stage(
    name: Annotated[str, typer.Argument(help="thinker, talker or code2wav")],
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")],
    downstream: Annotated[str | None, typer.Option("--downstream", help="gRPC target of the next stage.")] = None,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    host: HostOpt = None,
) -> None:
    """Run one stage service (what compose and Kubernetes run)."""
    from omnistage.cli.serve import resolve_model
    from omnistage.server.process import run_stage
    from omnistage.topology import STAGES

    if name not in STAGES:
        typer.echo(f"error: unknown stage {name!r}; expected one of {', '.join(STAGES)}", err=True)
        raise typer.Exit(2)
    cfg = _load_cfg(config, {})
    run_stage(name, cfg, resolve_model(cfg, model), host or cfg.host, port, downstream)  # type: ignore[arg-type]


@app.command("gateway")
def gateway(
    thinker: Annotated[str, typer.Option("--thinker", help="gRPC target of the thinker stage.")],
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 50051,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    host: HostOpt = None,
) -> None:
    """Run the gateway (gRPC Gateway.Generate) in front of a thinker target."""
    from gateway.server import run_gateway
    from omnistage.cli.serve import resolve_model
    from omnistage.models import open_checkpoint

    cfg = _load_cfg(config, {})
    run_gateway(cfg, open_checkpoint(resolve_model(cfg, model)), host or cfg.host, port, thinker)


@app.command("client")
def client(
    prompt: Annotated[str, typer.Argument(help="What to ask.")],
    target: Annotated[str, typer.Option("--target", help="Gateway HOST:PORT.")] = "localhost:50051",
    out: Annotated[Path, typer.Option("--out", help="WAV file to write.")] = Path("reply.wav"),
    no_audio: Annotated[bool, typer.Option("--no-audio", help="Text only (the talker is not used).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print ids, timings and audio length as JSON.")] = False,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="Thinker token limit.")] = None,
    max_frames: Annotated[int | None, typer.Option("--max-frames", help="Talker code-0 limit.")] = None,
    mode: Annotated[str | None, typer.Option("--mode", help="async_chunk or full_payload")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Deadline in seconds.")] = None,
) -> None:
    """Send one request to the gateway: print text as it streams, write a 24 kHz WAV."""
    import asyncio

    import grpc

    from gateway.client import generate, write_wav

    try:
        reply = asyncio.run(generate(
            target, prompt, on_text=None if as_json else (lambda t: typer.echo(t, nl=False)),
            want_audio=not no_audio, thinker_max_tokens=max_tokens, talker_max_tokens=max_frames,
            greedy=True, mode=mode, timeout=timeout,
        ))
    except grpc.aio.AioRpcError as e:
        typer.echo(f"\nerror: {e.code().name}: {e.details()}", err=True)
        raise typer.Exit(1) from None
    if not no_audio:
        write_wav(str(out), reply.pcm, reply.sample_rate)
    summary = {
        "token_ids": reply.token_ids, "ttft_s": reply.ttft_s, "ttfa_s": reply.ttfa_s, "e2e_s": reply.e2e_s,
        "usage": reply.usage, "timings": reply.timings, "audio_samples": int(reply.pcm.shape[0]),
        "audio_seconds": reply.pcm.shape[0] / reply.sample_rate, "wav": None if no_audio else str(out),
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        typer.echo("")
        ttft, ttfa = reply.ttft_s, reply.ttfa_s
        typer.echo(f"time to first token: {ttft * 1000:.0f} ms" if ttft is not None else "no text")
        if not no_audio:
            typer.echo(f"time to first audio: {ttfa * 1000:.0f} ms" if ttfa is not None else "no audio")
            typer.echo(f"wrote {out} ({summary['audio_seconds']:.2f} s at 24 kHz)")


@app.command("demo")
def demo(
    prompt: Annotated[str, typer.Argument(help="What to ask.")] = "Hello! Tell me a short story.",
    model: ModelOpt = None,
    out: Annotated[Path, typer.Option("--out", help="WAV file to write.")] = Path("reply.wav"),
) -> None:
    """Run the in-process staged pipeline (no gRPC) once and write a WAV."""
    import numpy as np

    from gateway.client import write_wav
    from omnistage.cli.serve import resolve_model
    from omnistage.config import DeployConfig
    from services.pipeline import AudioEvent, InProcessPipeline, PipelineRequest, TextEvent

    pipe = InProcessPipeline(resolve_model(DeployConfig(), model))
    req = PipelineRequest(pipe.prompt_ids(prompt), pipe.thinker_defaults().with_overrides(max_tokens=64))
    pcm = []
    for ev in pipe.run(req):
        if isinstance(ev, TextEvent):
            typer.echo(ev.text, nl=False)
        elif isinstance(ev, AudioEvent):
            pcm.append(ev.pcm.numpy())
    audio = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
    rate = pipe.checkpoint.sample_rate
    write_wav(str(out), audio, rate)
    typer.echo(f"\nwrote {out} ({audio.shape[0] / rate:.2f} s at {rate} Hz)")
