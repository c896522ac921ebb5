"""The generators against plain full-sequence forwards: the paged engine (`services.rollout.builtin`,
what the rollout service runs) and the eager reference (`torch_engine`), each test on both."""

from __future__ import annotations

import math

import pytest
import torch

from services.models import DecoderLM, KVCache, ModelConfig, Tokenizer, init_weights, make_char_tokenizer
from services.rollout import torch_engine
from services.rollout.builtin.core import CoreSettings, GenerationCore
from services.rollout.types import Sampling

torch.set_num_threads(1)

TOKENIZER = make_char_tokenizer("abcdefghijklmnopqrstuvwxyz \n")


def _model(arch: str = "qwen3", *, tied: bool = False, dtype=torch.float64, seed: int = 0,
           head_dim: int = 8) -> DecoderLM:
    # float64 keeps greedy comparisons free of near-tie flips between batched and unbatched math.
    config = ModelConfig(
        architecture=arch,
        vocab_size=TOKENIZER.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = DecoderLM(config).to(dtype)
    init_weights(model, seed)
    with torch.no_grad():  # sharpen the random model so greedy / sampled text has structure
        model.model.embed_tokens.weight.mul_(20)
    return model.eval()


def _prompts() -> list[list[int]]:
    return [TOKENIZER.encode(t) for t in ("abc", "hello world", "j", "k lm\nno")]


def _full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double()  # [T, V]


def _greedy_reference(model, prompt: list[int], max_new: int, stop_ids=()) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new):
        ids.append(int(_full_logits(model, ids)[-1].argmax()))
        if ids[-1] in stop_ids:
            break
    return ids[len(prompt) :]


