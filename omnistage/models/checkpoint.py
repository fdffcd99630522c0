"""Open a local checkpoint directory and load one stage's part of it, refusing a half-loaded one.

transformers leaves weights randomly initialised, with only a printed report, when a part's
class is loaded from a full checkpoint whose keys it cannot map. So every load here asks
`from_pretrained` for its loading info and refuses with the names of any missing, mismatched
or (for this part) unexpected weight. Nothing is downloaded: `local_files_only` is forced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.models.family import Family, UnknownFamily, family_for
from omnistage.models.sampling import SamplingParams

__all__ = ["DTYPES", "Checkpoint", "CheckpointError", "generation_defaults", "load_part", "load_tokenizer",
           "open_checkpoint", "read_tensor_rows"]  # fmt: skip

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}  # fmt: skip


class CheckpointError(ValueError):
    """The checkpoint directory cannot be served as asked; the message names the problem."""


@dataclass
class Checkpoint:
    path: Path
    family: Family
    config: Any  # the family's full config
    spec: Any  # the family's spec (ids and sizes the stages agree on)

    @property
    def sample_rate(self) -> int:
        return self.family.sample_rate


def weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{path}: weight shards named in the index are missing: {', '.join(missing)}")
        return [path / n for n in names]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Check the directory's layout and pick its model family; no weights are read."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {p}")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{p}: missing config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
    try:
        family = family_for(raw.get("model_type") if isinstance(raw, dict) else None)
    except UnknownFamily as e:
        raise CheckpointError(f"{cfg_file}: {e}") from None
    weight_files(p)
    if not (p / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{p}: missing tokenizer_config.json")
    if not ((p / "tokenizer.json").is_file() or (p / "vocab.json").is_file()):
        raise CheckpointError(f"{p}: missing tokenizer files (tokenizer.json or vocab.json + merges.txt)")
    config = family.load_config(p)
    return Checkpoint(path=p, family=family, config=config, spec=family.spec(config))


def load_tokenizer(ckpt: Checkpoint) -> Any:
    """The checkpoint's tokenizer, after checking its special ids agree with the config."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt.path, local_files_only=True)
    problems = ckpt.family.check_tokenizer(tok, ckpt.config)
    if problems:
        raise CheckpointError(f"{ckpt.path}: tokenizer disagrees with config: " + "; ".join(problems))
    return tok


def load_part(
    ckpt: Checkpoint, part: str, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> torch.nn.Module:
    """Build only `part` from the checkpoint, with every one of its weights loaded."""
    from transformers.utils import logging as hf_logging

    family = ckpt.family
    if part not in family.part_configs:
        raise CheckpointError(f"unknown stage part {part!r}; expected one of {', '.join(family.part_configs)}")
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    cls = family.part_class(part)
    part_config = getattr(ckpt.config, family.part_configs[part])
    prefix = f"{part}."
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # we report problems ourselves, as an error
    hf_logging.disable_progress_bar()
    try:
        model, info = cls.from_pretrained(
            ckpt.path,
            config=part_config,
            dtype=torch_dtype,
            local_files_only=True,
            output_loading_info=True,
            key_mapping=family.key_mapping(part),
        )
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{ckpt.path}: cannot load {part}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys", []))
    mismatched = sorted(str(k) for k in info.get("mismatched_keys", []))
    others = tuple(f"{p}." for p in family.part_configs if p != part)
    unexpected = sorted(k for k in info.get("unexpected_keys", []) if not k.startswith(others))
    if family.key_mapping(part) is None:
        unexpected = [k for k in unexpected if k.startswith(prefix)]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing weight(s): {_names(missing)}")
    if mismatched:
        problems.append(f"{len(mismatched)} mismatched weight(s): {_names(mismatched)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected weight(s): {_names(unexpected)}")
    if info.get("error_msgs"):
        problems.append("; ".join(str(m) for m in info["error_msgs"]))
    if problems:
        raise CheckpointError(f"{ckpt.path}: refusing half-loaded {part}: " + "; ".join(problems))
    return model.to(device).eval()


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def read_tensor_rows(ckpt: Checkpoint, keys: tuple[str, ...], rows: list[int]) -> torch.Tensor:
    """Read a few rows of one tensor (the first of `keys` present) without loading the rest
    of the checkpoint, e.g. the three thinker embeddings the talker needs."""
    from safetensors import safe_open

    for f in weight_files(ckpt.path):
        with safe_open(str(f), framework="pt") as handle:
            names = set(handle.keys())
            for key in keys:
                if key in names:
                    table = handle.get_slice(key)
                    return torch.stack([table[r : r + 1][0] for r in rows])
    raise CheckpointError(f"{ckpt.path}: none of the weights {', '.join(keys)} found")


def generation_defaults(ckpt: Checkpoint, stop_ids: tuple[int, ...], max_tokens: int = 1024) -> SamplingParams:
    """The checkpoint's generation_config.json as sampling defaults, stopping on `stop_ids`."""
    gen_file = ckpt.path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    sampled = bool(gen.get("do_sample", False))
    return SamplingParams(
        do_sample=sampled,
        temperature=float(gen.get("temperature") or 1.0),
        top_k=int(gen.get("top_k") or 0) if sampled else 0,
        top_p=float(gen.get("top_p") or 1.0),
        repetition_penalty=float(gen.get("repetition_penalty") or 1.0),
        max_tokens=max_tokens,
        stop_ids=stop_ids,
    )
