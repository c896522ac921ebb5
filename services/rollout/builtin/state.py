"""The rows' state on the device: fixed-size tensors a decode step reads and updates in place.

Slot s holds one row (one sample): its next input token and that token's position, its block
table, how many tokens it has made, whether it is done, its sampling key, and its outputs so
far. Sampling settings of the current call sit beside them as device scalars, so a captured step
reads whatever the call set. `ModelRunner` owns one; the ops backends update it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from services.rollout.builtin.kv_cache import TRASH_BLOCK


@dataclass
class RowState:
    tokens: torch.Tensor  # int64 [B]: the next input token
    positions: torch.Tensor  # int32 [B]: its position
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    num_made: torch.Tensor  # int32 [B]: tokens made so far
    done: torch.Tensor  # bool [B]
    keys: torch.Tensor  # int64 [B]: sampling.row_key
    out_tokens: torch.Tensor  # int64 [B, N]
    out_logprobs: torch.Tensor  # float32 [B, N]
    limit: torch.Tensor  # int32 [1]: this call's max_new_tokens
    inv_temperature: torch.Tensor  # float32 [1]
    top_p: torch.Tensor  # float32 [1]
    is_stop: torch.Tensor  # bool [V]: stop token ids (eos included unless ignored)

    @classmethod
    def allocate(cls, capacity: int, max_new_tokens: int, max_blocks: int, vocab_size: int,
                 device: torch.device) -> RowState:
        B, N = capacity, max_new_tokens
        return cls(
            tokens=torch.zeros(B, dtype=torch.int64, device=device),
            positions=torch.zeros(B, dtype=torch.int32, device=device),
            block_tables=torch.full((B, max_blocks), TRASH_BLOCK, dtype=torch.int32, device=device),
            num_made=torch.zeros(B, dtype=torch.int32, device=device),
            done=torch.ones(B, dtype=torch.bool, device=device),
            keys=torch.zeros(B, dtype=torch.int64, device=device),
            out_tokens=torch.zeros(B, N, dtype=torch.int64, device=device),
            out_logprobs=torch.zeros(B, N, dtype=torch.float32, device=device),
            limit=torch.full((1,), N, dtype=torch.int32, device=device),
            inv_temperature=torch.ones(1, dtype=torch.float32, device=device),
            top_p=torch.ones(1, dtype=torch.float32, device=device),
            is_stop=torch.zeros(vocab_size, dtype=torch.bool, device=device),
        )

    def per_row(self) -> list[torch.Tensor]:
        """The tensors with one entry per slot (what moves when rows are packed)."""
        return [self.tokens, self.positions, self.block_tables, self.num_made, self.done, self.keys,
                self.out_tokens, self.out_logprobs]

    def all(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]
