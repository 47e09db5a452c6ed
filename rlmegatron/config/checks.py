"""Cross-field checks on a parsed JobSpec: parallel layouts vs model and cluster, batch arithmetic, option clashes."""
from __future__ import annotations

import difflib
import json
from math import gcd, prod
from pathlib import Path
from typing import Any, Callable

from rlmegatron.config.errors import NO_VALUE, SpecProblem, render_value
from rlmegatron.config.spec import ActorConfig, JobSpec, MegatronConfig, ModelConfig, OptimConfig, PPOUpdateConfig
from rlmegatron.config.transformer_config import extra_problems
from rlmegatron.errors import one_of
from rlmegatron.models.families import (ArchitectureError, ModelArchitecture, architecture_of, built_mtp_layers,
                                       family_for, read_architecture)
from rlmegatron.models.pipeline import FIRST_STAGE, LAST_STAGE, PipelineSplitError, pipeline_stage_layers
from rlmegatron.plugins import is_plugin_reference, load_plugin, plugin_problem

# Registered estimators whose baseline is the other responses to the same prompt (they take
# `group_index`); a plug-in estimator is one when its signature takes `group_index`.
GROUP_ESTIMATORS = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline", "gspo", "gpg", "opo"})


def check_spec(spec: JobSpec) -> list[SpecProblem]:
    """Every cross-field problem in `spec`, empty when it can run; reads the model's config.json."""
    arch, problems = _read_model_architecture(spec.model)
    problems += _check_parallel_layouts(spec, arch)
    problems += _check_update_batches(spec)
    problems += _check_lengths(spec, arch)
    problems += _check_rollout(spec, arch)
    problems += _check_algorithm(spec)
    problems += _check_lora(spec, arch)
    problems += _check_routing(spec, arch)
    problems += _check_mtp(spec, arch)
    problems += _check_reward_model(spec)
    problems += _check_distillation(spec, arch)
    problems += _check_placement(spec)
    problems += _check_optimizers(spec)
    problems += _check_input_paths(spec)
    problems += _check_remote_code(spec.model)
    problems += _check_validation(spec)
    problems += _check_tracking(spec)
    return problems


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _common_divisors(*numbers: int) -> list[int]:
    return _divisors(gcd(*numbers))


def _read_model_architecture(model: ModelConfig) -> tuple[ModelArchitecture | None, list[SpecProblem]]:
    located = model.architecture_source()
    if located is None:
        reason = (
            "is not a local directory and model.hf_config is not set; hub ids cannot be fetched "
            "here, so set model.hf_config to the model's config.json (configs/models/ has common ones)"
        )
        return None, [SpecProblem("model.path", model.path, reason)]
    field, path = located
    try:
        return read_architecture(path), []
    except ArchitectureError as err:
        return None, [SpecProblem(field, path, str(err))]


def _trainer_ranks(spec: JobSpec) -> str:
    unit = "CPU ranks" if spec.placement.device == "cpu" else "GPUs"
    return (
        f"the {spec.placement.trainer_world_size} trainer {unit} "
        f"(placement.nnodes × placement.gpus_per_node)"
    )


def _data_parallel_size(megatron: MegatronConfig, world: int) -> int | None:
    """Data-parallel ranks of a layout, or None when the layout does not fit the world."""
    model_parallel = (
        megatron.tensor_model_parallel_size
        * megatron.pipeline_model_parallel_size
        * megatron.context_parallel_size
    )
    return world // model_parallel if world % model_parallel == 0 else None


def _check_parallel_layouts(spec: JobSpec, arch: ModelArchitecture | None) -> list[SpecProblem]:
    roles = [("actor", spec.actor.megatron)]
    # A role laid out exactly like the actor would only repeat the actor's problems.
    actor_layout = spec.actor.megatron.model_dump()
    if spec.needs_reference and spec.ref.megatron.model_dump() != actor_layout:
        roles.append(("ref", spec.ref.megatron))
    if spec.critic.enable and spec.critic.megatron.model_dump() != actor_layout:
        roles.append(("critic", spec.critic.megatron))
    problems = []
    for role, megatron in roles:
        problems += _check_layout_fits_world(f"{role}.megatron", megatron, spec)
        problems += check_layout_options(f"{role}.megatron", megatron)
        problems += extra_problems(f"{role}.megatron", megatron.extra, arch is not None and arch.mla is not None)
        if arch is not None:
            problems += check_layout_fits_model(f"{role}.megatron", megatron, arch, spec)
    return problems


def _groups_within_nodes(prefix: str, m: MegatronConfig, spec: JobSpec) -> list[SpecProblem]:
    """On several nodes, a TP group (Megatron's innermost, so a run of consecutive ranks, and a node's ranks are
    consecutive: transport.placement) must lie within one node, where its all-reduces run over NVLink, not the
    network; so must an EP group (ETP x EP consecutive ranks) that fits in one."""
    placement = spec.placement
    per_node = placement.gpus_per_node
    if placement.nnodes == 1:
        return []
    unit = "CPU ranks" if placement.device == "cpu" else "GPUs"
    fix = f"use {one_of(_divisors(per_node))}, or a node with more {unit}"
    problems = []
    for name in ("tensor_model_parallel_size", "expert_tensor_parallel_size"):
        size = getattr(m, name)
        if per_node % size and (name == "tensor_model_parallel_size" or size != m.tensor_model_parallel_size):
            problems.append(SpecProblem(f"{prefix}.{name}", size, f"does not divide a node's {per_node} {unit} "
                                        f"(placement.gpus_per_node): its groups would span nodes; {fix}"))
    expert_group = m.expert_tensor_parallel_size * m.expert_model_parallel_size
    if not problems and expert_group <= per_node and per_node % expert_group:
        problems.append(SpecProblem(
            f"{prefix}.expert_model_parallel_size", m.expert_model_parallel_size,
            f"its groups of {expert_group} ranks (expert_tensor_parallel_size x expert_model_parallel_size) fit in a "
            f"node's {per_node} {unit} but would straddle two nodes; make the product divide {per_node}"))
    return problems


def _check_layout_fits_world(prefix: str, m: MegatronConfig, spec: JobSpec) -> list[SpecProblem]:
    world = spec.placement.trainer_world_size
    sizes = {
        "tensor_model_parallel_size": m.tensor_model_parallel_size,
        "pipeline_model_parallel_size": m.pipeline_model_parallel_size,
        "context_parallel_size": m.context_parallel_size,
        "expert_model_parallel_size": m.expert_model_parallel_size,
        "expert_tensor_parallel_size": m.expert_tensor_parallel_size,
    }
    # An expert TP that merely follows TP (its default) would repeat TP's problem.
    own_sizes = {
        name: size
        for name, size in sizes.items()
        if name != "expert_tensor_parallel_size" or size != m.tensor_model_parallel_size
    }
    problems = [
        SpecProblem(
            f"{prefix}.{name}", size, f"does not divide {_trainer_ranks(spec)}; use {one_of(_divisors(world))}"
        )
        for name, size in own_sizes.items()
        if world % size
    ]
    if problems:
        return problems
    problems = _groups_within_nodes(prefix, m, spec)
    if problems:
        return problems
    # Megatron builds the dense grid from TP×PP×CP and the expert grid from ETP×EP×PP.
    for group in (
        ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"),
        ("expert_model_parallel_size", "expert_tensor_parallel_size", "pipeline_model_parallel_size"),
    ):
        product = prod(sizes[name] for name in group)
        if world % product:
            reason = (
                f"their product {product} does not divide {_trainer_ranks(spec)}; "
                "lower one of them until it does"
            )
            problems.append(SpecProblem(prefix, {name: sizes[name] for name in group}, reason))
    return problems


