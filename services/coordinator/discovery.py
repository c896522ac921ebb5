"""How the coordinator finds its workers: a `Discovery` of ready trainer and rollout addresses.

A discovery answers "which trainers and rollout engines can take work right now" as lists of
`host:port`, ordered by rank (a StatefulSet pod's ordinal), and lets a caller wait for that answer
to change. `StaticDiscovery` holds fixed lists (local runs, tests, `--trainers/--rollouts`);
`services.coordinator.k8s_discovery.KubernetesDiscovery` watches pods. `make_fleet` turns any
discovery into the `make_fleet(job) -> Fleet` callable the JobManager takes: it waits (bounded)
until enough workers are ready, so a coordinator that starts before its pods does not fail a job
it could run a minute later. This module imports no Kubernetes code.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Callable, Protocol, Sequence

from services import rpc
from services.coordinator.clients import RolloutClient, TrainerClient
from services.coordinator.config import JobConfig
from services.coordinator.loop import Fleet

log = rpc.get_logger("coordinator.discovery")

Listener = Callable[[list[str], list[str]], None]


class DiscoveryError(RuntimeError):
    """The worker registry (e.g. the Kubernetes API) could not be read."""


class Discovery(Protocol):
    def trainers(self) -> list[str]:
        """Addresses of the trainers ready for work, in rank order."""
        ...

    def rollouts(self) -> list[str]:
        """Addresses of the rollout engines ready for work, in rank order."""
        ...

    def critics(self) -> list[str]:
        """Addresses of the critics (trainer servers PPO jobs use as value models), in rank order."""
        ...

    def wait_until(self, predicate: Callable[[list[str], list[str]], bool], timeout_s: float) -> bool:
        """Block until predicate(trainers, rollouts) holds (True) or timeout_s passes (False)."""
        ...

    def subscribe(self, listener: Listener) -> None:
        """Call listener(trainers, rollouts) after every change of either list."""
        ...

    def resync(self) -> None:
        """Re-read the registry now; raises DiscoveryError when it cannot be read."""
        ...

    def close(self) -> None: ...


def rank_key(name: str) -> tuple:
    """Natural order, so `rollout-10` comes after `rollout-2` (StatefulSet ordinals are ranks)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


