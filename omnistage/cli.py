"""The `omnistage` command line. Each command imports its implementation lazily so that
`omnistage --help` stays fast and a broken optional piece cannot break the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from services.runtime.config import DeployConfig

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Staged serving for speech-output omni models.")
deploy_app = typer.Typer(no_args_is_help=True, help="Deployment files generated from the deploy YAML.")
app.add_typer(deploy_app, name="deploy")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: every figure against a baseline from the same run.")
app.add_typer(bench_app, name="bench")


@app.command("make-tiny")
def make_tiny(out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")]) -> None:
    """Write the deterministic tiny Qwen3-Omni checkpoint (Hugging Face layout) into OUT_DIR."""
    from omnistage.tiny import write_tiny_checkpoint

    summary = write_tiny_checkpoint(out_dir)
    typer.echo(json.dumps(summary, indent=2))


@bench_app.callback(invoke_without_command=True, no_args_is_help=False)
def bench(
    ctx: typer.Context,
    target: Annotated[str | None, typer.Option("--target", help="HOST:PORT of a running gateway.")] = None,
    serve: Annotated[bool, typer.Option("--serve", help="Start a stack (free ports) for the run.")] = False,
    config: Annotated[Path | None, typer.Option("--config", help="Deploy YAML for --serve.")] = None,
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint dir (default: the tiny one).")] = None,
    replicas: Annotated[str | None, typer.Option("--replicas", help="For --serve, e.g. talker=2,code2wav=2.")] = None,
    concurrency: Annotated[str, typer.Option("--concurrency", help="Closed-loop levels, e.g. 1,4,8,16.")] = "1,4,8",
    rate: Annotated[str, typer.Option("--rate", help="Poisson arrival rates (req/s), e.g. 2.0 or 1,2.")] = "",
    num_requests: Annotated[int, typer.Option("--num-requests", help="Requests per level.")] = 16,
    time_limit: Annotated[float, typer.Option("--time-limit", help="Seconds per level (0: none).")] = 120.0,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="Prompt file, one per line.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Request order and Poisson arrivals.")] = 0,
    thinker_max_tokens: Annotated[int, typer.Option("--thinker-max-tokens")] = 24,
    talker_max_tokens: Annotated[int, typer.Option("--talker-max-tokens")] = 48,
    baseline_requests: Annotated[
        int | None, typer.Option("--baseline-requests", help="Requests per baseline (default: --num-requests).")
    ] = None,
    monolithic: Annotated[bool, typer.Option("--monolithic/--no-monolithic", help="transformers generate().")] = True,
    inprocess: Annotated[bool, typer.Option("--inprocess/--no-inprocess", help="In-process pipeline.")] = True,
    full_payload: Annotated[bool, typer.Option("--full-payload/--no-full-payload", help="full_payload TTFA.")] = True,
    stages: Annotated[bool, typer.Option("--stages/--no-stages", help="Each stage alone (bottleneck).")] = True,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed requests per driver.")] = 1,
    threads: Annotated[int, typer.Option("--threads", help="torch threads in this process.")] = 1,
    request_timeout: Annotated[float, typer.Option("--request-timeout", help="gRPC deadline, seconds.")] = 300.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Every raw figure, ratios, machine.")] = None,
    plot_out: Annotated[Path | None, typer.Option("--plot", help="PNG: latency CDFs, throughput.")] = None,
    markdown_out: Annotated[Path | None, typer.Option("--markdown", help="Short markdown summary.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
) -> None:
    """Latency and throughput of the served pipeline, each figure against a same-run baseline."""
    if ctx.invoked_subcommand is not None:
        return
    from benchmarks.harness import BenchOptions, main, parse_float_list, parse_int_list

    main(
        BenchOptions(
            target=target, serve=serve, config=config, model=model, replicas=replicas,
            concurrency=parse_int_list(concurrency), rates=parse_float_list(rate), num_requests=num_requests,
            time_limit=time_limit or None, prompts=prompts, seed=seed, thinker_max_tokens=thinker_max_tokens,
            talker_max_tokens=talker_max_tokens, baseline_requests=baseline_requests, monolithic=monolithic,
            inprocess=inprocess, full_payload=full_payload, stages=stages, warmup=warmup, threads=threads,
            request_timeout=request_timeout, json_out=json_out, plot_out=plot_out, markdown_out=markdown_out,
            progress=progress,
        )
    )


@bench_app.command("wire")
def bench_wire(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write raw figures and ratios here.")] = None,
) -> None:
    """tensor_blob vs pickle vs torch.save; shared memory vs memcpy; gRPC inline vs shm."""
    from benchmarks.wire import main

    main(json_out)


@bench_app.command("stage-times")
def bench_stage_times(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: built-in tiny).")] = None,
) -> None:
    """Per-stage cost: thinker prefill/decode per token, talker per frame, code2wav per audio second."""
    from benchmarks.stage_times import main

    main(json_out, model)


@bench_app.command("code2wav")
def bench_code2wav(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write raw figures and ratios here.")] = None,
) -> None:
    """Exact incremental streaming vs windowed streaming vs one full decode."""
    from benchmarks.code2wav import main

    main(json_out)


@deploy_app.command("render")
def deploy_render(
    config: Annotated[Path | None, typer.Option("--config", help="Deploy YAML (default: built-in defaults).")] = None,
    target: Annotated[str, typer.Option("--target", help="compose or k8s")] = "k8s",
    out: Annotated[Path, typer.Option("--out", help="Directory to write into.")] = Path("deploy"),
) -> None:
    """Render docker-compose or Kubernetes files from the deploy YAML that `serve` reads."""
    from omnistage.deploy_render import render_to_dir

    for path in render_to_dir(config, target, out):
        typer.echo(str(path))


@app.command("health")
def health(
    target: Annotated[str, typer.Option("--target", help="HOST:PORT of any omnistage service.")] = "127.0.0.1:50051",
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for an answer.")] = 3.0,
) -> None:
    """grpc.health.v1 check (exit 0 when SERVING): the container and probe health check."""
    from omnistage.healthcheck import check

    raise typer.Exit(0 if check(target, timeout) else 1)


def _load_cfg(config: Path | None, overrides: dict[str, object]) -> DeployConfig:
    from services.runtime.config import ConfigError, apply_overrides, load_config

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

    from omnistage.serve import start_stack
    from services.runtime.config import ConfigError, parse_replicas

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
    from omnistage.serve import resolve_model
    from services.runtime.process import run_stage

    if name not in ("thinker", "talker", "code2wav"):
        typer.echo(f"error: unknown stage {name!r}; expected thinker, talker or code2wav", err=True)
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
    from omnistage.loader import open_checkpoint
    from omnistage.serve import resolve_model

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
    import torch

    from gateway.client import generate
    from omnistage.pipeline import write_wav

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
        write_wav(out, torch.from_numpy(reply.pcm.copy()))
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
    import torch

    from omnistage.pipeline import AudioEvent, InProcessPipeline, PipelineRequest, TextEvent, write_wav
    from omnistage.serve import resolve_model
    from services.runtime.config import DeployConfig

    pipe = InProcessPipeline(resolve_model(DeployConfig(), model))
    req = PipelineRequest(pipe.prompt_ids(prompt), pipe.thinker_defaults().with_overrides(max_tokens=64))
    pcm = []
    for ev in pipe.run(req):
        if isinstance(ev, TextEvent):
            typer.echo(ev.text, nl=False)
        elif isinstance(ev, AudioEvent):
            pcm.append(ev.pcm)
    audio = torch.cat(pcm) if pcm else torch.zeros(0)
    write_wav(out, audio)
    typer.echo(f"\nwrote {out} ({audio.shape[0] / 24000:.2f} s at 24 kHz)")


if __name__ == "__main__":
    from omnistage.serve import die_with_parent_if_asked

    die_with_parent_if_asked()
    app()
