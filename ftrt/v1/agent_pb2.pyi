from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStatus(_message.Message):
    __slots__ = ("local_rank", "rank", "pid", "state", "step", "last_heartbeat_age_s", "exit_code", "since_round")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SINCE_ROUND_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    rank: int
    pid: int
    state: str
    step: int
    last_heartbeat_age_s: float
    exit_code: int
    since_round: int
    def __init__(self, local_rank: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., exit_code: _Optional[int] = ..., since_round: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("job_id", "node_id", "round", "state", "pid", "uptime_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    round: int
    state: str
    pid: int
    uptime_s: float
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., round: _Optional[int] = ..., state: _Optional[str] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("health", "group_rank", "world_size", "restarts", "max_restarts", "workers", "warm_workers", "replicas_refused")
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WARM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    health: HealthResponse
    group_rank: int
    world_size: int
    restarts: int
    max_restarts: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    warm_workers: int
    replicas_refused: int
    def __init__(self, health: _Optional[_Union[HealthResponse, _Mapping]] = ..., group_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., restarts: _Optional[int] = ..., max_restarts: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., warm_workers: _Optional[int] = ..., replicas_refused: _Optional[int] = ...) -> None: ...

class LivenessRequest(_message.Message):
    __slots__ = ("from_node_id", "interval_s")
    FROM_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    from_node_id: str
    interval_s: float
    def __init__(self, from_node_id: _Optional[str] = ..., interval_s: _Optional[float] = ...) -> None: ...

class LivenessBeat(_message.Message):
    __slots__ = ("node_id", "round", "time")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    round: int
    time: float
    def __init__(self, node_id: _Optional[str] = ..., round: _Optional[int] = ..., time: _Optional[float] = ...) -> None: ...

class ReplicaChunk(_message.Message):
    __slots__ = ("source_node", "rank", "step", "index_json", "data", "sha256")
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INDEX_JSON_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    source_node: str
    rank: int
    step: int
    index_json: str
    data: bytes
    sha256: str
    def __init__(self, source_node: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., index_json: _Optional[str] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("bytes",)
    BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    def __init__(self, bytes: _Optional[int] = ...) -> None: ...
