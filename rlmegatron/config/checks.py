"""Cross-field checks on a parsed JobSpec: parallel layouts vs model and cluster, batch arithmetic, option clashes."""
from __future__ import annotations

from math import gcd, prod
from pathlib import Path

from rlmegatron.config.architecture import ArchitectureError, ModelArchitecture, read_architecture
from rlmegatron.config.errors import NO_VALUE, SpecProblem, one_of, render_value
from rlmegatron.config.spec import JobSpec, MegatronConfig, ModelConfig, PPOUpdateConfig

# Estimators whose baseline is the other responses to the same prompt.
GROUP_ESTIMATORS = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline", "gspo"})


def check_spec(spec: JobSpec) -> list[SpecProblem]:
    """Every cross-field problem in `spec`, empty when it can run; reads the model's config.json."""
    arch, problems = _read_model_architecture(spec.model)
    problems += _check_parallel_layouts(spec, arch)
    problems += _check_update_batches(spec)
    problems += _check_lengths(spec, arch)
    problems += _check_rollout(spec, arch)
    problems += _check_algorithm(spec)
    problems += _check_placement(spec)
    problems += _check_optimizers(spec)
    problems += _check_input_paths(spec)
    problems += _check_validation(spec)
    return problems


def training_problems(spec: JobSpec) -> list[SpecProblem]:
    """What `rlm train` needs on top of check_spec. `rlm validate` and `rlm plan` can read the architecture of a hub
    model from model.hf_config; training reads its config.json and weights from a local model.path."""
    if Path(spec.model.path).is_dir():
        return []
    return [SpecProblem("model.path", spec.model.path,
                        "rlm train reads the model from a local directory and downloads nothing; download it "
                        "(huggingface-cli download ID --local-dir DIR) and set model.path=DIR "
                        "(model.hf_config only serves rlm validate and rlm plan)")]


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
        problems += _check_layout_options(f"{role}.megatron", megatron)
        if arch is not None:
            problems += _check_layout_fits_model(f"{role}.megatron", megatron, arch, spec)
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


def _check_layout_options(prefix: str, m: MegatronConfig) -> list[SpecProblem]:
    problems = []
    if m.sequence_parallel and m.tensor_model_parallel_size == 1:
        problems.append(
            SpecProblem(
                f"{prefix}.sequence_parallel",
                True,
                "needs tensor_model_parallel_size > 1 (Megatron refuses it at TP=1); set it to false",
            )
        )
    if m.context_parallel_size > 1:
        # Until sequences are split over the CP ranks, CP>1 would only crash at model build (local attention).
        problems.append(
            SpecProblem(
                f"{prefix}.context_parallel_size",
                m.context_parallel_size,
                "is not supported yet (sequences are not split over context-parallel ranks); use 1",
            )
        )
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


