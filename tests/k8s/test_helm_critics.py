"""Critic pods in the chart (issue #21, item 1): PPO's value model as a StatefulSet of trainer servers.

A PPO training job (algorithm.advantage: ppo) needs critics: `serve trainer` pods with the
trainer's arguments (checkpoint root on the shared volume, metrics and rendezvous ports, token)
that the coordinator finds by the component label critic. Each render is validated strictly
(manifests.validate), read back with the coordinator's own job loader (parse_job) and discovery
selector, and its NetworkPolicies evaluated rule by rule. Nothing here runs a cluster.
"""

from __future__ import annotations

import pytest

from services.coordinator.config import parse_job
from services.coordinator.k8s_discovery import KubernetesDiscoveryConfig
from tests.k8s import manifests as m
from tests.k8s.emulator import selector_matches
from tests.k8s.test_helm_chart import BASE, JOB, NAMESPACE, RELEASE, job_text, render, values
from tests.k8s.test_helm_hardening import admits, labels_of

helm = pytest.importorskip("helm_python")
pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.k8s

PPO = {**JOB, "algorithm": {"advantage": "ppo"}, "critic": {"value_clip": 0.3, "optimizer": {"lr": 2.0e-6}}}
SHARED = {"enabled": True, "existingClaim": "", "storageClass": "", "accessModes": ["ReadWriteMany"],
          "size": "100Gi", "mountPath": "/var/lib/rlfleet-shared"}
COLOCATE = {"enabled": True, "gpuDeviceClass": "gpu.nvidia.com"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def rendered(chart, **overrides) -> list[dict]:
    objects = render(chart, values(**overrides))
    m.validate(objects)
    m.check_labels_and_selectors(objects)
    m.check_probes(objects)  # a critic container is `serve trainer`, probed as rlfleet.v1.Trainer
    m.check_security(objects)
    m.check_token_from_secret(objects, BASE["token"]["existingSecret"])
    m.check_discovery_wiring(objects)  # the coordinator's selector takes critic pods, at their port
    return objects


def refused(chart, message: str, **overrides) -> None:
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values(**overrides), name=RELEASE, namespace=NAMESPACE)


def critics(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["metadata"].get("labels", {}).get(m.COMPONENT) == "critic"]


def ppo_values(**overrides) -> dict:
    settings = dict(mode="train", job=PPO, replicas={"trainers": 1, "rollouts": 1, "critics": 2},
                    sharedStorage=SHARED, gpusPerPod={"trainer": 1, "rollout": 1, "critic": 1})
    return {**settings, **overrides}


def ppo_fleet(chart, **overrides) -> list[dict]:
    return rendered(chart, **ppo_values(**overrides))


# ---------------------------------------------------------------------------- the pods


def test_a_ppo_release_lints_clean_in_strict_mode():
    for version in (f"v{v}.0" for v in m.k8s_versions()):
        report = helm.lint(str(m.CHART), values(**ppo_values()), strict=True, kube_version=version, namespace=NAMESPACE)
        assert report["errors"] == [] and [msg for msg in report["messages"] if msg["severity"] >= 2] == [], report


