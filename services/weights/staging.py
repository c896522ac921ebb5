"""Host -> device staging for syncs that read an offloaded trainer's host copy on a GPU machine.

Three ways, each overlapping the PCIe copy with what follows instead of copying everything first:

- `stage_and_send` (NCCL broadcast): two device slots, used in turn. Bucket k+1 is copied
  host->device (by the SMs where it can, as below) on a side stream while bucket k is being
  sent; a slot is refilled only after the send that read it has finished on the GPU (an event,
  not a host wait). Device memory: two buckets, whatever the model size.
- `stage_for_ipc` (CUDA IPC to an engine on the same GPU): every bucket gets its own device
  buffer, and its copy is queued before the next one; exporting the buffer records an IPC event
  behind its copy, and an engine that opens it waits for that event on its own stream. The
  engine starts on bucket 0 while later buckets are still crossing PCIe, with no round trip per
  bucket. Used when the host copy is private memory.
- `upload_and_fingerprint` (an engine on the trainer's GPU, host copy in shared memory): the
  engine copies the trainer's page-locked host copy to its own device itself. With Triton, its
  SMs read the host pages and fingerprint them on the way (one pass); otherwise the copy
  engines upload and bucket k is fingerprinted while bucket k+1 crosses PCIe. Nothing is staged
  on the trainer's GPU.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from services.api import weights_pb2
from services.weights import cuda_ipc, fast_cuda
from services.weights.fingerprint import fingerprint


def stage_and_send(host_buffers: Sequence[torch.Tensor], device: torch.device,
                   send: Callable[[int, torch.Tensor], None], slots: int = 2, *, kernel: bool = True) -> None:
    """Copy each flat uint8 host bucket into a device slot and call `send(k, slot_view)`.

    `send` queues work that reads the slot on the current stream (or finishes before returning);
    it runs once the slot holds bucket k. Host buffers should be pinned, or the copies serialise.
    Page-locked buckets are copied by the SMs when Triton is there (`kernel`), for the reason
    `upload_and_fingerprint` gives: the trainer has just freed its memory by going to sleep, and
    the driver scrubs it on the copy engines."""
    if not host_buffers:
        return
    current = torch.cuda.current_stream(device)
    copier = torch.cuda.Stream(device)
    size = max(b.numel() for b in host_buffers)
    pool = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(min(slots, len(host_buffers)))]
    copier.wait_stream(current)  # the slots' memory may be in use by work queued there before
    freed: list[torch.cuda.Event | None] = [None] * len(pool)  # the last send that read each slot
    by_sms = kernel and fast_cuda.available(pool[0]) and all(fast_cuda.mapped(b) for b in host_buffers)

    def fill(k: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        s = k % len(pool)
        slot = pool[s][: host_buffers[k].numel()]
        with torch.cuda.device(device), torch.cuda.stream(copier):
            if freed[s] is not None:
                copier.wait_event(freed[s])
            if by_sms:
                fast_cuda.upload(slot, host_buffers[k])
            else:
                slot.copy_(host_buffers[k], non_blocking=True)
            filled = torch.cuda.Event()
            filled.record(copier)
        return slot, filled

    # Copies are queued ahead of the sends, so they run even while `send` blocks the host.
    queued = {k: fill(k) for k in range(len(pool))}
    for k in range(len(host_buffers)):
        slot, filled = queued.pop(k)
        current.wait_event(filled)
        send(k, slot)
        freed[k % len(pool)] = torch.cuda.Event()
        freed[k % len(pool)].record(current)
        if k + len(pool) < len(host_buffers):
            queued[k + len(pool)] = fill(k + len(pool))
    for buffer in pool:
        buffer.record_stream(copier)  # freed by the caching allocator only after both streams
    current.wait_stream(copier)


def stage_for_ipc(host_buffers: Sequence[torch.Tensor], device: torch.device
                  ) -> tuple[list[torch.Tensor], list[weights_pb2.CudaIpcHandle]]:
    """Queue every bucket's host->device copy and export each buffer as it is queued.

    Returns the device buffers (keep them until every engine has acknowledged) and one handle per
    bucket, each carrying the IPC event its copy completes; nothing here waits for the copies."""
    buffers, handles = [], []
    with torch.cuda.device(device):
        for k, host in enumerate(host_buffers):
            flat = torch.empty(host.numel(), dtype=torch.uint8, device=device)  # its own storage: its own event
            flat.copy_(host, non_blocking=True)
            handles.append(cuda_ipc.export(k, flat))  # records the event behind this copy
            buffers.append(flat)
    return buffers, handles


def upload_and_fingerprint(host_views: Sequence[torch.Tensor], device: torch.device, algo: str,
                           out: Sequence[torch.Tensor] | None = None, *, kernel: bool = True
                           ) -> tuple[list[torch.Tensor], list[str]]:
    """Copy flat uint8 host buckets (page-locked) into device buffers (`out`, or new ones) and
    fingerprint them. Returns both lists; the buffers are ready for the current stream.

    "fast" with Triton: a kernel on the current stream reads each bucket over PCIe, stores it and
    fingerprints it in one pass. That keeps off the copy engines, which the driver also uses to
    scrub device memory another process has just freed, and a trainer going to sleep frees
    everything: on the H200, 9.1 GB uploaded right after a 26 GiB free took 230 ms on the copy
    engines and 179 ms this way (165 and 178 ms with nothing freed; bench/host_upload.py).
    Otherwise, or with `kernel=False` (bench/host_upload.py compares both), the copy engines
    upload on a copy stream and each bucket is fingerprinted on the current stream as soon as it
    has landed."""
    current = torch.cuda.current_stream(device)
    # Allocated on the current stream, where they live on (as the model's weights): memory the
    # caching allocator hands out for one stream is only reused on that stream, and a stream made
    # per sync would never get it back.
    buffers = list(out) if out is not None else [
        torch.empty(host.numel(), dtype=torch.uint8, device=device) for host in host_views
    ]
    if kernel and algo == "fast" and all(fast_cuda.available(b) for b in buffers) \
            and all(fast_cuda.mapped(h) for h in host_views):
        with torch.cuda.device(device):
            return buffers, fast_cuda.copy_and_fingerprint(zip(buffers, host_views))
    copier = torch.cuda.Stream(device)
    copier.wait_stream(current)
    landed = []
    with torch.cuda.stream(copier):
        for flat, host in zip(buffers, host_views):
            flat.copy_(host, non_blocking=True)
            flat.record_stream(copier)
            event = torch.cuda.Event()
            event.record(copier)
            landed.append(event)
    if algo == "fast" and all(fast_cuda.available(b) for b in buffers):
        return buffers, fast_cuda.fingerprints(buffers, ready=landed)  # one host sync for all
    prints = []
    for flat, event in zip(buffers, landed):
        current.wait_event(event)
        prints.append(fingerprint(flat, algo))
    return buffers, prints
