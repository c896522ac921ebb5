"""Worker pods beyond the plain StatefulSets (issue #20, items 4 and 8): an eval's workers as
per-revision Indexed Jobs that exit when the eval ends, and colocated trainer+engine pods.

Every render is validated strictly (manifests.validate: the oldest and newest schemas the chart
supports, the newest only for objects of an API younger than the chart's floor, such as a DRA
ResourceClaimTemplate) and read back with the coordinator's own job loader and discovery selector.
What the Job controller, the device plugin or a DRA driver do with these objects is not run here.
"""

from __future__ import annotations

import random

import pytest

from services.coordinator.config import parse_job
from services.coordinator.discovery import rank_key
from services.coordinator.k8s_discovery import KubernetesDiscoveryConfig
from tests.k8s import manifests as m
from tests.k8s.emulator import selector_matches
from tests.k8s.test_helm_chart import BASE, JOB, NAMESPACE, RELEASE, job_text, values

helm = pytest.importorskip("helm_python")
pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.k8s

RLFLEET = {**BASE["model"], "format": "rlfleet"}
REVISION = "rlfleet.dev/revision"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def rendered(chart, revision: int = 1, **overrides) -> list[dict]:
    text = chart.render(values(**overrides), name=RELEASE, namespace=NAMESPACE, revision=revision,
                        is_upgrade=revision > 1)
    objects = [o for path, t in sorted(text.items()) if not path.endswith("NOTES.txt") for o in m.load_all(t)]
    m.validate(objects)
    m.check_labels_and_selectors(objects)
    m.check_probes(objects)
    m.check_security(objects)
    m.check_token_from_secret(objects, BASE["token"]["existingSecret"])
    m.check_discovery_wiring(objects)
    return objects


def refused(chart, message: str, **overrides) -> None:
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values(**overrides), name=RELEASE, namespace=NAMESPACE)


def coordinator_args(objects: list[dict]) -> list[str]:
    (coordinator,) = [w for w, meta, _ in m.pod_specs(objects) if meta["labels"][m.COMPONENT] == "coordinator"]
    return m.container(coordinator)["args"]


def env(main: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in main["env"]}


# ---------------------------------------------------------------------------- eval workers as Jobs


