from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightPlane(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_PLANE_UNSPECIFIED: _ClassVar[WeightPlane]
    WEIGHT_PLANE_GRPC_STREAM: _ClassVar[WeightPlane]
    WEIGHT_PLANE_BROADCAST: _ClassVar[WeightPlane]
    WEIGHT_PLANE_CUDA_IPC: _ClassVar[WeightPlane]
    WEIGHT_PLANE_SHM: _ClassVar[WeightPlane]

class VerifyMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFY_MODE_UNSPECIFIED: _ClassVar[VerifyMode]
    VERIFY_MODE_FINGERPRINT: _ClassVar[VerifyMode]
    VERIFY_MODE_EXACT: _ClassVar[VerifyMode]
WEIGHT_PLANE_UNSPECIFIED: WeightPlane
WEIGHT_PLANE_GRPC_STREAM: WeightPlane
WEIGHT_PLANE_BROADCAST: WeightPlane
WEIGHT_PLANE_CUDA_IPC: WeightPlane
WEIGHT_PLANE_SHM: WeightPlane
VERIFY_MODE_UNSPECIFIED: VerifyMode
VERIFY_MODE_FINGERPRINT: VerifyMode
VERIFY_MODE_EXACT: VerifyMode

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("index", "dtype", "tensors", "nbytes", "fingerprint")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    index: int
    dtype: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    nbytes: int
    fingerprint: str
    def __init__(self, index: _Optional[int] = ..., dtype: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., nbytes: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "source", "buckets", "total_bytes", "fingerprint_algo")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_ALGO_FIELD_NUMBER: _ClassVar[int]
    version: int
    source: str
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    total_bytes: int
    fingerprint_algo: str
    def __init__(self, version: _Optional[int] = ..., source: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., fingerprint_algo: _Optional[str] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("bucket", "offset", "data")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    offset: int
    data: bytes
    def __init__(self, bucket: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TrainerEndpoint(_message.Message):
    __slots__ = ("address", "token")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    address: str
    token: str
    def __init__(self, address: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class BroadcastSource(_message.Message):
    __slots__ = ("group_name", "src_rank", "packed")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    src_rank: int
    packed: bool
    def __init__(self, group_name: _Optional[str] = ..., src_rank: _Optional[int] = ..., packed: _Optional[bool] = ...) -> None: ...

class ShmSource(_message.Message):
    __slots__ = ("segment_names",)
    SEGMENT_NAMES_FIELD_NUMBER: _ClassVar[int]
    segment_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, segment_names: _Optional[_Iterable[str]] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("bucket", "gpu_uuid", "device_index", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "tensor_offset")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    gpu_uuid: str
    device_index: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    def __init__(self, bucket: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., device_index: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., tensor_offset: _Optional[int] = ...) -> None: ...

class CudaIpcSource(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedCompositeFieldContainer[CudaIpcHandle]
    def __init__(self, handles: _Optional[_Iterable[_Union[CudaIpcHandle, _Mapping]]] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("host_id", "gpu_uuids", "planes", "broadcast_backends", "packed_broadcast", "broadcast_ranks")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    PLANES_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_BROADCAST_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_RANKS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    planes: _containers.RepeatedScalarFieldContainer[WeightPlane]
    broadcast_backends: _containers.RepeatedScalarFieldContainer[str]
    packed_broadcast: bool
    broadcast_ranks: int
    def __init__(self, host_id: _Optional[str] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., planes: _Optional[_Iterable[_Union[WeightPlane, str]]] = ..., broadcast_backends: _Optional[_Iterable[str]] = ..., packed_broadcast: _Optional[bool] = ..., broadcast_ranks: _Optional[int] = ...) -> None: ...

class InitWeightUpdateGroupRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., group_name: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightUpdateGroupResponse(_message.Message):
    __slots__ = ("success", "message", "master_port")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    master_port: int
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ..., master_port: _Optional[int] = ...) -> None: ...

class DestroyWeightUpdateGroupRequest(_message.Message):
    __slots__ = ("group_name",)
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    def __init__(self, group_name: _Optional[str] = ...) -> None: ...

class DestroyWeightUpdateGroupResponse(_message.Message):
    __slots__ = ("success", "message")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
