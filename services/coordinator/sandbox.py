"""Python a model wrote, run in a child process with limits: time, memory, output, files, no
network, no child processes, no writes outside its own folder.

The child is a fresh interpreter (`-I -B`: no user site, no environment variables read, no
bytecode written) in its own session, with an empty environment, `folder` as its working
directory, and resource limits: CPU seconds, address space, the size of any file it writes
(its output file included: a flood of output is cut there), open files. Before the code runs,
an audit hook refuses what the limits cannot stop: sockets, subprocesses, exec, fork, loading C
libraries with ctypes, and opening, creating, renaming or removing a file for writing anywhere
but inside `folder`. The wall-clock timeout kills the whole session.

This is defence in depth for a code-execution tool, not a boundary against a determined
attacker with a kernel exploit. On Kubernetes the coordinator's pod adds its own network policy.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_HOOK = r'''
import os, sys
_FOLDER = os.path.realpath(sys.argv[1])
_BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
            "ctypes.", "os.kill", "os.killpg", "pty.", "shutil.", "webbrowser.", "urllib.Request")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _inside(path):
    try:
        real = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return real == _FOLDER or real.startswith(_FOLDER + os.sep)

def _hook(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, 0))[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
        if writes and not isinstance(path, int) and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox folder")
    elif event in ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.truncate",
                   "os.chmod", "os.chown", "os.utime"):
        paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
        if not all(_inside(p) for p in paths):
            raise PermissionError(f"sandbox: {event} outside the sandbox folder")

sys.addaudithook(_hook)
del _hook
_code = sys.stdin.read()
sys.stdin = open(os.devnull)
exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class SandboxResult:
    output: str  # stdout and stderr, interleaved, at most max_output characters
    exit_code: int  # negative: killed by that signal
    timed_out: bool
    truncated: bool


def run_python(code: str, folder: Path, *, timeout_s: float = 5.0, memory_mb: int = 256,
               max_output: int = 4096) -> SandboxResult:
    """Run `code` in a sandboxed child with `folder` as its working directory (see the module)."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    cap = 4 * max_output + 1024  # a file the child writes, its output included, stops growing here

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (int(timeout_s) + 1, int(timeout_s) + 2))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (cap, cap))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    with tempfile.TemporaryFile() as out:
        child = subprocess.Popen([sys.executable, "-I", "-B", "-c", _HOOK, str(folder)], stdin=subprocess.PIPE,
                                 stdout=out, stderr=subprocess.STDOUT, cwd=folder, env={}, preexec_fn=limits,
                                 start_new_session=True)
        timed_out = False
        try:
            child.communicate(code.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        except BrokenPipeError:  # it ended before reading all of the code
            child.wait()
        out.seek(0)
        data = out.read(max_output + 1)
    text = data[:max_output].decode(errors="replace")
    return SandboxResult(text, child.returncode, timed_out, len(data) > max_output)
