"""Actor and reference workers on CPU/gloo: parity over layouts, packing and dynamic batch size; offload."""
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlmegatron.runtime import ParallelLayout as L
from rlmegatron.transport.local_ranks import run_ranks
from tests.rank.roles.jobs import make_actor, on_policy_job, parity_job, plugin_loss_job, rollout_batch

ALGORITHMS_PAGE = Path(__file__).resolve().parents[3] / "docs" / "algorithms.md"

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def parity_reports(tmp_path_factory):
    layout_variants = [(str(layout), layout, {}) for layout in [L(tp=2), L(pp=2), L(tp=2, pp=2), L(pp=2, vpp=2)]]
    # DP=2 leaves each rank 4 sequences. At PP2xVPP2, 2 micro-batches of 2 put all of pipeline rank 0's
    # work in the interleaved warmup (the case that deadlocked on gloo); 4 of 1 reach the steady 1F1B phase.
    layout_variants.append(("TP1xPP2xVPP2-mbs1", L(pp=2, vpp=2), {"micro_batch_size": 1}))
    # Context parallelism splits each sequence over 2 ranks: packed (at DP=2) and padded (TP=2 with SP, DP=1).
    layout_variants += [("TP1xPP1xCP2", L(cp=2), {}),
                        ("TP2xPP1xCP2xSP-padded", L(tp=2, cp=2, sequence_parallel=True), {"use_packing": False})]
    # Shared prompts under sequence parallelism: the layout rounds up to a multiple of TP.
    layout_variants.append(("TP2xSP", L(tp=2, sequence_parallel=True), {}))
    # A bound on a hang, not a speed test (beside another 4-rank matrix on a slow CI machine it once ran out of a
    # tighter one), and under pytest.ini's per-test timeout, so that the ranks are named if it is reached.
    return run_ranks(parity_job, 4, layout_variants, str(tmp_path_factory.mktemp("parity")), timeout_s=780)


def test_log_probs_entropy_and_update_match_tp1(parity_reports):
    """Padded, packed, dynamic-bsz (token budget), TP=2, PP=2, TP=2xPP=2, PP=2xVPP=2, CP=2, TP=2xCP=2 and TP=2 with
    SP all equal TP=PP=1 with each prompt laid out once for its two responses (models/shared_prompts.py), which
    every variant but those that turn it off, split sequences (CP) or have one sequence per micro-batch uses."""
    report = parity_reports[0]
    assert all((r["log_probs"] == report["log_probs"]).all() for r in parity_reports), "ranks disagree"
    assert report["log_probs"].abs().sum() > 0 and report["entropy"].min() >= 0
    assert report["update_size"] > 1e-5, "the update must move the weights for the comparison to mean anything"
    assert set(report["variants"]) == {"padded", "packed", "dynamic-bsz", "TP2xPP1", "TP1xPP2", "TP2xPP2",
                                       "TP1xPP2xVPP2", "TP1xPP2xVPP2-mbs1", "TP1xPP1xCP2", "TP2xPP1xCP2xSP-padded",
                                       "TP2xSP"}
    unshared = {"padded", "packed", "TP1xPP2xVPP2-mbs1", "TP1xPP1xCP2", "TP2xPP1xCP2xSP-padded"}
    assert {label for label, shared in report["shared"].items() if not shared} == unshared
    for label, result in report["variants"].items():
        assert result["log_probs_diff"] < TOLERANCE, (label, result)
        assert result["entropy_diff"] < TOLERANCE, (label, result)
        assert result["pg_loss_diff"] < TOLERANCE, (label, result)
        assert result["param_diff"] < 1e-3 * report["update_size"], (label, result)
    for name in ["actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/lr",
                 "actor/pg_loss", "actor/kl_loss"]:
        assert name in report["metrics"], name


