"""The `omnistage` command line. Each command imports its implementation lazily so that
`omnistage --help` stays fast and a broken optional piece cannot break the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

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


@bench_app.command("wire")
def bench_wire(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write raw figures and ratios here.")] = None,
) -> None:
    """tensor_blob vs pickle vs torch.save; shared memory vs memcpy; gRPC inline vs shm."""
    from benchmarks.wire import main

    main(json_out)


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


if __name__ == "__main__":
    app()
