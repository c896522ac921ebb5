"""The Helm chart, rendered and linted by the real Helm engine (helm-python-sdk, no helm binary).

Both modes render to manifests that validate strictly against the oldest Kubernetes the chart
supports and the newest schemas kubernetes-validate ships (manifests.k8s_versions); train mode has the whole fleet, eval mode a Job that runs an
eval-only job (no trainers for a Hugging Face checkpoint, no optimizer or scheduler settings); the
schema and the templates refuse bad values with messages that name the value.
"""

from __future__ import annotations

import copy

import pytest

from services.coordinator.config import parse_job
from tests.k8s import manifests as m

helm = pytest.importorskip("helm_python")
pytest.importorskip("kubernetes_validate")

pytestmark = pytest.mark.k8s

RELEASE, NAMESPACE = "demo", "evals"
SECRET = "rlfleet-token"
JOB = {
    "name": "arith",
    "num_rollout": 20,
    "data": {"train": "/models/arith/train.jsonl"},
    "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4},
    "eval": {"every": 5, "datasets": [{"name": "test", "path": "/models/arith/test.jsonl", "limit": 100}]},
    "trainer": {
        "optimizer": {"lr": 1.0e-5, "weight_decay": 0.01},
        "scheduler": {"kind": "cosine", "warmup_steps": 2},
    },
}
BASE = {
    "token": {"existingSecret": SECRET, "key": "token"},
    "model": {"format": "hf", "path": "/models/arith/model", "existingClaim": "rlfleet-models", "hostPath": "", "mountPath": "/models"},
    "job": JOB,
}


def values(**overrides) -> dict:
    out = copy.deepcopy(BASE)
    for key, value in overrides.items():
        out[key] = value
    return out


