from services.api import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LossKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_KIND_UNSPECIFIED: _ClassVar[LossKind]
    LOSS_KIND_POLICY: _ClassVar[LossKind]
    LOSS_KIND_SFT: _ClassVar[LossKind]
    LOSS_KIND_VALUE: _ClassVar[LossKind]
LOSS_KIND_UNSPECIFIED: LossKind
LOSS_KIND_POLICY: LossKind
LOSS_KIND_SFT: LossKind
LOSS_KIND_VALUE: LossKind

class OptimizerConfig(_message.Message):
    __slots__ = ("lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip")
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    grad_clip: float
    def __init__(self, lr: _Optional[float] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., grad_clip: _Optional[float] = ...) -> None: ...

class SchedulerConfig(_message.Message):
    __slots__ = ("kind", "warmup_steps", "decay_steps", "min_lr_ratio")
    KIND_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECAY_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    kind: str
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float
    def __init__(self, kind: _Optional[str] = ..., warmup_steps: _Optional[int] = ..., decay_steps: _Optional[int] = ..., min_lr_ratio: _Optional[float] = ...) -> None: ...

class LossConfig(_message.Message):
    __slots__ = ("clip_eps_low", "clip_eps_high", "kl_coef", "kl_estimator", "entropy_coef", "loss_agg", "value_clip", "correction", "is_cap")
    CLIP_EPS_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPS_HIGH_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    KL_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    LOSS_AGG_FIELD_NUMBER: _ClassVar[int]
    VALUE_CLIP_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_FIELD_NUMBER: _ClassVar[int]
    IS_CAP_FIELD_NUMBER: _ClassVar[int]
    clip_eps_low: float
    clip_eps_high: float
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    loss_agg: str
    value_clip: float
    correction: str
    is_cap: float
    def __init__(self, clip_eps_low: _Optional[float] = ..., clip_eps_high: _Optional[float] = ..., kl_coef: _Optional[float] = ..., kl_estimator: _Optional[str] = ..., entropy_coef: _Optional[float] = ..., loss_agg: _Optional[str] = ..., value_clip: _Optional[float] = ..., correction: _Optional[str] = ..., is_cap: _Optional[float] = ...) -> None: ...

class TrainerConfig(_message.Message):
    __slots__ = ("model_path", "backend", "device", "dtype", "seed", "optimizer", "scheduler", "loss", "tags", "eval_only", "offload", "colocate", "micro_batch_size", "bucket_bytes", "master_weights", "ranks", "tensor_parallel", "pipeline_parallel", "role", "compile")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    EVAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_FIELD_NUMBER: _ClassVar[int]
    COLOCATE_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MASTER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    COMPILE_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    backend: str
    device: str
    dtype: str
    seed: int
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    loss: LossConfig
    tags: _containers.RepeatedScalarFieldContainer[str]
    eval_only: bool
    offload: bool
    colocate: bool
    micro_batch_size: int
    bucket_bytes: int
    master_weights: str
    ranks: RankGroup
    tensor_parallel: int
    pipeline_parallel: int
    role: str
    compile: bool
    def __init__(self, model_path: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., seed: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerConfig, _Mapping]] = ..., scheduler: _Optional[_Union[SchedulerConfig, _Mapping]] = ..., loss: _Optional[_Union[LossConfig, _Mapping]] = ..., tags: _Optional[_Iterable[str]] = ..., eval_only: _Optional[bool] = ..., offload: _Optional[bool] = ..., colocate: _Optional[bool] = ..., micro_batch_size: _Optional[int] = ..., bucket_bytes: _Optional[int] = ..., master_weights: _Optional[str] = ..., ranks: _Optional[_Union[RankGroup, _Mapping]] = ..., tensor_parallel: _Optional[int] = ..., pipeline_parallel: _Optional[int] = ..., role: _Optional[str] = ..., compile: _Optional[bool] = ...) -> None: ...

