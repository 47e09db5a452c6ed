"""Critic worker (TP=2 and CP=2 values equal TP=1, the value loss falls), a MoE actor's update at EP=2 and its
reference at EP=4 in the same processes, on CPU/gloo."""
import math
from pathlib import Path

import pytest
import torch

from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_hf import COMMON, FAMILY_CONFIGS
from tests.rank.roles.jobs import MOE_COUNT_VARIANTS, VOCAB, critic_and_moe_job, rollout_batch


def save_reward_model(directory: Path) -> Path:
    """A tiny random Qwen3 token-classification model with one label: a value model as verl trains them."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.for_model("qwen3", **{**COMMON, **FAMILY_CONFIGS["qwen3"], "vocab_size": VOCAB,
                                             "tie_word_embeddings": False, "num_labels": 1})
    torch.manual_seed(11)
    model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.score.bias.normal_()  # a zero bias would hide a head loaded without it
    model.save_pretrained(directory)
    return directory


def hf_values(directory: Path) -> torch.Tensor:
    """V(prefix before each response token) from transformers: the head's score at the preceding position."""
    from transformers import AutoModelForTokenClassification

    batch = rollout_batch()
    model = AutoModelForTokenClassification.from_pretrained(directory, dtype=torch.float32).eval()
    positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        scores = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=positions).logits[..., 0]
    prompt = batch.input_ids.shape[1] - batch.response_mask.shape[1]
    return scores[:, prompt - 1 : -1] * batch.response_mask


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("critic")
    save_reward_model(workdir / "reward_model")
    reports = run_ranks(critic_and_moe_job, 4, str(workdir), timeout_s=300)
    assert all((r["values"] == reports[0]["values"]).all() for r in reports), "ranks disagree"
    return reports[0]


def test_critic_from_an_hf_reward_model_at_tp2_gives_its_values(report, tmp_path_factory):
    expected = hf_values(save_reward_model(tmp_path_factory.mktemp("reference") / "reward_model"))
    assert expected.abs().sum() > 0
    assert (report["reward_model_values"] - expected).abs().max() < 1e-4


def test_moe_reference_at_ep4_beside_an_ep2_actor_gives_the_actors_log_probs(report):
    assert report["moe_log_probs"].abs().sum() > 0
    assert report["moe_local_experts"] == [2, 1]  # of the 4 experts, at EP=2 and at EP=4
    assert report["moe_reference_diff"] < 1e-5


def test_critic_values_at_tp2_equal_tp1(report):
    assert report["values"].abs().sum() > 0
    assert report["values_tp2_diff"] < 1e-5


def test_critic_values_of_shared_prompts_equal_each_sequence_laid_out_alone(report):
    assert report["values_shared_layouts"] == [True, False]
    assert report["values_shared_size"] > 0.01
    assert report["values_shared_diff"] < 1e-5


def test_critic_values_at_cp2_equal_cp1(report):
    assert report["values_cp2_diff"] < 1e-5


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


def test_every_rank_of_an_ep2_group_runs_as_many_micro_batches_in_every_layout_and_trains_as_ep1(report):
    """The ranks' shares of the batch cut into 3 and 5 micro-batches at EP=1 (where nothing pairs them up); at EP=2,
    where each micro-batch's all-to-alls pair a rank with others, every rank runs the same number: its own split, or
    fillers after them. The result is EP=1's: the same log-probs before and after one update."""
    counts = report["moe_counts"]
    baseline = counts["ep1"]
    assert len(set(baseline["counts"])) > 1, baseline["counts"]
    changed = float((baseline["after"] - baseline["before"]).abs().max())
    assert changed > 1e-3  # the update moves the log-probs; the layouts agree a hundred times closer
    for label in MOE_COUNT_VARIANTS:
        variant = counts[label]
        assert len(set(variant["counts"])) == 1, (label, variant["counts"])
        assert variant["layouts"] == [label if label != "dynamic-bsz" else "packed"], (label, variant["layouts"])
        for when in ("before", "after"):
            assert float((variant[when] - baseline[when]).abs().max()) < 1e-5, (label, when)
        assert abs(variant["pg_loss"] - baseline["pg_loss"]) < 1e-6, label
    assert counts["padded"]["fillers"] == [2, 2, 0, 0]  # the 3-row ranks cannot split single rows
    assert counts["shared-prompt"]["fillers"] == [1, 0, 0, 0]  # one prompt of two rows: split once, then a filler
    assert counts["packed"]["fillers"] == [0, 0, 0, 0]  # pairs split into singles instead
