"""The MLflow backend: a run in a sqlite store in the run directory (or the store tracking.tracking_uri names),
continued when the run resumes."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlmegatron.errors import UserError
from rlmegatron.tracking.samples import format_samples, sample_table

if TYPE_CHECKING:
    from rlmegatron.tracking.setup import TrackingSetup

RUN_ID_FILE = "mlflow_run.json"
SUPERSEDES_TAG = "rlmegatron.supersedes"
"""On a run that took over from the run of the same run_dir whose points after the resumed step were superseded."""
SUPERSEDED_BY_TAG = "rlmegatron.superseded_by"
RESUMED_AT_TAG = "rlmegatron.resumed_at_step"
_MLFLOW_PARAM_VALUE_LIMIT = 6000  # MLflow rejects longer parameter values
_MLFLOW_BATCH_LIMIT = 100  # params per log_batch call


class MlflowBackend:
    """An MLflow run: params and the resolved YAML at start, metrics every step. The default store is a sqlite file
    in the run directory with artifacts beside it, so a run needs no server. A run resumed in the same run directory
    continues that directory's MLflow run (RUN_ID_FILE), unless that run logged steps after the checkpoint resumed
    from (it was stopped between checkpoints): MLflow cannot delete a metric point, so a new run of the same name
    takes over, holding the earlier run's points up to that step and tagged with the run it supersedes, and the
    earlier run is deleted (MLflow's soft delete: `mlflow runs restore --run-id ID` brings it back). Either way the
    run a user sees holds each step once."""

    def __init__(self, setup: TrackingSetup, params: Mapping[str, Any], resolved_yaml: str | None) -> None:
        setup.run_dir.mkdir(parents=True, exist_ok=True)
        self.setup, self.params, self.resolved_yaml = setup, params, resolved_yaml
        self.tracking_uri = resolve_tracking_uri(setup)
        self.client = mlflow_client(self.tracking_uri)
        self.run_id: str | None = None

    def start(self, step: int) -> None:
        with damaged_store_is_the_users(self.tracking_uri):
            self._start(step)

    def _start(self, step: int) -> None:
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
        columns, rows = sample_table(samples, step)
        self.client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"{name}.json")
        self.client.log_text(self.run_id, format_samples(samples, step), f"{name}.txt")

    def finish(self, status: str) -> None:
        if self.run_id is not None:  # None: the run stopped before training started
            self.client.set_terminated(self.run_id, status=status)


def mlflow_client(tracking_uri: str):
    """A client of the store the spec (or a run directory's RUN_ID_FILE) names."""
    # Imported here: mlflow takes seconds to import, and most commands never track.
    from mlflow.tracking import MlflowClient

    # Its INFO lines as it creates and migrates a new store's tables tell a user nothing; its warnings still show.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    if is_file_store(tracking_uri):
        # MLflow 3 refuses to open its file store (file:/dir or a plain directory) unless this is set; the user
        # named that store, so it is allowed for this process (and the processes it starts), and for no other store.
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    new_sqlite = sqlite_path(tracking_uri)
    if new_sqlite is not None and not new_sqlite.exists():
        _copy_empty_store(new_sqlite)
    with damaged_store_is_the_users(tracking_uri):  # the client reads the store's tables as it opens it
        return MlflowClient(tracking_uri=tracking_uri)


# sqlite's words for a store file that is not a database at all, or one whose pages are damaged; sqlalchemy raises
# them as they are, MLflow as the text of an MlflowException.
_DAMAGED_STORE_TEXTS = ("file is not a database", "database disk image is malformed")


@contextlib.contextmanager
def damaged_store_is_the_users(tracking_uri: str) -> Iterator[None]:
    """A damaged sqlite store is one line naming its file and what to do (exit 2), not sqlalchemy's traceback."""
    try:
        yield
    except Exception as error:
        found = next((words for words in _DAMAGED_STORE_TEXTS if words in str(error)), None)
        if found is None:
            raise
        raise UserError(f"{sqlite_path(tracking_uri) or tracking_uri}: the MLflow store is damaged ({found}); "
                        "restore it from a copy, or move it aside: rlm train then starts a new store there, with a "
                        "new MLflow run") from error


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a sqlite:/// URI, else None."""
    prefix = "sqlite:///"
    return Path(tracking_uri[len(prefix):]) if tracking_uri.startswith(prefix) else None


def empty_store_template() -> Path:
    """Where this machine keeps an empty sqlite store of the installed MLflow (its cache directory)."""
    import mlflow

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlmegatron"
    return cache / f"mlflow-{mlflow.__version__}-empty-store.db"


def _copy_empty_store(path: Path) -> None:
    """Start a new sqlite store as a copy of an empty one whose tables MLflow already created and migrated.

    Why: MLflow builds a new store by running every one of its schema migrations (alembic), about 3 CPU-seconds per
    run directory. The copy has the schema at MLflow's head revision and no experiment: MLflow opens it as a store it
    made itself and adds its Default experiment, with this store's artifact root and time. The template is made once
    per MLflow version (by MLflow, in a scratch directory); a machine where it cannot be written or copied gets the
    store the usual way."""
    template = empty_store_template()
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        if not template.exists():
            _make_empty_store(template)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, partial)
        # Linked, not renamed, into place: a store another run made there meanwhile (a shared tracking_uri) is kept.
        os.link(partial, path)
    except (OSError, sqlite3.Error):
        pass
    finally:
        partial.unlink(missing_ok=True)


def _make_empty_store(template: Path) -> None:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=template.parent) as scratch:
        db = Path(scratch) / "mlflow.db"
        store = SqlAlchemyStore(f"sqlite:///{db}", (Path(scratch) / "artifacts").as_uri())
        store.engine.dispose()
        with contextlib.closing(sqlite3.connect(db)) as connection, connection:
            connection.execute("DELETE FROM experiments")  # only the Default one: MLflow adds it again on opening
        os.replace(db, template)


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
