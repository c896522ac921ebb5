"""A plain-PyTorch Llama / Qwen2 / Qwen3 decoder whose parameters carry Hugging Face names.

`DecoderLM` is the model both the trainer and the built-in rollout engine run, so weights move
between them and to or from a Hugging Face checkpoint as a bare `state_dict` with no renaming.
Its forward follows transformers numerically (RMSNorm upcast to float32, rotate-half RoPE computed
in float32, SiLU-gated MLP, grouped-query attention through `scaled_dot_product_attention`) and
accepts left padding: positions default to the running count of real tokens, so a left-padded row
sees the same positions as the unpadded prompt. `KVCache` holds preallocated keys and values for
incremental decoding; a prefill followed by one-token steps reproduces the full forward. The module
knows nothing about training or serving.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.models.config import ModelConfig

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` → `torch.bfloat16`; a `torch.dtype` passes through."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {', '.join(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[name]


class KVCache:
    """Preallocated keys/values of every layer plus the attention mask of the cached positions.

    All rows share one write position `pos` (prompts are left-padded), so a step of T tokens
    writes slots [pos, pos + T) of every row. `mask[b, s]` says whether slot s of row b holds a
    real token; padding slots are never attended to.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.mask = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # [B, L]
        self.max_len = max_len
        self.pos = 0

    @classmethod
    def for_model(cls, model: DecoderLM, *, batch_size: int, max_len: int) -> KVCache:
        weight = model.model.embed_tokens.weight
        cfg = model.config
        return cls(
            num_layers=cfg.num_hidden_layers,
            batch_size=batch_size,
            num_kv_heads=cfg.num_key_value_heads,
            max_len=max_len,
            head_dim=cfg.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, D] at `pos`; return all cached k, v [B, Hkv, pos + T, D]."""
        end = self.pos + k.shape[2]
        self.keys[layer][:, :, self.pos : end] = k
        self.values[layer][:, :, self.pos : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` (LongTensor [B']), e.g. to drop finished sequences."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.mask = self.mask.index_select(0, rows)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 and cast back before the weight, exactly as transformers does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, D] for LongTensor positions [B, T] (computed in float32)."""
    device = position_ids.device
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    freqs = position_ids.float()[:, :, None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos, sin [B, 1, T, D]."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_dim = self.num_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        bias = bool(config.attention_bias)
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, 1, T, D]
        sin: torch.Tensor,  # [B, 1, T, D]
        attn_mask: torch.Tensor | None,  # bool [B, 1, T, S] or None for plain causal
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        v = v.transpose(1, 2)  # [B, Hkv, T, D]
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # [B, Hkv, S, D]
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=attn_mask is None and seq > 1,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, 1, T, D]
        sin: torch.Tensor,  # [B, 1, T, D]
        attn_mask: torch.Tensor | None,  # bool [B, 1, T, S]
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def _embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding, initialised as it initialises itself (normal), except on the meta device:
    there `normal_` is a Python decomposition whose first use imports sympy, 1.4-1.9 s of every
    process's first model load (checkpoints are loaded through a meta-device model)."""
    embedding = nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    if not embedding.weight.is_meta:
        with torch.no_grad():
            nn.init.normal_(embedding.weight)
    return embedding


class DecoderBody(nn.Module):
    """Embeddings, layers and final norm: the `model.` prefix of the HF parameter names."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderLM(nn.Module):
    """Causal LM over `ModelConfig`; `state_dict()` keys are the Hugging Face ones.

    With tied embeddings there is no `lm_head` parameter at all: the output projection reuses
    `model.embed_tokens.weight`, so state_dict and named_parameters list only the embedding.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """The [V, hidden] output projection (the embedding when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # LongTensor [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, T], 1 = real token, 0 = padding
        position_ids: torch.Tensor | None = None,  # LongTensor [B, T]
        kv_cache: KVCache | None = None,
        *,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Logits [B, T, V] (or [B, logits_to_keep, V] for the last positions only).

        With `kv_cache`, `input_ids` and `attention_mask` cover only the new tokens; they are
        appended after the cached ones and the cache advances by T. Padding may sit anywhere
        (left padding is the intended use); outputs at padding positions are meaningless.
        """
        x = self.hidden_states(input_ids, attention_mask, position_ids, kv_cache, logits_to_keep=logits_to_keep)
        return F.linear(x, self.output_weight)  # [B, T, V]

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # LongTensor [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, T], 1 = real token, 0 = padding
        position_ids: torch.Tensor | None = None,  # LongTensor [B, T]
        kv_cache: KVCache | None = None,
        *,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """The final-norm hidden states [B, T, hidden] that `forward` projects to logits (a
        value head reads them instead); arguments as in `forward`."""
        batch, seq = input_ids.shape
        past = 0 if kv_cache is None else kv_cache.pos
        if kv_cache is not None and past + seq > kv_cache.max_len:
            raise ValueError(
                f"kv_cache: {past} cached + {seq} new tokens exceed max_len={kv_cache.max_len}"
            )
        new_mask = None if attention_mask is None else attention_mask.bool()  # [B, T]
        if kv_cache is not None:
            kv_cache.mask[:, past : past + seq] = True if new_mask is None else new_mask
            key_mask = kv_cache.mask[:, : past + seq]  # [B, S]
        else:
            key_mask = new_mask
        if position_ids is None:
            if key_mask is None:
                position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
            else:
                position_ids = (key_mask.long().cumsum(-1) - 1)[:, past:].clamp(min=0)
        attn_mask = None if key_mask is None else _attention_mask(key_mask, past, seq)

        x = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn_mask, kv_cache)
        if kv_cache is not None:
            kv_cache.pos += seq
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        return self.model.norm(x)  # [B, T, hidden]


def _attention_mask(key_mask: torch.Tensor, past: int, seq: int) -> torch.Tensor | None:
    """Causal ∧ key-is-real, bool [B, 1, T, S] for queries at slots [past, past + T).

    None where plain causal attention is already exact, so SDPA may pick its fused kernels:
    a fresh sequence with no padding or only right padding (padding keys then come after every
    real query), and a one-token step whose keys are all real. Otherwise each query may always
    see its own slot: a padding query would have no key at all, and SDPA returns NaN for such
    rows, which then leaks through 0 * NaN into real rows.
    """
    if past == 0 and bool((key_mask[:, 1:] <= key_mask[:, :-1]).all()):
        return None
    if seq == 1 and bool(key_mask.all()):
        return None
    device = key_mask.device
    q_pos = torch.arange(past, past + seq, device=device)[:, None]  # [T, 1]
    k_pos = torch.arange(past + seq, device=device)[None, :]  # [1, S]
    mask = (k_pos <= q_pos) & key_mask[:, None, :]  # [B, T, S]
    mask |= k_pos == q_pos
    return mask[:, None]


@torch.no_grad()
def init_weights(model: DecoderLM, seed: int) -> None:
    """Random init: Normal(0, 0.02) for matrices and embeddings, zero biases, unit norms."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.02
            param.copy_(values.to(param.dtype))
