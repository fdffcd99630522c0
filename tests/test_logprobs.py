"""A token's log-probability (OpenAI's `logprobs`): the thinker's, on the wire, and as the HTTP
API writes it. In exact mode they are the log-softmax of the very logits transformers' thinker
`generate()` produces (its `output_logits`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.logprobs import FLOOR, TokenPieces
from omnistage.models import load_tokenizer, open_checkpoint
from omnistage.models.sampling import SamplingParams, TokenLogprobs, token_logprobs
from omnistage.v1 import gateway_pb2, stage_pb2
from omnistage.wire import StageError
from omnistage.wire.resume import Resume, Seen
from services import edges
from services.pipeline import PipelineRequest, TextEvent, received

PROMPT = "Can you explain how streaming works?"


def _scored(pipeline: Any, ids: list[int], params: SamplingParams) -> list[TextEvent]:
    events = list(pipeline.run(PipelineRequest(prompt_ids=ids, thinker=params, want_audio=False)))
    return [e for e in events if isinstance(e, TextEvent)]


def _generate_logits(reference: Any, ids: list[int], max_tokens: int, eos: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' thinker alone, greedy: its ids and each step's raw logits."""
    with torch.no_grad():
        out = reference.model.thinker.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens,
                                               do_sample=False, eos_token_id=eos, output_logits=True,
                                               return_dict_in_generate=True)  # fmt: skip
    return out.sequences[0, len(ids) :].tolist(), [lg[0] for lg in out.logits]


def _check_against_generate(pipeline: Any, reference: Any, top: int) -> None:
    ids = pipeline.prompt_ids(PROMPT)
    tokens = _scored(pipeline, ids, pipeline.thinker_defaults().with_overrides(max_tokens=16, logprobs=top))
    ref_ids, logits = _generate_logits(reference, ids, 16, pipeline.spec.im_end_id)
    assert [t.token_id for t in tokens] == ref_ids and len(ref_ids) > 3
    for t, lg in zip(tokens, logits, strict=True):
        logp = torch.log_softmax(lg.float(), dim=-1)
        assert t.logprobs is not None and len(t.logprobs.top) == top
        assert t.logprobs.logprob == pytest.approx(float(logp[t.token_id]), abs=1e-6)
        values, best = logp.topk(top)
        assert [i for i, _ in t.logprobs.top] == best.tolist()
        assert [v for _, v in t.logprobs.top] == pytest.approx(values.tolist(), abs=1e-6)
        if top:  # greedy: the token is the most likely
            assert t.logprobs.top[0][0] == t.token_id


@pytest.mark.parametrize("checkpoint", ["published", "variant"])
def test_qwen3_logprobs_are_those_of_generate_s_logits(checkpoints: Any, checkpoint: str) -> None:
    pipeline, reference = checkpoints(checkpoint)
    _check_against_generate(pipeline, reference, top=5)


def test_qwen2_5_logprobs_are_those_of_generate_s_logits(q25_checkpoints: Any) -> None:
    pipeline, reference = q25_checkpoints("published")
    _check_against_generate(pipeline, reference, top=0)


def test_a_sampled_reply_s_logprobs_are_the_model_s_not_the_warped_ones(pipeline: Any) -> None:
    """Temperature and top-k change which token is drawn, not the probabilities reported: the
    same tokens given as the reply (forced, greedy) get the same numbers."""
    ids = pipeline.prompt_ids(PROMPT)
    sampled = pipeline.thinker_defaults().with_overrides(do_sample=True, temperature=0.5, top_k=3, seed=7,
                                                         max_tokens=12, logprobs=2)  # fmt: skip
    drawn = _scored(pipeline, ids, sampled)
    reply = [t.token_id for t in drawn if t.token_id != pipeline.spec.im_end_id]
    given = pipeline.thinker_defaults().with_overrides(forced_ids=reply, max_tokens=len(reply) + 1, logprobs=2)
    forced = _scored(pipeline, ids, given)
    assert [t.token_id for t in forced][: len(reply)] == reply
    assert len(reply) > 3 and any(t.logprobs is not None and t.logprobs.top[0][0] != t.token_id for t in drawn)
    for a, b in zip(drawn, forced, strict=False):
        assert a.logprobs == b.logprobs


def test_no_logprobs_unless_asked(pipeline: Any) -> None:
    ids = pipeline.prompt_ids(PROMPT)
    tokens = _scored(pipeline, ids, pipeline.thinker_defaults().with_overrides(max_tokens=4))
    assert tokens and all(t.logprobs is None for t in tokens)


def test_sampling_refuses_a_count_out_of_range() -> None:
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="logprobs must be from 0 to 20"):
            SamplingParams(logprobs=bad)
    start = stage_pb2.Start(request_id="r")
    start.sampling["talker"].logprobs = 2
    with pytest.raises(StageError, match="logprobs is for the thinker only"):
        edges.check_start("thinker", start)
    start = stage_pb2.Start(request_id="r")
    start.sampling["thinker"].logprobs = 21
    with pytest.raises(StageError, match="thinker: sampling: logprobs must be from 0 to 20"):
        edges.sampling("thinker", start, SamplingParams())


