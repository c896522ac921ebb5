"""`rlfleet serve rollout --front-end process`: the public port served by a process of its own,
which forwards every call to the engine's process (its child) over one link stream.

Real processes on loopback: a caller must not be able to tell the split server from the inline
one (same tokens, same errors, same streaming), concurrent callers share one running batch, a
caller that goes away stops its rows only, and the two processes live and die together."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from services import rpc
from services.api import rollout_pb2, rollout_pb2_grpc, weights_pb2
from services.launcher import LocalFleet
from tests.conftest import make_tiny_model

TOKEN = "frontend-test-token"
PROMPTS = ["1+2=", "3+4=", "12+9=", "7", "5-3=", "99", "0", "8+8="]


def _stub(address: str, token: str | None = TOKEN):
    channel = rpc.open_channel(address, token)
    return channel, rollout_pb2_grpc.RolloutStub(channel)


def _configure(stub, model_dir: Path, max_batch_size: int = 64) -> None:
    stub.Configure(rollout_pb2.ConfigureRolloutRequest(config=rollout_pb2.RolloutConfig(
        model_path=str(model_dir), load_weights=True, device="cpu", max_batch_size=max_batch_size)), timeout=120)


def _greedy(max_new_tokens: int = 12, **extra) -> rollout_pb2.SamplingParams:
    return rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **extra)


def _engine_pid(front_pid: int) -> int:
    children = Path(f"/proc/{front_pid}/task/{front_pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@contextlib.contextmanager
def _servers(logs: Path, *names_and_args):
    local = LocalFleet(logs, env={"OMP_NUM_THREADS": "1", "RLFLEET_TOKEN": TOKEN})
    try:
        for name, args in names_and_args:
            local.start("rollout", name, args)
        local.wait_ready()
        yield local
    finally:
        local.stop()


LONG = 8000  # tokens a row generates when it should still be running while the test acts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model with room for rows that run for seconds."""
    return make_tiny_model(tmp_path_factory.mktemp("roomy-model"), max_position_embeddings=LONG + 16)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, model_dir):
    """A split server and an inline one, both configured with the tiny model."""
    with _servers(tmp_path_factory.mktemp("frontend-logs"), ("split", ["--front-end", "process"]),
                  ("inline", [])) as local:
        split, inline = local.children
        stubs = []
        for child in (split, inline):
            channel, stub = _stub(child.address)
            _configure(stub, model_dir)
            stubs.append(stub)
        yield local, *stubs


def test_a_caller_gets_what_the_inline_server_answers(pair):
    _, split, inline = pair
    request = rollout_pb2.GenerateRequest(prompts=PROMPTS, sampling=_greedy(n=2), return_logprobs=True)
    got, want = split.Generate(request, timeout=60), inline.Generate(request, timeout=60)
    assert len(got.results) == len(PROMPTS) * 2
    assert [list(c.output_ids) for c in got.results] == [list(c.output_ids) for c in want.results]
    assert [c.finish_reason for c in got.results] == [c.finish_reason for c in want.results]
    assert max(abs(a - b) for g, w in zip(got.results, want.results) for a, b in zip(g.logprobs, w.logprobs)) < 1e-5
    assert got.weight_version == want.weight_version
    # GenerateStream: every completion once, each where Generate puts it
    streamed = {item.index: item.completion for item in split.GenerateStream(request, timeout=60)}
    assert sorted(streamed) == list(range(len(got.results)))
    assert all(list(streamed[i].output_ids) == list(c.output_ids) for i, c in enumerate(got.results))
    # the other methods are forwarded as they are
    status = split.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10)
    assert status.configured and status.serving and status.num_parameters > 0
    prints = split.GetWeightFingerprints(rollout_pb2.GetWeightFingerprintsRequest(fingerprint_algo="sha256"), timeout=30)
    assert list(prints.fingerprints) == list(inline.GetWeightFingerprints(
        rollout_pb2.GetWeightFingerprintsRequest(fingerprint_algo="sha256"), timeout=30).fingerprints)


