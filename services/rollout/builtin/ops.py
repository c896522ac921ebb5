"""The paged forward's building blocks, in plain torch: the CPU path, and the reference the GPU
kernels (`kernels.py` and the `*_kernels.py` it launches) are tested against.

Each op computes what the decoder (`services.models.decoder`) computes, in the same precision
steps (RMSNorm in float32 cast back before the weight, rotate-half RoPE with cos/sin cast to the
model's dtype), so an engine and a trainer on the same device and dtype give the same logprobs as
far as the attention kernels let them. Token-major shapes throughout: T tokens, H query heads,
Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from services.rollout.builtin import sampling
from services.rollout.builtin.state import RowState


def rope_table(head_dim: int, theta: float, max_positions: int, device: torch.device) -> torch.Tensor:
    """float32 [max_positions, 2, D/2]: cos and sin of every position, as the decoder computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq  # [P, D/2]
    return torch.stack((freqs.cos(), freqs.sin()), dim=1).contiguous()


class TorchOps:
    """Reference implementations; every tensor may live on any device."""

    name = "torch"
    _addresses: tuple | None = None  # `_step_addresses`' last step

    @contextlib.contextmanager
    def tuning(self):
        """Around the eager run before a graph is captured: the shapes run within are worth
        tuning (they are replayed); no ops here tune."""
        yield

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual) for [T, hidden]; residual None: x alone."""
        summed = x if residual is None else residual + x
        normed = F.rms_norm(summed.float(), (summed.shape[-1],), eps=eps)
        return weight * normed.to(summed.dtype), summed

    def qk_rope_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, eps: float, table: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise (Qwen3) and rotate q [T, H*D] and k [T, Hkv*D], write k and v [T, Hkv*D] to
        cache slots [T]; returns the rotated q [T, H, D] and k [T, Hkv, D]."""
        num_tokens = q.shape[0]
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        q = q.reshape(num_tokens, -1, head_dim)
        k = k.reshape(num_tokens, num_kv_heads, head_dim)
        if q_norm is not None:
            q, k = self._head_norm(q, q_norm, eps), self._head_norm(k, k_norm, eps)
        cos_sin = table[positions.long()]  # [T, 2, D/2]
        cos = torch.cat((cos_sin[:, 0], cos_sin[:, 0]), dim=-1).to(q.dtype)[:, None]  # [T, 1, D]
        sin = torch.cat((cos_sin[:, 1], cos_sin[:, 1]), dim=-1).to(q.dtype)[:, None]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_cache.index_copy_(0, slots.long(), k)
        v_cache.index_copy_(0, slots.long(), v.reshape(num_tokens, num_kv_heads, head_dim))
        return q, k

    @staticmethod
    def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                         num_splits: int) -> torch.Tensor:
        """One query token per row, q [b, H, D], over the row's first seq_lens[b] cached tokens;
        returns [b, H*D]. Gathers the rows' keys into a dense [b, L, Hkv, D] (the CPU way)."""
        batch, num_heads, head_dim = q.shape
        length = int(seq_lens.max())
        position = torch.arange(length, device=q.device)  # [L]
        slots = block_tables[:, position // block_size].long() * block_size + position % block_size  # [b, L]
        keys = k_cache[slots].transpose(1, 2)  # [b, Hkv, L, D]
        values = v_cache[slots].transpose(1, 2)
        mask = (position[None, :] < seq_lens[:, None])[:, None, None, :]  # [b, 1, 1, L]
        out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask,
                                             enable_gqa=num_heads != keys.shape[1])  # [b, H, 1, D]
        return out.reshape(batch, num_heads * head_dim)

    def rope_decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                              k_norm: torch.Tensor | None, eps: float, table: torch.Tensor, positions: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                              block_size: int, num_splits: int) -> torch.Tensor:
        """A decode step's attention from the q/k/v product's output (one new token per row, at
        `positions` [b], int32): `qk_rope_cache` into the row's slot for that position, then
        `decode_attention` over the row's first positions + 1 tokens; [b, H*D]."""
        slots, seq_lens = self._step_addresses(positions, block_tables, block_size)
        q, _ = self.qk_rope_cache(q, k, v, q_norm, k_norm, eps, table, positions, slots, k_cache, v_cache)
        return self.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, block_size, num_splits)

    def _step_addresses(self, positions: torch.Tensor, block_tables: torch.Tensor,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' cache slots and the rows' lengths, made at a step's first layer and
        reused by the others, which pass the same tensors, unchanged (on a CPU, ~15 us a layer)."""
        inputs = (positions, block_tables)
        versions = (positions._version, block_tables._version)  # bumped by any change in place
        last = self._addresses
        if last is None or any(a is not b for a, b in zip(last[0], inputs)) or last[1] != versions:
            blocks = block_tables.gather(1, (positions // block_size)[:, None].long()).squeeze(1)
            last = self._addresses = (inputs, versions, blocks * block_size + positions % block_size, positions + 1)
        return last[2], last[3]

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of right-padded prompts: q [G, P, H, D], k, v [G, P, Hkv, D] -> [G, P, H*D].
        Padding sits after every real token, so plain causal attention is exact for real tokens."""
        groups, length, num_heads, head_dim = q.shape
        # Key/value heads as they are, shared by their query groups: on an H200 (torch 2.11) the
        # fused kernel takes them so, and gives the same numbers as on heads repeated to match,
        # in 43% of the time (77 against 179 us a layer at 256 x 64 tokens of the 1.5B shape).
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                             enable_gqa=num_heads != k.shape[2])  # [G, H, P, D]
        return out.transpose(1, 2).reshape(groups, length, num_heads * head_dim)

    def context_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                          block_size: int) -> torch.Tensor:
        """Causal attention of prompt suffixes over their whole prompts in the cache: q [G, S, H, D]
        holds tokens starts[g].. of prompt g (lengths[g] of them, right-padded), whose keys and
        values, and those of every token before them, are in the cache at block_tables [G, W].
        -> [G, S, H*D]. (Prefill after a prefix-cache hit: the prefix was computed earlier.)"""
        groups, length, num_heads, head_dim = q.shape
        context = block_tables.shape[1] * block_size
        position = torch.arange(context, device=q.device)
        slots = block_tables[:, position // block_size].long() * block_size + position % block_size  # [G, C]
        k, v = k_cache[slots], v_cache[slots]  # [G, C, Hkv, D]
        query_at = starts[:, None] + torch.arange(length, device=q.device)  # [G, S]
        visible = (position[None, None, :] <= query_at[:, :, None]) & \
            (position[None, None, :] < (starts + lengths)[:, None, None])  # [G, S, C]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype),
                                             v.transpose(1, 2).to(q.dtype), attn_mask=visible[:, None],
                                             enable_gqa=num_heads != k.shape[2])  # [G, H, S, D]
        return out.transpose(1, 2).reshape(groups, length, num_heads * head_dim)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] times weight [N, K] transposed, plus bias [N]: [T, N], as `nn.Linear`."""
        return F.linear(x, weight, bias)

    def output_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The decode step's logits [b, V] from hidden states x [b, hidden] and the output embedding."""
        return F.linear(x, weight)

    def gated_mlp(self, h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
        """A fused layer's gated MLP (`forward.fuse_projections`): gate_up [2 I, hidden] holds the
        gate rows, then the up rows; linear(silu(h gate^T) * (h up^T), down)."""
        gate, up = self.linear(h, gate_up).chunk(2, dim=-1)
        return self.silu_mul_linear(gate, up, down, down_bias)

    def silu_mul_linear(self, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
        """The gated MLP's down product: linear(silu(gate) * up), the activation rounded to the
        model's dtype first, as the decoder does."""
        return self.linear(self.silu_mul(gate, up), weight, bias)

    def sample(self, logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, inv_temperature: torch.Tensor,
               greedy: bool, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return sampling.sample(logits, keys, steps, inv_temperature, greedy, scores)

    def sample_and_record(self, logits: torch.Tensor, scores: torch.Tensor | None, greedy: bool, rows: RowState,
                          start: int) -> None:
        """Sample a token for rows start..start+b from logits [b, V] and record it: the token and
        its logprob into the outputs, one more made, done on a stop token or the length limit,
        the token as the next input one position on. Done rows do not change."""
        count = logits.shape[0]
        slot = slice(start, start + count)
        made = rows.num_made[slot]
        tokens, logprobs = self.sample(logits, rows.keys[slot], made, rows.inv_temperature, greedy, scores)
        active = ~rows.done[slot]
        index = torch.arange(start, start + count, device=logits.device)
        at = made.clamp(max=rows.out_tokens.shape[1] - 1).long()
        rows.out_tokens[index, at] = torch.where(active, tokens, rows.out_tokens[index, at])
        rows.out_logprobs[index, at] = torch.where(active, logprobs, rows.out_logprobs[index, at])
        made = made + active.int()
        rows.done[slot] |= active & (rows.is_stop[tokens] | (made >= rows.limit))
        rows.num_made[slot] = made
        rows.tokens[slot] = torch.where(active, tokens, rows.tokens[slot])
        rows.positions[slot] += active.int()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, op for op as the decoder's `apply_rope` ([T, heads, D])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