def test_eval_workers_are_indexed_jobs_of_the_revision_that_exit_when_the_eval_ends(chart):
    objects = rendered(chart, revision=3, mode="eval", model=RLFLEET, replicas={"trainers": 2, "rollouts": 3})
    assert not m.by_kind(objects, "StatefulSet")
    eval_job = m.one(objects, "Job", "coordinator")
    for role, replicas in (("trainer", 2), ("rollout", 3)):
        job = m.one(objects, "Job", role)
        spec = job["spec"]
        assert job["metadata"]["name"] == f"demo-rlfleet-eval-3-{role}"
        assert job["metadata"]["labels"][REVISION] == "3"
        assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == replicas
        assert spec["ttlSecondsAfterFinished"] == eval_job["spec"]["ttlSecondsAfterFinished"]
        assert spec["activeDeadlineSeconds"] == eval_job["spec"]["activeDeadlineSeconds"]
        # A drained worker (DisruptionTarget) is replaced without counting; any other failure
        # fails the Job at once, so no pod outlives the eval waiting for a Shutdown.
        assert spec["backoffLimit"] == 0
        assert spec["podFailurePolicy"]["rules"] == [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onPodConditions": [], "onExitCodes": {"operator": "NotIn", "values": [0]}},
        ]
        template = spec["template"]
        assert template["metadata"]["labels"][REVISION] == "3"
        assert template["metadata"]["labels"][m.COMPONENT] == role
        assert template["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
        main = m.container(job)
        assert "--exit-code-on-signal=143" in main["args"]  # drained: failed, so replaced, never "done"
        assert "readinessProbe" in main  # discovery hands out Ready pods only
    args = coordinator_args(objects)
    assert {"--revision=3", "--stop-workers-on-finish", "--exit-on-finish", "--eval-trainers=2"} <= set(args)
    assert eval_job["spec"]["template"]["metadata"]["labels"][REVISION] == "3"
    # The headless Services stay (the ServiceMonitors scrape through them), per component, not per revision.
    assert {s["metadata"]["name"] for s in m.by_kind(objects, "Service")} == {"demo-rlfleet-trainer", "demo-rlfleet-rollout"}


def test_an_eval_discovers_only_its_own_revisions_workers(chart):
    old, new = (rendered(chart, revision=r, mode="eval", model=RLFLEET) for r in (1, 2))

    def selector(objects: list[dict]) -> str:
        revision = m.arg(m.container(m.one(objects, "Job", "coordinator")), "revision")
        return KubernetesDiscoveryConfig(namespace=NAMESPACE, instance=RELEASE, revision=revision).label_selector

    def worker_labels(objects: list[dict]) -> list[dict]:
        return [meta["labels"] for _, meta, _ in m.pod_specs(objects) if meta["labels"][m.COMPONENT] in m.WORKERS]

    assert worker_labels(old) and worker_labels(new)
    assert all(selector_matches(selector(new), labels) for labels in worker_labels(new))
    assert not any(selector_matches(selector(new), labels) for labels in worker_labels(old))  # still exiting


def test_indexed_job_pod_names_sort_into_index_order():
    """Pods of an Indexed Job are named <job>-<index>-<5 random characters> (the controller keeps the
    index even when it shortens a long job name); discovery's natural order must be index order,
    whatever digits the revision and the random suffix hold."""
    rng = random.Random(20)
    alphabet = "bcdfghjklmnpqrstvwxz2456789"  # the API server's generateName alphabet
    for job in ("demo-rlfleet-eval-3-trainer", "demo-rlfleet-eval-12-rollout", "r2d2-rlfleet-eval-100-colocated"):
        names = [f"{job}-{index}-{''.join(rng.choice(alphabet) for _ in range(5))}" for index in range(23)]
        shuffled = rng.sample(names, len(names))
        assert sorted(shuffled, key=rank_key) == names


def test_a_worker_hostname_over_63_characters_is_refused(chart):
    with pytest.raises(helm.HelmError, match="fullnameOverride: the eval worker Job .* longer than 63 characters"):
        chart.render(values(mode="eval", fullnameOverride="x" * 40, replicas={"trainers": 0, "rollouts": 10}),
                     name=RELEASE, namespace=NAMESPACE, revision=10**7, is_upgrade=True)


def test_eval_workers_keep_budgets_the_eviction_api_honours_for_job_pods(chart):
    objects = rendered(chart, mode="eval", model=RLFLEET, replicas={"trainers": 2, "rollouts": 3})
    budgets = {p["metadata"]["labels"][m.COMPONENT]: p["spec"] for p in m.by_kind(objects, "PodDisruptionBudget")}
    assert budgets["trainer"]["minAvailable"] == 2 and "maxUnavailable" not in budgets["trainer"]
    assert budgets["rollout"]["minAvailable"] == 2  # rolloutMaxUnavailable 1 of 3
    assert budgets["coordinator"]["minAvailable"] == 1


def test_train_mode_keeps_its_statefulsets(chart):
    objects = rendered(chart, mode="train", replicas={"trainers": 2, "rollouts": 3})
    assert sorted(j["metadata"]["labels"][m.COMPONENT] for j in m.by_kind(objects, "StatefulSet")) == ["rollout", "trainer"]
    assert not m.by_kind(objects, "Job")
    for workload, meta, spec in m.pod_specs(objects):
        assert REVISION not in meta["labels"] and "restartPolicy" not in spec
        assert not any(a.startswith(("--exit-code-on-signal", "--revision", "--stop-workers", "--colocated"))
                       for a in m.container(workload)["args"])


# ---------------------------------------------------------------------------- colocated pods


def _colocated(objects: list[dict], kind: str = "StatefulSet") -> tuple[dict, dict[str, dict], dict]:
    workload = m.one(objects, kind, "colocated")
    return workload, {c["name"]: c for c in m.containers(workload)}, workload["spec"]["template"]["spec"]


def test_colocated_pods_run_a_trainer_and_an_engine_sharing_dev_shm(chart):
    objects = rendered(chart, mode="train", colocate={"enabled": True, "gpuDeviceClass": "gpu.nvidia.com"},
                       replicas={"trainers": 2, "rollouts": 1})
    assert not [w for w in m.by_kind(objects, "StatefulSet") if w["metadata"]["labels"][m.COMPONENT] != "colocated"]
    workload, containers, spec = _colocated(objects)
    assert workload["metadata"]["name"] == "demo-rlfleet-colocated" and workload["spec"]["replicas"] == 2
    assert workload["spec"]["template"]["metadata"]["labels"][m.COMPONENT] == "colocated"
    assert list(containers) == ["trainer", "rollout"]
    assert containers["trainer"]["args"][:2] == ["serve", "trainer"] and m.arg(containers["trainer"], "port") == "50051"
    assert containers["rollout"]["args"][:2] == ["serve", "rollout"] and m.arg(containers["rollout"], "port") == "50052"
    ports = {p["name"]: p["containerPort"] for c in containers.values() for p in c["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9400, "grpc-rollout": 50052, "metrics-rollout": 9401,
                     "rank-store": 29400, "weight-store": 29401}
    for name, main in containers.items():
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert main[probe]["grpc"]["port"] == int(m.arg(main, "port")), (name, probe)
    # One memory-backed /dev/shm for both (the shm plane, the offloaded trainer's host copy), a /tmp each.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {name: {mt["mountPath"]: mt["name"] for mt in main["volumeMounts"]} for name, main in containers.items()}
    assert mounts["trainer"]["/dev/shm"] == mounts["rollout"]["/dev/shm"] == "dshm"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert mounts["trainer"]["/tmp"] != mounts["rollout"]["/tmp"]
    assert "shareProcessNamespace" not in spec  # no GPU, no CUDA IPC: nothing more is shared
    service = m.one(objects, "Service", "colocated")
    # the Service names the ports clients dial; the rendezvous stores are reached by pod IP
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        k: v for k, v in ports.items() if k not in ("rank-store", "weight-store")}

    args = coordinator_args(objects)
    assert "--colocated-rollout-port=50052" in args and "--worker-port=50051" in args
    job = parse_job(job_text(objects), "/", check_files=False)
    assert job.trainer.colocate and job.trainer.num_trainers == 2 and job.rollout.num_engines == 2
    assert job.trainer.device == "cpu" and job.rollout.devices == ("cpu",)
    budgets = {p["metadata"]["labels"][m.COMPONENT]: p["spec"] for p in m.by_kind(objects, "PodDisruptionBudget")}
    assert set(budgets) == {"coordinator", "colocated"} and budgets["colocated"]["maxUnavailable"] == 0


def test_a_colocated_gpu_pod_claims_one_gpu_for_both_containers(chart):
    objects = rendered(chart, mode="train", colocate={"enabled": True, "gpuDeviceClass": "gpu.nvidia.com"},
                       gpusPerPod={"trainer": 1, "rollout": 1})
    assert m.validation_versions(objects) == tuple(v for v in m.k8s_versions() if m._minor(v) >= (1, 34))
    (template,) = m.by_kind(objects, "ResourceClaimTemplate")
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 1}
    _, containers, spec = _colocated(objects)
    assert spec["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": template["metadata"]["name"]}]
    for main in containers.values():  # the same claim in both: the same GPU, seen by both
        assert main["resources"]["claims"] == [{"name": "gpu"}]
        assert not any(k.endswith("/gpu") for kind in ("requests", "limits") for k in main["resources"][kind])
        assert main["image"].endswith(":0.1.0-cuda") and "NVIDIA_VISIBLE_DEVICES" not in env(main)
    assert spec["shareProcessNamespace"] is True  # CUDA IPC: the importer must see the exporting process
    assert GPU_TOLERATION in spec["tolerations"]
    job = parse_job(job_text(objects), "/", check_files=False)
    assert job.trainer.colocate and job.trainer.device == "cuda" and job.rollout.devices == ("cuda",)


