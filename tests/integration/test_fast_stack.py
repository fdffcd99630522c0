"""The stack served in fast batching (deploy/examples/fast.yaml's modes, and its prefix cache):
requests sharing every stage's steps, the talkers' KV in one pool (models/batching.py `KVPool`),
a cancelled request giving everything back, and a spoken conversation's next turn prefilled from
what its previous one computed."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.client import generate
from omnistage.cli.serve import Stack, start_stack
from tests.integration.conftest import assert_all_idle, cancel_at_first_audio, run, solo_reply, stack_config

FAST = {"batching": "fast"}


@pytest.fixture(scope="module")
def fast_stack(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = stack_config(thinker={**FAST, "prefix_cache_tokens": 65536}, talker={**FAST, "replicas": 1}, code2wav=FAST)
    with start_stack(cfg, model=str(tiny_dir), log_dir=tmp_path_factory.mktemp("fast-stack-logs")) as s:
        yield s


def test_fast_stack_serves_concurrent_requests_as_each_alone(fast_stack: Stack, pipeline: Any) -> None:
    """Four requests at once, one talker replica: their decode rows share the talker's pool.
    Each gets the tokens and audio it gets alone (exact mode in process; a fast-mode request
    alone computes what exact mode does). Fast batching is not bitwise across batches: this
    holds on the tiny checkpoint because no two of its top logits are within the last bits
    that batching moves (measured: max |Δ| 2e-6, agreement 1.0 on the bench's mix)."""
    prompts = ["Tell me a short story about a robot who learns to sing.", "Numbers one two three",
               "Where is the nearest train station from here?", "Name three colours."]  # fmt: skip
    solo = [solo_reply(pipeline, p, 24, 40) for p in prompts]

    async def together() -> list[Any]:
        return await asyncio.gather(*(generate(fast_stack.gateway_address, p, thinker_max_tokens=24,
                                               talker_max_tokens=40, timeout=120) for p in prompts))  # fmt: skip

    replies = run(together())
    assert sum(s.pcm.size > 0 for s in solo) >= 2  # several requests speaking at once
    assert _talker_mean_batch(fast_stack) > 1  # their steps were shared
    for reply, (ids, audio, frames) in zip(replies, solo, strict=True):
        assert reply.token_ids == ids
        assert reply.usage["audio_frames"] == frames
        assert reply.pcm.shape == audio.shape
        assert np.allclose(reply.pcm, audio, atol=1e-4, rtol=0)


def test_a_cancelled_fast_request_frees_every_stage(fast_stack: Stack, pipeline: Any) -> None:
    """Cancelled at its first audio while two others speak: every stage lets go of it (its pool
    slot included: the others finish, and a later request is served; its prompt, a repeat, is
    taken from the prefix cache but its last token). The prompts are this test's own: none is
    cached before it."""

    async def scenario() -> list[Any]:
        others = [asyncio.ensure_future(generate(fast_stack.gateway_address, p, thinker_max_tokens=24,
                                                 talker_max_tokens=40, timeout=120))
                  for p in ("Count from four to nine.", "Name three animals.")]  # fmt: skip
        await cancel_at_first_audio(fast_stack.gateway_address, pipeline.spec.tts_pad_id)
        return list(await asyncio.gather(*others))

    replies = run(scenario())
    assert all(r.pcm.size > 0 for r in replies)
    stages = fast_stack.addresses("thinker") + fast_stack.addresses("talker") + fast_stack.addresses("code2wav")
    assert_all_idle(stages, 15)
    again = run(generate(fast_stack.gateway_address, "Name three animals.", thinker_max_tokens=24,
                         talker_max_tokens=40, timeout=120))  # fmt: skip
    assert again.token_ids == replies[1].token_ids
    assert again.pcm.shape == replies[1].pcm.shape and np.allclose(again.pcm, replies[1].pcm, atol=1e-4, rtol=0)


def test_a_conversations_next_turn_is_prefilled_from_its_last(fast_stack: Stack, pipeline: Any) -> None:
    """Two spoken turns through the gateway (which sends the media's digests with the prompt):
    the second is admitted with the first turn's prompt in its cache, and its reply is what the
    in-process pipeline (exact, no cache) gives the same messages (a hit moves the last bits,
    which the tiny checkpoint's top logits are far apart enough not to feel, as fast mode's)."""
    from benchmarks import media
    from gateway.client import user_message
    from gateway.media import decode_messages
    from omnistage.models.sampling import SamplingParams
    from omnistage.v1 import gateway_pb2
    from services.pipeline import DoneEvent, PipelineRequest
    from tests.integration.conftest import metric

    thinker = fast_stack.addresses("thinker")[0]
    clips = [media.encode_audio(media.tone(seconds, 16_000, hz, seed=i), 16_000)
             for i, (seconds, hz) in enumerate(((1.5, 300.0), (1.0, 450.0)))]  # fmt: skip
    first = run(generate(fast_stack.gateway_address, "", audio=[clips[0]], system="Answer briefly.",
                         thinker_max_tokens=8, talker_max_tokens=16, timeout=120))  # fmt: skip
    history = [user_message("", audio=[clips[0]]), gateway_pb2.ChatMessage(role="assistant", content=first.text)]
    before = metric(thinker, "omnistage_stage_prompt_tokens_total", source="cached")
    second = run(generate(fast_stack.gateway_address, "", audio=[clips[1]], messages=history, system="Answer briefly.",
                          thinker_max_tokens=8, talker_max_tokens=16, timeout=120))  # fmt: skip
    cached = metric(thinker, "omnistage_stage_prompt_tokens_total", source="cached") - before
    assert first.usage["prompt_tokens"] <= cached < second.usage["prompt_tokens"]
    request = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="system", content="Answer briefly."),
                                                    *history, user_message("", audio=[clips[1]])])  # fmt: skip
    messages, _ = decode_messages(request, stack_config().media, 16_000)
    ids, inputs = pipeline.family.input_builder(pipeline.checkpoint, pipeline.tokenizer).build(messages)
    assert len(ids) == second.usage["prompt_tokens"]
    want = [e for e in pipeline.run(PipelineRequest(ids, SamplingParams(max_tokens=8), SamplingParams(max_tokens=16),
                                                    multimodal=inputs)) if isinstance(e, DoneEvent)]  # fmt: skip
    assert second.token_ids == want[0].token_ids


