"""`trainer.compile` (on by default on GPUs) changes speed, not results: for both backends, a
trainer whose decoder layers go through torch.compile gives the logprobs, the loss, the gradient
norm and the trained weights of one that does not, within bf16 rounding, over three RL steps of
varying lengths (so the compiled graphs also meet new shapes)."""

from __future__ import annotations

import pytest
import torch

from services.trainer.backend import build_backend
from services.trainer.batch import Sample
from services.trainer.settings import OptimizerSettings, TrainerSettings
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.gpu


def _batches() -> list[list[Sample]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for length in (24, 40, 33):  # three shapes: compiled graphs must follow
        samples = []
        for _ in range(6):
            ids = torch.randint(3, 17, (length,), generator=gen).tolist()  # the tiny vocabulary
            n = length - 8
            samples.append(Sample(prompt_ids=ids[:8], response_ids=ids[8:],
                                  advantages=torch.randn(n, generator=gen).tolist()))
        out.append(samples)
    return out


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_compiled_layers_train_like_eager_ones(tmp_path, backend):
    if backend == "megatron":
        pytest.importorskip("megatron.core")
    model = make_tiny_model(tmp_path / "model", architecture="qwen2", hidden_size=128, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    runs = {}
    for compiled in (False, True):
        trainer = build_backend(TrainerSettings(
            model_path=str(model), backend=backend, device="cuda", dtype="bfloat16", master_weights="fp32",
            micro_batch_size=4, optimizer=OptimizerSettings(lr=1e-3), compile=compiled))
        try:
            initial = {k: v.detach().float().cpu().clone() for k, v in trainer.named.items()}
            logprobs, metrics = [], []
            for batch in _batches():
                logprobs.append(torch.tensor([x for row in trainer.compute_logprobs("", batch)[0] for x in row]))
                metrics.append(trainer.train_step(batch).metrics)
            weights = {k: v.detach().float().cpu().clone() for k, v in trainer.named.items()}
        finally:
            trainer.close()
        runs[compiled] = (logprobs, metrics, weights, initial)
    (eager_lp, eager_m, eager_w, w0), (comp_lp, comp_m, comp_w, _) = runs[False], runs[True]
    for a, b in zip(eager_lp, comp_lp):
        assert torch.allclose(a, b, atol=0.05, rtol=0), (a - b).abs().max()
    for a, b in zip(eager_m, comp_m):
        assert a["loss"] == pytest.approx(b["loss"], rel=0.05, abs=0.02)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=0.05)
    # Both trained the same way; only rounding differs (Adam may flip the sign of an update whose
    # gradient is near zero, so this compares mean movements, not the largest).
    drift = torch.cat([(eager_w[k] - comp_w[k]).abs().flatten() for k in eager_w]).mean().item()
    moved = torch.cat([(eager_w[k] - w0[k]).abs().flatten() for k in eager_w]).mean().item()
    assert drift < 0.25 * moved, (drift, moved)
    print(f"compile ({backend}): max logprob difference "
          f"{max(float((a - b).abs().max()) for a, b in zip(eager_lp, comp_lp)):.4f}, "
          f"weights drift {drift:.2e} against a move of {moved:.2e}")

