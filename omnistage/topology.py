"""The pipeline's shape as data: which stages exist, in which order, and what runs each one.

`omnistage serve`, every stage process, the deploy config and the deploy renderer read this
one definition; nothing else spells out the chain. A new stage (a prefill/decode split of the
thinker, an encoder) is a new entry here plus its worker module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DISAGGREGATED",
    "EDGES",
    "PIPELINE",
    "PROCESSES",
    "STAGES",
    "StageDef",
    "edge_name",
    "pipeline",
    "stage_def",
    "stages_below",
]


@dataclass(frozen=True)
class StageDef:
    name: str  # process and Info role; for a model part also its config section and stream tag
    worker: str  # module whose `build_worker(cfg, ckpt)` makes the stage's worker
    default_port: int  # base port of its replicas under `omnistage serve`
    downstream: str | None  # the next stage in the chain, None for the last
    output_unit: str = "tokens"  # what its outputs to the caller count (metrics): tokens, frames, samples
    settings: str = "stage"  # which settings block configures it: "stage", "thinker", "talker" or "code2wav"
    defaults: dict[str, Any] = field(default_factory=dict)  # its settings' defaults besides the port
    part: str = ""  # the model part it runs, when a role of one (thinker-prefill: thinker)

    @property
    def stream(self) -> str:
        """The tag of its output chunks and the key of its sampling: the model part it runs."""
        return self.part or self.name


PIPELINE: tuple[StageDef, ...] = (
    StageDef(
        "thinker",
        "services.thinker.worker",
        7101,
        "talker",
        settings="thinker",
        defaults={"cache_capacity_tokens": 65536},
    ),
    StageDef("talker", "services.talker.worker", 7201, "code2wav", output_unit="frames", settings="talker"),
    StageDef("code2wav", "services.code2wav.worker", 7301, None, output_unit="samples", settings="code2wav"),
)

# The model parts; also the stream tags of their outputs and the keys of Start.sampling.
STAGES: tuple[str, ...] = tuple(s.name for s in PIPELINE)

# The thinker split into a prefill and a decode role (deploy config `thinker.disaggregated`): the
# prefill role streams each request's KV cache to the decode role, which goes on as the thinker.
DISAGGREGATED: tuple[StageDef, ...] = (
    StageDef("thinker-prefill", "services.thinker.prefill", 7101, "thinker-decode", part="thinker",
             defaults={"cache_capacity_tokens": 65536}),
    StageDef("thinker-decode", "services.thinker.decode", 7151, "talker", part="thinker",
             defaults={"cache_capacity_tokens": 65536}),
    *PIPELINE[1:],
)  # fmt: skip

# Every kind of stage process.
PROCESSES: tuple[str, ...] = tuple(dict.fromkeys(s.name for s in (*PIPELINE, *DISAGGREGATED)))


def pipeline(disaggregated: bool = False) -> tuple[StageDef, ...]:
    """The chain of stage processes, first (the gateway's downstream) to last."""
    return DISAGGREGATED if disaggregated else PIPELINE


def edge_name(upstream: str, downstream: str) -> str:
    return f"{upstream}_to_{downstream}"


# Edges between stages, each with a mode (async_chunk or full_payload) in the deploy config.
EDGES: tuple[str, ...] = tuple(edge_name(s.name, s.downstream) for s in PIPELINE if s.downstream)


def stages_below(name: str, chain: tuple[str, ...] = STAGES) -> tuple[str, ...]:
    """The stage processes after `name` in `chain` (none for a name not in it)."""
    return chain[chain.index(name) + 1 :] if name in chain else ()


def stage_def(name: str) -> StageDef:
    for s in (*PIPELINE, *DISAGGREGATED):
        if s.name == name:
            return s
    raise KeyError(f"unknown stage {name!r}; expected one of {', '.join(PROCESSES)}")
