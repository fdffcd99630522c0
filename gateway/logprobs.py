"""OpenAI's chat `logprobs`: each generated token's text, bytes and log-probability, with the
most likely alternatives at its position (`choices[].logprobs.content`), from what the thinker
sends with each token (`TextDelta.logprobs`)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, ClassVar

from transformers.convert_slow_tokenizer import bytes_to_unicode

from omnistage.v1 import gateway_pb2

# What OpenAI reports for a token the model gives no probability at all (its log is -inf, which
# JSON cannot hold).
FLOOR = -9999.0


class TokenPieces:
    """A token id's text and UTF-8 bytes, as OpenAI's `token` and `bytes` give them: a byte-level
    BPE token (Qwen's) is its bytes, which may be part of a character (its text then has U+FFFD
    where the part is, as vLLM shows it); another tokenizer's token is the text it decodes to.
    Looked up once per id."""

    _BYTES: ClassVar[dict[str, int]] = {c: b for b, c in bytes_to_unicode().items()}

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # special tokens (the tokenizer's, and every added token marked special: <|im_start|>,
        # <tts_pad>, ...) are their text, not bytes of the byte-level table
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.special = frozenset([*(int(i) for i in tokenizer.all_special_ids),
                                  *(int(i) for i, t in added.items() if getattr(t, "special", False))])  # fmt: skip
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id)
        return piece

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if token is None:  # an id past the tokenizer's (a checkpoint whose embedding has spare rows)
            return "", []
        if token_id not in self.special and all(c in self._BYTES for c in token):
            raw = bytes(self._BYTES[c] for c in token)
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.convert_tokens_to_string([token])
        return text, list(text.encode("utf-8"))

    def entries(self, logprobs: Iterable[gateway_pb2.TokenLogprob], ends: Collection[int] = ()) -> list[dict[str, Any]]:
        """OpenAI's `logprobs.content` entries of these tokens, one per token (as `usage` counts
        them) but the one that ended the reply (an id of `ends`, the thinker's stop ids: its last).
        A special token within the reply has one too, its text the token's (the content, decoded
        without special tokens, shows nothing of it). Alternatives are the model's, special or not."""
        out = []
        for lp in logprobs:
            if lp.token_id in ends:  # (a stop id ends the reply: nothing comes after it)
                continue
            out.append({**self._entry(lp.token_id, lp.logprob),
                        "top_logprobs": [self._entry(t.token_id, t.logprob) for t in lp.top]})  # fmt: skip
        return out

    def plain(self, logprobs: Iterable[gateway_pb2.TokenLogprob], ends: Collection[int] = ()) -> list[dict[str, Any]]:
        """The entries as OpenAI's transcriptions give them: `{token, logprob, bytes}`, no alternatives."""
        return [{k: e[k] for k in ("token", "logprob", "bytes")} for e in self.entries(logprobs, ends)]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self(token_id)
        # (NaN fails the comparison too: JSON has no NaN, and a greedy pick from NaN logits has one)
        return {"token": text, "logprob": logprob if logprob >= FLOOR else FLOOR, "bytes": raw}


class Held:
    """A streamed reply's entries in the order its tokens came: each piece of text takes those not
    yet sent (a token whose text is not out yet, held for a stop text or part of a character, goes
    with the text that shows it); `every` has them all."""

    def __init__(self) -> None:
        self.every: list[dict[str, Any]] = []
        self._sent = 0

    def add(self, entries: list[dict[str, Any]]) -> None:
        self.every.extend(entries)

    def take(self) -> list[dict[str, Any]]:
        """The entries not sent before."""
        out, self._sent = self.every[self._sent :], len(self.every)
        return out
