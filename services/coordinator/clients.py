"""The coordinator's adapters to trainer and rollout servers.

Only this module speaks protobuf to the workers: the RL loop calls plain methods with domain
values, every call carries a deadline, and gRPC failures come back as `PeerError` naming the
peer and the call, chained to the original error.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc

from services import rpc
from services.api import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weights_pb2


class PeerError(RuntimeError):
    """A call to a trainer or rollout server failed."""

    def __init__(self, peer: str, call: str, code: grpc.StatusCode | None, details: str):
        self.peer, self.call, self.code, self.details = peer, call, code, details
        name = code.name if code is not None else "ERROR"
        super().__init__(f"{call} on {peer} failed ({name}): {details}")


@dataclass(frozen=True, slots=True)
class Completion:
    """One sample. Its token sequences are read-only: from a Generate reply they are the reply's
    own repeated fields (no copy; a step has thousands of samples, and a Python object for every
    token and logprob was most of the coordinator's time and of its garbage collector's)."""

    prompt_index: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    text: str
    logprobs: Sequence[float]
    finish_reason: str
    weight_version: int  # of its first token
    versions: tuple[tuple[int, int], ...] = ()  # (weight version, tokens) runs over output_ids, where reported
    loss_mask: Sequence[float] = ()  # per output token (an episode's: 0 on observations); empty: all 1


class _Client:
    def __init__(self, address: str, token: str | None, deadline_s: float):
        self.address = address
        self.deadline_s = deadline_s
        self._token = token
        self._channel = rpc.open_channel(address, token)

    def close(self) -> None:
        self._channel.close()

    @contextlib.contextmanager
    def _call(self, name: str):
        try:
            yield
        except grpc.RpcError as e:
            raise PeerError(self.address, name, e.code(), e.details()) from e


class Pending:
    """A call under way (a gRPC future, or a FanOut's): `result()` waits for its reply, or raises
    PeerError."""

    def __init__(self, client: _Client, name: str, future, then: Callable | None = None):
        self._client, self._name, self._future, self._then = client, name, future, then

    def result(self):
        with self._client._call(self._name):
            reply = self._future.result()
        return self._then(reply) if self._then is not None else reply


def wait_all(pending: list[Pending]) -> None:
    """Until every call has its reply or its error: one wake-up for a whole fan-out, where
    waiting on each in turn woke the caller (and took the GIL from the thread reading replies)
    once a call."""
    wait([p._future for p in pending if isinstance(p._future, Future)])  # (a channel's own future: by result())


class TrainerClient(_Client):
    def __init__(self, address: str, token: str | None = None, deadline_s: float = rpc.DEFAULT_DEADLINE_S):
        super().__init__(address, token, deadline_s)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    def configure(self, config: trainer_pb2.TrainerConfig) -> trainer_pb2.TrainerStatus:
        with self._call("Configure"):
            reply = self._stub.Configure(trainer_pb2.ConfigureTrainerRequest(config=config), timeout=self.deadline_s)
        self.capabilities = reply.capabilities
        return reply.status

    def status(self, timeout_s: float = 30.0) -> trainer_pb2.TrainerStatus:
        with self._call("GetStatus"):
            return self._stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=timeout_s)

    def sleep(self) -> trainer_pb2.LifecycleStatus:
        with self._call("Sleep"):
            return self._stub.Sleep(trainer_pb2.SleepRequest(), timeout=self.deadline_s).status

    def wake_up(self) -> trainer_pb2.LifecycleStatus:
        with self._call("WakeUp"):
            return self._stub.WakeUp(trainer_pb2.WakeUpRequest(), timeout=self.deadline_s).status

    def compute_logprobs(self, tag: str, batch: trainer_pb2.Batch) -> list[list[float]]:
        with self._call("ComputeLogProbs"):
            reply = self._stub.ComputeLogProbs(
                trainer_pb2.ComputeLogProbsRequest(tag=tag, batch=batch), timeout=self.deadline_s
            )
        return [list(r.values) for r in reply.results]

    def compute_values(self, batch: trainer_pb2.Batch) -> list[list[float]]:
        """A critic's values, one per response token of every sample."""
        with self._call("ComputeValues"):
            reply = self._stub.ComputeValues(trainer_pb2.ComputeValuesRequest(batch=batch), timeout=self.deadline_s)
        return [list(r.values) for r in reply.results]

    def train_step(
        self, batch: trainer_pb2.Batch, *, sft: bool = False, value: bool = False, lr: float = 0.0
    ) -> tuple[dict[str, float], int]:
        """One optimizer step: the policy loss, the SFT loss (`sft`) or a critic's value loss (`value`)."""
        loss = (trainer_pb2.LOSS_KIND_VALUE if value else
                trainer_pb2.LOSS_KIND_SFT if sft else trainer_pb2.LOSS_KIND_POLICY)
        request = trainer_pb2.TrainStepRequest(batch=batch, loss=loss, lr=lr)
        with self._call("TrainStep"):
            reply = self._stub.TrainStep(request, timeout=self.deadline_s)
        return dict(reply.metrics), reply.weights_version

    # The calls of a weight sync take the sync's timeout (`timeout_s`): a trainer that stalls
    # mid-sync fails it in that time, as a stalled engine does, not at the client's deadline.
    def weight_manifest(self, fingerprint_algo: str = "", plane: int = 0,
                        timeout_s: float | None = None) -> weights_pb2.WeightManifest:
        request = trainer_pb2.GetWeightManifestRequest(fingerprint_algo=fingerprint_algo, plane=plane)
        with self._call("GetWeightManifest"):
            return self._stub.GetWeightManifest(request, timeout=self._sync_deadline(timeout_s)).manifest

    def push_weights(
        self, plane: int, version: int | None, broadcast: weights_pb2.BroadcastSource | None = None,
        fingerprint_algo: str = "", timeout_s: float | None = None,
    ) -> trainer_pb2.PushWeightsResponse:
        """Version None pushes the current weights, making their manifest in the same call."""
        request = trainer_pb2.PushWeightsRequest(
            plane=plane, version=version or 0, current=version is None, broadcast=broadcast,
            fingerprint_algo=fingerprint_algo,
        )
        with self._call("PushWeights"):
            return self._stub.PushWeights(request, timeout=self._sync_deadline(timeout_s))

    def release_weights(self, version: int, timeout_s: float | None = None) -> None:
        with self._call("ReleaseWeights"):
            self._stub.ReleaseWeights(trainer_pb2.ReleaseWeightsRequest(version=version),
                                      timeout=self._sync_deadline(timeout_s))

    def _sync_deadline(self, timeout_s: float | None) -> float:
        return self.deadline_s if timeout_s is None else timeout_s * 1.1 + 2

    def init_weight_update_group(self, name: str, world_size: int, backend: str, timeout_s: float) -> int:
        """Rank 0's side: returns the port its store listens on (the group forms as engines join)."""
        request = weights_pb2.InitWeightUpdateGroupRequest(
            group_name=name, world_size=world_size, rank_offset=0, backend=backend, timeout_s=timeout_s
        )
        with self._call("InitWeightUpdateGroup"):
            return self._stub.InitWeightUpdateGroup(request, timeout=60).master_port

    def destroy_weight_update_group(self, name: str) -> None:
        with self._call("DestroyWeightUpdateGroup"):
            self._stub.DestroyWeightUpdateGroup(weights_pb2.DestroyWeightUpdateGroupRequest(group_name=name), timeout=10)

    def save_checkpoint(self, path: str, *, include_optimizer: bool = True) -> int:
        request = trainer_pb2.SaveCheckpointRequest(path=path, include_optimizer=include_optimizer)
        with self._call("SaveCheckpoint"):
            return self._stub.SaveCheckpoint(request, timeout=self.deadline_s).step

    def load_checkpoint(self, path: str, *, load_optimizer: bool = True) -> int:
        request = trainer_pb2.LoadCheckpointRequest(path=path, load_optimizer=load_optimizer)
        with self._call("LoadCheckpoint"):
            return self._stub.LoadCheckpoint(request, timeout=self.deadline_s).step

    def shutdown(self, reason: str) -> None:
        with self._call("Shutdown"):
            self._stub.Shutdown(weights_pb2.ShutdownRequest(reason=reason), timeout=30)

    def open_rank_group(self, world_size: int, timeout_s: float) -> int:
        """Rank 0's side: the port of the store the other ranks join."""
        request = trainer_pb2.OpenRankGroupRequest(world_size=world_size, timeout_s=timeout_s)
        with self._call("OpenRankGroup"):
            return self._stub.OpenRankGroup(request, timeout=60).port


class TrainerGroup:
    """The trainer ranks of a job, called as one model (SPMD): every rank gets the same call at
    once, and rank 0's answer is the group's. Rank 0 is also the weight source of every sync.

    A rank that fails fails the call; the ranks still inside a collective with it give up at
    the group's collective timeout (see services/trainer/ranks.py).
    """

    def __init__(self, ranks: list[TrainerClient], timeout_s: float = 600.0):
        if not ranks:
            raise ValueError("trainer group: no ranks")
        self.ranks, self.timeout_s = ranks, timeout_s
        self._pool = ThreadPoolExecutor(len(ranks), thread_name_prefix="trainer-rank")

    @property
    def source(self) -> TrainerClient:
        return self.ranks[0]

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _all(self, call):
        """call(client, rank) on every rank at once; rank 0's result, or the first error by rank."""
        futures = [self._pool.submit(call, client, rank) for rank, client in enumerate(self.ranks)]
        results, errors = [], []
        for fut in futures:
            try:
                results.append(fut.result())
            except PeerError as e:
                errors.append(e)
        if errors:  # the root cause first: a rank's own error, not a peer's collective timeout
            errors.sort(key=lambda e: e.code == grpc.StatusCode.UNAVAILABLE)
            raise errors[0]
        return results[0]

    def configure(self, config: trainer_pb2.TrainerConfig) -> trainer_pb2.TrainerStatus:
        world = len(self.ranks)
        address = ""
        if world > 1:
            port = self.source.open_rank_group(world, self.timeout_s)
            address = f"{self.source.address.rpartition(':')[0]}:{port}"

        def configure_rank(client: TrainerClient, rank: int) -> trainer_pb2.TrainerStatus:
            mine = trainer_pb2.TrainerConfig()
            mine.CopyFrom(config)
            if world > 1:
                mine.ranks.CopyFrom(trainer_pb2.RankGroup(
                    rank=rank, world_size=world, address="" if rank == 0 else address, timeout_s=self.timeout_s))
            return client.configure(mine)

        return self._all(configure_rank)

    def sleep(self) -> trainer_pb2.LifecycleStatus:
        return self._all(lambda client, _: client.sleep())

    def wake_up(self) -> trainer_pb2.LifecycleStatus:
        return self._all(lambda client, _: client.wake_up())

    def compute_logprobs(self, tag: str, batch: trainer_pb2.Batch) -> list[list[float]]:
        return self._all(lambda client, _: client.compute_logprobs(tag, batch))

    def compute_values(self, batch: trainer_pb2.Batch) -> list[list[float]]:
        return self._all(lambda client, _: client.compute_values(batch))

    def train_step(self, batch: trainer_pb2.Batch, *, sft: bool = False, value: bool = False,
                   lr: float = 0.0) -> tuple[dict[str, float], int]:
        return self._all(lambda client, _: client.train_step(batch, sft=sft, value=value, lr=lr))

    def save_checkpoint(self, path: str, *, include_optimizer: bool = True) -> int:
        return self._all(lambda client, _: client.save_checkpoint(path, include_optimizer=include_optimizer))

    def load_checkpoint(self, path: str, *, load_optimizer: bool = True) -> int:
        return self._all(lambda client, _: client.load_checkpoint(path, load_optimizer=load_optimizer))


class RolloutClient(_Client):
    def __init__(self, address: str, token: str | None = None, deadline_s: float = rpc.DEFAULT_DEADLINE_S):
        super().__init__(address, token, deadline_s)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)

    def configure(self, config: rollout_pb2.RolloutConfig) -> rollout_pb2.RolloutStatus:
        with self._call("Configure"):
            reply = self._stub.Configure(rollout_pb2.ConfigureRolloutRequest(config=config), timeout=self.deadline_s)
        self.capabilities = reply.capabilities
        return reply.status

    def status(self, timeout_s: float = 30.0) -> rollout_pb2.RolloutStatus:
        with self._call("GetStatus"):
            return self._stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=timeout_s)

    def generate(
        self, prompts: list[str], sampling: rollout_pb2.SamplingParams, *, return_logprobs: bool = True,
        priority: str = "train",
    ) -> list[Completion]:
        return self.generate_async(prompts, sampling, return_logprobs=return_logprobs, priority=priority).result()

    def generate_async(
        self, prompts: list[str], sampling: rollout_pb2.SamplingParams, *, return_logprobs: bool = True,
        priority: str = "train", fanout: rpc.FanOut | None = None,
    ) -> Pending:
        """`generate` started and not waited for (many engines' calls without a thread each:
        pass the caller's `fanout`); `result()` is the completions. `prompts` are texts, or token ids."""
        request = rollout_pb2.GenerateRequest(
            sampling=sampling,
            return_logprobs=return_logprobs,
            priority=rollout_pb2.PRIORITY_EVAL if priority == "eval" else rollout_pb2.PRIORITY_TRAIN,
        )
        if prompts and not isinstance(prompts[0], str):  # token ids (an episode's sequence so far)
            request.input_ids.extend(rollout_pb2.TokenIds(ids=ids) for ids in prompts)
        else:
            request.prompts.extend(prompts)
        reasons = {rollout_pb2.FINISH_REASON_STOP: "stop", rollout_pb2.FINISH_REASON_LENGTH: "length"}
        def completions(reply: rollout_pb2.GenerateResponse) -> list[Completion]:
            return self._completions(reply.results, reasons)

        with self._call("Generate"):
            if fanout is None:
                return Pending(self, "Generate", self._stub.Generate.future(request, timeout=self.deadline_s),
                               completions)
            return Pending(self, "Generate", fanout.call(self.address, self._token, rollout_pb2_grpc.RolloutStub,
                                                         "Generate", request, self.deadline_s, then=completions))

    @classmethod
    def _completions(cls, results, reasons) -> list[Completion]:
        runs: dict = {}  # one tuple for equal version runs (most samples of a reply share them)
        return [cls._completion(c, reasons, runs) for c in results]

    @staticmethod
    def _completion(c, reasons, runs: dict | None = None) -> Completion:
        versions = tuple([(r.version, r.tokens) for r in c.version_runs])
        if runs is not None:  # (kept objects are what the garbage collector walks; a step keeps thousands)
            versions = runs.setdefault(versions, versions)
        return Completion(
            prompt_index=c.prompt_index,
            prompt_ids=c.prompt_ids,  # (the reply's repeated fields themselves: see Completion)
            output_ids=c.output_ids,
            text=c.text,
            logprobs=c.logprobs,
            finish_reason=reasons.get(c.finish_reason, "abort"),
            weight_version=c.weight_version,
            versions=versions,
        )

    def generate_stream(self, prompts_ids: list[list[int]], sampling: rollout_pb2.SamplingParams, *,
                        return_logprobs: bool = True, priority: str = "train"):
        """(index, Completion) for each completion as it finishes (GenerateStream)."""
        request = rollout_pb2.GenerateRequest(
            input_ids=[rollout_pb2.TokenIds(ids=ids) for ids in prompts_ids], sampling=sampling,
            return_logprobs=return_logprobs,
            priority=rollout_pb2.PRIORITY_EVAL if priority == "eval" else rollout_pb2.PRIORITY_TRAIN)
        reasons = {rollout_pb2.FINISH_REASON_STOP: "stop", rollout_pb2.FINISH_REASON_LENGTH: "length"}
        with self._call("GenerateStream"):
            for item in self._stub.GenerateStream(request, timeout=self.deadline_s):
                yield item.index, self._completion(item.completion, reasons)

    def update_weights(
        self, manifest: weights_pb2.WeightManifest, timeout_s: float, exact: bool = False, *, policy: str = "drain",
        **source
    ) -> rollout_pb2.UpdateWeightsResponse:
        """`source` is one of trainer=, broadcast=, shm=, cuda_ipc= (the UpdateWeights oneof);
        `policy` drain, pause or abort (what becomes of rows generating meanwhile)."""
        return self.update_weights_async(manifest, timeout_s, exact, policy=policy, **source).result()

    def update_weights_async(self, manifest: weights_pb2.WeightManifest, timeout_s: float, exact: bool = False, *,
                             policy: str = "drain", fanout: rpc.FanOut | None = None, **source) -> Pending:
        """`update_weights` started and not waited for: one sync reaches hundreds of engines
        without a thread each (with the caller's `fanout`)."""
        verify = weights_pb2.VERIFY_MODE_EXACT if exact else weights_pb2.VERIFY_MODE_FINGERPRINT
        request = rollout_pb2.UpdateWeightsRequest(
            version=manifest.version, manifest=manifest, timeout_s=timeout_s, verify=verify,
            policy=rollout_pb2.UpdatePolicy.Value(f"UPDATE_POLICY_{policy.upper()}"), **source
        )
        with self._call("UpdateWeights"):  # the sync's timeout bounds the whole call, with a little grace
            return Pending(self, "UpdateWeights", self._start(fanout, "UpdateWeights", request, timeout_s * 1.1 + 2))

    def _start(self, fanout: rpc.FanOut | None, method: str, request, timeout: float):
        """A call started: on `fanout` (one loop for every engine), else as this channel's future."""
        if fanout is None:
            return getattr(self._stub, method).future(request, timeout=timeout)
        return fanout.call(self.address, self._token, rollout_pb2_grpc.RolloutStub, method, request, timeout)

    def init_weight_update_group(
        self, host: str, port: int, rank: int, world_size: int, name: str, backend: str, timeout_s: float
    ) -> None:
        self.init_weight_update_group_async(host, port, rank, world_size, name, backend, timeout_s).result()

    def init_weight_update_group_async(
        self, host: str, port: int, rank: int, world_size: int, name: str, backend: str, timeout_s: float
    ) -> Pending:
        """The join started, not waited for: every member of a group must be joining at once."""
        request = weights_pb2.InitWeightUpdateGroupRequest(
            master_address=host, master_port=port, rank_offset=rank, world_size=world_size,
            group_name=name, backend=backend, timeout_s=timeout_s,
        )
        with self._call("InitWeightUpdateGroup"):
            return Pending(self, "InitWeightUpdateGroup",
                           self._stub.InitWeightUpdateGroup.future(request, timeout=timeout_s + 30))

    def destroy_weight_update_group(self, name: str) -> None:
        with self._call("DestroyWeightUpdateGroup"):
            self._stub.DestroyWeightUpdateGroup(weights_pb2.DestroyWeightUpdateGroupRequest(group_name=name), timeout=10)

    def shutdown(self, reason: str) -> None:
        with self._call("Shutdown"):
            self._stub.Shutdown(weights_pb2.ShutdownRequest(reason=reason), timeout=30)

    def release_memory(self, tags: list[str]) -> rollout_pb2.RolloutStatus:
        with self._call("ReleaseMemory"):
            return self._stub.ReleaseMemory(rollout_pb2.ReleaseMemoryRequest(tags=tags), timeout=self.deadline_s).status

    def resume_memory(self, tags: list[str]) -> rollout_pb2.RolloutStatus:
        with self._call("ResumeMemory"):
            return self._stub.ResumeMemory(rollout_pb2.ResumeMemoryRequest(tags=tags), timeout=self.deadline_s).status

    def fingerprints(self, algo: str, bucket_bytes: int) -> tuple[int, list[str]]:
        with self._call("GetWeightFingerprints"):
            reply = self._stub.GetWeightFingerprints(
                rollout_pb2.GetWeightFingerprintsRequest(fingerprint_algo=algo, bucket_bytes=bucket_bytes),
                timeout=self.deadline_s,
            )
        return reply.version, list(reply.fingerprints)


def shutdown_workers(trainers: list[str], rollouts: list[str], token: str | None, reason: str) -> list[str]:
    """Ask every worker to exit; the addresses that could not be told (already gone, say)."""
    missed = []
    for clients in ([TrainerClient(a, token) for a in trainers], [RolloutClient(a, token) for a in rollouts]):
        for client in clients:
            try:
                client.shutdown(reason)
            except PeerError:
                missed.append(client.address)
            finally:
                client.close()
    return missed
