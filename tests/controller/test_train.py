"""`rlm train` end to end on CPU: spec rejection before Ray, the Ray loop on 2 ranks, resume, the rank class without Ray."""
import json
import math
import os
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


def test_colocated_sglang_engine_that_dies_mid_step_is_restarted_resynced_and_the_step_completes(tmp_path):
    """The SGLang path of the loop against the loopback server that speaks SGLang's protocol: it dies on the 5th
    of step 1's 16 generate calls; the engine restarts it, the trainer pushes the weights again and resends."""
    fake_sglang = REPO_ROOT / "tests" / "rollout" / "fake_sglang"
    calls = tmp_path / "calls.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake_sglang), str(REPO_ROOT)])}
    out = tmp_path / "sglang.json"
    subprocess.run([sys.executable, "-m", "tests.controller.jobs", str(out), "local", *SMALL, "trainer.total_steps=2",
                    "placement.gpus_per_node=1", f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_freq=-1",
                    "trainer.test_freq=-1", "tracking.backends=[console]", "rollout.engine=sglang",
                    f"rollout.sglang.python={sys.executable}", "rollout.sglang.startup_timeout_s=60",
                    f"rollout.sglang.extra_args.fake-record={calls}",
                    f"rollout.sglang.extra_args.fake-marker={tmp_path / 'died'}",
                    "rollout.sglang.extra_args.fake-die-after-generates=5"],
                   cwd=REPO_ROOT, env=env, check=True, timeout=300)
    history = json.loads(out.read_text())["history"]
    assert [s for s, _ in history["actor/pg_loss"]] == [1, 2]
    assert all(math.isfinite(v) for _, v in history["actor/pg_loss"] + history["actor/grad_norm"])

    records = [json.loads(line) for line in calls.read_text().splitlines()]
    first, second = sorted({r["pid"] for r in records}, key=[r["pid"] for r in records].index)
    assert len({r["pid"] for r in records}) == 2  # one restart
    died, restarted = [r for r in records if r["pid"] == first], [r for r in records if r["pid"] == second]
    # The replacement gets the weights before any request, then step 1's 16 samples (the share that saw the
    # failure is sent again whole), the colocated release, the wake-up with step 1's weights, and step 2.
    assert [r["path"] for r in died].count("/generate") < 5
    paths = [r["path"] for r in restarted]
    first_generate = paths.index("/generate")
    assert "/update_weights_from_tensor" in paths[:first_generate] and "/flush_cache" in paths[:first_generate]
    release = paths.index("/release_memory_occupation")
    assert paths[first_generate:release] == ["/generate"] * 16
    resume_weights, resume_cache = [i for i, p in enumerate(paths) if p == "/resume_memory_occupation"][:2]
    assert restarted[release]["tags"] == ["weights", "kv_cache", "cuda_graph"]
    assert restarted[resume_weights]["tags"] == ["weights"]
    assert set(paths[resume_weights + 1 : resume_cache]) == {"/update_weights_from_tensor", "/flush_cache"}
    assert restarted[resume_cache]["tags"] == ["kv_cache", "cuda_graph"]
    assert paths[resume_cache + 1 :].count("/generate") == 16
