"""gRPC plumbing shared by every rlfleet server and client.

One place builds servers (health, reflection, bearer-token auth, message limits, graceful
SIGTERM) and client channels (deadlines, token metadata), so the three services and the CLI
behave the same on the wire. Servicers stay thin: they translate protobuf to domain objects
and map typed domain errors to status codes with `abort_on`.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.tls import TlsConfig

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
DEFAULT_DEADLINE_S = 600.0
_OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def get_logger(role: str, rank: int | None = None) -> logging.Logger:
    name = f"rlfleet.{role}" if rank is None else f"rlfleet.{role}.{rank}"
    return logging.getLogger(name)


def configure_logging(role: str, level: str = "INFO") -> None:
    """Log lines carry the role so interleaved child-process output stays readable."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname).1s [{role}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


class _BearerAuth(grpc.ServerInterceptor):
    """Rejects calls without the configured bearer token; health and reflection stay open."""

    def __init__(self, token: str):
        self._expected = token.encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_OPEN_METHOD_PREFIXES):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            # "Bearer <token>", the scheme in any case (RFC 7235), as the REST API reads it
            scheme, _, given = value.partition(" ")
            if key == "authorization" and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._expected):
                return continuation(handler_call_details)
        return self._deny


@dataclass
class Server:
    """A started gRPC server with its health servicer and bound port."""

    grpc_server: grpc.Server
    health: health.HealthServicer
    port: int
    service_names: tuple[str, ...]
    on_stop: list[Callable[[], None]] = field(default_factory=list)  # run after the last call ends
    metrics_port: int | None = None  # where /metrics is served (trainer, rollout), when it is
    shutdown: threading.Event = field(default_factory=threading.Event)  # set by a Shutdown call

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set("", status)
        for name in self.service_names:
            self.health.set(name, status)

    def stop(self, grace_s: float = 5.0) -> None:
        self.set_serving(False)
        self.health.enter_graceful_shutdown()
        self.grpc_server.stop(grace_s).wait()
        for hook in self.on_stop:
            hook()

    def wait_for_termination_or_signal(self, grace_s: float = 5.0) -> bool:
        """Block until SIGTERM/SIGINT or a Shutdown call, then stop gracefully (in-flight calls
        get `grace_s`); True when a Shutdown call ended it."""
        wait_for_signal(self.shutdown)
        self.stop(grace_s)
        return self.shutdown.is_set() and not getattr(self.shutdown, "by_signal", False)


SIGNAL_POLL_S = 0.2  # how soon the main thread sees a signal that arrived


def wait_for_signal(stop: threading.Event | None = None) -> None:
    """Block the main thread until SIGTERM or SIGINT arrives (or `stop` is set).

    The handler only records the signal; the main thread sets `stop` itself. A handler that set
    the event deadlocked when a signal came while the main thread held the event's own lock
    (inside `wait`, or inside the set of an earlier signal's handler): a rollout engine whose
    front end died took several SIGTERMs at once and never exited."""
    stop = stop or threading.Event()
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        received.append(signum)  # (no lock: the main thread may be holding any)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while not received and not stop.wait(SIGNAL_POLL_S):
        pass
    if received:
        stop.by_signal = True  # told apart from a Shutdown call, which sets the event itself
        stop.set()


