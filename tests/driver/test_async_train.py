"""trainer.mode=async end to end on CPU, without Ray: the local engine in its own process (placement.mode=disaggregate),
rollouts generated ahead of the trainer within trainer.max_staleness, weights pushed mid-generation (partial rollout),
the stale samples corrected by rollout importance weights; an engine that dies while it generates ahead, and SIGTERM,
handled as in sync mode."""
import json
import math
import signal
import subprocess
import sys
import time

import pytest

from tests.driver.test_train import QUICKSTART, REPO_ROOT, SMALL, processes_of_run, train, with_fake_sglang
from tests.helpers.checkpoints import wait_for_checkpoint
from tests.helpers import warm_runs

ASYNC = ["trainer.total_steps=4", "placement.gpus_per_node=1", "placement.mode=disaggregate",
         "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1", "trainer.save_freq=-1",
         "trainer.test_freq=-1", "data.val_files=[]", "tracking.backends=[console]", "trainer.mode=async",
         "trainer.max_staleness=2", "trainer.partial_rollout=true", "algorithm.rollout_correction.rollout_is=token"]


def test_async_trains_within_its_staleness_bound_and_logs_it(tmp_path):
    result = train(tmp_path, "async", "local", *ASYNC, f"trainer.run_dir={tmp_path / 'run'}")
    history = result["history"]
    lags = [value for _, value in history["training/staleness/max"]]
    assert [step for step, _ in history["training/staleness/mean"]] == [1, 2, 3, 4]
    assert lags[0] == 0 and max(lags) <= 2 and max(lags) >= 1  # the engines really ran ahead
    assert all(mean <= lag for (_, mean), lag in zip(history["training/staleness/mean"], lags))
    # Older samples carry importance weights: the trainer's recomputed policy differs from the one that sampled.
    assert all(math.isfinite(v) for _, v in history["rollout_corr/is_weight_mean"])
    assert all(math.isfinite(v) for _, v in history["actor/pg_loss"])
    assert len(history["timing_s/wait_rollout"]) == 4


def test_an_engine_that_dies_while_generating_ahead_is_restarted_and_synced_and_sigterm_stops_cleanly(tmp_path):
    """The loopback SGLang server dies on its 20th request: early in step 2's rollout, made ahead while step 1
    trains and then pushes its weights (which must leave the dead server out, not crash or hang on it). SIGTERM
    once step 3's checkpoint is in: the run stops within seconds with the CLI's one line, keeps its checkpoints,
    and leaves no process behind. In async mode only: one_step_off makes its rollouts ahead by the same code
    (rollout_buffer.Ahead), with a bound of 1 instead of trainer.max_staleness."""
    mode = "async"
    name = f"faults_{mode}"
    sglang, env = with_fake_sglang(tmp_path, name, die_after_generates=20)
    settings = [a for a in ASYNC if not a.startswith(("trainer.mode", "trainer.total_steps", "trainer.save_freq"))]
    run_dir = tmp_path / "run"
    with open(tmp_path / "stderr", "w") as stderr:
        run = warm_runs.popen([sys.executable, "-m", "tests.driver.cli_in_process", QUICKSTART, *SMALL, *settings,
                                f"trainer.mode={mode}", "trainer.total_steps=20", "trainer.save_freq=1",
                                "rollout.sglang.extra_args.fake-token-delay=0.01", f"trainer.run_dir={run_dir}",
                                *sglang], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        latest = wait_for_checkpoint(run, run_dir, 3, timeout_s=180)
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
    errors = (tmp_path / "stderr").read_text()
    assert run.returncode == 128 + signal.SIGTERM and "Traceback" not in errors, errors[-3000:]
    kept = latest.read_text()
    assert errors.rstrip().splitlines()[-1] == ("interrupted; workers and engines stopped; last complete checkpoint: "
                                                f"{run_dir / 'checkpoints' / kept}")
    assert {f"step_{k}" for k in (1, 2, 3)} <= {p.name for p in (run_dir / "checkpoints").iterdir()}
    deadline = time.monotonic() + 30
    while processes_of_run(name) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_of_run(name) == []

    # The server died once; its replacement joined a new weight-update group and got the weights before it served.
    records = [json.loads(line) for line in (tmp_path / f"{name}.calls").read_text().splitlines()]
    servers = list(dict.fromkeys(r["pid"] for r in records))
    assert len(servers) == 2
    first, second = ([r["path"] for r in records if r["pid"] == pid] for pid in servers)
    assert first.count("/generate") < 20  # it died on its 20th
    assert second.index("/init_weights_update_group") < second.index("/update_weights_from_distributed") \
        < second.index("/generate")
