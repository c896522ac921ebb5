"""An SGLang server the rollout service starts and keeps alive as a child process.

The child listens on loopback only, on a free port, and with a random API key it gets on its
command line and rlfleet sends with every request: nothing else on the machine can drive it. Its
output goes to a log file beside the rollout service's. `start` waits for `/health_generate`;
`watch` notices an exit and calls back (the engine leaves the pool, restarts the child and waits
for a full weight sync before it serves again).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from services.rollout.sglang.client import SglangClient
from services.weights.broadcast import free_port

log = logging.getLogger("rlfleet.rollout")


def new_api_key() -> str:
    """A child's key. Hex, never url-safe base64: a key starting with "-" (1 in 64 of those) is
    read by SGLang's argparse as an option, and the child exits with "--api-key: expected one
    argument"."""
    return secrets.token_hex(24)


class SglangStartError(RuntimeError):
    """The SGLang child exited or did not become healthy in time (its log's tail is in the message)."""


class SglangProcess:
    def __init__(self, *, model_path: str, command: list[str], args: list[str], memory_saver: bool,
                 startup_timeout_s: float, request_timeout_s: float, log_dir: Path | None = None):
        self.model_path, self.command, self.args = model_path, command or [sys.executable, "-m", "sglang.launch_server"], args
        self.memory_saver, self.startup_timeout_s, self.request_timeout_s = memory_saver, startup_timeout_s, request_timeout_s
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"sglang-{os.getpid()}-{secrets.token_hex(4)}.log"
        self.child: subprocess.Popen | None = None
        self.client: SglangClient | None = None
        self.restarts = 0
        self._stopping = threading.Event()

    def argv(self, port: int, api_key: str) -> list[str]:
        argv = [*self.command, "--model-path", self.model_path, "--host", "127.0.0.1", "--port", str(port),
                "--api-key", api_key]
        if self.memory_saver:  # colocated: release and resume weights and KV cache, keep a host copy of the weights
            argv += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
        return argv + list(self.args)

    def start(self) -> SglangClient:
        port, api_key = free_port(), new_api_key()
        argv = self.argv(port, api_key)
        log.info("starting SGLang: %s (log %s)", " ".join(a if a != api_key else "***" for a in argv), self.log_path)
        with open(self.log_path, "ab") as out:
            self.child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        client = SglangClient(f"http://127.0.0.1:{port}", api_key, self.request_timeout_s)
        deadline = time.monotonic() + self.startup_timeout_s
        while not client.healthy():
            if self.child.poll() is not None:
                raise SglangStartError(f"SGLang exited with code {self.child.returncode} while starting: {self.tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise SglangStartError(f"SGLang did not answer /health_generate within {self.startup_timeout_s:g} s: "
                                       f"{self.tail()}")
            time.sleep(0.5)
        self.client = client
        return client

    def watch(self, on_exit: Callable[[int], None]) -> None:
        """Call on_exit(returncode) from a daemon thread when the child dies (not when stopped)."""
        def loop() -> None:
            while not self._stopping.wait(1.0):
                child = self.child
                if child is not None and child.poll() is not None:
                    on_exit(child.returncode)
        threading.Thread(target=loop, name="sglang-watch", daemon=True).start()

    def tail(self, lines: int = 20) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        self._stopping.set()
        child, self.child = self.child, None
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
