"""Rewards: built-in scorers, user functions by import path, and a real HTTP endpoint on loopback."""

from __future__ import annotations

import json
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from services.coordinator.config import RewardConfig
from services.coordinator.rewards import RewardError, build_reward, countdown, exact_match, math_answer


def test_exact_match_ignores_surrounding_whitespace():
    assert exact_match("  42\n", "42 ", "p") == 1.0
    assert exact_match("4 2", "42", "p") == 0.0
    assert build_reward(RewardConfig(kind="exact_match"))("x", "x", "p") == 1.0


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so the answer is 42", "42", 1.0),
        ("3 + 4 = 7, then 7 * 6 = 42.", "42", 1.0),
        ("first 42, no wait, 41", "42", 0.0),  # the last number counts
        ("The total is 1,234 apples", "1234", 1.0),
        ("half: 0.50", "1/2", 1.0),  # compared as numbers
        ("it is 3/4", "0.75", 1.0),
        ("-7", "-7.0", 1.0),
        ("x = 2.0000001", "2", 1.0),  # within the relative tolerance
        ("final: \\boxed{12} and then 13", "12", 1.0),  # \boxed beats the last number
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces, string comparison
        ("\\boxed{ X + 1 }", "x+1", 1.0),  # normalised: spaces, case
        ("\\boxed{$5$}", "5", 1.0),
        ("no numbers here", "5", 0.0),
        ("\\boxed{5", "5", 1.0),  # unclosed box: falls back to the last number
        ("", "0", 0.0),
    ],
)
def test_math_answer(completion, answer, expected):
    assert math_answer(completion, answer, "p") == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>(3 + 1) * 6</answer>", 1.0),  # not every number has to be used
        ("thinking...\n<answer>6 / (1 - 3 / 4) </answer>", 1.0),  # exact rational arithmetic
        ("Let me try.\n6 * 4 * 1 = 24", 1.0),  # the last line; "= 24" is ignored
        ("<answer>6 × 4</answer>", 1.0),
        ("<answer>6 + 4</answer>", 0.1),  # well-formed, wrong value
        ("<answer>6 * 4 * 1 * 1</answer>", 0.1),  # 1 is given once
        ("<answer>8 * 3</answer>", 0.1),  # 8 is not given
        ("<answer>6 / (4 - 4)</answer>", 0.1),  # 4 used twice (checked before evaluating)
        ("<answer>3 / (6 - 6)</answer>", 0.1),
        ("<answer>6 ** 2</answer>", 0.0),  # power is not allowed
        ("<answer>-6 + 30</answer>", 0.0),  # unary minus is not allowed
        ("<answer>__import__('os').system('true')</answer>", 0.0),
        ("<answer>6 4</answer>", 0.0),
        ("", 0.0),
    ],
)
def test_countdown(completion, expected):
    assert countdown(completion, "24|3,4,6,1", "p") == expected


def test_countdown_division_by_zero_is_wrong_not_an_error():
    assert countdown("<answer>3 / (4 - 4)</answer>", "24|3,4,4", "p") == 0.1


def test_countdown_malformed_answer_is_a_reward_error():
    with pytest.raises(RewardError, match="target\\|n1,n2"):
        countdown("1", "twenty-four", "p")


# --------------------------------------------------------------------------- python rewards


@pytest.fixture
def user_module(monkeypatch):
    module = types.ModuleType("my_rewards")
    module.length_bonus = lambda completion, answer, prompt: len(completion) / 10
    module.boom = lambda completion, answer, prompt: 1 / 0
    module.text = lambda completion, answer, prompt: "high"
    module.nan = lambda completion, answer, prompt: float("nan")
    module.not_callable = 3
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    return module


def test_python_reward_is_imported_by_module_and_function(user_module):
    reward = build_reward(RewardConfig(kind="python", function="my_rewards:length_bonus"))
    assert reward("abcde", "x", "p") == 0.5


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("my_rewards:missing", "'my_rewards' has no attribute 'missing'"),
        ("my_rewards:not_callable", "is not callable"),
    ],
)
def test_python_reward_import_errors_are_clear(user_module, function, message):
    with pytest.raises(RewardError, match=message):
        build_reward(RewardConfig(kind="python", function=function))


@pytest.mark.parametrize(
    ("function", "message"),
    [("boom", "raised ZeroDivisionError"), ("text", "returned str 'high', expected a number"), ("nan", "finite")],
)
def test_python_reward_failures_become_reward_errors(user_module, function, message):
    reward = build_reward(RewardConfig(kind="python", function=f"my_rewards:{function}"))
    with pytest.raises(RewardError, match=message):
        reward("c", "a", "p")


