"""The Tracker: one call per step fans metrics out to the MLflow and console backends."""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from rlmegatron.tracking.ascii_plot import ascii_plot
from rlmegatron.tracking.metric_names import REWARD_SCORE_MEAN

if TYPE_CHECKING:
    from rlmegatron.config.spec import JobSpec

RUN_ID_FILE = "mlflow_run.json"
_MLFLOW_PARAM_VALUE_LIMIT = 6000  # MLflow rejects longer parameter values
_MLFLOW_BATCH_LIMIT = 100  # params per log_batch call


@dataclass(frozen=True)
class TrackingSetup:
    """Everything a Tracker needs, resolved from the spec (or given directly by tests and tools)."""

    backends: list[str]
    run_dir: Path
    project_name: str
    experiment_name: str
    tracking_uri: str | None = None
    """None: MLFLOW_TRACKING_URI when set, else sqlite:///<run_dir>/mlflow.db."""


class Backend(Protocol):
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
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.backends: list[Backend] = []
        self.backend_named: dict[str, Backend] = {}
        for name in setup.backends:
            if name == "mlflow":
                backend: Backend = MlflowBackend(setup, params or {}, resolved_yaml)
            elif name == "console":
                backend = ConsoleBackend(console_stream or sys.stdout)
            else:
                raise ValueError(f"unknown tracking backend {name!r}; use mlflow or console")
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
        )
        return cls(setup, flatten(spec.model_dump(mode="json")), dump_spec(spec), console_stream)

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
        """An ASCII plot of one metric over the run, for the last lines of the log."""
        return ascii_plot(self.series(key), width=width, height=height, title=key)

    def finish(self, status: str = "FINISHED") -> None:
        """Close every backend; status is MLflow's: FINISHED, FAILED or KILLED."""
        for backend in self.backends:
            backend.finish(status)


class ConsoleBackend:
    """A compact table per step: a rule naming the step, then the metrics sorted, three to a line."""

    COLUMNS = 3

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.stream.write(format_metrics_table(metrics, step, self.COLUMNS))
        self.stream.flush()

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        self.stream.write(format_samples(samples, step))
        self.stream.flush()

    def finish(self, status: str) -> None:
        pass  # nothing buffered


def format_samples(samples: Sequence[Mapping[str, Any]], step: int) -> str:
    """Rollout samples for reading: each prompt once, then each of its responses with its score."""
    lines = [f"══ step {step}: rollout samples ══"]
    shown_prompt = None
    for sample in samples:
        if sample["prompt"] != shown_prompt or sample["sample"] == 0:
            shown_prompt = sample["prompt"]
            lines += [f"── prompt {sample['sample_id']} (ground truth: {sample['ground_truth']}) ──", sample["prompt"]]
        lines += [f"── response {sample['sample']}: score {sample['score']:.4g}, reward {sample['reward']:.4g}, "
                  f"{sample['response_length']} tokens ──", sample["response"]]
    return "\n".join(lines) + "\n"


def format_metrics_table(metrics: Mapping[str, float], step: int, columns: int = 3) -> str:
    cells = [(key, _format_value(value)) for key, value in sorted(metrics.items())]
    key_width = max((len(key) for key, _ in cells), default=0)
    value_width = max((len(value) for _, value in cells), default=0)
    lines = [f"── step {step} " + "─" * max(0, (key_width + value_width + 3) * columns - len(str(step)) - 8)]
    for start in range(0, len(cells), columns):
        row = cells[start : start + columns]
        lines.append("   ".join(f"{key:<{key_width}} {value:>{value_width}}" for key, value in row).rstrip())
    return "\n".join(lines) + "\n"


def _format_value(value: float) -> str:
    # Throughputs and token counts read better whole than as 1.235e+04.
    return f"{value:.0f}" if 1e4 <= abs(value) < 1e12 else f"{value:.4g}"


class MlflowBackend:
    """An MLflow run: params and the resolved YAML at start, metrics every step. The default store
    is a sqlite file in the run directory with artifacts beside it, so a run needs no server; a
    resumed run (same run directory) continues the same MLflow run."""

    def __init__(self, setup: TrackingSetup, params: Mapping[str, Any], resolved_yaml: str | None) -> None:
        # Imported here: mlflow takes seconds to import, and most commands never track.
        from mlflow.tracking import MlflowClient

        setup.run_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri = resolve_tracking_uri(setup)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id = self._resumed_run_id(setup.run_dir) or self._start_run(setup, params, resolved_yaml)

    def _start_run(self, setup: TrackingSetup, params: Mapping[str, Any], resolved_yaml: str | None) -> str:
        from mlflow.entities import Param

        experiment = self.client.get_experiment_by_name(setup.project_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifact_location = None
            if self.tracking_uri.startswith("sqlite:"):
                artifact_location = (setup.run_dir.resolve() / "mlartifacts").as_uri()
            experiment_id = self.client.create_experiment(setup.project_name, artifact_location=artifact_location)
        run = self.client.create_run(experiment_id, run_name=setup.experiment_name)
        run_id = run.info.run_id
        entries = [Param(key, _param_text(value)) for key, value in params.items()]
        for start in range(0, len(entries), _MLFLOW_BATCH_LIMIT):
            self.client.log_batch(run_id, params=entries[start : start + _MLFLOW_BATCH_LIMIT])
        if resolved_yaml is not None:
            self.client.log_text(run_id, resolved_yaml, "resolved_spec.yaml")
        (setup.run_dir / RUN_ID_FILE).write_text(json.dumps({"run_id": run_id, "tracking_uri": self.tracking_uri}))
        return run_id

    def _resumed_run_id(self, run_dir: Path) -> str | None:
        saved_file = run_dir / RUN_ID_FILE
        if not saved_file.is_file():
            return None
        saved = json.loads(saved_file.read_text())
        if saved.get("tracking_uri") != self.tracking_uri:
            return None  # the store moved; start a new run rather than write to an unknown one
        self.client.update_run(saved["run_id"], status="RUNNING")
        return saved["run_id"]

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        entries = [Metric(key, value, timestamp, step) for key, value in metrics.items()]
        for start in range(0, len(entries), 1000):  # MLflow's per-batch metric limit
            self.client.log_batch(self.run_id, metrics=entries[start : start + 1000])

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        """Artifacts rollout_samples/step_NNNNNN.json (a table the MLflow UI shows and mlflow.load_table reads, one
        row per sample) and .txt (the same, to read)."""
        if not samples:
            return
        name = f"rollout_samples/step_{step:06d}"
        columns = {key: [sample[key] for sample in samples] for key in samples[0]}
        self.client.log_table(self.run_id, data={"step": [step] * len(samples), **columns},
                              artifact_file=f"{name}.json")
        self.client.log_text(self.run_id, format_samples(samples, step), f"{name}.txt")

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def resolve_tracking_uri(setup: TrackingSetup) -> str:
    """tracking.tracking_uri, else MLFLOW_TRACKING_URI, else a sqlite store in the run directory."""
    if setup.tracking_uri:
        return setup.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(setup.run_dir / 'mlflow.db').resolve()}"


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= _MLFLOW_PARAM_VALUE_LIMIT else text[: _MLFLOW_PARAM_VALUE_LIMIT - 3] + "..."