def _check_layout_fits_model(
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

    pipeline_problem = _pipeline_split_problem(prefix, m, arch.num_hidden_layers, world)
    if pipeline_problem:
        problems.append(pipeline_problem)

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
    if tp > 1 and not m.sequence_parallel:
        reason = f"MoE layers at tensor_model_parallel_size={tp} need sequence parallelism; set it to true"
        problems.append(SpecProblem(f"{prefix}.sequence_parallel", False, reason))
    return problems


def _pipeline_split_problem(
    prefix: str, m: MegatronConfig, num_layers: int, world: int
) -> SpecProblem | None:
    """Mirror of Megatron-Core's layer split rules (TransformerConfig.__post_init__, 0.16)."""
    pp, vpp, extra = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size, m.extra
    if "pipeline_model_parallel_layout" in extra:
        return None  # an explicit layout string is validated by Megatron against the model itself
    first = extra.get("num_layers_in_first_pipeline_stage")
    last = extra.get("num_layers_in_last_pipeline_stage")
    pp_field = f"{prefix}.pipeline_model_parallel_size"
    if first is not None or last is not None:
        middle_layers = num_layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        if bool(middle_layers) != bool(middle_stages) or (middle_stages and middle_layers % middle_stages):
            reason = (
                f"leaves {middle_layers} layers for {middle_stages} middle stages after "
                "extra.num_layers_in_first/last_pipeline_stage; they must split evenly"
            )
            return SpecProblem(pp_field, pp, reason)
        stage_sizes = [size for size in (first, last) if size is not None]
        if middle_stages:
            stage_sizes.append(middle_layers // middle_stages)
    else:
        # Megatron counts the embedding and the loss as layers when asked to balance them.
        padded = (
            num_layers
            + bool(extra.get("account_for_embedding_in_pipeline_split"))
            + bool(extra.get("account_for_loss_in_pipeline_split"))
        )
        if padded % pp:
            reason = (
                f"does not divide the model's {padded} layers; use "
                f"{one_of(_common_divisors(padded, world))}, or split unevenly with "
                "extra.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
            )
            return SpecProblem(pp_field, pp, reason)
        stage_sizes = [padded // pp]
    if vpp is not None and any(size % vpp for size in stage_sizes):
        reason = (
            f"does not divide the layers of each pipeline stage ({one_of(sorted(set(stage_sizes)))}); "
            f"use {one_of(_common_divisors(*stage_sizes))}"
        )
        return SpecProblem(f"{prefix}.virtual_pipeline_model_parallel_size", vpp, reason)
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
    budget = spec.ref.log_prob_max_token_len_per_gpu
    if spec.needs_reference and spec.ref.log_prob_use_dynamic_bsz and budget < sequence_length:
        problems.append(_token_budget_problem("ref.log_prob_max_token_len_per_gpu", budget, sequence_length))
    return problems


def _token_budget_problem(field: str, budget: int, sequence_length: int) -> SpecProblem:
    reason = (
        "is below one full sequence (data.max_prompt_length + data.max_response_length = "
        f"{sequence_length}); use at least {sequence_length}"
    )
    return SpecProblem(field, budget, reason)


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
        if update.ppo_max_token_len_per_gpu < sequence_length:
            problems.append(
                _token_budget_problem(
                    f"{role}.ppo_max_token_len_per_gpu", update.ppo_max_token_len_per_gpu, sequence_length
                )
            )
        return problems
    dp = _data_parallel_size(megatron, spec.placement.trainer_world_size)
    if dp is None:
        return problems  # the layout check already reports the misfit
    n, micro = spec.rollout.n, update.ppo_micro_batch_size_per_gpu
    sequences = mini * n
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
    if placement.mode == "disaggregate" and rollout.engine != "sglang":
        reason = "a disaggregated rollout pool runs SGLang servers that receive weights over NCCL; use sglang"
        problems.append(SpecProblem("rollout.engine", rollout.engine, reason))
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
    return problems


def _check_algorithm(spec: JobSpec) -> list[SpecProblem]:
    estimator, n, problems = spec.algorithm.adv_estimator, spec.rollout.n, []
    if estimator in GROUP_ESTIMATORS and n < 2:
        reason = (
            f"algorithm.adv_estimator={estimator} compares the responses to each prompt, "
            "which needs rollout.n >= 2"
        )
        problems.append(SpecProblem("rollout.n", n, reason))
    if spec.algorithm.dynamic_sampling.enable and n < 2:
        reason = "drops groups whose rewards are all equal, which needs rollout.n >= 2"
        problems.append(SpecProblem("algorithm.dynamic_sampling.enable", True, reason))
    if estimator == "gae" and not spec.critic.enable:
        reason = "algorithm.adv_estimator=gae needs a value model; set it to true or leave it unset"
        problems.append(SpecProblem("critic.enable", False, reason))
    if estimator != "gae" and spec.critic.enable:
        reason = (
            f"algorithm.adv_estimator={estimator} does not use a value model; "
            "set it to false, or use algorithm.adv_estimator=gae"
        )
        problems.append(SpecProblem("critic.enable", True, reason))
    if spec.reward.overlong_buffer.enable and spec.reward.manager != "dapo":
        reason = "is applied by the dapo reward manager; set reward.manager=dapo"
        problems.append(SpecProblem("reward.overlong_buffer.enable", True, reason))
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
    return problems


def _check_optimizers(spec: JobSpec) -> list[SpecProblem]:
    optimizers = [("actor", spec.actor.optim)]
    if spec.critic.enable:
        optimizers.append(("critic", spec.critic.optim))
    return [
        SpecProblem(f"{role}.optim.min_lr", optim.min_lr, f"exceeds {role}.optim.lr={render_value(optim.lr)}")
        for role, optim in optimizers
        if optim.min_lr > optim.lr
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
