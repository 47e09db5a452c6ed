"""Rejection format: file, dotted field, value and reason for YAML typos, type errors and unreadable files."""
import pytest

from rlmegatron.config import SpecError
from rlmegatron.prelaunch.spec_pipeline import load_spec
from tests.config.specs import minimal_spec, problems_of


def test_typo_in_yaml_key_suggests_the_nearest():
    raw = minimal_spec()
    raw["actor"]["optim"] = {"lrr": 1e-6}
    assert problems_of(raw) == [
        "job.yaml: actor.optim.lrr=1.0e-06: unknown key 'lrr' in actor.optim; did you mean 'lr'?"
    ]


def test_verl_rollout_key_points_at_its_name_here():
    raw = minimal_spec()
    raw["rollout"]["tensor_model_parallel_size"] = 2
    assert problems_of(raw) == [
        "job.yaml: rollout.tensor_model_parallel_size=2: unknown key 'tensor_model_parallel_size' in rollout; "
        "did you mean 'tensor_parallel_size'?"
    ]


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.n=abc", "command line: rollout.n=abc: should be a valid integer"),
        ("placement.gpus_per_node=true", "command line: placement.gpus_per_node=true: should be a valid integer"),
        ("actor.use_kl_loss=1", "command line: actor.use_kl_loss=1: should be a valid boolean"),
        ("rollout.engine=sglng", "command line: rollout.engine=sglng: should be 'sglang' or 'local'"),
        ("actor.ppo_epochs=0", "command line: actor.ppo_epochs=0: should be greater than or equal to 1"),
        ("data.train_files=[a.csv]", "command line: data.train_files[0]=a.csv: must be a .parquet or .jsonl file"),
        ("tracking.backends=[swanlab]", "command line: tracking.backends[0]=swanlab: should be 'mlflow', 'wandb', "
                                          "'tensorboard' or 'console'"),
        ("reward.function=rewards.py", "command line: reward.function=rewards.py: must look like path/to/file.py:name"),
        ("trainer.save_freq=0", "command line: trainer.save_freq=0: must be a number of steps >= 1, or -1 for never"),
        ("actor=3", "command line: actor=3: must be a section: a mapping of keys to values"),
    ],
)
def test_type_errors_are_translated(override, message):
    [problem] = problems_of(minimal_spec(), override)
    assert problem.startswith(message)
    assert "Input should" not in problem and "pydantic" not in problem


def test_dynamic_sampling_needs_a_bound_on_its_rounds():
    # verl's 0 means "no limit", which never ends a step whose groups all keep scoring the same.
    [problem] = problems_of(minimal_spec(), "algorithm.dynamic_sampling.enable=true",
                            "algorithm.dynamic_sampling.max_num_gen_batches=0")
    assert problem == ("command line: algorithm.dynamic_sampling.max_num_gen_batches=0: must be a number of generation "
                       "rounds >= 1 (0, verl's 'no limit', could generate forever when every group scores the same); "
                       "e.g. 10")


def test_missing_required_field_is_named():
    raw = minimal_spec()
    del raw["model"]["path"]
    assert problems_of(raw) == ["job.yaml: model.path: is required but missing"]


def test_every_problem_is_reported_at_once():
    raw = minimal_spec()
    raw["rollout"]["n"] = "four"
    raw["actor"]["optim"] = {"lr": -1}
    raw["placement"]["device"] = "tpu"
    fields = [problem.split(": ")[1].split("=")[0] for problem in problems_of(raw, "trainer.seed=x")]
    assert sorted(fields) == ["actor.optim.lr", "placement.device", "rollout.n", "trainer.seed"]


def test_override_problems_and_check_problems_come_together():
    problems = problems_of(minimal_spec(), "rollout.nn=2", "actor.ppo_mini_batch_size=5")
    assert problems[0] == "command line: rollout.nn=2: unknown key 'nn' in rollout; did you mean 'n'?"
    assert problems[1].startswith("command line: actor.ppo_mini_batch_size=5: does not divide data.train_batch_size=16")


def test_problems_on_fields_the_yaml_set_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {path: x}\ndata: {train_files: [a.parquet], max_prompt_length: long}\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert str(caught.value.problems[0]) == f"{path}: data.max_prompt_length=long: should be a valid integer"


def test_yaml_syntax_error_gives_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  path: x\ndata: {train_files: [a.parquet\n")
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    [problem] = caught.value.problems
    assert str(problem).startswith(f"{path}: not valid YAML: line 4, column 1:")


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- data\n")
    with pytest.raises(SpecError, match="must be a YAML mapping of sections"):
        load_spec(path)


def test_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="nope.yaml: cannot read the spec: No such file or directory"):
        load_spec(tmp_path / "nope.yaml")
