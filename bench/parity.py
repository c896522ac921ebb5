"""Token parity of the built-in engine with transformers, over the shapes real checkpoints have.

For each architecture (llama, qwen2, qwen3 with its per-head QK norm), tied and untied output
embedding, and head dim (32, 48, 64, 80, 96, 128, 256): a random transformers model, saved with
`save_pretrained` and loaded with `load_hf_dir` as a user would, generates greedily at batch 1,
8 and 64 (the 64 rows are 32 prompts of two samples each, which share their prompt's blocks).
Prompt lengths sit on both sides of KV block boundaries (the pool's blocks are 16 tokens) and
every row decodes across more of them.

- float32: every row's tokens equal transformers' greedy `generate` (batched, left padded). A
  row that differs is a *tie* when, at its first difference, transformers' own logits (teacher
  forced on the engine's tokens) put the engine's token within `--tie` of their top; otherwise
  it is *wrong*. Wrong rows fail the run.
- bfloat16: the engine's logprobs of its own tokens against transformers' bf16 logprobs of the
  same tokens (teacher forced), max and mean absolute difference. What fails a case is being
  further from the truth than transformers is: the engine's mean distance from transformers'
  float32 logprobs of those tokens over `--bf16-slack` times transformers' own bf16 distance from
  them (plus 0.01). These random models are sharpened, so bf16 rounding alone moves a logprob by
  up to a nat or two in both implementations; a kernel that reads the wrong row moves it by more.

On a GPU every case runs with CUDA graphs on and off (the Triton kernels); on a CPU the torch ops.
One JSON line per case, a table last, a PNG of the matrix with --png; exit status 1 on any failure.

    python bench/parity.py --device cuda --out run.jsonl --png bench/results/parity-<machine>.png
    python bench/common.py publish parity run.jsonl   # the current result, appended to the history
    python bench/parity.py --device cpu --head-dims 32,48 --batches 1,8 --archs llama   # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import commit, emit, machine  # noqa: E402
from services.models import load_hf_dir, make_char_tokenizer  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")
HEAD_DIMS = (32, 48, 64, 80, 96, 128, 256)
BATCHES = (1, 8, 64)
# 124 characters + pad, bos, eos: a 127-token vocabulary, none of it a stop token here.
TOKENIZER = make_char_tokenizer("".join(chr(c) for c in range(33, 157)))
VOCAB = TOKENIZER.vocab_size
BLOCK = 16
# Prompt lengths around the pool's block boundaries (and one of a single token).
LENGTHS = (1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK + 3, 5, 3 * BLOCK + 1)
NEW_TOKENS = 24


@dataclass
class Case:
    arch: str
    tied: bool
    head_dim: int
    batch: int
    graphs: bool | None  # None: CPU, no graphs to speak of
    rows: int = 0
    equal: int = 0
    ties: int = 0
    wrong: int = 0
    bf16_max: float = float("nan")  # engine bf16 against transformers bf16, same tokens
    bf16_mean: float = float("nan")
    bf16_error: float = float("nan")  # mean distance from transformers float32: the engine's,
    hf_bf16_error: float = float("nan")  # and transformers' own in bf16
    fp32_logprob_max: float = 0.0  # engine float32 against transformers float32, same tokens
    first_wrong: dict = field(default_factory=dict)

    def ok(self, slack: float) -> bool:
        return self.wrong == 0 and self.bf16_error <= slack * self.hf_bf16_error + 0.01


def hf_model(arch: str, tied: bool, head_dim: int, seed: int = 0):
    """A random transformers model of this shape, sharpened so that greedy choices are rarely near
    ties: attention that is not uniform (q and k scaled up) and logits of a few nats' spread."""
    import transformers

    heads, kv_heads = 4, 2
    hidden = heads * head_dim
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        config, cls = transformers.LlamaConfig(**common, rope_theta=500000.0), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    else:
        config, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)  # HF makes norms 1, biases 0: test them
            elif "q_proj" in name or "k_proj" in name:
                param.mul_(8.0)
            elif "o_proj" in name or "down_proj" in name:
                # Layers that move the residual stream away from the input token's embedding
                # (tied: which the logits would otherwise just repeat).
                param.mul_(60.0 if tied else 10.0)
        model.get_input_embeddings().weight.normal_(0.0, 3.0 / hidden**0.5)
        if not tied:
            model.get_output_embeddings().weight.normal_(0.0, 3.0 / hidden**0.5)
    return model


