"""The step-time model (planner/step_time.py): within 25% of the published figures held out of its fit, with their
publishers' layouts, its constants those the fit rows give, and the shape every estimate must have whatever the
constants: overlap, the KV cache's batch, the length tail, bytes per receiver."""
import dataclasses
import json
from math import exp

import pytest

from benchmarks.step_time_calibration import (FREE, NEMO_RL, RELEASES, UNSOURCED, cases, constants_of, fit, predict,
                                              run_name, sync_checks)
from rlmegatron.entry.cli import main
from rlmegatron.config import read_architecture
from rlmegatron.planner.memory import engine_memory
from rlmegatron.planner.parameters import checkpoint_tensors, count_parameters
from rlmegatron.planner.step_time import (FITTED, FITTED_BY_RELEASE, Hardware, Workload, generation_seconds,
                                          length_scale, longest_response, sync_seconds)
from tests.config.specs import MODELS_DIR
from tests.planner.test_memory import _plan, _spec

COLOCATED_REFIT = "NeMo-RL refit, DeepSeek-V3, PP16 x EP16 -> TP32, colocated (unsourced)"


def _run(name: str, on_policy: bool = True, version: str = "v0.4"):
    return next(run for run in NEMO_RL if run.name == name and run.on_policy == on_policy and run.version == version)


# The held-out figures the model misses (benchmarks/RESULTS.md, "Step-time model out of sample"): what the published
# data leave unexplained, kept visible here; strict, so a model that comes to explain them says so.
_DEEPSEEK_TRAINING = ("training takes ~60 s on 256 H100s by v0.6's three DeepSeek-V3 rows (on 256 and 512 GPUs, 1-step "
                      "off on 512), 2.6-5.6x the 11-23 s the FLOPs, PP16's bubble and EP16's all-to-alls give at the "
                      "MoE efficiency the Qwen3 runs fit; Megatron trains it as fast per FLOP as Qwen3-235B with "
                      "experts force-balanced, NeMo-RL's recipes do not balance them, and no published quantity "
                      "(per-phase times, expert load per EP rank) sizes that")
KNOWN_MISSES = {
    "DeepSeek-V3 on 256 (v0.4)": _DEEPSEEK_TRAINING,
    "DeepSeek-V3 on 256 (v0.6)": _DEEPSEEK_TRAINING,
    "DeepSeek-V3 on 512 (v0.6)": _DEEPSEEK_TRAINING,
    COLOCATED_REFIT: "unsourced (../shared/DESIGN.md; in no NeMo-RL document or commit found): 45,395 tensors loaded "
                     "in 2.4-2.8 s is at most 53-62 us a tensor at infinite bandwidth, against the ~0.27 ms a tensor "
                     "that NeMo-RL's own checkpoint-engine benchmark (14.21 s over NCCL) and verl's sync give together",
}
@pytest.fixture(scope="module")
def all_cases():
    return cases()


@pytest.mark.parametrize("name", [run_name(run) for run in NEMO_RL if run.role == "held out"] + [COLOCATED_REFIT])
def test_each_held_out_run_is_predicted_within_25_percent(all_cases, name, request):
    if name in KNOWN_MISSES:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[name]))
    [case] = [case for case in all_cases if case.name == name]
    assert case.role in ("held out", UNSOURCED)  # never fitted
    assert case.predict(constants_of(case, FITTED_BY_RELEASE))["total"] == pytest.approx(case.published, rel=0.25)


def test_the_fitted_constants_are_what_the_fit_runs_alone_give(all_cases):
    refit = fit([case for case in all_cases if case.role == "fit"])
    for release in RELEASES:
        for name in FREE:
            assert getattr(refit[release], name) == pytest.approx(getattr(FITTED_BY_RELEASE[release], name),
                                                                  rel=0.02), (release, name)


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
    within = sync_seconds(10e9, colocated=True, trainer_shards=8, hw=hw, bucket_bytes=512 << 20)
    across = sync_seconds(10e9, colocated=True, trainer_shards=16, hw=hw, bucket_bytes=512 << 20)
    held = sync_seconds(10e9, colocated=True, trainer_shards=1, hw=hw, bucket_bytes=512 << 20)  # nothing gathered
    # The gathered share, (s - 1) / s of the bytes, over NVLink's 450 GB/s within a node, the network's 50 across.
    assert across - held == pytest.approx((within - held) * (15 / 16) / (7 / 8) * 450 / 50, rel=1e-9)


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


def _overlap_pair():
    # Two mini-batches, so both run the old-log-prob pass (one step off always needs it).
    placement, actor = {"mode": "disaggregate", "rollout_nnodes": 1, "rollout_gpus_per_node": 8}, \
        {"ppo_mini_batch_size": 32}
    sync = _plan(_spec("qwen3-1.7b", {}, placement=placement, actor=actor)).step_time
    ahead = _plan(_spec("qwen3-1.7b", {}, placement=placement, actor=actor,
                        trainer={"mode": "one_step_off", "val_before_train": False})).step_time
    return sync, ahead


