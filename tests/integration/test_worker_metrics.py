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


def test_an_engines_queue_depth_is_scraped_while_rows_wait(tiny_model_dir):
    """rlfleet_rollout_rows_waiting (what the chart's HPA scales on) counts the rows that wait for a
    place in a running batch of 2 while a call of 16 prompts runs, and is 0 once it has ended."""
    import threading

    server = build_rollout("127.0.0.1:0", metrics_port=0)
    try:
        engine = RolloutClient(f"127.0.0.1:{server.port}")
        engine.configure(rollout_pb2.RolloutConfig(model_path=str(tiny_model_dir), load_weights=True, max_batch_size=2))
        assert _scrape(server.metrics_port)["rlfleet_rollout_rows_waiting"] == 0
        done = threading.Event()
        call = threading.Thread(target=lambda: (engine.generate([f"{i}+1=" for i in range(16)], rollout_pb2.SamplingParams(
            max_new_tokens=48, ignore_eos=True)), done.set()))
        call.start()
        seen = []
        while not done.is_set():
            r = _scrape(server.metrics_port)
            seen.append((r["rlfleet_rollout_rows_waiting"], r["rlfleet_rollout_rows_running"]))
        call.join()
        assert max(w for w, _ in seen) > 0, seen  # rows queued behind the batch of 2
        assert max(r for _, r in seen) == 2 and all(w + r <= 16 for w, r in seen), seen
        after = _scrape(server.metrics_port)
        assert after["rlfleet_rollout_rows_waiting"] == 0 and after["rlfleet_rollout_rows_running"] == 0
    finally:
        server.stop(0)
