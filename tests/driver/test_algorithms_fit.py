"""Every advantage estimator and policy loss in the registries runs real fit-loop steps (rollout -> reward ->
log-probs -> advantages -> update -> weight sync), and its numbers are what it promises.

The cases come from the registries when the tests are collected, so an estimator or loss registered later is run too
(with the checks every case gets; the estimator-specific ones below are for the estimators known here). They all run
on one in-process rank in one process (tests/driver/algorithm_runs.py), two steps each."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from rlmegatron.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from tests.driver.graded_reward import compute_score, scores_nothing
from tests.helpers import warm_runs

REPO_ROOT = Path(__file__).resolve().parents[2]
GAMMA = 0.9  # algorithm.gamma in tests/driver/algorithm_runs.py
MAX_RESPONSE = 3  # data.max_response_length there

# Each policy loss trains on grpo's advantages.
CASES = [{"name": f"estimator-{name}", "estimator": name, "overrides": []} for name in ADVANTAGE_ESTIMATORS.names()]
CASES += [{"name": f"loss-{name}", "estimator": "grpo", "overrides": [f"actor.policy_loss.loss_mode={name}"]}
          for name in POLICY_LOSSES.names()]
CASES.append({"name": "remax-dynamic-sampling", "estimator": "remax",
              "overrides": ["algorithm.dynamic_sampling.enable=true"]})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("algorithms") / "runs.pt"
    run = warm_runs.run([sys.executable, "-m", "tests.driver.algorithm_runs", str(out), json.dumps(CASES)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return torch.load(out, weights_only=False)


def result_of(runs, name: str) -> dict:
    result = runs[name]
    assert "error" not in result, result["error"]
    return result


def check_fit_loop(result: dict) -> None:
    """What every case must show: two finite steps that trained the policy, towards its advantages, and reached
    the engine."""
    history = result["history"]
    assert [step for step, _ in history["actor/pg_loss"]] == [1, 2]
    for name, points in history.items():
        assert all(math.isfinite(value) for _, value in points), name
    assert all(value > 0 for _, value in history["actor/grad_norm"])
    # The update's one mini-batch is on-policy: the trainer's ratio is 1 up to rounding.
    assert all(abs(value) < 1e-6 for _, value in history["actor/ppo_kl"])
    assert result["engine_change"] > 1e-4, "the weights did not change"
    assert result["sync_error"] == 0.0, "the engine does not hold the trained weights"
    for step in result["steps"]:
        mask = step["response_mask"].bool()
        advantages = step["advantages"]
        assert torch.isfinite(advantages).all() and (advantages[~mask] == 0).all()
        assert advantages[mask].abs().max() > 0
        # The update raised the log-probability of positive-advantage tokens and lowered the others' (first order).
        moved = (step["new_log_probs"] - step["old_log_probs"])[mask]
        assert (advantages[mask] * moved).sum() > 0


def groups(step: dict) -> list[list[int]]:
    rows: dict[int, list[int]] = {}
    for row, uid in enumerate(step["uids"]):
        rows.setdefault(uid, []).append(row)
    return list(rows.values())


def per_token(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_sequence.unsqueeze(-1) * mask


def discounted_return_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The outcome reward sits on the last response token; gamma^(tokens after t) of it at token t."""
    lengths = mask.sum(-1, keepdim=True)
    after = lengths - 1 - torch.arange(mask.shape[1])
    return rewards.unsqueeze(-1) * GAMMA ** after.clamp(min=0) * mask


def whitened(values: torch.Tensor) -> torch.Tensor:
    return (values - values.mean()) / (values.var() + 1e-8).sqrt()


def check_group_normalised(step: dict) -> None:
    """grpo and gspo: (score - group mean) / group std, the same on every token of a response."""
    mask, advantages = step["response_mask"], step["advantages"]
    assert torch.equal(advantages, per_token(advantages[:, 0], mask))
    for rows in groups(step):
        scores, group = step["rewards"][rows], advantages[rows, 0]
        if scores.unique().numel() == 1:
            assert (group == 0).all()
        else:
            assert group.mean().abs() < 1e-5 and (group.std() - 1).abs() < 1e-4


def check_leave_one_out(step: dict) -> None:
    """rloo: score minus the mean of the other responses to the same prompt."""
    for rows in groups(step):
        scores = step["rewards"][rows]
        others = (scores.sum() - scores) / (len(rows) - 1)
        assert torch.allclose(step["advantages"][rows], per_token(scores - others, step["response_mask"][rows]),
                              atol=1e-6)


def check_whitened_discounted_return(step: dict) -> None:
    """reinforce_plus_plus: the discounted return-to-go, whitened over the batch's tokens."""
    mask = step["response_mask"]
    returns = discounted_return_to_go(step["rewards"], mask)
    assert torch.allclose(step["returns"], returns, atol=1e-6)
    assert torch.allclose(step["advantages"][mask.bool()], whitened(returns[mask.bool()]), atol=1e-5)


