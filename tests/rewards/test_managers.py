"""Reward managers: custom functions in worker processes (the built-in rules in the driver), errors and timeouts
scored 0 and counted, too many timeouts stopping the batch, stuck workers killed, a time budget per batch, async
functions, NaN rewards and broken plug-ins named, dict returns, and DAPO's overlong penalty."""
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from rlmegatron.config.spec import RewardConfig
from rlmegatron.rewards import manager as reward_manager_module
from rlmegatron.rewards import (
    DAPORewardManager,
    NaiveRewardManager,
    NonFiniteReward,
    RewardFunctionError,
    RewardInput,
    build_reward_manager,
    step_reward_metrics,
)
from rlmegatron.rewards.manager import TimedOutRewards

CUSTOM_REWARD = textwrap.dedent("""
    import math
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "raise":
            raise RuntimeError("boom")
        if solution_str == "sleep":
            time.sleep(60)
        if solution_str == "swallow":
            try:
                time.sleep(60)
            except Exception:
                return 1.0
        if solution_str == "none":
            return None
        if solution_str in ("nan", "inf"):
            return float(solution_str)
        if solution_str == "pid":
            return {"score": 1.0, "pid": os.getpid()}
        if solution_str == "exit":
            os._exit(3)
        return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}

    def returns(data_source, solution_str, ground_truth, extra_info):
        return eval(solution_str)
""")

ASYNC_REWARD = textwrap.dedent("""
    import asyncio

    running = peak = 0

    async def compute_score(data_source, solution_str, ground_truth, extra_info):
        global running, peak
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(60 if solution_str == "hang" else 0.2)
        finally:
            running -= 1
        if solution_str == "raise":
            raise ValueError("bad answer")
        return {"score": float(solution_str == ground_truth), "peak": peak}
""")

FAILS_IN_WORKERS = textwrap.dedent("""
    import os

    if os.getpid() != {driver}:
        with open({log!r}, "a") as log:
            log.write("imported\\n")
        raise ImportError("no sandbox in this process")

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return 1.0
""")


# Stuck where no signal reaches Python: a C loop that holds the interpreter lock, and an async function that blocks
# its event loop.
STUCK = {
    "c-loop": "import itertools\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
              "    return sum(itertools.repeat(0, 10**13))\n",
    "blocked-event-loop": "import time\n\nasync def compute_score(data_source, solution_str, ground_truth, "
                          "extra_info):\n    time.sleep(60)\n",
}


def children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def item(i, solution, truth="a", length=10, source="custom"):
    return RewardInput(sample_id=f"s{i}", data_source=source, solution_str=solution, ground_truth=truth,
                       response_length=length)


@pytest.fixture
def custom_reward(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_REWARD)
    return f"{path}:compute_score"


@pytest.fixture
def async_reward(tmp_path):
    path = tmp_path / "async_reward.py"
    path.write_text(ASYNC_REWARD)
    return f"{path}:compute_score"


@pytest.mark.parametrize("num_workers", [0, 2], ids=["default-workers", "two-workers"])
def test_failures_score_zero_are_counted_and_logged_once_the_batch_goes_on(custom_reward, caplog, num_workers):
    items = [item(0, "a"), item(1, "raise"), item(2, "sleep"), item(3, "b"), item(4, "swallow"),
             item(5, "none"), item(6, "a")]
    config = RewardConfig(function=custom_reward, num_workers=num_workers, timeout_s=0.5)
    with build_reward_manager(config, max_response_length=16) as manager:
        with caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
            result = manager(items)
        assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert result.rewards == result.scores
        assert result.metrics == {"reward/errors": 2.0, "reward/timeouts": 2.0}
        assert result.extra == {"acc": [True, None, None, False, None, None, True]}
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 3
        assert "raised on 1 of 7 samples, scored 0 (first: s1: RuntimeError: boom) [s1]" in messages[0]
        # A wrong return type is named as such, never as "raised".
        assert ("returned the wrong type on 1 of 7 samples, scored 0 (first: s5: returned NoneType; expected a float "
                "or a dict with 'score') [s5]") in messages[1]
        assert ("timed out on 2 of 7 samples, scored 0 (first: s2: took longer than reward.timeout_s=0.5s) [s2, s4]"
                in messages[2])
        # The workers survived the timeouts (their own alarm stopped the samples): a second batch is scored.
        assert manager([item(7, "a")]).scores == [1.0]


