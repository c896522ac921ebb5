"""Kubernetes pod discovery against an emulated API server (kmock on loopback, no cluster).

Pods appear, turn ready, turn unready, terminate and disappear; only ready pods of the right
release and component are ever handed out, in ordinal order; a watch that loses events is
corrected by the re-list on reconnect; API and transport errors come out as DiscoveryError.
"""

from __future__ import annotations

import threading
import time

import pytest
import urllib3

kubernetes = pytest.importorskip("kubernetes")
pytest.importorskip("kmock")

from services.coordinator.config import parse_job  # noqa: E402
from services.coordinator.discovery import DiscoveryError, StaticDiscovery, make_fleet  # noqa: E402
from services.coordinator.k8s_discovery import (  # noqa: E402
    KubernetesDiscovery,
    KubernetesDiscoveryConfig,
    pod_address,
)
from tests.k8s.emulator import EmulatorThread, selector_matches  # noqa: E402

pytestmark = pytest.mark.k8s

NS = "evals"
WAIT_S = 5.0


@pytest.fixture
def cluster():
    with EmulatorThread() as emulator:
        yield emulator


def core_api(url: str):
    client = kubernetes.client
    return client.CoreV1Api(client.ApiClient(client.Configuration(host=url)))


@pytest.fixture
def api(cluster):
    return core_api(cluster.url)


@pytest.fixture
def discovery(api):
    # A short watch: the emulator ignores timeoutSeconds, so the read timeout ends each watch.
    cfg = KubernetesDiscoveryConfig(
        namespace=NS, instance="demo", watch_timeout_s=1, read_grace_s=0.5, request_timeout_s=5, backoff_s=(0.1, 0.5)
    )
    found = KubernetesDiscovery(cfg, api)
    yield found
    found.close()


def make_pod(api, name: str, component: str, *, instance: str = "demo", ip: str = "", ready: bool = False, **labels):
    meta_labels = {
        "app.kubernetes.io/name": "rlfleet",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
        **labels,
    }
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": meta_labels},
        "spec": {"containers": [{"name": component, "image": "rlfleet"}]},
        "status": _status(ip, ready),
    }
    api.create_namespaced_pod(NS, body)


def _status(ip: str, ready: bool) -> dict:
    status = {"phase": "Running" if ip else "Pending", "conditions": [{"type": "Ready", "status": str(ready)}]}
    if ip:
        status["podIP"] = ip
    return status


def set_ready(api, name: str, ip: str, ready: bool = True) -> None:
    api.patch_namespaced_pod(name, NS, {"status": _status(ip, ready)})


def until(found, trainers=None, rollouts=None) -> None:
    def ok(t, r):
        return (trainers is None or t == trainers) and (rollouts is None or r == rollouts)

    assert found.wait_until(ok, WAIT_S), f"trainers {found.trainers()}, rollouts {found.rollouts()}"


def eval_job(tmp_path, num_engines: int):
    text = f"""
name: ev
model: {tmp_path}
num_rollout: 0
rollout: {{num_engines: {num_engines}}}
eval: {{datasets: [{{name: t, path: {tmp_path}/t.jsonl}}]}}
"""
    return parse_job(text, tmp_path, check_files=False)


def test_pods_appear_turn_ready_and_disappear(api, discovery):
    make_pod(api, "demo-trainer-0", "trainer")  # scheduled, no IP, not ready yet
    discovery.start()
    assert discovery.trainers() == [] and discovery.rollouts() == []

    set_ready(api, "demo-trainer-0", "10.0.0.5")
    until(discovery, trainers=["10.0.0.5:50051"])

    # Ordinal order, not string order: rank 2 before rank 10.
    make_pod(api, "demo-rollout-10", "rollout", ip="10.0.1.10", ready=True)
    make_pod(api, "demo-rollout-2", "rollout", ip="10.0.1.2", ready=True)
    until(discovery, rollouts=["10.0.1.2:50051", "10.0.1.10:50051"])

    set_ready(api, "demo-rollout-2", "10.0.1.2", ready=False)  # its readiness probe fails
    until(discovery, rollouts=["10.0.1.10:50051"])

    api.patch_namespaced_pod("demo-trainer-0", NS, {"metadata": {"deletionTimestamp": "2030-01-01T00:00:00Z"}})
    until(discovery, trainers=[])  # terminating: no new work even while still Ready

    api.delete_namespaced_pod("demo-rollout-10", NS)
    until(discovery, rollouts=[])


