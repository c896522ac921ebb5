"""The serving engine on a GPU (decode steps replayed as CUDA graphs): concurrent callers in one
batch get their own tokens, updates in flight keep every token's version exact with the weights
copied into the graphs' addresses between steps, and the prefix cache changes no token (the CPU
checks of tests/unit/test_serving.py and tests/unit/test_prefix_cache.py)."""

from __future__ import annotations

import pytest

from services.rollout.types import Sampling
from tests.unit.test_prefix_cache import check_cached_prefixes
from tests.unit.test_serving import check_abort, check_concurrent_callers, check_pause_versions

pytestmark = pytest.mark.gpu


def test_concurrent_callers_on_a_gpu(tiny_model_dir):
    check_concurrent_callers(tiny_model_dir, "cuda")


def test_pause_versions_on_a_gpu(long_model_dir):
    # (8 steps a round, and an update takes some: 24 rows of 120 tokens, 8 at a time, outlast five)
    check_pause_versions(long_model_dir, "cuda", tolerance=2e-3, rounds_between=1, new_tokens=120)


def test_abort_on_a_gpu(tiny_model_dir):
    # 16 of 40 tokens made; 96 prompts, 4 at a time, outlast the update (the tiny model's whole
    # 12 took less than an update on an H100)
    check_abort(tiny_model_dir, "cuda", rounds=2, prompts=96)


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.0, max_new_tokens=12, ignore_eos=True),
                                      Sampling(temperature=1.0, max_new_tokens=12, seed=4, n=3, ignore_eos=True)],
                         ids=["greedy", "seeded-n3"])
def test_prefix_cache_on_a_gpu(long_model_dir, sampling):
    """A prefill after a cache hit (eager, torch attention over the cached blocks) against the
    graphs' and kernels' whole-prompt prefill: the same tokens (float32)."""
    check_cached_prefixes(long_model_dir, sampling, "cuda", 2e-3)
