"""OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty` on the thinker. The bias is
transformers' own `sequence_bias` (equal to the thinker's `generate()` with it); the penalties,
which transformers lacks, equal `generate()` with an independent processor of OpenAI's formula."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from omnistage.models.sampling import SamplingParams, TokenChooser, choose_rows
from services.pipeline import PipelineRequest, TextEvent

PROMPT = "Can you explain how streaming works?"


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented formula over the reply's tokens: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = scores.clone()
        for j, c in zip(*torch.unique(input_ids[0, self.prompt_len :], return_counts=True), strict=True):
            out[0, j] -= c * self.frequency + self.presence
        return out


def _ids(pipeline: Any, params: SamplingParams) -> list[int]:
    ids = pipeline.prompt_ids(PROMPT)
    events = pipeline.run(PipelineRequest(prompt_ids=ids, thinker=params, want_audio=False))
    return [e.token_id for e in events if isinstance(e, TextEvent)]


def _generate(reference: Any, ids: list[int], eos: int, **kwargs: Any) -> list[int]:
    with torch.no_grad():
        out = reference.model.thinker.generate(input_ids=torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                               eos_token_id=eos, **kwargs)  # fmt: skip
    seq = out.sequences if hasattr(out, "sequences") else out
    return seq[0, len(ids) :].tolist()


def _families(checkpoints: Any, q25_checkpoints: Any) -> list[tuple[Any, Any]]:
    return [checkpoints("published"), q25_checkpoints("published")]


def test_logit_bias_is_generate_s_sequence_bias(checkpoints: Any, q25_checkpoints: Any) -> None:
    for pipeline, reference in _families(checkpoints, q25_checkpoints):
        ids, eos = pipeline.prompt_ids(PROMPT), pipeline.spec.im_end_id
        plain = _generate(reference, ids, eos)
        # the greedy reply's first token ruled out, another favoured, the end pushed off
        bias = {plain[0]: -100.0, plain[1]: 3.5, eos: -100.0}
        want = _generate(reference, ids, eos, sequence_bias={(i,): b for i, b in bias.items()})
        assert want != plain and want[0] != plain[0] and eos not in want
        got = _ids(pipeline, pipeline.thinker_defaults().with_overrides(max_tokens=24, logit_bias=bias))
        assert got == want


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.2), (-2.0, 0.0), (0.5, -2.0)])
def test_penalties_are_openai_s_formula(checkpoints: Any, q25_checkpoints: Any, presence: float,
                                        frequency: float) -> None:  # fmt: skip
    changed = []
    for pipeline, reference in _families(checkpoints, q25_checkpoints):
        ids, eos = pipeline.prompt_ids(PROMPT), pipeline.spec.im_end_id
        plain = _generate(reference, ids, eos)
        rule = OpenAIPenalties(len(ids), presence, frequency)
        want = _generate(reference, ids, eos, logits_processor=LogitsProcessorList([rule]))
        params = pipeline.thinker_defaults().with_overrides(max_tokens=24, presence_penalty=presence,
                                                            frequency_penalty=frequency)  # fmt: skip
        assert _ids(pipeline, params) == want
        changed.append(want != plain)
    assert any(changed), "the penalties should change some family's reply"


def test_the_penalties_come_after_the_repetition_penalty(checkpoints: Any, q25_checkpoints: Any) -> None:
    """In vLLM's order: generate()'s repetition penalty, then OpenAI's formula (a processor of
    generate()'s own list comes before one given as logits_processor)."""
    for pipeline, reference in _families(checkpoints, q25_checkpoints):
        ids, eos = pipeline.prompt_ids(PROMPT), pipeline.spec.im_end_id
        rule = OpenAIPenalties(len(ids), -2.0, -2.0)
        want = _generate(reference, ids, eos, repetition_penalty=2.0, logits_processor=LogitsProcessorList([rule]))
        params = pipeline.thinker_defaults().with_overrides(max_tokens=24, repetition_penalty=2.0,
                                                            presence_penalty=-2.0, frequency_penalty=-2.0)  # fmt: skip
        assert _ids(pipeline, params) == want
        # (the order tells: the other one gives another reply here)
        other = LogitsProcessorList([rule, RepetitionPenaltyLogitsProcessor(2.0)])
        assert _generate(reference, ids, eos, logits_processor=other) != want


def test_a_split_thinker_counts_the_prefill_s_token(tiny_dir: Path, pipeline: Any) -> None:
    """The decode role's penalties count the first token, which the prefill role chose."""
    from tests.test_pd_roles import _pd

    split = _pd(tiny_dir, prefill={"max_num_batched_tokens": 8})
    params = pipeline.thinker_defaults().with_overrides(max_tokens=16, presence_penalty=-2.0, frequency_penalty=-1.0,
                                                        logit_bias={7: 2.0})  # fmt: skip
    assert _ids(split, params) == _ids(pipeline, params) != _ids(pipeline, params.with_overrides(
        presence_penalty=0.0, frequency_penalty=0.0, logit_bias={}))


def test_rows_with_other_biases_and_penalties_batch_as_alone() -> None:
    vocab = 30
    torch.manual_seed(3)
    logits = torch.randn(4, vocab)
    top = torch.argmax(logits, dim=-1).tolist()
    params = [SamplingParams(logit_bias=((top[0], -100.0),)), SamplingParams(presence_penalty=2.0),
              SamplingParams(frequency_penalty=2.0, repetition_penalty=1.3), SamplingParams()]  # fmt: skip
    histories = [[1, 2], [5, top[1], 9], [top[2], top[2], 4], [0]]
    prompt_lens = [2, 1, 1, 0]

    def choosers() -> list[TokenChooser]:
        made = [TokenChooser(p) for p in params]
        for c, n in zip(made, prompt_lens, strict=True):
            c.prompt_len = n
        return made

    own = [c.choose(logits[i], torch.tensor(histories[i])) for i, c in enumerate(choosers())]
    assert choose_rows(choosers(), logits, histories) == own
    assert own[:3] != top[:3] and own[3] == top[3]  # each row's bias or penalty acted
    # rows alike but for one field each, beside a plain row of the same logits and history: a row
    # run through another's processors would choose what the plain one does
    same = logits[0].expand(4, vocab).clone()
    best = int(torch.argmax(same[0]))
    params = [SamplingParams(logit_bias=((best, -100.0),)), SamplingParams(presence_penalty=2.0),
              SamplingParams(frequency_penalty=2.0), SamplingParams()]  # fmt: skip
    histories, prompt_lens = [[best]] * 4, [0] * 4
    assert choose_rows(choosers(), same, histories)[3] == best
    assert all(i != best for i in choose_rows(choosers(), same, histories)[:3])
    for order in ([3, 0, 1, 2], [0, 3, 2, 1]):  # whichever row leads a group
        params, histories = [params[i] for i in order], [histories[i] for i in order]
        picks = choose_rows(choosers(), same, histories)
        assert [p == best for p in picks] == [not (pr.logit_bias or pr.presence_penalty or pr.frequency_penalty)
                                              for pr in params]  # fmt: skip
    # the penalties count the reply alone: the same history all prompt changes nothing
    prompt_only = TokenChooser(SamplingParams(presence_penalty=2.0))
    prompt_only.prompt_len = 3
    assert prompt_only.choose(logits[1], torch.tensor(histories[1])) == top[1]
