"""Experiment (2026-12-03, session 26): the host's time from a generate call's start to its
prefill's forward (the time a GPU sits idle at a call's start: checking the prompts, admitting
them, building the prefill's inputs), on the CPU with a tiny model, 256 prompts of 64 tokens.
The forward itself is cut short: the call stops where the device would get its first work.

    python bench/experiments/admission_cpu.py [batch] [calls]

Session 26 (the prompt ids converted once, one block allocation an admission) against the code
before it (321c286), on the 2-core CPU host, three alternating pairs of processes of 60 calls:
median 0.82-1.12 ms (min 0.78-0.79) against 1.16-2.18 (min 1.04-1.71);
bench/results/admission_cpu-experiment-*.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import _Ids, make_model  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402


class _Reached(Exception):
    """The call got to its prefill's forward."""


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    torch.set_num_threads(2)
    model = make_model("tiny", torch.float32, "cpu")
    core = GenerationCore(model, _Ids(), torch.device("cpu"), CoreSettings(max_batch_size=batch))
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(64)] for _ in range(batch)]
    sampling = Sampling(max_new_tokens=1, ignore_eos=True, seed=1)
    core.generate(prompts, sampling)  # the pool, the runner, the scheduler
    reached = {}

    def forward(*args, **kwargs):
        reached["at"] = time.perf_counter()
        raise _Reached

    core.runner._prefill_forward = forward
    spans = []
    for _ in range(calls):
        started = time.perf_counter()
        try:
            core.generate(prompts, sampling)
        except _Reached:
            pass
        spans.append(1e3 * (reached["at"] - started))
        core.cache.allocator.__init__(core.cache.num_blocks)  # the cut-short call's blocks back
    print(f"# call start -> prefill forward, {batch} prompts of 64 tokens, {calls} calls: "
          f"median {statistics.median(spans):.3f} ms, min {min(spans):.3f}")


if __name__ == "__main__":
    main()
