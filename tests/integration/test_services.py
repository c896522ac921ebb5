"""The three services as real processes on loopback: health, reflection, a weight sync that is bit
for bit exact, refusal of an update that does not fit the model, and one full RL step."""

from __future__ import annotations

import json
import textwrap

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.api import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weights_pb2,
)
from tests.integration.conftest import addresses, channel, run_job


def _configure(addrs, model_dir, *, lr=1e-2):
    with channel(addrs["trainer"]) as tch, channel(addrs["rollout"]) as rch:
        trainer = trainer_pb2_grpc.TrainerStub(tch)
        rollout = rollout_pb2_grpc.RolloutStub(rch)
        trainer.Configure(
            trainer_pb2.ConfigureTrainerRequest(
                config=trainer_pb2.TrainerConfig(
                    model_path=str(model_dir), optimizer=trainer_pb2.OptimizerConfig(lr=lr), bucket_bytes=4096
                )
            ),
            timeout=60,
        )
        rollout.Configure(
            rollout_pb2.ConfigureRolloutRequest(
                config=rollout_pb2.RolloutConfig(model_path=str(model_dir), load_weights=True)
            ),
            timeout=60,
        )


def _train_one_step(addrs) -> int:
    with channel(addrs["trainer"]) as ch:
        trainer = trainer_pb2_grpc.TrainerStub(ch)
        sample = trainer_pb2.Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7], advantage=1.0)
        reply = trainer.TrainStep(trainer_pb2.TrainStepRequest(batch=trainer_pb2.Batch(samples=[sample] * 4)), timeout=60)
        return reply.weights_version


def _sync(addrs, algo="sha256") -> tuple[weights_pb2.WeightManifest, rollout_pb2.UpdateWeightsResponse]:
    with channel(addrs["trainer"]) as tch, channel(addrs["rollout"]) as rch:
        manifest = trainer_pb2_grpc.TrainerStub(tch).GetWeightManifest(
            trainer_pb2.GetWeightManifestRequest(fingerprint_algo=algo), timeout=60
        ).manifest
        reply = rollout_pb2_grpc.RolloutStub(rch).UpdateWeights(
            rollout_pb2.UpdateWeightsRequest(
                version=manifest.version, manifest=manifest,
                trainer=weights_pb2.TrainerEndpoint(address=addrs["trainer"]),
            ),
            timeout=60,
        )
        return manifest, reply


def test_every_server_reports_serving_and_lists_its_service(fleet):
    expected = {"trainer": "rlfleet.v1.Trainer", "rollout": "rlfleet.v1.Rollout", "coordinator": "rlfleet.v1.Coordinator"}
    for role, address in addresses(fleet).items():
        with channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING, role
            named = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=expected[role]), timeout=10)
            assert named.status == health_pb2.HealthCheckResponse.SERVING, role
            replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            services = {s.name for r in replies for s in r.list_services_response.service}
            assert expected[role] in services
            assert "grpc.health.v1.Health" in services


def test_weight_sync_makes_engine_weights_bit_identical(fleet, tiny_model_dir):
    addrs = addresses(fleet)
    _configure(addrs, tiny_model_dir)
    version = _train_one_step(addrs)
    manifest, reply = _sync(addrs)
    assert manifest.version == version == reply.version
    assert len(manifest.buckets) > 1  # 4 KiB buckets: the sync really spans several
    with channel(addrs["rollout"]) as ch:
        engine = rollout_pb2_grpc.RolloutStub(ch)
        prints = engine.GetWeightFingerprints(
            rollout_pb2.GetWeightFingerprintsRequest(fingerprint_algo="sha256", bucket_bytes=4096), timeout=30
        )
        assert prints.version == version
        # sha256 over every byte of every bucket: equal digests mean bit-identical weights.
        assert list(prints.fingerprints) == [b.fingerprint for b in manifest.buckets]
        generated = engine.Generate(
            rollout_pb2.GenerateRequest(prompts=["1+2="], sampling=rollout_pb2.SamplingParams(max_new_tokens=3)),
            timeout=30,
        )
        assert generated.results[0].weight_version == version


