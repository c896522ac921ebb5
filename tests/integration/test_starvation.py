"""Slow or stalled clients hold no one hostage: a weight stream whose reader stops reading is cut
off so TrainStep and Sleep go on, and a pile of calls that wait on peers leaves threads for health
checks and status."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.api import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weights_pb2
from services.rollout.server import build_server as build_rollout
from services.trainer.server import build_server as build_trainer
from services.weights.broadcast import free_port
from tests.conftest import make_tiny_model
from tests.integration.conftest import channel

pytestmark = pytest.mark.faults
SAMPLE = trainer_pb2.Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7], advantage=1.0)


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    """About 50 MB of weights: more than socket buffers hold, so a reader that stops really stalls."""
    return make_tiny_model(tmp_path_factory.mktemp("starve-model"), hidden_size=512, intermediate_size=1536,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64)


def test_a_weight_stream_that_stops_reading_does_not_hold_training_or_sleep(tmp_path, mid_model):
    server = build_trainer("127.0.0.1:0", checkpoint_root=tmp_path)
    address = f"127.0.0.1:{server.port}"
    try:
        with channel(address) as ch:
            trainer = trainer_pb2_grpc.TrainerStub(ch)
            trainer.Configure(trainer_pb2.ConfigureTrainerRequest(config=trainer_pb2.TrainerConfig(
                model_path=str(mid_model), optimizer=trainer_pb2.OptimizerConfig(lr=1e-3))), timeout=60)
            version = trainer.GetWeightManifest(trainer_pb2.GetWeightManifestRequest(), timeout=30).manifest.version
            with channel(address) as slow_channel:  # another connection: the slow engine's
                stream = trainer_pb2_grpc.TrainerStub(slow_channel).GetWeights(
                    trainer_pb2.GetWeightsRequest(version=version), timeout=120)
                next(stream)  # one chunk, then it stops reading
                time.sleep(0.5)
                started = time.monotonic()
                reply = trainer.TrainStep(trainer_pb2.TrainStepRequest(batch=trainer_pb2.Batch(samples=[SAMPLE])),
                                          timeout=60)
                took = time.monotonic() - started
                trainer.Sleep(trainer_pb2.SleepRequest(), timeout=60)
                assert reply.weights_version == version + 1
                assert took < 5.0 + 10, f"TrainStep waited {took:.1f} s for a stalled reader"
                with pytest.raises(grpc.RpcError) as cut:  # the stalled reader learns why, when it reads on
                    for _ in stream:
                        pass
                assert cut.value.code() == grpc.StatusCode.ABORTED and "changed while this stream" in cut.value.details()
    finally:
        server.stop(0)


def test_calls_waiting_on_dead_peers_leave_room_for_health_and_status(tmp_path, tiny_model_dir):
    server = build_rollout("127.0.0.1:0")
    address = f"127.0.0.1:{server.port}"
    try:
        with channel(address) as ch:
            engine = rollout_pb2_grpc.RolloutStub(ch)
            engine.Configure(rollout_pb2.ConfigureRolloutRequest(
                config=rollout_pb2.RolloutConfig(model_path=str(tiny_model_dir), load_weights=True)), timeout=60)
            dead = free_port()  # nothing listens there
            outcomes: list[grpc.StatusCode] = []

            def join(k: int) -> None:
                try:
                    engine.InitWeightUpdateGroup(weights_pb2.InitWeightUpdateGroupRequest(
                        master_address="127.0.0.1", master_port=dead, rank_offset=1, world_size=2, backend="gloo",
                        group_name=f"g{k}", timeout_s=5.0), timeout=30)
                    outcomes.append(grpc.StatusCode.OK)
                except grpc.RpcError as e:
                    outcomes.append(e.code())

            threads = [threading.Thread(target=join, args=(k,)) for k in range(20)]
            for t in threads:
                t.start()
            time.sleep(1.0)  # every call has arrived
            started = time.monotonic()
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            status = engine.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=5)
            answered = time.monotonic() - started
            assert health.status == health_pb2.HealthCheckResponse.SERVING and status.configured
            assert answered < 1.0, f"health and status took {answered:.1f} s"
            for t in threads:
                t.join(timeout=60)
            busy = [c for c in outcomes if c == grpc.StatusCode.RESOURCE_EXHAUSTED]
            assert len(outcomes) == 20 and busy, outcomes  # the calls past one join are refused at once
            assert grpc.StatusCode.UNKNOWN not in outcomes
    finally:
        server.stop(0)


def test_many_concurrent_generate_clients_get_answers_or_a_retry_signal_and_memory_stays_bounded(tmp_path, tiny_model_dir):
    from bench.load import run

    result = run(tiny_model_dir, clients=24, seconds=4.0, log_dir=tmp_path)
    print(result)
    assert result["errors"] == 0, result["first_errors"]  # every refusal is RESOURCE_EXHAUSTED, every answer whole
    assert result["calls"] > 10
    assert result["rss_peak_mb"] - result["rss_start_mb"] < 150
