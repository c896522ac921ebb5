"""`rlfleet run`: one job on this machine, with every service as its own local process.

Starts the trainers and rollout engines, then a coordinator that knows their addresses, submits
the job over gRPC, follows its event stream with a progress bar, and prints the summary. Ctrl-C
or a dead child stops everything and returns a non-zero exit code with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
import yaml
from tqdm import tqdm

from services import rpc
from services.api import coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.config import JobConfig, to_dict
from services.coordinator.rewards import python_reward_modules
from services.launcher import ChildFailed, LocalFleet

EXIT_OK, EXIT_FAILED, EXIT_CHILD, EXIT_INTERRUPTED = 0, 1, 3, 130


def _watch(stub, job_id: str, events: queue.Queue) -> None:
    try:
        for event in stub.WatchJob(coordinator_pb2.WatchJobRequest(job_id=job_id)):
            events.put(event)
    except grpc.RpcError as e:
        events.put(e)
    events.put(None)


class Progress:
    """Renders job events: a progress bar over RL steps, eval scores as lines above it."""

    def __init__(self, job: JobConfig, plain: bool):
        self.plain = plain or not sys.stderr.isatty()
        self.bar = tqdm(total=job.num_rollout, desc=job.name, unit="step", disable=self.plain, dynamic_ncols=True)
        self.postfix: dict[str, str] = {}

    def write(self, line: str) -> None:
        if self.plain:
            print(line, flush=True)
        else:
            tqdm.write(line)

    def on(self, event: coordinator_pb2.JobEvent) -> None:  # noqa: C901 (one branch per event kind)
        data = json.loads(event.data_json or "{}")
        if event.kind == "step":
            self.postfix["reward"] = f"{data['reward_mean']:.3f}"
            if "value_loss" in data:  # PPO: how well the critic follows the returns
                self.postfix["vloss"] = f"{data['value_loss']:.4f}"
                self.postfix["ev"] = f"{data['explained_variance']:.2f}" if "explained_variance" in data else "n/a"
            if "tool_call_frac" in data:  # an agent job: how many episodes called a tool
                self.postfix["tool"] = f"{data['tool_call_frac']:.2f}"
            if self.plain:
                self.write(
                    f"step {event.step}/{self.bar.total}: reward {data['reward_mean']:.3f} "
                    f"len {data['response_len_mean']:.1f}{_tools(data)}{_critic(data)} ({_timings(data)})"
                )
            self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update(event.step - self.bar.n)
        elif event.kind == "eval":
            self.postfix[data["dataset"]] = f"{data['score']:.3f}"
            self.write(f"eval @ step {event.step}: {data['dataset']} = {data['score']:.3f} ({data['num_prompts']} prompts"
                       f"{_tools(data, ', ')})")
        elif event.kind == "sft" and event.step % 20 == 0:
            self.write(f"sft step {event.step}: loss {data.get('loss', float('nan')):.4f}")
        elif event.kind == "log":
            self.write(data.get("message", ""))

    def close(self) -> None:
        self.bar.close()


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a `kill`, a CI timeout, a container stop): handled as Ctrl-C is."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def run_local(job: JobConfig, job_path: Path, args: argparse.Namespace) -> int:
    started = time.time()
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # stop the services, never orphan them
    # Python leaves SIGINT ignored when it started ignored (a shell's background job, nohup scripts):
    # a `kill -INT` from whoever runs us must still stop the services.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _run_local(job, job_path, args, started)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _run_local(job: JobConfig, job_path: Path, args: argparse.Namespace, started: float) -> int:
    output_dir = Path(args.output_dir or job.output_dir or Path("runs") / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    output_dir = output_dir.resolve()
    config = to_dict(job)
    config["output_dir"] = str(output_dir)
    fleet = LocalFleet(output_dir / "logs")
    progress = None
    print(f"rlfleet: job {job.name!r} -> {output_dir}", flush=True)
    try:
        # An eval-only job evaluates a Hugging Face folder: the engines load it, no trainer runs.
        num_trainers = 0 if job.eval_only else job.trainer.num_trainers
        # The trainers may write checkpoints where this job says, and nowhere else.
        checkpoints = Path(job.checkpoint.dir or output_dir / "checkpoints").resolve()
        trainers = [fleet.start("trainer", f"trainer-{i}", ["--checkpoint-root", str(checkpoints)])
                    for i in range(num_trainers)]
        # PPO's value model: trainer servers the coordinator configures as critics (never for eval-only).
        critics = [fleet.start("trainer", f"critic-{i}", ["--checkpoint-root", str(checkpoints)])
                   for i in range(job.num_critics)]
        engines = [fleet.start("rollout", f"rollout-{i}", []) for i in range(job.rollout.num_engines)]
        fleet.wait_ready()
        # This job is the user's own, on their machine: its python rewards may import what it names.
        allowed = [a for m in python_reward_modules(job.rewards) for a in ("--allow-reward-module", m)]
        fleet.start(
            "coordinator", "coordinator",
            ["--trainers", ",".join(c.address for c in trainers), "--rollouts", ",".join(c.address for c in engines),
             *(["--critics", ",".join(c.address for c in critics)] if critics else []),
             "--runs-dir", str(output_dir.parent), "--db", "memory", *allowed],  # it lives as long as the run
        )
        fleet.wait_ready()
        coordinator = fleet.children[-1]
        print(
            f"rlfleet: {len(trainers)} trainer(s), {len(engines)} engine(s), "
            f"{f'{len(critics)} critic(s), ' if critics else ''}coordinator at {coordinator.address}; "
            f"logs in {output_dir / 'logs'}",
            flush=True,
        )
        with contextlib.closing(rpc.open_channel(coordinator.address)) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            created = stub.CreateJob(
                coordinator_pb2.CreateJobRequest(
                    config_yaml=yaml.safe_dump(config, sort_keys=False), base_dir=str(job_path.parent.resolve())
                ),
                timeout=60,
            )
            events: queue.Queue = queue.Queue()
            threading.Thread(target=_watch, args=(stub, created.id, events), daemon=True).start()
            progress = Progress(job, args.no_progress)
            while True:
                fleet.check()
                try:
                    event = events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if event is None:
                    break
                if isinstance(event, grpc.RpcError):
                    time.sleep(1.0)
                    fleet.check()
                    raise ChildFailed(f"lost the coordinator's event stream: {event.details()}")
                progress.on(event)
            progress.close()
            final = stub.GetJob(coordinator_pb2.GetJobRequest(job_id=created.id), timeout=30)
        if final.state != coordinator_pb2.JOB_STATE_SUCCEEDED:
            fleet.check(grace_s=2.0)  # a dead worker is the better explanation of a failed job
            print(f"rlfleet: job {final.id} {coordinator_pb2.JobState.Name(final.state)}: {final.error}", file=sys.stderr)
            return EXIT_FAILED
        summary = json.loads(final.summary_json)
        summary["wall_s"] = time.time() - started
        _print_summary(summary)
        if args.summary:
            Path(args.summary).write_text(json.dumps(summary, indent=2))
        return EXIT_OK
    except KeyboardInterrupt as e:
        how = "terminated (SIGTERM)" if isinstance(e, _Terminated) else "interrupted"
        print(f"\nrlfleet: {how}; stopping services", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ChildFailed as e:
        print(f"\nrlfleet: a service process failed, stopping the others:\n{e}", file=sys.stderr)
        return EXIT_CHILD
    finally:
        if progress is not None:
            progress.close()
        fleet.stop()


def _print_summary(summary: dict) -> None:
    if summary.get("eval_only"):
        print(f"\n== eval-only: {summary['checkpoint']} (step {summary['checkpoint_step']}) ==")
        print(f"{'dataset':<16}{'score':>8}")
        for name, score in summary["evals_after"].items():
            print(f"{name:<16}{score:>8.3f}")
        print(f"wall time {summary['wall_s']:.1f}s; results in {summary['output_dir']}/summary.json")
        return
    print("\n== summary ==")
    print(f"job            {summary['name']}")
    print(f"steps          {summary['steps']}")
    for name, before in summary["evals_before"].items():
        after = summary["evals_after"][name]
        print(f"eval {name:<10}{before:.3f} -> {after:.3f} ({after - before:+.3f})")
    print(f"wall time      {summary['wall_s']:.1f}s")
    print(f"outputs        {summary['output_dir']}")
    print(f"reward curve   {summary['plot']}")


def _tools(data: dict, sep: str = " ") -> str:
    """An agent job's tool use: " tool 0.41" (the fraction of episodes that called a tool)."""
    return f"{sep}tool {data['tool_call_frac']:.2f}" if "tool_call_frac" in data else ""


def _critic(step: dict) -> str:
    """PPO's critic, when the step had one: ", value loss 0.0123 ev 0.41" (ev: explained variance)."""
    if "value_loss" not in step:
        return ""
    ev = step.get("explained_variance")
    return f", value loss {step['value_loss']:.4f} ev {'n/a' if ev is None else f'{ev:.2f}'}"


def _timings(step: dict) -> str:
    """Where a step's time went: "0.31s: generate 0.12, train 0.15 (wake 0.01, sleep 0.02), sync 0.04"."""
    inside = [(name, step[key]) for name, key in (("critic", "critic_s"), ("wake", "train/wake_s"), ("sleep", "sleep_s"))
              if key in step]
    train = f"train {step['train_s']:.2f}" + (f" ({', '.join(f'{n} {s:.2f}' for n, s in inside)})" if inside else "")
    total = step["generate_s"] + step["train_s"] + step["sync_s"]
    return f"{total:.2f}s: generate {step['generate_s']:.2f}, {train}, sync {step['sync_s']:.2f}"