def prompts_for(batch: int, seed: int) -> tuple[list[list[int]], int]:
    """The prompts of one batch and the samples each takes: batch 64 is 32 prompts of 2."""
    n = 2 if batch >= 16 else 1
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(batch // n):
        length = LENGTHS[i % len(LENGTHS)]
        prompts.append(torch.randint(3, VOCAB, (length,), generator=gen).tolist())
    return prompts, n


def hf_greedy(model, prompts: list[list[int]], device: torch.device) -> list[list[int]]:
    """transformers' greedy generate of every prompt, batched and left padded; NEW_TOKENS each."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                             pad_token_id=0, top_k=None, top_p=None, temperature=None)
    return out[:, width:].cpu().tolist()


def hf_forced(model, sequences: list[tuple[list[int], list[int]]], device: torch.device) -> list[torch.Tensor]:
    """transformers' log-softmax [len(output), V] at each output position of each (prompt, output)
    pair, teacher forced: one right-padded forward (padding after every real token changes nothing)."""
    width = max(len(p) + len(o) for p, o in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, o) in enumerate(sequences):
        ids[i, :len(p) + len(o)] = torch.tensor(p + o)
        mask[i, :len(p) + len(o)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
    out = []
    for i, (p, o) in enumerate(sequences):
        out.append(torch.log_softmax(logits[i, len(p) - 1:len(p) + len(o) - 1], dim=-1).cpu())
    return out


def engine_generate(path: Path, dtype: str, device: torch.device, batch: int, graphs: bool | None,
                    prompts: list[list[int]], n: int):
    _, model = load_hf_dir(path, dtype=dtype, device=device)
    settings = CoreSettings(max_batch_size=batch, cuda_graphs=bool(graphs))
    core = GenerationCore(model.eval(), TOKENIZER, device, settings)
    sampling = Sampling(temperature=0.0, max_new_tokens=NEW_TOKENS, n=n, ignore_eos=True)
    results = core.generate(prompts, sampling)
    core.release()
    return sorted(results, key=lambda g: g.prompt_index)


def run_case(case: Case, hf32, hf16, path32: Path, path16: Path, device: torch.device, tie: float,
             seed: int) -> Case:
    prompts, n = prompts_for(case.batch, seed)
    reference = hf_greedy(hf32, prompts, device)
    got = engine_generate(path32, "float32", device, case.batch, case.graphs, prompts, n)
    forced = hf_forced(hf32, [(g.prompt_ids, g.output_ids) for g in got], device)
    case.rows = len(got)
    for g, lp in zip(got, forced):
        want = reference[g.prompt_index]
        chosen = lp.gather(1, torch.tensor(g.output_ids)[:, None])[:, 0]
        case.fp32_logprob_max = max(case.fp32_logprob_max, float((torch.tensor(g.logprobs) - chosen).abs().max()))
        if g.output_ids == want:
            case.equal += 1
            continue
        at = next(i for i, (a, b) in enumerate(zip(g.output_ids, want)) if a != b)
        gap = float(lp[at].max() - lp[at, g.output_ids[at]])
        if gap <= tie:
            case.ties += 1
        else:
            case.wrong += 1
            if not case.first_wrong:
                case.first_wrong = {"prompt_index": g.prompt_index, "prompt_len": len(g.prompt_ids), "at": at,
                                    "engine": g.output_ids[:at + 1], "transformers": want[:at + 1],
                                    "logit_gap": round(gap, 4)}
    got16 = engine_generate(path16, "bfloat16", device, case.batch, case.graphs, prompts, n)
    sequences = [(g.prompt_ids, g.output_ids) for g in got16]
    engine = torch.cat([torch.tensor(g.logprobs) for g in got16])
    hf_bf16, hf_fp32 = (_chosen(hf_forced(m, sequences, device), sequences) for m in (hf16, hf32))
    case.bf16_max, case.bf16_mean = float((engine - hf_bf16).abs().max()), float((engine - hf_bf16).abs().mean())
    case.bf16_error, case.hf_bf16_error = float((engine - hf_fp32).abs().mean()), float((hf_bf16 - hf_fp32).abs().mean())
    return case


def _chosen(logprobs: list[torch.Tensor], sequences: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """The logprobs of the sequences' own output tokens, all rows one after another."""
    return torch.cat([lp.gather(1, torch.tensor(out)[:, None])[:, 0] for lp, (_, out) in zip(logprobs, sequences)])


def matrix(archs, head_dims, batches, device: torch.device, graph_modes, tie: float, seed: int, out: Path | None,
           slack: float):
    import transformers

    transformers.logging.disable_progress_bar()
    cases = []
    total = len(archs) * 2 * len(head_dims) * len(batches) * len(graph_modes)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            for tied in (False, True):
                for head_dim in head_dims:
                    hf = hf_model(arch, tied, head_dim, seed)
                    path32, path16 = Path(tmp) / "fp32", Path(tmp) / "bf16"
                    hf.save_pretrained(path32, safe_serialization=True)
                    hf16 = hf.to(torch.bfloat16)
                    hf16.save_pretrained(path16, safe_serialization=True)
                    hf32 = transformers.AutoModelForCausalLM.from_pretrained(path32, dtype=torch.float32).eval()
                    hf32, hf16 = hf32.to(device), hf16.to(device)
                    for batch in batches:
                        for graphs in graph_modes:
                            case = run_case(Case(arch, tied, head_dim, batch, graphs), hf32, hf16, path32, path16,
                                            device, tie, seed)
                            cases.append(case)
                            line = {"metric": "parity", **{k: v for k, v in vars(case).items() if k != "first_wrong"},
                                    "ok": case.ok(slack), "date": time.strftime("%Y-%m-%d"),
                                    "commit": commit(), "machine": machine()}
                            if case.first_wrong:
                                line["first_wrong"] = case.first_wrong
                            emit(line, out)
                            print(f"# [{len(cases)}/{total}, {time.perf_counter() - started:.0f} s] {arch} "
                                  f"tied={tied} D={head_dim} b={batch} graphs={graphs}: {case.equal}/{case.rows} "
                                  f"equal, {case.ties} ties, {case.wrong} wrong, bf16 error {case.bf16_error:.4f} "
                                  f"(transformers {case.hf_bf16_error:.4f})",
                                  file=sys.stderr, flush=True)
                    del hf, hf16, hf32
    return cases


def _case(line: dict) -> Case:
    names = set(Case.__dataclass_fields__)
    return Case(**{k: v for k, v in line.items() if k in names})


def table(cases: list[Case], slack: float) -> str:
    lines = [f"{'arch':6} {'tied':5} {'D':>4} {'batch':>5} {'graphs':>6} {'equal':>7} {'ties':>4} {'wrong':>5} "
             f"{'bf16 max':>8} {'bf16 mean':>9} {'err':>6} {'hf err':>6} ok"]
    for c in cases:
        lines.append(f"{c.arch:6} {str(c.tied):5} {c.head_dim:4} {c.batch:5} {str(c.graphs):>6} "
                     f"{c.equal:3}/{c.rows:<3} {c.ties:4} {c.wrong:5} {c.bf16_max:8.4f} {c.bf16_mean:9.5f} "
                     f"{c.bf16_error:6.4f} {c.hf_bf16_error:6.4f} "
                     f"{'yes' if c.ok(slack) else 'NO'}")
    return "\n".join(lines)


def plot(cases: list[Case], path: Path, slack: float, stamp: str | None = None) -> None:
    """One panel per batch: rows are (arch, tied, graphs), columns head dims; the colour is the
    fraction of rows equal to transformers, a cross marks wrong rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({c.batch for c in cases})
    dims = sorted({c.head_dim for c in cases})
    keys = sorted({(c.arch, c.tied, c.graphs) for c in cases}, key=str)
    fig, axes = plt.subplots(1, len(batches), figsize=(4 + 2.2 * len(batches) * len(dims) / 7, 0.4 * len(keys) + 2),
                             squeeze=False)
    for ax, batch in zip(axes[0], batches):
        grid = torch.full((len(keys), len(dims)), float("nan"))
        for c in cases:
            if c.batch == batch:
                r, d = keys.index((c.arch, c.tied, c.graphs)), dims.index(c.head_dim)
                grid[r, d] = c.equal / max(c.rows, 1)
                if not c.ok(slack):
                    ax.text(d, r, "x", ha="center", va="center", color="red", fontsize=12, weight="bold")
        ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="Greens", aspect="auto")
        ax.set_xticks(range(len(dims)), [str(d) for d in dims])
        ax.set_yticks(range(len(keys)), [f"{a} {'tied' if t else 'untied'}{'' if g is None else ' graphs' if g else ' eager'}"
                                         for a, t, g in keys], fontsize=7)
        ax.set_xlabel("head dim")
        ax.set_title(f"batch {batch}")
    stamp = stamp or f"{machine()}, {commit()}, {time.strftime('%Y-%m-%d')}"
    fig.suptitle(f"built-in engine vs transformers, greedy fp32 rows equal "
                 f"(x: wrong tokens, or bf16 over {slack}x transformers' error)\n{stamp}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--graphs", default="on,off", help="on a GPU: CUDA graphs on, off or both")
    parser.add_argument("--tie", type=float, default=1e-4, help="a logit gap this small is a tie, not an error")
    parser.add_argument("--bf16-slack", type=float, default=1.5,
                        help="how many times transformers' own bf16 error the engine's may be")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="append the JSON lines here")
    parser.add_argument("--png", type=Path)
    parser.add_argument("--from-jsonl", type=Path, nargs="+",
                        help="no run: the table and --png of cases these files hold (runs of several modes in one)")
    args = parser.parse_args(argv)
    if args.from_jsonl:
        lines = [line for path in args.from_jsonl for line in map(json.loads, path.read_text().splitlines())
                 if line.get("metric") == "parity"]
        cases = [_case(line) for line in lines]
        print(table(cases, args.bf16_slack))
        if args.png and lines:
            plot(cases, args.png, args.bf16_slack, f"{lines[0]['machine']}, {lines[0]['commit']}, {lines[0]['date']}")
        return 1 if any(not c.ok(args.bf16_slack) for c in cases) else 0
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32
        torch.backends.cudnn.allow_tf32 = False
        modes = [{"on": True, "off": False}[m] for m in args.graphs.split(",")]
    else:
        modes = [None]
    cases = matrix(args.archs.split(","), [int(d) for d in args.head_dims.split(",")],
                   [int(b) for b in args.batches.split(",")], device, modes, args.tie, args.seed, args.out,
                   args.bf16_slack)
    print(table(cases, args.bf16_slack))
    bad = [c for c in cases if not c.ok(args.bf16_slack)]
    summary = {"metric": "parity_summary", "cases": len(cases), "failed": len(bad),
               "rows": sum(c.rows for c in cases), "rows_equal": sum(c.equal for c in cases),
               "ties": sum(c.ties for c in cases), "wrong": sum(c.wrong for c in cases),
               "bf16_worst_ratio": max(c.bf16_error / max(c.hf_bf16_error, 1e-9) for c in cases), "date": time.strftime("%Y-%m-%d"),
               "commit": commit(), "machine": machine()}
    emit(summary, args.out)
    if args.png:
        plot(cases, args.png, args.bf16_slack)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
