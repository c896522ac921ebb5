"""The SGLang contract kit and the stand-in server themselves: the kit judges as the pinned wheel
does (request structs, the unpickler allowlist, which models read weights back), and the stand-in
answers in SGLang's shapes, in SGLang's order, and takes weights over a gloo broadcast or as a
serialized flattened bucket exactly as SGLang 0.5.23 receives them. The test plays the trainer."""

from __future__ import annotations

import base64
import binascii
import contextlib
import datetime
import pickle
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from tests.conftest import make_tiny_model
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


@contextlib.contextmanager
def _standin(model_dir: Path, *flags: str):
    """A stand-in process started as sglang.launch_server would be, and an httpx client for it."""
    httpx = pytest.importorskip("httpx")
    cmd = [sys.executable, "-m", "tests.sglang.standin", "--model-path", str(model_dir), "--port", "0",
           "--api-key", API_KEY, "--tp", "1", "--mem-fraction-static", "0.5", *flags]
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


@pytest.fixture(scope="module")
def llama_model_dir(tmp_path_factory) -> Path:
    """Llama: one of the model classes whose weights SGLang 0.5.23 reads back by name."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), architecture="llama", seed=3)


@pytest.fixture(scope="module")
def server(llama_model_dir):
    with _standin(llama_model_dir, "--enable-memory-saver", "--standin-dist-timeout", "30") as client:
        yield client


def _payload(obj) -> str:
    """`serialized_named_tensors[0]` for `obj`: base64 of a plain pickle (CPU tensors pickle their
    bytes through torch.storage._load_from_bytes, which SGLang's allowlist special-cases)."""
    return base64.b64encode(pickle.dumps(obj)).decode()


def _flattened_bucket(tensors: dict, align: int = 16) -> dict:
    """The adapter's flattened-bucket payload: byte offsets into one uint8 tensor, each tensor
    starting on an `align`-byte boundary (so there are gaps)."""
    import torch

    chunks, metadata, offset = [], [], 0
    for name, t in tensors.items():
        data = t.reshape(-1).view(torch.uint8)
        metadata.append(types.SimpleNamespace(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                              end_idx=offset + data.numel(), numel=data.numel()))
        gap = -(offset + data.numel()) % align
        chunks += [data, data.new_full((gap,), 0xAB)]
        offset += data.numel() + gap
    return {"flattened_tensor": torch.cat(chunks), "metadata": metadata}


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


class _Reduces:
    """Pickles as a call of `fn(*args)`."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_kit_reads_sglangs_unpickler_allowlist():
    allowed = contract.safe_unpickler_globals()
    assert {("types", "SimpleNamespace"), ("torch._utils", "_rebuild_tensor_v2"),
            ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")} <= allowed
    assert not {("os", "system"), ("builtins", "eval"), ("torch", "load")} & allowed


@pytest.mark.parametrize("payload, named", [
    (b"cos\nsystem\n(S'touch standin-pwned'\ntR.", "os.system"),  # protocol 0, by hand: os.system pickles as posix
    (pickle.dumps({"metadata": _Reduces(eval, "1 + 1")}), "builtins.eval"),
], ids=["os.system", "builtins.eval"])
def test_kit_refuses_globals_off_sglangs_allowlist(payload, named, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError) as caught:
        contract.deserialize_named_tensors(base64.b64encode(payload).decode())
    assert str(caught.value) == f"Blocked unsafe global ({named}) during pickle deserialization"
    assert not (tmp_path / "standin-pwned").exists()


def test_kit_unpickles_a_cpu_flattened_bucket_as_sglang_does():
    import torch

    bucket = _flattened_bucket({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                                "b": torch.ones(3, dtype=torch.bfloat16)})
    got, named = contract.deserialize_named_tensors(_payload(bucket))
    assert torch.equal(got["flattened_tensor"], bucket["flattened_tensor"])
    assert got["metadata"] == bucket["metadata"]
    assert {"torch.storage._load_from_bytes", "torch._utils._rebuild_tensor_v2", "types.SimpleNamespace"} <= set(named)
    with pytest.raises(binascii.Error):  # validate=True, as SGLang
        contract.deserialize_named_tensors("not base64!")


def test_kit_rebuilds_cuda_tensors_with_sglangs_device_uuid_patch():
    """The adapter's CUDA payload names torch's rebuild_cuda_tensor with a GPU UUID as the device:
    SGLang's patched reductions look the UUID up among the local GPUs (none matches here)."""
    import torch
    from torch.multiprocessing import reductions

    args = (torch.Tensor, torch.Size([4]), (1,), 0, torch.storage.TypedStorage, torch.uint8, "GPU-00000000-standin",
            b"handle", 4, 0, False, b"refcount", 0, None, False)
    with pytest.raises(Exception, match="^Invalid device_uuid=GPU-00000000-standin$"):
        contract.deserialize_named_tensors(pickle.dumps(_Reduces(reductions.rebuild_cuda_tensor, *args)))


def test_kit_knows_which_models_read_weights_back():
    readable = contract.weights_by_name_architectures()
    assert {"LlamaForCausalLM", "Phi3ForCausalLM"} <= readable  # Phi3 inherits Llama's
    assert not {"Qwen2ForCausalLM", "Qwen3ForCausalLM"} & readable


def test_kit_checks_tensor_update_and_read_back_bodies():
    body = {"serialized_named_tensors": [_payload({})], "load_format": "flattened_bucket", "flush_cache": True,
            "weight_version": "3"}
    contract.check_request("POST", "/update_weights_from_tensor", body)
    with pytest.raises(contract.ContractError, match="serialized_named_tensors` must be base64-encoded bytes"):
        contract.check_request("POST", "/update_weights_from_tensor", body | {"serialized_named_tensors": ["gA*"]})
    contract.check_request("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 32})
    with pytest.raises(contract.ContractError, match="truncate_size` must be an integer"):
        contract.check_request("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "32"})


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


def test_standin_takes_a_flattened_bucket_over_gloo(server, llama_model_dir):
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
    new = {name: torch.randn_like(t) for name, t in load_file(llama_model_dir / "model.safetensors").items()}
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


def _read(server, name: str, rows: int):
    import torch

    reply = server.post("/get_weights_by_name", json={"name": name, "truncate_size": rows})
    assert reply.status_code == 200, reply.text
    return torch.tensor(reply.json())


def test_standin_reads_weights_back_only_for_models_sglang_can(server, llama_model_dir, tmp_path):
    from safetensors.torch import load_file

    qwen2 = make_tiny_model(tmp_path / "qwen2", architecture="qwen2")
    with _standin(qwen2) as refusing:
        reply = refusing.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 32})
    assert (reply.status_code, reply.json()) == (400, {"error": {"message": "Get parameter by name failed"}})
    # Llama answers: the first rows, as float32; tied, its lm_head reads as the embedding.
    embed = _read(server, "model.embed_tokens.weight", 17)
    assert embed.shape == load_file(llama_model_dir / "model.safetensors")["model.embed_tokens.weight"].shape
    assert _read(server, "lm_head.weight", 17).equal(embed)
    assert _read(server, "model.embed_tokens.weight", 2).equal(embed[:2])


def test_standin_starts_dummy_and_takes_a_serialized_flattened_bucket(llama_model_dir):
    """`--load-format dummy` weights differ from the checkpoint until an update gives them back;
    /update_weights_from_tensor takes CPU tensors pickled plainly, inside a session only."""
    import torch
    from safetensors.torch import load_file

    real = load_file(llama_model_dir / "model.safetensors")
    with _standin(llama_model_dir, "--load-format", "dummy") as server:
        assert server.get("/model_info").json()["load_format"] == "dummy"
        assert not _read(server, "model.norm.weight", 32).equal(real["model.norm.weight"])
        assert _read(server, "model.norm.weight", 32).abs().max() <= 1e-3  # SGLang's uniform(-1e-3, 1e-3)

        body = {"serialized_named_tensors": [_payload(_flattened_bucket(real))], "load_format": "flattened_bucket",
                "flush_cache": True, "weight_version": "v1"}
        refused = server.post("/update_weights_from_tensor", json=body)
        assert refused.status_code == 400 and refused.json() == {"success": False, "message": (
            "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")}
        assert server.post("/begin_weight_update", json={}).json()["success"]
        unknown = server.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [_payload([("model.norm.weight", real["model.norm.weight"])])],
            "load_format": "bogus"})
        assert unknown.status_code == 400 and unknown.json()["message"] == "Unknown load_format=bogus"
        unsafe = server.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [base64.b64encode(pickle.dumps(_Reduces(eval, "1"))).decode()]})
        assert (unsafe.status_code, unsafe.json()["message"]) == (
            400, "Blocked unsafe global (builtins.eval) during pickle deserialization")

        loaded = server.post("/update_weights_from_tensor", json=body)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json() == {"success": True, "message": "Success Weight version updated to v1."}
        norm = torch.full((32,), 0.5)
        pairs = server.post("/update_weights_from_tensor", json={  # load_format None: (name, tensor) pairs
            "serialized_named_tensors": [_payload([("model.norm.weight", norm)])]})
        assert pairs.status_code == 200, pairs.text
        assert server.post("/end_weight_update", json={}).json()["success"]

        for name, tensor in (real | {"model.norm.weight": norm}).items():
            assert _read(server, name, tensor.shape[0]).equal(tensor), name
        assert server.get("/model_info").json()["weight_version"] == "v1"
        loads = [e for e in server.get("/_standin/requests").json()
                 if e["path"] == "/update_weights_from_tensor" and e["status"] == 200]
        assert all("torch.storage._load_from_bytes" in e["globals"] for e in loads) and len(loads) == 2
