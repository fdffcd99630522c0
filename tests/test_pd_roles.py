"""The thinker's prefill and decode roles in process (services/pipeline.py with
`thinker.disaggregated`): the KV cache and the decode state pass between them as chunks, and
the output is the single thinker's, bitwise, on more than one checkpoint; prompts prefilled
over several chunks stream their cache chunk by chunk; mismatched roles are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import media
from omnistage.config import ConfigError, parse_config
from omnistage.models.sampling import SamplingParams
from omnistage.wire import Code, StageError
from services import edges
from services.pipeline import InProcessPipeline, PipelineRequest

PROMPTS = ["Tell me a short story about a robot who learns to sing.", "hi", "Where is the nearest train station?"]


def _pd(model_dir: Path, **thinker: Any) -> InProcessPipeline:
    return InProcessPipeline(model_dir, parse_config({"thinker": {"disaggregated": True, **thinker}}))


def _run(pipe: InProcessPipeline, ids: list[int], thinker: SamplingParams, want_audio: bool = True) -> Any:
    return list(pipe.run(PipelineRequest(ids, thinker, SamplingParams(max_tokens=30), want_audio=want_audio)))[-1]


@pytest.fixture(scope="module", params=["published", "variant"])
def pair(request: pytest.FixtureRequest, tiny_dir: Path, tiny_variant_dir: Path) -> tuple[Any, Any]:
    """(single thinker, split thinker) on the same checkpoint; the split one prefills at most 8
    tokens a step, so every prompt's cache crosses in several chunks."""
    model = tiny_dir if request.param == "published" else tiny_variant_dir
    single = InProcessPipeline(model, parse_config({"thinker": {"max_num_batched_tokens": 8}}))
    return single, _pd(model, prefill={"max_num_batched_tokens": 8})


@pytest.mark.parametrize("max_tokens", [1, 2, 24])  # 1: the prefill's token is the last
def test_split_thinker_equals_the_single_one(pair: tuple[Any, Any], max_tokens: int) -> None:
    single, split = pair
    for prompt in PROMPTS:
        ids = single.prompt_ids(prompt)
        assert len(ids) > 8  # several prefill chunks
        greedy = single.thinker_defaults().with_overrides(max_tokens=max_tokens)
        a, b = _run(single, ids, greedy), _run(split, ids, greedy)
        assert len(a.token_ids) == min(max_tokens, len(a.token_ids)) and a.token_ids
        assert b.token_ids == a.token_ids
        assert torch.equal(b.codes, a.codes)
        assert b.thinker_stopped_on == a.thinker_stopped_on
        assert _run(split, ids, greedy, want_audio=False).token_ids == a.token_ids


def test_a_seeded_sampler_goes_on_where_the_prefill_left_it(pair: tuple[Any, Any]) -> None:
    """The sampler's random state crosses with the cache: the same sampled stream."""
    single, split = pair
    ids = single.prompt_ids(PROMPTS[0])
    params = single.thinker_defaults().with_overrides(max_tokens=24, do_sample=True, temperature=1.5, seed=1234)
    a, b = _run(single, ids, params), _run(split, ids, params)
    greedy = _run(single, ids, params.with_overrides(do_sample=False))
    assert a.token_ids != greedy.token_ids, "the sampler must matter for this check to mean anything"
    assert b.token_ids == a.token_ids and torch.equal(b.codes, a.codes)


def test_a_video_at_a_fractional_rate_crosses_the_split(pair: tuple[Any, Any]) -> None:
    """After a video whose seconds per grid times the checkpoint's position_id_per_seconds is
    not whole, every later position is fractional (float32): the handoff keeps it so (it was
    cut to an int, and the decode diverged from its second token)."""
    single, split = pair
    frames = media.video(3, 48, 64, seed=3)
    messages = [{"role": "user", "content": [{"type": "video", "video": frames, "fps": 1.5, "audio": None},
                                             {"type": "text", "text": "What is it?"}]}]  # fmt: skip
    ids, inputs = single.family.input_builder(single.checkpoint, single.tokenizer).build(messages, False)
    per_second = single.checkpoint.config.thinker_config.position_id_per_seconds
    step = float(inputs["video_second_per_grid"][0]) * per_second
    assert step != int(step), "the video's positions must be fractional for this check to mean anything"
    greedy = single.thinker_defaults().with_overrides(max_tokens=12)

    def run(pipe: InProcessPipeline) -> Any:
        return list(pipe.run(PipelineRequest(ids, greedy, SamplingParams(max_tokens=16), multimodal=inputs)))[-1]

    a, b = run(single), run(split)
    assert len(a.token_ids) > 1
    assert b.token_ids == a.token_ids and torch.equal(b.codes, a.codes)


@pytest.mark.parametrize("bad", ["position_axes", "position_text_axis", "position_nan", "sampler_state",
                                 "no_sampler_state"])  # fmt: skip
