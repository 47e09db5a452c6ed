"""Reward managers: custom functions in worker processes, errors and timeouts scored 0 and counted,
dict returns, and DAPO's overlong penalty."""
import logging
import textwrap

import pytest

from rlmegatron.config.spec import RewardConfig
from rlmegatron.rewards import DAPORewardManager, NaiveRewardManager, RewardInput, build_reward_manager

CUSTOM_REWARD = textwrap.dedent("""
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
        return {"score": float(solution_str == ground_truth), "acc": solution_str == ground_truth}
""")


def item(i, solution, truth="a", length=10, source="custom"):
    return RewardInput(sample_id=f"s{i}", data_source=source, solution_str=solution, ground_truth=truth,
                       response_length=length)


@pytest.fixture
def custom_reward(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_REWARD)
    return f"{path}:compute_score"


def test_failures_score_zero_are_counted_and_logged_once_the_batch_goes_on(custom_reward, caplog):
    items = [item(0, "a"), item(1, "raise"), item(2, "sleep"), item(3, "b"), item(4, "swallow"),
             item(5, "none"), item(6, "a")]
    config = RewardConfig(function=custom_reward, num_workers=2, timeout_s=0.5)
    with build_reward_manager(config, max_response_length=16) as manager:
        with caplog.at_level(logging.WARNING, logger="rlmegatron.rewards.manager"):
            result = manager(items)
        assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert result.rewards == result.scores
        assert result.metrics == {"reward/errors": 2.0, "reward/timeouts": 2.0}
        assert result.extra == {"acc": [True, None, None, False, None, None, True]}
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 2
        assert "raised on 2 of 7 samples, scored 0 (first: s1: RuntimeError: boom)" in messages[0]
        assert "timed out on 2 of 7 samples, scored 0 (first: s2: took longer than reward.timeout_s=0.5s)" in messages[1]
        # The workers survived the timeouts: a second batch reuses them.
        assert manager([item(7, "a")]).scores == [1.0]


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