def test_one_step_off_saves_exactly_the_overlapped_side_against_the_same_gpus_on_policy():
    sync, ahead = _overlap_pair()
    assert sync.phases == ahead.phases and not sync.overlapped and ahead.overlapped
    training = sum(seconds for phase, seconds in ahead.phases.items() if phase not in ("generation", "weight_sync"))
    # Generation of step n + 1 runs under training of step n: the shorter side disappears, the sync does not.
    assert sync.total - ahead.total == pytest.approx(min(ahead.phases["generation"], training), rel=1e-12)
    assert ahead.total >= ahead.phases["weight_sync"] + max(ahead.phases["generation"], training) * (1 - 1e-12)


def _generation(kv_tokens: int, samples: int = 512, mean: float = 1500, longest: int = 4096) -> float:
    arch = read_architecture(MODELS_DIR / "qwen3-32b")
    params = count_parameters(arch)
    engine = dataclasses.replace(engine_memory(_spec("qwen3-32b", {}), arch, params, 80e9), kv_tokens=kv_tokens)
    return generation_seconds(arch, params, engine, engines=1, tp=4, work=Workload(samples, 200, mean, longest),
                              weight_bytes=2.0, hw=Hardware())


def test_a_larger_kv_budget_shortens_generation_until_the_whole_batch_fits():
    per_sample = 200 + 1500
    times = [_generation(per_sample * held) for held in (64, 128, 256, 512, 1024)]
    assert times[0] > times[1] > times[2] > times[3]  # more samples decode at once, in fewer steps
    assert times[1] < 0.85 * times[0]
    assert times[4] == times[3]  # the batch already fits: a larger cache holds nothing more


def test_response_lengths_are_exponential_with_the_spec_mean_cut_at_its_maximum_and_the_longest_sets_the_steps():
    for mean, longest in ((500, 4096), (3000, 4096), (4000, 4096)):
        mu = length_scale(mean, longest)
        assert mu * (1 - exp(-longest / mu)) == pytest.approx(mean, rel=1e-9)
    # Few short responses: the longest of 8 stays under the limit; of 512, one reaches it.
    assert longest_response(300, 8192, 8) == pytest.approx(300 * (2.0794 + 0.5772 + 1 / 16), rel=1e-3)
    assert longest_response(300, 8192, 8) < 8192 == longest_response(3000, 8192, 512)
    # The same mean with a longer tail allowed takes longer: the batch waits for its longest response.
    assert _generation(10**7, samples=64, mean=1000, longest=2048) < _generation(10**7, samples=64, mean=1000,
                                                                                 longest=8192)


def test_a_refit_takes_the_bytes_each_receiver_gets_over_the_link_plus_a_latency_per_bucket_server_by_server():
    hw, bucket = Hardware(), 512 << 20
    one = sync_seconds(8 * bucket, colocated=False, trainer_shards=8, hw=hw, bucket_bytes=bucket)
    assert sync_seconds(16 * bucket, colocated=False, trainer_shards=8, hw=hw, bucket_bytes=bucket) == \
        pytest.approx(2 * one, rel=1e-12)
    assert one == pytest.approx(8 * bucket / (hw.network_gbps / 8 * 1e9 * FITTED.link) + 8 * FITTED.bucket_s)
    # Each tensor the receiver loads costs the same, whatever its size.
    assert sync_seconds(8 * bucket, colocated=False, trainer_shards=8, hw=hw, bucket_bytes=bucket, tensors=1000) == \
        pytest.approx(one + 1000 * FITTED.tensor_s, rel=1e-12)
    # Disaggregated, every server takes its turn: the same bytes and tensors reach a GPU of a TP-4 engine as of a TP-2
    # one (whole tensors), and 8 rollout GPUs hold half as many TP-4 servers, so the push takes half as long.
    spec = {"placement": {"mode": "disaggregate", "rollout_nnodes": 1, "rollout_gpus_per_node": 8}}
    tp2 = _plan(_spec("qwen3-1.7b", {}, rollout={"tensor_parallel_size": 2}, **spec))
    tp4 = _plan(_spec("qwen3-1.7b", {}, rollout={"tensor_parallel_size": 4}, **spec))
    assert tp4.sync.bytes_per_receiver == tp2.sync.bytes_per_receiver == tp2.sync.total_bytes
    assert (tp2.sync.servers_in_sequence, tp4.sync.servers_in_sequence) == (4, 2)
    assert tp4.step_time.phases["weight_sync"] == pytest.approx(tp2.step_time.phases["weight_sync"] / 2, rel=1e-12)
    assert sync_seconds(8 * bucket, colocated=False, trainer_shards=8, hw=hw, bucket_bytes=bucket, in_sequence=3) == \
        pytest.approx(3 * one, rel=1e-12)


def test_a_receiver_loads_each_checkpoint_tensor_and_deepseek_v3_has_nemo_rls_45395():
    """checkpoint_tensors against the weight map's HF keys (what the sync exports), and NeMo-RL's published count
    per vLLM rank (docs/guides/checkpoint-engine-refit.md)."""
    from rlmegatron.models.hf_config import model_facts, read_hf_config
    from rlmegatron.models.weight_map import WeightMap

    assert checkpoint_tensors(read_architecture(MODELS_DIR / "deepseek-v3")) == 45_395
    for model in ("deepseek-v3", "qwen3-30b-a3b", "llama-3.1-8b", "qwen3-1.7b"):
        facts = model_facts(read_hf_config(MODELS_DIR / model), 1, mtp_layers=0)
        assert checkpoint_tensors(read_architecture(MODELS_DIR / model)) == len(WeightMap(facts).hf_keys()), model
