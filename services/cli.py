"""The `rlfleet` command: serve one service, or run a whole job on this machine.

  rlfleet serve trainer|rollout|coordinator --port N   one server, for Kubernetes pods or by hand
  rlfleet run examples/arith/job.yaml                  trainer + engines + coordinator as local
                                                       processes, the job with a progress bar,
                                                       metrics, a reward-curve PNG and a summary
  rlfleet submit | status | watch | cancel | logs | results   a running coordinator's jobs (jobs_cli.py)

Exit codes of `run`: 0 the job succeeded, 1 it failed, 2 the config is invalid, 3 a service
process died, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_CHILD, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _read_token(path: str | None, env: str = "RLFLEET_TOKEN") -> str | None:
    if path:
        return Path(path).read_text().strip() or None
    return os.environ.get(env) or None


def _write_ready(path: str | None, port: int, http_port: int | None = None) -> None:
    if path:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": port, "pid": os.getpid(), "http_port": http_port}))
        tmp.replace(path)


def cmd_serve(args: argparse.Namespace) -> int:
    from services import rpc

    rpc.configure_logging(args.role, args.log_level)
    log = rpc.get_logger(args.role)
    address = f"{args.host}:{args.port}"
    if (args.job or args.exit_on_finish) and (args.role != "coordinator" or not args.job):
        print("rlfleet: --job FILE [--exit-on-finish] is for `serve coordinator`", file=sys.stderr)
        return EXIT_CONFIG
    if args.stop_workers_on_finish and not args.exit_on_finish:
        print("rlfleet: --stop-workers-on-finish goes with --job FILE --exit-on-finish", file=sys.stderr)
        return EXIT_CONFIG
    if args.role != "rollout" and (args.front_end != "inline" or args.metrics_host or args.link_socket):
        print("rlfleet: --front-end, --metrics-host and --link-socket are for `serve rollout`", file=sys.stderr)
        return EXIT_CONFIG
    token = _read_token(args.token_file)
    try:
        tls = _tls(args)
    except ValueError as e:
        print(f"rlfleet: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if not token and not (tls is not None and tls.mutual) and not rpc.is_loopback(args.host):
        print(f"rlfleet: refusing to listen on {args.host} without authentication: give --token-file "
              "(or RLFLEET_TOKEN) or --tls-client-auth, or bind to 127.0.0.1", file=sys.stderr)
        return EXIT_CONFIG
    discovery = None  # the coordinator's, closed on the way out
    if args.role == "trainer":
        from services.trainer.server import build_server

        server = build_server(address, token, checkpoint_root=args.checkpoint_root, metrics_port=args.metrics_port,
                              rank_store_port=args.rank_store_port, weight_store_port=args.weight_store_port)
    elif args.role == "rollout" and args.front_end == "process":
        return _serve_split_rollout(args, address, token, log)
    elif args.role == "rollout":
        from services.rollout.server import RolloutServicer, build_server

        servicer = RolloutServicer()
        server = build_server(address, token, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                              servicer=servicer)
        if args.link_socket:  # the engine's process behind a front end (`--front-end process`)
            from services.rollout.link import Listener

            server.on_stop.append(Listener(args.link_socket, servicer, token).close)
    elif args.role == "environment":
        from services.environment.server import build_server

        if not args.module:
            print("rlfleet: serve environment needs --module package.module:Class", file=sys.stderr)
            return EXIT_CONFIG
        try:
            server = build_server(address, token, module=args.module)
        except ValueError as e:
            print(f"rlfleet: {e}", file=sys.stderr)
            return EXIT_CONFIG
    else:
        from services.coordinator.discovery import DiscoveryError
        from services.coordinator.serve import build_coordinator, freeze_heap

        worker_token = _read_token(args.worker_token_file, "RLFLEET_WORKER_TOKEN")
        try:
            make_fleet, discovery = _worker_fleet(args, worker_token)
        except (DiscoveryError, ValueError) as e:
            log.error("cannot discover workers: %s", e)
            return EXIT_FAILED
        from services.coordinator.store import StoreError

        try:
            server = build_coordinator(
                make_fleet, host=args.host, port=args.port, token=token, db=args.db, runs_dir=Path(args.runs_dir),
                http_port=args.http_port, max_running=args.max_running_jobs,
                allowed_reward_modules=tuple(args.allow_reward_module), trainer_restarts=args.trainer_restarts,
                trainer_wait_s=args.discovery_wait_s,
            )
        except (StoreError, ValueError) as e:  # ValueError: a coordinator setting out of range, named
            print(f"rlfleet: {e}", file=sys.stderr)
            return EXIT_CONFIG
        manager = server.manager
        freeze_heap()
    log.info("serving on %s:%d%s", args.host, server.port, " (bearer token required)" if token else "")
    _write_ready(args.ready_file, server.port, getattr(server, "http_port", None))
    if args.role == "coordinator" and args.job:
        code = _serve_job(manager, server, args, log)
        if args.stop_workers_on_finish:
            _stop_workers(args, discovery, log)
    else:
        told = server.wait_for_termination_or_signal(grace_s=args.grace)
        log.info("stopped (%s)", "Shutdown call" if told else "signal")
        code = 0 if told else args.exit_code_on_signal
    if discovery is not None:
        discovery.close()
    return code


def _serve_split_rollout(args: argparse.Namespace, address: str, token: str | None, log) -> int:
    """`serve rollout --front-end process`: this process serves the port; the engine is its child."""
    from services.rollout import frontend

    try:
        split = frontend.start(address, token, metrics_port=args.metrics_port, log_level=args.log_level,
                               grace_s=args.grace)
    except RuntimeError as e:
        log.error("%s", e)
        return EXIT_FAILED
    log.info("serving on %s:%d%s", args.host, split.port, " (bearer token required)" if token else "")
    _write_ready(args.ready_file, split.port)
    return split.wait(args.grace, args.exit_code_on_signal)


def _stop_workers(args: argparse.Namespace, discovery, log) -> None:
    """--stop-workers-on-finish: the one job is over, so its workers exit too (an eval's GPUs
    are freed when the eval ends, not when someone uninstalls it)."""
    from services.coordinator.clients import shutdown_workers

    if discovery is not None:
        trainers, rollouts = discovery.trainers() + discovery.critics(), discovery.rollouts()
    else:
        trainers, rollouts = _addresses(args.trainers) + _addresses(args.critics), _addresses(args.rollouts)
    missed = shutdown_workers(trainers, rollouts, _read_token(args.worker_token_file, "RLFLEET_WORKER_TOKEN"),
                              "the coordinator's one job has finished")
    log.info("asked %d workers to exit%s", len(trainers) + len(rollouts),
             f"; could not reach {', '.join(missed)}" if missed else "")


def _addresses(flag: str | None) -> list[str]:
    """A comma-separated address list flag (--trainers, --rollouts, --critics) as a list."""
    return [a for a in (flag or "").split(",") if a]


# ---- coordinator: worker discovery (--discovery) ------------------------------------------------
def _worker_fleet(args: argparse.Namespace, token: str | None):
    """The JobManager's fleet factory, and the discovery behind it (None for static lists)."""
    if args.discovery == "static":
        from services.coordinator.fleet import static_fleet

        return static_fleet(_addresses(args.trainers), _addresses(args.rollouts), token,
                            _addresses(args.critics)), None
    from services.coordinator.discovery import make_fleet

    try:
        from services.coordinator import k8s_discovery as k8s
    except ImportError as e:
        raise ValueError(f"--discovery kubernetes needs the kubernetes client (pip install 'rlfleet[k8s]'): {e}") from e
    cfg = k8s.KubernetesDiscoveryConfig(
        namespace=args.namespace or k8s.default_namespace(), instance=args.instance, port=args.worker_port,
        colocated_rollout_port=args.colocated_rollout_port, revision=args.revision,
    )
    discovery = k8s.KubernetesDiscovery(cfg).start()
    fleet = make_fleet(
        discovery, token, wait_s=args.discovery_wait_s, eval_trainers=args.eval_trainers, describe=repr(discovery)
    )
    return fleet, discovery


