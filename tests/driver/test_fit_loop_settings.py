"""The spec fields the fit loop reads take effect: sampling, validation, schedule, estimator options, KL in the
reward and dynamic sampling, each checked by hand on the pure-Python rig (tests/driver/fit_rig.py)."""
import math
import textwrap

import pytest
import torch

from rlmegatron.rewards import DAPORewardManager, NaiveRewardManager
from tests.driver.fit_rig import REPO_ROOT, FakeRanks, constant, run_rig


def steps(history: dict, name: str) -> list[int]:
    return [step for step, _ in history.get(name, [])]


def test_rollout_sampling_settings_reach_every_request_and_the_batch(tmp_path):
    rig = run_rig(tmp_path / "a", "rollout.n=3", "rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=5",
                  "rollout.max_new_tokens=2", "rollout.stop_token_ids=[7,8]", "rollout.seed=11",
                  "data.train_batch_size=2", "actor.ppo_mini_batch_size=2")
    calls = rig.calls("rollout")
    assert [len(requests) for requests in calls] == [2, 2]  # data.train_batch_size prompts per step
    for request in rig.requests("rollout"):
        sampling = request.sampling
        assert (sampling.n, sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_new_tokens,
                sampling.stop_token_ids) == (3, 0.7, 0.9, 5, 2, (7, 8))
    for batch in rig.ranks.updates["actor"]:
        assert batch.response_mask.shape == (2 * 3, 2)  # prompts x rollout.n rows, rollout.max_new_tokens wide

    # rollout.seed moves every request's seed; steps never share one.
    seeds = [[request.sampling.seed for request in requests] for requests in calls]
    default = run_rig(tmp_path / "b", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2")
    default_seeds = [[request.sampling.seed for request in requests] for requests in default.calls("rollout")]
    assert len({seed for step in seeds + default_seeds for seed in step}) == 8


def test_the_rollout_asks_the_engines_for_their_routing_only_when_the_actor_uses_it(tmp_path):
    """An MoE actor replaying the rollout's routing (r3) or measuring its agreement asks for it on every training
    request, not on validation's; r2 (its own old-log-prob pass's routing) and no replay do not ask."""
    moe = [f"model.path={REPO_ROOT / 'configs' / 'models' / 'tiny-qwen3-moe'}", "data.val_files=[val.jsonl]",
           "trainer.val_before_train=true", "actor.ppo_mini_batch_size=2"]
    for setting, asked in [("actor.moe.routing_replay=r3", True), ("actor.moe.routing_agreement=true", True),
                           ("actor.moe.routing_replay=r2", False), ("actor.moe.routing_replay=off", False)]:
        rig = run_rig(tmp_path / setting, *moe, setting, val_prompts=2)
        assert {request.return_routed_experts for request in rig.requests("rollout")} == {asked}, setting
        assert {request.return_routed_experts for request in rig.requests("validation")} == {False}, setting


def test_the_on_policy_check_adds_the_old_log_prob_pass_and_stops_a_step_whose_engine_sampled_off_policy(tmp_path):
    """The fake engine's log-probs are -0.5 on every token: ranks that score -0.5 pass the check, ranks that score
    -0.5 + 2e-5 stop step 1 before its update; without the check the same ranks train (on-policy, no pass)."""
    from rlmegatron.driver.trainer import TrainingStopped

    on_policy = FakeRanks()
    on_policy.log_prob = -0.5
    rig = run_rig(tmp_path / "exact", "trainer.on_policy_check=1e-5", ranks=on_policy)
    assert on_policy.calls.count("compute_log_prob") == 2 and len(rig.ranks.updates["actor"]) == 2

    off = FakeRanks()
    off.log_prob = -0.5 + 2e-5
    with pytest.raises(TrainingStopped) as stopped:
        run_rig(tmp_path / "off", "trainer.on_policy_check=1e-5", ranks=off)
    assert str(stopped.value).startswith(
        "step 1: trainer.on_policy_check=1e-05: row 0, response token 0 has log-prob -0.5 from the engine and "
        "-0.49998 from the actor (2e-05 apart): the engine did not sample with the trained weights"), stopped.value
    assert "update_actor" not in off.calls

    unchecked = FakeRanks()
    unchecked.log_prob = -0.5 + 2e-5
    run_rig(tmp_path / "unchecked", ranks=unchecked)
    assert "compute_log_prob" not in unchecked.calls and unchecked.calls.count("update_actor") == 2


def test_max_new_tokens_follows_data_max_response_length(tmp_path):
    rig = run_rig(tmp_path, "data.max_response_length=4")
    assert {request.sampling.max_new_tokens for request in rig.requests("rollout")} == {4}
    assert all(batch.response_mask.shape[1] == 4 for batch in rig.ranks.updates["actor"])


def test_validation_runs_when_and_how_the_spec_says(tmp_path):
    validation = ["data.val_files=[val.jsonl]", "data.val_batch_size=2", "rollout.val_kwargs.n=2",
                  "rollout.val_kwargs.temperature=0.5", "rollout.val_kwargs.top_p=0.8", "rollout.val_kwargs.top_k=3",
                  "rollout.seed=5", "trainer.test_freq=2", "trainer.total_steps=4"]
    rig = run_rig(tmp_path / "before", *validation, "trainer.val_before_train=true", val_prompts=5)
    assert steps(rig.history, "val/val/score/mean") == [0, 2, 4]
    # Each validation: 5 prompts in batches of data.val_batch_size, sampled as rollout.val_kwargs says.
    assert [len(requests) for requests in rig.calls("validation")] == [2, 2, 1] * 3
    for requests in rig.calls("validation"):
        assert [request.sampling.seed for request in requests] == [5 + i for i in range(len(requests))]
        for request in requests:
            sampling = request.sampling
            assert (sampling.n, sampling.temperature, sampling.top_p, sampling.top_k) == (2, 0.5, 0.8, 3)
    # Two samples of each prompt score 1 and 0 (tests/driver/fit_rig.py).
    assert all(value == 0.5 for _, value in rig.history["val/val/score/mean"])

    later = run_rig(tmp_path / "later", *validation, val_prompts=5)  # trainer.val_before_train=false
    assert steps(later.history, "val/val/score/mean") == [2, 4]


def test_the_run_length_and_its_checkpoints_follow_the_trainer_section(tmp_path):
    rig = run_rig(tmp_path / "steps", "trainer.total_steps=3", "trainer.save_freq=2", "trainer.max_ckpt_to_keep=1")
    assert steps(rig.history, "critic/score/mean") == [1, 2, 3]
    assert rig.ranks.calls.count("save_checkpoint") == 2  # every trainer.save_freq steps, and at the end
    assert sorted(p.name for p in (tmp_path / "steps" / "checkpoints").glob("step_*")) == ["step_3"]
    kept = run_rig(tmp_path / "kept", "trainer.total_steps=3", "trainer.save_freq=2")
    assert sorted(p.name for p in (tmp_path / "kept" / "checkpoints").glob("step_*")) == ["step_2", "step_3"]
    # Without total_steps: total_epochs passes over 6 prompts in batches of 2.
    epochs = run_rig(tmp_path / "epochs", "trainer.total_steps=null", "trainer.total_epochs=2",
                     "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", train_prompts=6)
    assert steps(epochs.history, "critic/score/mean") == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in epochs.history["training/epoch"]] == [0, 0, 0, 1, 1, 1]


def test_gae_discounts_with_gamma_and_lam(tmp_path):
    rig = run_rig(tmp_path, "algorithm.adv_estimator=gae", "algorithm.gamma=0.9", "algorithm.lam=0.5",
                  "critic.ppo_mini_batch_size=4")
    assert "compute_values" in rig.ranks.calls
    for batch in rig.ranks.updates["critic"]:
        # Values are 0, so the return at token t is the outcome reward discounted by (gamma * lam) per later token.
        mask = batch.response_mask
        lengths = mask.sum(-1, keepdim=True)
        after = (lengths - 1 - torch.arange(mask.shape[1])).clamp(min=0)
        scores = (batch.returns * mask).max(-1).values  # the return at the last token is the score itself
        assert torch.allclose(batch.returns, scores.unsqueeze(-1) * 0.45 ** after * mask)
        assert set(scores.tolist()) == {0.0, 1.0} and lengths.max() > 1


def test_grpo_divides_by_the_group_std_only_when_asked(tmp_path):
    # Every group scores [1, 0]: mean 0.5, unbiased std sqrt(0.5).
    plain = run_rig(tmp_path / "plain", "algorithm.norm_adv_by_std_in_grpo=false")
    normed = run_rig(tmp_path / "normed")
    for batch in plain.ranks.updates["actor"]:
        assert set(batch.advantages[batch.response_mask.bool()].tolist()) == {0.5, -0.5}
    for batch in normed.ranks.updates["actor"]:
        expected = 0.5 / (math.sqrt(0.5) + 1e-6)
        assert torch.allclose(batch.advantages[batch.response_mask.bool()].abs(), torch.tensor(expected))


