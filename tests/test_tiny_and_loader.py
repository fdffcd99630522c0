"""The tiny checkpoint is deterministic and loads; the loader refuses bad checkpoints with
errors that name the problem, before any model work."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.checkpoint import CheckpointError, load_part, load_tokenizer, open_checkpoint
from omnistage.models.qwen3_omni.tiny import write_tiny_checkpoint


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(ckpt: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply `edit` to all the checkpoint's tensors and write them back in the same layout: the
    same shards (new tensors into the first), the index kept in step."""
    index = ckpt / "model.safetensors.index.json"
    if not index.is_file():
        weights = load_file(str(ckpt / "model.safetensors"))
        edit(weights)
        save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
        return
    meta = json.loads(index.read_text())
    shards = sorted(set(meta["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(ckpt / shard)))
    edit(weights)
    new_map = {k: meta["weight_map"].get(k, shards[0]) for k in weights}
    for shard in shards:
        kept = {k: v for k, v in weights.items() if new_map[k] == shard}
        save_file(kept, str(ckpt / shard), metadata={"format": "pt"})
    meta["weight_map"] = new_map
    index.write_text(json.dumps(meta))


@pytest.mark.parametrize("layout", ["published", "fused"])
def test_tiny_checkpoint_is_byte_identical_across_runs(tmp_path: Path, layout: str) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    summary = write_tiny_checkpoint(one, layout=layout)
    write_tiny_checkpoint(two, layout=layout)
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert 500_000 < summary["parameters"] < 5_000_000
    assert summary["safetensors_bytes"] < 20_000_000
    if layout == "published":  # what save_pretrained writes: shards, an index, experts one by one
        assert len(summary["weight_files"]) > 1 and "model.safetensors.index.json" in names
        keys = json.loads((one / "model.safetensors.index.json").read_text())["weight_map"]
        assert "talker.model.layers.0.mlp.experts.0.down_proj.weight" in keys
        assert "thinker.model.layers.0.mlp.experts.3.gate_proj.weight" in keys
    else:
        assert summary["weight_files"] == ["model.safetensors"]


def test_both_layouts_and_bf16_storage_load_the_same_weights(tiny_dir: Path, tiny_fused_dir: Path,
                                                             tmp_path: Path) -> None:  # fmt: skip
    bf16 = tmp_path / "bf16"
    write_tiny_checkpoint(bf16, dtype="bfloat16")
    for part in ("thinker", "talker", "code2wav"):
        published = load_part(open_checkpoint(tiny_dir), part).state_dict()
        fused = load_part(open_checkpoint(tiny_fused_dir), part).state_dict()
        assert published.keys() == fused.keys()
        assert all(torch.equal(published[k], fused[k]) for k in published), part
        half = load_part(open_checkpoint(bf16), part, dtype="bfloat16").state_dict()
        assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], published[k].bfloat16())
                   for k in published if published[k].is_floating_point()), part  # fmt: skip
    # `dtype: auto`: each checkpoint's own
    assert open_checkpoint(bf16).resolve_dtype("auto") == "bfloat16"
    assert open_checkpoint(tiny_dir).resolve_dtype("auto") == "float32"
    assert open_checkpoint(bf16).resolve_dtype("float16") == "float16"
    auto = load_part(open_checkpoint(bf16), "code2wav", dtype="auto")
    assert {p.dtype for p in auto.parameters()} == {torch.bfloat16}
    _edit_config(bf16, lambda c: c.update(dtype="int8"))  # (its weights are still floats)
    with pytest.raises(CheckpointError, match=r"dtype 'int8' is none that omnistage loads"):
        open_checkpoint(bf16).resolve_dtype("auto")  # it was float32, without a word
    assert open_checkpoint(bf16).resolve_dtype("bfloat16") == "bfloat16"


def test_tiny_tokenizer_knows_the_special_tokens(tiny_dir: Path) -> None:
    ckpt = open_checkpoint(tiny_dir)
    tok = load_tokenizer(ckpt)  # raises if any special id disagrees with config.json
    assert len(tok) == ckpt.spec.thinker_vocab
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == ckpt.spec.im_start_id and ids[1] == ckpt.spec.user_id
    assert ids[-3:-1] == [ckpt.spec.im_start_id, ckpt.spec.assistant_id]
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


def test_a_prompt_longer_than_the_tokenizer_says_logs_nothing(tiny_dir: Path) -> None:
    """The gateway measures a prompt against the model's length and refuses it by name; the
    tokenizer's own warning ("... will result in indexing errors") was logged besides, with no
    request id, for every first long prompt."""
    import logging

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    from transformers.utils import logging as hf_logging

    tok = load_tokenizer(open_checkpoint(tiny_dir))
    tok.model_max_length = 64  # (a checkpoint's own may be any length)
    kept, transformers_log = Kept(), logging.getLogger("transformers")  # (its loggers' root: it logs there)
    transformers_log.addHandler(kept)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # (as a served gateway has it: a parity test before may have lowered it)
    try:
        assert len(tok.encode("word " * 100)) > 64
    finally:
        hf_logging.set_verbosity(level)
        transformers_log.removeHandler(kept)
    assert not [m for m in kept.messages if "indexing errors" in m], kept.messages


@pytest.mark.parametrize("part", ["thinker", "talker", "code2wav"])
def test_each_part_loads_alone_with_every_weight(tiny_dir: Path, part: str) -> None:
    model = load_part(open_checkpoint(tiny_dir), part)  # type: ignore[arg-type]
    assert sum(p.numel() for p in model.parameters()) > 10_000


