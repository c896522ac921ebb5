"""Environments the remote-environment tests serve (`rlfleet serve environment --module
tests.integration.agent_envs:Countdown`)."""

from __future__ import annotations

import threading

from services.coordinator.agents import Observation

RELEASE = threading.Event()  # set by a test's teardown: a hanging step then returns (the process can exit)


class Countdown:
    """Three turns: two observations, then done with reward 1."""

    def reset(self, example):
        self.left = 3
        return example.prompt

    def step(self, action):
        self.left -= 1
        if self.left == 0:
            return Observation("", 1.0, done=True)
        return Observation(f" {self.left} ")


class Hangs(Countdown):
    def step(self, action):
        RELEASE.wait(120)
        return Observation("", 0.0, done=True)


class Floods(Countdown):
    def step(self, action):
        return Observation("x" * (10 << 20))


class Raises(Countdown):
    def step(self, action):
        raise RuntimeError("the verifier crashed")


class Scorer:
    """A reward server: `Score` answers 0.25 for every completion, nan for one that says "nan",
    and waits for RELEASE on one that says "hang"."""

    def reset(self, example):
        return example.prompt

    def step(self, action):
        return Observation("", 0.0, done=True)

    def score(self, prompt, completion, answer, metadata):
        if completion == "hang":
            RELEASE.wait(120)
        return float("nan") if completion == "nan" else 0.25
