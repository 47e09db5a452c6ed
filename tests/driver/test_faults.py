"""Faults of the machine and of a plug-in, on the fit rig (no Megatron) and in `run_training`'s cleanup: each stops
the run with one line naming the step and the last complete checkpoint, and every part of the run stops."""
import errno
import re
import textwrap

import psutil
import pytest

from rlmegatron.driver import job
from rlmegatron.transport.local_ranks import RankDied
from rlmegatron.driver.trainer import StoppedByMistake, TrainingStopped
from rlmegatron.errors import disk_full_in, user_error_in
from rlmegatron.rewards import NaiveRewardManager
from tests.driver.fit_rig import failing_on_second_call, run_rig

# Three steps, a checkpoint after each: a fault in step 2 has step 1's checkpoint behind it.
THREE_STEPS = ["trainer.total_steps=3", "trainer.save_freq=1"]


def ray_actor_died() -> BaseException:
    from ray.exceptions import RayActorError

    return RayActorError(error_msg="The actor died unexpectedly before finishing this task.")


@pytest.mark.parametrize("method", ["update_actor", "save_checkpoint"])
@pytest.mark.parametrize("launcher", ["processes", "ray"])
def test_a_killed_rank_stops_the_run_naming_the_step_and_the_last_complete_checkpoint(tmp_path, method, launcher):
    died = RankDied(f"trainer rank 1 (pid 4242) was killed by SIGKILL during {method}") if launcher == "processes" \
        else ray_actor_died()
    ranks = failing_on_second_call(method, died)  # as a rank the OOM killer ends
    with pytest.raises(TrainingStopped) as raised:
        run_rig(tmp_path, *THREE_STEPS, ranks=ranks)
    assert str(raised.value) == (f"step 2: {died}. No checkpoint is written for this step; the last complete one is "
                                 f"{tmp_path / 'checkpoints' / 'step_1'}")
    # A save that died leaves nothing of its own: no step_2, no staging directory.
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1"]


UNUSABLE = {
    "str": ("return 'correct'", "returned str; expected a float or a dict with 'score'"),
    "dict-without-score": ("return {'reward': 1.0}", "returned a dict without a 'score' key: ['reward']"),
    "raises": ("raise KeyError('answer')", "KeyError: 'answer'"),
}


@pytest.mark.parametrize("returns", UNUSABLE)
def test_rewards_that_are_all_unusable_stop_the_run_as_the_functions_mistake(tmp_path, returns):
    body, why = UNUSABLE[returns]
    # Unusable on the second step only: a first step trains and is saved.
    (tmp_path / "reward.py").write_text(
        "calls = []\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    calls.append(1)\n"
        "    if len(calls) <= 8:\n"
        "        return 1.0\n"
        f"    {body}\n")
    function = f"{tmp_path / 'reward.py'}:compute_score"
    # One worker process, so that `calls` counts every call.
    with NaiveRewardManager(function, num_workers=1) as manager, pytest.raises(StoppedByMistake) as raised:
        run_rig(tmp_path / "run", *THREE_STEPS, reward_manager=manager)
    # rig#2: the first prompt of step 2 in data.seed's shuffle.
    assert str(raised.value) == (
        f"step 2: reward.function={function} failed on all 8 samples of the batch (first: rig#2/0: {why}), so every "
        "reward would be 0; fix it to return a number, or a dict with a 'score'. No checkpoint is written for this "
        f"step; the last complete one is {tmp_path / 'run' / 'checkpoints' / 'step_1'}")
    assert user_error_in(raised.value) is raised.value  # `rlm train`: this line alone, exit 2


