"""The wire layer: tensors in protobuf messages (tensor_blob), same-host shared memory (shm),
zero-copy parsing and one-copy serialization of stage messages (wire_view), and the errors a
request can fail with. No gRPC here."""

from omnistage.wire.errors import DEADLINE_PASSED, Code, StageError, TensorBlobError, invalid
from omnistage.wire.tensor_blob import ChunkAssembler, DecodedChunk, LazyChunk, encode_chunk, encode_chunks

__all__ = [
    "DEADLINE_PASSED",
    "ChunkAssembler",
    "Code",
    "DecodedChunk",
    "LazyChunk",
    "StageError",
    "TensorBlobError",
    "encode_chunk",
    "encode_chunks",
    "invalid",
]
