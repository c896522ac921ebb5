"""Multi-turn episodes over token ids: environments, tool calls and the agent loop.

An `Environment` turns a data row into a first observation (`reset`) and answers each of the
model's turns (`step`) with an observation, a reward and whether the episode is done. The agent
loop (`run_episodes`) keeps each episode as one sequence of token ids: the prompt, then each
assistant turn exactly as the engine sampled it, then each observation's tokens. Nothing
generated is decoded and encoded again, so the tokens the trainer scores are the tokens the
engine sampled, with the engine's logprobs. The loss mask is 1 on assistant tokens and 0 on
prompt and observation tokens. All live episodes take their next turn together, so one
engine call (one running batch) holds every episode's turn, and with the prefix cache each
turn prefills only what the last observation added.

Built in: `SingleTurn` (a prompt and a reward function: one turn), and `Calculator` (tool calls
in the Hermes / Qwen format, `<tool_call>{"name": "calculator", "arguments": {"expression":
"12*7"}}</tool_call>`, answered with `<tool_response>84</tool_response>`; a turn without a
tool call is the final answer), which may also offer `python_tool` (code run in the sandbox). docs/agents.md has the formats and the limits.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import grpc

from services import rpc
from services.api import environment_pb2, environment_pb2_grpc
from services.coordinator.clients import Completion
from services.coordinator.datasets import Example
from services.coordinator.sandbox import run_python

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_CALL_END = "</tool_call>"
_WRAPPED = re.compile(r"<tool_response>(.*)</tool_response>", re.DOTALL)
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15


@dataclass(frozen=True)
class Observation:
    text: str  # what the model reads next ("" when done)
    reward: float = 0.0  # this turn's reward (the final one when done)
    done: bool = False


class Environment(Protocol):
    def reset(self, example: Example) -> str:
        """The episode's first observation: the prompt text."""

    def step(self, action: str) -> Observation:
        """The model's turn (its text, a tool call's closing tag included) -> what comes next."""


class SingleTurn:
    """Today's single-turn task as an environment: the prompt, then one turn scored by `reward`."""

    def __init__(self, reward: Callable[[str, str, str, dict], float], prompt: Callable[[Example], str]):
        self._reward, self._prompt = reward, prompt
        self._example: Example | None = None
        self._prompt_text = ""

    def reset(self, example: Example) -> str:
        self._example, self._prompt_text = example, self._prompt(example)
        return self._prompt_text

    def step(self, action: str) -> Observation:
        e = self._example
        return Observation("", self._reward(action, e.answer, self._prompt_text, e.metadata), done=True)


class Calculator:
    """Arithmetic with a calculator tool. A turn holding a `calculator` tool call is answered with
    its result (or an error the model can read); a turn without one is the final answer, scored 1
    if it equals the row's answer (stripped). At most `max_calls` calls an episode: the next turn
    must answer."""

    def __init__(self, max_calls: int = 4, prompt: Callable[[Example], str] | None = None,
                 tools: dict[str, Callable[[dict], str]] | None = None):
        self.max_calls = max_calls
        self.calls = 0
        self._answer = ""
        self._prompt = prompt or (lambda example: example.prompt or "")
        self.tools = {"calculator": calculator_tool, **(tools or {})}

    def reset(self, example: Example) -> str:
        self._answer, self.calls = example.answer.strip(), 0
        return self._prompt(example)

    def step(self, action: str) -> Observation:
        match = TOOL_CALL.search(action)
        if match is None or self.calls >= self.max_calls:
            final = TOOL_CALL.sub("", action).strip()
            return Observation("", float(final == self._answer), done=True)
        self.calls += 1
        try:
            call = json.loads(match.group(1))
            tool = self.tools.get(call.get("name")) if isinstance(call, dict) else None
            if tool is None:
                raise ValueError(f"unknown tool {call.get('name') if isinstance(call, dict) else call!r}")
            if not isinstance(call.get("arguments"), dict):
                raise ValueError("arguments: expected an object")
            result = tool(call["arguments"])
        except (ValueError, ZeroDivisionError, json.JSONDecodeError) as e:
            result = f"error: {e}"
        return Observation(f"<tool_response>{result}</tool_response>")


def calculator_tool(arguments: dict) -> str:
    if not isinstance(arguments.get("expression"), str):
        raise ValueError('arguments: expected {"expression": "..."}')
    return format_number(evaluate_arithmetic(arguments["expression"]))


def python_tool(folder: Path, *, timeout_s: float = 5.0, memory_mb: int = 256,
                max_output: int = 2048) -> Callable[[dict], str]:
    """A `python` tool: {"code": "..."} run in the sandbox (`sandbox.run_python`) in `folder`;
    its output, cut at max_output characters and marked when cut or timed out."""
    def run(arguments: dict) -> str:
        if not isinstance(arguments.get("code"), str):
            raise ValueError('arguments: expected {"code": "..."}')
        result = run_python(arguments["code"], folder, timeout_s=timeout_s, memory_mb=memory_mb,
                            max_output=max_output)
        notes = (" [timed out]" if result.timed_out else "") + (" [output cut]" if result.truncated else "")
        return result.output + notes

    return run


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def evaluate_arithmetic(expression: str) -> float:
    """The value of an arithmetic expression: numbers, + - * / // % **, unary signs and
    parentheses, nothing else (no names, calls or attributes: ValueError). Bounded: at most
    MAX_EXPRESSION_CHARS characters, exponents at most 64, every value within MAX_MAGNITUDE."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            out = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            out = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent larger than 64")
            out = _OPERATORS[type(node.op)](left, right)
        else:
            raise ValueError(f"not allowed in an expression: {type(node).__name__}")
        if isinstance(out, complex) or not math.isfinite(out) or abs(out) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return out

    return value(tree.body)


def format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


class ChatFrame:
    """An observation as the model's chat template frames a `role` message after an assistant
    turn: the text between the assistant's content and the observation's (e.g. ChatML's
    `<|im_end|>\n<|im_start|>tool\n`), the observation, and the text up to the next assistant
    turn's content (`<|im_end|>\n<|im_start|>assistant\n`). Found by rendering the template once
    with placeholder contents, so any template that renders the role works; one that does not
    (or drops a placeholder) is refused by name. Nothing the model generated is rendered again:
    the frame is appended to the turn's sampled tokens."""

    _ASSISTANT, _OBSERVATION = "\x00assistant-turn\x00", "\x00observation\x00"

    def __init__(self, tokenizer, role: str = "tool"):
        messages = [{"role": "user", "content": "\x00prompt\x00"}, {"role": "assistant", "content": self._ASSISTANT},
                    {"role": role, "content": self._OBSERVATION}]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # (the template's own raise_exception, e.g. for an unknown role)
            raise ValueError(f"agent: the model's chat template cannot render a {role!r} message: {e}") from e
        if text.count(self._ASSISTANT) != 1 or text.count(self._OBSERVATION) != 1:
            raise ValueError(f"agent: the model's chat template does not render a {role!r} message's content "
                             "after the assistant's")
        start = text.index(self._ASSISTANT) + len(self._ASSISTANT)
        middle = text.index(self._OBSERVATION)
        self.before, self.after = text[start:middle], text[middle + len(self._OBSERVATION):]
        eos = tokenizer.eos_token_id
        self._eos = tokenizer.decode([eos], skip_special_tokens=False) if eos is not None else ""
        self._eos_id = eos
        # Qwen's template wraps a tool message in <tool_response> itself: the observation's own
        # wrapper (the calculator's) is then taken off, so the model reads one, as it was trained.
        self.wraps = "<tool_response>" in self.before

    def __call__(self, observation: str, turn_ids: list[int]) -> str:
        if self.wraps:
            inner = _WRAPPED.fullmatch(observation)
            observation = inner.group(1) if inner else observation
        before = self.before
        if turn_ids and turn_ids[-1] == self._eos_id and self._eos and before.startswith(self._eos):
            before = before[len(self._eos):]  # the turn already ended with the end-of-turn token
        return before + observation + self.after


