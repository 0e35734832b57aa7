import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QuorumMember(_message.Message):
    __slots__ = ("replica_id", "address", "store_address", "step", "world_size", "shrink_only", "data", "commit_failures", "reconfigure_handles")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHRINK_ONLY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    store_address: str
    step: int
    world_size: int
    shrink_only: bool
    data: str
    commit_failures: int
    reconfigure_handles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., store_address: _Optional[str] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., shrink_only: _Optional[bool] = ..., data: _Optional[str] = ..., commit_failures: _Optional[int] = ..., reconfigure_handles: _Optional[_Iterable[str]] = ...) -> None: ...

class Quorum(_message.Message):
    __slots__ = ("quorum_id", "participants", "created")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    participants: _containers.RepeatedCompositeFieldContainer[QuorumMember]
    created: _timestamp_pb2.Timestamp
    def __init__(self, quorum_id: _Optional[int] = ..., participants: _Optional[_Iterable[_Union[QuorumMember, _Mapping]]] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class LighthouseQuorumRequest(_message.Message):
    __slots__ = ("requester",)
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    requester: QuorumMember
    def __init__(self, requester: _Optional[_Union[QuorumMember, _Mapping]] = ...) -> None: ...

class LighthouseQuorumResponse(_message.Message):
    __slots__ = ("quorum",)
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    quorum: Quorum
    def __init__(self, quorum: _Optional[_Union[Quorum, _Mapping]] = ...) -> None: ...

class LighthouseHeartbeatRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class LighthouseHeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ManagerQuorumRequest(_message.Message):
    __slots__ = ("group_rank", "step", "checkpoint_metadata", "shrink_only", "init_sync", "commit_failures", "reconfigure_handle", "fingerprint")
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_METADATA_FIELD_NUMBER: _ClassVar[int]
    SHRINK_ONLY_FIELD_NUMBER: _ClassVar[int]
    INIT_SYNC_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    group_rank: int
    step: int
    checkpoint_metadata: str
    shrink_only: bool
    init_sync: bool
    commit_failures: int
    reconfigure_handle: str
    fingerprint: str
    def __init__(self, group_rank: _Optional[int] = ..., step: _Optional[int] = ..., checkpoint_metadata: _Optional[str] = ..., shrink_only: _Optional[bool] = ..., init_sync: _Optional[bool] = ..., commit_failures: _Optional[int] = ..., reconfigure_handle: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class ManagerQuorumResponse(_message.Message):
    __slots__ = ("quorum_id", "recover_src_manager_address", "recover_src_replica_rank", "recover_dst_replica_ranks", "store_address", "max_step", "max_replica_rank", "max_world_size", "replica_rank", "replica_world_size", "heal", "commit_failures", "replica_ids", "reconfigure_handles", "divergence", "quorum_created_ns", "group_heals")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    RECOVER_SRC_MANAGER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RECOVER_SRC_REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    RECOVER_DST_REPLICA_RANKS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAL_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
    QUORUM_CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    GROUP_HEALS_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    recover_src_manager_address: str
    recover_src_replica_rank: int
    recover_dst_replica_ranks: _containers.RepeatedScalarFieldContainer[int]
    store_address: str
    max_step: int
    max_replica_rank: int
    max_world_size: int
    replica_rank: int
    replica_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    reconfigure_handles: _containers.RepeatedScalarFieldContainer[str]
    divergence: str
    quorum_created_ns: int
    group_heals: bool
    def __init__(self, quorum_id: _Optional[int] = ..., recover_src_manager_address: _Optional[str] = ..., recover_src_replica_rank: _Optional[int] = ..., recover_dst_replica_ranks: _Optional[_Iterable[int]] = ..., store_address: _Optional[str] = ..., max_step: _Optional[int] = ..., max_replica_rank: _Optional[int] = ..., max_world_size: _Optional[int] = ..., replica_rank: _Optional[int] = ..., replica_world_size: _Optional[int] = ..., heal: _Optional[bool] = ..., commit_failures: _Optional[int] = ..., replica_ids: _Optional[_Iterable[str]] = ..., reconfigure_handles: _Optional[_Iterable[str]] = ..., divergence: _Optional[str] = ..., quorum_created_ns: _Optional[int] = ..., group_heals: _Optional[bool] = ...) -> None: ...

class CheckpointMetadataRequest(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class CheckpointMetadataResponse(_message.Message):
    __slots__ = ("checkpoint_metadata",)
    CHECKPOINT_METADATA_FIELD_NUMBER: _ClassVar[int]
    checkpoint_metadata: str
    def __init__(self, checkpoint_metadata: _Optional[str] = ...) -> None: ...

class ShouldCommitRequest(_message.Message):
    __slots__ = ("should_commit", "group_rank", "step")
    SHOULD_COMMIT_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    should_commit: bool
    group_rank: int
    step: int
    def __init__(self, should_commit: _Optional[bool] = ..., group_rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class ShouldCommitResponse(_message.Message):
    __slots__ = ("should_commit",)
    SHOULD_COMMIT_FIELD_NUMBER: _ClassVar[int]
    should_commit: bool
    def __init__(self, should_commit: _Optional[bool] = ...) -> None: ...

class KillRequest(_message.Message):
    __slots__ = ("msg",)
    MSG_FIELD_NUMBER: _ClassVar[int]
    msg: str
    def __init__(self, msg: _Optional[str] = ...) -> None: ...

class KillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
