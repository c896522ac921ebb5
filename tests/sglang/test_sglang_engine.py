"""The SGLang adapter end to end against the stand-in (tests/sglang/standin.py), which checks every
request it gets against the pinned SGLang wheel's own types and answers in SGLang's shapes: the
rollout service starts it as its SGLang child, generates through it, syncs weights into it by a
packed gloo broadcast, survives its death, and a whole `rlfleet run` job trains through it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services import rpc
from services.api import rollout_pb2, rollout_pb2_grpc, trainer_pb2, weights_pb2
from services.coordinator.clients import RolloutClient, TrainerClient
from services.rollout.engine import EngineUnavailable, RolloutSettings, SglangSettings
from services.rollout.server import RolloutServicer, build_server as build_rollout_server
from services.rollout.sglang.client import SglangClient, SglangRefused
from services.rollout.sglang.process import SglangProcess
from services.trainer.server import build_server as build_trainer_server
from tests.conftest import make_syncer, make_tiny_model

pytestmark = pytest.mark.sglang
ROOT = Path(__file__).resolve().parents[2]
STANDIN = [sys.executable, "-m", "tests.sglang.standin"]
EXAMPLE = ROOT / "examples" / "arith"


@pytest.fixture(autouse=True)
def _standin_importable(monkeypatch):
    """The SGLang child is `python -m tests.sglang.standin`: it must find this checkout."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _sglang_config(model_dir) -> rollout_pb2.RolloutConfig:
    return rollout_pb2.RolloutConfig(model_path=str(model_dir), engine="sglang", load_weights=True,
                                     sglang=rollout_pb2.SglangConfig(command=STANDIN, startup_timeout_s=120))


def _requests(url: str, key: str | None) -> list[dict]:
    return SglangClient(url, key).call("/_standin/requests", method="GET")


@contextlib.contextmanager
def _services(model_dir, *, load_weights: bool = True):
    """A trainer, an SGLang engine over the stand-in and a built-in engine for comparison, each a
    gRPC server on loopback; the SGLang engine's servicer is built here to reach its engine (and
    SGLang's request log). Yields (trainer, sglang, reference, servicer, pool)."""
    trainer_server = build_trainer_server("127.0.0.1:0")
    servicer = RolloutServicer()
    sglang_server = rpc.create_server(lambda s: rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, s),
                                      ("rlfleet.v1.Rollout",), address="127.0.0.1:0")
    sglang_server.on_stop.append(servicer.close)
    torch_server = build_rollout_server("127.0.0.1:0")
    pool = ThreadPoolExecutor(8)
    try:
        trainer = TrainerClient(f"127.0.0.1:{trainer_server.port}")
        trainer.configure(trainer_pb2.TrainerConfig(model_path=str(model_dir), bucket_bytes=4096,
                                                    optimizer=trainer_pb2.OptimizerConfig(lr=0.05)))
        sglang = RolloutClient(f"127.0.0.1:{sglang_server.port}")
        config = _sglang_config(model_dir)
        config.load_weights = load_weights
        sglang.configure(config)
        reference = RolloutClient(f"127.0.0.1:{torch_server.port}")
        reference.configure(rollout_pb2.RolloutConfig(model_path=str(model_dir), load_weights=True))
        yield trainer, sglang, reference, servicer, pool
    finally:
        pool.shutdown(wait=False)
        for server in (trainer_server, sglang_server, torch_server):
            server.stop(0)