class RankGroup(_message.Message):
    __slots__ = ("rank", "world_size", "address", "timeout_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    address: str
    timeout_s: float
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., address: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class OpenRankGroupRequest(_message.Message):
    __slots__ = ("world_size", "timeout_s")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    timeout_s: float
    def __init__(self, world_size: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class OpenRankGroupResponse(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class ConfigureTrainerRequest(_message.Message):
    __slots__ = ("config", "request_id")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    config: TrainerConfig
    request_id: str
    def __init__(self, config: _Optional[_Union[TrainerConfig, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class ConfigureTrainerResponse(_message.Message):
    __slots__ = ("status", "capabilities")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    status: TrainerStatus
    capabilities: _weights_pb2.Capabilities
    def __init__(self, status: _Optional[_Union[TrainerStatus, _Mapping]] = ..., capabilities: _Optional[_Union[_weights_pb2.Capabilities, _Mapping]] = ...) -> None: ...

class LifecycleStatus(_message.Message):
    __slots__ = ("asleep", "active_tag", "weights_version", "gpu_bytes_in_use", "host_backup_bytes")
    ASLEEP_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_TAG_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPU_BYTES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    HOST_BACKUP_BYTES_FIELD_NUMBER: _ClassVar[int]
    asleep: bool
    active_tag: str
    weights_version: int
    gpu_bytes_in_use: int
    host_backup_bytes: int
    def __init__(self, asleep: _Optional[bool] = ..., active_tag: _Optional[str] = ..., weights_version: _Optional[int] = ..., gpu_bytes_in_use: _Optional[int] = ..., host_backup_bytes: _Optional[int] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: LifecycleStatus
    def __init__(self, status: _Optional[_Union[LifecycleStatus, _Mapping]] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: LifecycleStatus
    def __init__(self, status: _Optional[_Union[LifecycleStatus, _Mapping]] = ...) -> None: ...

class GetTrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("lifecycle", "has_optimizer", "has_scheduler", "configured", "step", "num_parameters", "checkpoint_step", "rank", "world_size", "backend", "role", "has_value_head")
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    HAS_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    HAS_SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HAS_VALUE_HEAD_FIELD_NUMBER: _ClassVar[int]
    lifecycle: LifecycleStatus
    has_optimizer: bool
    has_scheduler: bool
    configured: bool
    step: int
    num_parameters: int
    checkpoint_step: int
    rank: int
    world_size: int
    backend: str
    role: str
    has_value_head: bool
    def __init__(self, lifecycle: _Optional[_Union[LifecycleStatus, _Mapping]] = ..., has_optimizer: _Optional[bool] = ..., has_scheduler: _Optional[bool] = ..., configured: _Optional[bool] = ..., step: _Optional[int] = ..., num_parameters: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., role: _Optional[str] = ..., has_value_head: _Optional[bool] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt_ids", "response_ids", "loss_mask", "advantage", "advantages", "old_logprobs", "ref_logprobs", "returns", "old_values")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUES_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[float]
    advantage: float
    advantages: _containers.RepeatedScalarFieldContainer[float]
    old_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ref_logprobs: _containers.RepeatedScalarFieldContainer[float]
    returns: _containers.RepeatedScalarFieldContainer[float]
    old_values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[float]] = ..., advantage: _Optional[float] = ..., advantages: _Optional[_Iterable[float]] = ..., old_logprobs: _Optional[_Iterable[float]] = ..., ref_logprobs: _Optional[_Iterable[float]] = ..., returns: _Optional[_Iterable[float]] = ..., old_values: _Optional[_Iterable[float]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class ComputeLogProbsRequest(_message.Message):
    __slots__ = ("tag", "batch")
    TAG_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    tag: str
    batch: Batch
    def __init__(self, tag: _Optional[str] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ...) -> None: ...

class TokenLogProbs(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogProbsResponse(_message.Message):
    __slots__ = ("results", "entropy")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenLogProbs]
    entropy: float
    def __init__(self, results: _Optional[_Iterable[_Union[TokenLogProbs, _Mapping]]] = ..., entropy: _Optional[float] = ...) -> None: ...

class ComputeValuesRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ...) -> None: ...

class TokenValues(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeValuesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenValues]
    def __init__(self, results: _Optional[_Iterable[_Union[TokenValues, _Mapping]]] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("batch", "loss", "request_id", "lr")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    loss: LossKind
    request_id: str
    lr: float
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., loss: _Optional[_Union[LossKind, str]] = ..., request_id: _Optional[str] = ..., lr: _Optional[float] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("metrics", "weights_version", "step")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    weights_version: int
    step: int
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., weights_version: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class GetWeightManifestRequest(_message.Message):
    __slots__ = ("fingerprint_algo", "plane")
    FINGERPRINT_ALGO_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    fingerprint_algo: str
    plane: _weights_pb2.WeightPlane
    def __init__(self, fingerprint_algo: _Optional[str] = ..., plane: _Optional[_Union[_weights_pb2.WeightPlane, str]] = ...) -> None: ...

class GetWeightManifestResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _weights_pb2.WeightManifest
    def __init__(self, manifest: _Optional[_Union[_weights_pb2.WeightManifest, _Mapping]] = ...) -> None: ...

class GetWeightsRequest(_message.Message):
    __slots__ = ("version", "buckets", "chunk_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    buckets: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: int
    def __init__(self, version: _Optional[int] = ..., buckets: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("plane", "version", "broadcast", "request_id", "current", "fingerprint_algo")
    PLANE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_ALGO_FIELD_NUMBER: _ClassVar[int]
    plane: _weights_pb2.WeightPlane
    version: int
    broadcast: _weights_pb2.BroadcastSource
    request_id: str
    current: bool
    fingerprint_algo: str
    def __init__(self, plane: _Optional[_Union[_weights_pb2.WeightPlane, str]] = ..., version: _Optional[int] = ..., broadcast: _Optional[_Union[_weights_pb2.BroadcastSource, _Mapping]] = ..., request_id: _Optional[str] = ..., current: _Optional[bool] = ..., fingerprint_algo: _Optional[str] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("manifest", "seconds", "shm_segments", "cuda_ipc_handles", "release_required")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHM_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    manifest: _weights_pb2.WeightManifest
    seconds: float
    shm_segments: _containers.RepeatedScalarFieldContainer[str]
    cuda_ipc_handles: _containers.RepeatedCompositeFieldContainer[_weights_pb2.CudaIpcHandle]
    release_required: bool
    def __init__(self, manifest: _Optional[_Union[_weights_pb2.WeightManifest, _Mapping]] = ..., seconds: _Optional[float] = ..., shm_segments: _Optional[_Iterable[str]] = ..., cuda_ipc_handles: _Optional[_Iterable[_Union[_weights_pb2.CudaIpcHandle, _Mapping]]] = ..., release_required: _Optional[bool] = ...) -> None: ...

class ReleaseWeightsRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class ReleaseWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path", "include_optimizer")
    PATH_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    path: str
    include_optimizer: bool
    def __init__(self, path: _Optional[str] = ..., include_optimizer: _Optional[bool] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path", "load_optimizer")
    PATH_FIELD_NUMBER: _ClassVar[int]
    LOAD_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    path: str
    load_optimizer: bool
    def __init__(self, path: _Optional[str] = ..., load_optimizer: _Optional[bool] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("step", "status")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    step: int
    status: TrainerStatus
    def __init__(self, step: _Optional[int] = ..., status: _Optional[_Union[TrainerStatus, _Mapping]] = ...) -> None: ...
