"""The step-time model (planner/step_time.py): within 25% of the published figures held out of its fit, with their
publishers' layouts, its constants those the fit rows give, and the shape every estimate must have whatever the
constants: overlap, the KV cache's batch, the length tail, bytes per receiver."""
import dataclasses
import json
from math import exp

import pytest

from benchmarks.step_time_calibration import (FREE, NEMO_RL, NEMO_RL_TRANSPORT, OTHER_TRANSPORT, RELEASES, cases, twin_phases, twins,
                                              constants_of, fit, leave_one_out, predict, run_name,
                                              sync_checks)
from rlmegatron.entry.cli import main
from rlmegatron.config import read_architecture
from rlmegatron.config.spec import MegatronConfig
from rlmegatron.planner.memory import Transport, engine_memory
from rlmegatron.planner.parameters import checkpoint_tensors, count_parameters
from rlmegatron.planner.step_time import (FITTED, FITTED_BY_RELEASE, Hardware, Workload, export_seconds,
                                          generation_seconds, length_scale, longest_response, sync_seconds)
from tests.config.specs import MODELS_DIR
from tests.planner.test_memory import _plan, _spec


def _run(name: str, on_policy: bool = True, version: str = "v0.4"):
    return next(run for run in NEMO_RL if run.name == name and run.on_policy == on_policy and run.version == version)


@pytest.fixture(scope="module")
def all_cases():
    return cases()


@pytest.mark.parametrize("name", [run_name(run) for run in NEMO_RL if run.role == "held out"])
def test_each_held_out_run_is_predicted_within_25_percent(all_cases, name):
    [case] = [case for case in all_cases if case.name == name]
    assert case.role == "held out"  # never fitted
    assert case.predict(constants_of(case, FITTED_BY_RELEASE))["total"] == pytest.approx(case.published, rel=0.25)


def test_nemo_rls_nixl_refit_never_fitted_is_predicted_within_25_percent(all_cases):
    """The same export and loads as the NCCL refit the fit sees, another transport: each rank its own link and its
    expert shards only."""
    [nixl] = [case for case in all_cases if case.name.startswith("NeMo-RL NIXL")]
    assert nixl.role == OTHER_TRANSPORT
    assert nixl.predict(FITTED)["total"] == pytest.approx(9.25, rel=0.25)


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


def test_leaving_each_run_out_predicts_every_run_but_deepseek_v3s_within_25_percent():
    """Leave-one-out with DeepSeek-V3's runs out of every fit (they alone set the MLA constants, which no other run
    uses): every other step run and both sync benchmarks, each predicted by the constants the others give."""
    checked = 0
    for case, predicted, _ in leave_one_out(cases(), frozenset({"deepseek-v3"})):
        if case.role != OTHER_TRANSPORT and case.model != "deepseek-v3":
            assert predicted == pytest.approx(case.published, rel=0.25), case.name
            checked += 1
    assert checked == 16


def test_each_deepseek_v3_run_left_out_is_predicted_within_25_percent_by_what_every_other_run_gives(all_cases):
    """The MLA constants out of sample the other way round: each DeepSeek-V3 run, on policy or off, either release,
    predicted by the constants fitted on every other modelled run (the other four DeepSeek-V3 runs among them)."""
    modelled = [case for case in all_cases if case.role != OTHER_TRANSPORT]
    deepseek = [case for case in modelled if case.model == "deepseek-v3"]
    assert len(deepseek) == 5
    for case in deepseek:
        without = fit([other for other in modelled if other is not case])
        assert case.predict(constants_of(case, without))["total"] == pytest.approx(case.published, rel=0.25), \
            case.name


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


def _layout(tp=1, pp=1, ep=1) -> MegatronConfig:
    return MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          expert_model_parallel_size=ep, expert_tensor_parallel_size=1)


