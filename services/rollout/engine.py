"""The built-in rollout engine (`engine: torch`): a model, its tokenizer, the weight version it
serves, whether it is in the generation pool, and the paged generation core that runs it.

Every caller's request joins one running batch (`services.rollout.builtin.scheduler`), served
round by round by the engine's serving thread under the engine's lock. Weight updates are staged
outside the model and verified before anything is copied in; the copy (or, on a CPU, the
adoption of the staged buffers) happens under that lock, between rounds, so no token is sampled
from a mix of two versions. What happens to the rows running then is the update's policy
(`UPDATE_POLICIES`): `drain` waits for every started request to finish and admits no new one
meanwhile (each call's tokens from one version), `pause` swaps between two rounds and the rows
go on under the new weights (each completion says which tokens came from which version), `abort`
ends the running rows with their tokens so far. On a GPU updates always copy
into the weights' own memory: captured decode graphs hold those addresses. After an update that
failed past validation the engine leaves the pool (`serving` false) until a full update succeeds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from services import devices
from services.models import load_hf_dir, load_tokenizer, memory
from services.models.checkpoint import checkpoint_step, load_config
from services.models.decoder import DecoderLM, init_weights, torch_dtype
from services.rollout.builtin.core import CoreSettings, GenerationCore
from services.rollout.builtin.scheduler import Request
from services.rollout.types import EngineLoad, Generation, Sampling
from services.weights import capabilities
from services.weights.apply import adoption_plan, load_buckets_into, named_weights
from services.weights.buckets import Manifest, dtype_name, pack_bucket, parse_dtype, plan_buckets
from services.weights.errors import WeightSyncError
from services.weights.fingerprint import fingerprint
from services.weights.manifest import ManifestReader


log = logging.getLogger("rlfleet.rollout")


class EngineUnavailable(RuntimeError):
    """The engine is out of the generation pool (a failed update, or memory released)."""


class EngineStateError(RuntimeError):
    """A call the engine's memory state does not allow (an update while weights are released)."""


MEMORY_TAGS = ("weights", "kv_cache")
UPDATE_POLICIES = ("drain", "pause", "abort")
_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # torch >= 2.13


