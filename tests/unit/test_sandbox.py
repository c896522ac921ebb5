"""The Python tool's sandbox (`services.coordinator.sandbox`), with real child processes: output
comes back bounded, and time, memory, network, child processes and writes outside its folder
are refused or cut, each saying why."""

from __future__ import annotations

import socket
import threading

import pytest

from services.coordinator.sandbox import run_python


def test_code_runs_and_its_output_comes_back(tmp_path):
    result = run_python("print(sum(range(10)))\nimport math\nprint(math.sqrt(16))", tmp_path)
    assert result.output == "45\n4.0\n" and result.exit_code == 0 and not result.timed_out


def test_it_may_write_in_its_folder_and_nowhere_else(tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    code = f"""
open("inside.txt", "w").write("ok")
try:
    open({str(outside)!r}, "w").write("no")
except PermissionError as e:
    print(e)
try:
    import os; os.remove({str(outside)!r})
except (PermissionError, FileNotFoundError) as e:
    print(type(e).__name__)
"""
    result = run_python(code, tmp_path / "box")
    assert (tmp_path / "box" / "inside.txt").read_text() == "ok"
    assert not outside.exists()
    assert "writing" in result.output and "outside the sandbox folder" in result.output
    assert "PermissionError" in result.output


def test_it_cannot_reach_the_network(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    server.settimeout(3)

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    waiter = threading.Thread(target=accept)
    waiter.start()
    code = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\nexcept PermissionError as e:\n    print(e)"
    result = run_python(code, tmp_path)
    waiter.join()
    server.close()
    assert "socket" in result.output and "not allowed" in result.output
    assert not accepted  # no connection ever arrived


@pytest.mark.parametrize("code, message", [
    ("import subprocess\nsubprocess.run(['id'])", "subprocess.Popen is not allowed"),
    ("import os\nos.system('id')", "os.system is not allowed"),
    ("import ctypes\nctypes.CDLL(None)", "ctypes"),
])
def test_child_processes_and_c_libraries_are_refused(tmp_path, code, message):
    result = run_python(code, tmp_path)
    assert message in result.output and result.exit_code != 0


def test_time_memory_and_output_are_bounded(tmp_path):
    slow = run_python("while True: pass", tmp_path, timeout_s=1.0)
    assert slow.timed_out and slow.exit_code < 0
    big = run_python("x = bytearray(1 << 30)", tmp_path, memory_mb=128)
    assert "MemoryError" in big.output and big.exit_code != 0
    loud = run_python("print('y' * 10_000_000)", tmp_path, max_output=1000)
    assert loud.truncated and len(loud.output) == 1000
