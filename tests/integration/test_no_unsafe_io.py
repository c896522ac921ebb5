"""No pickle on any wire or file, no unsafe loader, and no secret in any log: the code is scanned
for the calls that would break this, and a job is run with a token to check every log for it."""

from __future__ import annotations

import ast
import re
import secrets
import textwrap
import time
from pathlib import Path

import pytest

from services.api import coordinator_pb2
from services.launcher import LocalFleet
from tests.conftest import stop_fleet
from tests.integration.conftest import run_job

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "services").rglob("*.py"))
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
# The one module that may import pickle, and why: SGLang's /update_weights_from_tensor takes a pickle
# of CUDA IPC handles. This module only writes one (pickle.dumps), for an SGLang on the same host
# over loopback; nothing in rlfleet ever loads a pickle (checked below for every module).
SANCTIONED_PICKLE_WRITERS = {"services/rollout/sglang/ipc.py"}
PICKLE_LOADERS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "cPickle.loads", "dill.loads"}
# torch.distributed's object collectives pickle what they carry (between trainer pods, a socket)
OBJECT_COLLECTIVES = {"gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list",
                      "send_object_list", "recv_object_list"}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def test_no_module_imports_a_pickler_or_calls_an_unsafe_loader():
    problems = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        sanctioned = path.relative_to(ROOT).as_posix() in SANCTIONED_PICKLE_WRITERS
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            problems += [f"{path.name}:{node.lineno} imports {n}" for n in names
                         if n.split(".")[0] in UNSAFE_MODULES and not (sanctioned and n == "pickle")]
        for call, name in _calls(tree):
            keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
            where = f"{path.name}:{call.lineno} {name}"
            if name.endswith("torch.load") and keywords.get("weights_only") != "True":
                problems.append(f"{where} without weights_only=True")
            if name in ("yaml.load", "yaml.load_all") and "Loader" not in keywords:
                problems.append(f"{where} without a safe Loader")
            if name.endswith("np.load") and keywords.get("allow_pickle") == "True":
                problems.append(f"{where} with allow_pickle=True")
            if name in ("eval", "exec", "torch.jit.load") or name in PICKLE_LOADERS:
                problems.append(where)
            if name.split(".")[-1] in OBJECT_COLLECTIVES:
                problems.append(f"{where} pickles what it sends")
    assert not problems, problems


def _logged_names(node: ast.AST) -> list[str]:
    """Names whose values an expression passes on (an `x if token else y` logs x or y, not token)."""
    if isinstance(node, ast.IfExp):
        return _logged_names(node.body) + _logged_names(node.orelse)
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr] + _logged_names(node.value)
    return [name for child in ast.iter_child_nodes(node) for name in _logged_names(child)]


def test_no_log_call_formats_a_token_or_secret():
    pattern = re.compile(r"(token|secret|password|credential)", re.I)
    problems = []
    for path in SOURCES:
        for call, name in _calls(ast.parse(path.read_text(), str(path))):
            if not re.search(r"(log|logger|logging)\.(debug|info|warning|error|exception|critical)$", name):
                continue
            for arg in call.args[1:]:  # the message's arguments, not its text
                if any(pattern.search(n) for n in _logged_names(arg)):
                    problems.append(f"{path.name}:{call.lineno}: {ast.unparse(call)[:120]}")
    assert not problems, problems


def test_a_job_run_with_a_token_leaves_it_in_no_log(tmp_path, tiny_model_dir, task_files):
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    train, test = task_files
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1", "RLFLEET_TOKEN": token})
    try:
        trainer = local.start("trainer", "trainer-0", ["--checkpoint-root", str(tmp_path), "--log-level", "DEBUG"])
        rollout = local.start("rollout", "rollout-0", ["--log-level", "DEBUG"])
        local.wait_ready()
        coordinator = local.start("coordinator", "coordinator", [
            "--trainers", trainer.address, "--rollouts", rollout.address, "--db", str(tmp_path / "jobs.db"),
            "--worker-token-file", str(tmp_path / "token"), "--log-level", "DEBUG"])
        local.wait_ready()
        job = textwrap.dedent(f"""
            name: secret-keeper
            model: {tiny_model_dir}
            num_rollout: 2
            output_dir: {tmp_path / 'out'}
            rollout: {{prompts_per_step: 2, samples_per_prompt: 2, sampling: {{max_new_tokens: 3}}}}
            data: {{train: {train}}}
            eval: {{every: 0, datasets: [{{name: h, path: {test}, limit: 4, sampling: {{max_new_tokens: 3}}}}]}}
            weight_sync: {{plane: grpc_stream}}
            checkpoint: {{every: 1, dir: {tmp_path / 'ckpt'}}}
            """)
        final, _ = run_job(coordinator.address, job, token=token)
        assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
        time.sleep(0.5)  # the last log lines
    finally:
        stop_fleet(local)
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "token"]
    assert any(p.suffix == ".log" for p in written) and any("jobs.db" in p.name for p in written)
    leaks = [str(p) for p in written if token.encode() in p.read_bytes()]
    assert not leaks, f"the token is in {leaks}"
