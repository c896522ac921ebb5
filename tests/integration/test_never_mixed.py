"""An engine never serves a mixed model: Generate calls run without pause while the trainer
trains and syncs, on every CPU data plane, and each answer must equal what the complete version
it claims gives. One sync in the middle is refused (a bucket's fingerprint is wrong): while and
after it, the engine serves the previous version or nothing, never the refused bytes.

The reference for each version is computed here, in the test process, from the trainer's own
weights at that version (pulled over GetWeights once the trainer has stopped changing them).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.api import rollout_pb2, trainer_pb2, weights_pb2
from services.coordinator.clients import PeerError, RolloutClient, TrainerClient
from services.launcher import LocalFleet
from services.rollout.engine import RolloutEngine, RolloutSettings
from services.rollout.torch_engine import Sampling
from services.weights.grpc_stream import receive
from services.weights.manifest import manifest_from_proto
from tests.conftest import make_syncer, make_tiny_model, stop_fleet
from tests.integration.conftest import channel

pytestmark = pytest.mark.faults

PROMPTS = ["1+2=", "3+4=", "12+9=", "7-5="]
MAX_NEW = 5
TOLERANCE = 1e-4  # same code, same CPU: answers match their version far closer than versions differ
SAMPLE = trainer_pb2.Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7], advantage=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """About 50 MB of float32 weights: a sync takes long enough for Generate calls to land in it."""
    return make_tiny_model(tmp_path_factory.mktemp("never-mixed-model"), hidden_size=512, intermediate_size=1536,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64)


@contextlib.contextmanager
def trainer_and_engine(logs, model_dir, device: str = "cpu", offload: bool = False, rollout_args: tuple = ()):
    """A configured trainer and engine, each its own process, both on `device` (the engine's
    server started with `rollout_args`)."""
    local = LocalFleet(logs, env={"OMP_NUM_THREADS": "1"})
    try:
        local.start("trainer", "trainer-0", [])
        local.start("rollout", "rollout-0", list(rollout_args))
        local.wait_ready()
        trainer, engine = TrainerClient(local.children[0].address), RolloutClient(local.children[1].address)
        trainer.configure(trainer_pb2.TrainerConfig(model_path=str(model_dir), bucket_bytes=8 << 20, device=device,
                                                    offload=offload, optimizer=trainer_pb2.OptimizerConfig(lr=3e-3)))
        engine.configure(rollout_pb2.RolloutConfig(model_path=str(model_dir), load_weights=True, device=device))
        yield trainer, engine
    finally:
        stop_fleet(local, log_lines=20)


class _Reference:
    """What each complete version answers, computed from the trainer's weights in this process."""

    def __init__(self, model_dir, trainer: TrainerClient, device: str, max_new: int = MAX_NEW):
        self._engine = RolloutEngine(RolloutSettings(model_path=str(model_dir), device=device))
        self._trainer = trainer
        self.max_new = max_new
        self.answers: dict[int, list] = {}  # version -> [(output_ids, logprobs)] per prompt
        self.prints: dict[int, list[str]] = {}  # version -> sha256 of 8 MiB buckets

    def record(self) -> int:
        """The trainer's current weights: their version, and the answers they give."""
        manifest = self._trainer.weight_manifest("", weights_pb2.WEIGHT_PLANE_GRPC_STREAM)
        parsed = manifest_from_proto(manifest)
        with channel(self._trainer.address) as ch:
            stream = ch.unary_stream("/rlfleet.v1.Trainer/GetWeights",
                                     request_serializer=trainer_pb2.GetWeightsRequest.SerializeToString,
                                     response_deserializer=weights_pb2.WeightChunk.FromString)
            buffers = receive(stream(trainer_pb2.GetWeightsRequest(version=parsed.version), timeout=60), parsed)
        self._engine.apply(self._engine.read_manifest(manifest), buffers)
        ids = [self._engine.tokenizer.encode(p) for p in PROMPTS]
        results, _ = self._engine.generate(ids, Sampling(temperature=0.0, max_new_tokens=self.max_new, ignore_eos=True))
        self.answers[parsed.version] = [(r.output_ids, r.logprobs) for r in results]
        self.prints[parsed.version] = self._engine.fingerprints("sha256", 8 << 20)
        return parsed.version

    def mismatch(self, version: int, answer: list[tuple[list[int], list[float]]]) -> str | None:
        expected = self.answers.get(version)
        if expected is None:
            return f"claims version {version}, which the trainer never completed"
        for (got_ids, got_logprobs), (ids, logprobs) in zip(answer, expected):
            if got_ids != ids:
                return f"version {version}: tokens {got_ids} where the complete version gives {ids}"
            worst = max(abs(a - b) for a, b in zip(got_logprobs, logprobs))
            if worst > TOLERANCE:
                return f"version {version}: logprobs differ by {worst:.2e} from the complete version's"
        return None


