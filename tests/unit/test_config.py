"""Job configs: strict YAML loading, error messages that name the field, paths, round trips, schema."""

from __future__ import annotations

import dataclasses
import textwrap
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from services.coordinator.config import (
    ConfigError,
    JobConfig,
    RolloutConfig,
    SamplingConfig,
    TrainerConfig,
    job_json_schema,
    load_job,
    parse_job,
    resolve_output_dir,
    to_dict,
    to_yaml,
)

FULL_EXAMPLE = """\
name: arith-grpo
seed: 1
model: ./model
num_rollout: 60
output_dir: null
rollout:
  prompts_per_step: 16
  samples_per_prompt: 8
  sampling: {temperature: 1.0, top_p: 1.0, top_k: 0, max_new_tokens: 64, stop: [], seed: null}
  num_engines: 1
  devices: []
data:
  train: ./data/train.jsonl
  prompt_key: prompt
  answer_key: answer
  shuffle: true
reward:
  kind: exact_match
  function: null
  url: null
eval:
  every: 10
  datasets:
    - name: heldout
      path: ./data/test.jsonl
      limit: 200
      reward: {kind: exact_match}
      sampling: {temperature: 0.0, max_new_tokens: 64}
algorithm:
  advantage: grpo
  normalize_std: true
  kl_coef: 0.0
  kl_estimator: low_var_kl
  use_kl_loss: true
  clip_eps_low: 0.2
  clip_eps_high: 0.2
  entropy_coef: 0.0
  loss_agg: token_mean
  gamma: 1.0
  lam: 0.95
  whiten_advantages: true
trainer:
  backend: torch
  device: cpu
  dtype: float32
  num_trainers: 1
  micro_batch_size: 64
  optimizer: {lr: 1.0e-5, weight_decay: 0.0, betas: [0.9, 0.999], eps: 1.0e-8, grad_clip: 1.0}
  scheduler: {kind: constant, warmup_steps: 0, decay_steps: null, min_lr_ratio: 0.0}
  offload: false
  colocate: false
  master_weights: null
  tags: []
critic:
  model: null
  num_critics: 1
  device: null
  dtype: null
  micro_batch_size: null
  optimizer: {lr: 1.0e-5, weight_decay: 0.0, betas: [0.9, 0.999], eps: 1.0e-8, grad_clip: 1.0}
  scheduler: {kind: constant, warmup_steps: 0, decay_steps: null, min_lr_ratio: 0.0}
  value_clip: 0.2
  warmup_steps: 0
  offload: null
weight_sync:
  plane: auto
  verify: fingerprint
  bucket_mb: 512
  timeout_s: 120
checkpoint: {every: 0, dir: null}
sft: null
tracking: {tensorboard: false, wandb: null}
agent: null
"""

MINIMAL = {"name": "job", "model": "model", "num_rollout": 5, "data": {"train": "data/train.jsonl"}}


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A directory with what a job reads: a model dir with config.json and two datasets."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "data" / "test.jsonl").write_text('{"prompt": "2+2=", "answer": "4"}\n')
    return tmp_path


def parse(overrides: dict | None = None, *, drop: tuple[str, ...] = (), base_dir: Path = Path("/jobs")) -> JobConfig:
    data = {**MINIMAL, **(overrides or {})}
    for key in drop:
        del data[key]
    return parse_job(yaml.safe_dump(data), base_dir, check_files=False)


def error_of(overrides: dict | None = None, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        parse(overrides, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- loading


def test_full_example_loads_and_resolves_paths_against_the_yaml_directory(job_dir, monkeypatch, tmp_path_factory):
    (job_dir / "job.yaml").write_text(FULL_EXAMPLE)
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))  # the cwd must not matter
    cfg = load_job(job_dir / "job.yaml")
    assert cfg.name == "arith-grpo" and cfg.num_rollout == 60
    assert cfg.model == job_dir / "model"
    assert cfg.data.train == job_dir / "data" / "train.jsonl"
    assert cfg.eval.datasets[0].path == job_dir / "data" / "test.jsonl"
    assert cfg.eval.datasets[0].limit == 200
    assert cfg.trainer.optimizer.betas == (0.9, 0.999)
    assert cfg.weight_sync.timeout_s == 120.0 and isinstance(cfg.weight_sync.timeout_s, float)
    assert cfg.weight_sync.bucket_bytes == 512 * 1024 * 1024


