"""The grpc_stream data plane: buckets as a server stream of `WeightChunk {bucket, offset, data}`.

This is the fallback plane, used when trainer and engine share neither a GPU, a host, nor a
collective group: the engine pulls `GetWeights` from the trainer. The sender slices host
buckets into chunks (one copy, into the protobuf bytes); the receiver copies each chunk into a
preallocated flat buffer per bucket (one copy), rejects chunks that do not fit, hashes each
16 MiB piece as soon as it is complete, and hands the buffers out only when every byte arrived
and every bucket matches its fingerprint. Chunks may
arrive in any order. Servers and channels live elsewhere; this module only makes and consumes
the messages.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Callable, ContextManager, Iterable, Iterator, Optional, Sequence

import grpc
import torch
from google.protobuf.message import DecodeError

from services.api import weights_pb2
from services.weights.buckets import Manifest, host_bytes
from services.weights.errors import IncompleteTransfer, InvalidChunk, WeightSyncError
from services.weights.fingerprint import IncrementalFingerprint
from services.weights.verify import verify_buckets

__all__ = ["DEFAULT_CHUNK_BYTES", "StreamReceiver", "decode_chunk", "encode_chunk", "iter_chunks", "receive"]

# gRPC refuses received messages over 4 MiB unless the channel raises
# `grpc.max_receive_message_length`, so a 4 MiB chunk plus its header would fail on a default
# channel. On loopback (bench/weight_sync.py, 463 MB, 2 cores) 0.5-1 MiB chunks streamed at
# 2.0-2.1 GB/s, 2 MiB at 1.7-1.9, 4 MiB at 1.4 and 8 MiB at 1.2.
DEFAULT_CHUNK_BYTES = 1 << 20


def iter_chunks(
    manifest: Manifest,
    bucket_source: Callable[[int], torch.Tensor],
    buckets: Optional[Sequence[int]] = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    encoded: bool = False,
    guard: Callable[[], ContextManager] = contextlib.nullcontext,
) -> Iterator[weights_pb2.WeightChunk | bytes]:
    """Yield the chunks of `buckets` (default: all, in order). `bucket_source(i)` returns bucket
    i as a flat uint8 CPU tensor; it is called lazily, once per bucket, just before that
    bucket's first chunk, so a source staging from the GPU needs only one bucket on the host.
    With `encoded` each chunk comes already serialized (`encode_chunk`), for a server whose
    GetWeights handler sends bytes as they are. Each chunk is copied out of its bucket inside
    `guard()`, which may refuse (raise) once the bucket's memory is no longer the stream's."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    indices = list(range(len(manifest.buckets)) if buckets is None else buckets)
    for index in indices:
        if not 0 <= index < len(manifest.buckets):
            raise ValueError(
                f"bucket {index} is not in the manifest ({len(manifest.buckets)} buckets)"
            )
    for index in indices:
        nbytes = manifest.buckets[index].nbytes
        flat = bucket_source(index)
        if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.device.type != "cpu":
            raise ValueError(
                f"bucket_source({index}) must return a 1-D uint8 CPU tensor, "
                f"got {flat.dtype} {list(flat.shape)} on {flat.device}"
            )
        if flat.numel() < nbytes:
            raise ValueError(
                f"bucket_source({index}) returned {flat.numel()} bytes, the manifest says {nbytes}"
            )
        data = host_bytes(flat.detach().contiguous())  # [>= nbytes], shares memory
        for offset in range(0, nbytes, chunk_bytes):
            end = min(offset + chunk_bytes, nbytes)
            with guard():
                if encoded:
                    chunk = encode_chunk(index, offset, data[offset:end])
                else:
                    chunk = weights_pb2.WeightChunk(bucket=index, offset=offset, data=bytes(data[offset:end]))
            yield chunk


# ---- WeightChunk wire format by hand: the bytes are copied once on each side ----------------------
# A WeightChunk serialized by protobuf costs two copies of its data on the sender (slice to bytes,
# bytes into the message) and two on the receiver (message parse, then into the bucket). These
# write and read the same protobuf wire format (fields 1 and 2 varints, field 3 length-delimited),
# so either side may still use the generated message class.
_TAG_BUCKET, _TAG_OFFSET, _TAG_DATA = 0x08, 0x10, 0x1A


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # negative int32/int64 are ten-byte two's complement varints
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_chunk(bucket: int, offset: int, data) -> bytes:
    """`WeightChunk(bucket, offset, data).SerializeToString()`, with one copy of `data`."""
    header = bytearray()
    if bucket:
        header += bytes((_TAG_BUCKET,)) + _varint(bucket)
    if offset:
        header += bytes((_TAG_OFFSET,)) + _varint(offset)
    header += bytes((_TAG_DATA,)) + _varint(len(data))
    return b"".join((header, data))


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise ValueError("truncated varint")
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def decode_chunk(raw: bytes) -> tuple[int, int, memoryview]:
    """(bucket, offset, data) of a serialized WeightChunk; `data` is a view into `raw`. Anything
    but the three known fields goes through the generated parser (which also names bad input)."""
    bucket = offset = 0
    data = memoryview(b"")
    pos = 0
    try:
        while pos < len(raw):
            tag = raw[pos]
            pos += 1
            if tag in (_TAG_BUCKET, _TAG_OFFSET):
                value, pos = _read_varint(raw, pos)
                value = value - (1 << 64) if value >> 63 else value  # int32 and int64 alike
                if tag == _TAG_BUCKET:
                    bucket = value
                else:
                    offset = value
            elif tag == _TAG_DATA:
                size, pos = _read_varint(raw, pos)
                if pos + size > len(raw):
                    raise ValueError("truncated data field")
                data, pos = memoryview(raw)[pos : pos + size], pos + size
            else:
                raise ValueError("unexpected field")
    except ValueError:
        try:
            message = weights_pb2.WeightChunk.FromString(raw)
        except DecodeError as e:
            raise InvalidChunk(f"malformed WeightChunk ({len(raw)} bytes): {e}") from e
        return message.bucket, message.offset, memoryview(message.data)
    return bucket, offset, data


