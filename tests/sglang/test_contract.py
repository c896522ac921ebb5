"""The SGLang contract kit and the stand-in server themselves: the kit judges as the pinned wheel
does, and the stand-in answers in SGLang's shapes, in SGLang's order, and takes weights over a
gloo broadcast exactly as SGLang 0.5.23 receives them. The test plays the trainer (rank 0)."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.sglang import contract
from tests.sglang.standin import Standin

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-standin"
GOOD_GENERATE = {"input_ids": [[1, 2, 3], [4, 5]], "return_logprob": True,
                 "sampling_params": {"n": 2, "max_new_tokens": 4, "temperature": 1.0, "top_k": -1, "sampling_seed": 7}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """A stand-in process started as sglang.launch_server would be, and an httpx client for it."""
    httpx = pytest.importorskip("httpx")
    cmd = [sys.executable, "-m", "tests.sglang.standin", "--model-path", str(tiny_model_dir), "--port", "0",
           "--api-key", API_KEY, "--tp", "1", "--mem-fraction-static", "0.5", "--enable-memory-saver",
           "--standin-dist-timeout", "30"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("standin listening on "):
                url = line.split()[-1]
                break
        assert url, f"the stand-in exited with {proc.wait()}"
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
            yield client
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- the kit


def test_kit_rejects_an_unknown_sampling_key_with_sglangs_message():
    with pytest.raises(contract.ContractError, match="unknown field `seed`") as caught:
        contract.check_request("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"seed": 1}})
    assert caught.value.kind == "schema"
    contract.check_request("POST", "/generate", GOOD_GENERATE)


def test_kit_knows_required_keys_and_types_of_control_structs():
    body = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    contract.check_request("POST", "/init_weights_update_group", body)
    with pytest.raises(contract.ContractError, match="/init_weights_update_group: missing required key `world_size`"):
        contract.check_request("POST", "/init_weights_update_group", {k: v for k, v in body.items() if k != "world_size"})
    with pytest.raises(contract.ContractError, match="key `master_port` must be an integer"):
        contract.check_request("POST", "/init_weights_update_group", body | {"master_port": "29500"})
    with pytest.raises(contract.ContractError, match="/pause_generation: key `mode`"):
        contract.check_request("POST", "/pause_generation", {"mode": "drain"})


def test_kit_is_strict_about_keys_sglang_would_ignore():
    body = {"tags": ["weights"], "weight_version": "v1"}
    with pytest.raises(contract.ContractError, match="unknown key `weight_version`"):
        contract.check_request("POST", "/release_memory_occupation", body)
    contract.check_request("POST", "/release_memory_occupation", body, strict=False)


def test_kit_routes_come_from_the_wheel():
    routes = contract.routes()
    assert routes["/generate"] == {"POST", "PUT"}
    assert routes["/update_weights_from_distributed"] == {"POST"}
    assert "/get_weight_version" not in routes  # removed upstream by 0.5.19
    with pytest.raises(contract.ContractError) as caught:
        contract.check_request("GET", "/update_weights_from_distributed", {})
    assert caught.value.kind == "route"


def test_every_route_the_standin_serves_exists_in_the_wheel():
    served = {name for name in dir(Standin) if name.startswith("route_")}
    in_wheel = {"route_" + path.strip("/").replace("/", "_") for path in contract.routes()}
    assert served <= in_wheel, sorted(served - in_wheel)


# ---------------------------------------------------------------- the stand-in


def test_standin_health_and_api_key(server):
    import httpx

    assert server.get("/health_generate").status_code == 200
    bare = httpx.Client(base_url=str(server.base_url), timeout=10)
    assert bare.get("/health_generate").status_code == 200  # health is never behind the key
    denied = bare.get("/model_info")
    assert (denied.status_code, denied.json()) == (401, {"error": "Unauthorized"})
    info = server.get("/model_info").json()
    contract.check_response("/model_info", info)


def test_standin_answers_generate_in_sglangs_order_and_shapes(server):
    reply = server.post("/generate", json=GOOD_GENERATE)
    assert reply.status_code == 200, reply.text
    items = reply.json()
    contract.check_response("/generate", items, logprobs=True)
    # prompt-major, as SGLang's tokenizer manager expands n: p0s0, p0s1, p1s0, p1s1
    assert [it["meta_info"]["prompt_tokens"] for it in items] == [3, 3, 2, 2]
    assert len({it["meta_info"]["id"] for it in items}) == 4


def test_standin_rejects_what_the_wheel_rejects(server):
    reply = server.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "seed": 1}})
    assert reply.status_code == 400 and "unknown field `seed`" in reply.json()["error"]
    reply = server.post("/update_weights_from_distributed", json={"names": ["x"]})
    assert reply.status_code == 400 and "missing required key `dtypes`" in reply.json()["message"]


def test_standin_takes_a_flattened_bucket_over_gloo(server, tiny_model_dir):
    import torch
    from safetensors.torch import load_file

    init_group = contract.init_custom_process_group()
    before = server.get("/weights_checker").json()["per_engine_checksum"]
    # Outside a begin/end_weight_update session SGLang 0.5.23 refuses before receiving anything.
    refused = server.post("/update_weights_from_distributed", json={"names": ["model.norm.weight"],
                          "dtypes": ["float32"], "shapes": [[32]], "load_format": "flattened_bucket"})
    assert refused.status_code == 400 and "begin_weight_update" in refused.json()["message"]
    assert server.post("/begin_weight_update", json={}).json()["success"]

    port, replies = _free_port(), {}

    def call(key, path, body):
        replies[key] = server.post(path, json=body)

    joining = threading.Thread(target=call, args=("init", "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "test_sync", "backend": "gloo"}))
    joining.start()
    group = init_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                       group_name="test_sync", timeout=datetime.timedelta(seconds=30))
    joining.join(30)
    assert replies["init"].json() == {"success": True, "message": "Succeeded to initialize custom process group."}

    torch.manual_seed(1)
    new = {name: torch.randn_like(t) for name, t in load_file(tiny_model_dir / "model.safetensors").items()}
    body = {"names": list(new), "dtypes": [str(t.dtype).removeprefix("torch.") for t in new.values()],
            "shapes": [list(t.shape) for t in new.values()], "group_name": "test_sync",
            "load_format": "flattened_bucket", "weight_version": "step-1", "flush_cache": True}
    contract.check_request("POST", "/update_weights_from_distributed", body)
    sending = threading.Thread(target=call, args=("update", "/update_weights_from_distributed", body))
    sending.start()
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in new.values()])  # one buffer, no gaps
    torch.distributed.broadcast(flat, src=0, group=group)
    sending.join(30)
    assert replies["update"].status_code == 200, replies["update"].text
    assert replies["update"].json()["message"].endswith("Weight version updated to step-1.")
    # The default format: one broadcast per tensor, in `names` order.
    norm = torch.full((32,), 0.25)
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "group_name": "test_sync",
            "weight_version": "step-2"}
    sending = threading.Thread(target=call, args=("update", "/update_weights_from_distributed", body))
    sending.start()
    torch.distributed.broadcast(norm, src=0, group=group)
    sending.join(30)
    assert replies["update"].status_code == 200, replies["update"].text
    assert server.post("/end_weight_update", json={}).json()["success"]
    new["model.norm.weight"] = norm

    got = server.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 100}).json()
    assert got == pytest.approx(new["model.norm.weight"].tolist())
    assert server.get("/weights_checker").json()["per_engine_checksum"] != before
    embed = server.post("/get_weights_by_name", json={"name": "model.embed_tokens.weight", "truncate_size": 2}).json()
    torch.testing.assert_close(torch.tensor(embed), new["model.embed_tokens.weight"][:2])  # the first rows
    assert server.get("/model_info").json()["weight_version"] == "step-2"
    items = server.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).json()
    assert items["meta_info"]["weight_version"] == "step-2"
    done = server.post("/destroy_weights_update_group", json={"group_name": "test_sync"}).json()
    assert done == {"success": True, "message": "Succeeded to destroy custom process group."}
    torch.distributed.destroy_process_group(group)
    log = server.get("/_standin/requests").json()
    assert all(entry["path"] != "/_standin/requests" for entry in log)