def test_left_out_sections_take_the_dataclass_defaults():
    cfg = parse()
    assert cfg.rollout == RolloutConfig()
    assert cfg.trainer == TrainerConfig()
    assert cfg.seed == 1 and cfg.output_dir is None and cfg.sft is None
    assert cfg.eval.datasets == ()


def test_a_partial_section_overrides_only_the_fields_it_names():
    cfg = parse({"rollout": {"sampling": {"top_k": 5}}})
    assert cfg.rollout.sampling == SamplingConfig(top_k=5)
    assert cfg.rollout.samples_per_prompt == RolloutConfig().samples_per_prompt


def test_eval_sampling_stays_greedy_and_eval_reward_defaults_to_the_jobs():
    cfg = parse({
        "reward": {"kind": "math_answer"},
        "eval": {"datasets": [
            {"name": "a", "path": "a.jsonl", "sampling": {"max_new_tokens": 128}},
            {"name": "b", "path": "/abs/b.jsonl", "reward": {"kind": "exact_match"}},
        ]},
    })
    a, b = cfg.eval.datasets
    assert a.sampling.temperature == 0.0 and a.sampling.max_new_tokens == 128
    assert a.reward.kind == "math_answer"
    assert b.reward.kind == "exact_match"
    assert a.path == Path("/jobs/a.jsonl") and b.path == Path("/abs/b.jsonl")


def test_yaml_number_quirks():
    cfg = parse({"rollout": {"sampling": {"temperature": 1}}})
    assert cfg.rollout.sampling.temperature == 1.0 and isinstance(cfg.rollout.sampling.temperature, float)
    # PyYAML reads an unquoted 1e-5 (no dot) as a string; the loader reads it as YAML 1.2 does.
    text = "name: j\nmodel: m\nnum_rollout: 1\ndata: {train: t}\ntrainer: {optimizer: {lr: 3e-6}}\n"
    assert parse_job(text, "/x", check_files=False).trainer.optimizer.lr == 3e-6


# --------------------------------------------------------------------------- errors name the field


def test_unknown_keys_name_the_full_path_and_suggest_the_closest():
    assert error_of({"rollout": {"samples_per_promt": 4}}) == (
        "unknown key 'rollout.samples_per_promt' (did you mean 'samples_per_prompt'?)"
    )
    assert error_of({"num_rollouts": 3}) == "unknown key 'num_rollouts' (did you mean 'num_rollout'?)"
    message = error_of({"eval": {"datasets": [{"name": "a", "path": "a", "limt": 3}]}})
    assert message == "unknown key 'eval.datasets[0].limt' (did you mean 'limit'?)"
    assert error_of({"xyzzy": "blue"}) == "unknown key 'xyzzy'"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout": {"prompts_per_step": "ten"}}, "rollout.prompts_per_step: expected int, got str 'ten'"),
        ({"rollout": {"prompts_per_step": 2.5}}, "rollout.prompts_per_step: expected int, got float 2.5"),
        ({"seed": True}, "seed: expected int, got bool True"),
        ({"algorithm": {"kl_coef": "lots"}}, "algorithm.kl_coef: expected float, got str 'lots'"),
        ({"data": {"train": "t", "shuffle": "yes please"}}, "data.shuffle: expected bool, got str 'yes please'"),
        ({"rollout": {"sampling": {"stop": "###"}}}, "rollout.sampling.stop: expected a list of str, got str '###'"),
        ({"rollout": {"sampling": {"stop": [1]}}}, "rollout.sampling.stop[0]: expected str, got int 1"),
        ({"trainer": {"optimizer": {"betas": [0.9]}}}, "trainer.optimizer.betas: expected a list of 2 items, got 1"),
        ({"model": 3}, "model: expected a path, got int 3"),
        ({"model": ""}, "model: expected a path, got str ''"),
        ({"output_dir": 3}, "output_dir: expected a path or null, got int 3"),
        ({"sft": []}, "sft: expected a mapping or null, got a list"),
        ({"rollout": None}, "rollout: expected a mapping, got null"),
        ({"rollout": {"sampling": {"seed": "x"}}}, "rollout.sampling.seed: expected int or null, got str 'x'"),
        ({"trainer": {"optimizer": {"lr": float("inf")}}}, "trainer.optimizer.lr: expected a finite number, got inf"),
        ({"algorithm": {"advantage": "gpro"}}, "algorithm.advantage: expected one of 'grpo', 'dr_grpo', "
         "'reinforce_pp', 'reinforce_pp_baseline', 'ppo'; got str 'gpro' (did you mean 'grpo'?)"),
        ({"trainer": {"tags": ["ref", "teachr"]}}, "trainer.tags[1]: expected one of 'ref', 'old_actor', "
         "'teacher'; got str 'teachr' (did you mean 'teacher'?)"),
    ],
)
def test_wrong_types_name_the_field_and_the_expected_type(overrides, message):
    assert error_of(overrides).startswith(message)


