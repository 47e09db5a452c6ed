"""The reward-model worker scores sequences as transformers' `*ForSequenceClassification` does, at TP=1 and TP=2
(with sequence parallelism) on CPU/gloo; a model that is not one is named in one line."""
from pathlib import Path

import pytest
import torch

from rlmegatron.runtime import ParallelLayout as L
from rlmegatron.transport.local_ranks import run_ranks
from tests.models.tiny_hf import COMMON, FAMILY_CONFIGS
from tests.rank.roles.reward_model_jobs import reward_model_job

SEQUENCES = [[5, 9, 14, 3], [7, 1, 2, 8, 9, 10, 11], [3], [20, 21, 22, 23, 24], [100, 2, 100, 2, 100, 2]]


def save_sequence_classifier(directory: Path, num_labels: int = 1, seed: int = 5) -> Path:
    """A tiny random Qwen3 reward model (one label, as verl's reward models)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model("qwen3", **{**COMMON, **FAMILY_CONFIGS["qwen3"], "tie_word_embeddings": False,
                                             "num_labels": num_labels, "pad_token_id": 0})
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def hf_scores(directory: Path, sequences: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():  # one at a time: no padding to get wrong
        return torch.cat([model(input_ids=torch.tensor([tokens])).logits[:, 0] for tokens in sequences])


def test_scores_equal_transformers_at_tp1_and_tp2(tmp_path):
    path = save_sequence_classifier(tmp_path / "rm")
    expected = hf_scores(path, SEQUENCES)
    assert expected.std() > 1e-3, "the sequences must score differently for the comparison to mean anything"
    layouts = [L(), L(tp=2), L(tp=2, sequence_parallel=True)]
    reports = run_ranks(reward_model_job, 2, str(path), layouts, SEQUENCES, timeout_s=300)
    for report in reports:
        for layout in layouts:
            assert (report[str(layout)] - expected).abs().max() < 1e-4, layout


def test_a_model_without_one_score_label_is_named_in_one_line(tmp_path):
    from rlmegatron.transport.local_ranks import RankFailure

    path = save_sequence_classifier(tmp_path / "two_labels", num_labels=2)
    with pytest.raises(RankFailure, match=r"reward.model.path=.*two_labels: not a reward/value model with one label"):
        run_ranks(reward_model_job, 1, str(path), [L()], SEQUENCES, timeout_s=300)