@pytest.mark.parametrize("layout", ["published", "fused"])
@pytest.mark.parametrize(
    ("dropped_prefix", "part"),
    [("code2wav.decoder.", "code2wav"), ("talker.code_predictor.", "talker"), ("thinker.lm_head.", "thinker"),
     ("talker.model.layers.1.mlp.experts.", "talker")],
)  # fmt: skip
def test_half_loaded_checkpoint_is_refused(
    tiny_dir: Path, tiny_fused_dir: Path, tmp_path: Path, dropped_prefix: str, part: str, layout: str
) -> None:
    half = _copy(tiny_dir if layout == "published" else tiny_fused_dir, tmp_path / "half")

    def drop(weights: dict[str, torch.Tensor]) -> None:
        gone = [k for k in weights if k.startswith(dropped_prefix)]
        assert gone
        for k in gone:
            del weights[k]

    _rewrite(half, drop)
    ckpt = open_checkpoint(half)
    with pytest.raises(CheckpointError, match=rf"refusing half-loaded {part}: \d+ missing weight") as err:
        load_part(ckpt, part)  # type: ignore[arg-type]
    # The message names the missing weights (without the part prefix or with it).
    assert dropped_prefix.split(".", 1)[1].split(".")[0] in str(err.value)
    # The other parts are untouched and still load.
    other = "thinker" if part != "thinker" else "code2wav"
    load_part(ckpt, other)  # type: ignore[arg-type]


def test_a_missing_expert_is_named_by_its_key(tiny_dir: Path, tmp_path: Path) -> None:
    """One tensor of one expert gone (the published per-expert layout): named at open, not as the
    merged weight transformers would build from the experts."""
    gone = "talker.model.layers.0.mlp.experts.1.up_proj.weight"
    half = _copy(tiny_dir, tmp_path / "expert")
    _rewrite(half, lambda w: w.pop(gone))
    with pytest.raises(CheckpointError, match=r"1 expert weight\(s\) missing: " + re.escape(gone)):
        open_checkpoint(half)
    last = _copy(tiny_dir, tmp_path / "last")  # a layer's last expert gone whole: fewer than its neighbours
    block = "talker.model.layers.1.mlp.experts."
    count = sum(1 for k in open_checkpoint(tiny_dir).tensors if k.startswith(block) and k.endswith(".down_proj.weight"))
    _rewrite(last, lambda w: [w.pop(k) for k in list(w) if k.startswith(f"{block}{count - 1}.")])
    with pytest.raises(CheckpointError, match=r"3 expert weight\(s\) missing: " + re.escape(f"{block}{count - 1}.")):
        open_checkpoint(last)


@pytest.mark.parametrize(("key", "part"), [("talker.model.layers.0.mystery.weight", "talker"),
                                           ("thinker.model.bogus.weight", "thinker"),
                                           ("code2wav.bogus.weight", "code2wav")])  # fmt: skip
def test_unexpected_weight_in_part_is_refused(tiny_dir: Path, tmp_path: Path, key: str, part: str) -> None:
    bad = _copy(tiny_dir, tmp_path / "extra")
    _rewrite(bad, lambda w: w.__setitem__(key, torch.zeros(4)))
    ckpt = open_checkpoint(bad)
    with pytest.raises(CheckpointError, match=rf"half-loaded {part}: 1 unexpected weight.*{key.split('.')[-2]}"):
        load_part(ckpt, part)
    other = "code2wav" if part != "code2wav" else "thinker"
    load_part(ckpt, other)  # the other parts are not blamed


@pytest.mark.parametrize("family", ["tiny_dir", "q25_dir"])
def test_a_stored_buffer_the_model_computes_is_not_unexpected(request: pytest.FixtureRequest, family: str,
                                                              tmp_path: Path) -> None:  # fmt: skip
    """A published checkpoint may store a buffer the model computes and does not save (Qwen2.5-
    Omni's token2wav stores its DiT's rotary `inv_freq`; it was refused as unexpected): the part
    loads with the computed one, as transformers' does; a tensor of no buffer's name is refused."""
    src = request.getfixturevalue(family)
    ckpt = open_checkpoint(src)
    prefix = ckpt.family.weight_prefix("code2wav")
    model = load_part(ckpt, "code2wav")
    saved = model.state_dict().keys()
    buffer = next(name for name, _ in model.named_buffers() if name not in saved and name.endswith("inv_freq"))
    stored = _copy(src, tmp_path / "stored")
    _rewrite(stored, lambda w: w.__setitem__(prefix + buffer, torch.full((4,), 7.0)))
    loaded = load_part(open_checkpoint(stored), "code2wav")
    assert torch.equal(dict(loaded.named_buffers())[buffer], dict(model.named_buffers())[buffer])  # the computed one
    # only the buffer's own name: not its last part alone, nor its name under another module
    # (transformers itself drops any key holding `rotary_emb.inv_freq`, Qwen3-Omni's buffer)
    names = ["bogus_buffer"] + ([f"bogus.{buffer}", "rotary.inv_freq"] if "rotary_emb." not in buffer else [])
    for bogus in names:
        other = _copy(stored, tmp_path / bogus)
        _rewrite(other, lambda w, name=bogus: w.__setitem__(prefix + name, torch.zeros(4)))  # type: ignore[misc]
        with pytest.raises(CheckpointError, match=rf"half-loaded code2wav: 1 unexpected weight.*{re.escape(bogus)}"):
            load_part(open_checkpoint(other), "code2wav")


