"""Opt-in timelines of weight syncs: with RLFLEET_PROFILE_DIR set, each profiled step runs under
torch.profiler, leaves a Chrome trace `<dir>/<role>-<name>.json` and logs its costliest device
operations. For diagnosing where a sync's time goes (bench/sync_phases.py --profile DIR);
off, it costs nothing."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

ENV = "RLFLEET_PROFILE_DIR"
log = logging.getLogger("rlfleet.profiling")


@contextlib.contextmanager
def profiled(role: str, name: str):
    directory = os.environ.get(ENV)
    if not directory:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    path = Path(directory) / f"{role}-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    log.info("%s %s: trace in %s\n%s", role, name, path, prof.key_averages().table(sort_by=sort, row_limit=12))
