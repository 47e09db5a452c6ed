"""The Tracker: one call per step fans metrics out to each backend of tracking.backends (console, MLflow, W&B,
TensorBoard; a module each)."""
from __future__ import annotations

import functools
import queue
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from rlmegatron.tracking.ascii_plot import ascii_plot
from rlmegatron.tracking.console import ConsoleBackend
from rlmegatron.tracking.metric_names import REWARD_SCORE_MEAN
from rlmegatron.tracking.mlflow_run import MlflowBackend
from rlmegatron.tracking.setup import TrackingSetup
from rlmegatron.tracking.tensorboard_events import TensorBoardBackend
from rlmegatron.tracking.wandb_run import WandbBackend

if TYPE_CHECKING:
    from rlmegatron.config.spec import JobSpec

OPTIONAL_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}
"""Backend -> the package it needs beyond rlmegatron's own dependencies, installed by the extra of the backend's name
(`pip install rlmegatron[wandb]`). TensorBoard's event files are written by torch's SummaryWriter, which needs it."""


class Backend(Protocol):
    def start(self, step: int) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> None: ...

    def finish(self, status: str) -> None: ...


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"actor": {"optim": {"lr": 1e-6}}} -> {"actor.optim.lr": 1e-6}; lists stay leaves."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


class Tracker:
    """Logs the resolved spec once and metrics every step to each configured backend, and keeps the
    metric history in memory for the end-of-run summary."""

    def __init__(self, setup: TrackingSetup, params: Mapping[str, Any] | None = None,
                 resolved_yaml: str | None = None, console_stream: TextIO | None = None) -> None:
        self.setup = setup
        self.started = False
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.backends: list[Backend] = []
        self.backend_named: dict[str, Backend] = {}
        for name in setup.backends:
            if name == "mlflow":
                backend: Backend = InBackground(MlflowBackend(setup, params or {}, resolved_yaml))
            elif name == "wandb":
                backend = InBackground(WandbBackend(setup, params or {}))
            elif name == "tensorboard":
                backend = TensorBoardBackend(setup)  # its writer has a thread of its own
            elif name == "console":
                backend = ConsoleBackend(console_stream or sys.stdout, setup.log_freq)
            else:
                raise ValueError(f"unknown tracking backend {name!r}; use {', '.join(OPTIONAL_PACKAGES)}, mlflow or "
                                 "console")
            self.backends.append(backend)
            self.backend_named[name] = backend

    @classmethod
    def from_spec(cls, spec: JobSpec, console_stream: TextIO | None = None) -> Tracker:
        from rlmegatron.config import dump_spec

        setup = TrackingSetup(
            backends=list(spec.tracking.backends),
            run_dir=Path(spec.trainer.run_dir or f"runs/{spec.trainer.experiment_name}"),
            project_name=spec.tracking.project_name,
            experiment_name=spec.trainer.experiment_name,
            tracking_uri=spec.tracking.tracking_uri,
            log_freq=spec.trainer.log_freq,
        )
        return cls(setup, flatten(spec.model_dump(mode="json")), dump_spec(spec), console_stream)

    def start(self, step: int) -> None:
        """Open every backend at `step`, the checkpoint's step the run resumes from (0: a fresh start); what a
        backend holds from an earlier attempt after that step is superseded by what this run logs. Started again
        (trainer.max_restarts: the ranks restarted within the run) the backends stay open, the same run: only the
        history drops what the lost attempt logged after `step`."""
        if self.started:
            self.history = {key: kept for key, points in self.history.items()
                            if (kept := [(s, v) for s, v in points if step > 0 and s <= step])}
            return
        self.started = True
        for backend in self.backends:
            backend.start(step)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        clean = {key: float(value) for key, value in metrics.items()}
        for key, value in clean.items():
            self.history.setdefault(key, []).append((step, value))
        for backend in self.backends:
            backend.log_metrics(clean, step)

    def log_rollout_samples(self, samples: Sequence[Mapping[str, Any]], step: int, backend: str) -> None:
        """Rollout samples as text (rollout.traced_samples' rows) to one of the configured backends."""
        if backend not in self.backend_named:
            raise ValueError(f"rollout samples go to the {backend} tracker, which is not in tracking.backends")
        self.backend_named[backend].log_samples(samples, step)

    def series(self, key: str) -> list[float]:
        return [value for _, value in self.history.get(key, [])]

    def summary(self, key: str = REWARD_SCORE_MEAN, width: int = 60, height: int = 10) -> str:
        """An ASCII plot of one metric over the steps this run trained, for the last lines of the log."""
        points = self.history.get(key, [])
        return ascii_plot([value for _, value in points], steps=[step for step, _ in points], width=width,
                          height=height, title=key)

    def finish(self, status: str = "FINISHED") -> None:
        """Close every backend; status is MLflow's: FINISHED, FAILED or KILLED."""
        for backend in self.backends:
            backend.finish(status)


class InBackground:
    """A backend whose per-step calls run in order on a thread of its own, off the fit loop's path (MLflow's store
    writes take milliseconds every step). Opening the run stays in the caller's thread, as resuming depends on it.
    A failure there is raised in the loop at the next call; `finish` waits for every call before closing."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.calls: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        """The failure not yet raised in the loop's thread."""
        self.failed = False
        self.thread = threading.Thread(target=self._run, name="tracking", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (call := self.calls.get()) is not None:
            if not self.failed:
                try:
                    call()
                except BaseException as error:  # noqa: BLE001 - handed to the loop's thread
                    self.error, self.failed = error, True

    def _raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def start(self, step: int) -> None:
        self.backend.start(step)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._raise_error()
        self.calls.put(functools.partial(self.backend.log_metrics, dict(metrics), step))

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        self._raise_error()
        self.calls.put(functools.partial(self.backend.log_samples, list(samples), step))

    def finish(self, status: str) -> None:
        self.calls.put(None)
        self.thread.join()
        self.backend.finish("FAILED" if self.failed else status)
        self._raise_error()
