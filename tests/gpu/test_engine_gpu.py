"""The paged engine on a GPU: its Triton kernels against the torch ops, greedy outputs equal to
the eager path's, seeded samples reproducible, replayed graphs that see new weights after a sync,
and a KV pool that NVML sees freed on ReleaseMemory."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.rollout import torch_engine
from services.rollout.builtin.core import CoreSettings, GenerationCore
from services.rollout.builtin.ops import TorchOps, rope_table
from services.rollout.engine import RolloutEngine, RolloutSettings
from services.rollout.receiver import Staging
from services.rollout.types import Sampling
from tests.conftest import make_tiny_model
from tests.gpu.test_lifecycle_gpu import _nvml_used_by_me
from tests.unit.test_rollout_updates import _serves, _trainer_weights, _update
from tests.unit.test_torch_engine import TOKENIZER, _model, _prompts

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _free_device_memory():
    """Engines here hold KV pools and graph pools: give them back before the next test measures."""
    yield
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_kernels_compute_what_the_torch_ops_compute(dtype, tolerance):
    from services.rollout.builtin.kernels import TritonOps

    ref, tri = TorchOps(), TritonOps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.manual_seed(0)  # positions, slots, block tables and draw keys too: the same inputs every run

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    tokens, hidden, heads, kv_heads, dim, block = 37, 896, 14, 2, 64, 16
    x, residual, weight = rnd(tokens, hidden), rnd(tokens, hidden), rnd(hidden)
    for res in (None, residual):
        (h1, r1), (h2, r2) = ref.add_rmsnorm(x, res, weight, 1e-6), tri.add_rmsnorm(x, res, weight, 1e-6)
        assert _rel(h2, h1) < tolerance and _rel(r2, r1) < tolerance
    table = rope_table(dim, 1e6, 4096, torch.device("cuda"))
    qkv = rnd(tokens, (heads + 2 * kv_heads) * dim)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    positions = torch.randint(0, 4000, (tokens,), device="cuda", dtype=torch.int32)
    slots = torch.randperm(64 * block, device="cuda")[:tokens].int()
    for norm in (None, rnd(dim)):
        caches = [torch.zeros(64 * block, kv_heads, dim, dtype=dtype, device="cuda") for _ in range(4)]
        q1, k1 = ref.qk_rope_cache(q, k, v, norm, norm, 1e-6, table, positions, slots, caches[0], caches[1])
        q2, k2 = tri.qk_rope_cache(q, k, v, norm, norm, 1e-6, table, positions, slots, caches[2], caches[3])
        assert _rel(q2, q1) < tolerance and _rel(k2, k1) < tolerance and torch.equal(caches[2][slots.long()], k2)
        assert _rel(caches[2], caches[0]) < tolerance and torch.equal(caches[3], caches[1])
    k_cache, v_cache = rnd(64 * block, kv_heads, dim), rnd(64 * block, kv_heads, dim)
    tables = torch.randperm(63, device="cuda")[:48].view(4, 12).int() + 1
    lengths = torch.tensor([1, 17, 100, 192], device="cuda", dtype=torch.int32)
    query = rnd(4, heads, dim)
    expected = ref.decode_attention(query, k_cache, v_cache, tables, lengths, block, 1)
    for splits in (1, 5, 16):
        assert _rel(tri.decode_attention(query, k_cache, v_cache, tables, lengths, block, splits), expected) < tolerance
    # The decode step's RoPE, cache store and attention in one kernel, from the product's q/k/v
    # (strided views of one tensor), against the two reference ops; the new key in the cache too.
    qkv = rnd(4, (heads + 2 * kv_heads) * dim)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    for norm, splits in itertools.product((None, rnd(dim)), (1, 5, 16)):
        caches = [c.clone() for c in (k_cache, v_cache) for _ in range(2)]
        want = ref.rope_decode_attention(q, k, v, norm, norm, 1e-6, table, lengths - 1, caches[0], caches[2], tables,
                                         block, splits)
        got = tri.rope_decode_attention(q, k, v, norm, norm, 1e-6, table, lengths - 1, caches[1], caches[3], tables,
                                        block, splits)
        assert _rel(got, want) < tolerance and _rel(caches[1], caches[0]) < tolerance
        assert torch.equal(caches[3], caches[2]) and not torch.equal(caches[1], k_cache)
    gate, up = rnd(tokens, 4864), rnd(tokens, 4864)
    assert _rel(tri.silu_mul(gate, up), ref.silu_mul(gate, up)) < tolerance
    logits = rnd(6, 151936) * 4
    keys = torch.randint(0, 2**32, (6,), device="cuda")
    steps = torch.randint(0, 1000, (6,), device="cuda", dtype=torch.int32)
    inv_temp = torch.tensor([1 / 0.8], device="cuda")
    for greedy in (True, False):
        (t1, l1), (t2, l2) = ref.sample(logits, keys, steps, inv_temp, greedy), tri.sample(logits, keys, steps, inv_temp, greedy)
        # A draw sums in float32 on the GPU and float64 in the reference: where u x total falls
        # within rounding of the boundary between two tokens, they take neighbours (rare; see
        # the 4096-row test below). The logprob is each token's own, either way.
        same = t1 == t2
        assert bool(same.all()) if greedy else int((~same).sum()) <= 1 and bool(((t1 - t2).abs() <= 1).all())
        own = torch.log_softmax(logits.float(), dim=-1).gather(1, t2[:, None]).squeeze(1)
        assert torch.allclose(l1[same], l2[same], atol=1e-4) and torch.allclose(l2, own, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 200])
def test_small_batch_products_compute_what_the_torch_ops_compute(rows):
    """The decode step's products on `_skinny_linear_kernel` (split over k and merged by the
    last program of each column block, launched ahead of the kernel before it; one row tile up
    to 16 rows, tiles of 32 or 64 rows past that): q/k/v with its bias, and the MLP's down
    product with the activation fused in. Twice in a row, as a captured graph replays them: the
    same bits both times."""
    from services.rollout.builtin.kernels import TritonOps

    ref, tri = TorchOps(), TritonOps()
    tri.skinny_max_bytes = 1 << 30  # the 8.7 MB down product too (the engine leaves it to cuBLAS)
    tri.skinny_rows = 256  # every row count here on the kernel, whatever the engine's setting
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    x, w, bias = rnd(rows, 896), rnd(1152 + 40, 896, scale=0.05), rnd(1152 + 40)
    gate_up, down = rnd(rows, 2 * 4864), rnd(896, 4864, scale=0.02)
    gate, up = gate_up.chunk(2, dim=-1)
    for _ in range(2):
        first = tri.linear(x, w, bias), tri.silu_mul_linear(gate, up, down)
        second = tri.linear(x, w, bias), tri.silu_mul_linear(gate, up, down)
        assert all(torch.equal(a, b) for a, b in zip(first, second))
        assert _rel(first[0], ref.linear(x, w, bias)) < 5e-3
        assert _rel(first[1], ref.silu_mul_linear(gate, up, down)) < 5e-3
        assert _rel(tri.linear(x, w), ref.linear(x, w)) < 5e-3

@pytest.mark.parametrize("rows", [17, 64, 129, 256])
def test_tile_products_compute_what_the_torch_ops_compute(rows):
    """The attention's products of more than 16 rows on `_tile_linear_kernel` (64 x 32 tiles,
    weight lines asked of L2 before the kernel's wait): q/k/v with its bias and o, at row counts
    that leave a partial row tile and column counts that leave a partial column tile. Twice in a
    row, as a captured graph replays them: the same bits both times."""
    from services.rollout.builtin.kernels import TritonOps

    ref, tri = TorchOps(), TritonOps()
    gen = torch.Generator(device="cuda").manual_seed(2)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    x, qkv, bias, o = rnd(rows, 896), rnd(1152 + 40, 896, scale=0.05), rnd(1152 + 40), rnd(896, 896, scale=0.05)
    assert tri._tiled(x, qkv) and tri._tiled(x, o)
    first = tri.linear(x, qkv, bias), tri.linear(x, o)
    second = tri.linear(x, qkv, bias), tri.linear(x, o)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert _rel(first[0], ref.linear(x, qkv, bias)) < 5e-3
    assert _rel(first[1], ref.linear(x, o)) < 5e-3


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("groups,length,heads,kv_heads,dim", [(3, 64, 14, 2, 64), (2, 133, 12, 2, 128),
                                                              (5, 7, 4, 4, 64)])
def test_prefill_attention_kernel_computes_what_sdpa_computes(dtype, tolerance, groups, length, heads, kv_heads, dim):
    """Causal attention of right-padded prompts on `prefill_attention.py`'s kernel, from q and k
    as the prefill's RoPE kernel leaves them and v as a strided view of the q/k/v product (the
    decoder's layout), against SDPA: query groups of 7, 6 and 1 heads, lengths that leave partial
    row and key blocks. Twice: the same bits both times."""
    from services.rollout.builtin.kernels import TritonOps

    ref, tri = TorchOps(), TritonOps()
    tri.prefill_kernel_max_len = length  # the kernel, whatever the engine's bound
    gen = torch.Generator(device="cuda").manual_seed(4)
    tokens = groups * length
    qk = torch.randn(tokens, heads + kv_heads, dim, generator=gen, device="cuda").to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen, device="cuda").to(dtype)
    q = qk[:, :heads].view(groups, length, heads, dim)
    k = qk[:, heads:].view(groups, length, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(groups, length, kv_heads, dim)
    got, again = tri.prefill_attention(q, k, v), tri.prefill_attention(q, k, v)
    assert torch.equal(got, again)
    assert _rel(got, ref.prefill_attention(q, k, v)) < tolerance
    tri.prefill_kernel_max_len = length - 1  # longer prompts: SDPA, the same numbers as the reference
    assert torch.equal(tri.prefill_attention(q, k, v), ref.prefill_attention(q, k, v))


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(14, 2, 64, 16), (12, 2, 128, 16), (4, 4, 64, 8)])
def test_extend_attention_kernel_computes_what_the_dense_way_computes(dtype, tolerance, heads, kv_heads, dim,
                                                                       block_size):
    """A prefill after a prefix-cache hit (`extend_attention`): suffixes of 3 prompts over cached
    prefixes of other lengths (none, partial key tiles, several hundred tokens), the blocks
    scattered in the pool, against torch's dense gather, for the real rows of every prompt.
    Twice: the same bits both times."""
    from services.rollout.builtin.kernels import TritonOps

    ref, tri = TorchOps(), TritonOps()
    gen = torch.Generator(device="cuda").manual_seed(6)
    blocks, width = 200, 40
    k_cache = torch.randn(blocks * block_size, kv_heads, dim, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn(blocks * block_size, kv_heads, dim, generator=gen, device="cuda").to(dtype)
    tables = torch.stack([torch.randperm(blocks - 1, generator=gen, device="cuda")[:width] + 1 for _ in range(3)])
    starts = torch.tensor([0, 13 * block_size, 20 * block_size], device="cuda")
    lengths = torch.tensor([45, 3, 61], device="cuda")
    q = torch.randn(3, 61, heads, dim, generator=gen, device="cuda").to(dtype)
    got = tri.context_attention(q, k_cache, v_cache, tables, starts, lengths, block_size)
    again = tri.context_attention(q, k_cache, v_cache, tables, starts, lengths, block_size)
    want = ref.context_attention(q, k_cache, v_cache, tables, starts, lengths, block_size)
    for g, n in enumerate(lengths.tolist()):  # (padding rows are left unwritten)
        assert torch.equal(got[g, :n], again[g, :n])
        assert _rel(got[g, :n], want[g, :n]) < tolerance, g


def test_kernel_draws_match_the_reference_and_take_neither_end_for_an_extreme_u():
    """Over 4096 rows of a 151,936-token vocabulary the kernel (float32 sums by chunks) draws what
    the torch reference (float64 running sums) draws, but where u times the total falls within
    rounding of a boundary between two tokens; at the smallest and largest u it draws neither
    a token of probability ~1e-19 at the front nor the tokens top-k dropped at the back; and its
    draws over many steps follow the softmax."""
    from services.rollout.builtin import sampling
    from services.rollout.builtin.kernels import TritonOps
    from tests.unit.test_sampling_draw import KEY_HIGHEST_U, KEY_LOWEST_U
    tri = TritonOps()
    gen = torch.Generator(device="cuda").manual_seed(3)
    logits = (torch.randn(4096, 151936, generator=gen, device="cuda") * 6).to(torch.bfloat16)
    keys = torch.randint(0, 2**32, (4096,), generator=gen, device="cuda")
    steps = torch.randint(0, 1000, (4096,), generator=gen, device="cuda", dtype=torch.int32)
    for inv_temp in (1 / 0.7, 1.0):  # at temperature 1 the kernel sums the logits once for both
        inv_temp = torch.tensor([inv_temp], device="cuda")
        expected, lp_expected = sampling.sample(logits, keys, steps, inv_temp, False)
        drawn, lp_drawn = tri.sample(logits, keys, steps, inv_temp, False)
        assert int((drawn != expected).sum()) <= 2
        same = drawn == expected
        assert torch.allclose(lp_drawn[same], lp_expected[same], atol=1e-4)
    scores = torch.zeros(2, 151936, device="cuda")
    scores[:, 0] = -40.0
    scores[:, -5:] = float("-inf")
    extreme = torch.tensor([KEY_LOWEST_U, KEY_HIGHEST_U], device="cuda")
    token, logprob = tri.sample(scores, extreme, torch.zeros(2, dtype=torch.int32, device="cuda"),
                                torch.tensor([1.0], device="cuda"), False, scores=scores)
    assert token.tolist() == [1, 151930]
    small = torch.tensor([2.0, 0.5, -1.0, 1.5, float("-inf"), 0.0], device="cuda")
    draws = 40_000
    tokens, _ = tri.sample(small.expand(draws, -1).contiguous(), torch.full((draws,), 7, device="cuda"),
                           torch.arange(draws, dtype=torch.int32, device="cuda"), torch.tensor([1.0], device="cuda"),
                           False)
    counts = torch.bincount(tokens, minlength=6).double().cpu()
    p = torch.softmax(small.cpu(), dim=-1).double()
    assert int(counts[4]) == 0
    assert bool(((counts - draws * p).abs() <= 5 * (draws * p * (1 - p)).sqrt() + 1e-9).all())


@pytest.mark.parametrize("rows", [17, 64, 256])
def test_tuned_products_give_f_linear_bits_eagerly_and_replayed(rows):
    """The decode step's cuBLAS products on the cuBLASLt algorithm `cublaslt.choose` picks (any
    gain accepted here, so that a choice is made): the MLP's gate/up and down, a product with a
    bias, and the output embedding. Each gives F.linear's bits, eagerly and replayed in a graph;
    the gate/up product (where the H200 has faster candidates) is really on one."""
    import torch.nn.functional as F

    from services.rollout.builtin.kernels import TritonOps

    tri = TritonOps()
    tri.tune_min_gain = -1.0  # take the fastest candidate with F.linear's bits, faster or not
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    products = [(rnd(rows, 896), rnd(2 * 4864, 896, scale=0.05), None),  # gate/up
                (rnd(rows, 4864), rnd(896, 4864, scale=0.02), None),  # down
                (rnd(rows, 1536), rnd(2048, 1536, scale=0.05), rnd(2048)),  # q/k/v of the 1.5B shape
                (rnd(rows, 896), rnd(32768, 896, scale=0.05), None)]  # an output embedding
    eager = rnd(rows + 1, 896)  # a shape met outside `tuning` (an eager prefill's): F.linear, not tuned
    assert torch.equal(tri.linear(eager, products[0][1]), F.linear(eager, products[0][1]))
    assert not tri._products
    with tri.tuning():  # (as at the eager run before a capture)
        for x, w, b in products:
            assert torch.equal(tri.linear(x, w, b), F.linear(x, w, b))
    assert tri._products[(x.device, x.dtype, rows, 2 * 4864, 896, 896, False)] is not None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [tri.linear(x, w, b) for x, w, b in products]
    for x, w, b in products:
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))  # new inputs, as the next step's
    graph.replay()
    for out, (x, w, b) in zip(outs, products):
        assert torch.equal(out, F.linear(x, w, b))


def test_tuned_products_leave_every_token_and_logprob_as_it_was():
    """An engine whose products are on cuBLASLt's chosen algorithms against one on F.linear's:
    the same tokens and logprobs, bit for bit, sampled at a batch where the step's products
    are tuned (27 rows: bucket 32), on a model wide enough for cuBLAS's large-product kernels."""
    from services.models import DecoderLM, ModelConfig, init_weights

    config = ModelConfig(architecture="qwen2", vocab_size=TOKENIZER.vocab_size, hidden_size=512,
                         intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=64)
    model = DecoderLM(config)
    init_weights(model, seed=0)
    model = model.to(torch.bfloat16).cuda()
    prompts = _prompts() * 3
    sampled = Sampling(temperature=0.9, max_new_tokens=24, n=3, seed=11, ignore_eos=True)
    outputs = []
    for tune in (False, True):
        core = GenerationCore(model, TOKENIZER, torch.device("cuda"), CoreSettings(max_batch_size=32))
        core.ops.tune_products = tune
        core.ops.tune_min_gain = -1.0
        outputs.append(core.generate(prompts, sampled))
        assert any(core.ops._products.values()) == tune
    assert [r.output_ids for r in outputs[0]] == [r.output_ids for r in outputs[1]]
    assert [r.logprobs for r in outputs[0]] == [r.logprobs for r in outputs[1]]


