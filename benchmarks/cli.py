"""`omnistage bench`: the benchmark commands, registered with the CLI through the
`omnistage.commands` entry point group (pyproject.toml), so the package never imports them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from omnistage.cli import options

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: every figure against a baseline from the same run.")


def _list_option(parse_name: str) -> Callable[[str], str]:
    """A callback for a comma-separated option that `benchmarks.harness.<parse_name>` reads: a
    value it refuses (levels, batches: whole numbers >= 1; rates, seconds: numbers > 0) is a
    usage error naming the option, not a traceback."""

    def check(value: str) -> str:
        from benchmarks import harness

        try:
            getattr(harness, parse_name)(value)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        return value

    return check


_ints = _list_option("parse_int_list")
_floats = _list_option("parse_float_list")


@bench_app.callback(invoke_without_command=True, no_args_is_help=False)
def bench(
    ctx: typer.Context,
    target: Annotated[str | None, typer.Option("--target", help="HOST:PORT of a running gateway.")] = None,
    serve: Annotated[bool, typer.Option("--serve", help="Start a stack (free ports) for the run.")] = False,
    config: Annotated[Path | None, typer.Option("--config", help="Deploy YAML for --serve.")] = None,
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint dir (default: the tiny one).")] = None,
    replicas: Annotated[str | None, typer.Option("--replicas", help="For --serve, e.g. talker=2,code2wav=2.")] = None,
    concurrency: Annotated[str, typer.Option("--concurrency", callback=_ints, help="Closed-loop levels, e.g. "
                                             "1,4,8,16 (default 1,4,8; with a front door: --http, --realtime, "
                                             "--responses, --completions, 1,8).")] = "",
    rate: Annotated[str, typer.Option("--rate", callback=_floats,
                                      help="Poisson arrival rates (req/s), e.g. 2.0 or 1,2. A rate past what "
                                      "the stack takes gets refusals (RESOURCE_EXHAUSTED), failures (exit 1).")] = "",
    num_requests: Annotated[int, typer.Option("--num-requests", min=1, help="Requests per level.")] = 16,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0, help="Seconds per level (0: none).")] = 120.0,
    prompts: Annotated[Path | None, typer.Option("--prompts", help="Prompt file, one per line.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Request order and Poisson arrivals.")] = 0,
    thinker_max_tokens: Annotated[int, typer.Option("--thinker-max-tokens", min=1)] = 24,
    talker_max_tokens: Annotated[int, typer.Option("--talker-max-tokens", min=1)] = 48,
    sampled_speech: Annotated[bool, typer.Option(
        "--sampled-speech", help="The talker samples (its defaults, seed = request index), as an HTTP request's "
        "does; text stays greedy. generate() and the stage baselines are greedy: skipped.")] = False,
    baseline_requests: Annotated[
        int | None, typer.Option("--baseline-requests", min=1, help="Requests per baseline (default: --num-requests).")
    ] = None,
    monolithic: Annotated[bool, typer.Option("--monolithic/--no-monolithic", help="transformers generate().")] = True,
    inprocess: Annotated[bool, typer.Option("--inprocess/--no-inprocess", help="In-process pipeline.")] = True,
    full_payload: Annotated[bool, typer.Option("--full-payload/--no-full-payload", help="full_payload TTFA.")] = True,
    stages: Annotated[bool, typer.Option("--stages/--no-stages", help="Each stage alone (bottleneck).")] = True,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed requests per driver.")] = 1,
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch threads in this process.")] = 1,
    request_timeout: Annotated[float, typer.Option("--request-timeout", min=0.001,
                                                   help="gRPC deadline, seconds.")] = 300.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Every raw figure, ratios, machine.")] = None,
    plot_out: Annotated[Path | None, typer.Option("--plot", help="PNG: latency CDFs, throughput.")] = None,
    markdown_out: Annotated[Path | None, typer.Option("--markdown", help="Short markdown summary.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress")] = True,
    http: Annotated[bool, typer.Option("--http", help="HTTP (OpenAI SSE) against gRPC, same run: median TTFT, "
                                       "TTFA, E2E ratios at each --concurrency (default 1,8).")] = False,
    realtime: Annotated[bool, typer.Option("--realtime", help="The Realtime WebSocket (/v1/realtime) against "
                                           "gRPC, same run, as --http (the talker's limit: the stack's "
                                           "default on both).")] = False,
    responses: Annotated[bool, typer.Option("--responses", help="The Responses API (/v1/responses) against "
                                            "gRPC, same run, as --http, text alone on both (the API has no "
                                            "speech out).")] = False,
    completions: Annotated[bool, typer.Option("--completions", help="The Completions API (/v1/completions) "
                                              "against gRPC, same run, as --http, each prompt raw (no chat "
                                              "template) and text alone on both.")] = False,
    http_target: Annotated[
        str | None, typer.Option("--http-target", help="HOST:PORT of the gateway's HTTP port (with --target).")
    ] = None,
    api_key: Annotated[str, typer.Option("--api-key", envvar="OMNISTAGE_API_KEY", callback=options.api_key,
                                         help="The gateway's API key (with --target).")] = "",
    tls: Annotated[bool, typer.Option("--tls", help="Reach a TLS gateway (with --target), its certificate "
                                      "verified with the default roots (gRPC's; httpx's for --http); --tls-ca "
                                      "names the roots instead.")] = False,
    tls_ca: Annotated[Path | None, typer.Option(
        "--tls-ca", exists=True, dir_okay=False, help="PEM roots: reach a TLS gateway (with --target; --serve "
        "takes its config's tls.ca_file).")] = None,
    server_name: Annotated[str | None, typer.Option(
        "--server-name", help="With --tls or --tls-ca: the name to verify in the gateway's certificate "
        "(tls.server_name).")
    ] = None,
) -> None:
    """Latency and throughput of the served pipeline, each figure against a same-run baseline."""
    if ctx.invoked_subcommand is not None:
        return
    from benchmarks.harness import (
        BenchOptions,
        TargetError,
        check_options,
        failed_levels,
        main,
        parse_float_list,
        parse_int_list,
    )

    opts = (
        BenchOptions(
            target=target, serve=serve, config=config, model=model, replicas=replicas,
            concurrency=parse_int_list(concurrency) or ([1, 8] if http or realtime or responses or completions
                                                        else [1, 4, 8]),
            rates=parse_float_list(rate),
            num_requests=num_requests,
            time_limit=time_limit or None, prompts=prompts, seed=seed, thinker_max_tokens=thinker_max_tokens,
            talker_max_tokens=talker_max_tokens, sampled_speech=sampled_speech, baseline_requests=baseline_requests,
            monolithic=monolithic, inprocess=inprocess, full_payload=full_payload, stages=stages, warmup=warmup,
            threads=threads, request_timeout=request_timeout, json_out=json_out, plot_out=plot_out,
            markdown_out=markdown_out, progress=progress, http=http, realtime=realtime, responses=responses,
            completions=completions,
            http_target=http_target,
            api_key=api_key,
            tls_ca=tls_ca, server_name=server_name, tls=tls,
        )
    )
    try:
        check_options(opts)
    except ValueError as e:  # a usage error, as a bad value of one option is (it was a traceback)
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    from omnistage.cli.main import known_errors

    with known_errors():  # a config or checkpoint no bench stack can run: one line, exit 2
        try:
            result = main(opts)
        except TargetError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None
    failed = failed_levels(result)
    if failed:  # the figures are written; the exit status says they are not a clean measurement
        typer.echo("error: requests failed at " + "; ".join(failed) + ". A level's latency figures cover only "
                   "its requests that succeeded: with failures they are no measurement of it.", err=True)
        raise typer.Exit(1)


@bench_app.command("compare")
def bench_compare(
    configs: Annotated[list[str], typer.Argument(
        help="Deploy YAML files, the first the baseline; FILE@DIR runs the stack from the source tree DIR "
        "(a git worktree of another commit) instead of this one.")],
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Rounds; each starts every file's stack once.")] = 3,
    loads: Annotated[int, typer.Option("--loads", min=1, help="Measured loads per stack start.")] = 2,
    num_requests: Annotated[int, typer.Option("--num-requests", min=1, help="Requests per measured load.")] = 400,
    warmup: Annotated[int, typer.Option("--warmup", min=0,
                                        help="Requests before a stack's first measured load.")] = 400,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, help="Closed-loop concurrency.")] = 16,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0,
                                              help="Seconds per load at most (0: none).")] = 120.0,
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: built-in tiny).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Request order.")] = 0,
    thinker_max_tokens: Annotated[int, typer.Option("--thinker-max-tokens", min=1)] = 24,
    talker_max_tokens: Annotated[int, typer.Option("--talker-max-tokens", min=1)] = 48,
    json_out: Annotated[Path | None, typer.Option("--json", help="Every load's figures and the summary.")] = None,
) -> None:
    """Deploy files (or code: FILE@DIR) against each other in the steady state, their stacks
    alternated (A B, B A, ...) so the machine's drift falls on each alike: req/s, TTFA, E2E, and
    per process CPU and gRPC messages per request and mean batch; medians, spreads, ratios to the
    first."""
    from benchmarks.compare import BadArguments, CompareOptions, main

    specs = [spec.partition("@") for spec in configs]
    opts = CompareOptions(configs=[Path(c) for c, _, _ in specs],
                          checkouts=[Path(t) if sep else None for _, sep, t in specs], rounds=rounds, loads=loads,
                          num_requests=num_requests, warmup=warmup, concurrency=concurrency,
                          time_limit=time_limit or None, model=model, seed=seed,
                          thinker_max_tokens=thinker_max_tokens, talker_max_tokens=talker_max_tokens,
                          json_out=json_out)  # fmt: skip
    try:
        main(opts)
    except BadArguments as e:  # found before any stack starts
        raise typer.BadParameter(str(e)) from None


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


@bench_app.command("trace")
def bench_trace(
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for the Chrome traces and summaries.")] = Path("trace"),
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: built-in tiny).")] = None,
    batching: Annotated[str, typer.Option("--batching", help="exact, fast or both.")] = "both",
    requests: Annotated[int, typer.Option("--requests", min=1, help="Requests profiled (after one warm-up).")] = 2,
    dtype: Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16, every stage.")] = "float32",
) -> None:
    """CUDA only: the in-process pipeline under torch's profiler; each host<->device copy by kind
    and stream, and how much of it overlaps kernels on other streams."""
    from benchmarks.cuda_trace import measure

    for mode in ("exact", "fast") if batching == "both" else (batching,):
        summary = measure(model, out_dir, mode, requests, dtype)
        for row in summary["copies"]:
            typer.echo(f"{mode}: {row['kind']} stream {row['stream']}: {row['count']} copies, {row['us']:.0f} us, "
                       f"{100 * row['overlapped_fraction']:.0f} % under kernels on other streams")


@bench_app.command("code2wav")
def bench_code2wav(
    json_out: Annotated[Path | None, typer.Option("--json", help="Write raw figures and ratios here.")] = None,
) -> None:
    """Exact incremental streaming vs windowed streaming vs one full decode."""
    from benchmarks.code2wav import main

    main(json_out)


@bench_app.command("relay")
def bench_relay(
    target: Annotated[str, typer.Option("--target", help="Gateway HOST:PORT.")] = "127.0.0.1:50051",
    thinker: Annotated[str, typer.Option("--thinker", help="Thinker HOST:PORT (its Info is read).")] = "127.0.0.1:7101",
    requests: Annotated[int, typer.Option("--requests", min=1, help="Requests per level.")] = 48,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, help="Closed-loop concurrency.")] = 16,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """The thinker's mean step time with audio relayed through it vs text only, same load."""
    from benchmarks.relay import main

    main(target, thinker, requests, concurrency, json_out)


