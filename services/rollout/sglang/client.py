"""SGLang's HTTP API as plain method calls: one request body per endpoint, built from SGLang's
own field names, and SGLang's failures as typed errors carrying SGLang's message.

Only this module speaks HTTP to SGLang. Bodies follow SGLang 0.5.9 and newer (field names of
`sglang/srt/managers/io_struct.py` and `sglang/api/v1/api_types.py`); fields added later are
sent only when asked for. The contract tests check every body against the pinned wheel's types.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from typing import Any


class SglangError(RuntimeError):
    """SGLang answered with an error (its HTTP status and message are kept)."""

    def __init__(self, path: str, status: int, message: str):
        self.path, self.status, self.message = path, status, message
        super().__init__(f"SGLang {path}: HTTP {status}: {message}")


class SglangRefused(SglangError, ValueError):
    """HTTP 400: SGLang refused the request as invalid (e.g. an unknown sampling parameter)."""


class SglangUnavailable(SglangError):
    """SGLang cannot be reached, is starting (503), or did not answer in time."""


class SglangClient:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300.0):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"sglang.url: expected http://host:port, got {url!r}")
        self.url, self._parsed, self.timeout_s = url.rstrip("/"), parsed, timeout_s
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def call(self, path: str, body: dict | None = None, *, method: str = "POST", timeout_s: float | None = None) -> Any:
        """The decoded JSON answer (None for an empty body); SglangError subclasses otherwise."""
        conn_cls = http.client.HTTPSConnection if self._parsed.scheme == "https" else http.client.HTTPConnection
        conn = conn_cls(self._parsed.hostname, self._parsed.port, timeout=timeout_s or self.timeout_s)
        try:
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=payload, headers=self._headers)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException, socket.timeout) as e:
            raise SglangUnavailable(path, 0, f"{type(e).__name__}: {e}") from e
        finally:
            conn.close()
        text = raw.decode(errors="replace")
        if response.status >= 400:
            message = _message(text)
            kind = SglangRefused if response.status == 400 else SglangError
            if response.status in (502, 503, 504):
                kind = SglangUnavailable
            raise kind(path, response.status, message)
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text  # /flush_cache answers plain text

    # ---- the endpoints rlfleet uses ------------------------------------------------------------
    def healthy(self) -> bool:
        try:
            self.call("/health_generate", method="GET", timeout_s=30)
            return True
        except SglangError:
            return False

    def model_info(self) -> dict:
        return self.call("/model_info", method="GET")

    def generate(self, input_ids: list[list[int]], sampling_params: dict, rid: str, timeout_s: float) -> list[dict]:
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True, "rid": rid}
        out = self.call("/generate", body, timeout_s=timeout_s)
        return out if isinstance(out, list) else [out]

    def abort(self, rid: str) -> None:
        self.call("/abort_request", {"rid": rid, "abort_all": False}, timeout_s=30)

    def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str, timeout_s: float) -> dict:
        return self._checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        }, timeout_s)

    def destroy_weights_update_group(self, group_name: str) -> dict:
        return self._checked("/destroy_weights_update_group", {"group_name": group_name}, 60)

    def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str, flush_cache: bool, weight_version: str | None,
                                        timeout_s: float) -> dict:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "flush_cache": flush_cache, "load_format": "flattened_bucket"}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._checked("/update_weights_from_distributed", body, timeout_s)

    def update_weights_from_tensor(self, *, serialized_named_tensors: list[str], flush_cache: bool,
                                   weight_version: str | None, timeout_s: float) -> dict:
        """One flattened bucket per call, `serialized_named_tensors[r]` for tensor-parallel rank r
        (a pickle of CUDA IPC handles, base64: see `services.rollout.sglang.ipc`)."""
        body = {"serialized_named_tensors": serialized_named_tensors, "load_format": "flattened_bucket",
                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._checked("/update_weights_from_tensor", body, timeout_s)

    def get_weights_by_name(self, name: str, truncate_size: int, timeout_s: float) -> list:
        """The first `truncate_size` rows of a Hugging Face-named weight as SGLang holds it, as
        float32 values (SGLang's model classes that implement it; 400 for the others)."""
        return self.call("/get_weights_by_name", {"name": name, "truncate_size": truncate_size}, timeout_s=timeout_s)

    def begin_weight_update(self) -> bool:
        """Open an update session (SGLang 0.5.23 refuses weight updates outside one); False on an
        older SGLang, which has no such route and needs none."""
        try:
            self._checked("/begin_weight_update", {"selector": "all"}, 60)
            return True
        except SglangError as e:
            if e.status == 404:
                return False
            raise

    def end_weight_update(self) -> None:
        self._checked("/end_weight_update", {}, 60)

    def pause_generation(self, mode: str) -> None:
        """Stop SGLang's scheduler between steps: `abort` ends running requests, `retract` puts
        them back in the queue (KV freed), `in_place` keeps them and their KV. New requests wait."""
        self.call("/pause_generation", {"mode": mode}, timeout_s=60)

    def continue_generation(self) -> None:
        self.call("/continue_generation", {}, timeout_s=60)

    def release_memory(self, tags: list[str]) -> None:
        self.call("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: list[str]) -> None:
        self.call("/resume_memory_occupation", {"tags": tags})

    def flush_cache(self) -> None:
        self.call("/flush_cache", method="POST", timeout_s=60)

    def _checked(self, path: str, body: dict, timeout_s: float) -> dict:
        """A control call whose body says {success, message}: success false is an error too."""
        out = self.call(path, body, timeout_s=timeout_s)
        if isinstance(out, dict) and out.get("success") is False:
            raise SglangError(path, 200, str(out.get("message", "")))
        return out


def _message(text: str) -> str:
    """SGLang's message out of an error body ({"error": {"message"}}, {"message"}, or text)."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:2000]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:2000]
        if isinstance(error, str):  # /generate's schema check answers {"error": "<text>"}
            return error[:2000]
        if "message" in body:
            return str(body["message"])[:2000]
        if "detail" in body:
            return str(body["detail"])[:2000]
    return text.strip()[:2000]
