from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("step", "prompt_id", "version", "weights_digest")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    step: int
    prompt_id: int
    version: int
    weights_digest: str
    def __init__(self, step: _Optional[int] = ..., prompt_id: _Optional[int] = ..., version: _Optional[int] = ..., weights_digest: _Optional[str] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("step", "prompt_id", "version", "group", "width", "tokens", "server_id", "generate_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    prompt_id: int
    version: int
    group: int
    width: int
    tokens: bytes
    server_id: str
    generate_s: float
    def __init__(self, step: _Optional[int] = ..., prompt_id: _Optional[int] = ..., version: _Optional[int] = ..., group: _Optional[int] = ..., width: _Optional[int] = ..., tokens: _Optional[bytes] = ..., server_id: _Optional[str] = ..., generate_s: _Optional[float] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "digest", "tensors", "name", "dtype", "shape", "data", "last_piece", "sha256", "commit", "keep_from")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_PIECE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    KEEP_FROM_FIELD_NUMBER: _ClassVar[int]
    version: int
    digest: str
    tensors: int
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    last_piece: bool
    sha256: bytes
    commit: bool
    keep_from: int
    def __init__(self, version: _Optional[int] = ..., digest: _Optional[str] = ..., tensors: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., last_piece: _Optional[bool] = ..., sha256: _Optional[bytes] = ..., commit: _Optional[bool] = ..., keep_from: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("version", "digest", "bytes", "apply_s", "held")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    APPLY_S_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    version: int
    digest: str
    bytes: int
    apply_s: float
    held: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., digest: _Optional[str] = ..., bytes: _Optional[int] = ..., apply_s: _Optional[float] = ..., held: _Optional[_Iterable[int]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("server_id", "job_id", "engine", "version", "digest", "held", "generating_s", "served", "fenced")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    GENERATING_S_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    job_id: str
    engine: str
    version: int
    digest: str
    held: _containers.RepeatedScalarFieldContainer[int]
    generating_s: float
    served: int
    fenced: bool
    def __init__(self, server_id: _Optional[str] = ..., job_id: _Optional[str] = ..., engine: _Optional[str] = ..., version: _Optional[int] = ..., digest: _Optional[str] = ..., held: _Optional[_Iterable[int]] = ..., generating_s: _Optional[float] = ..., served: _Optional[int] = ..., fenced: _Optional[bool] = ...) -> None: ...
