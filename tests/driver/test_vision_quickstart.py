"""configs/vision_quickstart.yaml learns to see (issue 31 point 5): a tiny random Qwen2.5-VL, whose every prompt is
the same bare image placeholder, starts near or below chance on validation and names the colour of >= 0.8 of the
held-out images by the end, on CPU with the two gloo ranks the config asks for. End to end (a few minutes on two
cores), so it is in tests/conftest.py's FIRST."""
import json
import sys
from pathlib import Path

import pytest

from tests.helpers import warm_runs

REPO_ROOT = Path(__file__).resolve().parents[2]
VAL = "val/colour/score/mean"
# The run in its own process, as `rlm train` runs it, writing its metric history where the test reads it.
SCRIPT = """
import json, sys
from rlmegatron.driver.job import check_training, run_training
from rlmegatron.prelaunch.spec_pipeline import SpecSource
if __name__ == "__main__":
    out, *overrides = sys.argv[1:]
    report = run_training(check_training(SpecSource("configs/vision_quickstart.yaml", overrides)))
    with open(out, "w") as handle:
        json.dump({"history": report.history, "steps": report.steps, "seconds": report.seconds}, handle)
"""


@pytest.mark.timeout(900)
def test_the_vision_quickstart_learns_the_colours_from_the_images_alone(tmp_path):
    out = tmp_path / "report.json"
    run = warm_runs.run([sys.executable, "-c", SCRIPT, str(out), f"trainer.run_dir={tmp_path / 'run'}"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    curve = dict(report["history"][VAL])
    steps = report["steps"]
    # Chance among the four letters is 0.25; the untrained policy samples its whole vocabulary, so it scores less.
    assert curve[0] <= 0.3, curve
    assert curve[max(curve)] >= 0.8, curve
    assert max(curve) == steps == 80, (steps, curve)
