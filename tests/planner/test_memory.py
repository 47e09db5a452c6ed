"""Planner estimates against published memory figures and Megatron's documented formulas (within 25%)."""
import pytest

from rlmegatron.config import read_architecture
from rlmegatron.prelaunch.spec_pipeline import spec_from_raw
from rlmegatron.planner.parameters import checkpoint_tensors, count_parameters
from rlmegatron.planner.plan import PlanSettings, build_plan, render_plan
from rlmegatron.planner.step_time import FITTED
from tests.config.specs import MODELS_DIR


def _spec(model_name: str, megatron: dict, **sections):
    raw = {
        "model": {"path": "hub/id", "hf_config": str(MODELS_DIR / model_name)},
        "data": {"train_files": ["t.parquet"], "max_prompt_length": 1024, "max_response_length": 1024,
                 "train_batch_size": 64},
        "actor": {"ppo_mini_batch_size": 64, "ppo_micro_batch_size_per_gpu": 1, "megatron": megatron},
        "placement": {"nnodes": 1, "gpus_per_node": 8},
        "trainer": {"val_before_train": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return spec_from_raw(raw)


def _plan(spec, gpu_mem_gb=80.0):
    return build_plan(spec, read_architecture(spec.model.hf_config), PlanSettings(gpu_mem_gb=gpu_mem_gb))


def test_verl_deepseek_v3_on_96_h20_reports_66_gb():
    # verl docs/perf/dpsk.md and DESIGN.md: DeepSeek-V3 GRPO on 96 H20 (96 GB), TP8 / PP12 / EP8, full
    # offload with OFFLOAD_FRACTION=1 (Adam on the CPU): 66 GB of GPU memory. The 66 GB is verl's
    # measured peak, which also holds allocator fragmentation, NCCL/DeepEP buffers and MoE dispatch
    # activations that the planner does not model; the planner's figure is the actor update alone
    # (bf16 weights + fp32 grads of the largest stage + full-recompute activations at 4096 tokens).
    spec = _spec(
        "deepseek-v3",
        {
            "tensor_model_parallel_size": 8, "sequence_parallel": True, "pipeline_model_parallel_size": 12,
            "expert_model_parallel_size": 8, "expert_tensor_parallel_size": 1, "recompute_granularity": "full",
            "extra": {"num_layers_in_first_pipeline_stage": 5, "num_layers_in_last_pipeline_stage": 6},
        },
        data={"train_batch_size": 96, "max_response_length": 2048},
        actor={"ppo_mini_batch_size": 96, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 4096,
               "offload": {"params": True, "grads": True, "optimizer": True}},
        rollout={"tensor_parallel_size": 32, "expert_parallel_size": 32, "mem_fraction_static": 0.6},
        placement={"nnodes": 12},
    )
    plan = _plan(spec, gpu_mem_gb=96)
    assert not plan.problems
    assert plan.actor.optimizer_state == 0
    # 57.9 GB today: the last stage, with the MTP layer DeepSeek-V3 ships, frozen (54.3 GB counted without it).
    assert plan.actor.total / 1e9 == pytest.approx(66, rel=0.25)


@pytest.mark.parametrize("distributed, per_param", [(False, 18.0), (True, 6 + 12 / 8)])
def test_mixed_precision_adam_bytes_per_param_follow_megatron(distributed, per_param):
    # Megatron-LM docs/source/api-guide/dist_optimizer.md: bf16 params, fp32 grads -> 18 bytes per
    # parameter, or 6 + 12/DP with the distributed optimizer (here DP = 8).
    spec = _spec("qwen3-1.7b", {"use_distributed_optimizer": distributed})
    params = count_parameters(read_architecture(spec.model.hf_config)).total
    assert _plan(spec).actor.model_state == pytest.approx(params * per_param, rel=1e-6)


def test_fp16_adam_takes_20_bytes_per_param_without_sharding():
    spec = _spec("qwen3-1.7b", {"use_distributed_optimizer": False}, model={"dtype": "fp16"})
    params = count_parameters(read_architecture(spec.model.hf_config)).total
    assert _plan(spec).actor.model_state == pytest.approx(params * 20, rel=1e-6)


def _paper_activations(s, b, h, a, layers, t, vocab):
    """Korthikanti et al. 2022, eq. for TP + SP without recompute, plus the 4sbv/t output term."""
    return layers * s * b * h * (34 + 5 * a * s / h) / t + 4 * s * b * vocab / t


@pytest.mark.parametrize("tp", [2, 4])
def test_activations_follow_the_recomputation_paper(tp):
    # "Reducing Activation Recomputation in Large Transformer Models": sbh(34 + 5as/h)/t per layer.
    spec = _spec("qwen3-1.7b", {"tensor_model_parallel_size": tp, "sequence_parallel": True},
                 actor={"ppo_micro_batch_size_per_gpu": 2})
    expected = _paper_activations(s=2048, b=2, h=2048, a=16, layers=28, t=tp, vocab=151936)
    assert _plan(spec).actor.activations == pytest.approx(expected, rel=0.25)


def test_recompute_and_context_parallel_shrink_activations_in_order():
    base = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    sizes = [
        _plan(_spec("qwen3-1.7b", {**base, "recompute_granularity": granularity})).actor.activations
        for granularity in ("none", "selective", "full")
    ]
    assert sizes[0] > sizes[1] > sizes[2]


def test_context_parallel_keeps_its_tokens_whose_queries_attend_to_the_whole_sequence():
    # CP=2 with TP=2 + SP, no recompute: each rank keeps the activations of s/2 tokens, sbh(34 + 5as/h)/t per layer
    # with b = s/2 queries but the attention scores over all s keys (the term shrinks by CP, not CP squared), and
    # the logits of its s/2 tokens.
    layout = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    spec = _spec("qwen3-1.7b", {**layout, "context_parallel_size": 2}, actor={"ppo_micro_batch_size_per_gpu": 2})
    s, b, h, a, layers, t, vocab = 2048, 2, 2048, 16, 28, 2, 151936
    local = s // 2
    expected = layers * local * b * h * (34 + 5 * a * s / h) / t + 4 * local * b * vocab / t
    assert _plan(spec).actor.activations == pytest.approx(expected, rel=1e-12)
    assert _plan(_spec("qwen3-1.7b", layout, actor={"ppo_micro_batch_size_per_gpu": 2})).actor.activations == \
        pytest.approx(2 * expected, rel=1e-12)


def test_lora_trains_only_the_adapters_split_over_tp_like_their_weights():
    # Qwen3-1.7B, rank 16 on all four linears at TP=2 (DP=4 of 8 GPUs), bf16 with the distributed optimizer: per
    # layer, column-parallel qkv and fc1 keep A [r, in] whole and B [out/2, r]; row-parallel proj and fc2 the reverse.
    h, heads, kv, d, ffn, layers, r = 2048, 16, 8, 128, 6144, 28, 16
    qkv = r * h + r * (heads + 2 * kv) * d // 2
    proj = r * heads * d // 2 + r * h
    fc1 = r * h + r * 2 * ffn // 2
    fc2 = r * ffn // 2 + r * h
    adapters = layers * (qkv + proj + fc1 + fc2)
    layout = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    full = _plan(_spec("qwen3-1.7b", layout)).actor
    lora = _plan(_spec("qwen3-1.7b", layout, actor={"lora": {"rank": r, "alpha": 32}})).actor
    assert lora.adapter_parameters == adapters
    assert lora.parameters == (full.dense_parameters + adapters) * 2  # frozen bf16 weights, and the adapters
    assert lora.gradients == adapters * 4 and full.gradients == full.dense_parameters * 4
    assert lora.optimizer_state == pytest.approx(adapters * 12 / 4)
    assert lora.activations == full.activations
    only_qkv = _plan(_spec("qwen3-1.7b", layout, actor={"lora": {"rank": r, "target_modules": ["linear_qkv"]}}))
    assert only_qkv.actor.adapter_parameters == layers * qkv
    # The (tied) embedding trained whole beside them: its TP shard gets gradients and Adam state too, and a copy of
    # its base weights stays for the adapters-off model.
    saved = _plan(_spec("qwen3-1.7b", layout, actor={"lora": {"rank": r, "modules_to_save": ["embedding"]}})).actor
    assert saved.gradients == (adapters + 151936 * h // 2) * 4
    assert saved.parameters == lora.parameters + 151936 * h // 2 * 2


def test_lora_experts_shard_their_adapters_over_ep_and_etp():
    # Qwen3-30B-A3B at TP=2, EP=8, ETP=1: each GPU holds 128/8 experts' fc1/fc2 factors whole; the attention's split.
    h, heads, kv, d, experts, moe_ffn, layers, r = 2048, 32, 4, 128, 128, 768, 48, 8
    attention = (r * h + r * (heads + 2 * kv) * d // 2) + (r * heads * d // 2 + r * h)
    expert = (r * h + r * 2 * moe_ffn) + (r * moe_ffn + r * h)
    layout = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 8,
              "expert_tensor_parallel_size": 1}
    actor = _plan(_spec("qwen3-30b-a3b", layout, actor={"lora": {"rank": r}})).actor
    assert actor.adapter_parameters == layers * (attention + experts // 8 * expert)


def test_a_lora_run_keeps_no_reference_model():
    layout = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    kl = {"use_kl_loss": True}
    with_ref = _plan(_spec("qwen3-1.7b", layout, actor=kl)).trainer_phases[0].parts
    with_lora = _plan(_spec("qwen3-1.7b", layout, actor={**kl, "lora": {"rank": 8}})).trainer_phases[0].parts
    assert "ref (idle)" in with_ref and "ref (idle)" not in with_lora


def test_experts_shard_over_ep_and_etp():
    layout = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_tensor_parallel_size": 1}
    ep2 = _plan(_spec("qwen3-30b-a3b", {**layout, "expert_model_parallel_size": 2})).actor
    ep8 = _plan(_spec("qwen3-30b-a3b", {**layout, "expert_model_parallel_size": 8})).actor
    assert ep2.expert_parameters == pytest.approx(4 * ep8.expert_parameters, rel=1e-6)
    assert ep2.dense_parameters == ep8.dense_parameters


def test_cpu_optimizer_leaves_no_adam_state_on_the_gpu():
    spec = _spec("qwen3-1.7b", {}, actor={"offload": {"optimizer": True}})
    assert _plan(spec).actor.optimizer_state == 0


def test_engine_kv_budget_and_sync_bytes():
    spec = _spec("qwen3-1.7b", {}, rollout={"tensor_parallel_size": 2, "mem_fraction_static": 0.5})
    plan = _plan(spec)
    weights = count_parameters(read_architecture(spec.model.hf_config)).total * 2
    assert plan.engine.weights == pytest.approx(weights / 2)
    assert plan.engine.kv_cache == pytest.approx(40e9 - weights / 2)
    # 28 layers × (K and V) × 4 KV heads per GPU × 128 dims × 2 bytes.
    assert plan.engine.kv_bytes_per_token == 28 * 2 * 4 * 128 * 2
    # SGLang's push sends every tensor whole to every TP rank (its loader slices them): the whole model per engine
    # GPU, colocated from the trainer rank on it, every GPU at once.
    assert plan.sync.bytes_per_receiver == weights and plan.sync.servers_per_link == 1
    assert plan.sync.seconds == pytest.approx(weights * 8 / 400e9)


def test_a_hybrid_models_engine_caches_keys_of_its_attention_layers_beside_a_pool_of_recurrent_states():
    """Qwen3.5-397B at rollout TP 16: SGLang caches keys and values of the 15 full-attention layers only, and keeps
    the 45 Gated DeltaNet layers' states in a pool of its own, 0.9 of the KV cache's memory
    (mamba_full_memory_ratio)."""
    spec = _spec("qwen3.5-397b-a17b", {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                        "expert_model_parallel_size": 8},
                 placement={"nnodes": 2, "gpus_per_node": 8}, rollout={"tensor_parallel_size": 16})
    engine = _plan(spec).engine
    # 15 layers x (K and V) x 1 KV head per GPU (2 replicated over 16) x 256 dims x 2 bytes.
    assert engine.kv_bytes_per_token == 15 * 2 * 1 * 256 * 2
    assert engine.recurrent_states == pytest.approx(0.9 * engine.kv_cache)
    assert engine.kv_cache + engine.recurrent_states == pytest.approx(engine.static_reservation - engine.weights)


def test_delta_sync_plans_the_measured_share_of_a_full_push():
    """rollout.weight_sync=delta: per step the share benchmarks/delta_sync.py measured for bf16 at the actor's lr
    (log-linear between the measured rates), every full_sync_every-th push whole; fp32, unmeasured, counts whole."""
    from rlmegatron.planner.memory import DELTA_SENT_RATIO_BF16, delta_sent_ratio
    from rlmegatron.planner.step_time import DELTA_HOST_GB_PER_S, Hardware, export_seconds, sync_seconds

    disaggregated = {"mode": "disaggregate", "rollout_nnodes": 1, "rollout_gpus_per_node": 8}
    tp2 = {"tensor_parallel_size": 2}
    full = _plan(_spec("qwen3-1.7b", {}, placement={"nnodes": 1, "gpus_per_node": 8, **disaggregated}, rollout=tp2))
    assert full.sync.sent_per_server == full.sync.bytes_per_receiver  # broadcast once to the server's ranks
    for lr, ratio in DELTA_SENT_RATIO_BF16.items():
        spec = _spec("qwen3-1.7b", {"tensor_model_parallel_size": 2},
                     placement={"nnodes": 1, "gpus_per_node": 8, **disaggregated},
                     rollout={"weight_sync": "delta", **tp2}, actor={"optim": {"lr": lr}})
        delta = _plan(spec)
        assert delta.sync.bytes_per_receiver == pytest.approx(full.sync.bytes_per_receiver * ratio)
        # 4 TP-2 engines: a full push from each of the node's 8 ranks (one each), delta records from its first alone
        assert (full.sync.servers_per_link, delta.sync.servers_per_link) == (1, 4)
        # The records go in each server's request body, base64, one copy per TP rank (weight_push._post).
        assert delta.sync.sent_per_server == pytest.approx(delta.sync.bytes_per_receiver * 2 * 4 / 3)
        # The push of those bytes (their own buckets, each with its latency) and the host's work on the whole policy
        # (the comparison, the records), at the CPU rate measured.
        arch = read_architecture(MODELS_DIR / "qwen3-1.7b")
        export = export_seconds(count_parameters(arch).total * 2, 0.0, spec.actor.megatron, 8, Hardware())
        assert export > 0 and delta.sync.exported_bytes == count_parameters(arch).total * 2  # the TP 2 gather
        push = sync_seconds(delta.sync.bytes_per_receiver, colocated=False, hw=Hardware(), bucket_bytes=512 << 20,
                            tensors=checkpoint_tensors(arch), per_link=4,
                            sent_per_server=delta.sync.sent_per_server, export_s=export)
        assert delta.step_time.phases["weight_sync"] == pytest.approx(
            push + full.sync.total_bytes / (DELTA_HOST_GB_PER_S * 1e9), rel=1e-12)
    between = delta_sent_ratio("bf16", 10 ** -5.5, 0)[0]
    assert between == pytest.approx((DELTA_SENT_RATIO_BF16[1e-6] + DELTA_SENT_RATIO_BF16[1e-5]) / 2)
    assert delta_sent_ratio("bf16", 1e-7, 0)[0] == DELTA_SENT_RATIO_BF16[1e-6] and delta_sent_ratio("bf16", 1, 0)[0] == 1
    assert delta_sent_ratio("bf16", 1e-6, 4)[0] == pytest.approx((3 * DELTA_SENT_RATIO_BF16[1e-6] + 1) / 4)
    assert delta_sent_ratio("fp32", 1e-6, 0)[0] == 1.0


def test_mla_caches_the_compressed_latent():
    spec = _spec("deepseek-v3", {"tensor_model_parallel_size": 8, "sequence_parallel": True,
                                 "pipeline_model_parallel_size": 1},
                 rollout={"tensor_parallel_size": 8, "expert_parallel_size": 8})
    assert _plan(spec, gpu_mem_gb=1000).engine.kv_bytes_per_token == 61 * (512 + 64) * 2


def _reward_model_dir(tmp_path):
    """Qwen3-1.7B's architecture as a one-label sequence classifier (the planner reads its config alone)."""
    import json

    config = json.loads((MODELS_DIR / "qwen3-1.7b" / "config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], id2label={"0": "LABEL_0"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("offload", [False, True])
def test_the_reward_model_takes_its_weights_and_one_layers_activations_on_the_trainer_gpus(tmp_path, offload):
    # Its own TP=2 (no SP), 4 sequences of 2048 tokens per forward: weights = (decoder + a 1-label head) / 2 in
    # bf16; one layer's activations sbh(10 + 24/t + 5as/(ht)); idle, it stays resident unless offloaded.
    path = _reward_model_dir(tmp_path)
    model = {"path": path, "tensor_model_parallel_size": 2, "micro_batch_size_per_gpu": 4,
             "offload": {"params": offload}}
    plan = _plan(_spec("qwen3-1.7b", {}, reward={"model": model}))
    params = count_parameters(read_architecture(path))
    h, a, s, b, t = 2048, 16, 2048, 4, 2
    weights = (params.total + h) // t * 2  # tied embeddings: the count has no output layer to take away
    activations = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert plan.reward_model.weights == weights
    assert plan.reward_model.activations == pytest.approx(activations, rel=1e-12)
    phases = {phase.phase: phase for phase in plan.trainer_phases}
    assert phases["reward_scoring"].parts["reward model"] == pytest.approx(weights + activations)
    assert phases["actor_update"].parts["reward model (idle)"] == (0 if offload else weights)
    assert phases["rollout"].parts["reward model (idle)"] == (0 if offload else weights)


@pytest.mark.parametrize("mode, rollouts", [("sync", 1), ("one_step_off", 2), ("async", 4)])
def test_async_modes_plan_the_rollout_buffer_and_the_two_pools(mode, rollouts):
    # 64 prompts x 4 samples of 1024 + 1024 tokens: int64 ids and mask over 2048 tokens, fp32 response mask and
    # rollout log-probs over 1024, per sample; the one training plus max_staleness=3 (one_step_off: 1) made ahead.
    spec = _spec("qwen3-1.7b", {}, rollout={"n": 4}, placement={"mode": "disaggregate", "rollout_nnodes": 2,
                                                                  "rollout_gpus_per_node": 4},
                 trainer={"mode": mode, "max_staleness": 3} if mode == "async" else {"mode": mode})
    plan = _plan(spec)
    assert plan.rollout_buffer.rollouts == rollouts
    assert plan.rollout_buffer.total == rollouts * 64 * 4 * (2 * 8 * 2048 + 2 * 4 * 1024)
    assert (plan.trainer_gpus, plan.rollout_gpus) == (8, 8)
    assert plan.rollout_gpu_bytes == plan.engine.static_reservation
    assert "rollout" not in {phase.phase for phase in plan.trainer_phases}  # the engines have their own GPUs


def test_the_buffer_counts_the_bytes_of_the_batch_a_rollout_builds():
    from rlmegatron.driver.rollout_data import build_batch
    from rlmegatron.planner.memory import rollout_buffer_memory
    from rlmegatron.rollout.engine import GenerationResult

    spec = _spec("qwen3-1.7b", {}, data={"max_prompt_length": 12, "max_response_length": 5, "train_batch_size": 2},
                 actor={"ppo_mini_batch_size": 2}, rollout={"n": 4})
    results = [GenerationResult(request_index=i, sample_index=0, output_token_ids=(7,) * 5,
                                output_token_logprobs=(-0.5,) * 5, finish_reason="length") for i in range(8)]
    batch = build_batch([[1] * 12] * 8, results, response_width=5)
    tensors = [batch.input_ids, batch.attention_mask, batch.response_mask, batch.rollout_log_probs]
    assert rollout_buffer_memory(spec, read_architecture(spec.model.hf_config)).bytes_per_rollout == \
        sum(t.nbytes for t in tensors)


def test_the_buffer_counts_the_rollouts_routing_ids_when_the_actor_replays_or_measures_them():
    """A Qwen3-MoE rollout with its routing (actor.moe.routing_replay=r3): int16 ids per token, MoE layer and top-k
    slot, as build_batch lays them over the batch's columns."""
    import torch

    from rlmegatron.driver.rollout_data import build_batch
    from rlmegatron.planner.memory import rollout_buffer_memory
    from rlmegatron.rollout.engine import GenerationResult

    sections = dict(data={"max_prompt_length": 12, "max_response_length": 5, "train_batch_size": 2},
                    actor={"ppo_mini_batch_size": 2}, rollout={"n": 4})
    plain = _spec("qwen3-30b-a3b", {}, **sections)
    spec = _spec("qwen3-30b-a3b", {}, **{**sections, "actor": {"ppo_mini_batch_size": 2,
                                                              "moe": {"routing_replay": "r3"}}})
    arch = read_architecture(spec.model.hf_config)
    routed = torch.zeros(12 + 5 - 1, arch.num_moe_layers, arch.num_experts_per_tok, dtype=torch.int16)
    results = [GenerationResult(request_index=i, sample_index=0, output_token_ids=(7,) * 5, routed_experts=routed,
                                output_token_logprobs=(-0.5,) * 5, finish_reason="length") for i in range(8)]
    batch = build_batch([[1] * 12] * 8, results, response_width=5)
    memory = rollout_buffer_memory(spec, arch)
    assert memory.routing_bytes_per_rollout == batch.routed_experts.nbytes == 8 * 17 * 48 * 8 * 2
    assert memory.bytes_per_rollout - memory.routing_bytes_per_rollout == \
        rollout_buffer_memory(plain, arch).bytes_per_rollout
    assert "routing ids (actor.moe): " in render_plan(spec, _plan(spec))


def test_fp8_rollout_holds_and_syncs_the_projections_in_a_byte_and_a_scale_per_block():
    """DeepSeek-V3 on 8 GPUs an engine: 671 B parameters, of which all but the embedding, head and norms (1.9 B)
    are projections, a byte each plus 4 bytes per 128 x 128 block, against 2 bytes each in bf16. A sync carries the
    MTP layer only to engines that draft with it, and only when it trains: quantised alike but for eh_proj and
    norms, without its copies of embedding and head (the draft takes the main model's)."""
    layout = {"tensor_model_parallel_size": 8, "sequence_parallel": True, "pipeline_model_parallel_size": 1}
    rollout = {"tensor_parallel_size": 8, "expert_parallel_size": 8}
    bf16 = _spec("deepseek-v3", layout, rollout=rollout)
    fp8 = _spec("deepseek-v3", layout, rollout={**rollout, "quantization": "fp8"})
    drafting = _spec("deepseek-v3", layout, actor={"mtp": {"loss_weight": 0.1}},
                     rollout={**rollout, "quantization": "fp8", "speculative": {"method": "mtp", "num_draft_tokens": 1}})
    params = count_parameters(read_architecture(bf16.model.hf_config))
    rest = params.embedding + params.output_layer + params.final_norm + sum(layer.norms for layer in params.layers)
    expected = (params.total - rest) * (1 + 4 / 128**2) + rest * 2
    mtp = count_parameters(read_architecture(bf16.model.hf_config), mtp_layers=1)
    layer = mtp.mtp[0]
    mtp_projections = layer.attention + layer.mlp + layer.routed_experts
    mtp_sync = mtp_projections * (1 + 4 / 128**2) + (mtp.mtp_total - mtp_projections) * 2
    plain, quantised = _plan(bf16, gpu_mem_gb=1000), _plan(fp8, gpu_mem_gb=1000)
    assert quantised.sync.total_bytes == pytest.approx(expected)
    assert _plan(drafting, gpu_mem_gb=1000).sync.total_bytes == pytest.approx(expected + mtp_sync)
    assert quantised.engine.weights == pytest.approx(expected / 8)  # no speculative decoding: no draft model held
    assert plain.sync.total_bytes == params.total * 2
    assert quantised.sync.total_bytes / plain.sync.total_bytes == pytest.approx(0.5015, abs=1e-4)
    assert quantised.engine.kv_bytes_per_token == plain.engine.kv_bytes_per_token  # the KV cache stays bf16


def test_a_disaggregated_push_goes_from_every_trainer_gpu_at_once():
    """Every trainer rank sends (rank/weight_push.sending_ranks), each to its share of the servers through its GPU's
    own link: 6 TP-1 engines share one link from one trainer GPU, 3 from two, 2 from four (rounded up), 1 from
    eight; the bytes' seconds and the step's weight_sync shrink by as much, the bytes each receiver gets do not.
    Delta sync sends from one rank per node (its host copy of the policy), so its engines share that node's link."""
    disaggregated = {"mode": "disaggregate", "rollout_nnodes": 1, "rollout_gpus_per_node": 6}
    plans = {gpus: _plan(_spec("qwen3-1.7b", {}, placement={"nnodes": gpus, "gpus_per_node": 1, **disaggregated}))
             for gpus in (1, 2, 4, 8)}
    assert {gpus: plan.sync.servers_per_link for gpus, plan in plans.items()} == {1: 6, 2: 3, 4: 2, 8: 1}
    one = plans[1].sync
    for plan in plans.values():
        assert plan.sync.bytes_per_receiver == one.bytes_per_receiver
        assert plan.sync.seconds == pytest.approx(one.seconds * plan.sync.servers_per_link / 6, rel=1e-12)
    weight_sync = {gpus: plan.step_time.phases["weight_sync"] for gpus, plan in plans.items()}
    assert weight_sync[1] > weight_sync[2] > weight_sync[4] > weight_sync[8]
    assert weight_sync[2] - weight_sync[8] == pytest.approx(2 * (one.seconds / 6) / FITTED.link, rel=1e-9)
    # One node of eight GPUs: eight links, as eight nodes of one; delta sync, one link for the node.
    node = {"nnodes": 1, "gpus_per_node": 8, **disaggregated}
    assert _plan(_spec("qwen3-1.7b", {}, placement=node)).sync.servers_per_link == 1
    assert _plan(_spec("qwen3-1.7b", {}, placement=node, rollout={"weight_sync": "delta"})).sync.servers_per_link == 6
