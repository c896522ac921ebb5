"""Experiment tracking: a job's events as TensorBoard scalars and a Weights & Biases run.

Opt-in (`tracking:` in the job config) and beside, never instead of, the metrics.jsonl,
eval.jsonl and reward_curve.png every job writes. The job manager hands every event the loop
emits (`step`, `eval`, `weight_sync`, `checkpoint`, `sft`; the rest are ignored) to a `Tracker`;
`tracked_values` renames its fields with one table, `METRIC_NAMES`, into the groups RL users
read: `rollout/…`, `train/…`, `eval/<dataset>/…`, `sync/…`, `sft/…`. Numbers become scalars at
the event's RL step; strings (the weight plane, a checkpoint path) become text. A tracker that
fails while logging is dropped with one warning: tracking never fails a job, though a tracker
that cannot start (W&B online without credentials) does, before its first step.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any, Mapping, Protocol

from services.coordinator.config import TrackingConfig, WandbConfig

log = logging.getLogger("rlfleet.coordinator.tracking")

# (event kind, field) -> tracked name; None = not tracked (another event carries the same value).
# Fields of a kind that are not listed get the kind's prefix in DEFAULT_PREFIX; `{dataset}` is the
# eval event's dataset name. Trainer metrics arrive in step events already named `train/<metric>`.
METRIC_NAMES: dict[tuple[str, str], str | None] = {
    ("step", "reward_mean"): "rollout/reward_mean",
    ("step", "reward_std"): "rollout/reward_std",
    ("step", "solved_groups"): "rollout/solved_groups",
    ("step", "response_len_mean"): "rollout/response_len_mean",
    ("step", "truncated_frac"): "rollout/truncated_frac",
    ("step", "generate_s"): "rollout/generate_s",
    ("step", "reward_s"): "rollout/reward_s",
    ("step", "kl_reward_mean"): "rollout/kl_reward_mean",
    ("step", "train_s"): "train/train_s",
    ("step", "sleep_s"): "train/sleep_s",
    ("step", "sync_s"): None,  # = sync/seconds of the step's weight_sync event
    ("step", "sync_from_host"): "sync/from_host",
    ("step", "weights_version"): None,  # = sync/version
    ("weight_sync", "seconds"): "sync/seconds",
    ("weight_sync", "bytes"): "sync/bytes",
    ("weight_sync", "plane"): "sync/plane",  # text: grpc_stream, broadcast, shm, cuda_ipc (comma-joined)
    ("weight_sync", "source"): "sync/source",  # text: device or host
    ("weight_sync", "version"): "sync/version",
    ("weight_sync", "engines_in_pool"): "sync/engines_in_pool",
    ("weight_sync", "failures"): "sync/num_failures",  # a mapping engine -> error: tracked as its size
    ("weight_sync", "planes"): None,  # per engine; `plane` sums it up
    ("eval", "dataset"): None,  # part of the names
    ("eval", "score"): "eval/{dataset}/score",
    ("eval", "num_prompts"): "eval/{dataset}/num_prompts",
    ("eval", "seconds"): "eval/{dataset}/seconds",
    ("eval", "weights_version"): None,
    ("checkpoint", "path"): "checkpoint/path",  # text
}
DEFAULT_PREFIX = {"step": "rollout/", "weight_sync": "sync/", "eval": "eval/{dataset}/", "sft": "sft/", "checkpoint": "checkpoint/"}
RL_STEP = "rl_step"  # the x axis of every W&B chart but SFT's
SFT_STEP = "sft/step"


def tracked_values(kind: str, data: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """An event's (scalars, texts) under their tracked names; ({}, {}) for untracked kinds."""
    prefix = DEFAULT_PREFIX.get(kind)
    if prefix is None:
        return {}, {}
    dataset = str(data.get("dataset") or "eval")
    scalars: dict[str, float] = {}
    texts: dict[str, str] = {}
    for key, value in data.items():
        if (kind, key) in METRIC_NAMES:
            name = METRIC_NAMES[(kind, key)]
        else:
            name = key if "/" in key else prefix + key
        if name is None:
            continue
        name = name.format(dataset=dataset)
        if hasattr(value, "item") and callable(value.item):  # tensors and numpy scalars
            value = value.item()
        if isinstance(value, Mapping | list | tuple):
            value = len(value)
        if isinstance(value, bool | int | float):
            if math.isfinite(value):
                scalars[name] = float(value)
        elif isinstance(value, str):
            texts[name] = value
    return scalars, texts


class Tracker(Protocol):
    def log(self, kind: str, step: int, data: Mapping[str, Any]) -> None: ...

    def close(self, summary: Mapping[str, Any] | None = None) -> None: ...


class NullTracker:
    """Tracking off: every call does nothing."""

    def log(self, kind: str, step: int, data: Mapping[str, Any]) -> None:
        pass

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        pass


