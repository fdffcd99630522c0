"""Load one stage's part of a local Qwen3-Omni checkpoint, and refuse a half-loaded one.

transformers leaves weights randomly initialised, with only a printed report, when a part's
class is loaded from a full checkpoint whose keys it cannot map. So every load here asks
`from_pretrained` for its loading info and refuses with the names of any missing, mismatched
or (for this part) unexpected weight. Nothing is downloaded: `local_files_only` is forced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from omnistage.families.qwen3_omni import (
    MODEL_TYPE,
    ROLE_WORD_IDS,
    SPECIAL_TOKEN_TEXT,
    THINKER_SPECIAL_TOKEN_TEXT,
    FamilySpec,
    tts_special_embeds,
    tts_special_ids,
)
from services.runtime.sampling import SamplingParams

Part = Literal["thinker", "talker", "code2wav"]
PARTS: tuple[Part, ...] = ("thinker", "talker", "code2wav")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """The checkpoint directory cannot be served as asked; the message names the problem."""


@dataclass
class Checkpoint:
    path: Path
    config: Any  # Qwen3OmniMoeConfig
    spec: FamilySpec


def _weight_files(path: Path) -> list[Path]:
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
    """Check the directory's layout and model family; no weights are read."""
    from transformers import Qwen3OmniMoeConfig

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
    model_type = raw.get("model_type")
    if model_type != MODEL_TYPE:
        raise CheckpointError(
            f"{cfg_file}: unknown model family {model_type!r}; omnistage serves {MODEL_TYPE!r} (Qwen3-Omni)"
        )
    _weight_files(p)
    for name in ("tokenizer_config.json",):
        if not (p / name).is_file():
            raise CheckpointError(f"{p}: missing {name}")
    if not ((p / "tokenizer.json").is_file() or (p / "vocab.json").is_file()):
        raise CheckpointError(f"{p}: missing tokenizer files (tokenizer.json or vocab.json + merges.txt)")
    config = Qwen3OmniMoeConfig.from_pretrained(p, local_files_only=True)
    return Checkpoint(path=p, config=config, spec=FamilySpec.from_config(config))


def load_tokenizer(ckpt: Checkpoint) -> Any:
    """The checkpoint's tokenizer, after checking its special ids agree with the config."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt.path, local_files_only=True)
    cfg = ckpt.config
    expected: dict[str, tuple[str, int]] = {}
    for field_name, text in SPECIAL_TOKEN_TEXT.items():
        expected[field_name] = (text, getattr(cfg, field_name))
    for field_name, text in THINKER_SPECIAL_TOKEN_TEXT.items():
        expected[f"thinker_config.{field_name}"] = (text, getattr(cfg.thinker_config, field_name))
    problems = []
    for field_name, (text, want) in expected.items():
        got = tok.convert_tokens_to_ids(text)
        if got != want:
            problems.append(f"{text} is id {got} in the tokenizer but {field_name}={want} in config.json")
    for field_name, word in ROLE_WORD_IDS.items():
        want = getattr(cfg, field_name)
        got = tok.encode(word, add_special_tokens=False)
        if got != [want]:
            problems.append(f"{word!r} encodes to {got} but {field_name}={want} in config.json")
    if problems:
        raise CheckpointError(f"{ckpt.path}: tokenizer disagrees with config: " + "; ".join(problems))
    return tok


def _part_class_and_config(ckpt: Checkpoint, part: Part) -> tuple[Any, Any]:
    from transformers import (
        Qwen3OmniMoeCode2Wav,
        Qwen3OmniMoeTalkerForConditionalGeneration,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    cfg = ckpt.config
    return {
        "thinker": (Qwen3OmniMoeThinkerForConditionalGeneration, cfg.thinker_config),
        "talker": (Qwen3OmniMoeTalkerForConditionalGeneration, cfg.talker_config),
        "code2wav": (Qwen3OmniMoeCode2Wav, cfg.code2wav_config),
    }[part]


def load_part(
    ckpt: Checkpoint, part: Part, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> torch.nn.Module:
    """Build only `part` from the checkpoint, with every one of its weights loaded."""
    from transformers.utils import logging as hf_logging

    if part not in PARTS:
        raise CheckpointError(f"unknown stage part {part!r}; expected one of {', '.join(PARTS)}")
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    cls, part_config = _part_class_and_config(ckpt, part)
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
            # code2wav's class has no prefix of its own in a full checkpoint
            key_mapping={r"^code2wav\.": ""} if part == "code2wav" else None,
        )
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{ckpt.path}: cannot load {part}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys", []))
    mismatched = sorted(str(k) for k in info.get("mismatched_keys", []))
    others = tuple(f"{p}." for p in PARTS if p != part)
    unexpected = sorted(k for k in info.get("unexpected_keys", []) if not k.startswith(others))
    if part != "code2wav":
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

    for f in _weight_files(ckpt.path):
        with safe_open(str(f), framework="pt") as handle:
            names = set(handle.keys())
            for key in keys:
                if key in names:
                    table = handle.get_slice(key)
                    return torch.stack([table[r : r + 1][0] for r in rows])
    raise CheckpointError(f"{ckpt.path}: none of the weights {', '.join(keys)} found")


# Where the thinker's token embedding lives (transformers 5 layout, then the original one).
THINKER_EMBED_KEYS = ("thinker.model.language_model.embed_tokens.weight", "thinker.model.embed_tokens.weight")


def talker_tts_embeds(ckpt: Checkpoint, talker: torch.nn.Module) -> torch.Tensor:
    """The talker's projected tts_bos/eos/pad embeddings, from three rows of the thinker's
    embedding table (the talker stage never loads the thinker)."""
    rows = read_tensor_rows(ckpt, THINKER_EMBED_KEYS, tts_special_ids(ckpt.spec))
    return tts_special_embeds(talker, rows)


def thinker_sampling_defaults(ckpt: Checkpoint) -> SamplingParams:
    """The checkpoint's generation_config for the thinker, stopping on `<|im_end|>`."""
    gen_file = ckpt.path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    sampled = bool(gen.get("do_sample", False))
    return SamplingParams(
        do_sample=sampled,
        temperature=float(gen.get("temperature") or 1.0),
        top_k=int(gen.get("top_k") or 0) if sampled else 0,
        top_p=float(gen.get("top_p") or 1.0),
        repetition_penalty=float(gen.get("repetition_penalty") or 1.0),
        max_tokens=1024,
        stop_ids=(ckpt.spec.im_end_id,),
    )
