"""The megatron trainer backend: a Megatron-core GPTModel split over the trainer ranks.

The ranks of a trainer group are tensor-parallel x pipeline-parallel shards of one model, data
parallel beyond that. Everything that is not the model comes from the torch backend it extends:
the memory lifecycle (sleep, wake, tags, host store of this rank's shards), micro-batching, the
shared losses (`services/trainer/losses.py`), the optimizer and the schedule. What differs:

- the model is built and loaded through `megatron_model` (Hugging Face names in, shards out);
- the gradient norm sums tensor-parallel shards and counts replicated tensors once;
- the Hugging Face weights are gathered onto rank 0's `export` host copy, which every weight
  sync and `GetWeights` reads: engines cannot tell which backend sent them, and a sync needs no
  collective among the trainer ranks. When the model is split (tensor or pipeline parallel) the
  gather is a collective, so every rank takes part at the end of each step; when rank 0 holds
  the whole model it gathers alone, only when a sync or a sleep needs it (a step then pays
  nothing for a copy no one reads: about 0.15 s a step for 1.5B parameters on an H200);
- checkpoints are Hugging Face folders written by rank 0, plus one optimizer file per rank;
- on GPUs, training runs on Megatron's own DDP, distributed optimizer and `OptimizerParamScheduler`
  (`megatron_optimizer`): parameters live in DDP's contiguous buffer, gradients in its float32
  buffer, float32 main weights and Adam's moments in the optimizer; sleep frees all of them.

On CPU (gloo, megatron-core 0.16) the optimizer is the torch backend's AdamW and schedule:
Megatron's distributed optimizer and DDP allocate CUDA buffers. Pipeline parallelism needs CUDA
(see `megatron_model.init_parallel`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from services.models import DecoderLM, load_hf_dir
from services.trainer import checkpoint, megatron_model, megatron_optimizer
from services.trainer.backend import SyncWeights
from services.trainer.batch import PackedBatch, Sample
from services.trainer.host_store import ACTOR, HostStore
from services.trainer.megatron_optimizer import MegatronOptimizer
from services.trainer.ranks import DataParallel, RankError, world
from services.trainer.torch_backend import TorchTrainer, compile_layers
from services.weights.buckets import parse_dtype

log = logging.getLogger("rlfleet.trainer")


class MegatronTrainer(TorchTrainer):
    def __init__(self, settings):
        if "old_actor" in settings.tags:
            raise ValueError("tags: old_actor is not supported by the megatron backend yet")
        self._own_group = False
        self.ddp = None  # Megatron's DDP (GPUs, training): the parameters live in its buffer
        self._megatron_optimizer: MegatronOptimizer | None = None
        self.export: HostStore | None = None  # rank 0: the Hugging Face weights every sync reads
        self._exported = -1  # the weights version last gathered (every rank knows it: no rank skips a gather)
        try:
            super().__init__(settings)
            self._split = self.settings.tensor_parallel * self.settings.pipeline_parallel > 1
            if self._split:
                self._export()
        except BaseException:  # a trainer that failed to start leaves no process groups behind
            self._drop_groups()
            raise

    def _build_model(self) -> DataParallel:
        s = self.settings
        if not dist.is_initialized():  # one rank: Megatron still wants a default group
            # NCCL on a GPU: the distributed optimizer's parameter gather runs CUDA tensors
            # through it (gloo crashes the process there: no coalesced CUDA all-gather)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        megatron_model.init_parallel(s.tensor_parallel, s.pipeline_parallel, seed=s.seed)
        dtype = parse_dtype(s.dtype)
        self.model_config, hf_model = load_hf_dir(s.model_path, dtype=dtype, device="cpu")
        self.model = megatron_model.build_model(self.model_config, dtype=dtype, device=self.device)
        megatron_model.load_hf_state(self.model, hf_model.state_dict(), self.model_config)
        del hf_model
        if s.compile and self.device.type == "cuda":  # where compile_layers compiles
            megatron_model.quiet_group_lookup()
        compile_layers(self.model.decoder.layers, s)
        if self.device.type == "cuda" and not s.eval_only:
            self.ddp = megatron_optimizer.wrap(self.model)
        self.named = dict(self.model.named_parameters())
        dp_size = parallel_state.get_data_parallel_world_size()
        log.info("megatron: rank %d of %d, tensor parallel %d, pipeline parallel %d, data parallel %d",
                 world()[0], world()[1], s.tensor_parallel, s.pipeline_parallel, dp_size)
        return DataParallel(parallel_state.get_data_parallel_group() if dp_size > 1 else None, self.device)

    def close(self) -> None:
        super().close()
        if self.export is not None:
            self.export.close()
        self._drop_groups()

    def _drop_groups(self) -> None:
        megatron_model.destroy_parallel()
        if self._own_group:
            dist.destroy_process_group()
            self._own_group = False

    # ---- optimizer (Megatron's on GPUs, the torch backend's on CPU) ----------------------------
    def _lay_out_weights(self) -> list[torch.Tensor] | None:
        return None if self.ddp is not None else super()._lay_out_weights()

    def _build_optimizer(self) -> None:
        if self.ddp is None:
            return super()._build_optimizer()
        self._megatron_optimizer = MegatronOptimizer(self.ddp, self.settings, parse_dtype(self.settings.dtype))
        self.optimizer = self._megatron_optimizer.torch_optimizer
        self.scheduler = self._megatron_optimizer.scheduler
        storages = {p.untyped_storage().data_ptr() for p in self.params}
        assert len(storages) == 1, "DDP keeps every parameter in one buffer (sleep frees it whole)"

    def _scratch_buffers(self) -> list[torch.Tensor]:
        return self._megatron_optimizer.gradient_buffers() if self._megatron_optimizer else []

    def _state_tensors(self) -> list[torch.Tensor]:
        mains = self._megatron_optimizer.main_weights() if self._megatron_optimizer else []
        return mains + super()._state_tensors()

    @property
    def schedule_position(self) -> int:
        if self._megatron_optimizer is None:
            return super().schedule_position
        return self._megatron_optimizer.schedule_position

    @schedule_position.setter
    def schedule_position(self, steps: int) -> None:
        if self._megatron_optimizer is None:
            TorchTrainer.schedule_position.fset(self, steps)
        else:
            self._megatron_optimizer.schedule_position = steps

    def _finish_gradients(self) -> float:
        if self._megatron_optimizer is None:
            return super()._finish_gradients()
        return self._megatron_optimizer.finish_gradients()

    def _discard_gradients(self) -> None:
        if self._megatron_optimizer is None:
            return super()._discard_gradients()
        self._megatron_optimizer.zero_grad()
        for p in self.params:
            p.grad = None

    def _apply_gradients(self, lr: float | None) -> float:
        if self._megatron_optimizer is None:
            return super()._apply_gradients(lr)
        return self._megatron_optimizer.step(lr)

    # ---- compute -----------------------------------------------------------------------------
    def _forward(self, batch: PackedBatch) -> torch.Tensor:
        logits = megatron_model.forward_logits(self.model, batch.input_ids, batch.attention_mask,
                                               vocab_size=self.model_config.vocab_size)  # [B, T, V]
        return logits[:, :-1]  # in the model's dtype: the losses compute in float32

    def _complete_gradients(self) -> None:
        megatron_model.finalize_grads(self.model, self.model_config)

    def _clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ over the whole model: tensor-parallel shards add up across the
        tensor group, replicated tensors (norms) count once, pipeline stages add up."""
        sharded_grads, replicated_grads = [], []
        for owner, p in zip(self.params, params):
            if p.grad is not None:
                (sharded_grads if getattr(owner, "tensor_model_parallel", False) else replicated_grads).append(p.grad)
        sharded, replicated = _square_sum(sharded_grads, self.device), _square_sum(replicated_grads, self.device)
        try:
            if parallel_state.get_tensor_model_parallel_world_size() > 1:
                dist.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
            total = sharded + replicated
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        except RuntimeError as e:
            raise RankError(f"ranks: the gradient-norm all-reduce failed (a rank died or stalled): {e}") from e
        norm = total.sqrt()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = sharded_grads + replicated_grads
        for dtype in {g.dtype for g in grads}:  # a few fused kernels, not one per tensor
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], scale.to(dtype))
        return norm

    def train_step(self, samples: list[Sample], *, sft: bool = False, value: bool = False, lr: float | None = None):
        result = super().train_step(samples, sft=sft, value=value, lr=lr)
        if self._split:
            self._export()
        return result

    def sleep(self):
        if not self._split and not self.asleep:
            self._export()  # the last chance: asleep, the live weights are gone
        return super().sleep()

    # ---- weights for sync --------------------------------------------------------------------
    def _export(self) -> None:
        """Gather the Hugging Face weights onto rank 0's export copy (a collective: every rank
        calls it at the same point of the same call)."""
        if self._exported == self.weights_version:
            return
        self.use(ACTOR)
        state = megatron_model.gather_hf_state(self.model, self.model_config)
        self._exported = self.weights_version
        if state is None:
            return
        if self.export is None:
            self.export = HostStore(list(state.items()), self.settings.bucket_bytes, share=self._shared_tags())
        self.export.capture(ACTOR, state, self.weights_version)

    def weights_for_sync(self) -> SyncWeights | None:
        """Rank 0's export copy, awake or asleep: the last trained weights in Hugging Face names."""
        if not self._split and self.rank == 0:
            self._export()  # rank 0 holds the whole model: gather it now, alone (a no-op when current)
        if self.export is None:
            return None
        return SyncWeights("host", self.export.get(ACTOR), self.export.layout, None)

    def lifecycle(self):
        state = super().lifecycle()
        if self.export is None:
            return state
        return dataclasses.replace(state, host_backup_bytes=state.host_backup_bytes + self.export.nbytes)

    # ---- checkpoints -------------------------------------------------------------------------
    def _optimizer_file(self) -> str:
        rank, size = world()
        return f"optimizer.rank-{rank:05d}-of-{size:05d}.safetensors"

    def save_checkpoint(self, path: str, *, include_optimizer: bool) -> None:
        """Rank 0 writes the Hugging Face folder, every rank its optimizer shard, rank 0 the state
        file last (after a barrier: the folder is complete only when every rank's part is in)."""
        directory = Path(path)
        self.use(ACTOR)
        state = megatron_model.gather_hf_state(self.model, self.model_config)
        if state is not None:
            checkpoint.begin(directory)
            with torch.device("meta"):
                model = DecoderLM(self.model_config)
            model.load_state_dict(state, strict=True, assign=True)
            checkpoint.write_weights(model, self.model_config, directory, self.settings.model_path)
        dist.barrier()
        extra = checkpoint.save_optimizer(self, directory / self._optimizer_file()) if include_optimizer else None
        dist.barrier()
        if state is not None:
            checkpoint.finish(self, directory, extra, ranks=world()[1], tensor_parallel=self.settings.tensor_parallel,
                              pipeline_parallel=self.settings.pipeline_parallel)

    def load_checkpoint(self, path: str, *, load_optimizer: bool) -> None:
        """Every rank loads its shards from the Hugging Face folder (and its optimizer shard)."""
        super().load_checkpoint(path, load_optimizer=load_optimizer)
        if self._megatron_optimizer is not None:
            self._megatron_optimizer.reload_main_weights()
        self._exported = -1  # same version number, other weights: gather again
        if self._split:
            self._export()

    def _checkpoint_weights(self, path: str) -> dict[str, torch.Tensor]:
        config, loaded = load_hf_dir(path, dtype=parse_dtype(self.settings.dtype), device="cpu")
        if config.to_hf_dict() | {"torch_dtype": None, "dtype": None} != \
                self.model_config.to_hf_dict() | {"torch_dtype": None, "dtype": None}:
            raise checkpoint.CheckpointError(f"checkpoint {path}: its config.json is not this model's")
        return loaded.state_dict()

    def _load_weights(self, source: dict[str, torch.Tensor]) -> None:
        megatron_model.load_hf_state(self.model, source, self.model_config)


def _square_sum(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of all of `grads`, in float32, from one fused norm per dtype."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads)  # [one 0-d tensor per gradient]
    return torch.stack([n.float() for n in norms]).pow(2).sum()