class ReadySet:
    """The current ready addresses per role, with change notification; shared by discoveries."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._trainers: tuple[str, ...] = ()
        self._rollouts: tuple[str, ...] = ()
        self._critics: tuple[str, ...] = ()
        self._listeners: list[Listener] = []

    def snapshot(self) -> tuple[list[str], list[str]]:
        with self._cond:
            return list(self._trainers), list(self._rollouts)

    def critics(self) -> list[str]:
        with self._cond:
            return list(self._critics)

    def replace(self, trainers: Sequence[str], rollouts: Sequence[str], critics: Sequence[str] = ()) -> bool:
        """Set every list; listeners run (outside the lock) only when something changed."""
        new_t, new_r, new_c = tuple(trainers), tuple(rollouts), tuple(critics)
        with self._cond:
            if (new_t, new_r, new_c) == (self._trainers, self._rollouts, self._critics):
                return False
            self._trainers, self._rollouts, self._critics = new_t, new_r, new_c
            listeners = list(self._listeners)
            self._cond.notify_all()
        for listener in listeners:
            try:
                listener(list(new_t), list(new_r))
            except Exception:  # a listener's bug must not stop discovery
                log.exception("discovery listener failed")
        return True

    def wait_until(self, predicate: Callable[[list[str], list[str]], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(list(self._trainers), list(self._rollouts)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def subscribe(self, listener: Listener) -> None:
        with self._cond:
            self._listeners.append(listener)


class ReadySetDiscovery:
    """The read side of the Discovery protocol, answered from a ReadySet kept in `self._ready`."""

    _ready: ReadySet

    def trainers(self) -> list[str]:
        return self._ready.snapshot()[0]

    def rollouts(self) -> list[str]:
        return self._ready.snapshot()[1]

    def critics(self) -> list[str]:
        return self._ready.critics()

    def wait_until(self, predicate: Callable[[list[str], list[str]], bool], timeout_s: float) -> bool:
        return self._ready.wait_until(predicate, timeout_s)

    def subscribe(self, listener: Listener) -> None:
        self._ready.subscribe(listener)


class StaticDiscovery(ReadySetDiscovery):
    """Fixed address lists: every listed worker is taken to be ready."""

    def __init__(self, trainers: Sequence[str], rollouts: Sequence[str], critics: Sequence[str] = ()) -> None:
        self._ready = ReadySet()
        self._ready.replace(trainers, rollouts, critics)

    def resync(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_fleet(
    discovery: Discovery,
    token: str | None = None,
    *,
    wait_s: float = 600.0,
    eval_trainers: int = 0,
    describe: str = "",
) -> Callable[[JobConfig], Fleet]:
    """A JobManager fleet factory over a discovery, compatible with `fleet.static_fleet`.

    A job gets the first `trainer.num_trainers` ready trainers and `rollout.num_engines` ready
    engines, in rank order, waiting up to wait_s for them. An eval-only job waits for only
    `eval_trainers` trainers (0 when engines load a Hugging Face checkpoint themselves) and also
    takes any other ready ones, up to num_trainers.
    """

    def make(job: JobConfig) -> Fleet:
        want_t = min(eval_trainers, job.trainer.num_trainers) if job.eval_only else job.trainer.num_trainers
        want_r = job.rollout.num_engines
        want_c = job.num_critics  # PPO only; an eval-only job waits for none

        chosen: list[list[str]] = []

        def enough(trainers: list[str], rollouts: list[str]) -> bool:
            # Runs under the ready set's (reentrant) lock, so the critics read here belong to the
            # same state as the trainers and rollouts passed in.
            critics = discovery.critics()
            ok = len(trainers) >= want_t and len(rollouts) >= want_r and len(critics) >= want_c
            if ok:  # keep the lists that satisfied the wait; a later read could already differ
                chosen[:] = [trainers[: job.trainer.num_trainers], rollouts[:want_r], critics[:want_c]]
            return ok

        if not discovery.wait_until(enough, wait_s):
            trainers, rollouts = discovery.trainers(), discovery.rollouts()
            last_error = getattr(discovery, "last_error", None)  # e.g. the API server was unreachable
            where = (f" ({describe})" if describe else "") + (f"; last discovery error: {last_error}" if last_error else "")
            if len(trainers) < want_t:
                raise ValueError(
                    f"trainer.num_trainers: job wants {want_t}, {len(trainers)} ready after {wait_s:g} s{where}"
                )
            if len(discovery.critics()) < want_c:
                raise ValueError(f"critic.num_critics: job wants {want_c}, {len(discovery.critics())} ready "
                                 f"after {wait_s:g} s{where}")
            raise ValueError(f"rollout.num_engines: job wants {want_r}, {len(rollouts)} ready after {wait_s:g} s{where}")
        trainers, rollouts, critics = chosen
        log.info("job %s: trainers %s, rollout engines %s%s", job.name, trainers, rollouts,
                 f", critics {critics}" if critics else "")

        def relocate(index: int) -> RolloutClient | None:
            """Engine `index`'s current address: the index-th ready engine in rank order, once
            as many are ready as the job has (before that, ranks after a missing pod shift)."""
            ready = discovery.rollouts()
            return RolloutClient(ready[index], token) if len(ready) >= want_r else None

        return Fleet(
            trainers=[TrainerClient(a, token) for a in trainers],
            engines=[RolloutClient(a, token) for a in rollouts],
            critics=[TrainerClient(a, token) for a in critics],
            trainer_token=token or "",
            relocate=relocate,
            discover=discovery.rollouts if job.rollout.elastic else None,
            connect=lambda address: RolloutClient(address, token),
        )

    return make