def add_servicer(add_to_server: Callable, servicer, server: grpc.Server, *, serialized: tuple[str, ...] = ()) -> None:
    """Register `servicer` with the generated `add_XServicer_to_server`, except that the methods
    named in `serialized` yield responses already serialized to bytes (sent as they are)."""
    captured: dict[str, tuple[str, dict]] = {}

    class _Capture:
        def add_generic_rpc_handlers(self, handlers):
            pass

        def add_registered_method_handlers(self, name, handlers):
            captured["service"] = (name, handlers)

    add_to_server(servicer, _Capture())
    name, handlers = captured["service"]
    for method in serialized:
        handlers[method] = handlers[method]._replace(response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


MAX_TIMEOUT_S = 24 * 3600.0


def timeout_seconds(value: float, default: float, field: str = "timeout_s") -> float:
    """A request's timeout: 0 (unset) is `default`; NaN, infinite, negative or longer than a day
    is an error naming the field (a NaN once read as "no timeout" and held a thread forever)."""
    if value == 0:
        return default
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise ValueError(f"{field}: must be seconds in (0, {MAX_TIMEOUT_S:.0f}] (0: the default {default:g} s), "
                         f"got {value}")
    return value


class Admission:
    """At most `limit` calls of a kind at once; the next is refused at once (RESOURCE_EXHAUSTED)
    instead of taking a pool thread to wait in. Calls that wait on peers or on each other could
    otherwise fill the pool, and health checks (served by the same threads) would starve."""

    def __init__(self, limit: int):
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit)

    @contextlib.contextmanager
    def enter(self, context: grpc.ServicerContext, method: str) -> Iterator[None]:
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{method}: {self.limit} such call(s) already in progress here; retry later")
        try:
            yield
        finally:
            self._slots.release()


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) binds to loopback only."""
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


def create_server(
    register: Callable[[grpc.Server], None],
    service_names: tuple[str, ...],
    *,
    address: str = "127.0.0.1:0",
    token: str | None = None,
    max_workers: int = 32,
    tls: TlsConfig | None = None,
) -> Server:
    """Build, bind and start a server; `address` may use port 0 (the bound port is returned).
    It serves TLS when `tls` (or the environment, see services.tls) has a certificate. Without a
    token or mutual TLS it binds to loopback only: anyone who reaches the port could drive it."""
    tls = tls if tls is not None else TlsConfig.from_env()
    mutual = tls is not None and tls.mutual
    if not token and not mutual and not is_loopback(address.rsplit(":", 1)[0]):
        raise ValueError(f"address: refusing to serve {address} without a token or mutual TLS (bind to 127.0.0.1, "
                         "or set one)")
    interceptors = [_BearerAuth(token)] if token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=interceptors,
        options=_CHANNEL_OPTIONS,
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    if tls is not None and tls.serves:
        port = server.add_secure_port(address, tls.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind gRPC server to {address}")
    server.start()
    result = Server(server, health_servicer, port, service_names)
    result.set_serving(False)
    return result


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self._metadata = ("authorization", f"Bearer {token}")

    def _augment(self, details):
        metadata = list(details.metadata or []) + [self._metadata]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._augment(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._augment(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._augment(details), request_iterator)


def open_channel(address: str, token: str | None = None, tls: TlsConfig | None = None,
                 max_receive_bytes: int | None = None) -> grpc.Channel:
    """A channel to `address` that adds the bearer token to every call: over TLS when the process
    has TLS settings (`tls`, or the environment's: see services.tls), in plaintext otherwise.
    `max_receive_bytes` bounds a reply's size (larger: RESOURCE_EXHAUSTED, nothing read)."""
    channel = _channel(grpc, address, tls, max_receive_bytes)
    if token:
        channel = grpc.intercept_channel(channel, _TokenMetadata(token))
    return channel


class FanOut:
    """Unary calls to many peers at once, carried by one asyncio loop on one thread.

    A sync channel's `future()` starts a thread for the channel whenever it has no call in
    flight, so a call to each of hundreds of engines started hundreds of threads, one after the
    other, and the last engine got its request that much later. Here every call is a task on one
    loop over grpc.aio channels (one per address and token, kept until `close`); `call` returns
    a concurrent future of the reply, whose error is the call's grpc.RpcError. Calls queued
    while the loop is busy start together at its next wake-up (one wake-up for a whole fan-out,
    not one per call). Channels have the settings `open_channel` gives (TLS from the
    environment, message limits, bearer token).
    """

    def __init__(self, name: str = "rpc-fanout"):
        import asyncio
        import collections

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._woken = False  # a drain is scheduled and has not begun
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, str, type], object] = {}

    def call(self, address: str, token: str | None, stub_type: type, method: str, request,
             timeout: float, then: Callable | None = None) -> futures.Future:
        """`stub_type(channel).method(request, timeout=timeout)` to `address`, started now; the
        future's result is `then(reply)` when given, run on the loop's thread as the reply comes
        (the caller's thread does not wake for each of hundreds of replies)."""
        future: futures.Future = futures.Future()
        self._queue.append((address, token or "", stub_type, method, request, timeout, then, future))
        with self._lock:
            wake, self._woken = not self._woken, True
        if wake:
            self._loop.call_soon_threadsafe(self._drain)
        return future

    def _drain(self) -> None:  # (on the loop's thread, as are all below)
        with self._lock:
            self._woken = False
        while self._queue:
            self._loop.create_task(self._run(*self._queue.popleft()))

    async def _run(self, address, token, stub_type, method, request, timeout, then, future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        try:
            reply = await getattr(self._stub(address, token, stub_type), method)(request, timeout=timeout,
                                                                              metadata=metadata)
            if then is not None:
                reply = then(reply)
        except BaseException as e:  # (the caller's to handle, as a sync call's would be)
            future.set_exception(e)
        else:
            future.set_result(reply)

    def _stub(self, address: str, token: str, stub_type: type):
        key = (address, token, stub_type)
        if key not in self._stubs:
            if (address, token) not in self._channels:
                self._channels[address, token] = _channel(grpc.aio, address)
            self._stubs[key] = stub_type(self._channels[address, token])
        return self._stubs[key]

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        import asyncio

        async def close_channels():
            for channel in self._channels.values():
                await channel.close()

        try:
            asyncio.run_coroutine_threadsafe(close_channels(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self._loop.close()


def _channel(kind, address: str, tls: TlsConfig | None = None, max_receive_bytes: int | None = None):
    """A channel of `kind` (the module `grpc`, or `grpc.aio`) with the project's options: over
    TLS when the process has TLS settings (`tls`, or the environment's), in plaintext otherwise."""
    tls = tls if tls is not None else TlsConfig.from_env()
    options = list(_CHANNEL_OPTIONS)
    if max_receive_bytes is not None:
        options = [o for o in options if o[0] != "grpc.max_receive_message_length"]
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    if tls is not None and tls.ca is not None:
        return kind.secure_channel(address, tls.channel_credentials(), options=options + tls.channel_options())
    return kind.insecure_channel(address, options=options)


def wait_ready(address: str, timeout_s: float, token: str | None = None) -> None:
    """Wait until the server at `address` reports SERVING on grpc.health.v1."""
    import time

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    with contextlib.closing(open_channel(address, token)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as e:  # not up yet
                last = e
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not report SERVING within {timeout_s:.0f}s ({last})")


@contextlib.contextmanager
def abort_on(context: grpc.ServicerContext, mapping: dict[type[BaseException], grpc.StatusCode]) -> Iterator[None]:
    """Turn typed domain errors into gRPC status codes with the error's message."""
    try:
        yield
    except tuple(mapping) as e:
        for exc_type, code in mapping.items():
            if isinstance(e, exc_type):
                context.abort(code, str(e))
        raise
