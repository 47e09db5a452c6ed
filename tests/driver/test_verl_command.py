"""A verl command line trains: PPO on the quickstart from verl's keys, with critic warmup, the old-log-prob pass's own
micro-batch size, and rollout samples traced to MLflow as text."""
import json
import os
import sys
from pathlib import Path

import pytest
from tests.helpers import warm_runs

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl")
    out = tmp / "run.json"
    verl_args = [
        "algorithm.adv_estimator=gae", "data.train_batch_size=4", "data.val_files=[]",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2", "critic.optim.lr=1e-3",
        "trainer.critic_warmup=1", f"trainer.total_training_steps={STEPS}", "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={tmp / 'run'}", 'trainer.logger=["console","mlflow"]',
        "actor_rollout_ref.rollout.trace.backend=mlflow", "actor_rollout_ref.rollout.trace.token2text=True",
        "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=2",
    ]
    env = {key: value for key, value in os.environ.items() if key != "MLFLOW_TRACKING_URI"}
    run = warm_runs.run([sys.executable, "-m", "tests.driver.verl_job", str(out), *verl_args], cwd=REPO_ROOT,
                         env=env, timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return json.loads(out.read_text())


def test_the_actor_waits_for_the_critic_warmup(verl_run):
    history = verl_run["history"]
    assert [step for step, _ in history["critic/vf_loss"]] == [1, 2]
    assert [step for step, _ in history["actor/pg_loss"]] == [2]


def test_the_old_log_prob_pass_cuts_its_own_micro_batches(verl_run):
    # Two PPO epochs, so the old log-probs get a pass of their own. Per step, 16 sequences: values (critic's 2), old
    # log-probs (8, not the actor's 4), the critic update (2), and from step 2 on the actor update (4), once per epoch.
    assert verl_run["cuts"] == [[16, 2], [16, 8], [16, 2]] + [[16, 2], [16, 8], [16, 2], [16, 4], [16, 4]]


def test_each_steps_rollout_samples_are_text_in_mlflow(verl_run):
    from mlflow.tracking import MlflowClient

    run_dir = Path(verl_run["run_dir"])
    saved = json.loads((run_dir / "mlflow_run.json").read_text())
    assert saved["tracking_uri"] == f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=saved["tracking_uri"])
    listed = sorted(artifact.path for artifact in client.list_artifacts(saved["run_id"], "rollout_samples"))
    assert listed == [f"rollout_samples/step_{step:06d}.{kind}" for step in range(1, STEPS + 1)
                      for kind in ("json", "txt")]
    for step in range(1, STEPS + 1):
        local = Path(client.download_artifacts(saved["run_id"], f"rollout_samples/step_{step:06d}.json"))
        table = json.loads(local.read_text())
        rows = [dict(zip(table["columns"], row)) for row in table["data"]]
        # Two prompts (max_samples_per_step_per_worker=2), each with all rollout.n=4 responses.
        assert len(rows) == 8 and len({row["sample_id"] for row in rows}) == 2
        assert sorted(row["sample"] for row in rows) == [0, 0, 1, 1, 2, 2, 3, 3]
        text = Path(client.download_artifacts(saved["run_id"], f"rollout_samples/step_{step:06d}.txt")).read_text()
        for row in rows:
            assert row["step"] == step
            # The quickstart's chat template is the bare prompt; its reward is 1 when the response is the digit
            # after the prompt's: the logged text and score agree with the reward function.
            assert row["prompt"] == f"next:{(int(row['ground_truth']) - 1) % 10}"
            assert row["score"] == (1.0 if row["response"][:1] == row["ground_truth"] else 0.0)
            assert row["response_length"] == 1
            assert row["prompt"] in text and f"score {row['score']:.4g}" in text
