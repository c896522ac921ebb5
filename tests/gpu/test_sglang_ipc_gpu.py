"""SGLang's colocated plane on one GPU: the trainer's buckets reach an SGLang server on the
trainer's GPU by `/update_weights_from_tensor` (CUDA IPC handles in SGLang's payload), from the
trainer's live weights and from an offloaded trainer's host copy, and exact verification reads
every tensor back. The server is the stand-in (tests/sglang/standin.py), which unpickles the
payload with SGLang 0.5.23's own allowlist, opens the handles as SGLang's patched torch
reductions do, and rebuilds the tensors with the wheel's FlattenedTensorBucket.

Needs the pinned wheel (RLFLEET_SGLANG_WHEEL, or the cache) and msgspec: bench/device.sh sglang."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services import rpc
from services.api import rollout_pb2, rollout_pb2_grpc, trainer_pb2
from services.coordinator.clients import RolloutClient, TrainerClient
from services.launcher import LocalFleet
from services.rollout.server import RolloutServicer
from services.rollout.sglang.client import SglangClient
from tests.conftest import make_syncer, make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]
ROOT = Path(__file__).resolve().parents[2]
STANDIN = [sys.executable, "-m", "tests.sglang.standin"]


@pytest.mark.parametrize("offload", [False, True], ids=["live", "host-copy"])
def test_sglang_takes_colocated_weights_by_cuda_ipc_and_reads_them_back(tmp_path, monkeypatch, offload):
    pytest.importorskip("msgspec")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    model = make_tiny_model(tmp_path / "model", architecture="llama", hidden_size=64, intermediate_size=128)
    fleet = LocalFleet(tmp_path / "logs")
    servicer = RolloutServicer()  # in this process, to reach the SGLang child's request log
    sglang_server = rpc.create_server(lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s),
                                      ("rlfleet.v1.Rollout",), address="127.0.0.1:0")
    sglang_server.on_stop.append(servicer.close)
    pool = ThreadPoolExecutor(4)
    try:
        fleet.start("trainer", "trainer-0", [])
        fleet.start("rollout", "rollout-0", [])  # the built-in engine, for comparison
        fleet.wait_ready(timeout_s=180)
        trainer, reference = TrainerClient(fleet.children[0].address), RolloutClient(fleet.children[1].address)
        trainer.configure(trainer_pb2.TrainerConfig(model_path=str(model), device="cuda", offload=offload,
                                                    bucket_bytes=16 << 10,  # several buckets, several handles
                                                    optimizer=trainer_pb2.OptimizerConfig(lr=1e-2)))
        sglang = RolloutClient(f"127.0.0.1:{sglang_server.port}")
        sglang.configure(rollout_pb2.RolloutConfig(
            model_path=str(model), device="cuda", engine="sglang", load_weights=False,  # exact: dummy weights first
            sglang=rollout_pb2.SglangConfig(command=STANDIN, startup_timeout_s=180)))
        reference.configure(rollout_pb2.RolloutConfig(model_path=str(model), device="cuda", load_weights=False))
        syncer = make_syncer(trainer, [sglang, reference], pool, exact=True, timeout_s=60)
        assert syncer.planes == ["cuda_ipc", "cuda_ipc"]
        prompts, greedy = ["1+2=", "3+4=", "5+6="], rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=6)
        for step in (1, 2):
            trainer.train_step(trainer_pb2.Batch(samples=[
                trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5, 6], advantage=1.0)]))
            if offload:
                assert trainer.sleep().asleep
            result = syncer.sync({0, 1})
            assert result.ok == {0, 1}, result.failures  # exact: SGLang's weights read back bit for bit
            assert result.source == ("host" if offload else "gpu")
            answers = sglang.generate(prompts, greedy)
            assert {c.weight_version for c in answers} == {step}
            assert [c.output_ids for c in answers] == [c.output_ids for c in reference.generate(prompts, greedy)]
        # Nothing of the weights stays behind in the adapter: its staging (host-copy path) is freed.
        assert servicer._staging._sets == [[], []]

        engine = servicer._engine
        key = engine.client._headers["Authorization"].split()[-1]
        log = SglangClient(engine.client.url, key).call("/_standin/requests", method="GET")
        updates = [r for r in log if r["path"] == "/update_weights_from_tensor"]
        num_buckets = len(trainer.weight_manifest("sha256").buckets)
        assert len(updates) == 2 * num_buckets >= 4 and all(r["status"] == 200 for r in updates), updates[:2]
        assert all(r["body"]["load_format"] == "flattened_bucket" for r in updates)
        assert [r["body"].get("weight_version") for r in updates][num_buckets - 1::num_buckets] == ["1", "2"]
        print(f"sglang colocated ({'host copy' if offload else 'live'}): {len(updates)} IPC bucket loads, "
              f"{sum(r['path'] == '/get_weights_by_name' for r in log)} tensors read back, all verified")
        syncer.close()
    finally:
        pool.shutdown()
        sglang_server.stop(0)
        fleet.stop()