def check_layout_options(prefix: str, m: MegatronConfig) -> list[SpecProblem]:
    problems = []
    if m.sequence_parallel and m.tensor_model_parallel_size == 1:
        problems.append(
            SpecProblem(
                f"{prefix}.sequence_parallel",
                True,
                "needs tensor_model_parallel_size > 1 (Megatron refuses it at TP=1); set it to false",
            )
        )
    for name in ("recompute_method", "recompute_num_layers"):
        # Compared with the default, not with "was it set": a dumped spec sets every field.
        if getattr(m, name) != MegatronConfig.model_fields[name].default and m.recompute_granularity != "full":
            reason = (f"picks the layers of full recompute, but recompute_granularity={m.recompute_granularity}; "
                      "remove it or set recompute_granularity=full")
            problems.append(SpecProblem(f"{prefix}.{name}", getattr(m, name), reason))
    vpp = m.virtual_pipeline_model_parallel_size
    if vpp is not None and m.pipeline_model_parallel_size == 1:
        problems.append(
            SpecProblem(
                f"{prefix}.virtual_pipeline_model_parallel_size",
                vpp,
                "needs pipeline_model_parallel_size > 1; remove it or raise the pipeline size",
            )
        )
    return problems


def check_layout_fits_model(
    prefix: str, m: MegatronConfig, arch: ModelArchitecture, spec: JobSpec
) -> list[SpecProblem]:
    world = spec.placement.trainer_world_size
    tp = m.tensor_model_parallel_size
    problems = []
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    valid_tp = [
        d for d in _common_divisors(heads, world) if kv_heads % d == 0 or d % kv_heads == 0
    ]
    if heads % tp:
        reason = f"does not divide the model's {heads} attention heads; use {one_of(valid_tp)}"
        problems.append(SpecProblem(f"{prefix}.tensor_model_parallel_size", tp, reason))
    elif kv_heads % tp and tp % kv_heads:
        # Megatron's rule: each rank holds whole query groups, or a group is replicated over ranks.
        reason = (
            f"must divide or be a multiple of the model's {kv_heads} key/value heads "
            f"(Megatron's num_query_groups rule); use {one_of(valid_tp)}"
        )
        problems.append(SpecProblem(f"{prefix}.tensor_model_parallel_size", tp, reason))

    if not problems and arch.qk_norm_over_all_heads and tp > kv_heads:
        # Its key norm's weight is split with the key heads (models/all_heads_norm.py), which TP then replicates.
        reason = (f"is more than the model's {kv_heads} key/value heads, which its query/key norms over all heads "
                  f"need whole on each rank; use {one_of([t for t in valid_tp if t <= kv_heads])}")
        problems.append(SpecProblem(f"{prefix}.tensor_model_parallel_size", tp, reason))
    linear = arch.linear_attention
    if not problems and linear is not None and linear.num_key_heads % tp:
        # Gated DeltaNet's TP split (models/gated_delta_net.py) gives each rank whole key heads and their value heads.
        reason = (f"does not divide the model's {linear.num_key_heads} linear-attention key heads, which Gated "
                  f"DeltaNet splits whole over TP ranks; use "
                  f"{one_of([t for t in valid_tp if linear.num_key_heads % t == 0])}")
        problems.append(SpecProblem(f"{prefix}.tensor_model_parallel_size", tp, reason))
    pipeline_problem = _pipeline_split_problem(prefix, m, arch.num_hidden_layers, world)
    if pipeline_problem:
        problems.append(pipeline_problem)
    if linear is not None and m.context_parallel_size > 1:
        problems.append(SpecProblem(f"{prefix}.context_parallel_size", m.context_parallel_size,
                                    "Gated DeltaNet's recurrence runs over whole sequences, which context parallelism "
                                    "splits over ranks; use 1"))
    if arch.indexer[0] and m.context_parallel_size > 1:
        # Megatron-Core's MLA hands sparse attention's indexer its input only without context parallelism.
        problems.append(SpecProblem(f"{prefix}.context_parallel_size", m.context_parallel_size,
                                    "DeepSeek Sparse Attention's indexer scores whole sequences, which Megatron-Core "
                                    "gives it without context parallelism only; use 1"))
    if arch.vision is not None:
        # The images' embeddings replace placeholder tokens of the whole sequence on the first stage
        # (models/vision.py); CP and SP hand each rank a slice of it.
        why = "a vision-language model's image embeddings replace placeholders of whole sequences; use "
        if m.context_parallel_size > 1:
            problems.append(SpecProblem(f"{prefix}.context_parallel_size", m.context_parallel_size, why + "1"))
        if m.sequence_parallel:
            problems.append(SpecProblem(f"{prefix}.sequence_parallel", True, why + "false"))
        deepstack = arch.vision.deepstack_layers
        if deepstack and not pipeline_problem:
            first_chunk = pipeline_stage_layers(arch.num_hidden_layers, m.pipeline_model_parallel_size,
                                                m.virtual_pipeline_model_parallel_size, m.extra.get(FIRST_STAGE),
                                                m.extra.get(LAST_STAGE))[0][0]
            if len(first_chunk) < deepstack:
                # DeepStack's features come from the tower, which runs on the first stage only (models/vision.py).
                reason = (f"puts {len(first_chunk)} decoder layers on the first (virtual) pipeline stage, but DeepStack "
                          f"adds image features after layers 0..{deepstack - 1} there; set "
                          f"{prefix}.extra.{FIRST_STAGE} >= {deepstack}, or lower the (virtual) pipeline size")
                field, value = (f"extra.{FIRST_STAGE}", m.extra[FIRST_STAGE]) if FIRST_STAGE in m.extra \
                    else ("pipeline_model_parallel_size", m.pipeline_model_parallel_size)
                problems.append(SpecProblem(f"{prefix}.{field}", value, reason))
        if deepstack and m.recompute_granularity == "full":
            reason = ("reruns decoder layers in the backward, without the DeepStack image features hooks add to the "
                      "first ones (models/vision.py); use selective or none")
            problems.append(SpecProblem(f"{prefix}.recompute_granularity", "full", reason))

    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size
    if not arch.is_moe:
        if ep > 1:
            reason = "the model is dense (its config.json declares no routed experts); use 1"
            problems.append(SpecProblem(f"{prefix}.expert_model_parallel_size", ep, reason))
        return problems
    if arch.num_experts % ep:
        reason = (
            f"does not divide the {arch.num_experts} experts; "
            f"use {one_of(_common_divisors(arch.num_experts, world))}"
        )
        problems.append(SpecProblem(f"{prefix}.expert_model_parallel_size", ep, reason))
    expert_ffn = arch.moe_intermediate_size
    if expert_ffn and expert_ffn % etp:
        reason = (
            f"does not divide the experts' hidden size {expert_ffn}; "
            f"use {one_of(_common_divisors(expert_ffn, world))}"
        )
        if etp == tp:
            reason += " (unset, it follows tensor_model_parallel_size)"
        problems.append(SpecProblem(f"{prefix}.expert_tensor_parallel_size", etp, reason))
    if arch.biased_linears and etp > 1:
        reason = ("the experts have biases, which Megatron-Core supports at expert tensor parallelism 1 only (it "
                  "follows tensor_model_parallel_size when unset); set it to 1")
        problems.append(SpecProblem(f"{prefix}.expert_tensor_parallel_size", etp, reason))
    if tp > 1 and not m.sequence_parallel:
        reason = f"MoE layers at tensor_model_parallel_size={tp} need sequence parallelism; set it to true"
        problems.append(SpecProblem(f"{prefix}.sequence_parallel", False, reason))
    return problems


