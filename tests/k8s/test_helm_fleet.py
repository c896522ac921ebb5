"""The chart's production wiring (issue #20): GPUs the job computes on, per-role placement, shared
storage for checkpoints, eval Jobs that can be rerun, disruption budgets and image pinning.

Every render is validated strictly against the oldest and newest Kubernetes schemas the chart
supports (`manifests.k8s_versions`); the job config is read back with the coordinator's own loader.
Nothing here talks to a cluster: what a kubelet, a scheduler or the NVIDIA runtime do with these
objects is not tested.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from services.coordinator.config import parse_job
from tests.k8s import manifests as m
from tests.k8s.test_helm_chart import BASE, JOB, NAMESPACE, RELEASE, job_text, render, values

helm = pytest.importorskip("helm_python")
pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.k8s

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SHARED = {"enabled": True, "existingClaim": "", "storageClass": "nfs", "accessModes": ["ReadWriteMany"],
          "size": "500Gi", "mountPath": "/var/lib/rlfleet-shared"}
DIGEST = "sha256:" + "ab" * 32


def rendered(chart, **overrides) -> list[dict]:
    objects = render(chart, values(**overrides))
    m.validate(objects)
    m.check_labels_and_selectors(objects)
    m.check_probes(objects)
    m.check_security(objects)
    return objects


def pods(objects: list[dict]) -> dict[str, tuple[dict, dict, dict]]:
    """component -> (workload, pod metadata, pod spec)."""
    return {meta["labels"][m.COMPONENT]: (w, meta, spec) for w, meta, spec in m.pod_specs(objects)}


def env(workload: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in m.container(workload)["env"]}


def refused(chart, message: str, **overrides) -> None:
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values(**overrides), name=RELEASE, namespace=NAMESPACE)


# ---------------------------------------------------------------------------- 1. GPUs that compute


def test_gpus_per_pod_makes_the_job_compute_on_them(chart):
    objects = rendered(chart, mode="train", gpusPerPod={"trainer": 1, "rollout": 1})
    job = parse_job(job_text(objects), "/", check_files=False)  # what the coordinator runs
    assert job.trainer.device == "cuda" and job.rollout.devices == ("cuda",)
    fleet = pods(objects)
    for role in ("trainer", "rollout"):
        workload, _, spec = fleet[role]
        assert m.container(workload)["image"] == "ghcr.io/rlfleet/rlfleet:0.1.0-cuda"
        assert m.container(workload)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert GPU_TOLERATION in spec["tolerations"]
        assert "NVIDIA_VISIBLE_DEVICES" not in env(workload)  # the device plugin names the pod's GPU
    coordinator, _, spec = fleet["coordinator"]
    assert m.container(coordinator)["image"] == "ghcr.io/rlfleet/rlfleet:0.1.0-cpu"
    assert "tolerations" not in spec
    assert env(coordinator)["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_a_role_without_gpus_runs_on_cpu_beside_a_gpu_role(chart):
    objects = rendered(chart, mode="train", gpusPerPod={"trainer": 1, "rollout": 0})
    job = parse_job(job_text(objects), "/", check_files=False)
    # Explicit: the loader's default (the trainer's device) would put engines on a GPU they lack.
    assert job.trainer.device == "cuda" and job.rollout.devices == ("cpu",)
    rollout = pods(objects)["rollout"][0]
    assert m.container(rollout)["image"].endswith(":0.1.0-cpu") and env(rollout)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "nvidia.com/gpu" not in m.container(rollout)["resources"]["limits"]


def test_cpu_fleet_says_cpu_everywhere(chart):
    objects = rendered(chart, mode="train")
    job = parse_job(job_text(objects), "/", check_files=False)
    assert job.trainer.device == "cpu" and job.rollout.devices == ("cpu",)
    assert all(env(w)["NVIDIA_VISIBLE_DEVICES"] == "void" for w, _, _ in m.pod_specs(objects))


def test_an_eval_on_gpu_rollouts_generates_on_cuda(chart):
    objects = rendered(chart, mode="eval", gpusPerPod={"trainer": 0, "rollout": 2},
                       job={**JOB, "rollout": {"devices": ["cuda:1"]}})
    job = parse_job(job_text(objects), "/", check_files=False)
    assert job.eval_only and job.rollout.devices == ("cuda:1",)
    assert m.container(pods(objects)["rollout"][0])["resources"]["requests"]["nvidia.com/gpu"] == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"job": {**JOB, "trainer": {"device": "cuda"}}},
         "job.trainer.device: cuda, but gpusPerPod.trainer is 0: trainer pods have no GPU"),
        ({"gpusPerPod": {"trainer": 1, "rollout": 0}, "job": {**JOB, "trainer": {"device": "cpu"}}},
         "job.trainer.device: cpu, but gpusPerPod.trainer is 1: a trainer pod's GPU would idle"),
        ({"gpusPerPod": {"trainer": 1, "rollout": 0}, "job": {**JOB, "trainer": {"device": "cuda:1"}}},
         "job.trainer.device: cuda:1, but a trainer pod sees its 1 GPU as cuda:0"),
        ({"job": {**JOB, "rollout": {"devices": ["cuda"]}}},
         r"job.rollout.devices: cuda, but gpusPerPod.rollout is 0"),
        ({"gpusPerPod": {"trainer": 0, "rollout": 1}, "job": {**JOB, "rollout": {"devices": ["cpu"]}}},
         r"job.rollout.devices: cpu, but gpusPerPod.rollout is 1: a rollout pod's GPUs would idle"),
        ({"gpusPerPod": {"trainer": 0, "rollout": 2}, "job": {**JOB, "rollout": {"devices": ["cuda:2"]}}},
         r"job.rollout.devices: cuda:2, but a rollout pod has 2 GPU\(s\), cuda:0 to cuda:1"),
        ({"resources": {"coordinator": {}, "rollout": {},
                        "trainer": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": 1}}}},
         r"resources.trainer.limits: nvidia.com/gpu: GPUs come from gpusPerPod .* set gpusPerPod.trainer"),
        ({"resources": {"trainer": {}, "rollout": {}, "coordinator": {"requests": {"nvidia.com/gpu": 1}}}},
         r"resources.coordinator.requests: nvidia.com/gpu: .*the coordinator needs no GPU"),
    ],
    ids=["cuda-without-gpu", "cpu-with-gpu", "cuda-index-out-of-pod", "rollout-cuda-without-gpu",
         "rollout-cpu-with-gpu", "rollout-index-out-of-pod", "gpu-in-resources", "gpu-for-coordinator"],
)
def test_contradictory_gpu_settings_are_refused_at_render_time(chart, overrides, message):
    refused(chart, message, mode="train", **overrides)


def test_a_trainer_pod_is_one_rank_on_one_gpu(chart):
    with pytest.raises(helm.HelmValuesError, match=r"/gpusPerPod/trainer"):
        chart.render(values(gpusPerPod={"trainer": 2, "rollout": 0}), name=RELEASE, namespace=NAMESPACE)


# ---------------------------------------------------------------------------- 2. placement per role


def test_placement_and_pod_metadata_per_role_merge_over_the_globals(chart):
    spot = {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
    zone = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}]}]}}}
    objects = rendered(
        chart, mode="train", gpusPerPod={"trainer": 1, "rollout": 1},
        nodeSelector={"pool": "general", "arch": "amd64"}, tolerations=[spot], podLabels={"team": "rl"},
        podAnnotations={"owner": "rl"}, priorityClassName="batch-low", affinity=zone,
        coordinator={"priorityClassName": "system-critical-ish", "podAnnotations": {"owner": "platform"}},
        trainer={"nodeSelector": {"pool": "h200"}, "runtimeClassName": "nvidia", "priorityClassName": "train-high",
                 "podLabels": {"app.kubernetes.io/component": "hijack", "tier": "gpu"},
                 "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}},
        rollout={"tolerations": [GPU_TOLERATION], "runtimeClassName": "nvidia"},
    )
    fleet = pods(objects)
    _, meta, spec = fleet["coordinator"]
    assert spec["nodeSelector"] == {"pool": "general", "arch": "amd64"} and spec["tolerations"] == [spot]
    assert spec["priorityClassName"] == "system-critical-ish" and "runtimeClassName" not in spec
    assert meta["annotations"]["owner"] == "platform" and "checksum/job" in meta["annotations"]
    assert meta["labels"]["team"] == "rl"
    _, meta, spec = fleet["trainer"]
    assert spec["nodeSelector"] == {"pool": "h200", "arch": "amd64"}
    assert spec["tolerations"] == [spot, GPU_TOLERATION]
    assert spec["runtimeClassName"] == "nvidia" and spec["priorityClassName"] == "train-high"
    assert set(spec["affinity"]) == {"nodeAffinity", "podAntiAffinity"}
    assert meta["labels"]["tier"] == "gpu" and meta["labels"][m.COMPONENT] == "trainer"  # the chart's labels win
    _, meta, spec = fleet["rollout"]
    assert spec["tolerations"] == [spot, GPU_TOLERATION]  # given twice, listed once
    assert spec["priorityClassName"] == "batch-low" and meta["annotations"] == {"owner": "rl"}
    m.check_discovery_wiring(objects)


def test_the_eval_jobs_pod_takes_the_eval_job_placement(chart):
    objects = rendered(chart, mode="eval", nodeSelector={"pool": "general"},
                       evalJob={"backoffLimit": 0, "priorityClassName": "eval", "nodeSelector": {"pool": "cpu"},
                                "podLabels": {"suite": "nightly"}},
                       coordinator={"priorityClassName": "not-used-in-eval-mode"})
    job = m.one(objects, "Job", "coordinator")
    pod = job["spec"]["template"]
    assert pod["spec"]["priorityClassName"] == "eval" and pod["spec"]["nodeSelector"] == {"pool": "cpu"}
    assert pod["metadata"]["labels"]["suite"] == "nightly"


@pytest.mark.parametrize("name", ["Nvidia", "nvidia_gpu", "-x"])
def test_runtime_class_names_are_checked(chart, name):
    with pytest.raises(helm.HelmValuesError, match="runtimeClassName"):
        chart.render(values(trainer={"runtimeClassName": name}), name=RELEASE, namespace=NAMESPACE)


# ---------------------------------------------------------------------------- 3. shared storage


def _args(workload: dict) -> dict[str, str]:
    return dict(re.match(r"--([\w-]+)=(.*)", a).groups() for a in m.container(workload)["args"] if re.match(r"--[\w-]+=", a))


def _mount(workload: dict, spec: dict, name: str) -> tuple[dict, dict]:
    (mount,) = [mt for mt in m.container(workload)["volumeMounts"] if mt["name"] == name]
    (volume,) = [v for v in spec["volumes"] if v["name"] == name]
    return mount, volume


def test_trainers_and_the_coordinator_agree_on_where_checkpoints_go(chart):
    job_values = {**JOB, "checkpoint": {"every": 5}}
    objects = rendered(chart, mode="train", replicas={"trainers": 2, "rollouts": 1}, sharedStorage=SHARED, job=job_values)
    fleet = pods(objects)
    (pvc,) = [p for p in m.by_kind(objects, "PersistentVolumeClaim") if p["metadata"]["name"].endswith("-shared")]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "nfs"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    root = SHARED["mountPath"]
    coordinator, _, coordinator_spec = fleet["coordinator"]
    trainer, _, trainer_spec = fleet["trainer"]
    for workload, spec in ((coordinator, coordinator_spec), (trainer, trainer_spec)):
        mount, volume = _mount(workload, spec, "shared")
        assert mount == {"name": "shared", "mountPath": root}  # read-write, same path in both
        assert volume["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"]}
    rollout_mount, rollout_volume = _mount(*fleet["rollout"][:1], fleet["rollout"][2], "shared")
    assert rollout_mount["readOnly"] is True and rollout_volume["persistentVolumeClaim"]["readOnly"] is True
    assert _args(trainer)["checkpoint-root"] == root

    # Where the coordinator will ask trainer 0 to save: JobManager puts output_dir under --runs-dir
    # (services/coordinator/jobs.py), checkpoints default to <output_dir>/checkpoints (loop.py).
    job = parse_job(job_text(objects), "/", check_files=False)
    assert job.checkpoint.every == 5 and job.output_dir is None and job.checkpoint.dir is None
    output_dir = Path(_args(coordinator)["runs-dir"]) / f"{job.name}-0123456789ab"
    checkpoint = (job.checkpoint.dir or output_dir / "checkpoints") / "step-000005"
    assert checkpoint.is_relative_to(_args(trainer)["checkpoint-root"])  # inside the trainer's --checkpoint-root
    assert _args(coordinator)["db"] == "/var/lib/rlfleet/jobs.db"  # SQLite stays on its own ReadWriteOnce volume


def test_an_existing_claim_is_shared_and_the_eval_writes_its_outputs_there(chart):
    shared = {**SHARED, "existingClaim": "team-checkpoints"}
    objects = rendered(chart, mode="eval", model={**BASE["model"], "format": "rlfleet"}, sharedStorage=shared)
    assert not [p for p in m.by_kind(objects, "PersistentVolumeClaim") if p["metadata"]["name"].endswith("-shared")]
    for role in ("coordinator", "trainer", "rollout"):
        workload, _, spec = pods(objects)[role]
        assert _mount(workload, spec, "shared")[1]["persistentVolumeClaim"]["claimName"] == "team-checkpoints"
    assert _args(pods(objects)["coordinator"][0])["runs-dir"] == "/var/lib/rlfleet-shared/runs"


def test_without_shared_storage_nothing_changes(chart):
    objects = rendered(chart, mode="train")
    fleet = pods(objects)
    assert _args(fleet["coordinator"][0])["runs-dir"] == "/var/lib/rlfleet/runs"
    assert "checkpoint-root" not in _args(fleet["trainer"][0])
    assert not any(v["name"] == "shared" for _, _, spec in m.pod_specs(objects) for v in spec["volumes"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"job": {**JOB, "checkpoint": {"every": 10}}}, "job.checkpoint.every: .* set sharedStorage.enabled: true"),
        ({"sharedStorage": SHARED, "job": {**JOB, "checkpoint": {"every": 1, "dir": "/var/lib/rlfleet/ckpt"}}},
         r"job.checkpoint.dir: /var/lib/rlfleet/ckpt is outside sharedStorage.mountPath \(/var/lib/rlfleet-shared\)"),
        ({"sharedStorage": SHARED, "job": {**JOB, "output_dir": "/var/lib/rlfleet-sharedX/out"}},
         "job.output_dir: .* is outside sharedStorage.mountPath"),
        ({"job": {**JOB, "output_dir": "/out"}}, "job.output_dir: /out is on no volume the pods can write"),
    ],
    ids=["checkpoints-without-shared-storage", "checkpoint-dir-elsewhere", "output-dir-prefix-trick", "output-dir-nowhere"],
)
def test_checkpoints_and_outputs_off_the_shared_volume_are_refused(chart, overrides, message):
    refused(chart, message, mode="train", **overrides)


# ---------------------------------------------------------------------------- 4. eval reruns


def test_each_revision_runs_its_own_eval_job(chart):
    first, second = (chart.render(values(mode="eval"), name=RELEASE, namespace=NAMESPACE, revision=r, is_upgrade=r > 1)
                     for r in (1, 2))
    jobs = []
    for text in (first, second):
        objects = [o for path, t in text.items() if not path.endswith("NOTES.txt") for o in m.load_all(t)]
        m.validate(objects)
        job = m.one(objects, "Job", "coordinator")
        jobs.append(job)
        notes = next(t for path, t in text.items() if path.endswith("NOTES.txt"))
        assert f"job/{job['metadata']['name']}" in notes
    assert [j["metadata"]["name"] for j in jobs] == ["demo-rlfleet-eval-1", "demo-rlfleet-eval-2"]
    policy = jobs[0]["spec"]["podFailurePolicy"]["rules"]
    assert policy[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert policy[1]["action"] == "FailJob" and policy[1]["onExitCodes"] == {
        "containerName": "coordinator", "operator": "NotIn", "values": [0]}
    assert jobs[0]["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it


# ---------------------------------------------------------------------------- 5. disruption budgets


def _budgets(objects: list[dict]) -> dict[str, dict]:
    return {p["metadata"]["labels"][m.COMPONENT]: p["spec"] for p in m.by_kind(objects, "PodDisruptionBudget")}


def test_disruption_budgets_keep_every_pod_a_running_job_needs(chart):
    objects = rendered(chart, mode="train", replicas={"trainers": 2, "rollouts": 3})
    budgets = _budgets(objects)
    assert budgets["coordinator"]["minAvailable"] == 1 and budgets["trainer"]["maxUnavailable"] == 0
    assert budgets["rollout"]["maxUnavailable"] == 1
    assert all(b["unhealthyPodEvictionPolicy"] == "AlwaysAllow" for b in budgets.values())
    for component, budget in budgets.items():  # each selects exactly its own pods
        chosen = [meta["labels"][m.COMPONENT] for _, meta, _ in m.pod_specs(objects)
                  if m.selects(budget["selector"]["matchLabels"], meta["labels"])]
        assert chosen == [component]


def test_the_last_rollout_pod_is_never_drained_and_an_hf_eval_has_no_trainer_budget(chart):
    budgets = _budgets(rendered(chart, mode="eval"))
    # Eval workers are Job pods: an integer minAvailable is the budget the eviction API honours for them.
    assert set(budgets) == {"coordinator", "rollout"} and budgets["rollout"] == {
        "minAvailable": 1, "unhealthyPodEvictionPolicy": "AlwaysAllow", "selector": budgets["rollout"]["selector"]}
    assert not _budgets(rendered(chart, mode="train", podDisruptionBudget={"enabled": False}))


# ---------------------------------------------------------------------------- 6. images


def test_a_digest_pins_its_variant_and_wins_over_the_tag(chart):
    image = {"repository": "registry.example.com/rlfleet", "tag": "0.1.0-custom", "pullPolicy": "IfNotPresent",
             "digest": {"cpu": "", "cuda": DIGEST}}
    fleet = pods(rendered(chart, mode="train", image=image, gpusPerPod={"trainer": 1, "rollout": 0}))
    assert m.container(fleet["trainer"][0])["image"] == f"registry.example.com/rlfleet@{DIGEST}"
    assert m.container(fleet["rollout"][0])["image"] == "registry.example.com/rlfleet:0.1.0-custom"
    assert m.container(fleet["coordinator"][0])["image"] == "registry.example.com/rlfleet:0.1.0-custom"
    with pytest.raises(helm.HelmValuesError, match="/image/digest/cpu"):
        chart.render(values(image={**image, "digest": {"cpu": "sha256:short"}}), name=RELEASE, namespace=NAMESPACE)


def test_the_images_import_check_runs_against_the_installed_package():
    """From the source directory, `python -c "import services"` would import the copied sources
    (the script directory comes first on sys.path) and prove nothing about the install."""
    dockerfile = (m.ROOT / "Dockerfile").read_text()
    checks = re.findall(r"[^\n]*python[^\n]*-c \"import services[^\n]*", dockerfile)
    assert len(checks) == 2, checks  # the runtime image and the sglang image
    assert all("cd / && python -I -c" in check for check in checks), checks


# ---------------------------------------------------------------------------- docs


def test_every_values_block_of_the_deploy_guide_renders_and_validates(chart):
    guide = (m.ROOT / "docs" / "deploy.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", guide, re.S)]
    manifests = [b for b in blocks if isinstance(b, dict) and "apiVersion" in b]
    examples = [b for b in blocks if isinstance(b, dict) and "apiVersion" not in b]
    assert len(blocks) == len(manifests) + len(examples)
    assert all("mode" in e for e in examples), "every values block is a whole values file"
    assert {e["mode"] for e in examples} == {"eval", "train"}
    for example in examples:
        objects = render(chart, example)
        m.validate(objects)
        if m.by_kind(objects, "ConfigMap"):
            job = parse_job(job_text(objects), "/", check_files=False)
            assert job.eval_only == (example["mode"] == "eval")
            gpus = example.get("gpusPerPod", {})
            assert job.trainer.device == ("cuda" if gpus.get("trainer") else "cpu"), example["job"]["name"]


# ---------------------------------------------------------------------------- rollout autoscaling


AUTOSCALED = {"rollouts": {"enabled": True, "minReplicas": 2, "maxReplicas": 6, "rowsWaitingPerPod": 16}}


def test_rollout_autoscaling_scales_the_rollout_statefulset_on_its_queue_depth(chart):
    from services import telemetry

    job = {**JOB, "rollout": {**JOB["rollout"], "elastic": True}}
    objects = rendered(chart, job=job, autoscaling=AUTOSCALED)
    (hpa,) = m.by_kind(objects, "HorizontalPodAutoscaler")
    rollout = pods(objects)["rollout"][0]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                            "name": rollout["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "16"}
    # the metric it scales on is one a rollout server exports
    exported = {f.name for c in [telemetry.EngineQueue(lambda: None)] for f in c.collect()}
    assert metric["pods"]["metric"]["name"] in exported
    assert "replicas" not in rollout["spec"]  # the HPA's count, not reset by a helm upgrade
    assert parse_job(job_text(objects), "/", check_files=False).rollout.num_engines == 2  # the job starts on minReplicas engines
    # without autoscaling: no HPA, and the StatefulSet has its count
    plain = rendered(chart)
    assert not m.by_kind(plain, "HorizontalPodAutoscaler") and pods(plain)["rollout"][0]["spec"]["replicas"] == 1


@pytest.mark.parametrize("overrides, message", [
    ({}, "job.rollout.elastic: autoscaling.rollouts scales the rollout pods"),
    ({"colocate": {"enabled": True, "gpuDeviceClass": "gpu.nvidia.com"}}, "autoscaling.rollouts: not with colocate.enabled"),
    ({"metrics": {"enabled": False}}, "autoscaling.rollouts: needs metrics.enabled"),
    ({"autoscaling": {"rollouts": {**AUTOSCALED["rollouts"], "minReplicas": 7}}},
     "autoscaling.rollouts.minReplicas: 7 is more than maxReplicas"),
])
def test_rollout_autoscaling_refuses_what_it_cannot_follow(chart, overrides, message):
    elastic = {} if not overrides else {"job": {**JOB, "rollout": {**JOB["rollout"], "elastic": True}}}
    refused(chart, message, **{"autoscaling": AUTOSCALED, **elastic, **overrides})


def test_rollout_pods_can_serve_their_callers_from_a_front_end_process(chart):
    """rollout.frontEnd process: `serve rollout --front-end=process` in rollout and colocated
    rollout containers, nothing else changed; inline (the default) passes nothing."""
    objects = rendered(chart, rollout={"frontEnd": "process"})
    workloads = pods(objects)
    assert _args(workloads["rollout"][0])["front-end"] == "process"
    assert "front-end" not in _args(workloads["trainer"][0])
    assert "front-end" not in _args(pods(rendered(chart))["rollout"][0])
    colocated = rendered(chart, rollout={"frontEnd": "process"}, colocate={"enabled": True, "gpuDeviceClass": "gpu.nvidia.com"})
    (rollout_container,) = [c for _, _, spec in m.pod_specs(colocated) for c in spec["containers"] if c["name"] == "rollout"]
    assert "--front-end=process" in rollout_container["args"]
    with pytest.raises(helm.HelmValuesError, match="frontEnd"):
        chart.render(values(rollout={"frontEnd": "separate"}), name=RELEASE, namespace=NAMESPACE)
