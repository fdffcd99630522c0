"""What each edge of the pipeline carries: the one place for tensor names, meta keys and the
checks a receiver makes (errors name the stage and the field: INVALID_ARGUMENT).

    gateway  -> thinker   Prompt        ids [L] (int)
    thinker  -> caller    Text          ids [n]; the last chunk is finished and says why
    thinker  -> talker    ThinkerPrompt prompt_ids [L], prompt_embed [L, H], prompt_hidden [L, H]
                                        (the accept-layer states, sent only when the prompt has
                                        audio/image/video placeholders)
                          Tokens        ids [n], embed [n, H] per generated token; the chunk
                                        holding the thinker's last token is finished (or an
                                        empty finished chunk follows)
    talker   -> code2wav  Frames        codes [G, n]; then an empty finished chunk
    talker   -> caller    Frames        the same chunks, and the finished one says why
    code2wav -> caller    Audio         audio [samples] float32, meta sample_rate; then finished

Offsets count the stream's own positions: prompt tokens (0 for the prompt), generated tokens,
frames, samples. A chunk's length (wire meta) is how many positions it advances.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from omnistage.engine import OutChunk
from omnistage.models import SamplingParams
from omnistage.v1 import stage_pb2
from omnistage.wire import DecodedChunk, invalid

# tensor names
IDS = "ids"
EMBED = "embed"
PROMPT_IDS = "prompt_ids"
PROMPT_EMBED = "prompt_embed"
PROMPT_HIDDEN = "prompt_hidden"
CODES = "codes"
AUDIO = "audio"
# meta keys
FINISH_REASON = "finish_reason"  # on a finished chunk to the caller: "stop_id", "max_tokens", ...
SAMPLE_RATE = "sample_rate"

INT_DTYPES = (torch.int64, torch.int32)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- checks -------------------------------------------------------------------------------------


def check_names(stage: str, chunk: DecodedChunk, required: set[str], optional: set[str] = frozenset()) -> None:
    names = set(chunk.tensors)
    problems = []
    if required - names:
        problems.append(f"missing tensor(s) {sorted(required - names)}")
    if names - required - optional:
        problems.append(f"unexpected tensor(s) {sorted(names - required - optional)}")
    if problems:
        expected = sorted(required | optional)
        raise invalid(f"{stage}: chunk at offset {chunk.offset}: {', '.join(problems)}; expected {expected}")


def tensor(
    stage: str, chunk: DecodedChunk, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int | None, ...]
) -> torch.Tensor:
    """The named tensor, checked against dtypes and a shape pattern (None = any size)."""
    t = chunk.tensors[name]
    if t.dtype not in dtypes:
        raise invalid(f"{stage}: tensor '{name}' has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True)):
        pattern = ["*" if s is None else s for s in shape]
        raise invalid(f"{stage}: tensor '{name}' has shape {list(t.shape)}; expected {pattern}")
    return t


def _check_length(stage: str, chunk: DecodedChunk, n: int, what: str) -> None:
    if chunk.length != n:
        raise invalid(f"{stage}: chunk length {chunk.length} disagrees with its {n} {what}")


def end_chunk(offset: int, reason: str = "") -> OutChunk:
    """An empty finished chunk: the sender has nothing more (`reason` for the caller)."""
    return OutChunk({}, offset=offset, finished=True, meta={FINISH_REASON: reason} if reason else {})


def is_end(chunk: DecodedChunk) -> bool:
    return chunk.finished and not chunk.tensors


# ---- gateway -> thinker ----------------------------------------------------------------------------


def prompt_chunk(ids: list[int]) -> OutChunk:
    return OutChunk({IDS: torch.tensor(ids, dtype=torch.long)}, offset=0, length=len(ids), finished=True)


def read_prompt(stage: str, chunk: DecodedChunk) -> list[int]:
    check_names(stage, chunk, {IDS})
    ids = tensor(stage, chunk, IDS, INT_DTYPES, (None,))
    _check_length(stage, chunk, int(ids.shape[0]), "prompt ids")
    return [int(i) for i in ids.tolist()]


# ---- thinker -> caller, thinker -> talker --------------------------------------------------------


def text_chunk(offset: int, token_id: int, finish_reason: str | None) -> OutChunk:
    meta = {FINISH_REASON: finish_reason} if finish_reason else {}
    return OutChunk({IDS: torch.tensor([token_id])}, offset=offset, length=1, finished=bool(finish_reason), meta=meta)


def thinker_prompt_chunk(ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor | None) -> OutChunk:
    tensors = {PROMPT_IDS: ids, PROMPT_EMBED: embeds}
    if hidden is not None:
        tensors[PROMPT_HIDDEN] = hidden
    return OutChunk(tensors, offset=0, length=0)


def read_thinker_prompt(
    stage: str, chunk: DecodedChunk, hidden_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(ids [L], embeds [L, H], hidden [L, H] or None), copied out of the received bytes."""
    check_names(stage, chunk, {PROMPT_IDS, PROMPT_EMBED}, {PROMPT_HIDDEN})
    ids = tensor(stage, chunk, PROMPT_IDS, INT_DTYPES, (None,)).long()
    n = int(ids.shape[0])
    embeds = tensor(stage, chunk, PROMPT_EMBED, FLOAT_DTYPES, (n, hidden_size))
    hidden = None
    if PROMPT_HIDDEN in chunk.tensors:
        hidden = tensor(stage, chunk, PROMPT_HIDDEN, FLOAT_DTYPES, (n, hidden_size)).clone()
    _check_length(stage, chunk, 0, "stream positions (a prompt advances none)")
    return ids.clone(), embeds.clone(), hidden


