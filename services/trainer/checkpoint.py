"""Trainer checkpoints: a Hugging Face folder plus the training state, with no pickle anywhere.

A checkpoint is what `load_hf_dir` and every engine can read directly (config.json, safetensors,
tokenizer files), plus `optimizer.safetensors` (Adam moments, one tensor per parameter and key)
and `trainer_state.json` (step, weights version, scheduler position, optimizer hyper-parameters).
The state file is written last, so a folder without it is an incomplete save. An eval-only
trainer never opens the optimizer file: a missing or corrupt one does not stop an evaluation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.models import DecoderLM, ModelConfig
from services.models.checkpoint import TRAINER_STATE_FILE, save_hf_dir
from services.trainer.host_store import ACTOR

OPTIMIZER_FILE = "optimizer.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
FORMAT = "rlfleet-torch-v1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked (missing or corrupt files, mismatched shapes)."""


def save(trainer, path: str, *, include_optimizer: bool) -> Path:
    """A whole checkpoint of a trainer whose rank holds the whole model (the torch backend)."""
    directory = Path(path)
    trainer.use(ACTOR)
    begin(directory)
    write_weights(trainer.model, trainer.model_config, directory, trainer.settings.model_path)
    extra = save_optimizer(trainer, directory / OPTIMIZER_FILE) if include_optimizer else None
    finish(trainer, directory, extra)
    return directory


def begin(directory: Path) -> None:
    """Mark `directory` incomplete until `finish` writes the state file again."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / TRAINER_STATE_FILE).unlink(missing_ok=True)


def write_weights(model: DecoderLM, config: ModelConfig, directory: Path, source: str) -> None:
    """The Hugging Face folder: config, safetensors and the tokenizer files of the source model."""
    save_hf_dir(model, config, directory)
    source_dir = Path(source)
    for name in TOKENIZER_FILES:
        if (source_dir / name).exists() and source_dir.resolve() != directory.resolve():
            shutil.copyfile(source_dir / name, directory / name)


def save_optimizer(trainer, file: Path) -> dict | None:
    """Adam's moments of this rank's parameters to `file`; the state entries `finish` records
    (None in eval-only, which has no optimizer)."""
    if trainer.optimizer is None:
        return None
    opt_state = trainer.optimizer.state_dict()
    tensors = {
        f"state.{index}.{key}": value.detach().cpu().contiguous()
        for index, entries in opt_state["state"].items()
        for key, value in entries.items()
        if isinstance(value, torch.Tensor)
    }
    save_file(tensors, str(file), metadata={"format": FORMAT})
    return {"param_groups": opt_state["param_groups"], "scheduler_last_epoch": trainer.schedule_position}


def finish(trainer, directory: Path, optimizer: dict | None, **extra) -> None:
    """Write the state file last: a folder without it is an incomplete save."""
    state = {"format": FORMAT, "step": trainer.step, "weights_version": trainer.weights_version,
             "optimizer": optimizer is not None, **(optimizer or {}), **extra}
    tmp = directory / (TRAINER_STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(directory / TRAINER_STATE_FILE)


def read_state(path: str) -> dict:
    state_file = Path(path) / TRAINER_STATE_FILE
    if not state_file.exists():
        return {"step": 0, "weights_version": 0, "optimizer": False}
    try:
        return json.loads(state_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{state_file}: corrupt trainer state ({e})") from e


def load_optimizer(trainer, path: str, file_name: str = OPTIMIZER_FILE) -> None:
    """Load Adam's state saved by `save`; errors name the file and what is wrong with it."""
    file = Path(path) / file_name
    if not file.exists():
        raise CheckpointError(f"optimizer state: {file} not found (saved without include_optimizer?)")
    state = read_state(path)
    template = trainer.optimizer.state_dict()
    try:
        with safe_open(str(file), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        raise CheckpointError(f"optimizer state: {file} is corrupt ({e})") from e
    entries: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        entries.setdefault(int(index), {})[name] = value
    params = [p for group in template["param_groups"] for p in group["params"]]
    for index, entry in entries.items():
        if index not in params:
            raise CheckpointError(f"optimizer state: {file} has state for parameter {index}, the model has {len(params)}")
        expected = trainer.optimizer_params()[index]
        for name in ("exp_avg", "exp_avg_sq"):
            if name in entry and entry[name].shape != expected.shape:
                raise CheckpointError(
                    f"optimizer state: {name} of parameter {index} is {list(entry[name].shape)}, "
                    f"the parameter is {list(expected.shape)}"
                )
    trainer.optimizer.load_state_dict({"state": entries, "param_groups": state.get("param_groups", template["param_groups"])})
    if "scheduler_last_epoch" in state:
        trainer.schedule_position = state["scheduler_last_epoch"]
