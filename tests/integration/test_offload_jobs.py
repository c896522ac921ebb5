"""Offload and colocate through the whole stack: an offloaded trainer's syncs read its host copy,
and the job learns exactly as the same job without offload (same seed, same scores)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from services.api import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weights_pb2,
)
from tests.integration.conftest import addresses, channel

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith"


def _run_job(fleet, yaml_text: str) -> tuple[coordinator_pb2.Job, list[coordinator_pb2.JobEvent]]:
    with channel(addresses(fleet)["coordinator"]) as ch:
        coordinator = coordinator_pb2_grpc.CoordinatorStub(ch)
        job = coordinator.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=yaml_text), timeout=30)
        events = list(coordinator.WatchJob(coordinator_pb2.WatchJobRequest(job_id=job.id), timeout=300))
        return coordinator.GetJob(coordinator_pb2.GetJobRequest(job_id=job.id), timeout=10), events


def _job(model, train, test, out, trainer_extra: str) -> str:
    return textwrap.dedent(
        f"""
        name: offload-check
        seed: 7
        model: {model}
        num_rollout: 3
        output_dir: {out}
        rollout: {{prompts_per_step: 8, samples_per_prompt: 4, sampling: {{max_new_tokens: 5}}}}
        data: {{train: {train}}}
        eval: {{every: 1, datasets: [{{name: heldout, path: {test}, limit: 32, sampling: {{max_new_tokens: 5}}}}]}}
        algorithm: {{kl_coef: 0.05}}
        trainer: {{optimizer: {{lr: 0.0002}}{trainer_extra}}}
        """
    )


def test_offloaded_and_colocated_jobs_learn_exactly_like_the_plain_job(fleet, tmp_path):
    """The example's SFT-warmed model gets mixed rewards, so every step really moves the weights."""
    model, train, test = EXAMPLE / "model", EXAMPLE / "data" / "train.jsonl", EXAMPLE / "data" / "test.jsonl"
    results = {}
    for name, extra in [("plain", ""), ("offload", ", offload: true"), ("colocate", ", offload: true, colocate: true")]:
        final, events = _run_job(fleet, _job(model, train, test, tmp_path / name, extra))
        assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, (name, final.error)
        syncs = [json.loads(e.data_json) for e in events if e.kind == "weight_sync"]
        steps = [json.loads(e.data_json) for e in events if e.kind == "step"]
        evals = [json.loads(e.data_json)["score"] for e in events if e.kind == "eval"]
        results[name] = (syncs, steps, evals)
    plain_syncs, plain_steps, plain_evals = results["plain"]
    assert {s["source"] for s in plain_syncs} == {"gpu"}
    assert all(s["train/grad_norm"] > 0 for s in plain_steps) and plain_steps[-1]["train/kl"] > 0  # it moved
    for name in ("offload", "colocate"):
        syncs, steps, evals = results[name]
        assert [s["source"] for s in syncs] == ["host"] * 4  # every sync, the first too, read the host copy
        assert evals == plain_evals
        assert [s["reward_mean"] for s in steps] == [s["reward_mean"] for s in plain_steps]
        assert [s["train/loss"] for s in steps] == [s["train/loss"] for s in plain_steps]


def test_engine_pulls_exact_weights_from_a_sleeping_trainer(fleet, tiny_model_dir):
    addrs = addresses(fleet)
    with channel(addrs["trainer"]) as tch, channel(addrs["rollout"]) as rch:
        trainer, engine = trainer_pb2_grpc.TrainerStub(tch), rollout_pb2_grpc.RolloutStub(rch)
        trainer.Configure(
            trainer_pb2.ConfigureTrainerRequest(
                config=trainer_pb2.TrainerConfig(
                    model_path=str(tiny_model_dir), offload=True, optimizer=trainer_pb2.OptimizerConfig(lr=0.05)
                )
            ),
            timeout=60,
        )
        engine.Configure(
            rollout_pb2.ConfigureRolloutRequest(config=rollout_pb2.RolloutConfig(model_path=str(tiny_model_dir))),
            timeout=60,
        )
        sample = trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5, 6], advantage=1.0)
        trainer.TrainStep(trainer_pb2.TrainStepRequest(batch=trainer_pb2.Batch(samples=[sample])), timeout=60)
        awake = trainer.GetWeightManifest(trainer_pb2.GetWeightManifestRequest(fingerprint_algo="sha256"), timeout=30)
        status = trainer.Sleep(trainer_pb2.SleepRequest(), timeout=30).status
        assert status.asleep and status.gpu_bytes_in_use == 0 and status.host_backup_bytes > 0
        asleep = trainer.GetWeightManifest(trainer_pb2.GetWeightManifestRequest(fingerprint_algo="sha256"), timeout=30)
        assert (awake.manifest.source, asleep.manifest.source) == ("gpu", "host")
        assert [b.fingerprint for b in asleep.manifest.buckets] == [b.fingerprint for b in awake.manifest.buckets]
        engine.UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(
                version=asleep.manifest.version, manifest=asleep.manifest,
                trainer=weights_pb2.TrainerEndpoint(address=addrs["trainer"]),
            ),
            timeout=60,
        )
        prints = engine.GetWeightFingerprints(rollout_pb2.GetWeightFingerprintsRequest(fingerprint_algo="sha256"), timeout=30)
        assert list(prints.fingerprints) == [b.fingerprint for b in asleep.manifest.buckets]
        assert trainer.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10).lifecycle.asleep  # the sync did not wake it


def test_released_engine_refuses_work_until_resumed_and_updated(fleet, tiny_model_dir):
    addrs = addresses(fleet)
    with channel(addrs["rollout"]) as rch:
        engine = rollout_pb2_grpc.RolloutStub(rch)
        engine.Configure(
            rollout_pb2.ConfigureRolloutRequest(config=rollout_pb2.RolloutConfig(model_path=str(tiny_model_dir))),
            timeout=60,
        )
        status = engine.ReleaseMemory(rollout_pb2.ReleaseMemoryRequest(tags=["weights"]), timeout=30).status
        assert not status.serving and list(status.released) == ["weights"]
        import grpc
        import pytest

        request = rollout_pb2.GenerateRequest(prompts=["1+2="], sampling=rollout_pb2.SamplingParams(max_new_tokens=2))
        with pytest.raises(grpc.RpcError) as err:
            engine.Generate(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "ResumeMemory" in err.value.details()
        status = engine.ResumeMemory(rollout_pb2.ResumeMemoryRequest(tags=["weights"]), timeout=30).status
        assert not status.serving  # values were discarded: it needs a full weight update first
        with pytest.raises(grpc.RpcError) as err:
            engine.Generate(request, timeout=30)
        assert "pool" in err.value.details()
