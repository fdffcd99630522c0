"""The `omnistage` command line. Each command imports its implementation lazily so that
`omnistage --help` stays fast and a broken optional piece cannot break the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Staged serving for speech-output omni models.")
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


if __name__ == "__main__":
    app()
