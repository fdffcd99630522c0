"""What each edge of the pipeline carries: the one place for tensor names, meta keys and the
checks a receiver makes (errors name the stage and the field: INVALID_ARGUMENT).

    gateway  -> thinker   Prompt        ids [L] (int); with audio, image or video the processor's
                                        tensors under transformers' names (MULTIMODAL: input_features,
                                        feature_attention_mask, pixel_values, image_grid_thw, ...)
                                        and meta use_audio_in_video; split over several messages
                                        when large
    thinker  -> caller    Text          ids [n]; the last chunk is finished and says why
    thinker-prefill       KV            per prompt chunk, per layer i: k.i and v.i [1, heads, n,
      -> thinker-decode                 dim] (the cache dtype) of positions [offset, offset + n);
                                        the first (offset 0) has meta KV_CHECKS: what both roles
                                        must agree on, and prompt_tokens
                          Handoff       at offset L, finished: prompt_ids [L], first_id [1],
                                        first_embed [1, H], last_position [4, 1, 1], generator_state
                                        (uint8, when sampling), meta stopped_on; with audio out
                                        also the ThinkerPrompt tensors for the talker
    thinker-decode -> caller            Text from the second token on (the prefill sends the first)
    thinker  -> talker    ThinkerPrompt prompt_ids [L], prompt_embed [L, H], prompt_hidden [L, H]
                                        (the accept-layer states, sent only when the prompt has
                                        audio/image/video placeholders), and the items' sizes the
                                        talker's positions need (ROPE: audio_lengths [A],
                                        image_grid_thw [I, 3], video_grid_thw [V, 3],
                                        video_second_per_grid [V])
                          Tokens        ids [n], embed [n, H] per generated token; the chunk
                                        holding the thinker's last token is finished (the talker
                                        turns that token into tts_eos, so an empty finished chunk
                                        after it is refused)
    talker   -> code2wav  Frames        codes [G, n], meta decode_now when the talker cut the chunk
                                        short of the schedule (an idle pipeline's first chunk);
                                        then an empty finished chunk
    talker   -> caller    Frames        the same chunks, and the finished one says why
    code2wav -> caller    Audio         audio [samples] float32, meta sample_rate; then finished

Offsets count the stream's own positions: prompt tokens (0 for the prompt), generated tokens,
frames, samples. A chunk's length (wire meta) is how many positions it advances.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.engine import OutChunk
from omnistage.models import SamplingParams
from omnistage.models.prefix_cache import DIGEST_BYTES
from omnistage.models.sampling import TokenLogprobs, greedy_temperature
from omnistage.models.text_stream import check_stop_texts
from omnistage.topology import STAGES
from omnistage.v1 import stage_pb2
from omnistage.wire import Code, DecodedChunk, StageError, invalid

# tensor names
IDS = "ids"
EMBED = "embed"
HIDDEN = "hidden"  # a token's hidden state, for a talker that reads it (spec.talker_needs_hidden)
PROMPT_IDS = "prompt_ids"
PROMPT_EMBED = "prompt_embed"
PROMPT_HIDDEN = "prompt_hidden"
CODES = "codes"
AUDIO = "audio"
# beside a text chunk's ids, where the request asks for them: each token's log-probability [n],
# and the most likely ids at its position [k, n] with theirs [k, n] (positions on the last axis, as
# wire/resume.py cuts a replayed chunk)
LOGPROB = "logprob"
TOP_IDS = "top_ids"
TOP_LOGPROBS = "top_logprobs"
# the processor's model inputs besides the ids (transformers' names, shared by the omni families)
MULTIMODAL = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw", "pixel_values_videos",
              "video_grid_thw", "video_second_per_grid")  # fmt: skip
# a digest of each of their items [items, 32] uint8, beside them where the thinker keeps prefixes
MEDIA_DIGESTS = "media_digests"
# the large float tensors among them, which only the thinker's encoders read (on its device)
MEDIA_FEATURES = frozenset({"input_features", "pixel_values", "pixel_values_videos"})
ROPE = ("audio_lengths", "image_grid_thw", "video_grid_thw", "video_second_per_grid")
# meta keys
FINISH_REASON = "finish_reason"  # on a finished chunk to the caller: "stop_id", "max_tokens", ...
SAMPLE_RATE = "sample_rate"
USE_AUDIO_IN_VIDEO = "use_audio_in_video"
DECODE_NOW = "decode_now"  # on a Frames chunk cut short of code2wav's schedule: decode what is final at once

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


def meta_flag(stage: str, chunk: DecodedChunk, key: str) -> bool:
    """A bool meta key (absent: False)."""
    flag = chunk.meta.get(key, False)
    if not isinstance(flag, bool):
        raise invalid(f"{stage}: meta {key!r} must be a bool, got {flag!r}")
    return flag


def tensor(
    stage: str, chunk: DecodedChunk, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int | None, ...],
    finite: bool = False,
) -> torch.Tensor:
    """The named tensor, checked against dtypes and a shape pattern (None = any size), and with
    `finite` for NaN and infinities (refused as they arrive: in a step shared with other
    requests they would fail them all)."""
    t = chunk.tensors[name]
    if t.dtype not in dtypes:
        raise invalid(f"{stage}: tensor '{name}' has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True)):
        pattern = ["*" if s is None else s for s in shape]
        raise invalid(f"{stage}: tensor '{name}' has shape {list(t.shape)}; expected {pattern}")
    if finite and not bool(torch.isfinite(t).all()):
        raise invalid(f"{stage}: tensor '{name}' holds NaN or infinite values")
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


@dataclass
class Prompt:
    ids: list[int]
    multimodal: dict[str, torch.Tensor] = field(default_factory=dict)  # MULTIMODAL names (checked by the model)
    use_audio_in_video: bool = False
    digests: torch.Tensor | None = None  # its media items' (the thinker's prefix cache: models/prefix_cache.py)


def prompt_chunk(ids: list[int], multimodal: Mapping[str, torch.Tensor] | None = None,
                 use_audio_in_video: bool = False, digests: torch.Tensor | None = None) -> OutChunk:  # fmt: skip
    tensors = {IDS: torch.tensor(ids, dtype=torch.long), **(multimodal or {})}
    unknown = set(tensors) - {IDS, *MULTIMODAL}
    if unknown:
        raise ValueError(f"prompt: unknown model input(s) {sorted(unknown)}")
    if digests is not None:
        tensors[MEDIA_DIGESTS] = digests
    meta = {USE_AUDIO_IN_VIDEO: True} if use_audio_in_video else {}
    return OutChunk(tensors, offset=0, length=len(ids), finished=True, meta=meta)


def read_prompt(stage: str, chunk: DecodedChunk) -> Prompt:
    check_names(stage, chunk, {IDS}, {*MULTIMODAL, MEDIA_DIGESTS})
    ids = tensor(stage, chunk, IDS, INT_DTYPES, (None,))
    _check_length(stage, chunk, int(ids.shape[0]), "prompt ids")
    flag = meta_flag(stage, chunk, USE_AUDIO_IN_VIDEO)
    digests = None
    if MEDIA_DIGESTS in chunk.tensors:  # (their number is checked against the items by the model)
        digests = tensor(stage, chunk, MEDIA_DIGESTS, (torch.uint8,), (None, DIGEST_BYTES)).clone()
    mm = {k: v.clone() for k, v in chunk.tensors.items() if k not in (IDS, MEDIA_DIGESTS)}  # out of the received bytes
    return Prompt([int(i) for i in ids.tolist()], mm, flag, digests)


# ---- thinker -> caller, thinker -> talker --------------------------------------------------------


def text_chunk(offset: int, token_id: int, finish_reason: str | None,
               logprobs: TokenLogprobs | None = None) -> OutChunk:  # fmt: skip
    meta = {FINISH_REASON: finish_reason} if finish_reason else {}
    tensors = {IDS: torch.tensor([token_id])}
    if logprobs is not None:
        tensors[LOGPROB] = torch.tensor([logprobs.logprob], dtype=torch.float32)
        tensors[TOP_IDS] = torch.tensor([i for i, _ in logprobs.top], dtype=torch.long).view(-1, 1)
        tensors[TOP_LOGPROBS] = torch.tensor([lp for _, lp in logprobs.top], dtype=torch.float32).view(-1, 1)
    return OutChunk(tensors, offset=offset, length=1, finished=bool(finish_reason), meta=meta)


def read_logprobs(stage: str, chunk: DecodedChunk) -> list[TokenLogprobs] | None:
    """A text chunk's tokens' log-probabilities, one per id (None: it carries none)."""
    if LOGPROB not in chunk.tensors:
        return None
    n = int(chunk.tensors[IDS].shape[0])
    lp = tensor(stage, chunk, LOGPROB, FLOAT_DTYPES, (n,)).float().tolist()
    top_ids = tensor(stage, chunk, TOP_IDS, INT_DTYPES, (None, n))
    k = int(top_ids.shape[0])
    ids = top_ids.t().tolist()
    top_lp = tensor(stage, chunk, TOP_LOGPROBS, FLOAT_DTYPES, (k, n)).float().t().tolist()
    return [TokenLogprobs(lp[i], tuple(zip(ids[i], top_lp[i], strict=True))) for i in range(n)]


def thinker_prompt_chunk(ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor | None,
                         rope: Mapping[str, torch.Tensor] | None = None) -> OutChunk:  # fmt: skip
    tensors = {PROMPT_IDS: ids, PROMPT_EMBED: embeds, **(rope or {})}
    if hidden is not None:
        tensors[PROMPT_HIDDEN] = hidden
    return OutChunk(tensors, offset=0, length=0)


@dataclass
class ThinkerPrompt:
    ids: torch.Tensor  # [L]
    embeds: torch.Tensor  # [L, H]
    hidden: torch.Tensor | None  # [L, H]
    rope: dict[str, torch.Tensor] = field(default_factory=dict)  # ROPE names


def read_thinker_prompt(stage: str, chunk: DecodedChunk, hidden_size: int) -> ThinkerPrompt:
    """The prompt's tensors, copied out of the received bytes."""
    check_names(stage, chunk, {PROMPT_IDS, PROMPT_EMBED}, {PROMPT_HIDDEN, *ROPE})
    ids = tensor(stage, chunk, PROMPT_IDS, INT_DTYPES, (None,)).long()
    n = int(ids.shape[0])
    embeds = tensor(stage, chunk, PROMPT_EMBED, FLOAT_DTYPES, (n, hidden_size), finite=True)
    hidden = None
    if PROMPT_HIDDEN in chunk.tensors:
        hidden = tensor(stage, chunk, PROMPT_HIDDEN, FLOAT_DTYPES, (n, hidden_size), finite=True).clone()
    _check_length(stage, chunk, 0, "stream positions (a prompt advances none)")
    rope = {}
    for name in ROPE:
        if name in chunk.tensors:
            shape: tuple[int | None, ...] = (None, 3) if name.endswith("grid_thw") else (None,)
            dtypes = FLOAT_DTYPES if name == "video_second_per_grid" else INT_DTYPES
            rope[name] = tensor(stage, chunk, name, dtypes, shape).clone()
            if not bool(torch.isfinite(rope[name]).all()) or bool((rope[name] < 0).any()):
                raise invalid(f"{stage}: tensor '{name}' holds negative, NaN or infinite values")
    return ThinkerPrompt(ids.clone(), embeds.clone(), hidden, rope)


def token_chunk(offset: int, token_id: int, embed: torch.Tensor, finished: bool,
                hidden: torch.Tensor | None = None) -> OutChunk:  # fmt: skip
    """One thinker token for the talker: its embedding, and (for a family whose talker reads it)
    the hidden state of the position that produced it."""
    tensors = {IDS: torch.tensor([token_id]), EMBED: embed.reshape(1, -1)}
    if hidden is not None:
        tensors[HIDDEN] = hidden.reshape(1, -1)
    return OutChunk(tensors, offset=offset, length=1, finished=finished)


def read_tokens(stage: str, chunk: DecodedChunk, hidden_size: int, with_hidden: bool = False
                ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:  # fmt: skip
    """Each token's embedding `[H]` and, `with_hidden`, its hidden state `[H]` (copied), in order."""
    check_names(stage, chunk, {IDS, EMBED, HIDDEN} if with_hidden else {IDS, EMBED})
    ids = tensor(stage, chunk, IDS, INT_DTYPES, (None,))
    n = int(ids.shape[0])
    embed = tensor(stage, chunk, EMBED, FLOAT_DTYPES, (n, hidden_size), finite=True)
    hidden = tensor(stage, chunk, HIDDEN, FLOAT_DTYPES, (n, hidden_size), finite=True) if with_hidden else None
    _check_length(stage, chunk, n, "tokens")
    return [(embed[i].clone(), None if hidden is None else hidden[i].clone()) for i in range(n)]


# ---- thinker-prefill -> thinker-decode ------------------------------------------------------------

KV_CHECKS = ("omnistage_version", "thinker_fingerprint", "kv_layout")  # meta both roles must agree on
PROMPT_TOKENS = "prompt_tokens"
STOPPED_ON = "stopped_on"
FIRST_ID, FIRST_EMBED, LAST_POSITION, GENERATOR_STATE = "first_id", "first_embed", "last_position", "generator_state"


def kv_chunk(offset: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> OutChunk:
    """One prompt chunk's keys and values, per layer (copied out of the live cache)."""
    tensors: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(kv):
        tensors[f"k.{i}"], tensors[f"v.{i}"] = k.contiguous(), v.contiguous()
    return OutChunk(tensors, offset=offset, length=int(kv[0][0].shape[-2]) if kv else 0)


def kv_header(meta: Mapping[str, Any]) -> OutChunk:
    """The first chunk to a decode role: no KV, only the prompt's size and the roles' checks
    (`meta`), so that the decode role can reserve the cache before any of it is sent."""
    return OutChunk({}, offset=0, length=0, meta=dict(meta))


def check_kv_meta(stage: str, meta: Mapping[str, Any], mine: Mapping[str, str]) -> int:
    """The KV header's meta against this role's own values: FAILED_PRECONDITION naming
    each difference. Returns the prompt's token count."""
    diffs = [f"{k}: prefill has {meta.get(k)!r}, decode has {mine[k]!r}" for k in KV_CHECKS if meta.get(k) != mine[k]]
    if diffs:
        raise StageError(Code.FAILED_PRECONDITION, f"{stage}: the prefill and decode roles do not match ("
                         + "; ".join(diffs) + "); run both on the same checkpoint, dtype and omnistage version")
    n = meta.get(PROMPT_TOKENS)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise invalid(f"{stage}: meta {PROMPT_TOKENS!r} must be a positive int, got {n!r}")
    return n


def read_kv(stage: str, chunk: DecodedChunk, layout: Mapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the chunk's keys and values, checked against this role's cache layout (views
    of the received bytes: copy them before the chunk is gone)."""
    layers = int(layout["layers"])
    check_names(stage, chunk, {f"{kv}.{i}" for i in range(layers) for kv in "kv"})
    n = chunk.length
    dtype = getattr(torch, str(layout["dtype"]))
    shape = (1, int(layout["kv_heads"]), n, int(layout["head_dim"]))
    return [(tensor(stage, chunk, f"k.{i}", (dtype,), shape), tensor(stage, chunk, f"v.{i}", (dtype,), shape))
            for i in range(layers)]  # fmt: skip


def handoff_chunk(offset: int, prompt_ids: list[int], token_id: int, embed: torch.Tensor, stopped_on: str | None,
                  last_position: torch.Tensor, generator_state: torch.Tensor | None,
                  talker_prompt: OutChunk | None) -> OutChunk:  # fmt: skip
    tensors = {PROMPT_IDS: torch.tensor(prompt_ids, dtype=torch.long), FIRST_ID: torch.tensor([token_id]),
               FIRST_EMBED: embed.reshape(1, -1), LAST_POSITION: last_position}  # fmt: skip
    if generator_state is not None:
        tensors[GENERATOR_STATE] = generator_state
    if talker_prompt is not None:
        tensors |= {k: v for k, v in talker_prompt.tensors.items() if k != PROMPT_IDS}
    return OutChunk(tensors, offset=offset, finished=True, meta={STOPPED_ON: stopped_on or ""})


@dataclass
class Handoff:
    prompt_ids: list[int]
    token_id: int
    embed: torch.Tensor  # [H]
    stopped_on: str | None
    last_position: torch.Tensor  # [4, 1, 1], int or float32
    generator_state: torch.Tensor | None
    talker_prompt: ThinkerPrompt | None  # with audio out


def read_handoff(stage: str, chunk: DecodedChunk, prompt_tokens: int, hidden_size: int, want_audio: bool) -> Handoff:
    required = {PROMPT_IDS, FIRST_ID, FIRST_EMBED, LAST_POSITION} | ({PROMPT_EMBED} if want_audio else set())
    check_names(stage, chunk, required, {GENERATOR_STATE, PROMPT_HIDDEN, *ROPE})
    if chunk.offset != prompt_tokens or not chunk.finished:
        raise invalid(f"{stage}: the handoff must be the finished chunk at offset {prompt_tokens} (the prompt's "
                      f"end); got offset {chunk.offset}, finished={chunk.finished}")  # fmt: skip
    _check_length(stage, chunk, 0, "stream positions (a handoff advances none)")
    ids = tensor(stage, chunk, PROMPT_IDS, INT_DTYPES, (prompt_tokens,))
    first = tensor(stage, chunk, FIRST_ID, INT_DTYPES, (1,))
    embed = tensor(stage, chunk, FIRST_EMBED, FLOAT_DTYPES, (1, hidden_size))
    # float32 after a video: its temporal positions, and so every later one, can be fractional
    position = tensor(stage, chunk, LAST_POSITION, (*INT_DTYPES, torch.float32), (None, 1, 1))
    gen = None
    if GENERATOR_STATE in chunk.tensors:
        gen = tensor(stage, chunk, GENERATOR_STATE, (torch.uint8,), (None,)).clone()
    stopped_on = meta_str(chunk.meta, STOPPED_ON) or None
    if stopped_on not in (None, "stop_id", "stop_text", "max_tokens"):
        raise invalid(f"{stage}: meta {STOPPED_ON!r} is {stopped_on!r}; expected '', 'stop_id', 'stop_text' or "
                      "'max_tokens'")  # fmt: skip
    talker_prompt = None
    if want_audio:
        prompt_part = DecodedChunk({k: v for k, v in chunk.tensors.items() if k in {PROMPT_IDS, PROMPT_EMBED,
                                                                                     PROMPT_HIDDEN, *ROPE}},
                                   {}, 0, chunk.seq, False)  # fmt: skip
        talker_prompt = read_thinker_prompt(stage, prompt_part, hidden_size)
    return Handoff([int(i) for i in ids.tolist()], int(first[0]), embed[0].clone(), stopped_on,
                   position.clone(), gen, talker_prompt)  # fmt: skip


# ---- talker -> code2wav, talker -> caller ----------------------------------------------------------


def frames_chunk(offset: int, codes: torch.Tensor, decode_now: bool = False) -> OutChunk:
    """`codes`: `[G, n]` frames; `decode_now`: the receiver decodes them without waiting for its
    schedule's count."""
    return OutChunk({CODES: codes}, offset=offset, length=int(codes.shape[1]),
                    meta={DECODE_NOW: True} if decode_now else {})  # fmt: skip


def read_frames(stage: str, chunk: DecodedChunk, groups: int) -> torch.Tensor:
    check_names(stage, chunk, {CODES})
    codes = tensor(stage, chunk, CODES, INT_DTYPES, (groups, None)).long()
    _check_length(stage, chunk, int(codes.shape[1]), "frames")
    return codes


# ---- code2wav -> caller -----------------------------------------------------------------------------


def audio_chunk(offset: int, pcm: torch.Tensor, sample_rate: int) -> OutChunk:
    return OutChunk({AUDIO: pcm}, offset=offset, length=int(pcm.shape[0]), meta={SAMPLE_RATE: sample_rate})


# ---- the Start message -------------------------------------------------------------------------------

_SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "max_tokens",
                    "logprobs", "presence_penalty", "frequency_penalty")  # fmt: skip


# fields that only the thinker's sampling reads
_THINKER_ONLY = ("forced_ids", "stop_texts", "logprobs", "logit_bias", "presence_penalty", "frequency_penalty",
                 "speech_end_ids")  # fmt: skip


def _asks(params: stage_pb2.SamplingParams, name: str) -> bool:
    """Whether `params` sets `name` to anything but what changes nothing (none, empty, a penalty of 0)."""
    return params.HasField(name) if name == "logprobs" else bool(getattr(params, name))


def check_start(stage: str, start: stage_pb2.Start) -> None:
    """What every stage checks in a Start before it opens the request (INVALID_ARGUMENT)."""
    if not start.request_id:
        raise invalid(f"{stage}: Start.request_id is empty")
    if len(start.request_id) > 256:
        raise invalid(f"{stage}: Start.request_id is {len(start.request_id)} characters; at most 256")
    if start.mode not in stage_pb2.EdgeMode.values():
        raise invalid(f"{stage}: Start.mode {start.mode} is not an EdgeMode "
                      f"({', '.join(stage_pb2.EdgeMode.keys())})")  # fmt: skip
    if not start.deadline_unix_s >= 0 or start.deadline_unix_s == float("inf"):  # NaN fails `>=`
        raise invalid(f"{stage}: Start.deadline_unix_s must be a finite time >= 0, got {start.deadline_unix_s}")
    unknown = sorted(set(start.sampling) - set(STAGES))
    if unknown:
        raise invalid(f"{stage}: Start.sampling has unknown stage(s) {unknown}; expected {list(STAGES)}")
    for field_name in _THINKER_ONLY:
        others = sorted(name for name, params in start.sampling.items()
                        if name != "thinker" and _asks(params, field_name))  # fmt: skip
        if others:
            verb = "are" if field_name in ("forced_ids", "stop_texts", "speech_end_ids") else "is"
            raise invalid(f"{stage}: sampling: {field_name} {verb} for the thinker only, not {others}")


def sampling(stage: str, start: stage_pb2.Start, defaults: SamplingParams,
             max_tokens_limit: int | None = None, limit_name: str = "max_model_len", *,
             vocab: int | None = None, required_stop_ids: Sequence[int] = ()) -> SamplingParams:  # fmt: skip
    """The stage's sampling from `Start.sampling[stage]` (unset fields keep `defaults`); a
    requested max_tokens over `max_tokens_limit` (what the stage can ever produce) is refused,
    unless it is no more than the stage's default: a client may send that back (vLLM-Omni's
    examples ask the talker for generate()'s 4096 frames), and it is bounded as the default is.
    Stop ids must be ids of the stage's `vocab`, and those that replace the stage's own must
    keep `required_stop_ids` (the talker's codec end, and Qwen2.5-Omni's codec pad: a frame past
    them is no audio, and code2wav refused it only after the speech had streamed)."""
    msg = start.sampling.get(stage)
    if msg is None:
        return defaults
    if max_tokens_limit is not None and msg.HasField("max_tokens"):
        limit, why = max_tokens_limit, limit_name
        if defaults.max_tokens > limit:
            limit, why = defaults.max_tokens, "this stage's default"
        if msg.max_tokens > limit:
            raise invalid(f"{stage}: sampling: max_tokens {msg.max_tokens} exceeds this stage's limit {limit} ({why})")
    overrides: dict[str, Any] = {f: getattr(msg, f) for f in _SAMPLING_FIELDS if msg.HasField(f)}
    if not msg.HasField("do_sample"):  # the knobs say what was meant (generate() would ignore them)
        if msg.HasField("temperature") and greedy_temperature(msg.temperature):  # 0: greedy, as over HTTP
            overrides["do_sample"] = False
            del overrides["temperature"]
        elif msg.HasField("temperature") or (msg.HasField("top_p") and msg.top_p < 1) \
                or (msg.HasField("top_k") and msg.top_k > 0):  # fmt: skip
            overrides["do_sample"] = True
    if msg.stop_ids:  # replaces the stage's default stop ids, as generate()'s *_eos_token_id does
        stops = tuple(int(i) for i in msg.stop_ids)
        if vocab is not None and (bad := [i for i in stops if not 0 <= i < vocab]):
            raise invalid(f"{stage}: sampling: stop_ids outside the vocabulary (0..{vocab - 1}): {bad[:8]}")
        if missing := [i for i in required_stop_ids if i not in stops]:
            own = list(required_stop_ids)
            raise invalid(f"{stage}: sampling: stop_ids must keep {missing}, of the stage's own {own} (codec "
                          "control ids that end the speech: a frame past them is no audio; add ids to them rather "
                          "than replace them)")  # fmt: skip
        overrides["stop_ids"] = stops
    if msg.forced_ids:
        overrides["forced_ids"] = tuple(int(i) for i in msg.forced_ids)
    if msg.speech_end_ids:
        if vocab is not None and (bad := [i for i in msg.speech_end_ids if not 0 <= i < vocab]):
            raise invalid(f"{stage}: sampling: speech_end_ids outside the vocabulary (0..{vocab - 1}): {bad[:8]}")
        overrides["speech_end_ids"] = tuple(int(i) for i in msg.speech_end_ids)
    if msg.logit_bias:
        if vocab is not None and (bad := sorted(i for i in msg.logit_bias if not 0 <= i < vocab)):
            raise invalid(f"{stage}: sampling: logit_bias ids outside the vocabulary (0..{vocab - 1}): {bad[:8]}")
        overrides["logit_bias"] = dict(msg.logit_bias)
    if msg.stop_texts:
        try:
            overrides["stop_texts"] = tuple(check_stop_texts(list(msg.stop_texts)))
        except ValueError as e:
            raise invalid(f"{stage}: sampling: stop_texts: {e}") from None
    try:
        return defaults.with_overrides(**overrides)
    except ValueError as e:
        raise invalid(f"{stage}: sampling: {e}") from None


def downstream_start(start: stage_pb2.Start, edge_mode: int, seeds: Mapping[str, int] | None = None) -> stage_pb2.Start:
    """The Start a stage sends downstream: its own, with the edge's mode unless the request
    asked for full_payload itself, and a seed for each stage in `seeds` whose sampling has
    none (a replay on another replica then samples the same stream: see wire/resume.py)."""
    out = stage_pb2.Start()
    out.CopyFrom(start)
    if start.mode != stage_pb2.FULL_PAYLOAD:
        out.mode = edge_mode  # type: ignore[assignment]
    for stage, seed in (seeds or {}).items():
        if stage not in start.sampling or not start.sampling[stage].HasField("seed"):
            out.sampling[stage].seed = seed
    return out


def edge_mode(name: str) -> int:
    """A config edge mode name -> the proto enum value."""
    return {"async_chunk": stage_pb2.ASYNC_CHUNK, "full_payload": stage_pb2.FULL_PAYLOAD}[name]


def meta_str(meta: Mapping[str, Any], key: str) -> str:
    value = meta.get(key, "")
    return value if isinstance(value, str) else ""


def sampling_proto(params: SamplingParams) -> stage_pb2.SamplingParams:
    """`SamplingParams` as the proto message a Start carries (every field set)."""
    msg = stage_pb2.SamplingParams(stop_ids=list(params.stop_ids), forced_ids=list(params.forced_ids),
                                   stop_texts=list(params.stop_texts), logit_bias=dict(params.logit_bias),
                                   speech_end_ids=list(params.speech_end_ids))  # fmt: skip
    for f in _SAMPLING_FIELDS:
        value = getattr(params, f)
        if value is not None and (value or f not in ("presence_penalty", "frequency_penalty")):  # (0: unset)
            setattr(msg, f, value)
    return msg