def test_yaml_booleans_in_a_string_field_get_a_hint():
    text = "name: j\nmodel: m\nnum_rollout: 1\ndata: {train: t}\nweight_sync: {plane: off}\n"
    with pytest.raises(ConfigError, match=r"weight_sync.plane: .*got bool False .*quote it"):
        parse_job(text, "/x", check_files=False)


def test_missing_required_keys_are_named():
    assert error_of(drop=("name",)) == "name: required key is missing"
    assert error_of(drop=("num_rollout",)) == "num_rollout: required key is missing"
    assert error_of({"sft": {"data": "sft.jsonl"}}) == "sft.steps: required key is missing"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_rollout": -1}, "num_rollout"),
        ({"name": "my job!"}, "name"),
        ({"rollout": {"sampling": {"top_p": 0}}}, "rollout.sampling.top_p"),
        ({"rollout": {"sampling": {"top_p": 1.5}}}, "rollout.sampling.top_p"),
        ({"rollout": {"sampling": {"temperature": -0.1}}}, "rollout.sampling.temperature"),
        ({"rollout": {"prompts_per_step": 0}}, "rollout.prompts_per_step"),
        ({"rollout": {"devices": ["cuda:1", "gpu1"]}}, "rollout.devices"),
        ({"algorithm": {"clip_eps_low": -0.1}}, "algorithm.clip_eps_low"),
        ({"algorithm": {"clip_eps_high": -0.1}}, "algorithm.clip_eps_high"),
        ({"algorithm": {"kl_coef": -1}}, "algorithm.kl_coef"),
        ({"trainer": {"optimizer": {"lr": 0}}}, "trainer.optimizer.lr"),
        ({"trainer": {"optimizer": {"betas": [0.9, 1.0]}}}, "trainer.optimizer.betas"),
        ({"trainer": {"device": "tpu"}}, "trainer.device"),
        ({"trainer": {"tags": ["ref", "ref"]}}, "trainer.tags"),
        ({"trainer": {"scheduler": {"min_lr_ratio": 2}}}, "trainer.scheduler.min_lr_ratio"),
        ({"weight_sync": {"bucket_mb": 0}}, "weight_sync.bucket_mb"),
        ({"eval": {"every": -1}}, "eval.every"),
        ({"eval": {"datasets": [{"name": "a", "path": "a", "limit": 0}]}}, "eval.datasets[0].limit"),
        ({"eval": {"datasets": [{"name": "a", "path": "a"}, {"name": "a", "path": "b"}]}}, "eval.datasets"),
    ],
)
def test_out_of_range_values_name_the_field(overrides, field):
    assert error_of(overrides).startswith(f"{field}: ")


