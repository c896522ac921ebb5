"""Every request body the SGLang adapter can send, checked against SGLang 0.5.23's own types read
from the pinned wheel (strictly: a key SGLang would ignore fails too), without any server."""

from __future__ import annotations

import pytest

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
