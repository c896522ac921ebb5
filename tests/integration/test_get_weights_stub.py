"""The trainer sends GetWeights chunks it serialized by hand; any client built from the proto
(here the generated stub, not rlfleet's engine) must read them as ordinary WeightChunk messages."""

from __future__ import annotations

import grpc
import pytest

from services import rpc
from services.api import trainer_pb2, trainer_pb2_grpc
from services.trainer.server import build_server
from services.weights.grpc_stream import receive
from services.weights.manifest import manifest_from_proto


@pytest.fixture
def trainer(tiny_model_dir):
    server = build_server("127.0.0.1:0")
    channel = rpc.open_channel(f"127.0.0.1:{server.port}")
    stub = trainer_pb2_grpc.TrainerStub(channel)
    stub.Configure(trainer_pb2.ConfigureTrainerRequest(
        config=trainer_pb2.TrainerConfig(model_path=str(tiny_model_dir), bucket_bytes=64 << 10)), timeout=60)
    yield stub
    channel.close()
    server.stop(0)


def test_a_generated_stub_receives_bit_identical_buckets(trainer):
    proto = trainer.GetWeightManifest(trainer_pb2.GetWeightManifestRequest(fingerprint_algo="sha256"), timeout=30).manifest
    manifest = manifest_from_proto(proto)
    assert len(manifest.buckets) > 1
    chunks = trainer.GetWeights(trainer_pb2.GetWeightsRequest(version=manifest.version, chunk_bytes=10_000), timeout=30)
    buffers = receive(chunks, manifest)  # verifies every bucket's sha256
    assert [b.numel() for b in buffers] == [b.nbytes for b in manifest.buckets]


def test_an_unknown_version_is_refused_before_any_chunk(trainer):
    with pytest.raises(grpc.RpcError) as info:
        list(trainer.GetWeights(trainer_pb2.GetWeightsRequest(version=12345), timeout=30))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "12345" in info.value.details()
