"""gRPC servicer of `rlfleet.v1.Rollout`: translates protobuf to the engine and runs weight pulls.

UpdateWeights validates the manifest against the model first (a mismatch is refused with
INVALID_ARGUMENT and the engine keeps serving its current version), then pulls every bucket from
the trainer into staging buffers, verifies them, and only then swaps them in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from typing import Callable

import grpc

from services import devices, profiling, rpc, telemetry
from services.api import rollout_pb2, rollout_pb2_grpc, trainer_pb2, weights_pb2
from services.rollout import receiver
from services.rollout.builtin.scheduler import GenerationCancelled
from services.rollout.engine import EngineStateError, EngineUnavailable, RolloutSettings, SglangSettings
from services.rollout.protocol import GenerationEngine, build_engine
from services.rollout.types import Sampling
from services.weights import shm
from services.weights.broadcast import WeightGroup
from services.weights.errors import InvalidChunk, WeightSyncError
from services.weights.fingerprint import default_algo
from services.weights.grpc_stream import StreamReceiver

SERVICE_NAME = "rlfleet.v1.Rollout"
DEFAULT_UPDATE_TIMEOUT_S = 120.0
_ERRORS = {
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
    FileNotFoundError: grpc.StatusCode.NOT_FOUND,
    EngineUnavailable: grpc.StatusCode.UNAVAILABLE,
    EngineStateError: grpc.StatusCode.FAILED_PRECONDITION,
    WeightSyncError: grpc.StatusCode.ABORTED,
    GenerationCancelled: grpc.StatusCode.CANCELLED,
}
_FINISH = {"stop": rollout_pb2.FINISH_REASON_STOP, "length": rollout_pb2.FINISH_REASON_LENGTH,
           "abort": rollout_pb2.FINISH_REASON_ABORT}
_POLICIES = {rollout_pb2.UPDATE_POLICY_UNSPECIFIED: "drain", rollout_pb2.UPDATE_POLICY_DRAIN: "drain",
             rollout_pb2.UPDATE_POLICY_PAUSE: "pause", rollout_pb2.UPDATE_POLICY_ABORT: "abort"}
MAX_GENERATE_CALLS = 512  # Generate and GenerateStream calls in progress at once; more are refused
SERVER_THREADS = MAX_GENERATE_CALLS + 32  # each call holds a thread; the rest serve updates and health
log = rpc.get_logger("rollout")


def sampling_from_proto(p: rollout_pb2.SamplingParams) -> Sampling:
    return Sampling(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=0 if p.top_k == -1 else p.top_k,  # the proto's "0 or -1 = all"
        max_new_tokens=p.max_new_tokens or 128,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        n=p.n or 1,
        seed=p.seed if p.HasField("seed") else None,
        ignore_eos=p.ignore_eos,
    )


MAX_ROWS_PER_CALL = 65536  # prompts x n
BYTES_PER_POSITION = 64  # a prompt longer than this many bytes per position cannot fit the model


def _check_sizes(request: rollout_pb2.GenerateRequest, sampling: Sampling, max_positions: int) -> None:
    """Refuse what cannot fit, by field, before tokenizing: a 10 MB prompt cost 2 GB of memory to
    tokenize only to be refused after."""
    count = len(request.prompts) or len(request.input_ids)
    if count * sampling.n > MAX_ROWS_PER_CALL:
        raise ValueError(f"prompts: {count} prompts x n={sampling.n} is more than {MAX_ROWS_PER_CALL} completions "
                         "per call; split the call")
    limit = BYTES_PER_POSITION * max_positions
    for i, prompt in enumerate(request.prompts):
        if len(prompt) > limit:  # characters: at least as many bytes
            raise ValueError(f"prompts[{i}]: {len(prompt)} characters cannot fit max_position_embeddings="
                             f"{max_positions} (at most {limit})")
    for i, ids in enumerate(request.input_ids):
        if len(ids.ids) + sampling.max_new_tokens > max_positions:
            raise ValueError(f"input_ids[{i}]: {len(ids.ids)} tokens plus max_new_tokens={sampling.max_new_tokens} "
                             f"exceed max_position_embeddings={max_positions}")


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, metrics: telemetry.RolloutMetrics | None = None):
        self.metrics = metrics or telemetry.RolloutMetrics()
        self.shutdown = threading.Event()  # build_server hands it the server's own
        self._engine: GenerationEngine | None = None
        self.metrics.registry.register(telemetry.EngineQueue(self._engine_load))
        self._update_lock = threading.Lock()
        self._groups: dict[str, WeightGroup] = {}
        self._staging: receiver.Staging | None = None
        self._shm = shm.ShmReader()
        # Calls that wait (on the engine, on peers) are bounded, so pool threads stay for health.
        self._waiting = rpc.Admission(8)
        # Generate calls wait on the running batch, not on each other: many may be in progress.
        self._generating = rpc.Admission(MAX_GENERATE_CALLS)
        self._joining = rpc.Admission(1)  # a group join blocks until its peers come, or its timeout

    def Shutdown(self, request, context):
        """Stop serving and let the process exit (the caller's job is over)."""
        log.info("shutdown requested%s", f": {request.reason[:200]}" if request.reason else "")
        self.shutdown.set()
        return weights_pb2.ShutdownResponse()

    def close(self) -> None:
        """Stop what the engine runs (an SGLang child)."""
        if self._engine is not None:
            self._engine.close()

    def _require(self) -> GenerationEngine:
        """The engine (EngineStateError, FAILED_PRECONDITION to a caller, before Configure)."""
        if self._engine is None:
            raise EngineStateError("engine is not configured: call Configure first")
        devices.use(self._engine.device)  # this pool thread may start on another GPU
        return self._engine

    def _status(self) -> rollout_pb2.RolloutStatus:
        e = self._engine
        if e is None:
            return rollout_pb2.RolloutStatus(configured=False)
        return rollout_pb2.RolloutStatus(
            configured=True,
            weight_version=e.weight_version,
            serving=e.serving and not e.released,
            released=sorted(e.released),
            last_error=e.last_error,
            num_parameters=e.num_parameters,
            checkpoint_step=e.checkpoint_step,
            load=rollout_pb2.EngineLoad(**dataclasses.asdict(load)) if (load := self._engine_load()) is not None else None,
        )

    def Configure(self, request, context):
        c = request.config
        with self._update_lock, rpc.abort_on(context, _ERRORS):
            settings = RolloutSettings(
                model_path=c.model_path,
                engine=c.engine or "torch",
                device=c.device or "cpu",
                dtype=c.dtype or "float32",
                seed=c.seed,
                max_batch_size=c.max_batch_size or 256,
                load_weights=c.load_weights,
                kv_cache_fraction=c.kv_cache_fraction if c.HasField("kv_cache_fraction") else 0.5,
                cuda_graphs=c.cuda_graphs if c.HasField("cuda_graphs") else True,
                prefix_cache=c.prefix_cache,
                sglang=SglangSettings(
                    url=c.sglang.url, args=tuple(c.sglang.args), command=tuple(c.sglang.command),
                    startup_timeout_s=c.sglang.startup_timeout_s or SglangSettings.startup_timeout_s,
                    memory_saver=c.sglang.memory_saver,
                    request_timeout_s=c.sglang.request_timeout_s or SglangSettings.request_timeout_s,
                ),
            )
            devices.use(settings.device)
            if self._engine is not None:
                self._engine.close()
                self._engine = None
            self._engine = build_engine(settings)
            self._staging = receiver.Staging(self._engine.device)
            log.info("configured: %s (%s engine, %d parameters, %s)", c.model_path, settings.engine,
                     self._engine.num_parameters, settings.device)
            return rollout_pb2.ConfigureRolloutResponse(status=self._status(), capabilities=self._engine.capabilities())

    def _engine_load(self):
        """The engine's load now, for the metrics; None without an engine that reports one."""
        engine = self._engine
        return engine.load() if engine is not None and hasattr(engine, "load") else None

    def GetStatus(self, request, context):
        return self._status()

    @contextlib.contextmanager
    def _metered(self):
        """A Generate or GenerateStream call's metrics: in flight while it runs, then its outcome
        ("ok" once the body has set `done[0]`) and, for one that succeeded, its seconds."""
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        done = [False]
        try:
            yield done
        finally:
            if done[0]:
                self.metrics.generate_seconds.observe(time.perf_counter() - started)
            self.metrics.in_flight.dec()
            self.metrics.requests.labels("ok" if done[0] else "error").inc()

    def Generate(self, request, context):
        with self._metered() as done:
            reply = self._generate(request, context)
            self.metrics.tokens.inc(sum(len(c.output_ids) for c in reply.results))
            done[0] = True
            return reply

    def _prepare(self, request):
        """The engine, the request's prompts as ids and its sampling settings (ValueError naming
        the field for what the model cannot take)."""
        engine = self._require()
        if request.prompts and request.input_ids:
            raise ValueError("prompts, input_ids: give one or the other, not both")
        sampling = sampling_from_proto(request.sampling)
        _check_sizes(request, sampling, engine.max_positions)  # before any tokenizing
        if request.prompts:
            prompts_ids = [engine.tokenizer.encode(p) for p in request.prompts]
        else:
            prompts_ids = [list(t.ids) for t in request.input_ids]
        if not prompts_ids:
            raise ValueError("prompts: no prompts given")
        return engine, prompts_ids, sampling

    @staticmethod
    def _serving_options(engine, request) -> dict:
        """What only a serving engine (one running batch for every caller) takes."""
        if not getattr(engine, "streams", False):
            return {}
        return {"priority": "eval" if request.priority == rollout_pb2.PRIORITY_EVAL else "train"}

    def _generate(self, request, context):
        with self._generating.enter(context, "Generate"), rpc.abort_on(context, _ERRORS):
            engine, prompts_ids, sampling = self._prepare(request)
            # A caller that cancels or runs past its deadline stops its rows (checked every round).
            results, version = engine.generate(prompts_ids, sampling, cancelled=_ended(context),
                                               **self._serving_options(engine, request))
            return rollout_pb2.GenerateResponse(
                weight_version=version,
                results=[_completion(g, version, request.return_logprobs) for g in results],
            )

    def GenerateStream(self, request, context):
        """Each completion as it finishes (an engine that cannot stream sends them all at its end)."""
        with self._metered() as done:
            with self._generating.enter(context, "GenerateStream"), rpc.abort_on(context, _ERRORS):
                engine, prompts_ids, sampling = self._prepare(request)
                for index, g, version in self._finishing(engine, request, prompts_ids, sampling, context):
                    self.metrics.tokens.inc(len(g.output_ids))
                    yield rollout_pb2.GenerateStreamResponse(
                        index=index, completion=_completion(g, version, request.return_logprobs))
                done[0] = True

    def _finishing(self, engine, request, prompts_ids, sampling, context):
        """(index, generation, version of its first token) of each completion as it finishes."""
        cancelled = _ended(context)
        if not getattr(engine, "streams", False):  # all of them at the call's end
            results, version = engine.generate(prompts_ids, sampling, cancelled=cancelled)
            yield from ((i, g, version) for i, g in enumerate(results))
            return
        finished: queue.SimpleQueue = queue.SimpleQueue()
        call = engine.submit(prompts_ids, sampling, cancelled=cancelled, on_result=lambda i, g: finished.put((i, g)),
                             **self._serving_options(engine, request))
        for _ in range(len(call.results)):
            while True:
                try:
                    index, g = finished.get(timeout=0.1)
                    break
                except queue.Empty:
                    if call.finished.is_set() and finished.empty():
                        call.wait()  # raises what ended it
            yield index, g, g.versions[0][0] if g.versions else engine.weight_version

    def UpdateWeights(self, request, context):
        with self._waiting.enter(context, "UpdateWeights"), self._update_lock, rpc.abort_on(context, _ERRORS):
            engine = self._require()
            started = time.perf_counter()
            manifest = engine.read_manifest(request.manifest)
            if request.version != manifest.version:
                raise ValueError(f"version: {request.version} does not match manifest.version {manifest.version}")
            if "weights" in engine.released:
                raise EngineStateError("UpdateWeights: weights are released; call ResumeMemory(weights) first")
            source = request.WhichOneof("source")
            if source is None:
                raise ValueError("source: one of trainer, broadcast, shm, cuda_ipc is required")
            timeout_s = rpc.timeout_seconds(request.timeout_s, DEFAULT_UPDATE_TIMEOUT_S)  # a bad one names itself now
            policy = _POLICIES.get(request.policy)
            if policy is None or policy not in getattr(engine, "update_policies", ("drain",)):
                raise ValueError(f"policy: {rollout_pb2.UpdatePolicy.Name(request.policy) if policy else request.policy} "
                                 f"is not one this engine supports "
                                 f"({', '.join(getattr(engine, 'update_policies', ('drain',)))})")
            if source in getattr(engine, "receives", ()):  # the engine takes these bytes itself (SGLang)
                return self._update_by_engine(engine, request, manifest, timeout_s, started, policy)
            if source == "broadcast" and request.broadcast.group_name not in self._groups:
                raise ValueError(f"broadcast.group_name: no group {request.broadcast.group_name!r}; call InitWeightUpdateGroup")
            read_back = request.verify == weights_pb2.VERIFY_MODE_EXACT
            checked = time.perf_counter()
            try:
                with profiling.profiled("rollout", f"update-{manifest.version}"):
                    copied = self._receive_and_apply(engine, request, manifest, read_back, timeout_s, policy)
            except (WeightSyncError, InvalidChunk, grpc.RpcError) as e:
                self.metrics.updates_failed.inc()
                self.metrics.serving.set(0.0)
                reason = e.details() if isinstance(e, grpc.RpcError) else str(e)
                engine.leave_pool(f"weight update to version {manifest.version} failed: {reason}")
                log.warning("update to version %d failed: %s", manifest.version, reason)
                raise WeightSyncError(engine.last_error) from e
            seconds = time.perf_counter() - started
            self._update_metrics(source, copied, seconds, manifest.version)
            log.info("weights version %d: %.1f MB in %.1f ms (checking the manifest %.1f ms, receiving and verifying "
                     "%.1f ms, loading into the model %.1f ms)", manifest.version, copied / 1e6, 1e3 * seconds,
                     1e3 * (checked - started), 1e3 * (seconds - (checked - started) - engine.last_apply_seconds),
                     1e3 * engine.last_apply_seconds)
            return rollout_pb2.UpdateWeightsResponse(
                version=manifest.version,
                fingerprints=[b.fingerprint for b in manifest.buckets],
                seconds=seconds,
                bytes=copied,
            )

    def _update_metrics(self, source: str, copied: int, seconds: float, version: int) -> None:
        plane = "grpc_stream" if source == "trainer" else source
        self.metrics.update_bytes.labels(plane).inc(copied)
        self.metrics.update_seconds.labels(plane).observe(seconds)
        self.metrics.weights_version.set(version)
        self.metrics.serving.set(1.0)

    def _update_by_engine(self, engine, request, manifest, timeout_s: float, started: float, policy: str):
        read_back = request.verify == weights_pb2.VERIFY_MODE_EXACT
        source = request.WhichOneof("source")
        try:
            if source == "broadcast":
                copied = engine.update_from_broadcast(manifest, request.broadcast.group_name, timeout_s, read_back,
                                                      **_policy(engine, policy))
            else:
                copied = engine.update_from_cuda_ipc(manifest, list(request.cuda_ipc.handles), timeout_s, read_back,
                                                     **_policy(engine, policy))
        except WeightSyncError as e:
            self.metrics.updates_failed.inc()
            self.metrics.serving.set(0.0)
            engine.leave_pool(f"weight update to version {manifest.version} failed: {e}")
            log.warning("update to version %d failed: %s", manifest.version, e)
            raise
        seconds = time.perf_counter() - started
        self._update_metrics(source, copied, seconds, manifest.version)
        log.info("weights version %d: %.1f MB loaded by the engine in %.1f ms%s", manifest.version, copied / 1e6,
                 1e3 * seconds, " (read back and verified)" if read_back else "")
        # Fingerprints only when the engine read its weights back; otherwise it loaded bytes it
        # cannot fingerprint (see docs/sglang.md).
        prints = [b.fingerprint for b in manifest.buckets] if read_back else []
        return rollout_pb2.UpdateWeightsResponse(version=manifest.version, seconds=seconds, bytes=copied,
                                                 fingerprints=prints)

    def _receive_and_apply(self, engine, request, manifest, read_back: bool, timeout_s: float, policy: str) -> int:
        source = request.WhichOneof("source")
        if source == "shm" and engine.device.type != "cuda":  # the trainer's segments become our weights
            try:
                buffers = receiver.receive_shm(self._shm, request.shm, manifest)
                copied = engine.apply(manifest, buffers, read_back=read_back, adopt=True, **_policy(engine, policy))
            except BaseException:
                self._shm.abandon()
                raise
            self._shm.adopted()
            return copied
        # Everything else lands in our staging, which the model then adopts.
        if source == "shm":  # a sleeping trainer's host copy, uploaded to our GPU
            buffers = receiver.receive_host_copy(self._shm, request.shm, manifest, self._staging)
        elif source == "trainer":
            buffers = self._pull(request.trainer, manifest, timeout_s)
        elif source == "cuda_ipc":  # the trainer's GPU memory: copied out of it
            buffers = receiver.receive_cuda_ipc(request.cuda_ipc, manifest, self._staging)
        else:
            group = self._groups[request.broadcast.group_name]
            try:
                buffers = receiver.receive_broadcast(group, request.broadcast.src_rank, manifest, self._staging)
            except WeightSyncError:
                # A broken collective cannot be reused. The group may be gone already (destroyed,
                # or replaced by a new group of its name, while this update waited on it).
                if self._groups.get(group.name) is group:
                    del self._groups[group.name]
                group.close()
                raise
        copied = engine.apply(manifest, buffers, read_back=read_back, adopt=True, owned=True, **_policy(engine, policy))
        self._staging.adopted(buffers, kept=engine.holds_buffers)
        if not engine.keeps_staging:  # it copied them out (SGLang): no second copy of the weights stays here
            self._staging.clear()
        self._shm.release()  # no longer serving a trainer's segments, if it ever did
        return copied

    def InitWeightUpdateGroup(self, request, context):
        """Join a broadcast group as rank `rank_offset`; blocks until every rank has joined."""
        with self._joining.enter(context, "InitWeightUpdateGroup"), rpc.abort_on(context, _ERRORS):
            engine = self._require()
            name = request.group_name or "weight_update_group"
            if "broadcast" in getattr(engine, "receives", ()):
                engine.init_group(master_address=request.master_address, master_port=request.master_port,
                                  rank_offset=request.rank_offset, world_size=request.world_size, group_name=name,
                                  backend=request.backend or "gloo",
                                  timeout_s=rpc.timeout_seconds(request.timeout_s, DEFAULT_UPDATE_TIMEOUT_S))
                return weights_pb2.InitWeightUpdateGroupResponse(success=True, message=f"joined from rank {request.rank_offset}")
            old = self._groups.pop(name, None)
            if old is not None:
                old.close()
            group = WeightGroup(
                master_address=request.master_address, master_port=request.master_port, rank=request.rank_offset,
                world_size=request.world_size, group_name=name, backend=request.backend or "gloo",
                timeout_s=rpc.timeout_seconds(request.timeout_s, DEFAULT_UPDATE_TIMEOUT_S), device=engine.device,
            ).connect()
            self._groups[name] = group
            return weights_pb2.InitWeightUpdateGroupResponse(success=True, message=f"joined as rank {group.rank}")

    def DestroyWeightUpdateGroup(self, request, context):
        engine = self._engine
        if engine is not None and "broadcast" in getattr(engine, "receives", ()):
            found = engine.destroy_group(request.group_name or "weight_update_group")
            return weights_pb2.DestroyWeightUpdateGroupResponse(success=found)
        group = self._groups.pop(request.group_name or "weight_update_group", None)
        if group is not None:
            group.close()
        return weights_pb2.DestroyWeightUpdateGroupResponse(success=group is not None)

    def _pull(self, endpoint: weights_pb2.TrainerEndpoint, manifest, timeout_s: float):
        receiver = StreamReceiver(manifest, buffers=self._staging.buffers(manifest))
        with contextlib.closing(rpc.open_channel(endpoint.address, endpoint.token or None)) as channel:
            get_weights = channel.unary_stream(  # the chunks' bytes, parsed by the receiver with one copy
                "/rlfleet.v1.Trainer/GetWeights", request_serializer=trainer_pb2.GetWeightsRequest.SerializeToString
            )
            for raw in get_weights(trainer_pb2.GetWeightsRequest(version=manifest.version), timeout=timeout_s):
                receiver.accept(raw)
        return receiver.finish(manifest.fingerprint_algo)

    def ReleaseMemory(self, request, context):
        with self._update_lock, rpc.abort_on(context, _ERRORS):
            engine = self._require()
            engine.release_memory(list(request.tags))
            if "weights" in engine.released:
                self._shm.release()  # the trainer may rewrite segments we served
                self._staging.clear()
            return rollout_pb2.ReleaseMemoryResponse(status=self._status())

    def ResumeMemory(self, request, context):
        with self._update_lock, rpc.abort_on(context, _ERRORS):
            self._require().resume_memory(list(request.tags))
            return rollout_pb2.ResumeMemoryResponse(status=self._status())

    def GetWeightFingerprints(self, request, context):
        with rpc.abort_on(context, _ERRORS):
            engine = self._require()
            algo = request.fingerprint_algo or default_algo(engine.device)
            prints = engine.fingerprints(algo, request.bucket_bytes or 512 * 1024 * 1024)
            return rollout_pb2.GetWeightFingerprintsResponse(version=engine.weight_version, fingerprints=prints)


def _completion(g, version: int, logprobs: bool) -> rollout_pb2.Completion:
    return rollout_pb2.Completion(
        prompt_index=g.prompt_index,
        prompt_ids=g.prompt_ids,
        output_ids=g.output_ids,
        text=g.text,
        logprobs=g.logprobs if logprobs else [],
        finish_reason=_FINISH[g.finish_reason],
        weight_version=g.versions[0][0] if g.versions else version,
        version_runs=[rollout_pb2.VersionRun(version=v, tokens=n) for v, n in g.versions],
    )


def _ended(context) -> Callable[[], bool]:
    """Whether the call ended (cancelled, past its deadline, its client gone): what the engine
    polls every round for each live request. A flag gRPC sets when the call ends, not a look at
    the call's state under its lock, hundreds of times a round."""
    ended = threading.Event()
    if not context.add_callback(ended.set):  # (already over)
        ended.set()
    return ended.is_set


def _policy(engine, policy: str) -> dict:
    """The apply keyword of an engine that takes update policies (others only drain)."""
    return {"policy": policy} if hasattr(engine, "update_policies") else {}


def build_server(address: str = "127.0.0.1:0", token: str | None = None, metrics_port: int | None = None,
                 servicer: RolloutServicer | None = None, metrics_host: str | None = None) -> rpc.Server:
    """A rollout server (of `servicer`, a new one by default); Prometheus metrics at
    http://<metrics_host, default address's host>:<metrics_port>/metrics when given."""
    servicer = servicer or RolloutServicer()
    server = rpc.create_server(
        lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s),
        (SERVICE_NAME,),
        address=address,
        token=token,
        max_workers=SERVER_THREADS,
    )
    server.on_stop.append(servicer.close)
    servicer.shutdown = server.shutdown
    if metrics_port is not None:
        telemetry.serve(server, servicer.metrics.registry, f"{metrics_host}:0" if metrics_host else address, metrics_port)
    server.set_serving(True)
    return server
