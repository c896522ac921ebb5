"""Every method of the three services, called with hypothesis-generated requests (edge numbers,
odd strings, unknown enum values, nested messages), against real servers on loopback: no call may
end in UNKNOWN or INTERNAL (an unhandled exception), and the server must still answer its health
check after each. Methods that join or wait on peers (InitWeightUpdateGroup, UpdateWeights) get
their own tests of bad input instead: a generated peer address would only make them wait out their
timeout. (PushWeights is fuzzed: with no group formed here it never waits.)"""

from __future__ import annotations

import math

import grpc
import hypothesis
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st

from services.api import coordinator_pb2_grpc, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.coordinator.jobs import JobManager
from services.coordinator.server import build_server as build_coordinator_server
from services.coordinator.store import MemoryJobStore
from services.rollout.server import build_server as build_rollout_server
from services.trainer.server import build_server as build_trainer_server
from tests.conftest import make_tiny_model
from tests.integration.conftest import channel

pytestmark = pytest.mark.faults

FD = __import__("google.protobuf.descriptor", fromlist=["FieldDescriptor"]).FieldDescriptor
EDGE_INTS = [0, 1, -1, 2, 7, 64, 70000, 2**31 - 1, -(2**31), 10**12]
EDGE_FLOATS = [0.0, 1e-45, -1.0, 0.5, 1.0, 1e30, math.inf, -math.inf, math.nan]
ODD_TEXT = ["", "garbage", "int8", "cuda:7", "cpu", "float16", "../escape", "/dev/zero", "\x00", "actor", "ref",
            "sha256", "xxh3", "fast", "é" * 3, "a" * 300]
SKIP = {"InitWeightUpdateGroup", "UpdateWeights", "Configure"}


def _scalar(field) -> st.SearchStrategy:
    t = field.type
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return st.sampled_from(EDGE_INTS[:8]) | st.integers(-(2**31), 2**31 - 1)
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return st.sampled_from(EDGE_INTS) | st.integers(-(2**63), 2**63 - 1)
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return st.sampled_from([0, 1, 2, 70000, 2**32 - 1])
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return st.sampled_from([0, 1, 2, 70000, 2**64 - 1])
    if t == FD.TYPE_FLOAT:
        return st.sampled_from(EDGE_FLOATS) | st.floats(width=32)
    if t == FD.TYPE_DOUBLE:
        return st.sampled_from(EDGE_FLOATS) | st.floats()
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_STRING:
        return st.sampled_from(ODD_TEXT) | st.text(max_size=12)
    if t == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FD.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [999])
    raise AssertionError(f"no strategy for {field.full_name}")


@st.composite
def messages(draw, cls, depth: int = 0):
    """A message of type `cls` with a random subset of its fields set."""
    message = cls()
    for field in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        repeated = field.is_repeated
        if field.type == FD.TYPE_MESSAGE:
            if depth >= 3 or field.message_type.GetOptions().map_entry:
                continue
            sub = field.message_type._concrete_class
            if repeated:
                getattr(message, field.name).extend(draw(st.lists(messages(sub, depth + 1), max_size=3)))
            else:
                getattr(message, field.name).CopyFrom(draw(messages(sub, depth + 1)))
        elif repeated:
            getattr(message, field.name).extend(draw(st.lists(_scalar(field), max_size=4)))
        else:
            setattr(message, field.name, draw(_scalar(field)))
    return message


def _methods(service_descriptor, stub) -> list[tuple[str, object, type, bool]]:
    out = []
    for method in service_descriptor.methods:
        if method.name in SKIP:
            continue
        out.append((method.name, getattr(stub, method.name), method.input_type._concrete_class,
                    method.server_streaming))
    return out