def test_the_export_gathers_over_nvlink_within_a_node_and_broadcasts_shards_between_stages():
    hw, size = Hardware(), 10e9
    gb = 1e9 * FITTED.link
    # TP 8 in a node: (8 - 1) / 8 of a dense model's bytes over NVLink; nothing crosses between stages at PP 1.
    assert export_seconds(size, 0.0, _layout(tp=8), 8, hw) == pytest.approx(size * 7 / 8 / (450 * gb), rel=1e-12)
    # Experts over EP 16, two whole nodes: a ring whose channels cross each node by its 8 links (400 GB/s).
    assert export_seconds(size, 1.0, _layout(ep=16), 16, hw) == pytest.approx(size * 15 / 16 / (400 * gb), rel=1e-12)
    # PP 4, each stage a node: each rank's TP shard leaves its stage (one link a GPU: every GPU of a node broadcasts
    # at once), then every stage gathers; dense weights split by TP, experts by EP x ETP.
    gather = size * 7 / 8 / (450 * gb)
    assert export_seconds(size, 0.0, _layout(tp=8, pp=4), 32, hw) == \
        pytest.approx(gather + size / 8 / (50 * gb), rel=1e-12)
    assert export_seconds(size, 0.5, _layout(tp=2, pp=4, ep=8), 32, hw) == pytest.approx(
        (size / 2 * 1 / 2 / 450 + size / 2 * 7 / 8 / 450 + (size / 2 / 2 + size / 2 / 8) / 50) / gb, rel=1e-12)
    # Stages within one node broadcast over NVLink; stages of 4 GPUs on 2 nodes, a group that crosses them, do not.
    assert export_seconds(size, 0.0, _layout(pp=4), 4, hw) == pytest.approx(size / (450 * gb), rel=1e-12)
    assert export_seconds(size, 0.0, _layout(tp=4, pp=4), 16, hw) == \
        pytest.approx((size * 3 / 4 / 450 + size / 4 / 50) / gb, rel=1e-12)


def test_an_nvlink_domain_of_several_nodes_prices_what_it_joins_as_one_node_does():
    """GB200 NVL72: 4-GPU trays, one NVLink fabric over 72 GPUs. A TP32 engine on the trays decodes and an EP16
    export gathers as they would in one 72-GPU node; on 4-GPU nodes without the fabric they cross the network."""
    arch = read_architecture(MODELS_DIR / "deepseek-v3")
    params = count_parameters(arch)
    spec = _spec("deepseek-v3", {}, placement={"nnodes": 64, "gpus_per_node": 4},
                    rollout={"tensor_parallel_size": 32})
    engine = engine_memory(spec, arch, params, 186e9)
    work = Workload(samples=512, prompt_tokens=128, response_tokens=600, max_response_tokens=1280)
    trays, fabric, one_node = Hardware(gpus_per_node=4), Hardware(gpus_per_node=4, nvlink_domain=72), \
        Hardware(gpus_per_node=72)

    def decode(hw):
        return generation_seconds(arch, params, engine, 8, 32, work, 2.0, hw)

    assert decode(fabric) == decode(one_node) < decode(trays)
    assert (fabric.link_gb_per_s(32), trays.link_gb_per_s(32)) == (450, 50)
    size = 10e9
    assert export_seconds(size, 1.0, _layout(ep=16), 16, fabric) == export_seconds(size, 1.0, _layout(ep=16), 16,
                                                                                   one_node)
    assert export_seconds(size, 1.0, _layout(ep=16), 16, fabric) < export_seconds(size, 1.0, _layout(ep=16), 16,
                                                                                  trays)
    assert Hardware().domain == 8 and fabric.domain == 72


def test_rlm_plan_takes_the_nvlink_domain_and_bandwidth_and_refuses_a_domain_smaller_than_a_node(capsys):
    recipe = "configs/deepseek_v3_671b_grpo.yaml"
    totals = {}
    for flags in ((), ("--nvlink-domain", "72"), ("--nvlink-domain", "72", "--nvlink-gb-per-s", "900")):
        assert main(["plan", recipe, "placement.gpus_per_node=4", "placement.nnodes=64", "--json", *flags]) == 0
        plan = json.loads(capsys.readouterr().out)
        totals[flags] = plan["step_time_s"]
        assert any(f"NVLink within {flags[1] if flags else 4} GPUs" in line
                   for line in plan["step_time"]["assumptions"])
    assert totals[()] > totals[("--nvlink-domain", "72")] > totals[("--nvlink-domain", "72", "--nvlink-gb-per-s",
                                                                      "900")]
    assert main(["plan", recipe, "--nvlink-domain", "4"]) == 2
    assert capsys.readouterr().err == (f"{recipe}: --nvlink-domain 4 is smaller than placement.gpus_per_node (8), "
                                       "whose GPUs NVLink already joins: give 8 or more, or leave it out\n")


