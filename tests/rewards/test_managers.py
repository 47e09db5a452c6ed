"""Reward managers: custom functions in the driver or in worker processes, errors and timeouts scored 0 and counted,
a time budget per batch, async functions, NaN rewards and broken plug-ins named, dict returns, and DAPO's overlong
penalty."""
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rlmegatron.config.spec import RewardConfig
from rlmegatron.rewards import (
    DAPORewardManager,
    NaiveRewardManager,
    NonFiniteReward,
    RewardFunctionError,
    RewardInput,
    build_reward_manager,
    step_reward_metrics,
)

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
    import multiprocessing

    if multiprocessing.current_process().name != "MainProcess":
        with open({log!r}, "a") as log:
            log.write("imported\\n")
        raise ImportError("no sandbox in this process")

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        return 1.0
""")


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


@pytest.mark.parametrize("num_workers", [0, 2], ids=["driver", "pool"])
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
        # The workers (or the driver's alarm) survived the timeouts: a second batch is scored.
        assert manager([item(7, "a")]).scores == [1.0]


def test_the_driver_scores_exactly_as_the_pool_does(custom_reward):
    items = [item(i, solution, truth) for i, (solution, truth) in enumerate(
        [("a", "a"), ("b", "a"), ("raise", "a"), ("none", "a"), ("x", "x"), ("12", "12"), ("12", "13")])]
    config = {"function": custom_reward, "manager": "dapo", "overlong_buffer": {"enable": True, "length": 4}}
    results = []
    for num_workers in (0, 2):
        with build_reward_manager(RewardConfig(**config, num_workers=num_workers), max_response_length=12) as m:
            results.append(m(items))
    assert results[0] == results[1]
    assert results[0].scores == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_num_workers_picks_the_driver_or_worker_processes(custom_reward):
    items = [item(i, "pid") for i in range(6)]
    with build_reward_manager(RewardConfig(function=custom_reward), max_response_length=16) as manager:
        assert manager(items).extra["pid"] == [os.getpid()] * 6
        assert manager._pool is None
    with build_reward_manager(RewardConfig(function=custom_reward, num_workers=2), max_response_length=16) as manager:
        pids = set(manager(items).extra["pid"])
        assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_off_the_main_thread_the_driver_mode_scores_in_one_worker_and_still_times_out(custom_reward):
    results = []
    with NaiveRewardManager(custom_reward, num_workers=0, timeout_s=0.5) as manager:
        thread = threading.Thread(target=lambda: results.append(manager([item(0, "pid"), item(1, "sleep")])))
        thread.start()
        thread.join(timeout=120)
    [result] = results
    assert result.extra["pid"][0] != os.getpid()
    assert result.metrics["reward/timeouts"] == 1.0


def test_the_driver_puts_back_the_alarm_it_found(custom_reward):
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.7)
        with NaiveRewardManager(custom_reward, timeout_s=0.3) as manager:
            assert manager([item(0, "sleep"), item(1, "a")]).scores == [0.0, 1.0]  # our alarm, 0.3 s
        assert fired == []
        time.sleep(1.0)  # theirs, 0.7 s after it was set, still fires
        assert fired == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_function_that_hangs_in_the_driver_moves_to_worker_processes_for_the_rest(custom_reward, caplog):
    # After its first timeout in the driver, the rest of the batch and every later batch score in a pool, where
    # timeouts run side by side (the pool test below times that); cheap samples before it stay in the driver.
    with NaiveRewardManager(custom_reward, timeout_s=0.5) as manager:
        with caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
            first = manager([item(0, "pid"), item(1, "sleep"), item(2, "pid"), item(3, "pid")])
        later = manager([item(4, "pid")])
    assert first.extra["pid"][0] == os.getpid()
    assert first.metrics["reward/timeouts"] == 1.0
    assert os.getpid() not in first.extra["pid"][2:] + later.extra["pid"]
    assert "it hangs in the driver, so from here on it scores in" in caplog.messages[0]


def test_hanging_samples_in_a_pool_time_out_together_not_one_after_another(custom_reward):
    with NaiveRewardManager(custom_reward, num_workers=4, timeout_s=0.5) as manager:
        manager([item(0, "a")])  # workers started
        started = time.perf_counter()
        result = manager([item(i, "sleep") for i in range(4)])
        elapsed = time.perf_counter() - started
    assert result.metrics["reward/timeouts"] == 4.0
    assert 0.5 <= elapsed < 1.25, elapsed  # one after another: 2 s


@pytest.mark.parametrize("num_workers", [0, 2], ids=["driver", "pool"])
def test_the_batch_budget_ends_a_batch_of_slow_samples(custom_reward, caplog, num_workers):
    items = [item(i, "sleep") for i in range(6)] + [item(6, "a")]
    config = RewardConfig(function=custom_reward, num_workers=num_workers, timeout_s=1.0, batch_timeout_s=1.5)
    with build_reward_manager(config, max_response_length=16) as manager:
        manager([item(0, "a")])  # any workers started
        started = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
            result = manager(items)
        elapsed = time.perf_counter() - started
    # Without the budget: 6 s in the driver, 3 s with two workers.
    assert 1.5 <= elapsed < 2.3, elapsed
    assert result.scores == [0.0] * 7 and result.metrics["reward/timeouts"] == 7.0
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith("reward function timed out on 7 of 7 samples, scored 0 (first: s0: took longer than "
                              "reward.timeout_s=1s) [s0, s1, s2, s3, s4, ...]")


def test_past_the_budget_a_sample_is_told_so(custom_reward, caplog):
    with NaiveRewardManager(custom_reward, timeout_s=5.0, batch_timeout_s=0.3) as manager:
        with caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
            assert manager([item(0, "sleep"), item(1, "a")]).metrics["reward/timeouts"] == 2.0
    assert "(first: s0: not scored within the batch's reward.batch_timeout_s=0.3s) [s0, s1]" in caplog.messages[0]


def test_an_async_function_runs_concurrently_in_the_driver_as_many_at_once_as_allowed(async_reward, caplog):
    items = [item(i, "a" if i % 2 else "b") for i in range(8)]
    for concurrency, fastest, slowest in ((2, 0.8, 1.2), (8, 0.2, 0.6)):
        config = RewardConfig(function=async_reward, async_concurrency=concurrency)
        with build_reward_manager(config, max_response_length=16) as manager:
            started = time.perf_counter()
            result = manager(items)
            elapsed = time.perf_counter() - started
            assert manager._pool is None
        assert result.scores == [0.0, 1.0] * 4
        assert max(result.extra["peak"]) == concurrency
        assert fastest <= elapsed < slowest, (concurrency, elapsed)
    # Hanging coroutines are cancelled together, after one timeout; errors are counted.
    with NaiveRewardManager(async_reward, timeout_s=0.5, async_concurrency=8) as manager:
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


@pytest.mark.parametrize("num_workers", [0, 2], ids=["driver", "pool"])
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
    file.write_text(FAILS_IN_WORKERS.format(log=str(log)))
    manager = NaiveRewardManager(f"{file}:compute_score", num_workers=2)  # loads in the driver
    started = time.perf_counter()
    with pytest.raises(RewardFunctionError) as raised:
        manager([item(i, "a") for i in range(4)])
    assert str(raised.value) == (f"reward.function={file}:compute_score: importing {file} raised ImportError: "
                                 "no sandbox in this process (in a reward worker process)")
    assert manager._pool is None and time.perf_counter() - started < 30
    time.sleep(1.0)
    assert 1 <= log.read_text().count("imported") <= 2  # each worker tried once; none was respawned


def test_a_function_stuck_in_c_code_ends_the_driver_instead_of_hanging(tmp_path):
    file = tmp_path / "stuck.py"
    file.write_text("import itertools\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    return sum(itertools.repeat(0, 10**13))  # no signal reaches Python until it returns\n")
    script = textwrap.dedent(f"""
        from rlmegatron.rewards import manager as M
        M._STUCK_GRACE_S = 0.5
        with M.NaiveRewardManager({str(file)!r} + ":compute_score", timeout_s=0.2) as rewards:
            rewards([M.RewardInput("s0", "custom", "x", "x", 1)])
        print("not reached")
    """)
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "not reached" not in run.stdout
    assert time.perf_counter() - started < 20
    assert "Timeout" in run.stderr and f'File "{file}", line 4 in compute_score' in run.stderr, run.stderr


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