def _healthy(address: str) -> None:
    with channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def _call(call, request, streaming: bool) -> grpc.StatusCode:
    try:
        if streaming:
            for _ in call(request, timeout=5):
                pass
        else:
            call(request, timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _fuzz(address: str, service, stub_class, method_name: str) -> None:
    with channel(address) as ch:
        methods = {m[0]: m for m in _methods(service, stub_class(ch))}
        _, call, request_class, streaming = methods[method_name]

        @hypothesis.settings(max_examples=40, deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(messages(request_class))
        def check(request):
            code = _call(call, request, streaming)
            assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method_name, request, code)
            _healthy(address)

        check()


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory):
    """A model of a few kilobytes: once a manifest exists, a generated GetWeights with a chunk size
    of a few bytes streams every byte in chunks that small, and with the tiny model's 78 KB such a
    call ran into its deadline instead of to its end."""
    return make_tiny_model(tmp_path_factory.mktemp("fuzz-model"), hidden_size=8, intermediate_size=16,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, micro_model_dir):
    root = tmp_path_factory.mktemp("fuzz-checkpoints")
    trainer = build_trainer_server("127.0.0.1:0", checkpoint_root=root)
    rollout = build_rollout_server("127.0.0.1:0")
    manager = JobManager(lambda job: (_ for _ in ()).throw(RuntimeError("no workers")),
                         runs_dir=tmp_path_factory.mktemp("fuzz-runs"), store=MemoryJobStore())
    coordinator = build_coordinator_server(manager, "127.0.0.1:0")
    addresses = {name: f"127.0.0.1:{s.port}" for name, s in
                 (("trainer", trainer), ("rollout", rollout), ("coordinator", coordinator))}
    with channel(addresses["trainer"]) as ch:
        trainer_pb2_grpc.TrainerStub(ch).Configure(trainer_pb2.ConfigureTrainerRequest(config=trainer_pb2.TrainerConfig(
            model_path=str(micro_model_dir), optimizer=trainer_pb2.OptimizerConfig(lr=1e-3))), timeout=60)
    with channel(addresses["rollout"]) as ch:
        rollout_pb2_grpc.RolloutStub(ch).Configure(rollout_pb2.ConfigureRolloutRequest(
            config=rollout_pb2.RolloutConfig(model_path=str(micro_model_dir), load_weights=True)), timeout=60)
    yield addresses
    for s in (trainer, rollout, coordinator):
        s.stop(0)
    manager.close()


def _names(service) -> list[str]:
    return [m.name for m in service.methods if m.name not in SKIP]


TRAINER = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"]
ROLLOUT = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"]
COORDINATOR = __import__("services.api.coordinator_pb2", fromlist=["x"]).DESCRIPTOR.services_by_name["Coordinator"]


@pytest.mark.parametrize("method", _names(TRAINER))
def test_trainer_methods_answer_every_generated_request_by_status(servers, method):
    _fuzz(servers["trainer"], TRAINER, trainer_pb2_grpc.TrainerStub, method)


@pytest.mark.parametrize("method", _names(ROLLOUT))
def test_rollout_methods_answer_every_generated_request_by_status(servers, method):
    _fuzz(servers["rollout"], ROLLOUT, rollout_pb2_grpc.RolloutStub, method)


@pytest.mark.parametrize("method", _names(COORDINATOR))
def test_coordinator_methods_answer_every_generated_request_by_status(servers, method):
    _fuzz(servers["coordinator"], COORDINATOR, coordinator_pb2_grpc.CoordinatorStub, method)


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_configure_answers_every_generated_config_by_status(tmp_path, tiny_model_dir, role):
    """Configure with the real model and every other field generated (device, dtype, optimizer
    numbers, tags...): an error names its field, never UNKNOWN."""
    server = build_trainer_server("127.0.0.1:0", checkpoint_root=tmp_path) if role == "trainer" else \
        build_rollout_server("127.0.0.1:0")
    address = f"127.0.0.1:{server.port}"
    config_class = trainer_pb2.TrainerConfig if role == "trainer" else rollout_pb2.RolloutConfig
    try:
        with channel(address) as ch:
            if role == "trainer":
                stub, request = trainer_pb2_grpc.TrainerStub(ch), trainer_pb2.ConfigureTrainerRequest
            else:
                stub, request = rollout_pb2_grpc.RolloutStub(ch), rollout_pb2.ConfigureRolloutRequest

            @hypothesis.settings(max_examples=40, deadline=None, derandomize=True, database=None,
                                 suppress_health_check=list(hypothesis.HealthCheck))
            @hypothesis.given(messages(config_class))
            def check(config):
                config.model_path = str(tiny_model_dir)
                code = _call(stub.Configure, request(config=config), False)
                assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (config, code)
                _healthy(address)

            check()
    finally:
        server.stop(0)


