import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    SUBSCRIBED: _ClassVar[EventKind]
    QUORUM_FORMED: _ClassVar[EventKind]
    MEMBER_FAILED: _ClassVar[EventKind]
    MEMBER_LEFT: _ClassVar[EventKind]
EVENT_KIND_UNSPECIFIED: EventKind
SUBSCRIBED: EventKind
QUORUM_FORMED: EventKind
MEMBER_FAILED: EventKind
MEMBER_LEFT: EventKind

class SubscribeRequest(_message.Message):
    __slots__ = ("replica_id", "listener")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LISTENER_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    listener: str
    def __init__(self, replica_id: _Optional[str] = ..., listener: _Optional[str] = ...) -> None: ...

class LighthouseEvent(_message.Message):
    __slots__ = ("kind", "quorum_id", "replica_id", "reason", "time", "replica_ids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    quorum_id: int
    replica_id: str
    reason: str
    time: _timestamp_pb2.Timestamp
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., quorum_id: _Optional[int] = ..., replica_id: _Optional[str] = ..., reason: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("status_json",)
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    status_json: str
    def __init__(self, status_json: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealReport(_message.Message):
    __slots__ = ("replica_id", "phase", "step", "quorum_id", "quorum_s", "reconfigure_s", "transfer_s", "load_s", "transfer_bytes", "error", "bytes_done")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    QUORUM_S_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    phase: str
    step: int
    quorum_id: int
    quorum_s: float
    reconfigure_s: float
    transfer_s: float
    load_s: float
    transfer_bytes: int
    error: str
    bytes_done: int
    def __init__(self, replica_id: _Optional[str] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ..., quorum_id: _Optional[int] = ..., quorum_s: _Optional[float] = ..., reconfigure_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., load_s: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., error: _Optional[str] = ..., bytes_done: _Optional[int] = ...) -> None: ...

class HealReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
