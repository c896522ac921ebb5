"""The link's socket protocol (`services/rollout/link.py`), against a real engine in this process:
only a peer with the engine's token is served, a frame that breaks the protocol closes that
connection and nothing else, and calls and cancellations get the replies they should."""

from __future__ import annotations

import socket
import struct

import grpc
import pytest

from services.api import rollout_link_pb2, rollout_pb2
from services.rollout import link
from services.rollout.engine import RolloutEngine, RolloutSettings
from services.rollout.server import RolloutServicer
from tests.conftest import make_tiny_model

TOKEN = "link-test-token"


LONG = 4000  # tokens of a row that must still run while a test acts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("link-model"), max_position_embeddings=LONG + 16)


@pytest.fixture
def listener(tmp_path, model_dir):
    servicer = RolloutServicer()
    servicer._engine = RolloutEngine(RolloutSettings(model_path=str(model_dir)))
    listening = link.Listener(str(tmp_path / "link.sock"), servicer, TOKEN)
    yield listening
    listening.close()
    servicer.close()


def _request(prompt: str = "1+2=", max_new_tokens: int = 8) -> bytes:
    return rollout_pb2.GenerateRequest(prompts=[prompt], sampling=rollout_pb2.SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)).SerializeToString()


def _connect(path: str, hello: bytes | None = TOKEN.encode()):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    if hello is not None:
        link.send(sock, hello)
    return sock, sock.makefile("rb")


def _replies(reader, count: int) -> list:
    got = []
    while len(got) < count:
        got += rollout_link_pb2.LinkReplies.FromString(link.read_frame(reader)).replies
    return got


def test_a_peer_with_the_token_gets_each_calls_replies(listener):
    sock, reader = _connect(listener.path)
    link.send(sock, rollout_link_pb2.LinkCalls(calls=[
        rollout_link_pb2.LinkCall(id=7, request=_request()),
        rollout_link_pb2.LinkCall(id=8, stream=True, request=_request("3+4=")),
        rollout_link_pb2.LinkCall(id=9, request=b"\xff\xff not a request")]))
    replies = _replies(reader, 4)  # 7's answer; 8's completion and its end; 9's error
    by_id = {}
    for r in replies:
        by_id.setdefault(r.id, []).append(r)
    (seven,) = by_id[7]
    assert seven.last and not seven.code
    assert len(rollout_pb2.GenerateResponse.FromString(seven.response).results[0].output_ids) == 8
    first, end = by_id[8]
    assert rollout_pb2.GenerateStreamResponse.FromString(first.response).index == 0 and not first.last
    assert end.last and not end.code and not end.response
    (nine,) = by_id[9]
    assert nine.last and nine.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "GenerateRequest" in nine.message
    sock.close()


def test_a_cancelled_call_ends_cancelled_and_a_bad_one_is_named(listener):
    sock, reader = _connect(listener.path)
    long = rollout_pb2.GenerateRequest(prompts=["1+2="], sampling=rollout_pb2.SamplingParams(
        temperature=0.0, max_new_tokens=LONG, ignore_eos=True), input_ids=[]).SerializeToString()
    link.send(sock, rollout_link_pb2.LinkCalls(calls=[rollout_link_pb2.LinkCall(id=1, request=long)], cancelled=[1]))
    (reply,) = _replies(reader, 1)
    assert reply.last and reply.code == grpc.StatusCode.CANCELLED.value[0]
    too_long = _request(max_new_tokens=LONG + 100)  # more than the model's positions
    link.send(sock, rollout_link_pb2.LinkCalls(calls=[rollout_link_pb2.LinkCall(id=2, request=too_long)]))
    (reply,) = _replies(reader, 1)
    assert reply.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "max_position_embeddings" in reply.message
    sock.close()


@pytest.mark.parametrize("hello", [b"wrong token", b""])
def test_a_peer_without_the_token_is_closed_unserved(listener, hello):
    sock, reader = _connect(listener.path, hello)
    try:
        link.send(sock, rollout_link_pb2.LinkCalls(calls=[rollout_link_pb2.LinkCall(id=1, request=_request())]))
    except OSError:
        pass  # closed already
    assert link.read_frame(reader) is None  # closed, no reply
    sock.close()


def test_a_frame_that_breaks_the_protocol_closes_only_its_connection(listener):
    good, good_reader = _connect(listener.path)
    bad, bad_reader = _connect(listener.path)
    bad.sendall(struct.pack("<I", link.MAX_FRAME_BYTES + 1))  # longer than any frame may be
    assert link.read_frame(bad_reader) is None
    garbage, garbage_reader = _connect(listener.path)
    link.send(garbage, b"\x0a\xff\xff\xff")  # not a LinkCalls
    assert link.read_frame(garbage_reader) is None
    link.send(good, rollout_link_pb2.LinkCalls(calls=[rollout_link_pb2.LinkCall(id=1, request=_request())]))
    (reply,) = _replies(good_reader, 1)
    assert reply.last and not reply.code
    for s in (good, bad, garbage):
        s.close()


def test_a_frame_cut_short_or_too_long_is_an_error_naming_it(tmp_path):
    a, b = socket.socketpair()
    a.sendall(struct.pack("<I", 10) + b"12345")
    a.close()
    with pytest.raises(link.LinkError, match="cut short"):
        link.read_frame(b.makefile("rb"))
    with pytest.raises(link.LinkError, match="more than"):
        link.send(b, b"x" * (link.MAX_FRAME_BYTES + 1))


def test_batches_keep_frames_under_the_limit_and_never_split_an_item():
    sizes = [link.MAX_BATCH_BYTES // 3] * 7 + [link.MAX_BATCH_BYTES * 2]
    batches = list(link._batches(sizes, lambda n: n))
    assert [len(b) for b in batches] == [3, 3, 1, 1]
    assert sum(sizes) == sum(map(sum, batches))


def test_the_front_ends_end_releases_a_caller_that_goes_away_and_fails_all_when_the_link_breaks(listener):
    broken = []
    engine = link.EngineLink(listener.path, TOKEN, on_broken=broken.append)
    long = rollout_pb2.GenerateRequest(prompts=["1+2="], sampling=rollout_pb2.SamplingParams(
        temperature=0.0, max_new_tokens=LONG, ignore_eos=True, stop=["never said"])).SerializeToString()
    call_id, replies = engine.call(long, stream=True, timeout_s=None)
    engine.cancel(call_id)  # the caller's thread waiting on `replies` is let go at once
    reply = replies.get(timeout=5)
    assert reply.last and reply.code == grpc.StatusCode.CANCELLED.value[0]
    _, answered = engine.call(_request(), stream=False, timeout_s=30)
    assert not answered.get(timeout=30).code
    _, waiting = engine.call(long, stream=False, timeout_s=None)
    engine._sock.shutdown(socket.SHUT_RDWR)  # the engine's process gone, as the front end sees it
    reply = waiting.get(timeout=10)
    assert reply.last and reply.code == grpc.StatusCode.UNAVAILABLE.value[0] and broken
    with pytest.raises(link.LinkBroken):
        engine.call(_request(), stream=False, timeout_s=30)
