"""The second family, Qwen2.5-Omni: its tiny checkpoint, and the staged pipeline against
transformers' monolithic `Qwen2_5OmniForConditionalGeneration.generate()` (text ids, talker
codes, waveform) for text, audio, image and video input, on two checkpoints of other sizes and
ids; token2wav's streaming against its full decode; bad inputs."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import media
from omnistage.models import CheckpointError, open_checkpoint
from omnistage.models.family import UnknownFamily, family_for
from omnistage.models.sampling import SamplingParams
from services.pipeline import AudioEvent, PipelineRequest, TextEvent
from tests.conftest import TEST_DEVICE, assert_same_wave, needs_cpu_rng, staged_pipeline

SEED = 7  # the token2wav noise seed, on both sides
# Streamed exact audio against the full decode: equal up to float rounding (windows of other
# lengths); measured max |delta| 9.5e-6 on a 300-code utterance here.
STREAM_ATOL = 5e-5


@dataclass(frozen=True)
class Case:
    prompt: str
    thinker_max: int
    talker_max: int
    repetition_penalty: float = 1.0


CASES = [
    Case("What is the weather like?", 40, 120),
    Case("hi", 40, 120, 1.05),  # the talker's penalty counts its prompt ids, as generate()'s does
    Case("Numbers one two three", 40, 120),
    Case("Can you explain how streaming works?", 40, 120),
]


def _run(pipeline: Any, ids: list[int], case: Case, **extra: Any) -> list[Any]:
    thinker = pipeline.thinker_defaults().with_overrides(max_tokens=case.thinker_max)
    talker = SamplingParams(max_tokens=case.talker_max, repetition_penalty=case.repetition_penalty)
    return list(pipeline.run(PipelineRequest(prompt_ids=ids, thinker=thinker, talker=talker, code2wav_seed=SEED,
                                             **extra)))  # fmt: skip


def _check_parity(pipeline: Any, events: list[Any], ref: tuple[list[int], Any, Any]) -> Any:
    ref_ids, ref_codes, ref_wav = ref
    done = events[-1]
    assert [e.token_id for e in events if isinstance(e, TextEvent)] == done.token_ids == ref_ids
    assert ref_codes is not None and done.codes.shape == ref_codes.shape
    assert torch.equal(done.codes, ref_codes)
    # the full decode of our codes is generate()'s waveform, bit for bit
    assert_same_wave(pipeline.code2wav.decode(done.codes, seed=SEED), ref_wav)
    chunks = [e.pcm for e in events if isinstance(e, AudioEvent)]
    streamed = torch.cat(chunks)
    assert streamed.shape == ref_wav.shape
    if TEST_DEVICE != "cpu":  # the streamed noise is the CPU generator's (see needs_cpu_rng)
        return done
    assert float((streamed - ref_wav).abs().max()) <= STREAM_ATOL
    if len(chunks) == 1:  # one window over the whole utterance: the full decode's numbers exactly
        assert torch.equal(streamed, ref_wav)
    return done


@pytest.mark.parametrize("checkpoint", ["published", "variant"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.prompt[:16])
def test_staged_pipeline_matches_generate(q25_checkpoints: Any, checkpoint: str, case: Case) -> None:
    pipeline, reference = q25_checkpoints(checkpoint)
    ids = pipeline.prompt_ids(case.prompt)
    ref = reference.generate(ids, case.thinker_max, case.talker_max, pipeline.spec.im_end_id, seed=SEED,
                             talker_repetition_penalty=case.repetition_penalty)  # fmt: skip
    done = _check_parity(pipeline, _run(pipeline, ids, case), ref)
    eos = pipeline.spec.im_end_id
    assert done.thinker_stopped_on == ("stop_id" if ref[0][-1] == eos else "max_tokens")
    assert done.talker_stopped_on == ("max_tokens" if ref[1].shape[1] == case.talker_max else "stop_id")


def test_a_system_prompt_alone_matches_generate(q25_checkpoints: Any) -> None:
    """A conversation with no user turn (the gateway refused it; OpenAI serves it), spoken."""
    pipeline, reference = q25_checkpoints("published")
    turns = [{"role": "system", "content": "You are a poet. Write about the sea."}]
    ids = list(pipeline.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)["input_ids"])
    case = Case("", 20, 40)
    ref = reference.generate(ids, case.thinker_max, case.talker_max, pipeline.spec.im_end_id, seed=SEED)
    _check_parity(pipeline, _run(pipeline, ids, case), ref)


def test_cases_cover_every_stop(q25_checkpoints: Any) -> None:
    """The cases above reach each stop of each part on the published checkpoint (reference side)."""
    pipeline, reference = q25_checkpoints("published")
    eos, stops = pipeline.spec.im_end_id, set()
    for case in CASES:
        ids, codes, _ = reference.generate(pipeline.prompt_ids(case.prompt), case.thinker_max, case.talker_max, eos,
                                           seed=SEED, talker_repetition_penalty=case.repetition_penalty)  # fmt: skip
        stops.add(("thinker", ids[-1] == eos))
        stops.add(("talker", codes.shape[1] < case.talker_max))
    assert stops == {("thinker", True), ("thinker", False), ("talker", True), ("talker", False)}


@pytest.mark.parametrize("kind", ["audio", "image", "video", "audio+image"])
def test_media_input_matches_generate(q25_checkpoints: Any, kind: str) -> None:
    """Audio, image and video in, through the checkpoint's own processor (Qwen2_5OmniProcessor)."""
    pipeline, reference = q25_checkpoints("published")
    tone, img, vid = media.tone(1.5, 16_000, seed=1), media.image(56, 84, seed=2), media.video(2, 56, 56, seed=3)
    parts = {
        "audio": [{"type": "audio", "audio": tone}],
        "image": [{"type": "image", "image": img}],
        "video": [{"type": "video", "video": vid, "fps": 2.0, "audio": None}],
        "audio+image": [{"type": "audio", "audio": tone}, {"type": "image", "image": img}],
    }[kind]
    builder = pipeline.family.input_builder(pipeline.checkpoint, pipeline.tokenizer)
    ids, inputs = builder.build([{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}])
    case = Case("", 30, 60)
    ref = reference.generate(ids, case.thinker_max, case.talker_max, pipeline.spec.im_end_id, seed=SEED, **inputs)
    _check_parity(pipeline, _run(pipeline, ids, case, multimodal=inputs), ref)