def test_logprobs_cross_the_wire() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    rows = token_logprobs(logits, [1, 0], [2, 0])
    logp = torch.log_softmax(logits, dim=-1)
    assert rows[0].logprob == pytest.approx(float(logp[0, 1]))
    assert [i for i, _ in rows[0].top] == [2, 1] and rows[1].top == ()
    for row, token in zip(rows, [1, 0], strict=True):
        chunk = edges.text_chunk(3, token, None, row)
        assert edges.read_logprobs("thinker", received(chunk)) == [
            TokenLogprobs(pytest.approx(row.logprob), tuple((i, pytest.approx(v)) for i, v in row.top))]  # type: ignore[arg-type]
    assert edges.read_logprobs("thinker", received(edges.text_chunk(0, 5, "stop_id"))) is None
    # a replay's chunk over positions the caller has: cut to what is new (here nothing), still read
    for top in ((), ((5, -1.0),), ((5, -1.0), (6, -2.0), (7, -3.0))):
        resume = Resume()
        resume.delivered("thinker", 0, 1, False)
        chunk = received(edges.text_chunk(0, 5, "stop_id", TokenLogprobs(-1.0, top)))
        assert resume.classify("thinker", 0, 1, True) == Seen.OVERLAP
        assert edges.read_logprobs("thinker", resume.tail("thinker", chunk)) == []
    bad = received(edges.text_chunk(0, 5, None, TokenLogprobs(-1.0, ((5, -1.0),))))
    bad.tensors[edges.TOP_LOGPROBS] = torch.zeros(1, 3)
    with pytest.raises(StageError, match="top_logprobs"):
        edges.read_logprobs("thinker", bad)


def test_token_pieces_are_the_tokens_bytes(tiny_dir: Path) -> None:
    tok = load_tokenizer(open_checkpoint(tiny_dir))
    pieces = TokenPieces(tok)
    text = "héllo wörld ✓ streaming"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(bytes(pieces(i)[1]) for i in ids) == text.encode("utf-8")
    partial = 0
    for i in ids:
        piece, raw = pieces(i)
        try:
            assert piece == bytes(raw).decode("utf-8")
        except UnicodeDecodeError:  # part of a character: its text marks the part, its bytes are exact
            partial += 1
            assert "\ufffd" in piece
    assert partial, "the text should hold a character split over tokens"
    end = int(tok.convert_tokens_to_ids("<|im_end|>"))
    assert pieces(end) == ("<|im_end|>", list(b"<|im_end|>"))
    # the special tokens are those the reply's text leaves out (<|im_start|>, <tts_pad>, ...): their text
    hidden = {i for i in range(len(tok)) if tok.decode([i], skip_special_tokens=True) == ""}
    assert hidden == pieces.special and int(tok.convert_tokens_to_ids("<|im_start|>")) in hidden
    assert all(pieces(i)[0] == tok.convert_ids_to_tokens(i) for i in hidden)
    # one entry per token, a special one within the reply too, but the reply's end (a stop id)
    entries = pieces.entries([
        gateway_pb2.TokenLogprob(token_id=ids[0], logprob=float("-inf"),
                                 top=[gateway_pb2.TopLogprob(token_id=end, logprob=-0.5),
                                      gateway_pb2.TopLogprob(token_id=ids[1], logprob=float("nan"))]),
        *(gateway_pb2.TokenLogprob(token_id=i, logprob=-0.1) for i in sorted(hidden)),
    ], ends={end})  # fmt: skip
    assert [e["token"] for e in entries[1:]] == [tok.convert_ids_to_tokens(i) for i in sorted(hidden - {end})]
    assert entries[0]["logprob"] == FLOOR and entries[0]["bytes"] == pieces(ids[0])[1]
    assert entries[0]["top_logprobs"] == [{"token": "<|im_end|>", "logprob": -0.5, "bytes": list(b"<|im_end|>")},
                                          {"token": pieces(ids[1])[0], "logprob": FLOOR, "bytes": pieces(ids[1])[1]}]


def test_a_split_thinker_gives_the_single_one_s_logprobs(tiny_dir: Path, pipeline: Any) -> None:
    """The first token's come from the prefill role, the rest from the decode role."""
    from tests.test_pd_roles import _pd

    split = _pd(tiny_dir, prefill={"max_num_batched_tokens": 8})
    ids = pipeline.prompt_ids(PROMPT)
    params = pipeline.thinker_defaults().with_overrides(max_tokens=8, logprobs=3)
    a, b = _scored(pipeline, ids, params), _scored(split, ids, params)
    assert [t.token_id for t in a] == [t.token_id for t in b]
    for x, y in zip(a, b, strict=True):  # (a prefill in chunks of 8 sums in another order: not bitwise)
        assert x.logprobs is not None and y.logprobs is not None
        assert [i for i, _ in x.logprobs.top] == [i for i, _ in y.logprobs.top]
        assert y.logprobs.logprob == pytest.approx(x.logprobs.logprob, abs=1e-5)
        assert [v for _, v in y.logprobs.top] == pytest.approx([v for _, v in x.logprobs.top], abs=1e-5)
