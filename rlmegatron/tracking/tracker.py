"""The Tracker: one call per step fans metrics out to the MLflow and console backends."""
from __future__ import annotations

import functools
import json
import logging
import os
import queue
import sys
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from rlmegatron.tracking.ascii_plot import ascii_plot
from rlmegatron.tracking.metric_names import REWARD_SCORE_MEAN

if TYPE_CHECKING:
    from rlmegatron.config.spec import JobSpec

RUN_ID_FILE = "mlflow_run.json"
SUPERSEDES_TAG = "rlmegatron.supersedes"
"""On a run that took over from the run of the same run_dir whose points after the resumed step were superseded."""
SUPERSEDED_BY_TAG = "rlmegatron.superseded_by"
RESUMED_AT_TAG = "rlmegatron.resumed_at_step"
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
    log_freq: int = -1
    """The console prints the full metric table every log_freq steps and one line on the others; -1: one line every
    step (trainer.log_freq)."""


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
            elif name == "console":
                backend = ConsoleBackend(console_stream or sys.stdout, setup.log_freq)
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


class ConsoleBackend:
    """One line per step (the step, its mean score, response length and time, and any validation scores); every
    `log_freq` trained steps the compact table of every metric instead: a rule naming the step, then the metrics
    sorted, three to a line."""

    COLUMNS = 3

    def __init__(self, stream: TextIO, log_freq: int = -1) -> None:
        self.stream, self.log_freq = stream, log_freq

    def start(self, step: int) -> None:
        pass  # a stream has no earlier attempt to continue

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.log_freq > 0 and step > 0 and step % self.log_freq == 0:  # step 0: validation before training
            self.stream.write(format_metrics_table(metrics, step, self.COLUMNS))
        else:
            self.stream.write(format_step_line(metrics, step))
        self.stream.flush()

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        self.stream.write(format_samples(samples, step))
        self.stream.flush()

    def finish(self, status: str) -> None:
        pass  # nothing buffered


def format_samples(samples: Sequence[Mapping[str, Any]], step: int) -> str:
    """Rollout samples for reading: each prompt once, then each of its responses with its score (and a multi-turn
    response's turns and tool calls)."""
    lines = [f"══ step {step}: rollout samples ══"]
    shown_prompt = None
    for sample in samples:
        if sample["prompt"] != shown_prompt or sample["sample"] == 0:
            shown_prompt = sample["prompt"]
            lines += [f"── prompt {sample['sample_id']} (ground truth: {sample['ground_truth']}) ──", sample["prompt"]]
        agent = (f", {sample['turns']} turns, {sample['tool_calls']} tool calls ({sample['tool_errors']} failed)"
                 if "turns" in sample else "")
        lines += [f"── response {sample['sample']}: score {sample['score']:.4g}, reward {sample['reward']:.4g}, "
                  f"{sample['response_length']} tokens{agent} ──", sample["response"]]
    return "\n".join(lines) + "\n"


STEP_LINE_METRICS = (REWARD_SCORE_MEAN, "response_length/mean", "timing_s/step")
"""What a step's one console line shows, with every validation score (val/<source>/score/mean) of the step."""


