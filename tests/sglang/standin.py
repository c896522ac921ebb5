"""A stand-in SGLang server: SGLang 0.5.23's HTTP API over rlfleet's own engine.

Started like `python -m sglang.launch_server`:

    python -m tests.sglang.standin --model-path DIR --port P [--host H] [--api-key K] [other sglang flags]

Unknown flags (`--tp 1`, `--mem-fraction-static 0.5`, ...) are accepted and ignored. `--port 0`
picks a free port; the line `standin listening on http://HOST:PORT` on stdout says which. The engine
runs on `cuda:<--base-gpu-id>` when that flag is given and CUDA is there, else on `--device`, else
on the CPU; `--load-format dummy` starts it from SGLang's own random weights.

It answers in SGLang's shapes, but never decides what is valid: every request first passes
`contract.check_request` (the wheel's types; strict unless `--standin-lenient`), and a rejection
is answered as SGLang answers it (400 `{"error": text}` from the /generate schema check, 400
`ErrorResponse` for a request struct, 404/405 for unknown routes). Authorisation is the wheel's own
`decide_request_auth`. Weight groups are joined with the wheel's `init_custom_process_group`
(gloo, or nccl when on a GPU) and flattened buckets sized by its `FlattenedTensorBucket`.
`/update_weights_from_tensor` payloads are unpickled through SGLang's own allowlist
(`contract.deserialize_named_tensors`), and `/get_weights_by_name` answers only for the model
classes that implement it in the wheel.

Test-only routes live under `/_standin/`: `GET /_standin/requests` (every request seen:
method, path, body, status), `POST /_standin/reset` (clear that log), `POST /_standin/crash`
(the process exits at once, as a dead server would).

Simplifications, all of engine behaviour and none of the API: aborting one rid aborts the whole
/generate call it came in (the engine generates a call as one batch) and an aborted item carries no
partial output; sampling parameters the engine lacks (penalties, min_p, ...) are ignored and listed
under `ignored` in the request log; pause modes retract/in_place let running calls finish.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import torch
import torch.distributed as dist

from tests.sglang import contract

log = logging.getLogger("standin")
SAMPLING_EPS = 1e-6  # sglang: temperatures below this are greedy
ENGINE_MIN_TEMPERATURE = 1e-4
TOP_K_ALL = 1 << 30
ENGINE_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "n",
                        "sampling_seed", "ignore_eos", "skip_special_tokens"}
SAMPLING_DEFAULTS = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                     "min_new_tokens": 0, "no_stop_trim": False, "spaces_between_special_tokens": True,
                     "logit_bias": {}, "stream_interval": None, "custom_params": None}


@dataclasses.dataclass
class Reply:
    status: int
    body: Any = None  # JSON-ready value; with `text` set, a text body instead
    text: str | None = None
    empty: bool = False  # 200 with no body (SGLang's bare Response)


def error(message: str, status: int = 400) -> Reply:
    """SGLang's `_create_error_response`."""
    return Reply(status, {"error": {"message": message}})


