"""What bench/rollout.py reports about where a step's and a call's time goes: each kernel counted
under the kind it is, and a call's idle device time split where it sits."""

from __future__ import annotations

import pytest

from bench.rollout import idle_split, kernel_kind


@pytest.mark.parametrize("name,kind", [
    ("nvjet_sm90_tst_168x128_64x5_4x2_h_bz_TNN", "matmul"),  # cuBLAS
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", "matmul"),
    ("_tile_linear_kernel", "matmul"),  # the attention's products past 16 rows (was "other")
    ("_skinny_linear_kernel", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64", "attention"),  # not "sm90_"
    ("_decode_attention_kernel", "attention"),
    ("_prefill_attention_kernel", "attention"),
    ("_qk_rope_cache_kernel", "norm_rope_silu"),
    ("_add_rmsnorm_kernel", "norm_rope_silu"),
    ("_silu_mul_kernel", "norm_rope_silu"),
    ("_sample_chunk_kernel", "sampling"),
    ("Memset (Unknown)", "other"),
])
def test_each_kernel_counts_under_its_kind(name, kind):
    assert kernel_kind(name) == kind


def test_a_calls_idle_device_time_is_split_before_between_and_after_its_kernels():
    # the marker at 100-102 us (the call's start), kernels overlapping as PDL lets them, a gap,
    # and the call returning 1.1 ms after the last kernel
    activity = [(100.0, 102.0), (600.0, 1600.0), (1500.0, 2600.0), (2700.0, 3000.0)]
    idle = idle_split(activity, call_us=4000.0)
    assert idle == {"busy": 2.3, "before_first_kernel": 0.498, "between_kernels": 0.1, "after_last_kernel": 1.1}
    assert idle_split([(0.0, 1.0)], call_us=500.0)["before_first_kernel"] == 0.499  # nothing ran
