"""The spec pipeline (rlmegatron/prelaunch/spec_pipeline.py) is the one place a spec is rejected: each stage rejects what it
is there for, `rlm validate` and `rlm train` say the same line for the same mistake, no other module makes a
SpecError, and the policy the spec implies is worked out by one function that the planner, the trainer and the
ranks' settings all call."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from rlmegatron.entry.cli import EXIT_BAD_SPEC, main
from rlmegatron.config import SpecError
from rlmegatron.config.spec import JobSpec, optimizer_steps
from rlmegatron.prelaunch.spec_pipeline import (
    SPEC_STAGES, STAGES, TRAIN_STAGES, VALIDATE_STAGES, SpecSource, check_job, load_spec,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "rlmegatron"
QUICKSTART = "configs/quickstart.yaml"

# A mistake each stage is there to find (run from the repository root), and the line it is reported with.
MISTAKES = {
    "schema": (["rollout.n=0"], "command line: rollout.n=0: should be greater than or equal to 1"),
    "cross-field": (["actor.optim.min_lr=1"], "command line: actor.optim.min_lr=1.0: exceeds actor.optim.lr=0.001"),
    "relevance": (["actor.kl_loss_coef=0.3"], "command line: actor.kl_loss_coef=0.3: only applies with "
                  "actor.use_kl_loss=true; remove it (~actor.kl_loss_coef on the command line) or turn the KL loss on"),
    "launch": (["placement.transport=processes"], "command line: placement.transport=processes: runs the ranks on "
               "this machine without Ray, but RAY_ADDRESS=10.0.0.1:6379 names a Ray cluster; use "
               "placement.transport=ray or auto, or unset RAY_ADDRESS"),
    "schedule": (["trainer.total_steps=10", "actor.optim.lr_warmup_steps=500"],
                 "command line: actor.optim.lr_warmup_steps=500: must be below the run's 10 steps "
                 "(trainer.total_steps); lower it"),
    "preflight": (["model.tokenizer_path=configs"],
                  "model.tokenizer_path=configs: holds no tokenizer (tokenizer.json, tokenizer_config.json, "
                  "tokenizer.model, ...); point model.tokenizer_path at the model's tokenizer directory"),
}


@pytest.fixture
def at_the_root(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


@pytest.mark.parametrize("stage", MISTAKES)
def test_each_stage_rejects_its_mistake_in_one_line(stage, at_the_root, monkeypatch):
    overrides, line = MISTAKES[stage]
    if stage == "launch":
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    source = SpecSource(QUICKSTART, (*overrides, f"trainer.run_dir={at_the_root}"))
    with pytest.raises(SpecError) as rejected:
        check_job(source, VALIDATE_STAGES)
    assert str(rejected.value) == line
    # Without the stage, the same spec passes: this stage, no other, rejected it.
    if stage != "schema":
        check_job(source, [name for name in VALIDATE_STAGES if name != stage])


def test_the_data_stage_reads_every_row_and_counts_the_batches_for_the_schedule(at_the_root):
    lines = (REPO_ROOT / "configs/quickstart/train.jsonl").read_text().splitlines()
    good, bad = at_the_root / "good.jsonl", at_the_root / "bad.jsonl"
    good.write_text("\n".join(lines[:32]) + "\n")
    # Row 9 lacks its ground truth: past the 8 rows preflight reads, so the data stage finds it.
    broken = json.loads(lines[8])
    del broken["reward_model"]
    bad.write_text("\n".join([*lines[:8], json.dumps(broken)]) + "\n")
    run_dir = f"trainer.run_dir={at_the_root / 'run'}"
    by_epochs = "~trainer.total_steps"  # the quickstart sets 150 steps
    job = check_job(SpecSource(QUICKSTART, (f"data.train_files=[{good}]", run_dir, by_epochs)), TRAIN_STAGES)
    # The schedule of a run by epochs runs after the data stage has counted the batches.
    assert job.stages == ("schema", "cross-field", "relevance", "launch", "preflight", "data", "schedule")
    assert len(job.loader) == 2 and job.total_steps == 2  # 32 rows / 16 per batch
    with pytest.raises(SpecError) as rejected:
        check_job(SpecSource(QUICKSTART, (f"data.train_files=[{good}]", run_dir, by_epochs,
                                          "actor.optim.lr_warmup_steps=2")))
    assert str(rejected.value) == ("command line: actor.optim.lr_warmup_steps=2: must be below the run's 2 steps "
                                   "(trainer.total_epochs=1 x 2 batches of data.train_files); lower it")
    from rlmegatron.data import DatasetError

    with pytest.raises(DatasetError) as rejected_row:
        check_job(SpecSource(QUICKSTART, (f"data.train_files=[{good}, {bad}]", run_dir, by_epochs)), TRAIN_STAGES)
    # Named as preflight names a bad row among the first: the field, then the file and line.
    assert str(rejected_row.value).startswith(f"data.train_files[1]: {bad}:9: no ground truth at data.answer_key=")


def test_each_command_runs_its_stages(at_the_root):
    source = SpecSource(QUICKSTART, (f"trainer.run_dir={at_the_root}", "~trainer.total_steps"))
    # Trained by epochs: the schedule has nothing to check until the data stage counts the batches.
    assert check_job(source, SPEC_STAGES).stages == ("schema", "cross-field", "relevance")
    assert check_job(source, VALIDATE_STAGES).stages == ("schema", "cross-field", "relevance", "launch", "preflight")
    steps = SpecSource(QUICKSTART, (f"trainer.run_dir={at_the_root}",))  # its trainer.total_steps
    assert check_job(steps, SPEC_STAGES).stages == SPEC_STAGES
    assert check_job(steps, VALIDATE_STAGES).stages == VALIDATE_STAGES
    assert set(TRAIN_STAGES) == set(STAGES)


@pytest.mark.parametrize("stage", MISTAKES)
def test_validate_and_train_say_the_same_line_with_exit_2(stage, at_the_root, monkeypatch, capsys):
    from rlmegatron.driver import job

    overrides, line = MISTAKES[stage]
    if stage == "launch":
        monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setattr(job, "fork_server", lambda *args: None)  # the ranks' imports, which train starts early
    monkeypatch.setattr(job, "run_training", lambda checked: pytest.fail("the run started"))
    argv = [QUICKSTART, *overrides, f"trainer.run_dir={at_the_root}"]
    said = {}
    for command in ("validate", "train"):
        assert main([command, *argv]) == EXIT_BAD_SPEC
        out, said[command] = capsys.readouterr()
        assert out == ""
    assert said["validate"] == said["train"] == line + "\n"


def _makes_a_spec_error(node: ast.AST) -> bool:
    func = getattr(node, "func", None)
    return isinstance(node, ast.Call) and (getattr(func, "id", None) == "SpecError"
                                           or getattr(func, "attr", None) == "SpecError")


def test_no_module_but_the_pipeline_makes_a_spec_error():
    """The other modules return SpecProblems; only the pipeline turns them into a rejection."""
    makers = {}
    for path in PACKAGE.rglob("*.py"):
        lines = [node.lineno for node in ast.walk(ast.parse(path.read_text())) if _makes_a_spec_error(node)]
        if lines:
            makers[str(path.relative_to(REPO_ROOT))] = lines
    assert set(makers) == {"rlmegatron/prelaunch/spec_pipeline.py"}, makers


def test_the_planner_the_trainer_and_the_ranks_count_with_the_same_functions(monkeypatch, tmp_path):
    from rlmegatron.driver.role_settings import actor_settings, critic_settings
    from rlmegatron.models.families import read_architecture
    from rlmegatron.planner.plan import PlanSettings, build_plan
    from tests.driver.fit_rig import run_rig

    spec = load_spec("configs/deepseek_v3_671b_grpo.yaml")
    arch = read_architecture(spec.model.architecture_source()[1])
    # The old-log-prob pass: the planner prices it, and the trainer runs it, exactly when the spec's rule says so.
    for needed in (True, False):
        monkeypatch.setattr(JobSpec, "needs_old_log_prob_pass", property(lambda self, needed=needed: needed))
        assert ("old_log_prob" in build_plan(spec, arch, PlanSettings()).step_time.phases) is needed
        rig = run_rig(tmp_path / str(needed), "trainer.total_steps=1")
        assert ("compute_log_prob" in rig.ranks.calls) is needed
    monkeypatch.undo()
    # Optimizer steps: the driver's count (its progress bar) and the ranks' own (their on-policy guard) from the
    # settings the driver hands them.
    for overrides in ([], ["actor.ppo_mini_batch_size=4", "actor.ppo_epochs=2", "actor.ppo_micro_batch_size_per_gpu=4"],
                      ["actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8"]):
        spec = load_spec(QUICKSTART, overrides)
        actor = actor_settings(spec, 10)
        sequences = spec.data.train_batch_size * spec.rollout.n
        assert actor.ppo_mini_batch_size == spec.mini_batch_sequences("actor")
        assert optimizer_steps(sequences, actor.ppo_mini_batch_size, actor.ppo_epochs) == \
            spec.optimizer_steps_per_update("actor")
        assert spec.needs_old_log_prob_pass is (spec.optimizer_steps_per_update("actor") > 1)
    critic_spec = load_spec(QUICKSTART, ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8"])
    assert critic_settings(critic_spec, 10).ppo_mini_batch_size == critic_spec.mini_batch_sequences("critic")


def test_the_spec_does_not_import_the_packages_that_read_it():
    """config reads no package that imports config (counting `if TYPE_CHECKING:` imports, which are a cycle to a
    reader all the same): the rewards' async check lives in plugins.py, which both use."""
    def imported_packages(root: Path) -> set[str]:
        found = set()
        for path in root.rglob("*.py") if root.is_dir() else [root]:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlmegatron."):
                    found.add(".".join(node.module.split(".")[:2]))
                elif isinstance(node, ast.Import):
                    found |= {".".join(a.name.split(".")[:2]) for a in node.names if a.name.startswith("rlmegatron.")}
        return found

    readers = {f"rlmegatron.{path.stem if path.is_file() else path.name}" for path in PACKAGE.iterdir()
               if path.name != "config" and (path.suffix == ".py" or (path / "__init__.py").exists())
               and "rlmegatron.config" in imported_packages(path)}
    assert "rlmegatron.rewards" in readers  # the walk finds the readers
    assert not imported_packages(PACKAGE / "config") & readers
