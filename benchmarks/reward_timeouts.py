"""Reward time of a step whose reward function hangs on every sample (issue 47, points 1 and 2).

128 samples, `time.sleep(60)` in each (or a C loop that holds the interpreter lock, --stuck-in-c), reward.timeout_s=1,
the default reward.num_workers=0; one call of the manager is one step's `timing_s/reward`, from a cold manager
(workers started within it, as at a run's first step). Runs against whatever `rlmegatron` is importable, so the old
code is measured with PYTHONPATH pointing at its tree; --fraction is only passed when given (the old code has no
reward.max_timeout_fraction).

Usage: python benchmarks/reward_timeouts.py [--samples 128] [--timeout 1] [--fraction F] [--stuck-in-c]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rlmegatron.rewards import NaiveRewardManager, RewardInput

SLEEPS = "import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n    time.sleep(60)\n"
STUCK_IN_C = ("import itertools\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
              "    return sum(itertools.repeat(0, 10**13))\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--fraction", type=float, help="reward.max_timeout_fraction (new code only)")
    parser.add_argument("--stuck-in-c", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "hangs.py"
        file.write_text(STUCK_IN_C if args.stuck_in_c else SLEEPS)
        items = [RewardInput(f"s{i}", "custom", "x", "x", 1) for i in range(args.samples)]
        extra = {} if args.fraction is None else {"max_timeout_fraction": args.fraction}
        with NaiveRewardManager(f"{file}:compute_score", timeout_s=args.timeout, **extra) as manager:
            started = time.perf_counter()
            try:
                outcome = f"returned, {manager(items).metrics['reward/timeouts']:g} timeouts"
            except Exception as err:  # the new code's TimedOutRewards: the run would stop here
                outcome = f"{type(err).__name__}: {err}"
            elapsed = time.perf_counter() - started
    print(f"{args.samples} samples, timeout_s={args.timeout:g}, fraction={args.fraction}: {elapsed:.1f} s; {outcome}")


if __name__ == "__main__":
    main()
