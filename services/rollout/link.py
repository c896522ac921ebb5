"""The link between a rollout server's front end and its engine's process (`--front-end process`).

One Unix socket carries every caller's Generate and GenerateStream call from the front end
(`frontend.py`) to the engine's process and the replies back, in frames of a 4-byte little-endian
length and one protobuf message (`rollout_link.proto`): LinkCalls one way, LinkReplies the other,
each holding as many calls or replies as were ready. The first frame from the front end is the
engine's token. No pickle: only those messages cross the socket.

Why not a gRPC stream: on this project's 2-core CPU, an echo over a gRPC bidirectional stream
cost the answering process 267 us of CPU a message in and out, a Unix socket 20 us (ad-hoc
/tmp/exp/link_cost.py, not committed). That CPU is the GIL the engine's serving thread needs.

The engine's side submits each call to the engine with callbacks (no thread per call); the
front end's side (`EngineLink`) hands each reply to the caller's thread waiting for it.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import os
import queue
import socket
import struct
import threading
import time
from typing import Callable, Iterator

import grpc

from services import rpc
from services.api import rollout_link_pb2, rollout_pb2
from services.rollout.server import _ERRORS, MAX_GENERATE_CALLS, RolloutServicer, _completion

log = rpc.get_logger("rollout-link")
_LENGTH = struct.Struct("<I")
MAX_BATCH_BYTES = rpc.MAX_MESSAGE_BYTES  # a frame holds calls (or replies) up to this many bytes, or one larger
MAX_FRAME_BYTES = 2 * rpc.MAX_MESSAGE_BYTES + (1 << 20)  # one largest call or reply and what went before it


class LinkError(RuntimeError):
    """A frame that breaks the link's protocol (too long, not the message it should be, cut short)."""


def send(sock: socket.socket, message) -> None:
    data = message if isinstance(message, bytes) else message.SerializeToString()
    if len(data) > MAX_FRAME_BYTES:
        raise LinkError(f"frame: {len(data)} bytes is more than {MAX_FRAME_BYTES}")
    sock.sendall(_LENGTH.pack(len(data)) + data)


def read_frame(reader) -> bytes | None:
    """The next frame's bytes from `reader` (a socket's makefile("rb")); None at a clean end."""
    head = reader.read(_LENGTH.size)
    if not head:
        return None
    if len(head) < _LENGTH.size:
        raise LinkError("frame: cut short in its length")
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise LinkError(f"frame: {length} bytes is more than {MAX_FRAME_BYTES}")
    data = reader.read(length)
    if len(data) < length:
        raise LinkError(f"frame: cut short ({len(data)} of {length} bytes)")
    return data


def messages(reader, parse: Callable[[bytes], object]) -> Iterator:
    """Every message on `reader` until it ends (LinkError for one that does not parse)."""
    while (data := read_frame(reader)) is not None:
        try:
            yield parse(data)
        except Exception as e:  # (protobuf's DecodeError)
            raise LinkError(f"frame: not the message expected: {e}") from e


def _batches(items: list, size: Callable[[object], int]) -> Iterator[list]:
    """`items` in runs of up to MAX_BATCH_BYTES (by `size`), each at least one item."""
    batch, total = [], 0
    for item in items:
        if batch and total + size(item) > MAX_BATCH_BYTES:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += size(item)
    if batch:
        yield batch


class _Forwarded:
    """A caller's call as the engine's side of the link holds it, until its last reply."""

    __slots__ = ("id", "stream", "logprobs", "deadline", "gone", "results", "started", "tokens")

    def __init__(self, call: rollout_link_pb2.LinkCall, logprobs: bool):
        self.id, self.stream, self.logprobs = call.id, call.stream, logprobs
        self.deadline = time.monotonic() + call.timeout_s if call.timeout_s > 0 else None
        self.gone = False  # the front end said its caller went away
        self.results: dict[int, object] = {}  # a Generate call's completions, until the last
        self.started = time.perf_counter()
        self.tokens = 0

    def cancelled(self) -> bool:
        """What the engine polls every round, as it polls a direct caller's `_ended`."""
        return self.gone or (self.deadline is not None and time.monotonic() > self.deadline)


