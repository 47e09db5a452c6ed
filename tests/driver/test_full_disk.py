"""A run directory on a disk that fills up during a save (issue 25's repro: a small tmpfs as trainer.run_dir): one line
naming the run directory and the last complete checkpoint, exit 2, no partial checkpoint, nothing left running.

The tmpfs is mounted in a mount namespace of the run's own (`unshare --user --map-root-user --mount`: no privilege
needed where user namespaces are allowed), so nothing of the host changes; the shell that mounted it lists the
checkpoints directory once the run has ended, before the namespace (and the tmpfs) goes away.
"""
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.driver.test_train import QUICKSTART, REPO_ROOT, processes_of_run

# 1 MB of MLflow store and one 1.6 MB checkpoint fit; a second checkpoint does not (max_ckpt_to_keep removes the
# first only once the second is complete).
TMPFS = "size=3584k"
RUN = ["trainer.total_steps=2", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=1", "trainer.val_before_train=false",
       "trainer.test_freq=-1", "data.val_files=[]", "tracking.backends=[console,mlflow]"]
LISTING = "== checkpoints =="
GONE_WITHIN_S = 10
# Mounts the tmpfs on the run directory, runs the command, then lists the checkpoints it left; exits with its code.
SHELL = (f'mount -t tmpfs -o {TMPFS} tmpfs "$0" && "$@"; code=$?; echo "{LISTING}"; ls -A "$0/checkpoints"; '
         'exit $code')


def in_a_mount_namespace() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not in_a_mount_namespace(), reason="needs a mount namespace (unshare -rm) for its tmpfs")
def test_a_full_disk_during_a_save_is_one_line_exit_2_and_leaves_no_partial_checkpoint_nor_a_process(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "RLM_TEST_RUN": f"full_disk-{os.getpid()}"}
    env.pop("RLM_DEBUG", None)
    started = time.monotonic()
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", SHELL, str(run_dir),
                             sys.executable, "-m", "rlmegatron", "train", QUICKSTART, *RUN,
                             f"trainer.run_dir={run_dir}"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    ended = time.monotonic()
    assert result.returncode == 2, result.stderr[-3000:]
    last = run_dir / "checkpoints" / "step_1"
    assert result.stderr == (f"trainer.run_dir={run_dir}: the disk is full (No space left on device: "
                             f"{run_dir / 'checkpoints' / 'step_2'}); the run stopped and its ranks with it. The last "
                             f"complete checkpoint is {last}: free space and run again to resume from it, or move the "
                             "run directory to a disk with room\n")
    # step_2's staging directory is gone; step_1 and its marker stay.
    assert result.stdout.split(LISTING + "\n")[1].split() == ["latest", "step_1"]
    while processes_of_run("full_disk") and time.monotonic() - ended < GONE_WITHIN_S:
        time.sleep(0.1)
    assert processes_of_run("full_disk") == []
    print(f"stopped {ended - started:.1f} s after the start")
