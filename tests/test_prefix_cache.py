"""The thinker's prefix cache (models/prefix_cache.py, thinker.prefix_cache_tokens): a prompt that
starts with what an ended request fed prefills only the rest and encodes only the media after it,
and gives what prefilling it whole gives (the same tokens; its numbers to the last bits only)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import media
from omnistage.config import DeployConfig, parse_config
from omnistage.models import load_tokenizer, open_checkpoint
from omnistage.models.prefix_cache import MediaItem, Prefix, PrefixCache
from omnistage.models.sampling import SamplingParams
from services.pipeline import DoneEvent, PipelineRequest
from tests.conftest import TEST_DEVICE, staged_pipeline

RATE = 16_000


def _run(thinker: Any, ids: list[int], mm: dict[str, Any] | None = None, max_tokens: int = 8,
         finish: bool = True, in_video: bool = False) -> tuple[list[int], Any, int]:  # fmt: skip
    """(reply ids, the prompt's output, positions taken from the cache) of one greedy request,
    stepped as the engine steps it: its prefill from the cached positions, then its decodes."""
    state = thinker.new_state(SamplingParams(max_tokens=max_tokens))
    thinker.set_prompt(state, ids, mm, in_video)
    cached = state.cached
    (step,) = thinker.step([(state, cached, len(ids) - cached)])
    out, prompt = [step.token.token_id], step.prompt
    while finish and not state.finished:
        (step,) = thinker.step([(state, len(state.history) - 1, 1)])
        out.append(step.token.token_id)
    thinker.release(state)
    return out, prompt, cached


@pytest.fixture(scope="module")
def cached_pipeline(tiny_dir: Path) -> Any:
    return staged_pipeline(tiny_dir, parse_config({"thinker": {"prefix_cache_tokens": 4096}}))


class Model:
    """A thinker with a prefix cache, one without (None where not needed), and the checkpoint's
    family, tokenizer and input builder."""

    def __init__(self, thinker: Any, plain: Any, family: Any, tokenizer: Any, builder: Any) -> None:
        self.thinker, self.plain, self.family, self.tokenizer, self.builder = thinker, plain, family, tokenizer, builder

    @classmethod
    def load(cls, path: Path, batching: str) -> Model:
        ckpt = open_checkpoint(path)
        tokenizer = load_tokenizer(ckpt)
        thinker, plain = (ckpt.family.thinker(ckpt, "float32", TEST_DEVICE, batching) for _ in range(2))
        thinker.keep_prefixes(4096)
        return cls(thinker, plain, ckpt.family, tokenizer, ckpt.family.input_builder(ckpt, tokenizer))

    def build(self, messages: list[dict[str, Any]], kind: str) -> tuple[list[int], dict[str, Any]]:
        if kind == "text":
            return self.family.prompt_ids(self.tokenizer, messages), {}
        return self.builder.build(messages, use_audio_in_video=kind == "audio-in-video")  # type: ignore[no-any-return]


def _turns(kind: str) -> list[list[dict[str, Any]]]:
    """A conversation's first turn's messages and its second user turn."""
    if kind == "text":
        first: list[Any] | str = "Tell me about the sea."
        second: list[Any] | str = "And about the sky?"
    else:  # the first turn's media, then a new clip (shorter: the first's features stay as they were)
        tone, image, video = media.tone(1.5, RATE, 300.0, seed=1), media.image(40, 56, seed=2), media.video(4, 32, 48)
        first = {"audio+image": [{"type": "audio", "audio": tone}, {"type": "image", "image": image}],
                 "image+video": [{"type": "image", "image": image},
                                 {"type": "video", "video": video, "fps": 2.0, "audio": None}],
                 "audio-in-video": [{"type": "video", "video": video, "fps": 2.0, "audio": tone}]}[kind]
        first = [*first, {"type": "text", "text": "What is it?"}]
        second = [{"type": "audio", "audio": media.tone(1.0, RATE, 500.0, seed=3)}]
    system = {"role": "system", "content": "Answer briefly."}
    return [[system, {"role": "user", "content": first}], [{"role": "user", "content": second}]]


def _conversation(model: Model, kind: str) -> tuple[Any, Any, Any, Any]:
    """(first prompt, its inputs, second prompt, its inputs): the first turn run on the cached
    thinker, its reply in the second turn's messages."""
    first, second = _turns(kind)
    ids1, mm1 = model.build(first, kind)
    reply, _, _ = _run(model.thinker, ids1, mm1, in_video=kind == "audio-in-video")
    messages = [*first, {"role": "assistant", "content": model.tokenizer.decode(reply, skip_special_tokens=True)},
                *second]  # fmt: skip
    ids2, mm2 = model.build(messages, kind)
    return ids1, mm1, ids2, mm2


@pytest.fixture(scope="module")
def models(tiny_dir: Path, tiny_variant_dir: Path, q25_dir: Path) -> Any:
    made: dict[tuple[str, str], Model] = {}
    paths = {"qwen3": tiny_dir, "qwen3-variant": tiny_variant_dir, "qwen2_5": q25_dir}

    def get(checkpoint: str, batching: str = "exact") -> Model:
        if (checkpoint, batching) not in made:
            made[checkpoint, batching] = Model.load(paths[checkpoint], batching)
        model = made[checkpoint, batching]
        model.thinker.keep_prefixes(4096)  # empty: what other tests kept gone
        return model

    return get


@pytest.mark.parametrize(("checkpoint", "batching", "kind"), [
    *((c, b, k) for c, b in (("qwen3", "exact"), ("qwen3", "fast"), ("qwen3-variant", "exact"), ("qwen2_5", "exact"),
                             ("qwen2_5", "fast")) for k in ("text", "audio+image")),
    ("qwen3", "exact", "image+video"), ("qwen3", "exact", "audio-in-video"), ("qwen2_5", "exact", "image+video"),
])  # fmt: skip
def test_the_next_turn_prefills_only_what_is_new(models: Any, checkpoint: str, batching: str, kind: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The second turn takes the first turn's prompt (and reply, as far as its ids are the same)
    from the cache; its media there are not encoded again; its tokens are those of a thinker with
    no cache, its prompt's embeddings and hidden states within 1e-4 (the embeddings the same for a
    text prompt)."""
    model = models(checkpoint, batching)
    ids1, _, ids2, mm2 = _conversation(model, kind)
    assert ids2[: len(ids1)] == ids1
    encoded: list[int] = []
    tower = model.thinker.model.model if hasattr(model.thinker.model.model, "get_audio_features") else \
        model.thinker.model  # fmt: skip
    for name in ("get_audio_features", "get_image_features", "get_video_features"):
        real = getattr(tower, name)

        def counted(x: torch.Tensor, *args: Any, real: Any = real, **kwargs: Any) -> Any:
            encoded.append(x.shape[0])
            return real(x, *args, **kwargs)

        monkeypatch.setattr(tower, name, counted)
    in_video = kind == "audio-in-video"
    reply, prompt, cached = _run(model.thinker, ids2, mm2, in_video=in_video)
    assert len(ids1) <= cached < len(ids2)
    if kind != "text":
        assert encoded == [1], f"only the new turn's audio is encoded, not the first turn's media: {encoded}"
    monkeypatch.undo()
    want, whole, none = _run(model.plain, ids2, mm2, in_video=in_video)
    assert none == 0 and model.plain.prefixes is None
    assert reply == want
    if kind == "text":
        assert torch.equal(prompt.embeds, whole.embeds)
    else:  # the first clip's encoder rows, encoded alone: the audio tower pads a batch of clips (~1e-6)
        assert torch.allclose(prompt.embeds, whole.embeds, atol=1e-4, rtol=0)
    assert torch.allclose(prompt.hidden, whole.hidden, atol=1e-4, rtol=0)


def test_other_media_in_the_same_place_are_not_taken_from_the_cache(models: Any) -> None:
    """The same ids with another clip of the same length: the prefix holds up to that clip."""
    model = models("qwen3")
    thinker = model.thinker
    ids1, _, ids2, mm2 = _conversation(model, "audio+image")
    other = dict(mm2)
    other["input_features"] = mm2["input_features"].clone()
    other["input_features"][0, :, 5] += 0.5  # the first clip, one frame
    state = thinker.new_state(SamplingParams(max_tokens=1))
    thinker.set_prompt(state, ids2, other)
    first_audio = min(item.start for item in state.media if item.kind == "audio")
    assert 0 < state.cached <= first_audio
    thinker.release(state)
    state = thinker.new_state(SamplingParams(max_tokens=1))
    thinker.set_prompt(state, ids2, mm2)
    assert state.cached >= len(ids1)
    thinker.release(state)


def test_a_request_that_did_not_end_by_itself_is_not_kept(models: Any) -> None:
    model = models("qwen3")
    thinker = model.thinker
    ids = model.build([{"role": "user", "content": "A question that will be cancelled."}], "text")[0]
    _run(thinker, ids, finish=False, max_tokens=8)  # released after its first token: a cancelled request
    assert len(thinker.prefixes) == 0
    _run(thinker, ids)
    assert len(thinker.prefixes) == 1
    (entry,) = thinker.prefixes._entries.values()
    kept = [entry.embeds, entry.hidden, *(t for kv in entry.kv for t in kv)]
    assert not any(t.requires_grad for t in kept), "kept outside the steps: no autograd graph held with it"
    assert _run(thinker, ids)[2] == len(ids) - 1  # the same prompt again: all but its last token


def test_the_served_thinker_schedules_only_the_rest(cached_pipeline: Any, pipeline: Any) -> None:
    """Through the stage's worker and engine: the second turn's prefill is the tokens after the
    cached ones, and the whole pipeline's reply (text and codes) is the uncached one's. (The talker
    takes no hidden states for a text prompt, and the embeddings are the same: so, with the same
    tokens, the same codes.)"""
    cached_pipeline.thinker.keep_prefixes(4096)
    model = Model(cached_pipeline.thinker, None, cached_pipeline.family, cached_pipeline.tokenizer, None)
    ids1, _, ids2, _ = _conversation(model, "text")
    engine = cached_pipeline.engines["thinker"]
    before = engine.scheduler.stats()["total_prefill_tokens"]
    sampling, talker = SamplingParams(max_tokens=6), SamplingParams(max_tokens=30)  # greedy
    done = [e for e in cached_pipeline.run(PipelineRequest(ids2, sampling, talker)) if isinstance(e, DoneEvent)]
    prefilled = engine.scheduler.stats()["total_prefill_tokens"] - before
    assert len(ids2) - prefilled >= len(ids1)
    want = [e for e in pipeline.run(PipelineRequest(ids2, sampling, talker)) if isinstance(e, DoneEvent)]
    assert done[0].token_ids == want[0].token_ids
    assert done[0].codes.shape[1] > 1 and torch.equal(done[0].codes, want[0].codes)


def _entry(ids: list[int], items: tuple[MediaItem, ...] = ()) -> Prefix:
    n = len(ids)
    return Prefix(torch.tensor(ids), items, [(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2))],
                  torch.zeros(n, 2), torch.zeros(n, 2))  # fmt: skip


def test_the_cache_keeps_the_longest_prefixes_within_its_bound() -> None:
    cache = PrefixCache(10)
    cache.add(_entry([1, 2, 3]))
    cache.add(_entry([1, 2, 3, 4, 5]))  # the same conversation, a turn on: the shorter one goes
    assert len(cache) == 1 and cache.tokens == 5
    assert cache.match(torch.tensor([1, 2, 3, 4, 5, 6, 7]), [])[0] == 5
    assert cache.match(torch.tensor([1, 2, 3, 4, 5]), [])[0] == 4, "the last prompt token is always fed"
    assert cache.match(torch.tensor([1, 2, 9]), [])[0] == 2
    assert cache.match(torch.tensor([7, 8]), []) == (0, None)
    cache.add(_entry([7, 8, 9, 10]))
    cache.add(_entry([5, 5, 5]))  # 12 tokens: the least recently used ([1..5]) goes
    assert len(cache) == 2 and cache.tokens == 7 and cache.match(torch.tensor([1, 2, 3]), [])[0] == 0
    cache.add(_entry(list(range(11))))  # larger than the whole bound: not kept
    assert len(cache) == 2


def test_a_prefix_ends_before_a_media_item_it_does_not_hold_whole_or_the_same() -> None:
    audio = MediaItem("audio", 2, 6, b"a")
    cache = PrefixCache(100)
    cache.add(_entry([1, 2, 3, 3, 3, 3, 4, 5], (audio,)))
    prompt = torch.tensor([1, 2, 3, 3, 3, 3, 4, 5, 6])
    assert cache.match(prompt, [audio])[0] == 8
    assert cache.match(prompt, [MediaItem("audio", 2, 6, b"b")])[0] == 2, "another clip: up to its start"
    assert cache.match(torch.tensor([1, 2, 3, 3, 9]), [MediaItem("audio", 2, 4, b"a")])[0] == 2


def test_a_split_thinker_keeps_no_prefixes() -> None:
    with pytest.raises(ValueError, match=r"thinker\.prefix_cache_tokens: a split thinker keeps no prefixes"):
        parse_config({"thinker": {"disaggregated": True, "prefix_cache_tokens": 1024}})
    assert DeployConfig().thinker.prefix_cache_tokens == 0


def test_an_extended_entry_replaces_one_only_with_the_same_media() -> None:
    audio = MediaItem("audio", 1, 3, b"a")
    cache = PrefixCache(100)
    cache.add(_entry([1, 2, 2, 3], (audio,)))
    cache.add(_entry([1, 2, 2, 3, 4], (MediaItem("audio", 1, 3, b"b"),)))  # another clip there: both kept
    assert len(cache) == 2
    cache.add(_entry([1, 2, 2, 3, 4, 5], (audio,)))  # the first, a turn on: it goes
    assert len(cache) == 2 and cache.tokens == 11
    assert cache.match(torch.tensor([1, 2, 2, 3, 4, 5, 6]), [audio])[0] == 6


def test_the_gateways_digests_are_the_thinkers_and_a_wrong_number_is_refused(models: Any, tiny_dir: Path) -> None:
    """The gateway sends each item's digest with the prompt (made in its worker thread, not on
    the thinker's engine thread): the same as the thinker's own; digests that do not fit the
    prompt's items are refused naming them."""
    from gateway.client import build_request
    from gateway.server import GatewayService
    from omnistage.models.qwen3_omni.multimodal import MultimodalInputs, media_digests
    from omnistage.v1 import gateway_pb2

    wav = media.encode_audio(media.tone(1.0, RATE, 300.0, seed=4), RATE)
    png = media.encode_image(media.image(32, 32, seed=5))
    request = build_request("what is it", audio=[wav], images=[png])

    async def services() -> tuple[GatewayService, GatewayService]:  # (a gateway's channels need a loop)
        ckpt = open_checkpoint(tiny_dir)
        return (GatewayService(parse_config({"thinker": {"prefix_cache_tokens": 1024}}), ckpt, "ipv4:127.0.0.1:1"),
                GatewayService(parse_config({}), ckpt, "ipv4:127.0.0.1:1"))  # fmt: skip

    service, plain_service = asyncio.run(services())
    prompt = service._prompt(request)
    assert prompt.digests is not None and prompt.digests.shape == (2, 32) and prompt.digests.dtype == torch.uint8
    assert torch.equal(prompt.digests, media_digests(MultimodalInputs.from_mapping(prompt.multimodal)))
    plain = plain_service._prompt(request)
    assert plain.digests is None, "a thinker with no prefix cache is sent none"
    # a conversation's turns carry one routing key (its replica keeps its prefixes), another's another
    later = build_request("and then?", messages=[*request.messages, gateway_pb2.ChatMessage(role="assistant",
                                                                                            content="a reply")])
    other = build_request("what is it", audio=[wav])
    key = service._conversation(request)
    assert key is not None and service._conversation(later) == key != service._conversation(other)
    assert plain_service._conversation(request) is None
    thinker = models("qwen3").thinker
    state = thinker.new_state(SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=r"media digests of shape \[1, 32\]; the prompt has 2 items"):
        thinker.set_prompt(state, prompt.ids, prompt.multimodal, False, prompt.digests[:1])
    # through the stage's worker: the request fails INVALID_ARGUMENT, naming them
    from omnistage.engine import Request
    from omnistage.v1 import stage_pb2
    from omnistage.wire import Code, StageError
    from services import edges
    from services.pipeline import received
    from services.thinker.worker import ThinkerWorker

    worker = ThinkerWorker(thinker, SamplingParams(max_tokens=4))
    request = Request("bad-digests", stage_pb2.Start(request_id="bad-digests"))
    worker.open(request)
    bad = received(edges.prompt_chunk(prompt.ids, prompt.multimodal, digests=prompt.digests[:1]))
    with pytest.raises(StageError, match="thinker: media digests of shape") as refused:
        worker.feed(request, bad)
    assert refused.value.code == Code.INVALID_ARGUMENT
    state = thinker.new_state(SamplingParams(max_tokens=1))
    thinker.set_prompt(state, prompt.ids, prompt.multimodal, False, prompt.digests)
    assert [item.kind for item in state.media] == ["audio", "image"]
    thinker.release(state)


def test_placeholders_before_their_start_token_are_never_taken_from_the_cache(models: Any) -> None:
    """A prompt the checks let through with an audio's placeholders before its start token: the
    item spans from its first placeholder, so another clip there is not taken from the cache."""
    model = models("qwen3")
    config = model.thinker.model.config
    messages = [{"role": "user", "content": [{"type": "text", "text": "hear this"},
                                             {"type": "audio", "audio": media.tone(1.0, RATE, 300.0, seed=6)}]}]
    ids, mm = model.build(messages, "audio")
    start = ids.index(config.audio_start_token_id)
    pads = [i for i, t in enumerate(ids) if t == config.audio_token_id]
    crafted = ids[:start] + ids[pads[0] : pads[-1] + 1] + [ids[start]] + ids[pads[-1] + 1 :]
    other = dict(mm, input_features=mm["input_features"] + 0.25)  # another clip of the same length
    _run(model.thinker, crafted, mm)
    state = model.thinker.new_state(SamplingParams(max_tokens=1))
    model.thinker.set_prompt(state, crafted, other)
    assert state.cached <= start, (state.cached, start)
    model.thinker.release(state)
    state = model.thinker.new_state(SamplingParams(max_tokens=1))
    model.thinker.set_prompt(state, crafted, mm)
    assert state.cached == len(crafted) - 1, "the same clip: all of it"
    model.thinker.release(state)


@pytest.mark.parametrize(("digests", "said"), [(torch.zeros(2, 32), "dtype torch.float32"),
                                               (torch.zeros(2, 16, dtype=torch.uint8), "shape [2, 16]")])  # fmt: skip
def test_malformed_digests_in_a_prompt_chunk_are_refused_naming_them(digests: torch.Tensor, said: str) -> None:
    from omnistage.wire import StageError
    from services import edges
    from services.pipeline import received

    chunk = received(edges.prompt_chunk([1, 2, 3], digests=digests))
    with pytest.raises(StageError, match=rf"thinker: tensor 'media_digests' has {re.escape(said)}"):
        edges.read_prompt("thinker", chunk)
    ok = edges.read_prompt("thinker", received(edges.prompt_chunk([1, 2, 3], digests=torch.zeros(2, 32,
                                                                                                 dtype=torch.uint8))))
    assert ok.digests is not None and ok.digests.shape == (2, 32) and "media_digests" not in ok.multimodal