BUILT_IN = [item(0, "#### 18", "18", source="openai/gsm8k"), item(1, "\\boxed{2}", "3", source="math"),
            item(2, "\\boxed{3}", "3", source="math", length=14), item(3, "5", "5", source="unknown")]


def test_the_built_in_rules_score_in_the_driver_exactly_as_in_workers():
    config = {"manager": "dapo", "overlong_buffer": {"enable": True, "length": 4}}
    results = []
    for num_workers in (0, 2):
        with build_reward_manager(RewardConfig(**config, num_workers=num_workers), max_response_length=16) as m:
            results.append(m(BUILT_IN))
            assert (m._pool is None) == (num_workers == 0)
    assert results[0] == results[1]
    assert results[0].scores == [1.0, 0.0, 1.0, 0.0] and results[0].rewards == [1.0, 0.0, 0.5, 0.0]


def test_a_reward_function_never_runs_in_the_driver_and_num_workers_bounds_its_processes(custom_reward):
    items = [item(i, "pid") for i in range(6)]
    for num_workers, most in ((0, reward_manager_module._DEFAULT_WORKERS), (2, 2), (1, 1)):
        config = RewardConfig(function=custom_reward, num_workers=num_workers)
        with build_reward_manager(config, max_response_length=16) as manager:
            pids = set(manager(items).extra["pid"])
        assert os.getpid() not in pids and 1 <= len(pids) <= most, (num_workers, pids)


def test_off_the_main_thread_the_built_in_rules_score_in_one_worker(caplog):
    results = []
    with NaiveRewardManager(None) as manager, caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
        thread = threading.Thread(target=lambda: results.append(manager(BUILT_IN)))
        thread.start()
        thread.join(timeout=60)
        assert len(manager._pool.workers) == 1
    [result] = results
    assert result.scores == [1.0, 0.0, 1.0, 0.0] and result.metrics["reward/errors"] == 1.0
    assert "this manager runs in another thread, so it scores in one worker process instead" in caplog.messages[0]


def test_the_driver_puts_back_the_alarm_it_found(monkeypatch):
    def built_in(data_source, solution_str, ground_truth, extra_info):  # as a built-in rule that is slow
        if solution_str == "sleep":
            time.sleep(60)
        return 1.0

    monkeypatch.setattr(reward_manager_module, "default_compute_score", built_in)
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.7)
        with NaiveRewardManager(None, timeout_s=0.3) as manager:
            assert manager([item(0, "sleep"), item(1, "a")]).scores == [0.0, 1.0]  # our alarm, 0.3 s
            assert manager._pool is None  # in the driver
        assert fired == []
        time.sleep(1.0)  # theirs, 0.7 s after it was set, still fires
        assert fired == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_once_a_sample_times_out_the_default_workers_grow_so_the_rest_time_out_side_by_side(custom_reward,
                                                                                               monkeypatch):
    monkeypatch.setattr(reward_manager_module, "_DEFAULT_WORKERS", 1)
    monkeypatch.setattr(reward_manager_module, "_HUNG_WORKERS", 7)
    with NaiveRewardManager(custom_reward, timeout_s=0.5, max_timeout_fraction=1.0) as manager:
        manager([item(0, "a")])  # the one default worker started
        started = time.perf_counter()
        result = manager([item(i, "sleep") for i in range(8)])
        elapsed = time.perf_counter() - started
        assert len(manager._pool.workers) == 1  # the extra workers left with the batch
    assert result.metrics["reward/timeouts"] == 8.0
    assert 1.0 <= elapsed < 2.5, elapsed  # one timeout, then seven side by side; in one worker: 4 s