class LinkServicer:
    """The engine's side of one link from a front end in its own process (`frontend.py`).

    Every forwarded call is submitted to the engine with callbacks, not given a thread: the
    connection's reader submits, the engine's serving thread only queues what finished, and the
    connection's own thread builds and sends the replies, as many as are ready in one frame. So
    the engine's process runs two threads for all its callers, where a gRPC front end in it runs
    one per caller, each taking the GIL from the serving thread."""

    def __init__(self, rollout: RolloutServicer):
        self.rollout = rollout

    def serve(self, request_iterator: Iterator[rollout_link_pb2.LinkCalls]) -> Iterator[rollout_link_pb2.LinkReplies]:
        """The replies to the calls `request_iterator` brings, as they are ready, until it ends."""
        done: queue.SimpleQueue = queue.SimpleQueue()  # (call, index, generation) | (call, error) | None
        calls: dict[int, _Forwarded] = {}
        threading.Thread(target=self._read, args=(request_iterator, calls, done), name="link-reader",
                         daemon=True).start()
        while True:
            items = [done.get()]
            while True:
                try:
                    items.append(done.get_nowait())
                except queue.Empty:
                    break
            replies = [r for item in items if item is not None for r in self._replies(item, calls)]
            for batch in _batches(replies, lambda r: len(r.response)):
                yield rollout_link_pb2.LinkReplies(replies=batch)
            if None in items:  # the front end went away: its calls' rows stop at the next round
                for _ in range(len(calls)):
                    self.rollout.metrics.in_flight.dec()
                    self.rollout.metrics.requests.labels("error").inc()
                calls.clear()
                return

    def _read(self, request_iterator, calls: dict[int, _Forwarded], done: queue.SimpleQueue) -> None:
        try:
            for message in request_iterator:
                for call in message.calls:
                    self._start(call, calls, done)
                for gone in message.cancelled:
                    if (forwarded := calls.get(gone)) is not None:
                        forwarded.gone = True
        except (OSError, LinkError):
            pass  # the front end went away: what it forwarded stops below
        except Exception:  # never leave the front end's callers waiting on a reader that died
            log.exception("link: reading the front end's calls failed")
        finally:
            for forwarded in list(calls.values()):
                forwarded.gone = True
            done.put(None)

    def _start(self, call: rollout_link_pb2.LinkCall, calls: dict[int, _Forwarded], done: queue.SimpleQueue) -> None:
        metrics = self.rollout.metrics
        if len(calls) >= MAX_GENERATE_CALLS:
            done.put((_Forwarded(call, False), _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"{'GenerateStream' if call.stream else 'Generate'}: {MAX_GENERATE_CALLS} such call(s) already in "
                "progress here; retry later"))))
            return
        try:
            request = rollout_pb2.GenerateRequest.FromString(call.request)
        except Exception as e:  # (protobuf's DecodeError)
            done.put((_Forwarded(call, False), _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a GenerateRequest: {e}")))
            return
        forwarded = _Forwarded(call, request.return_logprobs)
        calls[call.id] = forwarded
        metrics.in_flight.inc()
        try:
            engine, prompts_ids, sampling = self.rollout._prepare(request)
            options = self.rollout._serving_options(engine, request)
            if getattr(engine, "streams", False):
                engine.submit(prompts_ids, sampling, cancelled=forwarded.cancelled,
                              on_result=lambda index, g: done.put((forwarded, index, g)),
                              on_finish=lambda r: done.put((forwarded, r.error)), **options)
            else:  # an engine that answers a call at its end: a thread waits for it
                threading.Thread(target=self._wait, args=(engine, prompts_ids, sampling, forwarded, done),
                                 name="link-call", daemon=True).start()
        except Exception as e:
            done.put((forwarded, e))

    @staticmethod
    def _wait(engine, prompts_ids, sampling, forwarded: _Forwarded, done: queue.SimpleQueue) -> None:
        try:
            results, _ = engine.generate(prompts_ids, sampling, cancelled=forwarded.cancelled)
        except Exception as e:
            done.put((forwarded, e))
            return
        for index, g in enumerate(results):
            done.put((forwarded, index, g))
        done.put((forwarded, None))

    def _replies(self, item: tuple, calls: dict[int, _Forwarded]) -> list[rollout_link_pb2.LinkReply]:
        forwarded = item[0]
        engine = self.rollout._engine
        if len(item) == 3:  # a completion
            _, index, g = item
            forwarded.tokens += len(g.output_ids)
            if not forwarded.stream:
                forwarded.results[index] = g
                return []
            version = g.versions[0][0] if g.versions else engine.weight_version
            response = rollout_pb2.GenerateStreamResponse(index=index, completion=_completion(g, version, forwarded.logprobs))
            return [rollout_link_pb2.LinkReply(id=forwarded.id, response=response.SerializeToString())]
        error = item[1]
        metrics = self.rollout.metrics
        if calls.pop(forwarded.id, None) is not None:
            metrics.in_flight.dec()
        metrics.tokens.inc(forwarded.tokens)
        if error is not None:
            code, message = _status_of(error)
            metrics.requests.labels("error").inc()
            return [rollout_link_pb2.LinkReply(id=forwarded.id, last=True, code=code.value[0], message=message)]
        metrics.requests.labels("ok").inc()
        metrics.generate_seconds.observe(time.perf_counter() - forwarded.started)
        if forwarded.stream:
            return [rollout_link_pb2.LinkReply(id=forwarded.id, last=True)]
        results = [forwarded.results[i] for i in range(len(forwarded.results))]
        version = min((g.versions[0][0] for g in results if g.versions), default=engine.weight_version)
        response = rollout_pb2.GenerateResponse(
            weight_version=version, results=[_completion(g, version, forwarded.logprobs) for g in results])
        return [rollout_link_pb2.LinkReply(id=forwarded.id, last=True, response=response.SerializeToString())]


@dataclasses.dataclass
class _Refused(Exception):
    code: grpc.StatusCode
    message: str


def _status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a direct caller would have got for `error` (`_ERRORS`, as `rpc.abort_on` maps them)."""
    if isinstance(error, _Refused):
        return error.code, error.message
    for exc_type, code in _ERRORS.items():
        if isinstance(error, exc_type):
            return code, str(error)
    log.error("link: a forwarded call failed: %r", error)
    return grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}"


class Listener:
    """The engine's process accepting front ends on the Unix socket at `path`."""

    def __init__(self, path: str, rollout: RolloutServicer, token: str | None):
        self.path = path
        self._rollout = rollout
        self._token = (token or "").encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(4)
        threading.Thread(target=self._accept, name="link-accept", daemon=True).start()

    def close(self) -> None:
        self._sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="link", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb", buffering=1 << 16)
        try:
            hello = read_frame(reader)
            if hello is None or not hmac.compare_digest(hello, self._token):
                log.warning("link: a connection without the engine's token, closed")
                return
            for replies in LinkServicer(self._rollout).serve(messages(reader, rollout_link_pb2.LinkCalls.FromString)):
                send(conn, replies)
        except (OSError, LinkError) as e:
            log.warning("link: %s", e)
        finally:
            conn.close()


class LinkBroken(RuntimeError):
    """The link to the engine's process ended: the engine is gone."""


class EngineLink:
    """The front end's end of the link: one connection to the engine's process, every call on it.

    `call` returns a queue that gets the call's replies (`LinkReply`), the last with `last` set;
    if the link breaks, every call waiting gets a last reply with code UNAVAILABLE."""

    def __init__(self, path: str, token: str | None, on_broken: Callable[[str], None] = lambda reason: None):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        send(self._sock, (token or "").encode())
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # LinkCall | int (a cancelled id) | None
        self._pending: dict[int, queue.SimpleQueue] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.broken: str | None = None
        self._on_broken = on_broken
        threading.Thread(target=self._send, name="link-sender", daemon=True).start()
        threading.Thread(target=self._receive, name="link-receiver", daemon=True).start()

    def call(self, request: bytes, *, stream: bool, timeout_s: float | None) -> tuple[int, queue.SimpleQueue]:
        replies: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            if self.broken is not None:
                raise LinkBroken(self.broken)
            call_id = next(self._ids)
            self._pending[call_id] = replies
        self._outbox.put(rollout_link_pb2.LinkCall(id=call_id, stream=stream, request=request,
                                                   timeout_s=max(timeout_s or 0.0, 0.0)))
        return call_id, replies

    def cancel(self, call_id: int) -> None:
        """The caller went away: its rows stop on the engine, and the thread waiting for its
        replies gets a last one now (nothing happens for a finished call)."""
        with self._lock:
            replies = self._pending.pop(call_id, None)
        if replies is None:
            return
        self._outbox.put(call_id)
        replies.put(rollout_link_pb2.LinkReply(id=call_id, last=True, code=grpc.StatusCode.CANCELLED.value[0],
                                               message="the call ended (cancelled, or past its deadline)"))

    def close(self) -> None:
        self._outbox.put(None)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _send(self) -> None:
        try:
            while True:
                items = [self._outbox.get()]
                while True:
                    try:
                        items.append(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                calls = [i for i in items if isinstance(i, rollout_link_pb2.LinkCall)]
                cancelled = [i for i in items if isinstance(i, int)]
                for i, batch in enumerate(_batches(calls, lambda c: len(c.request)) if calls else [[]]):
                    if batch or cancelled:
                        send(self._sock, rollout_link_pb2.LinkCalls(calls=batch, cancelled=cancelled if i == 0 else []))
                if None in items:
                    return
        except (OSError, LinkError) as e:
            self._break(f"the link to the engine's process broke ({e})")

    def _receive(self) -> None:
        reason = "the engine's process closed the link"
        try:
            for message in messages(self._sock.makefile("rb", buffering=1 << 16), rollout_link_pb2.LinkReplies.FromString):
                for reply in message.replies:
                    with self._lock:
                        replies = self._pending.pop(reply.id, None) if reply.last else self._pending.get(reply.id)
                    if replies is not None:
                        replies.put(reply)
        except (OSError, LinkError) as e:
            reason = f"the link to the engine's process broke ({e})"
        self._break(reason)

    def _break(self, reason: str) -> None:
        with self._lock:
            if self.broken is not None:
                return
            self.broken = reason
            waiting, self._pending = list(self._pending.values()), {}
        for replies in waiting:
            replies.put(rollout_link_pb2.LinkReply(last=True, code=grpc.StatusCode.UNAVAILABLE.value[0], message=reason))
        self._on_broken(reason)
