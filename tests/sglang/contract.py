"""SGLang's HTTP contract, read from the pinned sglang wheel (never from our own guesses).

The wheel (`sglang==0.5.23`) is downloaded once per machine into a cache directory and read as a
zip; sglang itself is never imported (it needs CUDA-era dependencies). What it gives:

- `/generate` bodies go through the wheel's own generated decoder (`sglang/api/v1/api_types.py`,
  loaded standalone; needs `msgspec`): the exact check SGLang 0.5.22+ runs before serving, so an
  unknown `sampling_params` key fails with SGLang's own message. Responses are decoded with the
  same module's `GenerateResponse` / `GetModelInfoResponse`.
- Control routes: `sglang/srt/entrypoints/http_server.py` is parsed with `ast` to learn each
  route's methods, auth level and request struct; the struct's fields (name, required, type) come
  from `sglang/srt/managers/io_struct.py`, also parsed with `ast`, bases included.
- `sglang/srt/utils/auth.py` (stdlib only) is loaded for `decide_request_auth`, and
  `sglang/srt/weight_sync/tensor_bucket.py` (torch only) for `FlattenedTensorBucket`, so a
  stand-in server authorises and sizes weight buckets with SGLang's code.
- `/update_weights_from_tensor` payloads are unpickled as SGLang does: through the allowlist of
  its `SafeUnpickler` (read with `ast`), its torch-storage loader and its patched CUDA rebuild
  (GPU UUID -> index), those functions compiled from the wheel (`deserialize_named_tensors`).
- Which model classes answer `/get_weights_by_name` comes from `sglang/srt/models/*.py`, parsed
  with `ast` (`weights_by_name_architectures`).

This file is longer than the house ~500 lines because it is the one place that reads the wheel.

Strictness: real SGLang *ignores* unknown top-level keys (control structs are validated with
extra="ignore", `GenerateReqInput` is a dataclass); only unknown keys inside `sampling_params`
are rejected. `check_request(..., strict=True)` (the default) rejects unknown keys everywhere, so
our adapter cannot rely on a field SGLang silently drops; `strict=False` judges as SGLang does.
"""

from __future__ import annotations

import ast
import base64
import binascii
import functools
import importlib.util
import io
import os
import pickle
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Union
from urllib.parse import parse_qsl, urlsplit

SGLANG_VERSION = "0.5.23"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
API_TYPES = "sglang/api/v1/api_types.py"
AUTH = "sglang/srt/utils/auth.py"
TENSOR_BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"
COMMON = "sglang/srt/utils/common.py"
PATCH_TORCH = "sglang/srt/utils/patch_torch.py"
WEIGHT_UTILS = "sglang/srt/model_loader/weight_utils.py"
MODELS = "sglang/srt/models/"

# Response shapes of control routes, as their handlers in http_server.py (0.5.23) build them.
SUCCESS_MESSAGE_ROUTES = (
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
    "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update", "/update_weights_from_disk",
    "/update_weight_version",
)
STATUS_MESSAGE_ROUTES = ("/pause_generation", "/continue_generation")
NULL_BODY_ROUTES = ("/release_memory_occupation", "/resume_memory_occupation")


