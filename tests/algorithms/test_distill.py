"""On-policy distillation's advantage (algorithms/distill.py): -coef x the sampled tokens' reverse-KL estimate on the
response tokens, exactly 0 elsewhere, and its metrics' masked means."""
import pytest
import torch

from rlmegatron.algorithms import DISTILL_MODES, distill_advantages
from rlmegatron.algorithms.registry import UnknownNameError


def test_the_advantage_is_minus_coef_times_log_student_minus_log_teacher_on_the_response_tokens():
    student = torch.tensor([[-0.5, -2.0, -7.0], [-1.0, -3.0, -0.25]])
    teacher = torch.tensor([[-0.25, -4.0, 9.0], [-2.0, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages, metrics = distill_advantages(student, teacher, mask, coef=2.0)
    assert torch.equal(advantages, torch.tensor([[0.5, -4.0, 0.0], [-2.0, 4.0, -17.5]]))
    # Means over the 5 response tokens: (-0.25 + 2 + 1 - 2 + 8.75) / 5, and the teacher's (-0.25 - 4 - 2 - 1 - 9) / 5.
    assert metrics == {"distill/reverse_kl": pytest.approx(1.9, abs=1e-6), "distill/teacher_logp_mean": -3.25}


def test_reverse_kl_is_the_only_mode():
    assert DISTILL_MODES.names() == ("reverse_kl",)
    with pytest.raises(UnknownNameError):
        distill_advantages(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), coef=1.0, mode="forward_kl")


def test_the_group_mean_baseline_takes_each_prompts_mean_term_over_its_response_tokens_out():
    """Rows 0 and 1 answer one prompt (3 response tokens between them), row 2 another; the metrics stay the raw
    divergence's."""
    student = torch.tensor([[-1.0, -2.0], [-4.0, 0.0], [-1.0, -3.0]])
    teacher = torch.tensor([[-2.0, -2.0], [-1.0, 5.0], [-3.0, -4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    # Divergences: [1, 0], [-3, -], [2, 1]; group means (1 + 0 - 3) / 3 = -2/3 and (2 + 1) / 2 = 1.5.
    advantages, metrics = distill_advantages(student, teacher, mask, coef=1.0, group_index=["p", "p", "q"])
    expected = -torch.tensor([[1 + 2 / 3, 0 + 2 / 3], [-3 + 2 / 3, 0.0], [0.5, -0.5]])
    assert torch.allclose(advantages, expected, atol=1e-6) and advantages[1, 1] == 0
    for group in ([0, 1], [2]):
        assert abs(float(advantages[group][mask[group].bool()].sum())) < 1e-6
    assert metrics["distill/reverse_kl"] == pytest.approx(0.2)
