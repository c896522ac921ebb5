"""The coordinator's adapters to trainer and rollout servers.

Only this module speaks protobuf to the workers: the RL loop calls plain methods with domain
values, every call carries a deadline, and gRPC failures come back as `PeerError` naming the
peer and the call, chained to the original error.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc

from services import rpc
from services.api import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weights_pb2


class PeerError(RuntimeError):
    """A call to a trainer or rollout server failed."""

    def __init__(self, peer: str, call: str, code: grpc.StatusCode | None, details: str):
        self.peer, self.call, self.code, self.details = peer, call, code, details
        name = code.name if code is not None else "ERROR"
        super().__init__(f"{call} on {peer} failed ({name}): {details}")


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    weight_version: int


class _Client:
    def __init__(self, address: str, token: str | None, deadline_s: float):
        self.address = address
        self.deadline_s = deadline_s
        self._channel = rpc.open_channel(address, token)

    def close(self) -> None:
        self._channel.close()

    @contextlib.contextmanager
    def _call(self, name: str):
        try:
            yield
        except grpc.RpcError as e:
            raise PeerError(self.address, name, e.code(), e.details()) from e


class TrainerClient(_Client):
    def __init__(self, address: str, token: str | None = None, deadline_s: float = rpc.DEFAULT_DEADLINE_S):
        super().__init__(address, token, deadline_s)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    def configure(self, config: trainer_pb2.TrainerConfig) -> trainer_pb2.TrainerStatus:
        with self._call("Configure"):
            reply = self._stub.Configure(trainer_pb2.ConfigureTrainerRequest(config=config), timeout=self.deadline_s)
        return reply.status

    def status(self) -> trainer_pb2.TrainerStatus:
        with self._call("GetStatus"):
            return self._stub.GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=30)

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

    def train_step(
        self, batch: trainer_pb2.Batch, *, sft: bool = False, lr: float = 0.0
    ) -> tuple[dict[str, float], int]:
        loss = trainer_pb2.LOSS_KIND_SFT if sft else trainer_pb2.LOSS_KIND_POLICY
        request = trainer_pb2.TrainStepRequest(batch=batch, loss=loss, lr=lr)
        with self._call("TrainStep"):
            reply = self._stub.TrainStep(request, timeout=self.deadline_s)
        return dict(reply.metrics), reply.weights_version

    def weight_manifest(self, fingerprint_algo: str = "") -> weights_pb2.WeightManifest:
        with self._call("GetWeightManifest"):
            reply = self._stub.GetWeightManifest(
                trainer_pb2.GetWeightManifestRequest(fingerprint_algo=fingerprint_algo), timeout=self.deadline_s
            )
        return reply.manifest

    def save_checkpoint(self, path: str, *, include_optimizer: bool = True) -> int:
        request = trainer_pb2.SaveCheckpointRequest(path=path, include_optimizer=include_optimizer)
        with self._call("SaveCheckpoint"):
            return self._stub.SaveCheckpoint(request, timeout=self.deadline_s).step

    def load_checkpoint(self, path: str, *, load_optimizer: bool = True) -> int:
        request = trainer_pb2.LoadCheckpointRequest(path=path, load_optimizer=load_optimizer)
        with self._call("LoadCheckpoint"):
            return self._stub.LoadCheckpoint(request, timeout=self.deadline_s).step


class RolloutClient(_Client):
    def __init__(self, address: str, token: str | None = None, deadline_s: float = rpc.DEFAULT_DEADLINE_S):
        super().__init__(address, token, deadline_s)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)

    def configure(self, config: rollout_pb2.RolloutConfig) -> rollout_pb2.RolloutStatus:
        with self._call("Configure"):
            reply = self._stub.Configure(rollout_pb2.ConfigureRolloutRequest(config=config), timeout=self.deadline_s)
        return reply.status

    def status(self) -> rollout_pb2.RolloutStatus:
        with self._call("GetStatus"):
            return self._stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=30)

    def generate(
        self, prompts: list[str], sampling: rollout_pb2.SamplingParams, *, return_logprobs: bool = True
    ) -> list[Completion]:
        request = rollout_pb2.GenerateRequest(
            prompts=prompts,
            sampling=sampling,
            return_logprobs=return_logprobs,
        )
        with self._call("Generate"):
            reply = self._stub.Generate(request, timeout=self.deadline_s)
        reasons = {rollout_pb2.FINISH_REASON_STOP: "stop", rollout_pb2.FINISH_REASON_LENGTH: "length"}
        return [
            Completion(
                prompt_index=c.prompt_index,
                prompt_ids=list(c.prompt_ids),
                output_ids=list(c.output_ids),
                text=c.text,
                logprobs=list(c.logprobs),
                finish_reason=reasons.get(c.finish_reason, "abort"),
                weight_version=c.weight_version,
            )
            for c in reply.results
        ]

    def update_weights_from_trainer(
        self, manifest: weights_pb2.WeightManifest, trainer: weights_pb2.TrainerEndpoint, timeout_s: float
    ) -> rollout_pb2.UpdateWeightsResponse:
        request = rollout_pb2.UpdateWeightsRequest(
            version=manifest.version, manifest=manifest, trainer=trainer, timeout_s=timeout_s
        )
        with self._call("UpdateWeights"):
            return self._stub.UpdateWeights(request, timeout=timeout_s + 30)

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
