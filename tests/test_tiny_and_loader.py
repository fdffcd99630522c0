"""The tiny checkpoint is deterministic and loads; the loader refuses bad checkpoints with
errors that name the problem, before any model work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from omnistage.models.checkpoint import CheckpointError, load_part, load_tokenizer, open_checkpoint
from omnistage.models.qwen3_omni.tiny import write_tiny_checkpoint


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_tiny_checkpoint_is_byte_identical_across_runs(tiny_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    summary = write_tiny_checkpoint(again)
    names = sorted(p.name for p in tiny_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name
    assert 500_000 < summary["parameters"] < 5_000_000
    assert summary["safetensors_bytes"] < 20_000_000


def test_tiny_tokenizer_knows_the_special_tokens(tiny_dir: Path) -> None:
    ckpt = open_checkpoint(tiny_dir)
    tok = load_tokenizer(ckpt)  # raises if any special id disagrees with config.json
    assert len(tok) == ckpt.spec.thinker_vocab
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == ckpt.spec.im_start_id and ids[1] == ckpt.spec.user_id
    assert ids[-3:-1] == [ckpt.spec.im_start_id, ckpt.spec.assistant_id]
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


@pytest.mark.parametrize("part", ["thinker", "talker", "code2wav"])
def test_each_part_loads_alone_with_every_weight(tiny_dir: Path, part: str) -> None:
    model = load_part(open_checkpoint(tiny_dir), part)  # type: ignore[arg-type]
    assert sum(p.numel() for p in model.parameters()) > 10_000


@pytest.mark.parametrize(
    ("dropped_prefix", "part"),
    [("code2wav.decoder.", "code2wav"), ("talker.code_predictor.", "talker"), ("thinker.lm_head.", "thinker")],
)
def test_half_loaded_checkpoint_is_refused(tiny_dir: Path, tmp_path: Path, dropped_prefix: str, part: str) -> None:
    half = _copy(tiny_dir, tmp_path / "half")
    weights = load_file(str(half / "model.safetensors"))
    kept = {k: v for k, v in weights.items() if not k.startswith(dropped_prefix)}
    assert len(kept) < len(weights)
    save_file(kept, str(half / "model.safetensors"))
    ckpt = open_checkpoint(half)
    with pytest.raises(CheckpointError, match=rf"refusing half-loaded {part}: \d+ missing weight") as err:
        load_part(ckpt, part)  # type: ignore[arg-type]
    # The message names the missing weights (without the part prefix or with it).
    assert dropped_prefix.split(".", 1)[1].split(".")[0] in str(err.value)
    # The other parts are untouched and still load.
    other = "thinker" if part != "thinker" else "code2wav"
    load_part(ckpt, other)  # type: ignore[arg-type]


def test_unexpected_weight_in_part_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    bad = _copy(tiny_dir, tmp_path / "extra")
    weights = load_file(str(bad / "model.safetensors"))
    weights["talker.model.layers.0.mystery.weight"] = weights["talker.codec_head.weight"].clone()
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected weight.*mystery"):
        load_part(open_checkpoint(bad), "talker")


def _edit_config(path: Path, edit: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_model_family_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    bad = _copy(tiny_dir, tmp_path / "family")
    _edit_config(bad, lambda c: c.update(model_type="llama"))
    with pytest.raises(CheckpointError, match="unknown model family 'llama'"):
        open_checkpoint(bad)


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json"])
def test_missing_files_are_named(tiny_dir: Path, tmp_path: Path, missing: str) -> None:
    bad = _copy(tiny_dir, tmp_path / "missing")
    (bad / missing).unlink()
    with pytest.raises(CheckpointError, match=missing.split(".")[0]):
        open_checkpoint(bad)


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        open_checkpoint(tmp_path / "nope")


def test_tokenizer_disagreeing_with_config_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    bad = _copy(tiny_dir, tmp_path / "tok")
    _edit_config(bad, lambda c: c.update(tts_pad_token_id=c["tts_pad_token_id"] + 1))
    with pytest.raises(CheckpointError, match=r"tokenizer disagrees with config: <\|tts_pad\|> is id \d+"):
        load_tokenizer(open_checkpoint(bad))


def test_bad_prompts_fail_before_model_work(pipeline: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("model ran")

    monkeypatch.setattr(pipeline.thinker.model, "forward", boom)
    with pytest.raises(ValueError, match="empty prompt"):
        pipeline.prompt_ids("   ")
    thinker = pipeline.thinker
    with pytest.raises(ValueError, match="empty prompt"):
        thinker.set_prompt(thinker.new_state(pipeline.thinker_defaults()), [])
    too_long = [pipeline.spec.im_start_id] * pipeline.spec.max_positions
    with pytest.raises(ValueError, match=r"prompt of \d+ tokens exceeds the model maximum"):
        thinker.set_prompt(thinker.new_state(pipeline.thinker_defaults()), too_long)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        thinker.set_prompt(thinker.new_state(pipeline.thinker_defaults()), [pipeline.spec.thinker_vocab + 5])
    with pytest.raises(ValueError, match="unknown speaker 'nobody'"):
        pipeline.talker.new_state(pipeline.thinker_defaults(), "nobody")


def test_sampling_params_are_validated() -> None:
    from omnistage.models.sampling import SamplingParams

    nan = float("nan")
    for bad in ({"temperature": 0}, {"top_p": 0}, {"top_k": -1}, {"max_tokens": 0}, {"repetition_penalty": 0},
                {"temperature": nan}, {"top_p": nan}, {"repetition_penalty": nan}, {"temperature": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)  # type: ignore[arg-type]


def test_sampling_with_a_seed_is_repeatable(pipeline: Any) -> None:
    from omnistage.models.sampling import SamplingParams
    from services.pipeline import PipelineRequest

    ids = pipeline.prompt_ids("hi")
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=50, top_p=0.95, seed=7, max_tokens=8,
                            stop_ids=(pipeline.spec.im_end_id,))
    runs = [list(pipeline.run(PipelineRequest(ids, params, want_audio=False)))[-1].token_ids for _ in range(2)]
    assert runs[0] == runs[1]
    other = params.with_overrides(seed=8)
    assert list(pipeline.run(PipelineRequest(ids, other, want_audio=False)))[-1].token_ids != runs[0]
