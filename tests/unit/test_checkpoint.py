"""ModelConfig parsing and Hugging Face checkpoint directories: round trips and clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.models import DecoderLM, ModelConfig, init_weights, load_hf_dir, save_hf_dir

torch.set_num_threads(1)


def _config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="qwen2",
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return ModelConfig(**{**fields, **overrides})


def _model(config: ModelConfig, seed: int = 0) -> DecoderLM:
    model = DecoderLM(config)
    init_weights(model, seed)
    return model


def _assert_same_state(a: DecoderLM, b: DecoderLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


# --- config ----------------------------------------------------------------------------------


def test_config_defaults_follow_architecture():
    assert _config(architecture="qwen2").attention_bias is True
    assert _config(architecture="qwen3").qk_norm is True
    llama = _config(architecture="llama")
    assert llama.attention_bias is False and llama.qk_norm is False


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_hf_dict_round_trip(arch):
    config = _config(architecture=arch, tie_word_embeddings=True, eos_token_id=3, rope_theta=1e6)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_config_reads_legacy_and_new_rope_layouts():
    base = _config().to_hf_dict()
    legacy = {k: v for k, v in base.items() if k not in ("rope_parameters", "dtype")}
    legacy["rope_theta"] = 5000.0
    assert ModelConfig.from_hf_dict(legacy).rope_theta == 5000.0
    new = {k: v for k, v in base.items() if k not in ("rope_theta", "torch_dtype")}
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": 7000.0}
    assert ModelConfig.from_hf_dict(new).rope_theta == 7000.0


def test_config_hf_defaults_when_keys_absent():
    d = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 16, "intermediate_size": 8,
         "num_hidden_layers": 1, "num_attention_heads": 2, "eos_token_id": [5, 6]}
    config = ModelConfig.from_hf_dict(d)
    assert config.head_dim == 128  # Qwen3Config's default
    assert config.num_key_value_heads == 2
    assert config.eos_token_id == 5


def test_config_errors_name_the_field():
    d = _config().to_hf_dict()
    with pytest.raises(ValueError, match="model_type.*'mistral'"):
        ModelConfig.from_hf_dict({**d, "model_type": "mistral"})
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="rope_scaling.*llama3"):
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf_dict({**d, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        _config(num_key_value_heads=3)
    with pytest.raises(ValueError, match="architecture"):
        _config(architecture="gpt2")
    with pytest.raises(ValueError, match="qk_norm"):
        _config(architecture="llama", qk_norm=True)


# --- checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_single_file_round_trip(tmp_path, tied):
    config = _config(tie_word_embeddings=tied)
    model = _model(config)
    save_hf_dir(model, config, tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert ("lm_head.weight" in load_file(tmp_path / "model.safetensors")) is not tied
    loaded_config, loaded = load_hf_dir(tmp_path)
    assert loaded_config == config
    _assert_same_state(model, loaded)
    assert all(p.requires_grad for p in loaded.parameters())
    if tied:
        assert [n for n, _ in loaded.named_parameters() if "embed" in n or "lm_head" in n] == [
            "model.embed_tokens.weight"
        ]


def test_sharded_round_trip(tmp_path):
    config = _config()
    model = _model(config)
    save_hf_dir(model, config, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(model.state_dict())
    _, loaded = load_hf_dir(tmp_path)
    _assert_same_state(model, loaded)

    # A later unsharded save must not leave the stale shards around.
    save_hf_dir(model, config, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_load_converts_dtype(tmp_path):
    config = _config()
    model = _model(config)
    save_hf_dir(model, config, tmp_path)
    _, bf16 = load_hf_dir(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    save_hf_dir(bf16, config, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded_config, again = load_hf_dir(tmp_path / "bf16")  # dtype=None: the config's dtype
    assert {p.dtype for p in again.parameters()} == {torch.bfloat16}


def test_tied_config_ignores_checkpoint_lm_head(tmp_path):
    untied = _config()
    save_hf_dir(_model(untied), untied, tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tie_word_embeddings": True}))
    config, model = load_hf_dir(tmp_path)
    assert config.tie_word_embeddings and "lm_head.weight" not in model.state_dict()


def _rewrite_weights(tmp_path, edit) -> None:
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path)
    config = _config()
    save_hf_dir(_model(config), config, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_dir(tmp_path)


def test_missing_shard_is_named(tmp_path):
    config = _config()
    save_hf_dir(_model(config), config, tmp_path, max_shard_bytes=20_000)
    shard = sorted(tmp_path.glob("model-00002-of-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_hf_dir(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    config = _config()
    save_hf_dir(_model(config), config, tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf_dir(tmp_path)


def test_untied_checkpoint_without_lm_head_is_an_error(tmp_path):
    config = _config(tie_word_embeddings=True)
    save_hf_dir(_model(config), config, tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        load_hf_dir(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    config = _config()
    save_hf_dir(_model(config), config, tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"model\.safetensors.*unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_hf_dir(tmp_path)


def test_misshaped_tensor_is_named(tmp_path):
    config = _config()
    save_hf_dir(_model(config), config, tmp_path)
    _rewrite_weights(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(ValueError, match=r"model\.safetensors.*'model\.norm\.weight'.*\[31\].*\[32\]"):
        load_hf_dir(tmp_path)


def test_bad_max_shard_bytes(tmp_path):
    config = _config()
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_hf_dir(_model(config), config, tmp_path, max_shard_bytes=0)


def test_init_weights_is_seeded():
    config = _config()
    a, b, c = _model(config, seed=1), _model(config, seed=1), _model(config, seed=2)
    _assert_same_state(a, b)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert torch.all(a.model.norm.weight == 1)
    assert torch.all(a.model.layers[0].self_attn.q_proj.bias == 0)
    std = a.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025


def test_a_process_loads_a_checkpoint_without_importing_sympy(tiny_model_dir):
    """Loading goes through a meta-device model; a `normal_` there once imported sympy (and
    dynamo's symbolic shapes), 1.4-1.9 s of every engine's and trainer's first Configure."""
    import subprocess
    import sys

    code = ("import sys; from services.models import load_hf_dir; "
            f"load_hf_dir({str(tiny_model_dir)!r}); print('sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
