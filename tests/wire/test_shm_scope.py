"""A call may reference only the segments of the pool it proved on that call (its probe)."""

from __future__ import annotations

import pytest

from omnistage.v1.tensor_pb2 import ShmRef
from omnistage.wire import TensorBlobError
from omnistage.wire.shm import SHM_PROBE_KEY, ShmPool, ShmReader


def test_a_segment_the_caller_did_not_announce_is_refused_unread(pool: ShmPool, reader: ShmReader) -> None:
    other = ShmPool(threshold_bytes=1024, segment_bytes=1 << 20, max_total_bytes=16 << 20)
    try:
        victim = other.allocate("victim", 4096)  # another process's live segment
        mine = pool.allocate("mine", 4096)
        assert victim is not None and mine is not None
        ack, call = reader.accept_call([(SHM_PROBE_KEY, pool.probe_token() or "")])
        assert ack and call.enabled
        assert len(call.buffer(mine.ref())) == 4096  # the announcing pool's own segment: fine
        opened = dict(reader._maps)
        with pytest.raises(TensorBlobError, match="did not announce") as err:
            call.buffer(victim.ref())
        assert victim.segment not in reader._maps and reader._maps.keys() == opened.keys()  # never mapped
        assert victim.segment not in str(err.value)  # nor named back
        with pytest.raises(TensorBlobError, match="did not announce"):  # the probe segment itself
            call.buffer(ShmRef(segment=(pool.probe_token() or "").partition(":")[0], offset=0, nbytes=16))
    finally:
        other.close()


def test_a_call_without_a_valid_probe_may_reference_no_segment(pool: ShmPool, reader: ShmReader) -> None:
    slot = pool.allocate("r", 4096)
    assert slot is not None
    name, _, nonce = (pool.probe_token() or "").partition(":")
    wrong_nonce = [(SHM_PROBE_KEY, f"{name}:{'00' * 16}")]
    missing_probe = [(SHM_PROBE_KEY, "omnistage-1-2-3-x-probe:" + nonce)]
    for metadata in ([], wrong_nonce, missing_probe):
        ack, call = reader.accept_call(metadata)
        assert ack == [] and not call.enabled
        with pytest.raises(TensorBlobError):
            call.buffer(slot.ref())


def test_shm_false_refuses_every_reference(pool: ShmPool) -> None:
    off = ShmReader(enabled=False)
    slot = pool.allocate("r", 4096)
    assert slot is not None
    ack, call = off.accept_call([(SHM_PROBE_KEY, pool.probe_token() or "")])
    assert ack == [] and not call.enabled


def test_a_probe_of_any_other_form_or_a_shared_file_grants_nothing(pool: ShmPool, reader: ShmReader) -> None:
    """A probe named `omnistage-probe` would make the stem `omnistage`, which every segment
    starts with: only the exact form a pool gives its probe is taken. A file anyone else could
    have written (not 0600, this user's) is not mapped, and a name with a trailing newline is no
    segment name."""
    import os
    import secrets

    slot = pool.allocate("r", 4096)
    assert slot is not None
    nonce = secrets.token_bytes(16)
    short = pool.directory / "omnistage-probe"
    shared = pool.directory / f"omnistage-{os.getpid()}-0-0-{secrets.token_hex(4)}-probe"
    try:
        for path, mode in ((short, 0o600), (shared, 0o644)):
            path.write_bytes(nonce + bytes(4080))
            path.chmod(mode)
            ack, call = reader.accept_call([(SHM_PROBE_KEY, f"{path.name}:{nonce.hex()}")])
            assert ack == [] and not call.enabled, path.name
            with pytest.raises(TensorBlobError):
                call.buffer(slot.ref())
        with pytest.raises(TensorBlobError, match="not private to this user"):
            reader.buffer(ShmRef(segment=shared.name, offset=0, nbytes=16))
        with pytest.raises(TensorBlobError, match="invalid shared-memory segment name"):
            reader.buffer(ShmRef(segment=slot.segment + "\n", offset=0, nbytes=16))
        ack, call = reader.accept_call([(SHM_PROBE_KEY, pool.probe_token() or "")])
        assert ack and len(call.buffer(slot.ref())) == 4096  # the pool's own probe still grants its segments
    finally:
        for path in (short, shared):
            path.unlink(missing_ok=True)
