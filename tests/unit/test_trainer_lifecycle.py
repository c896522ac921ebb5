"""Trainer memory lifecycle at value level, with the real host store: sleep, wake, tag switching,
and which copy a weight sync reads (seed: miles #3128)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.trainer.batch import Sample
from services.trainer.settings import OptimizerSettings, TrainerSettings
from services.trainer.torch_backend import TorchTrainer
from services.trainer.weight_source import WeightSource
from services.weights.buckets import pack_bucket
from services.weights.fingerprint import fingerprint


def _trainer(model_dir, **overrides) -> TorchTrainer:
    base = TrainerSettings(model_path=str(model_dir), optimizer=OptimizerSettings(lr=1e-2), bucket_bytes=4096)
    return TorchTrainer(dataclasses.replace(base, **overrides))


def _samples() -> list[Sample]:
    return [
        Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7, 8], advantages=[1.0, 1.0, 1.0]),
        Sample(prompt_ids=[9, 10], response_ids=[11, 12], advantages=[-1.0, -1.0]),
    ]


def _clone(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in trainer.named.items()}


def _weight_bytes(trainer: TorchTrainer) -> int:
    return sum(t.numel() * t.element_size() for t in trainer.named.values())


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def test_sync_while_asleep_delivers_exactly_the_weights_after_the_last_train_step(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, offload=True)
    trainer.train_step(_samples())
    after_step = _clone(trainer)
    trainer.sleep()
    assert all(p.untyped_storage().nbytes() == 0 for p in trainer.params)  # device copy is gone
    sync = trainer.weights_for_sync()
    source, weights = sync.source, sync.weights
    assert source == "host"
    _assert_equal(weights.views, after_step)
    snap = WeightSource(4096).snapshot(weights, trainer.store.layout, trainer.weights_version, source, "sha256")
    assert snap.manifest.source == "host" and snap.manifest.version == 1
    expected = [fingerprint(pack_bucket(b, after_step), "sha256") for b in trainer.store.layout]
    assert [b.fingerprint for b in snap.manifest.buckets] == expected


def test_sync_while_awake_reads_the_live_weights(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, offload=True)
    trainer.train_step(_samples())
    sync = trainer.weights_for_sync()
    source, weights = sync.source, sync.weights
    assert source == "gpu"
    name, live = next(iter(trainer.named.items()))
    assert weights[name] is live
    with torch.no_grad():
        live.add_(1.0)  # whatever the live tensor holds is what the sync sends
    snap = WeightSource(4096).snapshot(weights, None, trainer.weights_version, source, "sha256")
    assert [b.fingerprint for b in snap.manifest.buckets] == [
        fingerprint(pack_bucket(b, _clone(trainer)), "sha256") for b in trainer.store.layout
    ]


def test_offload_without_ref_teacher_or_old_actor_still_keeps_the_store(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, offload=True)
    assert trainer.store is not None and trainer.settings.tags == ()
    trainer.train_step(_samples())
    state = trainer.sleep()
    assert state.asleep and state.gpu_bytes_in_use == 0
    assert state.host_backup_bytes >= 3 * _weight_bytes(trainer)  # weights + Adam's two moments
    assert _trainer(tiny_model_dir).store is None  # nothing asks for it: no host copy is kept


def test_switching_to_the_active_tag_after_sleep_restores_the_discarded_values(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, offload=True)
    trainer.train_step(_samples())
    expected = _clone(trainer)
    trainer.sleep()
    trainer.use("actor")
    assert not trainer.asleep
    _assert_equal(_clone(trainer), expected)
    assert trainer.store.stats.restores == {"actor": 1}


def test_a_valid_plain_copy_is_not_restored_again(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, tags=("ref",))
    stats, size = trainer.store.stats, _weight_bytes(trainer)
    initial = _clone(trainer)
    trainer.train_step(_samples())
    trained = _clone(trainer)
    trainer.use("ref")
    assert stats.bytes_restored == size
    _assert_equal(_clone(trainer), initial)
    trainer.use("ref")
    trainer.compute_logprobs("ref", _samples())
    assert stats.bytes_restored == size  # already there at its version: no copy
    trainer.use("actor")
    assert stats.bytes_restored == 2 * size
    _assert_equal(_clone(trainer), trained)
    trainer.train_step(_samples())
    assert stats.bytes_restored == 2 * size


def test_a_rebuilding_restore_always_runs(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, dtype="bfloat16", master_weights="fp32", offload=True)
    trainer.train_step(_samples())
    rebuilt = trainer.rebuilds
    trainer.use("actor")
    trainer.use("actor")
    assert trainer.rebuilds == rebuilt + 2  # valid copy, but the restore rebuilds from fp32 masters
    for p, m in zip(trainer.params, trainer.master):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16))
    trainer.sleep()
    trainer.wake()
    for p, m in zip(trainer.params, trainer.master):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_sleep_and_wake_are_idempotent(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, offload=True)
    trainer.train_step(_samples())
    first = trainer.sleep()
    captured = trainer.store.stats.bytes_captured
    assert trainer.sleep() == first and trainer.store.stats.bytes_captured == captured
    awake = trainer.wake()
    assert trainer.wake() == awake and trainer.store.stats.restores == {"actor": 1}
    assert not awake.asleep and awake.gpu_bytes_in_use > 0


def test_work_on_a_sleeping_trainer_wakes_it_once(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, offload=True)
    trainer.sleep()
    trainer.compute_logprobs("actor", _samples())
    trainer.train_step(_samples())
    assert not trainer.asleep and trainer.store.stats.restores == {"actor": 1}


def test_training_after_sleep_and_wake_matches_a_run_that_never_slept(tiny_model_dir):
    steady, napping = _trainer(tiny_model_dir, offload=True), _trainer(tiny_model_dir, offload=True)
    for _ in range(3):
        loss = steady.train_step(_samples()).metrics["loss"]
        napping.sleep()
        napping.wake()
        assert napping.train_step(_samples()).metrics["loss"] == loss
    _assert_equal(_clone(napping), _clone(steady))


def test_old_actor_holds_the_weights_last_synced(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, tags=("old_actor",))
    trainer.weights_for_sync()
    before, _ = trainer.compute_logprobs("actor", _samples())
    trainer.train_step(_samples())
    old, _ = trainer.compute_logprobs("old_actor", _samples())
    now, _ = trainer.compute_logprobs("actor", _samples())
    assert old == before and now != before
    with pytest.raises(ValueError, match="teacher"):
        trainer.use("teacher")


def test_after_wake_the_live_buckets_read_exactly_as_packed_alignment_gaps_included(tiny_model_dir):
    """A woken trainer's buckets are fingerprinted and sent whole, gaps between tensors included,
    and compared with copies packed from the tensors (gaps zero). Memory reallocated at wake is
    whatever the allocator hands back: here it was just filled with junk, as a staging buffer on
    a GPU can leave it. (On the H200 this made an NCCL sync from a sleeping trainer fail
    verification from its second step.)"""
    trainer = _trainer(tiny_model_dir, offload=True)
    storage_bytes = trainer.params[0].untyped_storage().nbytes()
    gaps = [b.nbytes - sum(t.nbytes for t in b.tensors) for b in trainer.layout]
    assert any(gaps), "the layout needs alignment gaps for this test to mean anything"
    for _ in range(2):
        trainer.train_step(_samples())
        trainer.sleep()
        junk = [torch.full((storage_bytes,), 0xAB, dtype=torch.uint8) for _ in range(4)]
        del junk  # freed: the next allocation of this size may reuse the dirty memory
        trainer.wake()
        named = {name: t.detach() for name, t in trainer.named.items()}
        for spec, live in zip(trainer.layout, trainer.bucket_views):
            assert torch.equal(live[: spec.nbytes], pack_bucket(spec, named)), f"bucket {spec.index}"