def test_only_pods_of_this_release_and_role_are_selected(cluster, api, discovery):
    make_pod(api, "other-rollout-0", "rollout", instance="other", ip="10.9.0.1", ready=True)
    make_pod(api, "demo-coordinator-x", "coordinator", ip="10.9.0.2", ready=True)
    make_pod(api, "demo-rollout-0", "rollout", ip="10.0.1.1", ready=True)
    discovery.start()
    assert discovery.rollouts() == ["10.0.1.1:50051"] and discovery.trainers() == []

    make_pod(api, "other-trainer-0", "trainer", instance="other", ip="10.9.0.3", ready=True)
    make_pod(api, "demo-trainer-0", "trainer", ip="10.0.0.1", ready=True)
    until(discovery, trainers=["10.0.0.1:50051"])
    assert discovery.rollouts() == ["10.0.1.1:50051"]

    assert set(cluster.emulator.selectors) == {discovery.cfg.label_selector}  # lists and watches
    assert selector_matches(discovery.cfg.label_selector, {
        "app.kubernetes.io/name": "rlfleet", "app.kubernetes.io/instance": "demo", "app.kubernetes.io/component": "rollout",
    })


def test_unready_pods_never_receive_work(tmp_path, api, discovery):
    make_pod(api, "demo-rollout-0", "rollout", ip="10.0.1.1", ready=False)
    make_pod(api, "demo-rollout-1", "rollout", ip="10.0.1.2", ready=True)
    discovery.start()
    factory = make_fleet(discovery, wait_s=0.3, describe=repr(discovery))

    fleet = factory(eval_job(tmp_path, num_engines=1))
    try:
        assert [e.address for e in fleet.engines] == ["10.0.1.2:50051"]
        assert fleet.trainers == []  # an eval-only job waits for no trainer
    finally:
        for client in fleet.engines:
            client.close()

    with pytest.raises(ValueError, match=r"rollout.num_engines: job wants 2, 1 ready after 0.3 s \(pods of instance"):
        factory(eval_job(tmp_path, num_engines=2))


def test_a_job_waits_for_pods_that_become_ready(tmp_path, api, discovery):
    make_pod(api, "demo-rollout-0", "rollout")
    discovery.start()
    seen = []
    discovery.subscribe(lambda trainers, rollouts: seen.append(rollouts))
    factory = make_fleet(discovery, wait_s=WAIT_S)
    threading.Timer(0.3, set_ready, args=(api, "demo-rollout-0", "10.0.1.1")).start()
    fleet = factory(eval_job(tmp_path, num_engines=1))
    assert [e.address for e in fleet.engines] == ["10.0.1.1:50051"]
    fleet.engines[0].close()
    assert ["10.0.1.1:50051"] in seen


def test_a_reconnect_relists_and_catches_changes_the_watch_missed(cluster, api, discovery):
    make_pod(api, "demo-rollout-0", "rollout", ip="10.0.1.1", ready=True)
    make_pod(api, "demo-rollout-1", "rollout", ip="10.0.1.2", ready=True)
    discovery.start()
    cluster.emulator.drop_events = True  # the watch goes deaf
    api.delete_namespaced_pod("demo-rollout-1", NS)
    assert discovery.rollouts() == ["10.0.1.1:50051", "10.0.1.2:50051"]
    until(discovery, rollouts=["10.0.1.1:50051"])  # after the next reconnect's re-list


def test_an_expired_watch_relists_at_once(cluster, api, discovery):
    make_pod(api, "demo-rollout-0", "rollout", ip="10.0.1.1", ready=True)
    cluster.emulator.expire_watches = 1
    discovery.start()
    deadline = time.monotonic() + 1.0  # well before the 1.5 s read timeout would reconnect anyway
    while len(cluster.emulator.selectors) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(cluster.emulator.selectors) >= 2, "410 Gone should trigger a re-list"
    assert discovery.rollouts() == ["10.0.1.1:50051"] and discovery.last_error is None


def test_api_errors_become_discovery_errors(cluster, api, discovery):
    cluster.emulator.forbidden = True
    with pytest.raises(DiscoveryError, match=r"HTTP 403 Forbidden.*needs get/list/watch on pods") as info:
        discovery.start()
    assert isinstance(info.value.__cause__, kubernetes.client.exceptions.ApiException)


def test_transport_errors_become_discovery_errors():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    configuration = kubernetes.client.Configuration(host=f"http://127.0.0.1:{port}")
    configuration.retries = False
    cfg = KubernetesDiscoveryConfig(namespace=NS, instance="demo", request_timeout_s=2)
    found = KubernetesDiscovery(cfg, kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration)))
    with pytest.raises(DiscoveryError, match=r"listing pods of instance 'demo' in namespace 'evals' failed") as info:
        found.start()
    assert isinstance(info.value.__cause__, urllib3.exceptions.HTTPError)


