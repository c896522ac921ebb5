"""Static discovery: the coordinator's workers given as address lists (local runs, tests).

A Kubernetes discovery adapter provides the same `make_fleet(job) -> Fleet` callable.
"""

from __future__ import annotations

from typing import Callable

from services.coordinator.clients import RolloutClient, TrainerClient
from services.coordinator.config import JobConfig
from services.coordinator.loop import Fleet


def static_fleet(trainers: list[str], rollouts: list[str], token: str | None = None,
                 critics: list[str] = ()) -> Callable[[JobConfig], Fleet]:
    def make(job: JobConfig) -> Fleet:
        want_t, want_r, want_c = job.trainer.num_trainers, job.rollout.num_engines, job.num_critics
        if job.num_rollout > 0 and len(trainers) < want_t:
            raise ValueError(f"trainer.num_trainers: job wants {want_t}, coordinator knows {len(trainers)}")
        if len(rollouts) < want_r:
            raise ValueError(f"rollout.num_engines: job wants {want_r}, coordinator knows {len(rollouts)}")
        if len(critics) < want_c:
            raise ValueError(f"critic.num_critics: job wants {want_c}, coordinator knows {len(critics)} (--critics)")
        return Fleet(
            trainers=[TrainerClient(a, token) for a in trainers[:want_t]],
            engines=[RolloutClient(a, token) for a in rollouts[:want_r]],
            critics=[TrainerClient(a, token) for a in critics[:want_c]],
            trainer_token=token or "",
        )

    return make
