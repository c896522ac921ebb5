"""Rewards: score one completion against the reference answer of its prompt.

A reward is any callable `(completion, answer, prompt, metadata=None) -> float` (the `Reward`
protocol); `metadata` is the row's `data.metadata_keys` columns. Built-ins cover the example
tasks: `exact_match`, `math_answer` (last number or `\\boxed{}` compared numerically),
`math_verify` (math_answer first, then Hugging Face's math-verify for equivalent forms, in a
child process with a hard deadline per answer) and `countdown` (an arithmetic expression checked
with `ast`, never `eval`). Users plug in their own as a Python `module:function` (given
`metadata=` when its signature takes it) or as an HTTP endpoint. `build_reward` turns a
`RewardConfig` into one; failures of user code and remote endpoints are `RewardError`s chained
to their cause.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import logging
import math
import multiprocessing
import numbers
import re
import threading
import urllib.error
import urllib.request
import weakref
from collections import Counter
from fractions import Fraction
from typing import Any, Callable, Mapping, Protocol

from services.coordinator.config import RewardConfig

log = logging.getLogger("rlfleet.coordinator.rewards")
Metadata = Mapping[str, Any]


class Reward(Protocol):
    def __call__(self, completion: str, answer: str, prompt: str, metadata: Metadata | None = None) -> float: ...


class RewardError(RuntimeError):
    """A reward could not be computed: unimportable function, failing endpoint, malformed answer."""


# --------------------------------------------------------------------------- exact_match


def exact_match(completion: str, answer: str, prompt: str = "", metadata: Metadata | None = None) -> float:
    """1.0 when the completion equals the answer, ignoring surrounding whitespace."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


# --------------------------------------------------------------------------- math_answer

_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")


def math_answer(completion: str, answer: str, prompt: str = "", metadata: Metadata | None = None) -> float:
    """1.0 when the completion's final answer equals the reference.

    The final answer is the content of the last `\\boxed{...}` when there is one, else the last
    number in the completion (`1,234`, `-3.5` and `3/4` count as numbers). When both sides parse
    as numbers they are compared numerically (relative tolerance 1e-6), otherwise as strings
    after normalisation (no surrounding `$`, spaces or trailing period; lower case).
    """
    predicted = _last_boxed(completion)
    if predicted is None:
        numbers = _NUMBER_RE.findall(completion)
        if not numbers:
            return 0.0
        predicted = numbers[-1]
    a, b = _as_number(predicted), _as_number(answer)
    if a is not None and b is not None:
        return 1.0 if math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) else 0.0
    return 1.0 if _normalise(predicted) == _normalise(answer) else 0.0


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None  # unclosed: the model ran out of tokens mid-answer


def _normalise(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text)
    return re.sub(r"\s+", "", text).rstrip(".").lower()


def _as_number(text: str) -> float | None:
    text = _normalise(text).replace(",", "")
    if text.endswith("%"):
        text = text[:-1]
    try:
        value = float(Fraction(text))
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value if math.isfinite(value) else None


# --------------------------------------------------------------------------- math_verify


class RewardTimeout(RewardError):
    """A guarded call ran past its deadline; its process was killed."""


class GuardedProcess:
    """Runs picklable module-level calls in one child process, each under a hard deadline.

    math-verify bounds its own work with SIGALRM, which only works in a main thread (the
    coordinator scores in job threads) and cannot interrupt C code (sympy's big integers); a
    process can always be killed. The child is spawned (no fork of a threaded coordinator) on
    the first call, imports `preload` before the first deadline starts, and is replaced after a
    timeout or a crash. Calls are serialised.
    """

    def __init__(self, preload: tuple[str, ...] = (), startup_timeout_s: float = 120.0) -> None:
        self._preload = preload
        self._startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None
        self.num_killed = 0  # children killed for running past a deadline or found dead

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self._start()
            self._conn.send((fn, args))
            if not self._conn.poll(timeout_s):
                self._stop(kill=True)
                self.num_killed += 1
                raise RewardTimeout(f"{fn.__name__} took longer than {timeout_s:g}s; its process was killed")
            try:
                ok, value = self._conn.recv()
            except (EOFError, OSError) as e:
                self._stop(kill=True)
                self.num_killed += 1
                raise RewardError(f"{fn.__name__}: its process died ({e or 'no answer'})") from e
            if not ok:
                raise RewardError(f"{fn.__name__} raised {value}")
            return value

    def close(self) -> None:
        with self._lock:
            self._stop(kill=False)

    def _start(self) -> None:
        self._stop(kill=True)  # a child that died between calls
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self._preload), name="rlfleet-reward-guard", daemon=True)
        proc.start()
        child.close()
        if not parent.poll(self._startup_timeout_s):
            proc.kill()
            raise RewardError(f"reward process did not start within {self._startup_timeout_s:g}s")
        try:
            ready = parent.recv()
        except EOFError as e:
            raise RewardError("reward process exited while starting") from e
        if ready != "ready":
            proc.kill()
            raise RewardError(f"reward process could not start: {ready}")
        self._proc, self._conn = proc, parent

    def _stop(self, *, kill: bool) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is None:
            return
        if not kill:
            try:
                conn.send(None)  # asks the child to return
            except OSError:
                pass
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        conn.close()