class ContractError(ValueError):
    """A request or response that SGLang 0.5.23's types reject (or, strictly, would ignore).

    `kind` says which layer judged it, so a server can answer as SGLang would: "route" (no such
    route or method: 404/405), "schema" (the api_types decoder: 400 `{"error": text}`),
    "validation" (the request struct: 400 in SGLang's ErrorResponse shape)."""

    def __init__(self, message: str, *, kind: str = "validation", detail: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.detail = detail or message  # the text SGLang itself answers with, where it has one


# ---------------------------------------------------------------- the wheel


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "rlfleet" / f"sglang-{SGLANG_VERSION}"


def wheel_path() -> Path:
    """The pinned wheel: $RLFLEET_SGLANG_WHEEL, or the cached download (made on first use)."""
    if override := os.environ.get("RLFLEET_SGLANG_WHEEL"):
        return Path(override)
    directory = cache_dir()
    found = sorted(directory.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if found:
        return found[0]
    directory.mkdir(parents=True, exist_ok=True)
    # Download beside the cache and move in atomically, so concurrent test workers never read a
    # half-written wheel.
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"sglang=={SGLANG_VERSION}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        got = sorted(Path(tmp).glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if done.returncode != 0 or not got:
            raise RuntimeError(
                f"could not download sglang=={SGLANG_VERSION} (needed for the SGLang contract tests): "
                f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr.strip()[-800:]}\n"
                f"Put the wheel in {directory} or point RLFLEET_SGLANG_WHEEL at it.")
        target = directory / got[0].name
        os.replace(got[0], target)
    return target


@functools.cache
def wheel_source(member: str) -> str:
    with zipfile.ZipFile(wheel_path()) as zf:
        return zf.read(member).decode()


def load_wheel_module(member: str, name: str) -> ModuleType:
    """Execute one self-contained file of the wheel as module `name` (no sglang import)."""
    with zipfile.ZipFile(wheel_path()) as zf:
        code = zf.read(member)
    path = cache_dir() / "modules" / member
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_bytes() != code:
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
            f.write(code)
        os.replace(f.name, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # msgspec/dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def wheel_constant(member: str, name: str) -> Any:
    """A module-level literal of a wheel file (e.g. patch_torch's `_REDUCE_TENSOR_ARG_DEVICE_INDEX`)."""
    for node in ast.parse(wheel_source(member)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{member}: no module-level {name} in sglang {SGLANG_VERSION}")


def wheel_function(member: str, function: str, namespace: dict[str, Any]) -> Callable:
    """One top-level function of a wheel file that cannot be imported whole, compiled on its own
    with the globals in `namespace` (e.g. `init_custom_process_group` from utils/common.py)."""
    source = wheel_source(member)
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == function)
    scope = dict(namespace)
    exec(compile(ast.Module([node], []), f"{member}:{function}", "exec"), scope)  # noqa: S102
    return scope[function]


# ---------------------------------------------------------------- fields and routes


@dataclass(frozen=True)
class Field:
    name: str
    required: bool
    annotation: str  # as written in io_struct.py
    check: Callable[[Any], str | None]  # None if the JSON value fits, else what was expected


@dataclass(frozen=True)
class Route:
    path: str
    methods: frozenset[str]
    handler: str
    struct: str | None  # the io_struct class the body is parsed into
    body_optional: bool  # the struct parameter has a default (e.g. /weights_checker)
    query: frozenset[str]  # query parameters the handler declares
    auth_level: str  # "normal", "admin_optional" or "admin_force" (utils/auth.py)


def _literal_path(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    # os.environ.get("SGLANG_OLLAMA_CHAT_ROUTE", "/api/chat"): the default is the route
    if isinstance(node, ast.Call) and len(node.args) == 2:
        return _literal_path(node.args[1])
    return None


def _struct_of(annotation: ast.expr | None) -> tuple[str | None, bool]:
    """(struct name, optional) of a parameter annotation: X, Annotated[X, Body()], Optional[X]."""
    if annotation is None:
        return None, False
    if isinstance(annotation, ast.Name):
        return annotation.id, False
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        head, inner = annotation.value.id, annotation.slice
        if head == "Annotated" and isinstance(inner, ast.Tuple):
            return _struct_of(inner.elts[0])
        if head == "Optional":
            return _struct_of(inner)[0], True
    return None, False


def parse_routes(source: str, struct_names: set[str]) -> dict[str, Route]:
    routes: dict[str, Route] = {}
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        found, level = [], "normal"
        for dec in fn.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            target = dec.func
            if isinstance(target, ast.Name) and target.id == "auth_level" and dec.args:
                level = getattr(dec.args[0], "attr", "NORMAL").lower()
            if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "app"):
                continue
            path = _literal_path(dec.args[0]) if dec.args else None
            if path is None:
                continue
            if target.attr == "api_route":
                methods = next((frozenset(ast.literal_eval(k.value)) for k in dec.keywords if k.arg == "methods"),
                               frozenset({"GET"}))
            elif target.attr in ("get", "post", "put", "delete", "head", "patch"):
                methods = frozenset({target.attr.upper()})
            elif target.attr == "websocket":
                methods = frozenset({"WEBSOCKET"})
            else:
                continue
            found.append((path, methods))
        if not found:
            continue
        struct, optional, query = None, False, set()
        args = fn.args.args
        defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
        for arg, default in zip(args, defaults):
            name, opt = _struct_of(arg.annotation)
            if name in struct_names and struct is None:
                struct, optional = name, opt or default is not None
            if isinstance(default, ast.Call) and getattr(default.func, "id", None) == "Query":
                query.add(arg.arg)
        for path, methods in found:
            old = routes.get(path)
            if old is not None:  # one path served by two handlers (e.g. GET and DELETE)
                methods = methods | old.methods
            routes[path] = Route(path, methods, fn.name, struct or (old.struct if old else None),
                                 optional, frozenset(query), level)
    return routes


def _checker(node: ast.expr | None, structs: dict[str, dict[str, Field]]) -> Callable[[Any], str | None]:
    """A cheap JSON type check for an io_struct annotation; unknown names accept anything."""
    def ok(_v):
        return None
    if node is None:
        return ok
    if isinstance(node, ast.Constant) and node.value is None:
        return lambda v: None if v is None else "null"
    if isinstance(node, ast.Name) or isinstance(node, ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        simple = {
            "str": (lambda v: isinstance(v, str), "a string"),
            "bytes": (lambda v: isinstance(v, str), "a base64 string"),
            "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
            "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
            "bool": (lambda v: isinstance(v, bool), "a boolean"),
        }.get(name)
        if simple is not None:
            test, what = simple
            return lambda v: None if test(v) else what
        if name in structs:
            return lambda v: None if isinstance(v, dict) else "an object"
        return ok
    if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)):
        head = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Annotated":
            inner = _checker(parts[0], structs)
            if any(isinstance(p, ast.Call) and ast.unparse(p.func) == "Base64Bytes" for p in parts[1:]):
                return _base64_checked(inner)
            return inner
        if head == "Optional":
            inner = _checker(parts[0], structs)
            return lambda v: None if v is None else inner(v)
        if head == "Union":
            options = [_checker(p, structs) for p in parts]
            return lambda v: None if any(o(v) is None for o in options) else \
                " or ".join(filter(None, (o(v) for o in options)))
        if head in ("List", "list", "Tuple", "tuple", "Sequence"):
            item = _checker(parts[0], structs) if head in ("List", "list", "Sequence") else ok

            def check_list(v):
                if not isinstance(v, list):
                    return "a list"
                bad = next((item(x) for x in v if item(x) is not None), None)
                return None if bad is None else f"a list of {bad}"
            return check_list
        if head in ("Dict", "dict"):
            return lambda v: None if isinstance(v, dict) else "an object"
        if head == "Literal":
            allowed = [p.value for p in parts if isinstance(p, ast.Constant)]
            return lambda v: None if v in allowed else "one of " + ", ".join(repr(a) for a in allowed)
    return ok


def _base64_checked(inner: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """SGLang's `Base64Bytes` marker (utils/msgspec_utils.py): every string, also inside lists, is
    decoded with validate=True before the type check; one that does not decode fails validation."""
    def decodes(v: Any) -> bool:
        if isinstance(v, str):
            try:
                base64.b64decode(v, validate=True)
            except binascii.Error:
                return False
            return True
        return all(decodes(x) for x in v) if isinstance(v, (list, tuple)) else True
    return lambda v: inner(v) or (None if decodes(v) else "base64-encoded bytes")


def parse_structs(source: str) -> dict[str, dict[str, Field]]:
    """Every class of io_struct.py: its fields in order, bases' fields first."""
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    structs: dict[str, dict[str, Field]] = {}

    def fields_of(name: str) -> dict[str, Field]:
        if name in structs:
            return structs[name]
        node = classes[name]
        fields: dict[str, Field] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                fields.update(fields_of(base.id))
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            if ast.unparse(stmt.annotation).startswith("ClassVar"):
                continue
            required = stmt.value is None or (
                isinstance(stmt.value, ast.Call) and ast.unparse(stmt.value.func) in ("field", "msgspec.field")
                and not any(k.arg in ("default", "default_factory") for k in stmt.value.keywords))
            fields[stmt.target.id] = Field(stmt.target.id, required, ast.unparse(stmt.annotation),
                                           _checker(stmt.annotation, classes))
        structs[name] = fields
        return fields

    for name in classes:
        fields_of(name)
    return structs


# ---------------------------------------------------------------- the contract


class Contract:
    """SGLang 0.5.23's HTTP contract: routes, request structs, and the generated JSON types."""

    def __init__(self):
        self.version = SGLANG_VERSION
        self.structs = parse_structs(wheel_source(IO_STRUCT))
        self.routes = parse_routes(wheel_source(HTTP_SERVER), set(self.structs))
        self.api = load_wheel_module(API_TYPES, "_sglang_wheel_api_types")
        self.auth = load_wheel_module(AUTH, "_sglang_wheel_auth")

    def route(self, method: str, path: str) -> Route:
        route = self.routes.get(urlsplit(path).path)
        if route is None:
            raise ContractError(f"{path}: no such route in sglang {self.version}", kind="route")
        if method.upper() not in route.methods:
            raise ContractError(f"{route.path}: sglang {self.version} serves it with {sorted(route.methods)}, "
                                f"not {method.upper()}", kind="route")
        return route

    def fields(self, path: str) -> dict[str, Field]:
        """The request fields a route's body is parsed into ({} for routes without a body)."""
        route = self.routes[path]
        return self.structs[route.struct] if route.struct else {}

    def check_request(self, method: str, path: str, body: Any, *, strict: bool = True) -> None:
        route = self.route(method, path)
        where = route.path
        unknown_query = [k for k, _ in parse_qsl(urlsplit(path).query, keep_blank_values=True) if k not in route.query]
        if strict and unknown_query:
            raise ContractError(f"{where}: unknown query parameter `{unknown_query[0]}` "
                                f"(the handler declares {sorted(route.query) or 'none'})")
        if route.path == "/generate":
            self._check_generate(body, strict=strict)
        if route.struct is None:
            if strict and body not in (None, {}):
                raise ContractError(f"{where}: takes no request body, got {type(body).__name__}")
            return
        if body is None:
            if route.body_optional:
                return
            raise ContractError(f"{where}: a JSON body ({route.struct}) is required")
        if not isinstance(body, dict):
            raise ContractError(f"{where}: the body must be a JSON object ({route.struct}), got {type(body).__name__}")
        fields = self.structs[route.struct]
        for key, value in body.items():
            field = fields.get(key)
            if field is None:
                if strict:
                    raise ContractError(f"{where}: unknown key `{key}` ({route.struct} has {', '.join(fields)}; "
                                        f"real SGLang ignores unknown keys, the strict contract does not)")
                continue
            expected = field.check(value)
            if expected is not None:
                raise ContractError(f"{where}: key `{key}` must be {expected} ({field.annotation}), got {value!r:.80}")
        missing = [name for name, f in fields.items() if f.required and name not in body]
        if missing:
            raise ContractError(f"{where}: missing required key `{missing[0]}` ({route.struct})")

    def _check_generate(self, body: Any, *, strict: bool) -> None:
        try:
            self.api.GenerateRequest.from_json_value(body)
        except self.api.JsonContractError as e:
            raise ContractError(f"/generate: {e}", kind="schema", detail=str(e)) from e
        if strict:
            known = self.structs["GenerateReqInput"]
            extra = [k for k in body if k not in known]
            if extra:
                raise ContractError(f"/generate: unknown key `{extra[0]}` (not a GenerateReqInput field; real SGLang "
                                    f"ignores it, the strict contract does not)")

    def check_response(self, path: str, body: Any, *, logprobs: bool = False, text: bool = True) -> None:
        """That `body` has the shape SGLang 0.5.23 answers `path` with, and every field our adapter
        reads. For /generate: `logprobs` requires output_token_logprobs (one per output id), `text`
        requires text (absent with --skip-tokenizer-init)."""
        path = urlsplit(path).path
        if path == "/generate":
            items = body if isinstance(body, list) else [body]
            for i, item in enumerate(items):
                self._check_generate_item(item, f"/generate[{i}]", logprobs=logprobs, text=text)
        elif path in ("/model_info", "/get_model_info"):
            self._decode(self.api.GetModelInfoResponse, body, path)
            if not isinstance(body.get("weight_version"), str):
                raise ContractError(f"{path}: weight_version must be a string, got {body.get('weight_version')!r}")
        elif path in SUCCESS_MESSAGE_ROUTES:
            self._require(body, path, success=bool, message=str)
        elif path in STATUS_MESSAGE_ROUTES:
            self._require(body, path, message=str, status=str)
        elif path in NULL_BODY_ROUTES:
            if body is not None:
                raise ContractError(f"{path}: SGLang answers with a null body, got {body!r:.80}")
        elif path == "/weights_checker":
            self._require(body, path, success=bool, message=str)
            info_fields = self.structs["ChecksumInfo"]
            for rank in body.get("ranks", []):
                if set(rank) != set(info_fields):
                    raise ContractError(f"{path}: a rank entry has keys {sorted(rank)}, expected {list(info_fields)}")
            if "per_engine_checksum" in body and not isinstance(body["per_engine_checksum"], str):
                raise ContractError(f"{path}: per_engine_checksum must be a string")
        elif path == "/get_weights_by_name":
            if not isinstance(body, list):
                raise ContractError(f"{path}: SGLang answers with a JSON list of values, got {type(body).__name__}")
        else:
            raise ContractError(f"{path}: no response shape recorded for this route", kind="route")

    def _check_generate_item(self, item: Any, where: str, *, logprobs: bool, text: bool) -> None:
        self._decode(self.api.GenerateResponse, item, where)
        needed = ("text", "output_ids", "meta_info") if text else ("output_ids", "meta_info")
        for key in needed:
            if key not in item:
                raise ContractError(f"{where}: missing `{key}`")
        meta = item["meta_info"]
        self._require(meta, f"{where}.meta_info", id=str, prompt_tokens=int, completion_tokens=int, weight_version=str)
        finish = meta.get("finish_reason")
        if not (isinstance(finish, dict) and finish.get("type") in ("stop", "length", "abort")):
            raise ContractError(f"{where}.meta_info: finish_reason must be a stop/length/abort object, got {finish!r}")
        if meta["completion_tokens"] != len(item["output_ids"]):
            raise ContractError(f"{where}.meta_info: completion_tokens {meta['completion_tokens']} but "
                                f"{len(item['output_ids'])} output_ids")
        if logprobs:
            entries = meta.get("output_token_logprobs")
            if not isinstance(entries, list) or len(entries) != len(item["output_ids"]):
                raise ContractError(f"{where}.meta_info: output_token_logprobs must have one [logprob, token_id, "
                                    f"text] per output id")
            if [e[1] for e in entries] != item["output_ids"]:
                raise ContractError(f"{where}.meta_info: output_token_logprobs token ids differ from output_ids")

    def _decode(self, cls, body: Any, where: str) -> None:
        try:
            cls.from_json_value(body)
        except self.api.JsonContractError as e:
            raise ContractError(f"{where}: {e}", kind="schema") from e

    @staticmethod
    def _require(body: Any, where: str, **types: type) -> None:
        if not isinstance(body, dict):
            raise ContractError(f"{where}: expected a JSON object, got {type(body).__name__}")
        for key, kind in types.items():
            value = body.get(key)
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ContractError(f"{where}: `{key}` must be {kind.__name__}, got {value!r:.80}")

    def authorize(self, method: str, path: str, authorization: str | None, *, api_key: str | None,
                  admin_api_key: str | None) -> tuple[bool, int]:
        """(allowed, status if not) by SGLang's own `decide_request_auth` and the route's level."""
        route = self.routes.get(urlsplit(path).path)
        level = self.auth.AuthLevel(route.auth_level if route else "normal")
        decision = self.auth.decide_request_auth(method=method, path=urlsplit(path).path,
                                                 authorization_header=authorization, api_key=api_key,
                                                 admin_api_key=admin_api_key, auth_level=level)
        return decision.allowed, decision.error_status_code


@functools.cache
def load_contract() -> Contract:
    return Contract()


def check_request(method: str, path: str, body: Any, *, strict: bool = True) -> None:
    """ContractError naming the endpoint and the offending key if SGLang 0.5.23 would reject
    `body` (with `strict`, also if it would silently ignore part of it)."""
    load_contract().check_request(method, path, body, strict=strict)


def check_response(path: str, body: Any, *, logprobs: bool = False, text: bool = True) -> None:
    load_contract().check_response(path, body, logprobs=logprobs, text=text)


def routes() -> dict[str, frozenset[str]]:
    """Every route of SGLang 0.5.23's http_server.py -> its HTTP methods."""
    return {path: route.methods for path, route in load_contract().routes.items()}


@functools.cache
def tensor_bucket_module() -> ModuleType:
    """SGLang's weight_sync/tensor_bucket.py (imports only torch): `FlattenedTensorMetadata` and
    `FlattenedTensorBucket`."""
    return load_wheel_module(TENSOR_BUCKET, "_sglang_wheel_tensor_bucket")


def flattened_tensor_bucket() -> type:
    return tensor_bucket_module().FlattenedTensorBucket


@functools.cache
def init_custom_process_group() -> Callable:
    """SGLang's `init_custom_process_group` (utils/common.py), compiled alone: the rendezvous and
    store prefixes a weight-update group really uses."""
    import torch
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    return wheel_function(COMMON, "init_custom_process_group", {"torch": torch, "torch_release": release})


@functools.cache
def initialize_dummy_weights() -> Callable:
    """SGLang's `initialize_dummy_weights` (model_loader/weight_utils.py), what `--load-format
    dummy` runs on a fresh model: every float tensor uniform in [-1e-3, 1e-3] from its own
    generator seeded 1234 (not --random-seed)."""
    import torch
    return wheel_function(WEIGHT_UTILS, "initialize_dummy_weights", {"torch": torch})


# ---------------------------------------------------------------- serialized tensors


def _class_node(member: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(wheel_source(member)).body if isinstance(n, ast.ClassDef) and n.name == name)


@functools.cache
def safe_unpickler_globals() -> frozenset[tuple[str, str]]:
    """`SafeUnpickler.ALLOWED_GLOBALS` (utils/common.py): the (module, name) globals SGLang lets a
    serialized payload name."""
    for stmt in _class_node(COMMON, "SafeUnpickler").body:
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == "ALLOWED_GLOBALS" for t in stmt.targets):
            return frozenset(ast.literal_eval(stmt.value))
    raise LookupError(f"{COMMON}: SafeUnpickler has no ALLOWED_GLOBALS in sglang {SGLANG_VERSION}")


@functools.cache
def _replaced_globals() -> dict[tuple[str, str], Callable]:
    """Globals SGLang resolves to its own code, each compiled from the wheel: the ones
    `SafeUnpickler.find_class` special-cases before its allowlist (torch's `_load_from_bytes`,
    which would run an unrestricted torch.load), and the CUDA rebuild that
    `monkey_patch_torch_reductions` puts in torch's place (device index 6 may be a GPU UUID)."""
    import torch
    from torch.multiprocessing import reductions

    special: dict[tuple[str, str], Callable] = {}
    for node in ast.walk(next(n for n in _class_node(COMMON, "SafeUnpickler").body
                              if isinstance(n, ast.FunctionDef) and n.name == "find_class")):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.comparators[0], ast.Tuple) and isinstance(node.body[0], ast.Return)):
            key = ast.literal_eval(node.test.comparators[0])
            special[key] = wheel_function(COMMON, node.body[0].value.id, {"torch": torch, "io": io, "pickle": pickle})
    scope = {"torch": torch, "Union": Union, "Callable": Callable}
    torch_rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    rebuild = wheel_function(PATCH_TORCH, "_rebuild_cuda_tensor_modified", {
        "reductions": SimpleNamespace(_rebuild_cuda_tensor_original=torch_rebuild),
        "_modify_tuple": wheel_function(PATCH_TORCH, "_modify_tuple", scope),
        "_device_from_maybe_uuid": wheel_function(PATCH_TORCH, "_device_from_maybe_uuid", scope),
        "_REDUCE_TENSOR_ARG_DEVICE_INDEX": wheel_constant(PATCH_TORCH, "_REDUCE_TENSOR_ARG_DEVICE_INDEX"),
    })
    special[("torch.multiprocessing.reductions", "rebuild_cuda_tensor")] = rebuild
    special[("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")] = rebuild
    return special


