"""A real job (trainer, engine and coordinator processes) with the new pieces together: training
rows from Parquet, eval rows from a `save_to_disk` folder, the math_verify reward scoring in the
coordinator's job thread, and TensorBoard plus offline W&B receiving every step."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from services.api import coordinator_pb2
from tests.integration.conftest import addresses, run_job

for package in ("pyarrow", "datasets", "math_verify", "tensorboard", "wandb"):
    pytest.importorskip(package, reason=f"{package} is not installed (pip install {package.replace('_', '-')})")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith"


def _rows(name: str, limit: int) -> list[dict]:
    lines = (EXAMPLE / "data" / name).read_text().splitlines()[:limit]
    return [{**json.loads(line), "level": i % 3} for i, line in enumerate(lines)]


def test_a_job_reads_parquet_and_a_saved_dataset_and_is_tracked(fleet, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.unit.test_tracking import read_scalars, wandb_records

    pq.write_table(pa.Table.from_pylist(_rows("train.jsonl", 256)), str(tmp_path / "train.parquet"), row_group_size=64)
    datasets.Dataset.from_list(_rows("test.jsonl", 32)).save_to_disk(str(tmp_path / "heldout"))
    out = tmp_path / "out"
    job = textwrap.dedent(f"""
        name: tracked
        seed: 3
        model: {EXAMPLE / 'model'}
        num_rollout: 2
        output_dir: {out}
        rollout: {{prompts_per_step: 8, samples_per_prompt: 4, sampling: {{max_new_tokens: 5}}}}
        data: {{train: {tmp_path / 'train.parquet'}, metadata_keys: [level]}}
        reward: {{kind: math_verify, timeout_s: 5}}
        eval: {{every: 0, datasets: [{{name: heldout, path: {tmp_path / 'heldout'}, sampling: {{max_new_tokens: 5}}}}]}}
        trainer: {{optimizer: {{lr: 0.001}}}}
        tracking: {{tensorboard: true, wandb: {{project: rlfleet-it, mode: offline}}}}
        """)
    final, events = run_job(addresses(fleet)["coordinator"], job, timeout_s=300)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error

    steps = {e.step: json.loads(e.data_json) for e in events if e.kind == "step"}
    scalars = read_scalars(out / "tensorboard")
    assert [s for s, _ in scalars["rollout/reward_mean"]] == [1, 2]
    assert [s for s, _ in scalars["eval/heldout/score"]] == [0, 2]
    assert [s for s, _ in scalars["sync/seconds"]] == [0, 1, 2]
    assert "train/loss" in scalars and "rollout/response_len_mean" in scalars
    # the same numbers as the job's own event log
    assert [v for _, v in scalars["rollout/reward_mean"]] == pytest.approx([steps[1]["reward_mean"], steps[2]["reward_mean"]])

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    logged = [r for r in wandb_records(run_file) if r.WhichOneof("record_type") == "history"]
    names = {item.key or "/".join(item.nested_key) for r in logged for item in r.history.item}
    assert {"rollout/reward_mean", "eval/heldout/score", "sync/seconds", "rl_step"} <= names
    assert (out / "metrics.jsonl").is_file() and (out / "reward_curve.png").is_file()  # still written
