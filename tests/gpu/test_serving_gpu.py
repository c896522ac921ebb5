"""The serving engine on a GPU (decode steps replayed as CUDA graphs): concurrent callers in one
batch get their own tokens, and updates in flight keep every token's version exact with the
weights copied into the graphs' addresses between steps (the CPU checks of tests/unit/test_serving.py)."""

from __future__ import annotations

import pytest

from tests.unit.test_serving import check_abort, check_concurrent_callers, check_pause_versions

pytestmark = pytest.mark.gpu


def test_concurrent_callers_on_a_gpu(tiny_model_dir):
    check_concurrent_callers(tiny_model_dir, "cuda")


def test_pause_versions_on_a_gpu(tiny_model_dir):
    check_pause_versions(tiny_model_dir, "cuda", tolerance=2e-3)


def test_abort_on_a_gpu(tiny_model_dir):
    check_abort(tiny_model_dir, "cuda")