def _serve(conn: Any, preload: tuple[str, ...]) -> None:
    """The child's loop: (fn, args) in, (True, result) or (False, "Type: message") out; None ends it."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its timeouts are ours to report
    try:
        for module in preload:
            importlib.import_module(module)
    except Exception as e:  # reported to the parent, which refuses to use this child
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send("ready")
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        fn, args = request
        try:
            conn.send((True, fn(*args)))
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}"))


def math_verify_equal(completion: str, answer: str, seconds: int) -> bool:
    """math-verify's judgement (run it in a GuardedProcess: it needs a main thread for its alarms).

    The reference is read as LaTeX inside `\\boxed{}` unless it has its own `$` or `\\boxed`;
    in the completion a boxed answer beats any other expression.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_text = answer if ("\\boxed" in answer or "$" in answer) else f"\\boxed{{{answer}}}"
    gold = parse(gold_text, parsing_timeout=seconds)
    if not gold:
        return False
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    predicted = parse(completion, extraction_config=config, parsing_timeout=seconds)
    return bool(predicted) and bool(verify(gold, predicted, timeout_seconds=seconds))


class MathVerifyReward:
    """1.0 when math_answer already agrees (equal normalised strings or equal numbers: no
    math-verify call), else when math-verify finds the completion's answer equivalent to the
    reference (fractions, LaTeX forms, 0.5 vs 1/2, sqrt(8) vs 2 sqrt 2, sets, intervals).

    An answer whose check runs past `timeout_s` scores 0.0 (counted in `num_timeouts`); the
    checking process is killed and replaced, so a pathological answer never stalls a job.
    """

    def __init__(self, timeout_s: float) -> None:
        if importlib.util.find_spec("math_verify") is None:
            raise RewardError("reward.kind: math_verify needs the math-verify package (pip install math-verify)")
        self.timeout_s = timeout_s
        self.num_timeouts = 0
        self._guard = GuardedProcess(preload=("math_verify",))
        weakref.finalize(self, self._guard.close)  # the child goes with the reward (a finished job)
        # math-verify's own alarms go off first, so most slow answers still get an answer back.
        self._seconds = max(1, int(timeout_s / 3))

    def __call__(self, completion: str, answer: str, prompt: str = "", metadata: Metadata | None = None) -> float:
        if math_answer(completion, answer) == 1.0:
            return 1.0
        try:
            equal = self._guard.call(math_verify_equal, completion, answer, self._seconds, timeout_s=self.timeout_s)
        except RewardTimeout:
            self.num_timeouts += 1
            log.warning("math_verify: an answer took longer than %gs to check; it scores 0 (answer %r, completion "
                        "ends %r)", self.timeout_s, answer[:80], completion[-200:])
            return 0.0
        return 1.0 if equal else 0.0

    def close(self) -> None:
        self._guard.close()


# --------------------------------------------------------------------------- countdown

_MAX_EXPRESSION_CHARS = 200
_BINARY_OPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__, ast.Div: Fraction.__truediv__}


def countdown(completion: str, answer: str, prompt: str = "", metadata: Metadata | None = None) -> float:
    """Score a Countdown answer: reach the target with + - * / and the given numbers.

    The answer is `"target|n1,n2,..."` (e.g. `"24|3,4,6,1"`). The expression is the content of
    the last `<answer>...</answer>` in the completion, else its last non-empty line; anything
    from the first `=` on is ignored (`3*8 = 24`), and `×`/`÷` are read as `*`/`/`.
    Returns 1.0 when the expression uses each given number at most once (as many times as it
    is listed) and equals the target exactly; 0.1 when it is a well-formed arithmetic expression
    (non-negative integers, binary + - * /, parentheses) that breaks a rule, divides by zero or
    misses the target; 0.0 when no well-formed expression is found.
    """
    target, numbers = _parse_countdown_answer(answer)
    expression = _extract_expression(completion)
    if expression is None:
        return 0.0
    used = _arithmetic_literals(expression)
    if used is None:
        return 0.0
    if Counter(used) - Counter(numbers):
        return 0.1  # a number that is not given, or one used more often than given
    try:
        value = _evaluate(expression.body)
    except ZeroDivisionError:
        return 0.1
    return 1.0 if value == target else 0.1


