"""Kubernetes pod discovery: the ready trainer and rollout pods of one release, kept current.

This is the only module that imports `kubernetes`. It lists the pods labelled
`app.kubernetes.io/name=rlfleet, app.kubernetes.io/instance=<release>` with component trainer or
rollout in one namespace, then follows them with a watch in a background thread. A pod counts as
ready when its Ready condition is True, it is not terminating and it has a pod IP; only ready pods
are handed out (as `podIP:port`, ordered by StatefulSet ordinal), so a pod whose readiness probe
fails stops receiving new jobs. Every reconnect starts with a full re-list, which also catches
deletions a dropped watch missed; a failed list or watch is retried with capped exponential
backoff. Kubernetes API and transport errors surface as `DiscoveryError`, chained to the cause.
The coordinator needs get/list/watch on pods in its namespace (the chart's Role) and nothing more.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from services import rpc
from services.coordinator.discovery import DiscoveryError, ReadySet, ReadySetDiscovery, rank_key

log = rpc.get_logger("coordinator.k8s")

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
ROLES = ("trainer", "rollout", "critic")  # critic: a trainer server that PPO jobs use as their value model
# A pod running a trainer and a rollout engine side by side (one GPU, shared /dev/shm and IPC): it
# is a trainer at `port` and an engine at `colocated_rollout_port`.
COLOCATED = "colocated"
REVISION_LABEL = "rlfleet.dev/revision"
_SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True, kw_only=True)
class KubernetesDiscoveryConfig:
    """Where to look for workers and how patiently.

    Attributes:
        namespace: namespace of the worker pods (the coordinator's own, in the chart).
        instance: value of the app.kubernetes.io/instance label (the Helm release name).
        port: gRPC port of the trainer and rollout containers.
        colocated_rollout_port: gRPC port of the engine in a colocated pod (its trainer is at `port`).
        revision: only pods labelled rlfleet.dev/revision=<this> (an eval release's own workers,
            never the previous revision's still shutting down); empty = any.
        watch_timeout_s: the API server ends each watch after this long; the watcher then re-lists.
        request_timeout_s: connect timeout, and read timeout of a list.
        read_grace_s: a watch with no bytes for watch_timeout_s + this is taken as dead.
        backoff_s: first and largest pause between retries after a failed list or watch.
    """

    namespace: str
    instance: str
    port: int = 50051
    colocated_rollout_port: int = 50052
    revision: str = ""
    watch_timeout_s: float = 240.0
    request_timeout_s: float = 30.0
    read_grace_s: float = 15.0
    backoff_s: tuple[float, float] = (0.5, 30.0)

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("namespace: must not be empty")
        if not self.instance:
            raise ValueError("instance: must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"port: must be in 1..65535, got {self.port}")

    @property
    def label_selector(self) -> str:
        roles = ",".join(sorted((*ROLES, COLOCATED)))
        selector = f"{NAME_LABEL}=rlfleet,{INSTANCE_LABEL}={self.instance},{COMPONENT_LABEL} in ({roles})"
        return selector + (f",{REVISION_LABEL}={self.revision}" if self.revision else "")


def pod_address(pod: dict[str, Any], port: int) -> str | None:
    """`podIP:port` of a pod that may take work, else None (unready, terminating or without an IP)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
    if not ip or not ready:
        return None
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def default_namespace() -> str:
    """The pod's own namespace when running in a cluster, else "default"."""
    try:
        return _SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def load_api() -> client.CoreV1Api:
    """A CoreV1Api from the in-cluster service account, else from the local kubeconfig."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except ConfigException as in_cluster:
        try:
            config.load_kube_config(client_configuration=configuration)
        except (ConfigException, OSError) as e:
            raise DiscoveryError(
                f"no Kubernetes credentials: not in a pod ({in_cluster}) and no usable kubeconfig ({e})"
            ) from e
    return client.CoreV1Api(client.ApiClient(configuration))


class _Expired(Exception):
    """The API server no longer has the watch's resourceVersion (410 Gone)."""


def _lines(response) -> Iterator[bytes]:
    """The non-empty lines of a streamed watch response (one JSON event each)."""
    pending = b""
    for chunk in response.stream(amt=None, decode_content=False):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from (line for line in lines if line.strip())


def _shutdown(response) -> None:
    if response is None:
        return
    sock = getattr(getattr(response, "connection", None), "sock", None)
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)


class KubernetesDiscovery(ReadySetDiscovery):
    """Ready trainer and rollout pods of one release; call start() before use, close() after."""

    def __init__(self, cfg: KubernetesDiscoveryConfig, api: client.CoreV1Api | None = None) -> None:
        self.cfg = cfg
        self._api = api
        self._ready = ReadySet()
        self._pods: dict[str, dict[str, Any]] = {}
        self._resource_version = ""  # of the last list: the watch resumes there, so nothing falls between
        self._lock = threading.Lock()
        self._publishing = threading.Lock()  # snapshot and publish as one step, so no stale set lands last
        self._stop = threading.Event()
        self._response: Any = None  # the open watch response (urllib3), for close() to cut
        self._thread: threading.Thread | None = None
        self.last_error: DiscoveryError | None = None

    def __repr__(self) -> str:
        return f"pods of instance {self.cfg.instance!r} in namespace {self.cfg.namespace!r}"

    # ---- the Discovery protocol (reads come from ReadySetDiscovery) ----------------------------
    def resync(self) -> None:
        """List the pods now and replace what is known; raises DiscoveryError."""
        with self._api_errors("listing"):
            reply = self._core().list_namespaced_pod(
                self.cfg.namespace,
                label_selector=self.cfg.label_selector,
                _preload_content=False,
                _request_timeout=self.cfg.request_timeout_s,
            )
            listing = json.loads(reply.data)
        with self._lock:
            self._pods = {p["metadata"]["name"]: p for p in listing.get("items") or []}
            self._resource_version = (listing.get("metadata") or {}).get("resourceVersion") or ""
        self._publish()

    def start(self) -> KubernetesDiscovery:
        """Make the first list (its failure raises DiscoveryError), then watch in the background."""
        self.resync()
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)
        self._thread.start()
        log.info("watching %s: trainers %s, rollouts %s", self, self.trainers(), self.rollouts())
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            # Shut the watch's socket so a blocked read returns now; repeated because a watch
            # whose response has not arrived yet has no socket to shut.
            _shutdown(self._response)
            self._thread.join(timeout=0.05)

    # ---- the watcher -----------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = self.cfg.backoff_s[0]
        relist = False  # start() has just listed
        while not self._stop.is_set():
            try:
                if relist:
                    self.resync()
                relist = True  # a reconnect must not trust what it knew: deletions may have been missed
                self._follow()
                backoff = self.cfg.backoff_s[0]
                self.last_error = None
            except DiscoveryError as e:
                if self._stop.is_set():
                    return
                self.last_error = e
                log.warning("%s; retrying in %.1f s", e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.cfg.backoff_s[1])

    def _follow(self) -> None:
        """One watch, until the server ends it, it goes quiet too long, or close() is called."""
        with self._lock:
            since = {"resource_version": self._resource_version} if self._resource_version else {}
        try:
            with self._api_errors("watching"):
                response = self._core().list_namespaced_pod(
                    self.cfg.namespace,
                    label_selector=self.cfg.label_selector,
                    watch=True,
                    allow_watch_bookmarks=True,
                    timeout_seconds=max(1, int(self.cfg.watch_timeout_s)),
                    _preload_content=False,
                    _request_timeout=(self.cfg.request_timeout_s, self.cfg.watch_timeout_s + self.cfg.read_grace_s),
                    **since,
                )
                self._response = response
                try:
                    for line in _lines(response):
                        if self._stop.is_set():
                            return
                        self._apply(json.loads(line))
                except _Expired:
                    return
                finally:
                    self._response = None
                    response.close()  # never hand a half-read connection back to the pool
                    response.release_conn()
        except DiscoveryError as e:
            if isinstance(e.__cause__, urllib3.exceptions.ReadTimeoutError) or self._stop.is_set():
                return  # a quiet watch the server did not end, or close(): reconnect (and re-list) or stop
            raise

    def _apply(self, event: dict[str, Any]) -> None:
        kind, pod = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if pod.get("code") == 410:  # our resourceVersion is too old: end this watch, re-list
                raise _Expired()
            raise DiscoveryError(f"watching {self} failed: HTTP {pod.get('code')} {pod.get('message', '')}".rstrip())
        name = (pod.get("metadata") or {}).get("name")
        if kind not in ("ADDED", "MODIFIED", "DELETED") or not name:
            return  # BOOKMARK and anything unknown carry no pod
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(name, None)
            else:
                self._pods[name] = pod
        self._publish()

    def _publish(self) -> None:
        with self._publishing:
            ready: dict[str, list[tuple[tuple, str]]] = {role: [] for role in ROLES}
            with self._lock:
                pods = list(self._pods.items())
            for name, pod in pods:
                role = ((pod.get("metadata") or {}).get("labels") or {}).get(COMPONENT_LABEL)
                address = pod_address(pod, self.cfg.port)
                if address is None:
                    continue
                if role in ready:
                    ready[role].append((rank_key(name), address))
                elif role == COLOCATED:  # both: the trainer at `port`, the engine beside it
                    ready["trainer"].append((rank_key(name), address))
                    ready["rollout"].append((rank_key(name), pod_address(pod, self.cfg.colocated_rollout_port)))
            trainers = [a for _, a in sorted(ready["trainer"])]
            rollouts = [a for _, a in sorted(ready["rollout"])]
            critics = [a for _, a in sorted(ready["critic"])]
            if self._ready.replace(trainers, rollouts, critics):
                log.info("ready workers of %s: trainers %s, rollouts %s%s", self, trainers, rollouts,
                         f", critics {critics}" if critics else "")

    # ---- plumbing --------------------------------------------------------------------------------
    def _core(self) -> client.CoreV1Api:
        if self._api is None:
            self._api = load_api()
        return self._api

    @contextlib.contextmanager
    def _api_errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except ApiException as e:
            hint = " (the coordinator's service account needs get/list/watch on pods)" if e.status in (401, 403) else ""
            raise DiscoveryError(
                f"{action} {self} failed: HTTP {e.status} {e.reason or ''}".rstrip() + hint
            ) from e
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as e:
            raise DiscoveryError(f"{action} {self} failed: {type(e).__name__}: {e}") from e
