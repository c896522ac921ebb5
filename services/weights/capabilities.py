"""What a process can offer on the data planes: its host identity, GPUs and backends.

Two processes share a host (and so /dev/shm) when their host ids match; they share a GPU when a
GPU UUID appears in both lists. The coordinator negotiates planes from these reports alone.
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from services.api import weights_pb2
from services.weights.cuda_ipc import gpu_uuids


def host_id() -> str:
    """Hostname plus the kernel boot id: two containers on one node differ by hostname."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def local(device: torch.device) -> weights_pb2.Capabilities:
    planes = [weights_pb2.WEIGHT_PLANE_GRPC_STREAM, weights_pb2.WEIGHT_PLANE_SHM, weights_pb2.WEIGHT_PLANE_BROADCAST]
    backends = ["gloo"]
    uuids: list[str] = []
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuids = [gpu_uuids()[index]]
        planes.append(weights_pb2.WEIGHT_PLANE_CUDA_IPC)
        backends.append("nccl")
    return weights_pb2.Capabilities(host_id=host_id(), gpu_uuids=uuids, planes=planes, broadcast_backends=backends)
