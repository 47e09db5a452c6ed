"""Megatron-Core GPTModel on CPU/gloo: loss and every gradient at each layout equal the TP=PP=EP=1 run (fp32)."""
import pytest

from rlmegatron.runtime import ParallelLayout as L
from rlmegatron.transport.local_ranks import run_ranks
from tests.helpers.megatron_parity import parity_job

TOLERANCE = 1e-5


def _assert_parity(reports, expected_layouts):
    reference_losses = {r["reference_loss"] for r in reports}
    assert len(reference_losses) == 1, f"ranks disagree on the reference loss: {reference_losses}"
    (reference_loss,) = reference_losses
    for label in expected_layouts:
        losses = [r["layouts"][label]["loss"] for r in reports if r["layouts"][label]["loss"] is not None]
        assert losses, f"{label}: no rank reported a loss"
        for loss in losses:
            assert loss == pytest.approx(reference_loss, abs=TOLERANCE), label
        diffs = reports[0]["layouts"][label]["grad_max_abs_diff"]
        scale = reports[0]["layouts"][label]["ref_grad_abs_max"]
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < TOLERANCE, f"{label}: grad of {worst} differs by {diffs[worst]:.3g}"
        # The comparison means something only if the gradients are not all zero.
        assert max(scale.values()) > 1e-3, f"{label}: reference gradients are ~0"


def test_dense_tp2_pp2_vpp2_tp2xpp2_and_cp2_on_4_ranks(tmp_path):
    # Uneven pipelines too: 1 + 3 and 3 + 1 of the 4 layers (Megatron's num_layers_in_first/last_pipeline_stage).
    # Context parallelism: each sequence split over 2 ranks (at DP=2), and over the 2 TP=2 groups with SP.
    layouts = [(L(tp=2), ""), (L(pp=2), ""), (L(tp=2, pp=2), ""), (L(pp=2, vpp=2), ""), (L(tp=2, sequence_parallel=True), ""),
               (L(pp=2, first_stage_layers=1), ""), (L(pp=2, last_stage_layers=1), ""), (L(cp=2), ""),
               (L(tp=2, cp=2, sequence_parallel=True), "")]
    reports = run_ranks(parity_job, 4, "dense", layouts, 4, str(tmp_path), timeout_s=300)
    _assert_parity(reports, ["TP2xPP1", "TP1xPP2", "TP2xPP2", "TP1xPP2xVPP2", "TP2xPP1xSP", "TP1xPP2(1,-)", "TP1xPP2(-,1)",
                             "TP1xPP1xCP2", "TP2xPP1xCP2xSP"])
    for label in ("TP1xPP2(1,-)", "TP1xPP2(-,1)"):
        assert sorted({r["layouts"][label]["decoder_layers"] for r in reports}) == [1, 3], label


def test_sinks_and_a_sliding_window_at_tp2_and_cp2(tmp_path):
    """gpt-oss's attention: the sinks split with the heads over TP; under CP each rank's chunks keep their own window
    of the all-gathered keys, by sequence position."""
    layouts = [(L(tp=2, sequence_parallel=True), ""), (L(cp=2), "")]
    reports = run_ranks(parity_job, 2, "sinks_window", layouts, 2, str(tmp_path), timeout_s=300)
    _assert_parity(reports, ["TP2xPP1xSP-", "TP1xPP1xCP2-"])
    sinks = [n for n in reports[0]["layouts"]["TP1xPP1xCP2-"]["grad_max_abs_diff"] if n.endswith("softmax_offset")]
    assert len(sinks) == 4, sinks  # each layer's sinks took part in the comparison


def test_moe_ep2_allgather_ep2_alltoall_tp2_sequence_parallel_and_cp2xep2(tmp_path):
    layouts = [(L(ep=2), "allgather"), (L(ep=2), "alltoall"), (L(tp=2, sequence_parallel=True), "alltoall"),
               (L(cp=2, ep=2), "alltoall")]
    reports = run_ranks(parity_job, 2, "moe", layouts, 2, str(tmp_path), timeout_s=300)
    _assert_parity(reports, ["TP1xPP1xEP2-allgather", "TP1xPP1xEP2-alltoall", "TP2xPP1xSP-alltoall",
                             "TP1xPP1xCP2xEP2-alltoall"])


def test_deepseek_shaped_mla_moe_ep2_tp2_sequence_parallel_and_cp2xep2(tmp_path):
    layouts = [(L(ep=2), "alltoall"), (L(tp=2, sequence_parallel=True), "alltoall"), (L(cp=2, ep=2), "alltoall")]
    reports = run_ranks(parity_job, 2, "mla_moe", layouts, 2, str(tmp_path), timeout_s=300)
    _assert_parity(reports, ["TP1xPP1xEP2-alltoall", "TP2xPP1xSP-alltoall", "TP1xPP1xCP2xEP2-alltoall"])


def test_distributed_optimizer_at_dp2_steps_like_plain_adam_at_one_rank(tmp_path):
    """The CPU layer lets Megatron's DistributedOptimizer (sharded Adam state over DP) run under gloo."""
    from tests.helpers.megatron_parity import optimizer_job

    (plain,) = run_ranks(optimizer_job, 1, L(), False, str(tmp_path), timeout_s=300)
    sharded = run_ranks(optimizer_job, 2, L(), True, str(tmp_path), timeout_s=300)[0]
    assert sharded["grad_norms"] == pytest.approx(plain["grad_norms"], abs=TOLERANCE)
    worst = max(float((sharded["params"][n] - plain["params"][n]).abs().max()) for n in plain["params"])
    assert worst < TOLERANCE
