"""tests/conftest.py's guard: an unmarked (unit) test that starts a training run, as a new interpreter or forked warm
(tests/helpers/warm_runs.py), fails before anything starts, saying that it is an end-to-end test."""
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import warm_runs

RLM = str(Path(sys.executable).parent / "rlm")
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("start", [subprocess.run, warm_runs.run], ids=["subprocess", "warm"])
def test_an_unmarked_test_that_starts_rlm_train_fails_naming_itself(start, tmp_path):
    with pytest.raises(RuntimeError, match=r"test_e2e_guard\.py::.* starts rlm train: an end-to-end test, which "
                                           r"tests/conftest\.py's E2E must name"):
        start([RLM, "train", "configs/quickstart.yaml", f"trainer.run_dir={tmp_path}"], cwd=REPO_ROOT)
    assert not (tmp_path / "checkpoints").exists()


def test_a_warm_fork_runs_as_a_new_interpreter_would(tmp_path):
    """Its argv, environment, working directory, streams and exit code are the command's (e2e: the first fork in a
    worker waits for the fork server's imports)."""
    script = ("import os, sys; print(sys.argv[1:], os.environ['MARK'], os.getcwd()); "
              "print('to stderr', file=sys.stderr); sys.exit(int(sys.argv[1]))")
    env = {"MARK": "marked", "PATH": "/usr/bin:/bin"}
    result = warm_runs.run([sys.executable, "-c", script, "3", "b"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert (result.returncode, result.stdout, result.stderr) == (3, f"['3', 'b'] marked {tmp_path}\n", "to stderr\n")
    raised = warm_runs.run([sys.executable, "-c", "raise ValueError('no')"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: no"), raised.stderr
