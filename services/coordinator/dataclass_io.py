"""Strict conversion between plain data (YAML, JSON) and trees of frozen dataclasses.

Generic machinery behind the job config: a YAML loader that refuses duplicate keys, a converter
that builds a dataclass tree and names the full dotted field of any unknown key, wrong type or
failed check, the reverse dump to plain data, and a JSON Schema derived from the same classes
(field descriptions come from each dataclass's `Attributes:` docstring section).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import keyword
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

class ConfigError(ValueError):
    """A mistake in a job config; the message names the dotted field it is about."""


class FieldError(ConfigError):
    """A component's own check failed; the loader prefixes `field` with the component's path."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason



class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads `1e-5` as a float (as YAML 1.2 does)."""


def _construct_mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, typing.Hashable):
            continue  # construct_mapping below reports unhashable keys itself
        if key in seen:
            raise ConfigError(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)




def from_dict(cls: type, data: Any, *, base_dir: str | Path, path: str = "") -> Any:
    """Build dataclass `cls` from plain data (as YAML or JSON gives it), strictly.

    Nested dataclasses, Optional, tuple[X, ...], tuple[X, Y], list[X], Literal, Path, int, float,
    bool and str are understood. An int is accepted for a float, a bool never for an int.
    """
    base = Path(base_dir).expanduser().absolute()
    return _convert(cls, data, path, base, None)


def _convert(tp: Any, value: Any, path: str, base_dir: Path, default: Any, expected: str = "") -> Any:
    """Convert `value` to type `tp`; `expected` overrides the type's name in messages (for Optional)."""
    origin = typing.get_origin(tp)
    expected = expected or _type_name(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, base_dir, default if dataclasses.is_dataclass(default) else None, expected)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # only Optional[X] unions appear in the tree
        return _convert(inner, value, path, base_dir, default, expected)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, str) and value in allowed:
            return value
        hint = _suggest(value, allowed) if isinstance(value, str) else _bool_hint(value)
        raise ConfigError(f"{path}: expected {expected}; got {_describe(value)}{hint}")
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected {expected}, got {_describe(value)}")
        args = typing.get_args(tp)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected a list of {len(args)} items, got {len(value)}")
            item_types = args
        else:
            item_types = (args[0],) * len(value)
        items = [_convert(t, v, f"{path}[{i}]", base_dir, None) for i, (t, v) in enumerate(zip(item_types, value))]
        return tuple(items) if origin is tuple else items
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{path}: expected {expected}, got {_describe(value)}{_bool_hint(value)}")
        resolved = Path(value).expanduser()
        if not resolved.is_absolute():
            resolved = base_dir / resolved
        return Path(os.path.normpath(resolved))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(2**63) <= value < 2**63:  # the job store, protobuf and torch all hold int64
                raise ConfigError(f"{path}: {_describe(value)} is out of range (a 64-bit integer)")
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an int beyond any float
                raise ConfigError(f"{path}: expected a finite number, got {_describe(value)}") from None
            if not finite:
                raise ConfigError(f"{path}: expected a finite number, got {value}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"{path}: the config converter does not handle type {tp!r}")
    raise ConfigError(f"{path}: expected {expected}, got {_describe(value)}{_bool_hint(value)}")


def _build(cls: type, value: Any, path: str, base_dir: Path, base: Any, expected: str) -> Any:
    """Build one dataclass from a mapping; fields left out come from `base`, else the class default."""
    if not isinstance(value, dict):
        raise ConfigError(f"{path or 'job config'}: expected {expected}, got {_describe(value)}")
    hints = typing.get_type_hints(cls)
    fields = {key_of(f.name): f for f in dataclasses.fields(cls) if f.init}
    for key in value:
        if key not in fields:
            suggestion = _suggest(str(key), tuple(fields))
            raise ConfigError(f"unknown key {_join(path, str(key))!r}{suggestion}")
    kwargs: dict[str, Any] = {}
    for key, f in fields.items():
        sub_path, name = _join(path, key), f.name
        if key in value:
            inner_default = getattr(base, name) if base is not None else _field_default(f)
            kwargs[name] = _convert(hints[name], value[key], sub_path, base_dir, inner_default)
        elif base is not None:
            kwargs[name] = getattr(base, name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{sub_path}: required key is missing")
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise ConfigError(f"{_join(path, e.field)}: {e.reason}") from e


def key_of(name: str) -> str:
    """A field's key in the config: its name, less the trailing underscore of a name that would
    be a Python keyword (`async_` is `async`)."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _suggest(word: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _bool_hint(value: Any) -> str:
    return " (YAML reads yes/no/on/off/true/false as booleans; quote it)" if isinstance(value, bool) else ""


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(inner)} or null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return f"a list of {len(args)} items"
        return f"a list of {_type_name(args[0])}"
    return {Path: "a path", bool: "bool", int: "int", float: "float", str: "str"}.get(tp, repr(tp))




def to_dict(cfg: Any) -> Any:
    """Plain data (dicts, lists, str, numbers, None) for a config tree; paths become absolute strings."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {key_of(f.name): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Path):
        return str(cfg.absolute())
    if isinstance(cfg, list | tuple):
        return [to_dict(v) for v in cfg]
    return cfg



def json_schema(cls: type) -> dict[str, Any]:
    """The JSON Schema object of dataclass `cls`, with every nested dataclass under `$defs`."""
    defs: dict[str, Any] = {}
    _schema(cls, defs)
    root = defs.pop(cls.__name__)
    return {**root, "$defs": defs}


def _schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # placeholder first: a self-reference must not recurse forever
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return {"anyOf": [_schema(inner, defs), {"type": "null"}]}
    if origin is Literal:
        return {"type": "string", "enum": list(typing.get_args(tp))}
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            items = [_schema(a, defs) for a in args]
            return {"type": "array", "prefixItems": items, "items": False, "minItems": len(items)}
        return {"type": "array", "items": _schema(args[0], defs)}
    if tp is Path:
        return {"type": "string", "minLength": 1, "description": "a path; relative paths are resolved "
                "against the job file's directory"}
    return {"type": {bool: "boolean", int: "integer", float: "number", str: "string"}[tp]}


def _object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    docs = _field_docs(cls)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        key = key_of(f.name)
        prop = _schema(hints[f.name], defs)
        if key in docs:
            prop = {**prop, "description": docs[key]}
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(key)
        else:
            prop["default"] = to_dict(_field_default(f))
        properties[key] = prop
    summary = (inspect.getdoc(cls) or "").split("\n\n")[0]
    return {
        "type": "object", "description": summary, "properties": properties,
        "required": required, "additionalProperties": False,
    }


def _field_docs(cls: type) -> dict[str, str]:
    """Per-field descriptions from the `Attributes:` section of a dataclass docstring."""
    _, _, section = (inspect.getdoc(cls) or "").partition("Attributes:\n")
    docs: dict[str, str] = {}
    for line in section.splitlines():
        if match := re.fullmatch(r"    (\w+): (.*)", line):
            docs[match[1]] = match[2]
        elif line.startswith("        ") and docs:
            docs[next(reversed(docs))] += " " + line.strip()
        else:
            break
    return docs
