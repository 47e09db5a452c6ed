"""Actor worker on CPU/gloo: log-probs, entropy and a PPO update at TP=2, PP=2, TP=2xPP=2 equal TP=PP=1."""
from rlmegatron.runtime import ParallelLayout as L
from rlmegatron.runtime import run_ranks
from tests.workers.jobs import parity_job

TOLERANCE = 1e-5


def test_log_probs_entropy_and_update_match_tp1_at_tp2_pp2_tp2xpp2(tmp_path):
    layouts = [L(tp=2), L(pp=2), L(tp=2, pp=2)]
    reports = run_ranks(parity_job, 4, layouts, str(tmp_path), timeout_s=300)
    report = reports[0]
    assert all((r["log_probs"] == report["log_probs"]).all() for r in reports), "ranks disagree"
    assert report["log_probs"].abs().sum() > 0 and report["entropy"].min() >= 0
    assert report["padded_log_probs_diff"] < TOLERANCE
    assert report["padded_entropy_diff"] < TOLERANCE
    assert report["padded_pg_loss_diff"] < TOLERANCE
    assert report["padded_param_diff"] < 1e-3 * report["update_size"]
    assert report["update_size"] > 1e-5, "the update must move the weights for the comparison to mean anything"
    for label, result in report["layouts"].items():
        assert result["log_probs_diff"] < TOLERANCE, (label, result)
        assert result["entropy_diff"] < TOLERANCE, (label, result)
        assert result["pg_loss_diff"] < TOLERANCE, (label, result)
        assert result["param_diff"] < 1e-3 * report["update_size"], (label, result)
    for name in ["actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/lr",
                 "actor/pg_loss", "actor/kl_loss"]:
        assert name in report["metrics"], name
