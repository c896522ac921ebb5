"""Environments as a service (`rlfleet serve environment`), over real gRPC: episodes run on the
server; one that is killed mid-episode, one that never answers, one that returns a 10 MB
observation and one that raises each fail their episodes in bounded time, counted and never
scored, while episodes on a healthy server finish; and a job runs on a remote environment."""

from __future__ import annotations

import json
import textwrap
import time

import grpc
import pytest

from services import rpc
from services.api import coordinator_pb2, environment_pb2, environment_pb2_grpc
from services.coordinator.agents import RemoteEnvironments, run_episodes
from services.coordinator.clients import Completion
from services.coordinator.datasets import Example
from services.environment.server import build_server
from services.launcher import LocalFleet
from tests.conftest import stop_fleet
from tests.integration import agent_envs
from tests.integration.conftest import addresses, run_job

pytestmark = pytest.mark.faults


class _Chars:
    def encode(self, text):
        return [ord(c) % 250 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def _generate(prompts_ids, max_new_tokens):
    return [Completion(0, p, [65, 66], "", [-0.5, -0.5], "length", 3) for p in prompts_ids]


def _examples(k):
    return [Example(prompt=f"q{i}", answer="", index=i) for i in range(k)]


@pytest.fixture
def servers():
    built = {name: build_server(factory=getattr(agent_envs, name))
             for name in ("Countdown", "Hangs", "Floods", "Raises", "Scorer")}
    agent_envs.RELEASE.clear()
    yield {name: f"127.0.0.1:{s.port}" for name, s in built.items()}
    agent_envs.RELEASE.set()  # (the hanging step returns: no server thread is left sleeping)
    for s in built.values():
        s.stop(0)


def test_bad_environments_fail_their_episodes_in_bounded_time_and_good_ones_finish(servers):
    remotes = {name: RemoteEnvironments(address, timeout_s=1.0, max_observation_bytes=1 << 20)
               for name, address in servers.items()}
    kinds = ["Countdown", "Hangs", "Floods", "Raises", "Countdown"]
    started = time.monotonic()
    episodes = run_episodes([remotes[k].new() for k in kinds], _examples(5), _Chars(), _generate, max_new_tokens=2,
                            max_turns=5, max_tokens=100)
    assert time.monotonic() - started < 10  # the hanging one cost its timeout, once
    good, hangs, floods, raises, good2 = episodes
    for ep in (good, good2):
        assert ep.done and not ep.failed and ep.turns == 3 and ep.reward == 1.0
        assert ep.mask == [1, 1] + [0] * len(" 2 ") + [1, 1] + [0] * len(" 1 ") + [1, 1]
    assert "DEADLINE_EXCEEDED" in hangs.failed and hangs.reward == 0.0
    assert "over 1048576 bytes" in floods.failed
    assert "the verifier crashed" in raises.failed and "INVALID_ARGUMENT" in raises.failed
    for remote in remotes.values():
        remote.close()


def test_a_server_killed_mid_episode_fails_the_rest_of_it(tmp_path):
    local = LocalFleet(tmp_path / "logs")
    try:
        child = local.start("environment", "env-0", ["--module", "tests.integration.agent_envs:Countdown"])
        local.wait_ready()
        remote = RemoteEnvironments(child.address, timeout_s=2.0)
        env = remote.new()
        assert env.reset(Example(prompt="q", answer="", index=0)) == "q"
        assert env.step("a").text == " 2 "
        child.process.kill()  # SIGKILL, mid-episode
        child.process.wait()
        episodes = run_episodes([env], [Example("q", "", 0)], _Chars(), _generate, max_new_tokens=2, max_turns=5,
                                max_tokens=100)
        # (reset against the dead server: it fails at once, named)
        assert episodes[0].failed and "UNAVAILABLE" in episodes[0].failed
        remote.close()
    finally:
        stop_fleet(local)


def test_unknown_episodes_and_bad_metadata_are_refused_by_name(servers):
    with rpc.open_channel(servers["Countdown"]) as ch:
        stub = environment_pb2_grpc.EnvironmentStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(environment_pb2.StepRequest(episode_id="nope", action="a"), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "not held" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Reset(environment_pb2.ResetRequest(prompt="q", metadata_json="[1"), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "metadata_json" in info.value.details()
        assert stub.Score(environment_pb2.ScoreRequest(prompt="q", completion="a"), timeout=5).reward == 0.0


def test_a_job_trains_on_a_remote_environment_and_drops_groups_whose_server_fails(fleet, tiny_model_dir, task_files,
                                                                                   tmp_path, servers):
    train, test = task_files
    for name, expect_trained in (("Countdown", True), ("Raises", False)):
        job = textwrap.dedent(f"""
            name: remote-{name.lower()}
            model: {tiny_model_dir}
            num_rollout: 2
            output_dir: {tmp_path / name}
            rollout: {{prompts_per_step: 3, samples_per_prompt: 2, sampling: {{max_new_tokens: 3}}}}
            data: {{train: {train}}}
            eval: {{every: 0, datasets: [{{name: h, path: {test}, limit: 4, sampling: {{temperature: 0.0, max_new_tokens: 3}}}}]}}
            trainer: {{optimizer: {{lr: 0.01}}}}
            agent: {{environment: remote, address: "{servers[name]}", timeout_s: 5, max_turns: 4, max_tokens: 60}}
            """)
        final, events = run_job(addresses(fleet)["coordinator"], job, timeout_s=120)
        assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error  # the job goes on either way
        steps = {e.step: json.loads(e.data_json) for e in events if e.kind == "step"}
        assert sorted(steps) == [1, 2]
        for m in steps.values():
            if expect_trained:
                assert m["samples"] == 6 and m["episodes_failed"] == 0 and m["turns_mean"] == 3 and m["reward_mean"] == 1
            else:
                assert m["samples"] == 0 and m["episodes_failed"] == 6  # counted, never scored


def test_a_remote_reward_scores_with_the_servers_score_call_and_names_a_failure(servers):
    from services.coordinator.config import RewardConfig
    from services.coordinator.rewards import RewardError, build_reward

    reward = build_reward(RewardConfig(kind="remote", address=servers["Scorer"], timeout_s=1.0))
    assert reward("42", "42", "q") == 0.25
    with pytest.raises(RewardError, match=f"server {servers['Scorer']} returned nan, expected a finite number"):
        reward("nan", "1", "q")
    started = time.monotonic()
    with pytest.raises(RewardError, match="reward server: environment .* Score: DEADLINE_EXCEEDED"):
        reward("hang", "1", "q")
    assert time.monotonic() - started < 5
    with pytest.raises(ValueError, match="address: kind remote needs host:port"):
        RewardConfig(kind="remote")


def test_a_single_turn_job_is_scored_by_a_remote_reward_server(fleet, tiny_model_dir, task_files, tmp_path, servers):
    train, test = task_files
    job = textwrap.dedent(f"""
        name: remote-reward
        model: {tiny_model_dir}
        num_rollout: 2
        output_dir: {tmp_path / 'out'}
        rollout: {{prompts_per_step: 3, samples_per_prompt: 2, sampling: {{max_new_tokens: 3}}}}
        data: {{train: {train}}}
        reward: {{kind: remote, address: "{servers['Scorer']}", timeout_s: 5}}
        eval: {{every: 0, datasets: [{{name: h, path: {test}, limit: 4, sampling: {{temperature: 0.0, max_new_tokens: 3}}}}]}}
        trainer: {{optimizer: {{lr: 0.01}}}}
        """)
    final, events = run_job(addresses(fleet)["coordinator"], job, timeout_s=120)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    steps = [json.loads(e.data_json) for e in events if e.kind == "step"]
    evals = [json.loads(e.data_json) for e in events if e.kind == "eval"]
    assert len(steps) == 2 and all(m["reward_mean"] == 0.25 and m["samples"] == 6 for m in steps)
    assert evals and all(e["score"] == 0.25 for e in evals)  # the eval set takes the job's reward
