"""`rlm train` disaggregated with a pool that goes 1 -> 3 -> 2 engines mid-run (`rlm pool add 2`, then `remove 1`,
asked while it trains): every step keeps all its samples, every engine holds the trained weights bit for bit at every
step it serves (delta sync with trainer.check_sync_every=1: a joined engine's first push is whole), and in
trainer.mode=async the staleness bound holds across the changes (the loop refuses a sample past it)."""
import re
import subprocess

import pytest

from rlmegatron.driver.pool_control import request
from tests.driver.test_train import QUICKSTART, REPO_ROOT, RLM
from tests.helpers import warm_runs

STEPS = 10
SAMPLES = 128  # the quickstart's 16 prompts x 8 responses
COMMON = ("placement.mode=disaggregate", "placement.rollout_nnodes=1", "placement.rollout_gpus_per_node=1",
          "placement.gpus_per_node=1", "trainer.val_before_train=false", "trainer.test_freq=-1", "~data.val_files",
          "trainer.save_freq=-1", "trainer.log_freq=1", "tracking.backends=[console]")


def _values(stdout: str, metric: str) -> list[float]:
    return [float(value) for value in re.findall(rf"{re.escape(metric)}\s+([-\d.e]+)", stdout)]


def _train_resizing(tmp_path, add: int, remove: int, *overrides: str, env=None) -> tuple[int, str, list[int]]:
    """`rlm train` of the quickstart starting with one engine: once step 2's table is out `rlm pool add ADD` is
    asked while it trains, and once a table shows 1 + ADD engines `rlm pool remove REMOVE`. Returns the exit code,
    stdout and stderr, and the pool's size per step."""
    run_dir = tmp_path / "run"
    with open(tmp_path / "stderr", "w") as errors:
        process = warm_runs.popen([RLM, "train", QUICKSTART, f"trainer.run_dir={run_dir}", *COMMON, *overrides],
                                  cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=errors)
        lines, seen, asked = [], [], set()
        try:
            for line in process.stdout:
                lines.append(line)
                seen += [int(float(count)) for count in re.findall(r"pool/engines\s+([\d.]+)", line)]
                if len(seen) == 2 and "add" not in asked:
                    request(str(run_dir), "add", add)
                    asked.add("add")
                if seen and seen[-1] == 1 + add and "remove" not in asked:
                    request(str(run_dir), "remove", remove)
                    asked.add("remove")
            code = process.wait(timeout=300)
        finally:
            if process.poll() is None:
                process.kill()
    return code, "".join(lines) + (tmp_path / "stderr").read_text(), seen


def _changes(sizes: list[int]) -> list[int]:
    return [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_engines_join_and_leave_a_running_job_and_no_sample_is_lost(tmp_path, mode):
    code, output, engines = _train_resizing(
        tmp_path, 2, 1, f"trainer.total_steps={STEPS}", f"trainer.mode={mode}", "placement.rollout_max_engines=3",
        "rollout.weight_sync=delta", "trainer.check_sync_every=1")
    assert code == 0, output[-3000:]
    assert len(engines) == STEPS and _changes(engines) == [1, 3, 2], engines
    assert _values(output, "rollout/samples") == [SAMPLES] * STEPS
    assert re.search(r"rollout pool: rlm pool add: engine\(s\) \[1, 2\] joined with the weights of step_\d+; 3 "
                     r"engines", output)
    assert "rollout pool: rlm pool remove: engine(s) [2] left after their samples; 2 engines" in output
    if mode == "async":
        assert max(_values(output, "training/staleness/max")) <= 2  # trainer.max_staleness's default


def test_behind_a_router_an_engine_joins_it_after_its_weights_and_leaves_it_before_it_stops(tmp_path):
    """SGLang (the loopback stand-in) behind sglang_router's stand-in, 1 -> 2 -> 1 engines: the joined server is a
    worker of the router only once it holds the trained weights, and the leaving one stops being one before it
    stops; the other stays a worker throughout."""
    import json

    from tests.driver.test_train import with_fake_sglang

    sglang, env = with_fake_sglang(tmp_path, "elastic")
    router = ["rollout.sglang.router=true", f"rollout.sglang.router_args.fake-record={tmp_path / 'router.jsonl'}"]
    code, output, seen = _train_resizing(tmp_path, 1, 1, "trainer.total_steps=10", "placement.rollout_max_engines=2",
                                         *sglang, *router, env=env)
    assert code == 0, output[-3000:]
    assert _changes(seen) == [1, 2, 1], seen
    routed = [json.loads(line) for line in (tmp_path / "router.jsonl").read_text().splitlines()]
    changes = [(r["path"], r["url"]) for r in routed if r["path"] in ("add", "remove")]
    first, joined = changes[0][1], changes[1][1]
    # ... and the first leaves the router as the run stops.
    assert changes == [("add", first), ("add", joined), ("remove", joined), ("remove", first)] and first != joined
    assert any(r["path"] == "generate" and r["worker"] == joined for r in routed)
    # The joined server (the second to start) had its weights before it generated anything.
    calls = [json.loads(line) for line in (tmp_path / "elastic.calls").read_text().splitlines()]
    second = list(dict.fromkeys(r["pid"] for r in calls))[1]
    paths = [r["path"] for r in calls if r["pid"] == second]
    assert paths.index("/init_weights_update_group") < paths.index("/update_weights_from_distributed") \
        < paths.index("/generate")
