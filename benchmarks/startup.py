"""Start-up of `rlm train` before step 1, phase by phase (issue 14: "start-up to step 1 <= 10 s on the quickstart").

    python benchmarks/startup.py [--rounds 3] [--tree DIR --tree DIR2] [--variant "KEY=VALUE ..." ...] [KEY=VALUE ...]

Each round starts one `rlm train configs/quickstart.yaml` child per source tree (the tree's rlmegatron is imported:
PYTHONPATH), alternating, so load from other jobs falls on both alike; pass two trees to compare two commits
(`mkdir /tmp/before && git archive REF | tar -x -C /tmp/before`), or two variants of the spec
(`--variant placement.transport=ray --variant placement.transport=processes`), alternated the same way. A child records when each driver phase starts and
ends, from the moment its command was started (the interpreter's own start included), and exits as soon as step 1 is
logged (the reaper stops its Ray session). Printed per run: the phases and the 1-minute load average before and after.

The driver sees the ranks as one phase (`ranks`: Ray actors start, import torch, Megatron-Core and transformers, build
the model, its optimizer and the local engine, and sync the engine's weights once); benchmarks/RESULTS.md ("Start-up")
breaks that down from timestamps taken inside the ranks. Rank processes (placement.transport=processes) are started in
`ranks` and build while the driver goes on: `first call` (the engines asking them which lead one) waits for them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/quickstart.yaml"
PHASES = ("preflight", "build_dataset", "fork_server", "start_ray", "create_pools", "ranks")


def child(out: str, run_dir: str, started: float, overrides: list[str]) -> None:
    """`rlm train CONFIG OVERRIDES` into `run_dir` in this process, writing each phase's (start, end) to `out` at
    step 1."""
    marks: dict[str, list[float]] = {"imports": [started, 0.0]}
    from rlmegatron import data, spec_pipeline
    from rlmegatron.entry.cli import main
    from rlmegatron.driver import job
    from rlmegatron.tracking import Tracker

    marks["imports"][1] = time.time()

    def timed(name, function):
        def run(*args, **kwargs):
            begin = time.time()
            try:
                return function(*args, **kwargs)
            finally:
                marks.setdefault(name, [begin, 0.0])[1] = time.time()  # build_dataset runs twice: both
        return run

    # The spec pipeline's preflight and data stages, then the job's parts.
    for name in PHASES[:-1]:
        owner = {"preflight": spec_pipeline, "build_dataset": data}.get(name, job)
        setattr(owner, name, timed(name, getattr(owner, name)))

    class TimedRanks(job.RayWorkerGroup):
        __init__ = timed("ranks", job.RayWorkerGroup.__init__)

    class TimedProcesses(job.RankProcesses):
        __init__ = timed("ranks", job.RankProcesses.__init__)

    job.RayWorkerGroup, job.RankProcesses = TimedRanks, TimedProcesses
    job.TrainerClient.engine_ranks = timed("first call", job.TrainerClient.engine_ranks)
    start, log_metrics = Tracker.start, Tracker.log_metrics

    def fit_started(self, step):
        marks["fit start"] = [time.time()] * 2
        start(self, step)

    def logged(self, metrics, step):
        marks[f"step {step} logged"] = [time.time()] * 2
        if step >= 1:
            record = {"marks": marks, "load_1m_after": os.getloadavg()[0]}
            Path(out).write_text(json.dumps(record))
            os._exit(0)  # what comes after step 1 is not start-up; the reaper ends this run's Ray session
        log_metrics(self, metrics, step)

    Tracker.start, Tracker.log_metrics = fit_started, logged
    main(["train", CONFIG, f"trainer.run_dir={run_dir}", *overrides])
    raise SystemExit("the run ended before step 1 was logged")


def one_run(tree: Path, overrides: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.TemporaryDirectory(prefix="startup_") as run_dir:
        load_before = os.getloadavg()[0]
        started = time.time()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
        code = (f"import sys; sys.path.insert(0, {str(REPO_ROOT / 'benchmarks')!r}); import startup; "
                f"startup.child({out.name!r}, {run_dir!r}, {started!r}, {overrides!r})")
        subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        record = json.loads(Path(out.name).read_text())
    marks = record["marks"]
    phases = {name: round(end - begin, 2) for name, (begin, end) in marks.items() if end > begin}
    return {"tree": str(tree), "step 1 logged s": round(marks["step 1 logged"][0] - started, 2),
            "fit start s": round(marks["fit start"][0] - started, 2), "phases s": phases,
            "load 1m before, after": [round(load_before, 2), round(record["load_1m_after"], 2)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", type=Path, action="append", help="a source tree to run (default: this one)")
    parser.add_argument("--variant", action="append", default=None,
                        help="space-separated overrides of one variant, alternated with the others in each round")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for the quickstart spec")
    args = parser.parse_args()
    for _ in range(args.rounds):
        for tree in args.tree or [REPO_ROOT]:
            for variant in args.variant or [""]:
                run = one_run(tree.resolve(), [*args.overrides, *variant.split()])
                print(json.dumps({"variant": variant, **run}), flush=True)


if __name__ == "__main__":
    main()
