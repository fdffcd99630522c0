"""Byte-level mutations of serialized messages, shared by the wire fuzz tests."""

from __future__ import annotations

from hypothesis import strategies as st

BYTE_OPS = ["flip", "set", "cut", "insert", "delete"]


def mutate_bytes(draw: st.DrawFn, b: bytearray, op: str) -> bytearray:
    """Apply one of BYTE_OPS at a drawn position (an empty buffer is left as it is for flip/set)."""
    pos = draw(st.integers(0, max(0, len(b) - 1)))
    if op == "flip" and b:
        b[pos] ^= 1 << draw(st.integers(0, 7))
    elif op == "set" and b:
        b[pos] = draw(st.integers(0, 255))
    elif op == "cut":
        b = b[:pos]
    elif op == "insert":
        b[pos:pos] = draw(st.binary(min_size=1, max_size=12))
    elif op == "delete":
        del b[pos : pos + draw(st.integers(1, 8))]
    return b