# ---- coordinator: one job, then exit (--job FILE --exit-on-finish), e.g. a Kubernetes Job ----------
def _serve_job(manager, server, args: argparse.Namespace, log) -> int:
    """Run --job while serving; with --exit-on-finish stop when it ends and exit with its result."""
    import signal

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # A long-running coordinator restarted with the same --job must not start it twice; a one-shot
    # (--exit-on-finish) run always runs, even where an earlier run left its record in the store.
    code = run_job_file(manager, Path(args.job), stop, log, idempotent=not args.exit_on_finish)
    if not args.exit_on_finish:  # the job was one of many: serve on, until SIGTERM
        while not stop.wait(0.5):
            pass
        code = EXIT_OK
    server.stop(args.grace)
    log.info("stopped")
    return code


def run_job_file(manager, job_path: Path, stop: threading.Event, log, *, idempotent: bool = False) -> int:
    """Submit a job file to `manager`, follow it to the end, print its result as JSON on stdout.

    Returns 0 when the job succeeded, 1 when it failed or was cancelled (`stop` set, e.g. by
    SIGTERM at a Job's activeDeadlineSeconds, cancels it), 2 when the file is not a valid job.
    With `idempotent` the file's content is the request id, so a job store that remembers it
    returns the job it already has instead of starting a second one.
    """
    import hashlib

    from services.coordinator.config import ConfigError

    try:
        text = job_path.read_text()
        request_id = "job-file-" + hashlib.sha256(text.encode()).hexdigest()[:16] if idempotent else ""
        record = manager.create(text, str(job_path.absolute().parent), request_id)
    except (ConfigError, OSError) as e:
        log.error("invalid job %s: %s", job_path, e)
        print(json.dumps({"job": str(job_path), "state": "invalid", "error": str(e)}), flush=True)
        return EXIT_CONFIG
    log.info("job %s (%s) started from %s", record.id, record.name, job_path)
    seen = 0
    for event in manager.watch(record.id, stop=stop):
        seen = event.seq
        if event.kind in ("state", "eval", "log"):
            log.info("job %s: %s %s step %d %s", record.id, event.kind, event.state, event.step, event.data or "")
    if stop.is_set() and manager.get(record.id).state not in ("succeeded", "failed", "cancelled"):
        log.warning("job %s: stopping, cancelling it", record.id)
        manager.cancel(record.id)
        for _ in manager.watch(record.id, after_seq=seen):
            pass
    final = manager.get(record.id)
    result = {"job_id": final.id, "name": final.name, "state": final.state, "error": final.error,
              "output_dir": str(final.output_dir), "summary": final.summary}
    print(json.dumps(result, default=str), flush=True)
    (log.info if final.state == "succeeded" else log.error)("job %s %s%s", final.id, final.state,
                                                            f": {final.error}" if final.error else "")
    return EXIT_OK if final.state == "succeeded" else EXIT_FAILED