def _parse_countdown_answer(answer: str) -> tuple[int, list[int]]:
    try:
        target, _, numbers = answer.partition("|")
        return int(target), [int(n) for n in numbers.split(",") if n.strip()]
    except ValueError as e:
        raise RewardError(f"countdown: answer must be \"target|n1,n2,...\", got {answer!r}") from e


def _extract_expression(completion: str) -> ast.Expression | None:
    tagged = re.findall(r"<answer>(.*?)</answer>", completion, flags=re.DOTALL)
    if tagged:
        text = tagged[-1]
    else:
        lines = [line for line in completion.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    text = text.split("=")[0].replace("×", "*").replace("÷", "/").strip().rstrip(".")
    if not text or len(text) > _MAX_EXPRESSION_CHARS:
        return None
    try:
        return ast.parse(text, mode="eval")
    except SyntaxError:
        return None


def _arithmetic_literals(tree: ast.Expression) -> list[int] | None:
    """The integer literals of a pure binary + - * / expression; None if it contains anything else."""
    literals: list[int] = []
    for node in ast.walk(tree.body):
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _BINARY_OPS:
                return None
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            literals.append(node.value)
        elif not isinstance(node, ast.operator):
            return None
    return literals


def _evaluate(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)  # _arithmetic_literals admitted nothing else
    return _BINARY_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))


# --------------------------------------------------------------------------- user rewards


