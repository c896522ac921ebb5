"""Prometheus metrics of a trainer or rollout process, served on their own HTTP port.

Each worker process keeps its own registry (never the global one: tests run several servers in
one process) and serves it at `http://host:port/metrics` when started with `--metrics-port`. As
the coordinator's `/metrics`, the endpoint is read-only counts and takes no token. Device memory
is read from NVML when the process uses a GPU: what the driver sees, whatever the allocator says.
"""

from __future__ import annotations

import logging
import os
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("rlfleet.telemetry")
_SECONDS = (0.001, 0.005, 0.02, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300)


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # scrapes are not news
        pass


def serve(server, registry: CollectorRegistry, address: str, port: int) -> None:
    """Serve `registry` at http://<host of `address`>:`port`/metrics in a daemon thread, for as
    long as the gRPC `server` runs; `server.metrics_port` says where."""
    http = make_server(address.rpartition(":")[0] or "127.0.0.1", port, make_wsgi_app(registry), handler_class=_Quiet)
    threading.Thread(target=http.serve_forever, name="metrics", daemon=True).start()
    server.metrics_port = http.server_port
    server.on_stop.append(http.shutdown)


class NvmlMemory:
    """`rlfleet_device_memory_used_bytes{gpu}` for the GPUs this process has a context on, as NVML
    reports them (per process where the driver tells, else the whole GPU)."""

    def __init__(self, role: str):
        self.role = role

    def collect(self):
        family = GaugeMetricFamily("rlfleet_device_memory_used_bytes",
                                   "GPU memory this process holds, as NVML sees it", labels=["role", "gpu"])
        try:
            import pynvml
            import torch
        except ImportError:
            yield family
            return
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            yield family
            return
        try:
            pynvml.nvmlInit()
            try:
                for index in range(pynvml.nvmlDeviceGetCount()):
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                            if p.pid == os.getpid() and p.usedGpuMemory is not None]
                    if mine:
                        family.add_metric([self.role, pynvml.nvmlDeviceGetUUID(handle)], float(sum(mine)))
            finally:
                pynvml.nvmlShutdown()
        except pynvml.NVMLError as e:  # a scrape must not fail because NVML did
            log.debug("NVML: %s", e)
        yield family


class TrainerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("rlfleet_trainer_train_steps", "optimizer steps taken", registry=r)
        self.step_seconds = Histogram("rlfleet_trainer_train_step_seconds", "TrainStep wall time", buckets=_SECONDS,
                                      registry=r)
        self.tokens = Counter("rlfleet_trainer_trained_tokens", "response tokens trained on", registry=r)
        self.lifecycle = Counter("rlfleet_trainer_lifecycle", "Sleep and WakeUp calls", ["call"], registry=r)
        self.lifecycle_seconds = Histogram("rlfleet_trainer_lifecycle_seconds", "Sleep and WakeUp wall time", ["call"],
                                           buckets=_SECONDS, registry=r)
        self.sent_bytes = Counter("rlfleet_trainer_weight_bytes_sent", "weight bytes pushed or streamed", ["plane"],
                                  registry=r)
        self.push_seconds = Histogram("rlfleet_trainer_push_seconds", "PushWeights wall time", ["plane"],
                                      buckets=_SECONDS, registry=r)
        self.weights_version = Gauge("rlfleet_trainer_weights_version", "weights version the trainer holds", registry=r)
        self.device_bytes = Gauge("rlfleet_trainer_device_state_bytes",
                                  "weights, gradients and optimizer state on the device (0 asleep)", registry=r)
        self.asleep = Gauge("rlfleet_trainer_asleep", "1 while asleep", registry=r)
        r.register(NvmlMemory("trainer"))


class EngineQueue:
    """`rlfleet_rollout_rows_waiting` and `rlfleet_rollout_rows_running`: the engine's queue depth
    (rows admitted to no running batch yet, preempted ones included) and its running batch, read
    from `load()` (an engine's EngineLoad, or None) when scraped. An HPA scales the rollout pods on
    the first (autoscaling.rollouts in the chart)."""

    def __init__(self, load):
        self._load = load

    def collect(self):
        waiting = GaugeMetricFamily("rlfleet_rollout_rows_waiting",
                                    "rows waiting for a place in the engine's running batch")
        running = GaugeMetricFamily("rlfleet_rollout_rows_running", "rows in the engine's running batch")
        try:
            load = self._load()
        except Exception:  # noqa: BLE001 (a scrape never fails for it: the engine may be closing)
            load = None
        if load is not None:
            waiting.add_metric([], load.rows_waiting)
            running.add_metric([], load.rows_running)
        yield waiting
        yield running


class RolloutMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rlfleet_rollout_generate_requests", "Generate calls answered", ["outcome"], registry=r)
        self.tokens = Counter("rlfleet_rollout_generated_tokens", "completion tokens generated", registry=r)
        self.generate_seconds = Histogram("rlfleet_rollout_generate_seconds", "Generate wall time", buckets=_SECONDS,
                                          registry=r)
        self.in_flight = Gauge("rlfleet_rollout_generate_in_flight", "Generate calls running or queued", registry=r)
        self.update_bytes = Counter("rlfleet_rollout_weight_bytes_received", "weight bytes loaded", ["plane"],
                                    registry=r)
        self.update_seconds = Histogram("rlfleet_rollout_weight_update_seconds", "UpdateWeights wall time", ["plane"],
                                        buckets=_SECONDS, registry=r)
        self.updates_failed = Counter("rlfleet_rollout_weight_updates_failed", "updates that failed", registry=r)
        self.weights_version = Gauge("rlfleet_rollout_weights_version", "weights version the engine serves",
                                     registry=r)
        self.serving = Gauge("rlfleet_rollout_serving", "1 while the engine is in the generation pool", registry=r)
        r.register(NvmlMemory("rollout"))
