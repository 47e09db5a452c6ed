"""The GRPO part of the GPU harness: the quickstart job for a few steps on one rank of `--device`, colocated local
engine, in-process (`check_training(source, in_process=True)`: no Ray), console tracking only (no MLflow), no checkpoints.

    python -m benchmarks.gpu.grpo --device cuda --steps 20 --run-dir DIR --result FILE [KEY=VALUE ...]

Extra KEY=VALUE arguments are spec overrides on top of the harness's own. Run from the repository root: the
quickstart's paths are relative to it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

QUICKSTART = "configs/quickstart.yaml"


def overrides(device: str, steps: int, run_dir: str, extra: list[str]) -> list[str]:
    return [f"placement.device={device}", "placement.gpus_per_node=1", "placement.nnodes=1",
            f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}", "trainer.save_freq=-1",
            "tracking.backends=[console]", *extra]


def summary(report, wall_s: float) -> dict:
    from rlmegatron.tracking.metric_names import REWARD_SCORE_MEAN, THROUGHPUT

    def values(name: str) -> list[float]:
        return [value for _, value in report.history.get(name, [])]

    step_s = values("timing_s/step")
    return {
        "steps": report.steps,
        "reward_first": report.reward_first,
        "reward_last": report.reward_last,
        "reward_curve": values(REWARD_SCORE_MEAN),
        "train_s": report.seconds,
        "wall_s": wall_s,
        "startup_s": wall_s - report.seconds,
        "step_s_median": statistics.median(step_s) if step_s else None,
        "step_s_first": step_s[0] if step_s else None,
        "tokens_per_s_median": statistics.median(values(THROUGHPUT)) if values(THROUGHPUT) else None,
        "phase_s_median": {name.removeprefix("timing_s/"): statistics.median(points)
                           for name in report.history if name.startswith("timing_s/")
                           for points in [values(name)]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("overrides", nargs="*", help="further spec overrides, KEY=VALUE")
    args = parser.parse_args()

    start = time.perf_counter()
    from rlmegatron.driver.job import check_training, run_training
    from rlmegatron.prelaunch.spec_pipeline import SpecSource

    spec_overrides = overrides(args.device, args.steps, args.run_dir, args.overrides)
    report = run_training(check_training(SpecSource(QUICKSTART, spec_overrides), in_process=True))
    result = {"spec": QUICKSTART, "overrides": spec_overrides, **summary(report, time.perf_counter() - start)}
    result["forbidden_modules_imported"] = sorted(
        {name.split(".")[0] for name in sys.modules} & {"ray", "mlflow", "sglang", "transformer_engine"})
    with open(args.result, "w") as handle:
        json.dump(result, handle, indent=1)


# dist_checkpointing's writer starts a spawn Manager that re-imports __main__: the work stays under the guard.
if __name__ == "__main__":
    main()
