"""GPU tests run where a CUDA GPU is visible; everywhere else they skip with the reason."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (bash bench/device.sh gpu-tests-a gpu-tests-b on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
