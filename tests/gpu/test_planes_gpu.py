"""CUDA IPC between a trainer and an engine on one GPU, from live weights and from the host store
of an offloaded trainer: the engine ends up with exactly the trainer's bytes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from services.api import rollout_pb2, trainer_pb2
from services.coordinator.clients import RolloutClient, TrainerClient
from services.launcher import LocalFleet
from tests.conftest import make_syncer, make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fingerprint"])
@pytest.mark.parametrize("offload", [False, True])
def test_cuda_ipc_sync_is_bit_exact(tmp_path, offload, exact):
    model = make_tiny_model(tmp_path / "model")
    fleet = LocalFleet(tmp_path / "logs")
    pool = ThreadPoolExecutor(4)
    try:
        fleet.start("trainer", "trainer-0", [])
        fleet.start("rollout", "rollout-0", [])
        fleet.wait_ready(timeout_s=180)
        trainer, engine = TrainerClient(fleet.children[0].address), RolloutClient(fleet.children[1].address)
        trainer.configure(trainer_pb2.TrainerConfig(model_path=str(model), device="cuda", offload=offload,
                                                    bucket_bytes=16 << 10,  # several buckets, events, handles
                                                    optimizer=trainer_pb2.OptimizerConfig(lr=1e-2)))
        engine.configure(rollout_pb2.RolloutConfig(model_path=str(model), device="cuda", load_weights=False))
        syncer = make_syncer(trainer, [engine], pool, exact=exact, timeout_s=60)
        assert syncer.planes == ["cuda_ipc"]
        for step in (1, 2, 3):  # later syncs swap memory with the staging that holds the last version
            trainer.train_step(trainer_pb2.Batch(samples=[trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5], advantage=1.0)]))
            if offload:
                assert trainer.sleep().asleep
            result = syncer.sync({0})
            assert result.ok == {0} and not result.failures, result.failures
            assert result.source == ("host" if offload else "gpu")
            manifest = trainer.weight_manifest("sha256")
            version, prints = engine.fingerprints("sha256", 16 << 10)
            assert version == manifest.version == step
            assert len(prints) > 2 and prints == [b.fingerprint for b in manifest.buckets]
        syncer.close()
    finally:
        pool.shutdown()
        fleet.stop()
