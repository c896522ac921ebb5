"""The never-mixed check (tests/integration/test_never_mixed.py) on the GPU planes: CUDA IPC from
a live trainer, and an offloaded trainer's host copy uploaded by the engine."""

from __future__ import annotations

import pytest

from tests.integration.test_never_mixed import check_never_mixed, model_dir, trainer_and_engine  # noqa: F401

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("offload", [False, True], ids=["cuda-ipc-live", "host-copy"])
def test_generate_during_gpu_syncs_answers_only_complete_versions(tmp_path, model_dir, offload):  # noqa: F811
    with trainer_and_engine(tmp_path / "logs", model_dir, device="cuda", offload=offload) as (trainer, engine):
        check_never_mixed(trainer, engine, model_dir, "cuda_ipc", device="cuda", offload=offload)
