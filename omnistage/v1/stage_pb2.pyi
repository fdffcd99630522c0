# ruff: noqa
from omnistage.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EdgeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ASYNC_CHUNK: _ClassVar[EdgeMode]
    FULL_PAYLOAD: _ClassVar[EdgeMode]
ASYNC_CHUNK: EdgeMode
FULL_PAYLOAD: EdgeMode

class SamplingParams(_message.Message):
    __slots__ = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "max_tokens", "stop_ids", "forced_ids", "stop_texts", "logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "speech_end_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    FORCED_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_TEXTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SPEECH_END_IDS_FIELD_NUMBER: _ClassVar[int]
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    max_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    forced_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_texts: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    speech_end_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., forced_ids: _Optional[_Iterable[int]] = ..., stop_texts: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., speech_end_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Start(_message.Message):
    __slots__ = ("request_id", "sampling", "want_audio", "mode", "speaker", "deadline_unix_s", "omit_codes")
    class SamplingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SamplingParams
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WANT_AUDIO_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    OMIT_CODES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampling: _containers.MessageMap[str, SamplingParams]
    want_audio: bool
    mode: EdgeMode
    speaker: str
    deadline_unix_s: float
    omit_codes: bool
    def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Mapping[str, SamplingParams]] = ..., want_audio: _Optional[bool] = ..., mode: _Optional[_Union[EdgeMode, str]] = ..., speaker: _Optional[str] = ..., deadline_unix_s: _Optional[float] = ..., omit_codes: _Optional[bool] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("start", "chunk", "cancel")
    START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: Start
    chunk: _tensor_pb2.Chunk
    cancel: Cancel
    def __init__(self, start: _Optional[_Union[Start, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ...) -> None: ...

class StageResponse(_message.Message):
    __slots__ = ("stage", "chunk", "failure")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    chunk: _tensor_pb2.Chunk
    failure: Failure
    def __init__(self, stage: _Optional[str] = ..., chunk: _Optional[_Union[_tensor_pb2.Chunk, _Mapping]] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_tokens", "max_message_bytes")
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_cache_tokens: int
    max_message_bytes: int
    def __init__(self, max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_cache_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("running", "waiting", "waiting_for_input", "cache_usage", "open_streams", "shm_segments", "requests_total", "steps_total", "step_requests_total", "step_seconds_total", "kv_pool_tokens")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_INPUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    waiting_for_input: int
    cache_usage: float
    open_streams: int
    shm_segments: int
    requests_total: int
    steps_total: int
    step_requests_total: int
    step_seconds_total: float
    kv_pool_tokens: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., waiting_for_input: _Optional[int] = ..., cache_usage: _Optional[float] = ..., open_streams: _Optional[int] = ..., shm_segments: _Optional[int] = ..., requests_total: _Optional[int] = ..., steps_total: _Optional[int] = ..., step_requests_total: _Optional[int] = ..., step_seconds_total: _Optional[float] = ..., kv_pool_tokens: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "arch", "role", "capacity", "load", "device", "dtype", "serving", "chain")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    model: str
    arch: str
    role: str
    capacity: Capacity
    load: Load
    device: str
    dtype: str
    serving: bool
    chain: _containers.RepeatedCompositeFieldContainer[StageHealth]
    def __init__(self, model: _Optional[str] = ..., arch: _Optional[str] = ..., role: _Optional[str] = ..., capacity: _Optional[_Union[Capacity, _Mapping]] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., serving: _Optional[bool] = ..., chain: _Optional[_Iterable[_Union[StageHealth, _Mapping]]] = ...) -> None: ...

class StageHealth(_message.Message):
    __slots__ = ("stage", "target", "serving", "detail")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    stage: str
    target: str
    serving: bool
    detail: str
    def __init__(self, stage: _Optional[str] = ..., target: _Optional[str] = ..., serving: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...
