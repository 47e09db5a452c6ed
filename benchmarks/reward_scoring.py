"""Reward time per quickstart step: the same 16 prompts x 8 responses scored in the driver and in a process pool.

The inputs are the quickstart's (configs/quickstart/train.jsonl, its reward function, one random character per
response), so each call is one step's `timing_s/reward`. Every mode runs in this one process, back to back, on the
same inputs; the pools are started (and warmed by one call) before timing, so the numbers are steady-state cost
per step, not start-up.

Usage: python benchmarks/reward_scoring.py [--steps 50] [--workers 0 1 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import string
import time
from pathlib import Path

from rlmegatron.rewards import NaiveRewardManager, RewardInput

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart"


def quickstart_batch(prompts: int, n: int, seed: int) -> list[RewardInput]:
    rows = [json.loads(line) for line in (QUICKSTART / "train.jsonl").read_text().splitlines()[:prompts]]
    rng = random.Random(seed)
    return [
        RewardInput(sample_id=f"echo#{row['extra_info']['index']}/{k}", data_source=row["data_source"],
                    solution_str=rng.choice(string.ascii_lowercase + string.digits),
                    ground_truth=row["reward_model"]["ground_truth"], response_length=1, extra_info=row["extra_info"])
        for row in rows for k in range(n)
    ]


def time_mode(workers: int, batch: list[RewardInput], steps: int) -> dict:
    with NaiveRewardManager(f"{QUICKSTART / 'reward.py'}:compute_score", workers, 30.0) as manager:
        scores = manager(batch).scores  # starts and warms a pool; imports the function either way
        seconds = []
        for _ in range(steps):
            started = time.perf_counter()
            assert manager(batch).scores == scores
            seconds.append(time.perf_counter() - started)
    return {"workers": workers, "median_ms": 1e3 * statistics.median(seconds), "min_ms": 1e3 * min(seconds),
            "mean_reward": sum(scores) / len(scores)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2],
                        help="reward.num_workers to compare; 0 scores in the driver")
    args = parser.parse_args()
    batch = quickstart_batch(args.prompts, args.n, seed=0)
    rows = [time_mode(workers, batch, args.steps) for workers in args.workers]
    pool_one = next((r["median_ms"] for r in rows if r["workers"] == 1), None)
    print(f"{len(batch)} samples per step, {args.steps} steps per mode, {platform.processor() or platform.machine()}")
    print("| reward.num_workers | median ms/step | min ms/step | vs 1-worker pool |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        ratio = f"{r['median_ms'] / pool_one:.4f}" if pool_one else "-"
        print(f"| {r['workers']} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
