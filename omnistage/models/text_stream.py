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
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars that may begin a stop text
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters already emitted
        self.stopped = False  # a stop text appeared

    def push(self, ids: Sequence[int]) -> str:
        """New token ids -> the text that can be sent now."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # half a character: wait for the rest
            return ""
        self.text = text
        if self.stop:
            start = max(0, self.sent - self.hold)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                return self._emit_to(min(hits))
            return self._emit_to(max(self.sent, len(text) - self._could_begin_stop(text)))
        return self._emit_to(len(text))

    def _could_begin_stop(self, text: str) -> int:
        """How many characters at the end of `text` begin some stop text (held back)."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def flush(self) -> str:
        """At the end: whatever was held back."""
        return "" if self.stopped else self._emit_to(len(self.text))

    def _emit_to(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta
