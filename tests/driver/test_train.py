"""`rlm train` end to end on CPU: spec rejection before Ray, the Ray loop on 2 ranks, resume, the rank class without Ray."""
import json
import math
import os
import re
import signal
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from rlmegatron.entry.cli import EXIT_BAD_SPEC, main
from tests.helpers import warm_runs
from tests.helpers.checkpoints import wait_for_checkpoint
from tests.helpers.remote_code import write_remote_code_model
from tests.helpers.tracking_readers import (plotted, tensorboard_events, tensorboard_history, wandb_history,
                                           wandb_runs)

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = "configs/quickstart.yaml"
# Tiny steps: 4 prompts x 4 samples, validation on step 2 (none before training), a checkpoint every 2 steps.
SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=4", "trainer.test_freq=2",
         "trainer.val_before_train=false", "trainer.save_freq=2", "trainer.max_ckpt_to_keep=null",
         "tracking.backends=[console,mlflow]", "reward.function=tests/driver/parity_reward.py:compute_score"]
NOT_REPRODUCIBLE = ("timing_s/", "perf/")
EVERY_TRACKER = "tracking.backends=[console,mlflow,wandb,tensorboard]"


FAKE_SGLANG = REPO_ROOT / "tests" / "rollout" / "fake_sglang"
RLM = str(Path(sys.executable).parent / "rlm")


def train(tmp: Path, name: str, where: str, *overrides: str, env: dict | None = None) -> dict:
    """`where`: launched (as placement.transport says) or local (the one rank in the job's process)."""
    out = tmp / f"{name}.json"
    run = warm_runs.run([sys.executable, "-m", "tests.driver.jobs", str(out), where, *SMALL, *overrides],
                         cwd=REPO_ROOT, timeout=300, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return {**json.loads(out.read_text()), "stdout": run.stdout, "stderr": run.stderr}


def with_fake_sglang(tmp: Path, name: str, die_after_generates: int = 0) -> tuple[list[str], dict]:
    """Overrides and environment that put the loopback SGLang server (tests/rollout/fake_sglang) behind the loop;
    every process of the run carries RLM_TEST_RUN=name-PID (this pytest's pid: another session may run the same
    tests on the machine) in its environment, so survivors can be found (processes_of_run)."""
    # Seeded samples (SGLang honours seeds in deterministic-inference mode only): a resumed run samples again what the
    # killed one did, and a group's samples differ, so its advantages do.
    overrides = ["rollout.engine=sglang", f"rollout.sglang.python={sys.executable}",
                 "rollout.sglang.extra_args.enable-deterministic-inference=true",
                 "rollout.sglang.startup_timeout_s=60", f"rollout.sglang.extra_args.fake-record={tmp / name}.calls",
                 f"rollout.sglang.extra_args.fake-marker={tmp / name}.died",
                 f"rollout.sglang.extra_args.fake-die-after-generates={die_after_generates}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)]),
           "RLM_TEST_RUN": f"{name}-{os.getpid()}"}
    return overrides, env


def processes_of_run(name: str) -> list[str]:
    """Live processes whose environment carries this session's RLM_TEST_RUN for `name`, as 'pid cmdline'."""
    found = []
    mark = f"RLM_TEST_RUN={name}-{os.getpid()}".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark in (proc / "environ").read_bytes().split(b"\0"):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{proc.name} {command}")
        except OSError:
            pass
    return found


def at_step(history: dict, step: int) -> dict[str, float]:
    return {k: v for k, points in history.items() for s, v in points if s == step and not k.startswith(NOT_REPRODUCIBLE)}


def test_bad_config_is_rejected_before_ray_starts(monkeypatch, capsys):
    from rlmegatron.driver import job

    monkeypatch.chdir(REPO_ROOT)
    started = []
    monkeypatch.setattr(job, "start_ray", lambda spec: started.append(spec))
    monkeypatch.setattr(job, "run_training", lambda checked: started.append(checked))
    assert main(["train", QUICKSTART, "rollout.n=0"]) == EXIT_BAD_SPEC
    assert "rollout.n=0" in capsys.readouterr().err
    assert started == []
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_a_warmup_longer_than_the_epochs_is_rejected_before_any_worker_starts(monkeypatch, capsys):
    from rlmegatron.driver import job

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(job, "start_ray", lambda spec: pytest.fail("Ray started"))
    monkeypatch.setattr(job, "RankProcesses", lambda *args: pytest.fail("rank processes started"))
    assert main(["train", QUICKSTART, "trainer.total_steps=null", "actor.optim.lr_warmup_steps=100000"]) == EXIT_BAD_SPEC
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"command line: actor\.optim\.lr_warmup_steps=100000: must be below the run's (\d+) steps "
                        r"\(trainer\.total_epochs=1 x \1 batches of data\.train_files\); lower it", err), err


def mlflow_history(db: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric a run logged to its MLflow store, as the tracker's history: name -> [(step, value)]."""
    with sqlite3.connect(db) as store:
        rows = store.execute("SELECT key, step, value FROM metrics ORDER BY step").fetchall()
    history: dict[str, list[tuple[int, float]]] = {}
    for key, step, value in rows:
        history.setdefault(key, []).append((step, value))
    return history


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory):
    """`rlm train` on 2 Ray ranks, each leading a (loopback) SGLang engine, one of which dies in step 1; SIGTERM
    once step 4's checkpoint is in. Then step 4's shards are damaged in place (their sizes intact), and the run is
    resumed in the same run_dir (trainer.resume=auto) to step 5 behind a router: it falls back to step 2. The resumed
    run's ranks are rank processes (placement.transport=processes): what Ray ranks saved, they load and continue
    exactly, and the suite starts one Ray cluster fewer (each costs tens of CPU-seconds)."""
    tmp = tmp_path_factory.mktemp("ray")
    sglang, env = with_fake_sglang(tmp, "killed", die_after_generates=3)
    with open(tmp / "killed.stderr", "w") as stderr:  # a file, not a pipe nobody reads while it runs
        # --verbose: the progress bars' lines, checked below, show in the log.
        killed = warm_runs.popen([RLM, "train", "--verbose", QUICKSTART, *SMALL, "trainer.total_steps=10", *sglang,
                                   "placement.transport=ray",
                                   f"trainer.run_dir={tmp / 'killed'}", "trainer.resume=disable", EVERY_TRACKER],
                                  cwd=REPO_ROOT, env=env, stderr=stderr)
        wait_for_checkpoint(killed, tmp / "killed", 4, timeout_s=600)  # a bound on a hang, not a speed test
        killed.send_signal(signal.SIGTERM)
        killed.wait(timeout=120)
    first = {"history": mlflow_history(tmp / "killed" / "mlflow.db"), "stderr": (tmp / "killed.stderr").read_text()}
    for shard in (tmp / "killed" / "checkpoints" / "step_4" / "actor").glob("*.distcp"):
        damage_tail(shard)
    sglang, env = with_fake_sglang(tmp, "resumed")
    # Behind a router, which may send any request to either server: the samples must not change.
    router = ["rollout.sglang.router=true", f"rollout.sglang.router_args.fake-record={tmp / 'resumed.router'}"]
    resumed = train(tmp, "resumed", "launched", "placement.transport=processes", "trainer.total_steps=5", f"trainer.run_dir={tmp / 'killed'}",
                    "trainer.resume=auto", *sglang, *router, EVERY_TRACKER, env=env)
    return tmp, first, resumed, killed.returncode


def damage_tail(file: Path) -> None:
    """Zero the last eighth of a file in place: its size (all a manifest checks) stays right, its content does not."""
    size = file.stat().st_size
    with open(file, "r+b") as handle:
        handle.seek(size - size // 8)
        handle.write(b"\0" * (size // 8))


def test_the_loop_logs_finite_verl_metrics_on_two_ray_ranks(ray_run):
    tmp, first, resumed, _ = ray_run
    history = first["history"]
    assert [s for s, _ in history["critic/score/mean"]][:4] == [1, 2, 3, 4]
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/advantages/mean", "response_length/mean",
                 "response_length/clip_ratio", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights",
                 "timing_s/step", "perf/throughput", "val/next_digit/score/mean"):
        assert name in history, name
        assert all(math.isfinite(v) for _, v in history[name]), name
    # Progress bars, fed from the ranks through Ray: 16 samples per step, one optimizer step per update.
    full = "[" + "#" * 30 + "]"
    steps = len(history["critic/score/mean"])
    assert first["stderr"].count(f"rollout        {full} 16/16") >= steps  # a step in flight may add one
    assert first["stderr"].count(f"update_actor   {full} 1/1") >= steps
    assert (tmp / "killed" / "checkpoints" / "latest").read_text() == "step_5"
    exported = Path(resumed["exported_hf"])
    assert (exported / "model.safetensors.index.json").is_file() and (exported / "config.json").is_file()


def test_resume_gives_the_same_next_step_metrics(ray_run):
    tmp, first, resumed, _ = ray_run
    routed = [json.loads(line) for line in (tmp / "resumed.router").read_text().splitlines()]
    assert [r["path"] for r in routed].count("add") == 2  # both colocated servers, once they had the weights
    assert len({r["worker"] for r in routed if r["path"] == "generate"}) == 2
    assert [s for s, _ in resumed["history"]["critic/score/mean"]] == [3, 4, 5]
    expected, got = at_step(first["history"], 3), at_step(resumed["history"], 3)
    assert expected["actor/grad_norm"] > 0  # the step did train: equal metrics are not trivially equal
    assert expected.keys() == got.keys()
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_checkpoint_that_does_not_load_is_named_and_the_ranks_fall_back_to_the_one_before(ray_run):
    """Step 4's manifest is intact, so its load is tried; it fails in both ranks midway, and the step-3 metrics
    (test above) equal the uninterrupted run's: the ranks reloaded step 2 whole."""
    tmp, _, resumed, _ = ray_run
    checkpoints = tmp / "killed" / "checkpoints"
    lines = resumed["stderr"].splitlines()
    failed = [line for line in lines if line.startswith(f"checkpoint {checkpoints / 'step_4'}: does not load: ")]
    assert len(failed) == 1 and "Traceback" not in resumed["stderr"]
    assert re.search(r"does not load: actor/__\d_\d\.distcp: \w+Error: .+; falling back to the one before it$",
                     failed[0]), failed[0]
    assert f"checkpoint {checkpoints / 'step_4'} renamed to step_4.invalid" in lines
    assert f"resumed from {checkpoints / 'step_2'} at step 2" in resumed["stdout"]
    # Kept, out of the way of the step this run wrote again (trainer.save_freq=2); nothing complete was overwritten.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_2", "step_4", "step_4.invalid",
                                                             "step_5"]


def test_after_the_resume_mlflow_shows_each_step_once(ray_run):
    """The killed run logged steps 3 and 4 (maybe 5) after the step-2 checkpoint; the resumed run logged 3-5."""
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    from rlmegatron.tracking.mlflow_run import SUPERSEDED_BY_TAG, SUPERSEDES_TAG

    tmp, first, resumed, _ = ray_run
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'killed' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rlmegatron").experiment_id
    [run] = client.search_runs([experiment])  # the active runs: what a user sees
    [superseded] = client.search_runs([experiment], run_view_type=ViewType.DELETED_ONLY)
    assert run.data.tags[SUPERSEDES_TAG] == superseded.info.run_id
    assert superseded.data.tags[SUPERSEDED_BY_TAG] == run.info.run_id
    assert [s for s, _ in first["history"]["critic/score/mean"]][:4] == [1, 2, 3, 4]
    for key in first["history"]:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert steps == sorted(set(steps)) and set(steps) <= {0, 1, 2, 3, 4, 5}, key
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
               for key in ("critic/score/mean", "actor/grad_norm")}
    for key, points in history.items():
        # Steps 1-2 as the killed run logged them, steps 3-5 as the resumed run did.
        assert points == [p for p in first["history"][key] if p[0] <= 2] + [tuple(p) for p in resumed["history"][key]]
    assert f"mlflow: run {superseded.info.run_id} logged" in resumed["stderr"]


def test_after_the_resume_wandb_continues_its_run_and_tensorboard_shows_each_step_once(ray_run):
    """The killed run's W&B run (offline) is continued by the resumed one, under its id; TensorBoard shows steps 1-2
    as the killed run logged them and 3-5 as the resumed run did, as MLflow does."""
    tmp, first, resumed, _ = ray_run
    run_dir = tmp / "killed"
    killed_records, resumed_records = wandb_runs(run_dir)
    [killed_run], [resumed_run] = ([r["run"] for r in records if r["type"] == "run"]
                                   for records in (killed_records, resumed_records))
    assert resumed_run["run_id"] == killed_run["run_id"] and resumed_run.get("resume") is True
    killed, ours = wandb_history(killed_records), wandb_history(resumed_records)
    assert ours == {key: [tuple(point) for point in points] for key, points in resumed["history"].items()}
    assert killed == {key: [tuple(point) for point in points] for key, points in first["history"].items()}
    expected = {key: [tuple(p) for p in first["history"].get(key, []) if p[0] <= 2]
                + [tuple(p) for p in resumed["history"].get(key, [])]
                for key in first["history"].keys() | resumed["history"].keys()}
    events = {key: points for key, points in tensorboard_history(tensorboard_events(run_dir)).items() if points}
    assert events.keys() == {key for key, points in expected.items() if points}
    for key, points in events.items():
        expected_points = expected[key]
        assert [step for step, _ in points] == [step for step, _ in expected_points], key
        assert [value for _, value in points] == pytest.approx([value for _, value in expected_points], rel=1e-6), key


def test_the_finished_run_draws_the_curves_of_every_attempt_and_report_redraws_them(ray_run, capsys):
    """The resumed run's curves.png shows steps 1-5 as its MLflow run holds them: 1-2 from the killed attempt, 3-5
    its own; `rlm report` draws the same from the store."""
    from mlflow.tracking import MlflowClient

    tmp, _, resumed, _ = ray_run
    run_dir = tmp / "killed"
    path = run_dir / "curves.png"
    assert f"curves:     {path}" in resumed["stdout"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    drawn = plotted(path)
    assert {"critic/score/mean", "val/next_digit/score/mean", "actor/ppo_kl", "actor/entropy", "response_length/mean",
            "timing_s/step"} <= set(drawn)
    for key, points in drawn.items():
        assert points == sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)), key
    assert [step for step, _ in drawn["critic/score/mean"]] == [1, 2, 3, 4, 5]
    assert [step for step, _ in drawn["val/next_digit/score/mean"]] == [2, 4]

    path.unlink()
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out == f"curves: {path} (steps 1-5 of run quickstart, FINISHED)\n"
    assert plotted(path) == drawn


def test_the_summary_names_the_steps_the_resumed_run_trained(ray_run):
    stdout = ray_run[2]["stdout"]
    assert "trained steps 3-5 (3 steps, resumed from step 2) in " in stdout
    assert "critic/score/mean" in stdout and "steps 3-5" in stdout


