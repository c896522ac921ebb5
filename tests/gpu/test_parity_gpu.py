"""The built-in engine on a GPU against transformers (the CPU version is
`tests/unit/test_engine_parity.py`; the whole matrix is `bench/parity.py`): the Triton kernels,
CUDA graphs on and off, at head dims that are and are not powers of two, and the decode
attention kernel fed the strided query view that `qk_rope_cache` returns."""

from __future__ import annotations

import pytest
import torch

from bench import parity
from services.rollout.builtin.ops import TorchOps, rope_table

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _float32_is_float32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("head_dim", [48, 64, 80, 96, 112, 256])
@pytest.mark.parametrize("graphs", [True, False])
def test_engine_tokens_equal_transformers(tmp_path, head_dim, graphs):
    arch = {48: "llama", 64: "qwen2", 80: "qwen3", 96: "llama", 112: "qwen2", 256: "qwen3"}[head_dim]
    device = torch.device("cuda")
    hf = parity.hf_model(arch, head_dim % 64 == 0, head_dim)
    hf.save_pretrained(tmp_path / "fp32")
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval().to(device)
    hf16 = hf.to(torch.bfloat16)
    hf16.save_pretrained(tmp_path / "bf16")
    hf16 = hf16.to(device)
    for batch in (8, 64):
        case = parity.run_case(parity.Case(arch, head_dim % 64 == 0, head_dim, batch, graphs), hf32, hf16,
                               tmp_path / "fp32", tmp_path / "bf16", device, tie=1e-4, seed=0)
        assert case.wrong == 0, case.first_wrong
        assert case.equal >= batch - 1
        assert case.bf16_error <= 1.5 * case.hf_bf16_error + 0.01, (case.bf16_error, case.hf_bf16_error)


@pytest.mark.parametrize("head_dim", [48, 80, 96, 112, 128, 256])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_attention_reads_each_rows_own_query(head_dim, dtype, tolerance):
    """q as `qk_rope_cache` returns it: [b, H, D] rows (H + Hkv) D apart, the keys between them."""
    from services.rollout.builtin.kernels import TritonOps

    ref, tri = TorchOps(), TritonOps()
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    heads, kv_heads, block, batch = 8, 2, 16, 6

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    qk = rnd(batch, heads + kv_heads, head_dim)
    q = qk[:, :heads]
    assert not q.is_contiguous()
    k_cache, v_cache = rnd(64 * block, kv_heads, head_dim), rnd(64 * block, kv_heads, head_dim)
    tables = torch.randperm(63, device="cuda")[:6 * 8].view(6, 8).int() + 1
    lengths = torch.tensor([1, 15, 16, 17, 40, 100], device="cuda", dtype=torch.int32)
    expected = ref.decode_attention(q.contiguous(), k_cache, v_cache, tables, lengths, block, 1)
    for splits in (1, 4):
        got = tri.decode_attention(q, k_cache, v_cache, tables, lengths, block, splits)
        rel = float((got.float() - expected.float()).norm() / expected.float().norm())
        assert rel < tolerance, (splits, rel)
    # And the whole decode step's attention, which takes the two-kernel path at these head dims.
    table = rope_table(head_dim, 1e6, 4096, torch.device("cuda"))
    qkv = rnd(batch, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    caches = [c.clone() for c in (k_cache, v_cache) for _ in range(2)]
    want = ref.rope_decode_attention(q, k, v, None, None, 1e-6, table, lengths - 1, caches[0], caches[2], tables,
                                     block, 1)
    got = tri.rope_decode_attention(q, k, v, None, None, 1e-6, table, lengths - 1, caches[1], caches[3], tables,
                                    block, 1)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < tolerance
