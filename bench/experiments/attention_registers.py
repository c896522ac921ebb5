"""Registers, spills and shared memory of the decode attention kernel's variants, compiled for
sm_90a without a GPU (2026-12-03): which settings keep every program of a batch-256 step
resident. An H200 SM has 64k registers; a program of 4 warps at R registers takes 128 R, so
floor(65536 / (128 R)) programs fit an SM, and 512 programs (256 rows x 2 KV heads) need 4.

Needs Triton (3.6 as on the device machine) and a `ptxas` (the nvidia-cuda-nvcc-cu12 wheel):

    python bench/experiments/attention_registers.py /path/to/ptxas
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.rollout.builtin.attention_kernels import _decode_attention_kernel  # noqa: E402

ARGS = [("q_ptr", "*bf16"), ("kc_ptr", "*bf16"), ("vc_ptr", "*bf16"), ("bt_ptr", "*i32"), ("pos_ptr", "*i32"),
        ("out_ptr", "*bf16"), ("acc_ptr", "*fp32"), ("ml_ptr", "*fp32"), ("count_ptr", "*i32"), ("stride_bt", "i32"),
        ("scale", "fp32"), ("k_ptr", "*bf16"), ("v_ptr", "*bf16"), ("qn_ptr", "*bf16"), ("kn_ptr", "*bf16"),
        ("table_ptr", "*fp32"), ("stride_q", "i32"), ("stride_k", "i32"), ("stride_v", "i32"), ("eps", "fp32")]
CONSTS = ["NUM_HEADS", "NUM_KV_HEADS", "GROUP", "GROUP_PAD", "HEAD_DIM", "DIM_PAD", "BLOCK_SIZE", "BLOCK_N",
          "NUM_SPLITS", "IEEE", "ROPE", "QK_NORM", "PRELOAD"]
# (shape, query heads, head dim, tokens a tile, tiles before the wait)
VARIANTS = [("0.5b", 14, 64, 64, 1), ("0.5b", 14, 64, 64, 2), ("1.5b", 12, 128, 64, 1), ("1.5b", 12, 128, 64, 2),
            ("1.5b", 12, 128, 32, 1), ("1.5b", 12, 128, 32, 2)]


def main() -> None:
    ptxas = sys.argv[1] if len(sys.argv) > 1 else "ptxas"
    signature = dict(ARGS) | dict.fromkeys(CONSTS, "constexpr")
    # Pointers and strides divisible by 16, as Triton specialises them at launch (without it
    # the loads are not vectorised and the counts are far from the device's).
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(ARGS)
             if kind.startswith("*") or name.startswith("stride")}
    for shape, heads, dim, block_n, preload in VARIANTS:
        consts = dict(NUM_HEADS=heads, NUM_KV_HEADS=2, GROUP=heads // 2, GROUP_PAD=16, HEAD_DIM=dim, DIM_PAD=dim,
                      BLOCK_SIZE=16, BLOCK_N=block_n, NUM_SPLITS=1, IEEE=False, ROPE=True, QK_NORM=False,
                      PRELOAD=preload)
        source = triton.compiler.ASTSource(fn=_decode_attention_kernel, signature=signature, constexprs=consts,
                                           attrs=attrs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(kernel.asm["ptx"])
            ptx.flush()
            report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", "/dev/null"], capture_output=True,
                                    text=True, check=True).stderr
        regs = int(report.split("Used ")[1].split(" registers")[0])
        spills = report.split("bytes stack frame, ")[1].split(" bytes spill stores")[0]
        print(f"{shape} tile {block_n:2d} x {dim:3d}, {preload} before the wait: {regs:3d} registers, {spills} bytes "
              f"spilled, {kernel.metadata.shared} B shared, {65536 // (128 * regs)} programs an SM", flush=True)


if __name__ == "__main__":
    main()
