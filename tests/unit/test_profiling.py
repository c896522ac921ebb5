"""RLFLEET_PROFILE_DIR: a profiled step leaves a Chrome trace of what ran and logs its costliest
operations; unset, nothing is written."""

from __future__ import annotations

import json
import logging

import torch

from services import profiling


def test_a_profiled_step_leaves_a_trace_naming_its_operations(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(profiling.ENV, str(tmp_path / "traces"))
    with caplog.at_level(logging.INFO, logger="rlfleet.profiling"):
        with profiling.profiled("rollout", "update-7"):
            torch.ones(64, 64).matmul(torch.ones(64, 64))
    trace = tmp_path / "traces" / "rollout-update-7.json"
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "aten::matmul" in names
    assert "rollout update-7: trace in" in caplog.text and "aten::" in caplog.text


def test_unset_it_profiles_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(profiling.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with profiling.profiled("rollout", "update-1"):
        torch.ones(3).sum()
    assert list(tmp_path.iterdir()) == []
