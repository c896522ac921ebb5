"""gRPC servicer of `rlfleet.v1.Trainer`: translates protobuf to the torch backend and back.

All work on the model is serialised by one lock: the coordinator drives a trainer rank with one
call at a time, and a weight pull must never observe a half-applied optimizer step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import grpc

from services import devices, rpc, telemetry
from services.api import trainer_pb2, trainer_pb2_grpc, weights_pb2
from services.trainer.batch import Sample
from services.trainer.settings import LossSettings, OptimizerSettings, SchedulerSettings, TrainerSettings
from services.trainer import ranks
from services.trainer.backend import TrainerBackend, TrainerStateError, build_backend
from services.trainer.weight_push import WeightPusher
from services.trainer.weight_source import StreamCutOff
from services.weights import capabilities
from services.weights.grpc_stream import DEFAULT_CHUNK_BYTES, iter_chunks
from services.weights.errors import WeightSyncError
from services.weights.manifest import ManifestEncoder

SERVICE_NAME = "rlfleet.v1.Trainer"
_ERRORS = {
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
    TrainerStateError: grpc.StatusCode.FAILED_PRECONDITION,
    ranks.RankError: grpc.StatusCode.UNAVAILABLE,
    WeightSyncError: grpc.StatusCode.ABORTED,
    FileNotFoundError: grpc.StatusCode.NOT_FOUND,
}
log = rpc.get_logger("trainer")
MAX_CHUNK_BYTES = 64 << 20  # a chunk is one message, and messages are capped at rpc.MAX_MESSAGE_BYTES


def settings_from_proto(cfg: trainer_pb2.TrainerConfig) -> TrainerSettings:
    defaults = TrainerSettings(model_path="-")
    opt, sched, loss = cfg.optimizer, cfg.scheduler, cfg.loss
    return TrainerSettings(
        model_path=cfg.model_path,
        backend=cfg.backend or defaults.backend,
        device=cfg.device or defaults.device,
        dtype=cfg.dtype or defaults.dtype,
        seed=cfg.seed,
        optimizer=OptimizerSettings(**{  # unset: the default; set: what it says, 0 included
            name: getattr(opt, name) for name in ("lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip")
            if opt.HasField(name)
        }),
        scheduler=SchedulerSettings(
            kind=sched.kind or defaults.scheduler.kind,
            warmup_steps=sched.warmup_steps,
            decay_steps=sched.decay_steps,
            min_lr_ratio=sched.min_lr_ratio,
        ),
        loss=LossSettings(
            clip_eps_low=loss.clip_eps_low if loss.HasField("clip_eps_low") else defaults.loss.clip_eps_low,
            clip_eps_high=loss.clip_eps_high if loss.HasField("clip_eps_high") else defaults.loss.clip_eps_high,
            kl_coef=loss.kl_coef,
            kl_estimator=loss.kl_estimator or defaults.loss.kl_estimator,
            entropy_coef=loss.entropy_coef,
            loss_agg=loss.loss_agg or defaults.loss.loss_agg,
            value_clip=loss.value_clip if loss.HasField("value_clip") else defaults.loss.value_clip,
            correction=loss.correction or defaults.loss.correction,
            is_cap=loss.is_cap if loss.HasField("is_cap") else defaults.loss.is_cap,
        ),
        tags=tuple(cfg.tags),
        eval_only=cfg.eval_only,
        offload=cfg.offload,
        colocate=cfg.colocate,
        micro_batch_size=cfg.micro_batch_size or defaults.micro_batch_size,
        bucket_bytes=cfg.bucket_bytes or defaults.bucket_bytes,
        master_weights=cfg.master_weights,
        tensor_parallel=cfg.tensor_parallel or 1,
        pipeline_parallel=cfg.pipeline_parallel or 1,
        role=cfg.role or defaults.role,
        compile=cfg.compile if cfg.HasField("compile") else defaults.compile,
    )


def samples_from_proto(batch: trainer_pb2.Batch) -> list[Sample]:
    samples = []
    for s in batch.samples:
        advantages = list(s.advantages) or [s.advantage] * len(s.response_ids)
        samples.append(
            Sample(
                prompt_ids=list(s.prompt_ids),
                response_ids=list(s.response_ids),
                loss_mask=list(s.loss_mask),
                advantages=advantages,
                old_logprobs=list(s.old_logprobs),
                ref_logprobs=list(s.ref_logprobs),
                returns=list(s.returns),
                old_values=list(s.old_values),
            )
        )
    return samples


def _lifecycle_proto(state) -> trainer_pb2.LifecycleStatus:
    return trainer_pb2.LifecycleStatus(
        asleep=state.asleep,
        active_tag=state.active_tag,
        weights_version=state.weights_version,
        gpu_bytes_in_use=state.gpu_bytes_in_use,
        host_backup_bytes=state.host_backup_bytes,
    )


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, checkpoint_root: Path = Path("."), metrics: telemetry.TrainerMetrics | None = None,
                 rank_store_port: int = 0, weight_store_port: int = 0):
        self._checkpoint_root = checkpoint_root
        self._rank_store_port, self._weight_store_port = rank_store_port, weight_store_port
        self.metrics = metrics or telemetry.TrainerMetrics()
        self.shutdown = threading.Event()  # build_server hands it the server's own
        self._lock = threading.Lock()
        self._trainer: TrainerBackend | None = None
        self._rank_store = None  # rank 0's rendezvous store, from OpenRankGroup until the group forms
        self._configuring = threading.Lock()
        self._pusher: WeightPusher | None = None
        self._manifests = ManifestEncoder()  # under self._lock
        self._streams = rpc.Admission(16)  # GetWeights streams at once (each holds a pool thread)

    @contextlib.contextmanager
    def _mutating(self):
        """The trainer lock, plus exclusion of weight streams: live weights are about to change."""
        with self._lock:
            if self._pusher is None:
                yield
            else:
                with self._pusher.source.exclusive():
                    yield

    def _require(self, context) -> TrainerBackend:
        if self._trainer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "trainer is not configured: call Configure first")
        devices.use(self._trainer.device)  # this pool thread may start on another GPU
        return self._trainer

    def _status(self) -> trainer_pb2.TrainerStatus:
        t = self._trainer
        if t is None:
            return trainer_pb2.TrainerStatus(configured=False)
        return trainer_pb2.TrainerStatus(
            lifecycle=_lifecycle_proto(t.lifecycle()),
            has_optimizer=t.has_optimizer,
            has_scheduler=t.has_scheduler,
            configured=True,
            step=t.step,
            num_parameters=t.num_parameters,
            checkpoint_step=t.checkpoint_step,
            rank=ranks.world()[0],
            world_size=ranks.world()[1],
            backend=t.settings.backend,
            role=t.settings.role,
            has_value_head=t.settings.role == "critic",
        )

    def Shutdown(self, request, context):
        """Stop serving and let the process exit (the caller's job is over)."""
        log.info("shutdown requested%s", f": {request.reason[:200]}" if request.reason else "")
        self.shutdown.set()
        return weights_pb2.ShutdownResponse()

    def close(self) -> None:
        """Leave nothing behind: broadcast groups, shared-memory segments."""
        with self._lock:
            if self._pusher is not None:
                self._pusher.close()
                self._trainer.close()

    def Configure(self, request, context):
        """Build the backend, after joining the rank group when there is one. The join blocks
        until every rank is in, so it runs outside the trainer lock: meanwhile other calls are
        answered (FAILED_PRECONDITION: not configured), and a second Configure is refused."""
        if not self._configuring.acquire(blocking=False):
            context.abort(grpc.StatusCode.ABORTED, "Configure: another Configure of this trainer is in progress")
        try:
            with rpc.abort_on(context, _ERRORS):
                settings = settings_from_proto(request.config)
                devices.use(settings.device)
                with self._lock:
                    if self._pusher is not None:
                        self._pusher.close()
                        self._trainer.close()
                        self._trainer = self._pusher = None
                    store, self._rank_store = self._rank_store, None
                self._join_ranks(request.config.ranks, settings, store)
                trainer = build_backend(settings)
                with self._lock:
                    self._trainer, self._pusher = trainer, WeightPusher(trainer, self._weight_store_port)
                    log.info("configured: %s (%s backend, %d parameters, %s, eval_only=%s)", settings.model_path,
                             settings.backend, trainer.num_parameters, settings.device, settings.eval_only)
                    return trainer_pb2.ConfigureTrainerResponse(
                        status=self._status(), capabilities=capabilities.local(trainer.device)
                    )
        finally:
            self._configuring.release()

    @staticmethod
    def _join_ranks(group: trainer_pb2.RankGroup, settings, store) -> None:
        """Form (or leave) the trainer group this rank belongs to; blocks until every rank is in.
        `store`: the one OpenRankGroup opened (rank 0 only)."""
        if group.world_size <= 1:
            if group.rank != 0:
                raise ValueError(f"ranks.rank: {group.rank} in a group of {group.world_size or 1}")
            ranks.leave()
            return
        ranks.join(rank=group.rank, world_size=group.world_size, address=group.address,
                   store=store if group.rank == 0 else None,
                   backend="nccl" if settings.device.startswith("cuda") else "gloo",
                   timeout_s=rpc.timeout_seconds(group.timeout_s, 600.0))

    def OpenRankGroup(self, request, context):
        with self._lock, rpc.abort_on(context, _ERRORS):
            if self._rank_store is not None:  # a retry: the old store holds the fixed port
                self._rank_store = None
            self._rank_store = ranks.open_store(request.world_size, rpc.timeout_seconds(request.timeout_s, 600.0),
                                                self._rank_store_port)
            return trainer_pb2.OpenRankGroupResponse(port=self._rank_store.port)

    def GetStatus(self, request, context):
        with self._lock:
            return self._status()

    def Sleep(self, request, context):
        with self._mutating(), rpc.abort_on(context, _ERRORS):
            with self.metrics.lifecycle_seconds.labels("sleep").time():
                state = self._require(context).sleep()
            self._lifecycle_metrics("sleep", state)
            return trainer_pb2.SleepResponse(status=_lifecycle_proto(state))

    def WakeUp(self, request, context):
        with self._mutating(), rpc.abort_on(context, _ERRORS):
            with self.metrics.lifecycle_seconds.labels("wake").time():
                state = self._require(context).wake()
            self._lifecycle_metrics("wake", state)
            return trainer_pb2.WakeUpResponse(status=_lifecycle_proto(state))

    def _lifecycle_metrics(self, call: str, state) -> None:
        self.metrics.lifecycle.labels(call).inc()
        self.metrics.asleep.set(float(state.asleep))
        self.metrics.device_bytes.set(state.gpu_bytes_in_use)

    def ComputeLogProbs(self, request, context):
        with self._mutating(), rpc.abort_on(context, _ERRORS):
            trainer = self._require(context)
            values, entropy = trainer.compute_logprobs(request.tag, samples_from_proto(request.batch))
            return trainer_pb2.ComputeLogProbsResponse(
                results=[trainer_pb2.TokenLogProbs(values=v) for v in values], entropy=entropy
            )

    def ComputeValues(self, request, context):
        with self._mutating(), rpc.abort_on(context, _ERRORS):
            trainer = self._require(context)
            values = trainer.compute_values(samples_from_proto(request.batch))
            return trainer_pb2.ComputeValuesResponse(results=[trainer_pb2.TokenValues(values=v) for v in values])

    def TrainStep(self, request, context):
        with self._mutating(), rpc.abort_on(context, _ERRORS):
            trainer = self._require(context)
            samples = samples_from_proto(request.batch)
            with self.metrics.step_seconds.time():
                result = trainer.train_step(
                    samples,
                    sft=request.loss == trainer_pb2.LOSS_KIND_SFT,
                    value=request.loss == trainer_pb2.LOSS_KIND_VALUE,
                    lr=request.lr if request.lr != 0 else None,  # 0: unset; NaN, inf and < 0 are refused
                )
            self.metrics.steps.inc()
            self.metrics.tokens.inc(sum(len(s.response_ids) for s in samples))
            self.metrics.weights_version.set(result.weights_version)
            self.metrics.asleep.set(0.0)
            return trainer_pb2.TrainStepResponse(
                metrics=result.metrics, weights_version=result.weights_version, step=result.step
            )

    def GetWeightManifest(self, request, context):
        with self._lock, rpc.abort_on(context, _ERRORS):
            self._require(context)
            manifest = self._pusher.manifest(request.plane, request.fingerprint_algo)
            return trainer_pb2.GetWeightManifestResponse(manifest=self._manifests.encode(manifest))

    def GetWeights(self, request, context):
        with self._streams.enter(context, "GetWeights"):
            yield from self._get_weights(request, context)

    def _get_weights(self, request, context):
        if not 0 <= request.chunk_bytes <= MAX_CHUNK_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"chunk_bytes: must be in [0, {MAX_CHUNK_BYTES}] (0: {DEFAULT_CHUNK_BYTES}), got {request.chunk_bytes}")
        with self._lock:
            self._require(context)
            source = self._pusher.source
        with source.reading(request.version) as held:
            snap = held.snap
            if snap is None:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"version: weights version {request.version} is not available; call GetWeightManifest first",
                )
            num_buckets = len(snap.manifest.buckets)
            bad = [b for b in request.buckets if not 0 <= b < num_buckets]
            if bad:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"buckets: no bucket {bad[0]} (manifest has {num_buckets})")
            try:
                yield from iter_chunks(
                    snap.manifest,
                    lambda i: snap.buffers[i],
                    list(request.buckets) or None,
                    chunk_bytes=request.chunk_bytes or DEFAULT_CHUNK_BYTES,
                    encoded=True,  # registered to send bytes as they are: see build_server
                    guard=held.copying,
                )
                wanted = list(request.buckets) or range(num_buckets)
                self.metrics.sent_bytes.labels("grpc_stream").inc(sum(snap.manifest.buckets[b].nbytes for b in wanted))
            except StreamCutOff as e:
                context.abort(grpc.StatusCode.ABORTED, f"version: {e} (version {request.version}); pull the new version")

    def InitWeightUpdateGroup(self, request, context):
        with self._lock, rpc.abort_on(context, _ERRORS):
            self._require(context)
            port = self._pusher.init_group(request)
            return weights_pb2.InitWeightUpdateGroupResponse(success=True, message="rank 0 listening", master_port=port)

    def DestroyWeightUpdateGroup(self, request, context):
        with self._lock, rpc.abort_on(context, _ERRORS):
            self._require(context)
            found = self._pusher.destroy_group(request.group_name)
            return weights_pb2.DestroyWeightUpdateGroupResponse(success=found, message="" if found else "no such group")

    def PushWeights(self, request, context):
        started = time.perf_counter()
        with self._lock, rpc.abort_on(context, _ERRORS):
            self._require(context)
            manifest, names, handles, staged, seconds = self._pusher.push(request)
            plane = weights_pb2.WeightPlane.Name(request.plane).removeprefix("WEIGHT_PLANE_").lower()
            self.metrics.sent_bytes.labels(plane).inc(manifest.total_bytes)
            self.metrics.push_seconds.labels(plane).observe(seconds)
            reply = trainer_pb2.PushWeightsResponse(
                manifest=self._manifests.encode(manifest), seconds=seconds, shm_segments=names,
                cuda_ipc_handles=handles, release_required=staged,
            )
            log.info("pushed weights version %d over %s: %.1f ms (manifest %.1f ms, sending %.1f ms), reply %.1f ms",
                     manifest.version, weights_pb2.WeightPlane.Name(request.plane), 1e3 * seconds,
                     1e3 * self._pusher.last_manifest_seconds, 1e3 * (seconds - self._pusher.last_manifest_seconds),
                     1e3 * (time.perf_counter() - started))
            return reply

    def ReleaseWeights(self, request, context):
        with self._lock, rpc.abort_on(context, _ERRORS):
            self._require(context)
            self._pusher.release()
            return trainer_pb2.ReleaseWeightsResponse()

    def SaveCheckpoint(self, request, context):
        with self._mutating(), rpc.abort_on(context, _ERRORS):
            trainer = self._require(context)
            path = confine(request.path, self._checkpoint_root)
            with _path_errors(path):
                trainer.save_checkpoint(str(path), include_optimizer=request.include_optimizer)
            log.info("saved checkpoint of step %d to %s", trainer.step, path)
            return trainer_pb2.SaveCheckpointResponse(path=str(path), step=trainer.step)

    def LoadCheckpoint(self, request, context):
        with self._mutating(), rpc.abort_on(context, _ERRORS):
            trainer = self._require(context)
            path = confine(request.path, self._checkpoint_root)
            with _path_errors(path):
                trainer.load_checkpoint(str(path), load_optimizer=request.load_optimizer)
            log.info("loaded checkpoint of step %d from %s", trainer.step, path)
            return trainer_pb2.LoadCheckpointResponse(step=trainer.step, status=self._status())


