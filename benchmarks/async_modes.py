"""The quickstart task in trainer.mode sync, one_step_off and async, disaggregated, same steps, back to back.

    python benchmarks/async_modes.py --steps 150 [--modes sync one_step_off async] [--max-staleness 2] [--ray]

One trainer rank (in the child's own process, or with --ray a Ray actor of its own) and the local engine in a
process of its own (placement.mode=disaggregate); each mode runs in a fresh child process. Per mode it reports steps/s over the fit
loop, the fraction of that time the trainer was busy (not waiting for a rollout: 1 - sum(timing_s/wait_rollout) /
wall) and the engine was busy (sum(timing_s/gen) / wall), the first step whose 5-step mean reward reaches 0.8, the
reward at a few steps, and the staleness. Everything also goes to runs/async_modes/{in_process,ray}/result.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
OUT = REPO_ROOT / "runs" / "async_modes"
REWARD = "critic/score/mean"
DISAGGREGATED = ["placement.gpus_per_node=1", "placement.mode=disaggregate", "placement.rollout_nnodes=1",
                 "placement.rollout_gpus_per_node=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "data.val_files=[]", "tracking.backends=[console]"]


def child(out: str, ray: bool, overrides: list[str]) -> None:
    from rlmegatron.config import load_spec
    from rlmegatron.controller.job import run_training

    spec = load_spec("configs/quickstart.yaml", [*overrides, "placement.launcher=ray"] if ray else overrides)
    report = run_training(spec, in_process=not ray)
    Path(out).write_text(json.dumps({"seconds": report.seconds, "history": report.history}))


def first_reach(rewards: list[float], threshold: float = 0.8, window: int = 5):
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1 : i + 1]) / window >= threshold:
            return i + 1
    return None


def summary(mode: str, run: dict) -> dict:
    history, wall = run["history"], run["seconds"]

    def series(name: str) -> list[float]:
        return [value for _, value in history.get(name, [])]

    rewards = series(REWARD)
    return {
        "mode": mode,
        "steps": len(rewards),
        "fit_s": round(wall, 1),
        "steps_per_s": round(len(rewards) / wall, 3),
        "trainer_busy": round(1 - sum(series("timing_s/wait_rollout")) / wall, 3),
        "engine_busy": round(sum(series("timing_s/gen")) / wall, 3),
        "first_step_5_mean_ge_0.8": first_reach(rewards),
        "reward_5_mean_at": {step: round(sum(rewards[max(0, step - 5) : step]) / len(rewards[max(0, step - 5) : step]),
                                         3) for step in (5, 25, 50, 75, 100, 125, 150) if step <= len(rewards)},
        "staleness_mean": round(sum(series("training/staleness/mean")) / max(1, len(rewards)), 3),
        "staleness_max": max(series("training/staleness/max"), default=0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--modes", nargs="+", default=["sync", "one_step_off", "async"])
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--ray", action="store_true", help="the trainer rank and the engine's host as Ray actors")
    args = parser.parse_args()
    out_dir = OUT / ("ray" if args.ray else "in_process")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in args.modes:
        extra = [f"trainer.max_staleness={args.max_staleness}"] if mode == "async" else []
        out = out_dir / f"{mode}.json"
        overrides = [*DISAGGREGATED, f"trainer.total_steps={args.steps}", f"trainer.mode={mode}",
                     f"trainer.run_dir={out_dir / mode}", "trainer.resume=disable", *extra]
        subprocess.run([sys.executable, __file__, "--child", str(out), str(args.ray), *overrides], cwd=REPO_ROOT,
                       check=True, stdout=subprocess.DEVNULL)
        results.append(summary(mode, json.loads(out.read_text())))
        print(json.dumps(results[-1]), flush=True)
    (out_dir / "result.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3] == "True", sys.argv[4:])
    else:
        main()