def test_the_docs_loss_plugin_trains_in_a_rank_process_like_the_builtin_it_restates(tmp_path):
    """The algorithms page's ten-line REINFORCE loss, loaded by path in a spawned rank, updates exactly like `gpg`."""
    [code] = re.findall(r"```python\n(# my_losses.py\n.*?)```", ALGORITHMS_PAGE.read_text(), flags=re.DOTALL)
    (tmp_path / "my_losses.py").write_text(code)
    reference = f"{tmp_path / 'my_losses.py'}:reinforce"
    report = run_ranks(plugin_loss_job, 1, reference, timeout_s=300)[0]
    plugin, builtin = report[reference], report["gpg"]
    assert all(torch.equal(plugin["initial"][n], p) for n, p in builtin["initial"].items())
    update_size = max(float((builtin["updated"][n] - p).abs().max()) for n, p in builtin["initial"].items())
    assert update_size > 1e-5, "the update must move the weights for the comparison to mean anything"
    assert plugin["metrics"]["actor/pg_loss"] == pytest.approx(builtin["metrics"]["actor/pg_loss"], abs=1e-7)
    assert max(float((plugin["updated"][n] - p).abs().max()) for n, p in builtin["updated"].items()) < 1e-7
    assert "actor/advantage_mean" in plugin["metrics"] and "actor/ppo_kl" not in plugin["metrics"]
    assert "actor/ppo_kl" in builtin["metrics"]


def test_an_on_policy_update_without_the_old_log_prob_pass_is_the_same_update():
    """One epoch of one mini-batch: the old log-probs from the update's own forward give the loss, every metric and
    the weights of the separate pass, bit for bit; with two epochs the pass is required."""
    report = run_ranks(on_policy_job, 1, timeout_s=300)[0]
    with_pass, without = report["with the pass"], report["without"]
    assert with_pass["metrics"]["actor/pg_loss"] != 0.0
    assert without["metrics"] == with_pass["metrics"]
    assert all(torch.equal(without["updated"][n], p) for n, p in with_pass["updated"].items())
    assert "must be on-policy" in report["two epochs"]
    # The rollout-vs-trainer mismatch is measured without the pass too, from the update's own forward.
    expected = report["mismatch of the pass"]
    assert expected.keys() == report["mismatch of the update"].keys() and expected["training/rollout_kl"] > 0
    assert report["mismatch of the update"] == pytest.approx(expected, rel=1e-9)


def test_reference_log_probs_equal_the_actors(parity_reports):
    assert parity_reports[0]["reference_equal"]
    assert parity_reports[0]["reference_equal_after_offload"]


def test_offload_round_trip_keeps_training_identical(parity_reports):
    assert parity_reports[0]["offloaded_bytes"] > 0
    assert parity_reports[0]["offload_param_diff"] == 0.0


def gpu_offload_job() -> dict:
    """GPU memory allocated with the trained actor loaded, offloaded, and onloaded again."""
    actor = make_actor(L())
    batch = rollout_batch()
    log_probs, _ = actor.compute_log_prob(batch)
    actor.update(replace(batch, old_log_probs=log_probs))
    loaded = torch.cuda.memory_allocated()
    actor.offload()
    offloaded, host_bytes = torch.cuda.memory_allocated(), actor.offloader.offloaded_bytes
    actor.onload()
    return {"loaded": loaded, "offloaded": offloaded, "onloaded": torch.cuda.memory_allocated(),
            "host_bytes": host_bytes}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload frees GPU memory; there is no GPU here")
def test_offload_frees_gpu_memory():
    memory = run_ranks(gpu_offload_job, 1, device="cuda", timeout_s=300)[0]
    # Every byte that went to the host left the device (the allocator rounds blocks up, so at least as many). What
    # stays is not the model's: on an H100 about 64 MiB of cuBLAS workspaces, which the caching allocator counts.
    assert memory["host_bytes"] > 0
    assert memory["loaded"] - memory["offloaded"] >= memory["host_bytes"], memory
    assert memory["onloaded"] >= memory["loaded"] - 2**20, memory