def validation_error(message: str) -> Reply:
    """SGLang's RequestValidationError answer (a FastAPI 422 turned into 400)."""
    return Reply(400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


class Standin:
    """Server state; each public `route_*` method answers one SGLang route."""

    def __init__(self, args: argparse.Namespace):
        from services.rollout.engine import RolloutEngine, RolloutSettings

        self.args = args
        self.contract = contract.load_contract()
        self.device = torch.device(engine_device(args))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL groups and CUDA IPC handles open on this GPU
        dummy = args.load_format == "dummy"
        self.engine = RolloutEngine(RolloutSettings(model_path=args.model_path, device=str(self.device),
                                                    seed=args.random_seed, load_weights=not dummy))
        if dummy:  # SGLang's DummyModelLoader: its own random values, never the checkpoint's
            contract.initialize_dummy_weights()(self.engine.model)
        self.tokenizer = self.engine.tokenizer
        self.config = json.loads((Path(args.model_path) / "config.json").read_text())
        self.weight_version: str = args.weight_version
        self.model_lock = threading.Lock()  # generation vs weight loads: SGLang's model_update_lock
        self.state = threading.Condition()  # guards everything below
        self.paused = False
        self.inflight: dict[str, threading.Event] = {}  # rid -> its call's cancel flag
        self.waiting = 0
        self.groups: dict[str, Any] = {}
        self.session: str | None = None  # begin_weight_update's selector while a session is open
        self.released: set[str] = set()
        self.requests: list[dict] = []

    # ------------------------------------------------------------ generation

    def route_generate(self, body: dict, query: dict) -> Reply:
        started = time.perf_counter()
        if body.get("stream"):
            return error("stand-in: stream=true is not implemented")
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            return error("Either text, input_ids or input_embeds should be provided.")
        if text is not None:
            single = isinstance(text, str)
            prompts = [self.tokenizer.encode(t) for t in ([text] if single else text)]
        else:
            single = bool(input_ids) and isinstance(input_ids[0], int)
            prompts = [input_ids] if single else input_ids
        params = body.get("sampling_params") or {}
        per_item = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_item) != len(prompts):
            return error("The sampling_params list length must match the batch size.")
        n = per_item[0].get("n", 1) if per_item else 1
        if any(p.get("n", 1) != n for p in per_item):
            return error("The parallel_sample_num should be the same for all samples in sample params.")
        single = single and n == 1
        rids = self._rids(body.get("rid"), len(prompts), n, single)
        if isinstance(rids, Reply):
            return rids
        want_logprobs = body.get("return_logprob") or False
        want_logprobs = want_logprobs if isinstance(want_logprobs, list) else [want_logprobs] * len(prompts)
        ignored = sorted({k for p in per_item for k, v in p.items()
                          if k not in ENGINE_SAMPLING_KEYS and SAMPLING_DEFAULTS.get(k, object()) != v})
        self._note(ignored=ignored)

        cancel = threading.Event()
        with self.state:
            self.waiting += 1
            self.state.wait_for(lambda: not self.paused)  # SGLang holds new requests while paused
            self.waiting -= 1
            if self.released:
                return error(f"stand-in: memory is released ({', '.join(sorted(self.released))}); "
                             f"call /resume_memory_occupation first", 503)
            flat_rids = [r for prompt_rids in rids for r in prompt_rids]
            self.inflight.update((r, cancel) for r in flat_rids)
        try:
            items = self._generate(prompts, per_item, n, cancel)
        except ValueError as e:
            return error(str(e))
        finally:
            with self.state:
                for r in flat_rids:
                    self.inflight.pop(r, None)
                self.state.notify_all()
        elapsed = time.perf_counter() - started
        out = []
        for p, prompt in enumerate(prompts):  # prompt-major: p0s0, p0s1, ..., p1s0, ... (SGLang's order)
            for s in range(n):
                gen = items[p][s] if items is not None else None
                out.append(self._item(gen, rids[p][s], prompt, per_item[p], bool(want_logprobs[p]),
                                      bool(body.get("return_text_in_logprobs")), elapsed))
        return Reply(200, out[0] if single else out)

    def _rids(self, rid: Any, num_prompts: int, n: int, single: bool) -> list[list[str]] | Reply:
        """Each prompt's n request ids, named as SGLang names them (GenerateReqInput._normalize_rid;
        with n > 1 the tokenizer manager gives every sample a fresh uuid)."""
        if n > 1:
            return [[uuid.uuid4().hex for _ in range(n)] for _ in range(num_prompts)]
        if single:
            return [[rid if isinstance(rid, str) else uuid.uuid4().hex]]
        if rid is None:
            return [[uuid.uuid4().hex] for _ in range(num_prompts)]
        if isinstance(rid, str):
            return [[f"{rid}_{i}"] for i in range(num_prompts)]
        if len(rid) != num_prompts:
            return error("The specified rids length mismatch with the batch_size for batch processing.")
        return [[r] for r in rid]

    def _generate(self, prompts: list[list[int]], per_item: list[dict], n: int, cancel: threading.Event):
        """Per prompt, its n Generations (None where aborted); one engine call per distinct
        sampling_params."""
        from services.rollout.builtin.scheduler import GenerationCancelled

        groups: dict[str, list[int]] = {}
        for i, params in enumerate(per_item):
            groups.setdefault(json.dumps(params, sort_keys=True), []).append(i)
        results: list[list | None] = [None] * len(prompts)
        for indices in groups.values():
            sampling = self._sampling(per_item[indices[0]])
            with self.model_lock:
                try:
                    gens, _ = self.engine.generate([prompts[i] for i in indices], sampling, cancel.is_set)
                except GenerationCancelled:
                    for i in indices:
                        results[i] = [None] * n
                    continue
            for k, i in enumerate(indices):
                results[i] = [g for g in gens if g.prompt_index == k]
        return results

    def _sampling(self, p: dict):
        from services.rollout.types import Sampling

        temperature = p.get("temperature", 1.0)
        if temperature < SAMPLING_EPS:
            temperature = 0.0
        elif temperature < ENGINE_MIN_TEMPERATURE:
            temperature = ENGINE_MIN_TEMPERATURE
        top_k = p.get("top_k", TOP_K_ALL)
        stop = p.get("stop") or ()
        return Sampling(
            temperature=temperature, top_p=p.get("top_p", 1.0),
            top_k=0 if top_k in (-1, TOP_K_ALL) or top_k >= self.engine.model_config.vocab_size else top_k,
            max_new_tokens=p.get("max_new_tokens", 128), stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(p.get("stop_token_ids") or ()), n=p.get("n", 1), seed=p.get("sampling_seed"),
            ignore_eos=p.get("ignore_eos", False))

    def _item(self, gen, rid: str, prompt: list[int], params: dict, logprobs: bool, logprob_text: bool,
              elapsed: float) -> dict:
        meta: dict[str, Any] = {"id": rid, "prompt_tokens": len(prompt), "weight_version": self.weight_version,
                                "num_retractions": 0}
        if gen is None:
            ids, text = [], ""
            meta["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue", "status_code": None,
                                     "err_type": None}
        else:
            ids = list(gen.output_ids)
            text, meta["finish_reason"] = self._finish(gen, params)
        if logprobs:
            values = [] if gen is None else gen.logprobs
            meta["input_token_logprobs"] = []  # logprob_start_len -1: output tokens only
            meta["output_token_logprobs"] = [
                [v if math.isfinite(v) else None, t, self.tokenizer.decode([t]) if logprob_text else None]
                for v, t in zip(values, ids)]
            meta["output_token_logprobs_length"] = len(ids)
        meta.update(reasoning_tokens=0, completion_tokens=len(ids), cached_tokens=0, e2e_latency=elapsed)
        item = {"output_ids": ids, "meta_info": meta}
        return item if self.args.skip_tokenizer_init else {"text": text, **item}

    def _finish(self, gen, params: dict) -> tuple[str, dict]:
        """SGLang's text (the matched stop trimmed off) and finish_reason for one Generation."""
        ids = gen.output_ids
        if gen.finish_reason == "length":
            return gen.text, {"type": "length", "length": params.get("max_new_tokens", 128)}
        stop_ids = set(params.get("stop_token_ids") or ())
        if not params.get("ignore_eos") and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        if ids and ids[-1] in stop_ids:
            return self.tokenizer.decode(ids[:-1]), {"type": "stop", "matched": ids[-1]}
        stops = params.get("stop") or ()
        stops = [stops] if isinstance(stops, str) else stops
        found = sorted((gen.text.find(s), s) for s in stops if s in gen.text)
        if found:
            pos, matched = found[0]
            return gen.text[:pos], {"type": "stop", "matched": matched}
        return gen.text, {"type": "stop", "matched": None}

    def route_abort_request(self, body: dict, query: dict) -> Reply:
        with self.state:
            for rid, cancel in self.inflight.items():
                if body.get("abort_all") or rid == body.get("rid"):
                    cancel.set()
        return Reply(200, empty=True)

    def route_pause_generation(self, body: dict, query: dict) -> Reply:
        with self.state:
            self.paused = True
            if body.get("mode", "abort") == "abort":
                for cancel in self.inflight.values():
                    cancel.set()
                self.state.wait_for(lambda: not self.inflight)
        return Reply(200, {"message": "Generation paused successfully.", "status": "ok"})

    def route_continue_generation(self, body: dict, query: dict) -> Reply:
        with self.state:
            self.paused = False
            self.state.notify_all()
        return Reply(200, {"message": "Generation continued successfully.", "status": "ok"})

    def route_flush_cache(self, body: Any, query: dict) -> Reply:
        with self.state:
            busy = bool(self.inflight) or self.waiting > 0
        if busy:
            return Reply(400, text="Flush cache failed.\n")
        return Reply(200, text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                               "or waiting requests, the operation will not be performed.)\n")

    def route_health(self, body: Any, query: dict) -> Reply:
        return Reply(200, empty=True)

    route_health_generate = route_health

    # ------------------------------------------------------------ weights

    def route_init_weights_update_group(self, body: dict, query: dict) -> Reply:
        backend = body.get("backend", "nccl")
        if backend != "gloo" and not (backend == "nccl" and self.device.type == "cuda"):
            return Reply(400, {"success": False, "message": f"Failed to initialize custom process group: the stand-in "
                                                            f"runs on {self.device}, so backend {backend!r} cannot "
                                                            f"work; use gloo."})
        host, port = body["master_address"], body["master_port"]
        init_method = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        name = body.get("group_name", "weight_update_group")
        try:
            group = contract.init_custom_process_group()(
                backend=backend, init_method=init_method, world_size=body["world_size"], rank=body["rank_offset"],
                group_name=name, timeout=datetime.timedelta(seconds=self.args.standin_dist_timeout))
        except Exception as e:  # noqa: BLE001 (SGLang answers every failure the same way)
            return Reply(400, {"success": False, "message": f"Failed to initialize custom process group: {e}."})
        with self.state:
            self.groups[name] = group
        return Reply(200, {"success": True, "message": "Succeeded to initialize custom process group."})

    def route_destroy_weights_update_group(self, body: dict, query: dict) -> Reply:
        with self.state:
            group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return Reply(400, {"success": False, "message": "The group to be destroyed does not exist."})
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001
            return Reply(400, {"success": False, "message": f"Failed to destroy custom process group: {e}."})
        return Reply(200, {"success": True, "message": "Succeeded to destroy custom process group."})

    def route_begin_weight_update(self, body: dict, query: dict) -> Reply:
        with self.state:
            if self.session is not None:
                return Reply(400, {"success": False, "message": "a weight-update session is already open; "
                                                                "call end_weight_update() first"})
            self.session = body.get("selector", "all")
        return Reply(200, {"success": True, "message": "Success"})

    def route_end_weight_update(self, body: dict, query: dict) -> Reply:
        with self.state:
            if self.session is None:
                return Reply(400, {"success": False, "message": "no weight-update session is open; call "
                                                                "begin_weight_update() first"})
            self.session = None
        return Reply(200, {"success": True, "message": "Success"})

    def route_update_weights_from_distributed(self, body: dict, query: dict) -> Reply:
        """As SGLang 0.5.23: refused outside a begin/end_weight_update session (before receiving
        anything); flattened_bucket receives ONE uint8 broadcast of the tensors' bytes back to
        back in `names` order; the default format one broadcast per tensor, in order."""
        if self.session is None:
            return Reply(400, {"success": False, "message": "update_weights_from_distributed must run between "
                                                            "begin_weight_update() and end_weight_update()"})
        if body.get("abort_all_requests"):
            self.route_abort_request({"abort_all": True}, {})
        name = body.get("group_name", "weight_update_group")
        with self.model_lock:
            try:
                group = self.groups.get(name)
                assert group is not None, (f"Group {name} not in {list(self.groups)}. Please call "
                                           f"`init_weights_update_group` first.")
                weights = self._receive(body, group)
            except Exception as e:  # noqa: BLE001
                return Reply(400, {"success": False, "message": f"Failed to receive weights: {e}"})
            try:
                self._load(weights)
            except (KeyError, ValueError) as e:
                return Reply(400, {"success": False, "message": f"Failed to update parameter online: {e}. The full "
                                   "weights of the ModelRunner are partially updated. Please discard the whole weights."})
        message = "Succeeded to update parameter online."
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
            message += f" Weight version updated to {body['weight_version']}."
        return Reply(200, {"success": True, "message": message})

    def _receive(self, body: dict, group) -> list[tuple[str, torch.Tensor]]:
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        device = self.device if dist.get_backend(group) == "nccl" else "cpu"
        if body.get("load_format") == "flattened_bucket":
            bucket = contract.flattened_tensor_bucket().empty(names, dtypes, shapes, device)
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            return bucket.reconstruct_tensors()
        weights = [(n, torch.empty(s, dtype=getattr(torch, d), device=device))
                   for n, d, s in zip(names, dtypes, shapes)]
        works = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in weights]
        for work in works:
            work.wait()
        return weights

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the engine's model (converting dtype, as a model's
        load_weights does), after checking all of them: nothing is written if one does not fit.
        The caller holds model_lock, so no generation sees a half-updated model."""
        targets = self.engine.model.state_dict(keep_vars=True)  # tied names alias one tensor
        tied = self.config.get("tie_word_embeddings", False)
        plan = []
        for name, tensor in weights:
            if name == "lm_head.weight" and tied and name not in targets:
                continue  # sglang's loaders skip it too: the embedding is the head
            if name not in targets:
                raise KeyError(name)
            if tuple(targets[name].shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {list(tensor.shape)}, the model holds {list(targets[name].shape)}")
            plan.append((targets[name], tensor))
        with torch.no_grad():
            for target, tensor in plan:
                target.copy_(tensor)

    def route_update_weights_from_tensor(self, body: dict, query: dict) -> Reply:
        """As SGLang 0.5.23: refused outside a begin/end_weight_update session; the payload for TP
        rank 0 unpickled as SGLang does (its allowlist; a CUDA tensor's device may be a GPU UUID),
        then loaded under the model lock. Real SGLang raises inside its scheduler on a bad payload
        or format (and the server dies); the stand-in answers that error as a failed update."""
        if self.session is None:
            return Reply(400, {"success": False, "message": "update_weights_from_tensor must run between "
                                                            "begin_weight_update() and end_weight_update()"})
        if body.get("abort_all_requests"):
            self.route_abort_request({"abort_all": True}, {})
        with self.model_lock:
            try:
                self._load_serialized(body["serialized_named_tensors"][0], body.get("load_format"))
            except Exception as e:  # noqa: BLE001 (every failure is the update's)
                self._note(error=f"{type(e).__name__}: {e}")
                return Reply(400, {"success": False, "message": str(e)})
            finally:
                if self.device.type == "cuda":  # the producer may reuse its memory once ours is gone
                    torch.cuda.ipc_collect()
        message = "Success"
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
            message += f" Weight version updated to {body['weight_version']}."
        return Reply(200, {"success": True, "message": message})

    def _load_serialized(self, payload: str, load_format: str | None) -> None:
        """SGLang's `update_weights_from_tensor` for one payload. Every received tensor is local
        here, so none outlives the call (CUDA IPC memory is released when the last view goes)."""
        received, named = contract.deserialize_named_tensors(payload)
        self._note(globals=named)
        if load_format == "flattened_bucket":  # _update_weights_from_flattened_bucket
            module = contract.tensor_bucket_module()
            metadata = [module.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                                       end_idx=m.end_idx, numel=m.numel) for m in received["metadata"]]
            bucket = module.FlattenedTensorBucket(flattened_tensor=received["flattened_tensor"], metadata=metadata)
            self._load(bucket.reconstruct_tensors())
            return
        weights = [(name, tensor) for name, tensor in received]  # SGLang unpacks the pairs before the format
        if load_format is None:
            self._load(weights)
        elif load_format == "direct":
            raise NotImplementedError("stand-in: load_format='direct' takes SGLang's fused parameter names, "
                                      "which the stand-in's model does not have")
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")

    def route_update_weight_version(self, body: dict, query: dict) -> Reply:
        if body.get("abort_all_requests", True):
            self.route_abort_request({"abort_all": True}, {})
        self.weight_version = body["new_version"]
        return Reply(200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                           "new_version": body["new_version"]})

    def route_get_weights_by_name(self, body: dict, query: dict) -> Reply:
        """As SGLang 0.5.23: only model classes with `get_weights_by_name` answer (Llama's: the
        first `truncate_size` rows in float32, a tied lm_head read as the embedding); for the
        others, and for an unknown name, the call fails."""
        architecture = (self.config.get("architectures") or [None])[0]
        if architecture not in contract.weights_by_name_architectures():
            return error("Get parameter by name failed")
        params = self.engine.model.state_dict(keep_vars=True)
        name = body["name"]
        if name == "lm_head.weight" and self.config.get("tie_word_embeddings"):
            name = "model.embed_tokens.weight"
        if name not in params:
            return error("Get parameter by name failed")
        with self.model_lock:
            values = params[name].detach().cpu().to(torch.float32).numpy().tolist()
        return Reply(200, values[: body.get("truncate_size", 100)])

    def route_weights_checker(self, body: dict | None, query: dict) -> Reply:
        """action "checksum" in SGLang's shape: per-tensor sha256 (first 8 bytes, hex, its CPU
        tensor_hash) over named_parameters, per_gpu_checksum over the sorted names."""
        body = body or {}
        if body.get("action", "checksum") != "checksum":
            return Reply(400, {"success": False, "message": f"stand-in: action {body['action']!r} is not implemented"})
        skip = body.get("skip_tensor_list") or ()
        with self.model_lock:
            checksums = {n: hashlib.sha256(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
                         .digest()[:8].hex()
                         for n, p in self.engine.model.named_parameters() if not any(s in n for s in skip)}
        overall = hashlib.sha256()
        for n in sorted(checksums):
            overall.update(n.encode())
            overall.update(checksums[n].encode())
        per_gpu = overall.hexdigest()
        placement = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                     "pp_size": 1, "rank": 0, "size": 1}
        rank = {"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": [placement]}
        return Reply(200, {"success": True, "message": "Success.", "ranks": [rank],
                           "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest()})

    # ------------------------------------------------------------ memory and info

    def route_release_memory_occupation(self, body: dict, query: dict) -> Reply:
        tags = set(body.get("tags") or ("weights", "kv_cache", "cuda_graph"))
        with self.state:
            if self.inflight or (self.waiting and not self.paused):
                return error("release_memory_occupation should be called only when server is idle.")
            self.released |= tags
        if "weights" in tags and self.args.enable_memory_saver and not self.args.enable_weights_cpu_backup:
            with self.model_lock, torch.no_grad():  # the values are gone, as on a GPU without a CPU backup
                for p in self.engine.model.parameters():
                    p.zero_()
        return Reply(200, None)

    def route_resume_memory_occupation(self, body: dict, query: dict) -> Reply:
        tags = set(body.get("tags") or ("weights", "kv_cache", "cuda_graph"))
        with self.state:
            self.released -= tags
            self.state.notify_all()
        return Reply(200, None)

    def route_model_info(self, body: Any, query: dict) -> Reply:
        return Reply(200, {
            "model_path": self.args.model_path, "served_model_name": self.args.served_model_name or self.args.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.weight_version,
            "load_format": self.args.load_format,
            "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": self.config.get("model_type"), "architectures": self.config.get("architectures"),
        })

    route_get_model_info = route_model_info

    def route_server_info(self, body: Any, query: dict) -> Reply:
        """A few fields of SGLang's (which lists every ServerArgs field)."""
        return Reply(200, {"model_path": self.args.model_path, "tp_size": 1, "dp_size": 1, "version": contract.SGLANG_VERSION,
                           "skip_tokenizer_init": self.args.skip_tokenizer_init, "weight_version": self.weight_version,
                           "internal_states": [{}], "frontend": "python"})

    # ------------------------------------------------------------ plumbing

    def _note(self, **fields) -> None:
        """Add fields to the current request's log entry."""
        entry = getattr(_current, "entry", None)
        if entry is not None:
            entry.update(fields)

    def handle(self, method: str, raw_path: str, headers, raw_body: bytes) -> Reply:
        path, query = urlsplit(raw_path).path, parse_qs(urlsplit(raw_path).query)
        try:
            body = json.loads(raw_body) if raw_body.strip() else None
        except ValueError as e:
            return validation_error(f"JSON decode error: {e}")
        entry = {"method": method, "path": raw_path, "body": body}
        _current.entry = entry
        if not path.startswith("/_standin/"):
            with self.state:
                self.requests.append(entry)
        reply = self._dispatch(method, raw_path, path, query, body, headers)
        entry["status"] = reply.status
        return reply

    def _dispatch(self, method, raw_path, path, query, body, headers) -> Reply:
        if path == "/_standin/requests" and method == "GET":
            with self.state:
                return Reply(200, list(self.requests))
        if path == "/_standin/reset" and method == "POST":
            with self.state:
                self.requests.clear()
            return Reply(200, {"ok": True})
        if path == "/_standin/crash" and method == "POST":
            os._exit(17)  # as a dead server: no answer, no cleanup
        allowed, status = self.contract.authorize(method, path, headers.get("Authorization"),
                                                  api_key=self.args.api_key, admin_api_key=self.args.admin_api_key)
        if not allowed:
            return Reply(status, {"error": "Unauthorized" if status == 401 else "Forbidden"})
        try:
            self.contract.check_request(method, raw_path, body, strict=not self.args.standin_lenient)
        except contract.ContractError as e:
            if e.kind == "route":
                known = path in self.contract.routes
                return Reply(405 if known else 404, {"detail": "Method Not Allowed" if known else "Not Found"})
            if e.kind == "schema":
                return Reply(400, {"error": e.detail})
            return validation_error(str(e))
        handler = getattr(self, "route_" + path.strip("/").replace("/", "_"), None)
        if handler is None:
            return error(f"stand-in: {path} exists in sglang {contract.SGLANG_VERSION} but is not implemented here", 501)
        return handler(body if body is not None else ({} if path != "/weights_checker" else None), query)


