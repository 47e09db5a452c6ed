"""The shipped quickstart learns: reward <= 0.2 at step 1, >= 0.8 at the end, within 10 minutes (about 1.5 on 2 cores)."""
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_reward_rises_from_at_most_0_2_to_at_least_0_8_within_10_minutes(tmp_path):
    out = tmp_path / "report.json"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "tests.controller.jobs", str(out), "ray", f"trainer.run_dir={tmp_path / 'run'}"],
                   cwd=REPO_ROOT, check=True, timeout=600)
    wall_s = time.monotonic() - started
    scores = [v for _, v in json.loads(out.read_text())["history"]["critic/score/mean"]]
    assert scores[0] <= 0.2 and scores[-1] >= 0.8, scores
    assert wall_s < 600
    print(f"quickstart: {len(scores)} steps, {wall_s:.0f} s wall, reward {scores[0]:.3f} -> {scores[-1]:.3f}")
