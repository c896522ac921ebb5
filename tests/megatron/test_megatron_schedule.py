"""The learning-rate schedule the megatron backend runs on GPUs is Megatron's own
`OptimizerParamScheduler`, built from the trainer's scheduler settings (`schedule_arguments`).
The scheduler only reads and writes its optimizer's param groups, so it runs here on a stand-in
with one group; the GPU test drives it through real training steps."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("megatron.core")

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402

from services.trainer.megatron_optimizer import schedule_arguments  # noqa: E402
from services.trainer.settings import OptimizerSettings, SchedulerSettings, TrainerSettings  # noqa: E402

pytestmark = pytest.mark.megatron


class _Groups:
    def __init__(self) -> None:
        self.param_groups = [{"lr": None, "weight_decay": None}]


def _lrs(scheduler: SchedulerSettings, steps: int, lr: float = 1e-4, weight_decay: float = 0.01) -> list[float]:
    settings = TrainerSettings(model_path="unused", backend="megatron", scheduler=scheduler,
                               optimizer=OptimizerSettings(lr=lr, weight_decay=weight_decay))
    optimizer = _Groups()
    megatron = OptimizerParamScheduler(optimizer, **schedule_arguments(settings))
    seen = []
    for _ in range(steps):  # the trainer steps with the group's LR, then advances the schedule
        seen.append(optimizer.param_groups[0]["lr"])
        assert optimizer.param_groups[0]["weight_decay"] == weight_decay
        megatron.step(increment=1)
    return seen


def test_warmup_then_cosine_to_the_floor():
    lrs = _lrs(SchedulerSettings(kind="cosine", warmup_steps=2, decay_steps=6, min_lr_ratio=0.1), 8)
    peak, floor = 1e-4, 1e-5
    cosine = [floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (n - 2) / 4)) for n in range(3, 7)]
    assert lrs == pytest.approx([0.0, peak / 2, peak, *cosine, floor], rel=1e-9, abs=1e-15)


def test_linear_decay_and_constant_after_a_warmup():
    assert _lrs(SchedulerSettings(kind="linear", warmup_steps=0, decay_steps=4), 6) == \
        pytest.approx([1e-4, 0.75e-4, 0.5e-4, 0.25e-4, 0.0, 0.0], abs=1e-15)
    # a constant schedule needs no decay_steps: Megatron's own assertion is satisfied for it
    assert _lrs(SchedulerSettings(kind="constant", warmup_steps=4), 6) == \
        pytest.approx([0.0, 0.25e-4, 0.5e-4, 0.75e-4, 1e-4, 1e-4], abs=1e-15)


def test_a_decay_that_ends_before_the_warmup_is_refused_by_name():
    with pytest.raises(ValueError, match=r"scheduler\.decay_steps \(2\) must be larger than scheduler\.warmup_steps \(3\)"):
        _lrs(SchedulerSettings(kind="cosine", warmup_steps=3, decay_steps=2), 1)
