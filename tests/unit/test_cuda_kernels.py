"""Building the engine's CUDA C kernels (`cuda_kernels.py`): once per source text, into the
cache, a failed build named with nvcc's own words, and an engine without nvcc or a Hopper GPU
told why and left on its other path. (The kernels themselves run in tests/gpu.)"""

from __future__ import annotations

import logging
import stat

import pytest

from services.rollout.builtin import cuda_kernels


def _fake_nvcc(tmp_path, body: str):
    """An executable standing in for nvcc that logs each call to calls.txt."""
    script = tmp_path / "nvcc"
    script.write_text("#!/bin/sh\necho called >> " + str(tmp_path / "calls.txt") + "\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def _calls(tmp_path) -> int:
    log = tmp_path / "calls.txt"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_kernel_is_built_once_per_source_text(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_KERNEL_CACHE", str(tmp_path / "cache"))
    # writes the file named after -o, as nvcc would
    nvcc = _fake_nvcc(tmp_path, 'while [ "$1" != "-o" ]; do shift; done; echo built > "$2"\n')
    source = tmp_path / "k.cu"
    source.write_text("// one kernel\n")
    first = cuda_kernels._build(source, nvcc)
    assert first.read_text() == "built\n" and first.parent == tmp_path / "cache" and _calls(tmp_path) == 1
    assert cuda_kernels._build(source, nvcc) == first and _calls(tmp_path) == 1  # cached
    source.write_text("// another kernel\n")
    second = cuda_kernels._build(source, nvcc)
    assert second != first and second.is_file() and _calls(tmp_path) == 2
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == []  # no scratch left behind


def test_a_failed_build_says_what_nvcc_said_and_leaves_nothing_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_KERNEL_CACHE", str(tmp_path / "cache"))
    nvcc = _fake_nvcc(tmp_path, 'echo "k.cu(3): error: identifier wgmma is undefined" >&2; exit 1\n')
    source = tmp_path / "k.cu"
    source.write_text("// broken\n")
    with pytest.raises(RuntimeError, match="nvcc failed on k.cu: .*identifier wgmma is undefined"):
        cuda_kernels._build(source, nvcc)
    assert list((tmp_path / "cache").glob("*.so")) == []


def test_without_a_hopper_gpu_the_library_is_none_and_the_log_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cuda_kernels, "_library", None)
    monkeypatch.setattr(cuda_kernels, "_failure", None)
    monkeypatch.setattr(cuda_kernels.torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="rlfleet.rollout"):
        assert cuda_kernels.gated_up_library() is None
        assert cuda_kernels.gated_up_library() is None  # asked again: the same answer, logged once
    warnings = [r.getMessage() for r in caplog.records if "CUDA C kernels off" in r.getMessage()]
    assert len(warnings) == 1 and "needs a Hopper GPU" in warnings[0]