@pytest.mark.parametrize("field, value, message", [
    ("master_port", 70000, "master_port: 70000 is not a TCP port"),
    ("timeout_s", math.inf, "timeout_s: must be seconds"),
    ("timeout_s", math.nan, "timeout_s: must be seconds"),
    ("timeout_s", -1.0, "timeout_s: must be seconds"),
    ("world_size", 0, "world_size: must be in"),
    ("world_size", -3, "world_size: must be in"),
    ("rank_offset", 5, "rank_offset: "),
    ("backend", "mpi", "backend: unknown backend 'mpi'"),
])
@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_init_weight_update_group_refuses_bad_input_by_field(servers, role, field, value, message):
    from services.api import weights_pb2

    request = weights_pb2.InitWeightUpdateGroupRequest(master_address="127.0.0.1", master_port=29999, world_size=2,
                                                       rank_offset=0 if role == "trainer" else 1, backend="gloo",
                                                       timeout_s=1.0, group_name="fuzz")
    setattr(request, field, value)
    with channel(servers[role]) as ch:
        stub = trainer_pb2_grpc.TrainerStub(ch) if role == "trainer" else rollout_pb2_grpc.RolloutStub(ch)
        with pytest.raises(grpc.RpcError) as refused:
            stub.InitWeightUpdateGroup(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.details()
    _healthy(servers[role])


@pytest.mark.parametrize("value", [math.nan, -5.0, math.inf])
def test_update_weights_refuses_a_bad_timeout_by_field(servers, value):
    from services.api import weights_pb2

    with channel(servers["trainer"]) as ch:
        manifest = trainer_pb2_grpc.TrainerStub(ch).GetWeightManifest(trainer_pb2.GetWeightManifestRequest(), timeout=30)
    request = rollout_pb2.UpdateWeightsRequest(version=manifest.manifest.version, manifest=manifest.manifest,
                                               timeout_s=value,
                                               trainer=weights_pb2.TrainerEndpoint(address=servers["trainer"]))
    with channel(servers["rollout"]) as ch:
        with pytest.raises(grpc.RpcError) as refused:
            rollout_pb2_grpc.RolloutStub(ch).UpdateWeights(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s: must be seconds" in refused.value.details()


@pytest.mark.parametrize("chunk_bytes", [-1, 1 << 40])
def test_get_weights_refuses_a_chunk_size_it_cannot_send(servers, chunk_bytes):
    with channel(servers["trainer"]) as ch:
        stub = trainer_pb2_grpc.TrainerStub(ch)
        version = stub.GetWeightManifest(trainer_pb2.GetWeightManifestRequest(), timeout=30).manifest.version
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.GetWeights(trainer_pb2.GetWeightsRequest(version=version, chunk_bytes=chunk_bytes), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chunk_bytes: must be in" in refused.value.details()


def test_top_k_minus_one_means_all_as_the_proto_says(tiny_model_dir):
    server = build_rollout_server("127.0.0.1:0")  # its own: the fuzzing above may have released memory
    with channel(f"127.0.0.1:{server.port}") as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        stub.Configure(rollout_pb2.ConfigureRolloutRequest(
            config=rollout_pb2.RolloutConfig(model_path=str(tiny_model_dir), load_weights=True)), timeout=60)
        request = rollout_pb2.GenerateRequest(prompts=["1+2="], sampling=rollout_pb2.SamplingParams(
            top_k=-1, max_new_tokens=4, seed=3, ignore_eos=True))
        unfiltered = stub.Generate(request, timeout=30)
        request.sampling.top_k = 0
        assert [r.output_ids for r in stub.Generate(request, timeout=30).results] == \
            [r.output_ids for r in unfiltered.results]
        request.sampling.top_k = -2
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(request, timeout=30)
        assert "top_k: must be >= 0" in refused.value.details()
    server.stop(0)
