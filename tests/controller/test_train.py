"""`rlm train` end to end on CPU: spec rejection before Ray, the Ray loop on 2 ranks, resume, the rank class without Ray."""
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlmegatron.cli import EXIT_BAD_SPEC, main

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = "configs/quickstart.yaml"
# Tiny steps: 4 prompts x 4 samples, validation on step 2, a checkpoint every 2 steps.
SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=4", "trainer.test_freq=2",
         "trainer.save_freq=2", "trainer.max_ckpt_to_keep=null", "tracking.backends=[console,mlflow]",
         "reward.function=tests/controller/parity_reward.py:compute_score"]
NOT_REPRODUCIBLE = ("timing_s/", "perf/")
CONSOLE_ONLY = "tracking.backends=[console]"


FAKE_SGLANG = REPO_ROOT / "tests" / "rollout" / "fake_sglang"
RLM = str(Path(sys.executable).parent / "rlm")


def train(tmp: Path, name: str, use_ray: str, *overrides: str, env: dict | None = None) -> dict:
    out = tmp / f"{name}.json"
    run = subprocess.run([sys.executable, "-m", "tests.controller.jobs", str(out), use_ray, *SMALL, *overrides],
                         cwd=REPO_ROOT, timeout=300, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return {**json.loads(out.read_text()), "stderr": run.stderr}


def with_fake_sglang(tmp: Path, name: str, die_after_generates: int = 0) -> tuple[list[str], dict]:
    """Overrides and environment that put the loopback SGLang server (tests/rollout/fake_sglang) behind the loop;
    every process of the run carries RLM_TEST_RUN=name in its environment, so survivors can be found."""
    overrides = ["rollout.engine=sglang", f"rollout.sglang.python={sys.executable}",
                 "rollout.sglang.startup_timeout_s=60", f"rollout.sglang.extra_args.fake-record={tmp / name}.calls",
                 f"rollout.sglang.extra_args.fake-marker={tmp / name}.died",
                 f"rollout.sglang.extra_args.fake-die-after-generates={die_after_generates}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)]), "RLM_TEST_RUN": name}
    return overrides, env


def processes_of_run(name: str) -> list[str]:
    """Live processes whose environment carries RLM_TEST_RUN=name, as 'pid cmdline'."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"RLM_TEST_RUN={name}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{proc.name} {command}")
        except OSError:
            pass
    return found


def at_step(history: dict, step: int) -> dict[str, float]:
    return {k: v for k, points in history.items() for s, v in points if s == step and not k.startswith(NOT_REPRODUCIBLE)}


def test_bad_config_is_rejected_before_ray_starts(monkeypatch, capsys):
    from rlmegatron.controller import job

    monkeypatch.chdir(REPO_ROOT)
    started = []
    monkeypatch.setattr(job, "start_ray", lambda spec: started.append(spec))
    monkeypatch.setattr(job, "run_training", lambda spec, use_ray=True: started.append(spec))
    assert main(["train", QUICKSTART, "rollout.n=0"]) == EXIT_BAD_SPEC
    assert "rollout.n=0" in capsys.readouterr().err
    assert started == []
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


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
    once step 4's checkpoint is in. Then a run resumed from its step-2 checkpoint to step 3, behind a router."""
    tmp = tmp_path_factory.mktemp("ray")
    sglang, env = with_fake_sglang(tmp, "killed", die_after_generates=3)
    with open(tmp / "killed.stderr", "w") as stderr:  # a file, not a pipe nobody reads while it runs
        killed = subprocess.Popen([RLM, "train", QUICKSTART, *SMALL, "trainer.total_steps=10", *sglang,
                                   f"trainer.run_dir={tmp / 'killed'}", "trainer.resume=disable"],
                                  cwd=REPO_ROOT, env=env, stderr=stderr, text=True)
        latest = tmp / "killed" / "checkpoints" / "latest"
        deadline = time.monotonic() + 240
        while not (latest.is_file() and latest.read_text() == "step_4") and killed.poll() is None:
            assert time.monotonic() < deadline, "no step_4 checkpoint within 240 s"
            time.sleep(0.2)
        killed.send_signal(signal.SIGTERM)
        killed.wait(timeout=120)
    first = {"history": mlflow_history(tmp / "killed" / "mlflow.db"), "stderr": (tmp / "killed.stderr").read_text()}
    sglang, env = with_fake_sglang(tmp, "resumed")
    # Behind a router, which may send any request to either server: the samples must not change.
    router = ["rollout.sglang.router=true", f"rollout.sglang.router_args.fake-record={tmp / 'resumed.router'}"]
    resumed = train(tmp, "resumed", "ray", "trainer.total_steps=3", f"trainer.run_dir={tmp / 'resumed'}",
                    f"trainer.resume={tmp / 'killed' / 'checkpoints' / 'step_2'}", *sglang, *router, CONSOLE_ONLY,
                    env=env)
    return tmp, first, resumed, killed.returncode


def test_the_loop_logs_finite_verl_metrics_on_two_ray_ranks(ray_run):
    tmp, first, resumed, _ = ray_run
    history = first["history"]
    assert [s for s, _ in history["critic/score/mean"]][:4] == [1, 2, 3, 4]
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/advantages/mean", "response_length/mean",
                 "response_length/clip_ratio", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights",
                 "timing_s/step", "perf/throughput", "val/echo/score/mean"):
        assert name in history, name
        assert all(math.isfinite(v) for _, v in history[name]), name
    # Progress bars, fed from the ranks through Ray: 16 samples per step, one optimizer step per update.
    full = "[" + "#" * 30 + "]"
    steps = len(history["critic/score/mean"])
    assert first["stderr"].count(f"rollout        {full} 16/16") >= steps  # a step in flight may add one
    assert first["stderr"].count(f"update_actor   {full} 1/1") >= steps
    assert (tmp / "resumed" / "checkpoints" / "latest").read_text() == "step_3"
    exported = Path(resumed["exported_hf"])
    assert (exported / "model.safetensors.index.json").is_file() and (exported / "config.json").is_file()


def test_resume_gives_the_same_next_step_metrics(ray_run):
    tmp, first, resumed, _ = ray_run
    routed = [json.loads(line) for line in (tmp / "resumed.router").read_text().splitlines()]
    assert [r["path"] for r in routed].count("add") == 2  # both colocated servers, once they had the weights
    assert len({r["worker"] for r in routed if r["path"] == "generate"}) == 2
    assert [s for s, _ in resumed["history"]["critic/score/mean"]] == [3]
    expected, got = at_step(first["history"], 3), at_step(resumed["history"], 3)
    assert expected["actor/grad_norm"] > 0  # the step did train: equal metrics are not trivially equal
    assert expected.keys() == got.keys()
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_sigterm_stops_every_rank_and_engine_server_and_keeps_the_last_checkpoint(ray_run):
    tmp, first, _, code = ray_run
    stderr = first["stderr"]
    assert code != 0 and "interrupted" in stderr, stderr[-2000:]
    assert f"last complete checkpoint: {tmp / 'killed' / 'checkpoints' / 'step_4'}" in stderr
    deadline = time.monotonic() + 30  # Ray's own daemons take a moment to go
    while processes_of_run("killed") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_of_run("killed") == []
    # Step 2's checkpoint is what the resumed run (above) started from; only step 3 ran there.


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
    assert set(paths[resume_weights + 1 : resume_cache]) == {"/update_weights_from_tensor", "/flush_cache"}
    assert replacement[resume_cache]["tags"] == ["kv_cache", "cuda_graph"]


def test_the_policy_rank_runs_in_process_without_ray(tmp_path):
    result = train(tmp_path, "local", "local", "trainer.total_steps=2", "placement.gpus_per_node=1",
                   f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_freq=-1", "tracking.backends=[console]")
    assert [s for s, _ in result["history"]["actor/pg_loss"]] == [1, 2]
    assert not result["ray_imported"]
    assert (Path(result["exported_hf"]) / "model.safetensors.index.json").is_file()


def test_dapo_runs_in_process(tmp_path):
    result = train(tmp_path, "dapo", "local", "trainer.total_steps=2", "placement.gpus_per_node=1",
                   f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_freq=2", "tracking.backends=[console]",
                   "algorithm.dynamic_sampling.enable=true", "algorithm.dynamic_sampling.max_num_gen_batches=3",
                   "reward.manager=dapo", "actor.clip_ratio_high=0.28", "actor.use_kl_loss=true")
    history = result["history"]
    assert [s for s, _ in history["actor/pg_loss"]] == [1, 2]
    assert "training/num_gen_batches" in history and "actor/kl_loss" in history


def test_ppo_with_critic_trains_the_same_with_every_role_offloaded_between_phases(tmp_path):
    ppo = ["trainer.total_steps=2", "placement.gpus_per_node=1", "trainer.save_freq=2", "trainer.test_freq=-1",
           "data.val_files=[]", "tracking.backends=[console]", "algorithm.adv_estimator=gae",
           "critic.ppo_mini_batch_size=4",
           "critic.ppo_micro_batch_size_per_gpu=8", "critic.optim.lr=1e-3", "actor.use_kl_loss=true"]
    offload = ["actor.offload.params=true", "actor.offload.grads=true", "actor.offload.optimizer=true",
               "ref.offload.params=true", "critic.offload.params=true", "critic.offload.grads=true",
               "critic.offload.optimizer=true"]
    resident = train(tmp_path, "resident", "local", *ppo, f"trainer.run_dir={tmp_path / 'resident'}")
    offloaded = train(tmp_path, "offloaded", "local", *ppo, *offload, f"trainer.run_dir={tmp_path / 'offloaded'}")
    history = resident["history"]
    assert all(math.isfinite(v) for _, v in history["critic/vf_loss"] + history["critic/values/mean"])
    assert history["actor/grad_norm"][-1][1] > 0 and "actor/kl_loss" in history
    assert [lr for _, lr in history["critic/lr"]] == [1e-3, 1e-3]  # critic.optim.lr, not its 1e-5 default
    # Offloading frees every storage and restores it bit for bit, so the run is the same run.
    assert at_step(offloaded["history"], 2) == at_step(history, 2)



def test_a_nan_loss_stops_the_step_keeps_the_last_checkpoint_and_says_why(tmp_path):
    # Step 1 (16 samples) scores normally and is saved; step 2's rewards are NaN, and so are its advantages.
    (tmp_path / "calls").mkdir()
    env = {**os.environ, "RLM_NAN_REWARD_DIR": str(tmp_path / "calls"), "RLM_NAN_AFTER": "16"}
    run = subprocess.run([sys.executable, "-m", "tests.controller.jobs", str(tmp_path / "out.json"), "local", *SMALL,
                          "trainer.total_steps=3", "placement.gpus_per_node=1", f"trainer.run_dir={tmp_path / 'run'}",
                          "trainer.save_freq=1", "trainer.test_freq=-1", "data.val_files=[]",
                          "tracking.backends=[console]",
                          "reward.function=tests/controller/nan_reward.py:compute_score"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (f"TrainingStopped: step 2: actor/pg_loss=nan: stopped before the optimizer step; the weights are "
            f"unchanged. No checkpoint is written for this step; the last complete one is {checkpoints / 'step_1'}"
            in run.stderr), run.stderr[-3000:]
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
