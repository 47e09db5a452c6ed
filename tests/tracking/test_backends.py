"""W&B and TensorBoard: what the tracker logs is read back with each library's own reader (W&B's transaction-log
inspector, `wandb leet inspect`, on an offline run; TensorBoard's EventAccumulator on the event files), and a resumed
run continues each one's run. A backend whose package is missing is one line at validation."""
import json
import sys
from pathlib import Path

import pytest

from rlmegatron.entry.cli import EXIT_BAD_SPEC, main
from rlmegatron.errors import UserError
from rlmegatron.tracking import Tracker
from rlmegatron.tracking.mlflow_run import resolve_tracking_uri
from rlmegatron.tracking.samples import format_samples, sample_table
from tests.helpers.tracking_readers import tensorboard_events, tensorboard_history, wandb_history, wandb_runs
from tests.tracking.test_tracking import job_spec

REPO_ROOT = Path(__file__).resolve().parents[2]
# Values a float32 holds exactly: TensorBoard stores scalars as float32.
STEPS = {0: {"val/echo/score/mean": 0.125},
         1: {"critic/score/mean": 0.25, "actor/pg_loss": -0.5, "timing_s/step": 2.75},
         2: {"critic/score/mean": 0.75, "actor/pg_loss": 1.5, "timing_s/step": 3.25, "val/echo/score/mean": 0.5}}
SAMPLES = [{"sample_id": "echo#3", "sample": k, "prompt": "echo:x", "response": response, "ground_truth": "x",
            "score": score, "reward": score, "response_length": 1}
           for k, (response, score) in enumerate([("x", 1.0), ("q", 0.0)])]


def test_every_backend_gets_the_same_metric_names_values_and_samples(tmp_path, monkeypatch):
    """MLflow, W&B (offline) and TensorBoard side by side, each read back from its own store."""
    from mlflow.tracking import MlflowClient
    from tensorboard.util import tensor_util

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracker = Tracker.from_spec(job_spec(tmp_path, ["mlflow", "wandb", "tensorboard"]))
    tracker.start(0)
    for step, metrics in STEPS.items():
        tracker.log_metrics(metrics, step)
    for backend in ("mlflow", "wandb", "tensorboard"):
        tracker.log_rollout_samples(SAMPLES, 2, backend)
    tracker.finish()

    logged = {key: [(step, value) for step, metrics in STEPS.items() for k, value in metrics.items() if k == key]
              for key in {key for metrics in STEPS.values() for key in metrics}}
    client = MlflowClient(tracking_uri=resolve_tracking_uri(tracker.setup))
    mlflow_run = tracker.backend_named["mlflow"].backend.run_id
    assert {key: [(m.step, m.value) for m in client.get_metric_history(mlflow_run, key)] for key in logged} == logged

    [records] = wandb_runs(tmp_path)
    assert wandb_history(records) == logged
    [run] = [r["run"] for r in records if r["type"] == "run"]
    assert (run["project"], run["display_name"]) == ("proj", "exp1")
    assert run["config"]["update"]["actor.optim.lr"] == 3e-6  # the resolved spec, flattened as MLflow's params
    [table_step] = [r["history"] for r in records if r["type"] == "history" and "rollout_samples._type" in
                    r["history"]["item"]]
    assert table_step["step"]["num"] == 2 and table_step["item"]["rollout_samples._type"] == "table-file"
    table = json.loads((next((tmp_path / "wandb").glob("offline-run-*")) / "files" /
                        table_step["item"]["rollout_samples.path"]).read_text())
    columns, rows = sample_table(SAMPLES, 2)
    assert table == {"columns": columns, "data": rows}

    events = tensorboard_events(tmp_path)
    assert tensorboard_history(events) == logged
    [text] = events.Tensors("rollout_samples/text_summary")
    assert text.step == 2
    assert tensor_util.make_ndarray(text.tensor_proto).item().decode() == f"```\n{format_samples(SAMPLES, 2)}```"


