"""The megatron backend behind the trainer service: two trainer processes, tensor parallel 2 over
gloo, against one torch-backend trainer on the same checkpoint and the same batch."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from services.api import trainer_pb2  # noqa: E402
from services.coordinator.clients import PeerError, TrainerClient, TrainerGroup  # noqa: E402
from services.launcher import LocalFleet  # noqa: E402
from services.models.checkpoint import load_hf_dir  # noqa: E402
from services.weights.buckets import unpack_bucket  # noqa: E402
from services.weights.grpc_stream import receive  # noqa: E402
from services.weights.manifest import manifest_from_proto  # noqa: E402
from tests.conftest import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # llama with untied embeddings: every Megatron layout (fused qkv, gate/up, vocab split, row split)
    return make_tiny_model(tmp_path_factory.mktemp("m"), architecture="llama", tie_word_embeddings=False,
                           hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


@pytest.fixture
def trainers(tmp_path):
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    try:
        children = [local.start("trainer", f"trainer-{i}", ["--checkpoint-root", str(tmp_path)]) for i in range(3)]
        local.wait_ready()
        yield local, [TrainerClient(c.address, deadline_s=180) for c in children]
    finally:
        for child in local.children:
            try:
                os.kill(child.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        local.stop()


def _config(model_dir, backend: str, **kw) -> trainer_pb2.TrainerConfig:
    return trainer_pb2.TrainerConfig(
        model_path=str(model_dir), backend=backend, seed=3, micro_batch_size=2, bucket_bytes=1 << 20,
        optimizer=trainer_pb2.OptimizerConfig(lr=1e-2, grad_clip=0.5), **kw,
    )


def _batch(num: int) -> trainer_pb2.Batch:
    gen = torch.Generator().manual_seed(11)
    samples = []
    for i in range(num):
        prompt = torch.randint(3, 14, (3 + i % 4,), generator=gen).tolist()
        response = torch.randint(3, 14, (2 + (i * 5) % 7,), generator=gen).tolist()
        samples.append(trainer_pb2.Sample(prompt_ids=prompt, response_ids=response,
                                          advantages=torch.randn(len(response), generator=gen).tolist(),
                                          old_logprobs=[-2.5] * len(response)))
    return trainer_pb2.Batch(samples=samples)


def _hf_weights(client: TrainerClient) -> dict[str, torch.Tensor]:
    """What an engine receives over grpc_stream, by Hugging Face name."""
    manifest = manifest_from_proto(client.weight_manifest("sha256"))
    chunks = client._stub.GetWeights(trainer_pb2.GetWeightsRequest(version=manifest.version), timeout=60)
    out = {}
    for spec, flat in zip(manifest.buckets, receive(chunks, manifest)):
        out.update(unpack_bucket(spec, flat))
    return out


def _flat(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(sum(values, []))


def test_tensor_parallel_2_is_the_torch_model(trainers, model_dir, tmp_path):
    _, (rank0, rank1, torch_trainer) = trainers
    group = TrainerGroup([rank0, rank1], timeout_s=120)
    status = group.configure(_config(model_dir, "megatron", tensor_parallel=2, offload=True))
    assert (status.backend, status.world_size) == ("megatron", 2)
    torch_trainer.configure(_config(model_dir, "torch"))

    # The weights an engine gets are the checkpoint's, bit for bit, in Hugging Face names.
    _, reference = load_hf_dir(model_dir)
    sent = _hf_weights(rank0)
    assert sorted(sent) == sorted(reference.state_dict())
    for name, tensor in reference.state_dict().items():
        assert torch.equal(sent[name], tensor), name

    batch = _batch(5)
    assert torch.allclose(_flat(group.compute_logprobs("", batch)), _flat(torch_trainer.compute_logprobs("", batch)),
                          atol=1e-5)
    megatron_metrics, version = group.train_step(batch)
    torch_metrics, _ = torch_trainer.train_step(batch)
    assert version == 1
    for key in ("loss", "pg_loss", "grad_norm"):
        assert megatron_metrics[key] == pytest.approx(torch_metrics[key], rel=1e-4, abs=1e-6), key

    # The step moved both models the same way; the sync now reads the new weights. Adam's first
    # step moves a weight by up to lr (1e-2) whatever its gradient's size, so gradients that differ
    # in the last bits (two ranks' partial sums over gloo against one sum) move it differently by
    # ~0.1% of that (1.04e-5 on one o_proj element, measured on a CPU). 1% of lr is "the same way".
    after = _hf_weights(rank0)
    for name, tensor in _hf_weights(torch_trainer).items():
        assert torch.allclose(after[name], tensor, atol=1e-4), name
    assert torch.allclose(_flat(group.compute_logprobs("", batch)), _flat(torch_trainer.compute_logprobs("", batch)),
                          atol=1e-5)

    # Both ranks sleep; the sync still reads the last trained weights.
    group.sleep()
    for client in (rank0, rank1):
        life = client.status().lifecycle
        assert life.asleep and life.gpu_bytes_in_use == 0, client.address
    assert all(torch.equal(after[k], v) for k, v in _hf_weights(rank0).items())
    with pytest.raises(PeerError, match="not the weight source"):
        rank1.weight_manifest()

    # A checkpoint is a Hugging Face folder the torch backend loads, with both optimizer shards.
    saved = tmp_path / "ckpt"
    assert group.save_checkpoint(str(saved)) == 1
    on_disk = load_file(str(saved / "model.safetensors"))
    assert all(torch.equal(on_disk[k], after[k]) for k in on_disk)
    assert sorted(p.name for p in saved.glob("optimizer.rank-*")) == [
        "optimizer.rank-00000-of-00002.safetensors", "optimizer.rank-00001-of-00002.safetensors"]
    torch_trainer.load_checkpoint(str(saved), load_optimizer=False)
    assert all(torch.equal(v, after[k]) for k, v in _hf_weights(torch_trainer).items())
    group.load_checkpoint(str(saved), load_optimizer=True)
    assert rank0.status().step == 1


def test_eval_only_megatron_builds_no_optimizer(trainers, model_dir):
    _, (rank0, rank1, _) = trainers
    status = TrainerGroup([rank0, rank1], timeout_s=120).configure(
        _config(model_dir, "megatron", tensor_parallel=2, eval_only=True,
                scheduler=trainer_pb2.SchedulerConfig(kind="cosine", warmup_steps=0, decay_steps=0)))
    assert not status.has_optimizer and not status.has_scheduler
    with pytest.raises(PeerError, match="eval_only"):
        TrainerGroup([rank0, rank1]).train_step(_batch(2))


def test_one_rank_gathers_only_when_a_sync_or_a_sleep_needs_it(model_dir):
    """Unsplit, rank 0 gathers the Hugging Face weights lazily; a sync while asleep still reads
    exactly the weights of the last step."""
    from services.trainer.batch import Sample
    from services.trainer.megatron_backend import MegatronTrainer
    from services.trainer.settings import OptimizerSettings, TrainerSettings

    trainer = MegatronTrainer(TrainerSettings(model_path=str(model_dir), backend="megatron", offload=True,
                                              optimizer=OptimizerSettings(lr=1e-2)))
    try:
        samples = [Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7], advantages=[1.0, -0.5])] * 3
        trainer.train_step(samples)
        assert trainer.export is None  # no sync asked yet: nothing gathered
        expected = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        trainer.sleep()
        sync = trainer.weights_for_sync()
        assert sync.source == "host" and trainer.export.version("actor") == 1
        got = sync.weights.views
        # the fused Megatron tensors were split back: q_proj is the head of linear_qkv's first group
        qkv = expected["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"][:8], qkv[:8])
        assert torch.equal(got["model.norm.weight"], expected["decoder.final_layernorm.weight"])
        trainer.wake()
        trainer.train_step(samples)
        assert trainer.weights_for_sync().weights.version == 2  # gathered again for the new version
    finally:
        trainer.close()
