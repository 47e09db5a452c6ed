"""curves.png: `rlm report RUN_DIR` redraws it from the MLflow store of a run still running; the PNG decodes and
carries what it plots, which is what the store holds. (A finished run's own curves: tests/driver/test_train.py.)"""
import time

from rlmegatron.entry.cli import EXIT_BAD_SPEC, EXIT_OK, main
from rlmegatron.tracking import Tracker
from tests.helpers.tracking_readers import plotted
from tests.tracking.test_tracking import damage, job_spec


def wait_until_stored(tracker: Tracker, key: str, points: int) -> None:
    from mlflow.tracking import MlflowClient

    backend = tracker.backends[0].backend
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    deadline = time.monotonic() + 30
    while len(client.get_metric_history(backend.run_id, key)) < points:
        assert time.monotonic() < deadline, f"MLflow's thread did not store {key}"
        time.sleep(0.05)


def test_report_draws_a_running_runs_curves_from_its_store(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker.from_spec(job_spec(tmp_path, ["mlflow"]))
    tracker.start(0)
    tracker.log_metrics({"val/echo/score/mean": 0.0, "val/reward/errors": 0.0}, step=0)
    logged = {}
    for step in (1, 2, 3):
        metrics = {"critic/score/mean": step / 4, "actor/ppo_kl": step * 1e-3, "actor/kl_loss": step * 2e-3,
                   "actor/entropy": 2.0 - step / 10, "response_length/mean": 10.0 + step, "timing_s/step": 1.5,
                   "actor/pg_loss": -1.0}  # not a curve
        tracker.log_metrics(metrics, step)
        for key, value in metrics.items():
            logged.setdefault(key, []).append((step, value))
    tracker.log_metrics({"val/echo/score/mean": 0.5}, step=3)
    wait_until_stored(tracker, "val/echo/score/mean", 2)  # MLflow's writes run on a thread; the run stays open

    assert main(["report", str(tmp_path)]) == EXIT_OK
    path = tmp_path / "curves.png"
    assert capsys.readouterr().out == f"curves: {path} (steps 0-3 of run exp1, RUNNING)\n"
    del logged["actor/pg_loss"]
    assert plotted(path) == {**logged, "val/echo/score/mean": [(0, 0.0), (3, 0.5)]}

    tracker.log_metrics({"critic/score/mean": 1.0}, step=4)
    tracker.finish()
    assert main(["report", str(tmp_path)]) == EXIT_OK
    assert capsys.readouterr().out == f"curves: {path} (steps 0-4 of run exp1, FINISHED)\n"
    assert plotted(path)["critic/score/mean"] == [*logged["critic/score/mean"], (4, 1.0)]


def test_report_on_a_directory_without_an_mlflow_run_or_none_at_all_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == EXIT_BAD_SPEC
    assert capsys.readouterr().err == (
        f"{tmp_path}: no MLflow run here (mlflow_run.json is missing); rlm report reads the MLflow store of a run "
        "directory whose run had mlflow in tracking.backends\n")
    assert main(["report", str(tmp_path / "no_such_run")]) == EXIT_BAD_SPEC
    assert capsys.readouterr().err == f"{tmp_path / 'no_such_run'}: no such directory; rlm report takes a run's " \
                                      "trainer.run_dir\n"


def test_report_on_a_damaged_store_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker.from_spec(job_spec(tmp_path, ["mlflow"]))
    tracker.start(0)
    tracker.finish()
    damage(tmp_path / "mlflow.db", page=1)
    assert main(["report", str(tmp_path)]) == EXIT_BAD_SPEC
    assert capsys.readouterr().err.startswith(f"{tmp_path.resolve() / 'mlflow.db'}: the MLflow store is damaged (file "
                                              "is not a database); restore it from a copy")
