"""Other valid checkpoints of each family through the real multi-process stack, served with no
setting of their own. Qwen3-Omni's variant: other special-token ids, widths, 8 code groups,
another codebook, 240 samples per frame, other voices, small shards
(omnistage.models.qwen3_omni.tiny.VARIANT); Qwen2.5-Omni's: other special ids, widths, codebook,
DiT blocks, samples per mel frame and voices. The in-process parity tests cover their model
code; these cover what the stage services, the wire and the gateway assume about a checkpoint
(frame shapes, samples per frame, voice names)."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gateway.client import generate
from omnistage.cli.serve import Stack, start_stack
from tests.integration.conftest import (
    call_outputs,
    prompt_chunk,
    run,
    solo_reply,
    stack_config,
    stage_call,
)
from tests.integration.test_stack import greedy_start

PROMPTS = ["Tell me a short story about a robot who learns to sing.", "Where is the station?", "Numbers one two"]
THINKER_MAX, TALKER_MAX = 30, 60


@pytest.fixture(scope="module")
def variant_stack(tiny_variant_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = stack_config(talker={"replicas": 1})
    with start_stack(cfg, model=str(tiny_variant_dir), log_dir=tmp_path_factory.mktemp("variant-stack-logs")) as s:
        yield s


def test_the_variant_checkpoint_through_the_stack_is_generate(variant_stack: Stack, checkpoints: Any) -> None:
    pipeline, reference = checkpoints("variant")
    spec = pipeline.spec
    assert spec.num_code_groups == 8 and spec.im_end_id >= 300  # not the default tiny's
    ids = pipeline.prompt_ids(PROMPTS[0])
    ref_ids, ref_codes, ref_wav = reference.generate(ids, THINKER_MAX, TALKER_MAX, spec.im_end_id)
    assert ref_codes.shape[0] == 8 and ref_codes.shape[1] > 4 and ref_wav.numel() > 0

    # straight into the thinker: the talker's 8-group frames and code2wav's audio come back up
    out = run(stage_call(variant_stack.addresses("thinker")[0], greedy_start("variant-1", thinker=THINKER_MAX,
                                                                            talker=TALKER_MAX), [prompt_chunk(ids)]))
    tokens, codes, audio = call_outputs(out)
    assert tokens == ref_ids
    assert torch.equal(codes, ref_codes)
    assert audio.shape == ref_wav.shape and torch.allclose(audio, ref_wav, atol=1e-5, rtol=0)

    # through the gateway, concurrently: each reply equals its request's in-process run alone
    solo = [solo_reply(pipeline, p, THINKER_MAX, TALKER_MAX) for p in PROMPTS]
    assert solo[0][0] == ref_ids

    async def together() -> list[Any]:
        return await asyncio.gather(*(generate(variant_stack.gateway_address, p, thinker_max_tokens=THINKER_MAX,
                                               talker_max_tokens=TALKER_MAX, timeout=120)
                                      for p in PROMPTS))  # fmt: skip

    for reply, (want_ids, want_pcm, frames) in zip(run(together()), solo, strict=True):
        assert reply.token_ids == want_ids
        assert reply.sample_rate == 24000
        assert reply.pcm.shape == want_pcm.shape and np.allclose(reply.pcm, want_pcm, atol=1e-5, rtol=0)
        assert reply.usage["audio_frames"] == frames


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_the_http_door_speaks_with_the_variant_voices(variant_stack: Stack) -> None:
    """Its voices (not the default tiny's) are listed and spoken; an unknown one is refused by name."""
    base = f"http://{variant_stack.http_address}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=30) as resp:
        model = json.loads(resp.read())["data"][0]
    assert sorted(model["voices"]) == ["ryan", "vivian"]
    spoken = {}
    for voice in ("ryan", "vivian"):
        body = {"model": model["id"], "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 8,
                "temperature": 0,  # greedy speech: a sampled reply may end before its first frame (a CI run did)
                "modalities": ["text", "audio"], "audio": {"voice": voice, "format": "pcm16"}}
        reply = _post(f"{base}/chat/completions", body)
        spoken[voice] = np.frombuffer(base64.b64decode(reply["choices"][0]["message"]["audio"]["data"]), np.int16)
        assert spoken[voice].size > 0
    assert not np.array_equal(spoken["ryan"], spoken["vivian"])  # the voice reaches the talker
    bad = {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "chelsie", "format": "wav"},
           "modalities": ["text", "audio"]}
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(f"{base}/chat/completions", bad)
    assert err.value.code == 400 and "chelsie" in err.value.read().decode()


@pytest.fixture(scope="module")
def q25_variant_stack(q25_checkpoints: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    pipeline, _ = q25_checkpoints("variant")
    with start_stack(stack_config(talker={"replicas": 1}), model=str(pipeline.checkpoint.path),
                     log_dir=tmp_path_factory.mktemp("q25-variant-stack-logs")) as s:  # fmt: skip
        yield s


def test_the_qwen2_5_variant_through_the_stack_is_generate(q25_variant_stack: Stack, q25_checkpoints: Any) -> None:
    """Through the gateway, in its default voice and in another of its own (named in another
    case: voices match case-insensitively), each reply equals generate()'s (seeded vocoder)."""
    pipeline, reference = q25_checkpoints("variant")
    spec = pipeline.spec
    assert spec.im_end_id >= 300  # not the default tiny's
    ids = pipeline.prompt_ids(PROMPTS[1])
    waves = []
    for voice in ("", "noah"):
        ref_ids, ref_codes, ref_wav = reference.generate(ids, THINKER_MAX, 120, spec.im_end_id, seed=7,
                                                         speaker=voice.capitalize() or None)  # fmt: skip
        assert ref_codes is not None and ref_wav is not None and ref_wav.numel() > 0
        reply = run(generate(q25_variant_stack.gateway_address, PROMPTS[1], thinker_max_tokens=THINKER_MAX,
                             talker_max_tokens=120, speaker=voice, sampling={"code2wav": {"seed": 7}},
                             timeout=120))  # fmt: skip
        assert reply.token_ids == ref_ids
        assert reply.pcm.shape == ref_wav.shape
        assert float(np.abs(reply.pcm - ref_wav.numpy()).max()) <= 5e-5  # streamed token2wav (test_qwen2_5_stack)
        assert reply.usage["audio_frames"] == ref_codes.shape[1]
        waves.append(reply.pcm)
    assert waves[0].shape != waves[1].shape or not np.array_equal(waves[0], waves[1])