def test_kl_in_the_reward_uses_its_estimator_and_controller(tmp_path):
    rig = run_rig(tmp_path, "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.use_kl_in_reward=true",
                  "algorithm.kl_penalty=k2", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.2",
                  "algorithm.kl_ctrl.target_kl=0.11", "algorithm.kl_ctrl.horizon=10",
                  ranks=FakeRanks(log_prob=0.0, ref_log_prob=-0.5))
    assert "compute_ref_log_prob" in rig.ranks.calls
    kl = 0.5 * 0.5**2  # k2 of log-probs 0 (policy) and -0.5 (reference), on every token
    assert rig.history["actor/reward_kl_penalty"] == [(1, pytest.approx(kl)), (2, pytest.approx(kl))]
    # Adaptive: after step 1's 8 rows the coefficient moves by (kl / target_kl - 1) * 8 / horizon.
    assert rig.history["actor/reward_kl_penalty_coeff"] == [
        (1, pytest.approx(0.2)), (2, pytest.approx(0.2 * (1 + (kl / 0.11 - 1) * 8 / 10)))]
    # The penalty is in the rewards: REINFORCE++'s return at the first token (gamma 1) is score - coef * kl * length.
    batch = rig.ranks.updates["actor"][0]
    lengths = batch.response_mask.sum(-1)
    scores = batch.returns[:, 0] + 0.2 * kl * lengths
    assert torch.allclose(scores, scores.round()) and set(scores.round().tolist()) == {0.0, 1.0}


@pytest.mark.parametrize("overrides, pass_runs", [
    ((), False),  # one epoch of one mini-batch: the update's own forward is the sampling policy
    (("actor.ppo_epochs=2",), True),
    (("actor.ppo_mini_batch_size=2",), True),
    (("algorithm.use_kl_in_reward=true",), True),  # the penalty needs them before the advantages
    (("algorithm.rollout_correction.rollout_is=token",), True),  # the correction compares them with the engine's
    (("trainer.mode=one_step_off", "placement.mode=disaggregate", "placement.rollout_nnodes=1",
      "placement.rollout_gpus_per_node=1"), True),  # samples from older weights than the update's
])
def test_the_old_log_prob_pass_runs_only_when_the_update_is_not_on_policy(tmp_path, overrides, pass_runs):
    rig = run_rig(tmp_path, *overrides)
    assert rig.ranks.calls.count("compute_log_prob") == (2 if pass_runs else 0)
    assert all((batch.old_log_probs is not None) == pass_runs for batch in rig.ranks.updates["actor"])
    assert ("timing_s/old_log_prob" in rig.history) == pass_runs


def test_dynamic_sampling_generates_up_to_its_round_limit(tmp_path):
    stuck = run_rig(tmp_path / "stuck", "algorithm.dynamic_sampling.enable=true",
                    "algorithm.dynamic_sampling.max_num_gen_batches=3", reward=constant)
    assert stuck.history["training/num_gen_batches"] == [(1, 3), (2, 3)]
    assert len(stuck.calls("rollout")) == 6
    assert len(stuck.ranks.updates["actor"][0]) == 8  # nothing varied: the last round, all-zero advantages
    varied = run_rig(tmp_path / "varied", "algorithm.dynamic_sampling.enable=true")
    assert varied.history["training/num_gen_batches"] == [(1, 1), (2, 1)]


def test_the_reward_managers_metrics_cover_every_dynamic_sampling_round(tmp_path):
    """DAPO's manager with a rule that scores 0 (every group all-equal, so each step runs all 3 rounds) and raises
    on one-token responses. Prompt i's sample s is 1 + (2 + i + s) % 3 tokens (fit_rig); unshuffled, step 1 scores
    prompts 0-3, 4-7, 0-3: 3, 3 and 3 one-token responses; 3, 2 and 3 of 3 tokens, past max_response_length -
    overlong_buffer.length = 2 and so penalised 1 each. Step 2 scores 4-7, 0-3, 4-7."""
    (tmp_path / "rule.py").write_text(textwrap.dedent("""
        def rule(data_source, solution_str, ground_truth, extra_info):
            if len(solution_str.split()) == 1:
                raise ValueError("one token")
            return 0.0
    """))
    manager = DAPORewardManager(f"{tmp_path / 'rule.py'}:rule", 0, 30.0, max_response_length=3,
                                overlong_buffer_length=1, overlong_penalty_factor=1.0)
    rig = run_rig(tmp_path / "run", "data.shuffle=false", "algorithm.dynamic_sampling.enable=true",
                  "algorithm.dynamic_sampling.max_num_gen_batches=3", reward_manager=manager)
    assert rig.history["training/num_gen_batches"] == [(1, 3), (2, 3)]
    assert rig.history["reward/errors"] == [(1, 9.0), (2, 9.0)]  # summed over the rounds, not the last round's 3
    assert rig.history["reward/timeouts"] == [(1, 0.0), (2, 0.0)]
    assert rig.history["reward/overlong_ratio"] == [(1, pytest.approx(8 / 24)), (2, pytest.approx(7 / 24))]
    assert rig.history["reward/overlong_penalty/mean"] == [(1, pytest.approx(-8 / 24)), (2, pytest.approx(-7 / 24))]