# --------------------------------------------------------------------------- http rewards


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)  # type: ignore[attr-defined]
        mode = body["answer"]
        if mode == "500":
            self.send_response(500)
            self.end_headers()
            return
        if mode == "garbage":
            payload = b"not json"
        elif mode == "nokey":
            payload = b'{"score": 1}'
        else:
            payload = json.dumps({"reward": 1.0 if body["completion"] == body["answer"] else 0.25}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:  # keep test output quiet
        pass


@pytest.fixture(scope="module")
def http_server():
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


def _http_reward(server: HTTPServer, timeout_s: float = 5.0):
    host, port = server.server_address
    return build_reward(RewardConfig(kind="http", url=f"http://{host}:{port}/score", timeout_s=timeout_s))


def test_http_reward_posts_prompt_completion_answer(http_server):
    reward = _http_reward(http_server)
    http_server.requests.clear()
    assert reward("7", "7", "3+4=") == 1.0
    assert reward("8", "7", "3+4=") == 0.25
    assert http_server.requests[0] == {"prompt": "3+4=", "completion": "7", "answer": "7"}


@pytest.mark.parametrize(
    ("answer", "message"),
    [("500", "answered HTTP 500"), ("garbage", "invalid JSON"), ("nokey", "expected \\{\"reward\"")],
)
def test_http_reward_errors_are_typed(http_server, answer, message):
    with pytest.raises(RewardError, match=message):
        _http_reward(http_server)("c", answer, "p")


def test_http_reward_unreachable_endpoint():
    probe = HTTPServer(("127.0.0.1", 0), _Handler)  # take a free port, then close it
    port = probe.server_address[1]
    probe.server_close()
    reward = build_reward(RewardConfig(kind="http", url=f"http://127.0.0.1:{port}/", timeout_s=2))
    with pytest.raises(RewardError, match="unreachable"):
        reward("c", "a", "p")


def test_a_coordinator_imports_only_the_reward_modules_its_operator_allowed(tmp_path, tiny_model_dir, task_files):
    import textwrap

    from services.coordinator.config import ConfigError
    from services.coordinator.jobs import JobManager
    from services.coordinator.rewards import check_reward_modules
    from services.coordinator.store import MemoryJobStore

    train, test = task_files

    def job(function: str) -> str:
        return textwrap.dedent(f"""
            name: rewards
            model: {tiny_model_dir}
            num_rollout: 1
            data: {{train: {train}}}
            reward: {{kind: python, function: "{function}"}}
            eval: {{datasets: [{{name: h, path: {test}, reward: {{kind: exact_match}}}}]}}
            """)

    refusing = JobManager(lambda job: None, runs_dir=tmp_path, store=MemoryJobStore())
    before = set(sys.modules)
    with pytest.raises(ConfigError, match=r"reward.function: module 'os' is not allowed on this coordinator \(allowed: none"):
        refusing.submit(job("os:system"), str(tmp_path))
    with pytest.raises(ConfigError, match="module 'rlfleet_never_imported' is not allowed"):
        refusing.submit(job("rlfleet_never_imported:f"), str(tmp_path))
    assert "rlfleet_never_imported" not in set(sys.modules) - before  # refused before any import
    assert refusing.list_page(None)[0] == []  # nothing stored, nothing queued

    allowing = JobManager(lambda job: None, runs_dir=tmp_path, store=MemoryJobStore(), allowed_reward_modules=("team",))
    check_reward_modules([RewardConfig(kind="python", function="team.scoring.v2:f")], ("team",))  # a package's module
    with pytest.raises(RewardError, match="'teamwork' is not allowed"):  # a prefix is not a package
        check_reward_modules([RewardConfig(kind="python", function="teamwork:f")], ("team",))
    record, created = allowing.submit(job("team.scoring:f"), str(tmp_path))
    assert created and record.name == "rewards"
    allowing.close()
    refusing.close()


def test_score_all_keeps_server_rewards_in_flight_together_in_order_and_raises_their_error():
    import threading

    from services.coordinator.rewards import score_all

    together = threading.Barrier(4, timeout=10)  # passes only when 4 calls wait at once

    class Server:
        io_bound = True

        def __call__(self, completion, answer, prompt, metadata=None):
            together.wait()
            if completion == "bad":
                raise RewardError("the server said no")
            return float(completion)

    rows = [(str(i), "", "", None) for i in range(8)]
    assert score_all(Server(), rows) == [float(i) for i in range(8)]
    with pytest.raises(RewardError, match="the server said no"):
        score_all(Server(), rows[:3] + [("bad", "", "", None)])
    calls = []
    assert score_all(lambda c, a, p, m=None: calls.append(c) or 1.0, rows) == [1.0] * 8  # in-process: in order
    assert calls == [r[0] for r in rows]
