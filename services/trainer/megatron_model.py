"""The Megatron-core model behind the "megatron" trainer backend: build, run and convert weights.

`build_model` turns a `ModelConfig` (Llama / Qwen2 / Qwen3) into a Megatron `GPTModel` holding
this rank's tensor- and pipeline-parallel shard, from Megatron's local (Transformer-Engine-free)
layer spec, so the same code runs with megatron-core 0.16 on CPU over gloo and 0.19 on GPUs over
NCCL. Core attention is `SDPACoreAttention` on every device: Megatron's own local attention
needs CUDA buffers and materialises [b, heads, s, s] scores, while SDPA picks flash kernels on a
GPU. Weights enter and leave only in Hugging Face names and layouts (`load_hf_state`,
`gather_hf_state`), so checkpoints and the rollout engines never see Megatron's fused tensors;
the per-tensor layouts are pure functions (`to_megatron_shard`, `from_megatron_shards`) that
tests check without processes. The vocabulary is padded to a multiple of the tensor-parallel size
with zero rows that `forward_logits` and `gather_hf_state` cut off again.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from services.models.config import ModelConfig
from services.models.decoder import apply_rope, rope_cos_sin
from services.trainer.swiglu import FusedSwiGLU

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


class Layout(enum.Enum):
    """How one Megatron parameter is cut from (and glued back into) its Hugging Face tensors."""

    REPLICATED = "replicated"  # every TP rank holds the whole tensor (norms)
    ROW = "row"  # split on dim 1 (row-parallel inputs: o_proj, down_proj)
    VOCAB = "vocab"  # split on dim 0 after padding the vocabulary (embedding, lm_head)
    QKV = "qkv"  # fused [q_g; k_g; v_g] per query group, split by groups
    FC1 = "fc1"  # SwiGLU: shard i is [gate_i; up_i]


# Megatron name suffix inside `decoder.layers.<i>.` → (HF name suffixes in `model.layers.<i>.`, layout)
_LAYER_PARAMS = {
    "input_layernorm.weight": (("input_layernorm.weight",), Layout.REPLICATED),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        Layout.QKV,
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        Layout.QKV,
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), Layout.REPLICATED),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), Layout.REPLICATED),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), Layout.ROW),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), Layout.REPLICATED),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), Layout.FC1),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), Layout.ROW),
}
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


# ---------------------------------------------------------------------------------------------
# Process groups


def init_parallel(tp: int, pp: int, *, seed: int = 0) -> None:
    """Create Megatron's model-parallel groups over the already initialised default group.

    `seed` seeds Megatron's CUDA RNG tracker (used for dropout and init under TP); CUDA only.

    Pipeline parallelism is refused on CPU. In megatron-core 0.16.1 every pipeline schedule
    allocates `torch.zeros([], dtype=torch.int, device="cuda")` (`pipeline_parallel/schedules.py`
    lines 596 and 2138) and p2p buffers use `torch.cuda.current_device()`; with tied embeddings
    `GPTModel.__init__` already fails in `setup_embeddings_and_output_layer` at
    `weight.data = weight.data.cuda()` (`language_module.py:244`), both with
    "AssertionError: Torch not compiled with CUDA enabled".
    """
    if tp < 1 or pp < 1:
        raise ValueError(f"tp, pp: must be positive, got tp={tp}, pp={pp}")
    if pp > 1 and not torch.cuda.is_available():
        raise ValueError(
            f"pp: pipeline parallelism ({pp}) needs CUDA; megatron-core's pipeline schedules "
            "and tied-embedding setup allocate CUDA tensors unconditionally"
        )
    world_size = dist.get_world_size()
    if world_size % (tp * pp):
        raise ValueError(f"tp * pp = {tp * pp} does not divide the world size {world_size}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Drop Megatron's groups (the default group stays; the caller owns it)."""
    parallel_state.destroy_model_parallel()


# ---------------------------------------------------------------------------------------------
# Model


