"""Thinker stage: the prompt in (ids, and the processor's audio/image/video tensors); text token ids
up; the prompt's and each token's embeddings down to the talker."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Self

from omnistage.config import DeployConfig
from omnistage.engine import Demand, FinishReason, OutChunk, Request, ScheduledItem, StageWorker, StepOutput
from omnistage.models import Checkpoint, SamplingParams, load_tokenizer
from omnistage.models.text_stream import TextStream
from omnistage.v1 import stage_pb2
from omnistage.wire import Code, DecodedChunk, StageError, invalid
from services import edges

log = logging.getLogger(__name__)

# what made a thinker stop -> the engine's finish reason
FINISH_REASONS = {"stop_id": FinishReason.STOP, "stop_text": FinishReason.STOP, "max_tokens": FinishReason.LENGTH}


class ThinkerWorker(StageWorker):
    name = "thinker"  # its process; errors name it
    part = "thinker"  # the model part: its sampling is Start.sampling["thinker"] in every role
    reserves_reply = True  # a request is admitted with its whole reply's cache reserved (demand)

    def __init__(self, thinker: Any, defaults: SamplingParams, max_model_len: int | None = None,
                 audio_output: bool = True, tokenizer: Any = None) -> None:  # fmt: skip
        self.thinker = thinker  # the family's thinker (e.g. omnistage/models/qwen3_omni/thinker.py)
        self.tokenizer = tokenizer  # the reply's text, for stop texts
        self.audio_output = audio_output  # False: no talker below (a text-only stack)
        self.device = thinker.device
        self.spec = thinker.spec
        self.defaults = defaults
        # the family's talker reads every position's hidden state (else only the media's)
        self.talker_needs_hidden = bool(self.spec.talker_needs_hidden)
        self._max_model_len = min(int(self.spec.max_positions), max_model_len or 1 << 62)

    def wants_on_device(self, name: str) -> bool:
        return name in edges.MEDIA_FEATURES

    def open(self, req: Request) -> None:
        start: stage_pb2.Start = req.params
        if start.want_audio and not self.audio_output:
            raise invalid(f"{self.name}: want_audio: this stack serves text only (no stage below)")
        sampling = edges.sampling(self.part, start, self.defaults, self._max_model_len, vocab=self.spec.thinker_vocab)
        if sampling.stop_texts and self.tokenizer is None:
            raise invalid(f"{self.name}: sampling: stop_texts: this thinker has no tokenizer to read its reply with")
        req.state = self.thinker.new_state(sampling, self._max_model_len)

    def sends_down(self, req: Request) -> bool:
        # a reply with speech: the prompt and every token go to the talker, the last one finished
        return bool(req.params.want_audio)

    def feed(self, req: Request, chunk: DecodedChunk) -> None:
        prompt = edges.read_prompt(self.name, chunk)
        try:
            self.thinker.set_prompt(req.state, prompt.ids, prompt.multimodal, prompt.use_audio_in_video,
                                    prompt.digests)
        except ValueError as e:
            raise invalid(f"thinker: {e}") from None

    def demand(self, req: Request) -> Demand | None:
        state = req.state
        if not state.prompt_ids:
            return None
        n = len(state.prompt_ids)
        # (a prompt that starts with a cached prefix is prefilled from its end: models/prefix_cache.py)
        return Demand(n, self.reply_reservation(n, state.sampling.max_tokens, state.max_len), state.cached)

    def reply_reservation(self, prompt_tokens: int, max_tokens: int, max_len: int) -> int:
        """The cache a request reserves for its reply, past its prompt (`demand`)."""
        return min(max_tokens, max_len - prompt_tokens)

    def ready(self, req: Request) -> bool:
        return req.input_finished and bool(req.state.prompt_ids) and not req.state.finished

    def max_model_len(self) -> int:
        return self._max_model_len

    def capacity(self) -> dict[str, int]:
        return {"max_model_len": self.max_model_len()}

    def kv_pool_tokens(self) -> int:
        return int(self.thinker.batching.pooled_tokens())

    def prefix_cache_tokens(self) -> int:
        prefixes = self.thinker.prefixes
        return 0 if prefixes is None else int(prefixes.tokens)

    def execute(self, batch: Sequence[ScheduledItem]) -> list[StepOutput | Exception]:
        """One packed forward: prefill chunks of the tokens the scheduler gave, and decodes. A
        request whose audio/image/video cannot be encoded fails alone, before the forward."""
        failed: dict[int, Exception] = {}
        for i, item in enumerate(batch):
            try:
                self.thinker.encode(item.request.state)
            except (ValueError, IndexError) as e:
                failed[i] = invalid(f"thinker: the request's audio, image or video inputs cannot be encoded: {e}")
            except Exception as e:  # any other failure is this request's alone too
                failed[i] = e
        live = [it for i, it in enumerate(batch) if i not in failed]
        steps = iter(self.thinker.step([(it.request.state, it.request.num_computed_tokens, it.num_tokens)
                                        for it in live]) if live else [])  # fmt: skip
        out: list[StepOutput | Exception] = []
        for i, item in enumerate(batch):
            step = None if i in failed else next(steps)
            if step is not None and step.error is not None:
                failed[i] = StageError(Code.INTERNAL, f"thinker: {step.error}")  # the model's output, not the input
            out.append(failed[i] if i in failed else self._output(item, step))
        return out

    def talker_prompt(self, prompt: Any) -> OutChunk:
        """The prompt's chunk for the talker; the accept-layer states only when it has media."""
        mm = self.spec.multimodal_ids
        has_mm = any(int(i) in mm for i in prompt.ids.tolist())
        hidden = prompt.hidden if has_mm or self.talker_needs_hidden else None
        return edges.thinker_prompt_chunk(prompt.ids, prompt.embeds, hidden, prompt.rope.tensors())

    def end_at_stop_text(self, state: Any, tok: Any) -> None:
        """A token that completes one of the reply's stop texts is its last: every stage below
        ends with it (the gateway cuts the text before the stop text, as it streams it)."""
        if tok is None or tok.is_last or not state.sampling.stop_texts:
            return
        if state.text is None:  # (a decode role's first check: the prefill role's token too)
            state.text = TextStream(self.tokenizer, state.sampling.stop_texts)
            state.text.push(state.history[len(state.prompt_ids) :])
        else:
            state.text.push([tok.token_id])
        if state.text.stopped:
            tok.stopped_on = "stop_text"
            state.finished = True

    def _output(self, item: ScheduledItem, step: Any) -> StepOutput:
        req = item.request
        start: stage_pb2.Start = req.params
        out = StepOutput()
        prompt, tok = step.prompt, step.token
        self.end_at_stop_text(req.state, tok)
        if prompt is not None and start.want_audio:
            out.down.append(self.talker_prompt(prompt))
        if tok is None:  # a prefill chunk that is not the last
            return out
        out.up.append(edges.text_chunk(tok.index, tok.token_id, tok.stopped_on, tok.logprobs))
        if start.want_audio:
            hidden = tok.hidden if self.talker_needs_hidden else None
            out.down.extend(self.spoken(req.state, tok.index, tok.token_id, tok.embed, tok.is_last, hidden))
        if tok.is_last:
            out.finished = FINISH_REASONS[tok.stopped_on]
            out.detail = tok.stopped_on
        return out

    @staticmethod
    def spoken(state: Any, index: int, token_id: int, embed: Any, is_last: bool, hidden: Any) -> list[OutChunk]:
        """A generated token's chunk for the talker: none once its input has ended; the first of
        the request's speech_end_ids (a tool call's first token) goes as the last, which the
        talker never speaks, so the speech is the reply's up to there while its text goes on."""
        if state.speech_ended:
            return []
        state.speech_ended = is_last = is_last or token_id in state.sampling.speech_end_ids
        return [edges.token_chunk(index, token_id, embed, is_last, hidden)]

    def close(self, req: Request) -> None:
        self.thinker.release(req.state)

    @classmethod
    def build(cls, cfg: DeployConfig, ckpt: Checkpoint) -> Self:
        """This role's worker with the settings of its block of the deploy config."""
        stage = cfg.stage(cls.name)
        thinker = ckpt.family.thinker(ckpt, stage.dtype, stage.device, stage.batching)
        thinker.set_kv_budget(stage.cache_capacity_tokens)
        if cls.name == "thinker":  # the whole thinker (a split one's roles keep no prefixes)
            thinker.keep_prefixes(cfg.thinker.prefix_cache_tokens)
        worker = cls(thinker, ckpt.family.thinker_defaults(ckpt), cfg.max_model_len, cfg.audio_output,
                     load_tokenizer(ckpt))  # fmt: skip
        worker.warn_if_defaults_do_not_fit(stage.cache_capacity_tokens, stage.max_num_seqs)
        return worker

    def least_reservation(self) -> int:
        """The cache a one-token prompt reserves with a reply of the default length."""
        return 1 + self.reply_reservation(1, self.defaults.max_tokens, self._max_model_len)

    def warn_if_defaults_do_not_fit(self, cache_capacity_tokens: int | None, max_num_seqs: int | None = None) -> None:
        """A cache smaller than a one-token prompt with a reply of the default length refuses
        every request that does not set max_tokens: said at start, not at each request. So is
        one that holds fewer such requests than `max_num_seqs` (a request is admitted with its
        prompt and its whole reply reserved: a checkpoint's long max_new_tokens, taken as the
        default, cuts how many share a step)."""
        least = self.least_reservation()
        if cache_capacity_tokens is None or not self.reserves_reply:
            return
        if cache_capacity_tokens < least:
            log.warning("%s: cache_capacity_tokens=%d is below a reply of the default length (%d tokens) and its "
                        "prompt: every request that does not set max_tokens will be refused; raise it to at least %d",
                        self.name, cache_capacity_tokens, self.defaults.max_tokens, least)  # fmt: skip
        elif max_num_seqs is not None and (fit := cache_capacity_tokens // least) < max_num_seqs:
            log.warning("%s: cache_capacity_tokens=%d holds at most %d requests that do not set max_tokens at once "
                        "(each reserves its prompt and a reply of the default length, %d tokens: %d at least), "
                        "fewer than max_num_seqs=%d; raise it to %d to admit as many, or send max_tokens",
                        self.name, cache_capacity_tokens, fit, self.defaults.max_tokens, least, max_num_seqs,
                        least * max_num_seqs)  # fmt: skip


def build_worker(cfg: DeployConfig, ckpt: Checkpoint) -> ThinkerWorker:
    return ThinkerWorker.build(cfg, ckpt)
