"""The torch critic: a value model for PPO, served by a trainer configured with `role: critic`.

A critic is the policy's architecture with a scalar head: the decoder's final-norm hidden state
at each position goes through `value_head` (Linear(hidden, 1)), giving V(state) for the state
*before* each response token, laid over the same positions as the actor's logprobs. It has its
own optimizer and schedule and the same memory lifecycle as the actor (sleep, wake, host copy
when offloaded); it never serves weights to engines.

Checkpoints are the policy's Hugging Face folder (config.json, model.safetensors, tokenizer
files: `transformers` loads the backbone from it) plus `value_head.safetensors` beside it. A
critic configured from a folder that has that file starts from its head; from a plain policy
folder, the head starts at zero (every value 0: the first advantages are the discounted
returns themselves).

An untied model's `lm_head` is loaded with the backbone (it keeps the folder a valid policy
checkpoint) but never used or trained; it stays where it was loaded, also while asleep.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.trainer import checkpoint, losses
from services.trainer.backend import StepResult, SyncWeights, TrainerStateError
from services.trainer.batch import PackedBatch, Sample, micro_batches
from services.trainer.host_store import ACTOR
from services.trainer.ranks import DataParallel
from services.trainer.torch_backend import TorchTrainer

VALUE_HEAD_FILE = "value_head.safetensors"
HEAD_NAMES = ("value_head.weight", "value_head.bias")


class TorchCritic(TorchTrainer):
    """A value model on one trainer rank (whole model per rank; data parallel across ranks)."""

    def _build_model(self) -> DataParallel:
        dp = super()._build_model()
        config = self.model_config
        self.head = torch.nn.Linear(config.hidden_size, 1, device=self.device, dtype=self.model.output_weight.dtype)
        with torch.no_grad():
            head = read_value_head(self.settings.model_path)
            if head is None:
                self.head.weight.zero_()
                self.head.bias.zero_()
            else:
                _check_head(head, self.head, self.settings.model_path)
                self.head.weight.copy_(head["value_head.weight"])
                self.head.bias.copy_(head["value_head.bias"])
        if self.model.lm_head is not None:  # never used by a critic: no gradient, no optimizer state
            self.model.lm_head.requires_grad_(False)
        self.named.update({"value_head.weight": self.head.weight, "value_head.bias": self.head.bias})
        return dp

    def _trainable(self) -> list[torch.Tensor]:
        return [*super()._trainable(), self.head.weight, self.head.bias]

    # ---- compute -----------------------------------------------------------------------------
    def _values(self, batch: PackedBatch) -> torch.Tensor:
        """V at the T-1 "next token" positions: [B, T-1], float32."""
        hidden = self.model.hidden_states(batch.input_ids, attention_mask=batch.attention_mask)  # [B, T, H]
        return self.head(hidden[:, :-1]).squeeze(-1).float()  # [B, T-1]

    @torch.no_grad()
    def compute_values(self, samples: list[Sample]) -> list[list[float]]:
        """Per response token of every sample, the value of the state before it (each data-
        parallel rank computes its shard; every rank returns the whole batch's)."""
        self.use(ACTOR)
        self._check(samples)
        shard = self.dp.shard(len(samples))
        results: list[list[float]] = []
        for chunk in micro_batches(samples[shard], self.settings.micro_batch_size):
            batch = self._pack(chunk)
            results += batch.response_values(self._values(batch))
        return self.dp.gather_values([len(s.response_ids) for s in samples], shard, results)

    def compute_logprobs(self, tag: str, samples: list[Sample]) -> tuple[list[list[float]], float]:
        raise TrainerStateError("ComputeLogProbs: this trainer is a critic; ask the actor (a critic has ComputeValues)")

    def train_step(self, samples: list[Sample], *, sft: bool = False, value: bool = False,
                   lr: float | None = None) -> StepResult:
        if not value:
            raise TrainerStateError("TrainStep: a critic trains only with the value loss (LOSS_KIND_VALUE)")
        missing = next((i for i, s in enumerate(samples) if not s.returns), None)
        if missing is not None:
            raise ValueError(f"batch.samples[{missing}].returns: the value loss needs returns for every response token")
        return super().train_step(samples, lr=lr)

    def _micro_batch_loss(self, batch: PackedBatch, sft: bool) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.settings.loss
        values = self._values(batch)
        old = batch.old_values if batch.old_values is not None else values.detach()
        loss, metrics = losses.value_loss(values, old, batch.returns, batch.response_mask, cfg.value_clip, cfg.loss_agg)
        return loss, {"value_loss": loss.item(), "loss": loss.item(), **{k: float(v) for k, v in metrics.items()}}

    # ---- weights -----------------------------------------------------------------------------
    def weights_for_sync(self) -> SyncWeights | None:
        raise TrainerStateError("a critic's weights are never synced to rollout engines; sync from the actor")

    def _write_checkpoint(self, directory: Path, include_optimizer: bool) -> None:
        self.use(ACTOR)
        checkpoint.begin(directory)
        checkpoint.write_weights(self.model, self.model_config, directory, self.settings.model_path)
        save_file({name: self.named[name].detach().cpu().contiguous() for name in HEAD_NAMES},
                  str(directory / VALUE_HEAD_FILE), metadata={"format": checkpoint.FORMAT})
        extra = checkpoint.save_optimizer(self, directory / checkpoint.OPTIMIZER_FILE) if include_optimizer else None
        checkpoint.finish(self, directory, extra, role="critic")

    def _checkpoint_weights(self, path: str) -> dict[str, torch.Tensor]:
        head = read_value_head(path)
        if head is None:
            raise checkpoint.CheckpointError(f"checkpoint {path}: no {VALUE_HEAD_FILE}; not a critic's checkpoint")
        backbone = {name: t for name, t in self.named.items() if name not in HEAD_NAMES}
        named, self.named = self.named, backbone
        try:  # the policy part is checked as the actor checks its checkpoints
            source = super()._checkpoint_weights(path)
        finally:
            self.named = named
        _check_head(head, self.head, path)
        return {**source, **head}


def read_value_head(path: str) -> dict[str, torch.Tensor] | None:
    """The value head saved in a critic checkpoint folder; None when the folder has none."""
    file = Path(path) / VALUE_HEAD_FILE
    if not file.exists():
        return None
    try:
        with safe_open(str(file), framework="pt") as f:
            found = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated or garbled files
        raise checkpoint.CheckpointError(f"{file}: corrupt value head ({e})") from e
    missing = [name for name in HEAD_NAMES if name not in found]
    if missing:
        raise checkpoint.CheckpointError(f"{file}: tensor {missing[0]!r} is missing")
    return {name: found[name] for name in HEAD_NAMES}


def _check_head(head: dict[str, torch.Tensor], module: torch.nn.Linear, where: str) -> None:
    for name, target in (("value_head.weight", module.weight), ("value_head.bias", module.bias)):
        if tuple(head[name].shape) != tuple(target.shape):
            raise checkpoint.CheckpointError(
                f"{where}: {name} is {list(head[name].shape)}, this model's value head is {list(target.shape)}"
            )
        if not torch.isfinite(head[name]).all():
            raise checkpoint.CheckpointError(f"{where}: {name} holds non-finite values")
