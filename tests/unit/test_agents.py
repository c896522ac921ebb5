"""Multi-turn episodes over token ids (`services.coordinator.agents`): the calculator tool and its
bounds, and the agent loop with a real engine and a real trainer: assistant tokens are the
engine's sampled ids, observation tokens carry loss mask 0, and the trainer's logprobs of the
multi-turn sequences equal the engine's."""

from __future__ import annotations

import string

import pytest
import torch

from services.coordinator.agents import (Calculator, ChatFrame, Episode, Observation, SingleTurn, evaluate_arithmetic,
                                         run_episodes)
from services.coordinator.clients import Completion
from services.coordinator.datasets import Example
from services.rollout.engine import RolloutEngine, RolloutSettings
from services.rollout.types import Sampling
from services.trainer.batch import Sample
from services.trainer.settings import TrainerSettings
from services.trainer.torch_backend import TorchTrainer
from tests.conftest import make_tiny_model

torch.set_num_threads(1)
CHARS = string.ascii_letters + string.digits + " <>/{}[]\":,_+-*=().?"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("agent-model"), chars=CHARS, max_position_embeddings=256,
                           architecture="qwen2")


@pytest.mark.parametrize("expression, value", [("12*7", 84), ("(3+4)*-2", -14), ("7/2", 3.5), ("2**10", 1024),
                                               ("17 // 5 + 17 % 5", 5)])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert evaluate_arithmetic(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('id')", "not allowed in an expression: Call"),
    ("x + 1", "not allowed in an expression: Name"),
    ("(1).real", "not allowed in an expression: Attribute"),
    ("9**99", "exponent larger than 64"),
    ("10**20*10**20", "result out of range"),
    ("1" * 201, "longer than 200"),
    ("1 +", "not an arithmetic expression"),
])
def test_the_calculator_refuses_anything_else_by_name(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate_arithmetic(expression)


def test_a_calculator_episode_answers_tool_calls_and_scores_the_final_answer():
    env = Calculator(max_calls=2)
    assert env.reset(Example(prompt="What is 12*7?", answer="84", index=0)) == "What is 12*7?"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    assert env.step("Let me compute. " + call) == Observation("<tool_response>84</tool_response>")
    assert env.step("<tool_call>{not json}</tool_call>").text.startswith("<tool_response>error: ")
    assert env.step(call) == Observation("", 0.0, done=True)  # a third call: past max_calls, scored as it is
    env.reset(Example(prompt="q", answer="84", index=0))
    assert env.step(" 84 ") == Observation("", 1.0, done=True)
    assert env.step('<tool_call>{"name": "shell", "arguments": {}}</tool_call>').text == (
        "<tool_response>error: unknown tool 'shell'</tool_response>")


class _Scripted:
    """Answers the first `turns - 1` turns with a fixed tool response, then ends with reward 1."""

    def __init__(self, turns: int):
        self.turns, self.seen = turns, 0

    def reset(self, example):
        self.seen = 0
        return example.prompt

    def step(self, action):
        self.seen += 1
        if self.seen >= self.turns:
            return Observation("", 1.0, done=True)
        return Observation(" <tool_response>42</tool_response> ")


def _engine_generate(engine: RolloutEngine):
    def generate(prompts_ids, max_new_tokens):
        sampling = Sampling(temperature=1.0, max_new_tokens=max_new_tokens, seed=11, ignore_eos=True)
        results, _ = engine.generate(prompts_ids, sampling)
        return [Completion(prompt_index=g.prompt_index, prompt_ids=g.prompt_ids, output_ids=g.output_ids, text=g.text,
                           logprobs=g.logprobs, finish_reason=g.finish_reason, weight_version=0) for g in results]
    return generate


def test_multi_turn_episodes_keep_the_sampled_tokens_and_the_trainer_scores_them_as_the_engine(chat_model_dir):
    engine = RolloutEngine(RolloutSettings(model_path=str(chat_model_dir), seed=0))
    tokenizer = engine.tokenizer
    calls = []
    generate = _engine_generate(engine)

    def recording(prompts_ids, max_new_tokens):
        out = generate(prompts_ids, max_new_tokens)
        calls.append([list(c.output_ids) for c in out])
        return out

    examples = [Example(prompt=f"What is {i}*6?", answer=str(6 * i), index=i) for i in range(6)]
    envs = [_Scripted(turns=3) for _ in examples]
    episodes = run_episodes(envs, examples, tokenizer, recording, max_new_tokens=12, max_turns=5, max_tokens=200)
    engine.close()
    assert len(calls) == 3 and all(len(c) == 6 for c in calls)  # every episode's turn in one call
    observation = tokenizer.encode(" <tool_response>42</tool_response> ")
    for k, ep in enumerate(episodes):
        assert ep.done and not ep.truncated and ep.turns == 3 and ep.reward == 1.0
        # response = turn 1, observation, turn 2, observation, turn 3: the turns as sampled
        expected = calls[0][k] + observation + calls[1][k] + observation + calls[2][k]
        assert ep.response_ids == expected
        mask = [1.0] * len(calls[0][k]) + [0.0] * len(observation) + [1.0] * len(calls[1][k]) + \
            [0.0] * len(observation) + [1.0] * len(calls[2][k])
        assert ep.mask == mask and len(ep.logprobs) == len(mask)
    trainer = TorchTrainer(TrainerSettings(model_path=str(chat_model_dir)))
    scored, _ = trainer.compute_logprobs("actor", [Sample(prompt_ids=ep.ids[: ep.prompt_len],
                                                          response_ids=ep.response_ids) for ep in episodes])
    gaps = [abs(a - b) for ep, lps in zip(episodes, scored) for a, b, m in zip(ep.logprobs, lps, ep.mask) if m]
    assert len(gaps) > 6 * 20 and max(gaps) < 1e-3


def test_episodes_end_at_the_turn_and_token_limits():
    class Forever:
        def reset(self, example):
            return "go"

        def step(self, action):
            return Observation("more")

    class Tokens:
        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    def generate(prompts_ids, max_new_tokens):
        return [Completion(0, p, [65] * max_new_tokens, "", [-1.0] * max_new_tokens, "length", 0) for p in prompts_ids]

    by_turns = run_episodes([Forever()], [Example("go", "", 0)], Tokens(), generate, max_new_tokens=3, max_turns=2,
                            max_tokens=100)[0]
    assert by_turns.truncated and by_turns.turns == 2 and by_turns.reward == 0.0
    by_tokens = run_episodes([Forever()], [Example("go", "", 0)], Tokens(), generate, max_new_tokens=3, max_turns=50,
                             max_tokens=20)[0]
    assert by_tokens.truncated and len(by_tokens.ids) <= 20


def test_a_single_turn_environment_is_todays_prompt_and_reward():
    env = SingleTurn(lambda text, answer, prompt, meta: float(text.strip() == answer), lambda e: e.prompt)
    assert env.reset(Example("2+2=", "4", 0)) == "2+2="
    assert env.step("4") == Observation("", 1.0, done=True)
    assert isinstance(Episode(ids=[1], prompt_len=1).response_ids, list)


def test_a_python_tool_call_runs_in_the_sandbox_and_its_output_is_the_observation(tmp_path):
    from services.coordinator.agents import python_tool

    env = Calculator(tools={"python": python_tool(tmp_path)})
    env.reset(Example(prompt="q", answer="6", index=0))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(2*3)"}}</tool_call>'
    assert env.step(call) == Observation("<tool_response>6\n</tool_response>")
    net = '<tool_call>{"name": "python", "arguments": {"code": "import socket; socket.socket()"}}</tool_call>'
    assert "socket.__new__ is not allowed" in env.step(net).text


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chatml_tokenizer():
    from services.models import make_char_tokenizer

    tok = make_char_tokenizer(CHARS + "\n", specials=("<pad>", "<bos>", "<|im_end|>"), words=("<|im_start|>",))
    tok.chat_template = CHATML
    return tok


def test_observations_are_framed_as_tool_messages_of_the_chat_template_and_never_trained_on():
    tok = _chatml_tokenizer()
    frame = ChatFrame(tok)
    assert (frame.before, frame.after) == ("<|im_end|>\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12*7?"}])
    call = tok.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>')
    answer = [*tok.encode("84"), tok.eos_token_id]  # the final turn ends with the end-of-turn token

    def generate(prompts_ids, max_new_tokens):
        turn = call if len(prompts_ids[0]) < len(prompt) + 5 else answer
        return [Completion(0, p, turn, "", [-0.5] * len(turn), "stop", 0) for p in prompts_ids]

    ep = run_episodes([Calculator()], [Example(prompt=prompt, answer="84", index=0)], tok, generate,
                      max_new_tokens=80, max_turns=3, max_tokens=400, frame=frame)[0]
    assert ep.reward == 1.0 and ep.turns == 2 and ep.tool_calls == 1
    assert tok.decode(ep.ids, skip_special_tokens=False) == (
        prompt + tok.decode(call) + "<|im_end|>\n<|im_start|>tool\n<tool_response>84</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n84<|im_end|>")
    observation = len(ep.response_ids) - len(call) - len(answer)
    assert ep.mask == [1.0] * len(call) + [0.0] * observation + [1.0] * len(answer)
    # a turn that already closed with the end-of-turn token is not closed twice
    assert frame("r", [*call, tok.eos_token_id]) == "\n<|im_start|>tool\nr<|im_end|>\n<|im_start|>assistant\n"