@dataclass(frozen=True, kw_only=True)
class SglangSettings:
    """engine sglang: attach to `url`, or start `command` (default: python -m sglang.launch_server)."""

    url: str = ""
    args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    startup_timeout_s: float = 600.0
    memory_saver: bool = False
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("startup_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            if not (value == value and 0 < value <= 86400):  # NaN fails the first test
                raise ValueError(f"sglang.{name}: must be seconds in (0, 86400], got {value}")
        if "--api-key" in self.args:
            raise ValueError("sglang.args: --api-key is set by rlfleet (a random key per child); remove it")


@dataclass(frozen=True, kw_only=True)
class RolloutSettings:
    model_path: str
    engine: str = "torch"  # which engine: checked by protocol.build_engine, the registry
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    max_batch_size: int = 256
    load_weights: bool = True
    kv_cache_fraction: float = 0.5  # of the device memory free when the KV pool is made (GPU)
    cuda_graphs: bool = True
    prefix_cache: bool = False  # share KV blocks across requests by prompt prefix (`builtin/prefix_cache.py`)
    sglang: SglangSettings = SglangSettings()

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path: required")
        devices.parse(self.device)
        torch_dtype(self.dtype)
        self.core_settings()  # names a bad field

    def core_settings(self) -> CoreSettings:
        return CoreSettings(max_batch_size=self.max_batch_size, kv_cache_fraction=self.kv_cache_fraction,
                            cuda_graphs=self.cuda_graphs, prefix_cache=self.prefix_cache)


class RolloutEngine:
    def __init__(self, settings: RolloutSettings):
        self.settings = settings
        self.device = torch.device(settings.device)
        dtype = parse_dtype(settings.dtype)
        if settings.load_weights:
            self.model_config, self.model = load_hf_dir(settings.model_path, dtype=dtype, device=self.device)
        else:
            self.model_config = load_config(settings.model_path)
            self.model = DecoderLM(self.model_config).to(device=self.device, dtype=dtype)
            init_weights(self.model, seed=settings.seed)
        self.model.eval()
        self.tokenizer = load_tokenizer(settings.model_path)
        self.checkpoint_step = checkpoint_step(settings.model_path) if settings.load_weights else 0
        self.weight_version = 0
        self.serving = True
        self.last_error = ""
        self.released: set[str] = set()
        self._params = list(self.model.parameters())
        self._named = dict(named_weights(self.model))  # the same tensor objects for the engine's life
        memory.make_resizable(self._params)
        self.core = GenerationCore(self.model, self.tokenizer, self.device, settings.core_settings())
        self._param_sizes: list[int] = []
        self.last_apply_seconds = 0.0  # of the last update: loading verified buckets into the model
        self._manifests = ManifestReader(self.expected_tensors())
        # After adopting buffers of its own (`owned`), the model's weights are views of one storage
        # per bucket: (the buckets' layout, those storages). An update with the same layout then
        # swaps each storage's memory with its new buffer's, one swap per bucket.
        self._arranged: tuple[tuple, list[torch.UntypedStorage]] | None = None
        self.swapped = False  # whether the last `apply` swapped memory (see there)
        self.holds_buffers = False  # whether the model took the last `apply`'s buffers as its weights
        self.keeps_staging = True  # the next update is received into the set the model does not hold
        self._plans: list[tuple[tuple, list]] = []  # adoption plans of owned buffer sets, newest first
        self._lock = threading.Lock()  # the model, its pool and the batch: held for a round, or an update
        # Threads that want the lock (an update, a submission) make the serving thread wait for them
        # between rounds: a lock is not fair, and the serving thread would take it straight back.
        self._turns = threading.Condition()
        self._wanted = 0
        self._inbox: list[Request] = []  # submitted, not yet in the batch (under `_turns`)
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def max_positions(self) -> int:
        return self.model_config.max_position_embeddings

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    streams = True  # `submit` reports each completion as it finishes
    update_policies = UPDATE_POLICIES

    def submit(self, prompts_ids: list[list[int]], sampling: Sampling, *, cancelled: Callable[[], bool] | None = None,
               on_result: Callable[[int, Generation], None] | None = None, priority: str = "train",
               on_finish: Callable[[Request], None] | None = None) -> Request:
        """Queue a request into the running batch (ValueError naming the field if the model
        cannot take it; EngineUnavailable if the engine is out of the pool). `cancelled` is polled
        every round; `on_result(index, generation)` sees each completion as it finishes, and
        `on_finish(request)` the request's end (its `error` None when every row came back)."""
        request = self.core.request(prompts_ids, sampling, cancelled=cancelled, on_result=on_result,
                                    priority=priority, on_finish=on_finish)
        if self.core.scheduler is None:  # the first request makes the pool and the scheduler
            with self._turn():
                self._check_serving_locked()
                self.core.prepare(request)
        # Into the inbox, not the scheduler: a submission never waits for a round, nor makes the
        # serving thread wait for it (under hundreds of callers, taking turns with the serving
        # thread left the device idle a third of the time). The serving thread moves the inbox
        # into the batch before each round, and fails what it holds if the engine left the pool
        # meanwhile.
        with self._turns:
            if self._closed:
                raise EngineUnavailable("engine closed (reconfigured or shutting down)")
            self._check_serving_locked()
            self._inbox.append(request)
            self._start_locked()
        return request

    def generate(self, prompts_ids: list[list[int]], sampling: Sampling,
                 cancelled: Callable[[], bool] | None = None, *, priority: str = "train",
                 on_result: Callable[[int, Generation], None] | None = None) -> tuple[list[Generation], int]:
        """Completions and the oldest weight version any of their tokens came from (each
        completion's `versions` says which tokens came from which). `cancelled` is polled every
        round; when it says so the call stops (GenerationCancelled)."""
        request = self.submit(prompts_ids, sampling, cancelled=cancelled, on_result=on_result, priority=priority)
        results = request.wait()
        return results, min((g.versions[0][0] for g in results if g.versions), default=self.weight_version)

    def load(self) -> EngineLoad:
        """The running batch now and the scheduler's counters (zeros before the first request)."""
        with self._turn():
            s = self.core.scheduler
            if s is None:
                return EngineLoad()
            prefix = s.prefix
            prefill_s, decode_s, host_s = s.seconds_spent()
            with self._turns:
                inbox = list(self._inbox)
            return EngineLoad(prefill_s=prefill_s, decode_s=decode_s, host_s=host_s, rows_running=s.rows_running,
                              rows_waiting=s.rows_waiting + sum(len(r.results) for r in inbox),
                              requests_live=len(s.live()) + len(inbox), rounds=s.rounds_run,
                              decode_steps=s.steps_run, row_steps=s.row_steps, prefills=s.prefills_run, preempted=s.preempted,
                              prefix_lookup_tokens=prefix.lookup_tokens if prefix else 0,
                              prefix_hit_tokens=prefix.hit_tokens if prefix else 0)

    def _check_serving_locked(self) -> None:
        if self.released:
            raise EngineUnavailable(f"engine memory is released ({', '.join(sorted(self.released))}): call ResumeMemory")
        if not self.serving:
            raise EngineUnavailable(f"engine is out of the generation pool: {self.last_error}")

    @contextlib.contextmanager
    def _turn(self):
        """The engine's lock, taken between two rounds of the serving thread."""
        with self._turns:
            self._wanted += 1
        try:
            with self._lock:
                yield
        finally:
            with self._turns:
                self._wanted -= 1
                self._turns.notify_all()

    def _start_locked(self) -> None:
        """(`_turns` held.)"""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="rollout-serving", daemon=True)
            self._thread.start()
        self._turns.notify_all()

    def _take_inbox_locked(self) -> None:
        """(The engine's lock held.) Submitted requests into the batch, or their error if the
        engine cannot serve them now."""
        with self._turns:
            inbox, self._inbox = self._inbox, []
        for request in inbox:
            try:
                self._check_serving_locked()
                self.core.submit(request)
            except Exception as e:  # noqa: BLE001 (the request is given it: its caller raises it)
                request.finish(e)

    def _serve(self) -> None:
        """The serving thread: rounds of the running batch while it has work."""
        devices.use(self.device)
        while True:
            with self._turns:
                while not self._closed and (self._wanted or not (self._inbox or self.core.busy)):
                    self._turns.wait()
                if self._closed:
                    return
            with self._lock:
                try:
                    self._take_inbox_locked()
                    if (self.released or not self.serving) and self.core.scheduler is not None:
                        self.core.scheduler.fail(EngineUnavailable(
                            f"engine is out of the generation pool: {self.last_error or 'memory released'}"))
                    elif self.core.busy:
                        self.core.round()
                except Exception:  # noqa: BLE001 (the round failed its requests with it)
                    log.exception("a round of the running batch failed; its requests were given the error")
            with self._turns:
                self._turns.notify_all()  # a drain waits for requests to finish

    @contextlib.contextmanager
    def _quiet(self):
        """No request that has not started is admitted, and those started finish (a drain)."""
        with self._turn():
            scheduler = self.core.scheduler
            if scheduler is not None:
                scheduler.hold_new = True
        try:
            with self._turns:
                while self.core.scheduler is not None and self.core.scheduler.started():
                    self._turns.wait(0.05)
            yield
        finally:
            with self._turn():
                if self.core.scheduler is not None:
                    self.core.scheduler.hold_new = False
            with self._turns:
                self._turns.notify_all()

    def expected_tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in self._named.items()}

    def read_manifest(self, msg) -> Manifest:
        """A received manifest, converted and validated against this model (ManifestMismatch if
        it does not fit); a layout already validated is not checked tensor by tensor again."""
        return self._manifests.read(msg)

    def apply(self, manifest: Manifest, buffers: list[torch.Tensor], *, read_back: bool = False, adopt: bool = False,
              owned: bool = False, policy: str = "drain") -> int:
        """Copy verified buckets into the model and switch to the manifest's version atomically.

        With `read_back` (exact verification) the loaded weights are packed again and compared
        with the manifest, proving the model holds exactly the trainer's bytes. With `adopt` the
        model takes the verified buffers as its weights instead of copying them.

        `owned` buffers are the caller's own whole storages (one per bucket, e.g. staging). Once
        the model holds such buffers, a later update of the same layout swaps memory with them:
        the model's storages take the new bytes and `buffers` are left holding the previous
        weights, free for the caller to reuse. Returns the bytes loaded; `swapped` tells which.
        (Swapping needs torch >= 2.13; before that, owned buffers are adopted tensor by tensor
        with the views made once per buffer set.)

        `policy` (`UPDATE_POLICIES`) says what becomes of the rows running: see the module's doc."""
        if policy not in UPDATE_POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(UPDATE_POLICIES)}, got {policy!r}")
        quiet = self._quiet() if policy == "drain" else contextlib.nullcontext()
        with quiet, self._turn():
            try:
                return self._apply_locked(manifest, buffers, read_back, adopt, owned, policy)
            except BaseException as e:
                if self.core.scheduler is not None:  # rows that ran on weights now half loaded end here
                    self.core.scheduler.fail(EngineUnavailable(f"weight update to version {manifest.version} "
                                                               f"failed while this request ran: {e}"),
                                             self.core.scheduler.started())
                raise

    def _apply_locked(self, manifest: Manifest, buffers: list[torch.Tensor], read_back: bool, adopt: bool,
                      owned: bool, policy: str) -> int:
        started = time.perf_counter()
        adopt = adopt and not self.core.stable_weights
        if "weights" in self.released:
            raise EngineStateError("UpdateWeights: weights are released; call ResumeMemory(weights) first")
        if policy == "abort" and self.core.scheduler is not None:
            self.core.scheduler.abort_running()
        layout = _layout(manifest) if adopt and owned else None
        self.swapped = layout is not None and self._swap_locked(layout, buffers)
        if self.swapped:
            copied = manifest.total_bytes
        else:
            plan = self._plan_locked(layout, manifest, buffers) if layout is not None else None
            copied = load_buckets_into(self._named, manifest, buffers, adopt=adopt, plan=plan)
            self._arranged = (layout, [b.untyped_storage() for b in buffers]) \
                if layout is not None and all(_whole(b) for b in buffers) else None
        actual = self._fingerprints_locked(manifest.buckets, manifest.fingerprint_algo) if read_back else []
        expected = [b.fingerprint for b in manifest.buckets]
        if read_back and actual != expected:
            bad = next(i for i, (a, e) in enumerate(zip(actual, expected)) if a != e)
            self._leave_pool_locked(f"bucket {bad} reads back as {actual[bad]}, expected {expected[bad]}")
            raise WeightSyncError(f"weights did not verify after loading: {self.last_error}")
        self.holds_buffers = adopt and not self.swapped
        self.weight_version = manifest.version
        self.core.set_version(manifest.version)
        self.serving, self.last_error = True, ""
        self.last_apply_seconds = time.perf_counter() - started
        return copied

    def _plan_locked(self, layout: tuple, manifest: Manifest, buffers: list[torch.Tensor]) -> list:
        """The adoption plan for owned buffers, kept for the last two buffer sets (staging's two)."""
        key = (layout, tuple(b.data_ptr() for b in buffers))
        for cached_key, plan in self._plans:
            # The cached views keep their storages alive, so an address names the same storage,
            # as long as no swap moved memory between storages (a swap drops every plan).
            if cached_key == key:
                return plan
        plan = adoption_plan(self._named, manifest, buffers)
        self._plans = [(key, plan)] + self._plans[:1]
        return plan

    def _swap_locked(self, layout: tuple, buffers: list[torch.Tensor]) -> bool:
        """Swap the model's bucket storages with `buffers` if the model is laid out as `layout`."""
        if not _CAN_SWAP or self._arranged is None or self._arranged[0] != layout:
            return False
        storages = self._arranged[1]
        if len(buffers) != len(storages) or not all(
            _whole(b) and b.untyped_storage().device == s.device and b.untyped_storage().nbytes() == s.nbytes()
            for b, s in zip(buffers, storages)
        ):
            return False
        for storage, flat in zip(storages, buffers):
            storage._swap_data_ptr_(flat.untyped_storage())  # noqa: SLF001 (every view of it sees the new bytes)
        # A plan kept for these buffers' old addresses holds views of storages that now hold other
        # memory: loaded later (after an shm update reset the layout), it would serve old bytes.
        self._plans = []
        return True

    def leave_pool(self, reason: str) -> None:
        with self._turn():
            self._leave_pool_locked(reason)

    def _leave_pool_locked(self, reason: str) -> None:
        self.serving, self.last_error = False, reason

    def _fingerprints_locked(self, buckets, algo: str) -> list[str]:
        """Fingerprints of the model's weights laid out as `buckets` (caller holds the lock)."""
        tensors = self._named
        with torch.no_grad():
            return [fingerprint(pack_bucket(b, tensors), algo) for b in buckets]

    def release_memory(self, tags: list[str]) -> None:
        """Free device memory by tag. Released weights lose their values: the engine serves again
        only after ResumeMemory and a full weight update."""
        tags = _check_tags(tags)
        with self._quiet(), self._turn():
            if self.core.scheduler is not None:  # requests not started cannot run without the memory
                self.core.scheduler.fail(EngineUnavailable(f"engine memory released ({', '.join(tags)}) before "
                                                           "this request started: resubmit after ResumeMemory"))
            if "kv_cache" in tags:
                self.core.release()  # the KV pool, and the graphs that hold its addresses
            if "weights" in tags:
                self.core.drop_graphs()  # they hold the weights' addresses, which reallocating moves
            if "weights" in tags and "weights" not in self.released:
                self._arranged, self._plans = None, []
                memory.drop_fixed_storage(self._params)  # adopted shm segments are the trainer's
                self._param_sizes = memory.release(self._params)
                self._leave_pool_locked("weights were released; waiting for a full weight update")
            self.released |= set(tags)

    def resume_memory(self, tags: list[str]) -> None:
        tags = _check_tags(tags)
        with self._turn():
            if "weights" in tags and "weights" in self.released:
                memory.reallocate(self._params, self._param_sizes)
            self.released -= set(tags)

    def fingerprints(self, algo: str, bucket_bytes: int) -> list[str]:
        with self._turn():
            if "weights" in self.released:
                raise EngineStateError("GetWeightFingerprints: weights are released")
            return self._fingerprints_locked(plan_buckets(named_weights(self.model), bucket_bytes), algo)

    def capabilities(self):
        return capabilities.local(self.device)

    def close(self) -> None:
        """Stop the serving thread; requests still live end with EngineUnavailable."""
        with self._turns:
            self._closed = True
            self._turns.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._lock:
            with self._turns:
                inbox, self._inbox = self._inbox, []
            for request in inbox:
                request.finish(EngineUnavailable("engine closed (reconfigured or shutting down)"))
            if self.core.scheduler is not None:
                self.core.scheduler.fail(EngineUnavailable("engine closed (reconfigured or shutting down)"))


def _layout(manifest: Manifest) -> tuple:
    """What must match for a swap: every bucket's dtype, size and tensors (names, offsets, shapes)."""
    return tuple((b.dtype, b.nbytes, b.tensors) for b in manifest.buckets)


def _whole(flat: torch.Tensor) -> bool:
    """A flat uint8 tensor that is its storage, all of it."""
    return flat.storage_offset() == 0 and flat.numel() == flat.untyped_storage().nbytes()


def _check_tags(tags: list[str]) -> list[str]:
    for tag in tags:
        if tag not in MEMORY_TAGS:
            raise ValueError(f"tags: unknown memory tag {tag!r} (expected {' or '.join(MEMORY_TAGS)})")
    return list(tags) or list(MEMORY_TAGS)