def load_python_reward(spec: str) -> Reward:
    """Import `module:function` (the module must be importable, e.g. on PYTHONPATH)."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise RewardError(f"reward.function: expected \"module:function\", got {spec!r}")
    try:
        target: object = importlib.import_module(module_name)
    except ImportError as e:
        raise RewardError(f"reward.function: cannot import module {module_name!r} ({e})") from e
    for attr in attr_path.split("."):
        if not hasattr(target, attr):
            raise RewardError(f"reward.function: {module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, attr)
    if not callable(target):
        raise RewardError(f"reward.function: {spec!r} is not callable")
    return _checked(spec, target)


def _checked(name: str, fn: Callable[..., object]) -> Reward:
    """Wrap user code: its exceptions and non-numeric or non-finite results become RewardError.
    The row's metadata is passed as `metadata=` only to a function whose signature takes it
    (a `metadata` parameter or **kwargs), so three-argument rewards keep working."""
    takes_metadata = _takes_metadata(fn)

    def reward(completion: str, answer: str, prompt: str, metadata: Metadata | None = None) -> float:
        try:
            if takes_metadata:
                value = fn(completion, answer, prompt, metadata=dict(metadata or {}))
            else:
                value = fn(completion, answer, prompt)
        except Exception as e:
            raise RewardError(f"reward {name} raised {type(e).__name__}: {e}") from e
        return _as_reward(name, value)

    return reward


def _takes_metadata(fn: Callable[..., object]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return False
    return any(p.name == "metadata" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _as_reward(source: str, value: object) -> float:
    if not isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        raise RewardError(f"reward {source} returned {type(value).__name__} {value!r}, expected a number")
    if not math.isfinite(value):
        raise RewardError(f"reward {source} returned {value}, expected a finite number")
    return float(value)


class HttpReward:
    """POSTs `{"prompt", "completion", "answer"}` (and `"metadata"` when the row has any) as JSON
    to a URL and reads `{"reward": float}`."""

    io_bound = True  # score_all keeps several requests in flight

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s

    def __call__(self, completion: str, answer: str, prompt: str, metadata: Metadata | None = None) -> float:
        payload = {"prompt": prompt, "completion": completion, "answer": answer}
        if metadata:
            payload["metadata"] = dict(metadata)
        body = json.dumps(payload).encode()
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raise RewardError(f"reward endpoint {self.url} answered HTTP {e.code} {e.reason}") from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RewardError(f"reward endpoint {self.url} unreachable: {reason}") from e
        try:
            payload = json.loads(raw)
        except ValueError as e:
            raise RewardError(f"reward endpoint {self.url} returned invalid JSON: {raw[:200]!r}") from e
        if not isinstance(payload, dict) or "reward" not in payload:
            raise RewardError(f"reward endpoint {self.url} returned {payload!r}, expected {{\"reward\": <number>}}")
        value = payload["reward"]
        if isinstance(value, bool):  # JSON true is not a score
            raise RewardError(f"reward endpoint {self.url} returned bool {value!r}, expected a number")
        return _as_reward(f"endpoint {self.url}", value)


class RemoteReward:
    """Scores each completion with the `Score` call of an environment server
    (`rlfleet.v1.Environment`: a reward model, a verifier, in any language). Every call has
    `timeout_s`; one that finds the server unavailable is tried once more (a score changes
    nothing); a failure or a non-finite reward is a RewardError naming the server."""

    io_bound = True  # score_all keeps several requests in flight

    def __init__(self, address: str, timeout_s: float, token: str | None = None) -> None:
        from services.coordinator.agents import RemoteEnvironments

        self.address = address
        self._remote = RemoteEnvironments(address, token, timeout_s=timeout_s, max_observation_bytes=1024)
        weakref.finalize(self, self._remote.close)

    def __call__(self, completion: str, answer: str, prompt: str, metadata: Metadata | None = None) -> float:
        from services.api import environment_pb2
        from services.coordinator.agents import EnvironmentFailed

        request = environment_pb2.ScoreRequest(prompt=prompt, completion=completion, answer=answer,
                                               metadata_json=json.dumps(dict(metadata or {})))
        try:
            reply = self._remote.call("Score", request, retry=True)
        except EnvironmentFailed as e:
            raise RewardError(f"reward server: {e}") from None
        return _as_reward(f"server {self.address}", reply.reward)


MAX_REWARDS_IN_FLIGHT = 32


def score_all(reward: Reward, rows: list[tuple[str, str, str, Metadata | None]]) -> list[float]:
    """`reward` of each (completion, answer, prompt, metadata), in order. A reward that waits on a
    server (`io_bound`: http, remote) gets up to MAX_REWARDS_IN_FLIGHT requests at once; the first
    error is raised, as a sequential loop would."""
    if not getattr(reward, "io_bound", False) or len(rows) < 2:
        return [reward(*row) for row in rows]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(MAX_REWARDS_IN_FLIGHT, len(rows)), thread_name_prefix="reward") as pool:
        return list(pool.map(lambda row: reward(*row), rows))


_BUILTINS: dict[str, Reward] = {"exact_match": exact_match, "math_answer": math_answer, "countdown": countdown}


def python_reward_modules(rewards: list[RewardConfig]) -> list[str]:
    """The modules the `python` rewards among `rewards` would import."""
    return sorted({cfg.function.partition(":")[0] for cfg in rewards if cfg.kind == "python" and cfg.function})


def check_reward_modules(rewards: list[RewardConfig], allowed: tuple[str, ...]) -> None:
    """RewardError naming the field unless every python reward's module is one the operator allowed
    (a name in `allowed`, or a module inside such a package). A job config is data from whoever
    submits it; importing a module runs its code in the coordinator."""
    for module in python_reward_modules(rewards):
        if not any(module == a or module.startswith(a + ".") for a in allowed):
            allowed_text = ", ".join(allowed) if allowed else "none"
            raise RewardError(f"reward.function: module {module!r} is not allowed on this coordinator (allowed: "
                              f"{allowed_text}; the operator allows modules with --allow-reward-module)")


def build_reward(cfg: RewardConfig, token: str | None = None) -> Reward:
    """The reward a RewardConfig describes; imports a python reward now, so a typo fails at start.
    `token`: the one a remote reward server is reached with (the coordinator's worker token)."""
    if cfg.kind in _BUILTINS:
        return _BUILTINS[cfg.kind]
    if cfg.kind == "python":
        assert cfg.function is not None  # RewardConfig requires it
        return load_python_reward(cfg.function)
    if cfg.kind == "http":
        assert cfg.url is not None  # RewardConfig requires it
        return HttpReward(cfg.url, cfg.timeout_s)
    if cfg.kind == "math_verify":
        return MathVerifyReward(cfg.timeout_s)
    if cfg.kind == "remote":
        assert cfg.address is not None  # RewardConfig requires it
        return RemoteReward(cfg.address, cfg.timeout_s, token)
    raise ValueError(f"reward.kind: unknown kind {cfg.kind!r}")