def _stream(t2w: Any, codes: torch.Tensor, mode: str, context: int, step: int = 10) -> list[tuple[int, torch.Tensor]]:
    """Feed `codes` to a stream `step` frames at a time, as the code2wav stage does."""
    s = t2w.open_stream(mode, context, seed=SEED)
    out = []
    for i in range(0, codes.shape[1], step):
        s.pending.extend(codes[:, j].clone() for j in range(i, min(codes.shape[1], i + step)))
        if t2w.ready_frames(s) >= step:
            out += t2w.decode_pending([s])
    s.input_done = True
    out += t2w.decode_pending([s])
    t2w.close(s)
    return [(first, pcm) for first, pcm in out if pcm.numel()]


@needs_cpu_rng
def test_token2wav_streams_the_full_decode(q25_checkpoints: Any) -> None:
    """A long utterance streamed in many chunks: exact mode equals the full decode up to float
    rounding; windowed mode starts sooner and stays close."""
    pipeline, _ = q25_checkpoints("published")
    t2w = pipeline.code2wav
    codes = torch.randint(0, t2w.spec.codebook_size, (1, 150), generator=torch.Generator().manual_seed(1))
    full = t2w.decode(codes, seed=SEED)
    assert full.shape[0] == 150 * t2w.samples_per_frame
    exact = _stream(t2w, codes, "exact", 0, step=16)
    windowed = _stream(t2w, codes, "windowed", 32, step=16)
    for chunks in (exact, windowed):
        assert len(chunks) > 3, "audio came in pieces before the codes ended"
        assert [first for first, _ in chunks] == [0, *torch.tensor([p.shape[0] for _, p in chunks]).cumsum(0)[:-1]]
    exact_pcm, windowed_pcm = torch.cat([p for _, p in exact]), torch.cat([p for _, p in windowed])
    assert float((exact_pcm - full).abs().max()) <= STREAM_ATOL
    assert float((windowed_pcm - full).abs().max()) <= 1e-3
    assert exact[0][1].shape[0] > 0 and windowed[1][0] <= exact[1][0]  # windowed's second chunk comes no later