class _Hammer:
    """Generate calls back to back from two threads until stopped; keeps every answer."""

    def __init__(self, engine: RolloutClient):
        self._engine, self._stop = engine, threading.Event()
        self.answers: list[tuple[int, list]] = []
        self.refusals: list[str] = []
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def _run(self) -> None:
        sampling = rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
        while not self._stop.is_set():
            try:
                completions = self._engine.generate(PROMPTS, sampling)
            except PeerError as e:  # out of the pool after the refused sync: allowed, never wrong bytes
                self.refusals.append(f"{e.code.name}: {e.details}")
                continue
            self.answers.append((completions[0].weight_version, [(c.output_ids, c.logprobs) for c in completions]))

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def _corrupt_one_fingerprint(manifest: weights_pb2.WeightManifest) -> weights_pb2.WeightManifest:
    bad = weights_pb2.WeightManifest()
    bad.CopyFrom(manifest)
    last = bad.buckets[-1]
    last.fingerprint = last.fingerprint[:-1] + ("1" if last.fingerprint[-1] == "0" else "0")  # same algo, wrong digest
    return bad


@pytest.mark.parametrize("plane", ["grpc_stream", "shm", "broadcast"])
def test_generate_during_syncs_answers_only_complete_versions(tmp_path, model_dir, plane):
    with trainer_and_engine(tmp_path / "logs", model_dir) as (trainer, engine):
        check_never_mixed(trainer, engine, model_dir, plane, device="cpu")


def check_never_mixed(trainer: TrainerClient, engine: RolloutClient, model_dir, plane: str, *, device: str,
                      offload: bool = False) -> None:
    """Three syncs and a refused one with Generate running throughout; every answer must be
    what the complete version it names gives (the reference runs on the same device)."""
    reference = _Reference(model_dir, trainer, device)
    reference.record()  # version 0: what both load from disk
    pool = ThreadPoolExecutor(4)
    syncer = make_syncer(trainer, [engine], pool, plane=plane, timeout_s=30.0)
    real_manifest, real_push = trainer.weight_manifest, trainer.push_weights
    try:
        with _Hammer(engine) as hammer:
            for _ in range(3):
                trainer.train_step(trainer_pb2.Batch(samples=[SAMPLE]))
                if offload:
                    trainer.sleep()  # the sync reads the host copy
                assert syncer.sync({0}).ok == {0}
                served = reference.record()
            # A refused sync: the engine receives every byte of the next version, then one
            # bucket's fingerprint does not match.
            trainer.train_step(trainer_pb2.Batch(samples=[SAMPLE]))
            if offload:
                trainer.sleep()
            trainer.weight_manifest = lambda *a, **kw: _corrupt_one_fingerprint(real_manifest(*a, **kw))

            def corrupt_push(*a, **kw):
                reply = real_push(*a, **kw)
                reply.manifest.CopyFrom(_corrupt_one_fingerprint(reply.manifest))
                return reply

            trainer.push_weights = corrupt_push
            refused = syncer.sync({0})
            assert 0 not in refused.ok and "fingerprint mismatch" in next(iter(refused.failures.values())), refused
            trainer.weight_manifest, trainer.push_weights = real_manifest, real_push
            # The engine still holds exactly the version it names, not the refused bytes.
            version, prints = engine.fingerprints("sha256", 8 << 20)
            assert version == served
            assert prints == reference.prints[served], "the refused bytes are being served"
            assert syncer.sync({0}).ok == {0}  # the next full sync brings it back
            final = reference.record()
            for _ in range(50):  # let answers of the final version arrive
                if any(v == final for v, _ in hammer.answers[-4:]):
                    break
                threading.Event().wait(0.05)
    finally:
        trainer.weight_manifest, trainer.push_weights = real_manifest, real_push
        syncer.close()
        pool.shutdown()

    versions = sorted(reference.answers)
    for older, newer in zip(versions, versions[1:]):  # the check can tell versions apart
        assert reference.mismatch(older, reference.answers[newer]) is not None
    bad = [m for v, answer in hammer.answers if (m := reference.mismatch(v, answer))]
    assert not bad, f"{len(bad)} of {len(hammer.answers)} answers match no complete version: {bad[:3]}"
    seen = {v for v, _ in hammer.answers}
    assert len(hammer.answers) >= 10 and final in seen, (len(hammer.answers), seen)
    assert all("UNAVAILABLE" in r for r in hammer.refusals), hammer.refusals[:3]