def test_hanging_samples_time_out_together_and_more_than_max_timeout_fraction_stop_the_batch(custom_reward):
    with NaiveRewardManager(custom_reward, num_workers=4, timeout_s=0.5) as manager:
        manager([item(0, "a")])  # workers started
        started = time.perf_counter()
        # Half of them: not more than max_timeout_fraction (0.5), so the batch is scored, its timeouts 0.
        result = manager([item(i, "sleep") for i in range(4)] + [item(i, "a") for i in range(4, 8)])
        elapsed = time.perf_counter() - started
        assert result.scores == [0.0] * 4 + [1.0] * 4 and result.metrics["reward/timeouts"] == 4.0
        assert 0.5 <= elapsed < 1.25, elapsed  # one after another: 2 s
        with pytest.raises(TimedOutRewards) as raised:
            manager([item(i, "sleep") for i in range(3)] + [item(3, "a")])
    assert str(raised.value) == (
        f"reward.function={custom_reward} timed out on 3 of the batch's 4 samples, more than "
        "reward.max_timeout_fraction=0.5 of them at reward.timeout_s=0.5s; make the function faster, raise "
        "reward.timeout_s, or raise reward.max_timeout_fraction (1 never stops)")


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_max_timeout_fraction_is_how_many_timeouts_a_batch_may_have(custom_reward, fraction):
    # 3 of 8 samples hang: 0.375 of the batch.
    config = RewardConfig(function=custom_reward, num_workers=4, timeout_s=0.3, max_timeout_fraction=fraction)
    items = [item(i, "sleep") for i in range(3)] + [item(i, "a") for i in range(3, 8)]
    with build_reward_manager(config, max_response_length=16) as manager:
        if fraction >= 0.375:
            assert manager(items).scores == [0.0] * 3 + [1.0] * 5
            return
        with pytest.raises(TimedOutRewards) as raised:
            manager(items)
    assert str(raised.value).startswith(f"reward.function={custom_reward} timed out on 3 of the batch's 8 samples, "
                                        "more than reward.max_timeout_fraction=0.25 of them at reward.timeout_s=0.3s")


def test_a_batch_stops_as_soon_as_more_than_max_timeout_fraction_of_it_has_timed_out(custom_reward):
    # 4 workers, 8 hanging samples: past the first 4 timeouts the others are never started (0.3 s, not 0.6 s).
    config = RewardConfig(function=custom_reward, num_workers=4, timeout_s=0.3, max_timeout_fraction=0.0)
    with build_reward_manager(config, max_response_length=16) as manager:
        manager([item(0, "a")])  # workers started
        started = time.perf_counter()
        with pytest.raises(TimedOutRewards, match=r"timed out on [1-4] of the batch's 8 samples \(scoring stopped "
                                                  r"there\), more than reward.max_timeout_fraction=0 of them"):
            manager([item(i, "sleep") for i in range(8)])
        assert time.perf_counter() - started < 0.55


@pytest.mark.parametrize("num_workers", [1, 2], ids=["one-worker", "two-workers"])
def test_the_batch_budget_ends_a_batch_of_slow_samples(custom_reward, caplog, num_workers):
    items = [item(i, "sleep") for i in range(6)] + [item(6, "a")]
    config = RewardConfig(function=custom_reward, num_workers=num_workers, timeout_s=1.0, batch_timeout_s=1.5,
                          max_timeout_fraction=1.0)  # all of them time out: the run would stop
    with build_reward_manager(config, max_response_length=16) as manager:
        manager([item(0, "a")])  # any workers started
        started = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
            result = manager(items)
        elapsed = time.perf_counter() - started
    # Without the budget: 6 s in one worker, 3 s in two.
    assert 1.5 <= elapsed < 2.3, elapsed
    assert result.scores == [0.0] * 7 and result.metrics["reward/timeouts"] == 7.0
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith("reward function timed out on 7 of 7 samples, scored 0 (first: s0: took longer than "
                              "reward.timeout_s=1s) [s0, s1, s2, s3, s4, ...]")


