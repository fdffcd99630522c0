"""Plain Chunk messages from the one encoder, for tests that inspect or mutate messages."""

from __future__ import annotations

from typing import Any

from omnistage.v1.tensor_pb2 import Chunk
from omnistage.wire import tensor_blob as tb


def encode_messages(tensors: Any, **options: Any) -> list[Chunk]:
    return [c.message() for c in tb.encode_chunks(tensors, **options)]