class SDPACoreAttention(MegatronModule):
    """Rotary embedding and causal core attention through `scaled_dot_product_attention`, with
    Megatron's core-attention signature.

    RoPE is applied here rather than by Megatron (the model is built without position embedding):
    with cos and sin read from tables made once per model (`rope`, the torch backend's own
    `rope_cos_sin` at positions 0..max-1) and the torch backend's `apply_rope`, so both backends
    round alike. Megatron's own path recomputed cos and sin of every element in every layer (in
    its compiled kernels: 10 ms of a 1.5B step on an H200, against about 3 for the torch backend's
    RoPE). Head counts come from the tensors, which
    hold only this TP rank's heads, so the module needs no process group (whose constructor
    argument differs between Megatron versions). Only causal masking without an explicit mask is
    supported: `forward_logits` takes right-padded batches, for which causal attention alone is
    exact on every real token, at positions 0..T-1.
    """

    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [max_positions, D]; set per model

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type: only causal attention is supported, got {attn_mask_type}")
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,  # [S, B, heads, D]
        key: torch.Tensor,  # [S, B, groups, D]
        value: torch.Tensor,  # [S, B, groups, D]
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> torch.Tensor:  # [S, B, heads * D]
        assert attention_mask is None and attention_bias is None and packed_seq_params is None, (
            "SDPACoreAttention supports plain causal attention only"
        )
        seq, batch = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, heads, S, D]
        if self.rope is not None:
            cos, sin = (table[:seq] for table in self.rope)  # [S, D]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [B, heads, S, D]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def rope_tables(config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, D] in `dtype`, as the torch backend computes them."""
    positions = torch.arange(config.max_position_embeddings, device=device)[None]  # [1, P]
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta, dtype)  # [1, 1, P, D]
    return cos[0, 0], sin[0, 0]


def padded_vocab_size(config: ModelConfig, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of `tp_size` (VocabParallelEmbedding needs it)."""
    return -(-config.vocab_size // tp_size) * tp_size


def transformer_config(
    config: ModelConfig, *, dtype: torch.dtype, device: torch.device, tp: int, pp: int
) -> TransformerConfig:
    """Megatron's config for `config`; raises ValueError for what Megatron cannot express."""
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype: {dtype} is not one of {', '.join(map(str, _SUPPORTED_DTYPES))}")
    if config.o_proj_bias:
        # Megatron biases o_proj only through add_bias_linear, which also biases both MLP
        # projections; HF llama/qwen3 with attention_bias has no MLP biases.
        raise ValueError(
            f"attention_bias: {config.architecture} with attention_bias biases o_proj, which "
            "Megatron can only express together with MLP biases"
        )
    if config.num_key_value_heads % tp:
        raise ValueError(
            f"num_key_value_heads: {config.num_key_value_heads} is not divisible by tp={tp}"
        )
    if config.num_hidden_layers % pp:
        raise ValueError(f"num_hidden_layers: {config.num_hidden_layers} is not divisible by pp={pp}")
    return TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        # Megatron's hook for an activation module of one's own (named after Transformer Engine's,
        # which is not installed): the MLP then calls `FusedSwiGLU` on its fused fc1 output.
        use_te_activation_func=True,
        # The shared losses divide by the whole batch's token count: data-parallel gradients add
        # up. (Megatron's DDP would otherwise average them, dividing by the ranks a second time.)
        calculate_per_token_loss=True,
        add_bias_linear=False,
        add_qkv_bias=bool(config.attention_bias),
        qk_layernorm=bool(config.qk_norm),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu",
        # Kept on although load_hf_state overwrites every weight: Megatron's init functions are
        # what set the `tensor_model_parallel` / `partition_dim` attributes that its grad-norm
        # and clipping code read.
        perform_initialization=True,
    )


def quiet_group_lookup() -> None:
    """Megatron-core's RowParallelLinear hands its matmul tp_group=None on every call (0.19), and
    the group lookup then warns on rank 0 each time. Under torch.compile a warning cannot stay in
    the graph, so it split every layer into about ten graphs; this is the same lookup, silent."""
    from megatron.core.tensor_parallel import layers

    original = layers.get_tensor_model_parallel_group_if_none
    if getattr(original, "quiet", False):
        return

    def lookup(tp_group=None, is_expert=False, check_initialized=True):
        if tp_group is None and dist.is_initialized() and parallel_state.is_initialized():
            get = parallel_state.get_expert_tensor_parallel_group if is_expert else \
                parallel_state.get_tensor_model_parallel_group
            return get(check_initialized=check_initialized)
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    lookup.quiet, lookup.original = True, original
    layers.get_tensor_model_parallel_group_if_none = lookup


