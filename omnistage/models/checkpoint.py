"""Open a local checkpoint directory and load one stage's part of it, refusing a broken or
half-loaded one by name.

`open_checkpoint` reads no weights but checks, within seconds, what can be checked without
them: the layout (one `model.safetensors` or shards named by `model.safetensors.index.json`),
every safetensors file's header (a truncated, empty or corrupt file is named), the index
against the shards, the model family, the tokenizer files, and whether the parts of the config
agree with each other (the family's own checks).

`load_part` builds one part with transformers' `from_pretrained` and its conversion machinery
(the published layout stores MoE experts one by one; the family registers the conversion for
its parts). transformers leaves weights randomly initialised, with only a printed report, when
it cannot map keys, so every load asks for the loading info and refuses with the names of any
missing, wrong-shape or unexpected weight of this part. Nothing is downloaded:
`local_files_only` is forced.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from omnistage.models.family import Family, UnknownFamily, family_for
from omnistage.models.sampling import SamplingParams, greedy_temperature

log = logging.getLogger(__name__)

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
    tensors: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # name -> (dtype, shape)
    no_speech: list[str] = field(default_factory=list)  # why it cannot speak (empty: it can)
    chat_template: str = ""  # as the processor takes it (see `chat_template`)

    @property
    def name(self) -> str:
        """The name clients see by default: the directory's, or the repository's for a Hugging
        Face cache snapshot (`.../models--Qwen--Qwen3-Omni-30B-A3B-Instruct/snapshots/<commit>`
        serves as `Qwen/Qwen3-Omni-30B-A3B-Instruct`, not as the commit hash)."""
        p = self.path.resolve()
        repo = p.parent.parent.name if p.parent.name == "snapshots" else ""
        if repo.startswith("models--") and repo != "models--":
            return repo.removeprefix("models--").replace("--", "/")
        return p.name

    @property
    def sample_rate(self) -> int:
        return self.family.sample_rate

    @property
    def speaks(self) -> bool:
        return not self.no_speech

    def resolve_dtype(self, name: str) -> str:
        """A stage's `dtype` setting as a dtype name: `auto` is the checkpoint's own (config.json
        `dtype`, as published: bfloat16), float32 when it names none."""
        if name != "auto":
            return name
        own = getattr(self.config, "dtype", None)
        own = str(own).removeprefix("torch.") if own is not None else "float32"
        if own not in DTYPES:  # (its weights are floats: open_checkpoint checked)
            raise CheckpointError(f"{self.path / 'config.json'}: dtype {own!r} is none that omnistage loads "
                                  f"({', '.join(DTYPES)}): name one with --dtype (or the stage's `dtype`)")
        return own

    def check_serves(self, audio_output: bool) -> None:
        """Refuse a stack that would speak with a checkpoint that cannot (deploy `audio_output`)."""
        if audio_output and not self.speaks:
            raise CheckpointError(f"{self.path}: a checkpoint without speech output ({'; '.join(self.no_speech)}): "
                                  "serve it as text only with `audio_output: false` in the deploy config "
                                  "(`--text-only` for omnistage serve, stage, gateway or demo)")  # fmt: skip


def weight_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_index_map(index).values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{path}: weight shards named in the index are missing: {', '.join(missing)}")
        return [path / n for n in names]
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _index_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
    return weight_map


_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}  # fmt: skip


def read_header(file: Path) -> dict[str, tuple[str, list[int]]]:
    """A safetensors file's tensors (name -> dtype, shape), after checking the header and the
    file's size agree; any problem is a CheckpointError naming the file."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{file}: not a valid safetensors file: {why}")

    size = file.stat().st_size
    if size < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header length")
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > min(size - 8, 100 << 20):
            raise bad(f"header length {header_len} does not fit a file of {size} bytes")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    data_len = size - 8 - header_len
    tensors: dict[str, tuple[str, list[int]]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise bad("__metadata__ is not a map of strings")
            continue
        try:
            dtype, shape, (start, stop) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
            if dtype in _DTYPE_BYTES:
                size_ok = stop - start == _DTYPE_BYTES[dtype] * math.prod(shape) and start >= 0
            else:  # one this check has no size for (F8_E8M0, F4, ...): not a float weight, refused below by name
                size_ok = isinstance(dtype, str) and 0 <= start <= stop and all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has a malformed entry") from None
        if not size_ok:
            raise bad(f"tensor {name!r}: {stop - start} bytes for dtype {dtype} and shape {shape}")
        spans.append((start, stop, name))
        tensors[name] = (dtype, shape)
    # as safetensors itself requires (else it refuses the file when a part loads): the tensors
    # tile the data, in order of their offsets, with no gap, overlap or bytes after them
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            raise bad(f"tensor {name!r} starts at byte {start} of the data, the one before it ends at {end}")
        end = stop
    if end > data_len:
        raise bad(f"truncated: the header places tensor data up to byte {end}, the file holds {data_len}")
    if end < data_len:
        raise bad(f"{data_len - end} bytes after the last tensor's data")
    return tensors


def checkpoint_tensors(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of the checkpoint (name -> dtype, shape), each file's header checked, and the
    index (if sharded) checked against the shards."""
    files = weight_files(path)
    tensors: dict[str, tuple[str, list[int]]] = {}
    where: dict[str, str] = {}
    for f in files:
        for name, entry in read_header(f).items():
            if name in where:
                raise CheckpointError(f"{path}: tensor {name!r} is stored twice ({where[name]}, {f.name})")
            tensors[name] = entry
            where[name] = f.name
    index = path / "model.safetensors.index.json"
    if len(files) > 1 or files[0].name != "model.safetensors":
        weight_map = _index_map(index)
        wrong = sorted(k for k, v in weight_map.items() if where.get(k) != v)
        if wrong:
            raise CheckpointError(f"{index}: {len(wrong)} tensor(s) not in the shard the index names: {_names(wrong)}")
        unlisted = sorted(set(where) - set(weight_map))
        if unlisted:
            raise CheckpointError(f"{index}: {len(unlisted)} tensor(s) in the shards but not in the index: "
                                  f"{_names(unlisted)}")  # fmt: skip
    return tensors


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
    tensors = checkpoint_tensors(p)
    not_float = sorted(n for n, (dtype, _) in tensors.items() if dtype not in _FLOAT_DTYPES)
    if not_float:  # transformers would cast them to the model's dtype without a word
        raise CheckpointError(f"{p}: {len(not_float)} weight(s) not stored as floating point (e.g. "
                              f"{not_float[0]} as {tensors[not_float[0]][0]}): omnistage loads float32, bfloat16 "
                              "or float16 weights; quantized checkpoints are not supported")  # fmt: skip
    missing = _no_weights(family, "thinker", tensors)
    if missing:
        raise CheckpointError(f"{p}: {missing}")
    prefixes = tuple(family.weight_prefix(part) for part in family.part_configs)
    strays = sorted(n for n in tensors if not n.startswith(prefixes))
    if strays:  # no part would read them: a checkpoint of another model, or one edited by hand
        raise CheckpointError(f"{p}: {len(strays)} weight(s) of no part of the model (names start with none of "
                              f"{', '.join(prefixes)}): {_names(strays)}")  # fmt: skip
    no_speech = _speech_problems(raw, family, tensors)
    if no_speech and not family.text_only:
        raise CheckpointError(f"{p}: a checkpoint without speech output ({'; '.join(no_speech)}): omnistage serves "
                              f"{family.display_name} checkpoints that speak")  # fmt: skip
    _check_experts(p, tensors)
    if not (p / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{p}: missing tokenizer_config.json")
    if not ((p / "tokenizer.json").is_file() or ((p / "vocab.json").is_file() and (p / "merges.txt").is_file())):
        raise CheckpointError(f"{p}: missing tokenizer files (tokenizer.json or vocab.json + merges.txt)")
    template = chat_template(p)  # a checkpoint without one could answer no chat request
    from huggingface_hub.errors import StrictDataclassError  # transformers' typed config fields

    def invalid(why: object) -> CheckpointError:
        one_line = "; ".join(line.strip() for line in str(why).splitlines() if line.strip())
        return CheckpointError(f"{cfg_file}: not a valid {family.display_name} config ({one_line})")

    try:
        with _transformers_quiet():  # it misjudges ids of another part's vocabulary (Qwen2.5's talker config)
            config = family.load_config(p)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:
        raise invalid(e) from None
    sizes = _config_problems(config)
    if sizes:
        raise CheckpointError(f"{cfg_file}: not a valid {family.display_name} config: " + "; ".join(sizes))
    try:  # (a field of the wrong type that transformers does not type: an id as text, say)
        problems = family.check_config(config, speech=not no_speech)
        spec = family.spec(config, p, speech=not no_speech)
    except CheckpointError:  # another file's (Qwen2.5-Omni's voices): named already
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise invalid(e) from None
    if problems:
        raise CheckpointError(f"{cfg_file}: the parts of the config disagree: " + "; ".join(problems))
    return Checkpoint(path=p, family=family, config=config, spec=spec, tensors=tensors, no_speech=no_speech,
                      chat_template=template)  # fmt: skip


# sizes no model of these families can have at 0 or below (transformers builds it anyway: a
# thinker of -1 layers has none, and speaks)
_AT_LEAST_ONE = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size",
                 "encoder_layers", "num_heads", "max_position_embeddings", "num_code_groups", "num_quantizers",
                 "codebook_size")  # fmt: skip
_ALL_AT_LEAST_ONE = ("upsample_rates", "upsampling_ratios", "upsample_kernel_sizes")  # lists of them


# Qwen3-Omni's text stacks interleave their M-RoPE sections (transformers' recomposition_frequencies
# reads the height's and width's counts and takes every third frequency up to them, the time's the
# rest): sections that do not fill the head still make a model. Qwen2.5-Omni's split the head by them.
_INTERLEAVED_MROPE = frozenset({"qwen3_omni_moe_text", "qwen3_omni_moe_talker_text"})


def _config_problems(config: Any, prefix: str = "") -> list[str]:
    """What no model of these families can have, in the config or any of its sub-configs, by
    name (transformers builds the model anyway, and it fails on every request or at load):
    `_AT_LEAST_ONE` sizes below 1, rope sections that do not fill the head (where the model splits
    it by them), more experts per token than experts."""
    from transformers import PretrainedConfig

    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    out = []
    for key, value in vars(config).items():
        name = f"{prefix}{key}"
        if isinstance(value, PretrainedConfig):
            out += _config_problems(value, f"{name}.")
        elif key in _AT_LEAST_ONE and whole(value) and value < 1:
            out.append(f"{name} is {value}; it must be at least 1")
        elif key in _ALL_AT_LEAST_ONE and isinstance(value, list | tuple) and not all(
            whole(v) and v >= 1 for v in value
        ):
            out.append(f"{name} is {list(value)}; each must be a whole number of at least 1")
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict):
        theta = rope.get("rope_theta")
        if theta is not None and not (isinstance(theta, int | float) and not isinstance(theta, bool) and theta > 0):
            out.append(f"{prefix}rope_parameters.rope_theta is {theta!r}; it must be a number above 0")
        section, heads = rope.get("mrope_section"), getattr(config, "num_attention_heads", None)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // heads if whole(heads) and heads > 0 and whole(getattr(config, "hidden_size", None))
            else None)  # fmt: skip
        sections = isinstance(section, list) and all(whole(v) and v >= 0 for v in section)
        if getattr(config, "model_type", "") in _INTERLEAVED_MROPE:
            if section is not None and not (sections and len(section) >= 3):
                out.append(f"{prefix}rope_parameters.mrope_section is {section!r}; it must be three or more "
                           "whole numbers of at least 0")  # fmt: skip
        elif section is not None and whole(head_dim) and not (sections and 2 * sum(section) == head_dim):
            out.append(f"{prefix}rope_parameters.mrope_section is {section!r}; its sections must add up to half "
                       f"the head width ({head_dim} / 2)")  # fmt: skip
    per_token, experts = getattr(config, "num_experts_per_tok", None), getattr(config, "num_experts", None)
    if whole(per_token) and whole(experts) and experts > 0 and not 1 <= per_token <= experts:
        out.append(f"{prefix}num_experts_per_tok is {per_token}; it must be 1..num_experts ({experts})")
    return out


_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<index>\d+)\.(?P<rest>.+)$")


def _check_experts(path: Path, tensors: dict[str, Any]) -> None:
    """In the per-expert layout (`...mlp.experts.5.up_proj.weight`, as published), every expert
    of a block must have every tensor the block's experts have, and a part's blocks the same
    number of experts: a missing one is named here by its key (transformers, merging the
    experts, would report the merged weight missing or misshapen instead)."""
    blocks: dict[str, dict[str, set[int]]] = {}
    shapes: dict[tuple[str, str], dict[tuple[int, ...], str]] = {}  # (block, kind) -> shape -> an expert's name
    for name, (_, shape) in tensors.items():
        m = _EXPERT.match(name)
        if m:
            blocks.setdefault(m["block"], {}).setdefault(m["rest"], set()).add(int(m["index"]))
            shapes.setdefault((m["block"], m["rest"]), {}).setdefault(tuple(shape), name)
    odd = [f"{' vs '.join(f'{n} {list(s)}' for s, n in by_shape.items())}" for by_shape in shapes.values()
           if len(by_shape) > 1]  # fmt: skip
    if odd:  # transformers, stacking them, would report the merged weight missing
        raise CheckpointError(f"{path}: experts of one block differ in shape: {_names(sorted(odd), 2)}")
    widest: dict[str, int] = {}  # per part (the name's first component): the most experts of any block
    for block, kinds in blocks.items():
        part = block.split(".", 1)[0]
        widest[part] = max(widest.get(part, 0), max(max(ix) for ix in kinds.values()) + 1)
    missing = []
    for block, kinds in sorted(blocks.items()):
        for rest, indices in sorted(kinds.items()):
            missing += [f"{block}.{i}.{rest}" for i in range(widest[block.split(".", 1)[0]]) if i not in indices]
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} expert weight(s) missing: {_names(missing)}")


def _speech_problems(raw: dict[str, Any], family: Any, tensors: dict[str, Any]) -> list[str]:
    """Why a checkpoint of the family cannot speak (empty: it can): a text-only variant (such as
    Qwen3-Omni's Thinking and Captioner) has no talker or vocoder config or weights; for it
    transformers fills in default configs, which nothing may check or use."""
    reasons = []
    if raw.get("enable_audio_output") is False:
        reasons.append("config.json sets enable_audio_output: false")
    for part, key in family.part_configs.items():
        if part == "thinker":
            continue
        if key not in raw:
            reasons.append(f"config.json has no {key}")
        missing = _no_weights(family, part, tensors)
        if missing:
            reasons.append(missing)
    return reasons


def _no_weights(family: Any, part: str, tensors: dict[str, Any]) -> str:
    """Why the checkpoint has no weights of `part` ("": it has some)."""
    prefix = family.weight_prefix(part)
    if any(name.startswith(prefix) for name in tensors):
        return ""
    return f"no weights of the {part} (no tensor name starts with {prefix!r})"


def special_token_ids(path: Path, tokens: tuple[str, ...]) -> dict[str, int]:
    """The ids of `tokens` in the checkpoint's tokenizer (for ids config.json does not name)."""
    from transformers import AutoTokenizer

    try:
        with _transformers_quiet():  # (it reads config.json too, and warns as the config load does)
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({e})") from None
    out = {}
    for text in tokens:
        token_id = tok.convert_tokens_to_ids(text)
        if token_id is None or token_id == tok.unk_token_id:
            raise CheckpointError(f"{path}: the tokenizer has no {text} token")
        out[text] = int(token_id)
    return out


# transformers' processor order (ProcessorMixin.get_processor_dict): its config's key, then the
# legacy chat_template.json, then chat_template.jinja; the tokenizer's own last
CHAT_TEMPLATE_FILES = ("processor_config.json", "chat_template.json", "chat_template.jinja", "tokenizer_config.json")


def _template_in(file: Path) -> str | None:
    """The chat template a file holds: a .jinja file's text, or a JSON file's `chat_template`
    (a string, or named templates of which `default` is the one)."""
    if not file.is_file():
        return None
    try:
        if file.suffix == ".jinja":
            return file.read_text() or None
        value = json.loads(file.read_text()).get("chat_template")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from None
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(value, dict):
        value = value.get("default")
    return value if isinstance(value, str) and value else None


def chat_template(path: Path) -> str:
    """The checkpoint's chat template, as its processor takes it: processor_config.json's, else
    chat_template.json's (where the published Qwen Omni checkpoints keep it), else
    chat_template.jinja (where transformers 5 saves it, so a processor saved again into a
    downloaded folder leaves both files), else tokenizer_config.json's. CheckpointError when there
    is none."""
    for name in CHAT_TEMPLATE_FILES:
        template = _template_in(path / name)
        if template is not None:
            return template
    raise CheckpointError(f"{path}: no chat template (looked in {', '.join(CHAT_TEMPLATE_FILES)})")


def load_tokenizer(ckpt: Checkpoint) -> Any:
    """The checkpoint's tokenizer with the checkpoint's chat template, after checking its special
    ids agree with the config."""
    from transformers import AutoTokenizer

    try:
        with _transformers_quiet():  # (it reads config.json too, and warns as the config load does)
            tok = AutoTokenizer.from_pretrained(ckpt.path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{ckpt.path}: cannot load the tokenizer ({e})") from None
    tok.chat_template = ckpt.chat_template
    # What a client writes is sanitized of the special tokens alone (prompt.build_prompt_ids):
    # transformers would add the other added tokens its template's text holds, such as a role word
    # that a tokenizer adds as a token of its own (the tiny ones' "assistant", marked in a message's
    # role too: an earlier reply's turn would open with its letters, and a "user" word so read is
    # no user turn to the talker), and Qwen3's <think>, which a client's text may hold as the model
    # reads it.
    tok.chat_control_tokens = []
    _encode_one_at_a_time(tok)
    # The gateway checks a prompt's length against the model's and refuses it by name; transformers'
    # own warning of a long sequence ("... will result in indexing errors") would be logged besides,
    # with no request id, for a prompt that is then refused or served. Marked as given already.
    tok.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    problems = ckpt.family.check_tokenizer(tok, ckpt.config)
    if problems:
        raise CheckpointError(f"{ckpt.path}: tokenizer disagrees with config: " + "; ".join(problems))
    return tok


def _encode_one_at_a_time(tok: Any) -> None:
    """transformers' fast tokenizer sets its one Rust tokenizer's options (split_special_tokens,
    truncation, padding) before each encode: two threads encoding at once (the gateway builds
    prompts in worker threads) could each encode with the other's, a sanitized prompt's special
    token text (split) beside a plain prompt whose own tokens then came out as text. Its encodes
    go one at a time (reentrant: a sanitized encode encodes its pieces within)."""
    encode = getattr(tok, "_encode_plus", None)
    if encode is None:
        return
    lock = threading.RLock()

    def encode_locked(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return encode(*args, **kwargs)

    tok._encode_plus = encode_locked


def media_inputs(ckpt: Checkpoint, tokenizer: Any) -> tuple[Any, str]:
    """The family's input builder (the checkpoint's processor) and "", or None and why audio,
    images and video cannot be taken: its processor files are missing or damaged (text still
    can be served)."""
    try:
        return ckpt.family.input_builder(ckpt, tokenizer), ""
    except CheckpointError as e:
        return None, f"this checkpoint's processor cannot be used, so audio, images and video are not accepted: {e}"


def load_part(
    ckpt: Checkpoint, part: str, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> torch.nn.Module:
    """Build only `part` from the checkpoint, with every one of its weights loaded."""
    family = ckpt.family
    if part not in family.part_configs:
        raise CheckpointError(f"unknown stage part {part!r}; expected one of {', '.join(family.part_configs)}")
    torch_dtype = DTYPES[ckpt.resolve_dtype(dtype)] if isinstance(dtype, str) else dtype
    cls = family.part_class(part)
    part_config = getattr(ckpt.config, family.part_configs[part])
    family.register_conversions()
    try:
        # Only this part's tensors are read: handed a whole checkpoint, from_pretrained would read
        # every tensor of every part (a stage process would peak at the whole model's size).
        with _transformers_quiet():
            model, info = cls.from_pretrained(
                None,
                state_dict=_part_tensors(ckpt, part),
                config=part_config,
                dtype=torch_dtype,
                local_files_only=True,
                output_loading_info=True,
                ignore_mismatched_sizes=True,  # so that a wrong shape is reported by name, then refused below
                key_mapping=family.key_mapping(part),
            )
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"{ckpt.path}: cannot load {part}: {e}") from e
    missing = sorted(info.get("missing_keys", []))
    mismatched = sorted(_mismatch(m) for m in info.get("mismatched_keys", []))
    # A buffer the model computes from its config and does not save (a rotary `inv_freq`, an
    # anti-aliasing `filter`) may still be stored by a published checkpoint (Qwen2.5-Omni's
    # token2wav stores its DiT's `inv_freq`); transformers uses the computed one, and so do we.
    unsaved = _unsaved_buffers(model)  # transformers names unexpected keys as the model's own
    unexpected = sorted(k for k in info.get("unexpected_keys", []) if k not in unsaved)
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing weight(s): {_names(missing)}")
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) of the wrong shape: {_names(mismatched)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected weight(s): {_names(unexpected)}")
    if info.get("error_msgs"):
        problems.append("; ".join(str(m) for m in info["error_msgs"]))
    if problems:  # (weights named as the part's model names them: transformers renames the checkpoint's)
        raise CheckpointError(f"{ckpt.path}: refusing half-loaded {part}: " + "; ".join(problems)
                              + f" (named as transformers' {part} model names them, which may differ from the "
                              f"checkpoint's names, all under {family.weight_prefix(part)!r})")  # fmt: skip
    return model.to(device).eval()


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """transformers' warnings and progress bars off: we report what is wrong ourselves, as an error."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def _unsaved_buffers(model: torch.nn.Module) -> set[str]:
    """The names of `model`'s buffers that its state dict leaves out."""
    return {name for name, _ in model.named_buffers()} - model.state_dict().keys()


def _part_tensors(ckpt: Checkpoint, part: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under `part.`, read from the files that hold them."""
    from safetensors import safe_open

    prefix = ckpt.family.weight_prefix(part)
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(ckpt.path):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key.startswith(prefix):
                    out[key] = handle.get_tensor(key)
    if not out:
        raise CheckpointError(f"{ckpt.path}: {_no_weights(ckpt.family, part, out)}")
    return out


def _mismatch(entry: Any) -> str:
    """transformers reports (name, shape in the checkpoint, shape the model wants)."""
    if isinstance(entry, tuple | list) and len(entry) == 3:
        name, got, want = entry
        return f"{name} (checkpoint {list(got)}, model {list(want)})"
    return str(entry)


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def read_tensor_rows(ckpt: Checkpoint, keys: tuple[str, ...], rows: list[int], shape: tuple[int, int]
                     ) -> torch.Tensor:  # fmt: skip
    """Read a few rows of one tensor (the first of `keys` present), which must be of `shape`,
    without loading the rest of the checkpoint, e.g. the three thinker embeddings the talker
    needs (the stage that checks the whole table as it loads may run elsewhere)."""
    from safetensors import safe_open

    for f in weight_files(ckpt.path):
        try:
            with safe_open(str(f), framework="pt") as handle:
                names = set(handle.keys())
                for key in keys:
                    if key in names:
                        table = handle.get_slice(key)
                        if tuple(table.get_shape()) != shape:
                            raise CheckpointError(f"{f}: {key} is {list(table.get_shape())}, the config makes it "
                                                  f"{list(shape)} (the talker reads its rows {rows})")  # fmt: skip
                        return torch.stack([table[r : r + 1][0] for r in rows])
        except SafetensorError as e:
            raise CheckpointError(f"{f}: {e}") from e
    raise CheckpointError(f"{ckpt.path}: none of the weights {', '.join(keys)} found")


# generate()'s other logits processors, with the values that leave them off: a checkpoint's file
# that turns one on is served without it (said once), as the HTTP API refuses them in a request
_UNSAMPLED = {"min_p": (None, 0), "typical_p": (None, 1), "epsilon_cutoff": (None, 0), "eta_cutoff": (None, 0),
              "no_repeat_ngram_size": (None, 0), "min_new_tokens": (None, 0), "min_length": (None, 0),
              "bad_words_ids": (None, []), "suppress_tokens": (None, []), "begin_suppress_tokens": (None, []),
              "sequence_bias": (None, {}), "num_beams": (None, 1), "presence_penalty": (None, 0),
              "frequency_penalty": (None, 0)}  # fmt: skip


@functools.cache
def _say_unsampled(path: str, fields: str) -> None:
    log.warning("%s: generation_config.json sets %s, which this server does not apply (it samples with "
                "temperature, top_k, top_p and repetition_penalty): served without", path, fields)  # fmt: skip


def generation_defaults(ckpt: Checkpoint, stop_ids: tuple[int, ...], max_tokens: int = 1024) -> SamplingParams:
    """The checkpoint's generation_config.json as sampling defaults, stopping on `stop_ids` and
    on every `eos_token_id` it lists, and generating its `max_new_tokens` (else `max_tokens`), as
    vLLM takes the file (the Omni models' `generate()` gives its thinker neither stop ids nor
    limit: the parity tests pass both explicitly). A request's limit is still cut to what the
    model's context has left."""
    gen_file = ckpt.path / "generation_config.json"
    try:
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        if not isinstance(gen, dict):
            raise ValueError("not a JSON object")
        eos = gen.get("eos_token_id")
        eos_ids = [] if eos is None else [int(i) for i in (eos if isinstance(eos, list) else [eos])]
        unsampled = [f"{k}={gen[k]!r}" for k, off in _UNSAMPLED.items() if k in gen and gen[k] not in off]
        if unsampled:
            _say_unsampled(str(ckpt.path), ", ".join(unsampled))
        limit = gen.get("max_new_tokens")
        # (at most int32's largest: a request's max_tokens on the wire)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit < 1 << 31):
            raise ValueError(f"max_new_tokens must be a whole number from 1 to {(1 << 31) - 1}, got {limit!r}")
        temperature = 1.0 if gen.get("temperature") is None else float(gen["temperature"])
        # under 1e-5: greedy, as the HTTP API takes a request's; below 0 refused (SamplingParams)
        sampled = bool(gen.get("do_sample", False)) and not greedy_temperature(temperature)
        return SamplingParams(
            do_sample=sampled,
            temperature=temperature if sampled else 1.0,
            # generate() fills an absent top_k with GenerationConfig's 50; an explicit 0 turns it off
            top_k=(50 if gen.get("top_k") is None else int(gen["top_k"])) if sampled else 0,
            top_p=float(gen.get("top_p") or 1.0),
            repetition_penalty=float(gen.get("repetition_penalty") or 1.0),
            max_tokens=max_tokens if limit is None else limit,
            stop_ids=tuple(dict.fromkeys([*stop_ids, *eos_ids])),
        )
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{gen_file}: not a valid generation config ({e})") from None
