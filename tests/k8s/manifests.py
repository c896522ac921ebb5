"""Checks shared by the Helm chart and kustomize tests: schema validity and the wiring that matters.

Each `check_*` takes the list of rendered objects and asserts one property across all of them, so
the chart and the plain manifests are held to the same rules.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "k8s" / "helm" / "rlfleet"
SERVICE_NAMES = {"coordinator": "rlfleet.v1.Coordinator", "trainer": "rlfleet.v1.Trainer", "rollout": "rlfleet.v1.Rollout",
                 "environment": "rlfleet.v1.Environment"}
WORKLOADS = ("Deployment", "StatefulSet", "Job")
COMPONENT = "app.kubernetes.io/component"
# Worker pod components: a colocated pod runs a trainer and a rollout engine, one container each; a
# critic pod (PPO's value model) runs a trainer server, which the coordinator configures as a critic.
WORKERS = ("trainer", "rollout", "colocated", "critic")
COMPONENTS = (*SERVICE_NAMES, "colocated", "critic")
SERVERS = {"critic": "trainer"}  # a container's `rlfleet serve` command, where it is not its name


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"v?(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


@functools.cache
def chart_min_k8s() -> tuple[int, int]:
    """The oldest Kubernetes the chart installs on: its Chart.yaml `kubeVersion: ">=1.27.0-0"`."""
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    constraint = meta["kubeVersion"]
    assert re.fullmatch(r">=\s*\d+\.\d+(\.\d+)?(-0)?", constraint), f"update chart_min_k8s for {constraint!r}"
    return _minor(constraint.lstrip(">= "))


@functools.cache
def k8s_versions() -> tuple[str, ...]:
    """The oldest and the newest schema versions kubernetes-validate ships, the oldest raised to the
    chart's kubeVersion floor (Helm refuses to install the chart below it, so older schemas would
    hold it to APIs it never meets)."""
    import kubernetes_validate

    shipped = sorted({_minor(v) for v in kubernetes_validate.utils.all_versions()})
    supported = [v for v in shipped if v >= chart_min_k8s()]
    assert supported, f"kubernetes-validate ships no schema >= {chart_min_k8s()}"
    return tuple(dict.fromkeys(f"{major}.{minor}" for major, minor in (supported[0], supported[-1])))


def load_all(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


# Custom resources of CRDs kubernetes-validate has no schema for: tests check their shape directly.
UNVALIDATED_GROUPS = ("monitoring.coreos.com",)


def validated(obj: dict[str, Any]) -> bool:
    return obj["apiVersion"].partition("/")[0] not in UNVALIDATED_GROUPS or "/" not in obj["apiVersion"]


# Objects of an API younger than the chart's floor, and the release that made it GA: the chart
# renders them only where the cluster serves that API (it checks .Capabilities.APIVersions).
LATER_APIS = {"resource.k8s.io/v1": (1, 34)}


def validation_versions(objects: list[dict[str, Any]]) -> tuple[str, ...]:
    """k8s_versions, less those older than an API some object needs (LATER_APIS)."""
    floor = max((LATER_APIS.get(o["apiVersion"], (0, 0)) for o in objects), default=(0, 0))
    versions = tuple(v for v in k8s_versions() if _minor(v) >= floor)
    assert versions, f"no schema of Kubernetes >= {floor} to validate against"
    return versions


@functools.cache
def _schema_contents() -> Any:
    """kubernetes-validate's schema reader, remembering what it parsed: the stock one parses the
    multi-megabyte definitions file again for every object, most of these tests' time. The
    schemas are only read, so one parsed copy serves every validation of the session."""
    from kubernetes_validate import utils

    return functools.cache(utils.schema_contents)


def validate(objects: list[dict[str, Any]], versions: tuple[str, ...] | None = None) -> None:
    """Strict validation against `versions` (default: validation_versions, the oldest and newest
    schemas the chart supports, raised to the release of any later API the objects use)."""
    from unittest import mock

    import kubernetes_validate
    from kubernetes_validate import utils

    read = _schema_contents()
    with mock.patch.object(utils, "schema_contents", read):
        for version in versions or validation_versions(objects):
            for obj in filter(validated, objects):
                try:
                    kubernetes_validate.validate(obj, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    path = ".".join(str(p) for p in e.path)
                    raise AssertionError(
                        f"{obj['kind']}/{obj['metadata']['name']} (k8s {version}) at {path}: {e.message}") from e


_UNITS = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity ("4Gi", "500m", 1024) as a number."""
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * _UNITS[unit]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str, component: str) -> dict:
    found = [o for o in by_kind(objects, kind) if o["metadata"].get("labels", {}).get(COMPONENT) == component]
    assert len(found) == 1, f"expected one {kind} of component {component}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_specs(objects: list[dict]) -> Iterator[tuple[dict, dict, dict]]:
    """(workload, pod template metadata, pod spec) for every Deployment, StatefulSet and Job."""
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            template = obj["spec"]["template"]
            yield obj, template["metadata"], template["spec"]