def cmd_run(args: argparse.Namespace) -> int:
    from services.coordinator.config import ConfigError, load_job

    try:
        job = load_job(Path(args.job))
    except (ConfigError, FileNotFoundError) as e:
        print(f"rlfleet: invalid job: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from services.runner import run_local

    return run_local(job, Path(args.job), args)


def _tls(args: argparse.Namespace):
    """The serve command's TLS settings (None: plaintext), exported for the channels it opens."""
    from services.tls import TlsConfig

    if not (args.tls_cert or args.tls_ca):
        return TlsConfig.from_env()
    tls = TlsConfig.from_files(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, client_auth=args.tls_client_auth,
                               server_name=args.tls_server_name)
    tls.export(args.tls_cert, args.tls_key, args.tls_ca)
    return tls


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet", description="RL post-training for LLMs as gRPC services")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("role", choices=["trainer", "rollout", "coordinator", "environment"])
    serve.add_argument("--module", default="",
                       help="environment: the Environment class to serve, package.module:Class (docs/agents.md)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod)")
    serve.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    serve.add_argument("--token-file", help="require this bearer token (also: RLFLEET_TOKEN)")
    serve.add_argument("--ready-file", help="write {port, pid} here once serving")
    serve.add_argument("--grace", type=float, default=5.0, help="seconds in-flight calls get on SIGTERM")
    serve.add_argument("--log-level", default="INFO")
    serve.add_argument("--tls-cert", help="PEM certificate chain this server (and its clients) present; with --tls-key")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument("--tls-ca", help="PEM CA bundle peers' certificates are checked against")
    serve.add_argument("--tls-client-auth", action="store_true",
                       help="require client certificates signed by --tls-ca (mutual TLS)")
    serve.add_argument("--tls-server-name", default="",
                       help="the name clients expect in servers' certificates (pods are reached by address)")
    serve.add_argument("--checkpoint-root", default=os.environ.get("RLFLEET_CHECKPOINT_ROOT", "."),
                       help="trainer: checkpoints are saved and loaded under this folder only "
                            "(default: RLFLEET_CHECKPOINT_ROOT, else the working directory)")
    serve.add_argument("--rank-store-port", type=int, default=0,
                       help="trainer: port of rank 0's rendezvous store for a multi-rank trainer (0: a free one)")
    serve.add_argument("--weight-store-port", type=int, default=0,
                       help="trainer: port of the weight-sync broadcast group's store (0: a free one)")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="trainer, rollout: serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port)")
    serve.add_argument("--metrics-host", default=None,
                       help="rollout: the address /metrics binds (default: --host)")
    serve.add_argument("--front-end", choices=["inline", "process"], default="inline",
                       help="rollout: serve calls in the engine's process (inline), or in a process of their own "
                            "that forwards them to the engine's over one Unix socket (process: for hundreds of "
                            "concurrent callers; docs/rollout-engine.md)")
    serve.add_argument("--link-socket", default=None,
                       help="rollout: also take calls from a front end process on this Unix socket (the front end "
                            "of --front-end process starts its engine's process with it)")
    serve.add_argument("--trainers", help="coordinator: comma-separated trainer addresses")
    serve.add_argument("--rollouts", help="coordinator: comma-separated rollout engine addresses")
    serve.add_argument("--critics", help="coordinator: comma-separated critic addresses (trainer servers PPO jobs "
                                         "use as value models)")
    serve.add_argument("--worker-token-file", help="coordinator: token for trainers and engines")
    serve.add_argument("--runs-dir", default="runs", help="coordinator: where job outputs go by default")
    serve.add_argument("--discovery", choices=["static", "kubernetes"], default="static",
                       help="coordinator: workers from --trainers/--rollouts, or the ready pods of --instance")
    serve.add_argument("--namespace", help="coordinator: namespace of the worker pods (default: the pod's own)")
    serve.add_argument("--instance", default="rlfleet", help="coordinator: app.kubernetes.io/instance of the workers")
    serve.add_argument("--worker-port", type=int, default=50051, help="coordinator: gRPC port of discovered pods")
    serve.add_argument("--colocated-rollout-port", type=int, default=50052,
                       help="coordinator: gRPC port of the engine in a colocated trainer+engine pod")
    serve.add_argument("--revision", default="",
                       help="coordinator: only workers labelled rlfleet.dev/revision=REVISION (an eval release's own)")
    serve.add_argument("--discovery-wait-s", type=float, default=600.0,
                       help="coordinator: how long a job waits for enough ready workers (and for a lost "
                            "trainer's replacement)")
    serve.add_argument("--eval-trainers", type=int, default=0,
                       help="coordinator: trainers an eval-only job waits for (0: engines load the checkpoint)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="coordinator: also serve the REST API (/v1/jobs, /openapi.json) on this port; 0 picks one")
    serve.add_argument("--db", default="./rlfleet-jobs.db",
                       help="coordinator: SQLite job store (jobs and events survive restarts); 'memory' keeps none")
    serve.add_argument("--trainer-restarts", type=int, default=3,
                       help="coordinator: how often a job that loses a trainer restarts from its last checkpoint "
                            "(0: such a job fails)")
    serve.add_argument("--max-running-jobs", type=int, default=1,
                       help="coordinator: jobs that run at once; the rest wait as pending")
    serve.add_argument("--job", help="coordinator: run this job file at start")
    serve.add_argument("--allow-reward-module", action="append",
                       default=[m for m in os.environ.get("RLFLEET_ALLOW_REWARD_MODULES", "").split(",") if m],
                       help="coordinator: a module (or package) python rewards may import; repeat for more "
                            "(default: RLFLEET_ALLOW_REWARD_MODULES, comma-separated; none: python rewards refused)")
    serve.add_argument("--exit-code-on-signal", type=int, default=0,
                       help="trainer, rollout: exit code after SIGTERM/SIGINT (a worker run as a Kubernetes Job "
                            "exits non-zero when drained, so the Job replaces it; 0 only after Shutdown)")
    serve.add_argument("--stop-workers-on-finish", action="store_true",
                       help="coordinator with --job --exit-on-finish: ask every worker to exit when the job ends")
    serve.add_argument("--exit-on-finish", action="store_true",
                       help="coordinator: with --job, exit when it ends: 0 succeeded, 1 failed, 2 invalid job")
    serve.set_defaults(func=cmd_serve)

    run = sub.add_parser("run", help="run a job on this machine with local service processes")
    run.add_argument("job", help="job YAML file")
    run.add_argument("--output-dir", help="where metrics, logs, plots and the summary go")
    run.add_argument("--summary", help="also write the summary JSON here")
    run.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    run.set_defaults(func=cmd_run)

    from services.jobs_cli import add_job_commands  # submit, status, watch, cancel, logs, results

    add_job_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
