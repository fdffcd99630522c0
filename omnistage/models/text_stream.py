"""The reply's text as it streams: incremental detokenization that never emits half a UTF-8
character, and stop texts (the reply ends where one first appears, which is not sent; text that
could still become a stop text is held back until it cannot). The gateway streams the text with
it; the thinker ends a reply with it where a stop text appears, so every stage below ends there
too (the speech is that of the text up to the stop)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_STOP_TEXTS", "TextStream", "check_stop_texts"]

MAX_STOP_TEXTS = 16
MAX_STOP_CHARS = 256


def check_stop_texts(stop: Sequence[str]) -> list[str]:
    """The stop texts, or ValueError naming what is wrong."""
    if len(stop) > MAX_STOP_TEXTS:
        raise ValueError(f"stop: at most {MAX_STOP_TEXTS} texts, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise ValueError(f"stop[{i}]: empty")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop[{i}]: longer than {MAX_STOP_CHARS} characters")
    return list(stop)


class TextStream:
    """Each push decodes only the new ids, with the few before them as context (vLLM's prefix and read
    offsets): a reply's text costs O(its length), not O(length²) as re-decoding it whole each token
    would, which the thinker's engine thread paid per request per step. For the byte-level BPE
    tokenizers of the families served, the pieces join to exactly the whole reply's decode
    (tests/test_text_stream.py checks it on the tiny checkpoint's tokenizer)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars that may begin a stop text
        self.ids: list[int] = []
        self.text = ""  # the decoded text: whole characters
        self.sent = 0  # characters already emitted
        self.stopped = False  # a stop text appeared
        self._prefix = 0  # ids[_prefix:_read]: decoded last time, the context for the next piece
        self._read = 0  # ids before this are in self.text

    def push(self, ids: Sequence[int]) -> str:
        """New token ids -> the text that can be sent now."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        return self._take(final=False)

    def flush(self) -> str:
        """At the end: whatever was held back (a character still incomplete as the decoder shows it)."""
        return "" if self.stopped else self._take(final=True)

    def _take(self, final: bool) -> str:
        new = self._decode_new(final)
        if new is None:  # half a character: wait for the rest
            return ""
        self.text += new
        if self.stop:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._emit_to(min(hits))
            if not final:
                return self._emit_to(max(self.sent, len(self.text) - self._could_begin_stop(self.text)))
        return self._emit_to(len(self.text))

    def _decode_new(self, final: bool) -> str | None:
        """The text of the ids not yet read, or None while it ends in half a character."""
        if self._read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        text = decode(self.ids[self._prefix :], skip_special_tokens=True)
        # Half a character waits for the rest. (Invalid bytes from the model wait too, until a whole
        # character follows them: sending them sooner can split a character that a later id
        # completes, and no count of ids tells them apart, since a token may hold parts of two.)
        if text.endswith("\ufffd") and not final:
            return None
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before) :]

    def _could_begin_stop(self, text: str) -> int:
        """How many characters at the end of `text` begin some stop text (held back)."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _emit_to(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta
