"""TrackingSetup: what a Tracker and each of its backends needs, in a module of its own so that the backends
(mlflow_run, wandb_run, tensorboard_events) read it without importing the Tracker that imports them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrackingSetup:
    """Everything a Tracker needs, resolved from the spec (or given directly by tests and tools)."""

    backends: list[str]
    run_dir: Path
    project_name: str
    experiment_name: str
    tracking_uri: str | None = None
    """None: MLFLOW_TRACKING_URI when set, else sqlite:///<run_dir>/mlflow.db."""
    log_freq: int = -1
    """The console prints the full metric table every log_freq steps and one line on the others; -1: one line every
    step (trainer.log_freq)."""