def test_rerunning_a_finished_job_says_it_is_complete_and_changes_nothing(ray_run, monkeypatch, capsys):
    tmp = ray_run[0]
    run_dir = tmp / "killed"

    def contents() -> dict:  # but the run directory's lock, which names each run that enters it
        return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".rlm_run.lock"}

    before = contents()
    monkeypatch.chdir(REPO_ROOT)
    assert main(["train", QUICKSTART, *SMALL, "trainer.total_steps=5", f"trainer.run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert (f"already complete: {run_dir / 'checkpoints' / 'step_5'} is at step 5, and this job trains 5 steps; "
            "nothing to do. To train on, raise trainer.total_steps above 5; to start over, give a new "
            "trainer.run_dir") in out
    assert "trained" not in out
    assert contents() == before


def test_sigterm_stops_every_rank_and_engine_server_and_keeps_the_last_checkpoint(ray_run):
    tmp, first, _, code = ray_run
    stderr = first["stderr"]
    assert code != 0 and "interrupted" in stderr, stderr[-2000:]
    assert f"last complete checkpoint: {tmp / 'killed' / 'checkpoints' / 'step_4'}" in stderr
    deadline = time.monotonic() + 30  # Ray's own daemons take a moment to go
    while processes_of_run("killed") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_of_run("killed") == []
    # Step 2's checkpoint is what the resumed run (above) started from, step 4's having been damaged.


def test_an_engine_that_died_mid_step_was_restarted_resynced_and_the_step_completed(ray_run):
    """The uninterrupted run's metrics are finite and equal the resumed run's (tests above), so losing a server
    in step 1 cost no sample; here: the replacement got the weights before any request, then the colocated cycle."""
    records = [json.loads(line) for line in (ray_run[0] / "killed.calls").read_text().splitlines()]
    servers = list(dict.fromkeys(r["pid"] for r in records))
    assert len(servers) == 3  # two engines, one of them restarted
    replacement = [r for r in records if r["pid"] == servers[-1]]
    paths = [r["path"] for r in replacement]
    first_generate = paths.index("/generate")
    assert {"/update_weights_from_tensor", "/flush_cache"} <= set(paths[:first_generate])
    # Its engine's whole share of step 1 (2 prompts x 4 samples) is sent again, then memory is released for
    # training, and the wake-up brings weights back before the new weights, the KV cache after them.
    release = paths.index("/release_memory_occupation")
    assert paths[first_generate:release] == ["/generate"] * 8
    assert replacement[release]["tags"] == ["weights", "kv_cache", "cuda_graph"]
    resume_weights, resume_cache = [i for i, p in enumerate(paths) if p == "/resume_memory_occupation"][:2]
    assert resume_weights == release + 1 and replacement[resume_weights]["tags"] == ["weights"]
    assert set(paths[resume_weights + 1 : resume_cache]) == {"/begin_weight_update", "/update_weights_from_tensor",
                                                              "/end_weight_update", "/flush_cache"}
    assert replacement[resume_cache]["tags"] == ["kv_cache", "cuda_graph"]


def test_the_processes_transport_trains_on_two_rank_processes_without_ray(tmp_path):
    result = train(tmp_path, "processes", "launched", "placement.transport=processes", "trainer.total_steps=2",
                   f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_freq=-1",
                   "tracking.backends=[console,wandb,tensorboard]", "tracking.rollout_trace.backend=wandb")
    history = result["history"]
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean", "timing_s/update_actor"):
        assert [s for s, _ in history[name]] == [1, 2], name
        assert all(math.isfinite(v) for _, v in history[name]), name
    assert history["actor/entropy"][0][1] > 0  # two ranks really trained a policy that samples
    assert not result["ray_imported"]
    # Without an MLflow store, the curves are what the run logged.
    logged = {key: [tuple(point) for point in points] for key, points in history.items()}
    drawn = plotted(tmp_path / "run" / "curves.png")
    assert {"critic/score/mean", "val/next_digit/score/mean", "actor/entropy", "timing_s/step"} <= set(drawn)
    assert drawn == {key: logged[key] for key in drawn}
    # W&B (offline) and TensorBoard got every metric under its name: W&B exactly, TensorBoard as float32.
    [records] = wandb_runs(tmp_path / "run")
    assert wandb_history(records) == logged
    assert [r["history"]["step"]["num"] for r in records if r["type"] == "history"
            and "rollout_samples._type" in r["history"]["item"]] == [1, 2]  # the traced samples' tables
    events = tensorboard_history(tensorboard_events(tmp_path / "run"))
    assert events.keys() == logged.keys()
    for key, points in logged.items():
        assert [step for step, _ in events[key]] == [step for step, _ in points], key
        assert [value for _, value in events[key]] == pytest.approx([value for _, value in points], rel=1e-6), key
    # The progress bars, fed from the rank processes over their pipes: 16 samples and 1 optimizer step per step.
    full = "[" + "#" * 30 + "]"
    assert result["stderr"].count(f"rollout        {full} 16/16") == 2
    assert result["stderr"].count(f"update_actor   {full} 1/1") == 2


def test_the_policy_rank_runs_in_process_without_ray_on_a_model_with_its_own_code(tmp_path):
    # model.trust_remote_code: the tokenizer, config and rollout model are the directory's own classes (a tokenizer
    # transformers cannot load without them; tests/config shows `rlm validate` refusing it without the setting).
    # The schedule: a 1-step warm-up, then a linear decay that reaches min_lr at the run's last (second) step.
    model = write_remote_code_model(tmp_path / "model")
    env = {**os.environ, "RLM_REMOTE_CODE_MARKER": str(tmp_path / "built"), "HF_MODULES_CACHE": str(tmp_path / "hf")}
    schedule = ["actor.optim.lr=1e-3", "actor.optim.min_lr=1e-4", "actor.optim.lr_warmup_steps=1",
                "actor.optim.lr_decay_style=linear"]
    result = train(tmp_path, "local", "local", "trainer.total_steps=2", "placement.gpus_per_node=1",
                   f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_freq=-1", "tracking.backends=[console]",
                   f"model.path={model}", "model.trust_remote_code=true", *schedule, env=env)
    assert [s for s, _ in result["history"]["actor/pg_loss"]] == [1, 2]
    assert result["history"]["actor/lr"] == [[1, pytest.approx(1e-3)], [2, pytest.approx(1e-4)]]
    assert not result["ray_imported"]
    assert (Path(result["exported_hf"]) / "model.safetensors.index.json").is_file()
    assert set((tmp_path / "built").read_text().split()) == {"EchoConfig", "EchoTokenizer", "EchoForCausalLM"}


def test_dapo_runs_in_process(tmp_path):
    result = train(tmp_path, "dapo", "local", "trainer.total_steps=2", "placement.gpus_per_node=1",
                   f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_freq=2", "tracking.backends=[console]",
                   "algorithm.dynamic_sampling.enable=true", "algorithm.dynamic_sampling.max_num_gen_batches=3",
                   "reward.manager=dapo", "actor.clip_ratio_high=0.28", "actor.use_kl_loss=true")
    history = result["history"]
    assert [s for s, _ in history["actor/pg_loss"]] == [1, 2]
    assert "training/num_gen_batches" in history and "actor/kl_loss" in history


def test_ppo_with_critic_trains_the_same_with_every_role_offloaded_between_phases(tmp_path):
    # The critic warms up for 1 step, then decays (cosine) to min_lr at step 2, with the plain (per-rank) Adam.
    ppo = ["trainer.total_steps=2", "placement.gpus_per_node=1", "trainer.save_freq=2", "trainer.test_freq=-1",
           "data.val_files=[]", "tracking.backends=[console]", "algorithm.adv_estimator=gae",
           "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=8", "critic.optim.lr=1e-3",
           "actor.use_kl_loss=true", "critic.optim.lr_warmup_steps=1", "critic.optim.lr_decay_style=cosine",
           "critic.optim.min_lr=1e-4", "critic.megatron.use_distributed_optimizer=false"]
    offload = ["actor.offload.params=true", "actor.offload.grads=true", "actor.offload.optimizer=true",
               "ref.offload.params=true", "critic.offload.params=true", "critic.offload.grads=true",
               "critic.offload.optimizer=true"]
    resident = train(tmp_path, "resident", "local", *ppo, f"trainer.run_dir={tmp_path / 'resident'}")
    offloaded = train(tmp_path, "offloaded", "local", *ppo, *offload, f"trainer.run_dir={tmp_path / 'offloaded'}")
    history = resident["history"]
    assert all(math.isfinite(v) for _, v in history["critic/vf_loss"] + history["critic/values/mean"])
    assert history["actor/grad_norm"][-1][1] > 0 and "actor/kl_loss" in history
    assert history["critic/lr"] == [[1, pytest.approx(1e-3)], [2, pytest.approx(1e-4)]]
    # Offloading frees every storage and restores it bit for bit, so the run is the same run.
    assert at_step(offloaded["history"], 2) == at_step(history, 2)



@pytest.mark.parametrize("poisoned, plugin, calls_before_nan, expected", [
    # Step 1 (16 samples) scores normally and is saved; step 2's rewards are NaN: the run stops naming the reward
    # function, the first sample and the value, before any loss sees them.
    ("reward", "reward.function=tests/driver/nan_reward.py:compute_score", 16,
     r"reward function tests/driver/nan_reward.py:compute_score returned nan for sample next_digit#\d+/0 "
     r"\(and for 15 more of the batch's 16\); a reward must be a finite number"),
    # Finite rewards, and a loss that is NaN from step 2's first micro-batch (two micro-batches per step).
    ("loss", "actor.policy_loss.loss_mode=tests/driver/nan_loss.py:compute_policy_loss", 2,
     r"actor/pg_loss=nan: stopped before the optimizer step; the weights are unchanged"),
], ids=["reward", "loss"])
def test_a_nan_stops_the_step_keeps_the_last_checkpoint_and_says_why(tmp_path, poisoned, plugin, calls_before_nan,
                                                                     expected):
    (tmp_path / "calls").mkdir()
    env = {**os.environ, "RLM_NAN_REWARD_DIR": str(tmp_path / "calls"), "RLM_NAN_AFTER": str(calls_before_nan)}
    run = warm_runs.run([sys.executable, "-m", "tests.driver.jobs", str(tmp_path / "out.json"), "local", *SMALL,
                          "trainer.total_steps=3", "placement.gpus_per_node=1", f"trainer.run_dir={tmp_path / 'run'}",
                          "trainer.save_freq=1", "trainer.test_freq=-1", "data.val_files=[]",
                          "tracking.backends=[console]", plugin],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    checkpoints = tmp_path / "run" / "checkpoints"
    stopped = re.search(f"TrainingStopped: step 2: {expected}\\. No checkpoint is written for this step; the last "
                        "complete one is (.*)\n", run.stderr)
    assert stopped and stopped[1] == str(checkpoints / "step_1"), run.stderr[-3000:]
    assert poisoned == "loss" or "pg_loss" not in run.stderr  # a NaN reward is never blamed on the loss
    assert (checkpoints / "latest").read_text() == "step_1"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_1"]
    assert (checkpoints / "step_1" / "trainer_state.json").is_file()


def test_disaggregated_engine_behind_a_router_gets_weights_over_its_group_and_a_restarted_one_rejoins(tmp_path):
    sglang, env = with_fake_sglang(tmp_path, "disaggregated", die_after_generates=3)
    router = ["rollout.sglang.router=true", f"rollout.sglang.router_args.fake-record={tmp_path / 'router.jsonl'}"]
    result = train(tmp_path, "disaggregated", "local", "trainer.total_steps=2", "placement.gpus_per_node=1",
                   "placement.mode=disaggregate", "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1",
                   f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_freq=-1", "trainer.test_freq=-1",
                   "data.val_files=[]",
                   "tracking.backends=[console]", *sglang, *router, env=env)
    assert [s for s, _ in result["history"]["actor/pg_loss"]] == [1, 2]
    assert all(math.isfinite(v) for _, v in result["history"]["actor/grad_norm"])

    records = [json.loads(line) for line in (tmp_path / "disaggregated.calls").read_text().splitlines()]
    servers = list(dict.fromkeys(r["pid"] for r in records))
    assert len(servers) == 2  # the engine died once in step 1
    index = json.loads((Path(result["exported_hf"]) / "model.safetensors.index.json").read_text())
    for pid in servers:
        calls = [r for r in records if r["pid"] == pid]
        paths = [r["path"] for r in calls]
        # Weights only over the process group: joined first, then every HF tensor broadcast before a request.
        assert paths[0] == "/init_weights_update_group" and calls[0]["backend"] == "gloo"
        assert (calls[0]["rank_offset"], calls[0]["world_size"]) == (1, 2)
        first_generate = paths.index("/generate") if "/generate" in paths else len(paths)  # it may die first
        pushed = {name for r in calls[:first_generate] if r["path"] == "/update_weights_from_distributed"
                  for name in r["names"]}
        assert pushed == set(index["weight_map"])
        assert not {"/update_weights_from_tensor", "/release_memory_occupation"} & set(paths)
    # The replacement serves step 1 again in full (16 samples) and step 2 after its second push.
    paths = [r["path"] for r in records if r["pid"] == servers[1]]
    assert paths.count("/generate") == 32 and paths.count("/init_weights_update_group") == 1
    # Generation went through the router, which had the server only while it held trained weights.
    routed = [json.loads(line) for line in (tmp_path / "router.jsonl").read_text().splitlines()]
    assert [r["path"] for r in routed if r["path"] != "generate"] == ["add", "remove", "add", "remove"]
    # Every answer the router returned came from the replacement: the first server died with its replies in flight.
    assert sum(r["path"] == "generate" for r in routed) == 32
