"""The `rlfleet` command: serve one service, or run a whole job on this machine.

  rlfleet serve trainer|rollout|coordinator --port N   one server, for Kubernetes pods or by hand
  rlfleet run examples/arith/job.yaml                  trainer + engines + coordinator as local
                                                       processes, the job with a progress bar,
                                                       metrics, a reward-curve PNG and a summary

Exit codes of `run`: 0 the job succeeded, 1 it failed, 2 the config is invalid, 3 a service
process died, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_CHILD, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _read_token(path: str | None, env: str = "RLFLEET_TOKEN") -> str | None:
    if path:
        return Path(path).read_text().strip() or None
    return os.environ.get(env) or None


def _write_ready(path: str | None, port: int) -> None:
    if path:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
        tmp.replace(path)


def cmd_serve(args: argparse.Namespace) -> int:
    from services import rpc

    rpc.configure_logging(args.role, args.log_level)
    log = rpc.get_logger(args.role)
    address = f"{args.host}:{args.port}"
    token = _read_token(args.token_file)
    if args.role == "trainer":
        from services.trainer.server import build_server

        server = build_server(address, token)
    elif args.role == "rollout":
        from services.rollout.server import build_server

        server = build_server(address, token)
    else:
        from services.coordinator.fleet import static_fleet
        from services.coordinator.jobs import JobManager
        from services.coordinator.server import build_server

        worker_token = _read_token(args.worker_token_file, "RLFLEET_WORKER_TOKEN")
        trainers = [a for a in (args.trainers or "").split(",") if a]
        rollouts = [a for a in (args.rollouts or "").split(",") if a]
        manager = JobManager(static_fleet(trainers, rollouts, worker_token), runs_dir=Path(args.runs_dir))
        server = build_server(manager, address, token)
    log.info("serving on %s:%d%s", args.host, server.port, " (bearer token required)" if token else "")
    _write_ready(args.ready_file, server.port)
    server.wait_for_termination_or_signal(grace_s=args.grace)
    log.info("stopped")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from services.coordinator.config import ConfigError, load_job

    try:
        job = load_job(Path(args.job))
    except (ConfigError, FileNotFoundError) as e:
        print(f"rlfleet: invalid job {args.job}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from services.runner import run_local

    return run_local(job, Path(args.job), args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet", description="RL post-training for LLMs as gRPC services")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("role", choices=["trainer", "rollout", "coordinator"])
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod)")
    serve.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    serve.add_argument("--token-file", help="require this bearer token (also: RLFLEET_TOKEN)")
    serve.add_argument("--ready-file", help="write {port, pid} here once serving")
    serve.add_argument("--grace", type=float, default=5.0, help="seconds in-flight calls get on SIGTERM")
    serve.add_argument("--log-level", default="INFO")
    serve.add_argument("--trainers", help="coordinator: comma-separated trainer addresses")
    serve.add_argument("--rollouts", help="coordinator: comma-separated rollout engine addresses")
    serve.add_argument("--worker-token-file", help="coordinator: token for trainers and engines")
    serve.add_argument("--runs-dir", default="runs", help="coordinator: where job outputs go by default")
    serve.set_defaults(func=cmd_serve)

    run = sub.add_parser("run", help="run a job on this machine with local service processes")
    run.add_argument("job", help="job YAML file")
    run.add_argument("--output-dir", help="where metrics, logs, plots and the summary go")
    run.add_argument("--summary", help="also write the summary JSON here")
    run.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
