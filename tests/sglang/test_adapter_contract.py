"""Every request body the SGLang adapter can send, checked against SGLang 0.5.23's own types read
from the pinned wheel (strictly: a key SGLang would ignore fails too), without any server."""

from __future__ import annotations

import base64
import io
import pickle
import sys

import pytest
import torch

from services.api import weights_pb2
from services.rollout.sglang import ipc
from services.weights.buckets import pack_bucket, plan_buckets

from services.rollout.sglang.client import SglangClient
from services.rollout.sglang.engine import sampling_params
from services.rollout.types import Sampling
from tests.sglang import contract

pytestmark = pytest.mark.sglang


class Recorder(SglangClient):
    """The adapter's client with the wire replaced by a list of what it would send."""

    def __init__(self):
        super().__init__("http://127.0.0.1:1", "key")
        self.sent: list[tuple[str, str, object]] = []

    def call(self, path, body=None, *, method="POST", timeout_s=None):
        self.sent.append((method, path, body))
        return [] if path == "/generate" else {"success": True, "message": ""}


SAMPLINGS = [
    Sampling(),
    Sampling(temperature=0.0, max_new_tokens=3),
    Sampling(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64, n=8, seed=1234, stop=("\n", "##"),
             stop_token_ids=(2, 7), ignore_eos=True),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["defaults", "greedy", "everything"])
def test_generate_bodies_pass_sglangs_schema(sampling):
    client = Recorder()
    client.generate([[3, 4, 5], [6]], sampling_params(sampling), rid="rlfleet-1", timeout_s=10)
    (method, path, body), = client.sent
    contract.check_request(method, path, body)


def test_every_control_body_passes_sglangs_request_structs():
    client = Recorder()
    client.init_weights_update_group(master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3,
                                     group_name="rlfleet-weights-1", backend="nccl", timeout_s=10)
    client.begin_weight_update()
    client.update_weights_from_distributed(names=["model.norm.weight"], dtypes=["bfloat16"], shapes=[[896]],
                                           group_name="rlfleet-weights-1", flush_cache=True, weight_version="7",
                                           timeout_s=10)
    client.update_weights_from_distributed(names=["a", "b"], dtypes=["float32", "float32"], shapes=[[2, 2], [3]],
                                           group_name="g", flush_cache=False, weight_version=None, timeout_s=10)
    client.update_weights_from_tensor(serialized_named_tensors=["gAJ9cQAu"], flush_cache=True, weight_version="8",
                                      timeout_s=10)
    client.update_weights_from_tensor(serialized_named_tensors=["gAJ9cQAu"], flush_cache=False, weight_version=None,
                                      timeout_s=10)
    client.get_weights_by_name("model.layers.0.self_attn.q_proj.weight", 896, timeout_s=10)
    client.end_weight_update()
    client.destroy_weights_update_group("rlfleet-weights-1")
    client.release_memory(["kv_cache", "cuda_graph"])
    client.resume_memory(["weights"])
    client.abort("rlfleet-1")
    client.model_info()
    client.healthy()
    routes = contract.routes()
    for method, path, body in client.sent:
        assert path in routes and method in routes[path], (method, path)
        contract.check_request(method, path, body)


def test_the_contract_would_catch_a_key_sglang_refuses():
    body = {"input_ids": [[1]], "sampling_params": {**sampling_params(Sampling()), "seed": 1}, "return_logprob": True}
    with pytest.raises(contract.ContractError, match="seed"):
        contract.check_request("POST", "/generate", body)


