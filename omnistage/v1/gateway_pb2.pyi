# ruff: noqa
from omnistage.v1 import stage_pb2 as _stage_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PCM_F32LE: _ClassVar[AudioFormat]
    PCM16: _ClassVar[AudioFormat]
    WAV: _ClassVar[AudioFormat]
    MP3: _ClassVar[AudioFormat]
    FLAC: _ClassVar[AudioFormat]
    OPUS: _ClassVar[AudioFormat]
    AAC: _ClassVar[AudioFormat]
PCM_F32LE: AudioFormat
PCM16: AudioFormat
WAV: AudioFormat
MP3: AudioFormat
FLAC: AudioFormat
OPUS: AudioFormat
AAC: AudioFormat

class ContentPart(_message.Message):
    __slots__ = ("text", "audio", "image", "video")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    text: str
    audio: AudioPart
    image: ImagePart
    video: VideoPart
    def __init__(self, text: _Optional[str] = ..., audio: _Optional[_Union[AudioPart, _Mapping]] = ..., image: _Optional[_Union[ImagePart, _Mapping]] = ..., video: _Optional[_Union[VideoPart, _Mapping]] = ...) -> None: ...

class AudioPart(_message.Message):
    __slots__ = ("file", "pcm")
    FILE_FIELD_NUMBER: _ClassVar[int]
    PCM_FIELD_NUMBER: _ClassVar[int]
    file: bytes
    pcm: RawAudio
    def __init__(self, file: _Optional[bytes] = ..., pcm: _Optional[_Union[RawAudio, _Mapping]] = ...) -> None: ...

class RawAudio(_message.Message):
    __slots__ = ("f32le", "sample_rate")
    F32LE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    f32le: bytes
    sample_rate: int
    def __init__(self, f32le: _Optional[bytes] = ..., sample_rate: _Optional[int] = ...) -> None: ...

class ImagePart(_message.Message):
    __slots__ = ("file",)
    FILE_FIELD_NUMBER: _ClassVar[int]
    file: bytes
    def __init__(self, file: _Optional[bytes] = ...) -> None: ...

class VideoPart(_message.Message):
    __slots__ = ("file", "frames")
    FILE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    file: bytes
    frames: VideoFrames
    def __init__(self, file: _Optional[bytes] = ..., frames: _Optional[_Union[VideoFrames, _Mapping]] = ...) -> None: ...

class VideoFrames(_message.Message):
    __slots__ = ("images", "fps")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    fps: float
    def __init__(self, images: _Optional[_Iterable[bytes]] = ..., fps: _Optional[float] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "parts", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "messages", "want_audio", "speaker", "sampling", "mode", "request_id", "use_audio_in_video", "audio_format", "stop", "chat_template_kwargs", "speed", "tools", "raw_prompt", "prompt_ids")
    class SamplingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _stage_pb2.SamplingParams
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_stage_pb2.SamplingParams, _Mapping]] = ...) -> None: ...
    class ChatTemplateKwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    WANT_AUDIO_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    USE_AUDIO_IN_VIDEO_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FORMAT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    RAW_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    want_audio: bool
    speaker: str
    sampling: _containers.MessageMap[str, _stage_pb2.SamplingParams]
    mode: _stage_pb2.EdgeMode
    request_id: str
    use_audio_in_video: bool
    audio_format: AudioFormat
    stop: _containers.RepeatedScalarFieldContainer[str]
    chat_template_kwargs: _containers.ScalarMap[str, str]
    speed: float
    tools: _containers.RepeatedScalarFieldContainer[str]
    raw_prompt: bool
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., want_audio: _Optional[bool] = ..., speaker: _Optional[str] = ..., sampling: _Optional[_Mapping[str, _stage_pb2.SamplingParams]] = ..., mode: _Optional[_Union[_stage_pb2.EdgeMode, str]] = ..., request_id: _Optional[str] = ..., use_audio_in_video: _Optional[bool] = ..., audio_format: _Optional[_Union[AudioFormat, str]] = ..., stop: _Optional[_Iterable[str]] = ..., chat_template_kwargs: _Optional[_Mapping[str, str]] = ..., speed: _Optional[float] = ..., tools: _Optional[_Iterable[str]] = ..., raw_prompt: _Optional[bool] = ..., prompt_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("pcm_f32le", "sample_rate", "first_sample", "data", "format", "samples")
    PCM_F32LE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    FIRST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    pcm_f32le: bytes
    sample_rate: int
    first_sample: int
    data: bytes
    format: AudioFormat
    samples: int
    def __init__(self, pcm_f32le: _Optional[bytes] = ..., sample_rate: _Optional[int] = ..., first_sample: _Optional[int] = ..., data: _Optional[bytes] = ..., format: _Optional[_Union[AudioFormat, str]] = ..., samples: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "audio_frames", "audio_seconds")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    audio_frames: int
    audio_seconds: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., audio_frames: _Optional[int] = ..., audio_seconds: _Optional[float] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("first_output_s", "total_s")
    FIRST_OUTPUT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    first_output_s: float
    total_s: float
    def __init__(self, first_output_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("usage", "timings", "finish_reason")
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: StageTiming
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[StageTiming, _Mapping]] = ...) -> None: ...
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    timings: _containers.MessageMap[str, StageTiming]
    finish_reason: str
    def __init__(self, usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Mapping[str, StageTiming]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "audio", "final")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    text: TextDelta
    audio: AudioChunk
    final: Final
    def __init__(self, text: _Optional[_Union[TextDelta, _Mapping]] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...
