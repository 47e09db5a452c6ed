"""`rlm train` with a reward model (`reward.model`) on two rank processes: a tiny reward model whose
preference is known by construction (the response digit nearest 7 scores highest) at TP=2 with sequence
parallelism and its weights offloaded between uses, scoring alone; the reward rises as the policy learns it.
On the pure-Python rig (tests/driver/fit_rig.py): the model's and the rule's scores reach the tracker apart."""
import math
import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from rlmegatron.rewards import NaiveRewardManager
from rlmegatron.rewards.model import ModelRewardManager
from tests.driver.fit_rig import run_rig
from tests.driver.test_train import REPO_ROOT, train

QUICKSTART_MODEL = REPO_ROOT / "configs" / "quickstart" / "model"


def save_preference_model(directory: Path, preferred: str = "7") -> tuple[Path, dict[int, float]]:
    """A Qwen3 sequence classifier over the quickstart's tokens whose score is cos(angle of the last token) * sqrt(H):
    attention and MLP outputs are zero, so the last position's hidden state is its token's embedding, and each
    embedding is a unit vector at an angle growing with its distance from `preferred`'s id. Returns the directory
    and each token's score."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART_MODEL)
    config = AutoConfig.from_pretrained(QUICKSTART_MODEL, num_labels=1, tie_word_embeddings=False,
                                        architectures=["Qwen3ForSequenceClassification"])
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    target = tokenizer.convert_tokens_to_ids(preferred)
    ids = torch.arange(config.vocab_size)
    angle = (ids - target).abs().float() * math.pi / config.vocab_size
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        embeddings = torch.zeros(config.vocab_size, config.hidden_size)
        embeddings[:, 0], embeddings[:, 1] = angle.cos(), angle.sin()
        model.model.embed_tokens.weight.copy_(embeddings)
        model.score.weight.zero_()
        model.score.weight[0, 0] = 1.0
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QUICKSTART_MODEL / name, directory / name)
    scale = math.sqrt(config.hidden_size)  # the final RMSNorm of a unit vector over H dims
    return directory, {int(i): float(a.cos()) * scale for i, a in zip(ids, angle)}


def test_the_reward_model_scores_alone_and_the_policy_learns_its_preference(tmp_path):
    path, scores = save_preference_model(tmp_path / "reward_model")
    result = train(tmp_path, "reward_model", "launched", "trainer.total_steps=10", "trainer.test_freq=-1",
                   "data.train_batch_size=8", "rollout.n=8",
                   "data.val_files=[]", "trainer.save_freq=10", "tracking.backends=[console]",
                   f"trainer.run_dir={tmp_path / 'run'}", "reward.function=null", "actor.optim.lr=1e-2",
                   f"reward.model.path={path}", "reward.model.tensor_model_parallel_size=2",
                   "reward.model.sequence_parallel=true", "reward.model.offload.params=true",
                   "reward.model.micro_batch_size_per_gpu=4", "reward.model.weight=0.5")
    rewards = [value for _, value in result["history"]["critic/score/mean"]]
    model_scores = [value for _, value in result["history"]["reward/model_score/mean"]]
    assert rewards == pytest.approx([0.5 * score for score in model_scores])  # the model alone, weighted
    # Every score is the model's, weighted: within its range, which no rule reaches (the quickstart's gives 0 or 1).
    assert all(0.5 * min(scores.values()) - 1e-4 <= reward <= 0.5 * max(scores.values()) + 1e-4 for reward in rewards)
    # From near the random policy's mean to most responses at the preferred digit (measured: 0.17 -> 3.80 of 4).
    assert rewards[-1] > rewards[0] + 1.0 and rewards[-1] > 0.8 * 0.5 * max(scores.values()), rewards


def test_the_reward_model_role_has_the_specs_layout_batching_and_offload(tmp_path):
    import json

    from rlmegatron.prelaunch.spec_pipeline import spec_from_raw
    from rlmegatron.driver.role_settings import trainer_rank_settings
    from rlmegatron.runtime import ParallelLayout
    from tests.config.specs import minimal_spec

    config = json.loads((QUICKSTART_MODEL / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForSequenceClassification"],
                                                      "id2label": {"0": "score"}}))
    spec = spec_from_raw(minimal_spec("tiny-qwen3"), [
        f"reward.model.path={tmp_path}", "reward.model.tensor_model_parallel_size=2",
        "reward.model.sequence_parallel=true", "reward.model.micro_batch_size_per_gpu=3",
        "reward.model.offload.params=true"])
    settings = trainer_rank_settings(spec, total_steps=1)
    role = settings.roles["reward"]
    assert settings.reward_model_path == str(tmp_path)
    assert role.layout == ParallelLayout(tp=2, sequence_parallel=True)
    assert (role.worker.micro_batch_size, role.offload) == (3, ("params",))
    assert "reward" not in trainer_rank_settings(spec_from_raw(minimal_spec("tiny-qwen3"), []), 1).roles


def test_the_model_and_rule_scores_are_logged_apart_each_step(tmp_path):
    """The rig's sample s starts with token s and is 1 + (2 + i + s) % 3 tokens long for prompt i (fit_rig). The
    model scores 2s + 1: 1 and 3 in every group, a mean of 2. The rule scores a response of all 3 tokens 1: prompts
    0-3 (step 1, unshuffled) have 3 of their 8 responses that long (i=0 s=0, i=2 s=1, i=3 s=0), prompts 4-7 two."""
    (tmp_path / "rule.py").write_text(textwrap.dedent("""
        def rule(data_source, solution_str, ground_truth, extra_info):
            return float(len(solution_str.split()) == 3)
    """))
    manager = ModelRewardManager(NaiveRewardManager(f"{tmp_path / 'rule.py'}:rule"),
                                 lambda sequences: [2.0 * ids[2] + 1.0 for ids in sequences],  # ids[2]: 1st response
                                 lambda item: list(item.token_ids), weight=0.5, rule_weight=2.0)
    history = run_rig(tmp_path / "run", "data.shuffle=false", reward_manager=manager).history
    assert history["reward/model_score/mean"] == [(1, 2.0), (2, 2.0)]
    assert history["reward/rule_score/mean"] == [(1, 3 / 8), (2, 2 / 8)]
    assert history["critic/score/mean"] == [(1, pytest.approx(0.5 * 2.0 + 2.0 * 3 / 8)),
                                            (2, pytest.approx(0.5 * 2.0 + 2.0 * 2 / 8))]
    assert history["reward/errors"] == history["reward/timeouts"] == [(1, 0.0), (2, 0.0)]