def build_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> GPTModel:
    """This rank's shard of the model, randomly initialised (fill it with `load_hf_state`).

    Megatron creates its parallel linears on the CPU when `device` is the CPU, else on the
    current CUDA device, which the caller must have set to `device`.
    """
    device = torch.device(device)
    if device.type == "cuda" and (device.index or 0) != torch.cuda.current_device():
        raise ValueError(
            f"device: {device} is not the current CUDA device {torch.cuda.current_device()}"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tcfg = transformer_config(config, dtype=dtype, device=device, tp=tp, pp=pp)
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=bool(config.qk_norm))
    # A subclass per model carries this model's RoPE tables (one pair shared by every layer).
    core_attention = type("SDPACoreAttention", (SDPACoreAttention,),
                          {"rope": rope_tables(config, dtype=dtype, device=device)})
    layer_spec.submodules.self_attention.submodules.core_attention = core_attention
    _mlp_submodules(layer_spec).activation_func = FusedSwiGLU  # read with use_te_activation_func
    # An explicit block spec keeps the final norm a torch RMSNorm even where apex is installed
    # (Megatron would otherwise pick apex's FusedLayerNorm for it).
    block_spec = TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(tcfg), layer_norm=WrappedTorchNorm
    )
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=block_spec,
        vocab_size=padded_vocab_size(config, tp),
        max_sequence_length=config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # Vocab shards are gathered by forward_logits: Megatron's own gather allocates on CUDA.
        parallel_output=True,
        share_embeddings_and_output_weights=config.tie_word_embeddings,
        position_embedding_type="none",  # RoPE is applied by SDPACoreAttention
    )
    if model.post_process:
        _batch_major_logits(model)
    # Megatron's parallel linears are born on the CUDA device in `dtype`, but its torch norms on
    # the CPU in float32; Megatron-LM moves and casts the whole model afterwards (Float16Module)
    # too. RoPE's inv_freq is a plain attribute, so it stays float32.
    return model.to(device=device, dtype=dtype)


def _mlp_submodules(layer_spec):
    """The MLP's `MLPSubmodules` in a layer spec: a ModuleSpec's field in megatron-core 0.16, a
    keyword of the `functools.partial` that builds the MLP in 0.19."""
    mlp = layer_spec.submodules.mlp
    return mlp.submodules if hasattr(mlp, "submodules") else mlp.keywords["submodules"]


