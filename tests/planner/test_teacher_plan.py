"""On-policy distillation's teacher in `rlm plan`: its weights at its own layout, a memory phase of its own (its
log-prob pass) with the idle roles beside it, a step-time phase (its forward over the step's tokens at its layout),
its offload counted, and a teacher too large for the GPU named with its layout."""
from pathlib import Path

import pytest

from rlmegatron.config import read_architecture
from rlmegatron.entry.cli import main
from rlmegatron.planner.parameters import count_parameters
from rlmegatron.planner.plan import PlanSettings, build_plan
from rlmegatron.planner.step_time import offload_seconds, training_seconds, workload_of
from rlmegatron.prelaunch.spec_pipeline import load_spec

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE = "configs/distill_qwen3_30b_a3b_from_235b.yaml"  # a 30B-A3B student, a 235B-A22B teacher on 16 GPUs


def plan_of(*overrides: str):
    spec = load_spec(REPO_ROOT / RECIPE, overrides)
    return spec, build_plan(spec, read_architecture(REPO_ROOT / spec.model.hf_config), PlanSettings())


def test_the_teacher_has_its_weights_at_its_layout_and_a_memory_phase_of_its_own(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    spec, plan = plan_of()
    teacher = count_parameters(read_architecture(REPO_ROOT / spec.teacher.hf_config))
    assert 234e9 < teacher.total < 236e9
    # TP 8 x PP 2 for its dense weights, EP 8 x PP 2 for its experts: a sixteenth of them per GPU, in bf16 (the
    # embedding and the output layer, each on one stage only, make the stages differ a little).
    assert 0.99 < plan.teacher.weights / (2 * teacher.total / 16) < 1.03
    assert plan.teacher.activations > 0
    phases = {phase.phase: phase for phase in plan.trainer_phases}
    assert list(phases) == ["actor_update", "teacher_log_prob", "rollout"]
    assert phases["teacher_log_prob"].parts["teacher"] == plan.teacher.total
    # Offloaded (teacher.offload.params), it takes nothing while the others run; kept, its weights stay resident.
    assert phases["rollout"].parts["teacher (idle)"] == 0.0
    _, kept = plan_of("teacher.offload.params=false")
    kept_phases = {phase.phase: phase for phase in kept.trainer_phases}
    assert kept_phases["rollout"].parts["teacher (idle)"] == kept.teacher.weights
    assert kept_phases["actor_update"].bytes == phases["actor_update"].bytes + kept.teacher.weights
    _, plain = plan_of("~teacher", "~algorithm.distill")
    assert plain.teacher is None and "teacher_log_prob" not in {phase.phase for phase in plain.trainer_phases}


def test_the_teachers_forward_is_a_step_time_phase_at_its_layout(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    spec, plan = plan_of()
    arch = read_architecture(REPO_ROOT / spec.teacher.hf_config)
    work, hw = workload_of(spec), PlanSettings().hardware(spec.placement.gpus_per_node)
    phases = plan.step_time.phases
    assert phases["teacher_log_prob"] == pytest.approx(training_seconds(
        arch, count_parameters(arch), spec.teacher.megatron, spec.placement.trainer_world_size, work, 1,
        spec.teacher.log_prob_max_token_len_per_gpu, hw))
    # A forward of a model of 22B active parameters against the student's of 3.35B.
    assert phases["teacher_log_prob"] > 4 * phases["old_log_prob"]
    # Its weights cross PCIe out and back each step (teacher.offload.params).
    _, kept = plan_of("teacher.offload.params=false")
    assert phases["offload"] - kept.step_time.phases["offload"] == pytest.approx(offload_seconds(plan.teacher.weights,
                                                                                                 hw))


def test_a_teacher_too_large_for_the_gpu_is_named_with_its_layout(monkeypatch, capsys):
    monkeypatch.chdir(REPO_ROOT)
    # Its experts over 4 GPUs only: a quarter of 235B parameters' experts on each.
    args = ["plan", RECIPE, "teacher.megatron.pipeline_model_parallel_size=1",
            "teacher.megatron.expert_model_parallel_size=4"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (f"{RECIPE}: teacher.megatron={{TP: 8, PP: 1, CP: 1, EP: 4, ETP: 1}}: needs an estimated" in err), err
    assert "during teacher_log_prob" in err and "more than the 80 GB GPU (--gpu-mem-gb)" in err


def test_the_layout_search_keeps_the_teachers_own_layout_and_prices_its_pass(monkeypatch, capsys):
    """The search varies the actor's layout; the teacher's stays its own (the actor's virtual stages once reached it
    and every candidate failed the teacher's checks)."""
    monkeypatch.chdir(REPO_ROOT)
    assert main(["plan", RECIPE, "--search", "--top", "1"]) == 0
    out = capsys.readouterr().out
    best = out[out.index("#1 ~"):]
    assert "teacher_log_prob" in best.splitlines()[0] and not any("teacher." in line for line in best.splitlines())