def _pipeline_split_problem(
    prefix: str, m: MegatronConfig, num_layers: int, world: int
) -> SpecProblem | None:
    """The layout's pipeline split, by the one split function the model, the weight map and the planner use."""
    try:
        pipeline_stage_layers(num_layers, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size,
                              m.extra.get(FIRST_STAGE), m.extra.get(LAST_STAGE))
    except PipelineSplitError as err:
        field = err.field
        value = m.extra.get(field.removeprefix("extra.")) if field.startswith("extra.") else getattr(m, field)
        fits_world = [v for v in err.valid if world % v == 0] if field == "pipeline_model_parallel_size" else err.valid
        return SpecProblem(f"{prefix}.{field}", value, err.reason(fits_world))
    return None


def _check_update_batches(spec: JobSpec) -> list[SpecProblem]:
    roles: list[tuple[str, PPOUpdateConfig, MegatronConfig]] = [
        ("actor", spec.actor, spec.actor.megatron)
    ]
    if spec.critic.enable:
        roles.append(("critic", spec.critic, spec.critic.megatron))
    problems = []
    for role, update, megatron in roles:
        problems += _update_batch_problems(role, update, megatron, spec)
    sequence_length = spec.data.max_prompt_length + spec.data.max_response_length
    if spec.needs_reference and spec.ref.log_prob_use_dynamic_bsz:
        problem = _token_budget_problem("ref", "log_prob_max_token_len_per_gpu", spec.ref.log_prob_max_token_len_per_gpu,
                                        spec.ref.megatron.context_parallel_size, sequence_length)
        problems += [problem] if problem else []
    return problems


def _token_budget_problem(role: str, name: str, budget: int, cp: int, sequence_length: int) -> SpecProblem | None:
    """A per-GPU token budget that cannot hold one full sequence; each of the CP ranks holds 1/CP of it."""
    if budget * cp >= sequence_length:
        return None
    reason = f"is below one full sequence (data.max_prompt_length + data.max_response_length = {sequence_length}"
    if cp > 1:
        reason += f", of which each of the {role}.megatron.context_parallel_size={cp} ranks holds 1/{cp}"
    return SpecProblem(f"{role}.{name}", budget, f"{reason}); use at least {-(-sequence_length // cp)}")


