"""`named_weights` and `load_buckets_into`: what a checkpoint holds, and an all-or-nothing swap."""

import pytest
import torch
from torch import nn

from services.weights.apply import load_buckets_into, named_weights
from services.weights.buckets import pack_bucket, plan_buckets
from services.weights.errors import ManifestMismatch
from services.weights.grpc_stream import iter_chunks, receive
from services.weights.manifest import expected_layout, make_manifest, validate_against


class _Tiny(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(32, 8)
        self.block = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 32, bias=False)
        self.lm_head.weight = self.embed.weight  # tied
        self.block.to(torch.bfloat16)
        self.register_buffer("step", torch.tensor([seed], dtype=torch.int64))
        self.register_buffer("rope_cache", torch.randn(4), persistent=False)


def _transfer(src: nn.Module):
    named = named_weights(src)
    buckets = plan_buckets(named, bucket_bytes=512)
    flats = [pack_bucket(b, dict(named)) for b in buckets]
    manifest = make_manifest(1, "gpu", buckets, flats)
    return manifest, receive(iter_chunks(manifest, flats.__getitem__), manifest)


def test_named_weights_has_params_and_persistent_buffers_once():
    model = _Tiny(0)
    named = named_weights(model)
    names = [name for name, _ in named]
    # state_dict order: a module's own tensors before its children's.
    assert names == [
        "step", "embed.weight", "block.weight", "block.bias", "norm.weight", "norm.bias",
    ]
    params = [name for name, _ in model.named_parameters()]
    assert [n for n in names if n != "step"] == params  # same order, tied name dropped
    assert dict(named)["embed.weight"] is model.embed.weight


def test_load_copies_everything_and_keeps_ties():
    src, dst = _Tiny(1), _Tiny(2)
    manifest, buffers = _transfer(src)
    targets = dict(named_weights(dst))
    validate_against(manifest, expected_layout(targets.items()))
    num_bytes = load_buckets_into(targets, manifest, buffers)
    assert num_bytes == sum(t.numel() * t.element_size() for t in targets.values())
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), name
    assert dst.lm_head.weight is dst.embed.weight
    assert dst.embed.weight.requires_grad and dst.block.weight.dtype == torch.bfloat16


def test_mismatch_is_refused_before_any_copy():
    src, dst = _Tiny(1), _Tiny(2)
    manifest, buffers = _transfer(src)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    targets = dict(named_weights(dst))
    targets["norm.bias"] = torch.zeros(9)  # a later tensor does not fit
    with pytest.raises(ManifestMismatch, match=r"'norm.bias'.*float32\[8\].*float32\[9\]"):
        load_buckets_into(targets, manifest, buffers)
    del targets["norm.bias"]
    with pytest.raises(ManifestMismatch, match="'norm.bias'.*not in the model"):
        load_buckets_into(targets, manifest, buffers)
    with pytest.raises(ManifestMismatch, match="buffers"):
        load_buckets_into(dict(named_weights(dst)), manifest, buffers[:-1])
    for name, value in dst.state_dict().items():
        assert torch.equal(value, before[name]), name
