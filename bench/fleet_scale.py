"""How the coordinator's own work per RL step grows with the number of rollout engines.

For each engine count E (1 to 256 by default), E simulated engines and one simulated trainer run
as real gRPC servers on loopback, spread over `--processes` child processes. An engine answers
Generate after `--new-tokens` x `--step-ms` (a batch decodes in that time whatever its size),
with canned tokens; the trainer answers TrainStep after `--train-ms`; weight updates carry no
bytes. The coordinator's real loop (`RLLoop`: spreading prompts, rewards, advantages, the batch,
the weight sync of every engine) runs `--steps` steps in this process, each step holding
`--prompts-per-engine` prompts for every engine (weak scaling).

The limit is a step with no coordinator at all: the simulated generation plus the simulated
training. Reported per E: the step's wall time, the coordinator's overhead (wall time less that
limit, and its share of the step), the coordinator process's CPU seconds per step, and the
efficiency (limit over wall time). The goal is an overhead under 5% of the step at 256 engines.

    python bench/fleet_scale.py --out run.jsonl --png bench/results/fleet_scale-<machine>.png && python bench/common.py publish fleet_scale run.jsonl
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import commit, emit, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ---- the simulated workers (child processes) -----------------------------------------------------
def _servers(count: int, with_trainer: bool, step_s: float, new_tokens: int, train_s: float, conn) -> None:
    """`count` engines (and the trainer) as grpc.aio servers on one event loop: a sync server
    polls on a thread of its own, and 256 of them burnt CPU the coordinator needs even between
    calls; on one loop they share one poller, and a call needs no thread."""
    import asyncio

    import grpc

    from services.api import rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc, weights_pb2

    replies: dict[tuple[int, int, int], rollout_pb2.GenerateResponse] = {}

    def canned(prompts: int, n: int, version: int) -> rollout_pb2.GenerateResponse:
        """The reply to `prompts` prompts of n samples at `version`, built once: the simulators
        share the coordinator's cores, and building thousands of messages a step in Python would
        charge their work to the coordinator's overhead."""
        key = (prompts, n, version)
        if key not in replies:
            run = [rollout_pb2.VersionRun(version=version, tokens=new_tokens)]
            results = [rollout_pb2.Completion(prompt_index=i, prompt_ids=[3, 4, 5], output_ids=[6] * new_tokens,
                                              text=str(j % 10), logprobs=[-0.5] * new_tokens,
                                              finish_reason=rollout_pb2.FINISH_REASON_LENGTH,
                                              weight_version=version, version_runs=run)
                       for i in range(prompts) for j in range(n)]
            replies[key] = rollout_pb2.GenerateResponse(results=results, weight_version=version)
        return replies[key]

    class Engine(rollout_pb2_grpc.RolloutServicer):
        def __init__(self):
            self.version = 0

        def _status(self):
            return rollout_pb2.RolloutStatus(configured=True, weight_version=self.version, serving=True)

        async def Configure(self, request, context):
            return rollout_pb2.ConfigureRolloutResponse(status=self._status(), capabilities=weights_pb2.Capabilities())

        async def GetStatus(self, request, context):
            return self._status()

        async def Generate(self, request, context):
            await asyncio.sleep(new_tokens * step_s)
            return canned(len(request.prompts), max(1, request.sampling.n), self.version)

        async def UpdateWeights(self, request, context):
            self.version = request.manifest.version
            return rollout_pb2.UpdateWeightsResponse(version=self.version)

    class Trainer(trainer_pb2_grpc.TrainerServicer):
        def __init__(self):
            self.version = 0

        def _status(self):
            return trainer_pb2.TrainerStatus(configured=True, has_optimizer=True, backend="simulated",
                                             lifecycle=trainer_pb2.LifecycleStatus(weights_version=self.version))

        async def Configure(self, request, context):
            return trainer_pb2.ConfigureTrainerResponse(status=self._status(), capabilities=weights_pb2.Capabilities())

        async def GetStatus(self, request, context):
            return self._status()

        async def TrainStep(self, request, context):
            await asyncio.sleep(train_s)
            self.version += 1
            return trainer_pb2.TrainStepResponse(metrics={"loss": 0.0}, weights_version=self.version, step=self.version)

        async def GetWeightManifest(self, request, context):
            return trainer_pb2.GetWeightManifestResponse(manifest=weights_pb2.WeightManifest(version=self.version,
                                                                                              source="gpu"))

    async def serve() -> None:
        servers, addresses = [], []
        for k in range(count + with_trainer):
            server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 * 1024 * 1024)])
            if with_trainer and k == 0:
                trainer_pb2_grpc.add_TrainerServicer_to_server(Trainer(), server)
            else:
                rollout_pb2_grpc.add_RolloutServicer_to_server(Engine(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            servers.append(server)
            addresses.append(f"127.0.0.1:{port}")
        conn.send(addresses)
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, conn.recv) == "cpu":  # until told to stop
            conn.send(time.process_time())
        for server in servers:
            await server.stop(0)

    asyncio.run(serve())


class Workers:
    """`engines` simulated engines and a trainer over `processes` child processes."""

    def __init__(self, engines: int, processes: int, step_s: float, new_tokens: int, train_s: float):
        context = multiprocessing.get_context("spawn")
        processes = max(1, min(processes, engines))
        shares = [engines // processes + (i < engines % processes) for i in range(processes)]
        self.children, self.pipes = [], []
        for i, share in enumerate(shares):
            mine, theirs = context.Pipe()
            child = context.Process(target=_servers, args=(share, i == 0, step_s, new_tokens, train_s, theirs),
                                    daemon=True)
            child.start()
            self.children.append(child)
            self.pipes.append(mine)
        lists = [pipe.recv() for pipe in self.pipes]
        self.trainer, self.engines = lists[0][0], lists[0][1:] + [a for part in lists[1:] for a in part]

    def cpu_s(self) -> float:
        """CPU seconds the simulated workers have used so far (all their processes)."""
        for pipe in self.pipes:
            pipe.send("cpu")
        return sum(pipe.recv() for pipe in self.pipes)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send("stop")
        for child in self.children:
            child.join(10)


# ---- the coordinator, here ------------------------------------------------------------------------
def run(engines: int, *, steps: int, prompts_per_engine: int, samples: int, new_tokens: int, step_ms: float,
        train_ms: float, processes: int) -> dict:
    from services.coordinator.clients import RolloutClient, TrainerClient
    from services.coordinator.config import parse_job
    from services.coordinator.datasets import PromptSampler, open_dataset
    from services.coordinator.loop import Fleet, RLLoop
    from services.coordinator.rewards import build_reward

    workers = Workers(engines, processes, step_ms / 1000, new_tokens, train_ms / 1000)
    try:
        job = parse_job(f"""
name: fleet-scale
model: {ROOT / 'examples/arith/model'}
num_rollout: {steps}
rollout: {{prompts_per_step: {prompts_per_engine * engines}, samples_per_prompt: {samples}, num_engines: {engines},
          max_batch_size: 4096, sampling: {{max_new_tokens: {new_tokens}}}}}
data: {{train: {ROOT / 'examples/arith/data/train.jsonl'}}}
reward: {{kind: exact_match}}
eval: {{every: 0, datasets: []}}
weight_sync: {{plane: grpc_stream, verify: fingerprint}}
""", ROOT)
        fleet = Fleet(trainers=[TrainerClient(workers.trainer)], engines=[RolloutClient(a) for a in workers.engines])
        events = []
        loop = RLLoop(job, fleet, lambda kind, step, data: events.append((kind, step)))
        loop._rng, loop._reward = random.Random(0), build_reward(job.reward)
        loop.setup()
        sampler = PromptSampler(open_dataset(job.data.train, job.data.columns), job.rollout.prompts_per_step, seed=0,
                                shuffle=True)
        loop._sampler = sampler
        loop.rl_step(1, sampler.next_batch())  # warm: connections, first calls
        wall, cpu, workers_cpu = time.perf_counter(), time.process_time(), workers.cpu_s()
        metrics = [loop.rl_step(step, sampler.next_batch()) for step in range(2, steps + 2)]
        wall, cpu = (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps
        workers_cpu = (workers.cpu_s() - workers_cpu) / steps
        loop.close()
    finally:
        workers.close()
    limit = (new_tokens * step_ms + train_ms) / 1000

    def mean(key: str) -> float:
        return sum(m[key] for m in metrics) / len(metrics)

    return {
        "bench": "fleet_scale", "engines": engines, "steps": steps, "samples_per_step": prompts_per_engine * engines * samples,
        "step_s": round(wall, 4), "limit_s": round(limit, 4), "overhead_s": round(wall - limit, 4),
        "overhead_frac": round((wall - limit) / wall, 4), "coordinator_cpu_s": round(cpu, 4),
        # the simulators' own CPU a step: on a machine with few cores they compete with the coordinator
        "simulators_cpu_s": round(workers_cpu, 4),
        # where the overhead is: each phase's time less its simulated part (generate: spreading
        # prompts and reading completions; train: rewards, advantages and the batch; sync: all of it)
        "generate_overhead_s": round(mean("generate_s") - new_tokens * step_ms / 1000, 4),
        "train_overhead_s": round(mean("train_s") - train_ms / 1000, 4), "sync_s": round(mean("sync_s"), 4),
        "ratio": round(limit / wall, 3), "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine(),
    }


def plot(lines: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [line["engines"] for line in lines]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot(engines, [100 * line["overhead_frac"] for line in lines], "o-")
    left.axhline(5, color="green", linestyle="--", linewidth=0.8, label="goal 5%")
    left.set(xscale="log", xlabel="rollout engines", ylabel="coordinator overhead (% of the step)")
    left.legend(fontsize=7)
    right.plot(engines, [line["coordinator_cpu_s"] for line in lines], "o-", label="coordinator CPU s / step")
    right.plot(engines, [line["overhead_s"] for line in lines], "s--", label="overhead s / step")
    right.set(xscale="log", yscale="log", xlabel="rollout engines", ylabel="seconds per step")
    right.legend(fontsize=7)
    fig.suptitle(f"coordinator against simulated engines ({lines[0]['machine']}, {lines[0]['commit']}, "
                 f"{lines[0]['samples_per_step'] // lines[0]['engines']} samples per engine per step)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="1,4,16,64,256")
    parser.add_argument("--steps", type=int, default=5, help="steps counted per engine count (after one warm step)")
    parser.add_argument("--prompts-per-engine", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=20.0, help="a simulated engine's decode step")
    parser.add_argument("--train-ms", type=float, default=2000.0, help="a simulated train step")
    parser.add_argument("--processes", type=int, default=8, help="child processes the simulated servers run in")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.engines.split(",")]
    from services.coordinator.serve import freeze_heap

    freeze_heap()  # this process is the coordinator: it starts as `rlfleet serve coordinator` does
    lines = []
    for i, engines in enumerate(counts):
        print(f"# [{i + 1}/{len(counts)}] {engines} engines, {args.steps} steps ...", file=sys.stderr, flush=True)
        line = run(engines, steps=args.steps, prompts_per_engine=args.prompts_per_engine, samples=args.samples,
                   new_tokens=args.new_tokens, step_ms=args.step_ms, train_ms=args.train_ms, processes=args.processes)
        emit(line, args.out)
        lines.append(line)
        print(f"#   step {line['step_s']} s (limit {line['limit_s']} s): overhead {100 * line['overhead_frac']:.1f}%, "
              f"coordinator CPU {line['coordinator_cpu_s']} s a step, simulators' {line['simulators_cpu_s']} s",
              file=sys.stderr, flush=True)
    if args.png:
        plot(lines, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
