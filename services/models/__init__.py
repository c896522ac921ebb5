"""Model code shared by trainer and rollout: the Llama / Qwen2 / Qwen3 decoder, its config,
Hugging Face checkpoint I/O and the tokenizer wrapper. Parameter names, `config.json` and
`tokenizer.json` all follow Hugging Face conventions, so checkpoints move between rlfleet and the
Hugging Face ecosystem without conversion."""

import importlib

# Exported lazily: the tokenizer alone (the coordinator's need) does not import torch.
_WHERE = {
    "load_config": "checkpoint", "load_hf_dir": "checkpoint", "save_hf_dir": "checkpoint",
    "ModelConfig": "config",
    "DecoderLM": "decoder", "KVCache": "decoder", "init_weights": "decoder",
    "Tokenizer": "tokenizer", "load_tokenizer": "tokenizer", "make_char_tokenizer": "tokenizer",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "DecoderLM",
    "KVCache",
    "ModelConfig",
    "Tokenizer",
    "init_weights",
    "load_config",
    "load_hf_dir",
    "load_tokenizer",
    "make_char_tokenizer",
    "save_hf_dir",
]