def _fp32_model(arch: str = "qwen3"):
    # heads of 32: wide enough for the decode step's RoPE to run inside the attention kernel
    return _model(arch, dtype=torch.float32, head_dim=32).cuda()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_outputs_equal_the_eager_path(arch):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _fp32_model(arch)
    prompts = _prompts() * 5
    greedy = Sampling(temperature=0, max_new_tokens=20, ignore_eos=True)
    eager = torch_engine.generate(model, TOKENIZER, prompts, greedy, device="cuda")
    core = GenerationCore(model, TOKENIZER, torch.device("cuda"), CoreSettings(max_batch_size=8))
    paged = core.generate(prompts, greedy)
    assert core.runner.use_graphs and core.runner.num_graphs > 0
    assert [r.output_ids for r in paged] == [r.output_ids for r in eager]
    assert max(abs(a - b) for p, e in zip(paged, eager) for a, b in zip(p.logprobs, e.logprobs)) < 1e-4


def test_graphs_replay_exactly_what_the_eager_runner_computes_and_seeds_reproduce():
    """Decode and prefill graphs against the same kernels launched one by one: the same tokens
    and logprobs, bit for bit."""
    model = _model(dtype=torch.bfloat16, head_dim=32).cuda()
    prompts = _prompts() * 3
    sampled = Sampling(temperature=0.9, top_p=0.95, max_new_tokens=24, n=3, seed=7, ignore_eos=True)
    graphs = GenerationCore(model, TOKENIZER, torch.device("cuda"), CoreSettings(max_batch_size=16))
    a, b = graphs.generate(prompts, sampled), graphs.generate(prompts, sampled)
    assert graphs.runner._prefill_graphs  # prefills replayed too, as two graphs: the first layer, the rest
    assert all(len(prefill.graphs) == 2 for prefill in graphs.runner._prefill_graphs.values())
    eager = GenerationCore(model, TOKENIZER, torch.device("cuda"), CoreSettings(max_batch_size=16, cuda_graphs=False))
    c = eager.generate(prompts, sampled)  # the same kernels launched one by one: the same numbers
    assert [r.output_ids for r in a] == [r.output_ids for r in b] == [r.output_ids for r in c]
    assert [r.logprobs for r in a] == [r.logprobs for r in c]
    other = graphs.generate(prompts, Sampling(**{**sampled.__dict__, "seed": 8}))
    assert [r.output_ids for r in other] != [r.output_ids for r in a]


