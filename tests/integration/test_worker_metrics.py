"""Trainers and engines export Prometheus metrics of their own: what they did (steps, tokens,
sleeps, weight bytes and seconds), what they hold (weights version, serving), scraped over HTTP."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.api import rollout_pb2, trainer_pb2
from services.coordinator.clients import RolloutClient, TrainerClient
from services.rollout.server import build_server as build_rollout
from services.trainer.server import build_server as build_trainer


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f"{s.name}{dict(sorted(s.labels.items())) or ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_trainer_and_engine_metrics_count_what_happened(tiny_model_dir):
    trainer_server = build_trainer("127.0.0.1:0", metrics_port=0)
    rollout_server = build_rollout("127.0.0.1:0", metrics_port=0)
    try:
        trainer = TrainerClient(f"127.0.0.1:{trainer_server.port}")
        trainer.configure(trainer_pb2.TrainerConfig(model_path=str(tiny_model_dir), offload=True,
                                                    optimizer=trainer_pb2.OptimizerConfig(lr=1e-3)))
        engine = RolloutClient(f"127.0.0.1:{rollout_server.port}")
        engine.configure(rollout_pb2.RolloutConfig(model_path=str(tiny_model_dir), load_weights=True))
        completions = engine.generate(["1+2=", "3+4="], rollout_pb2.SamplingParams(max_new_tokens=3, n=2))
        batch = trainer_pb2.Batch(samples=[trainer_pb2.Sample(prompt_ids=c.prompt_ids, response_ids=c.output_ids,
                                                              advantage=1.0) for c in completions if c.output_ids])
        trainer.train_step(batch)
        trainer.train_step(batch)
        trainer.sleep()
        manifest = trainer.weight_manifest()
        engine.update_weights(manifest, timeout_s=30, trainer=__import__("services.api.weights_pb2", fromlist=["x"])
                              .TrainerEndpoint(address=f"127.0.0.1:{trainer_server.port}"))

        t = _scrape(trainer_server.metrics_port)
        assert t["rlfleet_trainer_train_steps_total"] == 2
        assert t["rlfleet_trainer_trained_tokens_total"] == 2 * sum(len(s.response_ids) for s in batch.samples)
        assert t["rlfleet_trainer_weights_version"] == 2 and t["rlfleet_trainer_asleep"] == 1
        assert t["rlfleet_trainer_lifecycle_total{'call': 'sleep'}"] == 1
        assert t["rlfleet_trainer_weight_bytes_sent_total{'plane': 'grpc_stream'}"] == manifest_bytes(manifest)

        r = _scrape(rollout_server.metrics_port)
        assert r["rlfleet_rollout_generate_requests_total{'outcome': 'ok'}"] == 1
        assert r["rlfleet_rollout_generated_tokens_total"] == sum(len(c.output_ids) for c in completions)
        assert r["rlfleet_rollout_generate_in_flight"] == 0
        assert r["rlfleet_rollout_weights_version"] == 2 and r["rlfleet_rollout_serving"] == 1
        loaded = sum(t.nbytes for b in manifest.buckets for t in b.tensors)  # the tensors, not the layout's gaps
        assert r["rlfleet_rollout_weight_bytes_received_total{'plane': 'grpc_stream'}"] == loaded
    finally:
        trainer_server.stop(0)
        rollout_server.stop(0)


def manifest_bytes(manifest) -> int:
    return sum(b.nbytes for b in manifest.buckets)


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_metrics_are_off_unless_asked(role):
    server = (build_trainer if role == "trainer" else build_rollout)("127.0.0.1:0")
    try:
        assert server.metrics_port is None
    finally:
        server.stop(0)
