from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Progress(_message.Message):
    __slots__ = ("done", "phase", "total")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    phase: str
    done: int
    total: int
    def __init__(self, phase: str | None = ..., done: int | None = ..., total: int | None = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("checkpoint_step", "index_step", "instance", "message", "metrics", "progress", "role", "run_id", "state", "step")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: str | None = ..., value: float | None = ...) -> None: ...
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
    def __init__(self, role: str | None = ..., run_id: str | None = ..., instance: str | None = ..., step: int | None = ..., checkpoint_step: int | None = ..., index_step: int | None = ..., progress: Progress | _Mapping | None = ..., metrics: _Mapping[str, float] | None = ..., state: str | None = ..., message: str | None = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Iterable[float] | None = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("embeddings", "k", "queries")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedScalarFieldContainer[str]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    k: int
    def __init__(self, queries: _Iterable[str] | None = ..., embeddings: _Iterable[Embedding | _Mapping] | None = ..., k: int | None = ...) -> None: ...

class Hit(_message.Message):
    __slots__ = ("doc_id", "score")
    DOC_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    doc_id: str
    score: float
    def __init__(self, doc_id: str | None = ..., score: float | None = ...) -> None: ...

class Hits(_message.Message):
    __slots__ = ("hits",)
    HITS_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[Hit]
    def __init__(self, hits: _Iterable[Hit | _Mapping] | None = ...) -> None: ...

class SearchReply(_message.Message):
    __slots__ = ("index_step", "results")
    INDEX_STEP_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    index_step: int
    results: _containers.RepeatedCompositeFieldContainer[Hits]
    def __init__(self, index_step: int | None = ..., results: _Iterable[Hits | _Mapping] | None = ...) -> None: ...