class _SafeUnpickler(pickle.Unpickler):
    """SGLang's `SafeUnpickler` after `monkey_patch_torch_reductions()`, recording what it is asked for."""

    def __init__(self, file):
        super().__init__(file)
        self.allowed, self.replaced = safe_unpickler_globals(), _replaced_globals()
        self.named: list[str] = []

    def find_class(self, module: str, name: str):
        self.named.append(f"{module}.{name}")
        key = (module, name)
        if key == ("torch.storage", "_load_from_bytes"):  # checked before the allowlist, as SGLang does
            return self.replaced[key]
        if key not in self.allowed:
            raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")
        if key in self.replaced:
            return self.replaced[key]
        if module == "sglang.srt.weight_sync.tensor_bucket":
            return getattr(tensor_bucket_module(), name)
        if module.startswith("sglang."):  # allowed, but only importable with sglang itself
            raise pickle.UnpicklingError(f"stand-in: {module}.{name} is allowed by SGLang, but its module "
                                         f"cannot be loaded without importing sglang")
        return super().find_class(module, name)


def deserialize_named_tensors(data: str | bytes) -> tuple[Any, list[str]]:
    """(the object, the globals it named as "module.name") for one `serialized_named_tensors`
    entry, as SGLang's `MultiprocessingSerializer.deserialize` decodes it: base64 with
    validate=True for a string, then its allowlisted unpickler. A global off the allowlist raises
    RuntimeError with SGLang's own message."""
    if isinstance(data, str):
        data = base64.b64decode(data, validate=True)
    unpickler = _SafeUnpickler(io.BytesIO(data))
    return unpickler.load(), unpickler.named


