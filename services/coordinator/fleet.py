"""Static discovery: the coordinator's workers given as address lists (local runs, tests).

A Kubernetes discovery adapter provides the same `make_fleet(job) -> Fleet` callable. The
rollout list of a static one can change while jobs run (`ScaleEngines`): each job's `Fleet`
reads it through `discover`, and admits engines new to it at a step boundary.
"""

from __future__ import annotations

import re
import threading

from services.coordinator.clients import RolloutClient, TrainerClient
from services.coordinator.config import JobConfig
from services.coordinator.loop import Fleet

_ADDRESS = re.compile(r"[\w.\-\[\]:]+:\d{1,5}")


class EnginesDiscovered(RuntimeError):
    """The coordinator discovers its engines (Kubernetes): they are not set by a call."""


class StaticFleet:
    """`make(job) -> Fleet` over fixed trainer and critic lists and a rollout list that
    `scale_engines` may replace."""

    def __init__(self, trainers: list[str], rollouts: list[str], token: str | None = None, critics: list[str] = ()):
        self.trainers, self.critics, self.token = list(trainers), list(critics), token
        self._rollouts = list(rollouts)
        self._lock = threading.Lock()

    def rollouts(self) -> list[str]:
        with self._lock:
            return list(self._rollouts)

    def scale_engines(self, rollouts: list[str]) -> list[str]:
        """Replace the rollout list (ValueError naming a malformed or repeated address)."""
        if not rollouts:
            raise ValueError("rollouts: at least one engine address (host:port)")
        bad = [a for a in rollouts if not _ADDRESS.fullmatch(a)]
        if bad:
            raise ValueError(f"rollouts: not host:port: {bad[0]!r}")
        if len(set(rollouts)) < len(rollouts):
            raise ValueError("rollouts: an address is listed twice")
        with self._lock:
            self._rollouts = list(rollouts)
            return list(self._rollouts)

    def __call__(self, job: JobConfig) -> Fleet:
        trainers, rollouts, critics = self.trainers, self.rollouts(), self.critics
        want_t, want_r, want_c = job.trainer.num_trainers, job.rollout.num_engines, job.num_critics
        if job.num_rollout > 0 and len(trainers) < want_t:
            raise ValueError(f"trainer.num_trainers: job wants {want_t}, coordinator knows {len(trainers)}")
        if len(rollouts) < want_r:
            raise ValueError(f"rollout.num_engines: job wants {want_r}, coordinator knows {len(rollouts)}")
        if len(critics) < want_c:
            raise ValueError(f"critic.num_critics: job wants {want_c}, coordinator knows {len(critics)} (--critics)")
        token = self.token
        return Fleet(
            trainers=[TrainerClient(a, token) for a in trainers[:want_t]],
            engines=[RolloutClient(a, token) for a in rollouts[:want_r]],
            critics=[TrainerClient(a, token) for a in critics[:want_c]],
            trainer_token=token or "",
            discover=self.rollouts if job.rollout.elastic else None,
            connect=lambda address: RolloutClient(address, token),
        )


def static_fleet(trainers: list[str], rollouts: list[str], token: str | None = None,
                 critics: list[str] = ()) -> StaticFleet:
    return StaticFleet(trainers, rollouts, token, critics)
