from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LinkCall(_message.Message):
    __slots__ = ("id", "stream", "request", "timeout_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    id: int
    stream: bool
    request: bytes
    timeout_s: float
    def __init__(self, id: _Optional[int] = ..., stream: _Optional[bool] = ..., request: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class LinkCalls(_message.Message):
    __slots__ = ("calls", "cancelled")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[LinkCall]
    cancelled: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, calls: _Optional[_Iterable[_Union[LinkCall, _Mapping]]] = ..., cancelled: _Optional[_Iterable[int]] = ...) -> None: ...

class LinkReply(_message.Message):
    __slots__ = ("id", "response", "last", "code", "message")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: int
    response: bytes
    last: bool
    code: int
    message: str
    def __init__(self, id: _Optional[int] = ..., response: _Optional[bytes] = ..., last: _Optional[bool] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class LinkReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[LinkReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[LinkReply, _Mapping]]] = ...) -> None: ...
