"""Asynchronous RL through the coordinator on a real fleet (trainer, engine and coordinator
processes on loopback): the engines generate coming steps while the trainer trains, no trained
sample is more than max_staleness versions behind, weights reach the engines mid-generation, and
max_staleness 0 is the synchronous job bit for bit."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from services.api import coordinator_pb2
from tests.integration.conftest import addresses, run_job

NOISE = ("_s", "time", "wake", "sleep", "_frac", "queue_depth")  # timings and what depends on them


EVAL = "{{every: 4, datasets: [{{name: h, path: {test}, limit: 8, sampling: {{temperature: 0.0, max_new_tokens: 3}}}}]}}"


def _job(name, model, train, test, out, algorithm: str = "", steps: int = 8, eval_: str = EVAL) -> str:
    return textwrap.dedent(f"""
        name: {name}
        seed: 3
        model: {model}
        num_rollout: {steps}
        output_dir: {out}
        rollout: {{prompts_per_step: 4, samples_per_prompt: 4, sampling: {{max_new_tokens: 6}}}}
        data: {{train: {train}}}
        eval: {eval_.format(test=test)}
        trainer: {{optimizer: {{lr: 0.01}}}}
        algorithm: {{advantage: grpo{algorithm}}}
        """)


def _steps(events) -> dict[int, dict]:
    return {e.step: json.loads(e.data_json) for e in events if e.kind == "step"}


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_no_trained_sample_is_more_than_max_staleness_versions_old(fleet, tiny_model_dir, task_files, tmp_path,
                                                                     max_staleness):
    train, test = task_files
    job = _job(f"async-{max_staleness}", tiny_model_dir, train, test, tmp_path / "out",
               f", async: {{max_staleness: {max_staleness}, correction: tis, tis_cap: 2.0}}")
    final, events = run_job(addresses(fleet)["coordinator"], job, timeout_s=180)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    steps = _steps(events)
    assert sorted(steps) == list(range(1, 9))
    for step, m in steps.items():
        assert m["staleness_max"] <= max_staleness, (step, m)
        assert m["generated_version"] >= step - 1 - max_staleness  # generation waited for the gate
        assert m["samples_dropped"] == 0
        assert "train/is_weight_mean" in m and 0.0 <= m["train/is_capped_frac"] <= 1.0
    # the engines ran ahead: later steps trained on samples of older weights
    assert any(m["staleness_max"] >= 1 for m in steps.values())
    syncs = [json.loads(e.data_json) for e in events if e.kind == "weight_sync"]
    assert [s["version"] for s in syncs] == list(range(9)) and all(s["engines_in_pool"] == 1 for s in syncs)
    evals = [e for e in events if e.kind == "eval"]
    assert [e.step for e in evals] == [0, 4, 8]
    assert [json.loads(e.data_json)["weights_version"] for e in evals] == [0, 4, 8]  # each at its step's weights
    assert [json.loads(e.data_json)["beside_training"] for e in evals] == [False, True, False]


def test_an_eval_beside_training_stays_at_its_steps_weights(fleet, tiny_model_dir, task_files, tmp_path):
    """A long eval (64 prompts of 48 greedy tokens) runs while the next step trains, and the sync
    after that step waits for it: no eval token comes from the weights trained meanwhile."""
    train, test = task_files
    long_eval = (f"{{{{every: 2, datasets: [{{{{name: long, path: {train}, limit: 64, "
                 "sampling: {{temperature: 0.0, max_new_tokens: 48}}}}]}}")
    job = _job("eval-beside", tiny_model_dir, train, test, tmp_path / "out",
               ", async: {max_staleness: 1, correction: tis, tis_cap: 2.0}", steps=6, eval_=long_eval)
    final, events = run_job(addresses(fleet)["coordinator"], job, timeout_s=180)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    steps = _steps(events)
    evals = {e.step: json.loads(e.data_json) for e in events if e.kind == "eval"}
    assert sorted(evals) == [0, 2, 4, 6]
    for step in (2, 4):  # beside the training of step + 1, whose sync waited for it
        assert evals[step]["beside_training"] and evals[step]["weights_version"] == step, evals[step]
        assert evals[step]["tokens_at_other_versions"] == 0, evals[step]
        assert "eval_wait_s" in steps[step + 1] and "eval_wait_s" not in steps[step + 2]
    assert all(e["tokens_at_other_versions"] == 0 for e in evals.values())


def test_max_staleness_0_is_the_synchronous_job_bit_for_bit(fleet, tiny_model_dir, task_files, tmp_path):
    train, test = task_files
    runs = []
    for name, algorithm in (("sync", ""), ("async-0", ", async: {max_staleness: 0, correction: tis}")):
        final, events = run_job(addresses(fleet)["coordinator"],
                                _job(name, tiny_model_dir, train, test, tmp_path / name, algorithm, steps=5))
        assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
        steps = {s: {k: v for k, v in m.items() if not any(n in k for n in NOISE)} for s, m in _steps(events).items()}
        evals = [(e.step, json.loads(e.data_json)["score"]) for e in events if e.kind == "eval"]
        runs.append((steps, evals))
    assert runs[0] == runs[1]
    assert "staleness_max" not in runs[0][0][1]  # the synchronous loop, not the pipeline


ARITH = Path(__file__).resolve().parents[2] / "examples/arith"


@pytest.mark.parametrize("algorithm", ["", ", async: {max_staleness: 1}"], ids=["sync", "async"])
def test_dynamic_sampling_refills_groups_whose_rewards_do_not_vary(fleet, tmp_path, algorithm):
    """The arithmetic model gets some prompts all right or all wrong in a group of 4: those
    groups are dropped and more prompts generated until the step has its 8 varied groups."""
    job = textwrap.dedent(f"""
        name: dynamic{'-async' if algorithm else ''}
        seed: 2
        model: {ARITH / 'model'}
        num_rollout: 3
        output_dir: {tmp_path / 'out'}
        rollout: {{prompts_per_step: 8, samples_per_prompt: 4, sampling: {{temperature: 1.0, max_new_tokens: 5}},
                   dynamic_sampling: {{max_rounds: 6}}}}
        data: {{train: {ARITH / 'data/train.jsonl'}}}
        eval: {{every: 0, datasets: [{{name: h, path: {ARITH / 'data/test.jsonl'}, limit: 8,
                                       sampling: {{temperature: 0.0, max_new_tokens: 5}}}}]}}
        trainer: {{optimizer: {{lr: 1.0e-4}}}}
        algorithm: {{advantage: grpo{algorithm}}}
        """)
    final, events = run_job(addresses(fleet)["coordinator"], job, timeout_s=180)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    steps = _steps(events)
    assert all(m["groups_trained"] == 8 and m["samples"] == 32 for m in steps.values()), steps
    assert sum(m["groups_uniform"] for m in steps.values()) > 0  # some were dropped ...
    assert any(m["generation_rounds"] > 1 for m in steps.values())  # ... and refilled
    assert all(m["reward_std"] > 0 for m in steps.values())


def test_an_agent_job_runs_calculator_episodes_through_the_coordinator(fleet, tmp_path_factory, tmp_path):
    """A job with `agent`: every sample is an episode over token ids (a random model mostly
    answers at once; tests/unit/test_agents.py drives multi-turn episodes), trained with its loss
    mask, synchronously and with async."""
    import string

    from tests.conftest import make_tiny_model

    chars = string.ascii_letters + string.digits + " <>/{}[]\":,_+-*=().?"
    model = make_tiny_model(tmp_path_factory.mktemp("agent-model"), chars=chars, max_position_embeddings=256)
    rows = [{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a in range(2, 9) for b in range(2, 9)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for algorithm in ("", ", async: {max_staleness: 1}"):
        job = textwrap.dedent(f"""
            name: agent{'-async' if algorithm else ''}
            model: {model}
            num_rollout: 3
            output_dir: {tmp_path / ('out' + algorithm[:3])}
            rollout: {{prompts_per_step: 4, samples_per_prompt: 2, sampling: {{max_new_tokens: 24}}}}
            data: {{train: {data}}}
            eval: {{every: 0, datasets: [{{name: h, path: {data}, limit: 4, sampling: {{temperature: 0.0, max_new_tokens: 4}}}}]}}
            trainer: {{optimizer: {{lr: 0.01}}}}
            agent: {{environment: calculator, max_turns: 3, max_tokens: 120, max_tool_calls: 2}}
            algorithm: {{advantage: grpo{algorithm}}}
            """)
        final, events = run_job(addresses(fleet)["coordinator"], job, timeout_s=180)
        assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
        steps = _steps(events)
        assert sorted(steps) == [1, 2, 3]
        for m in steps.values():
            assert m["samples"] == 8 and 1 <= m["turns_mean"] <= 3 and 0 <= m["tool_call_frac"] <= 1
            assert m["train/rollout_logprob_gap_max"] < 1e-3  # scored as the engine sampled them
