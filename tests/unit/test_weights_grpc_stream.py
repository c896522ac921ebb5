"""The grpc_stream plane: chunking, the receiver's checks, and a real loopback stream."""

import random
from concurrent import futures

import grpc
import pytest
import torch

from services.api import trainer_pb2, weights_pb2
from services.weights.buckets import Manifest, pack_bucket, plan_buckets, unpack_bucket
from services.weights.errors import (
    FingerprintMismatch,
    IncompleteTransfer,
    InvalidChunk,
    WeightSyncError,
)
from services.weights.grpc_stream import StreamReceiver, decode_chunk, encode_chunk, iter_chunks, receive
from services.weights.manifest import make_manifest


def _weights(num_bytes_per_dtype: int, num_tensors: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    named = []
    for dtype in (torch.bfloat16, torch.float32):
        numel = num_bytes_per_dtype // num_tensors // dtype.itemsize
        for i in range(num_tensors):
            named.append((f"{dtype}.{i}", torch.randn(numel - i, generator=g).to(dtype)))
    return named


def _pack(named, bucket_bytes: int, algo: str = "fast"):
    buckets = plan_buckets(named, bucket_bytes)
    flats = [pack_bucket(b, dict(named)) for b in buckets]
    return make_manifest(3, "host", buckets, flats, algo), flats


def _assert_same(manifest: Manifest, received: list[torch.Tensor], named) -> None:
    got = {}
    for bucket, flat in zip(manifest.buckets, received):
        got.update(unpack_bucket(bucket, flat))
    assert got.keys() == dict(named).keys()
    for name, tensor in named:
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


@pytest.fixture
def small():
    named = _weights(64 << 10)
    manifest, flats = _pack(named, bucket_bytes=20 << 10)
    assert len(manifest.buckets) >= 4
    return named, manifest, flats


def test_chunks_in_any_order_reassemble_bit_identical(small):
    named, manifest, flats = small
    chunks = list(iter_chunks(manifest, flats.__getitem__, chunk_bytes=1000))
    assert max(len(c.data) for c in chunks) == 1000
    random.Random(0).shuffle(chunks)
    _assert_same(manifest, receive(chunks, manifest), named)


def test_sha256_manifest_verifies_exactly(small):
    named, _, _ = small
    manifest, flats = _pack(named, bucket_bytes=20 << 10, algo="sha256")
    _assert_same(manifest, receive(iter_chunks(manifest, flats.__getitem__), manifest), named)


def test_iter_chunks_selects_buckets_and_checks_arguments(small):
    _, manifest, flats = small
    chunks = list(iter_chunks(manifest, flats.__getitem__, buckets=[2, 0], chunk_bytes=1 << 20))
    assert [c.bucket for c in chunks] == [2, 0]
    assert [len(c.data) for c in chunks] == [manifest.buckets[2].nbytes, manifest.buckets[0].nbytes]
    with pytest.raises(ValueError, match="bucket 99"):
        next(iter_chunks(manifest, flats.__getitem__, buckets=[99]))
    with pytest.raises(ValueError, match="chunk_bytes"):
        next(iter_chunks(manifest, flats.__getitem__, chunk_bytes=0))
    with pytest.raises(ValueError, match=r"bucket_source\(0\)"):
        next(iter_chunks(manifest, lambda i: flats[i][:10]))


def test_receiver_rejects_chunks_that_do_not_fit(small):
    _, manifest, _ = small
    receiver = StreamReceiver(manifest)
    nbytes = manifest.buckets[1].nbytes
    with pytest.raises(InvalidChunk, match="unknown bucket 42"):
        receiver.accept(weights_pb2.WeightChunk(bucket=42, offset=0, data=b"x"))
    with pytest.raises(ValueError, match="bucket 1 runs past the end"):
        receiver.accept(weights_pb2.WeightChunk(bucket=1, offset=nbytes - 2, data=b"xyz"))
    receiver.accept(weights_pb2.WeightChunk(bucket=1, offset=100, data=b"x" * 50))
    with pytest.raises(InvalidChunk, match="bucket 1 overlaps"):
        receiver.accept(weights_pb2.WeightChunk(bucket=1, offset=100, data=b"x" * 50))
    with pytest.raises(InvalidChunk, match=r"\[149, 151\) of bucket 1 overlaps"):
        receiver.accept(weights_pb2.WeightChunk(bucket=1, offset=149, data=b"xy"))
    receiver.accept(weights_pb2.WeightChunk(bucket=1, offset=150, data=b"x"))  # touching is fine
    receiver.accept(weights_pb2.WeightChunk(bucket=1, offset=99, data=b"x"))
    assert receiver.received_bytes == 52


def test_missing_chunk_is_incomplete_transfer_naming_the_bucket(small):
    _, manifest, flats = small
    chunks = list(iter_chunks(manifest, flats.__getitem__, chunk_bytes=4096))
    dropped = next(i for i, c in enumerate(chunks) if c.bucket == 2 and c.offset == 4096)
    del chunks[dropped]
    expected = manifest.buckets[2].nbytes
    with pytest.raises(
        IncompleteTransfer,
        match=f"bucket 2 is incomplete: received {expected - 4096} of {expected} bytes "
        r"\(first missing byte at 4096\)",
    ):
        receive(chunks, manifest)


def test_corrupted_byte_is_fingerprint_mismatch_naming_the_bucket(small):
    _, manifest, flats = small
    chunks = list(iter_chunks(manifest, flats.__getitem__, chunk_bytes=4096))
    victim = next(i for i, c in enumerate(chunks) if c.bucket == 3)
    data = bytearray(chunks[victim].data)
    data[17] ^= 0x40
    chunks[victim].data = bytes(data)
    with pytest.raises(FingerprintMismatch, match="bucket 3 fingerprint mismatch"):
        receive(chunks, manifest)


def test_finish_needs_a_fingerprint_of_the_requested_algo(small):
    _, manifest, flats = small
    with pytest.raises(WeightSyncError, match="bucket 0 .*cannot be verified with 'sha256'"):
        receive(iter_chunks(manifest, flats.__getitem__), manifest, verify_algo="sha256")


def test_rpc_error_mid_stream_becomes_weight_sync_error(small):
    _, manifest, flats = small

    class _Broken(grpc.RpcError, grpc.Call):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "trainer went away"

        initial_metadata = trailing_metadata = time_remaining = cancel = is_active = None
        add_callback = None

    def stream():
        yield from iter_chunks(manifest, flats.__getitem__, buckets=[0])
        raise _Broken()

    with pytest.raises(WeightSyncError, match="UNAVAILABLE: trainer went away") as info:
        receive(stream(), manifest)
    assert isinstance(info.value.__cause__, grpc.RpcError)


_METHOD = "/rlfleet.test.WeightsLoopback/GetWeights"


def test_grpc_loopback_streams_64_mib_bit_identical():
    named = _weights(32 << 20, num_tensors=6, seed=1)  # 2 dtypes x 32 MiB
    manifest, flats = _pack(named, bucket_bytes=16 << 20)
    assert manifest.total_bytes > 63 << 20 and len(manifest.buckets) >= 4

    def get_weights(request: trainer_pb2.GetWeightsRequest, context):
        assert request.version == manifest.version
        yield from iter_chunks(manifest, flats.__getitem__, buckets=list(request.buckets) or None)

    handler = grpc.method_handlers_generic_handler(
        "rlfleet.test.WeightsLoopback",
        {
            "GetWeights": grpc.unary_stream_rpc_method_handler(
                get_weights,
                request_deserializer=trainer_pb2.GetWeightsRequest.FromString,
                response_serializer=weights_pb2.WeightChunk.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream(
                _METHOD,
                request_serializer=trainer_pb2.GetWeightsRequest.SerializeToString,
                response_deserializer=weights_pb2.WeightChunk.FromString,
            )
            stream = call(trainer_pb2.GetWeightsRequest(version=manifest.version), timeout=30)
            received = receive(stream, manifest)
    finally:
        server.stop(grace=None)
    _assert_same(manifest, received, named)


@pytest.mark.parametrize("bucket, offset", [(0, 0), (3, 0), (0, 5), (7, 1 << 40), (-1, -2)])
def test_hand_encoded_chunks_are_the_protobuf_wire_format(bucket, offset):
    data = bytes(range(256)) * 5
    raw = encode_chunk(bucket, offset, memoryview(data))
    parsed = weights_pb2.WeightChunk.FromString(raw)
    assert (parsed.bucket, parsed.offset, parsed.data) == (bucket, offset, data)
    generated = weights_pb2.WeightChunk(bucket=bucket, offset=offset, data=data).SerializeToString()
    assert raw == generated
    got = decode_chunk(generated)
    assert (got[0], got[1], bytes(got[2])) == (bucket, offset, data)


def test_decoding_falls_back_to_the_generated_parser_and_names_garbage():
    # fields in another order plus an unknown field: still read correctly
    message = weights_pb2.WeightChunk(bucket=2, offset=9, data=b"abc")
    raw = message.SerializeToString()
    reordered = raw[-5:] + raw[:-5] + b"\x20\x01"  # data first, then bucket/offset, then field 4
    bucket, offset, data = decode_chunk(reordered)
    assert (bucket, offset, bytes(data)) == (2, 9, b"abc")
    with pytest.raises(InvalidChunk, match="malformed WeightChunk"):
        decode_chunk(b"\x1a\xff\xff\xff\x0f" + b"x")  # a data field longer than the message
