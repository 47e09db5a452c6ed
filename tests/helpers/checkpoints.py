"""Waiting, in a test, for a run started as a process to write a given checkpoint."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path


def wait_for_checkpoint(run: subprocess.Popen, run_dir: Path, step: int, timeout_s: float) -> Path:
    """Block until `run_dir`'s `latest` names step_`step` or a later one (fast steps can pass several between two
    looks), or the run ends; returns the `latest` file."""
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + timeout_s
    while run.poll() is None and not (latest.is_file() and _step(latest.read_text()) >= step):
        assert time.monotonic() < deadline, f"no step_{step} checkpoint within {timeout_s:.0f} s"
        time.sleep(0.05)
    return latest


def _step(name: str) -> int:
    return int(name.removeprefix("step_")) if name.startswith("step_") and name[5:].isdigit() else -1
