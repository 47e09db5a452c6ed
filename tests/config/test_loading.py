"""Layering of the spec: pydantic defaults, then YAML, then command-line overrides; derived defaults; dumps."""
import subprocess
import sys

import pytest
import yaml

from rlmegatron.config import dump_spec
from rlmegatron.prelaunch.spec_pipeline import load_spec, spec_from_raw
from rlmegatron.config.yamlio import parse_yaml
from tests.config.specs import REPO_ROOT, minimal_spec


@pytest.fixture
def spec_file(tmp_path):
    raw = minimal_spec()
    raw["actor"]["optim"] = {"lr": 3e-6}
    raw["rollout"]["temperature"] = 0.7
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_defaults_fill_every_section():
    spec = spec_from_raw(minimal_spec())
    assert spec.actor.optim.lr == 1e-6
    assert spec.actor.clip_ratio_c == 3.0
    assert spec.algorithm.adv_estimator == "grpo"
    assert spec.critic.optim.lr == 1e-5
    assert spec.rollout.val_kwargs.temperature == 0.0
    assert spec.tracking.backends == ["console"]


def test_derived_defaults_follow_the_fields_they_derive_from():
    spec = spec_from_raw(minimal_spec(), ["data.max_response_length=48", "trainer.experiment_name=exp1"])
    assert spec.rollout.max_new_tokens == 48
    assert spec.model.tokenizer_path == spec.model.path
    assert spec.critic.enable is False
    assert spec.trainer.run_dir == "runs/exp1"
    assert spec.actor.megatron.expert_tensor_parallel_size == spec.actor.megatron.tensor_model_parallel_size


def test_loss_mode_follows_the_estimator_unless_set():
    assert spec_from_raw(minimal_spec()).actor.policy_loss.loss_mode == "vanilla"
    assert spec_from_raw(minimal_spec(), ["algorithm.adv_estimator=gspo"]).actor.policy_loss.loss_mode == "gspo"
    chosen = spec_from_raw(minimal_spec(), ["actor.policy_loss.loss_mode=cispo"])
    assert chosen.actor.policy_loss.loss_mode == "cispo"


def test_critic_is_enabled_by_gae():
    spec = spec_from_raw(minimal_spec(), ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8"])
    assert spec.critic.enable is True


def test_ref_and_critic_take_unset_megatron_fields_from_the_actor():
    raw = minimal_spec()
    raw["actor"]["megatron"] = {"tensor_model_parallel_size": 2, "extra": {"hidden_dropout": 0.1}}
    raw["actor"]["use_kl_loss"] = True  # the reference and the critic must exist for their layouts to matter
    raw["algorithm"] = {"adv_estimator": "gae"}
    raw["critic"] = {"ppo_mini_batch_size": 8}
    raw["ref"] = {"megatron": {"pipeline_model_parallel_size": 2}}
    spec = spec_from_raw(raw)
    assert spec.ref.megatron.tensor_model_parallel_size == 2
    assert spec.ref.megatron.pipeline_model_parallel_size == 2
    assert spec.ref.megatron.extra == {"hidden_dropout": 0.1}
    assert spec.critic.megatron.tensor_model_parallel_size == 2
    assert spec.critic.megatron.pipeline_model_parallel_size == 1
    assert spec.ref.megatron.expert_tensor_parallel_size == 2


def test_empty_yaml_section_takes_the_defaults():
    raw = minimal_spec()
    raw["critic"] = None  # `critic:` with nothing under it
    assert spec_from_raw(raw).critic.cliprange_value == 0.5


def test_yaml_overrides_defaults(spec_file):
    spec = load_spec(spec_file)
    assert spec.actor.optim.lr == 3e-6
    assert spec.rollout.temperature == 0.7


def test_command_line_overrides_yaml(spec_file):
    spec = load_spec(
        spec_file,
        [
            "actor.optim.lr=1e-6",
            "rollout.n=8",
            "data.train_files=[a.parquet,b.parquet]",
            "actor.megatron.extra.hidden_dropout=0.1",
            "actor.use_kl_loss=true",
            "rollout.top_p=0.9",
        ],
    )
    assert spec.actor.optim.lr == 1e-6
    assert spec.rollout.n == 8
    assert spec.data.train_files == ["a.parquet", "b.parquet"]
    assert spec.actor.megatron.extra == {"hidden_dropout": 0.1}
    assert spec.actor.use_kl_loss is True
    assert spec.rollout.top_p == 0.9
    assert spec.rollout.temperature == 0.7  # untouched YAML value survives


def test_a_single_file_is_accepted_where_a_list_is_expected():
    spec = spec_from_raw(minimal_spec(), ["data.train_files=only.parquet", "tracking.backends=mlflow"])
    assert spec.data.train_files == ["only.parquet"]
    assert spec.tracking.backends == ["mlflow"]


def test_exponent_floats_without_a_dot_are_floats():
    # PyYAML's YAML 1.1 rules would read 1e-6 as the string "1e-6".
    assert parse_yaml("lr: 1e-6") == {"lr": 1e-6}
    spec = spec_from_raw(minimal_spec(), ["actor.megatron.extra.init_method_std=2e-2"])
    assert spec.actor.megatron.extra["init_method_std"] == 0.02


def test_numbers_in_free_text_fields_are_text():
    spec = spec_from_raw(minimal_spec(), ["trainer.experiment_name=2024"])
    assert spec.trainer.experiment_name == "2024"


@pytest.mark.parametrize(
    "algorithm",
    [[], ["algorithm.adv_estimator=gspo"],
     ["actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0.01"]],
    ids=["grpo", "gspo-derived-loss", "clip-cov"],
)
def test_dump_reloads_to_the_same_spec(algorithm):
    raw = minimal_spec()
    raw["ref"] = {"megatron": {"pipeline_model_parallel_size": 2}}
    spec = spec_from_raw(raw, ["actor.use_kl_loss=true", *algorithm])
    # Every knob is written out, those the chosen loss does not read at their defaults, so it loads back.
    assert spec_from_raw(parse_yaml(dump_spec(spec))) == spec


@pytest.mark.parametrize("config", ["configs/quickstart.yaml", "configs/quickstart_lora.yaml",
                                    "configs/gsm8k_cpu_smoke.yaml"])
def test_shipped_job_specs_validate(config, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # their paths are relative to the repository root
    spec = load_spec(config)
    assert spec.placement.device == "cpu"
    assert spec.rollout.engine == "local"
    assert spec.algorithm.adv_estimator == "grpo"


def test_importing_the_config_package_loads_no_torch_or_megatron():
    probe = (
        "import sys, rlmegatron.config, rlmegatron.config.verl_keys; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron', 'transformers'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_a_spec_error_crosses_a_process_boundary_with_its_problems():
    import pickle

    from rlmegatron.config import SpecError, SpecProblem

    error = SpecError([SpecProblem("rollout.n", 0, "should be at least 1", file="job.yaml"),
                       SpecProblem("data.train_files[0]", "a.jsonl", "no such file")])
    copy = pickle.loads(pickle.dumps(error))
    assert copy.problems == error.problems and str(copy) == str(error)