def _update_batch_problems(
    role: str, update: PPOUpdateConfig, megatron: MegatronConfig, spec: JobSpec
) -> list[SpecProblem]:
    prompts, mini = spec.data.train_batch_size, update.ppo_mini_batch_size
    problems = []
    if prompts % mini:
        reason = f"does not divide data.train_batch_size={prompts}; use {one_of(_divisors(prompts))}"
        problems.append(SpecProblem(f"{role}.ppo_mini_batch_size", mini, reason))
    if update.use_dynamic_bsz:
        sequence_length = spec.data.max_prompt_length + spec.data.max_response_length
        problem = _token_budget_problem(role, "ppo_max_token_len_per_gpu", update.ppo_max_token_len_per_gpu,
                                        megatron.context_parallel_size, sequence_length)
        return problems + ([problem] if problem else [])
    dp = _data_parallel_size(megatron, spec.placement.trainer_world_size)
    if dp is None:
        return problems  # the layout check already reports the misfit
    n, micro = spec.rollout.n, update.ppo_micro_batch_size_per_gpu
    sequences = spec.mini_batch_sequences(role)
    if sequences % dp:
        reason = (
            f"makes {sequences} sequences (× rollout.n={n}), which do not split evenly over {dp} "
            f"data-parallel ranks; use a multiple of {dp // gcd(n, dp)}"
        )
        problems.append(SpecProblem(f"{role}.ppo_mini_batch_size", mini, reason))
    elif (sequences // dp) % micro:
        per_rank = sequences // dp
        reason = (
            f"does not divide the {per_rank} sequences each of {dp} data-parallel ranks gets per "
            f"mini-batch ({role}.ppo_mini_batch_size={mini} × rollout.n={n} / {dp}); "
            f"use {one_of(_divisors(per_rank))}"
        )
        problems.append(SpecProblem(f"{role}.ppo_micro_batch_size_per_gpu", micro, reason))
    return problems


def _check_lengths(spec: JobSpec, arch: ModelArchitecture | None) -> list[SpecProblem]:
    data, problems = spec.data, []
    total = data.max_prompt_length + data.max_response_length
    positions = arch.max_position_embeddings if arch else None
    if positions and total > positions:
        reason = (
            f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's "
            f"{positions} positions (max_position_embeddings)"
        )
        problems.append(SpecProblem("data.max_response_length", data.max_response_length, reason))
    max_new_tokens = spec.rollout.max_new_tokens
    if max_new_tokens is not None and max_new_tokens > data.max_response_length:
        reason = (
            f"exceeds data.max_response_length={data.max_response_length}, the longest response "
            "the trainer accepts; lower it or raise that"
        )
        problems.append(SpecProblem("rollout.max_new_tokens", max_new_tokens, reason))
    buffer = spec.reward.overlong_buffer
    if buffer.enable and buffer.length >= data.max_response_length:
        reason = (
            f"must be below data.max_response_length={data.max_response_length}, "
            "the end of which it penalises"
        )
        problems.append(SpecProblem("reward.overlong_buffer.length", buffer.length, reason))
    return problems


def _check_rollout(spec: JobSpec, arch: ModelArchitecture | None) -> list[SpecProblem]:
    rollout, placement, problems = spec.rollout, spec.placement, []
    if rollout.engine == "sglang" and placement.device == "cuda":
        if placement.mode == "colocate" and not rollout.sglang.enable_memory_saver:
            reason = (
                "colocated engines must release GPU memory while the trainer runs; "
                "set it to true, or use placement.mode=disaggregate"
            )
            problems.append(SpecProblem("rollout.sglang.enable_memory_saver", False, reason))
    tp, ep = rollout.tensor_parallel_size, rollout.expert_parallel_size
    node_gpus = placement.gpus_per_node if placement.mode == "colocate" else placement.rollout_gpus_per_node
    if node_gpus is not None and tp > node_gpus and tp % node_gpus:
        reason = (
            f"is larger than a node's {node_gpus} GPUs but not a whole number of nodes; a multi-node "
            f"engine spans whole nodes, so use a divisor of {node_gpus} or a multiple of it"
        )
        problems.append(SpecProblem("rollout.tensor_parallel_size", tp, reason))
    if (rollout.sglang.router or rollout.sglang.router_url) and rollout.engine != "sglang":
        reason = "a router spreads requests over SGLang servers; use rollout.engine=sglang or turn the router off"
        problems.append(SpecProblem("rollout.engine", rollout.engine, reason))
    if spec.trainer.mode != "sync" and placement.mode == "colocate":
        reason = ("overlaps generation with training, so the engines need devices of their own; set "
                  "placement.mode=disaggregate with placement.rollout_nnodes and placement.rollout_gpus_per_node, "
                  "or use trainer.mode=sync")
        problems.append(SpecProblem("trainer.mode", spec.trainer.mode, reason))
    pool = placement.rollout_pool_size
    if pool is not None:
        if rollout.num_gpus is not None and rollout.num_gpus > pool:
            reason = f"exceeds the {pool} GPUs of the rollout pool"
            problems.append(SpecProblem("rollout.num_gpus", rollout.num_gpus, reason))
        else:
            gpus = rollout.num_gpus or pool
            if gpus % tp:
                reason = f"does not divide the {gpus} rollout GPUs; use {one_of(_divisors(gpus))}"
                problems.append(SpecProblem("rollout.tensor_parallel_size", tp, reason))
    if tp % ep:
        # SGLang shards experts inside each engine's tensor-parallel group (moe_tp = tp / ep).
        reason = f"must divide rollout.tensor_parallel_size={tp}; use {one_of(_divisors(tp))}"
        problems.append(SpecProblem("rollout.expert_parallel_size", ep, reason))
    if rollout.quantization == "fp8" and rollout.engine == "sglang" and placement.mode == "disaggregate" \
            and placement.device == "cpu":
        # SGLang receives each tensor of a push into one it allocates in the announced dtype, and gloo, the only
        # backend between CPU processes, cannot carry float8 ("Invalid scalar type"): no push would ever land.
        problems.append(SpecProblem("rollout.quantization", "fp8", "SGLang receives a disaggregated push over gloo "
                                    "on CPU, which cannot carry FP8 weights; use rollout.quantization=none, or "
                                    "placement.device=cuda (NCCL carries them)"))
    problems += _weight_sync_problems(spec)
    problems += _engine_bound_problems(spec)
    if arch is None:
        return problems
    if arch.num_attention_heads % tp:
        reason = (
            f"does not divide the model's {arch.num_attention_heads} attention heads; "
            f"use {one_of(_divisors(arch.num_attention_heads))}"
        )
        problems.append(SpecProblem("rollout.tensor_parallel_size", tp, reason))
    if not arch.is_moe and ep > 1:
        reason = "the model is dense (its config.json declares no routed experts); use 1"
        problems.append(SpecProblem("rollout.expert_parallel_size", ep, reason))
    elif arch.is_moe and arch.num_experts % ep:
        reason = f"does not divide the {arch.num_experts} experts; use {one_of(_divisors(arch.num_experts))}"
        problems.append(SpecProblem("rollout.expert_parallel_size", ep, reason))
    if rollout.quantization == "fp8" and arch.linear_attention is not None:
        # The FP8 sync quantises attention and MLP projections only: unchecked against SGLang's FP8 layers for this
        # model's gated q_proj (query and gate rows) and its bf16 Gated DeltaNet projections.
        problems.append(SpecProblem("rollout.quantization", "fp8", "FP8 rollout is not bridged for a model with "
                                    "Gated DeltaNet layers (Qwen3-Next, Qwen3.5); use rollout.quantization=none"))
    elif rollout.quantization == "fp8" and rollout.engine == "sglang":
        problems += _fp8_fusion_problems(arch, tp, ep)
    return problems


def _engine_bound_problems(spec: JobSpec) -> list[SpecProblem]:
    bounds = spec.placement.engine_bounds(spec.rollout.tensor_parallel_size, spec.rollout.num_gpus)
    if bounds is None:
        return []
    fewest, start, most = bounds
    problems = []
    if fewest > start:
        problems.append(SpecProblem("placement.rollout_min_engines", fewest, f"exceeds the {start} engine(s) the "
                                    f"rollout pool starts with; use at most {start}"))
    if most < start:
        problems.append(SpecProblem("placement.rollout_max_engines", most, f"is below the {start} engine(s) the "
                                    f"rollout pool starts with; use at least {start}"))
    if spec.rollout.autoscale and fewest == most:
        problems.append(SpecProblem("rollout.autoscale", True, f"has no room: the pool's engines are bounded to "
                                    f"{fewest}; set placement.rollout_min_engines below or rollout_max_engines above "
                                    f"{start}"))
    return problems


def _weight_sync_problems(spec: JobSpec) -> list[SpecProblem]:
    rollout, placement = spec.rollout, spec.placement
    problems = []
    if rollout.weight_sync == "delta":
        if rollout.engine == "sglang" and placement.mode == "colocate":
            problems.append(SpecProblem("rollout.weight_sync", "delta", "colocated SGLang takes each bucket by IPC from "
                                        "the trainer rank on its GPU, which sends no bytes a delta could save; use "
                                        "rollout.weight_sync=full, or placement.mode=disaggregate"))
        if spec.actor.lora.rank and spec.actor.lora.weight_sync == "adapter":
            problems.append(SpecProblem("rollout.weight_sync", "delta", "with actor.lora.weight_sync=adapter the engines "
                                        "load each step's adapter, not weights; use actor.lora.weight_sync=merge for "
                                        "delta sync of the merged weights, or rollout.weight_sync=full"))
    if spec.trainer.check_sync_every and rollout.engine == "sglang":
        # SGLang holds its weights fused and sharded, and answers for them only by its own names, truncated.
        problems.append(SpecProblem("trainer.check_sync_every", spec.trainer.check_sync_every, "compares the local "
                                    "engine's weights by HF name; SGLang's are fused and sharded under names of its "
                                    "own; use rollout.engine=local for the check, or 0"))
    return problems


def _fp8_fusion_problems(arch: ModelArchitecture, tp: int, ep: int) -> list[SpecProblem]:
    """What SGLang cannot hold in block-wise FP8 at rollout TP `tp`, one line each with the rollout TP sizes that
    fit. No way of quantising the synced weights gets around these: SGLang refuses them when it builds the model."""
    unfit = _sglang_fp8_unfit(arch, tp, ep)
    # A TP size that fits with an EP that divides it and the current one (so it divides the experts too).
    fits = [size for size in _divisors(arch.num_attention_heads) if not _sglang_fp8_unfit(arch, size, gcd(ep, size))]
    with_ep = " (with rollout.expert_parallel_size dividing it)" if any(size % ep for size in fits) else ""
    fix = (f"use rollout.tensor_parallel_size={one_of(fits)}{with_ep}, " if fits else "use ") + \
        "rollout.quantization=none or rollout.engine=local"
    return [SpecProblem("rollout.quantization", "fp8", f"{what}; {fix}") for what in unfit]


def _sglang_fp8_unfit(arch: ModelArchitecture, tp: int, ep: int) -> list[str]:
    """The projections whose share per rollout TP rank is not whole 128 x 128 FP8 blocks where SGLang needs it
    (sglang/srt/layers/quantization/fp8.py): every projection it stacks into one weight (q/k/v, gate/up, the
    experts' and shared experts' gate/up), since their scales are stacked alike and a partial block would carry
    rows of the next projection; a projection split over TP ranks, since its scale blocks are split too. Both raise
    when the server builds the model. DeepSeek's q_a_proj SGLang concatenates with kv_a_proj_with_mqa, scales
    included, without a check: a partial last block of q_a_proj would give kv_a_proj_with_mqa's rows the wrong
    scales. What SGLang checks but a listed one implies (v_proj is k_proj's size, up_proj and down_proj's columns
    gate_proj's, o_proj's columns q_proj's) is not listed twice."""
    from rlmegatron.models.fp8 import DEFAULT_CONFIG  # the format FP8 rollout syncs; its module imports torch

    block = DEFAULT_CONFIG["weight_block_size"][0]  # rows and columns alike
    stacked, split = "SGLang stacks it with the projections fused with it", "SGLang splits it over TP ranks"
    sizes = []  # (projection, rows or columns in all, the TP ranks that share them, "rows" or "columns", why)
    if arch.mla is not None:
        mla, heads = arch.mla, arch.num_attention_heads
        if mla.q_lora_rank:
            sizes.append(("q_a_proj", mla.q_lora_rank, 1, "rows",
                          "SGLang concatenates it and its scales with kv_a_proj_with_mqa's"))  # replicated
        if tp > 1:  # column- and row-parallel projections SGLang checks only when it splits them
            query = "q_b_proj" if mla.q_lora_rank else "q_proj"
            sizes += [(query, heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim), tp, "rows", split),
                      ("kv_b_proj", heads * (mla.qk_nope_head_dim + mla.v_head_dim), tp, "rows", split),
                      ("o_proj", heads * mla.v_head_dim, tp, "columns", split)]
    else:
        sizes += [("q_proj", arch.num_attention_heads * arch.head_dim, tp, "rows", stacked),
                  # KV heads are replicated up to TP.
                  ("k_proj", max(arch.num_key_value_heads, tp) * arch.head_dim, tp, "rows", stacked)]
    if arch.intermediate_size and not all(arch.moe_layers or (False,)):
        sizes.append(("gate_proj", arch.intermediate_size, tp, "rows", stacked))
    if arch.is_moe:
        # SGLang's expert TP is TP / EP.
        sizes.append(("the experts' gate_proj", arch.moe_intermediate_size, max(tp // ep, 1), "rows", stacked))
    if arch.shared_expert_intermediate_size:
        sizes.append(("the shared experts' gate_proj", arch.shared_expert_intermediate_size, tp, "rows", stacked))
    return [f"{name} would have {total // ranks} {unit} per rollout TP rank ({total} in all), not whole "
            f"{block}-{unit[:-1]} FP8 scale blocks, and {why}"
            for name, total, ranks, unit, why in sizes if (total // ranks) % block]


def _check_algorithm(spec: JobSpec) -> list[SpecProblem]:
    # The registries hold torch functions, so they load only when a spec is checked.
    from rlmegatron import algorithms

    problems = []
    for field, value, registry in (
        ("actor.loss_agg_mode", spec.actor.loss_agg_mode, algorithms.LOSS_AGGREGATIONS),
        ("actor.kl_loss_type", spec.actor.kl_loss_type, algorithms.KL_ESTIMATORS),
        ("algorithm.kl_penalty", spec.algorithm.kl_penalty, algorithms.KL_ESTIMATORS),
    ):
        if value not in registry:
            problems.append(SpecProblem(field, value, _unknown_name(value, registry, plugins=False)))
    estimator_field, estimator = "algorithm.adv_estimator", spec.algorithm.adv_estimator
    estimate, problem = _resolve(
        estimator_field, estimator, algorithms.ADVANTAGE_ESTIMATORS, algorithms.ESTIMATOR_POSITIONAL,
        algorithms.estimator_inputs,
        hint=f"; an estimator may take {one_of(algorithms.ESTIMATOR_INPUTS)} by name",
    )
    if problem:
        problems.append(problem)
    elif not _distills_alone(spec):  # else no estimator runs (relevance.py refuses its settings)
        problems += _estimator_problems(spec, algorithms.estimator_inputs(estimate))
    loss_field, loss_mode = "actor.policy_loss.loss_mode", spec.actor.policy_loss.loss_mode
    loss, problem = _resolve(
        loss_field, loss_mode, algorithms.POLICY_LOSSES, algorithms.POLICY_LOSS_POSITIONAL,
        algorithms.POLICY_LOSS_KEYWORDS,
    )
    problems += [problem] if problem else _unread_loss_knobs(spec.actor, loss, algorithms)
    if estimator == "gspo" and loss_mode != "gspo":
        reason = (
            "algorithm.adv_estimator=gspo is grpo's advantage with the gspo loss; to pair grpo's "
            "advantage with another loss, use algorithm.adv_estimator=grpo"
        )
        problems.append(SpecProblem(loss_field, loss_mode, reason))
    knobs = spec.actor.policy_loss
    if knobs.clip_cov_lb >= knobs.clip_cov_ub:
        reason = f"must be below actor.policy_loss.clip_cov_ub={render_value(knobs.clip_cov_ub)}"
        problems.append(SpecProblem("actor.policy_loss.clip_cov_lb", knobs.clip_cov_lb, reason))
    correction = spec.algorithm.rollout_correction
    if correction.rollout_rs_threshold_lower is not None and \
            correction.rollout_rs_threshold_lower >= correction.rollout_rs_threshold:
        reason = (f"must be below algorithm.rollout_correction.rollout_rs_threshold="
                  f"{render_value(correction.rollout_rs_threshold)}")
        problems.append(SpecProblem("algorithm.rollout_correction.rollout_rs_threshold_lower",
                                    correction.rollout_rs_threshold_lower, reason))
    if spec.algorithm.dynamic_sampling.enable and spec.rollout.n < 2:
        reason = "drops groups whose rewards are all equal, which needs rollout.n >= 2"
        problems.append(SpecProblem("algorithm.dynamic_sampling.enable", True, reason))
    if spec.trainer.critic_warmup and not spec.critic.enable:
        reason = "lets only the critic train for its first steps, and there is no critic; set it to 0"
        problems.append(SpecProblem("trainer.critic_warmup", spec.trainer.critic_warmup, reason))
    if spec.reward.overlong_buffer.enable and spec.reward.manager != "dapo":
        reason = "is applied by the dapo reward manager; set reward.manager=dapo"
        problems.append(SpecProblem("reward.overlong_buffer.enable", True, reason))
    return problems


def _check_lora(spec: JobSpec, arch: ModelArchitecture | None) -> list[SpecProblem]:
    lora, megatron = spec.actor.lora, spec.actor.megatron
    if not lora.rank:
        return []
    problems = []
    if arch is not None and arch.linear_attention is not None:
        reason = ("LoRA adapts Megatron's attention and MLP linears; this model's Gated DeltaNet layers "
                  "(models/gated_delta_net.py) have no adapters, so their mixers would stay frozen; use 0")
        problems.append(SpecProblem("actor.lora.rank", lora.rank, reason))
    if megatron.extra.get("moe_grouped_gemm"):
        reason = ("LoRA adapts each expert's own linears, which grouped-GEMM experts do not have; "
                  "remove moe_grouped_gemm or set actor.lora.rank=0")
        problems.append(SpecProblem("actor.megatron.extra", megatron.extra, reason))
    if "output_layer" in lora.modules_to_save and arch is not None and arch.tie_word_embeddings:
        reason = "the model ties its output layer to the embedding (tie_word_embeddings): name embedding"
        problems.append(SpecProblem("actor.lora.modules_to_save", lora.modules_to_save, reason))
    if lora.weight_sync == "adapter" and lora.modules_to_save:
        reason = "SGLang loads LoRA factors, not whole modules; use actor.lora.weight_sync=merge"
        problems.append(SpecProblem("actor.lora.modules_to_save", lora.modules_to_save, reason))
    if lora.weight_sync == "adapter":
        if spec.rollout.quantization == "fp8":
            # The engines would quantise the base weights alone and add the adapters to them unquantised: not the
            # policy trained quantised, which is what FP8 rollout's mismatch (and its correction) is about.
            reason = ("with rollout.quantization=fp8 the base weights would be quantised without the adapters; use "
                      "actor.lora.weight_sync=merge, whose merged weights are quantised, or rollout.quantization=none")
            problems.append(SpecProblem("actor.lora.weight_sync", "adapter", reason))
        if spec.rollout.engine != "sglang":
            reason = "only SGLang loads LoRA adapters; use actor.lora.weight_sync=merge or rollout.engine=sglang"
            problems.append(SpecProblem("actor.lora.weight_sync", "adapter", reason))
        elif (arch is not None and arch.is_moe) or megatron.pipeline_model_parallel_size > 1:
            reason = ("adapters travel from dense models on one pipeline stage (no experts, "
                      "actor.megatron.pipeline_model_parallel_size=1); use actor.lora.weight_sync=merge")
            problems.append(SpecProblem("actor.lora.weight_sync", "adapter", reason))
    return problems


def _check_routing(spec: JobSpec, arch: ModelArchitecture | None) -> list[SpecProblem]:
    """Routing replay and its agreement need routers, a pass to record (r2) and engines that return routing."""
    moe, problems = spec.actor.moe, []
    asked = [(f"actor.moe.{name}", value) for name, value, default in
             (("routing_replay", moe.routing_replay, "off"), ("routing_agreement", moe.routing_agreement, False))
             if value != default]
    if not asked or arch is None:
        return problems
    if not arch.is_moe:
        return [SpecProblem(field, value, "the model is dense (its config.json declares no routed experts); remove it")
                for field, value in asked]
    if moe.routing_replay == "r2" and not spec.needs_old_log_prob_pass:
        problems.append(SpecProblem(
            "actor.moe.routing_replay", "r2", "replays the old-log-prob pass's routing in the update, and this update "
            "is on-policy (one epoch of one mini-batch), so no such pass runs and the update's routing is its own; use "
            "r3, or more mini-batches (actor.ppo_mini_batch_size below data.train_batch_size) or epochs"))
    if spec.actor.megatron.extra.get("moe_router_fusion"):
        # Transformer Engine's fused top-k never asks Megatron-Core's router-replay hook.
        problems.append(SpecProblem("actor.megatron.extra.moe_router_fusion", True,
                                    "routing replay and its agreement need Megatron-Core's unfused top-k routing; "
                                    "remove it"))
    # What asks the engines for the rollout's routing.
    field, value = ("actor.moe.routing_replay", "r3") if moe.routing_replay == "r3" else \
        ("actor.moe.routing_agreement", True)
    if spec.actor.wants_rollout_routing and spec.rollout.engine == "local" and spec.model.trust_remote_code:
        # The local engine records transformers' own *TopKRouter modules (rollout/local.py); custom code has its own.
        problems.append(SpecProblem(field, value, "the local engine records routing from transformers' own MoE "
                                                  "routers, and model.trust_remote_code runs the model's own code; "
                                                  "use rollout.engine=sglang, or r2 without routing_agreement"))
    return problems


def _check_mtp(spec: JobSpec, arch: ModelArchitecture | None) -> list[SpecProblem]:
    """Training the MTP layers and drafting with them need a model that has them (config.json declares them and the
    checkpoint holds them); the MTP loss shifts its labels along each sequence, which CP splits over ranks."""
    weight, speculative = spec.actor.mtp.loss_weight, spec.rollout.speculative
    asked = ([("actor.mtp.loss_weight", weight)] if weight > 0 else []) + \
        ([("rollout.speculative.method", speculative.method)] if speculative is not None else [])
    if not asked or arch is None:
        return []
    if not built_mtp_layers(arch, spec.model.path, spec.model.random_init):
        if arch.num_mtp_layers:
            why = ("the checkpoint at model.path holds none of the MTP layers config.json declares (transformers "
                   "saves none)")
        elif "mtp." in family_for(arch.model_type).carried_prefixes:
            why = (f"{family_for(arch.model_type).display_name}'s MTP layer (mtp.*) is carried as released, not built "
                   "in Megatron, so it neither trains nor reaches the engines with the sync")
        else:
            why = "the model has no multi-token-prediction layers (config.json declares no num_nextn_predict_layers)"
        return [SpecProblem(field, value, f"{why}; remove it, or use a checkpoint with MTP layers (DeepSeek-V3, "
                                          "GLM-4.5 as published)") for field, value in asked]
    if weight > 0 and spec.actor.megatron.context_parallel_size > 1:
        return [SpecProblem("actor.mtp.loss_weight", weight, "the MTP loss is not supported at actor.megatron."
                            "context_parallel_size > 1; use 0, or context_parallel_size=1")]
    if weight > 0 and spec.actor.lora.rank:
        # LoRA freezes every base weight, the MTP layers' included: their loss would only move the trunk's adapters.
        return [SpecProblem("actor.mtp.loss_weight", weight, "trains the MTP layers whole, and actor.lora freezes "
                            "every base weight; use 0 with LoRA, or train without it (actor.lora.rank=0)")]
    if speculative is not None and spec.rollout.engine == "local" and spec.actor.wants_rollout_routing:
        # Its verification forwards run drafts that are then rejected: no one routing per sampled token to record.
        return [SpecProblem("rollout.speculative.method", speculative.method, "the local engine's speculative "
                            "decoding records no routed experts, which actor.moe's r3 and routing_agreement read from "
                            "the rollout; remove one of them (r2 replays the old-log-prob pass's routing instead)")]
    return []


def _check_reward_model(spec: JobSpec) -> list[SpecProblem]:
    """`reward.model.path` is an HF sequence classifier with one label that its layout fits."""
    model = spec.reward.model
    if model.path is None:
        return []
    fix = "give the directory of an HF *ForSequenceClassification reward model with one label"
    config_file = Path(model.path) / "config.json"
    if not config_file.is_file():
        return [SpecProblem("reward.model.path", model.path, f"has no config.json; {fix}")]
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        held = ", ".join(architectures) or "no architectures"
        return [SpecProblem("reward.model.path", model.path, f"holds {held}; {fix}")]
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if labels != 1:
        return [SpecProblem("reward.model.path", model.path, f"scores {labels} labels, not one; {fix}")]
    layout = MegatronConfig(tensor_model_parallel_size=model.tensor_model_parallel_size,
                            expert_tensor_parallel_size=model.tensor_model_parallel_size,
                            sequence_parallel=model.sequence_parallel)
    problems = _check_layout_fits_world("reward.model", layout, spec)
    try:
        return problems or check_layout_fits_model("reward.model", layout, read_architecture(config_file), spec)
    except ArchitectureError as err:
        return [SpecProblem("reward.model.path", model.path, str(err))]


def _distills_alone(spec: JobSpec) -> bool:
    return spec.algorithm.distill is not None and spec.algorithm.distill.only


def _check_distillation(spec: JobSpec, arch: ModelArchitecture | None) -> list[SpecProblem]:
    """algorithm.distill has a teacher whose layout fits it, a mode that exists, and a task for the critic; the
    teacher without distill is relevance.py's (a setting that does nothing)."""
    from rlmegatron.algorithms import DISTILL_MODES  # lazy: torch, as _check_algorithm's registries

    distill, teacher = spec.algorithm.distill, spec.teacher
    if distill is None:
        return []
    problems = []
    if distill.mode not in DISTILL_MODES:
        problems.append(SpecProblem("algorithm.distill.mode", distill.mode,
                                    _unknown_name(distill.mode, DISTILL_MODES, plugins=False)))
    if distill.only and spec.critic.enable:
        problems.append(SpecProblem("algorithm.distill.only", True,
                                    "the advantage is the teacher's term alone, so the critic "
                                    f"(algorithm.adv_estimator={spec.algorithm.adv_estimator}) would learn the values "
                                    "of no return; use algorithm.adv_estimator=grpo, or only=false"))
    if distill.baseline == "group_mean" and spec.rollout.n < 2:
        problems.append(SpecProblem("algorithm.distill.baseline", distill.baseline,
                                    "subtracts the mean over each prompt's responses, which needs rollout.n >= 2; "
                                    "use baseline=none, or sample more responses per prompt"))
    if teacher.path is None:
        problems.append(SpecProblem("algorithm.distill", NO_VALUE,
                                    "needs a teacher to distill from; set teacher.path to its HF checkpoint (or a "
                                    "checkpoint written by `rlm convert hf-to-mcore`)"))
        return problems
    teacher_arch, problem = teacher_architecture(spec)
    if problem is not None:
        return problems + [problem]
    if arch is not None and teacher_arch.vocab_size != arch.vocab_size:
        problems.append(SpecProblem("teacher.path", teacher.path,
                                    f"has a vocabulary of {teacher_arch.vocab_size} tokens and the student "
                                    f"(model.path) {arch.vocab_size}: distillation compares the two models' log-probs "
                                    "token by token, so the teacher must share the student's tokenizer; use a teacher "
                                    "of the student's family"))
    problems += _check_layout_fits_world("teacher.megatron", teacher.megatron, spec)
    problems += check_layout_options("teacher.megatron", teacher.megatron)
    problems += extra_problems("teacher.megatron", teacher.megatron.extra, teacher_arch.mla is not None)
    return problems or check_layout_fits_model("teacher.megatron", teacher.megatron, teacher_arch, spec)


def teacher_architecture(spec: JobSpec) -> tuple[ModelArchitecture | None, SpecProblem | None]:
    """The teacher's architecture: from its config.json (teacher.path, else teacher.hf_config), or the config a
    converted checkpoint (`rlm convert hf-to-mcore`) records."""
    from rlmegatron.models.convert import META_FILE  # lazy: torch, for a constant of a spec that distills

    teacher = spec.teacher
    if Path(teacher.path, META_FILE).is_file():
        try:
            return architecture_of(json.loads(Path(teacher.path, META_FILE).read_text())["hf_config"]), None
        except (ValueError, KeyError, TypeError, ArchitectureError) as err:
            return None, SpecProblem("teacher.path", teacher.path, f"{META_FILE} is unreadable ({err}); rewrite the "
                                     "checkpoint with `rlm convert hf-to-mcore`")
    located = teacher.architecture_source()
    if located is None:
        return None, SpecProblem("teacher.path", teacher.path,
                                 "is not a local directory and teacher.hf_config is not set; hub ids cannot be "
                                 "fetched here, so set teacher.hf_config to the teacher's config.json (configs/models/ "
                                 "has common ones)")
    field, path = located
    try:
        return read_architecture(path), None
    except ArchitectureError as err:
        return None, SpecProblem(field, path, str(err))


def _unknown_name(value: str, registry: Any, plugins: bool) -> str:
    reason = f"is not a registered {registry.kind} ({one_of(registry.names())})"
    if plugins:
        reason += " nor a path/to/file.py:function plug-in"
    close = difflib.get_close_matches(value, registry.names(), n=1, cutoff=0.6)
    return reason + (f"; did you mean '{close[0]}'?" if close else "")


def _resolve(
    field: str, value: str, registry: Any, positional: tuple[str, ...], keywords: Any, hint: str = ""
) -> tuple[Callable | None, SpecProblem | None]:
    """The function a registered name or a plug-in reference stands for, or the problem that stops it."""
    if is_plugin_reference(value):
        reason = plugin_problem(value, positional, keywords)
        if reason:
            # `hint` explains a call that does not fit (call_problem's "cannot be called as ..."), not a load error.
            return None, SpecProblem(field, value, reason + (hint if reason.startswith("cannot be called") else ""))
        return load_plugin(value), None
    if value not in registry:
        return None, SpecProblem(field, value, _unknown_name(value, registry, plugins=True))
    return registry.get(value), None


def _estimator_problems(spec: JobSpec, inputs: tuple[str, ...]) -> list[SpecProblem]:
    """What the estimator taking `inputs` needs from the rest of the spec."""
    estimator, n, problems = spec.algorithm.adv_estimator, spec.rollout.n, []
    in_groups = estimator in GROUP_ESTIMATORS if not is_plugin_reference(estimator) else "group_index" in inputs
    if in_groups and n < 2:
        reason = (
            f"algorithm.adv_estimator={estimator} compares the responses to each prompt, "
            "which needs rollout.n >= 2"
        )
        problems.append(SpecProblem("rollout.n", n, reason))
    if "values" in inputs and not spec.critic.enable:
        fix = "set it to true or leave it unset" if estimator == "gae" else "set it to true"
        reason = f"algorithm.adv_estimator={estimator} needs a value model; {fix}"
        problems.append(SpecProblem("critic.enable", False, reason))
    if "values" not in inputs and spec.critic.enable:
        reason = (
            f"algorithm.adv_estimator={estimator} does not use a value model; "
            "set it to false, or use algorithm.adv_estimator=gae"
        )
        problems.append(SpecProblem("critic.enable", True, reason))
    return problems


def _unread_loss_knobs(actor: ActorConfig, loss: Callable, algorithms: Any) -> list[SpecProblem]:
    """Loss settings the chosen loss never reads must keep their defaults (a user's loss may read any)."""
    read = algorithms.config_fields_read(loss)
    if read is None:
        return []
    defaults = ActorConfig().policy_loss_settings()
    problems = []
    for name, (field, value) in actor.policy_loss_settings().items():
        if name in read or value == defaults[name][1]:
            continue
        readers = sorted(
            loss_name for loss_name in algorithms.POLICY_LOSSES.names()
            if name in algorithms.config_fields_read(algorithms.POLICY_LOSSES.get(loss_name))
        )
        reason = (
            f"actor.policy_loss.loss_mode={actor.policy_loss.loss_mode} does not use it; remove it, "
            f"or use a loss that does ({one_of(readers)})"
        )
        problems.append(SpecProblem(field, value, reason))
    return problems


def _check_placement(spec: JobSpec) -> list[SpecProblem]:
    placement, problems = spec.placement, []
    for name in ("rollout_nnodes", "rollout_gpus_per_node"):
        value = getattr(placement, name)
        if placement.mode == "disaggregate" and value is None:
            reason = "is required when placement.mode=disaggregate, where the engines have their own nodes"
            problems.append(SpecProblem(f"placement.{name}", NO_VALUE, reason))
        elif placement.mode == "colocate" and value is not None:
            reason = "only applies to placement.mode=disaggregate; remove it or switch the mode"
            problems.append(SpecProblem(f"placement.{name}", value, reason))
    if placement.transport == "processes" and not placement.fits_processes:
        asks = (f"placement.nnodes={placement.nnodes}" if placement.nnodes > 1
                else "a rollout pool of GPUs of its own (placement.mode=disaggregate)")
        reason = f"runs the ranks on this machine without Ray, but {asks} needs Ray; use placement.transport=ray or auto"
        problems.append(SpecProblem("placement.transport", placement.transport, reason))
    return problems


def _trained_optimizers(spec: JobSpec) -> list[tuple[str, OptimConfig]]:
    optimizers = [("actor", spec.actor.optim)]
    if spec.critic.enable:
        optimizers.append(("critic", spec.critic.optim))
    return optimizers


def _check_optimizers(spec: JobSpec) -> list[SpecProblem]:
    # Against the run's length: schedule_problems, the pipeline's schedule stage (the length may come from the data).
    return [
        SpecProblem(f"{role}.optim.min_lr", optim.min_lr, f"exceeds {role}.optim.lr={render_value(optim.lr)}")
        for role, optim in _trained_optimizers(spec)
        if optim.min_lr > optim.lr
    ]


def schedule_problems(spec: JobSpec, total_steps: int, source: str) -> list[SpecProblem]:
    """Learning-rate schedules that do not fit the run's `total_steps` (known from `source`): the schedule
    warms up over its first lr_warmup_steps trainer steps and decays over the rest."""
    return [
        SpecProblem(f"{role}.optim.lr_warmup_steps", optim.lr_warmup_steps,
                    f"must be below the run's {total_steps} steps ({source}); lower it")
        for role, optim in _trained_optimizers(spec)
        if optim.lr_warmup_steps >= total_steps
    ]


def _check_input_paths(spec: JobSpec) -> list[SpecProblem]:
    """Inputs the user writes must exist; data files may not yet (`rlm prepare` writes them)."""
    problems = []
    for field, plugin in (("data.dataset_class", spec.data.dataset_class), ("reward.function", spec.reward.function)):
        if plugin is None:
            continue
        file = plugin.rpartition(":")[0]
        if not Path(file).is_file():
            reason = f"{file} is not a file (relative paths start at the working directory)"
            problems.append(SpecProblem(field, plugin, reason))
    resume = spec.trainer.resume
    if resume not in ("auto", "disable") and not Path(resume).exists():
        reason = "is not auto, disable, or an existing checkpoint path"
        problems.append(SpecProblem("trainer.resume", resume, reason))
    init_from = spec.critic.init_from
    if spec.critic.enable and init_from != "actor" and not (Path(init_from) / "config.json").is_file():
        reason = "is neither `actor` nor an HF reward/value model directory (no config.json there)"
        problems.append(SpecProblem("critic.init_from", init_from, reason))
    return problems


def _check_remote_code(model: ModelConfig) -> list[SpecProblem]:
    """A local model or tokenizer directory whose own code (`auto_map`) transformers needs to load it."""
    if model.trust_remote_code:
        return []
    problems = []
    for directory, file, loader in ((model.path, "config.json", "AutoConfig"),
                                    (model.tokenizer_path, "tokenizer_config.json", "AutoTokenizer")):
        try:
            auto_map = json.loads((Path(directory) / file).read_text(encoding="utf-8")).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue  # no such local file: nothing declares custom code (or the architecture check says why)
        declared = auto_map.get(loader) if isinstance(auto_map, dict) else None
        if not declared:
            continue
        # transformers falls back on a class of its own where it has one, so only a failed load needs the code.
        if _loads_without_remote_code(loader, directory):
            continue
        code = ", ".join(name for name in (declared if isinstance(declared, list) else [declared]) if name)
        reason = (f"{Path(directory) / file} names its own code ({code}), without which transformers cannot load it; "
                  "set it to true if you trust that code")
        problems.append(SpecProblem("model.trust_remote_code", False, reason))
    return problems


def _loads_without_remote_code(loader: str, directory: str) -> bool:
    import transformers  # only for a directory that declares custom code

    try:
        getattr(transformers, loader).from_pretrained(directory, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - it names its own code and does not load without it
        return False
    return True


def _check_validation(spec: JobSpec) -> list[SpecProblem]:
    if spec.data.val_files:
        return []
    problems = []
    if spec.trainer.val_before_train:
        reason = "needs data.val_files; add some or set it to false"
        problems.append(SpecProblem("trainer.val_before_train", True, reason))
    if spec.trainer.test_freq > 0:
        reason = "needs data.val_files; add some or set it to -1"
        problems.append(SpecProblem("trainer.test_freq", spec.trainer.test_freq, reason))
    return problems


def _check_tracking(spec: JobSpec) -> list[SpecProblem]:
    backend = spec.tracking.rollout_trace.backend
    if backend is None or backend in spec.tracking.backends:
        return []
    reason = f"the samples go to the run's {backend} tracker; add {backend} to tracking.backends"
    return [SpecProblem("tracking.rollout_trace.backend", backend, reason)]
