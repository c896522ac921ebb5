"""The kustomize base and overlays, built with `kubectl kustomize` and held to the chart's rules.

Skipped (with the reason) where kubectl is not installed.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.k8s import manifests as m

pytest.importorskip("kubernetes_validate")

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (needed for `kubectl kustomize`)"),
]

OVERLAYS = {"cpu-dev": "rlfleet-dev", "gpu": "rlfleet"}


def _kustomize(path) -> str:
    done = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@functools.cache
def _build(overlay: str) -> str:
    return _kustomize(m.ROOT / "deploy" / "k8s" / "overlays" / overlay)


def build(overlay: str) -> list[dict]:
    return m.load_all(_build(overlay))


# ids not equal to "gpu": a bare "gpu" keyword is how GPU-only tests are recognised (tests/gpu/conftest.py)
@pytest.fixture(scope="module", params=sorted(OVERLAYS), ids=lambda name: f"overlay-{name}")
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, build(request.param)


def test_overlay_validates_strictly_and_is_wired_like_the_chart(overlay):
    name, objects = overlay
    m.validate(objects)
    m.check_labels_and_selectors(objects)
    m.check_probes(objects)
    m.check_security(objects)
    m.check_rbac(objects)
    m.check_discovery_wiring(objects)
    m.check_token_from_secret(objects, "rlfleet-token")


def test_overlay_has_the_train_fleet_in_its_namespace(overlay):
    name, objects = overlay
    namespace = OVERLAYS[name]
    assert {o["metadata"].get("namespace") for o in objects} == {namespace}
    (binding,) = m.by_kind(objects, "RoleBinding")
    assert binding["subjects"][0]["namespace"] == namespace
    replicas = {w["metadata"]["labels"][m.COMPONENT]: w["spec"]["replicas"] for w in m.by_kind(objects, "StatefulSet")}
    assert set(replicas) == {"trainer", "critic", "rollout"}
    assert replicas["critic"] == 0  # PPO's critics run only with components/ppo
    coordinator = m.one(objects, "Deployment", "coordinator")
    args = m.container(coordinator)["args"]
    assert "--http-port=8080" in args and m.resolved_arg(coordinator, "instance") == "rlfleet"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in coordinator["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {pvc["metadata"]["name"] for pvc in m.by_kind(objects, "PersistentVolumeClaim")}


def test_only_the_gpu_overlay_asks_for_gpus_and_only_pods_with_gpus_run_cuda():
    for name in OVERLAYS:
        objects = build(name)
        for workload, meta, _ in m.pod_specs(objects):
            main = m.container(workload)
            gpus = main["resources"]["limits"].get("nvidia.com/gpu", 0)
            worker = meta["labels"][m.COMPONENT] in ("trainer", "critic", "rollout")
            assert gpus == (1 if name == "gpu" and worker else 0), (name, workload["metadata"]["name"])
            assert main["resources"]["requests"].get("nvidia.com/gpu", 0) == gpus
            # The coordinator keeps the CPU image in the gpu overlay; a pod without GPUs says void,
            # since the CUDA image's NVIDIA_VISIBLE_DEVICES=all would expose the node's GPUs.
            assert main["image"].endswith("-cuda" if gpus else "-cpu"), (name, workload["metadata"]["name"])
            env = {e["name"]: e.get("value") for e in main["env"]}
            assert env.get("NVIDIA_VISIBLE_DEVICES") == (None if gpus else "void"), (name, workload["metadata"]["name"])


def test_scratch_volumes_are_bounded_and_shm_fits_in_the_memory_limit():
    for name in (*OVERLAYS, "gpu-sglang"):
        for workload, meta, spec in m.pod_specs(build(name)):
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert volumes["tmp"]["emptyDir"]["sizeLimit"], (name, workload["metadata"]["name"])
            if "dshm" in volumes:
                limit = m.container(workload)["resources"]["limits"]["memory"]
                assert m.quantity(volumes["dshm"]["emptyDir"]["sizeLimit"]) <= m.quantity(limit), (name, meta["labels"])


# ---------------------------------------------------------------------------- another fleet, same namespace


def _relative(tmp_path, path) -> str:
    return os.path.relpath(path, tmp_path)  # kustomize refuses absolute roots


def _second_fleet(tmp_path, base_overlay: str | Path, instance: str) -> list[dict]:
    """The pattern docs/deploy.md gives: an overlay that sets the instance label once (with the
    selectors) and a name prefix, over an existing overlay (by name, or a directory)."""
    base = base_overlay if isinstance(base_overlay, Path) else m.ROOT / "deploy" / "k8s" / "overlays" / base_overlay
    target = _relative(tmp_path, base)
    (tmp_path / "kustomization.yaml").write_text(textwrap.dedent(f"""\
        apiVersion: kustomize.config.k8s.io/v1beta1
        kind: Kustomization
        resources: [{target}]
        namePrefix: {instance}-
        labels:
          - pairs: {{app.kubernetes.io/instance: {instance}}}
            includeSelectors: true
        """))
    return m.load_all(_kustomize(tmp_path))


@pytest.mark.parametrize("base_overlay", ["cpu-dev", "gpu"])
def test_a_second_fleet_in_the_namespace_sets_its_instance_once(tmp_path, base_overlay):
    first, second = build(base_overlay), _second_fleet(tmp_path, base_overlay, "team-b")
    m.validate(second)
    m.check_labels_and_selectors(second)
    m.check_discovery_wiring(second)  # --instance resolves to the coordinator pod's own label
    m.check_rbac(second)
    # One value everywhere: every object, every selector, every pod template, the coordinator's --instance.
    for obj in second:
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "team-b", obj["metadata"]["name"]
    for workload, meta, _ in m.pod_specs(second):
        assert meta["labels"]["app.kubernetes.io/instance"] == "team-b"
        assert workload["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "team-b"
    for service in m.by_kind(second, "Service"):
        assert service["spec"]["selector"]["app.kubernetes.io/instance"] == "team-b"
    assert m.resolved_arg(m.one(second, "Deployment", "coordinator"), "instance") == "team-b"
    # Applied beside the first fleet, nothing is overwritten and neither coordinator sees the other's pods.
    names = [{(o["kind"], o["metadata"]["name"]) for o in fleet} for fleet in (first, second)]
    assert not names[0] & names[1]
    assert {o["metadata"].get("namespace") for o in second} == {o["metadata"].get("namespace") for o in first}
    _assert_disjoint_discovery(first, second)


def _assert_disjoint_discovery(*fleets: list[dict]) -> None:
    from services.coordinator.k8s_discovery import KubernetesDiscoveryConfig
    from tests.k8s.emulator import selector_matches

    pods = [(i, meta["labels"]) for i, fleet in enumerate(fleets) for _, meta, _ in m.pod_specs(fleet)]
    for i, fleet in enumerate(fleets):
        instance = m.resolved_arg(m.one(fleet, "Deployment", "coordinator"), "instance")
        selector = KubernetesDiscoveryConfig(namespace="ns", instance=instance).label_selector
        seen = [(j, labels[m.COMPONENT]) for j, labels in pods if selector_matches(selector, labels)]
        assert sorted(seen) == [(i, "critic"), (i, "rollout"), (i, "trainer")], (instance, seen)


def test_the_sglang_overlay_runs_sglang_only_in_rollout_pods():
    objects = build("gpu-sglang")
    m.validate(objects)
    m.check_labels_and_selectors(objects)
    m.check_security(objects)
    rollout = m.one(objects, "StatefulSet", "rollout")
    assert m.container(rollout)["image"].endswith("-sglang")
    assert m.container(m.one(objects, "StatefulSet", "trainer"))["image"].endswith("-cuda")
    dshm = next(v for v in rollout["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert m.container(rollout)["resources"]["limits"]["nvidia.com/gpu"] == 1


# ---------------------------------------------------------------------------- PPO critics (components/ppo)


def _with_ppo(directory, base_overlay: str) -> list[dict]:
    """The overlay components/ppo documents: an existing overlay plus the component."""
    directory.mkdir(parents=True, exist_ok=True)
    overlay = _relative(directory, m.ROOT / "deploy" / "k8s" / "overlays" / base_overlay)
    component = _relative(directory, m.ROOT / "deploy" / "k8s" / "components" / "ppo")
    (directory / "kustomization.yaml").write_text(textwrap.dedent(f"""\
        apiVersion: kustomize.config.k8s.io/v1beta1
        kind: Kustomization
        resources: [{overlay}]
        components: [{component}]
        """))
    return m.load_all(_kustomize(directory))


@pytest.mark.parametrize("base_overlay", ["cpu-dev", "gpu"])
def test_the_ppo_component_runs_one_critic_wired_like_the_trainer(tmp_path, base_overlay):
    objects = _with_ppo(tmp_path, base_overlay)
    m.validate(objects)
    m.check_labels_and_selectors(objects)
    m.check_probes(objects)  # `serve trainer`, probed as rlfleet.v1.Trainer
    m.check_security(objects)
    m.check_rbac(objects)
    m.check_discovery_wiring(objects)  # the coordinator's selector takes the critic pod
    m.check_token_from_secret(objects, "rlfleet-token")
    critic, trainer = m.one(objects, "StatefulSet", "critic"), m.one(objects, "StatefulSet", "trainer")
    assert critic["spec"]["replicas"] == 1
    assert critic["metadata"]["namespace"] == trainer["metadata"]["namespace"] == OVERLAYS[base_overlay]
    # The instance label flows from the base's kustomization to the critic as to the trainer, and
    # equals what the coordinator reads of its own pod through the downward API.
    instance = m.resolved_arg(m.one(objects, "Deployment", "coordinator"), "instance")
    for workload in (critic, m.one(objects, "Service", "critic")):
        assert workload["metadata"]["labels"]["app.kubernetes.io/instance"] == instance
    assert critic["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == instance
    assert critic["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == instance
    # What the overlay gives the trainer, the critic gets: image, arguments, env, resources, placement, volumes.
    main, twin = m.container(critic), m.container(trainer)
    assert main["name"] == "critic" and main["args"][:2] == ["serve", "trainer"]
    for key in ("image", "args", "env", "resources", "volumeMounts", "ports"):
        assert main[key] == twin[key], key
    pod, twin_pod = critic["spec"]["template"]["spec"], trainer["spec"]["template"]["spec"]
    assert pod.get("tolerations") == twin_pod.get("tolerations") and pod["volumes"] == twin_pod["volumes"]
    # Everything else the overlay built is unchanged by the component.
    plain = {(o["kind"], o["metadata"]["name"]): o for o in build(base_overlay)}
    for obj in objects:
        if obj is not critic:
            assert plain[(obj["kind"], obj["metadata"]["name"])] == obj, obj["metadata"]["name"]


def test_a_second_ppo_fleet_relabels_its_critic_too(tmp_path):
    first = _with_ppo(tmp_path / "ppo", "cpu-dev")
    (tmp_path / "team-b").mkdir()
    second = _second_fleet(tmp_path / "team-b", tmp_path / "ppo", "team-b")
    m.validate(second)
    m.check_labels_and_selectors(second)
    m.check_discovery_wiring(second)
    critic = m.one(second, "StatefulSet", "critic")
    assert critic["metadata"]["name"] == critic["spec"]["serviceName"] == "team-b-rlfleet-critic"
    assert critic["spec"]["replicas"] == 1
    assert critic["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == "team-b"
    assert critic["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "team-b"
    _assert_disjoint_discovery(first, second)
