"""How the spec becomes the policy rank's worker settings (the actor's loss and its knobs)."""
from rlmegatron.algorithms import PolicyLossConfig
from rlmegatron.config import spec_from_raw
from rlmegatron.controller.policy_rank import actor_settings
from tests.config.specs import minimal_spec


def test_the_actor_gets_the_chosen_loss_and_every_knob():
    spec = spec_from_raw(minimal_spec(), [
        "actor.policy_loss.loss_mode=clip_cov", "actor.policy_loss.clip_cov_ratio=0.01",
        "actor.policy_loss.clip_cov_lb=0.5", "actor.policy_loss.clip_cov_ub=2.0", "actor.clip_ratio_low=0.1",
        "actor.clip_ratio_high=0.28", "actor.tis_imp_ratio_cap=2.0"])
    settings = actor_settings(spec, 1)
    assert settings.policy_loss == "clip_cov"
    assert settings.policy_loss_config == PolicyLossConfig(
        clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=3.0, tis_cap=2.0, clip_cov_ratio=0.01,
        clip_cov_lb=0.5, clip_cov_ub=2.0)
    kl_cov = actor_settings(spec_from_raw(minimal_spec(), [
        "actor.policy_loss.loss_mode=kl_cov", "actor.policy_loss.kl_cov_ratio=0.05",
        "actor.policy_loss.ppo_kl_coef=1.0"]), 1)
    assert (kl_cov.policy_loss, kl_cov.policy_loss_config.kl_cov_ratio, kl_cov.policy_loss_config.ppo_kl_coef) == (
        "kl_cov", 0.05, 1.0)
    no_dual_clip = actor_settings(spec_from_raw(minimal_spec(), ["actor.clip_ratio_c=null"]), 1)
    assert no_dual_clip.policy_loss_config.clip_ratio_c is None
    assert actor_settings(spec_from_raw(minimal_spec(), ["algorithm.adv_estimator=gspo"]), 1).policy_loss == "gspo"
