"""Broadcast groups on their own store: a one-rank gloo group moves buckets whole and in parts,
and closing a group whose communicator will not abort does not hold the caller."""

from __future__ import annotations

import logging
import threading
import time

import torch

from services.weights.broadcast import PART_BYTES, WeightGroup, free_port


def _group(name: str) -> WeightGroup:
    return WeightGroup(master_address="127.0.0.1", master_port=free_port(), rank=0, world_size=1,
                       group_name=name, backend="gloo", timeout_s=10, device=torch.device("cpu")).connect()


def test_buckets_are_reported_part_by_part_in_order():
    group = _group("parts")
    try:
        flats = [torch.zeros(n, dtype=torch.uint8) for n in (PART_BYTES + 5, 7)]
        seen = []
        group.broadcast_buckets(flats, on_part=lambda k, n: seen.append((k, n)))
        assert seen == [(0, PART_BYTES), (0, PART_BYTES + 5), (1, 7)]
    finally:
        group.close()


def test_a_communicator_that_will_not_abort_does_not_hold_close(caplog):
    group = _group("stuck")
    released = threading.Event()
    real = group._pg

    class Stuck:
        def abort(self):
            released.wait(30)

    group._pg = Stuck()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rlfleet.weights"):
        group.close(wait_s=0.2)
    assert time.monotonic() - started < 5
    assert "aborting its communicator did not finish" in caplog.text
    released.set()
    real.abort()
