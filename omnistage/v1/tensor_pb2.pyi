# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    BF16: _ClassVar[DType]
    F16: _ClassVar[DType]
    F32: _ClassVar[DType]
    F64: _ClassVar[DType]
    I64: _ClassVar[DType]
    I32: _ClassVar[DType]
    I16: _ClassVar[DType]
    I8: _ClassVar[DType]
    U8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
BF16: DType
F16: DType
F32: DType
F64: DType
I64: DType
I32: DType
I16: DType
I8: DType
U8: DType
BOOL: DType

class ShmRef(_message.Message):
    __slots__ = ("segment", "offset", "nbytes")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offset: int
    nbytes: int
    def __init__(self, segment: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TensorBlob(_message.Message):
    __slots__ = ("dtype", "shape", "raw", "shm", "element_offset")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw: bytes
    shm: ShmRef
    element_offset: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., raw: _Optional[bytes] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ..., element_offset: _Optional[int] = ...) -> None: ...

class Scalar(_message.Message):
    __slots__ = ("int_value", "double_value", "string_value", "bool_value")
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    int_value: int
    double_value: float
    string_value: str
    bool_value: bool
    def __init__(self, int_value: _Optional[int] = ..., double_value: _Optional[float] = ..., string_value: _Optional[str] = ..., bool_value: _Optional[bool] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("tensors", "meta", "offset", "seq", "finished", "part", "parts")
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorBlob
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorBlob, _Mapping]] = ...) -> None: ...
    class MetaEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Scalar
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Scalar, _Mapping]] = ...) -> None: ...
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.MessageMap[str, TensorBlob]
    meta: _containers.MessageMap[str, Scalar]
    offset: int
    seq: int
    finished: bool
    part: int
    parts: int
    def __init__(self, tensors: _Optional[_Mapping[str, TensorBlob]] = ..., meta: _Optional[_Mapping[str, Scalar]] = ..., offset: _Optional[int] = ..., seq: _Optional[int] = ..., finished: _Optional[bool] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ...) -> None: ...