def test_engines_take_the_listed_devices_in_turn_or_the_trainers():
    assert [parse().rollout.device_of(k, "cuda:0") for k in range(2)] == ["cuda:0", "cuda:0"]
    rollout = parse({"rollout": {"num_engines": 3, "devices": ["cuda:1", "cuda:2"]}}).rollout
    assert [rollout.device_of(k, "cuda:0") for k in range(3)] == ["cuda:1", "cuda:2", "cuda:1"]


# --------------------------------------------------------------------------- cross-field rules


def test_eval_only_job_needs_an_eval_dataset():
    assert error_of({"num_rollout": 0}, drop=("data",)) == (
        "eval.datasets: an eval-only job (num_rollout: 0) needs at least one eval dataset"
    )


def test_eval_only_job_skips_training_checks():
    cfg = parse(
        {
            "num_rollout": 0,
            "eval": {"datasets": [{"name": "a", "path": "a.jsonl"}]},
            "algorithm": {"advantage": "ppo", "kl_coef": 0.1},  # no critic is built in eval-only jobs
            "rollout": {"samples_per_prompt": 1},
            "trainer": {"scheduler": {"kind": "cosine", "warmup_steps": 10}},  # no scheduler is built either
        },
        drop=("data",),
    )
    assert cfg.eval_only and cfg.data.train is None
    assert cfg.trainer_tags == ()


def test_eval_only_job_rejects_sft():
    message = error_of({"num_rollout": 0, "eval": {"datasets": [{"name": "a", "path": "a"}]},
                        "sft": {"data": "s.jsonl", "steps": 3}})
    assert message.startswith("sft: an eval-only job")


def test_training_job_needs_training_data():
    assert error_of(drop=("data",)).startswith("data.train: a training job (num_rollout > 0) needs")


def test_ppo_trains_with_critics_and_an_eval_only_job_has_none():
    cfg = parse({"algorithm": {"advantage": "ppo", "gamma": 0.99, "lam": 0.9}, "critic": {"num_critics": 2}})
    assert cfg.needs_critic and cfg.num_critics == 2
    assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (0.99, 0.9)
    assert parse({"algorithm": {"advantage": "grpo"}}).num_critics == 0  # the critic section is unused


@pytest.mark.parametrize("overrides, message", [
    ({"algorithm": {"advantage": "ppo", "lam": 1.5}}, "algorithm.lam: must be in [0, 1], got 1.5"),
    ({"algorithm": {"advantage": "ppo", "gamma": -0.1}}, "algorithm.gamma: must be in [0, 1]"),
    ({"algorithm": {"advantage": "ppo"}, "critic": {"num_critics": 0}}, "critic.num_critics: must be >= 1"),
    ({"algorithm": {"advantage": "ppo"}, "critic": {"value_clip": -1}}, "critic.value_clip: must be >= 0"),
    ({"algorithm": {"advantage": "ppo"}, "critic": {"warmup_steps": 99}}, "critic.warmup_steps: must be < num_rollout"),
    ({"algorithm": {"advantage": "ppo"}, "critic": {"lr": 1e-5}}, "unknown key 'critic.lr'"),
])
def test_bad_ppo_settings_name_the_field(overrides, message):
    assert message in error_of(overrides)


