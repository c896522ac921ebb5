"""Model code shared by trainer and rollout: the Llama / Qwen2 / Qwen3 decoder, its config,
Hugging Face checkpoint I/O and the tokenizer wrapper. Parameter names, `config.json` and
`tokenizer.json` all follow Hugging Face conventions, so checkpoints move between rlfleet and the
Hugging Face ecosystem without conversion."""

from services.models.checkpoint import load_config, load_hf_dir, save_hf_dir
from services.models.config import ModelConfig
from services.models.decoder import DecoderLM, KVCache, init_weights
from services.models.tokenizer import Tokenizer, load_tokenizer, make_char_tokenizer

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