def test_replayed_graphs_serve_the_weights_of_the_latest_sync(tiny_model_dir):
    engine = RolloutEngine(RolloutSettings(model_path=str(tiny_model_dir), device="cuda"))
    staging = Staging(engine.device)
    greedy = Sampling(temperature=0, max_new_tokens=8, ignore_eos=True)
    prompts = [[3, 4, 5], [6, 7], [8]]
    w1, w2 = (_trainer_weights(engine, seed) for seed in (1, 2))
    _update(engine, staging, w1, 1)
    first, _ = engine.generate(prompts, greedy)
    graphs = engine.core.runner.num_graphs
    addresses = [p.data_ptr() for p in engine.model.parameters()]
    _update(engine, staging, w2, 2)
    assert _serves(engine, w2) and [p.data_ptr() for p in engine.model.parameters()] == addresses  # copied in
    second, version = engine.generate(prompts, greedy)
    assert version == 2 and engine.core.runner.num_graphs == graphs  # the same graphs, replayed
    fresh = RolloutEngine(RolloutSettings(model_path=str(tiny_model_dir), device="cuda"))
    _update(fresh, Staging(fresh.device), w2, 2)
    expected, _ = fresh.generate(prompts, greedy)
    assert [r.output_ids for r in second] == [r.output_ids for r in expected]
    assert [r.logprobs for r in second] == [r.logprobs for r in expected]
    assert [r.logprobs for r in second] != [r.logprobs for r in first]  # the old weights would give these


def test_release_memory_frees_the_kv_pool_as_nvml_sees_it(tmp_path):
    # 4096 positions: the pool is 5% of the free memory (GBs), not what 256 rows of 64 need
    model_dir = make_tiny_model(tmp_path / "long", hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                                num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
    engine = RolloutEngine(RolloutSettings(model_path=str(model_dir), device="cuda", kv_cache_fraction=0.05))
    greedy = Sampling(temperature=0, max_new_tokens=8, ignore_eos=True)
    before, _ = engine.generate([[3, 4, 5]], greedy)
    torch.cuda.synchronize()
    pool = engine.core.cache.nbytes
    held = _nvml_used_by_me()
    engine.release_memory(["kv_cache"])
    freed = held - _nvml_used_by_me()
    print(f"KV pool {pool / 1e9:.2f} GB; NVML saw {freed / 1e9:.2f} GB freed")
    assert pool > 1e9 and freed >= 0.95 * pool
    with pytest.raises(Exception, match="released"):
        engine.generate([[3, 4, 5]], greedy)
    engine.resume_memory(["kv_cache"])
    after, _ = engine.generate([[3, 4, 5]], greedy)
    assert after[0].output_ids == before[0].output_ids
