"""Architecture description of the Llama / Qwen2 / Qwen3 decoder family.

`ModelConfig` is the one plain-data record every other piece of `services.models` builds from:
the decoder reads its shapes, the checkpoint code reads and writes it as a Hugging Face
`config.json`. The three architectures differ only in small switches (q/k/v bias for Qwen2,
RMSNorm on q and k for Qwen3), so one frozen dataclass covers them; `from_hf_dict` rejects the
variants this decoder does not implement (rope scaling, sliding windows, non-SiLU MLPs) instead of
loading them and silently computing something else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3")

_HF_CLASS_NAMES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Defaults the transformers config classes apply when a key is absent from config.json.
_HF_MAX_POSITIONS_DEFAULT = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}
_DTYPES = ("float32", "bfloat16", "float16")
_REQUIRED_HF_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and switches of one decoder-only causal LM.

    `attention_bias` and `qk_norm` default to what the architecture implies (Qwen2: q/k/v bias;
    Qwen3: q/k RMSNorm). For llama and qwen3 `attention_bias` also adds a bias to `o_proj`, as
    in transformers; qwen2 never biases `o_proj`.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool | None = None
    qk_norm: bool | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not one of {', '.join(ARCHITECTURES)}"
            )
        if self.attention_bias is None:
            object.__setattr__(self, "attention_bias", self.architecture == "qwen2")
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", self.architecture == "qwen3")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim: rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta: must be > 0, got {self.rope_theta}")
        if self.torch_dtype not in _DTYPES:
            raise ValueError(f"torch_dtype: {self.torch_dtype!r} is not one of {', '.join(_DTYPES)}")
        # Each architecture's transformers class hard-wires these; anything else could not be
        # loaded back by transformers, so it is a mistake rather than a variant.
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ValueError("attention_bias: qwen2 always has q/k/v biases")
        if self.qk_norm != (self.architecture == "qwen3"):
            raise ValueError(f"qk_norm: must be {self.architecture == 'qwen3'} for {self.architecture}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}: {value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def o_proj_bias(self) -> bool:
        return bool(self.attention_bias) and self.architecture != "qwen2"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        model_type = d.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"model_type: {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        for key in _REQUIRED_HF_KEYS:
            if key not in d:
                raise ValueError(f"{key}: required key missing from the {model_type} config")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {d['hidden_act']!r}")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias: biased MLP projections are not supported")
        if d.get("use_sliding_window", False):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")
        rope_theta = _read_rope_theta(d)

        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim")
        if head_dim is None:
            # Qwen3Config's default is 128, not hidden_size // num_heads.
            head_dim = 128 if model_type == "qwen3" else d["hidden_size"] // num_heads
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            # Llama-3 instruct lists several; the first is the canonical one. Generation stops
            # on the tokenizer's eos plus Sampling.stop_token_ids, not on this field.
            eos = eos[0] if eos else None
        return cls(
            architecture=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=d.get(
                "max_position_embeddings", _HF_MAX_POSITIONS_DEFAULT[model_type]
            ),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            torch_dtype=d.get("torch_dtype") or d.get("dtype") or "float32",
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` dict that transformers 4.x and 5.x both load.

        The rope base and dtype are written under both the old (`rope_theta`, `torch_dtype`) and
        the new (`rope_parameters`, `dtype`) keys; each transformers version ignores the other's.
        """
        d: dict[str, Any] = {
            "architectures": [_HF_CLASS_NAMES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
        }
        if self.architecture == "qwen2":
            d["use_sliding_window"] = False
        else:
            d["attention_bias"] = bool(self.attention_bias)
        if self.architecture == "llama":
            d["mlp_bias"] = False
        if self.architecture == "qwen3":
            d["use_sliding_window"] = False
        return d

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _read_rope_theta(d: dict[str, Any]) -> float:
    """The rope base from either layout; scaled rope variants are rejected by name."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for field, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{field}: rope_type {rope_type!r} is not supported (only 'default')")
    return float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