def render(chart, vals: dict) -> list[dict]:
    rendered = chart.render(vals, name=RELEASE, namespace=NAMESPACE)
    return [obj for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt") for obj in m.load_all(text)]


def job_text(objects: list[dict]) -> str:
    (configmap,) = m.by_kind(objects, "ConfigMap")
    return configmap["data"]["job.yaml"]


def job_config(objects: list[dict]) -> dict:
    import yaml

    return yaml.safe_load(job_text(objects))


# ---------------------------------------------------------------------------- lint and schemas


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_chart_lints_clean_in_strict_mode(mode):
    for version in (f"v{v}.0" for v in m.k8s_versions()):
        report = helm.lint(str(m.CHART), values(mode=mode), strict=True, kube_version=version, namespace=NAMESPACE)
        problems = [msg for msg in report["messages"] if msg["severity"] >= 2]
        assert report["errors"] == [] and problems == [], report


def test_chart_metadata(chart):
    meta = chart.metadata
    assert meta["apiVersion"] == "v2" and meta["name"] == "rlfleet" and meta["type"] == "application"
    assert chart.schema["additionalProperties"] is False


@pytest.mark.parametrize(
    "vals",
    [values(mode="train"), values(mode="eval"), values(mode="eval", model={**BASE["model"], "format": "rlfleet"}),
     {}, values(mode="train", gpusPerPod={"trainer": 1, "rollout": 2}, persistence={"enabled": False}),
     values(mode="train", tls={"existingSecret": "rlfleet-tls", "clientAuth": True, "serverName": "rlfleet"})],
    ids=["train", "eval-hf", "eval-rlfleet", "defaults", "train-gpu-no-pvc", "tls"],
)
def test_every_rendered_manifest_validates_strictly(chart, vals):
    objects = render(chart, vals)
    assert objects
    m.validate(objects)
    m.check_labels_and_selectors(objects)
    m.check_probes(objects)
    m.check_security(objects)
    m.check_rbac(objects)
    m.check_discovery_wiring(objects)


# ---------------------------------------------------------------------------- train mode


def test_train_mode_renders_the_whole_fleet(chart):
    objects = render(chart, values(mode="train", replicas={"trainers": 2, "rollouts": 3}))
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted([
        "ConfigMap", "Deployment", "PersistentVolumeClaim", "Role", "RoleBinding", "Service", "Service", "Service",
        "ServiceAccount", "StatefulSet", "StatefulSet",
        "PodDisruptionBudget", "PodDisruptionBudget", "PodDisruptionBudget",
    ])
    assert not m.by_kind(objects, "Job")
    assert m.one(objects, "StatefulSet", "trainer")["spec"]["replicas"] == 2
    assert m.one(objects, "StatefulSet", "rollout")["spec"]["replicas"] == 3

    coordinator = m.one(objects, "Deployment", "coordinator")
    assert coordinator["spec"]["strategy"]["type"] == "Recreate"
    args = m.container(coordinator)["args"]
    assert args[:2] == ["serve", "coordinator"]
    assert {"--http-port=8080", f"--instance={RELEASE}", "--job=/config/job.yaml"} <= set(args)
    assert "--exit-on-finish" not in args
    service = m.one(objects, "Service", "coordinator")
    assert {(p["name"], p["port"]) for p in service["spec"]["ports"]} == {("grpc", 50051), ("http", 8080)}
    pvc = m.one(objects, "PersistentVolumeClaim", "coordinator")
    volumes = {v["name"]: v for v in coordinator["spec"]["template"]["spec"]["volumes"]}
    assert volumes["state"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "rlfleet-models", "readOnly": True}

    # The coordinator's own loader reads what the chart wrote (it also reads Go's `1e-05` as a float).
    job = parse_job(job_text(objects), "/", check_files=False)
    assert job.model.as_posix() == "/models/arith/model" and job.num_rollout == 20 and not job.eval_only
    assert job.trainer.optimizer.lr == 1.0e-5 and job.trainer.scheduler.kind == "cosine"
    assert job.trainer.num_trainers == 2 and job.rollout.num_engines == 3  # from the replicas


def test_train_mode_without_a_job_waits_for_submissions(chart):
    objects = render(chart, values(mode="train", job={}))
    assert not m.by_kind(objects, "ConfigMap")
    args = m.container(m.one(objects, "Deployment", "coordinator"))["args"]
    assert not any(a.startswith("--job") for a in args)


def test_the_token_comes_from_a_secret_and_never_from_values(chart):
    objects = render(chart, values(mode="train"))
    m.check_token_from_secret(objects, SECRET)
    coordinator = m.container(m.one(objects, "Deployment", "coordinator"))
    assert "--worker-token-file=/var/run/secrets/rlfleet/token" in coordinator["args"]

    with pytest.raises(helm.HelmError, match="token.existingSecret: required"):  # no pod listens unauthenticated
        render(chart, values(mode="train", token={"existingSecret": "", "key": "token"}))


def test_tls_comes_from_a_secret_for_every_server_and_probes_fall_back_to_tcp(chart):
    plain = render(chart, values(mode="train"))
    for workload, _, spec in m.pod_specs(plain):
        assert not any(a.startswith("--tls") for a in m.container(workload)["args"])
        assert "grpc" in m.container(workload)["livenessProbe"]
    secured = render(chart, values(mode="train", tls={"existingSecret": "rlfleet-tls", "clientAuth": True,
                                                      "serverName": "rlfleet"}))
    workloads = list(m.pod_specs(secured))
    assert len(workloads) >= 3
    for workload, _, spec in workloads:
        main = m.container(workload)
        assert {"--tls-cert=/var/run/secrets/rlfleet-tls/tls.crt", "--tls-key=/var/run/secrets/rlfleet-tls/tls.key",
                "--tls-ca=/var/run/secrets/rlfleet-tls/ca.crt", "--tls-client-auth",
                "--tls-server-name=rlfleet"} <= set(main["args"]), workload["metadata"]["name"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "rlfleet-tls"
        assert any(mnt["name"] == "tls" and mnt["readOnly"] for mnt in main["volumeMounts"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if probe in main:  # the kubelet's gRPC probes speak plaintext only
                assert main[probe]["tcpSocket"] == {"port": 50051} and "grpc" not in main[probe]


def test_gpus_go_to_trainers_and_rollouts_only(chart):
    objects = render(chart, values(mode="train", gpusPerPod={"trainer": 1, "rollout": 2}))
    for component, gpus in (("trainer", 1), ("rollout", 2)):
        resources = m.container(m.one(objects, "StatefulSet", component))["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == gpus == resources["requests"]["nvidia.com/gpu"]
        assert m.container(m.one(objects, "StatefulSet", component))["image"].endswith(":0.1.0-cuda")
    coordinator = m.container(m.one(objects, "Deployment", "coordinator"))["resources"]
    assert "nvidia.com/gpu" not in coordinator["limits"]
    cpu_only = render(chart, values(mode="train"))
    assert m.container(m.one(cpu_only, "StatefulSet", "trainer"))["image"] == "ghcr.io/rlfleet/rlfleet:0.1.0-cpu"


# ---------------------------------------------------------------------------- eval mode


def test_eval_mode_is_a_job_with_rollouts_and_no_trainers_for_hf(chart):
    objects = render(chart, values(mode="eval"))
    assert not m.by_kind(objects, "Deployment") and not m.by_kind(objects, "StatefulSet")
    assert sorted(j["metadata"]["labels"][m.COMPONENT] for j in m.by_kind(objects, "Job")) == ["coordinator", "rollout"]
    assert "trainer" not in {s["metadata"]["labels"][m.COMPONENT] for s in m.by_kind(objects, "Service")}

    job = m.one(objects, "Job", "coordinator")
    assert job["apiVersion"] == "batch/v1"
    spec = job["spec"]
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] > 0 and spec["ttlSecondsAfterFinished"] > 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    main = m.container(job)
    assert main["args"][:2] == ["serve", "coordinator"]
    assert main["args"][-4:] == ["--revision=1", "--job=/config/job.yaml", "--exit-on-finish", "--stop-workers-on-finish"]
    assert not any(a.startswith("--eval-trainers") for a in main["args"])
    mounts = {mt["mountPath"]: mt["name"] for mt in main["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (configmap,) = m.by_kind(objects, "ConfigMap")
    assert volumes[mounts["/config"]]["configMap"]["name"] == configmap["metadata"]["name"]


def test_eval_mode_job_config_is_eval_only_without_optimizer_or_scheduler(chart):
    job = job_config(render(chart, values(mode="eval")))
    assert job["num_rollout"] == 0
    assert "optimizer" not in job["trainer"] and "scheduler" not in job["trainer"]
    assert job["trainer"]["device"] == "cpu"  # what eval still uses is kept
    assert job["eval"]["datasets"][0]["name"] == "test"
    parsed = parse_job(job_text(render(chart, values(mode="eval"))), "/", check_files=False)
    assert parsed.eval_only and parsed.model.as_posix() == "/models/arith/model"


def test_eval_mode_with_an_rlfleet_checkpoint_runs_trainers_too(chart):
    objects = render(chart, values(mode="eval", model={**BASE["model"], "format": "rlfleet"}, replicas={"trainers": 2, "rollouts": 1}))
    trainers = m.one(objects, "Job", "trainer")["spec"]
    assert trainers["completionMode"] == "Indexed" and trainers["completions"] == trainers["parallelism"] == 2
    job = m.one(objects, "Job", "coordinator")
    assert "--eval-trainers=2" in m.container(job)["args"]
    assert "optimizer" not in job_config(objects)["trainer"]


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mode": "bogus"}, r"/mode.*value must be one of 'train', 'eval'"),
        ({"replicas": {"trainers": -1, "rollouts": 1}}, r"/replicas/trainers.*minimum.*0|/replicas/trainers.*-1"),
        ({"replicas": {"trainers": 1, "rollouts": 0}}, r"/replicas/rollouts"),
        ({"gpusPerPod": {"trainer": -2, "rollout": 0}}, r"/gpusPerPod/trainer"),
        ({"colour": "blue"}, r"additional propert.*'colour'"),
        ({"token": {"existingSecret": "s", "key": "token", "value": "hunter2"}}, r"/token.*additional propert.*'value'"),
        ({"image": {"repository": "x", "tag": "1", "pullPolicy": "Sometimes"}}, r"/image/pullPolicy"),
        ({"model": {**BASE["model"], "path": "relative/model"}}, r"/model/path"),
        ({"model": {**BASE["model"], "format": "gguf"}}, r"/model/format.*'hf', 'rlfleet'"),
        ({"job": {**JOB, "nmae": "typo"}}, r"/job.*additional propert.*'nmae'"),
    ],
    ids=["mode", "negative-trainers", "zero-rollouts", "negative-gpus", "unknown-key", "literal-token", "pull-policy",
         "relative-model-path", "model-format", "job-typo"],
)
def test_schema_rejects_invalid_values_with_a_clear_message(chart, overrides, message):
    with pytest.raises(helm.HelmValuesError, match=message):
        chart.render(values(**overrides), name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"job": {**JOB, "model": "/elsewhere"}}, "job.model: leave it out; set model.path"),
        ({"mode": "train", "job": {**JOB, "num_rollout": 0}}, "job.num_rollout: 0 means an eval-only job; install it with mode=eval"),
        ({"mode": "eval", "job": {**JOB, "eval": {"datasets": []}}}, "job.eval.datasets: an eval .* needs at least one"),
        ({"mode": "eval", "job": {"num_rollout": 0}}, "job.name: required"),
        ({"mode": "eval", "job": {}}, "job: mode eval needs the job config"),
        ({"job": {**JOB, "rollout": {"num_engines": 4}}}, r"job.rollout.num_engines: 4 is more than replicas.rollouts \(1\)"),
        ({"replicas": {"trainers": 0, "rollouts": 1}}, "replicas.trainers: mode train .* needs at least 1 trainer"),
    ],
    ids=["job-model", "train-with-zero-steps", "eval-without-datasets", "no-name", "eval-without-job", "too-many-engines", "no-trainers"],
)
def test_templates_refuse_inconsistent_values(chart, overrides, message):
    with pytest.raises(helm.HelmError, match=message):
        chart.render(values(**overrides), name=RELEASE, namespace=NAMESPACE)


def test_job_top_level_keys_follow_the_job_config(chart):
    import dataclasses

    from services.coordinator.config import JobConfig

    keys = set(chart.schema["properties"]["job"]["properties"])
    assert keys == {f.name for f in dataclasses.fields(JobConfig)}


# The deploy guide's values files: tests/k8s/test_helm_fleet.py renders every one.


# ---------------------------------------------------------------------------- SGLang engines


def test_sglang_rollout_pods_run_the_sglang_image_with_a_sized_shm(chart):
    job = dict(values(mode="train")["job"])
    job["rollout"] = {**job.get("rollout", {}), "engine": "sglang",
                      "sglang": {"args": ["--mem-fraction-static", "0.7"], "memory_saver": True}}
    objects = render(chart, values(mode="train", job=job, gpusPerPod={"trainer": 1, "rollout": 1},
                                   sglang={"image": {"repository": "registry.example.com/rlfleet-sglang", "tag": "0.5.9"},
                                           "shmSize": "32Gi"},
                                   resources={"coordinator": {}, "trainer": {},  # /dev/shm counts against the limit
                                              "rollout": {"requests": {"cpu": "8", "memory": "32Gi"},
                                                          "limits": {"cpu": "16", "memory": "96Gi"}}}))
    m.validate(objects)
    rollout = m.one(objects, "StatefulSet", "rollout")
    assert m.container(rollout)["image"] == "registry.example.com/rlfleet-sglang:0.5.9"
    dshm = next(v for v in rollout["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    trainer = m.one(objects, "StatefulSet", "trainer")
    assert "sglang" not in m.container(trainer)["image"]  # only rollout pods run SGLang
    parsed = parse_job(job_text(objects), "/", check_files=False)
    assert parsed.rollout.engine == "sglang" and parsed.rollout.sglang.memory_saver
    assert parsed.rollout.sglang.args == ("--mem-fraction-static", "0.7")


def test_an_sglang_job_without_an_sglang_image_is_refused_at_render_time(chart):
    job = dict(values(mode="train")["job"])
    job["rollout"] = {**job.get("rollout", {}), "engine": "sglang"}
    with pytest.raises(helm.HelmError, match="sglang.image.repository"):
        chart.render(values(mode="train", job=job), name=RELEASE, namespace=NAMESPACE)
