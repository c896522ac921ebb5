"""Experiment tracking: the name table, TensorBoard event files read back, an offline W&B run read back."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
import yaml

from services.coordinator import config as config_module
from services.coordinator.config import ConfigError, TrackingConfig, WandbConfig, check_packages, parse_job
from services.coordinator.tracking import FanOut, NullTracker, build_tracker, tracked_values

# What one RL step emits, in the order the loop emits it.
STEP_EVENTS = [
    ("weight_sync", {"version": 3, "source": "device", "bytes": 4096, "seconds": 0.25, "plane": "shm",
                     "planes": {"e0": "shm"}, "engines_in_pool": 1, "failures": {}}),
    ("step", {"reward_mean": 0.5, "reward_std": 0.1, "solved_groups": 1.0, "response_len_mean": 7.0,
              "truncated_frac": 0.0, "generate_s": 1.5, "train_s": 2.0, "sync_s": 0.25, "sync_from_host": 0.0,
              "weights_version": 3.0, "train/loss": 0.75, "train/grad_norm": 1.25, "train/entropy": 2.0}),
    ("eval", {"dataset": "heldout", "score": 0.375, "num_prompts": 64, "weights_version": 3, "seconds": 4.0}),
    ("checkpoint", {"path": "/ckpt/step-000002"}),
]


def test_names_follow_the_groups_rl_users_read():
    scalars, texts = tracked_values(*STEP_EVENTS[1])
    assert scalars == {
        "rollout/reward_mean": 0.5, "rollout/reward_std": 0.1, "rollout/solved_groups": 1.0,
        "rollout/response_len_mean": 7.0, "rollout/truncated_frac": 0.0, "rollout/generate_s": 1.5,
        "train/train_s": 2.0, "sync/from_host": 0.0, "train/loss": 0.75, "train/grad_norm": 1.25,
        "train/entropy": 2.0,
    }
    assert texts == {}
    assert tracked_values(*STEP_EVENTS[0]) == (
        {"sync/version": 3.0, "sync/bytes": 4096.0, "sync/seconds": 0.25, "sync/engines_in_pool": 1.0,
         "sync/num_failures": 0.0},
        {"sync/source": "device", "sync/plane": "shm"},
    )
    assert tracked_values(*STEP_EVENTS[2]) == (
        {"eval/heldout/score": 0.375, "eval/heldout/num_prompts": 64.0, "eval/heldout/seconds": 4.0}, {})
    assert tracked_values(*STEP_EVENTS[3]) == ({}, {"checkpoint/path": "/ckpt/step-000002"})
    assert tracked_values("sft", {"loss": 1.0}) == ({"sft/loss": 1.0}, {})
    assert tracked_values("log", {"message": "hello"}) == ({}, {})
    assert tracked_values("step", {"new_metric": float("nan"), "later": 2}) == ({"rollout/later": 2.0}, {})


def test_config_keys_are_strict_and_off_by_default():
    base = {"name": "j", "model": "m", "num_rollout": 0, "eval": {"datasets": [{"name": "t", "path": "t.jsonl"}]}}
    assert parse_job(yaml.safe_dump(base), "/x", check_files=False).tracking == TrackingConfig()

    def error_of(tracking) -> str:
        with pytest.raises(ConfigError) as e:
            parse_job(yaml.safe_dump({**base, "tracking": tracking}), "/x", check_files=False)
        return str(e.value)

    assert error_of({"tensorbord": True}) == "unknown key 'tracking.tensorbord' (did you mean 'tensorboard'?)"
    assert error_of({"wandb": {"projct": "p"}}).startswith("unknown key 'tracking.wandb.projct'")
    assert error_of({"wandb": {"project": "p", "mode": "disabled"}}).startswith("tracking.wandb.mode: expected one of")
    assert error_of({"wandb": {}}) == "tracking.wandb.project: required key is missing"
    cfg = parse_job(yaml.safe_dump({**base, "tracking": {"tensorboard": True, "wandb": {"project": "p", "tags": ["a"]}}}),
                    "/x", check_files=False)
    assert cfg.tracking == TrackingConfig(tensorboard=True, wandb=WandbConfig(project="p", tags=("a",)))


@pytest.mark.parametrize(("tracking", "package"), [({"tensorboard": True}, "tensorboard"),
                                                  ({"wandb": {"project": "p"}}, "wandb")])
def test_a_missing_package_is_named_at_config_validation(monkeypatch, tracking, package):
    base = {"name": "j", "model": "m", "num_rollout": 0, "eval": {"datasets": [{"name": "t", "path": "t.jsonl"}]}}
    cfg = parse_job(yaml.safe_dump({**base, "tracking": tracking}), "/x", check_files=False)
    real = config_module.importlib.util.find_spec
    monkeypatch.setattr(config_module.importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ConfigError, match=rf"tracking.{package}: needs the {package} package.*pip install {package}"):
        check_packages(cfg)


def test_nothing_on_is_a_null_tracker(tmp_path):
    assert isinstance(build_tracker(TrackingConfig(), tmp_path, run_name="j", run_id="1", config={}), NullTracker)
    assert not list(tmp_path.iterdir())


def test_a_failing_tracker_is_dropped_and_the_others_go_on():
    class Broken:
        def log(self, kind, step, data):
            raise OSError("disk full")

        def close(self, summary=None):
            raise AssertionError("a dropped tracker is not closed")

    class Recording:
        def __init__(self):
            self.events, self.closed = [], False

        def log(self, kind, step, data):
            self.events.append((kind, step))

        def close(self, summary=None):
            self.closed = True

    good = Recording()
    fan = FanOut([Broken(), good])
    fan.log("step", 1, {"reward_mean": 1.0})
    fan.log("step", 2, {"reward_mean": 1.0})
    fan.close()
    assert good.events == [("step", 1), ("step", 2)] and good.closed


# ---------------------------------------------------------------------------- TensorBoard


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_every_scalar_by_name_and_step(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    tracker = build_tracker(TrackingConfig(tensorboard=True), tmp_path, run_name="j", run_id="1", config={})
    for step in (1, 2):
        for kind, data in STEP_EVENTS:
            tracker.log(kind, step, {**data, "reward_mean": step / 4} if kind == "step" else data)
    tracker.log("sft", 1, {"loss": 3.0})
    tracker.close()
    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars["rollout/reward_mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["train/loss"] == [(1, 0.75), (2, 0.75)]
    assert scalars["eval/heldout/score"] == [(1, 0.375), (2, 0.375)]
    assert scalars["sync/seconds"] == [(1, 0.25), (2, 0.25)]
    assert scalars["sync/bytes"] == [(1, 4096.0), (2, 4096.0)]
    assert scalars["sft/loss"] == [(1, 3.0)]
    assert "rollout/sync_s" not in scalars and "sync/weights_version" not in scalars


def test_tensorboard_drops_the_steps_a_resumed_job_runs_again(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    first = build_tracker(TrackingConfig(tensorboard=True), tmp_path, run_name="j", run_id="1", config={})
    for step in (1, 2, 3):
        first.log("step", step, {"reward_mean": 0.0})
    first.close()  # the coordinator died after step 3; the checkpoint is of step 2
    resumed = build_tracker(TrackingConfig(tensorboard=True), tmp_path, run_name="j", run_id="1", config={},
                            resume_step=2)
    for step in (3, 4):
        resumed.log("step", step, {"reward_mean": 1.0})
    resumed.close()
    assert read_scalars(tmp_path / "tensorboard")["rollout/reward_mean"] == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0)]


# ---------------------------------------------------------------------------- W&B offline


def wandb_records(path: Path):
    """The protobuf records of a .wandb file (a LevelDB-style log after a 7-byte header), read
    without wandb.Api and without a network."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb versions fill one or the other


def test_wandb_offline_run_records_metrics_without_a_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no write to ~/.config
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = TrackingConfig(wandb=WandbConfig(project="rlfleet-test", tags=("ci",)))
    tracker = build_tracker(cfg, tmp_path, run_name="job-abc", run_id="abc123", config={"seed": 3})
    tracker.log("sft", 1, {"loss": 3.0})
    for step in (1, 2):
        for kind, data in STEP_EVENTS:
            tracker.log(kind, step, {**data, "reward_mean": step / 4} if kind == "step" else data)
    tracker.close({"eval_after": 0.375, "name": "job"})

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*-abc123")
    (run_file,) = run_dir.glob("run-abc123.wandb")
    # wandb's service process writes the file; once (CI under load, wandb 0.31.0) it held no
    # history yet when finish() had returned. What a user syncs later is the file as it ends up,
    # so read it again for a few seconds before judging it.
    deadline = time.monotonic() + 15
    while True:
        history, summary = [], {}
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
            elif kind == "summary":
                summary.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
            elif kind == "run":
                assert record.run.project == "rlfleet-test" and record.run.display_name == "job-abc"
        rewards = [(row["rl_step"], row["rollout/reward_mean"]) for row in history if "rollout/reward_mean" in row]
        if len(rewards) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert rewards == [(1, 0.25), (2, 0.5)]
    assert [(r["rl_step"], r["eval/heldout/score"]) for r in history if "eval/heldout/score" in r] == [(1, 0.375), (2, 0.375)]
    assert [r["sft/step"] for r in history if "sft/loss" in r] == [1]
    assert summary["sync/plane"] == "shm" and summary["job/eval_after"] == 0.375
    assert summary["checkpoint/path"] == "/ckpt/step-000002"