class _Ranges:
    """Disjoint received byte ranges of one bucket, merged as they touch."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.num_bytes = 0

    def add(self, start: int, end: int) -> bool:
        """Record [start, end); False (and nothing recorded) if it overlaps a recorded range."""
        i = bisect.bisect_right(self.starts, start)
        if (i > 0 and self.ends[i - 1] > start) or (i < len(self.starts) and self.starts[i] < end):
            return False
        joins_left = i > 0 and self.ends[i - 1] == start
        joins_right = i < len(self.starts) and self.starts[i] == end
        if joins_left and joins_right:
            self.ends[i - 1] = self.ends.pop(i)
            del self.starts[i]
        elif joins_left:
            self.ends[i - 1] = end
        elif joins_right:
            self.starts[i] = start
        else:
            self.starts.insert(i, start)
            self.ends.insert(i, end)
        self.num_bytes += end - start
        return True

    def first_missing(self) -> int:
        return self.ends[0] if self.starts and self.starts[0] == 0 else 0


class StreamReceiver:
    """Assembles one manifest's buckets from `WeightChunk`s into flat uint8 CPU buffers."""

    def __init__(self, manifest: Manifest, buffers: Optional[Sequence[torch.Tensor]] = None) -> None:
        """`buffers` (flat uint8 CPU tensors sized as the buckets) are reused when given."""
        self.manifest = manifest
        if buffers is not None and [b.numel() for b in buffers] != [b.nbytes for b in manifest.buckets]:
            raise ValueError("buffers: sizes do not match the manifest's buckets")
        self._buffers = list(buffers) if buffers is not None else [torch.empty(b.nbytes, dtype=torch.uint8) for b in manifest.buckets]
        self._views = [host_bytes(buf) for buf in self._buffers]  # writable views of the buffers
        self._ranges = [_Ranges() for _ in manifest.buckets]
        # Host fingerprints are computed piece by piece as the front of each bucket fills in.
        incremental = manifest.fingerprint_algo == "xxh3"
        self._hashers = [IncrementalFingerprint(buf) for buf in self._buffers] if incremental else []
        self._finished = False

    @property
    def received_bytes(self) -> int:
        return sum(r.num_bytes for r in self._ranges)

    def accept(self, chunk: weights_pb2.WeightChunk | bytes) -> None:
        """Copy one chunk (a message, or its serialized bytes) into place; `InvalidChunk` (a
        ValueError) if it does not fit."""
        if isinstance(chunk, bytes):
            index, offset, data = decode_chunk(chunk)
        else:
            index, offset, data = chunk.bucket, chunk.offset, chunk.data
        if self._finished:
            raise InvalidChunk(f"chunk for bucket {index} arrived after finish()")
        size = len(data)
        if not 0 <= index < len(self._buffers):
            raise InvalidChunk(f"chunk names unknown bucket {index} ({len(self._buffers)} buckets)")
        nbytes = self.manifest.buckets[index].nbytes
        if offset < 0 or offset + size > nbytes:
            raise InvalidChunk(
                f"chunk [{offset}, {offset + size}) of bucket {index} runs past the end "
                f"of the bucket ({nbytes} bytes)"
            )
        if size == 0:
            return
        if not self._ranges[index].add(offset, offset + size):
            raise InvalidChunk(
                f"chunk [{offset}, {offset + size}) of bucket {index} overlaps bytes already "
                f"received (duplicate or overlapping chunk)"
            )
        self._views[index][offset : offset + size] = data
        if self._hashers:
            self._hashers[index].filled(self._ranges[index].first_missing())

    def finish(self, verify_algo: Optional[str] = None) -> list[torch.Tensor]:
        """Check completeness, then fingerprints, and return one flat buffer per bucket.

        `verify_algo` defaults to the manifest's algo; the manifest must carry fingerprints made
        with it (a fingerprint can only be checked with the algo that made it).
        """
        for bucket, ranges in zip(self.manifest.buckets, self._ranges):
            if ranges.num_bytes != bucket.nbytes:
                raise IncompleteTransfer(
                    f"bucket {bucket.index} is incomplete: received {ranges.num_bytes} of "
                    f"{bucket.nbytes} bytes (first missing byte at {ranges.first_missing()})"
                )
        computed = [h.result() for h in self._hashers] if self._hashers else None
        verify_buckets(self.manifest, self._buffers, verify_algo, computed)
        self._finished = True
        return list(self._buffers)


def receive(
    chunks: Iterable[weights_pb2.WeightChunk],
    manifest: Manifest,
    verify_algo: Optional[str] = None,
) -> list[torch.Tensor]:
    """Drain `chunks` (e.g. a `GetWeights` response stream) and return verified buffers.

    A gRPC failure mid-stream becomes `WeightSyncError` carrying the status code.
    """
    receiver = StreamReceiver(manifest)
    try:
        for chunk in chunks:
            receiver.accept(chunk)
    except grpc.RpcError as e:
        code = e.code() if isinstance(e, grpc.Call) else None
        details = e.details() if isinstance(e, grpc.Call) else str(e)
        raise WeightSyncError(
            f"weight stream failed after {receiver.received_bytes} bytes: {code}: {details}"
        ) from e
    return receiver.finish(verify_algo)
