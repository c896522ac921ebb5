"""The chart's network, security, metrics, memory and image settings (issue #20, second part).

Each render is validated strictly against the oldest and newest Kubernetes schemas the chart
supports; ServiceMonitors (a CRD kubernetes-validate has no schema for) are checked field by
field here instead. NetworkPolicies are checked by evaluating them: which pod may open which port
on which other pod. Nothing here runs a cluster, a CNI or Prometheus.
"""

from __future__ import annotations

import re

import pytest

from tests.k8s import constraints
from tests.k8s import manifests as m
from tests.k8s.test_helm_chart import JOB, NAMESPACE, RELEASE, render, values

helm = pytest.importorskip("helm_python")
pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.k8s

MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
CLIENTS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ci"}}}
TLS = {"existingSecret": "rlfleet-tls", "clientAuth": True, "serverName": "rlfleet"}


def rendered(chart, **overrides) -> list[dict]:
    objects = render(chart, values(**overrides))
    m.validate(objects)
    m.check_labels_and_selectors(objects)
    m.check_probes(objects)
    return objects


def refused(chart, message: str, **overrides) -> None:
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values(**overrides), name=RELEASE, namespace=NAMESPACE)


def pods(objects: list[dict]) -> dict[str, tuple[dict, dict, dict]]:
    return {meta["labels"][m.COMPONENT]: (w, meta, spec) for w, meta, spec in m.pod_specs(objects)}


def labels_of(component: str, instance: str = RELEASE) -> dict[str, str]:
    return {"app.kubernetes.io/name": "rlfleet", "app.kubernetes.io/instance": instance, m.COMPONENT: component}


# ---------------------------------------------------------------------------- network policies


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    if not m.selects(selector.get("matchLabels", {}), labels):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr  # all this chart uses
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def admits(objects: list[dict], target: dict[str, str], port: int, source: dict | None = None) -> bool:
    """Whether a TCP connection to `port` of a pod labelled `target` is allowed from `source`: the
    labels of a pod in the release's namespace, or a NetworkPolicyPeer as configured (other namespaces)."""
    policies = [p for p in m.by_kind(objects, "NetworkPolicy") if _selects(p["spec"]["podSelector"], target)]
    if not policies:
        return True  # no policy selects the pod: Kubernetes admits everything
    for policy in policies:
        assert policy["spec"]["policyTypes"][0] == "Ingress"
        for rule in policy["spec"]["ingress"]:
            if not any(p.get("port") in (None, port) and p["protocol"] == "TCP" for p in rule["ports"]):
                continue
            for peer in rule["from"]:
                if peer == source or (set(peer) == {"podSelector"} and "podSelector" not in (source or {})
                                      and source is not None and _selects(peer["podSelector"], source)):
                    return True
    return False


def test_network_policies_are_off_by_default(chart):
    assert not m.by_kind(rendered(chart, mode="train"), "NetworkPolicy")
    assert m.CHART.joinpath("values.yaml").read_text().count("networkPolicy:\n  enabled: false") == 1


def test_network_policies_admit_the_coordinator_the_peers_and_the_configured_clients(chart):
    objects = rendered(chart, mode="train", networkPolicy={"enabled": True, "coordinatorFrom": [CLIENTS],
                                                           "metricsFrom": [MONITORING]})
    assert len(m.by_kind(objects, "NetworkPolicy")) == 3
    coordinator, trainer, rollout = labels_of("coordinator"), labels_of("trainer"), labels_of("rollout")
    for worker in (trainer, rollout):
        assert admits(objects, worker, 50051, coordinator)  # the coordinator drives the workers
        assert not admits(objects, worker, 29500, coordinator)  # and nothing else
        assert not admits(objects, worker, 50051, CLIENTS)
        assert not admits(objects, worker, 50051, labels_of("coordinator", instance="other"))  # another release
        assert admits(objects, worker, 9400, MONITORING) and not admits(objects, worker, 50051, MONITORING)
        for peer in (trainer, rollout):  # torch.distributed stores and NCCL/gloo: ports picked at run time
            assert all(admits(objects, worker, port, peer) for port in (29500, 41234, 50051))
        assert not admits(objects, worker, 29500, labels_of("trainer", instance="other"))
    assert admits(objects, coordinator, 50051, CLIENTS) and admits(objects, coordinator, 8080, CLIENTS)
    assert admits(objects, coordinator, 8080, MONITORING) and not admits(objects, coordinator, 50051, MONITORING)
    assert not admits(objects, coordinator, 50051, trainer)


