"""On a GPU too, an engine's second update of a layout swaps memory with its staging (a device
that reads "cuda" in the settings and "cuda:0" on a tensor is the same device)."""

from __future__ import annotations

import pytest

from services.rollout import engine as engine_module
from services.rollout.engine import RolloutEngine, RolloutSettings
from services.rollout.receiver import Staging
from tests.unit.test_rollout_updates import _serves, _trainer_weights, _update

pytestmark = pytest.mark.gpu


def test_a_gpu_engine_swaps_memory_from_its_second_update(tiny_model_dir):  # where torch can (>= 2.13)
    engine = RolloutEngine(RolloutSettings(model_path=str(tiny_model_dir), device="cuda"))
    staging = Staging(engine.device)
    w1, w2 = (_trainer_weights(engine, seed) for seed in (1, 2))
    _update(engine, staging, w1, 1)
    assert not engine.swapped and _serves(engine, w1)
    _update(engine, staging, w2, 2)
    assert engine.swapped == engine_module._CAN_SWAP and _serves(engine, w2)
