"""An engine taking updates into its own staging: the first adopts the buffers, later ones of the
same layout swap memory with them. Receiving must never write the weights being served, and a
released-and-resumed engine must take a full update again."""

from __future__ import annotations

import pytest
import torch

from services.models.decoder import DecoderLM, init_weights
from services.rollout import engine as engine_module
from services.rollout.engine import RolloutEngine, RolloutSettings
from services.rollout.receiver import Staging
from services.weights.apply import named_weights
from services.weights.buckets import pack_bucket, plan_buckets
from services.weights.manifest import make_manifest, manifest_to_proto

BUCKET_BYTES = 64 << 10  # a few buckets for the tiny model


def _trainer_weights(engine: RolloutEngine, seed: int) -> dict[str, torch.Tensor]:
    model = DecoderLM(engine.model_config)
    init_weights(model, seed=seed)
    return {name: t.detach().clone() for name, t in named_weights(model)}


def _packed(weights: dict[str, torch.Tensor], version: int, bucket_bytes: int = BUCKET_BYTES):
    buckets = plan_buckets(list(weights.items()), bucket_bytes)
    flats = [pack_bucket(b, weights) for b in buckets]
    return make_manifest(version, "gpu", buckets, flats, "xxh3"), flats


def _update(engine: RolloutEngine, staging: Staging, weights, version: int, bucket_bytes: int = BUCKET_BYTES):
    """What UpdateWeights does for a staged plane: read the manifest, receive, apply, hand back."""
    manifest, flats = _packed(weights, version, bucket_bytes)
    manifest = engine.read_manifest(manifest_to_proto(manifest))
    buffers = staging.buffers(manifest)
    for buffer, flat in zip(buffers, flats):
        buffer.copy_(flat)
    engine.apply(manifest, buffers, adopt=True, owned=True)
    staging.adopted(buffers, kept=engine.holds_buffers)
    return buffers, flats


def _serves(engine: RolloutEngine, weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t.cpu(), weights[name]) for name, t in named_weights(engine.model))


@pytest.mark.parametrize("can_swap", [True, False], ids=["swap", "adopt-per-tensor"])
def test_later_updates_swap_memory_and_receiving_never_touches_served_weights(tiny_model_dir, monkeypatch, can_swap):
    monkeypatch.setattr(engine_module, "_CAN_SWAP", can_swap and engine_module._CAN_SWAP)  # torch < 2.13 cannot
    engine = RolloutEngine(RolloutSettings(model_path=str(tiny_model_dir)))
    staging = Staging(engine.device)
    w1, w2, w3 = (_trainer_weights(engine, seed) for seed in (1, 2, 3))

    first, _ = _update(engine, staging, w1, 1)
    assert not engine.swapped and _serves(engine, w1)
    second, old = _update(engine, staging, w2, 2)
    assert engine.swapped == engine_module._CAN_SWAP and _serves(engine, w2) and engine.weight_version == 2
    if engine.swapped:  # the buffers just received now hold version 1's bytes, and take the next update
        assert all(torch.equal(b, f) for b, f in zip(second, _packed(w1, 1)[1]))
    receiving = staging.buffers(_packed(w3, 3)[0])
    expected = second if engine.swapped else first
    assert all(r is e for r, e in zip(receiving, expected))
    for buffer in receiving:
        buffer.fill_(0xAB)  # a receive in progress
    assert _serves(engine, w2)
    _update(engine, staging, w3, 3)
    assert engine.swapped == engine_module._CAN_SWAP and _serves(engine, w3)
    _update(engine, staging, w1, 4)  # back into the first set: per tensor, from the plan kept for it
    assert _serves(engine, w1)
    prompts = [[3, 4, 5]]
    reference = RolloutEngine(RolloutSettings(model_path=str(tiny_model_dir)))
    _update(reference, Staging(reference.device), w3, 3)
    from services.rollout.torch_engine import Sampling
    greedy = Sampling(temperature=0.0, max_new_tokens=6)
    assert engine.generate(prompts, greedy)[0][0].output_ids == reference.generate(prompts, greedy)[0][0].output_ids


