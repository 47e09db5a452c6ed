"""Plug-in algorithms the spec checks load: some fit their protocol, some do not (each says how)."""


def reinforce_loss(old_log_prob, log_prob, advantages, response_mask, config, aggregation, rollout_is_weights=None):
    return (-advantages * log_prob).sum(), {}


def loss_without_aggregation(old_log_prob, log_prob, advantages, response_mask, config):
    """Misses the aggregation keyword the actor passes."""
    return (-advantages * log_prob).sum(), {}


def centred_estimator(token_level_rewards, response_mask, *, group_index):
    scores = token_level_rewards.sum(-1)
    return (scores - scores.mean()).unsqueeze(-1) * response_mask, scores.unsqueeze(-1) * response_mask


def estimator_wanting_a_teacher(token_level_rewards, response_mask, *, teacher_scores):
    """Needs an input the trainer does not have."""
    return token_level_rewards, token_level_rewards


def value_baseline_estimator(token_level_rewards, response_mask, *, values, gamma):
    return token_level_rewards - values, token_level_rewards