def test_validation_logs_the_reward_managers_errors_beside_the_scores(tmp_path):
    """A reward function that fails only on some held-out answers: each validation counts its failures (over every
    validation batch, not the last one's) and they score 0."""
    (tmp_path / "rule.py").write_text(textwrap.dedent("""
        def rule(data_source, solution_str, ground_truth, extra_info):
            if solution_str.split()[0] == "1":  # the second sample of every prompt (tests/driver/fit_rig.py)
                raise ValueError("unparsable")
            return 1.0
    """))
    manager = NaiveRewardManager(f"{tmp_path / 'rule.py'}:rule")
    rig = run_rig(tmp_path / "run", "data.val_files=[val.jsonl]", "data.val_batch_size=2", "rollout.val_kwargs.n=2",
                  "trainer.test_freq=2", "trainer.total_steps=2", "trainer.val_before_train=true", val_prompts=5,
                  reward_manager=manager)
    assert rig.history["val/reward/errors"] == [(0, 5.0), (2, 5.0)]  # 5 prompts x 1 failing sample, in 3 batches
    assert rig.history["val/val/score/mean"] == [(0, 0.5), (2, 0.5)]


def test_rollout_correction_weights_and_rejects_what_the_actor_trains_on(tmp_path):
    """The rig's engines report log-prob -0.5 per token and its ranks recompute 0: every token's ratio is e^0.5,
    a sequence of n tokens has e^(n/2); responses are 1 to 3 tokens long."""
    def lengths(batch):
        return batch.response_mask.sum(-1)

    plain = run_rig(tmp_path / "plain")
    assert all(batch.rollout_is_weights is None for batch in plain.ranks.updates["actor"])
    assert not any(name.startswith("rollout_corr/") for name in plain.history)

    tis = run_rig(tmp_path / "tis", "algorithm.rollout_correction.rollout_is=token",
                  "algorithm.rollout_correction.rollout_is_threshold=1.5")
    for batch in tis.ranks.updates["actor"]:
        torch.testing.assert_close(batch.rollout_is_weights, 1.5 * batch.response_mask)
    assert [value for _, value in tis.history["rollout_corr/is_capped_fraction"]] == [1.0, 1.0]
    assert tis.history["rollout_corr/token_ratio_mean"][0][1] == pytest.approx(math.exp(0.5))

    mis = run_rig(tmp_path / "mis", "algorithm.rollout_correction.rollout_is=sequence",
                  "algorithm.rollout_correction.rollout_is_mode=mask",
                  "algorithm.rollout_correction.rollout_is_threshold=3")
    for batch in mis.ranks.updates["actor"]:
        sequence_ratio = torch.exp(0.5 * lengths(batch))  # e^0.5, e, e^1.5 > 3 (masked)
        expected = torch.where(sequence_ratio <= 3, sequence_ratio, 0.0).unsqueeze(-1) * batch.response_mask
        torch.testing.assert_close(batch.rollout_is_weights, expected)

    # Sequences of 3 tokens (ratio e^1.5 = 4.48) fall outside [1/3, 3] and leave the loss; their advantage too.
    rejected = run_rig(tmp_path / "rs", "algorithm.rollout_correction.rollout_rs=sequence",
                       "algorithm.rollout_correction.rollout_rs_threshold=3")
    for batch in rejected.ranks.updates["actor"]:
        assert batch.rollout_is_weights is None
        long_rows = batch.attention_mask.sum(-1) - 2 == 3  # every rig prompt is 2 tokens
        assert long_rows.any() and (lengths(batch)[long_rows] == 0).all() and (lengths(batch)[~long_rows] > 0).all()
        assert (batch.advantages[long_rows] == 0).all()
    share = [value for _, value in rejected.history["rollout_corr/rejected_seq_fraction"]]
    assert all(0 < value < 1 for value in share)
    # response_length still counts every generated token.
    assert rejected.history["response_length/max"] == plain.history["response_length/max"]

    vetoed = run_rig(tmp_path / "veto", "algorithm.rollout_correction.rollout_token_veto_threshold=2")
    assert all(lengths(batch).sum() == 0 for batch in vetoed.ranks.updates["actor"])  # every ratio is below 2
    lower = run_rig(tmp_path / "lower", "algorithm.rollout_correction.rollout_rs=token",
                    "algorithm.rollout_correction.rollout_rs_threshold=3",
                    "algorithm.rollout_correction.rollout_rs_threshold_lower=1.7")  # e^0.5 = 1.65 < 1.7
    assert all(lengths(batch).sum() == 0 for batch in lower.ranks.updates["actor"])
