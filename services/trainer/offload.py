"""Offload a trainer's parameters and optimizer state: what `Sleep` frees and `WakeUp` brings back.

Sleep must hand memory back to the device, not just to PyTorch's cache: gradients are dropped,
optimizer state tensors are copied to host buffers (allocated once, pinned on CUDA), and then the
storage of parameters and state is released (services.models.memory). Wake reallocates and copies
the optimizer state in; parameter values come back from the host store.
"""

from __future__ import annotations

import torch

from services.models import memory


class Offloader:
    def __init__(self, params: list[torch.Tensor], pinned: bool):
        memory.make_resizable(params)
        self.params = params
        self.pinned = pinned
        self._param_bytes = [memory.storage_bytes(p) for p in params]
        self._host: dict[int, torch.Tensor] = {}  # id(state tensor) -> host copy of its storage
        self._state_bytes: dict[int, int] = {}

    @staticmethod
    def _offloadable(state_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # 0-dim tensors (Adam's step counters) are tiny and often live on the host already.
        return [t for t in state_tensors if t.dim() > 0]

    def device_bytes(self, state_tensors: list[torch.Tensor]) -> int:
        tensors = [*self.params, *(p.grad for p in self.params if p.grad is not None), *self._offloadable(state_tensors)]
        return sum(memory.storage_bytes(t) for t in tensors)

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() for t in self._host.values())

    def release(self, state_tensors: list[torch.Tensor]) -> None:
        """Copy optimizer state to the host, then free params, grads and state on the device.

        Copies already queued on the current stream (the host store's capture of the weights)
        finish before anything is freed: one synchronisation covers them all."""
        state = self._offloadable(state_tensors)
        with torch.no_grad():
            for t in state:
                key = id(t)
                if key not in self._host:
                    self._state_bytes[key] = memory.storage_bytes(t)
                    self._host[key] = torch.empty(self._state_bytes[key], dtype=torch.uint8, pin_memory=self.pinned)
                self._host[key].copy_(memory.as_bytes(t), non_blocking=self.pinned)
            if self.params and self.params[0].device.type == "cuda":
                torch.cuda.synchronize(self.params[0].device)
            for p in self.params:
                p.grad = None
            memory.release([*self.params, *state])

    def reallocate(self, state_tensors: list[torch.Tensor]) -> None:
        """Give params back their storage (values undefined until restored) and reload the state."""
        state = self._offloadable(state_tensors)
        memory.reallocate(self.params, self._param_bytes)
        memory.reallocate(state, [self._state_bytes[id(t)] for t in state])
        with torch.no_grad():
            for t in state:
                memory.as_bytes(t).copy_(self._host[id(t)], non_blocking=self.pinned)
        if self.params and self.params[0].device.type == "cuda":
            torch.cuda.synchronize(self.params[0].device)