def check_whitened_group_baseline(step: dict) -> None:
    """reinforce_plus_plus_baseline: score minus group mean on every token, whitened over the batch's tokens."""
    mask = step["response_mask"]
    centred = step["rewards"].clone()
    for rows in groups(step):
        centred[rows] -= step["rewards"][rows].mean()
    expected = whitened(per_token(centred, mask)[mask.bool()])
    assert torch.allclose(step["advantages"][mask.bool()], expected, atol=1e-5)


def check_gae(step: dict) -> None:
    """gae at lam=1: returns are the discounted return-to-go whatever the values; advantages are returns - values,
    whitened over the batch's tokens."""
    mask = step["response_mask"].bool()
    assert step["values"] is not None and step["values"][mask].abs().max() > 0
    assert torch.allclose(step["returns"], discounted_return_to_go(step["rewards"], step["response_mask"]), atol=1e-5)
    raw = (step["returns"] - step["values"])[mask]
    assert torch.allclose(step["advantages"][mask], whitened(raw), atol=1e-4)


def check_greedy_baseline(step: dict) -> None:
    """remax: score minus the reward of the greedy response to the same prompt, one greedy response per prompt."""
    greedy = step["greedy"]
    assert greedy["n"] == 1 and greedy["temperature"] == 0.0
    assert greedy["gap"] < 1e-5, "a greedy-pass token is not the engine's argmax"
    assert max(greedy["lengths"]) <= MAX_RESPONSE
    # Once per prompt of the batch, and for no other prompt.
    assert sorted(greedy["sample_ids"]) == sorted(set(step["sample_ids"]))
    by_prompt = {sample_id: compute_score("next_digit", text, truth)
                 for sample_id, text, truth in zip(greedy["sample_ids"], greedy["texts"], greedy["ground_truths"])}
    baselines = torch.tensor([by_prompt[sample_id] for sample_id in step["sample_ids"]])
    assert torch.equal(step["baselines"], baselines)
    mask = step["response_mask"]
    assert torch.allclose(step["advantages"], per_token(step["rewards"] - baselines, mask), atol=1e-6)
    assert torch.allclose(step["returns"], per_token(step["rewards"], mask), atol=1e-6)


ESTIMATOR_PROPERTIES = {
    "gae": check_gae,
    "grpo": check_group_normalised,
    "gspo": check_group_normalised,
    "reinforce_plus_plus": check_whitened_discounted_return,
    "reinforce_plus_plus_baseline": check_whitened_group_baseline,
    "remax": check_greedy_baseline,
    "rloo": check_leave_one_out,
}


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS.names())
def test_estimator_runs_the_fit_loop(runs, estimator):
    result = result_of(runs, f"estimator-{estimator}")
    check_fit_loop(result)
    for step in result["steps"]:
        ESTIMATOR_PROPERTIES.get(estimator, lambda step: None)(step)
    # Only ReMax pays for a greedy pass.
    assert [step["greedy"] is not None for step in result["steps"]] == [estimator == "remax"] * 2
    assert ("critic/reward_baseline/mean" in result["history"]) == (estimator == "remax")
    if estimator == "gae":
        assert all(value > 0 for _, value in result["history"]["critic/grad_norm"])


# A ratio-based loss is -A x ratio per token; on-policy (ratio 1) its token-mean is minus the mean advantage.
ON_POLICY_LOSS_IS_MINUS_MEAN_ADVANTAGE = {"vanilla", "ppo", "gspo"}


@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_policy_loss_runs_the_fit_loop(runs, loss):
    result = result_of(runs, f"loss-{loss}")
    assert result["policy_loss"] == loss
    check_fit_loop(result)
    for step in result["steps"]:
        check_group_normalised(step)
    if loss in ON_POLICY_LOSS_IS_MINUS_MEAN_ADVANTAGE:
        for (_, pg_loss), step in zip(result["history"]["actor/pg_loss"], result["steps"]):
            mask = step["response_mask"]
            assert pg_loss == pytest.approx(-float((step["advantages"] * mask).sum() / mask.sum()), abs=1e-6)


def test_remax_baselines_follow_the_rows_dynamic_sampling_keeps(runs):
    result = result_of(runs, "remax-dynamic-sampling")
    check_fit_loop(result)
    history = result["history"]
    assert max(value for _, value in history["training/num_gen_batches"]) >= 2, "no step needed a second round"
    for step in result["steps"]:
        # Prompts whose answer is an even digit score 0 on every response, so their groups are dropped, and the
        # greedy pass skips them.
        assert len(step["uids"]) == 16
        assert all(step["rewards"][rows].unique().numel() > 1 for rows in groups(step))
        assert not any(scores_nothing(truth) for truth in step["greedy"]["ground_truths"])
        check_greedy_baseline(step)
    for (_, logged), step in zip(history["critic/reward_baseline/mean"], result["steps"]):
        by_prompt = dict(zip(step["sample_ids"], step["baselines"].tolist()))
        assert logged == pytest.approx(sum(by_prompt.values()) / len(by_prompt))
    # The samples' own tokens are not greedy: the measure that finds the greedy pass's tokens greedy can tell.
    assert max(step["sample_gap"] for step in result["steps"]) > 1e-2
