"""SGLang's colocated payload: one bucket of GPU memory, described for `/update_weights_from_tensor`.

SGLang takes tensors on its own GPU as `serialized_named_tensors`: base64 of a pickle, which
SGLang unpickles with its allowlist (`SafeUnpickler`) after patching torch's CUDA reductions to
take a GPU's UUID for its index. For `load_format: flattened_bucket` the pickle is
`{"flattened_tensor": <uint8 CUDA tensor>, "metadata": [<name, shape, dtype, start_idx, end_idx,
numel>, ...]}` with byte offsets into the flat tensor (slime sends the same).

THIS IS A PICKLE. It carries CUDA IPC handles, which only mean something to a process on the same
host and GPU, and it is sent only to an SGLang server this rollout service reaches over loopback
(`SglangEngine` refuses the plane for any other URL). It is never built from, or sent to, the
network, and no rlfleet process ever unpickles anything: the payload is written here from the
trainer's handle fields (`weights_pb2.CudaIpcHandle`, explicit protobuf fields) and read only
by SGLang.

What the pickle names: `torch.multiprocessing.reductions.rebuild_cuda_tensor` with the arguments
torch's own `reduce_tensor` gives it, `torch.Tensor`, `torch.storage.TypedStorage`,
`torch.Size`, `torch.uint8` and the bucket's dtypes, and `types.SimpleNamespace` for each tensor's
metadata (SGLang reads the fields by attribute) -- all on SGLang's allowlist, so nothing of
rlfleet's needs to be importable in SGLang's process. Its opener is the only consumer of each
handle: the engine that forwards one never opens it itself (torch counts a handle's consumers,
and the producer may reuse the memory once they are done).
"""

from __future__ import annotations

import base64
import pickle
import types

import torch
from torch.multiprocessing import reductions

from services.api import weights_pb2
from services.weights.buckets import BucketSpec, parse_dtype
from services.weights.cuda_ipc import export


class _SharedCudaBytes:
    """Pickles as the flat uint8 CUDA tensor behind a handle, exactly as torch's `reduce_tensor`
    would reduce it, except the device: the GPU's UUID, as SGLang's patched reductions expect."""

    def __init__(self, handle: weights_pb2.CudaIpcHandle, nbytes: int):
        self.handle, self.nbytes = handle, nbytes

    def __reduce__(self):
        h = self.handle
        return reductions.rebuild_cuda_tensor, (
            torch.Tensor, torch.Size([self.nbytes]), (1,), h.tensor_offset, torch.storage.TypedStorage, torch.uint8,
            h.gpu_uuid, h.handle, h.storage_size_bytes, h.storage_offset_bytes, False, h.ref_counter_handle,
            h.ref_counter_offset, h.event_handle or None, h.event_sync_required,
        )


def bucket_payload(handle: weights_pb2.CudaIpcHandle, spec: BucketSpec) -> str:
    """`serialized_named_tensors[0]` for one bucket whose bytes the handle points at."""
    if handle.bucket != spec.index:
        raise ValueError(f"cuda_ipc: handle for bucket {handle.bucket} given for bucket {spec.index}")
    if not handle.gpu_uuid or not handle.handle:
        raise ValueError(f"cuda_ipc: bucket {spec.index}: the handle names no GPU or no memory")
    dtype = parse_dtype(spec.dtype)
    metadata = [
        types.SimpleNamespace(name=t.name, shape=torch.Size(t.shape), dtype=dtype, start_idx=t.offset,
                              end_idx=t.offset + t.nbytes, numel=t.nbytes)
        for t in spec.tensors
    ]
    payload = {"flattened_tensor": _SharedCudaBytes(handle, spec.nbytes), "metadata": metadata}
    return base64.b64encode(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def local_payloads(buffers: list[torch.Tensor], specs: list[BucketSpec]) -> list[str]:
    """Payloads for buckets in this process's own GPU memory (a host copy uploaded here); the
    caller keeps `buffers` alive until SGLang has loaded them."""
    return [bucket_payload(export(spec.index, flat), spec) for flat, spec in zip(buffers, specs)]
