"""`omnistage demo` prints the reply's text as the gateway sends it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from omnistage.cli.main import app


def _demo_with_events(monkeypatch: pytest.MonkeyPatch, model_dir: Path, out: Path, ids: list[int],
                      then: Exception | None = None) -> Any:  # fmt: skip
    """`omnistage demo` on a pipeline whose reply is `ids` (the real one's are the tiny model's,
    random here), raising `then` after them when given."""
    import services.pipeline
    from omnistage.models import load_tokenizer, open_checkpoint
    from omnistage.models.sampling import SamplingParams
    from services.pipeline import TextEvent

    ckpt = open_checkpoint(model_dir)
    tokenizer = load_tokenizer(ckpt)

    class Replay:
        def __init__(self, model_dir: Any, cfg: Any = None) -> None:
            self.checkpoint, self.tokenizer = ckpt, tokenizer

        def prompt_ids(self, prompt: str) -> list[int]:
            return [0]

        def thinker_defaults(self) -> Any:
            return SamplingParams()

        def run(self, req: Any) -> Iterator[TextEvent]:
            for i in ids:
                yield TextEvent(i, tokenizer.decode([i]), 0.0)
            if then is not None:
                raise then

    monkeypatch.setattr(services.pipeline, "InProcessPipeline", Replay)
    return CliRunner().invoke(app, ["demo", "hi", "--model", str(model_dir), "--out", str(out)])


def test_demo_prints_whole_characters_and_no_stop_token(tiny_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Each token was decoded alone: a character split over two tokens printed as two U+FFFD,
    and the reply's last token as `<|im_end|>`."""
    from omnistage.models import load_tokenizer, open_checkpoint

    ckpt = open_checkpoint(tiny_dir)
    tokenizer = load_tokenizer(ckpt)
    words = "naïve café 中文"
    ids = [*tokenizer.encode(words), ckpt.spec.im_end_id]
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "no character spans two tokens: the case is moot"
    result = _demo_with_events(monkeypatch, tiny_dir, tmp_path / "r.wav", ids)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(words) and "<|im_end|>" not in result.output and "\ufffd" not in result.output


def test_demo_runs_a_checkpoint_without_speech_as_text_only(thinking_dir: Path, tmp_path: Path) -> None:
    """A Thinking or Captioner checkpoint: the refusal names --text-only, which demo takes too."""
    out = tmp_path / "r.wav"
    refused = CliRunner().invoke(app, ["demo", "hi", "--model", str(thinking_dir), "--out", str(out)])
    assert refused.exit_code != 0 and "--text-only" in refused.output and "demo" in refused.output
    result = CliRunner().invoke(app, ["demo", "hi", "--model", str(thinking_dir), "--text-only", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() and "wrote" not in result.output and not out.exists()


def test_a_demo_failing_mid_reply_puts_its_error_on_a_line_of_its_own(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    from omnistage.models import load_tokenizer, open_checkpoint

    ids = load_tokenizer(open_checkpoint(tiny_dir)).encode("Once upon")
    failure = ValueError("codec id outside the codebook")
    result = _demo_with_events(monkeypatch, tiny_dir, tmp_path / "r.wav", ids, failure)
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[:2] == ["Once upon", "error: ValueError: codec id outside the codebook"], result.output