def test_a_ppo_job_gets_critic_pods_that_are_trainer_servers(chart):
    objects = ppo_fleet(chart)
    sts = m.one(objects, "StatefulSet", "critic")
    assert sts["metadata"]["name"] == "demo-rlfleet-critic" and sts["spec"]["replicas"] == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # ordinals are ranks; all start at once
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert {k: labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance", m.COMPONENT)} == labels_of("critic")
    main = m.container(sts)
    assert main["name"] == "critic" and main["args"][:2] == ["serve", "trainer"]
    assert {"--port=50051", "--checkpoint-root=/var/lib/rlfleet-shared", "--metrics-port=9400",
            "--rank-store-port=29400", "--weight-store-port=29401",
            "--token-file=/var/run/secrets/rlfleet/token"} <= set(main["args"])
    assert {p["name"]: p["containerPort"] for p in main["ports"]} == {
        "grpc": 50051, "metrics": 9400, "rank-store": 29400, "weight-store": 29401}
    assert main["readinessProbe"]["grpc"] == {"port": 50051, "service": "rlfleet.v1.Trainer"}
    # Same image variant and GPU wiring as a trainer with gpusPerPod 1.
    trainer = m.container(m.one(objects, "StatefulSet", "trainer"))
    assert main["image"] == trainer["image"] == "ghcr.io/rlfleet/rlfleet:0.1.0-cuda"
    assert main["resources"]["limits"]["nvidia.com/gpu"] == main["resources"]["requests"]["nvidia.com/gpu"] == 1
    spec = sts["spec"]["template"]["spec"]
    assert GPU_TOLERATION in spec["tolerations"]
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in main["env"]}
    # The critic's checkpoint (<checkpoint>/step-N/critic) goes to the shared volume, read-write.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {mt["mountPath"]: mt for mt in main["volumeMounts"]}
    shared = mounts["/var/lib/rlfleet-shared"]
    assert volumes[shared["name"]]["persistentVolumeClaim"] == {"claimName": "demo-rlfleet-shared"}
    assert not shared.get("readOnly")
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    assert volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]["readOnly"] is True
    service = m.one(objects, "Service", "critic")
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["name"] == sts["spec"]["serviceName"]
    budget = m.one(objects, "PodDisruptionBudget", "critic")
    assert budget["spec"]["maxUnavailable"] == 0  # a drained critic rank would fail the step


def test_the_rendered_ppo_job_asks_for_the_critic_pods_on_their_device(chart):
    objects = ppo_fleet(chart)
    job = parse_job(job_text(objects), "/", check_files=False)
    assert job.needs_critic and job.critic.num_critics == job.num_critics == 2  # from replicas.critics
    assert job.critic.device == "cuda" and job.critic.value_clip == 0.3 and job.critic.optimizer.lr == 2.0e-6
    # A CPU critic beside a GPU trainer: set explicitly, as the loader's default is the trainer's device.
    cpu = rendered(chart, mode="train", job=PPO, replicas={"trainers": 1, "rollouts": 1, "critics": 1},
                   gpusPerPod={"trainer": 1, "rollout": 0, "critic": 0})
    job = parse_job(job_text(cpu), "/", check_files=False)
    assert job.trainer.device == "cuda" and job.critic.device == "cpu" and job.critic.num_critics == 1
    critic = m.container(m.one(cpu, "StatefulSet", "critic"))
    assert critic["image"].endswith(":0.1.0-cpu") and "nvidia.com/gpu" not in critic["resources"]["limits"]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in critic["env"]
    # Fewer critics than pods is the job's choice.
    fewer = render(chart, values(mode="train", job={**PPO, "critic": {"num_critics": 1}},
                                 replicas={"trainers": 1, "rollouts": 1, "critics": 3}))
    assert parse_job(job_text(fewer), "/", check_files=False).critic.num_critics == 1


def test_no_critic_pods_by_default_nor_in_eval_mode(chart):
    assert not critics(rendered(chart, mode="train"))
    assert not critics(render(chart, {}))  # the chart's own defaults
    assert m.CHART.joinpath("values.yaml").read_text().count("\n  critics: 0\n") == 1
    # An eval never builds a critic: no pods even when replicas.critics is set, and no critic section.
    objects = rendered(chart, mode="eval", model={**BASE["model"], "format": "rlfleet"}, job=PPO,
                       replicas={"trainers": 1, "rollouts": 1, "critics": 2}, gpusPerPod={"trainer": 0, "rollout": 0, "critic": 1},
                       networkPolicy={"enabled": True, "coordinatorFrom": [], "metricsFrom": []},
                       metrics={"enabled": True, "port": 9400, "serviceMonitor": {"enabled": True}})
    assert not critics(objects)
    job = parse_job(job_text(objects), "/", check_files=False)
    assert job.eval_only and job.num_critics == 0
    assert "critic" not in m.load_all(job_text(objects))[0]