def test_a_wrong_shape_is_refused_by_name(tiny_dir: Path, tmp_path: Path) -> None:
    bad = _copy(tiny_dir, tmp_path / "shape")
    key = "thinker.model.layers.0.self_attn.q_proj.weight"
    _rewrite(bad, lambda w: w.__setitem__(key, torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=r"wrong shape: .*layers\.0\.self_attn\.q_proj\.weight \(checkpoint "
                                              r"\[3, 3\], model \[64, 64\]\)"):  # fmt: skip
        load_part(open_checkpoint(bad), "thinker")


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda f: f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2]), "truncated"),
        (lambda f: f.write_bytes(b""), "shorter than the 8-byte header length"),
        (lambda f: f.write_bytes(b"\x10" + b"\0" * 7 + b"not json at all!" + b"\0" * 64), "not JSON"),
        (lambda f: f.write_bytes(b"\xff" * 64), "header length"),
        # safetensors refuses these when a part loads (an error naming no file, not a CheckpointError)
        (lambda f: f.write_bytes(f.read_bytes() + b"\0" * 4), "4 bytes after the last tensor's data"),
        (lambda f: _edit_header(f, lambda h: h.__setitem__("__metadata__", {"format": 1})), "map of strings"),
        (lambda f: _edit_header(f, _gap_first), "starts at byte 4 of the data, the one before it ends at 0"),
        # a dtype with no size here: its shape is still checked (a TypeError later, naming no file)
        (lambda f: _edit_header(f, _odd_dtype_bad_shape), r"for dtype F8_E8M0 and shape \[\{\}\]"),
    ],
    ids=["truncated", "empty", "garbage-header", "garbage", "trailing-bytes", "metadata", "gap", "odd-dtype-shape"],
)
def test_broken_weight_files_are_named_at_open(tiny_dir: Path, tmp_path: Path, damage: Any, needle: str) -> None:
    bad = _copy(tiny_dir, tmp_path / "broken")
    shard = sorted(bad.glob("*.safetensors"))[-1]
    damage(shard)
    with pytest.raises(CheckpointError, match=needle) as err:
        open_checkpoint(bad)
    assert shard.name in str(err.value)


def _edit_header(f: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a safetensors file's JSON header (the tensor data kept as it is)."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def _odd_dtype_bad_shape(header: dict[str, Any]) -> None:
    entry = next(e for name, e in header.items() if name != "__metadata__")
    entry.update(dtype="F8_E8M0", shape=[{}])


def _gap_first(header: dict[str, Any]) -> None:
    """Every tensor's bytes 4 later: a gap before the first (safetensors refuses it)."""
    for name, entry in header.items():
        if name != "__metadata__":
            entry["data_offsets"] = [o + 4 for o in entry["data_offsets"]]


@pytest.mark.parametrize("stored", [torch.int64, torch.bool, torch.float8_e8m0fnu])
def test_weights_not_stored_as_floats_are_refused(tiny_dir: Path, tmp_path: Path, stored: torch.dtype) -> None:
    """transformers would cast them to the model's dtype without a word: refused at open. (An
    MXFP8 scale, F8_E8M0, was called a malformed file: its size was unknown here.)"""
    bad = _copy(tiny_dir, tmp_path / "ints")
    key = "code2wav.decoder.0.conv.weight"
    _rewrite(bad, lambda w: w.__setitem__(key, (w[key] * 1000).to(stored)))
    with pytest.raises(CheckpointError, match=rf"1 weight\(s\) not stored as floating point \(e\.g\. "
                                              rf"{re.escape(key)} as (I64|BOOL|F8_E8M0)\).*quantized "
                                              "checkpoints"):  # fmt: skip
        open_checkpoint(bad)


def test_experts_of_one_block_that_differ_in_shape_are_named(tiny_dir: Path, tmp_path: Path) -> None:
    """One expert's tensor in another shape: named at open (transformers, failing to stack the
    experts, would call the merged weight missing)."""
    bad = _copy(tiny_dir, tmp_path / "odd-expert")
    key = "talker.model.layers.0.mlp.experts.1.up_proj.weight"
    _rewrite(bad, lambda w: w.__setitem__(key, w[key][:-1].clone()))
    with pytest.raises(CheckpointError, match=r"experts of one block differ in shape: .*" + re.escape(key)):
        open_checkpoint(bad)


def test_an_index_out_of_step_with_its_shards_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    bad = _copy(tiny_dir, tmp_path / "index")
    index = bad / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    key = next(iter(meta["weight_map"]))
    meta["weight_map"][key] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"model-00009-of-00009\.safetensors"):
        open_checkpoint(bad)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: c["talker_config"]["code_predictor_config"].update(num_code_groups=10),
         "number of code groups: talker_config.num_code_groups=16, "
         "talker_config.code_predictor_config.num_code_groups=10"),
        (lambda c: c["talker_config"].update(thinker_hidden_size=48), "thinker width"),
        (lambda c: c["talker_config"].update(accept_hidden_layer=9), "accept_hidden_layer=9"),
        (lambda c: c["talker_config"].update(codec_eos_token_id=99999), "codec_eos_token_id=99999 is outside"),
        (lambda c: c.update(tts_pad_token_id=99999), "tts_pad_token_id=99999 is outside"),
        # generate() leaves the talker every id below its top 1024: past the codebook, codes code2wav refuses
        (lambda c: c["talker_config"]["code_predictor_config"].update(vocab_size=96) or c["code2wav_config"].update(
            codebook_size=96), "leaves the talker ids 96..127"),
    ],
    ids=["code-groups", "width", "accept-layer", "codec-id", "special-id", "codes-past-the-codebook"],
)
def test_a_config_whose_parts_disagree_is_refused(tiny_dir: Path, tmp_path: Path, edit: Any, needle: str) -> None:
    bad = _copy(tiny_dir, tmp_path / "config")
    _edit_config(bad, edit)
    with pytest.raises(CheckpointError, match="the parts of the config disagree") as err:
        open_checkpoint(bad)
    assert needle in str(err.value)


def _no_code_groups_but_one(c: dict) -> None:
    c["talker_config"].update(num_code_groups=1)
    c["talker_config"]["code_predictor_config"].update(num_code_groups=1)
    c["code2wav_config"].update(num_quantizers=1)


