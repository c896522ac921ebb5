"""Which CUDA device the calling thread works on.

CUDA's current device belongs to a thread, and gRPC serves each call on a pool thread that starts
on device 0. A trainer or engine placed on cuda:1 would then launch Triton kernels on the wrong
GPU, seed the wrong generator and open a second context on GPU 0. Every handler therefore makes
its thread work on its service's device first (`use`), before any CUDA call.
"""

from __future__ import annotations

import torch


def use(device: torch.device | str) -> None:
    """Make the calling thread's current CUDA device `device` (a no-op for CPU and for a bare
    "cuda", which means the current device)."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:
        return
    if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"device: {device} does not exist here (this process sees {seen} GPU(s))")
    if torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)
