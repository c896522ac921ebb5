"""A running coordinator refuses a job whose dataset has a bad row, naming the field, the file and
the row, before any worker is configured."""

from __future__ import annotations

import textwrap
from pathlib import Path

import grpc
import pytest

from services.api import coordinator_pb2, coordinator_pb2_grpc
from tests.integration.conftest import addresses, channel

pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install pyarrow)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith"


def test_a_bad_parquet_row_fails_create_job(fleet, tmp_path):
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(100)]
    rows[42] = {"messages": [{"role": "narrator", "content": "once upon a time"}], "answer": "1"}
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "train.parquet"))
    job = textwrap.dedent(f"""
        name: bad-row
        model: {EXAMPLE / 'model'}
        num_rollout: 1
        data: {{train: {tmp_path / 'train.parquet'}, messages_key: messages}}
        eval: {{datasets: [{{name: t, path: {EXAMPLE / 'data' / 'test.jsonl'}, limit: 4}}]}}
        """)
    with channel(addresses(fleet)["coordinator"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            coordinator_pb2_grpc.CoordinatorStub(ch).CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=job), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (f"data.train: {tmp_path / 'train.parquet'}: row 42: messages[0]: role must be one of system, user, "
            "assistant, got 'narrator'") in e.value.details()
