from services.api import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_TRAIN: _ClassVar[Priority]
    PRIORITY_EVAL: _ClassVar[Priority]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class UpdatePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_POLICY_UNSPECIFIED: _ClassVar[UpdatePolicy]
    UPDATE_POLICY_DRAIN: _ClassVar[UpdatePolicy]
    UPDATE_POLICY_PAUSE: _ClassVar[UpdatePolicy]
    UPDATE_POLICY_ABORT: _ClassVar[UpdatePolicy]
PRIORITY_UNSPECIFIED: Priority
PRIORITY_TRAIN: Priority
PRIORITY_EVAL: Priority
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
UPDATE_POLICY_UNSPECIFIED: UpdatePolicy
UPDATE_POLICY_DRAIN: UpdatePolicy
UPDATE_POLICY_PAUSE: UpdatePolicy
UPDATE_POLICY_ABORT: UpdatePolicy

class RolloutConfig(_message.Message):
    __slots__ = ("model_path", "engine", "device", "dtype", "seed", "max_batch_size", "load_weights", "kv_cache_fraction", "cuda_graphs", "sglang", "prefix_cache")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    CUDA_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    SGLANG_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    engine: str
    device: str
    dtype: str
    seed: int
    max_batch_size: int
    load_weights: bool
    kv_cache_fraction: float
    cuda_graphs: bool
    sglang: SglangConfig
    prefix_cache: bool
    def __init__(self, model_path: _Optional[str] = ..., engine: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., seed: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., load_weights: _Optional[bool] = ..., kv_cache_fraction: _Optional[float] = ..., cuda_graphs: _Optional[bool] = ..., sglang: _Optional[_Union[SglangConfig, _Mapping]] = ..., prefix_cache: _Optional[bool] = ...) -> None: ...

class SglangConfig(_message.Message):
    __slots__ = ("url", "args", "command", "startup_timeout_s", "memory_saver", "request_timeout_s")
    URL_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    STARTUP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SAVER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    url: str
    args: _containers.RepeatedScalarFieldContainer[str]
    command: _containers.RepeatedScalarFieldContainer[str]
    startup_timeout_s: float
    memory_saver: bool
    request_timeout_s: float
    def __init__(self, url: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., command: _Optional[_Iterable[str]] = ..., startup_timeout_s: _Optional[float] = ..., memory_saver: _Optional[bool] = ..., request_timeout_s: _Optional[float] = ...) -> None: ...

