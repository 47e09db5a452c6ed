"""On-policy distillation's teacher in PolicyRank on 2 gloo ranks: a model of its own (seeded HF weights, not the
student's random ones), loaded from its HF checkpoint or from an `rlm convert hf-to-mcore` one, at its own layout and
batching, offloaded between phases; its log-probs of the sampled tokens are transformers' to float rounding."""
import os
from pathlib import Path

import pytest
import torch

from rlmegatron.transport.local_ranks import run_ranks
from tests.rank.test_policy_rank import max_diff, recording_micro_batches, write_hf_model

REPO_ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5
# The quickstart's student (random weights, TP=1 x DP=2) distilling from the HF model; synthetic batches of
# tests/rank/roles/jobs.py (6 + 6 tokens).
COMMON = ["algorithm.distill.only=true", "data.max_prompt_length=6", "data.max_response_length=6"]
RUNS = {
    # The teacher at the student's layout, micro-batches of 3 sequences, offloaded between its phases.
    "student_layout": ["teacher.log_prob_micro_batch_size_per_gpu=3", "teacher.offload.params=true"],
    # TP=2 with sequence parallelism, micro-batches by a 16-token budget.
    "tp2": ["teacher.megatron.tensor_model_parallel_size=2", "teacher.megatron.sequence_parallel=true",
            "teacher.log_prob_use_dynamic_bsz=true", "teacher.log_prob_max_token_len_per_gpu=16"],
    # Two pipeline stages.
    "pp2": ["teacher.megatron.pipeline_model_parallel_size=2"],
    # The converted checkpoint (written at TP=2 below) loaded at TP=1 x PP=2.
    "converted": ["teacher.megatron.pipeline_model_parallel_size=2"],
}


def hf_log_probs(model_dir: str, batch) -> torch.Tensor:
    """transformers' log p(response token) [B, R] of each row's real tokens, 0 outside the response."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    width = batch.response_mask.shape[1]
    out = torch.zeros(batch.response_mask.shape)
    for row, (ids, mask, response) in enumerate(zip(batch.input_ids, batch.attention_mask, batch.response_mask)):
        tokens = ids[mask.bool()]
        answer = int(response.sum())
        with torch.no_grad():
            logits = model(input_ids=tokens[None]).logits[0].double()
        log_probs = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, tokens[1:, None]).squeeze(-1)
        out[row, :answer] = log_probs[len(tokens) - 1 - answer:].float()
        assert width >= answer
    return out


def _teacher_job(workdir: str, teacher: str) -> dict:
    from rlmegatron.driver.role_settings import trainer_rank_settings
    from rlmegatron.entry.convert_command import hf_to_mcore
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.rank.policy_rank import PolicyRank
    from rlmegatron.runtime import ParallelLayout
    from tests.rank.roles.jobs import rollout_batch

    os.chdir(REPO_ROOT)  # the quickstart spec's paths are relative to the repository
    converted = os.path.join(workdir, "mcore")
    hf_to_mcore(teacher, converted, ParallelLayout(tp=2))
    micro_batches = recording_micro_batches()
    batch = rollout_batch(n=8)
    reports = {}
    for name, overrides in RUNS.items():
        path = converted if name == "converted" else teacher
        spec = load_spec("configs/quickstart.yaml", [*COMMON, *overrides, f"trainer.run_dir={workdir}/{name}",
                                                     f"teacher.path={path}"])
        rank = PolicyRank(trainer_rank_settings(spec, spec.trainer.total_steps))
        models = rank.models
        micro_batches.clear()
        reports[name] = {
            "layouts": {role: str(layout) for role, layout in models.layouts.items()},
            "teacher_log_probs": rank.compute_teacher_log_prob(batch),
            "student_log_probs": rank.compute_log_prob(batch),
            "teacher_micro_batches": micro_batches[0],
            "offloaded": models.offload_parts.get("teacher", ()),
        }
        rank.shutdown()
    return reports


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("teacher")
    teacher = str(write_hf_model(workdir / "teacher"))
    reports = run_ranks(_teacher_job, 2, str(workdir), teacher, timeout_s=300)
    for name in RUNS:
        assert torch.equal(reports[0][name]["teacher_log_probs"], reports[1][name]["teacher_log_probs"]), name
    from tests.rank.roles.jobs import rollout_batch

    return reports[0], hf_log_probs(teacher, rollout_batch(n=8))


def test_the_teachers_log_probs_are_its_hf_models_at_every_layout_and_from_its_converted_checkpoint(runs):
    reports, expected = runs
    assert expected.abs().sum() > 0
    layouts = {name: report["layouts"]["teacher"] for name, report in reports.items()}
    assert layouts == {"student_layout": "TP1xPP1xETP1", "tp2": "TP2xPP1xETP2xSP", "pp2": "TP1xPP2xETP1",
                       "converted": "TP1xPP2xETP1"}
    for name, report in reports.items():
        assert set(report["layouts"]) == {"actor", "teacher"}  # no reference: no KL term
        assert max_diff(report["teacher_log_probs"], expected) < TOLERANCE, name
        # The student is the quickstart's random model, not the teacher.
        assert max_diff(report["student_log_probs"], expected) > 0.1


def test_the_teacher_batches_and_offloads_as_its_section_says(runs):
    reports, _ = runs
    # teacher.log_prob_micro_batch_size_per_gpu=3: this DP rank's 4 sequences as 3 + 1.
    assert [n for n, _ in reports["student_layout"]["teacher_micro_batches"]] == [3, 1]
    # teacher.log_prob_use_dynamic_bsz at TP=2 (one DP rank, 8 sequences): micro-batches of at most 16 tokens.
    budget = reports["tp2"]["teacher_micro_batches"]
    assert len(budget) > 1 and max(t for _, t in budget) <= 16 and sum(n for n, _ in budget) == 8
    # Unset, it follows the student's log-prob batching (the quickstart's 32 sequences): PP=2's one DP rank's 8 at once.
    assert [n for n, _ in reports["pp2"]["teacher_micro_batches"]] == [8]
    assert reports["student_layout"]["offloaded"] == ("params",) and reports["pp2"]["offloaded"] == ()