def test_a_bad_handoff_fails_its_request_invalid_argument(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                         bad: str) -> None:  # fmt: skip
    """A handoff whose decode state cannot be right is refused when it is adopted, before any
    step it would share with other requests (an index error there would fail them all): the
    last position must have the text axis and three M-RoPE axes, finite, the text axis at the
    prompt's end; a sampled request needs a sampler state that loads."""
    pipe = _pd(tiny_dir)
    prefill = pipe.engines["thinker-prefill"].worker.thinker
    real = prefill.decode_state

    def decode_state(state: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos, gen = real(state)
        if bad == "position_axes":
            pos = pos[:1]
        elif bad == "position_text_axis":
            pos = pos + 1
        elif bad == "position_nan":
            pos = pos.float().clone()
            pos[2] = float("nan")
        elif bad == "sampler_state":
            gen = torch.zeros_like(gen)
        else:
            gen = None
        return pos, gen

    monkeypatch.setattr(prefill, "decode_state", decode_state)
    params = pipe.thinker_defaults().with_overrides(max_tokens=4)
    if bad.endswith("sampler_state"):
        params = params.with_overrides(do_sample=True, seed=7)
    with pytest.raises(StageError) as err:
        _run(pipe, pipe.prompt_ids("hi"), params)
    assert err.value.code == Code.INVALID_ARGUMENT, err.value
    want = {"position_axes": "last position of shape [1, 1, 1]", "position_text_axis": "on the text axis",
            "position_nan": "finite values", "sampler_state": "sampler state: Invalid",
            "no_sampler_state": "carries no sampler state"}[bad]  # fmt: skip
    assert err.value.message.startswith("thinker-decode:") and want in err.value.message, err.value.message
    assert pipe.engines["thinker-decode"].idle


def test_a_request_the_decode_role_cannot_hold_is_refused_at_its_kv_header(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Its demand is known from the KV header: a request over the decode role's cache is refused
    INVALID_ARGUMENT there (no retry helps), not after its whole cache has crossed and been rebuilt. (In
    process the header and the first KV chunk are taken in one engine iteration; a stage's
    transport reads no KV before the request is admitted.)"""
    pipe = _pd(tiny_dir, prefill={"max_num_batched_tokens": 8}, decode={"cache_capacity_tokens": 24})
    decode = pipe.engines["thinker-decode"].worker
    fed: list[int] = []
    real = decode.feed
    monkeypatch.setattr(decode, "feed", lambda req, chunk: (fed.append((chunk.offset, chunk.length)),
                                                            real(req, chunk))[1])  # fmt: skip
    ids = pipe.prompt_ids(PROMPTS[0])
    assert len(ids) > 3 * 8
    with pytest.raises(StageError) as err:
        _run(pipe, ids, pipe.thinker_defaults().with_overrides(max_tokens=4))
    assert err.value.code == Code.INVALID_ARGUMENT and "cache_capacity_tokens=24" in err.value.message
    assert fed == [(0, 0), (0, 4)]  # the header and the first prefill chunk (4: half the 8-token budget), no more
    assert pipe.engines["thinker-decode"].idle


def test_adopt_refuses_a_first_token_outside_the_vocabulary(pair: tuple[Any, Any]) -> None:
    single, _ = pair
    thinker = single.thinker
    state = thinker.new_state(single.thinker_defaults())
    ids = single.prompt_ids("hi")
    position = torch.full((4, 1, 1), len(ids) - 1)
    for token in (-1, single.spec.thinker_vocab):
        with pytest.raises(ValueError, match=f"first token {token} outside the vocabulary"):
            thinker.adopt(state, ids, token, None, position, None, [])


def test_the_decode_role_keeps_no_cache_after_a_request(pair: tuple[Any, Any]) -> None:
    _, split = pair
    _run(split, split.prompt_ids("hi"), split.thinker_defaults().with_overrides(max_tokens=4))
    for name in ("thinker-prefill", "thinker-decode"):
        assert split.engines[name].idle
        assert split.engines[name].scheduler.stats()["reserved_tokens"] == 0


def test_roles_that_differ_are_refused_naming_the_difference(tiny_dir: Path) -> None:
    """A decode role in another dtype: FAILED_PRECONDITION naming the cache layout. (One deploy
    file that says so is refused at start; each role's process may be given its own, or its own
    `--dtype`, as compose and Kubernetes run them.)"""
    with pytest.raises(ConfigError, match="must agree"):
        _pd(tiny_dir, decode={"dtype": "bfloat16"})
    cfg = parse_config({"thinker": {"disaggregated": True}})
    cfg.thinker.decode.dtype = "bfloat16"  # what the decode role's own process would run
    pipe = InProcessPipeline(tiny_dir, cfg)
    with pytest.raises(StageError) as err:
        _run(pipe, pipe.prompt_ids("hi"), pipe.thinker_defaults().with_overrides(max_tokens=4))
    assert err.value.code == Code.FAILED_PRECONDITION
    assert "kv_layout" in err.value.message and "dtype=bfloat16" in err.value.message
    assert "thinker_fingerprint" not in err.value.message  # the same checkpoint


def test_a_sampler_state_from_another_device_type_is_refused(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:  # fmt: skip
    """A prefill role on CUDA hands over a 16-byte Philox state; a CPU decode role's generator
    cannot take it: FAILED_PRECONDITION saying so (not INTERNAL from set_state). Greedy
    requests, which carry no sampler state, still cross."""
    pipe = _pd(tiny_dir)
    prefill = pipe.engines["thinker-prefill"].worker.thinker
    real = prefill.decode_state
    monkeypatch.setattr(prefill, "decode_state", lambda state: (real(state)[0], torch.zeros(16, dtype=torch.uint8)))
    ids = pipe.prompt_ids("hi")
    sampled = pipe.thinker_defaults().with_overrides(max_tokens=4, do_sample=True, seed=7)
    with pytest.raises(StageError) as err:
        _run(pipe, ids, sampled)
    assert err.value.code == Code.FAILED_PRECONDITION
    assert "sampler state (16 bytes) does not fit this role's cpu generator" in err.value.message
    monkeypatch.setattr(prefill, "decode_state", lambda state: (real(state)[0], None))  # greedy: no state
    assert _run(pipe, ids, pipe.thinker_defaults().with_overrides(max_tokens=4)).token_ids


def test_check_kv_meta_names_each_difference() -> None:
    mine = {"omnistage_version": "1", "thinker_fingerprint": "abc", "kv_layout": "layers=2"}
    ok = {**mine, edges.PROMPT_TOKENS: 5}
    assert edges.check_kv_meta("thinker-decode", ok, mine) == 5
    with pytest.raises(StageError, match="thinker_fingerprint: prefill has 'xyz', decode has 'abc'") as err:
        edges.check_kv_meta("thinker-decode", {**ok, "thinker_fingerprint": "xyz"}, mine)
    assert err.value.code == Code.FAILED_PRECONDITION
    for bad in (0, "5", True, None):
        with pytest.raises(StageError, match=edges.PROMPT_TOKENS):
            edges.check_kv_meta("thinker-decode", {**mine, edges.PROMPT_TOKENS: bad}, mine)


def test_each_roles_cache_is_sized_by_what_it_reserves(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill role's cache holds the prompt (its reservation: prompt + first token), the
    decode role's the prompt and every token it may make: neither grows past its reservation."""
    from omnistage.models.kv_caches import SlotCache

    limits: list[int | None] = []
    made = SlotCache.for_model.__func__  # type: ignore[attr-defined]

    def spy(cls: type, config: Any, limit: int | None = None) -> Any:
        limits.append(limit)
        return made(cls, config, limit)

    monkeypatch.setattr(SlotCache, "for_model", classmethod(spy))
    split = _pd(tiny_dir)
    ids = split.prompt_ids(PROMPTS[0])
    _run(split, ids, split.thinker_defaults().with_overrides(max_tokens=24), want_audio=False)
    assert limits == [len(ids) + 1, len(ids) + 24]  # prefill role, then decode role


def test_the_decode_role_refuses_kv_before_its_header(pair: tuple[Any, Any]) -> None:
    """The first chunk must be the header (no KV): KV first is INVALID_ARGUMENT, naming it."""
    from benchmarks.stages import make_start
    from omnistage.engine import Request
    from services.pipeline import received

    _, split = pair
    decode = split.engines["thinker-decode"].worker
    req = Request("kv-first", make_start(split.thinker_defaults(), SamplingParams()))
    decode.open(req)
    layout = decode.layout
    shape = (1, int(layout["kv_heads"]), 2, int(layout["head_dim"]))
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(int(layout["layers"]))]
    with pytest.raises(StageError, match="the first chunk must be the KV header") as err:
        decode.feed(req, received(edges.kv_chunk(0, kv)))
    assert err.value.code == Code.INVALID_ARGUMENT
    decode.close(req)


def test_a_fast_decode_role_adopts_the_cache_into_its_token_pool(tiny_dir: Path) -> None:
    """In fast batching the decode role keeps each adopted cache in its thinker's token pool (and
    gives it back), and the prefill role keeps its own caches (their KV chunks are read after its
    request ends there); the split thinker's tokens are the single fast thinker's."""
    fast = {"batching": "fast"}
    single = InProcessPipeline(tiny_dir, parse_config({"thinker": fast}))
    split = _pd(tiny_dir, prefill=fast, decode=fast)
    for prompt in PROMPTS:
        ids = single.prompt_ids(prompt)
        greedy = single.thinker_defaults().with_overrides(max_tokens=12)
        assert _run(split, ids, greedy, want_audio=False).token_ids == _run(single, ids, greedy, False).token_ids
    decode, prefill = (split.workers[f"thinker-{r}"].thinker for r in ("decode", "prefill"))
    assert decode.batching.fast and decode.pool_kv and not prefill.pool_kv and prefill.batching.token_pool is None
    pool = decode.batching.token_pool
    assert pool is not None and not pool.ranges and pool.k[0] is None  # made, and every range given back
    assert split.engines["thinker-decode"].load()["kv_pool_tokens"] == 0
