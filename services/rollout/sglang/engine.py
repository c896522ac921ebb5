"""`engine: sglang`: the rollout service's generation engine over an SGLang server's HTTP API.

The servicer sees the same `GenerationEngine` as for the built-in engine; this adapter
translates. Generation is `/generate` with token ids in and token ids, logprobs and SGLang's
`weight_version` out. Weights reach SGLang two ways, both loaded by SGLang itself:

- broadcast: SGLang joins the trainer's group (`/init_weights_update_group`) and receives each
  bucket packed (`load_format: flattened_bucket`, one `/update_weights_from_distributed` per
  bucket, the trainer sending the bucket's tensors back to back);
- colocated, on the trainer's GPU: one `/update_weights_from_tensor` per bucket whose payload
  points SGLang at the bucket's GPU memory by CUDA IPC handle (`services.rollout.sglang.ipc`: a
  pickle, so offered only when SGLang is reached over loopback). The memory is the trainer's
  staged copy, or, when the trainer sleeps, this service's upload of the trainer's host copy.

No generation runs while an update is in progress (the adapter's own lock, held across all of a
version's buckets), and the last bucket flushes SGLang's prefix cache and sets its weight
version, so a completion never mixes two versions. An update that fails part-way leaves SGLang
holding part of the new weights: the engine leaves the pool until a full update succeeds.

Verification: with `verify: exact`, SGLang starts from random weights (`--load-format dummy`) and
after each update every tensor is read back through `/get_weights_by_name`, packed as the
manifest lays it out, and must have the trainer's fingerprint. SGLang implements that route for
some model classes only (Llama's in 0.5.23, not Qwen2's or Qwen3's) and, with tensor parallel,
returns only rank 0's shard of most weights: exact verification is refused for those. Otherwise
(`fingerprint`) the trainer's fingerprints cover the bytes it sent, not what SGLang holds.
"""

from __future__ import annotations

import contextlib

import itertools
import logging
import os
import re
import threading
import time
import urllib.parse
from typing import Callable

import torch

from services import rpc
from services.api import weights_pb2
from services.models import load_tokenizer
from services.models.checkpoint import checkpoint_step, load_config
from services.models.decoder import DecoderLM, torch_dtype
from services.rollout.builtin.scheduler import GenerationCancelled
from services.rollout.engine import EngineStateError, EngineUnavailable
from services.rollout.sglang import ipc
from services.rollout.sglang.client import SglangClient, SglangError, SglangRefused, SglangUnavailable
from services.rollout.sglang.process import SglangProcess
from services.rollout.types import Generation, Sampling, validate_prompts
from services.weights import capabilities
from services.weights.buckets import Manifest, TensorSpec, dtype_name, pack_bucket, parse_dtype
from services.weights.errors import WeightSyncError
from services.weights.fingerprint import fingerprint
from services.weights.manifest import ManifestReader

log = logging.getLogger("rlfleet.rollout")
_rids = itertools.count()
# rlfleet's memory tags -> SGLang's: the KV cache goes with the CUDA graphs that point into it
_TAGS = {"weights": ["weights"], "kv_cache": ["kv_cache", "cuda_graph"]}