def test_past_the_budget_a_sample_is_told_so(custom_reward, caplog):
    with NaiveRewardManager(custom_reward, 1, timeout_s=5.0, batch_timeout_s=0.3, max_timeout_fraction=1.0) as manager:
        with caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
            assert manager([item(0, "sleep"), item(1, "a")]).metrics["reward/timeouts"] == 2.0
    assert "(first: s0: not scored within the batch's reward.batch_timeout_s=0.3s) [s0, s1]" in caplog.messages[0]


def test_an_async_function_runs_concurrently_in_one_worker_as_many_at_once_as_allowed(async_reward, caplog):
    items = [item(i, "a" if i % 2 else "b") for i in range(8)]
    for concurrency, fastest, slowest in ((2, 0.8, 1.2), (8, 0.2, 0.6)):
        config = RewardConfig(function=async_reward, async_concurrency=concurrency)
        with build_reward_manager(config, max_response_length=16) as manager:
            manager([item(8, "a")])  # its worker started
            started = time.perf_counter()
            result = manager(items)
            elapsed = time.perf_counter() - started
            assert len(manager._pool.workers) == 1
        assert result.scores == [0.0, 1.0] * 4
        assert max(result.extra["peak"]) == concurrency
        assert fastest <= elapsed < slowest, (concurrency, elapsed)
    # Hanging coroutines are cancelled together, after one timeout; errors are counted.
    with NaiveRewardManager(async_reward, timeout_s=0.5, async_concurrency=8, max_timeout_fraction=1.0) as manager:
        manager([item(8, "a")])
        started = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
            result = manager([item(i, "hang") for i in range(6)] + [item(6, "raise"), item(7, "a")])
        elapsed = time.perf_counter() - started
    assert 0.5 <= elapsed < 1.0, elapsed
    assert result.scores == [0.0] * 7 + [1.0]
    assert result.metrics == {"reward/errors": 1.0, "reward/timeouts": 6.0}
    assert "raised on 1 of 8 samples, scored 0 (first: s6: ValueError: bad answer)" in caplog.messages[0]


def test_an_async_function_in_worker_processes_is_awaited_and_timed_out(async_reward):
    with NaiveRewardManager(async_reward, num_workers=2, timeout_s=0.5) as manager:
        result = manager([item(0, "a"), item(1, "hang"), item(2, "b")])
    assert result.scores == [1.0, 0.0, 0.0] and result.metrics["reward/timeouts"] == 1.0


@pytest.mark.parametrize("num_workers", [0, 2], ids=["default-workers", "two-workers"])
def test_a_nan_or_infinite_reward_is_named_with_its_sample(custom_reward, num_workers):
    with NaiveRewardManager(custom_reward, num_workers=num_workers) as manager:
        with pytest.raises(NonFiniteReward) as raised:
            manager([item(0, "a"), item(1, "nan"), item(2, "inf"), item(3, "a")])
    assert str(raised.value) == (f"reward function {custom_reward} returned nan for sample s1 (and for 1 more of the "
                                 "batch's 4); a reward must be a finite number")


@pytest.mark.parametrize("returned, problem", [
    ("'1.0'", "returned str; expected a float or a dict with 'score'"),
    ("[1.0]", "returned list; expected a float or a dict with 'score'"),
    ("None", "returned NoneType; expected a float or a dict with 'score'"),
    ("{'score': '1'}", "returned a dict whose 'score' is str; expected a float"),
    ("{'acc': 1}", "returned a dict without a 'score' key: ['acc']"),
])
def test_a_wrong_return_type_is_named_as_such(custom_reward, caplog, returned, problem):
    with NaiveRewardManager(custom_reward.replace(":compute_score", ":returns")) as manager:
        with caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
            result = manager([item(0, returned), item(1, "True")])
    assert result.scores == [0.0, 1.0] and result.metrics["reward/errors"] == 1.0
    assert caplog.messages == [
        f"reward function returned the wrong type on 1 of 2 samples, scored 0 (first: s0: {problem}) [s0]"]


