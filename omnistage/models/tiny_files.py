"""What every family's tiny checkpoint writer shares: the byte-level BPE tokenizer (the 256 byte
tokens, merges learnt from a fixed corpus, the family's special tokens and role words at the ids
its config names, reserved fillers up to the vocabulary size), the chat template and processor
files around it, the config files and summary of the written checkpoint, and config overrides
(`omnistage make-tiny --set`). Deterministic: two runs give the same files."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# A fixed English text the byte-level BPE merges are learnt from.
_CORPUS = """
The quick brown fox jumps over the lazy dog. Hello, how are you today? I am fine, thank you.
Speech models answer with text and with audio. The thinker writes the words, the talker turns
them into codec frames, and the decoder turns the frames into a waveform that you can hear.
Please tell me a short story about a robot who learns to sing. Once upon a time there was a
small robot that lived in a quiet town by the sea. Every morning it listened to the birds and
tried to sing their songs. What is the weather like in the city this afternoon? It is sunny and
warm, with a light wind from the west. Can you explain how streaming works? Streaming means the
first sound starts before the whole answer is ready, so the listener does not have to wait.
Serving many requests at once means they share each step of the model on the same machine.
Thank you for listening, and have a nice day. Where is the nearest train station from here?
Numbers one two three four five six seven eight nine ten, and the letters of the alphabet.
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def _learn_merges(num_merges: int) -> list[tuple[str, str]]:
    """Plain deterministic BPE on the fixed corpus (ties broken by the pair's text)."""
    byte_map = _bytes_to_unicode()
    words: dict[tuple[str, ...], int] = {}
    for raw in _CORPUS.replace("\n", " ").split(" "):
        if not raw:
            continue
        # byte-level pre-tokenization attaches the leading space to the word
        word = tuple(byte_map[b] for b in (" " + raw).encode("utf-8"))
        words[word] = words.get(word, 0) + 1
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: dict[tuple[str, str], int] = {}
        for word, count in words.items():
            for a, b in itertools.pairwise(word):
                pairs[(a, b)] = pairs.get((a, b), 0) + count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        new_words: dict[tuple[str, ...], int] = {}
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + count
        words = new_words
    return merges


