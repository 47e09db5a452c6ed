"""Where one step of TRL's echo task goes, inside one process: the fit loop with one trainer rank in the driver
(`check_training(source, in_process=True)`, no launcher), medians of every timing_s/* phase and of the functions below
it that the issue-14 work measured, over the steps after the first five.

    python benchmarks/echo_step_phases.py --steps 60 [--threads 1] [KEY=VALUE ...]

Needs the task files `benchmarks/peer_trl.py` writes (runs/peer_trl/task). One process, one rank: the numbers move
less with the machine's load than a launched run's, so two trees compare well when their runs alternate
(PYTHONPATH=TREE python TREE/benchmarks/echo_step_phases.py, each in turn).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import shutil
import statistics
import tempfile
import time
from collections import defaultdict

SPEC = "benchmarks/peer_trl_echo/spec.yaml"
TIMED = [  # module, qualified name
    ("rlmegatron.rollout.local", "LocalEngine._generate_batch"),
    ("rlmegatron.driver.trainer", "build_batch"),  # as the trainer imported it
    ("rlmegatron.rank.roles.megatron_step", "shard_micro_batches"),
    ("megatron.core.pipeline_parallel.schedules", "forward_step"),
    ("megatron.core.pipeline_parallel.schedules", "backward_step"),
    ("megatron.core.optimizer.optimizer", "ChainedOptimizer.step"),
]


def timed(samples: dict, module_name: str, qualified: str) -> None:
    owner = importlib.import_module(module_name)
    *path, name = qualified.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            samples[qualified].append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1, help="the rank's torch threads (a launched CPU rank of two "
                                                                "on 2 cores has 1)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()

    from rlmegatron.prelaunch.spec_pipeline import SpecSource
    from rlmegatron.transport import worker_group
    from rlmegatron.driver.job import check_training, run_training
    from rlmegatron.tracking import Tracker

    samples: dict[str, list[float]] = defaultdict(list)
    for module_name, qualified in TIMED:
        timed(samples, module_name, qualified)
    host_init = worker_group.RankHost.__init__
    worker_group.RankHost.__init__ = lambda self, env, device, threads=1: host_init(self, env, device, args.threads)
    steps: list[dict[str, float]] = []
    log_metrics = Tracker.log_metrics

    def logged(self, metrics, step):
        if step >= 1:
            steps.append({k: float(v) for k, v in metrics.items() if k.startswith("timing_s/")})
        log_metrics(self, metrics, step)

    Tracker.log_metrics = logged
    run_dir = tempfile.mkdtemp(prefix="echo_phases_")
    try:
        source = SpecSource(SPEC, [f"trainer.total_steps={args.steps}", f"trainer.run_dir={run_dir}",
                                   "placement.gpus_per_node=1", *args.overrides])
        run_training(check_training(source, in_process=True))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    kept = steps[5:]
    print(f"\n{len(kept)} steps after the first five; median (min) ms")
    for phase in sorted({k for s in kept for k in s}):
        values = [s[phase] for s in kept if phase in s]
        print(f"  {phase:32s} {statistics.median(values) * 1e3:8.1f} ({min(values) * 1e3:.1f})")
    for _, qualified in TIMED:
        values = samples[qualified][len(samples[qualified]) * 5 // max(1, args.steps):]
        if values:
            per_step = len(values) / max(1, len(kept))
            print(f"  {qualified:32s} {statistics.median(values) * 1e3:8.2f} ({min(values) * 1e3:.2f}), "
                  f"{per_step:.1f} calls per step")


if __name__ == "__main__":
    main()
