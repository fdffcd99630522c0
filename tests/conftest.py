"""Session fixtures: the tiny checkpoint (generated once), the staged pipeline and the
monolithic reference model loaded from it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Two cores on CI: keep torch from oversubscribing when services run beside the tests.
torch.set_num_threads(int(os.environ.get("OMNISTAGE_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.models.qwen3_omni.tiny import write_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen3-omni")
    write_tiny_checkpoint(out)
    return out


@pytest.fixture(scope="session")
def tiny_fused_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint in the fused in-memory layout (one file, experts fused)."""
    from omnistage.models.qwen3_omni.tiny import write_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen3-omni-fused")
    write_tiny_checkpoint(out, layout="fused")
    return out


@pytest.fixture(scope="session")
def pipeline(tiny_dir: Path) -> Any:
    from services.pipeline import InProcessPipeline

    return InProcessPipeline(tiny_dir)


class RecordingReference:
    """Monolithic `Qwen3OmniMoeForConditionalGeneration` whose code2wav call is recorded, so
    the codes `generate()` produced can be compared, not only its waveform."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import Qwen3OmniMoeForConditionalGeneration
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.last_codes: torch.Tensor | None = None
        original = self.model.code2wav.chunked_decode

        def recording(codes: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.last_codes = codes.clone()
            return original(codes, *args, **kwargs)

        self.model.code2wav.chunked_decode = recording

    def generate(
        self, prompt_ids: list[int], thinker_max: int, talker_max: int, eos_id: int, audio: bool = True,
        speaker: str | None = None, **inputs: Any,
    ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """Greedy reference: (generated ids, codes [G, T] or None, wav [samples] or None).
        `speaker`: default the checkpoint's default voice; `inputs`: multimodal model inputs."""
        from omnistage.models.qwen3_omni.spec import FamilySpec

        self.last_codes = None
        ids = torch.tensor([prompt_ids])
        speaker = speaker or FamilySpec.from_config(self.model.config).default_speaker
        out = self.model.generate(
            input_ids=ids,
            speaker=speaker,
            **inputs,
            thinker_max_new_tokens=thinker_max,
            talker_max_new_tokens=talker_max,
            talker_do_sample=False,
            talker_repetition_penalty=1.0,
            thinker_eos_token_id=eos_id,
            return_audio=audio,
        )
        if not audio:
            seq = out.sequences if hasattr(out, "sequences") else out
            return seq[0, len(prompt_ids) :].tolist(), None, None
        seq, wav = out
        codes = self.last_codes[0] if self.last_codes is not None else None
        return seq[0, len(prompt_ids) :].tolist(), codes, wav.reshape(-1)


@pytest.fixture(scope="session")
def reference(tiny_dir: Path) -> RecordingReference:
    return RecordingReference(tiny_dir)


@pytest.fixture(scope="session")
def tiny_variant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another valid checkpoint of the family (omnistage.models.qwen3_omni.tiny.VARIANT): other
    special ids, widths, code groups, codebook, samples per frame and voices; small shards."""
    from omnistage.models.qwen3_omni.tiny import VARIANT, write_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen3-omni-variant")
    write_tiny_checkpoint(out, shape=VARIANT, shard_bytes=1 << 20)
    return out


@pytest.fixture(scope="session")
def checkpoints(tiny_dir: Path, tiny_fused_dir: Path, tiny_variant_dir: Path, pipeline: Any,
                reference: RecordingReference) -> Any:  # fmt: skip
    """(pipeline, reference) per checkpoint name, built on first use: 'published' (the default
    tiny checkpoint), 'fused' (the same weights in the fused layout), 'variant'."""
    from services.pipeline import InProcessPipeline

    dirs = {"published": tiny_dir, "fused": tiny_fused_dir, "variant": tiny_variant_dir}
    made: dict[str, Any] = {"published": (pipeline, reference)}

    def get(name: str) -> tuple[Any, RecordingReference]:
        if name not in made:
            made[name] = (InProcessPipeline(dirs[name]), RecordingReference(dirs[name]))
        return made[name]

    return get


@pytest.fixture
def no_talker_calls(pipeline: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records every talker or code2wav entry point the pipeline touches."""
    calls: list[str] = []
    for obj, names in ((pipeline.talker, ("new_state", "step")),
                       (pipeline.code2wav, ("open_stream", "decode", "decode_pending"))):
        for name in names:
            original = getattr(obj, name)

            def spy(*a: Any, _name: str = name, _orig: Any = original, **k: Any) -> Any:
                calls.append(_name)
                return _orig(*a, **k)

            monkeypatch.setattr(obj, name, spy)
    yield calls


@contextlib.contextmanager
def talker_audio_policy(reference: Any, needed: bool) -> Iterator[None]:
    """generate() cannot place audio in a talker prompt that also has an image or video (its
    talker config lacks audio_config); omnistage's talker takes the thinker's (the family's
    documented policy). The reference gets the same for those requests only."""
    talker_config = reference.model.talker.config
    if needed:
        talker_config.audio_config = reference.model.config.thinker_config.audio_config
    try:
        yield
    finally:
        if needed:
            del talker_config.audio_config
