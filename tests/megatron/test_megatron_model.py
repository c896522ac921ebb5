"""The Megatron-core model against `DecoderLM`: weight round trips, logits and gradients under TP.

Multi-rank checks run in real processes over gloo (`torch.multiprocessing.spawn`); each spawn
checks all four model variants, since importing megatron costs seconds per process while the
tiny models cost milliseconds. The pure layout functions are tested on hand-built tensors.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from services.models import DecoderLM, ModelConfig, init_weights  # noqa: E402
from services.trainer import megatron_model as mm  # noqa: E402

pytestmark = pytest.mark.megatron

_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=127, max_position_embeddings=64)
VARIANTS = {
    "llama-tied": ModelConfig(architecture="llama", tie_word_embeddings=True, **_SHAPE),
    "llama-untied": ModelConfig(architecture="llama", tie_word_embeddings=False, **_SHAPE),
    "qwen2-bias": ModelConfig(architecture="qwen2", tie_word_embeddings=False, **_SHAPE),
    # head_dim 8: q/k/v widths differ from hidden_size, as in real Qwen3 models.
    "qwen3-qknorm": ModelConfig(architecture="qwen3", tie_word_embeddings=True, **(_SHAPE | {"head_dim": 8})),
}


def reference_model(config: ModelConfig, seed: int = 0) -> DecoderLM:
    """A DecoderLM whose every tensor is random, norms and biases included, so no layout hides."""
    torch.manual_seed(seed)
    model = DecoderLM(config)
    init_weights(model, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def padded_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, mask [3, 9]: right-padded rows of 9, 5 and 2 real tokens."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab_size, (3, 9), generator=gen)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for row, length in enumerate((9, 5, 2)):
        mask[row, :length] = 1
    return ids * mask, mask


def token_mean_ce(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over the real target tokens."""
    per_token = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    weights = mask[:, 1:].flatten().float()
    return (per_token * weights).sum() / weights.sum()


# ---------------------------------------------------------------------------------------------
# Process harness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, tp: int, check) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mm.init_parallel(tp, 1)
        check()
    finally:
        mm.destroy_parallel()
        dist.destroy_process_group()


def run_ranks(world_size: int, check, *, tp: int) -> None:
    """Run `check()` on `world_size` gloo ranks with tensor parallel size `tp`."""
    mp.spawn(_entry, args=(world_size, _free_port(), tp, check), nprocs=world_size, join=True)


def _megatron_copy(config: ModelConfig, reference: DecoderLM):
    model = mm.build_model(config, dtype=torch.float32, device=torch.device("cpu"))
    mm.load_hf_state(model, reference.state_dict(), config)
    return model


# ---------------------------------------------------------------------------------------------
# Multi-rank checks (module-level so spawn can pickle them)


def _check_round_trip() -> None:
    for name, config in VARIANTS.items():
        reference = reference_model(config)
        gathered = mm.gather_hf_state(_megatron_copy(config, reference), config)
        if dist.get_rank() != 0:
            assert gathered is None
            continue
        expected = reference.state_dict()
        assert gathered.keys() == expected.keys(), name
        for key, tensor in expected.items():
            assert torch.equal(gathered[key], tensor), f"{name}: {key} differs"


def _check_logits() -> None:
    for name, config in VARIANTS.items():
        reference = reference_model(config)
        ids, mask = padded_batch(config.vocab_size)
        model = _megatron_copy(config, reference)
        with torch.no_grad():
            got = mm.forward_logits(model, ids, mask, vocab_size=config.vocab_size)
            want = reference(ids, mask)
        real = mask.bool()
        assert got.shape == want.shape, name
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5, msg=name)


def _check_backward() -> None:
    for name, config in VARIANTS.items():
        reference = reference_model(config)
        ids, mask = padded_batch(config.vocab_size)
        model = _megatron_copy(config, reference)
        loss = token_mean_ce(mm.forward_logits(model, ids, mask, vocab_size=config.vocab_size), ids, mask)
        loss.backward()
        want_loss = token_mean_ce(reference(ids, mask), ids, mask)
        want_loss.backward()
        torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-6, msg=name)
        mm.finalize_grads(model, config)
        _assert_replicated_grads_agree(model, name)
        with torch.no_grad():  # gather the gradients by the weights' route
            for param in model.parameters():
                param.copy_(param.grad)
        grads = mm.gather_hf_state(model, config)
        if dist.get_rank() == 0:
            for key, param in reference.named_parameters():
                torch.testing.assert_close(grads[key], param.grad, atol=1e-5, rtol=1e-4, msg=f"{name}: {key}")


def _assert_replicated_grads_agree(model, name: str) -> None:
    """After finalize_grads, every replicated weight has the same gradient on every TP rank."""
    group = mm.parallel_state.get_tensor_model_parallel_group()
    for pname, param in model.named_parameters():
        if getattr(param, "tensor_model_parallel", False):
            continue
        copies = [torch.empty_like(param.grad) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, param.grad, group=group)
        for copy in copies[1:]:
            assert torch.equal(copy, copies[0]), f"{name}: {pname} grads differ across TP ranks"


