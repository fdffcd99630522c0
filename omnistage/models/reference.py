"""The monolithic reference every family's parity is checked against: transformers' full model
of the family and its `generate()`, greedy, with the codes it hands its vocoder recorded (the
parity tests and the bench's baseline). A family's `reference.py` says how to load its model and
which of `generate()`'s arguments it needs beyond the shared ones."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch


class MonolithicReference(ABC):
    model: Any

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.last_codes: torch.Tensor | None = None

    def record_codes(self, owner: Any, method: str, pick: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Wrap `owner.method` (the vocoder's entry) so that `pick(codes)` of each call is kept."""
        original = getattr(owner, method)

        def recording(codes: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self.last_codes = pick(codes.clone())
            return original(codes, *args, **kwargs)

        setattr(owner, method, recording)

    @property
    @abstractmethod
    def default_speaker(self) -> str:
        """The voice `generate()` speaks with when a request names none."""

    @abstractmethod
    def family_arguments(self, audio: bool, inputs: dict[str, Any]) -> dict[str, Any]:
        """The family's own `generate()` arguments (`inputs`: the request's multimodal inputs)."""

    def generate(self, prompt_ids: list[int], thinker_max: int, talker_max: int, eos_id: int, audio: bool = True,
                 speaker: str | None = None, seed: int = 0, talker_repetition_penalty: float = 1.0,
                 **inputs: Any) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
        """Greedy: (generated ids, codes `[groups, frames]` or None, wav `[samples]` or None).
        The global seed is `seed` first (what a sampled vocoder draws its noise from). Inputs go to
        the model's device; what it returns comes back to the host."""
        self.last_codes = None
        inputs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=torch.tensor([prompt_ids], device=self.device),
                speaker=speaker or self.default_speaker,
                **inputs,
                thinker_max_new_tokens=thinker_max,
                thinker_eos_token_id=eos_id,
                talker_max_new_tokens=talker_max,
                talker_do_sample=False,
                talker_repetition_penalty=talker_repetition_penalty,
                **self.family_arguments(audio, inputs),
            )
        if not audio:
            seq = out.sequences if hasattr(out, "sequences") else out
            return seq[0, len(prompt_ids) :].tolist(), None, None
        seq, wav = out
        codes = None if self.last_codes is None else self.last_codes.cpu()
        return seq[0, len(prompt_ids) :].tolist(), codes, wav.reshape(-1).cpu()
