"""What a model family provides, and the registry that picks one from `config.json`.

A family is one folder under `omnistage/models/` (like transformers' `models/<family>/`)
exposing `FAMILY`, an instance of `Family`. Everything above the model layer asks the family
for its parts and its prompt rules and never names a family itself; the family is chosen by the
checkpoint's `model_type`.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from omnistage.models.checkpoint import Checkpoint
    from omnistage.models.sampling import SamplingParams

__all__ = ["FAMILIES", "Family", "UnknownFamily", "family_for"]

# model_type -> the module whose FAMILY serves it
FAMILIES: dict[str, str] = {
    "qwen3_omni_moe": "omnistage.models.qwen3_omni",
    "qwen2_5_omni": "omnistage.models.qwen2_5_omni",
}


class UnknownFamily(ValueError):
    pass


class PartRefused(ValueError):
    """A part of a request's messages its model inputs cannot be built from, named as the
    gateway names media parts: `messages[i].parts[j] (kind): why` (an input builder's refusal)."""


class Family(ABC):
    """One model family: its checkpoint layout, its parts and the glue `generate()` does
    between them."""

    model_type: str
    display_name: str
    sample_rate: int
    # stage part -> the attribute of the full config holding that part's config
    part_configs: ClassVar[dict[str, str]]
    # whether its checkpoints without a talker (text only) can be served, with `audio_output: false`
    text_only: ClassVar[bool] = False

    @abstractmethod
    def load_config(self, path: Path) -> Any:
        """The full model config from a checkpoint directory (no weights read)."""

    @abstractmethod
    def spec(self, config: Any, path: Path | None = None, speech: bool = True) -> Any:
        """The ids and sizes the stages agree on (see the family's `spec.py`); `path`: the
        checkpoint directory, for what a family keeps beside config.json (voices, tokenizer ids);
        `speech` False: a text-only checkpoint (only the thinker's are meaningful)."""

    @abstractmethod
    def part_class(self, part: str) -> Any:
        """The transformers class of one part."""

    def weight_prefix(self, part: str) -> str:
        """How the checkpoint names the part's tensors (default: the stage part's name)."""
        return f"{part}."

    def key_mapping(self, part: str) -> dict[str, str] | None:
        """Checkpoint-key renames `from_pretrained` needs for this part (None: none)."""
        return None

    def register_conversions(self) -> None:  # noqa: B027 - most families need none
        """Register with transformers the weight conversions its parts need to load the published
        layout (idempotent)."""

    def check_config(self, config: Any, speech: bool = True) -> list[str]:
        """Where the parts of the config disagree with each other (empty: they agree); without
        `speech`, the thinker's alone (the talker's and vocoder's are transformers' defaults)."""
        return []

    def row_modules(self) -> tuple[type, ...]:
        """Module types that exact batching runs on each request's rows alone: those that call
        `F.linear` on their own weights, and those whose math is not row-independent (see
        models/batching.py)."""
        return ()

    @abstractmethod
    def check_tokenizer(self, tokenizer: Any, config: Any) -> list[str]:
        """Disagreements between the tokenizer's special ids and the config (empty: none)."""

    @abstractmethod
    def prompt_ids(self, tokenizer: Any, messages: list[dict[str, str]],
                   template_kwargs: Mapping[str, Any] | None = None) -> list[int]:  # fmt: skip
        """Chat messages -> prompt ids ending with the assistant header (`template_kwargs`: the
        request's own variables for the chat template)."""

    @abstractmethod
    def input_builder(self, ckpt: Checkpoint, tokenizer: Any) -> Any:
        """Chat messages with decoded audio, images and video -> prompt ids and model inputs,
        with the checkpoint's processor (see `qwen3_omni/processor.py`'s `InputBuilder`)."""

    @abstractmethod
    def thinker(self, ckpt: Checkpoint, dtype: str, device: str, batching: str = "exact") -> Any:
        """The thinker part, ready to step many requests (see `qwen3_omni/thinker.py`);
        `batching`: "exact" or "fast" (models/batching.py)."""

    @abstractmethod
    def talker(self, ckpt: Checkpoint, dtype: str, device: str, batching: str = "exact",
               cuda_graphs: int = 0) -> Any:  # fmt: skip
        """The talker part (with its code predictor), ready to step many requests; `cuda_graphs`:
        on CUDA, the largest batch whose per-frame loop replays a captured graph (0: eager)."""

    @abstractmethod
    def code2wav(self, ckpt: Checkpoint, dtype: str, device: str, batching: str = "exact") -> Any:
        """The codes -> waveform part, full and streaming; `batching` as for the thinker, where
        the family's decoder has a choice."""

    @abstractmethod
    def thinker_defaults(self, ckpt: Checkpoint) -> SamplingParams:
        """Thinker sampling when a request sets none (the checkpoint's generation config)."""

    @abstractmethod
    def talker_defaults(self) -> SamplingParams:
        """Talker sampling when a request sets none (`generate()`'s defaults)."""

    @abstractmethod
    def reference(self, model_dir: Path, device: str = "cpu", dtype: str = "float32") -> Any:
        """transformers' monolithic model on a checkpoint, as the parity reference: an object with
        `generate(prompt_ids, thinker_max, talker_max, eos_id, audio=True, speaker=None, seed=0,
        talker_repetition_penalty=1.0, **inputs) -> (ids, codes [G, T] | None, wav | None)`, greedy."""

    @abstractmethod
    def write_tiny(self, out_dir: Path, **options: Any) -> dict[str, Any]:
        """Write this family's deterministic tiny checkpoint."""


def family_for(model_type: object) -> Family:
    """The family serving `model_type`; an unknown type is refused naming the supported ones."""
    module = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if module is None:
        known = ", ".join(repr(k) for k in sorted(FAMILIES))
        raise UnknownFamily(f"unknown model family {model_type!r}; omnistage serves {known}")
    family: Family = importlib.import_module(module).FAMILY
    return family