def test_generate_and_a_packed_broadcast_sync_through_sglang(tiny_model_dir):
    with _services(tiny_model_dir) as (trainer, sglang, reference, servicer, pool):
        assert sglang.capabilities.packed_broadcast

        prompts = ["1+2=", "3+4="]
        greedy = rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=4, n=3)
        before = sglang.generate(prompts, greedy)
        assert [c.prompt_index for c in before] == [0, 0, 0, 1, 1, 1]  # rlfleet's prompt-major order
        assert all(len(c.logprobs) == len(c.output_ids) > 0 for c in before)
        assert [c.output_ids for c in before] == [c.output_ids for c in reference.generate(prompts, greedy)]

        # Train until the greedy answers change, then sync both engines; the SGLang one by broadcast.
        batch = trainer_pb2.Batch(samples=[trainer_pb2.Sample(prompt_ids=list(c.prompt_ids),
                                                              response_ids=list(c.output_ids), advantage=-1.0)
                                           for c in before])
        for _ in range(3):
            trainer.train_step(batch)
        syncer = make_syncer(trainer, [sglang, reference], pool, timeout_s=60)
        assert syncer.planes == ["broadcast", "shm"]
        # Generate keeps running while the buckets go in one by one: every answer is all version 0
        # or all version 3, never a mix (the adapter holds generation out of a multi-bucket update).
        during, syncing = [], threading.Event()
        syncing.set()

        def generate_throughout() -> None:
            while syncing.is_set():
                during.append(sglang.generate(prompts, greedy))

        generating = threading.Thread(target=generate_throughout)
        generating.start()
        result = syncer.sync({0, 1})
        syncing.clear()
        generating.join(60)
        assert result.ok == {0, 1}, result.failures
        after = sglang.generate(prompts, greedy)
        assert {c.weight_version for c in after} == {3}
        assert [c.output_ids for c in after] == [c.output_ids for c in reference.generate(prompts, greedy)]
        assert [c.output_ids for c in after] != [c.output_ids for c in before]
        assert during
        for answer in during:
            (version,) = {c.weight_version for c in answer}
            assert [c.output_ids for c in answer] == [c.output_ids for c in {0: before, 3: after}[version]]

        # On the wire: every request passed the wheel's types (the stand-in answers 400 otherwise),
        # and the sync was one flattened bucket per manifest bucket inside an update session.
        client = servicer._engine.client
        log = [r for r in SglangClient(client.url, client._headers["Authorization"].split()[-1])
               .call("/_standin/requests", method="GET") if not r["path"].startswith("/_standin")]
        assert all(r["status"] == 200 for r in log), [r for r in log if r["status"] != 200]
        paths = [r["path"] for r in log]
        updates = [r["body"] for r in log if r["path"] == "/update_weights_from_distributed"]
        assert len(updates) == len(result_manifest_buckets(trainer)) >= 2
        assert all(u["load_format"] == "flattened_bucket" for u in updates)
        assert [u.get("weight_version") for u in updates][-1] == "3" and updates[-1]["flush_cache"]
        first, last = paths.index("/update_weights_from_distributed"), len(paths) - 1 - paths[::-1].index(
            "/update_weights_from_distributed")
        assert paths[first - 1] == "/begin_weight_update" and paths[last + 1] == "/end_weight_update"


def test_exact_verification_reads_back_what_sglang_loaded(tmp_path):
    """verify: exact starts SGLang from random weights (--load-format dummy); after the sync every
    tensor is read back through /get_weights_by_name and must carry the trainer's fingerprint.
    A value SGLang reads back wrong fails the sync and takes the engine out of the pool."""
    model = make_tiny_model(tmp_path / "llama", architecture="llama")  # SGLang reads back Llama's weights
    with _services(model, load_weights=False) as (trainer, sglang, reference, servicer, pool):
        engine = servicer._engine
        key = engine.client._headers["Authorization"].split()[-1]
        assert "--load-format" in engine.process.args and "dummy" in engine.process.args

        syncer = make_syncer(trainer, [sglang], pool, exact=True, timeout_s=60)
        result = syncer.sync({0})
        assert result.ok == {0}, result.failures
        prompts, greedy = ["1+2=", "3+4="], rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=4)
        assert [c.output_ids for c in sglang.generate(prompts, greedy)] == \
            [c.output_ids for c in reference.generate(prompts, greedy)]
        log = [r for r in _requests(engine.client.url, key) if r["path"] == "/get_weights_by_name"]
        manifest = trainer.weight_manifest("sha256", weights_pb2.WEIGHT_PLANE_BROADCAST)
        read = {r["body"]["name"] for r in log[1:]}  # the first is the probe made at Configure
        assert read == {t.name for b in manifest.buckets for t in b.tensors} and all(r["status"] == 200 for r in log)

        # SGLang answers one value wrong: the sync fails naming the bucket, the engine stops serving.
        real = engine.client.get_weights_by_name

        def one_value_off(name, truncate_size, timeout_s):
            values = real(name, truncate_size, timeout_s)
            if name == "model.norm.weight":
                values[0] += 1.0
            return values

        engine.client.get_weights_by_name = one_value_off
        batch = trainer_pb2.Batch(samples=[trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5], advantage=1.0)])
        trainer.train_step(batch)
        result = syncer.sync({0})
        assert "reads back from SGLang as" in result.failures[sglang.address]
        with pytest.raises(Exception, match="reads back from SGLang"):
            sglang.generate(prompts, greedy)


