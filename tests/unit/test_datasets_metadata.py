"""Row metadata (data.metadata_keys) travels from the dataset to the reward: python rewards that
ask for it get `metadata=`, three-argument ones keep working, HTTP endpoints get it in the body."""

from __future__ import annotations

import json
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from services.coordinator.config import RewardConfig
from services.coordinator.datasets import Columns, load_examples
from services.coordinator.rewards import build_reward, countdown, exact_match, math_answer


@pytest.fixture
def example(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": "7", "tolerance": 0.5, "tags": ["a"], "unused": 1}) + "\n")
    (row,) = load_examples(path, Columns(metadata_keys=("tolerance", "tags")))
    assert row.metadata == {"tolerance": 0.5, "tags": ["a"]}
    return row


@pytest.fixture
def user_module(monkeypatch):
    module = types.ModuleType("meta_rewards")
    module.seen = []

    def with_metadata(completion, answer, prompt, metadata):
        module.seen.append(metadata)
        return abs(float(completion) - float(answer)) <= metadata["tolerance"]

    def with_kwargs(completion, answer, prompt, **kwargs):
        module.seen.append(kwargs)
        return 1.0

    module.with_metadata = with_metadata
    module.with_kwargs = with_kwargs
    module.three_args = lambda completion, answer, prompt: 0.5
    monkeypatch.setitem(sys.modules, "meta_rewards", module)
    return module


def test_python_rewards_get_metadata_only_when_they_ask(user_module, example):
    reward = build_reward(RewardConfig(kind="python", function="meta_rewards:with_metadata"))
    assert reward("7.4", example.answer, example.prompt, example.metadata) == 1.0
    assert reward("8", example.answer, example.prompt, example.metadata) == 0.0
    assert user_module.seen[0] == {"tolerance": 0.5, "tags": ["a"]}
    build_reward(RewardConfig(kind="python", function="meta_rewards:with_kwargs"))("x", "y", "p", {"k": 1})
    assert user_module.seen[-1] == {"metadata": {"k": 1}}
    three = build_reward(RewardConfig(kind="python", function="meta_rewards:three_args"))
    assert three("x", "y", "p", example.metadata) == 0.5 and three("x", "y", "p") == 0.5


def test_builtins_accept_and_ignore_metadata(example):
    for reward in (exact_match, math_answer):
        assert reward("7", "7", "p", example.metadata) == 1.0
    assert countdown("<answer>3*8</answer>", "24|3,8", "p", example.metadata) == 1.0


class _Echo(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)  # type: ignore[attr-defined]
        payload = b'{"reward": 1.0}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


def test_http_rewards_get_metadata_in_the_body_when_there_is_some(example):
    server = HTTPServer(("127.0.0.1", 0), _Echo)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        host, port = server.server_address
        reward = build_reward(RewardConfig(kind="http", url=f"http://{host}:{port}/", timeout_s=5))
        reward("7", "7", "q", example.metadata)
        reward("7", "7", "q", {})
        reward("7", "7", "q")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert server.requests[0] == {"prompt": "q", "completion": "7", "answer": "7", "metadata": {"tolerance": 0.5, "tags": ["a"]}}
    assert server.requests[1] == server.requests[2] == {"prompt": "q", "completion": "7", "answer": "7"}