def test_errors_come_back_as_a_direct_caller_gets_them(pair):
    local, split, _ = pair
    both = rollout_pb2.GenerateRequest(prompts=["1+2="], input_ids=[rollout_pb2.TokenIds(ids=[1, 2])], sampling=_greedy())
    for call in (split.Generate, lambda r, timeout: list(split.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as e:
            call(both, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "give one or the other" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # a forwarded method's error keeps its code and message
        split.ReleaseMemory(rollout_pb2.ReleaseMemoryRequest(tags=["nonsense"]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nonsense" in e.value.details()
    channel, anonymous = _stub(local.children[0].address, token=None)
    with pytest.raises(grpc.RpcError) as e:
        anonymous.Generate(rollout_pb2.GenerateRequest(prompts=["1+2="], sampling=_greedy()), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def test_concurrent_callers_share_one_running_batch(pair):
    _, split, inline = pair
    sampling = _greedy(max_new_tokens=24)
    want = inline.Generate(rollout_pb2.GenerateRequest(prompts=PROMPTS, sampling=sampling), timeout=60).results
    before = split.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10).load
    start = threading.Barrier(64)

    def one(i: int):
        start.wait()
        reply = split.Generate(rollout_pb2.GenerateRequest(prompts=[PROMPTS[i % len(PROMPTS)]], sampling=sampling),
                               timeout=120)
        return i, list(reply.results[0].output_ids)

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(one, range(64)))
    assert all(ids == list(want[i % len(PROMPTS)].output_ids) for i, ids in answers)
    after = split.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10).load
    steps = after.decode_steps - before.decode_steps
    assert (after.row_steps - before.row_steps) / steps > 8, "the 64 one-prompt calls did not run together"


def test_a_caller_that_goes_away_stops_only_its_own_rows(pair):
    _, split, inline = pair
    long = rollout_pb2.GenerateRequest(prompts=["1+2="] * 4, sampling=_greedy(max_new_tokens=LONG, stop=["never said"]))
    short = rollout_pb2.GenerateRequest(prompts=PROMPTS, sampling=_greedy())
    want = [list(c.output_ids) for c in inline.Generate(short, timeout=60).results]
    stream = split.GenerateStream(long, timeout=60)
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(split.Generate, short, timeout=60) for _ in range(4)]
        time.sleep(0.5)
        running = split.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10).load.rows_running
        stream.cancel()
        assert all([list(c.output_ids) for c in f.result().results] == want for f in others)
    assert running >= 4
    with pytest.raises(grpc.RpcError) as e:
        next(stream)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    deadline = time.monotonic() + 10  # the cancelled rows leave the batch, not only the caller
    while (load := split.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=10).load).rows_running:
        assert time.monotonic() < deadline, f"{load.rows_running} rows still run for a caller that went away"
        time.sleep(0.1)
    with pytest.raises(grpc.RpcError) as e:  # a deadline is the engine's too
        split.Generate(long, timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_an_engine_process_that_dies_fails_the_calls_in_flight_and_the_front_end_exits(tmp_path, model_dir):
    with _servers(tmp_path, ("split", ["--front-end", "process"])) as local:
        front = local.children[0]
        channel, stub = _stub(front.address)
        _configure(stub, model_dir)
        stream = stub.GenerateStream(rollout_pb2.GenerateRequest(
            prompts=["1+2="] * 4, sampling=_greedy(max_new_tokens=LONG, stop=["never said"])), timeout=60)
        time.sleep(0.5)
        os.kill(_engine_pid(front.process.pid), signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert front.process.wait(timeout=20) == 3  # "a service process died": a pod restarts
        channel.close()


def test_shutdown_stops_both_processes_and_a_killed_front_end_takes_its_engine(tmp_path, model_dir):
    with _servers(tmp_path, ("a", ["--front-end", "process"]), ("b", ["--front-end", "process"])) as local:
        a, b = local.children
        engines = [_engine_pid(a.process.pid), _engine_pid(b.process.pid)]
        channel, stub = _stub(a.address)
        stub.Shutdown(weights_pb2.ShutdownRequest(reason="test"), timeout=10)
        assert a.process.wait(timeout=20) == 0
        channel.close()
        os.kill(b.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30  # (its engine gets SIGTERM and stops within its 5 s grace)
        while any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in engines):
            assert time.monotonic() < deadline, "an engine's process outlived its front end"
            time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