def trajectory_tokens(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int], list[float]]:
    """A whole conversation (system / user turns, then assistant and tool turns, ending with the
    assistant's) as the SFT stage trains on it: (prompt ids, response ids, loss mask). The prompt
    is everything before the first assistant turn with the assistant header; each later turn is
    the template's text it adds, tokenised on its own as the agent loop appends turns, with mask
    1 on assistant turns up to their end-of-turn token and 0 on the rest; nothing follows the
    last turn's end. The ids are those the agent loop builds for the same episode (ChatFrame)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or messages[-1]["role"] != "assistant":
        raise ValueError("messages: a trajectory needs assistant turns and must end with one")

    def render(k: int) -> str:  # the first k turns, with the assistant header if turn k is the assistant's
        header = k < len(messages) and messages[k]["role"] == "assistant"
        return tokenizer.apply_chat_template(messages[:k], add_generation_prompt=header)

    texts = [render(k) for k in range(first, len(messages) + 1)]
    eos = tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False) if tokenizer.eos_token_id is not None else ""
    prompt_ids = tokenizer.encode(texts[0])
    response: list[int] = []
    mask: list[float] = []
    for k, (before, after) in enumerate(zip(texts, texts[1:]), start=first):
        if not after.startswith(before):
            raise ValueError(f"messages[{k}]: the chat template renders this conversation differently once turn {k} "
                             "is added, so its turns cannot be trained on as one token sequence")
        text, rest = after[len(before):], ""
        if messages[k]["role"] == "assistant" and eos and eos in text:  # the turn ends at its end-of-turn token
            cut = text.index(eos) + len(eos)
            text, rest = text[:cut], ("" if k == len(messages) - 1 else text[cut:])
        for piece, trained in ((text, messages[k]["role"] == "assistant"), (rest, False)):
            ids = tokenizer.encode(piece) if piece else []
            response += ids
            mask += [1.0 if trained else 0.0] * len(ids)
    return prompt_ids, response, mask


class EnvironmentFailed(RuntimeError):
    """An environment did not answer in time, answered too much, or failed: the episode is
    dropped and counted, never scored."""


class RemoteEnvironments:
    """Episodes on an environment server (`rlfleet.v1.Environment`): `new()` is one episode's
    Environment. One channel for all of them; every call has `timeout_s`; a reply over
    `max_observation_bytes` is refused before it is read. A Reset that finds the server
    unavailable is tried once more; a Step is not (it may have happened)."""

    def __init__(self, address: str, token: str | None = None, *, timeout_s: float = 30.0,
                 max_observation_bytes: int = 1 << 20):
        self.address, self.timeout_s, self.max_observation_bytes = address, timeout_s, max_observation_bytes
        self._channel = rpc.open_channel(address, token, max_receive_bytes=max_observation_bytes + 1024)
        self._stub = environment_pb2_grpc.EnvironmentStub(self._channel)

    def new(self) -> _RemoteEpisode:
        return _RemoteEpisode(self)

    def call(self, name: str, request, *, retry: bool = False):
        for attempt in range(2 if retry else 1):
            try:
                return getattr(self._stub, name)(request, timeout=self.timeout_s)
            except grpc.RpcError as e:
                if retry and attempt == 0 and e.code() == grpc.StatusCode.UNAVAILABLE:
                    continue
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise EnvironmentFailed(f"environment {self.address} {name}: its reply is over "
                                            f"{self.max_observation_bytes} bytes ({e.details()})") from None
                raise EnvironmentFailed(f"environment {self.address} {name}: {e.code().name}: {e.details()}") from None

    def close(self) -> None:
        self._channel.close()


class _RemoteEpisode:
    def __init__(self, remote: RemoteEnvironments):
        self._remote, self._episode = remote, ""

    def reset(self, example: Example) -> str:
        reply = self._remote.call("Reset", environment_pb2.ResetRequest(
            prompt=example.prompt or "", answer=example.answer, index=example.index,
            metadata_json=json.dumps(example.metadata, default=str)), retry=True)
        self._episode = reply.episode_id
        return reply.observation

    def step(self, action: str) -> Observation:
        reply = self._remote.call("Step", environment_pb2.StepRequest(episode_id=self._episode, action=action))
        if not math.isfinite(reply.reward):
            raise EnvironmentFailed(f"environment {self._remote.address} Step: reward {reply.reward} is not finite")
        return Observation(reply.observation, reply.reward, reply.done)


@dataclass
class Episode:
    """One episode as the trainer sees it: ids[:prompt_len] the prompt, the rest response tokens
    with their loss mask (1: sampled by the engine) and logprobs (the engine's; 0 elsewhere)."""

    ids: list[int]
    prompt_len: int
    mask: list[float] = field(default_factory=list)  # one per token after the prompt
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # weight version of each sampled turn's first token
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    done: bool = False
    truncated: bool = False  # ended by the turn or token limit, not by the environment
    failed: str = ""  # why its environment failed (EnvironmentFailed): never trained on

    @property
    def response_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]