class SglangEngine:
    def __init__(self, settings):
        s = settings.sglang
        self.settings = settings
        self.device = torch.device(settings.device)
        self.model_config = load_config(settings.model_path)
        self.tokenizer = load_tokenizer(settings.model_path)
        dtype = torch_dtype(settings.dtype)
        with torch.device("meta"):
            model = DecoderLM(self.model_config)
        self._expected = {name: (dtype_name(dtype), tuple(t.shape)) for name, t in model.state_dict().items()
                          if not (name == "lm_head.weight" and self.model_config.tie_word_embeddings)}
        self._num_parameters = sum(t.numel() for t in model.parameters())
        self._manifests = ManifestReader(self._expected)
        self.checkpoint_step = checkpoint_step(settings.model_path)
        self.weight_version = self.checkpoint_step
        self.serving, self.last_error, self.released = True, "", set()
        self.holds_buffers, self.last_apply_seconds = False, 0.0
        self.keeps_staging = False  # SGLang copies every update out: no second copy stays on the device
        self._reads_back: bool | None = None  # whether SGLang answers /get_weights_by_name for this model
        self._lock = threading.RLock()  # an update holds it across all its buckets, as a memory change does
        # Generate calls run side by side (SGLang batches them); a drain waits for them to end and
        # holds new ones back (`_exclusive`).
        self._gate = threading.Condition()
        self._active = 0
        self._draining = 0
        self.process: SglangProcess | None = None
        if s.url:
            self.client = SglangClient(s.url, os.environ.get("RLFLEET_SGLANG_API_KEY") or None, s.request_timeout_s)
            if not self.client.healthy():
                raise EngineUnavailable(f"sglang.url: no healthy SGLang at {s.url} (/health_generate)")
        else:
            args = list(s.args)
            if self.device.type == "cuda" and "--base-gpu-id" not in args:  # SGLang on the engine's GPU
                args += ["--base-gpu-id", str(self.device.index or 0)]
            if not settings.load_weights and "--load-format" not in args:  # exact verification: only a sync fixes them
                args += ["--load-format", "dummy"]
            self.process = SglangProcess(model_path=settings.model_path, command=list(s.command), args=args,
                                         memory_saver=s.memory_saver, startup_timeout_s=s.startup_timeout_s,
                                         request_timeout_s=s.request_timeout_s)
            self.client = self.process.start()
            self.process.watch(self._child_exited)
        self.tp_size = _tp_size(list(s.args))
        # The colocated plane hands SGLang a pickle: only ever to a server on this host, over loopback.
        self.local = self.process is not None or rpc.is_loopback(urllib.parse.urlsplit(self.client.url).hostname or "")
        if not settings.load_weights:  # the job verifies exactly: only a sync gives SGLang the weights
            try:
                self._check_reads_back()
            except BaseException:
                self.close()
                raise
        version = str((self.client.model_info() or {}).get("weight_version", ""))
        if re.fullmatch(r"-?\d+", version):  # a server we attached to may already hold a synced version
            self.weight_version = int(version)

    # ---- what the servicer reads --------------------------------------------------------------
    @property
    def num_parameters(self) -> int:
        return self._num_parameters

    @property
    def max_positions(self) -> int:
        return self.model_config.max_position_embeddings

    receives = frozenset({"broadcast", "cuda_ipc"})  # the planes whose bytes SGLang takes itself

    @property
    def takes_cuda_ipc(self) -> bool:
        """SGLang on a GPU of this host, reached over loopback, one rank (a payload per rank would
        need a handle per rank's GPU)."""
        return self.device.type == "cuda" and self.local and self.tp_size == 1

    def capabilities(self):
        caps = capabilities.local(self.device)  # the host, and the GPU SGLang runs on (rollout device)
        del caps.planes[:]
        caps.planes.append(weights_pb2.WEIGHT_PLANE_BROADCAST)
        if self.takes_cuda_ipc:
            caps.planes.append(weights_pb2.WEIGHT_PLANE_CUDA_IPC)
        del caps.broadcast_backends[:]
        caps.broadcast_backends.append("nccl" if self.device.type == "cuda" else "gloo")
        caps.packed_broadcast, caps.broadcast_ranks = True, self.tp_size
        return caps

    def close(self) -> None:
        if self.process is not None:
            self.process.stop()

    # ---- generation ---------------------------------------------------------------------------
    update_policies = ("drain", "pause", "abort")

    def generate(self, prompts_ids: list[list[int]], sampling: Sampling,
                 cancelled: Callable[[], bool] | None = None) -> tuple[list[Generation], int]:
        """Completions, and the version the call started under. Calls run concurrently in SGLang's
        own running batch."""
        packed = validate_prompts(prompts_ids, sampling, self.model_config.vocab_size, self.max_positions)
        prompts_ids = packed.as_lists(prompts_ids)  # (JSON to the server: Python ints)
        with self._gate:
            self._gate.wait_for(lambda: not self._draining)
            if not self.serving or self.released:
                raise EngineUnavailable(self.last_error or f"memory released: {sorted(self.released)}")
            self._active += 1
            started_under = self.weight_version
        try:
            rid = f"rlfleet-{next(_rids)}"
            items = self._call_cancellable(prompts_ids, sampling, rid, cancelled)
        finally:
            with self._gate:
                self._active -= 1
                self._gate.notify_all()
        return _completions(items, prompts_ids, sampling.n, started_under)

    @contextlib.contextmanager
    def _exclusive(self, drain: bool = True):
        """The update lock, and with `drain` no Generate call running: those in flight finish,
        new ones wait."""
        with self._lock:
            if not drain:
                yield
                return
            with self._gate:
                self._draining += 1
                self._gate.wait_for(lambda: self._active == 0)
            try:
                yield
            finally:
                with self._gate:
                    self._draining -= 1
                    self._gate.notify_all()

    def _call_cancellable(self, prompts_ids, sampling: Sampling, rid: str, cancelled) -> list[dict]:
        """`/generate` in a thread, so a caller that gives up aborts the request in SGLang."""
        outcome: dict = {}

        def run() -> None:
            try:
                outcome["items"] = self.client.generate(prompts_ids, sampling_params(sampling), rid,
                                                        timeout_s=self.client.timeout_s)
            except BaseException as e:  # handed to the caller's thread
                outcome["error"] = e

        worker = threading.Thread(target=run, name="sglang-generate", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
            if worker.is_alive() and cancelled is not None and cancelled():
                self.client.abort(rid)
                worker.join(30)
                raise GenerationCancelled("Generate: the caller gave up; the request was aborted in SGLang")
        if "error" in outcome:
            e = outcome["error"]
            if isinstance(e, SglangRefused):
                raise ValueError(f"sampling: SGLang refused the request: {e.message}") from e
            if isinstance(e, SglangUnavailable):
                raise EngineUnavailable(str(e)) from e
            raise e
        return outcome["items"]

    # ---- weights ------------------------------------------------------------------------------
    def read_manifest(self, msg) -> Manifest:
        return self._manifests.read(msg)

    def apply(self, manifest: Manifest, buffers, *, read_back: bool = False, policy: str = "drain", **_) -> int:
        """Buckets already in this process's GPU memory (an offloaded trainer's host copy, uploaded
        and verified here): SGLang loads them from here by CUDA IPC."""
        if not self.takes_cuda_ipc or any(b.device.type != "cuda" for b in buffers):
            raise ValueError("source: an SGLang engine takes weights by broadcast, or by CUDA IPC on its own GPU")
        payloads = ipc.local_payloads(buffers, list(manifest.buckets))
        return self._update(manifest, self._from_tensor(payloads), read_back=read_back, policy=policy)

    def update_from_cuda_ipc(self, manifest: Manifest, handles, timeout_s: float, read_back: bool = False,
                             policy: str = "drain") -> int:
        """The trainer's staged buckets on this GPU: SGLang opens each handle and copies from it
        (this process never opens them: a handle has one consumer)."""
        if not self.takes_cuda_ipc:
            raise ValueError("source: cuda_ipc needs SGLang on this host's GPU, over loopback, with one rank")
        by_bucket = {h.bucket: h for h in handles}
        missing = [b.index for b in manifest.buckets if b.index not in by_bucket]
        if missing or len(by_bucket) != len(manifest.buckets):
            raise ValueError(f"cuda_ipc: {len(handles)} handles for {len(manifest.buckets)} buckets"
                             + (f" (none for bucket {missing[0]})" if missing else ""))
        payloads = [ipc.bucket_payload(by_bucket[b.index], b) for b in manifest.buckets]
        return self._update(manifest, self._from_tensor(payloads, timeout_s), timeout_s, read_back, policy)

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> None:
        try:
            self.client.init_weights_update_group(master_address=master_address, master_port=master_port,
                                                  rank_offset=rank_offset, world_size=world_size,
                                                  group_name=group_name, backend=backend, timeout_s=timeout_s + 30)
        except SglangError as e:
            raise WeightSyncError(f"SGLang could not join group {group_name!r}: {e}") from e

    def destroy_group(self, group_name: str) -> bool:
        try:
            self.client.destroy_weights_update_group(group_name)
            return True
        except SglangError:
            return False  # no such group, or SGLang is gone: nothing left to destroy

    def update_from_broadcast(self, manifest: Manifest, group_name: str, timeout_s: float,
                              read_back: bool = False, policy: str = "drain") -> int:
        """One `/update_weights_from_distributed` per bucket while the trainer broadcasts it."""
        def send(k: int, bucket, version: str | None) -> None:
            self.client.update_weights_from_distributed(
                names=[t.name for t in bucket.tensors], dtypes=[t.dtype for t in bucket.tensors],
                shapes=[list(t.shape) for t in bucket.tensors], group_name=group_name,
                flush_cache=version is not None, weight_version=version, timeout_s=timeout_s + 30,
            )
        return self._update(manifest, send, timeout_s, read_back, policy)

    def _from_tensor(self, payloads: list[str], timeout_s: float | None = None):
        def send(k: int, bucket, version: str | None) -> None:
            self.client.update_weights_from_tensor(
                serialized_named_tensors=[payloads[k]], flush_cache=version is not None, weight_version=version,
                timeout_s=(timeout_s or self.client.timeout_s) + 30,
            )
        return send

    def _update(self, manifest: Manifest, send, timeout_s: float | None = None, read_back: bool = False,
                policy: str = "drain") -> int:
        """Every bucket of a version, in manifest order, while no generation runs; the last one
        flushes the prefix cache and sets the weight version. With `read_back`, SGLang's weights
        are then read back and must carry the manifest's fingerprints.

        `drain`: the Generate calls in flight finish first and new ones wait. `pause`: SGLang's
        `/pause_generation {mode: retract}` puts running requests back in its queue (their KV
        freed, recomputed under the new weights when they resume), and `/continue_generation`
        resumes them after the last bucket. `abort`: `{mode: abort}` ends them, with finish
        reason abort. (Not `in_place`: its kept KV makes the flush of the prefix cache fail.)"""
        if policy not in self.update_policies:
            raise ValueError(f"policy: must be one of {', '.join(self.update_policies)}, got {policy!r}")
        started = time.perf_counter()
        with self._exclusive(drain=policy == "drain"), self._paused(policy):
            if "weights" in self.released:
                raise EngineStateError("UpdateWeights: weights are released; call ResumeMemory(weights) first")
            if read_back:
                self._check_reads_back()
            last, k = len(manifest.buckets) - 1, 0
            try:
                session = self.client.begin_weight_update()  # SGLang >= 0.5.23 refuses updates outside one
                for k, bucket in enumerate(manifest.buckets):
                    send(k, bucket, str(manifest.version) if k == last else None)
                if session:
                    self.client.end_weight_update()
            except SglangError as e:
                self._close_session()
                raise WeightSyncError(f"SGLang failed to load bucket {k} of version {manifest.version}: {e}") from e
            if read_back:
                self._read_back(manifest)
            self.weight_version, self.serving, self.last_error = manifest.version, True, ""
        self.last_apply_seconds = time.perf_counter() - started
        return manifest.total_bytes

    @contextlib.contextmanager
    def _paused(self, policy: str):
        if policy == "drain":
            yield
            return
        try:
            self.client.pause_generation("retract" if policy == "pause" else "abort")
        except SglangError as e:
            raise WeightSyncError(f"SGLang could not pause generation for the update: {e}") from e
        try:
            yield
        finally:
            try:
                self.client.continue_generation()
            except SglangError as e:
                self.leave_pool(f"SGLang did not continue generation after an update: {e}")

    # ---- exact verification: what SGLang holds, read back ---------------------------------------
    def _check_reads_back(self) -> None:
        """Refuse exact verification before loading anything if SGLang cannot read weights back."""
        if self.tp_size > 1:
            raise ValueError(f"verify: exact reads weights back through SGLang's /get_weights_by_name, which with "
                             f"--tp {self.tp_size} returns only rank 0's shard of most weights (use fingerprint)")
        if self._reads_back is None:
            try:
                self.client.get_weights_by_name(next(iter(self._expected)), 1, timeout_s=60)
                self._reads_back = True
            except SglangRefused as e:
                arch = self.model_config.to_hf_dict()["architectures"][0]
                raise ValueError(f"verify: exact reads weights back through SGLang's /get_weights_by_name, which "
                                 f"SGLang does not answer for {arch} ({e.message}); SGLang 0.5.23 implements it for "
                                 "Llama-family models only (use fingerprint)") from e
            except SglangError as e:
                raise EngineUnavailable(f"SGLang did not answer /get_weights_by_name: {e}") from e

    def _read_back(self, manifest: Manifest) -> None:
        for spec in manifest.buckets:
            tensors = {t.name: self._read_tensor(t) for t in spec.tensors}
            actual = fingerprint(pack_bucket(spec, tensors), manifest.fingerprint_algo)
            if actual != spec.fingerprint:
                self.leave_pool(f"bucket {spec.index} of version {manifest.version} reads back from SGLang as "
                                f"{actual}, expected {spec.fingerprint}")
                raise WeightSyncError(f"weights did not verify after loading: {self.last_error}")

    def _read_tensor(self, t: TensorSpec) -> torch.Tensor:
        """One weight as SGLang holds it: its float32 values give back the exact bf16/fp16/fp32 bits."""
        try:
            values = self.client.get_weights_by_name(t.name, t.shape[0] if t.shape else 1, timeout_s=None)
        except SglangError as e:
            self.leave_pool(f"SGLang could not read back {t.name}: {e}")
            raise WeightSyncError(self.last_error) from e
        tensor = torch.tensor(values, dtype=torch.float32)
        if tuple(tensor.shape) != tuple(t.shape):
            self.leave_pool(f"SGLang reads {t.name} back as shape {list(tensor.shape)}, the manifest says {list(t.shape)}")
            raise WeightSyncError(self.last_error)
        return tensor.to(parse_dtype(t.dtype))

    def _close_session(self) -> None:
        """After a failed update: SGLang refuses to open a second session over an open one."""
        try:
            self.client.end_weight_update()
        except SglangError:
            pass  # none was open, or an SGLang older than 0.5.23

    def leave_pool(self, reason: str) -> None:
        self.serving, self.last_error = False, reason

    def release_memory(self, tags: list[str]) -> None:
        wanted = [t for t in tags if t not in self.released]
        if wanted:
            self._memory(wanted, self.client.release_memory)
            self.released |= set(wanted)

    def resume_memory(self, tags: list[str]) -> None:
        wanted = [t for t in tags if t in self.released]
        if wanted:
            self._memory(wanted, self.client.resume_memory)
            self.released -= set(wanted)

    def _memory(self, tags: list[str], call) -> None:
        bad = [t for t in tags if t not in _TAGS]
        if bad:
            raise ValueError(f"tags: unknown memory tag {bad[0]!r} (expected weights or kv_cache)")
        with self._exclusive():  # SGLang asserts it is idle
            try:
                call([sg for t in tags for sg in _TAGS[t]])
            except SglangError as e:
                raise EngineStateError(f"SGLang refused to change its memory ({tags}): {e}") from e

    def fingerprints(self, algo: str, bucket_bytes: int) -> list[str]:
        raise EngineStateError("GetWeightFingerprints: SGLang exposes no fingerprint of the weights it holds in "
                               "rlfleet's algorithms")

    # ---- a child that died --------------------------------------------------------------------
    def _child_exited(self, code: int) -> None:
        """Out of the pool now; a new child, then the next full weight sync, brings it back."""
        self.leave_pool(f"SGLang exited with code {code}; restarting it (it rejoins after a full weight sync)")
        log.warning("%s; log tail: %s", self.last_error, self.process.tail(5))
        with self._lock:
            self.process.restarts += 1
            try:
                self.client = self.process.start()
                self.released.clear()
                self.weight_version = self.checkpoint_step  # a fresh child holds the checkpoint again
            except Exception as e:
                self.last_error = f"SGLang exited with code {code} and could not be restarted: {e}"
                log.error(self.last_error)


def sampling_params(s: Sampling) -> dict:
    """rlfleet's sampling settings in SGLang's `sampling_params` keys (nothing SGLang would refuse)."""
    params = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "max_new_tokens": s.max_new_tokens,
        "n": s.n,
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": True,
    }
    if s.stop:
        params["stop"] = list(s.stop)
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        params["sampling_seed"] = s.seed
    return params


