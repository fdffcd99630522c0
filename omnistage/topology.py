"""The pipeline's shape as data: which stages exist, in which order, and what runs each one.

`omnistage serve`, every stage process, the deploy config and the deploy renderer read this
one definition; nothing else spells out the chain. A new stage (a prefill/decode split of the
thinker, an encoder) is a new entry here plus its worker module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["EDGES", "PIPELINE", "STAGES", "StageDef", "edge_name", "stage_def"]


@dataclass(frozen=True)
class StageDef:
    name: str  # process, config section, Info role and the tag of its output chunks
    worker: str  # module whose `build_worker(cfg, ckpt)` makes the stage's worker
    default_port: int  # base port of its replicas under `omnistage serve`
    downstream: str | None  # the next stage in the chain, None for the last
    output_unit: str = "tokens"  # what its outputs to the caller count (metrics): tokens, frames, samples
    settings: str = "stage"  # which settings block configures it: "stage" or "code2wav"
    defaults: dict[str, Any] = field(default_factory=dict)  # its settings' defaults besides the port


PIPELINE: tuple[StageDef, ...] = (
    StageDef("thinker", "services.thinker.worker", 7101, "talker", defaults={"cache_capacity_tokens": 65536}),
    StageDef("talker", "services.talker.worker", 7201, "code2wav", output_unit="frames"),
    StageDef("code2wav", "services.code2wav.worker", 7301, None, output_unit="samples", settings="code2wav"),
)

STAGES: tuple[str, ...] = tuple(s.name for s in PIPELINE)


def edge_name(upstream: str, downstream: str) -> str:
    return f"{upstream}_to_{downstream}"


# Edges between stages, each with a mode (async_chunk or full_payload) in the deploy config.
EDGES: tuple[str, ...] = tuple(edge_name(s.name, s.downstream) for s in PIPELINE if s.downstream)


def stage_def(name: str) -> StageDef:
    for s in PIPELINE:
        if s.name == name:
            return s
    raise KeyError(f"unknown stage {name!r}; expected one of {', '.join(STAGES)}")
