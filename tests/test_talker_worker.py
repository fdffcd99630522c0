"""The talker stage's outgoing frames: on code2wav's schedule for a causal decoder, each frame
alone for one that looks ahead; every frame once, in order, whatever the schedule."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from omnistage.config import Code2WavConfig
from omnistage.engine import Request, ScheduledItem
from omnistage.models.sampling import SamplingParams
from omnistage.v1 import stage_pb2
from services import edges
from services.talker.worker import TalkerWorker


@dataclass
class _Spec:
    code2wav_causal: bool
    default_speaker: str = "v"
    max_positions: int = 10_000
    talker_vocab: int = 10_000

    def talker_stop_ids(self) -> tuple[int, ...]:
        return ()


@dataclass
class _State:
    total: int
    frames: int = 0
    stopped_on: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.stopped_on is not None


class _FakeTalker:
    """Makes one frame `[3]` per step (frame k holds k), `total` of them, then stops."""

    device = torch.device("cpu")

    def __init__(self, spec: _Spec, total: int) -> None:
        self.spec, self.total = spec, total

    def new_state(self, sampling: SamplingParams, speaker: str) -> _State:
        return _State(self.total)

    def step(self, items: list[tuple[_State, bool]]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for state, _ in items:
            out.append(torch.full((3,), state.frames))
            state.frames += 1
            if state.frames == state.total:
                state.stopped_on = "max_tokens"
        return out

    def release(self, state: _State) -> None:
        pass


def _sent(causal: bool, total: int, schedule: Code2WavConfig,
          starts: list[Any]) -> list[tuple[list[Any], list[Any]]]:  # fmt: skip
    """One request per Start, stepped together until each has made `total` frames: what each
    sent (up, down)."""
    worker = TalkerWorker(_FakeTalker(_Spec(causal), total), SamplingParams(), schedule)  # type: ignore[arg-type]
    reqs = [Request(start.request_id, start) for start in starts]
    for req in reqs:
        worker.open(req)
    sent: list[tuple[list[Any], list[Any]]] = [([], []) for _ in reqs]
    while not all(req.state.finished for req in reqs):
        outs = worker.execute([ScheduledItem(req, 1, False) for req in reqs])
        for (up, down), out in zip(sent, outs, strict=True):
            up += out.up
            down += out.down
    for req in reqs:
        worker.close(req)
    assert worker.held == {}  # nothing left for the requests once closed
    return sent


def _run_all(causal: bool, total: int, schedule: Code2WavConfig, requests: int = 1) -> list[list[Any]]:
    """`requests` requests stepped together until each has made `total` frames: what each sent down."""
    starts = [stage_pb2.Start(request_id=f"r{i}") for i in range(requests)]
    return [down for _, down in _sent(causal, total, schedule, starts)]


def _run(causal: bool, total: int, schedule: Code2WavConfig) -> list[Any]:
    return _run_all(causal, total, schedule)[0]


@pytest.mark.parametrize(
    ("first", "total", "sizes"),
    [
        # each chunk as long as what was sent before it, from the first chunk's size up to 5
        (3, 40, [3, 3, 5, 5, 5, 5, 5, 5, 4]),
        (3, 3, [3]),
        (3, 2, [2]),
        (3, 8, [3, 3, 2]),
        (1, 23, [1, 1, 2, 4, 5, 5, 5]),
        (7, 12, [7, 5]),  # a first chunk longer than chunk_frames
    ],
)
def test_a_causal_decoder_gets_its_frames_on_its_decode_schedule(first: int, total: int, sizes: list[int]) -> None:
    cfg = Code2WavConfig(base_port=7301, first_chunk_frames=first, chunk_frames=5, first_chunk_frames_idle=None)
    down = _run(True, total, cfg)
    frames = [c for c in down if edges.CODES in c.tensors]
    assert [c.length for c in frames] == sizes
    assert [c.offset for c in frames] == [sum(sizes[:i]) for i in range(len(sizes))]
    codes = torch.cat([c.tensors[edges.CODES] for c in frames], dim=1)
    assert codes.shape == (3, total) and codes[0].tolist() == list(range(total))
    assert down[-1].finished and down[-1].offset == total


def test_omit_codes_sends_the_frames_down_only_and_the_count_up() -> None:
    """A Start with omit_codes (the gateway's) gets only the finished chunk up, at the frame count;
    down goes the same as for one without, which gets every frame up too."""
    cfg = Code2WavConfig(base_port=7301, first_chunk_frames=2, chunk_frames=5)
    starts = [stage_pb2.Start(request_id=f"r{omit}", omit_codes=omit) for omit in (False, True)]
    up, down = zip(*_sent(True, 9, cfg, starts), strict=True)  # per request: [without, with]
    assert [(c.offset, c.length, c.finished) for c in down[0]] == [(c.offset, c.length, c.finished) for c in down[1]]
    assert all(torch.equal(a.tensors[edges.CODES], b.tensors[edges.CODES])
               for a, b in zip(down[0][:-1], down[1][:-1], strict=True))  # fmt: skip
    sent = [c for c in up[0] if edges.CODES in c.tensors]
    assert torch.cat([c.tensors[edges.CODES] for c in sent], dim=1)[0].tolist() == list(range(9))
    assert len(up[1]) == 1 and up[1][0].finished and not up[1][0].tensors and up[1][0].offset == 9
    assert up[0][-1].finished and up[0][-1].offset == 9


def test_a_lone_requests_first_chunk_is_the_idle_one_and_code2wav_is_told() -> None:
    """Made alone in its step, a request's first frame goes down at once marked decode_now (not on
    code2wav's own count); the chunks after it follow the schedule from there, unmarked."""
    cfg = Code2WavConfig(base_port=7301, first_chunk_frames=2, chunk_frames=5)  # first_chunk_frames_idle: 1
    down = _run(True, 12, cfg)
    frames = [c for c in down if edges.CODES in c.tensors]
    assert [c.length for c in frames] == [1, 1, 2, 4, 4]
    assert [c.meta.get(edges.DECODE_NOW, False) for c in frames] == [True, False, False, False, False]
    codes = torch.cat([c.tensors[edges.CODES] for c in frames], dim=1)
    assert codes[0].tolist() == list(range(12))


def test_requests_stepped_together_keep_the_first_chunk_of_the_schedule() -> None:
    cfg = Code2WavConfig(base_port=7301, first_chunk_frames=2, chunk_frames=5)
    for down in _run_all(True, 12, cfg, requests=2):
        frames = [c for c in down if edges.CODES in c.tensors]
        assert [c.length for c in frames] == [2, 2, 4, 4]
        assert not any(edges.DECODE_NOW in c.meta for c in frames)


def test_a_request_stepped_alone_beside_an_open_one_keeps_the_first_chunk_of_the_schedule() -> None:
    """Another request open in the talker (say, waiting for its thinker's first token) is a
    pipeline about to be busy: no idle first chunk, even in a step of one."""
    cfg = Code2WavConfig(base_port=7301, first_chunk_frames=2, chunk_frames=5)
    worker = TalkerWorker(_FakeTalker(_Spec(True), 12), SamplingParams(), cfg)  # type: ignore[arg-type]
    stepped, waiting = (Request(r, stage_pb2.Start(request_id=r)) for r in ("stepped", "waiting"))
    worker.open(stepped)
    worker.open(waiting)
    down = []
    while not down:
        (out,) = worker.execute([ScheduledItem(stepped, 1, False)])
        down = [c for c in out.down if edges.CODES in c.tensors]
    assert [c.length for c in down] == [2] and edges.DECODE_NOW not in down[0].meta
    worker.close(waiting)
    worker.close(stepped)


def test_a_decoder_that_looks_ahead_gets_each_frame_as_it_is_made() -> None:
    down = _run(False, 7, Code2WavConfig(base_port=7301, first_chunk_frames=3, chunk_frames=5))
    frames = [c for c in down if edges.CODES in c.tensors]
    assert [c.length for c in frames] == [1] * 7 and [c.offset for c in frames] == list(range(7))


def test_bad_thinker_rows_are_refused_as_they_arrive(pipeline: Any) -> None:
    """Rows that would fail the shared talker step (and every request in it) fail their own
    request when they arrive: NaN, media placeholders without hidden states, a NaN video rate.
    Rows in another float dtype (a bfloat16 thinker) are taken in the talker's."""
    from omnistage.wire import Code, DecodedChunk, StageError
    from omnistage.wire.tensor_blob import LENGTH_KEY

    worker = pipeline.workers["talker"]
    ids = torch.tensor(pipeline.prompt_ids("hi"))
    h = pipeline.spec.thinker_hidden
    media = torch.cat([ids[:2], torch.tensor([pipeline.spec.multimodal_ids[0]]), ids[2:]])

    def feed(tensors: dict[str, torch.Tensor], after_prompt: bool = False, length: int = 0) -> Request:
        req = Request("bad", stage_pb2.Start(request_id="bad"))
        worker.open(req)
        if after_prompt:  # a valid prompt first
            worker.feed(req, DecodedChunk({edges.PROMPT_IDS: ids, edges.PROMPT_EMBED: torch.zeros(len(ids), h)},
                                          {LENGTH_KEY: 0}, 0, 0, False))  # fmt: skip
        try:
            worker.feed(req, DecodedChunk(tensors, {LENGTH_KEY: length}, 0, 0, False))
        except StageError:
            worker.close(req)  # as the engine frees a failed request
            raise
        return req

    cases = [
        ({edges.PROMPT_IDS: ids, edges.PROMPT_EMBED: torch.full((len(ids), h), float("nan"))}, False, 0,
         "tensor 'prompt_embed' holds NaN or infinite values"),
        ({edges.PROMPT_IDS: media, edges.PROMPT_EMBED: torch.zeros(len(media), h)}, False, 0,
         "placeholders but no thinker hidden states"),
        ({edges.PROMPT_IDS: ids, edges.PROMPT_EMBED: torch.zeros(len(ids), h),
          "video_second_per_grid": torch.tensor([float("nan")])}, False, 0, "negative, NaN or infinite"),
        ({"ids": torch.tensor([1]), edges.EMBED: torch.full((1, h), float("inf"))}, True, 1, "holds NaN or infinite"),
    ]  # fmt: skip
    for tensors, after_prompt, length, message in cases:
        with pytest.raises(StageError) as err:
            feed(tensors, after_prompt, length)
        assert err.value.code == Code.INVALID_ARGUMENT and message in err.value.message, err.value.message
    req = feed({edges.PROMPT_IDS: ids, edges.PROMPT_EMBED: torch.zeros(len(ids), h, dtype=torch.bfloat16)})
    assert req.state.prompt[1].dtype == next(worker.talker.model.parameters()).dtype == torch.float32
    worker.close(req)
    assert "bad" not in worker.held
    # an empty finished chunk after tokens none of which was marked last: the talker cannot end its
    # speech on tts_eos then (it would talk on to max_tokens)
    req = feed({"ids": torch.tensor([1]), edges.EMBED: torch.zeros(1, h)}, True, 1)
    with pytest.raises(StageError, match="an empty finished chunk after the tokens"):
        worker.feed(req, DecodedChunk({}, {LENGTH_KEY: 0}, 1, 0, True))
    worker.close(req)


def test_a_stage_takes_its_own_default_max_tokens_back_but_not_more() -> None:
    """A client may send the default back (vLLM-Omni's examples ask the talker for generate()'s
    4096 frames) even where it is over the stage's limit; more than both is refused."""
    from omnistage.models.sampling import TALKER_DEFAULTS
    from omnistage.wire import StageError

    start = stage_pb2.Start(request_id="r")
    for limit, asked in ((2048, 4096), (2048, 2048), (8192, 8192)):
        start.sampling["talker"].max_tokens = asked
        assert edges.sampling("talker", start, TALKER_DEFAULTS, limit).max_tokens == asked
    for limit, asked, why in ((2048, 4097, "this stage's default"), (8192, 8193, "the model's positions")):
        start.sampling["talker"].max_tokens = asked
        with pytest.raises(StageError) as e:
            edges.sampling("talker", start, TALKER_DEFAULTS, limit, "the model's positions")
        assert f"max_tokens {asked} exceeds this stage's limit {max(limit, 4096)} ({why})" in str(e.value)


def test_stop_ids_are_ids_of_the_vocabulary_and_the_talker_keeps_its_codec_end() -> None:
    """`stop_ids` replace a stage's own: out of the vocabulary they are refused (the thinker ran
    to max_tokens), and the talker's must keep its codec end (without it the talker emitted the
    end as a code, which code2wav refused after the speech had streamed)."""
    from omnistage.models.sampling import TALKER_DEFAULTS, SamplingParams
    from omnistage.wire import StageError

    thinker_defaults = SamplingParams(stop_ids=(9,))
    start = stage_pb2.Start(request_id="r")
    for stage, defaults, stops, message in (
        ("thinker", thinker_defaults, [-1], "stop_ids outside the vocabulary (0..499): [-1]"),
        ("thinker", thinker_defaults, [7, 1 << 62], "stop_ids outside the vocabulary (0..499): [4611686018427387904]"),
        ("talker", TALKER_DEFAULTS, [-1], "stop_ids outside the vocabulary (0..499): [-1]"),
        ("talker", TALKER_DEFAULTS, [5], "stop_ids must keep [300]"),
    ):  # fmt: skip
        start.sampling[stage].ClearField("stop_ids")
        start.sampling[stage].stop_ids.extend(stops)
        with pytest.raises(StageError, match=re.escape(f"{stage}: sampling: {message}")):
            edges.sampling(stage, start, defaults, vocab=500, required_stop_ids=(300,) if stage == "talker" else ())
    start.sampling["talker"].ClearField("stop_ids")
    start.sampling["talker"].stop_ids.extend([300, 5])  # the codec end, and one more
    assert edges.sampling("talker", start, TALKER_DEFAULTS, vocab=500, required_stop_ids=(300,)).stop_ids == (300, 5)
    start.sampling["thinker"].ClearField("stop_ids")
    start.sampling["thinker"].stop_ids.append(7)  # the thinker may replace its own (to run to max_tokens)
    assert edges.sampling("thinker", start, thinker_defaults, vocab=500).stop_ids == (7,)


def _fed(pipeline: Any, req: Request) -> Request:
    """`req` opened on the pipeline's talker worker and fed a prompt and two tokens (seeded
    random rows), so its next step runs the talker's prompt."""
    from omnistage.wire import DecodedChunk
    from omnistage.wire.tensor_blob import LENGTH_KEY

    worker = pipeline.workers["talker"]
    ids = torch.tensor(pipeline.prompt_ids("hi"))
    h = pipeline.spec.thinker_hidden
    g = torch.Generator().manual_seed(0)
    prompt = {edges.PROMPT_IDS: ids, edges.PROMPT_EMBED: torch.randn(len(ids), h, generator=g),
              edges.PROMPT_HIDDEN: torch.randn(len(ids), h, generator=g)}  # fmt: skip
    tokens = {"ids": torch.tensor([1, 2]), edges.EMBED: torch.randn(2, h, generator=g)}
    if pipeline.spec.talker_needs_hidden:
        tokens[edges.HIDDEN] = torch.randn(2, h, generator=g)
    worker.open(req)
    worker.feed(req, DecodedChunk(prompt, {LENGTH_KEY: 0}, 0, 0, False))
    worker.feed(req, DecodedChunk(tokens, {LENGTH_KEY: 2}, 0, 0, False))
    return req


@pytest.mark.parametrize("family", ["qwen3_omni", "qwen2_5_omni"])
def test_a_code_that_cannot_be_chosen_fails_its_request_alone(family: str, request: pytest.FixtureRequest) -> None:
    """A sampled request whose talker logits are no distribution (NaN) fails with a clear error
    (raised out of the shared step it would fail every request in it); the request beside it gets
    the code it gets alone (its draw is made once)."""
    from omnistage.wire import Code, StageError
    from tests.conftest import staged_pipeline

    pipeline = request.getfixturevalue("pipeline") if family == "qwen3_omni" else \
        staged_pipeline(request.getfixturevalue("q25_dir"))  # fmt: skip
    worker = pipeline.workers["talker"]

    def ready(name: str) -> Request:
        start = stage_pb2.Start(request_id=name)
        start.sampling["talker"].do_sample = True
        start.sampling["talker"].seed = 5
        return _fed(pipeline, Request(name, start))

    def step(reqs: list[Request]) -> list[Any]:
        try:
            return worker.execute([ScheduledItem(r, 1, False) for r in reqs])
        finally:
            for r in reqs:
                worker.close(r)

    alone = ready("alone")
    step([alone])
    good, bad = ready("good"), ready("bad")

    def nan_last_row(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[..., -1, :] = float("nan")  # the step's last row: the second request's last prompt position
        return out

    hook = worker.talker.model.codec_head.register_forward_hook(nan_last_row)
    try:
        good_out, bad_out = step([good, bad])
    finally:
        hook.remove()
    assert isinstance(bad_out, StageError) and bad_out.code == Code.INTERNAL
    assert "talker: no code could be chosen" in bad_out.message and "not a distribution" in bad_out.message
    assert not isinstance(good_out, Exception)
    assert good.state.history == alone.state.history and good.state.frames == alone.state.frames == 1  # drawn once


def test_a_qwen2_5_code_token2wav_cannot_take_fails_as_a_model_failure(q25_dir: Any) -> None:
    """Qwen2.5-Omni's talker may pick an id past token2wav's codebook (generate() suppresses only
    the start id): the talker fails that request with INTERNAL naming the code, not code2wav with
    INVALID_ARGUMENT (a client's 400) after the frame went down."""
    from omnistage.wire import Code, StageError
    from tests.conftest import staged_pipeline

    pipeline = staged_pipeline(q25_dir)
    worker = pipeline.workers["talker"]
    spec = pipeline.spec
    stops = set(spec.talker_stop_ids()) | {spec.codec_bos_id}
    beyond = next(i for i in range(spec.codebook_size, spec.talker_vocab) if i not in stops)
    start = stage_pb2.Start(request_id="beyond")
    start.sampling["talker"].do_sample = False  # (the family's default samples)
    req = _fed(pipeline, Request("beyond", start))

    def favour_beyond(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[..., beyond] = out.abs().amax() + 10  # greedy picks it
        return out

    hook = worker.talker.model.codec_head.register_forward_hook(favour_beyond)
    try:
        [got] = worker.execute([ScheduledItem(req, 1, False)])
    finally:
        hook.remove()
        worker.close(req)
    assert isinstance(got, StageError) and got.code == Code.INTERNAL, got
    assert got.message.startswith("talker: ") and f"codec id {beyond} at frame 0" in got.message, got.message
    assert f"[0, {spec.codebook_size})" in got.message
    assert req.state.frames == 0  # no frame of it was handed out