def _completions(items: list[dict], prompts_ids: list[list[int]], n: int,
                 started_under: int) -> tuple[list[Generation], int]:
    """SGLang's answers as prompt-major Generations, and the version the call started under.

    SGLang reports one weight version a request, the one in effect when it finished: a request
    that finished under the version it started under made every token under it; one that
    finished under a later version (an update with policy pause went by) made its tokens under
    both, and SGLang does not say which where, so its `versions` are left empty."""
    if len(items) != len(prompts_ids) * n:
        raise EngineStateError(f"SGLang answered {len(items)} completions for {len(prompts_ids)} prompts x n={n}")
    out = []
    for k, item in enumerate(items):
        prompt = _prompt_of(k, len(prompts_ids), n)
        meta = item.get("meta_info") or {}
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in ("stop", "length", "abort"):
            raise EngineStateError(f"SGLang finished completion {k} with {meta.get('finish_reason')!r}")
        version = str(meta.get("weight_version", ""))
        finished_under = int(version) if re.fullmatch(r"-?\d+", version) else started_under
        output_ids = list(item.get("output_ids") or [])
        logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        versions = ((started_under, len(output_ids)),) if finished_under == started_under and output_ids else ()
        out.append((prompt, Generation(prompt_index=prompt, prompt_ids=prompts_ids[prompt], output_ids=output_ids,
                                       text=item.get("text", ""), logprobs=logprobs, finish_reason=reason,
                                       versions=versions)))
    out.sort(key=lambda pair: pair[0])  # stable: the samples of a prompt keep SGLang's order
    return [g for _, g in out], started_under


def _prompt_of(k: int, num_prompts: int, n: int) -> int:
    """Which prompt SGLang's k-th batched answer belongs to: SGLang answers prompt-major (the n
    samples of prompt 0, then of prompt 1, ...; read from 0.5.23's tokenizer manager)."""
    return k // n


def _tp_size(args: list[str]) -> int:
    for flag in ("--tp", "--tp-size", "--tensor-parallel-size"):
        if flag in args:
            return int(args[args.index(flag) + 1])
    return 1