@pytest.mark.parametrize("source, problem", [
    ("def compute_scor(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n",
     "{ref}: bad_reward.py defines no 'compute_score'"),
    ("def compute_score(data_source, solution_str:\n    return 1.0\n",
     "{ref}: importing {file} raised SyntaxError: '(' was never closed (bad_reward.py, line 1)"),
    ("import not_a_module_anywhere\n",
     "{ref}: importing {file} raised ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
    ("def compute_score(solution_str, ground_truth):\n    return 1.0\n",
     "{ref}: cannot be called as compute_score(data_source, solution_str, ground_truth, extra_info): "
     "too many positional arguments"),
], ids=["missing-name", "syntax-error", "import-error", "signature"])
def test_a_plugin_that_cannot_be_loaded_fails_once_naming_the_file(tmp_path, source, problem):
    file = tmp_path / "bad_reward.py"
    file.write_text(source)
    ref = f"{file}:compute_score"
    with pytest.raises(RewardFunctionError) as raised:
        build_reward_manager(RewardConfig(function=ref, num_workers=2), max_response_length=16)
    assert str(raised.value) == "reward.function=" + problem.format(ref=ref, file=file)


def test_a_plugin_that_fails_only_in_the_workers_fails_the_batch_once(tmp_path):
    log = tmp_path / "imports.log"
    file = tmp_path / "worker_reward.py"
    file.write_text(FAILS_IN_WORKERS.format(log=str(log), driver=os.getpid()))
    manager = NaiveRewardManager(f"{file}:compute_score", num_workers=2)  # loads in the driver
    started = time.perf_counter()
    with pytest.raises(RewardFunctionError) as raised:
        manager([item(i, "a") for i in range(4)])
    assert str(raised.value) == (f"reward.function={file}:compute_score: importing {file} raised ImportError: "
                                 "no sandbox in this process (in a reward worker process)")
    assert manager._pool is None and time.perf_counter() - started < 30
    time.sleep(1.0)
    assert 1 <= log.read_text().count("imported") <= 2  # each worker tried once; none was respawned


@pytest.mark.parametrize("stuck", STUCK)
def test_a_function_stuck_where_no_signal_reaches_it_has_its_worker_killed_and_leaves_nothing_running(tmp_path,
                                                                                                    stuck):
    file = tmp_path / "stuck.py"
    file.write_text(STUCK[stuck])
    before = children()
    with NaiveRewardManager(f"{file}:compute_score", timeout_s=0.2) as manager:
        manager._workers()._start_for(1, 1)
        started = time.perf_counter()
        with pytest.raises(TimedOutRewards, match=r"timed out on [12] of the batch's 2 samples"):
            manager([item(0, "a"), item(1, "a")])
        # Its timeout, the kill's grace, and no more: the driver was never stuck with it.
        assert time.perf_counter() - started < 0.2 + reward_manager_module._KILL_GRACE_S + 1.0
        assert children() - before <= {w.process.pid for w in manager._pool.workers}
    assert children() - before == set()


def test_idle_workers_leave_when_the_driver_is_killed(custom_reward):
    script = textwrap.dedent(f"""
        import time
        from rlmegatron.rewards.manager import NaiveRewardManager, RewardInput
        manager = NaiveRewardManager({custom_reward!r}, num_workers=2)
        result = manager([RewardInput(f"s{{i}}", "custom", "pid", "a", 1) for i in range(4)])
        print(*set(result.extra["pid"]), flush=True)
        time.sleep(60)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    workers = [int(pid) for pid in driver.stdout.readline().split()]
    driver.kill()
    driver.wait()
    assert workers
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in workers):
        time.sleep(0.05)
    assert not any(psutil.pid_exists(pid) for pid in workers)  # each saw its socket close, and ended


def test_a_worker_that_dies_costs_its_sample_and_a_new_one_goes_on(custom_reward, caplog):
    with NaiveRewardManager(custom_reward, num_workers=1) as manager:
        with caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
            result = manager([item(0, "exit"), item(1, "a")])
    assert result.scores == [0.0, 1.0] and result.metrics["reward/errors"] == 1.0
    assert "(first: s0: its worker process died (exit code 3); a new one goes on)" in caplog.messages[0]


def test_reward_num_workers_score_side_by_side(tmp_path):
    # Each call registers its process and waits (up to 20 s) until 3 processes have: only 3 workers get there.
    path = tmp_path / "meet.py"
    path.write_text(textwrap.dedent(f"""
        import os, pathlib, time

        def compute_score(data_source, solution_str, ground_truth, extra_info):
            here = pathlib.Path({str(tmp_path / "pids")!r})
            here.mkdir(exist_ok=True)
            (here / str(os.getpid())).touch()
            deadline = time.monotonic() + 20
            while len(list(here.iterdir())) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            return {{"score": 1.0, "met": len(list(here.iterdir()))}}
    """))
    with build_reward_manager(RewardConfig(function=f"{path}:compute_score", num_workers=3), 16) as manager:
        result = manager([item(i, "a") for i in range(3)])
    assert result.extra["met"] == [3, 3, 3]


def test_default_reward_dispatches_by_data_source_and_unknown_sources_score_zero():
    with NaiveRewardManager(None, num_workers=1) as manager:
        result = manager([item(0, "#### 18", "18", source="openai/gsm8k"), item(1, "\\boxed{2}", "3", source="math"),
                          item(2, "5", "5", source="unknown")])
    assert result.scores == [1.0, 0.0, 0.0] and result.metrics["reward/errors"] == 1.0


@pytest.mark.parametrize("length, penalty", [(10, 0.0), (12, 0.0), (13, -0.125), (14, -0.25), (16, -0.5)])
def test_dapo_overlong_penalty(length, penalty):
    # L_max=16, L_buf=4: responses past 12 tokens lose (len - 12) / 4 * factor.
    manager = DAPORewardManager(None, 1, 1.0, max_response_length=16, overlong_buffer_length=4,
                                overlong_penalty_factor=0.5)
    assert manager.overlong_penalty(length) == penalty


def test_dapo_manager_adds_the_penalty_to_the_score(custom_reward):
    config = RewardConfig(function=custom_reward, manager="dapo",
                          overlong_buffer={"enable": True, "length": 4, "penalty_factor": 1.0})
    with build_reward_manager(config, max_response_length=16) as manager:
        result = manager([item(0, "a", length=16), item(1, "b", length=14), item(2, "a", length=5)])
    assert result.scores == [1.0, 0.0, 1.0]
    assert result.rewards == [0.0, -0.5, 1.0]
    assert result.metrics["reward/overlong_ratio"] == pytest.approx(2 / 3)
    assert result.metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.5)


def test_dapo_penalty_scales_with_the_penalty_factor(custom_reward):
    config = RewardConfig(function=custom_reward, manager="dapo",
                          overlong_buffer={"enable": True, "length": 4, "penalty_factor": 0.5})
    with build_reward_manager(config, max_response_length=16) as manager:
        result = manager([item(0, "a", length=16), item(1, "b", length=14), item(2, "a", length=5)])
    assert result.rewards == [0.5, -0.25, 1.0]


def test_dapo_without_the_buffer_enabled_is_naive():
    config = RewardConfig(manager="dapo")
    manager = build_reward_manager(config, max_response_length=16)
    assert manager.overlong_penalty(10_000) == 0.0


def test_a_steps_reward_metrics_add_counts_and_weigh_means_by_responses():
    rounds = [(2, {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/overlong_ratio": 0.5}),
              (6, {"reward/errors": 2.0, "reward/timeouts": 3.0, "reward/overlong_ratio": 1 / 6})]
    assert step_reward_metrics(rounds) == {"reward/errors": 3.0, "reward/timeouts": 3.0,
                                           "reward/overlong_ratio": pytest.approx(2 / 8)}
    assert step_reward_metrics(rounds[:1]) == rounds[0][1]