@pytest.mark.parametrize(("family", "edit", "needle"), [
    # the towers' embeddings take the place of media tokens: a narrower one failed every media
    # request, a wider audio one served them scrambled
    ("tiny_dir", lambda c: c["thinker_config"]["audio_config"].update(output_dim=96),
     "thinker_config.audio_config.output_dim=96 is not the thinker's width"),
    ("tiny_dir", lambda c: c["thinker_config"]["vision_config"].update(out_hidden_size=32),
     "thinker_config.vision_config.out_hidden_size=32 is not the thinker's width"),
    ("q25_dir", lambda c: c["thinker_config"]["audio_config"].update(output_dim=96),
     "thinker_config.audio_config.output_dim=96 is not the thinker's width"),
    # each failed every speech request, as an internal error or as the client's unknown voice ''
    ("tiny_dir", lambda c: c["talker_config"]["code_predictor_config"].update(hidden_size=32),
     "talker width: talker_config.text_config.hidden_size=64, talker_config.code_predictor_config.hidden_size=32"),
    ("tiny_dir", _no_code_groups_but_one, "talker_config.num_code_groups=1: a frame has at least 2 codes"),
    ("tiny_dir", lambda c: c["talker_config"].update(speaker_id={}), "talker_config.speaker_id names no voice"),
], ids=["audio-width", "vision-width", "q25-audio-width", "code-predictor-width", "one-code-group", "no-voice"])
def test_a_config_whose_towers_or_talker_disagree_is_refused(request: pytest.FixtureRequest, tmp_path: Path,
                                                             family: str, edit: Any, needle: str) -> None:  # fmt: skip
    bad = _copy(request.getfixturevalue(family), tmp_path / "config")
    _edit_config(bad, edit)
    with pytest.raises(CheckpointError, match="the parts of the config disagree") as err:
        open_checkpoint(bad)
    assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("family", ["tiny_dir", "q25_dir"])
def test_the_talker_refuses_a_thinker_embedding_table_of_another_shape(
        request: pytest.FixtureRequest, tmp_path: Path, family: str) -> None:  # fmt: skip
    """The talker stage reads a few rows of the thinker's embeddings, which it never loads
    (it may run on another machine): a table of another width failed as a shape error in a
    matrix product, one too short as an IndexError, neither naming the checkpoint."""
    bad = _copy(request.getfixturevalue(family), tmp_path / "embed")
    ckpt = open_checkpoint(bad)
    key = next(k for k in ckpt.tensors if k.startswith("thinker.") and k.endswith("embed_tokens.weight"))
    _rewrite(bad, lambda w: w.__setitem__(key, w[key][:, :-16].clone()))
    ckpt = open_checkpoint(bad)  # (the thinker stage refuses it as it loads)
    with pytest.raises(CheckpointError, match=rf"{re.escape(key)} is \[\d+, \d+\], the config makes it"):
        ckpt.family.talker(ckpt, "float32", "cpu")


@pytest.mark.parametrize(("file", "field", "value", "needle"), [
    ("preprocessor_config.json", "feature_size", 80, "feature_extractor.feature_size=80, "
                                                     "thinker_config.audio_config.num_mel_bins=128"),
    ("preprocessor_config.json", "patch_size", 8, "image_processor.patch_size=8, thinker_config.vision_config"),
    ("video_preprocessor_config.json", "merge_size", 4, "video_processor.merge_size=4"),
])
def test_a_processor_that_disagrees_with_the_towers_turns_media_off_saying_why(
        tiny_dir: Path, tmp_path: Path, file: str, field: str, value: int, needle: str) -> None:  # fmt: skip
    """Every audio request failed, blamed on its input; now the gateway takes text only and
    says why (as for missing processor files)."""
    from omnistage.models import load_tokenizer, media_inputs

    bad = _copy(tiny_dir, tmp_path / "processor")
    settings = json.loads((bad / file).read_text())
    settings[field] = value
    (bad / file).write_text(json.dumps(settings))
    ckpt = open_checkpoint(bad)
    inputs, why = media_inputs(ckpt, load_tokenizer(ckpt))
    assert inputs is None and "disagree with config.json" in why and needle in why, why
    assert media_inputs(open_checkpoint(tiny_dir), load_tokenizer(ckpt))[0] is not None


@pytest.mark.parametrize(("family", "edit", "needle"), [
    ("tiny_dir", lambda c: c["talker_config"]["text_config"].update(num_hidden_layers=-1),
     "talker_config.text_config.num_hidden_layers is -1; it must be at least 1"),
    ("tiny_dir", lambda c: c["thinker_config"]["text_config"].update(num_attention_heads=0),
     "thinker_config.text_config.num_attention_heads is 0; it must be at least 1"),
    ("tiny_dir", lambda c: c["thinker_config"]["text_config"].update(max_position_embeddings=-5),
     "max_position_embeddings is -5"),
    ("tiny_dir", lambda c: c["code2wav_config"].update(upsample_rates=[8, -5, 4, 3]),
     "upsample_rates is [8, -5, 4, 3]"),
    ("tiny_dir", lambda c: c["thinker_config"]["text_config"].update(num_experts_per_tok=9),
     "num_experts_per_tok is 9; it must be 1..num_experts (4)"),
    ("tiny_dir", lambda c: c["thinker_config"]["text_config"]["rope_parameters"].update(rope_theta="big"),
     "rope_theta is 'big'"),
    ("q25_dir", lambda c: c["thinker_config"]["text_config"]["rope_parameters"].update(mrope_section=[2, 3, 4]),
     "mrope_section is [2, 3, 4]; its sections must add up to half the head width (16 / 2)"),
    ("q25_dir", lambda c: c["talker_config"].update(head_dim=32), "talker_config.rope_parameters.mrope_section"),
    # Qwen3-Omni interleaves them (the variant checkpoint's do not fill its head): only their form
    ("tiny_dir", lambda c: c["talker_config"]["text_config"]["rope_parameters"].update(mrope_section=[24, -1, 20]),
     "talker_config.text_config.rope_parameters.mrope_section is [24, -1, 20]; it must be three or more"),
    # fields of the wrong type: transformers' own check, and one it does not make (the voice ids)
    ("tiny_dir", lambda c: c["thinker_config"]["text_config"].update(num_hidden_layers="two"),
     "Field 'num_hidden_layers' expected int, got str"),
    ("tiny_dir", lambda c: c["talker_config"].update(speaker_id={"chelsie": "x"}), "invalid literal for int()"),
], ids=["layers", "heads", "positions", "upsample-rates", "experts-per-token", "rope-theta", "mrope", "mrope-head-dim",
        "mrope-interleaved", "typed-field", "untyped-field"])  # fmt: skip
