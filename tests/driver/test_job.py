"""The end-of-run report names the steps this run trained, from the step after its checkpoint; a job its checks
refuse leaves nothing running."""
import re
import subprocess
import sys
from pathlib import Path

from rlmegatron.driver.job import JobReport, format_report

REPO_ROOT = Path(__file__).resolve().parents[2]


def report(steps: int, resumed_from: int) -> JobReport:
    rewards = [(step, step / 100) for step in range(resumed_from + 1, steps + 1)]
    return JobReport(steps=steps, resumed_from=resumed_from, seconds=1.25, reward_first=rewards[0][1],
                     reward_last=rewards[-1][1], tracking="console only", checkpoint=None, exported_hf=None,
                     history={"critic/score/mean": rewards})


def test_a_resumed_run_reports_the_steps_it_trained():
    first_line = format_report(report(25, 20)).splitlines()[0]
    assert first_line == ("trained steps 21-25 (5 steps, resumed from step 20) in 1.2 s; "
                          "critic/score/mean 0.210 (step 21) -> 0.250 (step 25)")


def test_a_fresh_run_and_a_single_step():
    assert format_report(report(80, 0)).startswith("trained steps 1-80 (80 steps) in 1.2 s; critic/score/mean "
                                                   "0.010 (step 1) -> 0.800 (step 80)")
    assert format_report(report(3, 2)).startswith("trained step 3 (1 step, resumed from step 2) in ")
    # tests/launch/test_local_cluster.py reads the quickstart's learning from this line.
    assert re.search(r"trained steps 1-150 \(150 steps\) in [\d.]+ s; critic/score/mean ([\d.]+) \(step 1\) "
                     r"-> ([\d.]+) \(step 150\)", format_report(report(150, 0)))


def test_the_report_gives_the_validation_score_before_and_after_training():
    run = report(150, 0)
    run.history["val/next_digit/score/mean"] = [(0, 0.0), (25, 0.625), (150, 1.0)]
    run.history["val/other/score/mean"] = [(25, 0.5)]
    lines = format_report(run).splitlines()
    # tests/launch/test_local_cluster.py reads the quickstart's validation from this line.
    assert re.fullmatch(r"validation: val/next_digit/score/mean ([\d.]+) \(step 0, before training\) -> "
                        r"([\d.]+) \(step 150\)", lines[1])
    assert lines[1:3] == ["validation: val/next_digit/score/mean 0.000 (step 0, before training) -> 1.000 (step 150)",
                          "validation: val/other/score/mean 0.500 (step 25)"]
    assert not any(line.startswith("validation:") for line in format_report(report(150, 0)).splitlines())


# A process of its own, whose fork server (started as the checks begin, for the ranks' imports) this job starts.
REFUSED_AT_PREFLIGHT = """
import os, sys
from multiprocessing import forkserver
from rlmegatron.entry.cli import main
code = main(["train", "configs/quickstart.yaml", f"trainer.run_dir={sys.argv[1]}", "data.train_files=[no.jsonl]"])
pid = forkserver._forkserver._forkserver_pid
if pid is not None:  # left importing, to be orphaned as this process exits
    os.kill(pid, 9)
print(code, pid)
"""


def test_a_job_refused_by_its_checks_leaves_no_fork_server_behind(tmp_path):
    result = subprocess.run([sys.executable, "-c", REFUSED_AT_PREFLIGHT, str(tmp_path / "run")], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.stderr.startswith("data.train_files[0]=no.jsonl: no such file")
    assert result.stdout == "2 None\n"
