"""Qwen3-Omni's thinker, stepping many requests at once: chunked prefill and greedy or sampled
decode, one packed forward per step (models/batching.py), each request with its own KV cache.

A prompt with audio, image or video runs its encoders when its prefill starts, inside that step
(multimodal.py): its embeddings, M-RoPE positions and deepstack rows are kept until the prefill
ends, and its chunks pack with every other request's rows like text. The encoders run per
request, each over all of the request's items of one kind, as `generate()` groups them (so a
request's numbers do not depend on its batch).

Per new token it gives the token id, its layer-0 embedding (what the talker projects) and the
`accept_hidden_layer` hidden state of the position that produced it; when a prompt's prefill
completes, the embeddings and accept-layer hidden states of every prompt position.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.models.batching import PackedBatching, PackedCache
from omnistage.models.kv_caches import SlotCache, layer_kv
from omnistage.models.prefix_cache import MediaItem, Prefix, PrefixCache
from omnistage.models.qwen3_omni.multimodal import (
    AudioRows,
    MultimodalInputs,
    PromptInputs,
    RopeInputs,
    encode_prompt,
    media_digests,
    media_items,
)
from omnistage.models.qwen3_omni.prompt import text_positions
from omnistage.models.qwen3_omni.spec import FamilySpec
from omnistage.models.sampling import (
    SamplingParams,
    TokenChooser,
    TokenLogprobs,
    choose_rows,
    forced_token,
    token_logprobs,
)

__all__ = ["PromptOutput", "Thinker", "ThinkerState", "ThinkerStep", "TokenOutput"]

log = logging.getLogger(__name__)


@dataclass
class PromptOutput:
    ids: torch.Tensor  # [L] int64
    embeds: torch.Tensor  # [L, H] layer-0 embeddings
    hidden: torch.Tensor  # [L, H] accept_hidden_layer hidden states
    rope: RopeInputs = field(default_factory=RopeInputs)  # the items' sizes (for the talker's positions)


@dataclass
class TokenOutput:
    index: int  # 0-based position among generated tokens
    token_id: int
    embed: torch.Tensor  # [H] layer-0 embedding of token_id
    hidden: torch.Tensor  # [H] accept-layer hidden state of the position that produced token_id
    stopped_on: str | None = None  # "stop_id" | "max_tokens" (| "stop_text": services/thinker) when the last
    logprobs: TokenLogprobs | None = None  # when its request's sampling asks for them

    @property
    def is_last(self) -> bool:
        return self.stopped_on is not None


@dataclass
class ThinkerState:
    """One request's thinker state; its progress (tokens in the cache) is the engine's count."""

    sampling: SamplingParams
    chooser: TokenChooser
    max_len: int  # prompt + generated tokens it may reach (the model's positions, or less)
    prompt_ids: list[int] = field(default_factory=list)  # empty until the prompt arrives
    cache: Any = None
    history: list[int] = field(default_factory=list)  # prompt then generated ids (repetition penalty)
    prompt_parts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # prefill chunks' rows
    multimodal: MultimodalInputs | None = None  # until the encoders have run
    rope: RopeInputs = field(default_factory=RopeInputs)
    prompt_inputs: PromptInputs | None = None  # a multimodal prompt, during its prefill
    last_position: torch.Tensor | None = None  # [4, 1, 1] position of the last token fed
    finished: bool = False
    role: Any = None  # what a prefill/decode role of the thinker keeps for the request (services/thinker)
    # the generated tokens its cache will hold when fewer than max_tokens (a prefill role's: its first)
    cache_new_tokens: int | None = None
    text: Any = None  # its reply's text, where it has stop texts (services/thinker: a TextStream)
    speech_ended: bool = False  # its talker input ended at one of sampling.speech_end_ids (services/thinker)
    # with a prefix cache (models/prefix_cache.py): the prompt's media, the cached prefix it starts
    # with and its length (prefilled from there), and what it keeps for the cache when it ends
    media: list[MediaItem] = field(default_factory=list)
    prefix: Prefix | None = None
    cached: int = 0
    prompt_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # its prompt's (embeds, hidden)
    fed_hidden: list[torch.Tensor] = field(default_factory=list)  # accept-layer rows of the tokens fed since

    @property
    def generated(self) -> int:
        return len(self.history) - len(self.prompt_ids)


@dataclass
class ThinkerStep:
    prompt: PromptOutput | None = None  # when the prefill completed in this step
    token: TokenOutput | None = None  # None after a prefill chunk that is not the last
    error: ValueError | None = None  # this request's token could not be chosen (its own failure)


class Thinker:
    def __init__(self, model: Any, spec: FamilySpec, row_modules: tuple[type, ...] = (), batching: str = "exact",
                 audio_rows: AudioRows | None = None) -> None:  # fmt: skip
        """`audio_rows`: the audio tower's output rows per audio (default Qwen3-Omni's; another
        family with this thinker's interface, as Qwen2.5-Omni, passes its own)."""
        self.model = model
        self.spec = spec
        self.audio_rows = audio_rows
        self.device = next(model.parameters()).device
        self.embedding = model.get_input_embeddings()
        self.batching = PackedBatching(model, row_modules, batching)
        # fast mode keeps the requests' caches in one pool (`PackedBatching.new_cache`); a role
        # whose cache is read after its request ends turns it off (services/thinker/prefill.py)
        self.pool_kv = True
        self.prefixes: PrefixCache | None = None  # `keep_prefixes`

    def keep_prefixes(self, max_tokens: int) -> None:
        """Keep what ended requests computed, up to `max_tokens` positions, for prompts that start
        alike (models/prefix_cache.py); 0: keep none."""
        self.prefixes = PrefixCache(max_tokens) if max_tokens else None

    def validate_prompt(self, prompt_ids: Sequence[int], max_len: int | None = None) -> None:
        """Refuse a prompt before any model work: empty, too long, or out of vocabulary."""
        limit = min(self.spec.max_positions, max_len or self.spec.max_positions)
        if not prompt_ids:
            raise ValueError("empty prompt: nothing to generate from")
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds the model maximum of {limit - 1}")
        bad = [i for i in prompt_ids if not 0 <= i < self.spec.thinker_vocab]
        if bad:
            raise ValueError(f"prompt ids outside the vocabulary (0..{self.spec.thinker_vocab - 1}): {bad[:8]}")

    def _check_given_reply(self, sampling: SamplingParams) -> None:
        """A given reply's ids (and the stop id that ends it) must be ids of this vocabulary."""
        given = (*sampling.forced_ids, *sampling.stop_ids[:1]) if sampling.forced_ids else ()
        bad = [i for i in given if not 0 <= i < self.spec.thinker_vocab]
        if bad:
            raise ValueError(f"sampling: forced_ids (or the stop id ending them) outside the vocabulary "
                             f"(0..{self.spec.thinker_vocab - 1}): {bad[:8]}")  # fmt: skip

    def new_state(self, sampling: SamplingParams, max_len: int | None = None) -> ThinkerState:
        """`max_len`: a cap below the model's positions on prompt + generated tokens (it stops
        there as at max_tokens)."""
        limit = min(self.spec.max_positions, max_len or self.spec.max_positions)
        return ThinkerState(sampling, TokenChooser(sampling, device=str(self.device)), limit)

    def set_prompt(
        self,
        state: ThinkerState,
        prompt_ids: Sequence[int],
        multimodal: Mapping[str, torch.Tensor] | None = None,
        use_audio_in_video: bool = False,
        digests: torch.Tensor | None = None,
    ) -> None:
        """`multimodal`: the processor's audio/image/video tensors (transformers' names);
        `digests`: its items' (`media_digests`), for the prefix cache (else made here)."""
        if state.prompt_ids:
            raise ValueError("the prompt was already received")
        self.validate_prompt(prompt_ids, state.max_len)
        self._check_given_reply(state.sampling)
        mm = MultimodalInputs.from_mapping(multimodal or {}, use_audio_in_video)
        mm.check(torch.tensor(list(prompt_ids)), self.model.config, self.audio_rows)
        state.prompt_ids = list(prompt_ids)
        if not mm.empty:
            state.multimodal = mm
            state.rope = mm.rope()
        if self.prefixes is not None:
            ids = torch.tensor(state.prompt_ids)
            if not mm.empty:  # (digests made here when the caller sent none: the in-process pipeline's)
                given = media_digests(mm) if digests is None else digests
                state.media = media_items(ids, mm, self.model.config, given, self.audio_rows)
            state.cached, state.prefix = self.prefixes.match(ids, state.media)

    @torch.no_grad()
    def encode(self, state: ThinkerState) -> None:
        """Run the request's audio and vision encoders, once, before its first prefill chunk (a
        step does it itself; calling it first lets a caller fail one request, not the step)."""
        if state.multimodal is not None:
            ids = torch.tensor(state.prompt_ids, device=self.device)
            mm, state.multimodal = state.multimodal, None
            skip = collections.Counter(item.kind for item in state.media if item.end <= state.cached)  # cached ones
            state.prompt_inputs = encode_prompt(self.model, ids, mm, state.cached, skip)

    def _prompt_rows(self, state: ThinkerState, pos: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embeddings `[n, H]` and positions `[4, 1, n]` of prompt chunk [pos, pos + n)."""
        self.encode(state)
        inputs = state.prompt_inputs
        if inputs is None:
            ids = torch.tensor(state.prompt_ids[pos : pos + n], device=self.device)
            return self.embedding(ids), text_positions(pos, n, self.device)
        return inputs.embeds[pos : pos + n], inputs.positions[..., pos : pos + n]

    def _deepstack(self, items: Sequence[tuple[ThinkerState, int, int]]) -> dict[str, Any]:
        """The text model's deepstack arguments for a packed step: the visual rows' mask over
        all rows, and per deepstack layer the features of those rows in row order."""
        if all(state.prompt_inputs is None for state, _, _ in items):  # no media in the step (decode steps)
            return {}
        masks, rows = [], []
        for state, pos, n in items:
            inputs = state.prompt_inputs
            if inputs is None or inputs.visual_mask is None or pos >= len(state.prompt_ids):
                masks.append(torch.zeros(n, dtype=torch.bool, device=self.device))
                continue
            mask = inputs.visual_mask
            masks.append(mask[pos : pos + n])
            first, last = int(mask[:pos].sum()), int(mask[: pos + n].sum())
            if last > first:
                assert inputs.deepstack is not None
                rows.append([layer[first:last] for layer in inputs.deepstack])
        if not rows:
            return {}
        return {
            "visual_pos_masks": torch.cat(masks).unsqueeze(0),
            "deepstack_visual_embeds": [torch.cat(layer) for layer in zip(*rows, strict=True)],
        }

    def _emit(self, emits: Sequence[tuple[ThinkerStep, ThinkerState, torch.Tensor]], logits: torch.Tensor) -> None:
        """Each `(result, state, hidden row)`'s next token from its row of `logits` (`[n, V]`):
        its given reply's, or chosen for all of them at once (`choose_rows`: one host sync for
        the step). A row with no token to choose (NaN logits from NaN media, a sampler with no
        distribution left) fails only its own request, on its result."""
        tokens: list[int | RuntimeError | None] = [
            forced_token(state.sampling, len(state.history) - len(state.prompt_ids)) for _, state, _ in emits
        ]
        free = [i for i, token in enumerate(tokens) if token is None]
        if free:
            states = [emits[i][1] for i in free]
            rows = logits if len(free) == len(emits) else logits[free]
            chosen = choose_rows([s.chooser for s in states], rows, [s.history for s in states])
            for i, token in zip(free, chosen, strict=True):
                tokens[i] = token
        ids = [token if isinstance(token, int) else 0 for token in tokens]
        embeds = self.embedding(torch.tensor(ids, device=self.device))
        logprobs: list[TokenLogprobs | None] = [None] * len(emits)
        want = [i for i, (_, state, _) in enumerate(emits)
                if state.sampling.logprobs is not None and isinstance(tokens[i], int)]  # fmt: skip
        if want:
            rows = logits if len(want) == len(emits) else logits[want]
            tops = [emits[i][1].sampling.logprobs or 0 for i in want]
            for i, lp in zip(want, token_logprobs(rows, [ids[i] for i in want], tops), strict=True):
                logprobs[i] = lp
        for (result, state, hidden_row), token, embed, lp in zip(emits, tokens, embeds, logprobs, strict=True):
            if not isinstance(token, int):
                result.error = ValueError(f"no token could be chosen from this request's logits: {token}")
                continue
            state.history.append(token)
            stopped_on = None
            if state.chooser.is_stop(token):
                stopped_on = "stop_id"
            elif state.generated >= state.sampling.max_tokens or len(state.history) >= state.max_len:
                stopped_on = "max_tokens"
            state.finished = stopped_on is not None
            result.token = TokenOutput(state.generated - 1, token, embed, hidden_row, stopped_on, lp)

    @torch.no_grad()
    def step(self, items: Sequence[tuple[ThinkerState, int, int]]) -> list[ThinkerStep]:
        """One forward for every `(state, position, n)`: `position` is how many tokens the
        request has in its cache; `n` prompt tokens from there (a prefill chunk) or, past the
        prompt, one decode step."""
        embeds: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        decodes: list[int] = []
        for i, (state, pos, n) in enumerate(items):
            if state.finished:
                raise RuntimeError("thinker request already finished")
            if state.cache is None:
                state.cache = self._new_cache(state)
                state.history = list(state.prompt_ids)
                state.chooser.prompt_len = len(state.prompt_ids)
                if state.cached:
                    self._take_prefix(state, pos)
            if pos < len(state.prompt_ids):
                if n < 1 or pos + n > len(state.prompt_ids):
                    raise ValueError(f"prefill chunk [{pos}, {pos + n}) outside a prompt of {len(state.prompt_ids)}")
                rows, position = self._prompt_rows(state, pos, n)
                state.last_position = position[..., -1:]
            else:
                if n != 1 or pos != len(state.history) - 1:
                    want = len(state.history) - 1
                    raise ValueError(f"decode step at position {pos} of {n} tokens; expected 1 at {want}")
                assert state.last_position is not None
                rows = position = state.last_position  # placeholders: the decode rows are made below
                decodes.append(i)
            embeds.append(rows)
            positions.append(position)
        if decodes:  # every decode row's embedding and position in one op each, not per request
            states = [items[i][0] for i in decodes]
            rows = self.embedding(torch.tensor([s.history[-1] for s in states], device=self.device))
            stepped = torch.cat([s.last_position for s in states], dim=-1) + 1  # as generate() steps every axis on
            for i, state, row, position in zip(decodes, states, rows.split(1), stepped.split(1, dim=-1), strict=True):
                embeds[i], positions[i] = row, position
                state.last_position = position
        only_decodes = len(decodes) == len(items)
        lengths = [n for _, _, n in items]
        cache = PackedCache([state.cache for state, _, _ in items], lengths)
        with self.batching.step(lengths, cache):
            # the thinker's forward, with deepstack features it cannot take as arguments
            out = self.model.model.language_model(
                inputs_embeds=(rows if only_decodes else torch.cat(embeds)).unsqueeze(0),
                position_ids=stepped if only_decodes else torch.cat(positions, dim=-1),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=True,
                **self._deepstack(items),
            )
            lasts = [end - 1 for end in itertools.accumulate(lengths)]
            if self.batching.mode == "exact":  # each request's lm_head over all its rows, as generate() runs it
                last_logits = self.model.lm_head(out.last_hidden_state)[0, lasts]
            else:  # only the rows a token is chosen from: a 100-row prefill's lm_head at the published
                # vocabulary (151,936 x 2,048) took 512 ms on one CPU thread, one row 80 ms
                last_logits = self.model.lm_head(out.last_hidden_state[0, lasts])
        embeds_all = out.hidden_states[0][0]
        accept_all = out.hidden_states[self.spec.accept_hidden_layer][0]
        results = []
        emits: list[tuple[ThinkerStep, ThinkerState, torch.Tensor]] = []
        emit_rows: list[int] = []
        # each token's hidden state, the last row of its request: in a decode step every row, as
        # views made in one op (else one index per request)
        last_rows = accept_all.unbind(0) if only_decodes else None
        start = 0
        for row, (state, pos, n) in enumerate(items):
            end = start + n
            last = last_rows[row] if last_rows is not None else accept_all[end - 1]
            result = ThinkerStep()
            if pos < len(state.prompt_ids):
                state.prompt_parts.append((embeds_all[start:end], accept_all[start:end]))
                if pos + n == len(state.prompt_ids):
                    result.prompt = PromptOutput(
                        ids=torch.tensor(state.prompt_ids, dtype=torch.long),
                        embeds=torch.cat([e for e, _ in state.prompt_parts]),
                        hidden=torch.cat([h for _, h in state.prompt_parts]),
                        rope=state.rope,
                    )
                    state.prompt_parts = []
                    if self.prefixes is not None:
                        state.prompt_rows = (result.prompt.embeds, result.prompt.hidden)
                    state.prompt_inputs = None
                    emits.append((result, state, last))
                    emit_rows.append(row)
            else:
                emits.append((result, state, last))
                emit_rows.append(row)
                if self.prefixes is not None:  # the fed token's (a view would hold the step's states)
                    state.fed_hidden.append(last.clone())
            results.append(result)
            start = end
        if emits:
            self._emit(emits, last_logits if len(emit_rows) == len(items) else last_logits[emit_rows])
        return results

    # ---- prefill/decode roles: the KV cache and the state moved between processes --------------

    def kv_layout(self) -> dict[str, Any]:
        """What a request's KV cache looks like: per layer keys and values `[1, heads, T, dim]`."""
        text = self.model.config.text_config
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        return {"layers": int(text.num_hidden_layers), "kv_heads": int(heads), "head_dim": int(head_dim),
                "dtype": dtype}  # fmt: skip

    def kv_rows(self, state: ThinkerState, pos: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the keys and values of cache positions [pos, pos + n) (views)."""
        layers = (layer_kv(state.cache, i) for i in range(int(self.model.config.text_config.num_hidden_layers)))
        return [(k[:, :, pos : pos + n], v[:, :, pos : pos + n]) for k, v in layers]

    def decode_state(self, state: ThinkerState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After the prefill's first token, what a decode role needs besides the cache, the
        prompt and that token: the position it was fed at (`[4, 1, 1]`) and the sampler's
        random state (uint8; None when greedy)."""
        assert state.last_position is not None
        gen = state.chooser.generator
        return state.last_position.clone(), None if gen is None else gen.get_state()

    def adopt(self, state: ThinkerState, prompt_ids: Sequence[int], token_id: int, stopped_on: str | None,
              last_position: torch.Tensor, generator_state: torch.Tensor | None,
              kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:  # fmt: skip
        """Make `state` (new, with the request's sampling) go on where a prefill role stopped
        (`decode_state`): its cache from `kv` (per layer keys and values of every prompt position),
        the first token in its history. The next `step` for it is a decode at len(prompt)."""
        self.validate_prompt(prompt_ids, state.max_len)
        self._check_given_reply(state.sampling)
        if not 0 <= token_id < self.spec.thinker_vocab:
            raise ValueError(f"first token {token_id} outside the vocabulary (0..{self.spec.thinker_vocab - 1})")
        want = text_positions(0, 1, "cpu").shape  # the text axis and the three M-RoPE axes
        if last_position.shape != want or not bool(torch.isfinite(last_position).all()):
            raise ValueError(f"last position of shape {list(last_position.shape)} (finite values of shape "
                             f"{list(want)} expected)")  # fmt: skip
        if float(last_position[0, 0, 0]) != len(prompt_ids) - 1:  # the text axis counts the prompt
            raise ValueError(f"last position {float(last_position[0, 0, 0]):g} on the text axis; the prompt's last "
                             f"is {len(prompt_ids) - 1}")  # fmt: skip
        gen = state.chooser.generator
        if gen is not None:
            if generator_state is None:
                raise ValueError("a sampled request's handoff carries no sampler state")
            try:
                gen.set_state(generator_state)
            except RuntimeError as e:  # right size, wrong contents
                raise ValueError(f"sampler state: {e}") from None
        state.prompt_ids = list(prompt_ids)
        self.batching.free_cache(state.cache)
        state.cache = self._new_cache(state)
        for i, (k, v) in enumerate(kv):
            state.cache.update(k.to(self.device), v.to(self.device), i)
        state.history = [*state.prompt_ids, token_id]
        state.chooser.prompt_len = len(state.prompt_ids)
        state.last_position = last_position.to(self.device)
        state.finished = stopped_on is not None

    def _new_cache(self, state: ThinkerState) -> Any:
        config, limit = self.model.config.text_config, self._cache_limit(state)
        return self.batching.new_cache(config, limit) if self.pool_kv else SlotCache.for_model(config, limit)

    @staticmethod
    def _cache_limit(state: ThinkerState) -> int:
        """The positions a request's cache can reach: its prompt and every token it may make
        (its reservation in the scheduler)."""
        new = state.sampling.max_tokens if state.cache_new_tokens is None else state.cache_new_tokens
        return min(state.max_len, len(state.prompt_ids) + new)

    def set_kv_budget(self, tokens: int | None) -> None:
        """The KV tokens the scheduler lets all requests reserve (`cache_capacity_tokens`; None:
        unbounded): fast mode's pool of request caches grows no further while they fit in it."""
        self.batching.kv_budget = tokens

    def _take_prefix(self, state: ThinkerState, pos: int) -> None:
        """A new cache's first `state.cached` positions, and the prompt rows it sends the talker,
        from the cached prefix its prompt starts with."""
        prefix, n = state.prefix, state.cached
        if prefix is None or pos != n:
            raise ValueError(f"a prompt whose first {n} positions are cached prefilled from {pos}")
        for i, (k, v) in enumerate(prefix.kv):
            state.cache.update(k[:, :, :n], v[:, :, :n], i)
        state.prompt_parts.append((prefix.embeds[:n], prefix.hidden[:n]))
        state.prefix = None  # (the entry may go from the cache now: nothing more is read of it)

    @torch.no_grad()  # (called from `release`, outside the steps: no graph on what is kept)
    def _keep_prefix(self, state: ThinkerState) -> None:
        """An ended request's positions, for prompts that start with them: every one it fed (its
        prompt, and its reply but the last token)."""
        assert self.prefixes is not None and state.prompt_rows is not None
        n = int(state.cache.get_seq_length())
        prompt = len(state.prompt_ids)
        if n - prompt != len(state.fed_hidden) or n > self.prefixes.max_tokens:  # (a step failed after writing)
            return
        rows = self.kv_rows(state, 0, n)
        if any(k.shape[2] != n for k, _ in rows):  # a sliding-window layer keeps only its window
            return
        embeds, hidden = state.prompt_rows
        if n > prompt:
            fed = torch.tensor(state.history[prompt:n], device=self.device)
            embeds = torch.cat([embeds, self.embedding(fed)])
            hidden = torch.cat([hidden, torch.stack(state.fed_hidden)])
        kv = [(k.clone(), v.clone()) for k, v in rows]
        self.prefixes.add(Prefix(torch.tensor(state.history[:n]), tuple(state.media), kv, embeds, hidden))

    def release(self, state: ThinkerState) -> None:
        """Free the request's cache (kept for later prompts first, with a prefix cache, when it
        ended by itself: stopped or at its length, not cancelled or failed)."""
        if self.prefixes is not None and state.finished and state.cache is not None and state.prompt_rows is not None:
            try:
                self._keep_prefix(state)
            except Exception:  # out of memory copying it: not kept, and the request's cache freed all the same
                log.warning("thinker: an ended request's prefix could not be kept", exc_info=True)
        self.batching.free_cache(state.cache)
        state.cache = None
        state.prompt_parts = []
        state.multimodal = state.prompt_inputs = None
        state.prefix = state.prompt_rows = None
        state.fed_hidden = []
        state.finished = True
