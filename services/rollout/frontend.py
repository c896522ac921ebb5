"""A rollout server's front end in a process of its own (`rlfleet serve rollout --front-end process`).

The engine's process runs the serving thread, which must hold the GIL to keep the device fed.
With the gRPC server in the same process, every caller's call is a server thread there, and at
hundreds of callers their request and reply handling takes the GIL from the serving thread
(docs/performance.md: on an H100 at 256 callers, between a third and two thirds of the
throughput). Here the public port is served by this process instead. It starts the engine's
server as its child, on loopback behind a random token, with the link's socket in a directory of
its own (mode 0700), and:

- forwards every Generate and GenerateStream call over one Unix socket (`link.py`), the
  callers' calls and their replies batched into as few frames as are ready, and a caller that
  goes away cancelled on the engine;
- forwards every other Rollout call (Configure, UpdateWeights, GetStatus, ...) as it is, bytes
  in and bytes out, with the caller's deadline.

Both processes live and die together: the child gets SIGTERM if this process dies, and this
process stops (exit code 3) if the child does, failing the calls in flight with UNAVAILABLE.
A Shutdown call is forwarded; the child exits 0 and so does this process. The child serves the
Prometheus metrics, on this server's host.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from services import rpc
from services.api import rollout_pb2
from services.rollout.link import EngineLink, LinkBroken
from services.rollout.server import MAX_GENERATE_CALLS, SERVER_THREADS, SERVICE_NAME
from services.tls import ENV as TLS_ENV

log = rpc.get_logger("rollout-frontend")
_PREFIX = f"/{SERVICE_NAME}/"
_STATUS = {code.value[0]: code for code in grpc.StatusCode}
ENGINE_START_TIMEOUT_S = 120.0
EXIT_ENGINE_DIED = 3  # as `rlfleet run`'s "a service process died"


class FrontEnd(grpc.GenericRpcHandler):
    """The public server's handler of every `rlfleet.v1.Rollout` method."""

    def __init__(self, link: EngineLink, engine: grpc.Channel):
        self.link = link
        self._engine = engine
        self._generating = rpc.Admission(MAX_GENERATE_CALLS)
        # every other Rollout method (all unary), forwarded as it is
        self._forwards = {_PREFIX + m.name: grpc.unary_unary_rpc_method_handler(self._forwarder(_PREFIX + m.name))
                          for m in rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].methods
                          if m.name not in ("Generate", "GenerateStream")
                          and not (m.client_streaming or m.server_streaming)}
        self._generate = grpc.unary_unary_rpc_method_handler(self._unary)
        self._stream = grpc.unary_stream_rpc_method_handler(self._streamed)

    def service(self, handler_call_details):
        method = handler_call_details.method
        if method == _PREFIX + "Generate":
            return self._generate
        if method == _PREFIX + "GenerateStream":
            return self._stream
        return self._forwards.get(method)  # None: UNIMPLEMENTED

    def _forwarder(self, method: str):
        call = self._engine.unary_unary(method)  # bytes in, bytes out

        def forward(request: bytes, context) -> bytes:
            try:
                return call(request, timeout=context.time_remaining())
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())

        return forward

    def _send(self, request: bytes, context, stream: bool):
        try:
            call_id, replies = self.link.call(request, stream=stream, timeout_s=context.time_remaining())
        except LinkBroken as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if not context.add_callback(lambda: self.link.cancel(call_id)):
            self.link.cancel(call_id)
        return replies

    def _unary(self, request: bytes, context) -> bytes:
        with self._generating.enter(context, "Generate"):
            reply = self._send(request, context, stream=False).get()
            if reply.code:
                context.abort(_STATUS.get(reply.code, grpc.StatusCode.UNKNOWN), reply.message)
            return reply.response

    def _streamed(self, request: bytes, context):
        with self._generating.enter(context, "GenerateStream"):
            replies = self._send(request, context, stream=True)
            while True:
                reply = replies.get()
                if reply.code:
                    context.abort(_STATUS.get(reply.code, grpc.StatusCode.UNKNOWN), reply.message)
                if reply.response:
                    yield reply.response
                if reply.last:
                    return


