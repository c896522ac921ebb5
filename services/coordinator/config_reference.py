"""The job-config reference page, `docs/config-reference.md`, rendered from the JSON Schema the
coordinator publishes over REST (`job_json_schema`), which the config dataclasses derive: the page
lists what the loader accepts, and a test fails when the two part.

    python -m services.coordinator.config_reference > docs/config-reference.md
"""

from __future__ import annotations

import json
import sys
from typing import Any

from services.coordinator.config import job_json_schema

HEADER = """# Job configuration reference

A job is one YAML file, loaded strictly: an unknown key is an error that names it (with a
suggestion), a wrong type names the field and the type it expects, an out-of-range value names
the field and its range, and relative paths are resolved against the file's folder. A mapping
given for a section overrides that section's defaults field by field. The same schema is served
as JSON Schema by the coordinator's REST API (`GET /v1/schema/job`).

This page is generated from the config dataclasses (`services/coordinator/config.py`):
`python -m services.coordinator.config_reference > docs/config-reference.md`. Required fields
have no default.
"""


def render() -> str:
    schema = job_json_schema()
    defs = schema["$defs"]
    sections: list[tuple[str, dict]] = []
    seen: set[str] = set()

    def walk(path: str, obj: dict) -> None:
        sections.append((path, obj))
        for name, prop in obj["properties"].items():
            ref = _ref(prop)
            if ref and ref not in seen:
                seen.add(ref)
                walk(f"{path}.{name}" + ("[]" if _is_list(prop) else "") if path else name, defs[ref])

    walk("", schema)
    out = [HEADER]
    for path, obj in sections:
        out.append(f"## {'`' + path + '`' if path else 'Top level'}\n")
        if obj.get("description"):
            out.append(" ".join(obj["description"].split()) + "\n")
        out.append("| field | type | default | meaning |")
        out.append("|---|---|---|---|")
        for name, prop in obj["properties"].items():
            default = "required" if name in obj.get("required", ()) else _value(prop.get("default"))
            if _ref(prop) and not _is_list(prop):
                default = "see below"
            meaning = " ".join(prop.get("description", "").split()).replace("|", "\\|")
            out.append(f"| `{name}` | {_type(prop)} | {default} | {meaning} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _ref(prop: dict) -> str | None:
    """The dataclass a field holds (directly, optionally, or as list items), if any."""
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[1]
    for inner in prop.get("anyOf", ()):
        if "$ref" in inner:
            return inner["$ref"].rsplit("/", 1)[1]
    items = prop.get("items")
    if isinstance(items, dict):
        return _ref(items)
    return None


def _is_list(prop: dict) -> bool:
    return prop.get("type") == "array"


def _type(prop: dict) -> str:
    if "$ref" in prop:
        return "mapping"
    if "anyOf" in prop:
        inner = [p for p in prop["anyOf"] if p.get("type") != "null"]
        return f"{_type(inner[0])} or null"
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    kind = prop.get("type")
    if kind == "array":
        if "prefixItems" in prop:
            return "list of " + ", ".join(_type(p) for p in prop["prefixItems"])
        return f"list of {_type(prop['items'])}"
    if kind == "string" and "minLength" in prop:
        return "path"
    return {"boolean": "bool", "integer": "int", "number": "float", "string": "str"}.get(kind, str(kind))


def _value(value: Any) -> str:
    text = json.dumps(value)
    return f"`{text}`" if len(text) <= 40 else f"`{text[:37]}...`"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
