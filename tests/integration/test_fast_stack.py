"""The stack served in fast batching (deploy/examples/fast.yaml's modes): requests sharing every
stage's steps, the talkers' KV in one pool (models/batching.py `KVPool`), and a cancelled
request giving everything back."""

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
    cfg = stack_config(thinker=FAST, talker={**FAST, "replicas": 1}, code2wav=FAST)
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
    slot included: the others finish, and a later request is served)."""

    async def scenario() -> list[Any]:
        others = [asyncio.ensure_future(generate(fast_stack.gateway_address, p, thinker_max_tokens=24,
                                                 talker_max_tokens=40, timeout=120))
                  for p in ("Numbers one two three", "Name three colours.")]  # fmt: skip
        await cancel_at_first_audio(fast_stack.gateway_address, pipeline.spec.tts_pad_id)
        return list(await asyncio.gather(*others))

    replies = run(scenario())
    assert all(r.pcm.size > 0 for r in replies)
    stages = fast_stack.addresses("thinker") + fast_stack.addresses("talker") + fast_stack.addresses("code2wav")
    assert_all_idle(stages, 15)
    again = run(generate(fast_stack.gateway_address, "Name three colours.", thinker_max_tokens=24,
                         talker_max_tokens=40, timeout=120))  # fmt: skip
    assert again.token_ids == replies[1].token_ids
    assert again.pcm.shape == replies[1].pcm.shape and np.allclose(again.pcm, replies[1].pcm, atol=1e-4, rtol=0)


def _talker_mean_batch(stack: Stack) -> float:
    """The talker's mean batch over its steps so far (its `omnistage_stage_batch_size` histogram)."""
    port = int(stack.addresses("talker")[0].rsplit(":", 1)[1]) + 1000
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    samples = {s.name: s.value for s in families["omnistage_stage_batch_size"].samples}
    return samples["omnistage_stage_batch_size_sum"] / samples["omnistage_stage_batch_size_count"]
