"""Which CUDA device the calling thread works on.

CUDA's current device belongs to a thread, and gRPC serves each call on a pool thread that starts
on device 0. A trainer or engine placed on cuda:1 would then launch Triton kernels on the wrong
GPU, seed the wrong generator and open a second context on GPU 0. Every handler therefore makes
its thread work on its service's device first (`use`), before any CUDA call.
"""

from __future__ import annotations

import functools
import re

import torch


def parse(text: str) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` on a machine that has it; ValueError naming the field otherwise."""
    if not _DEVICE.fullmatch(text or ""):
        raise ValueError(f"device: expected cpu, cuda or cuda:N, got {text!r}")
    device = torch.device(text)
    if device.type == "cuda":
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if seen == 0 or (device.index is not None and device.index >= seen):
            raise ValueError(f"device: {text} does not exist here (this process sees {seen} GPU(s))")
    return device


_DEVICE = re.compile(r"cpu|cuda(:\d{1,3})?")


def use(device: torch.device | str) -> None:
    """Make the calling thread's current CUDA device `device` (a no-op for CPU and for a bare
    "cuda", which means the current device)."""
    device = parse(str(device))  # a device this machine lacks is refused by name
    if device.type == "cuda" and device.index is not None and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, read once per device (1 for a CPU, where only
    Triton's interpreter runs kernels)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
