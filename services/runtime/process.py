"""Entry point of one stage process (`omnistage stage NAME ...`)."""

from __future__ import annotations

import asyncio
import logging
from importlib import import_module
from pathlib import Path

import torch

from omnistage.loader import open_checkpoint
from services.runtime.config import DeployConfig, StageName
from services.runtime.engine import Engine
from services.runtime.metrics import start_metrics_server
from services.runtime.server import StageServer, StageService

DOWNSTREAM_OF: dict[str, str | None] = {"thinker": "talker", "talker": "code2wav", "code2wav": None}


def run_stage(
    name: StageName, cfg: DeployConfig, model_dir: Path, host: str, port: int, downstream: str | None
) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name}:{port} %(levelname)s %(message)s")
    stage_cfg = cfg.stage(name)
    torch.set_num_threads(stage_cfg.threads)
    if DOWNSTREAM_OF[name] is not None and not downstream:
        raise SystemExit(f"{name}: --downstream TARGET is required (the {DOWNSTREAM_OF[name]} stage)")
    ckpt = open_checkpoint(model_dir)
    worker = import_module(f"services.{name}.service").build_worker(cfg, ckpt)
    engine = Engine(
        worker,
        cfg.timeouts.input_wait_timeout_s,
        max_num_seqs=stage_cfg.max_num_seqs,
        max_num_batched_tokens=stage_cfg.max_num_batched_tokens,
        cache_capacity_tokens=stage_cfg.cache_capacity_tokens,
        chunked_prefill=stage_cfg.chunked_prefill,
    )
    service = StageService(
        engine,
        model_name=str(model_dir),
        arch=(ckpt.config.architectures or ["Qwen3OmniMoeForConditionalGeneration"])[0],
        device=stage_cfg.device,
        dtype=stage_cfg.dtype,
        downstream=downstream,
        downstream_name=DOWNSTREAM_OF[name],
        max_message_bytes=cfg.max_message_bytes,
        shm=cfg.shm,
    )
    server = StageServer(service, host, port, cfg.timeouts.drain_grace_s)
    start_metrics_server(name, engine.load)

    async def main() -> None:
        bound = await server.start()
        logging.getLogger(__name__).info("%s serving on %s:%d", name, host, bound)
        await server.serve_forever()

    asyncio.run(main())
