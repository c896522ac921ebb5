"""Generate refuses what cannot fit before doing any work for it, and a caller that gives up
stops its call: the engine is free for the next one at once."""

from __future__ import annotations

import resource
import time

import grpc
import pytest

from services.api import rollout_pb2, rollout_pb2_grpc
from services.rollout.server import build_server
from tests.conftest import make_tiny_model
from tests.integration.conftest import channel

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("long-model"), max_position_embeddings=4096)
    server = build_server("127.0.0.1:0")
    try:
        with channel(f"127.0.0.1:{server.port}") as ch:
            stub = rollout_pb2_grpc.RolloutStub(ch)
            stub.Configure(rollout_pb2.ConfigureRolloutRequest(
                config=rollout_pb2.RolloutConfig(model_path=str(model), load_weights=True)), timeout=60)
            yield stub
    finally:
        server.stop(0)


def _refused(stub, request) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return refused.value.details()


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(engine):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    details = _refused(engine, rollout_pb2.GenerateRequest(prompts=["1+2=", "9" * 10_000_000]))
    assert "prompts[1]: 10000000 characters cannot fit max_position_embeddings=4096" in details
    assert time.monotonic() - started < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200_000  # KiB: no tokenizer blow-up


def test_too_many_completions_and_too_many_ids_are_refused_by_field(engine):
    many = rollout_pb2.GenerateRequest(prompts=["1+2="] * 100, sampling=rollout_pb2.SamplingParams(n=1000))
    assert "prompts: 100 prompts x n=1000 is more than 65536" in _refused(engine, many)
    assert "n: must be in [1, 1024]" in _refused(engine, rollout_pb2.GenerateRequest(
        prompts=["1+2="], sampling=rollout_pb2.SamplingParams(n=5000)))
    long_ids = rollout_pb2.GenerateRequest(input_ids=[rollout_pb2.TokenIds(ids=[3] * 4090)],
                                           sampling=rollout_pb2.SamplingParams(max_new_tokens=10))
    assert "input_ids[0]: 4090 tokens plus max_new_tokens=10 exceed max_position_embeddings=4096" in _refused(engine, long_ids)


def test_a_caller_that_gives_up_frees_the_engine_for_the_next_call(engine):
    slow = rollout_pb2.GenerateRequest(prompts=["1+2="] * 64, sampling=rollout_pb2.SamplingParams(
        n=4, max_new_tokens=4000, ignore_eos=True, seed=1))
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as gave_up:
        engine.Generate(slow, timeout=1.0)
    assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    quick = engine.Generate(rollout_pb2.GenerateRequest(prompts=["1+2="], sampling=rollout_pb2.SamplingParams(
        max_new_tokens=3, seed=1)), timeout=30)
    waited = time.monotonic() - started
    print(f"the next call was answered {waited:.2f} s after the first began")
    assert len(quick.results) == 1 and waited < 6  # the abandoned call would have run for many seconds
