"""A screening experiment (2026-12-03): the prefill with and without its two changes of this
session, alternating in one process on one model: the last layer's o product and MLP on each
prompt's last token only (`PagedDecoder._layers(wanted=...)`), and causal attention on
`prefill_attention.py`'s kernel instead of SDPA's cuDNN / flash kernels.

Each variant's 1-token call (admission, prefill, the first token drawn, rows handed back) is
timed, median of 5, after a warm-up call that compiles and captures; its first tokens and
logprobs are compared with the first variant's.

    python bench/experiments/prefill_ab.py [variants] [prompts x length, comma-separated]   # on a GPU
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import VOCAB, _Ids, make_model, timed  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.builtin.forward import PagedDecoder  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

ONE = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True, seed=1)
VARIANTS = {  # name: (last layer on the last tokens only, attention kernel)
    "before": (False, False), "trim": (True, False), "trim+kernel": (True, True),
}


def apply(core: GenerationCore, name: str) -> None:
    trim, kernel = VARIANTS[name]
    decoder = core.runner.decoder
    decoder.__dict__.pop("_layers", None)
    if not trim:
        def untrimmed(tokens, attend, wanted=None):  # every token through the last layer, then picked
            hidden = PagedDecoder._layers(decoder, tokens, attend)
            return hidden if wanted is None else hidden[wanted]

        decoder._layers = untrimmed
    core.ops.prefill_kernel_max_len = 1 << 20 if kernel else 0
    core.runner.drop_graphs()


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
    cases = [tuple(int(v) for v in c.split("x")) for c in (sys.argv[2] if len(sys.argv) > 2 else
                                                            "256x64,64x512").split(",")]
    for shape in ("0.5b", "1.5b"):
        model = make_model(shape, torch.bfloat16, "cuda")
        core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=256))
        rng = random.Random(0)
        for count, length in cases:
            prompts = [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(count)]
            first = first_lps = None
            results: dict[str, list[float]] = {}
            for _round in range(2):
                for name in names:
                    core.generate(prompts[:1], ONE)  # the runner exists
                    apply(core, name)
                    out = core.generate(prompts, ONE)  # compile, capture
                    ms = sorted(timed(lambda: core.generate(prompts, ONE), "cuda") for _ in range(5))[2] * 1e3
                    results.setdefault(name, []).append(ms)
                    # Drawn at temperature 1 from a near-uniform distribution over 151,936 tokens, a
                    # row's token changes with any rounding change: logprobs compared where it did not.
                    lps = torch.tensor([r.logprobs[0] for r in out])
                    match = torch.tensor([r.output_ids == f.output_ids for r, f in zip(out, first or out)])
                    same = int(match.sum())
                    diff = float((lps - first_lps)[match].abs().max()) if first else 0.0
                    if first is None:
                        first, first_lps = out, lps
                    print(f"{shape} {count}x{length} {name:12s} call {ms:7.2f} ms  first tokens as '{names[0]}' "
                          f"{same}/{len(out)}, max logprob diff where they are {diff:.3g}", flush=True)
            print("# summary", shape, f"{count}x{length}", {k: [round(v, 2) for v in vs] for k, vs in results.items()},
                  flush=True)
        core = model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
