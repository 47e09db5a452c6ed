"""The learning-rate schedule (Megatron's OptimizerParamScheduler) and the optimizer choice at DP=2."""
import math

import pytest

from rlmegatron.transport.local_ranks import run_ranks
from tests.rank.roles.jobs import SCHEDULE, optimizer_job


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return run_ranks(optimizer_job, 2, str(tmp_path_factory.mktemp("optimizer")), timeout_s=300)


def closed_form(style: str, step: int) -> float:
    """The lr of trainer step `step` (from 1): linear warm-up to lr, then constant, or a decay to min_lr."""
    lr, min_lr, warmup, total = SCHEDULE["lr"], SCHEDULE["min_lr"], SCHEDULE["lr_warmup_steps"], SCHEDULE["lr_decay_steps"]
    if step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / (total - warmup)
    return {"constant": lr, "linear": min_lr + (lr - min_lr) * (1 - progress),
            "cosine": min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))}[style]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_actor_lr_follows_the_closed_form_schedule(reports, style):
    expected = [closed_form(style, step) for step in range(1, 6)]
    for report in reports:
        assert report["lr"][style] == pytest.approx(expected, rel=1e-12)
    if style != "constant":
        assert expected[-1] == pytest.approx(SCHEDULE["min_lr"])


@pytest.mark.parametrize("style", ["linear", "cosine"])  # the plain and the distributed optimizer
def test_a_resumed_worker_continues_the_schedule_and_the_weights(reports, style):
    for report in reports:
        assert report["resumed_lr"][style] == report["lr"][style][3:]
        assert report["resumed_param_diff"][style] == 0.0


def test_the_scheduled_lr_is_the_one_adam_steps_with(reports):
    for report in reports:
        assert report["update_size"] > 1e-4
        assert report["warmup_vs_half_lr_diff"] == 0.0


def test_plain_and_distributed_optimizer_step_the_same_at_dp2(reports):
    for report in reports:
        assert report["distributed_vs_plain_diff"] < 1e-6