@bench_app.command("grpc-floor")
def bench_grpc_floor(
    messages: Annotated[int, typer.Option("--messages", min=1, max=200_000,
                                          help="Messages per run (at most 200000).")] = 20_000,
    payload: Annotated[int, typer.Option("--payload", min=1, help="Bytes per message (a token chunk: ~600).")] = 600,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Runs; the median is printed.")] = 3,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """CPU per streamed message of grpc.aio on loopback, client and server: the floor under every
    token, frame and audio chunk a stage sends or relays."""
    from benchmarks.grpc_floor import main

    main(messages, payload, repeats, json_out)


@bench_app.command("handoff")
def bench_handoff(
    batches: Annotated[str, typer.Option("--batches", callback=_ints,
                                         help="Outputs per step, comma-separated.")] = "1,4,16",
    steps: Annotated[int, typer.Option("--steps", min=1, max=100_000, help="Steps per run (at most 100000).")] = 2000,
    work_us: Annotated[float, typer.Option("--work-us", min=0,
                                           help="Microseconds of GIL-holding work between steps.")] = 2000,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """What handing a step's outputs to the event loop costs the engine thread: one
    call_soon_threadsafe per output against one wake-up per step (omnistage/server/handoff.py)."""
    from benchmarks.handoff import main
    from benchmarks.harness import parse_int_list

    main(parse_int_list(batches), steps, work_us, json_out)


@bench_app.command("load")
def bench_load(
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: a synthetic large one).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """Peak RSS of loading each stage's part alone against loading the whole model."""
    from benchmarks.load_rss import main

    main(model, json_out)


@bench_app.command("audio-in")
def bench_audio_in(
    target: Annotated[
        str | None, typer.Option("--target", help="HOST:PORT of a running gateway (default: start a stack).")
    ] = None,
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: built-in tiny).")] = None,
    clips: Annotated[str, typer.Option("--clips", callback=_floats, help="Clip lengths in seconds.")] = "2,10",
    requests: Annotated[int, typer.Option("--requests", min=1, help="Served requests per level.")] = 8,
    concurrency: Annotated[str, typer.Option("--concurrency", callback=_ints, help="Closed-loop levels.")] = "1,4",
    baseline_requests: Annotated[int, typer.Option("--baseline-requests", min=1, help="generate() runs per clip.")] = 3,
    thinker_max_tokens: Annotated[int, typer.Option("--thinker-max-tokens", min=1)] = 24,
    talker_max_tokens: Annotated[int, typer.Option("--talker-max-tokens", min=1)] = 48,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """TTFT and TTFA with an audio clip in, against monolithic generate() on the same inputs."""
    from benchmarks.audio_in import main
    from benchmarks.harness import parse_float_list, parse_int_list

    main(target, model, parse_float_list(clips), requests, parse_int_list(concurrency), baseline_requests,
         thinker_max_tokens, talker_max_tokens, json_out)  # fmt: skip


@bench_app.command("conversation")
def bench_conversation(
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: built-in tiny).")] = None,
    conversations: Annotated[int, typer.Option("--conversations", min=1, max=100,
                                               help="Conversations per stack.")] = 5,
    turns: Annotated[int, typer.Option("--turns", min=1, max=50, help="Spoken turns per conversation.")] = 8,
    clip_seconds: Annotated[float, typer.Option("--clip-seconds", min=0.5, max=30.0,
                                                help="Seconds of each turn's clip.")] = 3.0,
    clip_spread: Annotated[float, typer.Option("--clip-spread", min=0.0, max=0.8,
                                               help="Each clip's length drawn from seconds x (1 +- spread).")] = 0.0,
    thinker_max_tokens: Annotated[int, typer.Option("--thinker-max-tokens", min=1, max=512)] = 16,
    talker_max_tokens: Annotated[int, typer.Option("--talker-max-tokens", min=1, max=2048)] = 32,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """Each turn's TTFT and TTFA as a spoken conversation grows: nothing kept across requests,
    decoded media kept, and media and the thinker's prefixes kept (three stacks of a small
    checkpoint, alternating)."""
    from benchmarks.conversation import main

    main(model, conversations, turns, clip_seconds, thinker_max_tokens, talker_max_tokens, json_out, clip_spread)


@bench_app.command("truncation")
def bench_truncation(
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: built-in tiny).")] = None,
    sessions: Annotated[int, typer.Option("--sessions", min=1, max=20, help="Sessions per setting.")] = 2,
    turns: Annotated[int, typer.Option("--turns", min=2, max=100, help="Typed turns per session.")] = 24,
    words: Annotated[int, typer.Option("--words", min=1, max=500, help="Words in each turn.")] = 30,
    max_model_len: Annotated[int, typer.Option("--max-model-len", min=64,
                                               help="The stack's max_model_len (what the sessions pass).")] = 1024,
    ratio: Annotated[float, typer.Option("--ratio", min=0.0, max=1.0, help="The retention_ratio compared.")] = 0.5,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """A Realtime session past the model's length: TTFT and the prefix cache's share of the prompts
    with truncation "auto" and with a retention_ratio (one stack, sessions alternating)."""
    from benchmarks.truncation import main

    main(model, sessions, turns, words, max_model_len, ratio, json_out)


@bench_app.command("faults")
def bench_faults(
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: built-in tiny).")] = None,
    malformed: Annotated[int, typer.Option("--malformed", min=0, help="Malformed calls per stage.")] = 10_000,
    cancels: Annotated[int, typer.Option("--cancels", min=0, help="Requests cancelled at random points.")] = 1_000,
    kill_requests: Annotated[int, typer.Option("--kill-requests", min=0, help="Requests of the kill run (c=8).")] = 64,
    soak_requests: Annotated[int, typer.Option("--soak-requests", min=0, help="Requests of the soak (c=16).")] = 2_000,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0, help="Seconds per load phase at most.")] = 3600.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """Malformed messages per stage, cancels at random points, one replica of each stage killed
    under load, a soak: statuses, times back to baseline, failures, RSS growth."""
    from benchmarks.faults import main

    main(model, malformed, cancels, kill_requests, soak_requests, time_limit, json_out)


