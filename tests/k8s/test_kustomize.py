"""The kustomize base and overlays, built with `kubectl kustomize` and held to the chart's rules.

Skipped (with the reason) where kubectl is not installed.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

import pytest

from tests.k8s import manifests as m

pytest.importorskip("kubernetes_validate")

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (needed for `kubectl kustomize`)"),
]

OVERLAYS = {"cpu-dev": "rlfleet-dev", "gpu": "rlfleet"}


@functools.cache
def _build(overlay: str) -> str:
    path = m.ROOT / "deploy" / "k8s" / "overlays" / overlay
    done = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


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
    assert {w["metadata"]["labels"][m.COMPONENT] for w in m.by_kind(objects, "StatefulSet")} == {"trainer", "rollout"}
    coordinator = m.one(objects, "Deployment", "coordinator")
    args = m.container(coordinator)["args"]
    assert {"--http-port=8080", "--instance=rlfleet"} <= set(args)
    claims = {v["persistentVolumeClaim"]["claimName"] for v in coordinator["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {pvc["metadata"]["name"] for pvc in m.by_kind(objects, "PersistentVolumeClaim")}


def test_only_the_gpu_overlay_asks_for_gpus():
    for name in OVERLAYS:
        objects = build(name)
        for workload, meta, _ in m.pod_specs(objects):
            resources = m.container(workload)["resources"]
            gpus = resources["limits"].get("nvidia.com/gpu", 0)
            worker = meta["labels"][m.COMPONENT] in ("trainer", "rollout")
            assert gpus == (1 if name == "gpu" and worker else 0), (name, workload["metadata"]["name"])
            assert resources["requests"].get("nvidia.com/gpu", 0) == gpus
            assert m.container(workload)["image"].endswith("-cuda" if name == "gpu" else "-cpu")


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
