"""The model layer: one folder per family (like transformers' `models/<family>/`), plus what
every family shares: checkpoint loading, sampling and the exact batching mode."""

from omnistage.models.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_part,
    load_tokenizer,
    media_inputs,
    open_checkpoint,
)
from omnistage.models.family import Family, PartRefused, family_for
from omnistage.models.sampling import SamplingParams

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "Family",
    "PartRefused",
    "SamplingParams",
    "family_for",
    "load_part",
    "load_tokenizer",
    "media_inputs",
    "open_checkpoint",
]
