"""Starts rlfleet services as local child processes on loopback and keeps an eye on them.

`rlfleet run` uses it to bring up a trainer, rollout engines and a coordinator on one machine.
Each child binds port 0 and reports its port through a ready file once it is SERVING; its output
goes to a log file. A child that dies is noticed by `check()`, which names it and shows the end
of its log, so the caller can stop everything and exit non-zero with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


SERVER_GRACE_S = 5.0  # `rlfleet serve --grace` default


class ChildFailed(RuntimeError):
    """A child process exited or never became ready."""


@dataclass
class Child:
    role: str
    process: subprocess.Popen
    log_path: Path
    ready_file: Path
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class LocalFleet:
    def __init__(self, log_dir: Path, env: dict[str, str] | None = None):
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self._tmp = Path(tempfile.mkdtemp(prefix="rlfleet-"))
        self._env = {**os.environ, **(env or {})}

    def start(self, role: str, name: str, extra_args: list[str]) -> Child:
        ready = self._tmp / f"{name}.ready"
        log_path = self.log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "services.cli", "serve", role, "--port", "0", "--ready-file", str(ready), *extra_args]
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self._env, start_new_session=True,
            )
        child = Child(name, process, log_path, ready)
        self.children.append(child)
        return child

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            while not child.ready_file.exists():
                self.check()
                if time.monotonic() > deadline:
                    raise ChildFailed(f"{child.role} did not become ready within {timeout_s:.0f}s\n{child.log_tail()}")
                time.sleep(0.05)
            child.port = json.loads(child.ready_file.read_text())["port"]

    def check(self, grace_s: float = 0.0) -> None:
        """Raise ChildFailed naming the first child that exited. With `grace_s`, wait that long
        for one to finish dying (a killed process can close its sockets before it is reaped)."""
        deadline = time.monotonic() + grace_s
        while grace_s and time.monotonic() < deadline and all(c.process.poll() is None for c in self.children):
            time.sleep(0.05)
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise ChildFailed(
                    f"{child.role} (pid {child.process.pid}) exited with code {code}; "
                    f"last lines of {child.log_path}:\n{child.log_tail()}"
                )

    def stop(self, grace_s: float = SERVER_GRACE_S + 10.0) -> None:
        """SIGTERM every child, SIGKILL what is still alive after `grace_s`, remove the ready files.
        The default grace outlasts the servers' own (`serve --grace`, 5 s) by the time a trainer
        needs to remove its shared-memory segments after its last call ends."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()
        shutil.rmtree(self._tmp, ignore_errors=True)
