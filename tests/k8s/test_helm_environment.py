"""The chart's environment server (environment.enabled): `rlfleet serve environment --module ...`
as one pod behind a Service, wired into agent jobs (agent.address filled in), reached with the
release's token, admitting only the coordinator and opening no connection. Each render is
validated strictly and read back with the coordinator's own job loader."""

from __future__ import annotations

import pytest

from services.coordinator.config import parse_job
from tests.k8s import manifests as m
from tests.k8s.test_helm_chart import BASE, JOB, RELEASE, job_text, render, values
from tests.k8s.test_helm_hardening import admits, labels_of

helm = pytest.importorskip("helm_python")
pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.k8s

AGENT_JOB = {**JOB, "agent": {"environment": "remote", "max_turns": 3}}
ENVIRONMENT = {"enabled": True, "module": "mypkg.envs:Sokoban", "image": {"repository": "example.com/envs", "tag": "1.2"}}


def environment_values(**overrides) -> dict:
    return values(**{"mode": "train", "job": AGENT_JOB, "environment": ENVIRONMENT, **overrides})


def test_an_agent_job_gets_the_charts_environment_server(chart):
    objects = render(chart, environment_values())
    m.validate(objects)
    m.check_labels_and_selectors(objects)
    m.check_probes(objects)  # `serve environment`, probed as rlfleet.v1.Environment
    m.check_security(objects)
    m.check_token_from_secret(objects, BASE["token"]["existingSecret"])
    m.check_discovery_wiring(objects)  # the coordinator does not take the environment pod for a worker
    deployment = m.one(objects, "Deployment", "environment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    main = m.container(deployment)
    assert main["image"] == "example.com/envs:1.2"
    assert main["args"][:3] == ["serve", "environment", "--module=mypkg.envs:Sokoban"]
    (service,) = [s for s in m.by_kind(objects, "Service") if s["metadata"]["name"].endswith("-environment")]
    job = parse_job(job_text(objects), "/", check_files=False)
    assert job.agent.environment == "remote" and job.agent.address == f"{service['metadata']['name']}:50051"
    assert service["spec"]["ports"][0]["port"] == 50051


def test_an_address_the_job_gives_is_kept_and_the_rlfleet_image_is_the_default(chart):
    job = {**JOB, "agent": {"environment": "remote", "address": "envs.other-ns:7000"}}
    objects = render(chart, environment_values(job=job, environment={"enabled": True, "module": "a.b:C"}))
    assert parse_job(job_text(objects), "/", check_files=False).agent.address == "envs.other-ns:7000"
    assert m.container(m.one(objects, "Deployment", "environment"))["image"].endswith("-cpu")


def test_a_remote_agent_job_without_an_address_or_a_server_is_refused(chart):
    with pytest.raises(helm.HelmError, match="job.agent.address: agent.environment is remote and no address"):
        chart.render(values(mode="train", job=AGENT_JOB), name=RELEASE, namespace="default")
    with pytest.raises(helm.HelmError, match="environment.module: required"):
        chart.render(environment_values(environment={"enabled": True}), name=RELEASE, namespace="default")
    assert not [o for o in render(chart, values(mode="train")) if "environment" in o["metadata"]["name"]]


def test_with_network_policies_only_the_coordinator_reaches_it_and_it_reaches_nothing(chart):
    objects = render(chart, environment_values(networkPolicy={"enabled": True}))
    m.validate(objects)
    target = labels_of("environment")
    assert admits(objects, target, 50051, labels_of("coordinator"))
    for other in ("trainer", "rollout"):
        assert not admits(objects, target, 50051, labels_of(other))
    (policy,) = [p for p in m.by_kind(objects, "NetworkPolicy") if p["metadata"]["name"].endswith("-environment")]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["spec"]["egress"] == []
