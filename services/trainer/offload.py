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
    def __init__(self, params: list[torch.Tensor], pinned: bool, scratch: list[torch.Tensor] = ()):
        self.params = params
        self.scratch = list(scratch)  # each its own storage, views into it stay valid
        self.pinned = pinned
        self._params_shared = False
        self._host: dict[int, torch.Tensor] = {}  # id(storage owner) -> host copy of its storage
        self._sizes: dict[int, int] = {}
        self._state_owners: list[torch.Tensor] = []
        self._state_ids: set[int] = set()

    def _owners(self, state_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors whose storages Sleep frees: all parameters in one storage, and all
        optimizer state in another (both gathered on first use, since state appears lazily)."""
        if not self._params_shared:
            if len(memory.unique_storages(self.params)) > 1:  # already one storage (bucket layout): keep it
                memory.share_one_storage(self.params)
            self._params_shared = True
        state = self._offloadable(state_tensors)
        if {id(t) for t in state} != self._state_ids:
            memory.share_one_storage(state)
            self._state_ids = {id(t) for t in state}
            self._state_owners = memory.unique_storages(state)
        return [*memory.unique_storages(self.params), *self._state_owners, *memory.unique_storages(self.scratch)]

    @staticmethod
    def _offloadable(state_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # 0-dim tensors (Adam's step counters) are tiny and often live on the host already.
        return [t for t in state_tensors if t.dim() > 0]

    def device_bytes(self, state_tensors: list[torch.Tensor]) -> int:
        tensors = [*self.params, *(p.grad for p in self.params if p.grad is not None), *self._offloadable(state_tensors),
                   *self.scratch]
        return sum(memory.storage_bytes(t) for t in memory.unique_storages(tensors))

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() for t in self._host.values())

    def release(self, state_tensors: list[torch.Tensor]) -> None:
        """Copy optimizer state to the host, then free params, grads and state on the device.

        Copies already queued on the current stream (the host store's capture of the weights)
        finish before anything is freed: one synchronisation covers them all."""
        owners = self._owners(state_tensors)
        params = set(id(t) for t in memory.unique_storages([*self.params, *self.scratch]))
        with torch.no_grad():
            for t in owners:
                key = id(t)
                self._sizes[key] = memory.storage_bytes(t)
                if key in params:
                    continue  # parameter values live in the host store, scratch is rewritten: no copy
                if key not in self._host or self._host[key].numel() != self._sizes[key]:
                    self._host[key] = torch.empty(self._sizes[key], dtype=torch.uint8, pin_memory=self.pinned)
                self._host[key].copy_(memory.as_bytes(t), non_blocking=self.pinned)
            if self.params and self.params[0].device.type == "cuda":
                torch.cuda.synchronize(self.params[0].device)
            for p in self.params:
                p.grad = None
            memory.release(owners)

    def reallocate(self, state_tensors: list[torch.Tensor]) -> None:
        """Give params back their storage (tensor values undefined until restored, the gaps between
        them zero) and reload the state."""
        owners = self._owners(state_tensors)
        memory.reallocate(owners, [self._sizes[id(t)] for t in owners])
        with torch.no_grad():
            for t in owners:
                if id(t) in self._host:
                    memory.as_bytes(t).copy_(self._host[id(t)], non_blocking=self.pinned)
                else:  # the parameters' storage, laid out as sync buckets (or scratch)
                    # Buckets are fingerprinted and sent whole, alignment gaps included, and an
                    # engine compares them with copies whose gaps are zero; reallocated memory is
                    # whatever the allocator hands back (on the H200, a staging slot's bytes).
                    memory.as_bytes(t).zero_()
        if self.params and self.params[0].device.type == "cuda":
            torch.cuda.synchronize(self.params[0].device)
