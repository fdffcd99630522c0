"""SamplingParams <-> the `omnistage.v1.SamplingParams` message (unset fields keep defaults)."""

from __future__ import annotations

from omnistage.v1 import stage_pb2
from services.runtime.engine import invalid
from services.runtime.sampling import SamplingParams

_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "max_tokens")


def from_proto(stage: str, msg: stage_pb2.SamplingParams | None, defaults: SamplingParams) -> SamplingParams:
    if msg is None:
        return defaults
    overrides = {f: getattr(msg, f) for f in _FIELDS if msg.HasField(f)}
    if msg.stop_ids:  # replaces the stage's default stop ids, as generate()'s *_eos_token_id does
        overrides["stop_ids"] = tuple(int(i) for i in msg.stop_ids)
    try:
        return defaults.with_overrides(**overrides)
    except ValueError as e:
        raise invalid(f"{stage}: sampling: {e}") from None


def to_proto(params: dict[str, object]) -> stage_pb2.SamplingParams:
    msg = stage_pb2.SamplingParams()
    for key, value in params.items():
        if value is None:
            continue
        if key == "stop_ids":
            msg.stop_ids.extend(int(i) for i in value)  # type: ignore[attr-defined]
        else:
            setattr(msg, key, value)
    return msg
