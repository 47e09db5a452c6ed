"""Tracking: the MLflow sqlite store holds what was logged, console tables, ASCII plots, URI choice."""
import io
import os
import time
from pathlib import Path

import pytest
import yaml

from rlmegatron.config.spec import JobSpec
from rlmegatron.tracking import Tracker, TrackingSetup, ascii_plot, flatten, format_metrics_table, resolve_tracking_uri
from rlmegatron.tracking.tracker import InBackground


def job_spec(run_dir, backends):
    return JobSpec.model_validate({
        "model": {"path": "tiny"},
        "data": {"train_files": ["train.parquet"]},
        "trainer": {"run_dir": str(run_dir), "experiment_name": "exp1"},
        "tracking": {"backends": backends, "project_name": "proj"},
        "actor": {"optim": {"lr": 3e-6}},
    })


def test_mlflow_sqlite_store_holds_params_metrics_and_the_resolved_yaml(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset below")  # so monkeypatch removes it if the tracker sets it
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    run_dir = tmp_path / "run"
    tracker = Tracker.from_spec(job_spec(run_dir, ["mlflow"]))
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # MLflow's file store is allowed only when it is the store
    tracker.start(0)
    tracker.log_metrics({"critic/score/mean": 0.25, "actor/pg_loss": -0.5}, step=1)
    tracker.log_metrics({"critic/score/mean": 0.75}, step=2)
    tracker.finish()

    uri = f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    assert (run_dir / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(tracker.backends[0].backend.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "exp1"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    assert run.data.params["actor.optim.lr"] == "3e-06"
    assert run.data.params["data.train_files"] == '["train.parquet"]'
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.75)]
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert artifacts == ["resolved_spec.yaml"]
    assert str(run.info.artifact_uri).startswith((run_dir.resolve() / "mlartifacts").as_uri())
    resolved = yaml.safe_load((next((run_dir / "mlartifacts").rglob("resolved_spec.yaml"))).read_text())
    assert resolved["actor"]["optim"]["lr"] == 3e-6

    # A run resumed from step 2 in the same run directory continues the same MLflow run: it logged nothing later.
    resumed = Tracker.from_spec(job_spec(run_dir, ["mlflow"]))
    resumed.start(2)
    assert resumed.backends[0].backend.run_id == run.info.run_id
    resumed.log_metrics({"critic/score/mean": 1.0}, step=3)
    resumed.finish("KILLED")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == [1, 2, 3]
    assert client.get_run(run.info.run_id).info.status == "KILLED"


def test_a_run_resumed_before_steps_it_logged_shows_each_step_once(tmp_path, monkeypatch, capsys):
    """Killed after logging step 3 with its newest checkpoint at step 1: a new run holds steps 1-3 once, the
    killed run's step 1 and the resumed run's steps 2-3; the killed run is deleted but restorable."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    from rlmegatron.tracking.mlflow_run import RESUMED_AT_TAG, SUPERSEDED_BY_TAG, SUPERSEDES_TAG

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    killed = Tracker.from_spec(job_spec(tmp_path, ["mlflow"]))
    killed.start(0)
    killed.log_metrics({"val/echo/score/mean": 0.1}, step=0)
    for step in (1, 2, 3):
        killed.log_metrics({"critic/score/mean": step / 10, "actor/pg_loss": -step}, step=step)
    killed.finish("KILLED")
    resumed = Tracker.from_spec(job_spec(tmp_path, ["mlflow"]))
    resumed.start(1)
    for step in (2, 3):
        resumed.log_metrics({"critic/score/mean": step, "actor/pg_loss": step}, step=step)
    resumed.finish()

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("proj").experiment_id
    [run] = client.search_runs([experiment])
    [old] = client.search_runs([experiment], run_view_type=ViewType.DELETED_ONLY)
    assert old.info.run_id == killed.backends[0].backend.run_id and run.info.run_id == resumed.backends[0].backend.run_id
    assert (run.data.tags[SUPERSEDES_TAG], run.data.tags[RESUMED_AT_TAG]) == (old.info.run_id, "1")
    assert old.data.tags[SUPERSEDED_BY_TAG] == run.info.run_id
    assert run.info.run_name == "exp1" and run.data.params["actor.optim.lr"] == "3e-06"
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
               for key in ("val/echo/score/mean", "critic/score/mean", "actor/pg_loss")}
    assert history == {"val/echo/score/mean": [(0, 0.1)], "critic/score/mean": [(1, 0.1), (2, 2.0), (3, 3.0)],
                       "actor/pg_loss": [(1, -1.0), (2, 2.0), (3, 3.0)]}
    assert f"mlflow: run {old.info.run_id} logged 4 metric points after step 1" in capsys.readouterr().err
    # The superseded run is kept whole, so restoring it brings back what it logged.
    assert [m.step for m in client.get_metric_history(old.info.run_id, "critic/score/mean")] == [1, 2, 3]

    # A fresh start (step 0) in the same run directory keeps nothing of the run before it, not even step 0.
    again = Tracker.from_spec(job_spec(tmp_path, ["mlflow"]))
    again.start(0)
    again.finish()
    [fresh] = client.search_runs([experiment])
    assert fresh.info.run_id == again.backends[0].backend.run_id and fresh.data.metrics == {}


def damage(store: Path, page: int) -> None:
    """Overwrite one page of a sqlite file: page 1 holds its header, later ones its tables' rows."""
    with store.open("r+b") as file:
        file.seek((page - 1) * 4096)
        file.write(b"\xff" * 4096)


@pytest.mark.parametrize("page, words", [(1, "file is not a database"), ("runs", "database disk image is malformed")])
def test_a_damaged_mlflow_store_is_one_line_naming_the_file_and_what_to_do(tmp_path, monkeypatch, page, words):
    import sqlite3

    from rlmegatron.errors import UserError

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker.from_spec(job_spec(tmp_path, ["mlflow"]))
    tracker.start(0)
    tracker.log_metrics({"critic/score/mean": 0.5}, step=1)
    tracker.finish()
    store = tmp_path.resolve() / "mlflow.db"
    if page == "runs":  # the table a resume reads first
        with sqlite3.connect(store) as db:
            [(page,)] = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'runs'").fetchall()
    damage(store, page)
    with pytest.raises(UserError) as damaged:  # opening the store reads its header; resuming the run, its tables
        Tracker.from_spec(job_spec(tmp_path, ["mlflow"])).start(1)
    assert str(damaged.value) == (f"{store}: the MLflow store is damaged ({words}); restore it from a copy, or move it "
                                  "aside: rlm train then starts a new store there, with a new MLflow run")


def test_tracking_uri_prefers_the_spec_then_the_environment_then_the_run_dir(tmp_path, monkeypatch):
    setup = TrackingSetup(["mlflow"], tmp_path, "p", "e")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(setup) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert resolve_tracking_uri(setup) == "http://mlflow:5000"
    explicit = TrackingSetup(["mlflow"], tmp_path, "p", "e", tracking_uri="file:///x")
    assert resolve_tracking_uri(explicit) == "file:///x"


def test_a_new_sqlite_store_is_a_copy_of_an_empty_migrated_one_and_equals_what_mlflow_makes(tmp_path, monkeypatch):
    """The second new store of a machine runs none of MLflow's migrations, and MLflow's own reader finds in it what a
    store MLflow made itself holds: the same schema, a Default experiment at its own artifact root, the same ids."""
    import sqlite3

    import mlflow.store.db.utils
    from mlflow.tracking import MlflowClient

    from rlmegatron.tracking.mlflow_run import _copy_empty_store, empty_store_template, mlflow_client

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    mlflow_client(f"sqlite:///{tmp_path / 'first' / 'mlflow.db'}")._tracking_client.store  # makes the template
    assert empty_store_template().is_file() and empty_store_template().parent == tmp_path / "cache" / "rlmegatron"

    def stores_and_ids(client):
        experiment = client.create_experiment("proj", artifact_location=(tmp_path / "artifacts").as_uri())
        run = client.create_run(experiment)
        client.log_metric(run.info.run_id, "critic/score/mean", 0.5, step=1)
        default = client.get_experiment("0")
        return (experiment, default.name, default.artifact_location, default.lifecycle_stage,
                [m.value for m in client.get_metric_history(run.info.run_id, "critic/score/mean")])

    made_by_mlflow = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    expected = stores_and_ids(made_by_mlflow)
    # No migration runs for the copy: MLflow's table creation would fail.
    monkeypatch.setattr(mlflow.store.db.utils, "_initialize_tables", lambda engine: pytest.fail("migrated again"))
    copied = mlflow_client(f"sqlite:///{tmp_path / 'ours' / 'mlflow.db'}")
    got = stores_and_ids(copied)
    assert got == expected
    assert expected[2] == str(tmp_path / "mlruns" / "0")  # MLflow's default root, of the opening process's directory

    def schema(db):
        """Each table's and index's definition, its clauses in any order: MLflow's own migrations order a table's
        CHECK constraints differently from one process to the next."""
        with sqlite3.connect(db) as connection:
            rows = connection.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
        return sorted((kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
                      for kind, name, sql in rows)

    assert schema(tmp_path / "ours" / "mlflow.db") == schema(tmp_path / "mlflow" / "mlflow.db")

    # A store that appeared meanwhile (another run naming the same tracking_uri) is kept as it is, nothing left beside.
    before = (tmp_path / "ours" / "mlflow.db").read_bytes()
    _copy_empty_store(tmp_path / "ours" / "mlflow.db")
    assert (tmp_path / "ours" / "mlflow.db").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["mlflow.db"]


@pytest.mark.parametrize("uri", ["file:{}", "{}"], ids=["file_uri", "plain_directory"])
def test_an_mlflow_file_store_takes_the_runs_metrics(tmp_path, monkeypatch, uri):
    """MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE=true; a spec naming one gets it anyway."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset below")  # so monkeypatch removes what the tracker sets
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    store = tmp_path / "mlruns"
    spec = job_spec(tmp_path / "run", ["mlflow"]).model_copy(deep=True)
    spec.tracking.tracking_uri = uri.format(store)
    tracker = Tracker.from_spec(spec)
    tracker.start(0)
    tracker.log_metrics({"critic/score/mean": 0.25}, step=1)
    tracker.log_metrics({"critic/score/mean": 0.75}, step=2)
    tracker.finish()

    client = MlflowClient(tracking_uri=store.as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["actor.optim.lr"] == "3e-06"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == [
        (1, 0.25), (2, 0.75)]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["resolved_spec.yaml"]


def test_the_mlflow_store_is_the_specs_tracking_uri(tmp_path, monkeypatch):
    from rlmegatron.tracking import tracker as tracker_module

    opened = []
    monkeypatch.setattr(tracker_module, "MlflowBackend", lambda setup, params, resolved: opened.append(setup))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://from-the-environment:5000")
    spec = job_spec(tmp_path, ["mlflow"]).model_copy(deep=True)
    spec.tracking.tracking_uri = "sqlite:////elsewhere/mlflow.db"
    Tracker.from_spec(spec)
    assert [resolve_tracking_uri(setup) for setup in opened] == ["sqlite:////elsewhere/mlflow.db"]


def test_console_prints_one_line_a_step_and_the_full_table_every_log_freq_steps(tmp_path):
    stream = io.StringIO()
    spec = job_spec(tmp_path, ["console"])
    spec.trainer.log_freq = 7
    tracker = Tracker.from_spec(spec, console_stream=stream)
    metrics = {"timing_s/gen": 1.23456, "actor/pg_loss": -0.01234, "critic/score/mean": 0.5,
               "perf/throughput": 12345.6, "response_length/mean": 3.25, "timing_s/step": 2.5}
    tracker.log_metrics({"val/gsm8k/score/mean": 0.0}, step=0)  # validation before training: a line, whatever N
    tracker.log_metrics(metrics, step=6)
    tracker.log_metrics(metrics, step=7)
    tracker.log_metrics({**metrics, "val/gsm8k/score/mean": 0.125, "val/reward/errors": 0.0}, step=8)
    step_0, *lines = stream.getvalue().splitlines()
    assert step_0 == "step 0  val/gsm8k/score/mean 0"
    assert lines[0] == "step 6  critic/score/mean 0.5  response_length/mean 3.25  timing_s/step 2.5"
    assert lines[1].startswith("── step 7 ──")
    assert lines[2:4] == [
        "actor/pg_loss        -0.01234   critic/score/mean         0.5   perf/throughput         12346",
        "response_length/mean     3.25   timing_s/gen            1.235   timing_s/step             2.5"]
    assert lines[4:] == ["step 8  critic/score/mean 0.5  response_length/mean 3.25  timing_s/step 2.5  "
                         "val/gsm8k/score/mean 0.125"]
    assert tracker.series("critic/score/mean") == [0.5, 0.5, 0.5]
    assert format_metrics_table({}, 1).startswith("── step 1")
    spec.trainer.log_freq = -1  # the default: a line every step, never the table
    quiet = io.StringIO()
    Tracker.from_spec(spec, console_stream=quiet).log_metrics(metrics, step=7)
    assert quiet.getvalue() == "step 7  critic/score/mean 0.5  response_length/mean 3.25  timing_s/step 2.5\n"


def test_ascii_plot_shape():
    rising = [i / 99 for i in range(100)]
    lines = ascii_plot(rising, width=20, height=5, title="critic/score/mean").splitlines()
    assert lines[0] == "critic/score/mean"
    plot_rows, axis, steps = lines[1:6], lines[6], lines[7]
    assert len(lines) == 8
    assert {len(row) for row in plot_rows} == {len(axis)} and axis.endswith("+" + "-" * 20)
    assert [row.count("*") for row in plot_rows] and sum(row.count("*") for row in plot_rows) == 20
    # 100 points averaged into 20 columns: the top row is labelled with the last bucket's mean.
    assert plot_rows[0].startswith("0.9798 |") and plot_rows[0].endswith("*")  # the maximum, top right
    assert plot_rows[-1].startswith("0.0202 |*")  # the minimum, bottom left
    assert steps.strip() == "steps 1-100"
    assert ascii_plot([]) == "no data"
    assert ascii_plot([0.5, 0.7], steps=[21, 22]).splitlines()[-1].strip() == "steps 21-22"


def test_summary_plots_the_reward_curve(tmp_path):
    tracker = Tracker(TrackingSetup(["console"], tmp_path, "p", "e"), console_stream=io.StringIO())
    for step in range(21, 24):  # a run resumed from step 20
        tracker.log_metrics({"critic/score/mean": step / 30}, step)
    lines = tracker.summary(height=3).splitlines()
    assert lines[0] == "critic/score/mean" and lines[-1].strip() == "steps 21-23"


def test_flatten_uses_dotted_keys():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [1, 2], "e": {}}


def test_console_prints_rollout_samples_each_prompt_once_then_its_responses(tmp_path):
    stream = io.StringIO()
    tracker = Tracker(TrackingSetup(["console"], tmp_path, "p", "e"), console_stream=stream)
    samples = [{"sample_id": "echo#3", "sample": k, "prompt": "echo:x", "response": response, "ground_truth": "x",
                "score": score, "reward": score, "response_length": 1}
               for k, (response, score) in enumerate([("x", 1.0), ("q", 0.0)])]
    tracker.log_rollout_samples(samples, step=4, backend="console")
    assert stream.getvalue().splitlines() == [
        "══ step 4: rollout samples ══",
        "── prompt echo#3 (ground truth: x) ──",
        "echo:x",
        "── response 0: score 1, reward 1, 1 tokens ──",
        "x",
        "── response 1: score 0, reward 0, 1 tokens ──",
        "q",
    ]
    with pytest.raises(ValueError, match="mlflow tracker, which is not in tracking.backends"):
        tracker.log_rollout_samples(samples, step=4, backend="mlflow")


class SlowBackend:
    """Takes `delay` seconds per call, records the calls in order, and fails on step `fail_at`."""

    def __init__(self, delay: float, fail_at: int | None = None) -> None:
        self.delay, self.fail_at, self.calls = delay, fail_at, []

    def start(self, step: int) -> None:
        self.calls.append(("start", step))

    def log_metrics(self, metrics, step: int) -> None:
        time.sleep(self.delay)
        if step == self.fail_at:
            raise ConnectionError("the store went away")
        self.calls.append(("metrics", step, dict(metrics)))

    def log_samples(self, samples, step: int) -> None:
        self.calls.append(("samples", step, len(samples)))

    def finish(self, status: str) -> None:
        self.calls.append(("finish", status))


def test_a_backend_in_the_background_keeps_the_order_and_leaves_the_loop_at_once():
    slow = SlowBackend(delay=0.05)
    background = InBackground(slow)
    background.start(0)
    started = time.perf_counter()
    for step in range(1, 11):
        metrics = {"loss": float(step)}
        background.log_metrics(metrics, step)
        metrics["loss"] = -1.0  # the loop's dict may change afterwards: the backend logs what it was given
    background.log_samples([{"prompt": "p"}], 10)
    assert time.perf_counter() - started < 0.25  # ten calls of 50 ms each did not wait
    background.finish("FINISHED")
    assert slow.calls == [("start", 0), *[("metrics", s, {"loss": float(s)}) for s in range(1, 11)],
                          ("samples", 10, 1), ("finish", "FINISHED")]


def test_a_failure_in_the_background_reaches_the_loop_and_marks_the_run_failed():
    slow = SlowBackend(delay=0.0, fail_at=2)
    background = InBackground(slow)
    background.log_metrics({"loss": 1.0}, 1)
    background.log_metrics({"loss": 2.0}, 2)
    background.log_metrics({"loss": 3.0}, 3)  # may be queued before step 2 fails: it is then dropped
    with pytest.raises(ConnectionError, match="the store went away"):
        deadline = time.perf_counter() + 5
        while time.perf_counter() < deadline:
            background.log_metrics({"loss": 4.0}, 4)
            time.sleep(0.01)
    assert ("metrics", 1, {"loss": 1.0}) in slow.calls and not any(c[0] == "metrics" and c[1] > 2 for c in slow.calls)
    background.finish("FINISHED")
    assert slow.calls[-1] == ("finish", "FAILED")


def test_rollout_samples_go_to_mlflow_every_step_of_a_long_run(tmp_path, monkeypatch):
    """300 steps of samples: each step's table is there (MLflow's log_table records every table in a run tag that it
    cuts at 8000 characters, after which each further call failed, some 145 steps into a run)."""
    import json

    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker.from_spec(job_spec(tmp_path, ["mlflow"]))
    tracker.start(0)
    backend = tracker.backends[0].backend
    samples = [{"sample_id": "echo#1", "sample": 0, "prompt": "echo:x", "response": "x", "ground_truth": "x",
                "score": 1.0, "reward": 1.0, "response_length": 1}]
    for step in range(1, 301):
        backend.log_samples(samples, step)
    tracker.finish("FINISHED")
    client = MlflowClient(tracking_uri=resolve_tracking_uri(tracker.setup))
    last = json.loads(Path(client.download_artifacts(backend.run_id, "rollout_samples/step_000300.json")).read_text())
    assert [dict(zip(last["columns"], row)) for row in last["data"]] == [{"step": 300, **samples[0]}]