def test_a_config_no_model_can_have_is_refused_by_name(request: pytest.FixtureRequest, tmp_path: Path, family: str,
                                                       edit: Any, needle: str) -> None:  # fmt: skip
    """transformers builds these models anyway: a talker of -1 layers (it has none, and the stack
    served it), or a model that fails every request (rope sections that do not fill the head,
    more experts per token than experts) or fails at load naming no field; a field of the wrong
    type was refused, but not as the checkpoint's (exit 1, two lines of transformers' text)."""
    bad = _copy(request.getfixturevalue(family), tmp_path / "config")
    _edit_config(bad, edit)
    with pytest.raises(CheckpointError, match=r"config\.json: not a valid .* config") as err:
        open_checkpoint(bad)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_qwen2_5_windowed_attention_within_reach_is_refused(q25_dir: Path, tmp_path: Path) -> None:
    """transformers masks Qwen2.5-Omni's `sliding_attention` layers to the window; omnistage's steps
    attend over every position, so a window a request can outgrow is refused by name (one as long
    as the positions never binds, as the published configs' 32768, and is served)."""
    for part, edit in (("thinker_config.text_config", lambda c: c["thinker_config"]["text_config"]),
                       ("talker_config", lambda c: c["talker_config"])):  # fmt: skip
        bad = _copy(q25_dir, tmp_path / part)
        _edit_config(bad, lambda c, e=edit: e(c).update(use_sliding_window=True, sliding_window=64,
                                                        max_window_layers=1, layer_types=None))  # fmt: skip
        said = rf"{re.escape(part)}: sliding-window attention \({re.escape(part)}\.sliding_window=64, below the "
        said += r"\d+ positions its requests can reach, on 1 of its 2 layers\)"
        with pytest.raises(CheckpointError, match=said):
            open_checkpoint(bad)
        wide = _copy(q25_dir, tmp_path / f"{part}-wide")
        _edit_config(wide, lambda c, e=edit: e(c).update(use_sliding_window=True, sliding_window=1 << 20,
                                                         max_window_layers=1, layer_types=None))  # fmt: skip
        assert open_checkpoint(wide).speaks


def test_a_weight_of_no_part_is_refused_at_open(tiny_dir: Path, tmp_path: Path) -> None:
    """No part reads a tensor outside the parts' prefixes: it was served without a word."""
    bad = _copy(tiny_dir, tmp_path / "stray")
    _rewrite(bad, lambda w: w.__setitem__("mystery.weight", torch.zeros(4)))
    with pytest.raises(CheckpointError, match=r"1 weight\(s\) of no part of the model .*: mystery\.weight"):
        open_checkpoint(bad)


def test_a_config_that_does_not_match_the_weights_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    bad = _copy(tiny_dir, tmp_path / "layers")
    _edit_config(bad, lambda c: c["thinker_config"]["text_config"].update(num_hidden_layers=3))
    with pytest.raises(CheckpointError, match=r"missing weight\(s\): .*layers\.2\."):
        load_part(open_checkpoint(bad), "thinker")