@contextlib.contextmanager
def _path_errors(path: Path):
    """The file system's refusals (a name too long, no space, no permission) name the path."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ValueError(f"path: {e.strerror or e}: {path}") from e


def confine(path: str, root: Path) -> Path:
    """`path` (relative paths are under `root`) as an absolute directory path inside `root`, links
    and `..` resolved; ValueError naming the field otherwise. A trainer writes and reads
    checkpoints nowhere else, whoever asks."""
    if not path:
        raise ValueError("path: required")
    if "\x00" in path:
        raise ValueError("path: contains a NUL character")
    root = root.resolve()
    with _path_errors(Path(path)):
        resolved = (root / path).resolve()  # an absolute `path` replaces root here
        if resolved != root and root not in resolved.parents:
            raise ValueError(f"path: {path!r} is outside the checkpoint root {root} (the trainer's --checkpoint-root)")
        if resolved.exists() and not resolved.is_dir():
            raise ValueError(f"path: {resolved} exists and is not a directory")
    return resolved


def build_server(address: str = "127.0.0.1:0", token: str | None = None,
                 checkpoint_root: str | Path = ".", metrics_port: int | None = None,
                 rank_store_port: int = 0, weight_store_port: int = 0) -> rpc.Server:
    """A trainer server; checkpoints go under `checkpoint_root` only (default: the working
    directory); Prometheus metrics at http://<host>:<metrics_port>/metrics when given."""
    servicer = TrainerServicer(Path(checkpoint_root), rank_store_port=rank_store_port,
                               weight_store_port=weight_store_port)
    server = rpc.create_server(
        lambda s: rpc.add_servicer(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer, s, serialized=("GetWeights",)),
        (SERVICE_NAME,),
        address=address,
        token=token,
    )
    server.on_stop.append(servicer.close)
    servicer.shutdown = server.shutdown
    if metrics_port is not None:
        telemetry.serve(server, servicer.metrics.registry, address, metrics_port)
    server.set_serving(True)
    return server
