"""The torch trainer backend: one policy model, its frozen tag copies, AdamW and an LR schedule.

It runs the same code on CPU and GPU. `compute_logprobs` and `train_step` take lists of
`Sample`s and split them into micro-batches; gradients are accumulated so that the loss equals
the loss over the whole batch whatever the micro-batch size. In eval-only mode no optimizer or
scheduler is ever built, so schedule settings that only make sense while training are not read.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch

from services.models import load_hf_dir
from services.trainer import losses
from services.trainer.batch import PackedBatch, Sample, micro_batches, pack
from services.trainer.settings import SchedulerSettings, TrainerSettings
from services.weights.buckets import parse_dtype


class TrainerStateError(RuntimeError):
    """An operation that the trainer's current state does not allow (e.g. training in eval-only)."""


def lr_lambda(settings: SchedulerSettings):
    """Multiplier of the base LR at a step: linear warm-up, then constant / linear / cosine decay."""
    warmup, decay, floor = settings.warmup_steps, settings.decay_steps, settings.min_lr_ratio
    if settings.kind != "constant" and decay <= warmup:
        raise ValueError(
            f"scheduler.decay_steps ({decay}) must be larger than scheduler.warmup_steps ({warmup}) "
            f"for a {settings.kind} schedule"
        )

    def multiplier(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if settings.kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / (decay - warmup))
        if settings.kind == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


@dataclass(frozen=True)
class StepResult:
    metrics: dict[str, float]
    weights_version: int
    step: int


class TorchTrainer:
    def __init__(self, settings: TrainerSettings):
        self.settings = settings
        self.device = torch.device(settings.device)
        torch.manual_seed(settings.seed)
        self.model_config, self.model = load_hf_dir(
            settings.model_path, dtype=parse_dtype(settings.dtype), device=self.device
        )
        self.pad_id = self.model_config.pad_token_id or 0
        self.copies: dict[str, torch.nn.Module] = {
            tag: self._frozen_copy() for tag in dict.fromkeys(settings.tags)
        }
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if not settings.eval_only:
            opt = settings.optimizer
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=opt.lr,
                betas=(opt.beta1, opt.beta2),
                eps=opt.eps,
                weight_decay=opt.weight_decay,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(settings.scheduler))
        self.step = 0
        self.weights_version = 0

    def _frozen_copy(self) -> torch.nn.Module:
        clone = copy.deepcopy(self.model).eval()
        for p in clone.parameters():
            p.requires_grad_(False)
        return clone

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _model_for(self, tag: str) -> torch.nn.Module:
        if tag in ("", "actor"):
            return self.model
        if tag not in self.copies:
            raise ValueError(f"tag: {tag!r} is not loaded (loaded: actor, {', '.join(self.copies) or 'none'})")
        return self.copies[tag]

    def _pack(self, samples: list[Sample]) -> PackedBatch:
        return pack(samples, pad_id=self.pad_id, vocab_size=self.model_config.vocab_size, device=self.device)

    def _forward(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        logits = model(batch.input_ids, attention_mask=batch.attention_mask)  # [B, T, V]
        return logits[:, :-1].float()  # [B, T-1, V]

    @torch.no_grad()
    def compute_logprobs(self, tag: str, samples: list[Sample]) -> tuple[list[list[float]], float]:
        model = self._model_for(tag)
        results: list[list[float]] = []
        entropy_sum, token_count = 0.0, 0.0
        for chunk in micro_batches(samples, self.settings.micro_batch_size):
            batch = self._pack(chunk)
            logits = self._forward(model, batch)
            results += batch.response_values(losses.gather_logprobs(logits, batch.targets))
            entropy_sum += float((losses.entropy_from_logits(logits) * batch.response_mask).sum())
            token_count += float(batch.response_mask.sum())
        return results, entropy_sum / max(token_count, 1.0)

    def train_step(self, samples: list[Sample], *, sft: bool = False, lr: float | None = None) -> StepResult:
        """One optimizer step over the whole batch. With `lr`, that learning rate is used for this
        step only and the schedule does not advance (warm-up stages such as SFT before RL)."""
        if self.optimizer is None:
            raise TrainerStateError("TrainStep: this trainer was configured eval_only and has no optimizer")
        started = time.perf_counter()
        loss_cfg = self.settings.loss
        if not sft and loss_cfg.kl_coef > 0 and not all(s.ref_logprobs for s in samples):
            raise ValueError("batch: kl_coef > 0 but samples carry no ref_logprobs (call ComputeLogProbs with tag 'ref')")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        per_token = loss_cfg.loss_agg == "token_mean"
        total = sum(len(s.response_ids) for s in samples) if per_token else len(samples)
        sums: dict[str, float] = {}
        for chunk in micro_batches(samples, self.settings.micro_batch_size):
            batch = self._pack(chunk)
            weight = (float(batch.response_mask.sum()) if per_token else len(chunk)) / total
            loss, metrics = self._micro_batch_loss(batch, sft)
            (loss * weight).backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value * weight
        clip = self.settings.optimizer.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip > 0 else float("inf")
        )
        sums["grad_norm"] = float(grad_norm)
        scheduled = [group["lr"] for group in self.optimizer.param_groups]
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        sums["lr"] = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if lr is None:
            self.scheduler.step()
        else:
            for group, value in zip(self.optimizer.param_groups, scheduled):
                group["lr"] = value
        self.step += 1
        self.weights_version += 1
        sums["train_step_s"] = time.perf_counter() - started
        return StepResult(sums, self.weights_version, self.step)

    def _micro_batch_loss(self, batch: PackedBatch, sft: bool) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.settings.loss
        logits = self._forward(self.model, batch)
        if sft:
            loss = losses.sft_loss(logits, batch.targets, batch.response_mask, cfg.loss_agg)
            return loss, {"loss": loss.item(), "sft_loss": loss.item()}
        logprobs = losses.gather_logprobs(logits, batch.targets)  # [B, T-1]
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        pg_loss, pg_metrics = losses.policy_loss(
            logprobs, old, batch.advantages, batch.response_mask,
            cfg.clip_eps_low, cfg.clip_eps_high, cfg.loss_agg,
        )
        loss = pg_loss
        metrics = {"pg_loss": pg_loss.item(), **{k: float(v) for k, v in pg_metrics.items()}}
        if cfg.kl_coef > 0:
            kl = losses.aggregate(
                losses.kl_penalty(logprobs, batch.ref_logprobs, cfg.kl_estimator), batch.response_mask, cfg.loss_agg
            )
            loss = loss + cfg.kl_coef * kl
            metrics["kl"] = kl.item()
        if cfg.entropy_coef != 0:
            entropy = losses.aggregate(losses.entropy_from_logits(logits), batch.response_mask, cfg.loss_agg)
            loss = loss - cfg.entropy_coef * entropy
            metrics["entropy"] = entropy.item()
        metrics["loss"] = loss.item()
        return loss, metrics
