"""`rlfleet serve environment --module pkg.mod:Env`: any `agents.Environment` class served over
`rlfleet.v1.Environment`, so environments, tools and verifiers run as their own service.

The servicer translates between protobuf and the user's environment: `Reset` makes an instance
(the class called with no arguments) and holds it under a new episode id; `Step` calls it;
`Score` makes a throwaway instance and calls its `score(prompt, completion, answer, metadata)`,
or one reset and one step. Episodes are forgotten when done, on `Close`, after an idle hour, or
the oldest first past `max_episodes`. An error raised by the environment comes back
`INVALID_ARGUMENT` with its message; the server goes on serving.
"""

from __future__ import annotations

import importlib
import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Callable

import grpc

from services import rpc
from services.api import environment_pb2, environment_pb2_grpc
from services.coordinator.datasets import Example

SERVICE_NAME = "rlfleet.v1.Environment"
log = rpc.get_logger("environment")


def load_environment(spec: str) -> Callable[[], object]:
    """The class (or factory) named `module:attribute` (ValueError naming what is missing)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--module: expected package.module:Class, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--module: cannot import {module_name!r}: {e}") from e
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"--module: {module_name!r} has no callable {attribute!r}")
    return factory


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServicer):
    def __init__(self, factory: Callable[[], object], *, max_episodes: int = 10_000, idle_s: float = 3600.0):
        self.factory, self.max_episodes, self.idle_s = factory, max_episodes, idle_s
        self._episodes: OrderedDict[str, tuple[object, threading.Lock, float]] = OrderedDict()
        self._lock = threading.Lock()

    def Reset(self, request, context):
        example = self._example(request.prompt, request.answer, request.metadata_json, request.index, context)
        env = self.factory()
        observation = self._call(context, env.reset, example)
        episode = uuid.uuid4().hex
        with self._lock:
            self._forget_stale()
            self._episodes[episode] = (env, threading.Lock(), time.monotonic())
        return environment_pb2.ResetResponse(episode_id=episode, observation=observation)

    def Step(self, request, context):
        with self._lock:
            held = self._episodes.get(request.episode_id)
            if held is not None:
                self._episodes.move_to_end(request.episode_id)
                self._episodes[request.episode_id] = (held[0], held[1], time.monotonic())
        if held is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"episode {request.episode_id!r}: not held (ended, expired, "
                                                     "or this server restarted)")
        env, lock, _ = held
        with lock:  # one turn of an episode at a time
            out = self._call(context, env.step, request.action)
        if out.done:
            self._drop(request.episode_id)
        return environment_pb2.StepResponse(observation=out.text, reward=float(out.reward), done=out.done)

    def Score(self, request, context):
        example = self._example(request.prompt, request.answer, request.metadata_json, 0, context)
        env = self.factory()
        if hasattr(env, "score"):
            reward = self._call(context, env.score, request.prompt, request.completion, request.answer,
                                example.metadata)
        else:
            self._call(context, env.reset, example)
            reward = self._call(context, env.step, request.completion).reward
        return environment_pb2.ScoreResponse(reward=float(reward))

    def Close(self, request, context):
        self._drop(request.episode_id)
        return environment_pb2.CloseResponse()

    def _drop(self, episode: str) -> None:
        with self._lock:
            self._episodes.pop(episode, None)

    def _forget_stale(self) -> None:
        now = time.monotonic()
        while self._episodes:
            oldest, (_, _, used) = next(iter(self._episodes.items()))
            if now - used > self.idle_s or len(self._episodes) >= self.max_episodes:
                del self._episodes[oldest]
            else:
                return

    @staticmethod
    def _example(prompt: str, answer: str, metadata_json: str, index: int, context) -> Example:
        try:
            metadata = json.loads(metadata_json) if metadata_json else {}
        except json.JSONDecodeError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"metadata_json: not JSON ({e})")
        if not isinstance(metadata, dict):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "metadata_json: expected a JSON object")
        return Example(prompt=prompt, answer=answer, index=index, metadata=metadata)

    @staticmethod
    def _call(context, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 (the user's environment: its error goes back to the caller)
            log.warning("environment raised: %s", e)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"environment: {type(e).__name__}: {e}")


def build_server(address: str = "127.0.0.1:0", token: str | None = None, *, module: str = "",
                 factory: Callable[[], object] | None = None) -> rpc.Server:
    """An environment server for `module` (package.module:Class), or for `factory` directly."""
    servicer = EnvironmentServicer(factory or load_environment(module))
    server = rpc.create_server(lambda s: environment_pb2_grpc.add_EnvironmentServicer_to_server(servicer, s),
                               (SERVICE_NAME,), address=address, token=token)
    server.set_serving(True)
    return server