# --- KV cache --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_cached_decode_equals_full_forward(arch, tied):
    model = _model(arch, tied=tied, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    batch, prompt_len, num_new = 3, 6, 5
    full_ids = torch.randint(3, TOKENIZER.vocab_size, (batch, prompt_len + num_new), generator=gen)
    mask = torch.ones_like(full_ids)  # [B, P + N]
    mask[1, :3] = 0  # left padding
    mask[2, :5] = 0
    with torch.no_grad():
        expected = model(full_ids, mask)  # [B, P + N, V]
        cache = KVCache.for_model(model, batch_size=batch, max_len=prompt_len + num_new)
        steps = [model(full_ids[:, :prompt_len], mask[:, :prompt_len], kv_cache=cache)]
        # one two-token chunk, then single tokens
        steps.append(model(full_ids[:, prompt_len : prompt_len + 2], kv_cache=cache))
        for t in range(prompt_len + 2, prompt_len + num_new):
            steps.append(model(full_ids[:, t : t + 1], kv_cache=cache))
    got = torch.cat(steps, dim=1)
    assert cache.pos == prompt_len + num_new
    real = mask.bool()
    assert torch.allclose(got[real], expected[real], atol=1e-5)


def test_cache_overflow_is_an_error():
    model = _model()
    cache = KVCache.for_model(model, batch_size=1, max_len=3)
    with pytest.raises(ValueError, match="kv_cache"):
        model(torch.tensor([[3, 4, 5, 6]]), kv_cache=cache)


# --- generation ------------------------------------------------------------------------------


def paged_generate(model, tokenizer, prompts, sampling, *, max_batch_size: int = 256, device="cpu", check_every=0):
    settings = CoreSettings(max_batch_size=max_batch_size, check_every=check_every)
    return GenerationCore(model, tokenizer, torch.device(device), settings).generate(prompts, sampling)


def paged_every_8(model, tokenizer, prompts, sampling, **kwargs):
    """The host looks at the rows every 8 steps, as on a GPU: rows finish between looks."""
    return paged_generate(model, tokenizer, prompts, sampling, check_every=8, **kwargs)


@pytest.fixture(params=["paged", "paged-every-8", "eager"])
def generate(request):
    return {"paged": paged_generate, "paged-every-8": paged_every_8, "eager": torch_engine.generate}[request.param]


def test_greedy_equals_uncached_argmax_loop(generate):
    model = _model()
    prompts = _prompts()
    results = generate(model, TOKENIZER, prompts, Sampling(temperature=0, max_new_tokens=12, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        expected = _greedy_reference(model, prompt, 12)
        assert result.output_ids == expected
        assert result.finish_reason == "length"
        assert result.text == TOKENIZER.decode(expected)


def test_rows_finishing_early_leave_others_unchanged(generate, monkeypatch):
    # Stop ids end rows at different steps: the eager loop drops rows from its cache mid-batch,
    # the paged engine gives their slots to waiting prompts (max_batch_size 5 < 12 rows).
    compactions = []
    select_rows = KVCache.select_rows
    monkeypatch.setattr(KVCache, "select_rows", lambda self, rows: (compactions.append(len(rows)), select_rows(self, rows)))
    if generate is not torch_engine.generate:
        from services.rollout.builtin.runner import ModelRunner
        keep = ModelRunner.keep
        monkeypatch.setattr(ModelRunner, "keep", lambda self, slots: (compactions.append(len(slots)), keep(self, slots)))
    model = _model()
    prompts = _prompts() * 3
    free = generate(model, TOKENIZER, prompts, Sampling(temperature=0, max_new_tokens=15, ignore_eos=True))
    stop_ids = tuple({r.output_ids[2] for r in free[:4]})
    results = generate(
        model, TOKENIZER, prompts,
        Sampling(temperature=0, max_new_tokens=15, stop_token_ids=stop_ids, ignore_eos=True),
        max_batch_size=5,
    )
    for prompt, result in zip(prompts, results):
        assert result.output_ids == _greedy_reference(model, prompt, 15, stop_ids)
        assert result.finish_reason == ("stop" if result.output_ids[-1] in stop_ids else "length")
    assert any(r.finish_reason == "stop" for r in results)
    assert len({len(r.output_ids) for r in results}) > 1
    assert compactions  # the compaction path ran


def test_seeded_sampling_is_reproducible(generate):
    model = _model()
    sampling = Sampling(temperature=1.0, top_p=0.95, top_k=8, max_new_tokens=10, n=4, seed=7, ignore_eos=True)
    a = generate(model, TOKENIZER, _prompts(), sampling)
    b = generate(model, TOKENIZER, _prompts(), sampling)
    c = generate(model, TOKENIZER, _prompts(), Sampling(**{**sampling.__dict__, "seed": 8}))
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.output_ids for r in a] != [r.output_ids for r in c]
    assert len({tuple(r.output_ids) for r in a}) > len(_prompts())  # the n samples differ


def test_top_k_1_and_tiny_top_p_are_greedy(generate):
    model = _model()
    greedy = generate(model, TOKENIZER, _prompts(), Sampling(temperature=0, max_new_tokens=8, ignore_eos=True))
    for sampling in (
        Sampling(temperature=1.5, top_k=1, max_new_tokens=8, seed=0, ignore_eos=True),
        Sampling(temperature=1.5, top_p=1e-6, max_new_tokens=8, seed=0, ignore_eos=True),
    ):
        sampled = generate(model, TOKENIZER, _prompts(), sampling)
        assert [r.output_ids for r in sampled] == [r.output_ids for r in greedy]


def test_n_samples_are_prompt_major(generate):
    model = _model()
    prompts = _prompts()
    results = generate(model, TOKENIZER, prompts, Sampling(max_new_tokens=3, n=3, seed=0), max_batch_size=5)
    assert len(results) == 3 * len(prompts)
    for i, prompt in enumerate(prompts):
        for j in range(3):
            assert results[i * 3 + j].prompt_index == i
            assert results[i * 3 + j].prompt_ids == prompt


@pytest.mark.parametrize("n", [1, 3])
def test_every_result_owns_its_lists(generate, n):
    """A caller may edit what it gets back: no result shares a list with the prompts passed in
    or with another result (the n samples of a prompt included)."""
    model = _model()
    prompts = _prompts()
    sent = [list(p) for p in prompts]
    results = generate(model, TOKENIZER, prompts, Sampling(max_new_tokens=4, n=n, seed=0, ignore_eos=True))
    lengths = [(len(r.prompt_ids), len(r.output_ids), len(r.logprobs)) for r in results]
    for result in results:
        result.prompt_ids.append(0)
        result.output_ids.append(0)
        result.logprobs.append(0.0)
    assert prompts == sent
    assert [(len(r.prompt_ids), len(r.output_ids), len(r.logprobs)) for r in results] == [
        (p + 1, o + 1, lp + 1) for p, o, lp in lengths]


def test_logprobs_are_raw_log_softmax_of_a_full_forward(generate):
    model = _model(dtype=torch.float32)
    sampling = Sampling(temperature=0.7, top_k=6, top_p=0.9, max_new_tokens=10, n=2, seed=3, ignore_eos=True)
    for result in generate(model, TOKENIZER, _prompts(), sampling):
        ids = result.prompt_ids + result.output_ids
        logprobs = torch.log_softmax(_full_logits(model, ids), dim=-1)  # [T, V]
        start = len(result.prompt_ids)
        expected = [logprobs[start - 1 + k, tok].item() for k, tok in enumerate(result.output_ids)]
        assert result.logprobs == pytest.approx(expected, abs=1e-4)
        assert all(lp <= 0 for lp in result.logprobs)


def test_stop_token_and_eos_and_length(generate):
    model = _model()
    prompt = [TOKENIZER.encode("hello world")]
    free = generate(model, TOKENIZER, prompt, Sampling(temperature=0, max_new_tokens=10, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 10
    target = free.output_ids[4]
    first = free.output_ids.index(target)

    by_id = generate(model, TOKENIZER, prompt, Sampling(temperature=0, max_new_tokens=10, stop_token_ids=(target,)))[0]
    assert by_id.finish_reason == "stop"
    assert by_id.output_ids == free.output_ids[: first + 1]  # the stop token is kept
    assert len(by_id.logprobs) == len(by_id.output_ids)

    eos_tokenizer = Tokenizer(TOKENIZER.inner, eos_token=TOKENIZER.inner.id_to_token(target), pad_token="<pad>")
    by_eos = generate(model, eos_tokenizer, prompt, Sampling(temperature=0, max_new_tokens=10))[0]
    assert (by_eos.output_ids, by_eos.finish_reason) == (by_id.output_ids, "stop")
    ignored = generate(model, eos_tokenizer, prompt, Sampling(temperature=0, max_new_tokens=10, ignore_eos=True))[0]
    assert (ignored.output_ids, ignored.finish_reason) == (free.output_ids, "length")


def test_stop_strings_cut_text_after_the_stop_string(generate):
    model = _model()
    prompt = [TOKENIZER.encode("abc")]
    free = generate(model, TOKENIZER, prompt, Sampling(temperature=0, max_new_tokens=12, ignore_eos=True))[0]
    stop = free.text[3:5]  # two characters spanning two tokens
    end = free.text.index(stop) + len(stop)
    results = generate(
        model, TOKENIZER, prompt,
        Sampling(temperature=0, max_new_tokens=12, stop=("not-there", stop), ignore_eos=True),
    )
    result = results[0]
    assert result.finish_reason == "stop"
    assert result.text == free.text[:end]
    assert result.output_ids == free.output_ids[:end]  # char tokenizer: one token per character


def test_eos_is_kept_in_output_ids_but_special_tokens_leave_the_text(generate):
    model = _model()
    prompt = [TOKENIZER.encode("hello world")]
    free = generate(model, TOKENIZER, prompt, Sampling(temperature=0, max_new_tokens=8, ignore_eos=True))[0]
    eos = TOKENIZER.eos_token_id
    assert eos in free.output_ids  # this seed's model emits <bos> and <eos> here
    assert free.text == TOKENIZER.decode(free.output_ids) and "<" not in free.text
    result = generate(model, TOKENIZER, prompt, Sampling(temperature=0, max_new_tokens=8))[0]
    assert result.output_ids == free.output_ids[: free.output_ids.index(eos) + 1]
    assert result.finish_reason == "stop" and result.output_ids[-1] == eos
    assert result.text == TOKENIZER.decode(result.output_ids)


@pytest.mark.parametrize(
    "field,kwargs",
    [
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": math.nan}),
        ("temperature", {"temperature": 1e-45}),
        ("temperature", {"temperature": math.inf}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("top_k", {"top_k": -1}),
        ("n", {"n": 0}),
        ("max_new_tokens", {"max_new_tokens": 0}),
        ("stop", {"stop": ("",)}),
    ],
)
def test_bad_sampling_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        Sampling(**kwargs)


def test_bad_prompts_name_the_field(generate):
    model = _model()
    with pytest.raises(ValueError, match="prompts_ids"):
        generate(model, TOKENIZER, [[3, 4], []], Sampling(max_new_tokens=4))
    with pytest.raises(ValueError, match="prompts_ids"):
        generate(model, TOKENIZER, [[3, 10_000]], Sampling(max_new_tokens=4))
    with pytest.raises(ValueError, match="prompts_ids: prompt 1 holds token ids that are not integers"):
        generate(model, TOKENIZER, [[3, 4], [5.0, 6]], Sampling(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, TOKENIZER, [[3] * 10], Sampling(max_new_tokens=55))  # 65 > 64 positions
    with pytest.raises(ValueError, match="max_batch_size"):
        generate(model, TOKENIZER, [[3]], Sampling(max_new_tokens=4), max_batch_size=0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        generate(model, TOKENIZER, [[3]], Sampling(max_new_tokens=4, stop_token_ids=(-1,)))
    assert len(generate(model, TOKENIZER, [[3] * 10], Sampling(max_new_tokens=54))[0].output_ids) <= 54
