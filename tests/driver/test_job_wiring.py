"""`check_training` and `run_training` hand each spec setting to the part that uses it: the parts are replaced by recorders (nothing is
built, no worker starts), and the loop itself is stopped as it is handed over."""
from pathlib import Path

import pytest

from rlmegatron.prelaunch.spec_pipeline import SpecSource, load_spec

REPO_ROOT = Path(__file__).resolve().parents[2]


class Stop(Exception):
    """Raised where the fit loop would start."""


class Part:
    """Records how it was made; any method call does nothing."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_run_training_hands_the_data_reward_checkpoint_and_tokenizer_settings_over(tmp_path, monkeypatch):
    import rlmegatron.data
    import rlmegatron.tracking
    from rlmegatron.prelaunch import spec_pipeline
    from rlmegatron.driver import job
    from rlmegatron.driver.job import check_training, run_training
    from rlmegatron.prelaunch.preflight import Preflight

    monkeypatch.chdir(REPO_ROOT)
    made: dict[str, list] = {}

    def recorder(name, result=None):
        def make(*args, **kwargs):
            made.setdefault(name, []).append((args, kwargs))
            return result if result is not None else Part(*args, **kwargs)
        return make

    def trainer(*args):
        made["trainer"] = args
        raise Stop

    # The pipeline's preflight stage loads the tokenizer the run uses (tests/test_user_errors.py checks what it
    # checks), its data stage builds the datasets.
    monkeypatch.setattr(spec_pipeline, "preflight", lambda spec, launching: made.setdefault("tokenizer", []).append(
        spec.model.tokenizer_path) or Preflight(tokenizer="tokenizer"))
    monkeypatch.setattr(rlmegatron.data, "build_dataset", recorder("dataset"))
    monkeypatch.setattr(rlmegatron.data, "PromptDataLoader", recorder("loader"))
    monkeypatch.setattr(job, "build_reward_manager", recorder("reward"))
    monkeypatch.setattr(job, "CheckpointManager", recorder("checkpoints"))
    monkeypatch.setattr(rlmegatron.tracking.Tracker, "from_spec", recorder("tracker"))
    monkeypatch.setattr(job, "LocalWorkerGroup", recorder("workers"))
    monkeypatch.setattr(job, "InTrainerRanks", recorder("engines"))
    monkeypatch.setattr(job, "EngineFleet", recorder("fleet"))
    monkeypatch.setattr(job, "Trainer", trainer)

    checked = check_training(SpecSource("configs/quickstart.yaml", [
        "model.tokenizer_path=elsewhere/tokenizer", "data.shuffle=false", "data.seed=5", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8", "data.max_response_length=2",
        "reward.num_workers=3", "trainer.max_ckpt_to_keep=2", "trainer.total_steps=3",
        f"trainer.run_dir={tmp_path / 'run'}"]), in_process=True)
    spec = checked.spec
    with pytest.raises(Stop):
        run_training(checked)

    assert made["tokenizer"] == ["elsewhere/tokenizer"]
    (train_args, _), (val_args, _) = made["dataset"]
    assert train_args == (spec.data.train_files, "tokenizer", spec.data, "elsewhere/tokenizer")  # its processor
    assert val_args == (spec.data.val_files, "tokenizer", spec.data, "elsewhere/tokenizer")
    (loader_args, loader_kwargs), = made["loader"]
    assert loader_args[1:] == (4,) and loader_kwargs == {"shuffle": False, "seed": 5}
    (reward_args, _), = made["reward"]
    assert reward_args == (spec.reward, 2) and reward_args[0].num_workers == 3
    assert made["checkpoints"] == [((str(tmp_path / "run"), 2), {})]
    # The loop gets exactly these parts.
    _, workers, fleet, tokenizer, loader, val_set, reward, _, checkpoints = made["trainer"]
    engines = fleet.args[0]
    assert (tokenizer, loader.args, val_set.args, checkpoints.args) == (
        "tokenizer", tuple(loader_args), tuple(val_args), (str(tmp_path / "run"), 2))
    # The quickstart's engines are local on the CPU: nothing to give back between steps, so no release call.
    assert reward.args == reward_args and engines.args == (workers, False)
    assert fleet.kwargs == {"held": "init"}  # the colocated ranks pushed the initial weights as they built them


@pytest.mark.parametrize("settings, ray_address, launched", [
    ([], None, "processes"),  # the quickstart: 2 CPU ranks on this machine
    (["placement.nnodes=2"], None, "ray"),
    ([], "10.0.0.1:6379", "ray"),  # a cluster named: auto joins it
    (["placement.device=cuda", "placement.mode=disaggregate", "placement.rollout_nnodes=1",
      "placement.rollout_gpus_per_node=1", "rollout.engine=sglang"], None, "ray"),  # a GPU pool to place
    (["placement.mode=disaggregate", "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1"], None,
     "processes"),  # on CPU the pool's hosts run in the driver
    (["placement.transport=ray"], None, "ray"),
])
def test_auto_launches_processes_where_the_run_fits_one_machine_without_ray(settings, ray_address, launched,
                                                                             monkeypatch):
    from rlmegatron.prelaunch.spec_pipeline import transport_for

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray_address:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    assert transport_for(load_spec("configs/quickstart.yaml", settings)) == launched


def test_processes_with_a_ray_address_is_refused_naming_the_field_and_the_fix(monkeypatch):
    from rlmegatron.config import SpecError
    from rlmegatron.prelaunch.spec_pipeline import VALIDATE_STAGES, check_job

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(SpecError) as refused:
        check_job(SpecSource("configs/quickstart.yaml", ["placement.transport=processes"]), VALIDATE_STAGES)
    assert str(refused.value) == ("command line: placement.transport=processes: runs the ranks on this machine without "
                                  "Ray, but RAY_ADDRESS=10.0.0.1:6379 names a Ray cluster; use placement.transport=ray "
                                  "or auto, or unset RAY_ADDRESS")


def test_a_run_whose_ranks_restarted_reports_every_step_it_trained_and_the_restart(tmp_path, monkeypatch, capsys):
    import rlmegatron.data
    from rlmegatron.prelaunch import spec_pipeline
    from rlmegatron.driver import job
    from rlmegatron.driver.job import check_training, run_training
    from rlmegatron.driver.trainer import FitResult, RankLost
    from rlmegatron.prelaunch.preflight import Preflight

    class Tracker(Part):
        history: dict = {}

        def series(self, name):
            return []

        def summary(self):
            return ""

    attempts = []

    class Trainer:
        """The first attempt trains steps 1 and 2 (a checkpoint at 1) and loses a rank; the restart resumes at 1."""

        def __init__(self, *args):
            self.resumed_from = len(attempts)
            attempts.append(self)

        def fit(self):
            if len(attempts) == 1:
                raise RankLost("rank 1 died in step 2")
            return FitResult(steps=3, resumed_from=1, last_checkpoint="step_3", exported_hf=None)

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(spec_pipeline, "preflight", lambda spec, launching: Preflight(tokenizer="tokenizer"))
    monkeypatch.setattr(rlmegatron.data, "build_dataset", Part)
    monkeypatch.setattr(rlmegatron.data, "PromptDataLoader", Part)
    for name in ("build_reward_manager", "CheckpointManager", "LocalWorkerGroup", "InTrainerRanks", "EngineFleet"):
        monkeypatch.setattr(job, name, Part)
    monkeypatch.setattr(job.Tracker, "from_spec", Tracker)
    monkeypatch.setattr(job, "_draw_curves", lambda spec, tracker: None)
    monkeypatch.setattr(job, "Trainer", Trainer)
    run_training(check_training(SpecSource("configs/quickstart.yaml", [
        "trainer.total_steps=3", "trainer.max_restarts=1", "tracking.backends=[console]",
        f"trainer.run_dir={tmp_path / 'run'}"]), in_process=True))
    assert len(attempts) == 2
    # The first attempt started afresh: the run trained steps 1-3, not only the restart's 2-3.
    assert "trained steps 1-3 (3 steps, the ranks restarted 1 time(s)) in " in capsys.readouterr().out