def _edit_config(path: Path, edit: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_unknown_model_family_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    bad = _copy(tiny_dir, tmp_path / "family")
    _edit_config(bad, lambda c: c.update(model_type="llama"))
    with pytest.raises(CheckpointError, match="unknown model family 'llama'"):
        open_checkpoint(bad)


@pytest.mark.parametrize(
    "missing", ["config.json", "model.safetensors.index.json", "tokenizer_config.json", "tokenizer.json"]
)
def test_missing_files_are_named(tiny_dir: Path, tmp_path: Path, missing: str) -> None:
    bad = _copy(tiny_dir, tmp_path / "missing")
    (bad / missing).unlink()
    with pytest.raises(CheckpointError, match=missing.split(".")[0]):
        open_checkpoint(bad)


def test_vocab_json_needs_its_merges(tiny_dir: Path, tmp_path: Path) -> None:
    bad = _copy(tiny_dir, tmp_path / "vocab")
    (bad / "tokenizer.json").unlink()
    (bad / "vocab.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"vocab\.json \+ merges\.txt"):
        open_checkpoint(bad)


def _move_chat_template(path: Path, to: str) -> str:
    """Take the template out of chat_template.json (where the tiny checkpoint keeps it, as
    processors save it) and put it in `to`: tokenizer_config.json, chat_template.jinja, or none."""
    template = json.loads((path / "chat_template.json").read_text())["chat_template"]
    (path / "chat_template.json").unlink()
    if to == "tokenizer_config":
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    elif to == "jinja":
        (path / "chat_template.jinja").write_text(template)
    return template


def _prompt(path: Path) -> list[int]:
    ckpt = open_checkpoint(path)
    return ckpt.family.prompt_ids(load_tokenizer(ckpt), [{"role": "user", "content": "Hello there"}])


@pytest.mark.parametrize("to", ["tokenizer_config", "jinja"])
def test_the_chat_template_is_read_from_each_place_checkpoints_keep_it(tiny_dir: Path, tmp_path: Path,
                                                                        to: str) -> None:  # fmt: skip
    moved = _copy(tiny_dir, tmp_path / "moved")
    _move_chat_template(moved, to)
    assert _prompt(moved) == _prompt(tiny_dir)


def test_the_processors_chat_template_comes_first_and_none_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    both = _copy(tiny_dir, tmp_path / "both")
    template = json.loads((both / "chat_template.json").read_text())["chat_template"]
    config = json.loads((both / "tokenizer_config.json").read_text())
    (both / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ 'other' }}"}))
    assert load_tokenizer(open_checkpoint(both)).chat_template == template  # as the processor takes it
    none = _copy(tiny_dir, tmp_path / "none")
    _move_chat_template(none, "none")
    with pytest.raises(CheckpointError, match="no chat template"):
        open_checkpoint(none)


@pytest.mark.parametrize("layout", ["json and jinja", "processor_config", "jinja", "tokenizer_config"])
def test_the_chat_template_is_the_one_transformers_processor_takes(tiny_dir: Path, tmp_path: Path,
                                                                     layout: str) -> None:  # fmt: skip
    """Where a checkpoint holds more than one template (transformers 5 saves chat_template.jinja,
    so a processor saved again into a downloaded folder leaves it beside chat_template.json), the
    prompt is built with the one transformers' processor loads (it was the .jinja file)."""
    from transformers.processing_utils import ProcessorMixin

    path = _copy(tiny_dir, tmp_path / "layout")
    template = json.loads((path / "chat_template.json").read_text())["chat_template"]
    other = template.replace("<|im_start|>assistant", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant")
    assert other != template
    if layout == "json and jinja":
        (path / "chat_template.jinja").write_text(other)
    elif layout == "processor_config":  # (a legacy layout transformers still reads first, with a warning)
        (path / "processor_config.json").write_text(json.dumps({"chat_template": other}))
    else:
        _move_chat_template(path, "jinja" if layout == "jinja" else "tokenizer_config")
    ours = load_tokenizer(open_checkpoint(path)).chat_template
    theirs = ProcessorMixin.get_processor_dict(str(path), local_files_only=True)[0].get("chat_template")
    if layout == "tokenizer_config":  # the processor has none; its tokenizer's is the template
        assert theirs is None and ours == template
    else:
        assert ours == theirs == (template if layout in ("json and jinja", "jinja") else other)


def test_generation_config_eos_ids_all_stop_the_thinker(tiny_dir: Path, tmp_path: Path) -> None:
    two = _copy(tiny_dir, tmp_path / "eos")
    gen = json.loads((two / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], 5]
    (two / "generation_config.json").write_text(json.dumps(gen))
    ckpt = open_checkpoint(two)
    assert ckpt.family.thinker_defaults(ckpt).stop_ids == (ckpt.spec.im_end_id, 5)
    for top_k, want in ((None, 50), (0, 0), (7, 7), ("absent", 50)):  # generate()'s default is 50
        sampled = {k: v for k, v in gen.items() if k != "top_k"} | {"do_sample": True}
        if top_k != "absent":
            sampled["top_k"] = top_k
        (two / "generation_config.json").write_text(json.dumps(sampled))
        assert ckpt.family.thinker_defaults(ckpt).top_k == want, top_k
    for temperature, want_sampled, want_t in ((0, False, 1.0), (1e-6, False, 1.0), (0.7, True, 0.7), (None, True, 1.0)):
        (two / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, "temperature": temperature}))
        got = ckpt.family.thinker_defaults(ckpt)  # temperature 0 is greedy (as vLLM takes it), not 1.0
        assert (got.do_sample, got.temperature) == (want_sampled, want_t), temperature
    (two / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, "temperature": -1}))
    with pytest.raises(CheckpointError, match="temperature"):
        ckpt.family.thinker_defaults(ckpt)
    (two / "generation_config.json").write_text("{nope")
    with pytest.raises(CheckpointError, match=r"generation_config\.json: not a valid generation config"):
        ckpt.family.thinker_defaults(ckpt)