def test_exact_verification_is_refused_at_configure_when_sglang_cannot_read_the_model_back(tiny_model_dir,
                                                                                          monkeypatch):
    """SGLang 0.5.23's Qwen3 model has no get_weights_by_name: the engine says so when configured
    for exact verification, before any weights move, and leaves no SGLang child behind."""
    from services.rollout.sglang.engine import SglangEngine

    settings = RolloutSettings(model_path=str(tiny_model_dir), engine="sglang", load_weights=False,
                               sglang=SglangSettings(command=tuple(STANDIN), startup_timeout_s=120))
    children = []
    real_start = SglangProcess.start

    def start(process):
        client = real_start(process)
        children.append(process.child)
        return client

    monkeypatch.setattr(SglangProcess, "start", start)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM.*use fingerprint"):
        SglangEngine(settings)
    (child,) = children
    assert child.poll() is not None  # stopped, not left running


def result_manifest_buckets(trainer: TrainerClient) -> list:
    return list(trainer.weight_manifest("", weights_pb2.WEIGHT_PLANE_BROADCAST).buckets)


def test_a_dead_sglang_child_is_restarted_and_serves_only_after_a_full_sync(tiny_model_dir):
    from services.rollout.sglang.engine import SglangEngine

    engine = SglangEngine(RolloutSettings(model_path=str(tiny_model_dir), engine="sglang",
                                          sglang=SglangSettings(command=tuple(STANDIN), startup_timeout_s=120)))
    try:
        first = engine.client
        with pytest.raises(Exception):
            first.call("/_standin/crash")  # the server exits before it answers
        deadline = time.monotonic() + 120
        while engine.process.restarts == 0 or engine.client is first:
            assert time.monotonic() < deadline, engine.last_error
            time.sleep(0.2)
        assert not engine.serving and "exited with code" in engine.last_error
        assert engine.client.healthy()  # a new child, on a new port with a new key
        from services.rollout.types import Sampling

        with pytest.raises(EngineUnavailable, match="exited with code"):
            engine.generate([[3, 4]], Sampling(max_new_tokens=2))
    finally:
        engine.close()


def test_sglang_errors_come_back_typed_with_sglangs_message(tiny_model_dir):
    from services.rollout.sglang.engine import SglangEngine

    engine = SglangEngine(RolloutSettings(model_path=str(tiny_model_dir), engine="sglang",
                                          sglang=SglangSettings(command=tuple(STANDIN), startup_timeout_s=120)))
    try:
        with pytest.raises(SglangRefused) as info:  # what SGLang 0.5.22+ answers to an unknown sampling key
            engine.client.call("/generate", {"input_ids": [[3, 4]], "sampling_params": {"bogus_key": 1}})
        assert info.value.status == 400 and "bogus_key" in info.value.message
        unauthorised = SglangClient(engine.client.url, api_key="wrong")
        with pytest.raises(Exception, match="401|403"):
            unauthorised.call("/model_info", method="GET")
    finally:
        engine.close()


