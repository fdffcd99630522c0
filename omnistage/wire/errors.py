"""Errors that travel with a request: a status code and a message that names the stage and the
problem. Codes mirror gRPC's status names so the server layer maps them one to one, but nothing
below the server imports grpc."""

from __future__ import annotations

import enum

__all__ = ["DEADLINE_PASSED", "Code", "StageError", "TensorBlobError", "invalid"]

# in the message of a request that ran out its own deadline (DEADLINE_EXCEEDED also ends a hop that
# waited too long on its peer, which a retry may pass)
DEADLINE_PASSED = "passed its deadline"


class Code(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAVAILABLE = "UNAVAILABLE"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"


class StageError(Exception):
    """Fails one request with a status; the message names the stage and the problem."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> StageError:
    return StageError(Code.INVALID_ARGUMENT, message)


class TensorBlobError(ValueError):
    """A TensorBlob / Chunk that cannot be decoded (answered with INVALID_ARGUMENT)."""