def container(workload: dict) -> dict:
    (main,) = workload["spec"]["template"]["spec"]["containers"]
    return main


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def arg(main: dict, name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in main["args"] if a.startswith(f"--{name}=")]
    return value


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------------------- the checks


def check_labels_and_selectors(objects: list[dict]) -> None:
    templates = []
    for workload, meta, _ in pod_specs(objects):
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "rlfleet"
        assert labels["app.kubernetes.io/component"] in COMPONENTS
        assert labels.get("app.kubernetes.io/instance")
        if workload["kind"] != "Job":  # a Job's selector is generated by the API server
            selector = workload["spec"]["selector"]["matchLabels"]
            assert set(selector) == {"app.kubernetes.io/name", "app.kubernetes.io/instance", COMPONENT}
            assert selects(selector, labels), workload["metadata"]["name"]
        templates.append((workload, labels))
    for service in by_kind(objects, "Service"):
        chosen = [w for w, labels in templates if selects(service["spec"]["selector"], labels)]
        component = service["metadata"]["labels"][COMPONENT]
        assert [w["metadata"]["labels"][COMPONENT] for w in chosen] == [component], service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            named = {p["name"]: p["containerPort"] for c in containers(chosen[0]) for p in c["ports"]}
            assert port["targetPort"] in named, f"{service['metadata']['name']} targets unknown port {port['targetPort']}"
            assert named[port["targetPort"]] == port["port"], service["metadata"]["name"]
    for sts in by_kind(objects, "StatefulSet"):
        headless = [s for s in by_kind(objects, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"]]
        assert headless and headless[0]["spec"]["clusterIP"] == "None", sts["metadata"]["name"]


def check_probes(objects: list[dict]) -> None:
    """Every container's probes ask its own server (its --port, its gRPC service); every worker
    container has a readiness probe (discovery hands out Ready pods only), Job or not."""
    for workload, meta, _ in pod_specs(objects):
        component = meta["labels"][COMPONENT]
        if component == "coordinator" and workload["kind"] == "Deployment":
            assert {p["name"]: p["containerPort"] for p in container(workload)["ports"]}["http"] == 8080
        for main in containers(workload):
            role = component if component != "colocated" else main["name"]
            role = SERVERS.get(role, role)
            port = int(arg(main, "port"))
            assert main["args"][:2] == ["serve", role], workload["metadata"]["name"]
            grpc = [p for p in main["ports"] if p["name"].startswith("grpc")]
            assert [p["containerPort"] for p in grpc] == [port]
            assert port == 50051 or component == "colocated"
            readiness = component != "coordinator" or workload["kind"] != "Job"
            kinds = ["startupProbe", "livenessProbe"] + (["readinessProbe"] if readiness else [])
            tls = any(a.startswith("--tls-cert") for a in main["args"])  # the kubelet's gRPC probes speak plaintext
            for kind in kinds:
                probe = main[kind]
                expected = {"tcpSocket": {"port": port}} if tls else {"grpc": {"port": port, "service": SERVICE_NAMES[role]}}
                assert {k: probe[k] for k in expected if k in probe} == expected, (workload["metadata"]["name"], kind)
            assert main["startupProbe"]["periodSeconds"] * main["startupProbe"]["failureThreshold"] >= 300


def check_security(objects: list[dict]) -> None:
    for workload, _, spec in pod_specs(objects):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        for main in containers(workload):
            ctx = main["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["capabilities"] == {"drop": ["ALL"]}
            mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
            volumes = {v["name"]: v for v in spec["volumes"]}
            assert "emptyDir" in volumes[mounts["/tmp"]], "a writable /tmp on a read-only root"
            assert all(r in main["resources"].get(kind, {}) for kind in ("requests", "limits") for r in ("cpu", "memory"))


def check_token_from_secret(objects: list[dict], secret: str) -> None:
    for workload, _, spec in pod_specs(objects):
        for main in containers(workload):
            token_args = [a for a in main["args"] if a.startswith("--token-file=")]
            assert token_args == ["--token-file=/var/run/secrets/rlfleet/token"], workload["metadata"]["name"]
            mounts = {m["name"]: m for m in main["volumeMounts"]}
            volumes = {v["name"]: v for v in spec["volumes"]}
            (name,) = [n for n, v in volumes.items() if "secret" in v]
            assert volumes[name]["secret"]["secretName"] == secret
            assert mounts[name]["mountPath"] == "/var/run/secrets/rlfleet" and mounts[name]["readOnly"] is True
            assert not any("token" in e["name"].lower() and "value" in e for e in main.get("env", []))


def check_rbac(objects: list[dict]) -> None:
    (role,) = by_kind(objects, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    (binding,) = by_kind(objects, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    (account,) = by_kind(objects, "ServiceAccount")
    assert binding["subjects"][0]["kind"] == "ServiceAccount"
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    for workload, meta, spec in pod_specs(objects):
        if meta["labels"][COMPONENT] == "coordinator":
            assert spec["serviceAccountName"] == account["metadata"]["name"]
        else:  # workers never talk to the API server
            assert spec["automountServiceAccountToken"] is False


def resolved_arg(workload: dict, name: str) -> str:
    """The value of `--name=...` as the container sees it: a `$(VAR)` reference is expanded from the
    container's env, including a downward-API reference to one of the pod's own labels."""
    main = container(workload)
    (value,) = [a.split("=", 1)[1] for a in main["args"] if a.startswith(f"--{name}=")]
    labels = workload["spec"]["template"]["metadata"]["labels"]

    def expand(match: re.Match) -> str:
        (var,) = [e for e in main.get("env", []) if e["name"] == match[1]]
        if "value" in var:
            return var["value"]
        field = var["valueFrom"]["fieldRef"]["fieldPath"]
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", field)
        assert label, f"--{name} refers to {field}, which this check cannot resolve"
        return labels[label[1]]

    return re.sub(r"\$\((\w+)\)", expand, value)


def check_discovery_wiring(objects: list[dict], namespace_arg: str = "--namespace=$(POD_NAMESPACE)") -> None:
    """The coordinator discovers exactly the worker pods of its own release (and, given
    --revision, of its own revision), at the ports their containers serve on."""
    from services.coordinator.k8s_discovery import KubernetesDiscoveryConfig
    from tests.k8s.emulator import selector_matches

    (coordinator,) = [w for w, meta, _ in pod_specs(objects) if meta["labels"][COMPONENT] == "coordinator"]
    main = container(coordinator)
    args = dict(re.match(r"--([\w-]+)=(.*)", a).groups() for a in main["args"] if a.startswith("--") and "=" in a)
    args["instance"] = resolved_arg(coordinator, "instance")
    assert args["instance"] == coordinator["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"]
    assert "--discovery=kubernetes" in main["args"] and namespace_arg in main["args"]
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in main["env"]
    assert args["db"] == "/var/lib/rlfleet/jobs.db"
    mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
    assert "/var/lib/rlfleet" in mounts
    cfg = KubernetesDiscoveryConfig(namespace="ns", instance=args["instance"], port=int(args["worker-port"]),
                                    colocated_rollout_port=int(args.get("colocated-rollout-port", 50052)),
                                    revision=args.get("revision", ""))
    for workload, meta, _ in pod_specs(objects):
        role = meta["labels"][COMPONENT]
        assert selector_matches(cfg.label_selector, meta["labels"]) == (role in WORKERS), role
        if role in WORKERS:  # the ports discovery hands out are the ones the containers serve
            served = {c["name"]: int(arg(c, "port")) for c in containers(workload)}
            if role == "colocated":
                assert served == {"trainer": cfg.port, "rollout": cfg.colocated_rollout_port}
            else:
                assert served == {role: cfg.port}