def test_an_rl_job_trains_through_sglang_engines(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        name: arith-sglang
        seed: 1
        model: {EXAMPLE / 'model'}
        num_rollout: 30
        output_dir: {tmp_path / 'out'}
        rollout:
          prompts_per_step: 32
          samples_per_prompt: 8
          sampling: {{temperature: 1.0, max_new_tokens: 5}}
          engine: sglang
          sglang: {{command: {json.dumps(STANDIN)}, startup_timeout_s: 120}}
        data: {{train: {EXAMPLE / 'data' / 'train.jsonl'}}}
        reward: {{kind: exact_match}}
        weight_sync: {{verify: exact}}
        eval: {{datasets: [{{name: heldout, path: {EXAMPLE / 'data' / 'test.jsonl'}, limit: 300,
                            sampling: {{temperature: 0.0, max_new_tokens: 5}}}}]}}
        trainer: {{micro_batch_size: 256, colocate: true, optimizer: {{lr: 1.0e-4, betas: [0.9, 0.99]}}}}
        """))
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(job), "--summary", str(tmp_path / "summary.json")],
        capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "': 'broadcast'" in result.stdout  # the plane the coordinator negotiated for the SGLang engine
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_after"] - summary["eval_before"] >= 0.05, summary


@pytest.mark.parametrize("policy", ["pause", "abort"])
def test_update_policies_map_onto_sglangs_pause_and_continue(tiny_model_dir, policy):
    """UpdateWeights with PAUSE pauses SGLang in `retract` mode (running requests re-queued, their
    KV recomputed under the new weights; `in_place` would keep old KV and fail the cache flush),
    with ABORT in `abort` mode (running requests end, finish reason abort); either way generation
    continues after the last bucket, and Generate calls run concurrently, not one at a time."""
    with _services(tiny_model_dir) as (trainer, sglang, reference, servicer, pool):
        syncer = make_syncer(trainer, [sglang], pool, timeout_s=60)
        syncer.policy = policy
        trainer.train_step(trainer_pb2.Batch(samples=[trainer_pb2.Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7],
                                                                         advantage=1.0)]))
        long = rollout_pb2.SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True)
        answers, errors, most = [], [], [0]
        syncing = threading.Event()
        syncing.set()
        engine = servicer._engine

        def generate() -> None:
            while syncing.is_set():
                try:
                    answers.append(sglang.generate(["1+2="] * 8, long))
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

        def watch() -> None:
            while syncing.is_set():
                most[0] = max(most[0], engine._active)
                time.sleep(0.001)

        callers = [threading.Thread(target=generate) for _ in range(3)] + [threading.Thread(target=watch)]
        for t in callers:
            t.start()
        time.sleep(0.5)  # the calls are in SGLang
        result = syncer.sync({0})
        time.sleep(0.2)
        syncing.clear()
        for t in callers:
            t.join(60)
        running_at_once = most[0]
        assert result.ok == {0}, result.failures
        assert not errors, errors
        assert running_at_once > 1  # concurrent calls reach SGLang together
        client = engine.client
        log = [r for r in SglangClient(client.url, client._headers["Authorization"].split()[-1])
               .call("/_standin/requests", method="GET") if not r["path"].startswith("/_standin")]
        assert all(r["status"] == 200 for r in log), [r for r in log if r["status"] != 200]
        paths = [r["path"] for r in log]
        pause = paths.index("/pause_generation")
        assert log[pause]["body"] == {"mode": "retract" if policy == "pause" else "abort"}
        first, last = paths.index("/update_weights_from_distributed"), len(paths) - 1 - paths[::-1].index(
            "/update_weights_from_distributed")
        assert pause < first and "/continue_generation" in paths[last + 1:]
        reasons = {c.finish_reason for answer in answers for c in answer}
        if policy == "abort":
            assert "abort" in reasons
        after = sglang.generate(["1+2="], long)
        assert after[0].weight_version == 1 and after[0].versions == ((1, 40),)
