"""Critic worker (TP=2 values equal TP=1, the value loss falls) and a MoE actor's update at EP=2, on CPU/gloo."""
import math

import pytest

from rlmegatron.runtime import run_ranks
from tests.workers.jobs import critic_and_moe_job


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    reports = run_ranks(critic_and_moe_job, 4, str(tmp_path_factory.mktemp("critic")), timeout_s=300)
    assert all((r["values"] == reports[0]["values"]).all() for r in reports), "ranks disagree"
    return reports[0]


def test_critic_values_at_tp2_equal_tp1(report):
    assert report["values"].abs().sum() > 0
    assert report["values_tp2_diff"] < 1e-5


def test_critic_update_reduces_value_loss(report):
    losses = [m["critic/vf_loss"] for m in report["critic_metrics"]]
    assert losses[-1] < 0.9 * losses[0], losses
    for name in ["critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr"]:
        assert name in report["critic_metrics"][0], name


def test_moe_actor_trains_at_ep2_and_logs_router_aux_loss(report):
    metrics = report["moe_metrics"]
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
    changes = report["moe_param_change"]
    assert max(v for n, v in changes.items() if "experts" in n) > 0, changes
    assert max(v for n, v in changes.items() if "router" in n) > 0, changes
    aux = [name for name in metrics if name.startswith("actor/moe_")]
    assert aux and all(math.isfinite(metrics[name]) and metrics[name] > 0 for name in aux), metrics