def test_generation_config_max_new_tokens_is_the_thinker_default_limit(tiny_dir: Path, tmp_path: Path) -> None:
    """A checkpoint's `max_new_tokens` is how many tokens a request that sets no limit gets (as
    vLLM takes the file); none set: the family's own default; a value generate() refuses is
    refused by name."""
    from services.pipeline import PipelineRequest
    from tests.conftest import staged_pipeline

    path = _copy(tiny_dir, tmp_path / "limit")
    gen = json.loads((path / "generation_config.json").read_text())
    assert "max_new_tokens" not in gen
    ckpt = open_checkpoint(path)
    unset = ckpt.family.thinker_defaults(ckpt)
    pipe = staged_pipeline(path)
    ids = pipe.prompt_ids("Tell me a long story.")
    greedy = unset.with_overrides(do_sample=False, max_tokens=9)
    free = list(pipe.run(PipelineRequest(ids, greedy, want_audio=False)))[-1].token_ids
    assert len(free) > 4  # (its reply is longer than the limit below)
    (path / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 4}))
    limited = ckpt.family.thinker_defaults(ckpt)
    assert limited.max_tokens == 4 and unset.max_tokens > 9
    assert limited.with_overrides(max_tokens=unset.max_tokens) == unset  # nothing else changed
    # a request whose Start sets no max_tokens: the thinker stage's own default is its limit
    from benchmarks.stages import make_start, run_stage
    from omnistage.models.sampling import SamplingParams
    from services import edges

    pipe = staged_pipeline(path)
    assert pipe.workers["thinker"].defaults.max_tokens == 4
    start = make_start(limited.with_overrides(do_sample=False), SamplingParams(), want_audio=False)
    start.sampling["thinker"].ClearField("max_tokens")
    [rec] = run_stage(pipe, "thinker", [(start, [edges.prompt_chunk(ids)])])
    assert [int(i) for t in rec.tensors(edges.IDS) for i in t.tolist()] == free[:4]
    for bad in (0, -3, 2.5, "64", True, 1 << 31):
        (path / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": bad}))
        with pytest.raises(CheckpointError, match=r"generation_config\.json: .*max_new_tokens must be"):
            ckpt.family.thinker_defaults(ckpt)


def test_generation_config_fields_not_applied_are_said_once(tiny_dir: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """A checkpoint's file that turns on a logits processor this server has not (min_p, ...) is
    served without it, and the log says so once; the values that leave one off are not named."""
    path = _copy(tiny_dir, tmp_path / "gen")
    gen = json.loads((path / "generation_config.json").read_text())
    extra = {"do_sample": True, "min_p": 0.05, "no_repeat_ngram_size": 3, "typical_p": 1.0, "suppress_tokens": []}
    (path / "generation_config.json").write_text(json.dumps({**gen, **extra}))
    ckpt = open_checkpoint(path)
    with caplog.at_level(logging.WARNING, logger="omnistage.models.checkpoint"):
        first = ckpt.family.thinker_defaults(ckpt)
        assert ckpt.family.thinker_defaults(ckpt) == first
    said = [r.getMessage() for r in caplog.records if "does not apply" in r.getMessage()]
    assert len(said) == 1 and "min_p=0.05, no_repeat_ngram_size=3" in said[0], said
    assert "typical_p" not in said[0] and "suppress_tokens" not in said[0]


def test_a_checkpoint_that_cannot_speak_is_served_only_as_text(thinking_dir: Path, tiny_dir: Path,
                                                                 tmp_path: Path) -> None:  # fmt: skip
    """A text-only variant (Qwen3-Omni's Thinking and Captioner: the thinker's config and weights
    alone) opens, says why it cannot speak, and is refused by a stack that would speak, naming
    the setting that serves it; transformers' default talker config is neither checked nor used."""
    ckpt = open_checkpoint(thinking_dir)
    assert not ckpt.speaks
    for reason in ("enable_audio_output: false", "no talker_config", "no code2wav_config", "no weights of the talker",
                   "no weights of the code2wav"):  # fmt: skip
        assert any(reason in r for r in ckpt.no_speech), (reason, ckpt.no_speech)
    ckpt.check_serves(audio_output=False)
    with pytest.raises(CheckpointError, match=r"without speech output .* `audio_output: false`"):
        ckpt.check_serves(audio_output=True)
    assert ckpt.spec.thinker_vocab == open_checkpoint(tiny_dir).spec.thinker_vocab
    muted = _copy(tiny_dir, tmp_path / "muted")  # the weights there, the config saying no audio
    _edit_config(muted, lambda c: c.update(enable_audio_output=False))
    assert open_checkpoint(muted).no_speech == ["config.json sets enable_audio_output: false"]
    assert open_checkpoint(tiny_dir).speaks
    no_thinker = _copy(tiny_dir, tmp_path / "no-thinker")
    _rewrite(no_thinker, lambda w: [w.pop(k) for k in list(w) if k.startswith("thinker.")])
    with pytest.raises(CheckpointError, match="no weights of the thinker"):
        open_checkpoint(no_thinker)


def test_a_hugging_face_cache_snapshot_is_named_after_its_repository(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The cache keeps `models--Org--Name/snapshots/<commit>/` with each file a link into
    `blobs/`: the model is served as `Org/Name`, not as the commit hash."""
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-Omni-30B-A3B-Instruct"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in tiny_dir.iterdir():
        shutil.copy(f, blobs / f.name)
        (snapshot / f.name).symlink_to(blobs / f.name)
    assert open_checkpoint(snapshot).name == "Qwen/Qwen3-Omni-30B-A3B-Instruct"
    assert open_checkpoint(tiny_dir).name == tiny_dir.name
    monkeypatch.chdir(tiny_dir)
    assert open_checkpoint(".").name == tiny_dir.name  # not ""


def test_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        open_checkpoint(tmp_path / "nope")


def test_tokenizer_disagreeing_with_config_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    bad = _copy(tiny_dir, tmp_path / "tok")
    _edit_config(bad, lambda c: c.update(tts_pad_token_id=c["tts_pad_token_id"] + 1))
    with pytest.raises(CheckpointError, match=r"tokenizer disagrees with config: <tts_pad> is id \d+"):
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
                {"temperature": nan}, {"top_p": nan}, {"repetition_penalty": nan}, {"temperature": float("inf")},
                {"temperature": 1e-40, "do_sample": True}, {"repetition_penalty": 1e-40}):  # logits would overflow
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)  # type: ignore[arg-type]
    SamplingParams(temperature=1e-40)  # greedy: the temperature is never applied


def test_a_token_that_cannot_be_chosen_fails_its_request_alone(pipeline: Any) -> None:
    """A sampled request whose logits are no distribution (NaN) gets no token; raised out of the
    shared step it would fail every request in it: it stays on that request's result, and the
    request beside it gets the token it gets alone (its draw is made once)."""
    thinker = pipeline.thinker
    sampled = pipeline.thinker_defaults().with_overrides(do_sample=True, top_k=0, top_p=1.0, seed=3)
    ids = [pipeline.prompt_ids("hi"), pipeline.prompt_ids("Where is the train station?")]

    def step(prompts: list[Any]) -> list[Any]:
        states = [thinker.new_state(sampled) for _ in prompts]
        for state, prompt in zip(states, prompts, strict=True):
            thinker.set_prompt(state, prompt)
        try:
            return thinker.step([(s, 0, len(p)) for s, p in zip(states, prompts, strict=True)])
        finally:
            for state in states:
                thinker.release(state)

    alone = step(ids[:1])[0]

    def nan_last_row(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[..., -1, :] = float("nan")  # the step's last row: the second request's last prompt position
        return out

    hook = thinker.model.lm_head.register_forward_hook(nan_last_row)
    try:
        good, bad = step(ids)
    finally:
        hook.remove()
    assert good.error is None and good.token is not None and good.token.token_id == alone.token.token_id
    assert bad.token is None and bad.error is not None
    assert "no token could be chosen" in str(bad.error) and "not a distribution" in str(bad.error)


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


def test_a_given_reply_is_emitted_as_given_then_spoken(pipeline: Any) -> None:
    """`forced_ids` (speech of a given text): the thinker emits exactly those ids, then its stop
    id, running its forwards as for a generated reply, and the talker speaks them."""
    from omnistage.models.sampling import SamplingParams
    from omnistage.wire import StageError
    from services.pipeline import PipelineRequest

    ids = pipeline.prompt_ids("Read this aloud.")
    greedy = pipeline.thinker_defaults().with_overrides(do_sample=False, max_tokens=6)
    generated = list(pipeline.run(PipelineRequest(ids, greedy, want_audio=False)))[-1].token_ids
    words = pipeline.tokenizer.encode("other words", add_special_tokens=False)
    given = [*reversed([i for i in generated if i not in greedy.stop_ids]), *words]  # not what it would say
    forced = greedy.with_overrides(forced_ids=given, max_tokens=len(given) + 1)
    talker = SamplingParams(max_tokens=12, stop_ids=(pipeline.spec.codec_eos_id,))
    done = list(pipeline.run(PipelineRequest(ids, forced, talker=talker)))[-1]
    assert done.token_ids == [*given, pipeline.spec.im_end_id] and done.thinker_stopped_on == "stop_id"
    assert done.codes.shape[1] > 0
    with pytest.raises(ValueError, match="forced_ids need a stop id"):
        SamplingParams(forced_ids=(1,))
    out_of_vocab = greedy.with_overrides(forced_ids=[pipeline.spec.thinker_vocab])
    with pytest.raises(StageError, match=r"forced_ids .*outside the vocabulary"):
        list(pipeline.run(PipelineRequest(ids, out_of_vocab, want_audio=False)))


@pytest.mark.parametrize(("family", "key", "config_path"), [
    ("qwen3_omni_moe", "talker_config.text_config.num_hidden_layers", ("talker_config", "text_config")),
    ("qwen2_5_omni", "talker_config.num_hidden_layers", ("talker_config",)),
])  # fmt: skip
def test_make_tiny_sets_config_values_by_path(tmp_path: Path, family: str, key: str,
                                               config_path: tuple[str, ...]) -> None:  # fmt: skip
    """`make-tiny --set` builds another configuration of the family (here its talker's depth):
    the config holds the value, and the weights the model of that config has load. A path the
    config does not have, a malformed pair, or a value that makes a checkpoint no stage would
    serve (it was written, exit 0), is refused naming it; nothing is written."""
    from typer.testing import CliRunner

    from omnistage.cli.main import app

    out = tmp_path / "deep"
    result = CliRunner().invoke(app, ["make-tiny", str(out), "--family", family, "--set", f"{key}=3"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    for part in config_path:
        config = config[part]
    assert config["num_hidden_layers"] == 3
    ckpt = open_checkpoint(out)
    layers = {int(m.group(1)) for k in ckpt.tensors if (m := re.match(r"talker\.model\.layers\.(\d+)\.", k))}
    assert layers == {0, 1, 2}
    # the checkpoint's own checks refuse these (the tokenizer's <|im_end|> id is another)
    unservable = ("im_end_token_id=300", "tokenizer disagrees with config")
    if family == "qwen2_5_omni":
        unservable = ("thinker_config.text_config.rope_parameters.mrope_section=[2, 3, 4]", "sections must add up")
    for bad, needle in ((f"{key[:-2]}=3", "has no key 'num_hidden_laye'"), (key, "expected KEY.PATH=VALUE"),
                        (f"{key}=[", "not YAML"), unservable):  # fmt: skip
        result = CliRunner().invoke(app, ["make-tiny", str(tmp_path / "bad"), "--family", family, "--set", bad])
        assert result.exit_code == 2 and needle in result.output, result.output
        assert not (tmp_path / "bad").exists()


def test_dotted_overrides_nest_known_paths_and_refuse_the_rest() -> None:
    from omnistage.models.tiny_files import dotted_overrides

    base = {"a": {"b": {"c": 1, "d": 2}}, "e": 3}
    assert dotted_overrides(base, {"a.b.c": 5, "a.b.d": [1], "e": None}) == {"a": {"b": {"c": 5, "d": [1]}}, "e": None}
    for pairs, needle in (({"a.x": 1}, "a has no key 'x' (its keys: b)"), ({"e.f": 1}, "not a section"),
                          ({"a.b": 5, "a.b.c": 2}, "'b' was set to a value by another --set")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(needle)):
            dotted_overrides(base, pairs)


def test_the_built_in_checkpoints_cache_key_is_its_generators_source() -> None:
    """`serve` keys the cached built-in checkpoint by its generator's files, read without
    importing them (that imports torch): they must be the modules that write it."""
    from omnistage.cli import serve
    from omnistage.models import tiny_files
    from omnistage.models.qwen3_omni import tiny

    models = Path(serve.__file__).resolve().parents[1] / "models"
    assert [models / f for f in serve.TINY_GENERATOR] == [Path(m.__file__).resolve() for m in (tiny, tiny_files)]  # type: ignore[arg-type]
