from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class ScaleEnginesRequest(_message.Message):
    __slots__ = ("rollouts",)
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rollouts: _Optional[_Iterable[str]] = ...) -> None: ...

class ScaleEnginesResponse(_message.Message):
    __slots__ = ("rollouts",)
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rollouts: _Optional[_Iterable[str]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "name", "state", "config_yaml", "step", "num_steps", "error", "created_at", "updated_at", "summary_json", "output_dir", "request_id", "base_dir", "cancel_requested")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_JSON_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_DIR_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    state: JobState
    config_yaml: str
    step: int
    num_steps: int
    error: str
    created_at: float
    updated_at: float
    summary_json: str
    output_dir: str
    request_id: str
    base_dir: str
    cancel_requested: bool
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., config_yaml: _Optional[str] = ..., step: _Optional[int] = ..., num_steps: _Optional[int] = ..., error: _Optional[str] = ..., created_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., summary_json: _Optional[str] = ..., output_dir: _Optional[str] = ..., request_id: _Optional[str] = ..., base_dir: _Optional[str] = ..., cancel_requested: _Optional[bool] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("config_yaml", "base_dir", "request_id")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    BASE_DIR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    base_dir: str
    request_id: str
    def __init__(self, config_yaml: _Optional[str] = ..., base_dir: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "state")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    state: JobState
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "request_id")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    request_id: str
    def __init__(self, job_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "after_seq", "replay_only")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ONLY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    replay_only: bool
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., replay_only: _Optional[bool] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "job_id", "kind", "time", "state", "step", "data_json")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DATA_JSON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    job_id: str
    kind: str
    time: float
    state: JobState
    step: int
    data_json: str
    def __init__(self, seq: _Optional[int] = ..., job_id: _Optional[str] = ..., kind: _Optional[str] = ..., time: _Optional[float] = ..., state: _Optional[_Union[JobState, str]] = ..., step: _Optional[int] = ..., data_json: _Optional[str] = ...) -> None: ...

class GetJobMetricsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "time", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    time: float
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., time: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class EvalResult(_message.Message):
    __slots__ = ("step", "time", "dataset", "score", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    time: float
    dataset: str
    score: float
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., time: _Optional[float] = ..., dataset: _Optional[str] = ..., score: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("step", "time", "path")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    step: int
    time: float
    path: str
    def __init__(self, step: _Optional[int] = ..., time: _Optional[float] = ..., path: _Optional[str] = ...) -> None: ...

class JobMetrics(_message.Message):
    __slots__ = ("job_id", "steps", "evals", "checkpoints")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EVALS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    steps: _containers.RepeatedCompositeFieldContainer[StepMetrics]
    evals: _containers.RepeatedCompositeFieldContainer[EvalResult]
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    def __init__(self, job_id: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[StepMetrics, _Mapping]]] = ..., evals: _Optional[_Iterable[_Union[EvalResult, _Mapping]]] = ..., checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ...) -> None: ...
