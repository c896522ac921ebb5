"""The trainer's part of a job config crosses two boundaries (job YAML -> rlfleet.v1.TrainerConfig
-> TrainerSettings) and every field must arrive meaning what the user wrote: zeros included (a
`beta1: 0.0` once became 0.9), and no key accepted that nothing reads."""

from __future__ import annotations

import hypothesis
import yaml
from hypothesis import strategies as st

from services.coordinator.config import parse_job
from services.coordinator.loop import trainer_config
from services.trainer.server import settings_from_proto
from tests.unit.test_config import MINIMAL

unit = st.floats(0.0, 0.999, allow_nan=False)
positive = st.floats(1e-12, 10.0, allow_nan=False)
non_negative = st.floats(0.0, 10.0, allow_nan=False)


@st.composite
def job_overrides(draw) -> dict:
    use_kl_loss = draw(st.booleans())
    return {
        "seed": draw(st.integers(0, 2**31)),
        "trainer": {
            "dtype": draw(st.sampled_from(["float32", "bfloat16", "float16"])),
            "micro_batch_size": draw(st.integers(1, 4096)),
            "offload": draw(st.booleans()),
            "colocate": draw(st.booleans()),
            "tags": draw(st.lists(st.sampled_from(["old_actor", "teacher"]), unique=True)),
            "optimizer": {"lr": draw(positive), "weight_decay": draw(non_negative),
                          "betas": [draw(unit), draw(unit)], "eps": draw(positive), "grad_clip": draw(non_negative)},
            "scheduler": {"kind": draw(st.sampled_from(["constant", "linear", "cosine"])),
                          "warmup_steps": draw(st.integers(0, 4)), "min_lr_ratio": draw(st.floats(0, 1))},
        },
        "algorithm": {"kl_coef": draw(non_negative), "use_kl_loss": use_kl_loss,
                      "kl_estimator": draw(st.sampled_from(["k1", "k2", "k3", "low_var_kl"])),
                      "clip_eps_low": draw(unit), "clip_eps_high": draw(non_negative),
                      "entropy_coef": draw(st.floats(-1, 1)),
                      "loss_agg": draw(st.sampled_from(["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]))},
        "weight_sync": {"bucket_mb": draw(st.integers(1, 2048))},
    }


@hypothesis.settings(max_examples=200, deadline=None, derandomize=True, database=None)
@hypothesis.given(job_overrides())
def test_every_trainer_field_arrives_as_written(overrides):
    job = parse_job(yaml.safe_dump({**MINIMAL, **overrides}), "/jobs", check_files=False)
    settings = settings_from_proto(trainer_config(job))
    t, a, o = job.trainer, job.algorithm, job.trainer.optimizer
    assert (settings.optimizer.lr, settings.optimizer.weight_decay, settings.optimizer.beta1, settings.optimizer.beta2,
            settings.optimizer.eps, settings.optimizer.grad_clip) == (o.lr, o.weight_decay, *o.betas, o.eps, o.grad_clip)
    assert (settings.scheduler.kind, settings.scheduler.warmup_steps, settings.scheduler.min_lr_ratio) == \
        (t.scheduler.kind, t.scheduler.warmup_steps, t.scheduler.min_lr_ratio)
    assert settings.scheduler.decay_steps == t.scheduler.total_decay_steps(job.num_rollout)
    loss = settings.loss
    assert (loss.clip_eps_low, loss.clip_eps_high, loss.kl_estimator, loss.entropy_coef, loss.loss_agg) == \
        (a.clip_eps_low, a.clip_eps_high, a.kl_estimator, a.entropy_coef, a.loss_agg)
    assert loss.kl_coef == (a.kl_coef if a.use_kl_loss else 0.0)  # in the reward otherwise: the trainer adds none
    assert (settings.device, settings.dtype, settings.seed, settings.micro_batch_size, settings.offload,
            settings.colocate, settings.bucket_bytes) == \
        (t.device, t.dtype, job.seed, t.micro_batch_size, t.offload, t.colocate, job.weight_sync.bucket_bytes)
    assert set(settings.tags) == set(job.trainer_tags) and ("ref" in settings.tags) == (a.kl_coef > 0)
    assert settings.compile == t.compile


def test_zeros_are_kept_not_replaced_by_defaults():
    job = parse_job(yaml.safe_dump({**MINIMAL, "trainer": {"optimizer": {"lr": 1e-3, "betas": [0.0, 0.0],
                                                                              "weight_decay": 0.0, "grad_clip": 0.0}}}),
                    "/jobs", check_files=False)
    settings = settings_from_proto(trainer_config(job))
    assert (settings.optimizer.beta1, settings.optimizer.beta2, settings.optimizer.weight_decay,
            settings.optimizer.grad_clip) == (0.0, 0.0, 0.0, 0.0)
    unset = settings_from_proto(type(trainer_config(job))(model_path="/m"))
    assert (unset.optimizer.lr, unset.optimizer.beta1) == (1e-5, 0.9)  # unset fields take the defaults
    assert unset.compile  # GPU trainers compile their layers unless a job says compile: false
    off = parse_job(yaml.safe_dump({**MINIMAL, "trainer": {"compile": False}}), "/jobs", check_files=False)
    assert settings_from_proto(trainer_config(off)).compile is False
