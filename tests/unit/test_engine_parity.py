"""The built-in engine against transformers over the shapes real checkpoints have, on a CPU: the
small version of `bench/parity.py`'s matrix (its GPU version is `tests/gpu/test_parity_gpu.py`).
Each architecture, tied and untied, head dims that are and are not powers of two, batch 1, 8 and
64 (32 prompts of two samples sharing their prompt's blocks), prompts on both sides of a KV block
boundary: greedy float32 tokens equal transformers' `generate`, bf16 logprobs as close to
transformers' float32 ones as transformers' own bf16 are."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from bench import parity  # noqa: E402

torch.set_num_threads(2)

CASES = [
    ("llama", False, 48, 8), ("llama", True, 80, 1), ("qwen2", False, 96, 8), ("qwen2", True, 32, 64),
    ("qwen3", False, 80, 64), ("qwen3", True, 48, 8), ("llama", False, 112, 8),
]


@pytest.mark.parametrize("arch,tied,head_dim,batch", CASES)
def test_engine_tokens_equal_transformers(tmp_path, arch, tied, head_dim, batch):
    import transformers

    hf = parity.hf_model(arch, tied, head_dim)
    path32, path16 = tmp_path / "fp32", tmp_path / "bf16"
    hf.save_pretrained(path32)
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(path32, dtype=torch.float32).eval()
    hf16 = hf.to(torch.bfloat16)
    hf16.save_pretrained(path16)
    case = parity.run_case(parity.Case(arch, tied, head_dim, batch, None), hf32, hf16, path32, path16,
                           torch.device("cpu"), tie=1e-4, seed=0)
    assert case.rows == batch
    assert case.wrong == 0, case.first_wrong
    assert case.equal >= batch - 1  # at most one row may part at an exact tie
    assert case.fp32_logprob_max < 1e-3
    assert case.bf16_error <= 1.5 * case.hf_bf16_error + 0.01, (case.bf16_error, case.hf_bf16_error)


def test_a_wrong_kernel_is_caught(tmp_path, monkeypatch):
    """The matrix fails where attention reads another row's query (what batched decode did on a
    GPU for head dims that are not powers of two): the check can fail."""
    import transformers

    from services.rollout.builtin.ops import TorchOps

    real = TorchOps.decode_attention

    def shifted(self, q, *args):
        return real(self, q.roll(1, dims=0), *args)  # row i attends with row i-1's query

    monkeypatch.setattr(TorchOps, "decode_attention", shifted)
    hf = parity.hf_model("llama", False, 48)
    hf.save_pretrained(tmp_path / "fp32")
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval()
    hf16 = hf.to(torch.bfloat16)
    hf16.save_pretrained(tmp_path / "bf16")
    case = parity.run_case(parity.Case("llama", False, 48, 8, None), hf32, hf16, tmp_path / "fp32",
                           tmp_path / "bf16", torch.device("cpu"), tie=1e-4, seed=0)
    assert case.wrong >= 6 and not case.ok(1.5)