def test_with_no_clients_listed_the_coordinator_admits_no_one_and_the_eval_pod_never(chart):
    train = rendered(chart, mode="train", networkPolicy={"enabled": True, "coordinatorFrom": [], "metricsFrom": []})
    coordinator = next(p for p in m.by_kind(train, "NetworkPolicy") if p["metadata"]["labels"][m.COMPONENT] == "coordinator")
    assert coordinator["spec"]["ingress"] == []
    evaluation = rendered(chart, mode="eval", networkPolicy={"enabled": True, "coordinatorFrom": [CLIENTS],
                                                             "metricsFrom": [MONITORING]})
    assert {p["metadata"]["labels"][m.COMPONENT] for p in m.by_kind(evaluation, "NetworkPolicy")} == {"coordinator", "rollout"}
    assert not admits(evaluation, labels_of("coordinator"), 50051, CLIENTS)  # the eval Job's pod serves no one
    assert admits(evaluation, labels_of("rollout"), 50051, labels_of("coordinator"))


def test_a_peer_must_name_something(chart):
    with pytest.raises(helm.HelmValuesError, match="/networkPolicy/coordinatorFrom/0"):
        chart.render(values(networkPolicy={"enabled": True, "coordinatorFrom": [{}]}), name=RELEASE, namespace=NAMESPACE)


# ---------------------------------------------------------------------------- security contexts


