"""`rlm train` end to end on CPU: spec rejection before Ray, the Ray loop on 2 ranks, resume, the rank class without Ray."""
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlmegatron.cli import EXIT_BAD_SPEC, main

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = "configs/quickstart.yaml"
# Tiny steps: 4 prompts x 4 samples, validation on step 2, a checkpoint every 2 steps.
SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=4", "trainer.test_freq=2",
         "trainer.save_freq=2", "trainer.max_ckpt_to_keep=null", "tracking.backends=[console,mlflow]",
         "reward.function=tests/controller/parity_reward.py:compute_score"]
NOT_REPRODUCIBLE = ("timing_s/", "perf/")


def train(tmp: Path, name: str, use_ray: str, *overrides: str) -> dict:
    out = tmp / f"{name}.json"
    subprocess.run([sys.executable, "-m", "tests.controller.jobs", str(out), use_ray, *SMALL, *overrides],
                   cwd=REPO_ROOT, check=True, timeout=300)
    return json.loads(out.read_text())


def at_step(history: dict, step: int) -> dict[str, float]:
    return {k: v for k, points in history.items() for s, v in points if s == step and not k.startswith(NOT_REPRODUCIBLE)}


def test_bad_config_is_rejected_before_ray_starts(monkeypatch, capsys):
    import rlmegatron.controller.job as job

    monkeypatch.chdir(REPO_ROOT)
    started = []
    monkeypatch.setattr(job, "start_ray", lambda spec: started.append(spec))
    monkeypatch.setattr(job, "run_training", lambda spec, use_ray=True: started.append(spec))
    assert main(["train", QUICKSTART, "rollout.n=0"]) == EXIT_BAD_SPEC
    assert "rollout.n=0" in capsys.readouterr().err
    assert started == []
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    """3 steps on 2 Ray ranks (checkpoints at 2 and 3); then a copy of the run as if killed right after step 2's
    checkpoint, resumed with resume=auto and run to step 3."""
    tmp = tmp_path_factory.mktemp("ray")
    first = train(tmp, "first", "ray", "trainer.total_steps=3", f"trainer.run_dir={tmp / 'run'}",
                  "trainer.resume=disable")
    killed = tmp / "killed" / "checkpoints"
    killed.mkdir(parents=True)
    shutil.copytree(tmp / "run" / "checkpoints" / "step_2", killed / "step_2")
    (killed / "latest").write_text("step_2")
    resumed = train(tmp, "resumed", "ray", "trainer.total_steps=3", f"trainer.run_dir={tmp / 'killed'}",
                    "trainer.resume=auto")
    return tmp, first, resumed


def test_the_loop_logs_finite_verl_metrics_on_two_ray_ranks(ray_run):
    tmp, first, _ = ray_run
    history = first["history"]
    assert first["steps"] == 3 and [s for s, _ in history["critic/score/mean"]] == [1, 2, 3]
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/advantages/mean", "response_length/mean",
                 "response_length/clip_ratio", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights",
                 "timing_s/step", "perf/throughput", "val/echo/score/mean"):
        assert name in history, name
        assert all(math.isfinite(v) for _, v in history[name]), name
    assert (tmp / "run" / "checkpoints" / "latest").read_text() == "step_3"  # save_freq=2, and the last step
    assert (tmp / "run" / "mlflow.db").is_file()
    exported = Path(first["exported_hf"])
    assert (exported / "model.safetensors.index.json").is_file() and (exported / "config.json").is_file()


def test_resume_gives_the_same_next_step_metrics(ray_run):
    _, first, resumed = ray_run
    assert [s for s, _ in resumed["history"]["critic/score/mean"]] == [3]
    expected, got = at_step(first["history"], 3), at_step(resumed["history"], 3)
    assert expected["actor/grad_norm"] > 0  # the step did train: equal metrics are not trivially equal
    assert expected.keys() == got.keys()
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_the_policy_rank_runs_in_process_without_ray(tmp_path):
    result = train(tmp_path, "local", "local", "trainer.total_steps=2", "placement.gpus_per_node=1",
                   f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_freq=-1", "tracking.backends=[console]")
    assert [s for s, _ in result["history"]["actor/pg_loss"]] == [1, 2]
    assert not result["ray_imported"]
    assert (Path(result["exported_hf"]) / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("name,overrides", [
    ("ppo_critic", ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4",
                    "critic.ppo_micro_batch_size_per_gpu=8", "critic.optim.lr=1e-3"]),
    ("dapo", ["algorithm.dynamic_sampling.enable=true", "algorithm.dynamic_sampling.max_num_gen_batches=3",
              "reward.manager=dapo", "actor.clip_ratio_high=0.28", "actor.use_kl_loss=true"]),
])
def test_ppo_with_critic_and_dapo_run_in_process(tmp_path, name, overrides):
    result = train(tmp_path, name, "local", "trainer.total_steps=2", "placement.gpus_per_node=1",
                   f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_freq=2", "tracking.backends=[console]",
                   *overrides)
    history = result["history"]
    assert [s for s, _ in history["actor/pg_loss"]] == [1, 2]
    if name == "ppo_critic":
        assert all(math.isfinite(v) for _, v in history["critic/vf_loss"] + history["critic/values/mean"])
    else:
        assert "training/num_gen_batches" in history and "actor/kl_loss" in history