@pytest.mark.parametrize("corruption", ["shape", "dtype", "missing"])
def test_mismatched_update_is_refused_and_engine_keeps_serving(fleet, tiny_model_dir, corruption):
    addrs = addresses(fleet)
    _configure(addrs, tiny_model_dir)
    good, _ = _sync(addrs)
    with channel(addrs["trainer"]) as tch:
        bad = trainer_pb2_grpc.TrainerStub(tch).GetWeightManifest(
            trainer_pb2.GetWeightManifestRequest(fingerprint_algo="sha256"), timeout=30
        ).manifest
    tensor = bad.buckets[0].tensors[0]
    if corruption == "shape":
        tensor.shape[0] += 1
    elif corruption == "dtype":
        tensor.dtype = "float16"
    else:
        del bad.buckets[-1].tensors[-1]
    bad.version = good.version + 100
    with channel(addrs["rollout"]) as ch:
        engine = rollout_pb2_grpc.RolloutStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            engine.UpdateWeights(
                rollout_pb2.UpdateWeightsRequest(
                    version=bad.version, manifest=bad, trainer=weights_pb2.TrainerEndpoint(address=addrs["trainer"])
                ),
                timeout=30,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        if corruption != "missing":
            assert tensor.name in err.value.details()
        status = engine.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10)
        assert status.serving and status.weight_version == good.version
        reply = engine.Generate(
            rollout_pb2.GenerateRequest(prompts=["1+2="], sampling=rollout_pb2.SamplingParams(max_new_tokens=2)),
            timeout=30,
        )
        assert reply.weight_version == good.version


def test_one_full_rl_step_through_the_coordinator(fleet, tiny_model_dir, task_files, tmp_path):
    train, test = task_files
    job = textwrap.dedent(
        f"""
        name: one-step
        model: {tiny_model_dir}
        num_rollout: 1
        output_dir: {tmp_path / 'out'}
        rollout: {{prompts_per_step: 4, samples_per_prompt: 4, sampling: {{max_new_tokens: 3}}}}
        data: {{train: {train}}}
        eval: {{datasets: [{{name: heldout, path: {test}, limit: 8, sampling: {{temperature: 0.0, max_new_tokens: 3}}}}]}}
        trainer: {{optimizer: {{lr: 0.01}}}}
        """
    )
    final, events = run_job(addresses(fleet)["coordinator"], job, timeout_s=120)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    kinds = [e.kind for e in events]
    assert kinds.count("step") == 1 and kinds.count("eval") == 2
    syncs = [json.loads(e.data_json) for e in events if e.kind == "weight_sync"]
    assert [s["version"] for s in syncs] == [0, 1]  # the initial sync, then the trained weights
    step = json.loads(next(e.data_json for e in events if e.kind == "step"))
    assert 0.0 <= step["reward_mean"] <= 1.0 and "train/pg_loss" in step
    # The on-policy gap, every step: trainer and engine run the same float32 math on one CPU.
    assert 0.0 <= step["train/rollout_logprob_gap_mean"] <= step["train/rollout_logprob_gap_max"] < 1e-4
    summary = json.loads(final.summary_json)
    assert summary["steps"] == 1 and 0.0 <= summary["eval_after"] <= 1.0
    assert (tmp_path / "out" / "metrics.jsonl").read_text().count("\n") == 1
    assert (tmp_path / "out" / "reward_curve.png").read_bytes().startswith(b"\x89PNG")