_current = threading.local()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "Server"

    def _serve(self, method: str) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            reply = self.server.standin.handle(method, self.path, self.headers, raw)
        except Exception as e:  # noqa: BLE001 (a bug here must still answer, as uvicorn would: 500)
            log.exception("handler failed")
            reply = Reply(500, {"error": {"message": f"stand-in internal error: {e}"}})
        if reply.empty:
            data, kind = b"", None
        elif reply.text is not None:
            data, kind = reply.text.encode(), "text/plain; charset=utf-8"
        else:
            data, kind = json.dumps(reply.body).encode(), "application/json"
        self.send_response(reply.status)
        if kind:
            self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def do_PUT(self):
        self._serve("PUT")

    def do_DELETE(self):
        self._serve("DELETE")

    def log_message(self, fmt, *args):
        log.debug("%s " + fmt, self.address_string(), *args)


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, standin: Standin):
        super().__init__(address, Handler)
        self.standin = standin


def parse_args(argv: list[str]) -> argparse.Namespace:
    """SGLang's launch flags the stand-in uses; every other flag is accepted and ignored."""
    parser = argparse.ArgumentParser(prog="python -m tests.sglang.standin", allow_abbrev=False)
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--tokenizer-path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key")
    parser.add_argument("--admin-api-key")
    parser.add_argument("--served-model-name")
    parser.add_argument("--weight-version", default="default")  # sglang's default
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--base-gpu-id", type=int)
    parser.add_argument("--device")
    parser.add_argument("--load-format", default="auto")  # sglang's default
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--standin-lenient", action="store_true",
                        help="judge requests as SGLang does (ignore unknown keys) instead of strictly")
    parser.add_argument("--standin-dist-timeout", type=float, default=300.0,
                        help="seconds a weight-update group may take to form or to broadcast")
    args, ignored = parser.parse_known_args(argv)
    args.ignored_flags = ignored
    return args


def engine_device(args: argparse.Namespace) -> str:
    """Where the engine runs: SGLang's GPU (`--base-gpu-id`) when CUDA is there, else `--device`,
    else the CPU."""
    if args.base_gpu_id is not None and torch.cuda.is_available():
        return f"cuda:{args.base_gpu_id}"
    return args.device or "cpu"


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standin %(levelname)s %(message)s")
    torch.set_num_threads(1)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.ignored_flags:
        log.info("ignoring sglang flags: %s", " ".join(args.ignored_flags))
    server = Server((args.host, args.port), Standin(args))
    host, port = server.server_address[:2]
    print(f"standin listening on http://{host}:{port}", flush=True)
    print("The server is fired up and ready to roll!", flush=True)  # sglang's own ready line
    server.serve_forever()


if __name__ == "__main__":
    main()