GenerateIds = Callable[[list[list[int]], int], list[Completion]]  # (prompts' ids, max_new_tokens) -> one each


MAX_STEPS_IN_FLIGHT = 32


def run_episodes(envs: list[Environment], examples: list[Example], tokenizer, generate: GenerateIds, *,
                 max_new_tokens: int, max_turns: int, max_tokens: int, frame: ChatFrame | None = None,
                 max_in_flight: int = MAX_STEPS_IN_FLIGHT) -> list[Episode]:
    """Run one episode per (environment, example) to its end, every live episode's turn in one
    `generate` call. An episode ends when its environment says so, after `max_turns` turns, or
    when its sequence reaches `max_tokens` (then `truncated`, with reward 0). `frame`: each
    observation framed as a message of the model's chat template (else appended as it is).
    The environments' resets and steps run up to `max_in_flight` at once (a remote server's
    calls, a sandboxed tool's process), their results taken in episode order."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=max(1, max_in_flight), thread_name_prefix="env")
    try:
        return _run_episodes(envs, examples, tokenizer, generate, pool, max_new_tokens=max_new_tokens,
                             max_turns=max_turns, max_tokens=max_tokens, frame=frame)
    finally:
        pool.shutdown(wait=True)


def _each(pool, fn, args: list) -> list:
    """fn(*a) for each a, at once on `pool`: each result, or the EnvironmentFailed it raised."""
    def call(a):
        try:
            return fn(*a)
        except EnvironmentFailed as e:
            return e

    return list(pool.map(call, args)) if len(args) > 1 else [call(a) for a in args]


def _run_episodes(envs, examples, tokenizer, generate, pool, *, max_new_tokens: int, max_turns: int,
                  max_tokens: int, frame: ChatFrame | None) -> list[Episode]:
    episodes = []
    for first in _each(pool, lambda env, example: env.reset(example), list(zip(envs, examples))):
        try:
            if isinstance(first, EnvironmentFailed):
                raise first
            ids = tokenizer.encode(first)
        except (EnvironmentFailed, ValueError) as e:  # (ValueError: text the tokenizer cannot encode)
            episodes.append(Episode(ids=[], prompt_len=0, done=True, failed=str(e)))
            continue
        episodes.append(Episode(ids=ids, prompt_len=len(ids)))
    while True:
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        if not live:
            return episodes
        budgets = [min(max_new_tokens, max_tokens - len(episodes[i].ids)) for i in live]
        for i, budget in zip(live, budgets):
            if budget <= 0:
                episodes[i].done = episodes[i].truncated = True
        live = [i for i, budget in zip(live, budgets) if budget > 0]
        if not live:
            return episodes
        completions = generate([episodes[i].ids for i in live], min(b for b in budgets if b > 0))
        actions = [tokenizer.decode(c.output_ids) for c in completions]
        observations = _each(pool, lambda env, action: env.step(action),
                             [(envs[i], action) for i, action in zip(live, actions)])
        for i, completion, action, observation in zip(live, completions, actions, observations):
            ep = episodes[i]
            ep.ids += completion.output_ids  # as sampled: never decoded and encoded again
            ep.mask += [1.0] * len(completion.output_ids)
            ep.logprobs += completion.logprobs
            ep.versions.append(completion.weight_version)
            ep.turns += 1
            if TOOL_CALL.search(action):
                ep.tool_calls += 1
            if isinstance(observation, EnvironmentFailed):
                ep.done, ep.failed, ep.reward = True, str(observation), 0.0
                continue
            ep.reward = observation.reward
            if observation.done:
                ep.done = True
                continue
            try:
                text = observation.text if frame is None else frame(observation.text, completion.output_ids)
                seen = tokenizer.encode(text)
            except ValueError as e:
                ep.done, ep.failed, ep.reward = True, f"observation: {e}", 0.0
                continue
            if ep.turns >= max_turns or len(ep.ids) + len(seen) >= max_tokens:
                ep.done = ep.truncated = True
                ep.reward = 0.0
                continue
            ep.ids += seen
            ep.mask += [0.0] * len(seen)
            ep.logprobs += [0.0] * len(seen)
