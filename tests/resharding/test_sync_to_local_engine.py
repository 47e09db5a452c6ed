"""Train at TP=2, PP=2 and EP=2, sync into the local engine: bitwise weights, and train/inference log-prob parity."""
from rlmegatron.runtime import ParallelLayout as L
from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_hf import save_tiny_model
from tests.resharding.sync_jobs import train_sync_generate_job


def _check(report):
    for layout, result in report.items():
        assert result["pushed"] > 0 and not result["not_bitwise"], f"{layout}: {result['not_bitwise'][:5]}"
        assert result["changed_by_training"] > 0, f"{layout}: the updates changed no weight"
        assert result["response_tokens"] > 0
        assert result["log_prob_max_diff"] < 1e-4, f"{layout}: {result['log_prob_max_diff']:.3g}"


def test_dense_tp2_and_pp2(tmp_path):
    save_tiny_model("qwen3", str(tmp_path))
    for report in run_ranks(train_sync_generate_job, 2, str(tmp_path), [L(tp=2), L(pp=2)], timeout_s=600):
        _check(report)


def test_moe_ep2(tmp_path):
    save_tiny_model("qwen3_moe", str(tmp_path))
    for report in run_ranks(train_sync_generate_job, 2, str(tmp_path), [L(ep=2)], timeout_s=600):
        _check(report)