def test_a_chat_template_that_cannot_render_the_observation_role_is_refused_by_name():
    tok = _chatml_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                         "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="cannot render a 'tool' message: unknown role tool"):
        ChatFrame(tok)
    assert ChatFrame(tok, role="user").before == ""


def test_smollm2s_own_template_frames_a_tool_turn(smollm2_model):
    from services.models import load_tokenizer

    tok = load_tokenizer(smollm2_model)
    frame = ChatFrame(tok)
    assert frame.before == "<|im_end|>\n<|im_start|>tool\n" and frame.after == "<|im_end|>\n<|im_start|>assistant\n"
    full = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                    {"role": "tool", "content": "42"}])
    assert full.endswith("a" + frame("42", tok.encode("a")))  # what the template renders for the whole history


def test_an_sft_trajectory_is_the_token_sequence_the_agent_loop_builds_for_the_same_episode():
    from services.coordinator.agents import trajectory_tokens

    tok = _chatml_tokenizer()
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    messages = [{"role": "user", "content": "What is 12*7?"}, {"role": "assistant", "content": call},
                {"role": "tool", "content": "<tool_response>84</tool_response>"}, {"role": "assistant", "content": "84"}]
    prompt_ids, response_ids, mask = trajectory_tokens(tok, messages)
    assert tok.decode(prompt_ids, skip_special_tokens=False) == "<|im_start|>user\nWhat is 12*7?<|im_end|>\n<|im_start|>assistant\n"
    turns = [tok.encode(call), [*tok.encode("84"), tok.eos_token_id]]

    def generate(prompts_ids, max_new_tokens):  # the assistant turns as the engine would sample them
        turn = turns[0] if len(prompts_ids[0]) == len(prompt_ids) else turns[1]
        return [Completion(0, p, turn, "", [0.0] * len(turn), "stop", 0) for p in prompts_ids]

    ep = run_episodes([Calculator()], [Example(prompt=tok.decode(prompt_ids, skip_special_tokens=False), answer="84",
                                               index=0)], tok, generate, max_new_tokens=90, max_turns=3,
                      max_tokens=400, frame=ChatFrame(tok))[0]
    # the same ids: SFT on a trajectory trains the tokens RL later samples and scores
    assert ep.ids == prompt_ids + response_ids and ep.reward == 1.0
    # the same mask, but for the end-of-turn after the call: SFT learns it; RL stops at </tool_call>
    # and the frame supplies it as part of the observation
    end = len(turns[0])
    assert mask[:end] == ep.mask[:end] == [1.0] * end and (mask[end], ep.mask[end]) == (1.0, 0.0)
    assert mask[end + 1:] == ep.mask[end + 1:]
    with pytest.raises(ValueError, match="must end with one"):
        trajectory_tokens(tok, messages[:3])