# ---------------------------------------------------------------- model classes


def _statements(body: list[ast.stmt]):
    """Module-level statements, also those under if/try (conditional imports and classes)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try)):
            for block in (stmt.body, stmt.orelse, getattr(stmt, "finalbody", []),
                          *(h.body for h in getattr(stmt, "handlers", []))):
                yield from _statements(block)


@dataclass(frozen=True)
class _ModelModule:
    classes: dict[str, ast.ClassDef]
    names: dict[str, tuple[str, str]]  # local name -> (module, name): imports and `Alias = Other`
    entries: list[ast.expr]  # EntryClass's elements


def _model_module(module: str, tree: ast.Module) -> _ModelModule:
    classes, names, entries = {}, {}, []
    package = module.rsplit(".", 1)[0]
    for stmt in _statements(tree.body):
        if isinstance(stmt, ast.ClassDef):
            classes[stmt.name] = stmt
        elif isinstance(stmt, ast.ImportFrom):
            source = stmt.module or ""
            if stmt.level:
                base = package.rsplit(".", stmt.level - 1)[0] if stmt.level > 1 else package
                source = f"{base}.{source}" if source else base
            for alias in stmt.names:
                names[alias.asname or alias.name] = (source, alias.name)
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    names[alias.asname] = tuple(alias.name.rsplit(".", 1)) if "." in alias.name else (alias.name, "")
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            target = stmt.targets[0].id
            if target == "EntryClass":
                entries = stmt.value.elts if isinstance(stmt.value, (ast.List, ast.Tuple)) else [stmt.value]
            elif isinstance(stmt.value, ast.Name):
                names[target] = (module, stmt.value.id)
    return _ModelModule(classes, names, entries)


_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+\S+[ \t]+import[ \t]+(?:\([^)]*\)|[^\n]*)|import[ \t]+[^\n]*)", re.M)


def _imports_of(module: str, source: str) -> set[str] | None:
    """Every module the file's import statements name (None if one does not parse alone)."""
    found = set()
    for text in _IMPORT.findall(source):
        try:
            tree = ast.parse(text.strip())
        except SyntaxError:
            return None
        names = _model_module(module, tree).names.values()
        found |= {m for source, name in names for m in (source, f"{source}.{name}")}
    return found


