"""Datasets: strict JSON-lines loading and a deterministic, resumable prompt sampler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.coordinator.datasets import DatasetError, Example, PromptSampler, load_jsonl


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_jsonl_reads_rows_in_order(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [{"q": "1+1", "a": "2", "extra": 1}, "", {"q": "2+2", "a": 4}])
    examples = load_jsonl(path, "q", "a")
    assert examples == [Example(prompt="1+1", answer="2", index=0), Example(prompt="2+2", answer="4", index=1)]


def test_load_jsonl_limit(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [{"prompt": str(i), "answer": "x"} for i in range(10)] + ["{broken"])
    assert [e.prompt for e in load_jsonl(path, "prompt", "answer", limit=3)] == ["0", "1", "2"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "a", "answer": "b"}, "{not json"], r"d\.jsonl:2: invalid JSON"),
        ([{"prompt": "a"}], r"d\.jsonl:1: missing key 'answer' \(row has 'prompt'\)"),
        ([[1, 2]], r"d\.jsonl:1: expected a JSON object, got list"),
        ([{"prompt": 3, "answer": "b"}], r"d\.jsonl:1: 'prompt' must be a string, got int"),
        ([{"prompt": "a", "answer": None}], r"d\.jsonl:1: 'answer' must be a string or a number, got null"),
        ([{"prompt": "a", "answer": True}], r"d\.jsonl:1: 'answer' must be a string or a number, got bool"),
        ([], r"d\.jsonl: no rows"),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path, rows, message):
    path = write_rows(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError, match=message):
        load_jsonl(path, "prompt", "answer")


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(DatasetError, match=r"absent\.jsonl: cannot read"):
        load_jsonl(tmp_path / "absent.jsonl", "prompt", "answer")


def examples(n: int) -> list[Example]:
    return [Example(prompt=f"p{i}", answer=str(i), index=i) for i in range(n)]


def indices(batches: list[list[Example]]) -> list[list[int]]:
    return [[e.index for e in b] for b in batches]


def test_sampler_covers_each_example_once_per_epoch():
    sampler = PromptSampler(examples(10), batch_size=5, seed=3, shuffle=True)
    first_epoch = indices([sampler.next_batch(), sampler.next_batch()])
    second_epoch = indices([sampler.next_batch(), sampler.next_batch()])
    assert sorted(sum(first_epoch, [])) == list(range(10))
    assert sorted(sum(second_epoch, [])) == list(range(10))
    assert first_epoch != second_epoch  # reshuffled every epoch
    assert sampler.epoch == 1


def test_sampler_is_deterministic_for_a_seed():
    def draw(seed: int) -> list[list[int]]:
        sampler = PromptSampler(examples(7), batch_size=3, seed=seed, shuffle=True)
        return indices([sampler.next_batch() for _ in range(6)])

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    assert draw(-5) == draw(-5)  # negative seeds work too


def test_sampler_without_shuffle_keeps_file_order_and_straddles_epochs():
    sampler = PromptSampler(examples(5), batch_size=3, seed=0, shuffle=False)
    assert indices([sampler.next_batch() for _ in range(3)]) == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]


def test_sampler_with_fewer_examples_than_batch_size_repeats_rows():
    sampler = PromptSampler(examples(2), batch_size=5, seed=0, shuffle=False)
    assert indices([sampler.next_batch()]) == [[0, 1, 0, 1, 0]]


def test_sampler_resumes_where_it_left_off():
    reference = PromptSampler(examples(7), batch_size=3, seed=11, shuffle=True)
    expected = indices([reference.next_batch() for _ in range(8)])

    first = PromptSampler(examples(7), batch_size=3, seed=11, shuffle=True)
    seen = indices([first.next_batch() for _ in range(5)])
    state = json.loads(json.dumps(first.state_dict()))  # survives a round trip through the job store
    assert state["epoch"] == 2 and state["position"] == 1

    resumed = PromptSampler(examples(7), batch_size=3, seed=11, shuffle=True)
    resumed.load_state_dict(state)
    assert seen + indices([resumed.next_batch() for _ in range(3)]) == expected


def test_sampler_refuses_a_state_from_another_dataset_or_seed():
    state = PromptSampler(examples(7), batch_size=3, seed=1).state_dict()
    with pytest.raises(ValueError, match="saved for 7 examples"):
        PromptSampler(examples(8), batch_size=3, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="saved for seed 1"):
        PromptSampler(examples(7), batch_size=3, seed=2).load_state_dict(state)


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="examples"):
        PromptSampler([], batch_size=1, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(examples(3), batch_size=0, seed=0)