class ConfigureRolloutRequest(_message.Message):
    __slots__ = ("config", "request_id")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    config: RolloutConfig
    request_id: str
    def __init__(self, config: _Optional[_Union[RolloutConfig, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class ConfigureRolloutResponse(_message.Message):
    __slots__ = ("status", "capabilities")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    status: RolloutStatus
    capabilities: _weights_pb2.Capabilities
    def __init__(self, status: _Optional[_Union[RolloutStatus, _Mapping]] = ..., capabilities: _Optional[_Union[_weights_pb2.Capabilities, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "n", "seed", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    seed: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "input_ids", "sampling", "return_logprobs", "request_id", "priority")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedScalarFieldContainer[str]
    input_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    sampling: SamplingParams
    return_logprobs: bool
    request_id: str
    priority: Priority
    def __init__(self, prompts: _Optional[_Iterable[str]] = ..., input_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., return_logprobs: _Optional[bool] = ..., request_id: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class VersionRun(_message.Message):
    __slots__ = ("version", "tokens")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    version: int
    tokens: int
    def __init__(self, version: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("prompt_index", "prompt_ids", "output_ids", "text", "logprobs", "finish_reason", "weight_version", "version_runs")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_RUNS_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    weight_version: int
    version_runs: _containers.RepeatedCompositeFieldContainer[VersionRun]
    def __init__(self, prompt_index: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., output_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., weight_version: _Optional[int] = ..., version_runs: _Optional[_Iterable[_Union[VersionRun, _Mapping]]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("index", "completion")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    index: int
    completion: Completion
    def __init__(self, index: _Optional[int] = ..., completion: _Optional[_Union[Completion, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("results", "weight_version")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Completion]
    weight_version: int
    def __init__(self, results: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "manifest", "trainer", "broadcast", "shm", "cuda_ipc", "verify", "timeout_s", "request_id", "policy")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest: _weights_pb2.WeightManifest
    trainer: _weights_pb2.TrainerEndpoint
    broadcast: _weights_pb2.BroadcastSource
    shm: _weights_pb2.ShmSource
    cuda_ipc: _weights_pb2.CudaIpcSource
    verify: _weights_pb2.VerifyMode
    timeout_s: float
    request_id: str
    policy: UpdatePolicy
    def __init__(self, version: _Optional[int] = ..., manifest: _Optional[_Union[_weights_pb2.WeightManifest, _Mapping]] = ..., trainer: _Optional[_Union[_weights_pb2.TrainerEndpoint, _Mapping]] = ..., broadcast: _Optional[_Union[_weights_pb2.BroadcastSource, _Mapping]] = ..., shm: _Optional[_Union[_weights_pb2.ShmSource, _Mapping]] = ..., cuda_ipc: _Optional[_Union[_weights_pb2.CudaIpcSource, _Mapping]] = ..., verify: _Optional[_Union[_weights_pb2.VerifyMode, str]] = ..., timeout_s: _Optional[float] = ..., request_id: _Optional[str] = ..., policy: _Optional[_Union[UpdatePolicy, str]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "fingerprints", "seconds", "bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    fingerprints: _containers.RepeatedScalarFieldContainer[str]
    seconds: float
    bytes: int
    def __init__(self, version: _Optional[int] = ..., fingerprints: _Optional[_Iterable[str]] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ...) -> None: ...

class GetWeightFingerprintsRequest(_message.Message):
    __slots__ = ("fingerprint_algo", "bucket_bytes")
    FINGERPRINT_ALGO_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    fingerprint_algo: str
    bucket_bytes: int
    def __init__(self, fingerprint_algo: _Optional[str] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class GetWeightFingerprintsResponse(_message.Message):
    __slots__ = ("version", "fingerprints")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    fingerprints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., fingerprints: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseMemoryRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseMemoryResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: RolloutStatus
    def __init__(self, status: _Optional[_Union[RolloutStatus, _Mapping]] = ...) -> None: ...

class ResumeMemoryRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumeMemoryResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: RolloutStatus
    def __init__(self, status: _Optional[_Union[RolloutStatus, _Mapping]] = ...) -> None: ...

class GetRolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("configured", "weight_version", "serving", "released", "last_error", "num_parameters", "checkpoint_step", "load")
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    configured: bool
    weight_version: int
    serving: bool
    released: _containers.RepeatedScalarFieldContainer[str]
    last_error: str
    num_parameters: int
    checkpoint_step: int
    load: EngineLoad
    def __init__(self, configured: _Optional[bool] = ..., weight_version: _Optional[int] = ..., serving: _Optional[bool] = ..., released: _Optional[_Iterable[str]] = ..., last_error: _Optional[str] = ..., num_parameters: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., load: _Optional[_Union[EngineLoad, _Mapping]] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("rows_running", "rows_waiting", "requests_live", "rounds", "decode_steps", "row_steps", "prefills", "preempted", "prefix_lookup_tokens", "prefix_hit_tokens", "prefill_s", "decode_s", "host_s")
    ROWS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    ROWS_WAITING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_LIVE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROW_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    HOST_S_FIELD_NUMBER: _ClassVar[int]
    rows_running: int
    rows_waiting: int
    requests_live: int
    rounds: int
    decode_steps: int
    row_steps: int
    prefills: int
    preempted: int
    prefix_lookup_tokens: int
    prefix_hit_tokens: int
    prefill_s: float
    decode_s: float
    host_s: float
    def __init__(self, rows_running: _Optional[int] = ..., rows_waiting: _Optional[int] = ..., requests_live: _Optional[int] = ..., rounds: _Optional[int] = ..., decode_steps: _Optional[int] = ..., row_steps: _Optional[int] = ..., prefills: _Optional[int] = ..., preempted: _Optional[int] = ..., prefix_lookup_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., host_s: _Optional[float] = ...) -> None: ...
