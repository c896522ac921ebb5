"""Megatron's own training machinery for the megatron backend on GPUs: its DDP with contiguous
parameter and gradient buffers, its distributed optimizer, and its `OptimizerParamScheduler`.

The pieces are Megatron-LM's, configured from the trainer's settings:

- `DistributedDataParallel` moves every parameter into one contiguous buffer (the distributed
  optimizer gathers updated shards into it) and accumulates gradients into one float32 buffer
  (`main_grad`); `finalize_model_grads` reduces it across data-parallel ranks, completes the
  tensor-parallel partial gradients of q/k norms, and ties pipeline-split embeddings.
- The distributed optimizer shards float32 main weights and Adam's moments across data-parallel
  ranks (with one rank: the whole model). Without Transformer Engine or apex Megatron steps with
  torch's AdamW, built without `fused`; the groups are switched to the fused kernel here, which
  computes the same update in one pass (30 ms -> a few ms for 1.5B parameters on an H200).
- `OptimizerParamScheduler` runs Megatron's schedule: linear warm-up from 0 over `warmup_steps`
  (the first step's LR is 0 when there is a warm-up), then constant, linear or cosine decay to
  `min_lr_ratio * lr` at `decay_steps`. Biases and norms take no weight decay (Megatron's rule).

Gradients are summed across data-parallel ranks, not averaged: the shared losses already divide
by the whole batch's token count (`calculate_per_token_loss` in the model's config). Nothing here
runs on a CPU: Megatron allocates these buffers on the current CUDA device.
"""

from __future__ import annotations

import math

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from services.trainer.settings import TrainerSettings

def wrap(model: torch.nn.Module) -> DistributedDataParallel:
    """Megatron's DDP around `model`: the parameters move into its contiguous buffer, in place."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False
    )
    return DistributedDataParallel(model.config, ddp_config, model)


def schedule_arguments(settings: TrainerSettings) -> dict:
    """`OptimizerParamScheduler`'s arguments for the trainer's optimizer and scheduler settings."""
    opt, sched = settings.optimizer, settings.scheduler
    sched.check_decay()
    # Megatron asserts warmup < decay steps even for a constant schedule, which never decays
    decay_steps = sched.decay_steps if sched.kind != "constant" else max(sched.decay_steps, sched.warmup_steps + 1)
    return dict(
        init_lr=0.0, max_lr=opt.lr, min_lr=opt.lr * sched.min_lr_ratio,
        # the project's kinds (SCHEDULER_KINDS) are Megatron's decay-style names
        lr_warmup_steps=sched.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=sched.kind,
        start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
    )


class MegatronOptimizer:
    """The distributed optimizer and its schedule over one DDP-wrapped model (never built in eval-only)."""

    def __init__(self, ddp: DistributedDataParallel, settings: TrainerSettings, dtype: torch.dtype) -> None:
        opt = settings.optimizer
        config = OptimizerConfig(
            optimizer="adam", lr=opt.lr, min_lr=opt.lr * settings.scheduler.min_lr_ratio,
            weight_decay=opt.weight_decay, adam_beta1=opt.beta1, adam_beta2=opt.beta2, adam_eps=opt.eps,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            use_distributed_optimizer=True, clip_grad=opt.grad_clip,
        )
        self.ddp = ddp
        self.chained = get_megatron_optimizer(config, [ddp], use_gloo_process_groups=False)
        (self.distributed,) = self.chained.chained_optimizers
        self.torch_optimizer: torch.optim.Optimizer = self.distributed.optimizer  # AdamW over the main shards
        if isinstance(self.torch_optimizer, torch.optim.AdamW):
            for group in [self.torch_optimizer.defaults, *self.torch_optimizer.param_groups]:
                group["fused"], group["foreach"] = True, None
        if torch.distributed.get_world_size(self.distributed.data_parallel_group) == 1:
            # One data-parallel rank: the step already wrote every updated weight into the model's
            # buffer, and the "all-gather" would be a 3 GB device copy onto itself (1.5B, bf16).
            # The flag is the one Megatron's ChainedOptimizer sets to defer this gather.
            self.distributed._defer_param_sync = True
        self.scheduler = OptimizerParamScheduler(self.chained, **schedule_arguments(settings))
        self.clip = opt.grad_clip

    # ---- a step, in the trainer's order ------------------------------------------------------
    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.chained.zero_grad(set_to_none=True)

    def finish_gradients(self) -> float:
        """Reduce the gradient buffer, hand it to the main shards, clip; the norm before clipping
        (NaN or inf when a gradient is not finite: the caller then skips the step)."""
        finalize_model_grads([self.ddp])
        self.chained.prepare_grads()
        norm = self._grad_norm()
        coefficient = self.clip / (norm + 1e-6)
        if self.clip > 0 and math.isfinite(norm) and coefficient < 1:
            # Megatron's clip_grad_by_total_norm_fp32, in one fused multiply: without apex its
            # fallback launches one kernel per tensor, with the GPU idle behind the norm's sync.
            grads = [p.grad for p in self.chained.get_parameters() if p.grad is not None]
            torch._foreach_mul_(grads, coefficient)
        return norm

    def _grad_norm(self) -> float:
        """Megatron's L2 gradient norm (`get_grad_norm_fp32` over `get_grads_for_grad_norm`: no
        tensor-parallel duplicates, summed over the grad-stats group) from one fused norm. Without
        apex, Megatron's fallback turns a list of 0-d CUDA norms into a tensor: one host sync per
        parameter tensor, 340 for a 1.5B model."""
        grads = self.distributed.get_grads_for_grad_norm()
        squares = torch.stack(torch._foreach_norm(grads)).square().sum() if grads else \
            torch.zeros((), device=torch.cuda.current_device())
        group = self.distributed.get_grad_stats_parallel_group()
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(squares, group=group)
        return float(squares.sqrt())

    def step(self, lr: float | None) -> float:
        """Step at the scheduled LR (or at `lr`, this step only, the schedule then not advancing);
        the LR used. The updated main weights are copied (gathered) into the model's buffer."""
        groups = self.chained.param_groups
        scheduled = [group["lr"] for group in groups]
        if lr is not None:
            for group in groups:
                group["lr"] = lr
        used = groups[0]["lr"]
        self.chained.step_with_ready_grads()
        if lr is None:
            self.scheduler.step(increment=1)
        else:
            for group, value in zip(groups, scheduled):
                group["lr"] = value
        return used

    # ---- state -------------------------------------------------------------------------------
    @property
    def schedule_position(self) -> int:
        return self.scheduler.num_steps

    @schedule_position.setter
    def schedule_position(self, steps: int) -> None:
        self.scheduler.num_steps = 0
        self.scheduler.step(increment=steps)  # also sets the LR and weight decay of that step

    def main_weights(self) -> list[torch.Tensor]:
        """The float32 main shards of low-precision parameters (fp32 parameters are their own)."""
        return [t for group in self.distributed.shard_fp32_from_float16_groups for t in group]

    def gradient_buffers(self) -> list[torch.Tensor]:
        """DDP's contiguous gradient buffers: scratch, rewritten every step."""
        return [buffer.grad_data for buffer in self.ddp.buffers + self.ddp.expert_parallel_buffers]

    def reload_main_weights(self) -> None:
        """Main weights from the model's (after a checkpoint load)."""
        self.chained.reload_model_params()