def test_a_broadcast_over_whole_nodes_spreads_over_their_links_and_a_pipelined_refit_takes_its_slowest_part():
    hw, bucket = Hardware(), 512 << 20
    ours = sync_seconds(64 * bucket, colocated=False, hw=hw, bucket_bytes=bucket, tensors=1000, export_s=3.0)
    wide = Transport(links=8)
    spread = sync_seconds(64 * bucket, colocated=False, hw=hw, bucket_bytes=bucket, tensors=1000, export_s=3.0,
                          transport=wide)
    moved = 64 * bucket / (hw.network_gbps / 8 * 1e9 * FITTED.link)
    load = 64 * FITTED.bucket_s + 1000 * FITTED.tensor_s
    assert ours == pytest.approx(3.0 + moved + load, rel=1e-12)
    assert spread == pytest.approx(3.0 + moved / 8 + load, rel=1e-12)
    # Two buffers on each side: the export, the transfer and the loads of successive buckets overlap.
    piped = sync_seconds(64 * bucket, colocated=False, hw=hw, bucket_bytes=bucket, tensors=1000, export_s=3.0,
                         transport=Transport(links=8, pipelined=True))
    assert piped == pytest.approx(max(3.0, moved / 8, load), rel=1e-12)
    # More links than NVLink carries do not help: a node's GPUs forward what enters it.
    assert sync_seconds(64 * bucket, colocated=False, hw=hw, bucket_bytes=bucket, transport=Transport(links=16)) == \
        pytest.approx(64 * bucket / (450 * 1e9 * FITTED.link) + 64 * FITTED.bucket_s, rel=1e-12)
    assert NEMO_RL_TRANSPORT == Transport(links=8, pipelined=True)


def test_a_plans_weight_sync_is_its_export_then_its_push():
    """`rlm plan` prices this project's refit: the export (shards between stages, then the gathers), then the bytes
    and the loads, one after another."""
    spec = _spec("qwen3-1.7b", {"pipeline_model_parallel_size": 2}, placement={"nnodes": 2, "gpus_per_node": 8})
    plan = _plan(spec)
    arch = read_architecture(MODELS_DIR / "qwen3-1.7b")
    params = count_parameters(arch)
    export = export_seconds(params.total * 2, 0.0, spec.actor.megatron, 16, Hardware())
    push = sync_seconds(plan.sync.bytes_per_receiver, colocated=True, hw=Hardware(),
                        bucket_bytes=spec.rollout.update_weights_bucket_mb << 20, tensors=checkpoint_tensors(arch))
    assert plan.step_time.phases["weight_sync"] == pytest.approx(export + push, rel=1e-12)
    assert export > 0
    assert f"weight_sync begins with the trainer's export, {export:.1f} s of it (each rank's shard between the 2 " \
        "pipeline stages" in "\n".join(plan.step_time.assumptions)


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


def test_a_schedule_with_steps_in_flight_generates_at_the_full_batchs_rate_without_the_tail():
    arch = read_architecture(MODELS_DIR / "qwen3-32b")
    params = count_parameters(arch)
    engine = dataclasses.replace(engine_memory(_spec("qwen3-32b", {}), arch, params, 80e9), kv_tokens=1700 * 64)

    def seconds(samples: int, in_flight: int | None) -> float:
        return generation_seconds(arch, params, engine, engines=1, tp=4, work=Workload(samples, 200, 1500, 8192),
                                  weight_bytes=2.0, hw=Hardware(), steps_in_flight=in_flight)

    # A drained batch waits for its longest response; a full one only for its tokens: most where the cache holds the
    # whole batch, which then only drains.
    assert seconds(512, 1) < seconds(512, None)
    assert seconds(64, 1) < 0.6 * seconds(64, None)
    # With the KV cache the bound, the rate is fixed: twice the samples take twice as long (prefill too), where a
    # drained batch pays its tail once.
    assert seconds(1024, 1) == pytest.approx(2 * seconds(512, 1), rel=1e-12)
    assert seconds(1024, None) < 2 * seconds(512, None)
    # Below the cache's bound, more steps in flight run more samples at once.
    small = dataclasses.replace(engine, kv_tokens=10**8)
    one, two = (generation_seconds(arch, params, small, engines=1, tp=4, work=Workload(64, 200, 1500, 8192),
                                   weight_bytes=2.0, hw=Hardware(), steps_in_flight=k) for k in (1, 2))
    assert two < one


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