def test_sglang_engines_take_exact_verification_and_the_colocated_plane_where_they_can():
    sglang = {"engine": "sglang", "sglang": {"args": ["--tp", "1"]}}
    cfg = parse({"rollout": sglang, "weight_sync": {"plane": "cuda_ipc", "verify": "exact"}})
    assert cfg.rollout.sglang.tp_size == 1 and cfg.weight_sync.plane == "cuda_ipc"
    tp2 = {"engine": "sglang", "sglang": {"args": ["--tp", "2"]}}
    assert "returns only rank 0's shard" in error_of({"rollout": tp2, "weight_sync": {"verify": "exact"}})
    assert "--tp 1" in error_of({"rollout": tp2, "weight_sync": {"plane": "cuda_ipc"}})
    remote = {"engine": "sglang", "sglang": {"url": "http://10.0.0.5:30000"}}
    assert "reached over loopback" in error_of({"rollout": remote, "weight_sync": {"plane": "cuda_ipc"}})
    sidecar = {"engine": "sglang", "sglang": {"url": "http://127.0.0.1:30000"}}
    assert parse({"rollout": sidecar, "weight_sync": {"plane": "cuda_ipc"}}).rollout.sglang.local
    assert "got shm" in error_of({"rollout": sglang, "weight_sync": {"plane": "shm"}})


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "reinforce_pp_baseline"])
def test_group_baselines_need_a_group(advantage):
    message = error_of({"algorithm": {"advantage": advantage}, "rollout": {"samples_per_prompt": 1}})
    assert message.startswith("rollout.samples_per_prompt: must be >= 2")
    assert advantage in message


def test_reinforce_pp_takes_one_sample_per_prompt():
    cfg = parse({"algorithm": {"advantage": "reinforce_pp"}, "rollout": {"samples_per_prompt": 1}})
    assert cfg.rollout.samples_per_prompt == 1


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ({"kind": "python"}, "reward.function: required when kind is 'python'"),
        ({"kind": "python", "function": "no_colon"}, "reward.function: expected \"module:function\""),
        ({"kind": "http"}, "reward.url: required when kind is 'http'"),
        ({"kind": "http", "url": "ftp://x"}, "reward.url: expected an http:// or https:// URL"),
        ({"kind": "exact_match", "function": "m:f"}, "reward.function: only used when kind is 'python'"),
    ],
)
def test_reward_kinds_need_their_settings(reward, message):
    assert error_of({"reward": reward}).startswith(message)


def test_decaying_scheduler_warmup_must_end_before_decay():
    message = error_of({"trainer": {"scheduler": {"kind": "linear", "warmup_steps": 5}}})  # num_rollout 5
    assert message.startswith("trainer.scheduler.warmup_steps: must be < the decay steps")
    assert "num_rollout = 5" in message
    explicit = error_of({"trainer": {"scheduler": {"kind": "cosine", "warmup_steps": 3, "decay_steps": 2}}})
    assert "trainer.scheduler.decay_steps = 2" in explicit
    assert parse({"trainer": {"scheduler": {"kind": "constant", "warmup_steps": 50}}}).trainer.scheduler.warmup_steps == 50


def test_ref_is_added_to_trainer_tags_when_kl_is_on():
    assert parse({"algorithm": {"kl_coef": 0.01}}).trainer_tags == ("ref",)
    assert parse({"algorithm": {"kl_coef": 0.01}, "trainer": {"tags": ["old_actor", "ref"]}}).trainer_tags == (
        "old_actor", "ref",
    )
    assert parse().trainer_tags == ()


# --------------------------------------------------------------------------- files


def test_files_the_job_reads_must_exist(job_dir):
    def fails(text: str) -> str:
        with pytest.raises(ConfigError) as info:
            parse_job(text, job_dir)
        return str(info.value)

    base = "name: j\nmodel: model\nnum_rollout: 2\ndata: {train: data/train.jsonl}\n"
    parse_job(base, job_dir)  # all present
    assert fails(base.replace("model: model", "model: nope")) == f"model: {job_dir / 'nope'} does not exist " \
        "(expected a Hugging Face model directory)"
    (job_dir / "model" / "config.json").unlink()
    assert fails(base).startswith(f"model: {job_dir / 'model'} has no config.json")
    (job_dir / "model" / "config.json").write_text("{}")
    assert fails(base.replace("train.jsonl", "missing.jsonl")) == f"data.train: {job_dir / 'data/missing.jsonl'} does not exist"
    with_eval = base + "eval: {datasets: [{name: t, path: data/gone.jsonl}]}\n"
    assert fails(with_eval) == f"eval.datasets[0].path: {job_dir / 'data/gone.jsonl'} does not exist"
    eval_only = "name: j\nmodel: model\nnum_rollout: 0\ndata: {train: nowhere}\neval: {datasets: [{name: t, path: data/test.jsonl}]}\n"
    assert parse_job(eval_only, job_dir).eval_only  # data.train is not read by an eval-only job
    parse_job(base.replace("model: model", "model: nope"), job_dir, check_files=False)


