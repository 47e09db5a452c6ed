"""trainer.max_restarts: a trainer rank SIGKILLed mid-update (as the OOM killer does) is restarted within the same
`rlm train`, under the process launcher and under Ray: the run resumes from its last complete checkpoint, keeps its
MLflow run, and ends with exactly the weights of an uninterrupted run resumed from that checkpoint. Past the limit
the run stops with one line."""
from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.driver.test_train import QUICKSTART, REPO_ROOT, RLM
from tests.helpers import warm_runs

LOSS = "actor.policy_loss.loss_mode=tests/driver/dying_rank_loss.py:compute_policy_loss"
RUN = ["trainer.total_steps=3", "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
       "data.val_files=[]", "trainer.log_freq=1", "placement.gpus_per_node=2", "trainer.max_ckpt_to_keep=3", LOSS]


def rlm_train(run_dir: Path, *overrides: str, marker: Path, die_after: Path, times: int,
              how: str = "kill") -> subprocess.CompletedProcess:
    env = {**os.environ, "RLM_DIE_MARKER": str(marker), "RLM_DIE_ONCE_EXISTS": str(die_after),
           "RLM_DIE_TIMES": str(times), "RLM_DIE_HOW": how}
    env.pop("MLFLOW_TRACKING_URI", None)  # the run directory's own store
    return warm_runs.run([RLM, "train", QUICKSTART, *RUN, f"trainer.run_dir={run_dir}", *overrides], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=420)


def exported_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted((run_dir / "hf_policy").glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def mlflow_runs(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as store:
        return store.execute("SELECT run_uuid, lifecycle_stage FROM runs").fetchall()


def test_a_rank_killed_mid_update_is_restarted_and_the_run_ends_as_a_resume_from_its_checkpoint(tmp_path):
    finished = {}
    for launcher in ("processes", "ray"):
        run = tmp_path / launcher
        restarted = rlm_train(run, f"placement.transport={launcher}", "trainer.max_restarts=1",
                              marker=tmp_path / f"{launcher}.died", die_after=run / "checkpoints" / "step_1", times=1)
        assert restarted.returncode == 0, (launcher, restarted.stdout[-2000:] + restarted.stderr[-4000:])
        assert len((tmp_path / f"{launcher}.died").read_text().splitlines()) == 1  # rank 1 died once, in step 2
        assert f"Restarting the trainer ranks (1 of trainer.max_restarts=1) from {run / 'checkpoints' / 'step_1'}" \
            in restarted.stderr, launcher
        # The run's steps, from its start: the restart resumed within the run.
        assert "trained steps 1-3 (3 steps, the ranks restarted 1 time(s))" in restarted.stdout, launcher
        # One MLflow run, active: the restart continued it.
        assert [stage for _, stage in mlflow_runs(run / "mlflow.db")] == ["active"], launcher
        finished[launcher] = exported_weights(run)

    # The step-1 checkpoint resumed by hand without any death, once for both launchers (the ranks compute the same
    # whichever launcher starts them; a launcher whose step 1 differed would fail the comparison): the same final
    # weights, bit for bit.
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "processes" / "checkpoints" / "step_1", resumed / "checkpoints" / "step_1")
    by_hand = rlm_train(resumed, "placement.transport=processes", "trainer.resume=auto",
                        marker=tmp_path / "never", die_after=tmp_path / "never", times=0)
    assert by_hand.returncode == 0, by_hand.stdout[-2000:] + by_hand.stderr[-4000:]
    theirs = exported_weights(resumed)
    for launcher, ours in finished.items():
        assert ours.keys() == theirs.keys() and len(ours) > 0, launcher
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), (launcher, name)


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_rank_that_dies_again_past_max_restarts_stops_the_run_with_one_line(tmp_path, how):
    """Killed, or raising what is not the user's mistake (a CUDA error): restarted once, stopped the second time."""
    run = tmp_path / "run"
    stopped = rlm_train(run, "placement.transport=processes", "trainer.max_restarts=1", marker=tmp_path / "died",
                        die_after=run / "checkpoints" / "step_1", times=2, how=how)
    assert stopped.returncode == 3, stopped.stdout[-2000:] + stopped.stderr[-4000:]
    assert len((tmp_path / "died").read_text().splitlines()) == 2
    assert "Restarting the trainer ranks (1 of trainer.max_restarts=1)" in stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("training stopped: step 2: ")
    assert ("trainer rank 1" in last and "was killed by SIGKILL" in last) if how == "kill" else \
        "CUDA error: an illegal memory access" in last
    assert last.endswith("(the ranks were restarted 1 time(s) already: trainer.max_restarts=1)")
    assert "Traceback" not in stopped.stderr
    assert (run / "checkpoints" / "step_1").is_dir() and not (run / "checkpoints" / "step_2").exists()
