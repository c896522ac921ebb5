"""Read and write Hugging Face checkpoint directories for `DecoderLM`.

A checkpoint directory is `config.json` plus either one `model.safetensors` or shards listed in
`model.safetensors.index.json`, i.e. what `save_pretrained` writes and `from_pretrained` reads, so
checkpoints pass freely between rlfleet and the Hugging Face ecosystem. Loading builds the model
on the meta device and adopts the loaded tensors, so no memory is spent on a throwaway random
init; every mismatch between config and tensors (missing, unexpected, misshaped) is an error that
names the file and the tensor rather than a warning. With tied embeddings `lm_head.weight` is not
written, and is ignored when a checkpoint carries it anyway.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.models.config import ModelConfig
from services.models.decoder import DecoderLM, torch_dtype

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_TIED_HEAD = "lm_head.weight"
# Old Llama checkpoints store the rotary frequencies; they are derived from the config here.
_DERIVED_SUFFIX = "rotary_emb.inv_freq"
_SAFETENSORS_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def load_config(path: str | os.PathLike) -> ModelConfig:
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no such file")
    with open(config_path) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def load_hf_dir(
    path: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[ModelConfig, DecoderLM]:
    """Load config and weights; `dtype=None` means the config's `torch_dtype`."""
    path = Path(path)
    config = load_config(path)
    target_dtype = torch_dtype(dtype if dtype is not None else config.torch_dtype)
    with torch.device("meta"):
        model = DecoderLM(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}

    state: dict[str, torch.Tensor] = {}
    for file, names in _weight_files(path).items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            in_file = set(f.keys())
            for name in names if names is not None else sorted(in_file):
                if name.endswith(_DERIVED_SUFFIX):
                    continue
                if name == _TIED_HEAD and config.tie_word_embeddings:
                    continue
                if name not in expected:
                    raise ValueError(f"{file}: unexpected tensor {name!r} for this config")
                if name in state:
                    raise ValueError(f"{file}: tensor {name!r} appears in more than one shard")
                if name not in in_file:
                    raise ValueError(f"{file}: missing tensor {name!r} listed in {INDEX_FILE}")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise ValueError(
                        f"{file}: tensor {name!r} has shape {list(shape)}, "
                        f"config expects {list(expected[name])}"
                    )
                state[name] = f.get_tensor(name).to(device=device, dtype=target_dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        source = path / (INDEX_FILE if (path / INDEX_FILE).is_file() else WEIGHTS_FILE)
        raise ValueError(
            f"{source}: missing tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    model.load_state_dict(state, strict=True, assign=True)
    return config, model


def _weight_files(path: Path) -> dict[Path, list[str] | None]:
    """Weight files to read, each with the tensor names to take from it (None: all of them)."""
    single = path / WEIGHTS_FILE
    if single.is_file():
        return {single: None}
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(f"{path}: neither {WEIGHTS_FILE} nor {INDEX_FILE} exists")
    with open(index_path) as f:
        weight_map: dict[str, str] = json.load(f).get("weight_map", {})
    files: dict[Path, list[str]] = {}
    for name, file_name in weight_map.items():
        files.setdefault(path / file_name, []).append(name)
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file}: shard listed in {index_path} does not exist")
    return dict(files)


def save_hf_dir(
    model: DecoderLM,
    config: ModelConfig,
    path: str | os.PathLike,
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """Write config.json and safetensors weights that `from_pretrained` and `load_hf_dir` read.

    Weights go to one `model.safetensors`, or to `model-0000i-of-0000n.safetensors` shards plus
    an index when they exceed `max_shard_bytes`. Weight files of an earlier save in `path` are
    removed first so that a stale single file never shadows new shards (or the reverse). The
    config's `torch_dtype` is set to the dtype the tensors are saved in.
    """
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: must be positive, got {max_shard_bytes}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        name: t.detach().to("cpu", copy=True).contiguous()  # own storage: safetensors refuses shared ones
        for name, t in model.state_dict().items()
        if not (name == _TIED_HEAD and config.tie_word_embeddings)
    }
    shards = _split_shards(state, max_shard_bytes)
    for stale in [path / WEIGHTS_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)

    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / WEIGHTS_FILE), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / file_name), metadata=metadata)
            weight_map.update({name: file_name for name in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        with open(path / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    saved_dtype = next(iter(state.values())).dtype
    hf_config = config.to_hf_dict()
    if saved_dtype in _SAFETENSORS_DTYPE_NAMES:
        hf_config["torch_dtype"] = hf_config["dtype"] = _SAFETENSORS_DTYPE_NAMES[saved_dtype]
    with open(path / CONFIG_FILE, "w") as f:
        json.dump(hf_config, f, indent=2)


def _split_shards(
    state: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    """Greedy, order-preserving split; a tensor bigger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


TRAINER_STATE_FILE = "trainer_state.json"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The training step an rlfleet checkpoint was saved at; 0 for a plain Hugging Face folder."""
    state_file = Path(path) / TRAINER_STATE_FILE
    if not state_file.exists():
        return 0
    try:
        return int(json.loads(state_file.read_text())["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{state_file}: not a valid trainer state file ({e})") from e
