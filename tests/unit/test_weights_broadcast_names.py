"""A weight group's name can be used again once the group is closed: a trainer outlives its
coordinators, and every new coordinator numbers its groups from 1 again."""

from __future__ import annotations

import torch

from services.weights.broadcast import WeightGroup


def _group(name: str) -> WeightGroup:
    return WeightGroup(master_address="127.0.0.1", master_port=0, rank=0, world_size=1, group_name=name,
                       backend="gloo", timeout_s=30, device=torch.device("cpu")).connect()


def test_a_closed_groups_name_can_be_taken_again():
    for _ in range(3):
        group = _group("rlfleet-weights-1")
        flat = torch.arange(8, dtype=torch.uint8)
        group.broadcast_buckets([flat], src=0)  # a one-rank broadcast: the group works
        group.close()
