"""The tiny checkpoints' byte-level BPE tokenizer, shared by every family's tiny generator: the
256 byte tokens, merges learnt from a fixed corpus, the family's special tokens and role words at
the ids its config names, reserved fillers up to the vocabulary size. Deterministic: two runs give
the same `tokenizer.json`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

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
                   role_words: Sequence[str]) -> str:  # fmt: skip
    """`tokenizer.json` text: `special_tokens` then `role_words` (ordinary tokens, as in Qwen's
    vocabulary) take the ids from `first_special_id` on."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_map = _bytes_to_unicode()
    vocab: dict[str, int] = {byte_map[b]: b for b in range(256)}
    named = [*special_tokens, *role_words]
    merges = _learn_merges(vocab_size - 256 - len(named))
    fresh = (a + b for a, b in merges)
    filler = 0
    for i in range(256, vocab_size):
        if first_special_id <= i < first_special_id + len(named):
            vocab[named[i - first_special_id]] = i
            continue
        token = next((t for t in fresh if t not in vocab), None)
        if token is None:  # the corpus gave no more merges: fillers, so every model id decodes
            token, filler = f"<|reserved_{filler}|>", filler + 1
        vocab[token] = i
    merges = [(a, b) for a, b in merges if a + b in vocab]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in role_words])
    reserved = [t for t in vocab if t.startswith("<|reserved_")]
    if reserved:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    return tok.to_str(pretty=True)
