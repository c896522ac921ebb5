"""On a GPU an engine's updates copy into the weights' own memory: decode graphs hold those
addresses, so the model never adopts (or swaps with) its staging there."""

from __future__ import annotations

import pytest

from services.rollout.engine import RolloutEngine, RolloutSettings
from services.rollout.receiver import Staging
from tests.unit.test_rollout_updates import _serves, _trainer_weights, _update

pytestmark = pytest.mark.gpu


def test_a_gpu_engine_copies_updates_into_fixed_addresses(tiny_model_dir):
    engine = RolloutEngine(RolloutSettings(model_path=str(tiny_model_dir), device="cuda"))
    staging = Staging(engine.device)
    addresses = [p.data_ptr() for p in engine.model.parameters()]
    w1, w2 = (_trainer_weights(engine, seed) for seed in (1, 2))
    first, _ = _update(engine, staging, w1, 1)
    assert not engine.swapped and not engine.holds_buffers and _serves(engine, w1)
    second, _ = _update(engine, staging, w2, 2)
    assert all(a is b for a, b in zip(first, second))  # one staging set serves every update
    assert _serves(engine, w2) and [p.data_ptr() for p in engine.model.parameters()] == addresses
