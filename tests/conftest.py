"""Session fixtures: the tiny checkpoint (generated once), the staged pipeline and the
monolithic reference model loaded from it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# One thread, as each stage of the stacks the tests start runs (`threads: 1` in the deploy config):
# CPU float32 sums depend on how many threads split them, so the references computed here match
# the stages' numerics (Qwen2.5-Omni's DiT vocoder turned a 2-vs-1-thread difference into 1.1e-4 of
# audio, past the stack tests' 5e-5). On CI's two cores it costs no time (the tiny models' products
# are too small to split) and leaves the other core to the services beside the tests.
torch.set_num_threads(int(os.environ.get("OMNISTAGE_TEST_THREADS", "1")))

# Where the shared pipelines and references below run: cpu (CI), or cuda on a GPU machine, where
# the parity tests check exact mode on CUDA (`OMNISTAGE_TEST_DEVICE=cuda pytest tests/test_parity.py`).
TEST_DEVICE = os.environ.get("OMNISTAGE_TEST_DEVICE", "cpu")
# On CPU the staged waveform is generate()'s bit for bit. On CUDA the two runs may pick different
# kernels for the same products (other batch shapes), so the waveform is held to a tolerance there;
# each comparison's max |Δ| is appended to $OMNISTAGE_TEST_DIFFS when that is set (the GPU figures).
CUDA_WAVE_ATOL = 1e-3


def assert_same_wave(ours: torch.Tensor, ref: torch.Tensor, what: str = "waveform", cpu_atol: float = 0.0) -> None:
    """Bit for bit on CPU (or within `cpu_atol`), within CUDA_WAVE_ATOL on CUDA."""
    assert ours.shape == ref.shape, what
    diff = float((ours - ref).abs().max()) if ours.numel() else 0.0
    if TEST_DEVICE == "cpu":
        assert torch.equal(ours, ref) if cpu_atol == 0 else diff <= cpu_atol, f"{what}: max |Δ| {diff:.3g}"
        return
    if os.environ.get("OMNISTAGE_TEST_DIFFS"):
        with open(os.environ["OMNISTAGE_TEST_DIFFS"], "a", encoding="utf-8") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t{what}\t{diff:.3g}\n")
    assert diff <= max(cpu_atol, CUDA_WAVE_ATOL), f"{what}: max |Δ| {diff:.3g} on {TEST_DEVICE}"


needs_cpu_rng = pytest.mark.skipif(
    TEST_DEVICE != "cpu", reason="Qwen2.5's streamed DiT noise is drawn on the CPU generator (its prefix property); "
    "generate() on CUDA draws it with CUDA's, so only the full decode can match there")


class DispatchCount(TorchDispatchMode):
    """The aten ops dispatched inside it (`with DispatchCount() as count: ...; count.ops`): about
    one kernel launch each on a GPU."""

    ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_per_further_request(step_ops: Callable[[int], int], small: int = 2, large: int = 16) -> float:
    """How many more ops a step of `large` requests dispatches than one of `small`, per further
    request; each the fewer of two runs (a buffer grown in the first is not counted)."""
    fewest = {b: min(step_ops(b), step_ops(b)) for b in (small, large)}
    return (fewest[large] - fewest[small]) / (large - small)


def staged_pipeline(model_dir: Path, cfg: Any = None) -> Any:
    """The in-process staged pipeline of a checkpoint, every stage on TEST_DEVICE."""
    from omnistage.config import DeployConfig, apply_overrides, config_path
    from omnistage.topology import PROCESSES
    from services.pipeline import InProcessPipeline

    cfg = cfg or DeployConfig()
    if TEST_DEVICE != "cpu":
        cfg = apply_overrides(cfg, {f"{config_path(name)}.device": TEST_DEVICE for name in PROCESSES})
    return InProcessPipeline(model_dir, cfg)


@pytest.fixture(scope="session", autouse=True)
def temp_files_under_pytest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What the code under test makes with `tempfile` in this process (the bench's stack logs,
    ...) goes under pytest's own base folder, which keeps the last few runs, not into /tmp
    for good."""
    import tempfile

    before = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tempfile"))
    yield
    tempfile.tempdir = before


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
    return staged_pipeline(tiny_dir)


def family_reference(model_dir: Path) -> Any:
    """transformers' monolithic model of the checkpoint's family, its codes recorded (the family's
    `reference.py`)."""
    from omnistage.models import open_checkpoint

    return open_checkpoint(model_dir).family.reference(model_dir, TEST_DEVICE)


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


def thinker_only_copy(src: Path, out: Path) -> Path:
    """`src` as its family's text-only checkpoint is published (Qwen3-Omni's Thinking and
    Captioner): the thinker's config and weights alone, `enable_audio_output: false`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    for key in ("talker_config", "code2wav_config", "token2wav_config"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps({**config, "enable_audio_output": False}))
    index = out / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    kept = {k: v for k, v in meta["weight_map"].items() if k.startswith("thinker.")}
    for shard in sorted(set(meta["weight_map"].values())):
        weights = {k: v for k, v in load_file(str(out / shard)).items() if k in kept}
        if weights:
            save_file(weights, str(out / shard), metadata={"format": "pt"})
        else:
            (out / shard).unlink()
    index.write_text(json.dumps({**meta, "weight_map": kept}))
    return out


@pytest.fixture(scope="session")
def thinking_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinker_only_copy(tiny_dir, tmp_path_factory.mktemp("thinking") / "tiny-thinking")


@pytest.fixture(scope="session")
def checkpoints(tiny_dir: Path, tiny_fused_dir: Path, tiny_variant_dir: Path, pipeline: Any,
                reference: Any) -> Any:  # fmt: skip
    """(pipeline, reference) per checkpoint name, built on first use: 'published' (the default
    tiny checkpoint), 'fused' (the same weights in the fused layout), 'variant'."""

    dirs = {"published": tiny_dir, "fused": tiny_fused_dir, "variant": tiny_variant_dir}
    made: dict[str, Any] = {"published": (pipeline, reference)}

    def get(name: str) -> tuple[Any, Any]:
        if name not in made:
            made[name] = (staged_pipeline(dirs[name]), family_reference(dirs[name]))
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

    made: dict[str, Any] = {}

    def get(name: str) -> tuple[Any, Any]:
        if name not in made:
            path = q25_dir
            if name == "variant":
                path = tmp_path_factory.mktemp("tiny-qwen2_5-omni-variant")
                write_tiny_checkpoint(path, shape=VARIANT)
            made[name] = (staged_pipeline(path), family_reference(path))
        return made[name]

    return get
