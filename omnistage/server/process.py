"""Entry point of one stage process (`omnistage stage NAME ...`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from importlib import import_module
from pathlib import Path

import torch

from omnistage.config import ConfigError, DeployConfig
from omnistage.engine import Engine
from omnistage.models import open_checkpoint
from omnistage.models.onednn import widen_primitive_cache
from omnistage.server.metrics import StageMetrics, serve_metrics
from omnistage.server.stage_server import StageServer, StageService
from omnistage.topology import stage_def, stages_below
from services.edges import edge_mode

log = logging.getLogger(__name__)


ENGINE_DEAD_EXIT = 70  # (EX_SOFTWARE) the engine thread failed: the process exits for `serve` to restart it


def _exit_engine_dead(exc: BaseException) -> None:
    """The engine thread failed (logged): end the process at once, as a crash would, so its calls
    fail UNAVAILABLE and their callers replay them on another replica, and the supervisor
    (`serve`, Kubernetes) starts a new one. Not a drain: no request here can finish."""
    for flush in [h.flush for h in logging.getLogger().handlers] + [sys.stdout.flush, sys.stderr.flush]:
        with contextlib.suppress(OSError, ValueError):
            flush()
    os._exit(ENGINE_DEAD_EXIT)


def run_stage(name: str, cfg: DeployConfig, model_dir: Path, host: str, port: int, downstream: str | None) -> None:
    definition = stage_def(name)
    if name not in cfg.stage_names():
        raise ConfigError(f"{name}: not a stage of this deploy config's chain ({', '.join(cfg.stage_names())})")
    below = cfg.downstream(name)
    if below is not None and not downstream:
        raise ConfigError(f"{name}: --downstream TARGET is required (the {below} stage)")
    stage_cfg = cfg.stage(name)
    torch.set_num_threads(stage_cfg.threads)
    widen_primitive_cache()  # before any convolution runs here
    ckpt = open_checkpoint(model_dir)
    ckpt.check_serves(cfg.audio_output)
    worker = import_module(definition.worker).build_worker(cfg, ckpt)
    metrics: StageMetrics | None = None
    engine = Engine(
        worker,
        cfg.timeouts.input_wait_timeout_s,
        **stage_cfg.engine_limits(),
        output_stall_timeout_s=cfg.timeouts.output_stall_timeout_s,
        on_dead=_exit_engine_dead,
    )
    service = StageService(
        engine,
        model_name=cfg.served_model_name or ckpt.name,
        arch=(ckpt.config.architectures or [ckpt.family.display_name])[0],
        device=stage_cfg.device,
        dtype=ckpt.resolve_dtype(stage_cfg.dtype),
        downstream=downstream,
        downstream_name=below,
        edge_mode=edge_mode(cfg.edge_mode(name, below)) if below else 0,
        max_message_bytes=cfg.max_message_bytes,
        shm=cfg.shm,
        replay_budget_bytes=cfg.failover.replay_budget_bytes,
        replay_memory_bytes=cfg.failover.replay_memory_bytes,
        failover_attempts=cfg.failover.attempts,
        replica_wait_s=cfg.failover.replica_wait_s,
        routing=cfg.routing,
        tls=cfg.tls,
        below=stages_below(name, cfg.stage_names()),
        keepalive_s=cfg.timeouts.keepalive_s,
    )
    server = StageServer(service, host, port, cfg.timeouts.drain_grace_s)
    metrics_port = cfg.metrics_port(port)
    if metrics_port is not None:
        metrics = StageMetrics(name, definition.output_unit, engine.load, lambda: service.pool.num_segments,
                               lambda: service.requests_total, lambda: service.pool.inline_fallbacks,
                               lambda: service.replay_memory.held, lambda: service.replay_memory.refusals,
                               lambda: service.messages_sent, lambda: service.messages_received,
                               lambda: service.open_streams, service.downstream_replicas_out)  # fmt: skip
        engine.observer = metrics

    async def main() -> None:
        # metrics first: a taken metrics port then fails the start before any gRPC server exists
        # (started, it was left unstopped: the exit printed asyncio noise, not the reason)
        if metrics is not None and metrics_port is not None:
            serve_metrics(metrics.registry, host, metrics_port, f"{name} at {host}:{port}")
        bound = await server.start()
        log.info("%s serving on %s:%d (metrics on %s)", name, host, bound, metrics_port or "off")
        await server.serve_forever()

    asyncio.run(main())