def test_a_refit_takes_the_bytes_of_a_links_servers_then_their_loads_at_once():
    hw, bucket = Hardware(), 512 << 20
    one = sync_seconds(8 * bucket, colocated=False, hw=hw, bucket_bytes=bucket)
    assert sync_seconds(16 * bucket, colocated=False, hw=hw, bucket_bytes=bucket) == pytest.approx(2 * one, rel=1e-12)
    link_s = 8 * bucket / (hw.network_gbps / 8 * 1e9 * FITTED.link)
    assert one == pytest.approx(link_s + 8 * FITTED.bucket_s)
    # Each tensor the receiver loads costs the same, whatever its size.
    assert sync_seconds(8 * bucket, colocated=False, hw=hw, bucket_bytes=bucket, tensors=1000) == \
        pytest.approx(one + 1000 * FITTED.tensor_s, rel=1e-12)
    # Disaggregated, a sender's servers share its link, each bucket to all of them at once: the same bytes reach a GPU
    # of a TP-4 engine as of a TP-2 one (whole tensors), 8 rollout GPUs hold half as many TP-4 servers, so half as
    # many bytes cross the link; the servers' loads overlap, once whatever their number.
    spec = {"placement": {"mode": "disaggregate", "gpus_per_node": 1, "rollout_nnodes": 1, "rollout_gpus_per_node": 8}}
    tp2 = _plan(_spec("qwen3-1.7b", {}, rollout={"tensor_parallel_size": 2}, **spec))
    tp4 = _plan(_spec("qwen3-1.7b", {}, rollout={"tensor_parallel_size": 4}, **spec))
    assert tp4.sync.bytes_per_receiver == tp2.sync.bytes_per_receiver == tp2.sync.total_bytes
    assert (tp2.sync.servers_per_link, tp4.sync.servers_per_link) == (4, 2)
    # The trainer (TP 1, PP 1) exports nothing: all of it is the pushes.
    assert export_seconds(tp2.sync.exported_bytes, 0.0, _spec("qwen3-1.7b", {}).actor.megatron, 8, hw) == 0
    # The bytes through the link (at the fitted share of its 400 Gb/s), then the loads, the same for both.
    loads = tp2.step_time.phases["weight_sync"] - tp2.sync.seconds / FITTED.link
    assert loads > 0
    assert tp4.step_time.phases["weight_sync"] == pytest.approx(tp4.sync.seconds / FITTED.link + loads, rel=1e-12)
    assert tp2.sync.seconds == pytest.approx(2 * tp4.sync.seconds, rel=1e-12)
    assert sync_seconds(8 * bucket, colocated=False, hw=hw, bucket_bytes=bucket, per_link=3) == \
        pytest.approx(3 * link_s + 8 * FITTED.bucket_s, rel=1e-12)


def test_a_receiver_loads_each_checkpoint_tensor_and_deepseek_v3_has_nemo_rls_45395():
    """checkpoint_tensors against the weight map's HF keys (what the sync exports), and NeMo-RL's published count
    per vLLM rank (docs/guides/checkpoint-engine-refit.md)."""
    from rlmegatron.models.hf_config import model_facts, read_hf_config
    from rlmegatron.models.weight_map import WeightMap

    assert checkpoint_tensors(read_architecture(MODELS_DIR / "deepseek-v3")) == 45_395
    for model in ("deepseek-v3", "qwen3-30b-a3b", "llama-3.1-8b", "qwen3-1.7b"):
        facts = model_facts(read_hf_config(MODELS_DIR / model), 1, mtp_layers=0)
        assert checkpoint_tensors(read_architecture(MODELS_DIR / model)) == len(WeightMap(facts).hf_keys()), model