def test_pod_readiness_rules():
    ready = {"metadata": {"name": "p"}, "status": {"podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]}}
    assert pod_address(ready, 50051) == "10.1.2.3:50051"
    assert pod_address({**ready, "status": {**ready["status"], "podIP": "fd00::7"}}, 50051) == "[fd00::7]:50051"
    assert pod_address({**ready, "status": {"podIP": "10.1.2.3", "conditions": []}}, 50051) is None
    assert pod_address({**ready, "status": {"conditions": ready["status"]["conditions"]}}, 50051) is None
    terminating = {**ready, "metadata": {"name": "p", "deletionTimestamp": "2030-01-01T00:00:00Z"}}
    assert pod_address(terminating, 50051) is None
    with pytest.raises(ValueError, match="instance"):
        KubernetesDiscoveryConfig(namespace=NS, instance="")


def test_static_discovery_matches_the_protocol(tmp_path):
    found = StaticDiscovery(["t:1"], ["r:1", "r:2"])
    fleet = make_fleet(found, wait_s=0)(eval_job(tmp_path, num_engines=2))
    assert [e.address for e in fleet.engines] == ["r:1", "r:2"] and [t.address for t in fleet.trainers] == ["t:1"]
    for client in [*fleet.engines, *fleet.trainers]:
        client.close()


def test_a_colocated_pod_is_a_trainer_and_an_engine_at_their_own_ports(api, discovery):
    make_pod(api, "demo-colocated-1", "colocated", ip="10.0.2.2", ready=True)
    make_pod(api, "demo-colocated-0", "colocated", ip="10.0.2.1", ready=True)
    discovery.start()
    until(discovery, trainers=["10.0.2.1:50051", "10.0.2.2:50051"], rollouts=["10.0.2.1:50052", "10.0.2.2:50052"])


def test_an_eval_revision_sees_only_its_own_workers(cluster, api):
    cfg = KubernetesDiscoveryConfig(namespace=NS, instance="demo", revision="3", watch_timeout_s=1, read_grace_s=0.5,
                                    request_timeout_s=5, backoff_s=(0.1, 0.5))
    found = KubernetesDiscovery(cfg, api)
    try:
        make_pod(api, "demo-eval-2-rollout-0-abc", "rollout", ip="10.0.3.1", ready=True, **{"rlfleet.dev/revision": "2"})
        make_pod(api, "demo-eval-3-rollout-0-def", "rollout", ip="10.0.3.2", ready=True, **{"rlfleet.dev/revision": "3"})
        found.start()
        until(found, rollouts=["10.0.3.2:50051"])  # the previous revision's worker, still shutting down, is not ours
        assert cfg.label_selector.endswith(",rlfleet.dev/revision=3")
    finally:
        found.close()


def ppo_job(tmp_path, num_critics: int):
    text = f"""
name: ppo
model: {tmp_path}
num_rollout: 4
data: {{train: {tmp_path}/train.jsonl}}
algorithm: {{advantage: ppo}}
critic: {{num_critics: {num_critics}}}
"""
    return parse_job(text, tmp_path, check_files=False)


def test_a_critic_pod_is_a_critic_not_a_trainer(tmp_path, api, discovery):
    """component=critic (the chart's and kustomize's critic pods): handed out as critics in ordinal
    order, never as trainers, and only while ready; a PPO job's fleet takes them as its critics."""
    make_pod(api, "demo-critic-1", "critic", ip="10.0.4.2", ready=True)
    make_pod(api, "demo-critic-0", "critic", ip="10.0.4.1", ready=True)
    make_pod(api, "other-critic-0", "critic", instance="other", ip="10.9.4.1", ready=True)  # another release
    make_pod(api, "demo-trainer-0", "trainer", ip="10.0.0.1", ready=True)
    make_pod(api, "demo-rollout-0", "rollout", ip="10.0.1.1", ready=True)
    discovery.start()
    critics = ["10.0.4.1:50051", "10.0.4.2:50051"]
    assert discovery.wait_until(lambda t, r: discovery.critics() == critics, WAIT_S), discovery.critics()
    assert discovery.trainers() == ["10.0.0.1:50051"] and discovery.rollouts() == ["10.0.1.1:50051"]

    fleet = make_fleet(discovery, wait_s=WAIT_S)(ppo_job(tmp_path, num_critics=2))
    try:
        assert [c.address for c in fleet.critics] == critics
        assert [t.address for t in fleet.trainers] == ["10.0.0.1:50051"]
    finally:
        for client in [*fleet.engines, *fleet.trainers, *fleet.critics]:
            client.close()

    set_ready(api, "demo-critic-0", "10.0.4.1", ready=False)  # its readiness probe fails
    assert discovery.wait_until(lambda t, r: discovery.critics() == ["10.0.4.2:50051"], WAIT_S), discovery.critics()
    assert discovery.trainers() == ["10.0.0.1:50051"]
    with pytest.raises(ValueError, match=r"critic.num_critics: job wants 2, 1 ready after 0.3 s"):
        make_fleet(discovery, wait_s=0.3)(ppo_job(tmp_path, num_critics=2))