def test_load_job_errors_name_the_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: j\nmodel: m\nnum_rollout: 1\nrollout: {bogus: 1}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: unknown key 'rollout.bogus'"):
        load_job(path, check_files=False)
    with pytest.raises(ConfigError, match="cannot read job config"):
        load_job(tmp_path / "absent.yaml")


def test_malformed_yaml_is_a_config_error():
    with pytest.raises(ConfigError, match="invalid YAML"):
        parse_job("name: [unclosed\n", "/x")
    with pytest.raises(ConfigError, match="duplicate key 'seed' \\(line 2\\)"):
        parse_job("seed: 1\nseed: 2\n", "/x")
    with pytest.raises(ConfigError, match="empty"):
        parse_job("", "/x")
    with pytest.raises(ConfigError, match="job config: expected a mapping, got a list"):
        parse_job("- a\n", "/x")


# --------------------------------------------------------------------------- round trip and defaults


def test_to_dict_round_trips_with_absolute_paths(job_dir):
    (job_dir / "job.yaml").write_text(FULL_EXAMPLE)
    cfg = load_job(job_dir / "job.yaml")
    data = to_dict(cfg)
    assert data["model"] == str(job_dir / "model") and Path(data["model"]).is_absolute()
    assert data["trainer"]["optimizer"]["betas"] == [0.9, 0.999]
    again = parse_job(to_yaml(cfg), "/some/other/dir")  # the coordinator's base_dir does not matter
    assert again == cfg


def test_resolve_output_dir_default():
    cfg = parse()
    at = datetime(2025, 3, 4, 5, 6, 7)
    assert resolve_output_dir(cfg, cwd=Path("/work"), now=at) == Path("/work/runs/job-20250304-050607")
    explicit = parse({"output_dir": "out"})
    assert resolve_output_dir(explicit, cwd=Path("/work"), now=at) == Path("/jobs/out")


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse().seed = 2  # type: ignore[misc]


# --------------------------------------------------------------------------- JSON Schema


def _validate(schema: dict, value, root: dict, where: str = "$") -> None:
    """A small JSON Schema checker for the keywords job_json_schema uses (no jsonschema dependency)."""
    if "$ref" in schema:
        _validate(root["$defs"][schema["$ref"].rsplit("/", 1)[1]], value, root, where)
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                _validate(option, value, root, where)
                break
            except AssertionError as e:
                errors.append(e)
        else:
            raise AssertionError(f"{where}: matches no option: {errors}")
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
    if "type" in schema and schema["type"] != "null":
        expected = kinds[schema["type"]]
        assert isinstance(value, expected) and not (schema["type"] in ("integer", "number") and isinstance(value, bool)), \
            f"{where}: {value!r} is not {schema['type']}"
    if schema.get("type") == "null":
        assert value is None
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict) and schema.get("type") == "object":
        for key in schema["required"]:
            assert key in value, f"{where}: missing {key}"
        for key, item in value.items():
            assert key in schema["properties"], f"{where}: additional property {key!r}"
            _validate(schema["properties"][key], item, root, f"{where}.{key}")
    if isinstance(value, list) and schema.get("type") == "array":
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema["items"]
            assert sub is not False, f"{where}: too many items"
            _validate(sub, item, root, f"{where}[{i}]")


