"""The step-time model (planner/step_time.py): within 25% of the published figures it is calibrated against, with
their publishers' layouts, and the shape every estimate must have whatever the constants."""
import json

import pytest

from benchmarks.step_time_calibration import NEMO_RL, predict, sync_checks
from rlmegatron.entry.cli import main
from rlmegatron.planner.step_time import Hardware, sync_seconds
from tests.planner.test_memory import _plan, _spec


def _run(name: str, on_policy: bool = True):
    return next(run for run in NEMO_RL if run.name == name and run.on_policy == on_policy)


def test_deepseek_v3_on_256_h100_takes_nemo_rls_134_to_154_s_within_25_percent():
    total = predict(_run("DeepSeek-V3"))["total"]
    for published in (134, 154):
        assert total == pytest.approx(published, rel=0.25), total


def test_qwen3_30b_a3b_on_32_h100_processes_nemo_rls_925_to_1102_tokens_per_s_per_gpu_within_25_percent():
    run = _run("Qwen3-30B-A3B")
    tokens_per_s_per_gpu = run.samples * run.mean_sequence / predict(run)["total"] / run.gpus
    for published in (925, 1102):
        assert tokens_per_s_per_gpu == pytest.approx(published, rel=0.25), tokens_per_s_per_gpu


def test_verls_checkpoint_engine_sync_of_qwen3_30b_a3b_takes_about_7_s_within_25_percent():
    [verl] = [check for check in sync_checks() if check["name"].startswith("verl")]
    assert verl["predicted"] == pytest.approx(7.0, rel=0.25)


def test_a_sync_step_is_the_sum_of_its_phases_and_an_overlapped_one_the_longer_side_plus_the_sync():
    sync = _plan(_spec("qwen3-1.7b", {})).step_time
    assert not sync.overlapped and sync.total == pytest.approx(sum(sync.phases.values()))
    assert {"generation", "update", "weight_sync", "offload"} <= set(sync.phases)
    apart = _plan(_spec("qwen3-1.7b", {}, placement={"mode": "disaggregate", "rollout_nnodes": 1,
                                                      "rollout_gpus_per_node": 8},
                        trainer={"mode": "one_step_off", "val_before_train": False})).step_time
    training = sum(seconds for phase, seconds in apart.phases.items() if phase not in ("generation", "weight_sync"))
    assert apart.overlapped and "offload" not in apart.phases
    assert apart.total == pytest.approx(max(apart.phases["generation"], training) + apart.phases["weight_sync"])


def test_twice_the_data_parallel_gpus_halve_the_training_phases():
    two_mini_batches = {"ppo_mini_batch_size": 32}  # so an old-log-prob pass runs too
    one = _plan(_spec("qwen3-1.7b", {}, actor=two_mini_batches)).step_time.phases
    two = _plan(_spec("qwen3-1.7b", {}, actor=two_mini_batches,
                      placement={"nnodes": 2, "gpus_per_node": 8})).step_time.phases
    for phase in ("update", "old_log_prob"):
        assert two[phase] == pytest.approx(one[phase] / 2, rel=1e-9), phase


def test_full_recompute_adds_a_forward_to_the_update():
    plain = _plan(_spec("qwen3-1.7b", {})).step_time.phases
    recompute = _plan(_spec("qwen3-1.7b", {"recompute_granularity": "full"})).step_time.phases
    assert recompute["update"] == pytest.approx(plain["update"] * 4 / 3, rel=1e-9)


def test_longer_responses_lengthen_generation_more_than_in_proportion_to_their_steps_alone():
    spec = _spec("qwen3-1.7b", {})
    short = _plan(spec).step_time.phases["generation"]
    long = _plan(_spec("qwen3-1.7b", {}, data={"max_response_length": 2048})).step_time.phases["generation"]
    assert long > 2 * short * 0.99  # twice the steps, each reading a longer KV cache


def test_a_colocated_sync_gathers_over_the_network_only_when_the_trainers_shards_span_nodes():
    hw = Hardware()
    within = sync_seconds(10e9, colocated=True, trainer_shards=8, hw=hw)
    across = sync_seconds(10e9, colocated=True, trainer_shards=16, hw=hw)
    assert across > 5 * within  # NVLink 450 GB/s against 50 GB/s of network


def test_rlm_plan_prints_the_estimate_and_its_json_carries_step_time_s_and_each_phase(capsys):
    recipe = "configs/gsm8k_qwen3_1p7b_grpo.yaml"
    assert main(["plan", recipe, "--json", "--response-tokens", "300"]) == 0
    plan = json.loads(capsys.readouterr().out)
    phases = plan["step_time"]["phases_s"]
    assert plan["step_time_s"] == pytest.approx(sum(phases.values())) and phases["generation"] > 0
    assert any("300 tokens on average" in line for line in plan["step_time"]["assumptions"])
    assert main(["plan", recipe]) == 0
    out = capsys.readouterr().out
    assert "step time, estimated (a model, not a measurement" in out and "  generation " in out
