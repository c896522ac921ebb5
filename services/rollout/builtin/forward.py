"""The decoder's forward over the paged KV cache: prefill of whole prompts, and one-token decode.

It reads the weights of a `DecoderLM` (the same tensor objects the weight receiver writes), and
computes what `DecoderLM.forward` computes, op by op through an ops backend (`ops.TorchOps`, or
`kernels.TritonOps` on a GPU). On a GPU the engine lays q/k/v and gate/up out side by side
(`fuse_projections`), so each is one matrix product: fewer, larger kernels per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.models.decoder import DecoderLM
from services.rollout.builtin.kv_cache import TRASH_BLOCK, PagedKVCache
from services.rollout.builtin.ops import rope_table


@dataclass
class _Fused:
    """A layer's projections laid side by side: q, k, v (and their biases) and gate, up."""

    qkv: torch.Tensor  # [(H + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor  # [2 I, hidden]


def fuse_projections(model: DecoderLM) -> list[_Fused]:
    """Move each layer's q/k/v and gate/up weights into one tensor each and make the parameters
    views of it: the parameters keep their names, shapes and objects (a weight update copies into
    them as into any parameter), and the forward multiplies by the fused tensor once. Addresses
    then stay fixed for the engine's life, which captured CUDA graphs need."""
    fused = []
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _side_by_side([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            bias = None
            if attn.q_proj.bias is not None:
                bias = _side_by_side([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
            gate_up = _side_by_side([mlp.gate_proj.weight, mlp.up_proj.weight])
            fused.append(_Fused(qkv, bias, gate_up))
    return fused


def _side_by_side(params: list[torch.Tensor]) -> torch.Tensor:
    whole = torch.cat([p.data for p in params], dim=0)
    start = 0
    for p in params:
        p.data = whole[start : start + p.shape[0]]
        start += p.shape[0]
    return whole


class PagedDecoder:
    def __init__(self, model: DecoderLM, cache: PagedKVCache, ops, fused: list[_Fused] | None = None):
        self.model, self.cache, self.ops, self.fused = model, cache, ops, fused
        cfg = model.config
        self.config = cfg
        self.eps = cfg.rms_norm_eps
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.rope = rope_table(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings,
                               model.model.embed_tokens.weight.device)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
               num_splits: int) -> torch.Tensor:
        """Logits [b, V] for one new token per row (int64 tokens [b] at int positions [b]); the
        token's key and value are written to the cache first, then attended to with the rest."""
        bs = self.cache.shape.block_size

        def attend(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = self.cache.layer(layer_index)
            q_norm, k_norm = self._qk_norms(layer_index)
            return self.ops.rope_decode_attention(q, k, v, q_norm, k_norm, self.eps, self.rope, positions, k_cache,
                                                  v_cache, block_tables, bs, num_splits)

        hidden = self._layers(tokens, attend)  # [b, hidden]
        return self.ops.output_linear(hidden, self.model.output_weight)

    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                out: torch.Tensor | None = None, after_layer=None) -> torch.Tensor:
        """Logits [G, V] at the last real token of each right-padded prompt (tokens [G, P],
        lengths [G]), after writing every prompt token's key and value to cache slots [G, P];
        written into `out` [G, V] if given. `after_layer(index)` is called after each layer's
        work is queued (the runner captures a prefill's first layer as a graph of its own)."""
        groups, length = tokens.shape
        positions = torch.arange(length, device=tokens.device).expand(groups, length).reshape(-1)

        def attend(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # The prompt's keys and values are written to the cache, and attended to as they are
            # (rotated keys, the product's values) as a dense right-padded batch: the same
            # values the cache now holds, for real tokens (padding goes to the trash block).
            k_cache, v_cache = self.cache.layer(layer_index)
            q_norm, k_norm = self._qk_norms(layer_index)
            flat = slots.reshape(-1).long()
            q, k = self.ops.qk_rope_cache(q, k, v, q_norm, k_norm, self.eps, self.rope, positions, flat, k_cache,
                                          v_cache)
            dim = self.config.head_dim
            out = self.ops.prefill_attention(q.view(groups, length, -1, dim), k.view(groups, length, -1, dim),
                                             v.view(groups, length, -1, dim))
            return out.reshape(groups * length, -1)

        # Only each prompt's last token needs the last layer's o product and MLP: every token's
        # key and value are in the cache once that layer has attended.
        wanted = torch.arange(groups, device=tokens.device) * length + lengths - 1
        last = self._layers(tokens.reshape(-1), attend, wanted, after_layer)  # [G, hidden]
        if out is None:
            return F.linear(last, self.model.output_weight)
        return torch.mm(last, self.model.output_weight.t(), out=out)

    def extend(self, tokens: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, tables: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """`prefill` of prompts whose first starts[g] tokens are in the cache already (a prefix
        cache hit): tokens [G, S] are the rest, right-padded (lengths [G] real), written to the
        cache at their positions of block tables [G, W] and attending to the whole prompt."""
        groups, length = tokens.shape
        bs = self.cache.shape.block_size
        offsets = torch.arange(length, device=tokens.device)
        positions = starts[:, None] + offsets  # [G, S]
        real = offsets[None, :] < lengths[:, None]
        positions = torch.where(real, positions, 0)
        slots = tables.gather(1, positions // bs).long() * bs + positions % bs
        slots = torch.where(real, slots, TRASH_BLOCK * bs + offsets % bs).reshape(-1)
        flat_positions = positions.reshape(-1)

        def attend(layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = self.cache.layer(layer_index)
            q_norm, k_norm = self._qk_norms(layer_index)
            q, _ = self.ops.qk_rope_cache(q, k, v, q_norm, k_norm, self.eps, self.rope, flat_positions, slots,
                                          k_cache, v_cache)
            dim = self.config.head_dim
            return self.ops.context_attention(q.view(groups, length, -1, dim), k_cache, v_cache, tables, starts,
                                              lengths, bs).reshape(groups * length, -1)

        wanted = torch.arange(groups, device=tokens.device) * length + lengths - 1
        last = self._layers(tokens.reshape(-1), attend, wanted)  # [G, hidden]
        if out is None:
            return F.linear(last, self.model.output_weight)
        return torch.mm(last, self.model.output_weight.t(), out=out)

    def _qk_norms(self, layer_index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Qwen3's per-head q and k norm weights (None for models without them)."""
        attn = self.model.model.layers[layer_index].self_attn
        return getattr(attn.q_norm, "weight", None), getattr(attn.k_norm, "weight", None)

    def _layers(self, tokens: torch.Tensor, attend, wanted: torch.Tensor | None = None,
                after_layer=None) -> torch.Tensor:
        """The decoder layers over tokens [T]; `attend(layer, q, k, v)` (the q/k/v product's
        outputs) rotates, stores keys and values, and attends: prefill and decode differ there.
        With `wanted` (indices [W] into T) the output is those tokens' hidden states [W, hidden],
        and the last layer's o product and MLP run on them alone."""
        eps, ops = self.eps, self.ops
        last_layer = len(self.model.model.layers) - 1
        # Row indexing, not F.embedding: the same rows, and on a GPU one gather kernel at every
        # batch (F.embedding of 16 tokens takes a small-index kernel: 7.5 against 1.5 us).
        x = self.model.model.embed_tokens.weight[tokens]  # [T, hidden]
        residual = None
        for index, layer in enumerate(self.model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            h, residual = ops.add_rmsnorm(x, residual, layer.input_layernorm.weight, eps)
            if self.fused is not None:
                qkv = ops.linear(h, self.fused[index].qkv, self.fused[index].qkv_bias)  # [T, (H + 2 Hkv) D]
                q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            else:
                q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            attended = attend(index, q, k, v)
            if wanted is not None and index == last_layer:
                attended, residual = attended[wanted], residual[wanted]
            x = ops.linear(attended, attn.o_proj.weight, attn.o_proj.bias)
            h, residual = ops.add_rmsnorm(x, residual, layer.post_attention_layernorm.weight, eps)
            if self.fused is not None:
                x = ops.gated_mlp(h, self.fused[index].gate_up, mlp.down_proj.weight, mlp.down_proj.bias)
            else:
                x = ops.silu_mul_linear(mlp.gate_proj(h), mlp.up_proj(h), mlp.down_proj.weight, mlp.down_proj.bias)
            if after_layer is not None:
                after_layer(index)
        h, _ = ops.add_rmsnorm(x, residual, self.model.model.norm.weight, eps)
        return h