def test_an_on_off_twin_whose_totals_are_the_models_own_bounds_each_phase_at_exactly_the_models_generation_and_training():
    """The twin deduction inverts the model: given the model's own totals (the twins at one length), it returns the
    model's two phases."""
    pairs = twins()
    assert len(pairs) == 3
    for on, off in pairs:
        off = dataclasses.replace(off, mean_sequence=on.mean_sequence)
        own_on = dataclasses.replace(on, step_s=predict(on)["total"])
        own_off = dataclasses.replace(off, step_s=predict(off)["total"])
        twin = twin_phases(own_on, own_off)
        assert twin.low == pytest.approx(min(twin.generation, twin.training), rel=1e-9)
        assert twin.high == pytest.approx(max(twin.generation, twin.training), rel=1e-9)


def test_deepseek_v3s_published_twins_need_both_generation_and_training_about_twice_what_the_qwen3_efficiencies_give():
    """Why an MLA model has two constants of its own (RESULTS rounds 4 and 5): at the efficiencies the Qwen3 and
    Llama runs give (MLA shares of 1), DeepSeek-V3's on/off twins, which share trainer and engines, leave each of
    generation and training at least ~40 s, which that model gives neither; with the fitted shares, the v0.4 twin
    they were fitted on splits exactly at the model's two phases."""
    plain = {release: dataclasses.replace(constants, mla_train=1.0, mla_decode=1.0)
             for release, constants in FITTED_BY_RELEASE.items()}
    pairs = [(on, off) for on, off in twins() if on.name == "DeepSeek-V3"]
    assert [on.version for on, _ in pairs] == ["v0.4", "v0.6"]
    for on, off in pairs:
        twin = twin_phases(on, off, plain)
        floor = min(twin.low, twin.high)
        assert floor > 40
        assert floor / twin.generation > 1.5 and floor / twin.training > 1.8
    fitted = twin_phases(*pairs[0])  # two runs, two shares: the model's phases are the twin's bounds
    assert min(fitted.generation, fitted.training) == pytest.approx(fitted.low, rel=2e-3)
    assert max(fitted.generation, fitted.training) == pytest.approx(fitted.high, rel=2e-3)


def test_an_mla_models_plan_prices_it_at_its_shares_of_the_efficiencies_and_says_so(capsys):
    """The shares change what `rlm plan` prices for a multi-head latent attention model and nothing else: the same
    recipe at shares of 1 trains and generates faster by exactly them; its assumptions name them; a model without MLA
    is neither told of them nor priced by them."""
    from rlmegatron.planner import step_time as model

    arch = read_architecture(MODELS_DIR / "deepseek-v3")
    dense = read_architecture(MODELS_DIR / "qwen3-30b-a3b")
    plain = dataclasses.replace(FITTED, mla_train=1.0, mla_decode=1.0)
    assert FITTED.train(arch) == pytest.approx(plain.train(arch) * FITTED.mla_train)
    assert FITTED.decode(arch) == pytest.approx(plain.decode(arch) * FITTED.mla_decode)
    assert (FITTED.train(dense), FITTED.decode(dense)) == (plain.train(dense), plain.decode(dense))
    assert FITTED.mla_train < 1 and FITTED.mla_decode < 1
    for recipe, told in (("configs/deepseek_v3_671b_grpo.yaml", True), ("configs/kimi_k25_grpo.yaml", True),
                         ("configs/qwen3_30b_a3b_grpo.yaml", False)):
        assert main(["plan", recipe, "--json"]) == 0
        said = [line for line in json.loads(capsys.readouterr().out)["step_time"]["assumptions"]
                if line.startswith("a multi-head latent attention model")]
        assert len(said) == told, (recipe, said)
        assert not told or f"training at {FITTED.mla_train:g} and decoding at {FITTED.mla_decode:g}" in said[0]
    assert model.FITTED is FITTED


def test_twins_pair_only_runs_with_the_same_trainer_and_the_same_engines():
    """Each of twins()'s criteria on its own: an off-policy run that differs from its on-policy twin in the trainer's
    layout, its GPUs, the engines' TP or count, the release or the staleness is no twin."""
    on, off = next(pair for pair in twins() if pair[0].name == "DeepSeek-V3" and pair[0].version == "v0.4")
    assert twins([on, off]) == [(on, off)]
    for changed in (dict(layout=(1, 1, 32, 8)), dict(gpus=off.gpus * 2, generation_gpus=off.gpus // 2),
                    dict(rollout_tp=16), dict(generation_gpus=off.gpus // 4), dict(version="v0.6"),
                    dict(staleness=2)):
        assert twins([on, dataclasses.replace(off, **changed)]) == [], changed
