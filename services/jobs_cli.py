"""`rlfleet submit | status | watch | cancel | logs | results`: the coordinator's job API from a shell.

Every command talks gRPC (`rlfleet.v1.Coordinator`) to `--coordinator host:port` (or
$RLFLEET_COORDINATOR, default 127.0.0.1:50050) with the bearer token from `--token-file` (or
$RLFLEET_TOKEN). Exit codes scripts can rely on:

  0  ok; for submit --wait, watch and results: the job succeeded (or, for results, is still going)
  1  the job failed or was cancelled (or cancel found it already finished)
  2  usage error or invalid job config (the message names the field)
  3  cannot reach the coordinator
  4  no such job
  5  missing or wrong token

Job ids go to stdout (`JOB=$(rlfleet submit job.yaml)`); progress and messages go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Iterator

EXIT_OK, EXIT_JOB_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NOT_FOUND, EXIT_UNAUTHENTICATED = 0, 1, 2, 3, 4, 5
DEFAULT_COORDINATOR = "127.0.0.1:50050"
RECONNECT_S = 10.0  # how long watch retries a dropped stream before giving up
TERMINAL = ("succeeded", "failed", "cancelled")


class CliError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def add_job_commands(sub: argparse._SubParsersAction) -> None:
    """Register the job commands on `rlfleet`'s subcommand parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--coordinator", default=os.environ.get("RLFLEET_COORDINATOR") or DEFAULT_COORDINATOR,
                        help=f"coordinator gRPC address (env RLFLEET_COORDINATOR; default {DEFAULT_COORDINATOR})")
    common.add_argument("--token-file", help="bearer token file (env RLFLEET_TOKEN)")
    common.add_argument("--timeout", type=float, default=30.0, help="seconds each call may take")

    p = sub.add_parser("submit", parents=[common], help="submit a job file to a coordinator")
    p.add_argument("job", help="job YAML file (relative paths in it are resolved against its folder)")
    p.add_argument("--request-id", default="", help="a retried submit with the same id returns the same job")
    p.add_argument("--wait", action="store_true", help="then watch it; exit 0 if it succeeds, 1 if not")
    p.add_argument("--no-progress", action="store_true", help="with --wait: plain lines instead of a progress bar")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", parents=[common], help="a table of jobs, or one job in detail")
    p.add_argument("job_id", nargs="?")
    p.add_argument("--state", choices=("pending", "running", *TERMINAL), help="only jobs in this state")
    p.add_argument("--limit", type=int, default=50, help="at most this many jobs (newest first)")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("watch", parents=[common], help="follow a job to its end with a progress bar and step table")
    p.add_argument("job_id")
    p.add_argument("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    p.set_defaults(func=cmd_watch)

    p = sub.add_parser("cancel", parents=[common], help="cancel a pending or running job")
    p.add_argument("job_id")
    p.add_argument("--wait", action="store_true", help="wait until the job has stopped")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("logs", parents=[common], help="a job's events, one line each")
    p.add_argument("job_id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new events until the job ends")
    p.add_argument("--after-seq", type=int, default=0, help="only events after this sequence number")
    p.add_argument("--kind", action="append", help="only events of this kind (repeatable): state, step, eval, ...")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("results", parents=[common], help="a job's summary and eval table")
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true", help="JSON instead of tables")
    p.set_defaults(func=cmd_results)


# ---- talking to the coordinator ------------------------------------------------------------------
class Coordinator:
    """A gRPC client of the coordinator whose failures are CliErrors carrying the exit code."""

    def __init__(self, args: argparse.Namespace):
        from services import rpc
        from services.api import coordinator_pb2, coordinator_pb2_grpc

        self.pb = coordinator_pb2
        self.address = args.coordinator
        self.timeout = args.timeout
        self._channel = rpc.open_channel(self.address, _read_token(args.token_file))
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def call(self, method: str, request):
        with self._errors():
            return getattr(self._stub, method)(request, timeout=self.timeout)

    def events(self, job_id: str, after_seq: int = 0, follow: bool = True) -> Iterator:
        """WatchJob events; a dropped stream (coordinator restarting) is resumed from the last seq."""
        import grpc

        seq, gave_up_at = after_seq, None
        while True:
            request = self.pb.WatchJobRequest(job_id=job_id, after_seq=seq, replay_only=not follow)
            try:
                with self._errors():
                    # No deadline: a watch lasts as long as the job; liveness comes from the stream itself.
                    for event in self._stub.WatchJob(request):
                        gave_up_at = None
                        seq = event.seq
                        yield event
                return
            except CliError as e:
                cause = e.__cause__
                retryable = isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.UNAVAILABLE
                if not (follow and retryable):
                    raise
                gave_up_at = gave_up_at or time.monotonic() + RECONNECT_S
                if time.monotonic() > gave_up_at:
                    raise
                _err(f"lost the event stream ({cause.details()}); reconnecting...")
                time.sleep(1.0)

    @contextlib.contextmanager
    def _errors(self):
        import grpc

        try:
            yield
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            exit_code, message = {
                grpc.StatusCode.UNAVAILABLE: (EXIT_UNREACHABLE, f"cannot reach the coordinator at {self.address}: {details}"),
                grpc.StatusCode.DEADLINE_EXCEEDED: (EXIT_UNREACHABLE, f"the coordinator at {self.address} did not answer "
                                                    f"within {self.timeout:g}s"),
                grpc.StatusCode.NOT_FOUND: (EXIT_NOT_FOUND, details),
                grpc.StatusCode.UNAUTHENTICATED: (EXIT_UNAUTHENTICATED, f"{details} (set --token-file or RLFLEET_TOKEN)"),
                grpc.StatusCode.INVALID_ARGUMENT: (EXIT_USAGE, details),
                grpc.StatusCode.ALREADY_EXISTS: (EXIT_USAGE, details),
                grpc.StatusCode.FAILED_PRECONDITION: (EXIT_JOB_FAILED, details),
            }.get(code, (EXIT_JOB_FAILED, f"{code.name}: {details}"))
            raise CliError(exit_code, message) from e


def _read_token(path: str | None) -> str | None:
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as e:
            raise CliError(EXIT_USAGE, f"--token-file: cannot read {path}: {e.strerror or e}") from e
    return os.environ.get("RLFLEET_TOKEN") or None


def _run(args: argparse.Namespace, body) -> int:
    try:
        client = Coordinator(args)
        try:
            return body(client)
        finally:
            client.close()
    except CliError as e:
        _err(str(e))
        return e.code
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:  # `rlfleet logs ID | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _err(message: str) -> None:
    print(f"rlfleet: {message}", file=sys.stderr, flush=True)


# ---- commands --------------------------------------------------------------------------------------
def cmd_submit(args: argparse.Namespace) -> int:
    path = Path(args.job)
    try:
        text = path.read_text()
    except OSError as e:
        _err(f"cannot read job file {path}: {e.strerror or e}")
        return EXIT_USAGE

    def body(c: Coordinator) -> int:
        job = c.call("CreateJob", c.pb.CreateJobRequest(
            config_yaml=text, base_dir=str(path.absolute().parent), request_id=args.request_id))
        print(job.id, flush=True)
        _err(f"job {job.id} ({job.name}) {_state(c, job.state)}; follow it with: rlfleet watch {job.id}")
        return _watch(c, job.id, args.no_progress) if args.wait else EXIT_OK

    return _run(args, body)


def cmd_status(args: argparse.Namespace) -> int:
    def body(c: Coordinator) -> int:
        if args.job_id:
            job = c.call("GetJob", c.pb.GetJobRequest(job_id=args.job_id))
            if args.json:
                print(json.dumps(_job_dict(c, job), indent=2))
            else:
                _print_job(c, job)
            return EXIT_OK
        state = c.pb.JobState.Value(f"JOB_STATE_{args.state.upper()}") if args.state else 0
        jobs, token = [], ""
        while len(jobs) < args.limit:
            page = c.call("ListJobs", c.pb.ListJobsRequest(
                page_size=min(args.limit - len(jobs), 1000), page_token=token, state=state))
            jobs += page.jobs
            token = page.next_page_token
            if not token:
                break
        if args.json:
            print(json.dumps([_job_dict(c, j) for j in jobs], indent=2))
            return EXIT_OK
        rows = [(j.id, j.name, _state(c, j.state), f"{j.step}/{j.num_steps}", _when(j.created_at),
                 _clip(j.error, 60)) for j in jobs]
        _table(("ID", "NAME", "STATE", "STEP", "CREATED", "ERROR"), rows)
        if not jobs:
            _err("no jobs" + (f" in state {args.state}" if args.state else ""))
        return EXIT_OK

    return _run(args, body)


def cmd_watch(args: argparse.Namespace) -> int:
    return _run(args, lambda c: _watch(c, args.job_id, args.no_progress))


def cmd_cancel(args: argparse.Namespace) -> int:
    def body(c: Coordinator) -> int:
        job = c.call("CancelJob", c.pb.CancelJobRequest(job_id=args.job_id))
        state = _state(c, job.state)
        if state == "cancelled":
            _err(f"job {job.id} cancelled")
        else:
            _err(f"job {job.id} is {state}; it stops at its next step" + ("" if args.wait else
                 f" (rlfleet watch {job.id} to see it end)"))
        if args.wait and state not in TERMINAL:
            for _ in c.events(job.id, after_seq=0):
                pass
            job = c.call("GetJob", c.pb.GetJobRequest(job_id=job.id))
            _err(f"job {job.id} {_state(c, job.state)}")
        return EXIT_OK

    return _run(args, body)


def cmd_logs(args: argparse.Namespace) -> int:
    def body(c: Coordinator) -> int:
        for event in c.events(args.job_id, args.after_seq, follow=args.follow):
            if args.kind and event.kind not in args.kind:
                continue
            print(_event_line(c, event), flush=True)
        return EXIT_OK

    return _run(args, body)


def cmd_results(args: argparse.Namespace) -> int:
    def body(c: Coordinator) -> int:
        job = c.call("GetJob", c.pb.GetJobRequest(job_id=args.job_id))
        metrics = c.call("GetJobMetrics", c.pb.GetJobMetricsRequest(job_id=args.job_id))
        state = _state(c, job.state)
        evals = [{"step": e.step, "dataset": e.dataset, "score": _num(e.score), "metrics": dict(e.metrics)}
                 for e in metrics.evals]
        if args.json:
            print(json.dumps({
                "job": _job_dict(c, job), "evals": evals,
                "steps": [{"step": s.step, "metrics": dict(s.metrics)} for s in metrics.steps],
                "checkpoints": [{"step": k.step, "path": k.path} for k in metrics.checkpoints],
            }, indent=2))
        else:
            _print_results(job, state, metrics, evals)
        return EXIT_JOB_FAILED if state in ("failed", "cancelled") else EXIT_OK

    return _run(args, body)


# ---- watching ----------------------------------------------------------------------------------------
def _watch(c: Coordinator, job_id: str, no_progress: bool) -> int:
    job = c.call("GetJob", c.pb.GetJobRequest(job_id=job_id))
    view = _Progress(job.name, job.num_steps, plain=no_progress or not sys.stderr.isatty())
    try:
        for event in c.events(job_id):
            view.on(c, event)
    finally:
        view.close()
    job = c.call("GetJob", c.pb.GetJobRequest(job_id=job_id))
    state = _state(c, job.state)
    summary = json.loads(job.summary_json) if job.summary_json else {}
    if state == "succeeded":
        line = f"job {job.id} succeeded"
        if summary:
            line += (f" in {summary.get('wall_s', 0):.1f}s: {summary.get('eval_dataset', 'eval')} "
                     f"{_fmt(summary.get('eval_before'))} -> {_fmt(summary.get('eval_after'))}")
        _err(line)
        return EXIT_OK
    _err(f"job {job.id} {state}" + (f": {job.error}" if job.error else ""))
    return EXIT_JOB_FAILED


class _Progress:
    """A progress bar over RL steps (on a terminal) with a step table and eval lines above it."""

    HEADER = f"{'step':>6} {'reward':>8} {'std':>7} {'solved':>7} {'len':>6} {'gen s':>6} {'train s':>7} {'sync s':>6}"

    def __init__(self, name: str, num_steps: int, plain: bool):
        from tqdm import tqdm

        self._tqdm = tqdm
        self.plain = plain
        self.bar = tqdm(total=num_steps or None, desc=name, unit="step", disable=plain, dynamic_ncols=True,
                        file=sys.stderr)
        self.header_shown = False

    def write(self, line: str) -> None:
        if self.plain:
            print(line, file=sys.stderr, flush=True)
        else:
            self._tqdm.write(line, file=sys.stderr)

    def on(self, c: Coordinator, event) -> None:
        data = json.loads(event.data_json or "{}")
        if event.kind == "state":
            state = _state(c, event.state)
            self.write(f"state: {state}" + (f" ({data['error']})" if data.get("error") else ""))
        elif event.kind == "step":
            if not self.header_shown:
                self.write(self.HEADER)
                self.header_shown = True
            self.write(f"{event.step:>6} {_fmt(data.get('reward_mean')):>8} {_fmt(data.get('reward_std')):>7} "
                       f"{_fmt(data.get('solved_groups')):>7} {_fmt(data.get('response_len_mean'), 1):>6} "
                       f"{_fmt(data.get('generate_s'), 2):>6} {_fmt(data.get('train_s'), 2):>7} "
                       f"{_fmt(data.get('sync_s'), 2):>6}")
            self.bar.set_postfix(reward=_fmt(data.get("reward_mean")), refresh=False)
            self.bar.update(max(0, event.step - self.bar.n))
        elif event.kind == "eval":
            self.write(f"eval @ step {event.step}: {data.get('dataset')} = {_fmt(data.get('score'))} "
                       f"({data.get('num_prompts', '?')} prompts)")
        elif event.kind == "log" and data.get("message"):
            self.write(data["message"])
        elif event.kind == "checkpoint":
            self.write(f"checkpoint @ step {event.step}: {data.get('path')}")
        elif event.kind == "sft" and event.step % 20 == 0:
            self.write(f"sft step {event.step}: loss {_fmt(data.get('sft_loss', data.get('loss')), 4)}")

    def close(self) -> None:
        self.bar.close()


# ---- formatting ----------------------------------------------------------------------------------------
def _state(c: Coordinator, value: int) -> str:
    return c.pb.JobState.Name(value).removeprefix("JOB_STATE_").lower()


def _job_dict(c: Coordinator, job) -> dict:
    return {
        "id": job.id, "name": job.name, "state": _state(c, job.state), "step": job.step,
        "num_steps": job.num_steps, "error": job.error, "cancel_requested": job.cancel_requested,
        "created_at": job.created_at, "updated_at": job.updated_at, "request_id": job.request_id,
        "output_dir": job.output_dir, "summary": json.loads(job.summary_json) if job.summary_json else {},
    }


def _print_job(c: Coordinator, job) -> None:
    rows = [("id", job.id), ("name", job.name), ("state", _state(c, job.state) + (" (cancel requested)"
            if job.cancel_requested else "")), ("step", f"{job.step}/{job.num_steps}"),
            ("created", _when(job.created_at)), ("updated", _when(job.updated_at)), ("output_dir", job.output_dir)]
    if job.request_id:
        rows.append(("request_id", job.request_id))
    if job.error:
        rows.append(("error", job.error))
    summary = json.loads(job.summary_json) if job.summary_json else {}
    for name, before in (summary.get("evals_before") or {}).items():
        rows.append((f"eval {name}", f"{_fmt(before)} -> {_fmt((summary.get('evals_after') or {}).get(name))}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _print_results(job, state: str, metrics, evals: list[dict]) -> None:
    summary = json.loads(job.summary_json) if job.summary_json else {}
    print(f"job {job.id} ({job.name}): {state}, step {job.step}/{job.num_steps}"
          + (f", {summary['wall_s']:.1f}s" if "wall_s" in summary else ""))
    if job.error:
        print(f"error: {job.error}")
    if metrics.steps:
        rewards = [s.metrics.get("reward_mean") for s in metrics.steps if "reward_mean" in s.metrics]
        if rewards:
            print(f"train reward: first {_fmt(rewards[0])}, last {_fmt(rewards[-1])}, best {_fmt(max(rewards))} "
                  f"over {len(rewards)} steps")
    datasets = sorted({e["dataset"] for e in evals})
    if datasets:
        by_step: dict[int, dict[str, float | None]] = {}
        for e in evals:
            by_step.setdefault(e["step"], {})[e["dataset"]] = e["score"]
        print()
        _table(("STEP", *datasets), [(str(step), *(_fmt(scores.get(d)) for d in datasets))
                                     for step, scores in sorted(by_step.items())])
    if metrics.checkpoints:
        print()
        _table(("STEP", "CHECKPOINT"), [(str(k.step), k.path) for k in metrics.checkpoints])
    if not evals and not metrics.steps:
        print("no results recorded yet")


def _event_line(c: Coordinator, event) -> str:
    data = json.loads(event.data_json or "{}")
    when = datetime.fromtimestamp(event.time).strftime("%H:%M:%S")
    text = data.get("message") if event.kind == "log" and "message" in data else json.dumps(data, separators=(",", ":"))
    return f"{event.seq:>5} {when} {event.kind:<11} {_state(c, event.state):<9} step {event.step:<5} {text}"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())


def _num(value: float) -> float | None:
    return None if value != value else value  # NaN (no score) -> null


def _fmt(value, digits: int = 3) -> str:
    if isinstance(value, int | float) and value == value:
        return f"{value:.{digits}f}"
    return "-"


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."