def test_an_update_of_another_layout_and_a_released_engine_take_the_full_path(tiny_model_dir):
    engine = RolloutEngine(RolloutSettings(model_path=str(tiny_model_dir)))
    staging = Staging(engine.device)
    w1, w2, w3 = (_trainer_weights(engine, seed) for seed in (4, 5, 6))
    _update(engine, staging, w1, 1)
    _update(engine, staging, w2, 2, bucket_bytes=BUCKET_BYTES // 2)  # other buckets: adopted tensor by tensor
    assert not engine.swapped and _serves(engine, w2)
    engine.release_memory(["weights"])
    staging.clear()
    engine.resume_memory(["weights"])
    _update(engine, staging, w3, 3, bucket_bytes=BUCKET_BYTES // 2)
    assert not engine.swapped and _serves(engine, w3) and engine.serving
    _update(engine, staging, w1, 4, bucket_bytes=BUCKET_BYTES // 2)
    assert engine.swapped == engine_module._CAN_SWAP and _serves(engine, w1)


def test_staging_never_hands_out_the_set_the_model_holds_whatever_list_comes_back(tiny_model_dir):
    """Receivers hand back copies of the buffer list (the grpc_stream receiver did): the set
    the model adopted must still be known, or the next update is written into live weights."""
    engine = RolloutEngine(RolloutSettings(model_path=str(tiny_model_dir)))
    staging = Staging(engine.device)
    manifest, _ = _packed(_trainer_weights(engine, 7), 1)
    first = staging.buffers(manifest)
    staging.adopted(list(first), kept=True)  # adopted tensor by tensor: the model holds `first` now
    second = staging.buffers(manifest)
    assert not any(a is b for a, b in zip(first, second))
    staging.adopted(list(second), kept=False)  # swapped: `second` holds the previous weights
    assert all(a is b for a, b in zip(staging.buffers(manifest), second))
    with pytest.raises(AssertionError, match="not the set handed out"):
        staging.adopted(list(first), kept=True)


def _shm_update(engine: RolloutEngine, weights, version: int) -> None:
    """What UpdateWeights does for shm on a CPU engine: the trainer's segments (not staging, not
    owned by the engine) become the weights."""
    manifest, flats = _packed(weights, version)
    engine.apply(engine.read_manifest(manifest_to_proto(manifest)), flats, adopt=True)


@pytest.mark.parametrize("can_swap", [True, False], ids=["swap", "adopt-per-tensor"])
def test_staged_updates_between_shm_updates_serve_exactly_the_new_version(tiny_model_dir, monkeypatch, can_swap):
    """One engine switching planes: staged updates (broadcast, grpc_stream), then shm, then staged
    again. An update once loaded a plan kept for a buffer address whose memory a swap had since
    moved to another buffer, so the engine reported the new version while serving an older one's
    bytes. Every order of up to five updates of either kind must serve exactly the last version."""
    import itertools

    monkeypatch.setattr(engine_module, "_CAN_SWAP", can_swap and engine_module._CAN_SWAP)
    weights = [_trainer_weights(RolloutEngine(RolloutSettings(model_path=str(tiny_model_dir))), seed)
               for seed in range(10, 16)]
    for kinds in itertools.product(("staged", "shm"), repeat=5):
        engine = RolloutEngine(RolloutSettings(model_path=str(tiny_model_dir)))
        staging = Staging(engine.device)
        for version, kind in enumerate(kinds, start=1):
            served = weights[version % len(weights)]
            if kind == "staged":
                _update(engine, staging, served, version)
            else:
                _shm_update(engine, served, version)
            assert engine.weight_version == version
            assert _serves(engine, served), f"after {kinds[:version]}: version {version} is not what is served"
