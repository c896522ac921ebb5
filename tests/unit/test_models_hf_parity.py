"""DecoderLM against transformers: same logits from the same checkpoint, in both directions."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from services.models import ModelConfig, load_hf_dir, save_hf_dir  # noqa: E402

torch.set_num_threads(1)

CASES = [
    (arch, tied)
    for arch in ("llama", "qwen2", "qwen3")
    for tied in (False, True)
]


def _hf_model(arch: str, tied: bool):
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        # attention_bias exercises the llama o_proj bias too; rope_theta a non-default base.
        config = transformers.LlamaConfig(**common, attention_bias=True, rope_theta=500000.0)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    else:
        # head_dim != hidden / heads, as in real Qwen3 checkpoints.
        config = transformers.Qwen3Config(**common, head_dim=32)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; perturb so they are tested
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _padded_batch(side: str = "left"):
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 97, (3, 9), generator=gen)  # [B, T]
    attention_mask = torch.ones(3, 9, dtype=torch.long)
    attention_mask[1, :4] = 0
    attention_mask[2, :1] = 0
    if side == "right":
        attention_mask = attention_mask.flip(1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def _hf_logits(model, input_ids, attention_mask, position_ids):
    with torch.no_grad():
        return model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).logits


def _max_err_on_real_tokens(a, b, attention_mask):
    return ((a - b).abs() * attention_mask[..., None]).max().item()


@pytest.mark.parametrize("arch,tied", CASES)
def test_load_hf_checkpoint_matches_transformers(tmp_path, arch, tied):
    hf = _hf_model(arch, tied)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config, model = load_hf_dir(tmp_path)
    assert config.architecture == arch and config.tie_word_embeddings == tied
    assert sorted(model.state_dict()) == sorted(
        k for k in hf.state_dict() if not (tied and k == "lm_head.weight")
    )
    input_ids, mask, positions = _padded_batch()
    expected = _hf_logits(hf, input_ids, mask, positions)
    with torch.no_grad():
        got = model(input_ids, mask)  # default positions: cumulative real-token count - 1
    assert got.shape == (3, 9, 97)
    assert expected.abs().max() > 0.1  # not a trivially zero comparison
    assert _max_err_on_real_tokens(got, expected, mask) < 1e-5


@pytest.mark.parametrize("side", ["right", "none"])
def test_right_padding_and_no_padding_match_transformers(tmp_path, side):
    # These take the plain-causal SDPA path (no explicit mask).
    hf = _hf_model("qwen3", False)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _, model = load_hf_dir(tmp_path)
    input_ids, mask, positions = _padded_batch("right")
    if side == "none":
        mask = torch.ones_like(mask)
        positions = torch.arange(9).expand(3, 9)
    with torch.no_grad():
        got = model(input_ids, mask)
        unmasked = model(input_ids)
    assert _max_err_on_real_tokens(got, _hf_logits(hf, input_ids, mask, positions), mask) < 1e-5
    assert _max_err_on_real_tokens(got, unmasked, mask) < 1e-5  # right padding changes nothing


@pytest.mark.parametrize("arch,tied", CASES)
def test_save_hf_dir_loads_in_transformers(tmp_path, arch, tied):
    hf = _hf_model(arch, tied)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    config, model = load_hf_dir(tmp_path / "hf")
    save_hf_dir(model, config, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(reloaded) is type(hf)
    input_ids, mask, positions = _padded_batch()
    with torch.no_grad():
        ours = model(input_ids, mask)
    assert _max_err_on_real_tokens(_hf_logits(reloaded, input_ids, mask, positions), ours, mask) < 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_round_trips_through_transformers_autoconfig(tmp_path, arch):
    import json

    config = ModelConfig(
        architecture=arch,
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        rms_norm_eps=1e-5,
        rope_theta=123456.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf_config.model_type == arch
    assert hf_config.head_dim == 24 and hf_config.num_key_value_heads == 1
    assert hf_config.tie_word_embeddings is True
    assert ModelConfig.from_hf_dict(hf_config.to_dict()) == config