def _stage_state(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return {
        f"model.layers.{rank}.mlp.down_proj.weight": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
        f"model.layers.{rank}.input_layernorm.weight": torch.randn(7, generator=gen),
        "model.norm.weight": torch.randn(1, 4, 2, generator=gen).to(torch.float16),
    }


def _check_state_transfer() -> None:
    """Pipeline stages' weights reach rank 0 as tensors plus a JSON header (no pickle)."""
    if dist.get_rank():
        mm.send_state(_stage_state(dist.get_rank()), dst=0)
        return
    for src in (1, 2):
        got, want = mm.recv_state(src, device=torch.device("cpu")), _stage_state(src)
        assert list(got) == list(want)
        for name, tensor in want.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


# ---------------------------------------------------------------------------------------------
# Tests


def test_stage_weights_travel_between_ranks_bit_for_bit():
    run_ranks(3, _check_state_transfer, tp=1)



def test_tp2_gathered_weights_equal_the_loaded_checkpoint():
    run_ranks(2, _check_round_trip, tp=2)


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_decoder(tp):
    run_ranks(tp, _check_logits, tp=tp)


def test_tp2_loss_and_grads_match_decoder():
    run_ranks(2, _check_backward, tp=2)


def test_qkv_shards_are_whole_query_groups():
    config = ModelConfig(architecture="llama", vocab_size=8, hidden_size=3, intermediate_size=4,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=2)
    # Row r of each projection holds the value r (q) / 100 + r (k) / 200 + r (v).
    q = torch.arange(8.0)[:, None].expand(8, 3)  # heads 0..3, 2 rows each
    k = 100 + torch.arange(4.0)[:, None].expand(4, 3)  # groups 0..1
    v = 200 + torch.arange(4.0)[:, None].expand(4, 3)
    shard0 = mm.to_megatron_shard(mm.Layout.QKV, [q, k, v], config, 0, 2)
    shard1 = mm.to_megatron_shard(mm.Layout.QKV, [q, k, v], config, 1, 2)
    # Group g = [q heads 2g, 2g+1; k_g; v_g].
    assert shard0[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201]
    assert shard1[:, 0].tolist() == [4, 5, 6, 7, 102, 103, 202, 203]
    back = mm.from_megatron_shards(mm.Layout.QKV, [shard0, shard1], config)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))
    bias = mm.to_megatron_shard(mm.Layout.QKV, [q[:, 0], k[:, 0], v[:, 0]], config, 1, 2)
    assert bias.tolist() == [4, 5, 6, 7, 102, 103, 202, 203]


def test_fc1_shards_pair_gate_and_up_halves():
    config = VARIANTS["llama-untied"]
    gate = torch.arange(4.0)[:, None]
    up = 10 + torch.arange(4.0)[:, None]
    shards = [mm.to_megatron_shard(mm.Layout.FC1, [gate, up], config, r, 2) for r in range(2)]
    assert [s[:, 0].tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    back = mm.from_megatron_shards(mm.Layout.FC1, shards, config)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_row_and_vocab_shards():
    config = VARIANTS["llama-untied"]  # vocab 127: padded to 128 for tp=2
    o_proj = torch.arange(12.0).view(3, 4)
    assert mm.to_megatron_shard(mm.Layout.ROW, [o_proj], config, 1, 2).tolist() == [[2, 3], [6, 7], [10, 11]]
    embed = torch.randn(127, 5)
    shards = [mm.to_megatron_shard(mm.Layout.VOCAB, [embed], config, r, 2) for r in range(2)]
    assert [s.shape[0] for s in shards] == [64, 64]
    assert torch.equal(shards[1][-1], torch.zeros(5))
    assert torch.equal(mm.from_megatron_shards(mm.Layout.VOCAB, shards, config)[0], embed)


def test_o_proj_bias_is_refused():
    config = VARIANTS["llama-untied"].replace(attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias"):
        mm.transformer_config(config, dtype=torch.float32, device=torch.device("cpu"), tp=1, pp=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pipeline parallelism is refused on CPU only")
def test_pipeline_parallel_is_refused_on_cpu():
    with pytest.raises(ValueError, match="pp: pipeline parallelism"):
        mm.init_parallel(1, 2)


def test_the_quiet_group_lookup_finds_the_same_group_without_warning(monkeypatch):
    """Megatron-core's RowParallelLinear asks for its group with None on every call, which warns
    (and, under torch.compile, split each layer into many graphs): the replacement answers the
    same group, silently."""
    import warnings

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    current = layers.get_tensor_model_parallel_group_if_none
    monkeypatch.setattr(layers, "get_tensor_model_parallel_group_if_none", getattr(current, "original", current))
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mm.init_parallel(1, 1)
        with warnings.catch_warnings(record=True) as before:
            warnings.simplefilter("always")
            expected = layers.get_tensor_model_parallel_group_if_none(None)
        mm.quiet_group_lookup()
        with warnings.catch_warnings(record=True) as after:
            warnings.simplefilter("always")
            got = layers.get_tensor_model_parallel_group_if_none(None)
        assert got is expected is parallel_state.get_tensor_model_parallel_group()
        assert any("tp_group is None" in str(w.message) for w in before) and not after
    finally:
        mm.destroy_parallel()
        dist.destroy_process_group()