@bench_app.command("routing")
def bench_routing(
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: built-in tiny).")] = None,
    requests: Annotated[int, typer.Option("--requests", min=1, help="Requests per policy.")] = 48,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, help="Closed-loop concurrency.")] = 8,
    short_frames: Annotated[int, typer.Option("--short-frames", min=1, help="Talker frames of a short request.")] = 8,
    long_frames: Annotated[int, typer.Option("--long-frames", min=1, help="Talker frames of a long request.")] = 96,
    long_share: Annotated[float, typer.Option("--long-share", min=0, max=1, help="Fraction of long requests.")] = 0.25,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0, help="Seconds per policy at most.")] = 600.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """round_robin vs least_outstanding routing, two talker replicas, short and long requests mixed."""
    from benchmarks.routing import main

    main(model, requests, concurrency, short_frames, long_frames, long_share, time_limit, json_out)


@bench_app.command("pd")
def bench_pd(
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: built-in tiny).")] = None,
    tokens: Annotated[int, typer.Option("--tokens", min=1,
                                        help="Prompt tokens of the KV transfer and long requests.")] = 1500,
    chunk: Annotated[int, typer.Option("--chunk", min=1, help="Prompt tokens per KV chunk (prefill step).")] = 512,
    shorts: Annotated[int, typer.Option("--shorts", min=1, help="Short requests of the mixed load.")] = 48,
    rate: Annotated[float, typer.Option("--rate", min=0.001, help="Short requests per second.")] = 2.0,
    long_every: Annotated[int, typer.Option("--long-every", min=1, help="One long-prompt request per N short.")] = 4,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """Prefill/decode disaggregation: KV transfer rates (inline gRPC, shared memory, memcpy) and
    short requests' time between tokens and TTFA under long prompts, colocated vs split thinker."""
    from benchmarks.pd import main

    main(model, tokens, chunk, shorts, rate, long_every, json_out)


@bench_app.command("batching")
def bench_batching(
    model: Annotated[Path | None, typer.Option("--model", help="Checkpoint (default: built-in tiny).")] = None,
    requests: Annotated[int, typer.Option("--requests", min=1, help="Requests of the bench mix.")] = 32,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Requests stepped together.")] = 16,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Thinker tokens per request.")] = 24,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the figures here.")] = None,
) -> None:
    """Fast batching against exact on the bench mix: identical greedy ids, first divergence,
    max |Δ logits| (the thinker; `omnistage bench --serve` with fast stages adds the talker's)."""
    from benchmarks.batching import main

    main(model, requests, batch, max_tokens, json_out)