def test_a_colocated_eval_runs_its_pods_as_an_indexed_job(chart):
    objects = rendered(chart, revision=2, mode="eval", model=RLFLEET,
                       colocate={"enabled": True, "gpuDeviceClass": "gpu.nvidia.com"}, replicas={"trainers": 2, "rollouts": 1})
    job, containers, spec = _colocated(objects, "Job")
    assert job["metadata"]["name"] == "demo-rlfleet-eval-2-colocated" and job["spec"]["completions"] == 2
    assert job["spec"]["template"]["metadata"]["labels"][REVISION] == "2" and spec["restartPolicy"] == "Never"
    assert all("--exit-code-on-signal=143" in main["args"] for main in containers.values())
    assert {"--colocated-rollout-port=50052", "--revision=2", "--stop-workers-on-finish"} <= set(coordinator_args(objects))
    budgets = {p["metadata"]["labels"][m.COMPONENT]: p["spec"] for p in m.by_kind(objects, "PodDisruptionBudget")}
    assert budgets["colocated"]["minAvailable"] == 2


def test_colocated_pods_admit_the_coordinator_on_both_ports_and_are_scraped_twice(chart):
    objects = rendered(chart, mode="train", colocate={"enabled": True, "gpuDeviceClass": "gpu.nvidia.com"},
                       networkPolicy={"enabled": True, "coordinatorFrom": [], "metricsFrom": []},
                       metrics={"enabled": True, "port": 9400, "serviceMonitor": {"enabled": True}})
    policy = m.one(objects, "NetworkPolicy", "colocated")
    from_coordinator, from_peers = policy["spec"]["ingress"]
    assert from_coordinator["ports"] == [{"port": 50051, "protocol": "TCP"}, {"port": 50052, "protocol": "TCP"}]
    (peers,) = from_peers["from"][0]["podSelector"]["matchExpressions"]
    assert "colocated" in peers["values"]
    monitor = m.one(objects, "ServiceMonitor", "colocated")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics", "metrics-rollout"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mode": "eval"}, "colocate.enabled: an eval of a Hugging Face checkpoint needs no trainers"),
        ({"gpusPerPod": {"trainer": 1, "rollout": 0}}, r"gpusPerPod.rollout: 0, but colocate.enabled gives the engine its trainer's GPU"),
        ({"job": {**JOB, "trainer": {"colocate": False}}}, "job.trainer.colocate: false, but colocate.enabled"),
        ({"job": {**JOB, "rollout": {"num_engines": 2}}}, r"job.rollout.num_engines: 2 is more than replicas.trainers \(1\)"),
    ],
    ids=["hf-eval", "gpu-mismatch", "job-says-not-colocated", "more-engines-than-pods"],
)
def test_contradictory_colocate_settings_are_refused(chart, overrides, message):
    refused(chart, message, **{"mode": "train", "colocate": {"enabled": True, "gpuDeviceClass": "gpu.nvidia.com"}, **overrides})


def test_trainers_listen_for_rendezvous_on_declared_ports(chart):
    objects = rendered(chart, mode="train", replicas={"trainers": 2, "rollouts": 1})
    trainer = m.container(m.one(objects, "StatefulSet", "trainer"))
    assert {"--rank-store-port=29400", "--weight-store-port=29401"} <= set(trainer["args"])
    assert {(p["name"], p["containerPort"]) for p in trainer["ports"]} >= {("rank-store", 29400), ("weight-store", 29401)}
    rollout = m.container(m.one(objects, "StatefulSet", "rollout"))
    assert not any(a.startswith("--rank-store-port") for a in rollout["args"])