def test_critic_pods_serve_jobs_submitted_later_whatever_the_first_job(chart):
    """A GRPO job (or none) with replicas.critics: the pods stand by for PPO jobs from `rlfleet submit`."""
    grpo = rendered(chart, mode="train", replicas={"trainers": 1, "rollouts": 1, "critics": 1})
    assert m.one(grpo, "StatefulSet", "critic")["spec"]["replicas"] == 1
    assert "critic" not in m.load_all(job_text(grpo))[0]  # the GRPO job has no critic to size
    assert parse_job(job_text(grpo), "/", check_files=False).num_critics == 0
    idle = rendered(chart, mode="train", job={}, replicas={"trainers": 1, "rollouts": 1, "critics": 1})
    assert m.one(idle, "StatefulSet", "critic") and not m.by_kind(idle, "ConfigMap")


def test_critic_resources_scratch_and_placement_are_their_own_or_the_trainers(chart):
    trainer_res = {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"cpu": "16", "memory": "128Gi"}}
    objects = render(chart, values(**ppo_values(  # IPC_LOCK: check_security's strict default does not apply
        resources={"trainer": trainer_res, "critic": {"limits": {"cpu": "8", "memory": "32Gi"}}},
        scratch={"tmp": {"critic": "20Gi"}, "shm": {"critic": "8Gi"}},
        critic={"nodeSelector": {"pool": "critics"}, "podLabels": {"team": "rl"},
                "securityContext": {"capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}},
        trainer={"nodeSelector": {"pool": "trainers"}})))
    m.validate(objects)
    m.check_labels_and_selectors(objects)
    sts = m.one(objects, "StatefulSet", "critic")
    main, spec = m.container(sts), sts["spec"]["template"]["spec"]
    # requests from the trainer (the critic sets none), limits its own; GPUs from gpusPerPod.critic
    assert main["resources"]["requests"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 1}
    assert main["resources"]["limits"] == {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": 1}
    volumes = {v["name"]: v["emptyDir"] for v in spec["volumes"] if "emptyDir" in v}
    assert volumes == {"tmp": {"sizeLimit": "20Gi"}, "dshm": {"medium": "Memory", "sizeLimit": "8Gi"}}
    assert spec["nodeSelector"] == {"pool": "critics"}  # its own block, not the trainer's
    assert sts["spec"]["template"]["metadata"]["labels"]["team"] == "rl"
    assert main["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    # The /dev/shm check holds against the limit the critic pods actually get.
    refused(chart, r"scratch.shm.critic: 40Gi is more than resources.critic.limits.memory \(32Gi\)",
            mode="train", replicas={"trainers": 1, "rollouts": 1, "critics": 1},
            resources={"critic": {"limits": {"cpu": "8", "memory": "32Gi"}}}, scratch={"shm": {"critic": "40Gi"}})
    refused(chart, r"scratch.shm.critic: 40Gi is more than resources.trainer.limits.memory \(16Gi\)",
            mode="train", replicas={"trainers": 1, "rollouts": 1, "critics": 1}, scratch={"shm": {"critic": "40Gi"}})


def test_critics_are_scraped_by_their_own_service_monitor(chart):
    objects = ppo_fleet(chart, metrics={"enabled": True, "port": 9400, "serviceMonitor": {"enabled": True}})
    monitors = {o["metadata"]["labels"][m.COMPONENT]: o for o in m.by_kind(objects, "ServiceMonitor")}
    assert set(monitors) == {"coordinator", "trainer", "rollout", "critic"}
    (endpoint,) = monitors["critic"]["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert monitors["critic"]["spec"]["selector"]["matchLabels"] == m.one(objects, "Service", "critic")["spec"]["selector"]


# ---------------------------------------------------------------------------- network and discovery


def test_network_policies_let_the_coordinator_reach_critics_and_critics_each_other(chart):
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objects = ppo_fleet(chart, networkPolicy={"enabled": True, "coordinatorFrom": [], "metricsFrom": [monitoring]})
    coordinator, critic, trainer, rollout = (labels_of(c) for c in ("coordinator", "critic", "trainer", "rollout"))
    assert admits(objects, critic, 50051, coordinator)
    assert not admits(objects, critic, 29400, coordinator)
    assert not admits(objects, critic, 50051, labels_of("coordinator", instance="other"))
    # Critic ranks rendezvous on rank 0's store and open NCCL/gloo ports picked at run time.
    assert all(admits(objects, critic, port, critic) for port in (29400, 41234, 50051))
    assert not admits(objects, critic, 29400, labels_of("critic", instance="other"))
    # Critics exchange nothing with trainers or engines: weights sync from the actor only.
    for other in (trainer, rollout):
        assert not admits(objects, critic, 29400, other) and not admits(objects, other, 29400, critic)
    assert admits(objects, critic, 9400, monitoring) and not admits(objects, critic, 50051, monitoring)


def test_the_coordinators_discovery_takes_critic_pods_as_critics(chart):
    objects = ppo_fleet(chart)
    coordinator = m.container(m.one(objects, "Deployment", "coordinator"))
    assert "--discovery=kubernetes" in coordinator["args"] and f"--instance={RELEASE}" in coordinator["args"]
    selector = KubernetesDiscoveryConfig(namespace=NAMESPACE, instance=RELEASE).label_selector
    labels = m.one(objects, "StatefulSet", "critic")["spec"]["template"]["metadata"]["labels"]
    assert selector_matches(selector, labels)
    assert not selector_matches(KubernetesDiscoveryConfig(namespace=NAMESPACE, instance="other").label_selector, labels)


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"job": PPO}, r"replicas.critics: 0, but job.algorithm.advantage is ppo, which trains a value model on critic pods"),
        ({"job": {**PPO, "critic": {"num_critics": 3}}, "replicas": {"trainers": 1, "rollouts": 1, "critics": 2}},
         r"job.critic.num_critics: 3 is more than replicas.critics \(2\)"),
        ({"job": {**PPO, "critic": {"device": "cuda"}}, "replicas": {"trainers": 1, "rollouts": 1, "critics": 1}},
         r"job.critic.device: cuda, but gpusPerPod.critic is 0: critic pods have no GPU"),
        ({"job": {**PPO, "critic": {"device": "cpu"}}, "replicas": {"trainers": 1, "rollouts": 1, "critics": 1},
          "gpusPerPod": {"trainer": 0, "rollout": 0, "critic": 1}},
         r"job.critic.device: cpu, but gpusPerPod.critic is 1: a critic pod's GPU would idle"),
        ({"job": PPO, "colocate": COLOCATE},
         r"job.algorithm.advantage: ppo runs critic pods, which the chart does not run beside colocated trainers"),
        ({"colocate": COLOCATE, "replicas": {"trainers": 1, "rollouts": 1, "critics": 1}},
         r"replicas.critics: 1 with colocate.enabled: the chart does not run critics beside colocated trainers"),
        ({"resources": {"critic": {"limits": {"nvidia.com/gpu": 1}}}, "replicas": {"trainers": 1, "rollouts": 1, "critics": 1}},
         r"resources.critic.limits: nvidia.com/gpu: GPUs come from gpusPerPod .* set gpusPerPod.critic"),
    ],
    ids=["ppo-without-critics", "more-critics-than-pods", "cuda-critic-without-gpu", "cpu-critic-with-gpu",
         "ppo-colocated", "critics-colocated", "gpu-in-resources"],
)
def test_contradictory_critic_settings_are_refused(chart, overrides, message):
    refused(chart, message, **{"mode": "train", **overrides})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"replicas": {"trainers": 1, "rollouts": 1, "critics": -1}}, r"/replicas/critics"),
        ({"gpusPerPod": {"trainer": 0, "rollout": 0, "critic": 2}}, r"/gpusPerPod/critic"),
        ({"critic": {"nodeSelectr": {}}}, r"/critic.*additional propert.*'nodeSelectr'"),
        ({"resources": {"critic": {"limit": {}}}}, r"/resources/critic.*additional propert.*'limit'"),
    ],
    ids=["negative-critics", "two-gpus", "critic-block-typo", "critic-resources-typo"],
)
def test_schema_rejects_invalid_critic_values(chart, overrides, message):
    with pytest.raises(helm.HelmValuesError, match=message):
        chart.render(values(**overrides), name=RELEASE, namespace=NAMESPACE)