def _die_with_parent() -> None:
    """In the engine's process, before exec: SIGTERM when the front end dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class SplitServer:
    """The public server and the engine's process behind it."""

    def __init__(self, server: rpc.Server, engine: subprocess.Popen, link: EngineLink, channel: grpc.Channel,
                 metrics_port: int | None, ended: threading.Event, private: Path):
        self.server, self.engine, self.link, self._channel = server, engine, link, channel
        self._private = private
        self.port = server.port
        self.metrics_port = metrics_port
        self._ended = ended

    def wait(self, grace_s: float, exit_code_on_signal: int) -> int:
        """Serve until SIGTERM/SIGINT or the engine's process exits (a Shutdown call, or a crash);
        then stop both. The exit code: 0 after Shutdown, `exit_code_on_signal` after a signal, 3
        when the engine's process died."""
        rpc.wait_for_signal(self._ended)
        by_signal = getattr(self._ended, "by_signal", False)
        if not by_signal:  # the engine's process exited, or the link broke: give it a moment to exit
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.engine.wait(timeout=grace_s)
        code = self.engine.poll()  # None: alive, so the link broke (or a signal came)
        self.server.stop(grace_s if code is None and by_signal else 0.0)  # with no engine nothing ends well
        self.link.close()
        self._channel.close()
        if code is None:
            self.engine.send_signal(signal.SIGTERM)
            try:
                stopped = self.engine.wait(timeout=grace_s + 10.0)
            except subprocess.TimeoutExpired:
                self.engine.kill()
                stopped = self.engine.wait()
            code = stopped if by_signal else f"{stopped} after the link to it broke"
        shutil.rmtree(self._private, ignore_errors=True)
        if by_signal:
            log.info("stopped (signal); the engine's process exited with %s", code)
            return exit_code_on_signal
        if code == 0:
            log.info("stopped (Shutdown call)")
            return 0
        log.error("the engine's process exited with code %s: stopping", code)
        return EXIT_ENGINE_DIED


def start(address: str, token: str | None, *, metrics_port: int | None = None, log_level: str = "INFO",
          grace_s: float = 5.0) -> SplitServer:
    """Start the engine's process, wait for it, and serve `address` in front of it."""
    host = address.rsplit(":", 1)[0]
    engine_token = secrets.token_urlsafe(32)
    private = Path(tempfile.mkdtemp(prefix="rlfleet-frontend-"))  # 0700: the link's socket and the ready file
    ready, socket_path = private / "engine.ready", private / "link.sock"
    cmd = [sys.executable, "-m", "services.cli", "serve", "rollout", "--host", "127.0.0.1", "--port", "0",
           "--ready-file", str(ready), "--log-level", log_level, "--grace", str(grace_s), "--exit-code-on-signal", "0",
           "--link-socket", str(socket_path)]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port), "--metrics-host", host]
    env = {k: v for k, v in os.environ.items() if k not in TLS_ENV.values()}  # loopback, by token
    env["RLFLEET_TOKEN"] = engine_token
    engine = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
    while not ready.exists():
        if engine.poll() is not None:
            raise RuntimeError(f"the engine's process exited with code {engine.returncode} before it served")
        if time.monotonic() > deadline:
            engine.kill()
            raise RuntimeError(f"the engine's process did not serve within {ENGINE_START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    ready.unlink()
    engine_address = f"127.0.0.1:{info['port']}"
    channel = rpc.open_channel(engine_address, engine_token)
    rpc.wait_ready(engine_address, 30.0, engine_token)
    ended = threading.Event()

    def broken(reason: str) -> None:
        if not ended.is_set():
            log.error("%s", reason)
        ended.set()

    link = EngineLink(str(socket_path), engine_token, on_broken=broken)
    front = FrontEnd(link, channel)
    server = rpc.create_server(lambda s: s.add_generic_rpc_handlers((front,)), (SERVICE_NAME,), address=address,
                               token=token, max_workers=SERVER_THREADS)

    def watch() -> None:  # the engine's process exiting ends this one
        engine.wait()
        ended.set()

    threading.Thread(target=watch, name="engine-watch", daemon=True).start()
    server.set_serving(True)
    log.info("front end on %s, the engine's process (pid %d) on %s", address.rsplit(":", 1)[0], engine.pid,
             engine_address)
    return SplitServer(server, engine, link, channel, info.get("http_port"), ended, private)