def test_environment_steps_run_at_once_and_their_results_keep_episode_order():
    import threading

    together = threading.Barrier(6, timeout=10)  # passes only when all six steps wait at once

    class Slow:
        def reset(self, example):
            together.wait()
            return example.prompt

        def step(self, action):
            together.wait()
            return Observation("", float(self.n), done=True)

    class Tokens:
        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    envs = [Slow() for _ in range(6)]
    for n, env in enumerate(envs):
        env.n = n

    def generate(prompts_ids, max_new_tokens):
        return [Completion(0, p, [65], "", [-1.0], "stop", 0) for p in prompts_ids]

    episodes = run_episodes(envs, [Example(f"q{i}", "", i) for i in range(6)], Tokens(), generate, max_new_tokens=2,
                            max_turns=2, max_tokens=50)
    assert [ep.reward for ep in episodes] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert [ep.ids for ep in episodes] == [[ord("q"), ord(str(i)), 65] for i in range(6)]


def test_a_template_that_wraps_tool_replies_itself_gets_the_reply_unwrapped_once():
    tok = _chatml_tokenizer()
    # as Qwen2.5's template renders a tool message: a user turn holding <tool_response>
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
                         "{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    frame = ChatFrame(tok)
    assert frame.wraps
    assert frame("<tool_response>84</tool_response>", []) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert not ChatFrame(_chatml_tokenizer()).wraps  # ChatML's plain tool role keeps the reply as it is
