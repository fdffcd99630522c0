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


def family_reference(model_dir: Path) -> Any:
    """transformers' monolithic model of the checkpoint's family, its codes recorded (the family's
    `reference.py`)."""
    from omnistage.models import open_checkpoint

    return open_checkpoint(model_dir).family.reference(model_dir)


@pytest.fixture(scope="session")
def reference(tiny_dir: Path) -> Any:
    return family_reference(tiny_dir)


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
                reference: Any) -> Any:  # fmt: skip
    """(pipeline, reference) per checkpoint name, built on first use: 'published' (the default
    tiny checkpoint), 'fused' (the same weights in the fused layout), 'variant'."""
    from services.pipeline import InProcessPipeline

    dirs = {"published": tiny_dir, "fused": tiny_fused_dir, "variant": tiny_variant_dir}
    made: dict[str, Any] = {"published": (pipeline, reference)}

    def get(name: str) -> tuple[Any, Any]:
        if name not in made:
            made[name] = (InProcessPipeline(dirs[name]), family_reference(dirs[name]))
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


@pytest.fixture(scope="session")
def q25_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-Omni checkpoint (omnistage make-tiny --family qwen2_5_omni)."""
    from omnistage.models.qwen2_5_omni.tiny import write_tiny_checkpoint

    out = tmp_path_factory.mktemp("tiny-qwen2_5-omni")
    write_tiny_checkpoint(out)
    return out


@pytest.fixture(scope="session")
def q25_checkpoints(q25_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(pipeline, reference) per Qwen2.5-Omni checkpoint name, built on first use: 'published'
    (the default tiny checkpoint) and 'variant' (other special ids, widths, codebook, DiT blocks,
    samples per mel frame and voices)."""
    from omnistage.models.qwen2_5_omni.tiny import VARIANT, write_tiny_checkpoint
    from services.pipeline import InProcessPipeline

    made: dict[str, Any] = {}

    def get(name: str) -> tuple[Any, Any]:
        if name not in made:
            path = q25_dir
            if name == "variant":
                path = tmp_path_factory.mktemp("tiny-qwen2_5-omni-variant")
                write_tiny_checkpoint(path, shape=VARIANT)
            made[name] = (InProcessPipeline(path), family_reference(path))
        return made[name]

    return get
