"""Datasets as users keep them: JSON lines, Parquet and `save_to_disk` folders give the same
examples; conversations are checked turn by turn; bad rows are named by file and row; big files
are streamed, not loaded."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
import yaml

from services.coordinator.config import ConfigError, parse_job
from services.coordinator.datasets import (
    Columns,
    DatasetError,
    Example,
    PromptSampler,
    check_dataset,
    iter_examples,
    load_examples,
    open_dataset,
)

CHAT = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}],
     "answer": "2", "level": 1, "source": "arith"},
    {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "and 3+3?"}],
     "answer": 6, "level": 2, "source": "arith"},
]
PLAIN = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3, "source": "arith"} for i in range(10)]
CHAT_COLUMNS = Columns(messages_key="messages", metadata_keys=("level", "source"))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict], row_group_size: int | None = None) -> Path:
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install pyarrow)")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=row_group_size)
    return path


def write_hf(path: Path, rows: list[dict]) -> Path:
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install datasets)")
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


WRITERS = {"jsonl": lambda d, rows: write_jsonl(d / "d.jsonl", rows),
           "parquet": lambda d, rows: write_parquet(d / "d.parquet", rows),
           "hf": lambda d, rows: write_hf(d / "hf", rows)}


@pytest.mark.parametrize("fmt", WRITERS)
def test_every_format_gives_the_same_examples(tmp_path, fmt):
    (tmp_path / "p").mkdir()
    (tmp_path / "c").mkdir()
    plain_path = WRITERS[fmt](tmp_path / "p", PLAIN)
    chat_path = WRITERS[fmt](tmp_path / "c", [{**r, "answer": str(r["answer"])} for r in CHAT] if fmt != "jsonl" else CHAT)

    examples = load_examples(plain_path, Columns(metadata_keys=("level",)))
    assert examples[3] == Example(prompt="3+1=", answer="4", index=3, metadata={"level": 0})
    chats = load_examples(chat_path, CHAT_COLUMNS)
    assert chats == [
        Example(prompt=None, answer="2", index=0, messages=CHAT[0]["messages"], metadata={"level": 1, "source": "arith"}),
        Example(prompt=None, answer="6", index=1, messages=CHAT[1]["messages"], metadata={"level": 2, "source": "arith"}),
    ]
    # Random access reads the same rows as a stream does, through any index.
    lazy = open_dataset(plain_path, Columns(metadata_keys=("level",)))
    assert len(lazy) == 10 and lazy[3] == examples[3] and lazy[-1] == examples[-1] and list(lazy) == examples
    assert lazy[2:4] == examples[2:4]
    with pytest.raises(IndexError):
        lazy[10]
    assert len(open_dataset(plain_path, Columns(), limit=4)) == 4 and check_dataset(plain_path, Columns(), limit=4) == 4


@pytest.mark.parametrize("fmt", WRITERS)
def test_the_sampler_deals_the_same_batches_from_any_format(tmp_path, fmt):
    reference = PromptSampler(load_examples(WRITERS["jsonl"](tmp_path, PLAIN), Columns()), 4, seed=5)
    sampler = PromptSampler(open_dataset(WRITERS[fmt](tmp_path, PLAIN), Columns()), 4, seed=5)
    for _ in range(6):
        assert sampler.next_batch() == reference.next_batch()
    skipped = PromptSampler(open_dataset(WRITERS[fmt](tmp_path, PLAIN), Columns()), 4, seed=5)
    skipped.skip_batches(6)  # a resumed job moves on without reading the rows it skips
    assert skipped.state_dict() == sampler.state_dict() and skipped.next_batch() == sampler.next_batch()


BAD_ROWS = [
    ({"prompt": "", "answer": "1"}, Columns(), r"'prompt' is empty"),
    ({"prompt": "  \n", "answer": "1"}, Columns(), r"'prompt' is empty"),
    ({"prompt": "q", "answer": [1]}, Columns(), r"'answer' must be a string or a number, got list"),
    ({"messages": [{"role": "robot", "content": "hi"}], "answer": "1"}, Columns(messages_key="messages"),
     r"messages\[0\]: role must be one of system, user, assistant, got 'robot'"),
    ({"messages": [{"role": "user", "content": 5}], "answer": "1"}, Columns(messages_key="messages"),
     r"messages\[0\]: content must be a string, got int"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}, {"role": "user", "content": "c"}],
      "answer": "1"}, Columns(messages_key="messages"), r"messages\[1\]: a system turn may only come first"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "answer": "1"},
     Columns(messages_key="messages"), r"'messages' must end with a user turn .*got 'assistant'"),
    ({"messages": [], "answer": "1"}, Columns(messages_key="messages"), r"'messages' must be a non-empty list"),
    ({"messages": "hi", "answer": "1"}, Columns(messages_key="messages"), r"'messages' must be a non-empty list .*got str"),
    ({"messages": [{"content": "hi"}], "answer": "1"}, Columns(messages_key="messages"), r"messages\[0\]: expected \{role, content\}"),
]


@pytest.mark.parametrize(("bad", "columns", "message"), BAD_ROWS)
def test_a_bad_jsonl_row_is_named_by_file_and_line(tmp_path, bad, columns, message):
    good = {"prompt": "q", "messages": [{"role": "user", "content": "q"}], "answer": "1"}
    path = write_jsonl(tmp_path / "d.jsonl", [good, good, "", bad])
    for read in (check_dataset, load_examples, open_dataset):
        with pytest.raises(DatasetError, match=rf"d\.jsonl:4: {message}"):
            read(path, columns)


def _one_parquet_type(row: dict) -> bool:
    """Parquet columns have one type: rows whose fault is a mixed type cannot be written to one."""
    turns = row.get("messages", [])
    return (not isinstance(row["answer"], list) and isinstance(turns, list)
            and all(isinstance(t.get("content"), str) and "role" in t for t in turns))


@pytest.mark.parametrize(("bad", "columns", "message"), [b for b in BAD_ROWS if _one_parquet_type(b[0])])
def test_a_bad_parquet_row_is_named_by_file_and_row(tmp_path, bad, columns, message):
    good = {"prompt": "q", "answer": "1"} if columns.messages_key is None else {
        "messages": [{"role": "user", "content": "q"}], "answer": "1"}
    rows = [good] * 2500 + [bad]  # in the third record batch of the stream
    path = write_parquet(tmp_path / "d.parquet", rows, row_group_size=1000)
    for read in (check_dataset, open_dataset):
        with pytest.raises(DatasetError, match=rf"d\.parquet: row 2500: {message}"):
            read(path, columns)


def test_nulls_and_missing_columns_in_arrow_formats(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}])
    with pytest.raises(DatasetError, match=r"d\.parquet: row 1: 'prompt' must be a string, got null"):
        check_dataset(path, Columns())
    with pytest.raises(DatasetError, match=r"d\.parquet: missing column 'question' \(columns: 'prompt', 'answer'\)"):
        check_dataset(path, Columns(prompt_key="question"))
    hf = write_hf(tmp_path / "hf", [{"prompt": "a", "answer": "1", "meta": 1}])
    with pytest.raises(DatasetError, match=r"hf: missing column 'level'"):
        open_dataset(hf, Columns(metadata_keys=("level",)))
    hf_bad = write_hf(tmp_path / "hf_bad", [{"prompt": "a", "answer": "1"}] * 3 + [{"prompt": "", "answer": "1"}])
    with pytest.raises(DatasetError, match=r"hf_bad/data-00000-of-00001\.arrow: row 3: 'prompt' is empty"):
        check_dataset(hf_bad, Columns())


def test_folders_that_are_not_one_saved_split_are_explained(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install datasets)")
    split = datasets.Dataset.from_list(PLAIN)
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"dd: a DatasetDict; point at one split's folder \(test, train\)"):
        check_dataset(tmp_path / "dd", Columns())
    assert check_dataset(tmp_path / "dd" / "train", Columns()) == 10
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match=r"empty: not a Hugging Face datasets folder \(no state.json"):
        check_dataset(tmp_path / "empty", Columns())


def test_a_multi_file_saved_dataset_keeps_row_order(tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install datasets)")
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(50)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"), num_shards=3)
    assert len(list((tmp_path / "hf").glob("*.arrow"))) == 3
    lazy = open_dataset(tmp_path / "hf", Columns())
    assert [e.prompt for e in lazy] == [r["prompt"] for r in rows] and lazy[37].answer == "37"


# ---------------------------------------------------------------------------- memory


def test_checking_a_big_jsonl_file_streams_it(tmp_path):
    path = tmp_path / "big.jsonl"
    row = json.dumps({"prompt": "x" * 200, "answer": "1", "notes": "y" * 800}) + "\n"
    with path.open("w") as f:
        for _ in range(20_000):  # ~20 MB
            f.write(row)
    tracemalloc.start()
    try:
        assert check_dataset(path, Columns()) == 20_000
        _, checked_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        lazy = open_dataset(path, Columns())
        _, open_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert checked_peak < 1_000_000  # a few rows at a time, not 20 MB
    assert open_peak < 2_000_000  # plus 16 bytes of index a row
    assert lazy[19_999].prompt == "x" * 200


def test_a_parquet_file_is_mapped_not_loaded(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (pip install pyarrow)")
    rows = [{"prompt": f"{i}:" + "x" * 1000, "answer": str(i), "big": "z" * 4000} for i in range(5000)]
    path = write_parquet(tmp_path / "big.parquet", rows, row_group_size=500)  # ~25 MB of strings
    del rows
    before = pa.total_allocated_bytes()
    lazy = open_dataset(path, Columns())
    assert pa.total_allocated_bytes() - before < 4_000_000  # the mapped rows live in the page cache
    assert lazy[4321].prompt.startswith("4321:") and lazy[4321].answer == "4321"


# ---------------------------------------------------------------------------- at submit


def test_the_job_is_refused_at_submit_naming_field_file_and_row(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    rows = [{"messages": [{"role": "user", "content": "q"}], "answer": "1"}] * 3
    rows.append({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "1"})
    write_parquet(tmp_path / "train.parquet", rows)
    write_jsonl(tmp_path / "test.jsonl", rows[:1])
    job = {"name": "j", "model": "model", "num_rollout": 1, "data": {"train": "train.parquet", "messages_key": "messages"},
           "eval": {"datasets": [{"name": "t", "path": "test.jsonl"}]}}
    with pytest.raises(ConfigError, match=rf"data.train: {tmp_path}/train\.parquet: row 3: 'messages' must end with a user turn"):
        parse_job(yaml.safe_dump(job), tmp_path)
    rows[3] = rows[0]
    write_parquet(tmp_path / "train.parquet", rows)
    assert parse_job(yaml.safe_dump(job), tmp_path).data.messages_key == "messages"


@pytest.mark.parametrize(("data", "message"), [
    ({"messages_key": ""}, "data.messages_key: must not be empty (null = rows have a prompt)"),
    ({"metadata_keys": ["a", "a"]}, "data.metadata_keys: must not repeat a key, repeated: a"),
    ({"metadata_key": ["a"]}, "unknown key 'data.metadata_key' (did you mean 'metadata_keys'?)"),
])
def test_data_config_keys_are_checked(data, message):
    job = {"name": "j", "model": "m", "num_rollout": 1, "data": {"train": "t.jsonl", **data}}
    with pytest.raises(ConfigError) as e:
        parse_job(yaml.safe_dump(job), "/x", check_files=False)
    assert str(e.value) == message


def test_iter_examples_is_lazy(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", PLAIN[:2] + ["{broken"])
    rows = iter_examples(path, Columns())
    assert next(rows).prompt == "0+1=" and next(rows).prompt == "1+1="
    with pytest.raises(DatasetError, match=r"d\.jsonl:3: invalid JSON"):
        next(rows)


def test_sft_trajectories_may_hold_tool_turns_must_end_with_the_assistant_and_need_no_answer(tmp_path):
    columns = Columns(messages_key="messages", trajectories=True)
    turns = [{"role": "user", "content": "12*7?"}, {"role": "assistant", "content": "<tool_call>...</tool_call>"},
             {"role": "tool", "content": "84"}, {"role": "assistant", "content": "84"}]
    (example,) = load_examples(write_jsonl(tmp_path / "t.jsonl", [{"messages": turns}]), columns)
    assert example.messages == turns and example.answer == ""
    with pytest.raises(DatasetError, match=r"t2.jsonl:1: 'messages' must end with an assistant turn .*got 'tool'"):
        load_examples(write_jsonl(tmp_path / "t2.jsonl", [{"messages": turns[:3]}]), columns)
    with pytest.raises(DatasetError, match="role must be one of system, user, assistant, got 'tool'"):
        load_examples(write_jsonl(tmp_path / "t3.jsonl", [{"messages": turns[:3] + [{"role": "user", "content": "?"}],
                                                          "answer": "1"}]), Columns(messages_key="messages"))


def test_sft_conversations_need_a_messages_key(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", PLAIN)
    text = yaml.safe_dump({"name": "j", "model": str(tmp_path), "num_rollout": 1, "data": {"train": str(data)},
                           "sft": {"data": str(data), "steps": 1, "conversations": True}})
    with pytest.raises(ConfigError, match="sft.conversations: needs data.messages_key"):
        parse_job(text, tmp_path, check_files=False)
