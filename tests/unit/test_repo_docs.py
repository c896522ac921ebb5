"""What a newcomer reads stays true: the job-config reference is the schema's, the README keeps
its two set-up commands, and the guide pages describe the system as it is rather than narrate
when things were done (history lives in git)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.coordinator import config_reference

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_is_generated_from_the_current_schema():
    committed = (ROOT / "docs" / "config-reference.md").read_text()
    assert committed == config_reference.render(), (
        "docs/config-reference.md is stale: run python -m services.coordinator.config_reference > "
        "docs/config-reference.md")


def test_config_reference_lists_every_field_the_loader_accepts():
    import dataclasses

    import typing

    from services.coordinator.config import JobConfig
    from services.coordinator.dataclass_io import key_of

    page = config_reference.render()

    def fields(cls):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield key_of(f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                yield from fields(type(default))
            else:  # an optional section (`X | None`, default None)
                for inner in typing.get_args(hints[f.name]):
                    if dataclasses.is_dataclass(inner):
                        yield from fields(inner)

    for name in fields(JobConfig):
        assert f"| `{name}` |" in page, name


def test_readme_is_short_and_opens_with_the_two_setup_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160
    head = "\n".join(lines[:30])
    assert "pip install torch==2.13.0" in head and "rlfleet run examples/arith" in head
    assert "python -m pytest -q" in head


# A date, a numbered session/attempt/experiment, or "until <date>": the marks of a lab notebook.
_NARRATION = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b[Ss]ession \d+|\b(attempt|experiment) \d+\b|bench/experiments")


@pytest.mark.parametrize("folder", ["docs", "services", "tests", "bench"])
def test_no_page_or_module_narrates_when_things_were_done(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*")):
        if path.suffix not in (".md", ".py", ".sh", ".yaml") or "results" in path.parts:
            continue
        if path.name == "test_repo_docs.py":
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _NARRATION.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "\n".join(found[:40])


def test_every_relative_link_and_results_path_in_the_guide_exists():
    """A link or a `bench/results/...` path in the README or docs/ names a file that is there."""
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
        for target in re.findall(r"bench/results/[\w./<>*-]+", text):
            target = target.rstrip(".")
            if "*" not in target and "<" not in target and not (ROOT / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert not missing, "\n".join(missing)
