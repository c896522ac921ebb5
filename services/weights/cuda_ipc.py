"""The CUDA IPC plane: buckets in trainer GPU memory opened by an engine on the same GPU.

A bucket's CUDA IPC handle travels as explicit protobuf fields (never pickled). The engine
opens it, copies device-to-device, and drops it; the trainer frees the buffers only after every
engine has acknowledged (ReleaseWeights). GPUs are matched by UUID, because two processes may
number the same GPU differently.
"""

from __future__ import annotations

import torch

from services.api import weights_pb2


def gpu_uuids() -> list[str]:
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def device_for_uuid(uuid: str) -> torch.device:
    for index, candidate in enumerate(gpu_uuids()):
        if candidate == uuid:
            return torch.device("cuda", index)
    raise ValueError(f"cuda_ipc: GPU {uuid} is not visible to this process")


def export(bucket: int, flat: torch.Tensor) -> weights_pb2.CudaIpcHandle:
    """The IPC handle of one flat uint8 CUDA tensor (the storage stays owned by the caller)."""
    if flat.device.type != "cuda" or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("cuda_ipc: buckets must be flat uint8 CUDA tensors")
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        flat.untyped_storage()._share_cuda_()  # noqa: SLF001
    )
    return weights_pb2.CudaIpcHandle(
        bucket=bucket,
        gpu_uuid=gpu_uuids()[device],
        device_index=device,
        handle=handle,
        storage_size_bytes=size,
        storage_offset_bytes=offset,
        tensor_offset=flat.storage_offset(),
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=event_sync,
    )


def open_handle(h: weights_pb2.CudaIpcHandle, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over the trainer's bucket memory."""
    device = device_for_uuid(h.gpu_uuid)
    torch.cuda._lazy_init()  # noqa: SLF001
    storage = torch.UntypedStorage._new_shared_cuda(  # noqa: SLF001
        device.index, h.handle, h.storage_size_bytes, h.storage_offset_bytes, h.ref_counter_handle, h.ref_counter_offset,
        h.event_handle or None, h.event_sync_required,
    )
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    flat.set_(storage, h.tensor_offset, (nbytes,), (1,))
    return flat
