from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Progress(_message.Message):
    __slots__ = ("phase", "done", "total")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    phase: str
    done: int
    total: int
    def __init__(self, phase: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("role", "run_id", "instance", "step", "checkpoint_step", "index_step", "progress", "metrics", "state", "message", "store_bytes")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    INDEX_STEP_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: str
    run_id: str
    instance: str
    step: int
    checkpoint_step: int
    index_step: int
    progress: Progress
    metrics: _containers.ScalarMap[str, float]
    state: str
    message: str
    store_bytes: int
    def __init__(self, role: _Optional[str] = ..., run_id: _Optional[str] = ..., instance: _Optional[str] = ..., step: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., index_step: _Optional[int] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., state: _Optional[str] = ..., message: _Optional[str] = ..., store_bytes: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("queries", "embeddings", "k")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedScalarFieldContainer[str]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    k: int
    def __init__(self, queries: _Optional[_Iterable[str]] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., k: _Optional[int] = ...) -> None: ...

class Hit(_message.Message):
    __slots__ = ("doc_id", "score")
    DOC_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    doc_id: str
    score: float
    def __init__(self, doc_id: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class Hits(_message.Message):
    __slots__ = ("hits",)
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[Hit]
    def __init__(self, hits: _Optional[_Iterable[_Union[Hit, _Mapping]]] = ...) -> None: ...

class SearchReply(_message.Message):
    __slots__ = ("index_step", "results")
    INDEX_STEP_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    index_step: int
    results: _containers.RepeatedCompositeFieldContainer[Hits]
    def __init__(self, index_step: _Optional[int] = ..., results: _Optional[_Iterable[_Union[Hits, _Mapping]]] = ...) -> None: ...