def tokenizer_json(vocab_size: int, first_special_id: int, special_tokens: Sequence[str],
                   role_words: Sequence[str], top_words: Sequence[str] = ()) -> str:  # fmt: skip
    """`tokenizer.json` text: `special_tokens` then `role_words` (ordinary tokens, as in Qwen's
    vocabulary) take the ids from `first_special_id` on; `top_words` (added tokens, not special:
    Qwen's tool tags) the vocabulary's last ids, so that adding them leaves every other id and
    merge as it was but the last few merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_map = _bytes_to_unicode()
    vocab: dict[str, int] = {byte_map[b]: b for b in range(256)}
    named = [*special_tokens, *role_words]
    merges = _learn_merges(vocab_size - 256 - len(named))
    fresh = (a + b for a, b in merges)
    filler = 0
    for i in range(256, vocab_size - len(top_words)):
        if first_special_id <= i < first_special_id + len(named):
            vocab[named[i - first_special_id]] = i
            continue
        token = next((t for t in fresh if t not in vocab), None)
        if token is None:  # the corpus gave no more merges: fillers, so every model id decodes
            token, filler = f"<|reserved_{filler}|>", filler + 1
        vocab[token] = i
    vocab.update((word, vocab_size - len(top_words) + k) for k, word in enumerate(top_words))
    merges = [(a, b) for a, b in merges if a + b in vocab]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in [*role_words, *top_words]])
    reserved = [t for t in vocab if t.startswith("<|reserved_")]
    if reserved:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    return tok.to_str(pretty=True)


# The feature extractor's config: Whisper-style log-mel features at 16 kHz (both families' processors).
AUDIO_PREPROCESSOR = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 400,
    "chunk_length": 300,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "dither": 0.0,
}


# Qwen's tool-calling section (Qwen3's chat format): the tools as JSON lines in the system turn,
# the calls an assistant made as <tool_call> blocks, tool results as a user turn's <tool_response>s.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def chat_template(tokens: Mapping[str, str], tools: bool = False) -> str:
    """Qwen's chat format: a message's content is a string or a list of parts; audio, image and
    video parts become one placeholder wrapped in their start/end tokens (`tokens`: the
    tokenizer's named tokens, as `extra_special_tokens`), which the processor expands to one
    placeholder per encoder output row. `tools`: with Qwen3's tool calling (Qwen3-Omni's
    template has it, Qwen2.5-Omni's not): a prompt without tools, calls or tool results renders
    as without it."""
    audio = tokens["audio_bos_token"] + tokens["audio_token"] + tokens["audio_eos_token"]
    image = tokens["vision_bos_token"] + tokens["image_token"] + tokens["vision_eos_token"]
    video = tokens["vision_bos_token"] + tokens["video_token"] + tokens["vision_eos_token"]
    content = (
        "{%- macro render(content) %}"
        "{%- if content is string %}{{- content }}"
        "{%- else %}{%- for part in content %}"
        "{%- if part['type'] == 'text' %}{{- part['text'] }}"
        f"{{%- elif part['type'] == 'audio' %}}{{{{- '{audio}' }}}}"
        f"{{%- elif part['type'] == 'image' %}}{{{{- '{image}' }}}}"
        f"{{%- elif part['type'] == 'video' %}}{{{{- '{video}' }}}}"
        "{%- endif %}{%- endfor %}{%- endif %}"
        "{%- endmacro %}"
    )
    if not tools:
        return (
            content + "{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' }}{{- render(message['content']) }}{{- '<|im_end|>\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        )
    return (
        content + "{%- if tools %}{{- '<|im_start|>system\\n' }}"
        "{%- if messages[0]['role'] == 'system' %}{{- render(messages[0]['content']) + '\\n\\n' }}{%- endif %}"
        f"{{{{- {TOOLS_PREAMBLE!r} }}}}"
        "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        f"{{{{- {TOOLS_POSTAMBLE!r} + '<|im_end|>\\n' }}}}"
        "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if tools and loop.first and message['role'] == 'system' %}"  # (in the tools turn above)
        "{%- elif message['role'] == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' }}{{- render(message['content']) }}{{- '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' }}{{- render(message['content']) }}"
        "{%- for call in message['tool_calls'] or [] %}"
        "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
        "{%- set call = call['function'] if call['function'] is defined else call %}"
        "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
        "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}"
        "{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


def processor_files(*, vocab_size: int, first_special_id: int, special_tokens: Sequence[str],
                    role_words: Sequence[str], named_tokens: Mapping[str, str], vision: Mapping[str, Any],
                    processor_class: str, tools: Sequence[str] = ()) -> dict[str, str]:  # fmt: skip
    """The tokenizer and processor files: tokenizer.json and tokenizer_config.json (`named_tokens`
    become the tokenizer's `extra_special_tokens`, so the processor finds its placeholders), the
    chat template in chat_template.json, and the feature extractor's, image and video processors'
    configs (`vision`: Qwen2-VL-style patch settings) for transformers' `processor_class`.
    `tools`: Qwen's tool tags (`tokenizer_json`'s top words), and a template with tool calling."""
    text = tokenizer_json(vocab_size, first_special_id, special_tokens, role_words, tools)
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 2048,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "bos_token": None,
        "add_prefix_space": False,
        "extra_special_tokens": dict(named_tokens),
    }
    preprocessor = {**AUDIO_PREPROCESSOR, "image_processor_type": "Qwen2VLImageProcessor", **vision,
                    "processor_class": processor_class}  # fmt: skip
    video = {"video_processor_type": "Qwen2VLVideoProcessor", **vision, "processor_class": processor_class}
    return {
        "tokenizer.json": text + "\n",
        "tokenizer_config.json": _json(tokenizer_config),
        # (in chat_template.json, where processors save it)
        "chat_template.json": _json({"chat_template": chat_template(named_tokens, bool(tools))}),
        "preprocessor_config.json": _json(preprocessor),
        "video_preprocessor_config.json": _json(video),
    }


def _json(data: Mapping[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def write_configs(out: Path, model: Any, dtype: str, generation: Mapping[str, Any]) -> None:
    """Our own config.json and generation_config.json (save_pretrained's would carry its version
    string, so two transformers versions would write different files)."""
    config_dict = model.config.to_dict()
    config_dict.pop("transformers_version", None)
    config_dict["dtype"] = dtype
    (out / "config.json").write_text(_json(config_dict))
    (out / "generation_config.json").write_text(_json(generation))


def summary(out: Path, model: Any, layout: str, dtype: str) -> dict[str, Any]:
    """What was written: parameters, weight files, their bytes and sha256."""
    weights = sorted(out.glob("*.safetensors"))
    digest = hashlib.sha256()
    for f in weights:
        digest.update(f.read_bytes())
    return {
        "dir": str(out),
        "layout": layout,
        "dtype": dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight_files": [f.name for f in weights],
        "safetensors_bytes": sum(f.stat().st_size for f in weights),
        "safetensors_sha256": digest.hexdigest(),
    }


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` merged in, nested dicts key by key."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def dotted_overrides(base: Mapping[str, Any], pairs: Mapping[str, Any]) -> dict[str, Any]:
    """`{"talker_config.text_config.num_hidden_layers": 20}` as nested overrides of a config
    dict `base`. Every path must name a key `base` has (a typo would otherwise be a key the
    model's config silently ignores): ValueError naming it and the keys that level has."""
    out: dict[str, Any] = {}
    for path, value in pairs.items():
        keys = path.split(".")
        level: Any = base
        for depth, key in enumerate(keys):
            if not isinstance(level, Mapping) or key not in level:
                where = ".".join(keys[:depth]) or "the config"
                known = ", ".join(sorted(level)) if isinstance(level, Mapping) else "none (not a section)"
                raise ValueError(f"{path}: {where} has no key {key!r} (its keys: {known})")
            level = level[key]
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):  # an earlier pair set this section to a value
                raise ValueError(f"{path}: {key!r} was set to a value by another --set")
        node[keys[-1]] = value
    return out