def test_a_reward_stuck_in_c_code_stops_the_run_with_one_line_and_leaves_no_worker_running(tmp_path):
    # Stuck from the second step on: a first step trains and is saved. The file counts the calls of every worker.
    calls = tmp_path / "calls"
    (tmp_path / "reward.py").write_text(textwrap.dedent(f"""
        import itertools, os

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            with open({str(calls)!r}, "a") as log:
                log.write(".")
            if os.path.getsize({str(calls)!r}) <= 8:
                return 1.0
            return sum(itertools.repeat(0, 10**13))  # C code that holds the interpreter lock: no signal gets in
    """))
    function = f"{tmp_path / 'reward.py'}:compute_score"
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with NaiveRewardManager(function, timeout_s=0.3) as manager, pytest.raises(StoppedByMistake) as raised:
        run_rig(tmp_path / "run", *THREE_STEPS, reward_manager=manager)
    # More than half of step 2's 8 samples timed out: scoring stops as soon as that is certain.
    assert re.fullmatch(
        rf"step 2: reward\.function={re.escape(function)} timed out on [5-8] of the batch's 8 samples"
        r"( \(scoring stopped there\))?, more than reward\.max_timeout_fraction=0\.5 of them at "
        r"reward\.timeout_s=0\.3s; make the function faster, raise reward\.timeout_s, or raise "
        r"reward\.max_timeout_fraction \(1 never stops\)\. No checkpoint is written for this step; the last "
        rf"complete one is {re.escape(str(tmp_path / 'run' / 'checkpoints' / 'step_1'))}", str(raised.value))
    assert user_error_in(raised.value) is raised.value  # `rlm train`: this line alone, exit 2
    assert {child.pid for child in psutil.Process().children(recursive=True)} - before == set()


def test_a_reward_that_fails_on_some_samples_trains_on(tmp_path):
    (tmp_path / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 'no' if solution_str.startswith('1') else 1.0\n")
    with NaiveRewardManager(f"{tmp_path / 'reward.py'}:compute_score") as manager:
        rig = run_rig(tmp_path / "run", *THREE_STEPS, reward_manager=manager)
    assert rig.result.steps == 3
    assert rig.history["reward/errors"] == [(1, 4.0), (2, 4.0), (3, 4.0)]  # sample 1 of each of the 4 prompts


class Part:
    """A part of a run that `run_training` stops, recording the order; `fails` raises when it is stopped."""

    def __init__(self, name: str, stopped: list[str], fails: BaseException | None = None) -> None:
        self.name, self.stopped, self.fails = name, stopped, fails

    def shutdown(self) -> None:
        self.stopped.append(self.name)
        if self.fails is not None:
            raise self.fails

    stop = close = shutdown

    def finish(self, status: str) -> None:
        self.stopped.append(f"{self.name} {status}")
        if self.fails is not None:
            raise self.fails


class Opened:
    def __init__(self, tracker) -> None:
        self.tracker = tracker

    def result(self):
        return self.tracker


SQLITE_FULL = RuntimeError("(sqlite3.OperationalError) database or disk is full")


@pytest.mark.parametrize("run_failed", [True, False])
def test_every_part_stops_whatever_another_part_raises_as_it_stops(run_failed, monkeypatch):
    """Issue 25's hang: the tracker's finish raised MLflow's "database or disk is full" in run_training's cleanup,
    the ranks were never shut down, and multiprocessing's exit waited for them for good."""
    stopped: list[str] = []
    monkeypatch.setattr(job, "remove_pools", lambda pools: stopped.append("pools"))
    parts = dict(engines=Part("engines", stopped, fails=RuntimeError("engine server gone")),
                 ranks=Part("ranks", stopped), router=Part("router", stopped), pools=object(),
                 reward_manager=Part("reward", stopped),
                 opening=Opened(Part("tracker", stopped, fails=SQLITE_FULL)))
    if run_failed:  # what stopped the run stays what is raised
        job._stop(**parts, status="FAILED")
    else:  # the run went well: the first part that failed to stop is raised, once every part has stopped
        with pytest.raises(RuntimeError, match="engine server gone"):
            job._stop(**parts, status="FINISHED", reraise=True)
    status = "FAILED" if run_failed else "FINISHED"
    assert stopped == ["engines", "ranks", "router", "pools", "reward", f"tracker {status}"]


def test_a_full_disk_is_recognised_through_the_chain_of_causes():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/x/checkpoints/step_2")
        except OSError as error:
            raise RuntimeError("CheckpointException ranks:dict_keys([0])") from error
    except RuntimeError as chained:
        assert disk_full_in(chained) == "No space left on device: /runs/x/checkpoints/step_2"
    assert disk_full_in(SQLITE_FULL) == "database or disk is full"
    assert disk_full_in(RuntimeError("unexpected pos 704 vs 598")) is None