def _batch_major_logits(model: GPTModel) -> None:
    """Make the output layer lay its logits out batch-major in memory, returned as the [S, B, V]
    view Megatron expects: GPTModel's final `transpose(0, 1).contiguous()` then copies nothing.
    (Before, the 16k x 152k bf16 logits were copied to [B, S, V] and their gradient copied back:
    about 25 ms of a 1.5B step on an H200.) Same product, same gradients: the input goes through
    `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of its gradient across
    the tensor-parallel group), as ColumnParallelLinear's own path does; the vocabulary shards
    stay unreduced (`parallel_output`), for `forward_logits` to gather."""
    layer = model.output_layer
    assert layer.bias is None and not layer.sequence_parallel

    def forward(input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        hidden = input_.transpose(0, 1).contiguous()  # [B, S, H]
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            # After the transpose: Megatron's all-reduce of this gradient assumes it contiguous.
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
        logits = F.linear(hidden, layer.weight if weight is None else weight)  # [B, S, V/tp]
        return logits.transpose(0, 1), None  # [S, B, V/tp], a view

    layer.forward = forward


def forward_logits(
    model: GPTModel,
    input_ids: torch.Tensor,  # LongTensor [B, T]
    attention_mask: torch.Tensor,  # [B, T], 1 = real token, right-padded
    *,
    vocab_size: int,
) -> torch.Tensor:  # [B, T, vocab_size]
    """Full-vocabulary logits on every TP rank (pipeline parallel size 1 only), in the model's dtype.

    Positions are 0..T-1, so rows must be right-padded: causal attention then never lets a real
    token see padding. Outputs at padding positions are meaningless.
    """
    assert parallel_state.get_pipeline_model_parallel_world_size() == 1, "forward_logits: pp=1 only"
    mask = attention_mask.bool()
    if not bool((mask[:, 1:] <= mask[:, :-1]).all()):
        raise ValueError("attention_mask: rows must be right-padded (real tokens first)")
    logits = model(input_ids=input_ids, position_ids=None, attention_mask=None)  # [B, T, Vpad/tp]
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = _GatherVocab.apply(logits, parallel_state.get_tensor_model_parallel_group())
    return logits[..., :vocab_size]  # [B, T, V], in the model's dtype


def finalize_grads(model: GPTModel, config: ModelConfig) -> None:
    """Complete the gradients that backward leaves partial; call it before clipping or stepping.

    Megatron does this in `finalize_model_grads`, which needs its DDP wrapper (CUDA only):
    - the q/k layernorm weights are replicated, but each TP rank normalises only its own heads,
      so each rank holds a partial sum of their gradient (other replicated weights, the
      layer norms, already have identical full gradients on every TP rank);
    - with pp > 1 and tied embeddings, the first stage's embedding and the last stage's copy
      of it each hold part of the gradient.
    """
    if config.qk_norm and parallel_state.get_tensor_model_parallel_world_size() > 1:
        partial = [
            param.grad
            for name, param in model.named_parameters()
            if param.grad is not None and name.endswith(("q_layernorm.weight", "k_layernorm.weight"))
        ]
        flat = torch.cat([g.flatten() for g in partial])
        dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
        for grad, summed in zip(partial, flat.split([g.numel() for g in partial]), strict=True):
            grad.copy_(summed.view_as(grad))
    if (
        config.tie_word_embeddings
        and parallel_state.get_pipeline_model_parallel_world_size() > 1
        and parallel_state.is_rank_in_embedding_group()
    ):
        weight = model.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


class _GatherVocab(torch.autograd.Function):
    """All-gather vocab shards [..., V/tp] into [..., V]; the backward keeps this rank's slice.

    Every TP rank computes the same loss from the same full logits, so the gradient of the full
    logits is already complete on each rank and needs no reduction.
    """

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = grad.chunk(dist.get_world_size(ctx.group), dim=-1)
        return parts[dist.get_rank(ctx.group)].contiguous(), None


# ---------------------------------------------------------------------------------------------
# Per-tensor layouts (pure)


def to_megatron_shard(
    layout: Layout,
    hf_tensors: Sequence[torch.Tensor],
    config: ModelConfig,
    tp_rank: int,
    tp_size: int,
) -> torch.Tensor:
    """The TP shard `tp_rank` of the Megatron tensor made from `hf_tensors` (in `_LAYER_PARAMS` order)."""
    if layout is Layout.REPLICATED:
        return hf_tensors[0]
    if layout is Layout.ROW:
        return hf_tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if layout is Layout.VOCAB:
        full = hf_tensors[0]  # [V, H]
        pad = padded_vocab_size(config, tp_size) - full.shape[0]
        return F.pad(full, (0, 0, 0, pad)).chunk(tp_size, dim=0)[tp_rank]
    if layout is Layout.FC1:
        gate, up = (t.chunk(tp_size, dim=0)[tp_rank] for t in hf_tensors)
        return torch.cat((gate, up), dim=0)
    assert layout is Layout.QKV
    groups = _qkv_groups(*hf_tensors, config)  # [G, (heads_per_group + 2) * D, ...]
    return groups.chunk(tp_size, dim=0)[tp_rank].flatten(0, 1)


def from_megatron_shards(
    layout: Layout, shards: Sequence[torch.Tensor], config: ModelConfig
) -> list[torch.Tensor]:
    """The Hugging Face tensors (in `_LAYER_PARAMS` order) that the TP `shards` were cut from."""
    if layout is Layout.REPLICATED:
        return [shards[0]]
    if layout is Layout.ROW:
        return [torch.cat(shards, dim=1)]
    if layout is Layout.VOCAB:
        return [torch.cat(shards, dim=0)[: config.vocab_size]]
    if layout is Layout.FC1:
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
        return [torch.cat(gates, dim=0), torch.cat(ups, dim=0)]
    assert layout is Layout.QKV
    num_groups, head_dim = config.num_key_value_heads, config.head_dim
    q_rows = config.num_attention_heads // num_groups * head_dim
    full = torch.cat(shards, dim=0)
    groups = full.view(num_groups, q_rows + 2 * head_dim, *full.shape[1:])
    q, k, v = groups.split((q_rows, head_dim, head_dim), dim=1)
    return [t.flatten(0, 1) for t in (q, k, v)]


def _qkv_groups(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig
) -> torch.Tensor:
    """q [heads * D, ...], k and v [G * D, ...] → [G, (heads/G + 2) * D, ...] as [q_g; k_g; v_g]."""
    num_groups = config.num_key_value_heads
    rest = q.shape[1:]
    return torch.cat(
        (
            q.reshape(num_groups, -1, *rest),
            k.reshape(num_groups, -1, *rest),
            v.reshape(num_groups, -1, *rest),
        ),
        dim=1,
    )


def hf_names_and_layout(
    megatron_name: str, layer_index: int | None, config: ModelConfig
) -> tuple[tuple[str, ...], Layout]:
    """HF names behind one Megatron parameter; `layer_index` is the global layer of a layer param."""
    match = _LAYER_NAME.fullmatch(megatron_name)
    if match is not None:
        assert layer_index is not None
        suffixes, layout = _LAYER_PARAMS[match.group(2)]
        return tuple(f"model.layers.{layer_index}.{s}" for s in suffixes), layout
    if megatron_name == "embedding.word_embeddings.weight":
        return ("model.embed_tokens.weight",), Layout.VOCAB
    if megatron_name == "output_layer.weight":
        # Only on the last pipeline stage of a tied model with pp > 1 is this a tied copy.
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        return (head,), Layout.VOCAB
    if megatron_name == "decoder.final_layernorm.weight":
        return ("model.norm.weight",), Layout.REPLICATED
    raise AssertionError(f"no Hugging Face name for Megatron parameter {megatron_name!r}")


def _param_map(
    model: GPTModel, config: ModelConfig
) -> list[tuple[torch.nn.Parameter, tuple[str, ...], Layout]]:
    """Every parameter of this rank with its HF names and layout, in a rank-independent order."""
    entries = []
    for name, param in model.named_parameters():
        match = _LAYER_NAME.fullmatch(name)
        # layer_number is Megatron's 1-based global index, so pipeline offsets come for free.
        layer_index = None if match is None else model.decoder.layers[int(match.group(1))].layer_number - 1
        entries.append((param, *hf_names_and_layout(name, layer_index, config)))
    return entries


# ---------------------------------------------------------------------------------------------
# Conversion over processes


@torch.no_grad()
def load_hf_state(model: GPTModel, hf_state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Copy this rank's shards out of a full HF state dict (e.g. `DecoderLM.state_dict()`)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for param, names, layout in _param_map(model, config):
        missing = [n for n in names if n not in hf_state]
        if missing:
            raise ValueError(f"hf_state: missing tensor {missing[0]!r}")
        shard = to_megatron_shard(layout, [hf_state[n] for n in names], config, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(
                f"hf_state: {', '.join(names)} give a shard of shape {list(shard.shape)}, "
                f"the model expects {list(param.shape)}"
            )
        param.copy_(shard)


@torch.no_grad()
def gather_hf_state(model: GPTModel, config: ModelConfig) -> dict[str, torch.Tensor] | None:
    """The full HF-named state dict on global rank 0 (None elsewhere); a collective on every rank.

    TP shards are all-gathered inside each pipeline stage; with pp > 1 each stage's TP rank 0
    of the first data-parallel replica then sends its part to global rank 0 (tensors only). The
    result is bit-for-bit what `load_hf_state` was given (tensors on the parameters' device).
    """
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    state: dict[str, torch.Tensor] = {}
    for param, names, layout in _param_map(model, config):
        if layout is Layout.REPLICATED or tp_size == 1:
            shards = [param.detach()]
        else:
            shards = [torch.empty_like(param) for _ in range(tp_size)]
            dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
        tensors = from_megatron_shards(layout, shards, config)
        # A tied output layer on the last stage repeats the embedding: keep the first stage's.
        state.update({n: t.clone() for n, t in zip(names, tensors, strict=True) if n not in state})
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        return _gather_stages(state)
    return state if dist.get_rank() == 0 else None


def _gather_stages(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Merge each pipeline stage's part on global rank 0 (the first stage's TP rank 0).

    Tensors only travel (`send_state` / `recv_state`): no pickled objects between ranks."""
    senders = parallel_state.get_tensor_model_parallel_rank() == 0 and (
        parallel_state.get_data_parallel_rank() == 0
    )
    if not senders:
        return None
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_rank() != 0:
        send_state(state, dst=0, group=pp_group)
        return None
    merged = dict(state)
    device = next(iter(state.values())).device
    for src in dist.get_process_group_ranks(pp_group):
        if src != 0:
            merged.update({n: t for n, t in recv_state(src, group=pp_group, device=device).items() if n not in merged})
    return merged


def send_state(state: dict[str, torch.Tensor], *, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send named tensors to global rank `dst`: a JSON header (names, dtypes, shapes) as bytes in
    a uint8 tensor, its length first, then each tensor. The receiver calls `recv_state`."""
    device = next(iter(state.values())).device
    header = json.dumps([[n, str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in state.items()])
    raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8).to(device)
    dist.send(torch.tensor([raw.numel()], dtype=torch.int64, device=device), dst=dst, group=group)
    dist.send(raw, dst=dst, group=group)
    for tensor in state.values():
        dist.send(tensor.contiguous(), dst=dst, group=group)


def recv_state(src: int, *, group: dist.ProcessGroup | None = None, device: torch.device) -> dict[str, torch.Tensor]:
    """Receive what `send_state` sent from global rank `src`, onto `device`."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src=src, group=group)
    raw = torch.empty(int(length), dtype=torch.uint8, device=device)
    dist.recv(raw, src=src, group=group)
    state = {}
    for name, dtype, shape in json.loads(raw.cpu().numpy().tobytes().decode()):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"recv_state: rank {src} sent {name!r} with an unknown dtype {dtype!r}")
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.recv(tensor, src=src, group=group)
        state[name] = tensor
    return state
