"""The quickstart task in trainer.mode sync, one_step_off and async, disaggregated, same steps, back to back.

    python -m benchmarks.async_modes --steps 150 [--modes sync one_step_off async] [--max-staleness 2] [--ray]
                                     [--device cpu|cuda] [--out-dir DIR] [--result FILE]

One trainer rank (in the child's own process, or with --ray a Ray actor of its own) and the local engine in a
process of its own (placement.mode=disaggregate); each mode runs in a fresh child process. With `--device cuda` and
no Ray both share the one visible GPU (the GPU harness's `async` part, benchmarks/gpu/harness.py). Per mode it reports
steps/s over the fit loop, the median step, the fraction of that time the trainer was busy (not waiting for a
rollout: 1 - sum(timing_s/wait_rollout) / wall) and the engine was busy (sum(timing_s/gen) / wall), the reward curve
and the first step whose 5-step mean reward reaches 0.8, the staleness, and the start-up (the child's wall time
before and after the fit loop). Everything also goes to `--result` (default OUT_DIR/result.json, OUT_DIR defaulting
to runs/async_modes/{in_process,ray}), rewritten after each mode so that a run stopped midway keeps the modes it ran.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
OUT = REPO_ROOT / "runs" / "async_modes"
MODES = ("sync", "one_step_off", "async")
REWARD = "critic/score/mean"
TARGET_REWARD = 0.8
DISAGGREGATED = ["placement.gpus_per_node=1", "placement.mode=disaggregate", "placement.rollout_nnodes=1",
                 "placement.rollout_gpus_per_node=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "data.val_files=[]", "tracking.backends=[console]"]


def child(out: str, ray: bool, overrides: list[str]) -> None:
    from rlmegatron.driver.job import check_training, run_training
    from rlmegatron.prelaunch.spec_pipeline import SpecSource

    source = SpecSource("configs/quickstart.yaml", [*overrides, "placement.transport=ray"] if ray else overrides)
    report = run_training(check_training(source, in_process=not ray))
    Path(out).write_text(json.dumps({"seconds": report.seconds, "history": report.history}))


def first_reach(rewards: list[float], threshold: float = TARGET_REWARD, window: int = 5):
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1 : i + 1]) / window >= threshold:
            return i + 1
    return None


def summary(mode: str, run: dict, wall_s: float) -> dict:
    """`run`: the child's fit-loop seconds and metric history; `wall_s`: the child's whole life, start-up included."""
    history, wall = run["history"], run["seconds"]

    def series(name: str) -> list[float]:
        return [value for _, value in history.get(name, [])]

    rewards, step_s = series(REWARD), series("timing_s/step")
    return {
        "mode": mode,
        "steps": len(rewards),
        "fit_s": round(wall, 1),
        "startup_s": round(wall_s - wall, 1),
        "steps_per_s": round(len(rewards) / wall, 3),
        "step_s_median": round(statistics.median(step_s), 4) if step_s else None,
        "trainer_busy": round(1 - sum(series("timing_s/wait_rollout")) / wall, 3),
        "engine_busy": round(sum(series("timing_s/gen")) / wall, 3),
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "first_step_5_mean_ge_0.8": first_reach(rewards),
        "reward_5_mean_at": {step: round(sum(rewards[max(0, step - 5) : step]) / len(rewards[max(0, step - 5) : step]),
                                         3) for step in (5, 25, 50, 75, 100, 125, 150) if step <= len(rewards)},
        "reward_curve": rewards,
        "staleness_mean": round(sum(series("training/staleness/mean")) / max(1, len(rewards)), 3),
        "staleness_max": max(series("training/staleness/max"), default=0),
    }


def mode_overrides(mode: str, steps: int, max_staleness: int, device: str, run_dir: Path) -> list[str]:
    extra = [f"trainer.max_staleness={max_staleness}"] if mode == "async" else []
    return [*DISAGGREGATED, f"placement.device={device}", f"trainer.total_steps={steps}", f"trainer.mode={mode}",
            f"trainer.run_dir={run_dir}", "trainer.resume=disable", *extra]


def run_mode(mode: str, overrides: list[str], use_ray: bool, out: Path) -> dict:
    """One mode in a fresh child process (its console metrics dropped, its stderr passed on): its summary, or the
    child's exit status."""
    out.unlink(missing_ok=True)
    start = time.perf_counter()
    # -m from the repository root: the child imports this checkout's rlmegatron, and the quickstart's relative paths
    # resolve.
    child_run = subprocess.run([sys.executable, "-m", "benchmarks.async_modes", "--child", str(out), str(use_ray),
                                *overrides], cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    wall_s = time.perf_counter() - start
    if child_run.returncode != 0 or not out.exists():
        return {"mode": mode, "error": f"exit {child_run.returncode}", "wall_s": round(wall_s, 1)}
    return summary(mode, json.loads(out.read_text()), wall_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--ray", action="store_true", help="the trainer rank and the engine's host as Ray actors")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out-dir", type=Path, help="the runs' directories (default runs/async_modes/in_process|ray)")
    parser.add_argument("--result", type=Path, help="the summary's JSON (default OUT_DIR/result.json)")
    args = parser.parse_args(argv)
    out_dir = args.out_dir or OUT / ("ray" if args.ray else "in_process")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = args.result or out_dir / "result.json"
    report = {"device": args.device, "steps": args.steps, "max_staleness": args.max_staleness, "ray": args.ray,
              "modes": []}
    for mode in args.modes:
        overrides = mode_overrides(mode, args.steps, args.max_staleness, args.device, out_dir / mode)
        report["modes"].append(run_mode(mode, overrides, args.ray, out_dir / f"{mode}.json"))
        shown = {key: value for key, value in report["modes"][-1].items() if key != "reward_curve"}
        print(json.dumps(shown), flush=True)
        result.write_text(json.dumps(report, indent=1))
    return 0 if all("error" not in row for row in report["modes"]) else 1


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3] == "True", sys.argv[4:])
    else:
        sys.exit(main())