def format_step_line(metrics: Mapping[str, float], step: int) -> str:
    """`step 12  critic/score/mean 0.4375  response_length/mean 1  timing_s/step 0.07131`: the metrics' own names,
    as the table and the MLflow run show them."""
    shown = [key for key in STEP_LINE_METRICS if key in metrics]
    shown += sorted(key for key in metrics if key.startswith("val/") and key.endswith("/score/mean"))
    return "  ".join([f"step {step}", *(f"{key} {_format_value(metrics[key])}" for key in shown)]) + "\n"


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
    """An MLflow run: params and the resolved YAML at start, metrics every step. The default store is a sqlite file
    in the run directory with artifacts beside it, so a run needs no server. A run resumed in the same run directory
    continues that directory's MLflow run (RUN_ID_FILE), unless that run logged steps after the checkpoint resumed
    from (it was stopped between checkpoints): MLflow cannot delete a metric point, so a new run of the same name
    takes over, holding the earlier run's points up to that step and tagged with the run it supersedes, and the
    earlier run is deleted (MLflow's soft delete: `mlflow runs restore --run-id ID` brings it back). Either way the
    run a user sees holds each step once."""

    def __init__(self, setup: TrackingSetup, params: Mapping[str, Any], resolved_yaml: str | None) -> None:
        # Imported here: mlflow takes seconds to import, and most commands never track.
        from mlflow.tracking import MlflowClient

        # Its INFO lines as it creates and migrates a new store's tables tell a user nothing; its warnings still show.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)

        setup.run_dir.mkdir(parents=True, exist_ok=True)
        self.setup, self.params, self.resolved_yaml = setup, params, resolved_yaml
        self.tracking_uri = resolve_tracking_uri(setup)
        if is_file_store(self.tracking_uri):
            # MLflow 3 refuses to open its file store (file:/dir or a plain directory) unless this is set; the user
            # named that store, so it is allowed for this process (and the processes it starts), and for no other
            # store.
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.run_id: str | None = None

    def start(self, step: int) -> None:
        previous = self._previous_run()
        if previous is None:
            self.run_id = self._start_run(self.setup, self.params, self.resolved_yaml)
            return
        # A fresh start (step 0) keeps nothing: even step 0's validation is logged again.
        kept, superseded = [], 0
        for key in previous.data.metrics:
            for point in self.client.get_metric_history(previous.info.run_id, key):
                if step > 0 and point.step <= step:
                    kept.append(point)
                else:
                    superseded += 1
        if not superseded:
            self.client.update_run(previous.info.run_id, status="RUNNING")
            self.run_id = previous.info.run_id
            return
        self.run_id = self._start_run(self.setup, self.params, self.resolved_yaml,
                                      {SUPERSEDES_TAG: previous.info.run_id, RESUMED_AT_TAG: str(step)})
        self._log_points(kept)
        self.client.set_tag(previous.info.run_id, SUPERSEDED_BY_TAG, self.run_id)
        self.client.delete_run(previous.info.run_id)
        print(f"mlflow: run {previous.info.run_id} logged {superseded} metric points after step {step}, where this "
              f"run resumes; run {self.run_id} takes over with its points up to step {step}, and "
              f"{previous.info.run_id} is deleted (`mlflow runs restore --run-id {previous.info.run_id}` brings it "
              f"back)", file=sys.stderr, flush=True)

    def _start_run(self, setup: TrackingSetup, params: Mapping[str, Any], resolved_yaml: str | None,
                   tags: Mapping[str, str] | None = None) -> str:
        from mlflow.entities import Param

        experiment = self.client.get_experiment_by_name(setup.project_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifact_location = None
            if self.tracking_uri.startswith("sqlite:"):
                artifact_location = (setup.run_dir.resolve() / "mlartifacts").as_uri()
            experiment_id = self.client.create_experiment(setup.project_name, artifact_location=artifact_location)
        run = self.client.create_run(experiment_id, run_name=setup.experiment_name, tags=dict(tags or {}))
        run_id = run.info.run_id
        entries = [Param(key, _param_text(value)) for key, value in params.items()]
        for start in range(0, len(entries), _MLFLOW_BATCH_LIMIT):
            self.client.log_batch(run_id, params=entries[start : start + _MLFLOW_BATCH_LIMIT])
        if resolved_yaml is not None:
            self.client.log_text(run_id, resolved_yaml, "resolved_spec.yaml")
        (setup.run_dir / RUN_ID_FILE).write_text(json.dumps({"run_id": run_id, "tracking_uri": self.tracking_uri}))
        return run_id

    def _previous_run(self):
        """This run directory's MLflow run, if it is in this store and not deleted."""
        from mlflow.exceptions import MlflowException

        saved_file = self.setup.run_dir / RUN_ID_FILE
        if not saved_file.is_file():
            return None
        saved = json.loads(saved_file.read_text())
        if saved.get("tracking_uri") != self.tracking_uri:
            return None  # the store moved; start a new run rather than write to an unknown one
        try:
            run = self.client.get_run(saved["run_id"])
        except MlflowException:
            return None  # not in this store (it was recreated)
        return None if run.info.lifecycle_stage == "deleted" else run

    def _log_points(self, points: list) -> None:
        for start in range(0, len(points), 1000):  # MLflow's per-batch metric limit
            self.client.log_batch(self.run_id, metrics=points[start : start + 1000])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        assert self.run_id is not None, "Tracker.start opens the run"
        timestamp = int(time.time() * 1000)
        self._log_points([Metric(key, value, timestamp, step) for key, value in metrics.items()])

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int) -> None:
        """Artifacts rollout_samples/step_NNNNNN.json (a table, one row per sample, in the columns/data layout of
        MLflow's log_table, which pandas.read_json(orient="split") reads) and .txt (the same, to read). Not log_table
        itself: it lists every table in a run tag that MLflow cuts at 8000 characters, after which every further
        call fails (some 145 steps into a run)."""
        if not samples:
            return
        name = f"rollout_samples/step_{step:06d}"
        columns = ["step", *samples[0]]
        rows = [[step, *(sample[key] for key in columns[1:])] for sample in samples]
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"{name}.json")
        self.client.log_text(self.run_id, format_samples(samples, step), f"{name}.txt")

    def finish(self, status: str) -> None:
        if self.run_id is not None:  # None: the run stopped before training started
            self.client.set_terminated(self.run_id, status=status)


def resolve_tracking_uri(setup: TrackingSetup) -> str:
    """tracking.tracking_uri, else MLFLOW_TRACKING_URI, else a sqlite store in the run directory."""
    if setup.tracking_uri:
        return setup.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{(setup.run_dir / 'mlflow.db').resolve()}"


def is_file_store(tracking_uri: str) -> bool:
    """Whether MLflow opens this URI as its file store: a file: URI or a path without a scheme."""
    return urllib.parse.urlparse(tracking_uri).scheme in ("", "file")


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= _MLFLOW_PARAM_VALUE_LIMIT else text[: _MLFLOW_PARAM_VALUE_LIMIT - 3] + "..."