def test_the_colocated_payload_names_only_what_sglangs_unpickler_allows_and_rebuilds_the_bucket():
    """SGLang reads `/update_weights_from_tensor`'s payload with its SafeUnpickler (the allowlist
    read from the wheel) and rebuilds the tensors with its FlattenedTensorBucket (the wheel's
    class): every tensor comes back bit for bit, gaps between slots skipped, and the one CUDA
    rebuild call carries the trainer's handle with the GPU named by UUID."""
    generator = torch.Generator().manual_seed(0)
    named = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 8, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.randn(7, generator=generator).to(torch.bfloat16),  # odd size: a gap follows
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=generator).to(torch.bfloat16),
    }
    (spec,) = plan_buckets(named.items(), 1 << 20)
    flat = pack_bucket(spec, named)  # the bytes the trainer's handle points at
    assert spec.tensors[2].offset > spec.tensors[1].end  # the layout really has a gap
    handle = weights_pb2.CudaIpcHandle(
        bucket=0, gpu_uuid="GPU-8d3c1f7e", device_index=3, handle=b"\x01" * 64, storage_size_bytes=1 << 21,
        storage_offset_bytes=512, tensor_offset=0, ref_counter_handle=b"/torch_1_2", ref_counter_offset=5,
        event_handle=b"\x02" * 64, event_sync_required=True)
    client = Recorder()
    client.begin_weight_update()
    client.update_weights_from_tensor(serialized_named_tensors=[ipc.bucket_payload(handle, spec)], flush_cache=True,
                                      weight_version="4", timeout_s=10)
    (_, _, body) = client.sent[-1]
    contract.check_request("POST", "/update_weights_from_tensor", body)

    allowed, named_globals, rebuilds = contract.safe_unpickler_globals(), [], []

    class SglangSide(pickle.Unpickler):
        def find_class(self, module, name):
            named_globals.append((module, name))
            assert (module, name) in allowed, f"SGLang's SafeUnpickler blocks {module}.{name}"
            if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
                return lambda *args: rebuilds.append(args) or flat  # no GPU here: the bytes behind the handle
            return super().find_class(module, name)

    raw = base64.b64decode(body["serialized_named_tensors"][0], validate=True)  # SGLang: validate=True
    received = SglangSide(io.BytesIO(raw)).load()
    assert ("types", "SimpleNamespace") in named_globals
    (args,) = rebuilds
    assert args[1] == torch.Size([spec.nbytes]) and args[5] is torch.uint8
    assert args[6] == "GPU-8d3c1f7e"  # SGLang's patched reductions map the UUID to its own index
    assert (args[7], args[8], args[9], args[11], args[12], args[13], args[14]) == (
        handle.handle, handle.storage_size_bytes, handle.storage_offset_bytes, handle.ref_counter_handle,
        handle.ref_counter_offset, handle.event_handle, True)

    bucket_module = sys.modules[contract.flattened_tensor_bucket().__module__]
    metadata = [bucket_module.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                                      end_idx=m.end_idx, numel=m.numel)
                for m in received["metadata"]]  # as SGLang's _update_weights_from_flattened_bucket converts them
    rebuilt = dict(bucket_module.FlattenedTensorBucket(flattened_tensor=received["flattened_tensor"],
                                                       metadata=metadata).reconstruct_tensors())
    assert rebuilt.keys() == named.keys()
    for name, tensor in named.items():
        assert rebuilt[name].dtype == tensor.dtype and torch.equal(rebuilt[name].view(torch.int16),
                                                                   tensor.view(torch.int16)), name


def test_a_payload_is_built_only_from_the_handle_of_its_own_bucket():
    (spec,) = plan_buckets([("w", torch.zeros(4))], 1 << 20)
    with pytest.raises(ValueError, match="bucket 1 given for bucket 0"):
        ipc.bucket_payload(weights_pb2.CudaIpcHandle(bucket=1, gpu_uuid="GPU-1", handle=b"h"), spec)
    with pytest.raises(ValueError, match="names no GPU"):
        ipc.bucket_payload(weights_pb2.CudaIpcHandle(bucket=0, handle=b"h"), spec)


def test_every_child_key_reaches_sglang_as_its_api_key():
    """The launch line is parsed by argparse (SGLang's, and the stand-in's): a key that looked like
    an option would make the child exit at start, now and then."""
    from services.rollout.sglang.process import SglangProcess, new_api_key
    from tests.sglang.standin import parse_args

    process = SglangProcess(model_path="/m", command=["sglang"], args=["--tp", "1"], memory_saver=False,
                            startup_timeout_s=1, request_timeout_s=1)
    for _ in range(1000):
        key = new_api_key()
        assert parse_args(process.argv(30000, key)[1:]).api_key == key
