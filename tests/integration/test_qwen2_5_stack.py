"""The second family through the real multi-process stack: `serve --model <tiny Qwen2.5-Omni>`
with no family-specific setting. Parity with generate() through the gateway, requests batched
together equal to each alone, and a cancel that frees every stage."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from gateway.client import build_request, generate
from omnistage.cli.serve import Stack, start_stack
from omnistage.v1 import gateway_pb2_grpc, stage_pb2
from tests.integration.conftest import assert_all_idle, info, prompt_chunk, run, solo_reply, stack_config, stage_call

SEED = 7
STREAM_ATOL = 5e-5  # streamed exact token2wav against the full decode (tests/test_qwen2_5_omni.py)
SAMPLING = {"code2wav": {"seed": SEED}}


@pytest.fixture(scope="module")
def q25_stack(q25_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(stack_config(), model=str(q25_dir), log_dir=tmp_path_factory.mktemp("q25-stack-logs")) as s:
        yield s


def test_stack_matches_generate(q25_stack: Stack, q25_checkpoints: Any) -> None:
    pipeline, reference = q25_checkpoints("published")
    for prompt in ("What is the weather like?", "Can you explain how streaming works?"):
        ids = pipeline.prompt_ids(prompt)
        ref_ids, ref_codes, ref_wav = reference.generate(ids, 40, 120, pipeline.spec.im_end_id, seed=SEED)
        reply = run(generate(q25_stack.gateway_address, prompt, thinker_max_tokens=40, talker_max_tokens=120,
                             sampling=SAMPLING, timeout=120))  # fmt: skip
        assert reply.token_ids == ref_ids
        assert reply.sample_rate == 24000
        assert reply.pcm.shape == ref_wav.shape
        assert float(np.abs(reply.pcm - ref_wav.numpy()).max()) <= STREAM_ATOL
        assert reply.usage["audio_frames"] == ref_codes.shape[1]
        # straight into the thinker: the talker's codes come back up too
        start = stage_pb2.Start(request_id=f"q25-{len(ids)}", want_audio=True)
        start.sampling["thinker"].max_tokens = 40
        start.sampling["talker"].max_tokens = 120
        start.sampling["talker"].do_sample = False
        start.sampling["talker"].repetition_penalty = 1.0
        start.sampling["code2wav"].seed = SEED
        out = run(stage_call(q25_stack.addresses("thinker")[0], start, [prompt_chunk(ids)], timeout=120))
        codes = torch.cat([c.tensors["codes"] for c in out["talker"] if "codes" in c.tensors], dim=1)
        assert torch.equal(codes, ref_codes)


def test_a_raw_prompt_completion_matches_generate(q25_stack: Stack, q25_checkpoints: Any) -> None:
    """/v1/completions on the second family: the prompt as written (special-token text as those
    tokens), its greedy text generate()'s on the tokenizer's ids; a media token's text refused."""
    import httpx

    pipeline, reference = q25_checkpoints("published")
    prompt = "<|im_start|>user\nWhat is the weather like?<|im_end|>\n<|im_start|>assistant\n"
    ids = [int(i) for i in pipeline.tokenizer.encode(prompt)]
    assert ids[0] == pipeline.spec.im_start_id
    ref_ids, _, _ = reference.generate(ids, 16, 1, pipeline.spec.im_end_id, audio=False)
    reply = run(generate(q25_stack.gateway_address, prompt, raw=True, want_audio=False, thinker_max_tokens=16,
                         timeout=120))  # fmt: skip
    assert reply.token_ids == ref_ids and ref_ids
    url = f"http://{q25_stack.http_address}/v1/completions"
    done = httpx.post(url, json={"prompt": prompt, "temperature": 0, "max_tokens": 16}, timeout=120).json()
    assert done["choices"][0]["text"] == reply.text and done["usage"]["prompt_tokens"] == len(ids)
    for media_id in (pipeline.spec.multimodal_ids[0], pipeline.spec.audio_start_id):  # <|AUDIO|>, <|audio_bos|>
        media = pipeline.tokenizer.convert_ids_to_tokens(media_id)
        refused = httpx.post(url, json={"prompt": f"a {media}"}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt", refused.text


def test_full_payload_gives_the_same_output(q25_stack: Stack) -> None:
    """Every stage waiting for its whole input (one token2wav window) gives async_chunk's reply."""
    options = {"thinker_max_tokens": 40, "talker_max_tokens": 120, "sampling": SAMPLING, "timeout": 120}
    streamed = run(generate(q25_stack.gateway_address, "hi", **options))
    whole = run(generate(q25_stack.gateway_address, "hi", mode="full_payload", **options))
    assert whole.token_ids == streamed.token_ids
    assert whole.pcm.shape == streamed.pcm.shape and whole.pcm.size > 0
    assert float(np.abs(whole.pcm - streamed.pcm).max()) <= STREAM_ATOL


def test_concurrent_requests_match_their_solo_runs(q25_stack: Stack, q25_checkpoints: Any) -> None:
    """Six requests at once share the thinker's and the talker's forward steps and give what each
    gives alone."""
    pipeline, _ = q25_checkpoints("published")
    prompts = ["hi", "What is the weather like?", "Numbers one two three", "Tell me about the sea.",
               "Where is the nearest train station from here?", "Name three colours."]  # fmt: skip
    solo = [solo_reply(pipeline, p, 24, 40, code2wav_seed=SEED) for p in prompts]
    assert sum(s.pcm.size > 0 for s in solo) >= 4  # most of them speak

    def load(stage: str) -> tuple[int, int]:
        loads = [run(info(a)).load for a in q25_stack.addresses(stage)]
        return sum(x.steps_total for x in loads), sum(x.step_requests_total for x in loads)

    before = {s: load(s) for s in ("thinker", "talker")}

    async def together() -> list[Any]:
        return await asyncio.gather(*(generate(q25_stack.gateway_address, p, thinker_max_tokens=24,
                                               talker_max_tokens=40, sampling=SAMPLING, timeout=180)
                                      for p in prompts))  # fmt: skip

    for reply, (ids, audio, _) in zip(run(together()), solo, strict=True):
        assert reply.token_ids == ids
        assert reply.pcm.shape == audio.shape
        assert np.allclose(reply.pcm, audio, atol=STREAM_ATOL, rtol=0)
    for stage in ("thinker", "talker"):
        steps, requests = (a - b for a, b in zip(load(stage), before[stage], strict=True))
        assert steps > 0 and requests / steps > 1.2, f"{stage}: mean batch {requests / max(steps, 1):.2f}"


def test_cancellation_frees_every_stage(q25_stack: Stack, q25_checkpoints: Any) -> None:
    pipeline, _ = q25_checkpoints("published")

    async def cancel_mid_reply() -> int:
        req = build_request("hi", thinker_max_tokens=300, talker_max_tokens=200,
                            thinker_stop_ids=[pipeline.spec.tts_pad_id])  # a stop that never comes
        seen = 0
        async with grpc.aio.insecure_channel(q25_stack.gateway_address) as ch:
            call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60)
            async for resp in call:
                seen += resp.WhichOneof("kind") == "text"
                if seen == 30:  # the talker is speaking by now (it runs two tokens behind)
                    call.cancel()
                    break
        return seen

    assert run(cancel_mid_reply()) == 30
    stages = [a for s in ("thinker", "talker", "code2wav") for a in q25_stack.addresses(s)]
    assert_all_idle(stages, 15)


