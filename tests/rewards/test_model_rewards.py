"""Rewards from a reward model: alone (the rule does not run), as a weighted sum with the rule's scores, or through
a combiner plug-in; shaped like the rule's (DAPO); the model reads the policy's tokens when it shares the tokenizer
and chat template, else its own chat template over the texts."""
import shutil
import textwrap
from pathlib import Path

import pytest

from rlmegatron.rewards import DAPORewardManager, NaiveRewardManager, NonFiniteReward, RewardInput
from rlmegatron.rewards.model import ModelRewardManager, sequence_encoder

REPO_ROOT = Path(__file__).resolve().parents[2]
PLUGINS = textwrap.dedent("""
    calls = []

    def rule(data_source, solution_str, ground_truth, extra_info):
        calls.append(solution_str)
        return 1.0 if solution_str == ground_truth else 0.0

    def prefer_correct(model_score, rule_score, item):
        return model_score if rule_score > 0 else -1.0 - len(item.solution_str)
""")


@pytest.fixture
def plugins(tmp_path):
    (tmp_path / "rm_plugins.py").write_text(PLUGINS)
    return f"{tmp_path / 'rm_plugins.py'}"


def items() -> list[RewardInput]:
    return [RewardInput(f"s#{i}", "src", answer, "4", response_length=len(answer), prompt=[{"role": "user",
                        "content": "2+2="}], token_ids=(7, 8, i)) for i, answer in enumerate(["4", "5", "44"])]


def fixed_model(scores):
    seen = []

    def score(sequences):
        seen.append(sequences)
        return list(scores)

    return score, seen


def test_the_model_alone_scores_without_running_the_rule(plugins):
    from rlmegatron.plugins import load_plugin

    score, seen = fixed_model([0.5, -0.25, 2.0])
    manager = ModelRewardManager(NaiveRewardManager(f"{plugins}:rule"), score, lambda item: list(item.token_ids),
                                 weight=2.0)
    result = manager(items())
    assert result.rewards == result.scores == [1.0, -0.5, 4.0]
    assert seen == [[[7, 8, 0], [7, 8, 1], [7, 8, 2]]]  # one call for the batch, in the policy's tokens
    assert load_plugin(f"{plugins}:calls") == []
    assert result.metrics["reward/model_score/mean"] == pytest.approx(2.25 / 3)


def test_a_weighted_sum_adds_the_rule_scores(plugins):
    score, _ = fixed_model([0.5, -0.25, 2.0])
    manager = ModelRewardManager(NaiveRewardManager(f"{plugins}:rule"), score, lambda item: [1], weight=0.5,
                                 rule_weight=3.0)
    result = manager(items())
    assert result.rewards == [0.25 + 3.0, -0.125, 1.0]
    assert result.metrics["reward/rule_score/mean"] == pytest.approx(1 / 3)


def test_a_combiner_plugin_computes_the_reward(plugins):
    from rlmegatron.plugins import load_plugin

    score, _ = fixed_model([0.5, -0.25, 2.0])
    manager = ModelRewardManager(NaiveRewardManager(f"{plugins}:rule"), score, lambda item: [1],
                                 combiner=load_plugin(f"{plugins}:prefer_correct"))
    assert manager(items()).rewards == [0.5, -2.0, -3.0]


def test_the_rule_managers_overlong_penalty_shapes_the_combined_score(plugins):
    score, _ = fixed_model([1.0, 1.0, 1.0])
    dapo = DAPORewardManager(f"{plugins}:rule", 0, 30.0, max_response_length=4, overlong_buffer_length=2,
                             overlong_penalty_factor=1.0, overlong_buffer_enable=True)
    long_item = [RewardInput("s#0", "src", "4444", "4", response_length=4, token_ids=(1,))]
    result = ModelRewardManager(dapo, score, lambda item: [1])(long_item)
    assert result.scores == [1.0] and result.rewards == [0.0]  # past the buffer: -1 * (4 - 2) / 2


def test_a_nan_model_score_stops_the_run_naming_the_sample(plugins):
    score, _ = fixed_model([float("nan"), 0.0, 0.0])
    manager = ModelRewardManager(NaiveRewardManager(f"{plugins}:rule"), score, lambda item: [1])
    with pytest.raises(NonFiniteReward, match="reward.model: sample s#0 scored nan"):
        manager(items())


def test_the_model_reads_its_own_chat_template_when_it_differs_from_the_policys(tmp_path):
    from transformers import AutoTokenizer

    policy = AutoTokenizer.from_pretrained(REPO_ROOT / "configs" / "quickstart" / "model")
    assert sequence_encoder(policy, policy)(items()[0]) == [7, 8, 0]  # the policy's own tokens
    own = tmp_path / "rm_tokenizer"
    shutil.copytree(REPO_ROOT / "configs" / "quickstart" / "model", own)
    (own / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}")
    model = AutoTokenizer.from_pretrained(own)
    expected = model("<u>2+2=<a>5", add_special_tokens=False)["input_ids"]
    assert sequence_encoder(policy, model)(items()[1]) == expected
    plain = RewardInput("s#9", "src", "5", "4", response_length=1, prompt="2+2=", token_ids=(1,))
    assert sequence_encoder(policy, model)(plain) == model("2+2=5")["input_ids"]


def test_the_spec_hands_the_weights_and_the_combiner_to_the_manager(plugins):
    from rlmegatron.config.spec import RewardConfig
    from rlmegatron.rewards.model import model_reward_manager
    from transformers import AutoTokenizer

    policy = AutoTokenizer.from_pretrained(REPO_ROOT / "configs" / "quickstart" / "model")
    rules = NaiveRewardManager(f"{plugins}:rule")
    score, _ = fixed_model([0.5, -0.25, 2.0])
    model = {"path": str(REPO_ROOT / "configs" / "quickstart" / "model")}
    weighted = model_reward_manager(RewardConfig(model={**model, "weight": 0.5, "rule_weight": 3.0}), rules, score,
                                    policy)
    assert weighted(items()).rewards == [0.25 + 3.0, -0.125, 1.0]
    combined = model_reward_manager(RewardConfig(model={**model, "combiner": f"{plugins}:prefer_correct"}), rules,
                                    score, policy)
    assert combined(items()).rewards == [0.5, -2.0, -3.0]