def test_json_schema_describes_the_tree(job_dir):
    schema = job_json_schema()
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) == {"name", "model", "num_rollout"}
    for name, definition in schema["$defs"].items():
        assert definition["additionalProperties"] is False, name
        for field, prop in definition["properties"].items():
            assert prop.get("description"), f"{name}.{field} has no description"
    algorithm = schema["$defs"]["AlgorithmConfig"]["properties"]
    assert algorithm["advantage"]["enum"] == ["grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline", "ppo"]
    assert algorithm["clip_eps_low"]["default"] == 0.2
    assert schema["properties"]["rollout"]["default"]["samples_per_prompt"] == RolloutConfig().samples_per_prompt
    eval_sampling = schema["$defs"]["EvalDatasetConfig"]["properties"]["sampling"]["default"]
    assert eval_sampling["temperature"] == 0.0

    (job_dir / "job.yaml").write_text(FULL_EXAMPLE)
    data = to_dict(load_job(job_dir / "job.yaml"))
    _validate(schema, data, schema)
    data["rollout"]["bogus"] = 1
    with pytest.raises(AssertionError, match="additional property 'bogus'"):
        _validate(schema, data, schema)


def test_example_in_this_file_is_valid_yaml_for_the_docs():
    # The FULL_EXAMPLE mirrors the documented tree: every key in it is a real field.
    assert set(yaml.safe_load(FULL_EXAMPLE)) == {f.name for f in dataclasses.fields(JobConfig)}
    assert textwrap.dedent(FULL_EXAMPLE) == FULL_EXAMPLE


def test_async_is_a_section_of_the_algorithm_and_absent_is_the_synchronous_loop():
    assert parse().algorithm.async_ is None and parse().algorithm.max_staleness == 0
    cfg = parse({"algorithm": {"async": {"max_staleness": 2, "correction": "decoupled", "tis_cap": 0}}})
    assert cfg.algorithm.max_staleness == 2 and cfg.algorithm.async_.correction == "decoupled"
    assert parse({"algorithm": {"async": {}}}).algorithm.async_.max_staleness == 1  # the section's default
    assert to_dict(cfg)["algorithm"]["async"]["max_staleness"] == 2  # its key, not the Python name


@pytest.mark.parametrize("overrides, message", [
    ({"algorithm": {"async": {"max_stalenes": 1}}}, "unknown key 'algorithm.async.max_stalenes' (did you mean 'max_staleness'?)"),
    ({"algorithm": {"async_": {}}}, "unknown key 'algorithm.async_'"),
    ({"algorithm": {"async": {"max_staleness": -1}}}, "algorithm.async.max_staleness: must be in [0, 64]"),
    ({"algorithm": {"async": {"correction": "tis", "tis_cap": 0}}}, "algorithm.async.tis_cap: must be > 0"),
    ({"algorithm": {"async": {"correction": "importance"}}}, "algorithm.async.correction: expected one of"),
    ({"algorithm": {"async": {}}, "trainer": {"colocate": True}}, "algorithm.async: asynchronous RL keeps engines"),
    ({"algorithm": {"advantage": "ppo", "async": {}}}, "algorithm.async: asynchronous RL is not built for PPO"),
    ({"rollout": {"samples_per_prompt": 1, "dynamic_sampling": {}}, "algorithm": {"advantage": "reinforce_pp"}},
     "rollout.dynamic_sampling: needs samples_per_prompt >= 2"),
    ({"rollout": {"dynamic_sampling": {"max_rounds": 0}}}, "rollout.dynamic_sampling.max_rounds: must be in [1, 64]"),
])
def test_bad_async_settings_name_the_field(overrides, message):
    assert message in error_of(overrides)


def test_agent_is_an_optional_section_and_bad_limits_are_named():
    assert parse().agent is None
    cfg = parse({"agent": {"max_turns": 6}})
    assert cfg.agent.environment == "calculator" and cfg.agent.max_turns == 6
    assert "agent.max_turns: must be in [1, 64]" in error_of({"agent": {"max_turns": 0}})
    assert "agent.environment: expected one of 'calculator'" in error_of({"agent": {"environment": "shell"}})


def test_a_remote_environment_needs_an_address():
    assert "agent.address: environment remote needs host:port" in error_of({"agent": {"environment": "remote"}})
    cfg = parse({"agent": {"environment": "remote", "address": "envs:50051", "timeout_s": 5}})
    assert cfg.agent.address == "envs:50051" and cfg.agent.max_observation_bytes == 1 << 20