def test_openai_http_door_speaks_with_the_checkpoint_voices(q25_stack: Stack) -> None:
    """The OpenAI-style door needs nothing family-specific: this checkpoint's voices (named as
    its spk_dict.pt spells them, matched case-insensitively) and its audio."""
    import base64

    import httpx

    models = httpx.get(f"http://{q25_stack.http_address}/v1/models", timeout=30).json()["data"]
    assert models[0]["voices"] == ["Chelsie", "Ethan"] and models[0]["default_voice"] == "Chelsie"
    body = {"messages": [{"role": "user", "content": "What is the weather like?"}], "temperature": 0,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
            "max_tokens": 40}  # fmt: skip
    reply = httpx.post(f"http://{q25_stack.http_address}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["content"] and len(base64.b64decode(message["audio"]["data"])) > 0


@pytest.mark.parametrize("case", ["prompt-without-hidden", "token-without-hidden", "unknown-voice"])
def test_malformed_talker_input_is_invalid_argument(q25_stack: Stack, q25_checkpoints: Any, case: str) -> None:
    """This family's talker reads the thinker's hidden states: a thinker chunk without them, or a
    voice the checkpoint lacks, ends the call INVALID_ARGUMENT naming why; the stack continues."""
    from omnistage.wire.tensor_blob import encode_chunk

    pipeline, _ = q25_checkpoints("published")
    ids = torch.tensor(pipeline.prompt_ids("hi"))
    width = pipeline.spec.thinker_hidden
    rows = torch.zeros(len(ids), width)
    with_hidden = encode_chunk({"prompt_ids": ids, "prompt_embed": rows, "prompt_hidden": rows}, offset=0)
    token = encode_chunk({"ids": torch.tensor([5]), "embed": torch.zeros(1, width)}, offset=0, meta={"n": 1})
    chunks = {
        "prompt-without-hidden": [encode_chunk({"prompt_ids": ids, "prompt_embed": rows}, offset=0)],
        "token-without-hidden": [with_hidden, token],
        "unknown-voice": [with_hidden],
    }[case]
    voice = "nobody" if case == "unknown-voice" else ""
    start = stage_pb2.Start(request_id=f"bad-{case}", want_audio=True, speaker=voice)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        run(stage_call(q25_stack.addresses("talker")[0], start, chunks, timeout=20, hold_open=3))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    needle = {"prompt-without-hidden": "hidden states", "token-without-hidden": "hidden",
              "unknown-voice": "unknown speaker 'nobody'"}[case]  # fmt: skip
    assert needle in err.value.details() and "talker" in err.value.details()
    reply = run(generate(q25_stack.gateway_address, "hi", thinker_max_tokens=4, talker_max_tokens=4, timeout=60))
    assert reply.token_ids


def test_the_http_seed_makes_the_speech_repeatable(q25_stack: Stack) -> None:
    """Qwen2.5-Omni's token2wav starts from noise drawn from code2wav's seed: an HTTP request's
    `seed` sets it too, so the same seed gives the same bytes (it was drawn afresh each time)."""
    import httpx

    url = f"http://{q25_stack.http_address}/v1/audio/speech"
    body = {"input": "Hello world", "voice": "Ethan", "response_format": "pcm", "seed": 11}
    first, again = (httpx.post(url, json=body, timeout=120) for _ in range(2))
    assert first.status_code == again.status_code == 200, (first.text[:300], again.text[:300])
    assert len(first.content) > 0 and first.content == again.content
    other = httpx.post(url, json={**body, "seed": 12}, timeout=120)
    assert other.status_code == 200 and other.content != first.content  # the seed is what fixed it


def test_temperature_0_gives_the_same_speech_every_time(q25_stack: Stack) -> None:
    """Over HTTP, `temperature: 0` makes the whole reply deterministic: its token2wav noise is
    seeded as for seed 0 (it was drawn afresh, so two such replies had different audio)."""
    import httpx

    body = {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 6,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
            "sampling_params_list": [{}, {"max_tokens": 24}]}  # fmt: skip
    url = f"http://{q25_stack.http_address}/v1/chat/completions"
    first, again = (httpx.post(url, json=body, timeout=120) for _ in range(2))
    assert first.status_code == again.status_code == 200, (first.text[:300], again.text[:300])
    audio = [r.json()["choices"][0]["message"]["audio"]["data"] for r in (first, again)]
    assert audio[0] and audio[0] == audio[1]
    seeded = httpx.post(url, json={**body, "seed": 5}, timeout=120)
    assert seeded.status_code == 200 and seeded.json()["choices"][0]["message"]["audio"]["data"] != audio[0]


def test_a_transcription_is_the_chat_turn_it_stands_for(q25_stack: Stack) -> None:
    """`/v1/audio/transcriptions` on the second family: the text of the chat turn [the file,
    the instruction], greedy."""
    import base64

    import httpx

    from benchmarks import media

    wav = media.encode_audio(media.tone(1.0, 16_000, seed=8), 16_000, "wav")
    base = f"http://{q25_stack.http_address}/v1"
    content = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
               {"type": "text", "text": "Transcribe the English audio into text."}]  # fmt: skip
    chat = httpx.post(f"{base}/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": content}], "temperature": 0})  # fmt: skip
    assert chat.status_code == 200, chat.text[:300]
    text = chat.json()["choices"][0]["message"]["content"]
    got = httpx.post(f"{base}/audio/transcriptions", data={"language": "en"}, files={"file": ("a.wav", wav)},
                     timeout=120)  # fmt: skip
    assert got.status_code == 200, got.text[:300]
    assert text and got.json()["text"] == text