def token_chunk(offset: int, token_id: int, embed: torch.Tensor, finished: bool) -> OutChunk:
    return OutChunk(
        {IDS: torch.tensor([token_id]), EMBED: embed.reshape(1, -1)}, offset=offset, length=1, finished=finished
    )


def read_tokens(stage: str, chunk: DecodedChunk, hidden_size: int) -> list[torch.Tensor]:
    """Each token's embedding `[H]` (copied), in order."""
    check_names(stage, chunk, {IDS, EMBED})
    ids = tensor(stage, chunk, IDS, INT_DTYPES, (None,))
    n = int(ids.shape[0])
    embed = tensor(stage, chunk, EMBED, FLOAT_DTYPES, (n, hidden_size))
    _check_length(stage, chunk, n, "tokens")
    return [embed[i].clone() for i in range(n)]


# ---- talker -> code2wav, talker -> caller ----------------------------------------------------------


def frames_chunk(offset: int, codes: torch.Tensor) -> OutChunk:
    """`codes`: `[G, n]` frames."""
    return OutChunk({CODES: codes}, offset=offset, length=int(codes.shape[1]))


def read_frames(stage: str, chunk: DecodedChunk, groups: int) -> torch.Tensor:
    check_names(stage, chunk, {CODES})
    codes = tensor(stage, chunk, CODES, INT_DTYPES, (groups, None)).long()
    _check_length(stage, chunk, int(codes.shape[1]), "frames")
    return codes


# ---- code2wav -> caller -----------------------------------------------------------------------------


def audio_chunk(offset: int, pcm: torch.Tensor, sample_rate: int) -> OutChunk:
    return OutChunk({AUDIO: pcm}, offset=offset, length=int(pcm.shape[0]), meta={SAMPLE_RATE: sample_rate})


# ---- the Start message -------------------------------------------------------------------------------

_SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "max_tokens")


def sampling(stage: str, start: stage_pb2.Start, defaults: SamplingParams) -> SamplingParams:
    """The stage's sampling from `Start.sampling[stage]` (unset fields keep `defaults`)."""
    msg = start.sampling.get(stage)
    if msg is None:
        return defaults
    overrides: dict[str, Any] = {f: getattr(msg, f) for f in _SAMPLING_FIELDS if msg.HasField(f)}
    if msg.stop_ids:  # replaces the stage's default stop ids, as generate()'s *_eos_token_id does
        overrides["stop_ids"] = tuple(int(i) for i in msg.stop_ids)
    try:
        return defaults.with_overrides(**overrides)
    except ValueError as e:
        raise invalid(f"{stage}: sampling: {e}") from None


def downstream_start(start: stage_pb2.Start, edge_mode: int) -> stage_pb2.Start:
    """The Start a stage sends downstream: its own, with the edge's mode unless the request
    asked for full_payload itself."""
    out = stage_pb2.Start()
    out.CopyFrom(start)
    if start.mode != stage_pb2.FULL_PAYLOAD:
        out.mode = edge_mode  # type: ignore[assignment]
    return out


def edge_mode(name: str) -> int:
    """A config edge mode name -> the proto enum value."""
    return {"async_chunk": stage_pb2.ASYNC_CHUNK, "full_payload": stage_pb2.FULL_PAYLOAD}[name]


def meta_str(meta: Mapping[str, Any], key: str) -> str:
    value = meta.get(key, "")
    return value if isinstance(value, str) else ""


def sampling_proto(params: SamplingParams) -> stage_pb2.SamplingParams:
    """`SamplingParams` as the proto message a Start carries (every field set)."""
    msg = stage_pb2.SamplingParams(stop_ids=list(params.stop_ids))
    for f in _SAMPLING_FIELDS:
        value = getattr(params, f)
        if value is not None:
            setattr(msg, f, value)
    return msg
