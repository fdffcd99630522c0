"""Same-host shared-memory path for large tensor blobs (docs/architecture.md, "The wire").

The *sender* owns a ``ShmPool``: a bounded set of fixed-size segments, plain files under
``/dev/shm`` mapped with ``mmap`` (no ``multiprocessing.shared_memory``, so no
resource_tracker unlinking segments behind our back). A large blob is written once into a slot
of a segment held by its request and travels as a ``ShmRef`` (segment, offset, nbytes). The
*receiver* maps the segment once (``ShmReader``, cached) and wraps the bytes in place.

Lifetimes
---------
* A segment is held by one request at a time; slots are bump-allocated inside it, so nothing a
  request has sent is overwritten while the request lives. ``release_request`` (request finished
  or cancelled) returns its segments to the free list; free segments beyond
  ``max_free_segments`` are unlinked. Receivers must be done with (or have copied) the tensors
  of a request before its sender releases it, which the one-call-per-request protocol gives:
  the sender releases when its call to the receiver ends, or, for a receiver that copies all of
  a request's input in before it answers (the decode role), at the receiver's first answer.
* Segments are never truncated while they exist, so a late reader sees stale bytes at worst,
  never a SIGBUS. Space is reserved with ``posix_fallocate`` at creation so a full /dev/shm
  (Docker's default is 64 MB) makes the pool fall back to inline bytes instead of crashing.
* The owner unlinks its segments on ``close()``, at garbage collection and at interpreter exit.
  A SIGKILLed owner cannot: ``sweep_stale_segments`` (run by every new ``ShmPool``) unlinks
  segments whose owner is gone. Names are ``omnistage-<pid>-<pidns>-<starttime>-<token>-<n>``,
  so the sweeper recognises a dead owner even after its pid was reused, and leaves alone
  segments of other pid namespaces (other containers sharing /dev/shm) whose liveness it cannot
  judge.

Handshake
---------
A sender only sends ShmRefs to a receiver that has proven it can map its segments. The sender
puts ``pool.invocation_metadata()`` (a probe segment name and nonce) on the call; the receiver
answers ``reader.accept(metadata)`` in its initial metadata; the sender checks
``peer_accepts_shm(await call.initial_metadata())`` and otherwise encodes inline. A receiver
handed a ref it cannot map raises ``TensorBlobError``.

Off switch: ``ShmPool(enabled=False)`` / ``ShmReader(enabled=False)``, or ``OMNISTAGE_SHM=0`` in
the environment (then pools stay empty and readers decline the handshake).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from omnistage.v1.tensor_pb2 import ShmRef
from omnistage.wire.errors import TensorBlobError

__all__ = [
    "DEFAULT_DIR",
    "PREFIX",
    "SHM_ACK_KEY",
    "SHM_PROBE_KEY",
    "ShmPool",
    "ShmReader",
    "ShmSlot",
    "list_segments",
    "peer_accepts_shm",
    "shm_enabled_by_env",
    "sweep_stale_segments",
]

PREFIX = "omnistage-"
DEFAULT_DIR = Path("/dev/shm")
SHM_PROBE_KEY = "omnistage-shm-probe"  # invocation metadata, sender -> receiver
SHM_ACK_KEY = "omnistage-shm"  # initial metadata, receiver -> sender: "1" = can map
ENV_FLAG = "OMNISTAGE_SHM"

_ALIGN = 64
_NAME_RE = re.compile(r"omnistage-[A-Za-z0-9_-]{1,200}")  # fullmatch: `$` would let a trailing newline in
_PROBE_RE = re.compile(r"omnistage-\d+-\d+-\d+-[0-9a-f]{8}-probe")  # exactly what a pool names its probe
_OWNER_RE = re.compile(r"^omnistage-(\d+)-(\d+)-(\d+)-")
_NONCE_BYTES = 16


def shm_enabled_by_env() -> bool:
    """False when OMNISTAGE_SHM is 0/false/no/off."""
    return os.environ.get(ENV_FLAG, "1").strip().lower() not in {"0", "false", "no", "off"}


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _usable_dir(directory: Path) -> bool:
    return sys.platform.startswith("linux") and directory.is_dir() and os.access(directory, os.W_OK)


def list_segments(directory: str | Path = DEFAULT_DIR) -> list[str]:
    """Names of all omnistage segments in ``directory`` (any owner)."""
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith(PREFIX))
    except OSError:
        return []


def sweep_stale_segments(directory: str | Path = DEFAULT_DIR) -> list[str]:
    """Unlink segments whose owning process (same pid namespace) is dead; return their names."""
    ns = _pid_namespace()
    removed = []
    for name in list_segments(directory):
        m = _OWNER_RE.match(name)
        if m is None:
            continue
        pid, owner_ns, start = (int(g) for g in m.groups())
        if owner_ns != ns or _start_time(pid) == start:
            continue
        with contextlib.suppress(OSError):  # gone already, or another user's (sticky /dev/shm)
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


class _Segment:
    def __init__(self, path: Path, size: int, mm: mmap.mmap) -> None:
        self.path = path
        self.name = path.name
        self.size = size
        self.mm = mm
        self.view = memoryview(mm)
        self.used = 0  # bump pointer while held by a request

    @classmethod
    def create(cls, path: Path, size: int) -> _Segment | None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)  # reserve now: a full tmpfs must not SIGBUS later
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        os.close(fd)
        return cls(path, size, mm)

    def destroy(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        with contextlib.suppress(BufferError):
            self.view.release()
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()  # fails while tensors still view it; the GC unmaps it later


@dataclass(frozen=True)
class ShmSlot:
    """A writable range of a segment, held by one request until it is released."""

    segment: str
    offset: int
    nbytes: int
    buffer: memoryview  # exactly nbytes long

    def ref(self) -> ShmRef:
        return ShmRef(segment=self.segment, offset=self.offset, nbytes=self.nbytes)


def _unlink_all(paths: set[Path]) -> None:
    for p in list(paths):
        with contextlib.suppress(OSError):
            os.unlink(p)
    paths.clear()


class ShmPool:
    """Sender-side pool of shared-memory segments; thread-safe.

    ``threshold_bytes``: smaller blobs travel inline. ``segment_bytes``: the largest pooled
    segment (a larger blob gets a dedicated segment, unlinked on release). A request's segments
    grow: its first is the smallest power of two (at least ``min_segment_bytes``) that holds its
    first slot, each further one at least twice the last, so a request that sends little (the
    thinker's prompt rows for the talker) holds little for as long as its call lives, and one that
    sends much (a prefill role's KV) holds few segments. ``max_total_bytes``: all segments
    together; beyond it ``allocate`` returns None (inline fallback).
    ``max_request_bytes``: what one request may hold. ``max_free_segments``: free segments kept
    for reuse after a release. ``enabled=None`` follows OMNISTAGE_SHM.
    """

    def __init__(
        self,
        *,
        enabled: bool | None = None,
        threshold_bytes: int = 256 << 10,
        segment_bytes: int = 64 << 20,
        min_segment_bytes: int = 1 << 20,
        max_total_bytes: int = 2 << 30,
        max_request_bytes: int = 1 << 30,
        max_free_segments: int = 4,
        directory: str | Path = DEFAULT_DIR,
        sweep: bool = True,
    ) -> None:
        self.directory = Path(directory)
        want = shm_enabled_by_env() if enabled is None else enabled
        self.enabled = bool(want) and _usable_dir(self.directory)
        self.threshold_bytes = threshold_bytes
        self.segment_bytes = segment_bytes
        self.min_segment_bytes = min(min_segment_bytes, segment_bytes)
        self.max_total_bytes = max_total_bytes
        self.max_request_bytes = max_request_bytes
        self.max_free_segments = max_free_segments
        self._lock = threading.Lock()
        self._free: list[_Segment] = []
        self._held: dict[str, list[_Segment]] = {}
        self._held_bytes: dict[str, int] = {}
        self._total = 0
        self._counter = 0
        self.inline_fallbacks = 0  # slots refused (pool full, request over its share): those blobs went inline
        pid = os.getpid()
        self._stem = f"{PREFIX}{pid}-{_pid_namespace()}-{_start_time(pid) or 0}-{secrets.token_hex(4)}"
        self._paths: set[Path] = set()
        self._probe: tuple[str, bytes] | None = None
        self._probe_seg: _Segment | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths)
        if self.enabled and sweep:
            sweep_stale_segments(self.directory)

    # -- allocation ---------------------------------------------------------------------------

    def wants(self, nbytes: int) -> bool:
        """Whether a blob of this size should go through shared memory."""
        return self.enabled and nbytes >= max(1, self.threshold_bytes)

    def _new_segment(self, size: int) -> _Segment | None:
        self._counter += 1
        seg = _Segment.create(self.directory / f"{self._stem}-{self._counter}", size)
        if seg is not None:
            self._paths.add(seg.path)
            self._total += size
        return seg

    def _drop(self, seg: _Segment) -> None:
        self._paths.discard(seg.path)
        self._total -= seg.size
        seg.destroy()

    def allocate(self, request_id: str, nbytes: int) -> ShmSlot | None:
        """A slot of ``nbytes`` held by ``request_id``, or None (disabled, full, over a limit)."""
        if not self.enabled or nbytes <= 0:
            return None
        with self._lock:
            if self._closed:
                return None
            if self._held_bytes.get(request_id, 0) + nbytes > self.max_request_bytes:
                self.inline_fallbacks += 1
                return None
            held = self._held.get(request_id)
            seg = held[-1] if held else None
            start = (seg.used + _ALIGN - 1) // _ALIGN * _ALIGN if seg else 0
            if seg is None or start + nbytes > seg.size:
                seg = self._take_segment(nbytes, seg.size if seg else 0)
                if seg is None:
                    self.inline_fallbacks += 1
                    return None
                self._held.setdefault(request_id, []).append(seg)
                start = 0
            seg.used = start + nbytes
            self._held_bytes[request_id] = self._held_bytes.get(request_id, 0) + nbytes
            return ShmSlot(seg.name, start, nbytes, seg.view[start : start + nbytes])

    def _take_segment(self, nbytes: int, last: int) -> _Segment | None:
        """A segment for a slot of `nbytes` (`last`: the size of the request's last segment, 0
        for its first): a free one of the size the request grows to, else a new one; with the
        pool full, a free one that holds the slot, else room made by dropping free ones."""
        if nbytes > self.segment_bytes:
            size = -(-nbytes // (1 << 20)) << 20  # dedicated
        else:
            size = min(self.segment_bytes, max(self.min_segment_bytes, 1 << (nbytes - 1).bit_length(), 2 * last))
        fits = [s for s in self._free if s.size >= size] or (
            [s for s in self._free if s.size >= nbytes] if self._total + size > self.max_total_bytes else [])
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self._free.remove(seg)
            seg.used = 0
            return seg
        while self._total + size > self.max_total_bytes and self._free:
            self._drop(self._free.pop(0))
        if self._total + size > self.max_total_bytes:
            return None
        return self._new_segment(size)

    def release_request(self, request_id: str) -> int:
        """Return the request's segments to the pool (call on finish and on cancel); idempotent.

        Returns how many segments the request held.
        """
        with self._lock:
            segs = self._held.pop(request_id, [])
            self._held_bytes.pop(request_id, None)
            for seg in segs:
                seg.used = 0
                if seg.size > self.segment_bytes:  # dedicated
                    self._drop(seg)
                else:
                    self._free.append(seg)
            if len(self._free) > self.max_free_segments:  # keep the largest: they serve any request
                self._free.sort(key=lambda s: s.size, reverse=True)
                for seg in self._free[self.max_free_segments :]:
                    self._drop(seg)
                del self._free[self.max_free_segments :]
            return len(segs)

    # -- handshake ----------------------------------------------------------------------------

    def probe_token(self) -> str | None:
        """``<segment>:<hex nonce>`` of a tiny probe segment, or None when disabled."""
        if not self.enabled:
            return None
        with self._lock:
            if self._closed:
                return None
            if self._probe is None:
                path = self.directory / f"{self._stem}-probe"
                nonce = secrets.token_bytes(_NONCE_BYTES)
                seg = _Segment.create(path, mmap.PAGESIZE)
                if seg is None:
                    return None
                self._paths.add(path)
                seg.mm[:_NONCE_BYTES] = nonce
                self._probe_seg = seg
                self._probe = (path.name, nonce)
            name, nonce = self._probe
        return f"{name}:{nonce.hex()}"

    def invocation_metadata(self) -> list[tuple[str, str]]:
        """Metadata to put on a Stage.Stream call so the receiver can prove it sees our segments."""
        token = self.probe_token()
        return [] if token is None else [(SHM_PROBE_KEY, token)]

    # -- introspection / teardown -------------------------------------------------------------

    @property
    def num_segments(self) -> int:
        """Data segments this pool owns now (held + free), for ``Load.shm_segments``."""
        with self._lock:
            return len(self._free) + sum(len(s) for s in self._held.values())

    def held_requests(self) -> list[str]:
        with self._lock:
            return sorted(self._held)

    def segment_names(self) -> list[str]:
        with self._lock:
            return sorted(p.name for p in self._paths)

    def close(self) -> None:
        """Unlink every segment of this pool (readers keep their mappings until they drop them)."""
        with self._lock:
            self._closed = True
            for seg in self._free + [s for segs in self._held.values() for s in segs]:
                self._drop(seg)
            self._free.clear()
            self._held.clear()
            self._held_bytes.clear()
            if self._probe_seg is not None:
                self._paths.discard(self._probe_seg.path)
                self._probe_seg.destroy()
                self._probe_seg = None
                self._probe = None
            _unlink_all(self._paths)

    def __enter__(self) -> ShmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmReader:
    """Receiver side: maps sender segments (read-write, shared) once and hands out views.

    Thread-safe. Keeps at most ``max_cached`` mappings (LRU), and forgets those whose segment
    the sender has unlinked whenever it maps a new one (a sender makes new segments after it
    drops old ones): a cached mapping would otherwise keep a deleted segment's memory. Dropping
    a mapping never invalidates tensors already decoded from it (they hold it until freed).
    """

    def __init__(
        self, *, enabled: bool | None = None, directory: str | Path = DEFAULT_DIR, max_cached: int = 64
    ) -> None:
        self.directory = Path(directory)
        self.enabled = (shm_enabled_by_env() if enabled is None else enabled) and sys.platform.startswith(
            "linux"
        )
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, tuple[mmap.mmap, int]] = OrderedDict()

    def _map(self, name: str) -> tuple[mmap.mmap, int]:
        if not _NAME_RE.fullmatch(name):
            raise TensorBlobError(f"invalid shared-memory segment name {name[:80]!r}")
        with self._lock:
            hit = self._maps.get(name)
            if hit is not None:
                self._maps.move_to_end(name)
                return hit
        try:
            fd = os.open(self.directory / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TensorBlobError(f"shared-memory segment {name!r} not found") from None
        except OSError as e:
            raise TensorBlobError(f"cannot open shared-memory segment {name!r}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
                raise TensorBlobError(f"shared-memory segment {name!r} is not a usable file")
            # a pool's files are this user's alone (0600): anything else was made by someone else
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise TensorBlobError(f"shared-memory segment {name!r} is not private to this user")
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise TensorBlobError(f"cannot map shared-memory segment {name!r}: {e.strerror}") from None
        finally:
            os.close(fd)
        entry = (mm, st.st_size)
        with self._lock:
            for gone in [n for n in self._maps if not (self.directory / n).exists()]:
                del self._maps[gone]
            self._maps[name] = entry
            while len(self._maps) > self.max_cached:
                self._maps.popitem(last=False)
        return entry

    def buffer(self, ref: ShmRef) -> memoryview:
        """A writable view of ``[offset, offset + nbytes)`` of the referenced segment."""
        mm, size = self._map(ref.segment)
        if ref.offset < 0 or ref.nbytes < 0 or ref.offset + ref.nbytes > size:
            raise TensorBlobError(
                f"shm range [{ref.offset}, {ref.offset + ref.nbytes}) outside segment of {size} bytes"
            )
        return memoryview(mm)[ref.offset : ref.offset + ref.nbytes]

    def check_probe(self, token: str) -> bool:
        """True when the probe segment named in ``token`` is visible and holds its nonce."""
        if not self.enabled:
            return False
        name, _, nonce_hex = token.partition(":")
        try:
            nonce = bytes.fromhex(nonce_hex)
            mm, size = self._map(name)
        except (ValueError, TensorBlobError):
            return False
        ok = len(nonce) == _NONCE_BYTES and size >= _NONCE_BYTES and mm[:_NONCE_BYTES] == nonce
        self.forget(name)
        return ok

    def accept(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> list[tuple[str, str]]:
        """Initial metadata answering a caller's probe: ``[(SHM_ACK_KEY, "1")]`` or ``[]``."""
        return self.accept_call(metadata)[0]

    def accept_call(self, metadata: Iterable[tuple[str, str | bytes]] | None
                    ) -> tuple[list[tuple[str, str]], CallShmReader]:  # fmt: skip
        """The initial metadata answering a caller's probe, and the reader for that call: it maps
        only the segments of the pool whose probe the caller proved on this call."""
        for key, value in metadata or ():
            if key != SHM_PROBE_KEY or not isinstance(value, str):
                continue
            name = value.partition(":")[0]
            # only a pool's own probe name: a shorter stem ("omnistage") would cover every segment
            if _PROBE_RE.fullmatch(name) and self.check_probe(value):
                return [(SHM_ACK_KEY, "1")], CallShmReader(self, name.removesuffix("-probe"))
        return [], CallShmReader(self, None)

    def forget(self, name: str) -> None:
        with self._lock:
            self._maps.pop(name, None)

    @property
    def num_mapped(self) -> int:
        with self._lock:
            return len(self._maps)

    def close(self) -> None:
        with self._lock:
            self._maps.clear()


def peer_accepts_shm(initial_metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether the receiver's initial metadata acknowledged our probe."""
    return any(k == SHM_ACK_KEY and v in ("1", b"1") for k, v in initial_metadata or ())


class CallShmReader:
    """The shared-memory references one call may use: segments of the one pool whose probe
    (name and nonce, readable only by the pool's owner and the peers it lets read) the caller
    presented on this call. A reference to any other segment, however well its name matches
    the pattern, is refused without opening it."""

    def __init__(self, reader: ShmReader, stem: str | None) -> None:
        self.reader = reader
        self.stem = stem
        self.enabled = reader.enabled and stem is not None
        self._segment = None if stem is None else re.compile(re.escape(stem) + r"-\d+")  # the pool's data segments

    def buffer(self, ref: ShmRef) -> memoryview:
        name = ref.segment
        if self._segment is None or not self._segment.fullmatch(name):
            raise TensorBlobError("a shared-memory reference to a segment this caller did not announce on this call")
        return self.reader.buffer(ref)