@functools.cache
def _model_modules(method: str) -> dict[str, _ModelModule]:
    """The models package's files that can define or inherit `method`, parsed: those that mention
    it and, transitively, those importing one of them (the package is ~7 MB of source; parsing
    only these keeps this under a second)."""
    with zipfile.ZipFile(wheel_path()) as zf:
        sources = {member.removesuffix(".py").removesuffix("/__init__").replace("/", "."): zf.read(member).decode()
                   for member in zf.namelist() if member.startswith(MODELS) and member.endswith(".py")}
    imports = {module: _imports_of(module, source) for module, source in sources.items()}
    relevant = {module for module, source in sources.items() if method in source}
    while True:
        more = {m for m, names in imports.items() if m not in relevant and (names is None or names & relevant)}
        if not more:
            break
        relevant |= more
    return {module: _model_module(module, ast.parse(sources[module])) for module in relevant}


def _resolve(modules: dict[str, _ModelModule], module: str, expr: ast.expr, depth: int = 0):
    """(module, ClassDef) that a name or dotted name in `module` refers to; None outside the models."""
    if depth > 20 or module not in modules:
        return None
    here = modules[module]
    if isinstance(expr, ast.Name):
        if expr.id in here.classes:
            return module, here.classes[expr.id]
        if expr.id in here.names:
            source, name = here.names[expr.id]
            if name and source in modules:
                return _resolve(modules, source, ast.Name(name), depth + 1)
        return None
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id in here.names:
        source, name = here.names[expr.value.id]  # `from sglang.srt.models import llama`; `llama.X`
        return _resolve(modules, f"{source}.{name}" if name else source, ast.Name(expr.attr), depth + 1)
    return None


def _defines(modules: dict[str, _ModelModule], module: str, cls: ast.ClassDef, method: str, depth: int = 0) -> bool:
    """Whether the class defines `method` or inherits it from a class of the models package."""
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == method:
            return True
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == method for t in stmt.targets):
            return True
    if depth > 20:
        return False
    for base in cls.bases:
        found = _resolve(modules, module, base)
        if found is not None and _defines(modules, *found, method, depth + 1):
            return True
    return False


@functools.cache
def weights_by_name_architectures() -> frozenset[str]:
    """The architectures (`EntryClass` class names of sglang/srt/models/*.py, as SGLang's model
    registry names them) whose class has `get_weights_by_name`; for the others SGLang's
    `/get_weights_by_name` answers 400 "Get parameter by name failed"."""
    modules = _model_modules("get_weights_by_name")
    found = set()
    for module, parsed in modules.items():
        if module.count(".") != MODELS.count("/"):  # entry modules: the package's own files only
            continue
        for entry in parsed.entries:
            resolved = _resolve(modules, module, entry)
            if resolved is not None and _defines(modules, *resolved, "get_weights_by_name"):
                found.add(resolved[1].name)
    return frozenset(found)
