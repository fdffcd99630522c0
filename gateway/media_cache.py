"""Decoded media kept for the requests that send them again.

A chat client sends the whole conversation with every turn, so the audio, images and video of
earlier turns arrive again and again; a Realtime session sends every turn's audio again with each
response. Decoding them (FFmpeg's demuxer, decoder and resampler; Pillow) is most of what a
request's media cost the gateway, and it grows with the conversation. This cache keeps a part's
decoded arrays under a digest of the part's own bytes (its message, so the file or samples and
everything said about them: sample rate, frame rate, ...) and of how it was decoded, least
recently used first out, within a bound in bytes. The arrays are read-only: one copy serves
every request that sends the part.

Only what decoded is kept (a refusal is made again); a hit is charged to the request's decoded-
bytes budget as its decode would be.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["DecodedCache", "Entry"]

Entry = dict[str, Any]  # a decoded content part (media.py's `_decode_part`): its arrays read-only


def _arrays(entry: Entry) -> list[np.ndarray]:
    return [v for v in entry.values() if isinstance(v, np.ndarray)]


class DecodedCache:
    def __init__(self, max_bytes: int, on_lookup: Callable[[bool], None] | None = None) -> None:
        """`on_lookup(hit)`: told of every lookup (the gateway's metrics)."""
        self.max_bytes = max_bytes
        self.bytes = 0
        self.on_lookup = on_lookup
        self._entries: collections.OrderedDict[bytes, tuple[Entry, int]] = collections.OrderedDict()
        self._lock = threading.Lock()  # parts decode in worker threads

    @staticmethod
    def key(part: bytes, *how: object) -> bytes:
        """The digest of a part's serialized message and of what its decode depends on besides."""
        digest = hashlib.blake2b(part, digest_size=32)
        digest.update(repr(how).encode())
        return digest.digest()

    def get(self, key: bytes) -> tuple[Entry, int] | None:
        """A copy of the entry (its arrays shared) and the bytes it decoded to, or None."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
        if self.on_lookup is not None:
            self.on_lookup(found is not None)
        if found is None:
            return None
        entry, nbytes = found
        return dict(entry), nbytes

    def put(self, key: bytes, entry: Entry) -> None:
        """Keep `entry` (its arrays made read-only in place); one larger than the bound is not kept."""
        arrays = _arrays(entry)
        nbytes = sum(a.nbytes for a in arrays)
        for a in arrays:
            a.flags.writeable = False
        if nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (dict(entry), nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self.bytes -= freed

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