class TensorBoardTracker:
    """Event files under `log_dir`, through torch's SummaryWriter (which needs tensorboard)."""

    def __init__(self, log_dir: Path, *, purge_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard is optional

        # purge_step: a job resumed from step k rewrites steps > k; TensorBoard drops the old ones.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        self.log_dir = log_dir

    def log(self, kind: str, step: int, data: Mapping[str, Any]) -> None:
        scalars, texts = tracked_values(kind, data)
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        for name, text in texts.items():
            self.writer.add_text(name, text, global_step=step)
        if scalars or texts:
            self.writer.flush()  # a running job's curves show up now, not at the next 2-minute flush

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run per job; offline mode writes <dir>/wandb/offline-run-* without any network."""

    def __init__(self, cfg: WandbConfig, directory: Path, *, run_name: str, run_id: str,
                 config: Mapping[str, Any], resuming: bool) -> None:
        import wandb  # imported here: wandb is optional and slow to import

        directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True,
                                  save_code=False)
        try:
            self.run = wandb.init(
                project=cfg.project, entity=cfg.entity, name=cfg.name or run_name, id=run_id, group=cfg.group,
                tags=list(cfg.tags) or None, dir=str(directory), mode=cfg.mode, config=dict(config),
                resume="allow" if resuming else None, reinit="create_new", settings=settings,
            )
        except Exception as e:  # wandb raises its own errors and plain ones (UsageError, CommError, ...)
            raise TrackingError(f"tracking.wandb: cannot start a W&B run ({type(e).__name__}: {e})") from e
        # Several x axes: RL charts against the RL step, SFT against its own; W&B's internal
        # step only counts log calls, so a resumed job or SFT before step 0 never goes "backwards".
        self.run.define_metric(RL_STEP)
        self.run.define_metric(SFT_STEP)
        self.run.define_metric("sft/*", step_metric=SFT_STEP)
        for group in ("rollout", "train", "eval", "sync"):
            self.run.define_metric(f"{group}/*", step_metric=RL_STEP)

    def log(self, kind: str, step: int, data: Mapping[str, Any]) -> None:
        scalars, texts = tracked_values(kind, data)
        if scalars:
            axis = SFT_STEP if kind == "sft" else RL_STEP
            self.run.log({**scalars, axis: step})
        for name, text in texts.items():
            self.run.summary[name] = text  # the latest plane or checkpoint, on the run's page

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        for key, value in (summary or {}).items():
            if isinstance(value, int | float | str) and not isinstance(value, bool):
                self.run.summary[f"job/{key}"] = value
        self.run.finish()


class TrackingError(RuntimeError):
    """A tracker could not start."""


class FanOut:
    """Every tracker gets every event; one that raises is dropped with a warning (the job goes on)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = list(trackers)
        self._lock = threading.Lock()  # the loop and its helper threads all emit

    def log(self, kind: str, step: int, data: Mapping[str, Any]) -> None:
        with self._lock:
            for tracker in list(self.trackers):
                try:
                    tracker.log(kind, step, data)
                except Exception as e:
                    self.trackers.remove(tracker)
                    log.warning("tracking: %s failed (%s: %s); it is off for the rest of the job",
                                type(tracker).__name__, type(e).__name__, e)

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        with self._lock:
            for tracker in self.trackers:
                try:
                    tracker.close(summary)
                except Exception as e:
                    log.warning("tracking: closing %s failed (%s: %s)", type(tracker).__name__, type(e).__name__, e)
            self.trackers = []


def build_tracker(cfg: TrackingConfig, output_dir: Path, *, run_name: str, run_id: str,
                  config: Mapping[str, Any], resume_step: int | None = None) -> Tracker:
    """The trackers `cfg` turns on, writing under `output_dir` (TensorBoard: <output_dir>/tensorboard;
    W&B: <wandb.dir or output_dir>/wandb); a NullTracker when none is on."""
    trackers: list[Tracker] = []
    try:
        if cfg.tensorboard:
            purge = resume_step + 1 if resume_step is not None else None
            trackers.append(TensorBoardTracker(Path(output_dir) / "tensorboard", purge_step=purge))
        if cfg.wandb is not None:
            trackers.append(WandbTracker(cfg.wandb, Path(cfg.wandb.dir or output_dir), run_name=run_name,
                                         run_id=run_id, config=config, resuming=resume_step is not None))
    except ImportError as e:  # check_packages refuses such jobs at submit; a coordinator may have changed since
        FanOut(trackers).close()
        raise TrackingError(f"tracking: {e.name or e} is not installed (pip install {e.name or 'it'})") from e
    except Exception:
        FanOut(trackers).close()
        raise
    return FanOut(trackers) if trackers else NullTracker()
