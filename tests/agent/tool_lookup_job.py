"""Entry point the tool_lookup test runs in a fresh process: train configs/tool_lookup_cpu.yaml, write the metric
history as JSON."""
import json
import sys

from rlmegatron.driver.job import check_training, run_training
from rlmegatron.prelaunch.spec_pipeline import SpecSource

# dist_checkpointing's writer starts a spawn Manager that re-imports __main__: keep the work under the guard.
if __name__ == "__main__":
    out, *overrides = sys.argv[1:]
    report = run_training(check_training(SpecSource("configs/tool_lookup_cpu.yaml", overrides)))
    with open(out, "w") as handle:
        json.dump({"history": report.history, "seconds": report.seconds}, handle)
