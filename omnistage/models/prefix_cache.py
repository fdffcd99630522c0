"""The thinker's prefix cache: what ended requests computed, for later prompts that start alike.

A conversation's next request is its previous one (prompt and reply) plus a new turn, and every
request of a deployment may open with one system prompt. A request that ends keeps its KV cache,
the input embeddings and the accept-layer hidden states of every position it fed (what the
talker is sent for its prompt), the ids and its media items' digests. A new prompt that starts
with the same ids, the same media at the same places, takes the longest such prefix from them and
prefills only the rest; the encoders run only over the media after it.

Entries are bounded in tokens, least recently used out first; an entry whose ids begin another's
(the previous turn of a conversation) goes when that one is kept. A hit changes the last bits of
the numbers after it (the rest of the prompt is prefilled as a chunk of its own, as chunked
prefill does), so it is off by default: exact mode's parity with `generate()` is for prompts
prefilled whole.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["DIGEST_BYTES", "MediaItem", "Prefix", "PrefixCache"]

DIGEST_BYTES = 32  # a media item's digest (blake2b of its model inputs: models/<family>/multimodal.py)


@dataclass(frozen=True)
class MediaItem:
    """One audio, image or video of a prompt: its kind ("audio", "image", "video"), positions
    [start, end) from its start token to its last placeholder, and a digest of its model inputs."""

    kind: str
    start: int
    end: int
    digest: bytes


@dataclass
class Prefix:
    ids: torch.Tensor  # [n] int64, CPU: the positions' ids
    items: tuple[MediaItem, ...]  # its media, by start
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer keys and values [1, kv_heads, n, dim]
    embeds: torch.Tensor  # [n, H] input embeddings
    hidden: torch.Tensor  # [n, H] accept-layer hidden states

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def usable_length(n: int, items: Sequence[MediaItem], cached: Sequence[MediaItem]) -> int:
    """How much of a common prefix of `n` ids holds: up to the first media item that is not
    wholly in it or not the cached one."""
    same = {item.start: item for item in cached}
    for item in items:
        if item.start >= n:
            break
        if item.end > n or same.get(item.start) != item:
            return item.start
    return n


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._entries: collections.OrderedDict[int, Prefix] = collections.OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, ids: torch.Tensor, items: Sequence[MediaItem]) -> tuple[int, Prefix | None]:
        """The longest cached prefix of a prompt `ids` ([L] CPU int64) with media `items`, at most
        L - 1 tokens (the last prompt token is fed to make the first new one): (length, entry)."""
        best, found = 0, None
        for key, entry in self._entries.items():
            n = usable_length(min(_common(ids, entry.ids), ids.numel() - 1), items, entry.items)
            if n > best:
                best, found = n, key
        if found is None:
            return 0, None
        self._entries.move_to_end(found)
        return best, self._entries[found]

    def add(self, entry: Prefix) -> None:
        """Keep `entry` (not when larger than the bound); the entries it extends go."""
        if entry.tokens == 0 or entry.tokens > self.max_tokens:
            return
        for key, old in list(self._entries.items()):
            if old.tokens <= entry.tokens and usable_length(_common(old.ids, entry.ids), old.items,
                                                            entry.items) == old.tokens:  # fmt: skip
                self._drop(key)
        self._entries[self._next] = entry
        self._next += 1
        self.tokens += entry.tokens
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        self.tokens -= self._entries.pop(key).tokens
