"""Per-stage sampling parameters and token choice, built on transformers' own logits processors
(in the order `generate()` applies them), so greedy output matches the monolithic reference."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# Below it, sampled logits overflow float32: a stage refuses it with sampling on; the HTTP API,
# as vLLM does, takes it as greedy.
MIN_TEMPERATURE = 1e-5
# The most alternatives a token's log-probability comes with (OpenAI's `top_logprobs` limit).
MAX_TOP_LOGPROBS = 20
# OpenAI's bounds: a logit bias, and the presence and frequency penalties.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024  # (a request's bias is part of its rows' batching key, hashed each step)
MAX_PENALTY = 2.0


def greedy_temperature(temperature: float) -> bool:
    """0, and as in vLLM any temperature under 1e-5 (sampling there would divide the logits into
    overflow), means greedy: for the HTTP API, a Start's knobs and a checkpoint's generation config."""
    return 0 <= temperature < MIN_TEMPERATURE


@dataclass(frozen=True)
class SamplingParams:
    """One stage's sampling. `max_tokens` counts generated tokens (thinker) or code-0 tokens
    (talker, as `talker_max_new_tokens` does). `stop_ids` end generation when produced."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 1024
    stop_ids: tuple[int, ...] = field(default_factory=tuple)
    forced_ids: tuple[int, ...] = field(default_factory=tuple)  # a given reply (thinker): see `forced_token`
    stop_texts: tuple[str, ...] = field(default_factory=tuple)  # (thinker) the reply ends where one appears
    # (thinker) each generated token's log-probability and that many most likely ids with theirs
    # (`token_logprobs`); None: none
    logprobs: int | None = None
    # (thinker) OpenAI's: added to a token's logit ((id, bias) pairs, in id order), and taken off
    # per time a token was generated (frequency) and once for having been (presence)
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (thinker) the talker's input ends at the first of these the reply generates (services/thinker)
    speech_end_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # Written so that NaN fails every check (any comparison with NaN is False).
        if not 0 < self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if self.do_sample and self.temperature < MIN_TEMPERATURE:  # logits / T overflow: no distribution left
            raise ValueError(f"temperature {self.temperature:g} is below {MIN_TEMPERATURE:g} with sampling on; "
                             "turn sampling off (do_sample false, or temperature 0 over HTTP) for greedy")  # fmt: skip
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not MIN_TEMPERATURE <= self.repetition_penalty < math.inf:  # a positive logit / 1e-40 overflows
            raise ValueError(f"repetition_penalty must be a finite number >= {MIN_TEMPERATURE:g}, "
                             f"got {self.repetition_penalty}")  # fmt: skip
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be from {-MAX_LOGIT_BIAS:g} to {MAX_LOGIT_BIAS:g}")
        if any(i < 0 for i, _ in self.logit_bias):
            raise ValueError("logit_bias ids must be >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be from {-MAX_PENALTY:g} to {MAX_PENALTY:g}, got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        if self.forced_ids and not self.stop_ids:
            raise ValueError("forced_ids need a stop id to end the given reply")

    def with_overrides(self, **overrides: Any) -> SamplingParams:
        clean = {k: v for k, v in overrides.items() if v is not None}
        for name in ("stop_ids", "forced_ids", "speech_end_ids"):
            if name in clean:
                clean[name] = tuple(int(i) for i in clean[name])
        if "stop_texts" in clean:
            clean["stop_texts"] = tuple(str(s) for s in clean["stop_texts"])
        if "logit_bias" in clean:
            bias = clean["logit_bias"]
            clean["logit_bias"] = tuple(sorted((int(i), float(b)) for i, b in (bias.items() if isinstance(bias, dict)
                                                                               else bias)))  # fmt: skip
        return replace(self, **clean)


# The monolithic `generate()` defaults for the talker (code-0) and its code predictor.
TALKER_DEFAULTS = SamplingParams(
    do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, max_tokens=4096
)
CODE_PREDICTOR_SAMPLED = SamplingParams(do_sample=True, top_k=50, top_p=0.8, max_tokens=1)
GREEDY = SamplingParams()


class OutputPenalty(LogitsProcessor):
    """OpenAI's presence and frequency penalties (as vLLM applies them): a token's logit less
    `frequency` per time the reply generated it and `presence` once if it did. Its `input_ids`
    are the reply's ids alone (`RowChoice`), padded with ids past the vocabulary."""

    def __init__(self, presence: float, frequency: float) -> None:
        self.presence, self.frequency = presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        vocab = scores.shape[-1]
        counts = torch.zeros((scores.shape[0], vocab + 1), dtype=scores.dtype, device=scores.device)
        counts.scatter_add_(1, input_ids.clamp(max=vocab), torch.ones_like(input_ids, dtype=scores.dtype))
        counts = counts[:, :vocab]
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)  # type: ignore[return-value]


class TokenChooser:
    """Applies one request's processors to a logits row and picks the next id. `prompt_len`:
    how many of a history's ids are its prompt (the rest are the reply, which the presence and
    frequency penalties count); set by the stage once the prompt is known."""

    def __init__(self, params: SamplingParams, suppress_ids: list[int] | None = None, device: str = "cpu") -> None:
        self.params = params
        self.suppress_ids = tuple(suppress_ids or ())
        self.prompt_len = 0
        procs: list[Any] = []
        # in generate()'s order: the bias (its sequence_bias), the repetition penalty, ..., the warpers
        if params.logit_bias:
            procs.append(SequenceBiasLogitsProcessor({(i,): b for i, b in params.logit_bias}))
        if params.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(penalty=params.repetition_penalty))
        if params.presence_penalty or params.frequency_penalty:
            procs.append(OutputPenalty(params.presence_penalty, params.frequency_penalty))
        if suppress_ids:
            procs.append(SuppressTokensLogitsProcessor(suppress_ids, device=device))
        if params.do_sample:
            if params.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                procs.append(TopKLogitsWarper(top_k=params.top_k))
            if params.top_p < 1.0:
                procs.append(TopPLogitsWarper(top_p=params.top_p))
        self.processors = LogitsProcessorList(procs)
        self.generator: torch.Generator | None = None
        if params.do_sample:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

        # the request's history as an int64 tensor, kept between steps (`history_ids`)
        self._history: Sequence[int] | None = None
        self._history_ids = torch.empty(0, dtype=torch.long)
        self._history_len = 0

    def history_ids(self, history: Sequence[int]) -> torch.Tensor:
        """`history` as an int64 tensor (on the CPU; a view that later calls leave as it is): a
        request's history only grows by appends, so a call converts only the ids appended since
        the last one (another sequence starts over). A long history (a multimodal prompt, minutes
        of speech) converted whole every step took milliseconds a step at batch 16."""
        done = self._history_len
        if history is not self._history or len(history) < done:  # a fresh buffer: views handed out stay as they were
            self._history, self._history_ids, done = history, torch.empty(0, dtype=torch.long), 0
        size = len(history)
        if size > self._history_ids.numel():  # room for twice as many: appends stay amortized O(1)
            grown = torch.empty(2 * size, dtype=torch.long)
            grown[:done] = self._history_ids[:done]
            self._history_ids = grown
        if size > done:
            self._history_ids[done:size] = torch.tensor(history[done:size], dtype=torch.long)
        self._history_len = size
        return self._history_ids[:size]

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no logits processor: the choice is the argmax of the raw logits, so many
        requests' rows can be chosen in one call (`argmax` is exact on any batch)."""
        return not self.params.do_sample and not self.processors

    def choose(self, logits: torch.Tensor, history: torch.Tensor) -> int:
        """`logits`: `[V]` (float); `history`: `[T]` ids seen so far (for the penalties)."""
        ids = history.view(1, -1).to(logits.device)
        scores = self.process(ids, ids[:, self.prompt_len :], logits.view(1, -1).float())
        return int(self.pick(scores, [self.generator], check=True))

    def process(self, ids: torch.Tensor, reply_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The processors over `scores` (`[n, V]`): the presence and frequency penalties read
        `reply_ids`, the others `ids` (the whole histories)."""
        for proc in self.processors:
            scores = proc(reply_ids if isinstance(proc, OutputPenalty) else ids, scores)
        return scores

    @property
    def reads_history(self) -> bool:
        """Whether the repetition penalty reads the ids seen so far (else none are gathered)."""
        return self.params.repetition_penalty != 1.0

    @property
    def reads_reply(self) -> bool:
        """Whether the presence and frequency penalties read the reply's ids."""
        return bool(self.params.presence_penalty or self.params.frequency_penalty)

    def pick(self, scores: torch.Tensor, generators: Sequence[torch.Generator | None], check: bool,
             uniforms: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Each row's id from its processed `scores` (`[n, V]`): the argmax, or sampled with
        `generators[i]` or, given, `uniforms[i]` (`draw`)."""
        if not self.params.do_sample:
            return torch.argmax(scores, dim=-1)
        return draw(torch.softmax(scores, dim=-1), generators, check=check, uniforms=uniforms)

    def is_stop(self, token: int) -> bool:
        return token in self.params.stop_ids


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None], check: bool = False,
         uniforms: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Row i's id drawn from `probs[i]` (`[n, V]`) with `generators[i]`, `[n]` on the device: one
    uniform per row from its own generator (or `uniforms[i]`, drawn before), then the inverse of
    the row's cumulative sum, the rows together. A row's draw is its own whatever rows are beside
    it, and a batch costs one small call per row instead of one `multinomial` each (those were
    over a quarter of the code predictor's sampled frame at batch 16 on CPU)."""
    if uniforms is None:
        uniforms = draw_uniforms(generators, 1, probs.device).view(-1)
    return in_vocabulary(inverse_cdf(probs, uniforms), probs.shape[-1], check)


def draw_uniforms(generators: Sequence[torch.Generator | None], per_row: int,
                  device: torch.device | str) -> torch.Tensor:  # fmt: skip
    """`[n, per_row]` uniforms, row i from `generators[i]` in one call; zeros for a row with none
    (greedy: it reads none)."""
    zeros = torch.zeros(per_row, device=device)
    rows = [zeros if g is None else torch.rand(per_row, generator=g, device=device) for g in generators]
    return torch.stack(rows) if rows else torch.zeros(0, per_row, device=device)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's first id whose cumulative probability passes `uniforms[i]` of the row's total,
    `[n]`; `V` for a row that is no distribution. The sum is in float64, so a uniform below 1
    never lands past the last id with any probability, and one of 0 takes the first. Fixed
    shapes and no host sync: capturable in a CUDA graph."""
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1]).unsqueeze(-1), right=True).view(-1)


def in_vocabulary(picks: torch.Tensor, vocab: int, check: bool) -> torch.Tensor:
    """`picks`, where a row that found no id (NaN or infinite logits: a broken checkpoint, an
    overflow) is `vocab`. That raises on the CPU, and on a GPU with `check` (a host sync: callers
    that bring the ids to the host anyway); else the id is kept in range (an id past the
    embedding would be a device-side assert, fatal to the process)."""
    if check or picks.device.type == "cpu":
        if bool((picks >= vocab).any()):
            raise RuntimeError("sampling: a row's probabilities are not a distribution (NaN or infinite logits)")
        return picks
    return picks.clamp_(max=vocab - 1)


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model (the log-softmax of its raw logits,
    before any penalty or warper, as vLLM reports them) and the `top` most likely ids with theirs,
    most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, ids: Sequence[int], tops: Sequence[int]) -> list[TokenLogprobs]:
    """Row i's `TokenLogprobs` of `ids[i]` with `tops[i]` alternatives, from `logits` (`[n, V]`),
    the rows together (one host copy)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(list(ids), device=logp.device).view(-1, 1)).view(-1).tolist()
    k = max(tops, default=0)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [TokenLogprobs(lp, tuple(zip(top_ids[i][:n], top_lp[i][:n], strict=True)))
            for i, (lp, n) in enumerate(zip(chosen, tops, strict=True))]  # fmt: skip


def forced_token(params: SamplingParams, generated: int) -> int | None:
    """The given reply's token at step `generated` (then its first stop id); None when the reply
    is not given."""
    if not params.forced_ids:
        return None
    return params.forced_ids[generated] if generated < len(params.forced_ids) else params.stop_ids[0]


def choose_rows(choosers: Sequence[TokenChooser], logits: torch.Tensor,
                histories: Sequence[Sequence[int]]) -> list[int | RuntimeError]:  # fmt: skip
    """Row i's choice, as `choosers[i].choose(logits[i], histories[i])` makes it, the rows
    together (`RowChoice`: one host sync for them all). A row with no distribution left gets the
    error it raises alone, and the others their ids: each sampled row's uniform is drawn once,
    first, so the retry row by row draws nothing more."""
    device = logits.device
    uniforms = draw_uniforms([c.generator for c in choosers], 1, device).view(-1)
    try:
        return RowChoice(choosers, device, check=True)(logits, histories, uniforms).tolist()  # type: ignore[no-any-return]
    except RuntimeError:
        out: list[int | RuntimeError] = []
        for i, chooser in enumerate(choosers):
            try:
                out.append(int(RowChoice([chooser], device, check=True)(logits[i : i + 1], histories[i : i + 1],
                                                                        uniforms[i : i + 1])))  # fmt: skip
            except RuntimeError as e:
                out.append(e)
        return out


def greedy_or_drawn(lead: TokenChooser, logits: torch.Tensor, uniforms: torch.Tensor,
                    sampled: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Row i's id: where `sampled[i]`, drawn through `lead`'s processors with `uniforms[i]`;
    elsewhere the argmax of its raw logits. Every row goes through the same ops, whatever it is:
    fixed shapes and no host sync (off the CPU), so a CUDA graph can replay it.
    For a batch whose sampled rows have `lead`'s processors and whose other rows none: `RowChoice`
    gives it the same ids (each op works row by row)."""
    raw = logits.float()
    scores = lead.processors(raw.new_empty((raw.shape[0], 0), dtype=torch.long), raw)
    drawn = inverse_cdf(torch.softmax(scores, dim=-1), uniforms)
    return in_vocabulary(torch.where(sampled, drawn, torch.argmax(raw, dim=-1)), raw.shape[-1], check=False)


def alike(chooser: TokenChooser) -> tuple[Any, ...]:
    """What a chooser's processors and pick depend on, its generator aside (greedy: no warpers)."""
    p = chooser.params
    warpers = (p.temperature, p.top_k, p.top_p) if p.do_sample else ()
    return (p.do_sample, *warpers, p.repetition_penalty, chooser.suppress_ids, p.logit_bias, p.presence_penalty,
            p.frequency_penalty)  # fmt: skip


class RowChoice:
    """Row i's choice, as `choosers[i].choose(logits[i], histories[i])` makes it (no history:
    empty ones), as a `[n]` tensor on the device. Rows whose choosers are alike (the same
    processors) run through them as one `[n, V]` batch: every processor, the softmax and the
    argmax work row by row, so each row's numbers are its own; a sampled row then draws from its
    own generator, as it would alone (`draw`). Histories are padded with the id `V`, which the
    repetition penalty sets aside (ids past the vocabulary land in a column it drops).

    The groups and their row indices are worked out once, at construction: a call for a batch
    of one kind (the talker's code predictor, all its groups) runs with no host sync, and one of
    several kinds copies no index to the device. `check`: a sampled row with no distribution
    raises on the device too (a host sync); otherwise only on the CPU (`draw`)."""

    def __init__(self, choosers: Sequence[TokenChooser], device: torch.device | str, check: bool = False) -> None:
        self.choosers = choosers
        self.check = check
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, chooser in enumerate(choosers):
            groups.setdefault(alike(chooser), []).append(i)
        self.groups = list(groups.values())
        self.index = ([torch.tensor(rows, device=device) for rows in self.groups]
                      if len(self.groups) > 1 else [None])  # fmt: skip

    def __call__(self, logits: torch.Tensor, histories: Sequence[Sequence[int]] | None = None,
                 uniforms: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """`uniforms` (`[n]`, on the device): the sampled rows' draws, made before (else each
        row's generator gives one now)."""
        vocab = logits.shape[-1]
        if not self.groups:
            return torch.empty(0, dtype=torch.long, device=logits.device)
        out = None if len(self.groups) == 1 else torch.empty(len(self.choosers), dtype=torch.long,
                                                             device=logits.device)  # fmt: skip
        for rows, index in zip(self.groups, self.index, strict=True):
            lead = self.choosers[rows[0]]
            ids = replies = torch.empty((len(rows), 0), dtype=torch.long, device=logits.device)
            if histories is not None and (lead.reads_history or lead.reads_reply):  # (the penalties alone read them)
                seen = [self.choosers[i].history_ids(histories[i]) for i in rows]
                if lead.reads_history:
                    ids = pad_sequence(seen, batch_first=True, padding_value=vocab).to(logits.device)
                if lead.reads_reply:
                    replies = pad_sequence([s[self.choosers[i].prompt_len :] for s, i in zip(seen, rows, strict=True)],
                                           batch_first=True, padding_value=vocab).to(logits.device)  # fmt: skip
            scores = lead.process(ids, replies, (logits if index is None else logits.index_select(0, index)).float())
            drawn = None if uniforms is None else uniforms if index is None else uniforms.index_select(0, index)
            picks = lead.pick(scores, [self.choosers[i].generator for i in rows], self.check, drawn)
            if out is None:
                return picks
            out.index_copy_(0, index, picks)  # type: ignore[arg-type]
        assert out is not None
        return out
