"""A trainer lost mid-job: telling one from other failures, and waiting until the fleet answers again.

A critic (PPO's value model) is a trainer server too: losing one is handled the same way, and
the restarted loop loads its checkpoint (`<checkpoint>/critic`) with the policy's.

A trainer process that dies (SIGKILL, an OOM kill, a drained node) fails the loop's next call to
it with UNAVAILABLE (connection refused or reset; the other ranks' collectives with it fail the
same way), with DEADLINE_EXCEEDED (a node gone without closing its connections), or, when it came
back at the same address before that call, with FAILED_PRECONDITION "not configured". The job
manager restarts such a job from its last checkpoint on a fleet made anew (on Kubernetes the
replacement pod has a new address), once every trainer of that fleet answers. This module holds
what of that knows gRPC status codes and worker clients, so that jobs.py does not.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Collection

import grpc

from services.api import trainer_pb2
from services.coordinator.clients import PeerError, TrainerClient
from services.coordinator.config import JobConfig
from services.coordinator.loop import Fleet, JobCancelled

_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class TrainerLost(RuntimeError):
    """A trainer was lost and the job cannot go on without it (the message says why)."""


def lost_trainer(error: BaseException, clients: list[TrainerClient]) -> PeerError | None:
    """Whether a job failed because it lost one of `clients` (its trainer servers): the PeerError
    that says so, from the failure itself or, when that names no trainer, from a trainer that no
    longer answers; None when the failure is something else."""
    return _named(error, {c.address for c in clients}) or _silent(error, clients)


def _named(error: BaseException, trainers: Collection[str]) -> PeerError | None:
    """The PeerError in `error`'s cause/context chain saying that one of `trainers` (addresses)
    is gone."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PeerError) and current.peer in trainers and _means_lost(current):
            return current
        current = current.__cause__ if current.__cause__ is not None else current.__context__
    return None


def _silent(error: BaseException, clients: list[TrainerClient]) -> PeerError | None:
    """After a failure that names no trainer (a sync whose engines all failed because the trainer
    they pulled from died half-way), the first trainer that no longer answers at all, as a
    PeerError that tells what failed; None when every trainer still answers (then the failure
    was something else). Trainers that answer unconfigured do not count: before a job configures
    them, all do."""
    if isinstance(error, JobCancelled):
        return None
    for address, answer in probe(clients).items():
        if isinstance(answer, PeerError):
            return PeerError(address, "GetStatus", answer.code,
                             f"does not answer after the job failed ({type(error).__name__}: {error})")
    return None


def _means_lost(error: PeerError) -> bool:
    if error.code in _LOST:
        return True
    # restarted in place: the address answers, but the trainer it had is gone
    return error.code == grpc.StatusCode.FAILED_PRECONDITION and "not configured" in error.details


def probe(clients: list[TrainerClient], timeout_s: float = 5.0) -> dict[str, trainer_pb2.TrainerStatus | PeerError]:
    """Each trainer's GetStatus answer, or the error it gave instead, by address."""
    answers: dict[str, trainer_pb2.TrainerStatus | PeerError] = {}
    for client in clients:
        try:
            answers[client.address] = client.status(timeout_s=timeout_s)
        except PeerError as e:
            answers[client.address] = e
    return answers


def gone(clients: list[TrainerClient]) -> list[str]:
    """The trainers that do not answer, or answer with nothing configured: the ones a job lost."""
    return [address for address, answer in probe(clients).items()
            if isinstance(answer, PeerError) or not answer.configured]


def close_clients(fleet: Fleet) -> None:
    for client in (*fleet.trainer_servers, *fleet.engines):
        client.close()


def wait_for_trainers(make_fleet: Callable[[JobConfig], Fleet], job: JobConfig, cancel: threading.Event,
                      wait_s: float, poll_s: float = 2.0) -> Fleet:
    """A fleet made anew whose every trainer answers GetStatus, waiting up to wait_s for one: a
    dead trainer's address can stay listed a while, and its replacement takes time to start.

    JobCancelled as soon as `cancel` is set; TrainerLost, naming the silent ones, when the time is up.
    """
    deadline = time.monotonic() + wait_s
    why = "no fleet was made"
    while True:
        try:
            fleet = _make(make_fleet, job, cancel, deadline)
        except ValueError as e:  # not enough ready workers (yet)
            fleet, why = None, str(e)
        if fleet is not None:
            silent = {a: e for a, e in probe(fleet.trainer_servers).items() if isinstance(e, PeerError)}
            if not silent:
                return fleet
            close_clients(fleet)
            why = "; ".join(f"{address} does not answer ({e.code.name if e.code else 'ERROR'})"
                            for address, e in silent.items())
        left = deadline - time.monotonic()
        if left <= 0:
            raise TrainerLost(f"the job's trainers did not all answer within {wait_s:g} s: {why}")
        if cancel.wait(min(poll_s, left)):
            raise JobCancelled("job cancelled")


def _make(make_fleet: Callable[[JobConfig], Fleet], job: JobConfig, cancel: threading.Event,
          deadline: float) -> Fleet | None:
    """make_fleet(job), which may wait minutes for ready workers, in a thread given up on when the
    job is cancelled (JobCancelled) or the deadline passes (None); a fleet made after that is closed."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="make-fleet")
    future = pool.submit(make_fleet, job)
    pool.shutdown(wait=False)
    while not future.done():
        if cancel.wait(0.2):
            future.add_done_callback(_close_made)
            raise JobCancelled("job cancelled")
        if time.monotonic() >= deadline:
            future.add_done_callback(_close_made)
            return None
    return future.result()


def _close_made(future: Future) -> None:
    if future.exception() is None:
        close_clients(future.result())
