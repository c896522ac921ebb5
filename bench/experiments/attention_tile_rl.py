"""A one-off experiment (2026-12-02) kept as the record behind the decode-attention tile choice:
RL-shaped calls (128 prompts x 8 samples, prompts of 64-512 tokens, up to 1024 new tokens) with
32- and 64-token tiles for unsplit rows (`TritonOps.unsplit_tile`), alternating in one process
on one model. (The recorded run patched the same launch in by a copy of `decode_attention`.) Each trial
drops the captured graphs first, so every trial pays the same captures; the first trial of each
shape also compiles its kernels and is slow for that reason.

    python bench/experiments/attention_tile_rl.py [tile:stages,...] [shapes]   # on a GPU; output: bench/results/attention_tile_rl-*.txt
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import _Ids, make_model  # noqa: E402
from services.rollout.builtin import kernels as K  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402


def main() -> None:
    # variants "tile:stages", e.g. "64:2,128:1" (each run twice, in turn; the second round is the
    # measurement, the first compiles). The H100 run in bench/results also had a third field,
    # whether the first tile's block-table entries load alongside the row length (a change tried
    # in the working tree and not kept: 1.5B 38.3k tokens/s either way).
    specs = sys.argv[1].split(",") if len(sys.argv) > 1 else ["32:2", "64:2"]
    for shape in sys.argv[2].split(",") if len(sys.argv) > 2 else ("0.5b", "1.5b"):
        model = make_model(shape, torch.bfloat16, "cuda")
        vocab = model.config.vocab_size
        rng = random.Random(1)
        stops = tuple(rng.sample(range(vocab), vocab // 300))
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(64, 512))] for _ in range(128)]
        sampling = Sampling(temperature=1.0, max_new_tokens=1024, n=8, seed=3, stop_token_ids=stops)
        core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=256))
        for spec in specs * 2:
            tile, stages = (int(v) for v in spec.split(":")[:2])
            K.TritonOps.unsplit_tile, K.TritonOps.attention_stages = tile, stages
            if core.runner is not None:
                core.runner.drop_graphs()
            core.generate(prompts[:8], Sampling(temperature=1.0, max_new_tokens=64, n=8, seed=3, stop_token_ids=stops))
            torch.cuda.synchronize(); t = time.perf_counter()
            results = core.generate(prompts, sampling)
            torch.cuda.synchronize(); s = time.perf_counter() - t
            tokens = sum(len(r.output_ids) for r in results)
            st = core.scheduler.last_stats
            print(shape, "tile:stages", spec, "tokens", tokens, "s", round(s, 3), "tok/s", round(tokens / s), "decode_s", round(st.decode_s, 3),
                  "prefill_s", round(st.prefill_s, 3), flush=True)
        del core, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
