"""Entry point the controller tests run in a fresh process: train a spec, write the metric history as JSON."""
import json
import sys

from rlmegatron.driver.job import check_training, run_training
from rlmegatron.prelaunch.spec_pipeline import SpecSource
from rlmegatron.tracking.progress import ProgressBar

# The tests read the progress bars' lines in the log, as `rlm train --verbose` prints them.
ProgressBar.log_lines = True

# dist_checkpointing's writer starts a spawn Manager that re-imports __main__: keep the work under the guard.
if __name__ == "__main__":
    out, where, *overrides = sys.argv[1:]  # where: launched (as placement.transport says) or local (in this process)
    # The quickstart's spec, or the one the first argument names (a .yaml) before its overrides.
    spec = overrides.pop(0) if overrides and overrides[0].endswith(".yaml") else "configs/quickstart.yaml"
    report = run_training(check_training(SpecSource(spec, overrides), in_process=where == "local"))
    with open(out, "w") as handle:
        json.dump({"history": report.history, "checkpoint": report.checkpoint, "exported_hf": report.exported_hf,
                   "seconds": report.seconds, "steps": report.steps,
                   "ray_imported": "ray" in sys.modules}, handle)