def test_a_resumed_run_continues_its_wandb_and_tensorboard_runs(tmp_path):
    """Stopped after logging step 3 with its last checkpoint at step 1, then resumed there to step 4: W&B continues
    the same run (its id, resumed), and TensorBoard shows each step once, steps 2-3 as the resumed run logged them.
    A fresh start in the same run directory is a new W&B run and hides everything before it in TensorBoard."""
    stopped = Tracker.from_spec(job_spec(tmp_path, ["wandb", "tensorboard"]))
    stopped.start(0)
    for step in (1, 2, 3):
        stopped.log_metrics({"critic/score/mean": step / 8}, step)
    stopped.finish("KILLED")
    resumed = Tracker.from_spec(job_spec(tmp_path, ["wandb", "tensorboard"]))
    resumed.start(1)
    for step in (2, 3, 4):
        resumed.log_metrics({"critic/score/mean": step / 4}, step)
    resumed.finish()

    first, second = wandb_runs(tmp_path)
    [first_run], [second_run] = ([r["run"] for r in records if r["type"] == "run"] for records in (first, second))
    assert second_run["run_id"] == first_run["run_id"] and second_run.get("resume") is True
    assert "resume" not in first_run
    assert [r["exit"].get("exit_code", 0) for r in first + second if r["type"] == "exit"] == [1, 0]  # killed, finished
    assert wandb_history(first) == {"critic/score/mean": [(1, 0.125), (2, 0.25), (3, 0.375)]}
    assert wandb_history(second) == {"critic/score/mean": [(2, 0.5), (3, 0.75), (4, 1.0)]}
    assert tensorboard_history(tensorboard_events(tmp_path)) == {
        "critic/score/mean": [(1, 0.125), (2, 0.5), (3, 0.75), (4, 1.0)]}

    fresh = Tracker.from_spec(job_spec(tmp_path, ["wandb", "tensorboard"]))
    fresh.start(0)
    fresh.log_metrics({"critic/score/mean": 0.0}, 1)
    fresh.finish()
    *_, third = wandb_runs(tmp_path)
    [third_run] = [r["run"] for r in third if r["type"] == "run"]
    assert third_run["run_id"] != first_run["run_id"] and "resume" not in third_run
    assert tensorboard_history(tensorboard_events(tmp_path)) == {"critic/score/mean": [(1, 0.0)]}


@pytest.mark.parametrize("backend", ["wandb", "tensorboard"])
def test_a_backend_whose_package_is_missing_is_one_line_at_validation(backend, monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setitem(sys.modules, backend, None)  # Python's mark of a module that cannot be imported
    assert main(["validate", "configs/quickstart.yaml", f"tracking.backends=[console,{backend}]"]) == EXIT_BAD_SPEC
    assert capsys.readouterr().err.splitlines()[-1:] == [
        f"tracking.backends=[console, {backend}]: the {backend} backend needs the {backend} package, which is not "
        f"installed: pip install 'rlmegatron[{backend}]', or drop {backend}"]


def test_wandb_without_an_account_outside_offline_mode_is_one_line(tmp_path, monkeypatch):
    import wandb

    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a W&B key
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    # W&B keeps the settings the first run of a process read (here WANDB_MODE=offline, from the tests before);
    # torn down before and after, it reads this environment, and the next test's again.
    wandb.teardown()
    try:
        tracker = Tracker.from_spec(job_spec(tmp_path, ["wandb"]))
        with pytest.raises(UserError) as stopped:
            tracker.start(0)
        tracker.finish("FAILED")
    finally:
        wandb.teardown()
    assert str(stopped.value) == (
        "tracking.backends: wandb: No API key configured. Use `wandb login` to log in. Or log offline, without an "
        f"account: WANDB_MODE=offline keeps the run in {tmp_path / 'wandb'} for `wandb sync`")