def test_sft_warm_up_stage_lowers_the_loss_before_rl(fleet, tiny_model_dir, task_files, tmp_path):
    train, test = task_files
    job = textwrap.dedent(
        f"""
        name: sft-then-rl
        model: {tiny_model_dir}
        num_rollout: 1
        output_dir: {tmp_path / 'out'}
        rollout: {{prompts_per_step: 4, samples_per_prompt: 2, sampling: {{max_new_tokens: 3}}}}
        data: {{train: {train}}}
        eval: {{datasets: [{{name: heldout, path: {test}, limit: 4, sampling: {{max_new_tokens: 3}}}}]}}
        sft: {{data: {train}, steps: 12, batch_size: 16, lr: 0.01}}
        """
    )
    with channel(addresses(fleet)["coordinator"]) as ch:
        coordinator = coordinator_pb2_grpc.CoordinatorStub(ch)
        job_pb = coordinator.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=job), timeout=30)
        events = list(coordinator.WatchJob(coordinator_pb2.WatchJobRequest(job_id=job_pb.id), timeout=120))
    sft = [json.loads(e.data_json) for e in events if e.kind == "sft"]
    assert events[-1].state == coordinator_pb2.JOB_STATE_SUCCEEDED
    assert len(sft) == 12 and all(s["lr"] == 0.01 for s in sft)
    assert sft[-1]["sft_loss"] < sft[0]["sft_loss"]
    syncs = [json.loads(e.data_json)["version"] for e in events if e.kind == "weight_sync"]
    assert syncs == [0, 12, 13]  # initial, after SFT, after the RL step


def test_invalid_job_is_rejected_with_the_field_named(fleet):
    with channel(addresses(fleet)["coordinator"]) as ch:
        coordinator = coordinator_pb2_grpc.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            coordinator.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml="name: x\nnum_rollout: 1\nmodle: y\n"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "modle" in err.value.details()


def test_a_device_the_machine_lacks_is_refused_by_name_and_the_old_configuration_serves_on(fleet, tiny_model_dir):
    addrs = addresses(fleet)
    _configure(addrs, tiny_model_dir)
    _, synced = _sync(addrs)
    with channel(addrs["trainer"]) as tch, channel(addrs["rollout"]) as rch:
        trainer, engine = trainer_pb2_grpc.TrainerStub(tch), rollout_pb2_grpc.RolloutStub(rch)
        with pytest.raises(grpc.RpcError) as err:
            trainer.Configure(trainer_pb2.ConfigureTrainerRequest(
                config=trainer_pb2.TrainerConfig(model_path=str(tiny_model_dir), device="cuda:64")), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cuda:64 does not exist" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            engine.Configure(rollout_pb2.ConfigureRolloutRequest(
                config=rollout_pb2.RolloutConfig(model_path=str(tiny_model_dir), device="cuda:64")), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cuda:64 does not exist" in err.value.details()
        assert trainer.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10).configured
        status = engine.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10)
        assert status.serving and status.weight_version == synced.version


@pytest.mark.parametrize("use_kl_loss", [True, False])
def test_kl_goes_to_the_loss_or_to_the_reward_as_the_job_says(fleet, tiny_model_dir, task_files, tmp_path, use_kl_loss):
    train, test = task_files
    job = textwrap.dedent(
        f"""
        name: kl-{use_kl_loss}
        model: {tiny_model_dir}
        num_rollout: 2
        output_dir: {tmp_path / 'out'}
        rollout: {{prompts_per_step: 4, samples_per_prompt: 4, sampling: {{max_new_tokens: 4}}}}
        data: {{train: {train}}}
        eval: {{every: 0, datasets: [{{name: h, path: {test}, limit: 4, sampling: {{max_new_tokens: 3}}}}]}}
        algorithm: {{kl_coef: 0.5, use_kl_loss: {str(use_kl_loss).lower()}}}
        trainer: {{optimizer: {{lr: 0.05}}}}
        sft: {{data: {train}, steps: 3, lr: 0.01}}
        """
    )
    final, events = run_job(addresses(fleet)["coordinator"], job, timeout_s=120)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    steps = [json.loads(e.data_json) for e in events if e.kind == "step"]
    # the SFT warm-up moved the policy away from ref (the weights at the start): KL > 0 from step 1
    if use_kl_loss:
        assert all("kl_reward_mean" not in s and s["train/kl"] > 1e-4 for s in steps), steps
    else:  # the trainer adds no KL term; each completion's reward pays for its distance from ref
        assert all("train/kl" not in s and s["kl_reward_mean"] > 1e-4 for s in steps), steps