def test_the_strict_defaults_stay_and_volumes_are_reowned_only_on_mismatch(chart):
    objects = rendered(chart, mode="train")
    m.check_security(objects)
    for _, _, spec in m.pod_specs(objects):
        assert spec["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_openshift_unsets_the_fixed_ids_with_null(chart):
    objects = rendered(chart, mode="train",
                       podSecurityContext={"runAsUser": None, "runAsGroup": None, "fsGroup": None},
                       securityContext={"runAsUser": None})
    for workload, _, spec in m.pod_specs(objects):
        pod, ctx = spec["securityContext"], m.container(workload)["securityContext"]
        assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(pod) and "runAsUser" not in ctx
        assert pod["runAsNonRoot"] is True and ctx["runAsNonRoot"] is True  # the rest stays strict
        assert ctx["capabilities"] == {"drop": ["ALL"]} and ctx["readOnlyRootFilesystem"] is True


def test_ipc_lock_is_added_per_role_for_infiniband(chart):
    caps = {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    fleet = pods(rendered(chart, mode="train", trainer={"securityContext": {"capabilities": caps}},
                          rollout={"securityContext": {"capabilities": caps}}))
    for role in ("trainer", "rollout"):
        ctx = m.container(fleet[role][0])["securityContext"]
        assert ctx["capabilities"] == caps and ctx["readOnlyRootFilesystem"] is True  # the role's key, the rest global
    assert m.container(fleet["coordinator"][0])["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_unknown_security_context_keys_are_refused(chart):
    with pytest.raises(helm.HelmValuesError, match=r"/securityContext.*'runAsUsr'"):
        chart.render(values(securityContext={"runAsUsr": 1}), name=RELEASE, namespace=NAMESPACE)


# ---------------------------------------------------------------------------- metrics


def test_workers_serve_metrics_on_a_named_port_their_services_expose(chart):
    objects = rendered(chart, mode="train")  # check_labels_and_selectors: every Service port targets a named container port
    for role in ("trainer", "rollout"):
        main = m.container(m.one(objects, "StatefulSet", role))
        assert "--metrics-port=9400" in main["args"]
        assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in main["ports"]
        ports = {p["name"]: p for p in m.one(objects, "Service", role)["spec"]["ports"]}
        assert ports["metrics"]["port"] == 9400 and ports["metrics"]["targetPort"] == "metrics"
    coordinator = m.container(m.one(objects, "Deployment", "coordinator"))
    assert not any(a.startswith("--metrics-port") for a in coordinator["args"])  # its /metrics is on the REST port
    assert not [o for o in objects if o["kind"] == "ServiceMonitor"]

    off = rendered(chart, mode="train", metrics={"enabled": False, "port": 9400})
    for role in ("trainer", "rollout"):
        assert not any(a.startswith("--metrics-port") for a in m.container(m.one(off, "StatefulSet", role))["args"])
        assert {p["name"] for p in m.one(off, "Service", role)["spec"]["ports"]} == {"grpc"}


def _monitors(objects: list[dict]) -> dict[str, dict]:
    found = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert all(o["apiVersion"] == "monitoring.coreos.com/v1" and not m.validated(o) for o in found)
    return {o["metadata"]["labels"][m.COMPONENT]: o for o in found}


def test_a_service_monitor_per_role_scrapes_each_roles_metrics_port(chart):
    metrics = {"enabled": True, "port": 9400,
               "serviceMonitor": {"enabled": True, "interval": "15s", "scrapeTimeout": "10s", "labels": {"release": "kps"}}}
    objects = rendered(chart, mode="train", metrics=metrics)  # m.validate skips the ServiceMonitors, and only them
    monitors = _monitors(objects)
    assert set(monitors) == {"coordinator", "trainer", "rollout"}
    for role, monitor in monitors.items():
        assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
        assert monitor["metadata"]["labels"]["release"] == "kps"
        spec = monitor["spec"]
        assert set(spec) == {"selector", "endpoints"}
        (service,) = [s for s in m.by_kind(objects, "Service") if m.selects(spec["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert service["metadata"]["labels"][m.COMPONENT] == role
        (endpoint,) = spec["endpoints"]
        assert endpoint == {"port": "http" if role == "coordinator" else "metrics", "path": "/metrics",
                            "interval": "15s", "scrapeTimeout": "10s"}
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}

    hf_eval = _monitors(rendered(chart, mode="eval", metrics=metrics))
    assert set(hf_eval) == {"rollout"}  # no coordinator Service in eval mode, no trainers for an hf checkpoint


def test_the_coordinators_monitor_speaks_tls_with_the_release_certificate(chart):
    metrics = {"enabled": True, "port": 9400, "serviceMonitor": {"enabled": True}}
    (endpoint,) = _monitors(rendered(chart, mode="train", metrics=metrics, tls=TLS))["coordinator"]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"] == {
        "serverName": "rlfleet",
        "ca": {"secret": {"name": "rlfleet-tls", "key": "ca.crt"}},
        "cert": {"secret": {"name": "rlfleet-tls", "key": "tls.crt"}},  # mutual TLS: Prometheus presents one
        "keySecret": {"name": "rlfleet-tls", "key": "tls.key"},
    }
    (worker,) = _monitors(rendered(chart, mode="train", metrics=metrics, tls=TLS))["rollout"]["spec"]["endpoints"]
    assert "scheme" not in worker  # the workers' metrics endpoint is plain HTTP (services/telemetry.py)


def test_only_monitoring_kinds_escape_schema_validation():
    assert not m.validated({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor"})
    assert m.validated({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy"})
    assert m.validated({"apiVersion": "v1", "kind": "ServiceMonitor"})
    with pytest.raises(AssertionError, match="ServiceMonitor"):  # a core kind with a typo still fails
        m.validate([{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ServiceMonitor"}, "spec": {"portz": []}}])


# ---------------------------------------------------------------------------- memory


def _empty_dirs(objects: list[dict]) -> dict[str, dict[str, dict]]:
    return {role: {v["name"]: v["emptyDir"] for v in spec["volumes"] if "emptyDir" in v}
            for role, (_, _, spec) in pods(objects).items()}


def test_scratch_volumes_have_size_limits_per_role(chart):
    dirs = _empty_dirs(rendered(chart, mode="train"))
    assert dirs["coordinator"] == {"tmp": {"sizeLimit": "2Gi"}}  # its state is a PVC
    for role in ("trainer", "rollout"):
        assert dirs[role] == {"tmp": {"sizeLimit": "10Gi"}, "dshm": {"medium": "Memory", "sizeLimit": "4Gi"}}
    custom = _empty_dirs(rendered(chart, mode="train", scratch={"tmp": {"coordinator": "", "trainer": "50Gi", "rollout": "1Gi"},
                                                                "shm": {"trainer": "16Gi", "rollout": ""}}))
    assert custom["coordinator"]["tmp"] == {}
    assert custom["trainer"] == {"tmp": {"sizeLimit": "50Gi"}, "dshm": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert custom["rollout"]["dshm"] == {"medium": "Memory"}  # "" = no limit of its own


@pytest.mark.parametrize("shm, limit, ok", [("4Gi", "16Gi", True), ("16Gi", "16Gi", True), ("17Gi", "16Gi", False),
                                            ("2Gi", "1.5Gi", False), ("1536Mi", "1.5Gi", True), ("20G", "16Gi", False),
                                            ("4Gi", 17179869184, True), ("32Gi", None, True)])
def test_a_shm_larger_than_the_memory_limit_is_refused(chart, shm, limit, ok):
    limits = {"cpu": "4", "memory": limit}  # None unsets the chart's default limit
    overrides = dict(mode="train", scratch={"tmp": {"coordinator": "1Gi", "trainer": "1Gi", "rollout": "1Gi"},
                                            "shm": {"trainer": shm, "rollout": "1Gi"}},
                     resources={"coordinator": {}, "rollout": {}, "trainer": {"requests": {"cpu": "1"}, "limits": limits}})
    if ok:
        trainer = m.one(render(chart, values(**overrides)), "StatefulSet", "trainer")
        assert m.container(trainer)["resources"]["limits"].get("memory") == limit
    else:
        refused(chart, rf"scratch.shm.trainer: {shm} is more than resources.trainer.limits.memory \({limit}\): "
                       "/dev/shm is memory-backed", **overrides)


def test_sglang_rollouts_check_their_own_shm_size(chart):
    job = {**JOB, "rollout": {"engine": "sglang"}}
    sglang = {"image": {"repository": "registry.example.com/rlfleet-sglang", "tag": "0.5.9"}, "shmSize": "32Gi"}
    refused(chart, r"sglang.shmSize: 32Gi is more than resources.rollout.limits.memory \(16Gi\)",
            mode="train", job=job, sglang=sglang, gpusPerPod={"trainer": 1, "rollout": 1})


def test_an_unreadable_memory_limit_is_named(chart):
    refused(chart, r"resources.trainer.limits.memory: \"16e9\" is not a quantity the chart can read",
            mode="train", resources={"coordinator": {}, "rollout": {}, "trainer": {"limits": {"memory": "16e9"}}})


# ---------------------------------------------------------------------------- images


def test_the_image_installs_against_constraints_made_from_the_tested_environment():
    pinned = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+)$", (m.ROOT / "constraints.txt").read_text(), re.M))
    assert "torch" not in pinned  # installed first, from TORCH_INDEX_URL
    assert pinned == constraints.runtime_closure(), "regenerate: .venv/bin/python -m tests.k8s.constraints > constraints.txt"
    assert (m.ROOT / "constraints.txt").read_text() == constraints.render()
    dockerfile = (m.ROOT / "Dockerfile").read_text()
    runtime = dockerfile[dockerfile.index("AS runtime"):]
    assert re.search(r"COPY [^\n]*constraints\.txt", runtime)
    assert 'pip install --no-cache-dir -c constraints.txt ".[k8s,megatron]"' in runtime
    assert constraints.IMAGE_EXTRAS == ("k8s", "megatron")


def test_the_trainer_restart_budget_reaches_the_coordinator(chart):
    def coordinator_args(objects):
        return m.container(pods(objects)["coordinator"][0])["args"]

    assert "--trainer-restarts=3" in coordinator_args(rendered(chart, mode="train"))
    assert "--trainer-restarts=0" in coordinator_args(rendered(chart, mode="train", discovery={"trainerRestarts": 0}))
    with pytest.raises(helm.HelmValuesError, match="trainerRestarts"):
        chart.render(values(mode="train", discovery={"trainerRestarts": -1}), name=RELEASE, namespace=NAMESPACE)