def _talker_mean_batch(stack: Stack) -> float:
    """The talker's mean batch over its steps so far (its `omnistage_stage_batch_size` histogram)."""
    port = int(stack.addresses("talker")[0].rsplit(":", 1)[1]) + 1000
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    samples = {s.name: s.value for s in families["omnistage_stage_batch_size"].samples}
    return samples["omnistage_stage_batch_size_sum"] / samples["omnistage_stage_batch_size_count"]


def test_the_conversation_bench_runs_every_arm_on_every_turn(fast_stack: Stack) -> None:
    """`omnistage bench conversation`'s loop, its three arms pointed at this one stack: every turn
    of every arm timed, each later arm's replies compared with the first's, nothing failed."""
    from benchmarks.conversation import ARMS, _conversations

    stacks = dict.fromkeys(ARMS, fast_stack)
    ran = asyncio.run(_conversations(stacks, 1, 2, 1.0, 0.0, {"thinker_max_tokens": 4, "talker_max_tokens": 8},
                                     lambda _: None))  # fmt: skip
    assert ran["failed"] == []
    for arm in ARMS:
        for turn in (1, 2):
            assert len(ran["times"][arm][turn]["ttft"]) == 1 and ran["times"][arm][turn]["ttft"][0] > 0
    assert set(ran["same"]) == set(list(ARMS)[1:]) and all(total == 2 for _, total in ran["same"].values())