@needs_cpu_rng
def test_a_backlog_goes_through_in_pieces_no_smaller_than_the_windows_reach(q25_checkpoints: Any) -> None:
    """Every code there and the input done, decoded `max_frames` a call, or as many codes as a
    piece's window reaches around it where that is more (a smaller piece would cost more than
    it saves): the same audio as the full decode, within the streaming tolerance."""
    pipeline, _ = q25_checkpoints("published")
    t2w = pipeline.code2wav
    s = t2w.open_stream("exact", 0, seed=SEED)
    back, ahead = t2w._reach(s)
    reach = (back + ahead) * t2w.block // t2w.repeats
    assert 0 < reach < 240  # so that 40 (the reach, below) and 240 (max_frames) each bind
    n = 241  # past one 240 piece; a partial last piece for either size (the decodes cost as n grows)
    while n % reach == 0:
        n += 1
    codes = torch.randint(0, t2w.spec.codebook_size, (1, n), generator=torch.Generator().manual_seed(2))
    full = t2w.decode(codes, seed=SEED)
    for max_frames, piece in ((40, reach), (240, 240)):
        s = t2w.open_stream("exact", 0, seed=SEED)
        s.pending.extend(codes[:, j].clone() for j in range(codes.shape[1]))
        s.input_done = True
        pieces = []
        while s.pending:
            first, pcm = t2w.decode_pending([s], max_frames)[0]
            assert first == sum(p.shape[0] for p in pieces)
            pieces.append(pcm)
        t2w.close(s)
        assert [p.shape[0] // t2w.samples_per_frame for p in pieces[:-1]] == [piece] * (n // piece)
        assert float((torch.cat(pieces) - full).abs().max()) <= STREAM_ATOL


def test_noise_of_a_prefix_is_the_prefix_of_the_noise() -> None:
    """What streaming the DiT's noise rests on: on CPU, randn drawn in pieces of whole mel frames
    (80 values, a multiple of 16) equals one draw of the whole."""
    whole = torch.randn(80 * 37, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    pieces = torch.cat([torch.randn(80 * n, generator=g) for n in (5, 1, 19, 12)])
    assert torch.equal(whole, pieces)


def test_a_single_token_reply_gives_no_audio(q25_checkpoints: Any) -> None:
    """generate() fails when the thinker gives one token (its talker has no reply to read); the
    pipeline gives that token, no frames and no error."""
    pipeline, _ = q25_checkpoints("published")
    done = _run(pipeline, pipeline.prompt_ids("hi"), Case("", 1, 20))[-1]
    assert len(done.token_ids) == 1
    assert done.codes.shape == (1, 0)
    assert done.talker_stopped_on == "no_text"


def test_voices_and_codes_are_checked(q25_checkpoints: Any) -> None:
    pipeline, _ = q25_checkpoints("published")
    with pytest.raises(ValueError, match=r"unknown speaker 'nobody'.*Chelsie, Ethan"):
        pipeline.talker.new_state(SamplingParams(), "nobody")
    assert pipeline.spec.speaker_name("chelsie") == "Chelsie"  # matched case-insensitively
    rows = pipeline.code2wav.dit.text_embed.codec_embed.num_embeddings  # what transformers' DiT embeds
    pipeline.code2wav.validate_codes(torch.tensor([[0, rows - 1]]))
    with pytest.raises(ValueError, match=rf"codes must lie in \[0, {rows}\), got 3..{rows}"):
        pipeline.code2wav.validate_codes(torch.tensor([[3, rows]]))
    with pytest.raises(ValueError, match=r"codes must be \[1, frames\]"):
        pipeline.code2wav.validate_codes(torch.zeros((2, 3), dtype=torch.long))


def test_the_talker_stops_at_the_longest_utterance_token2wav_decodes(q25_dir: Path, tmp_path: Path) -> None:
    """generate()'s token2wav refuses more codes than its DiT's positions over `repeats`; the
    talker stops there (as at max_tokens: finish reason length), read from config.json."""
    copy = tmp_path / "short-dit"
    shutil.copytree(q25_dir, copy)
    raw = json.loads((copy / "config.json").read_text())
    dit = raw["token2wav_config"]["dit_config"]
    dit["max_position_embeddings"] = 5 * dit["repeats"] + 1
    (copy / "config.json").write_text(json.dumps(raw))
    pipeline = staged_pipeline(copy)
    assert pipeline.spec.max_frames == 5
    done = _run(pipeline, pipeline.prompt_ids("What is the weather like?"), Case("", 40, 120))[-1]
    assert done.codes.shape == (1, 5) and done.talker_stopped_on == "max_tokens"


def test_family_is_chosen_from_model_type(q25_dir: Path, tmp_path: Path) -> None:
    assert open_checkpoint(q25_dir).family.display_name == "Qwen2.5-Omni"
    with pytest.raises(UnknownFamily, match="'qwen2_5_omni', 'qwen3_omni_moe'"):
        family_for("qwen2_audio")


def test_a_checkpoint_without_its_voices_is_refused(q25_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "no-voices"
    shutil.copytree(q25_dir, broken)
    (broken / "spk_dict.pt").unlink()
    with pytest.raises(CheckpointError, match=r"^\S*: missing spk_dict\.pt"):  # (not config.json's fault)
        open_checkpoint(broken)
    (broken / "spk_dict.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"^\S*spk_dict\.pt: not a voice table") as err:
        open_checkpoint(broken)
    assert "\n" not in str(err.value), str(err.value)  # (torch's message is 6 lines: its first is said)


def test_tiny_checkpoint_is_deterministic_and_published_layout(q25_dir: Path, tmp_path: Path) -> None:
    from omnistage.models.qwen2_5_omni.tiny import write_tiny_checkpoint

    again = tmp_path / "again"
    write_tiny_checkpoint(again)

    def digest(d: Path) -> dict[str, str]:
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}

    assert digest(again) == digest(q25_dir)
    assert (q25_dir / "model.safetensors.index.json").is_file()  # sharded, with its index
    keys = open_checkpoint(q25_dir).tensors
    assert any(k.startswith("token2wav.code2wav_dit_model.") for k in keys)
    assert any(k.startswith("thinker.") for k in keys) and any(k.startswith("talker.") for k in keys)


@pytest.mark.parametrize("setting", ["disaggregated", "fast"])
def test_split_thinker_and_fast_batching_hold_for_this_family(q25_checkpoints: Any, q25_dir: Path,
                                                              setting: str) -> None:  # fmt: skip
    """The thinker split into prefill and decode roles (its KV cache and the talker's per-token
    hidden states crossing between them), and fast batching, give generate()'s output for a
    request alone."""
    from omnistage.config import parse_config

    _, reference = q25_checkpoints("published")
    cfg = {
        "disaggregated": {"thinker": {"disaggregated": True}},  # one prefill chunk, as generate() prefills
        "fast": {"thinker": {"batching": "fast"}, "talker": {"batching": "fast"}},
    }[setting]
    pipeline = staged_pipeline(q25_dir, parse_config(cfg))  # on the reference's device
    case = CASES[0]
    ids = pipeline.prompt_ids(case.prompt)
    ref = reference.generate(ids, case.thinker_max, case.talker_max, pipeline.spec.im_end_id, seed=SEED)
    _check_parity(pipeline, _run(pipeline, ids, case), ref)


@needs_cpu_rng
def test_fast_token2wav_batches_requests_and_stays_close(q25_dir: Path, q25_checkpoints: Any) -> None:
    """Fast batching runs every due request's window in one DiT pass per ODE step (windows of
    other lengths padded; a padded row attends only to padding): each request's audio stays
    within the windowed tolerance of its full decode, and the batch is one ODE, not one per
    request."""
    from omnistage.models.qwen2_5_omni.token2wav import Token2Wav

    pipeline, _ = q25_checkpoints("published")
    exact = pipeline.code2wav
    fast = Token2Wav(exact.model, exact.spec, exact.voices, batching="fast")
    g = torch.Generator().manual_seed(2)
    utterances = [torch.randint(0, exact.spec.codebook_size, (1, n), generator=g) for n in (48, 17, 30)]
    streams = []
    for i, codes in enumerate(utterances):
        s = fast.open_stream("exact", 0, speaker=["Chelsie", "Ethan", "Chelsie"][i], seed=SEED + i)
        s.pending = [codes[:, j].clone() for j in range(codes.shape[1])]
        s.input_done = True
        streams.append(s)
    calls = []
    original = fast._sample
    fast._sample = lambda jobs: calls.append(len(jobs)) or original(jobs)  # type: ignore[method-assign]
    out = fast.decode_pending(streams)
    assert calls == [3]
    for i, (codes, (first, pcm)) in enumerate(zip(utterances, out, strict=True)):
        full = exact.decode(codes, speaker=["Chelsie", "Ethan", "Chelsie"][i], seed=SEED + i)
        assert first == 0 and pcm.shape == full.shape
        assert float((pcm - full).abs().max()) <= 1e-3
