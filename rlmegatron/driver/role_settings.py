"""The job spec becomes the settings of each role that runs it: the trainer ranks' Megatron roles (actor, reference,
critic) with their layouts, optimizers, batching and offload; the model they start from; the rollout engines (local
or SGLang servers) and the weight push to them.

This is the one place where the spec reaches the code that runs in a trainer rank or on the rollout pool: those
processes read these settings, never the spec (tests/config/field_effects.py names the tests that show each field's
effect). The driver's fit loop reads the algorithm's fields itself (driver/trainer.py).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Optional

from rlmegatron.algorithms import PolicyLossConfig
from rlmegatron.config import JobSpec
from rlmegatron.config.spec import RolloutConfig, micro_batch_tokens
from rlmegatron.config.transformer_config import FIRST_STAGE, LAST_STAGE
from rlmegatron.models.fp8 import DEFAULT as FP8_ROLLOUT
from rlmegatron.models.hf_config import spec_config_options
from rlmegatron.models.lora import LoRASettings
from rlmegatron.models.source import ModelSource
from rlmegatron.rank.roles import ActorSettings, CriticSettings, OptimizerSettings
from rlmegatron.rank.roles.offload import PARTS
from rlmegatron.rank.roles.reward_model import RewardModelSettings
from rlmegatron.rank.settings import RoleSettings, TrainerRankSettings
from rlmegatron.rollout.agent_loop import AgentSettings
from rlmegatron.rollout.delta import LOADER as DELTA_LOADER
from rlmegatron.rollout.settings import RolloutSettings
from rlmegatron.rollout.sglang.server import RETURN_ROUTED_EXPERTS, SGLANG_DTYPES, ServerSpec, speculative_flags
from rlmegatron.runtime import ParallelLayout

LOCAL_SERVER_MODULE = "rlmegatron.rollout.local_server"

ROLES = ("actor", "reference", "critic", "teacher")
"""The Megatron roles the spec lays out in sections of their own (the teacher, algorithm.distill's, is a model of its
own at its own layout); a reward model (`reward.model`) is a role of its own model too."""


def trainer_rank_settings(spec: JobSpec, total_steps: int) -> TrainerRankSettings:
    """`total_steps`: the run's trainer steps (Trainer.total_steps), which the learning-rate schedules span."""
    actor = actor_settings(spec, total_steps)
    workers = {"actor": actor, "reference": reference_settings(actor, spec.ref),
               "critic": critic_settings(spec, total_steps), "teacher": reference_settings(actor, spec.teacher)}
    sections = {"actor": spec.actor, "reference": spec.ref, "critic": spec.critic, "teacher": spec.teacher}
    wanted = {"actor": True, "reference": spec.needs_reference, "critic": spec.critic.enable,
              "teacher": spec.algorithm.distill is not None}
    roles = {role: RoleSettings(parallel_layout(sections[role].megatron), spec_config_options(sections[role].megatron),
                                workers[role], _offload_parts(sections[role].offload))
             for role in ROLES if wanted[role]}
    if spec.reward.model.path is not None:
        roles["reward"] = reward_model_role(spec.reward.model)
    return TrainerRankSettings(
        seed=spec.trainer.seed,
        model=model_source(spec),
        roles=roles,
        critic_init_from=spec.critic.init_from,
        lora=lora_settings(spec.actor.lora),
        reward_model_path=spec.reward.model.path,
        teacher_path=spec.teacher.path if spec.algorithm.distill is not None else None,
        init_dir=str(Path(spec.trainer.run_dir) / "init_actor"),
        colocated=spec.placement.mode == "colocate",
        rollout=rollout_settings(spec),
        freeze_vision=spec.actor.vision.freeze,
    )


def model_source(spec: JobSpec) -> ModelSource:
    model = spec.model
    return ModelSource(model.path, model.dtype, model.random_init, model.trust_remote_code, model.tokenizer_path)


def parallel_layout(megatron) -> ParallelLayout:
    return ParallelLayout(
        tp=megatron.tensor_model_parallel_size,
        pp=megatron.pipeline_model_parallel_size,
        vpp=megatron.virtual_pipeline_model_parallel_size,
        cp=megatron.context_parallel_size,
        ep=megatron.expert_model_parallel_size,
        etp=megatron.expert_tensor_parallel_size,
        sequence_parallel=megatron.sequence_parallel,
        first_stage_layers=megatron.extra.get(FIRST_STAGE),
        last_stage_layers=megatron.extra.get(LAST_STAGE),
    )


def actor_settings(spec: JobSpec, total_steps: int) -> ActorSettings:
    """The actor's worker settings from the spec; mini-batches count prompts in the spec, sequences here;
    the learning-rate schedule spans the run's `total_steps` trainer steps."""
    actor = spec.actor
    return ActorSettings(
        **_training_fields("actor", spec, total_steps),
        temperature=spec.rollout.temperature or 1.0,
        policy_loss=actor.policy_loss.loss_mode,
        policy_loss_config=PolicyLossConfig(**{name: value for name, (_, value) in
                                               actor.policy_loss_settings().items()}),
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        entropy_coeff=actor.entropy_coeff,
        log_prob_micro_batch_size=spec.rollout.log_prob_micro_batch_size_per_gpu,
        routing_replay=actor.moe.routing_replay,
        routing_agreement=actor.moe.routing_agreement,
        mtp_loss_weight=actor.mtp.loss_weight,
        mtp_detach=actor.mtp.detach,
    )


def lora_settings(lora) -> Optional[LoRASettings]:
    """`actor.lora`'s adapters, or None for full training (rank 0)."""
    if not lora.rank:
        return None
    return LoRASettings(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                        target_modules=tuple(lora.target_modules), modules_to_save=tuple(lora.modules_to_save))


def reward_model_role(model) -> RoleSettings:
    """The reward model's role from `reward.model`: its own TP (and sequence parallelism), batching and offload."""
    return RoleSettings(ParallelLayout(tp=model.tensor_model_parallel_size, sequence_parallel=model.sequence_parallel),
                        {}, RewardModelSettings(micro_batch_size=model.micro_batch_size_per_gpu),
                        _offload_parts(model.offload))


def reference_settings(actor: ActorSettings, ref) -> ActorSettings:
    """The actor's settings `actor` (log-probs are computed exactly as the actor's: temperature, vocabulary) with
    the reference's (or the teacher's) own forward batching from its spec section `ref` (or `teacher`)."""
    return dataclasses.replace(
        actor,
        micro_batch_size=ref.log_prob_micro_batch_size_per_gpu,
        max_token_len=micro_batch_tokens(ref.log_prob_max_token_len_per_gpu, ref.megatron)
        if ref.log_prob_use_dynamic_bsz else None,
        routing_replay="off",  # the reference routes freely
        routing_agreement=False,
    )


def critic_settings(spec: JobSpec, total_steps: int) -> CriticSettings:
    return CriticSettings(**_training_fields("critic", spec, total_steps),
                          cliprange_value=spec.critic.cliprange_value)


def _training_fields(name: str, spec: JobSpec, total_steps: int) -> dict:
    """Batching and optimizer settings of a trained role (`name`: actor or critic) from its spec section."""
    role = getattr(spec, name)
    return dict(
        ppo_mini_batch_size=spec.mini_batch_sequences(name),
        ppo_epochs=role.ppo_epochs,
        micro_batch_size=role.ppo_micro_batch_size_per_gpu,
        max_token_len=(micro_batch_tokens(role.ppo_max_token_len_per_gpu, role.megatron)
                       if role.use_dynamic_bsz else None),
        loss_agg_mode=spec.actor.loss_agg_mode,
        optimizer=_optimizer_settings(role.optim, total_steps),
        use_distributed_optimizer=role.megatron.use_distributed_optimizer,
    )


def _optimizer_settings(optim, total_steps: int) -> OptimizerSettings:
    return OptimizerSettings(
        lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_style=optim.lr_decay_style,
        lr_decay_steps=total_steps,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
    )


def _offload_parts(offload) -> tuple[str, ...]:
    """The parts an `*.offload` section asks for (the reference's has params only)."""
    return tuple(part for part in PARTS if getattr(offload, part, False))


def rollout_settings(spec: JobSpec) -> RolloutSettings:
    rollout, sglang = spec.rollout, spec.rollout.sglang
    # A disaggregated local engine is a server of its own (rollout.local_server), run by this interpreter.
    local = {"python": sys.executable, "module": LOCAL_SERVER_MODULE} if rollout.engine == "local" else {}
    return RolloutSettings(
        engine=rollout.engine,
        device=spec.placement.device,
        model=model_source(spec),
        tensor_parallel_size=rollout.tensor_parallel_size,
        num_gpus=rollout.num_gpus,
        pool_size=rollout.num_gpus or spec.placement.rollout_pool_size,
        bucket_bytes=rollout.update_weights_bucket_mb << 20,
        quantization=rollout.quantization,
        server=server_spec(rollout, spec.model.path, port=0, trust_remote_code=spec.model.trust_remote_code,
                           dtype=SGLANG_DTYPES[spec.model.dtype], device=spec.placement.device, **local,
                           lora_rank=spec.actor.lora.rank if spec.actor.lora.weight_sync == "adapter" else 0,
                           return_routed_experts=spec.actor.wants_rollout_routing),
        router_url=sglang.router_url,
        router_args=dict(sglang.router_args),
        startup_timeout_s=sglang.startup_timeout_s,
        log_dir=str(Path(spec.trainer.run_dir) / "logs"),
        multi_turn=agent_settings(spec),
        lora=lora_settings(spec.actor.lora) if spec.actor.lora.weight_sync == "adapter" else None,
        adapter_dir=str(Path(spec.trainer.run_dir) / "lora_adapters"),
        partial_rollout=spec.trainer.partial_rollout,
        weight_sync=rollout.weight_sync,
        full_sync_every=rollout.full_sync_every,
        check_sync_every=spec.trainer.check_sync_every,
        num_draft_tokens=rollout.speculative.num_draft_tokens if rollout.speculative is not None else 0,
    )


def agent_settings(spec: JobSpec) -> Optional[AgentSettings]:
    multi_turn = spec.rollout.multi_turn
    if not multi_turn.tools:
        return None
    return AgentSettings(
        max_turns=multi_turn.max_turns,
        max_tool_response_length=multi_turn.max_tool_response_length,
        tool_call_format=multi_turn.tool_call_format,
        tools=tuple((tool.plugin, dict(tool.config)) for tool in multi_turn.tools),
        tool_timeout_s=multi_turn.tool_timeout_s,
        tokenizer_path=spec.model.tokenizer_path,
        trust_remote_code=spec.model.trust_remote_code,
    )


def server_spec(rollout: RolloutConfig, model_path: str, port: int, lora_rank: int = 0,
                return_routed_experts: bool = False, **overrides: Any) -> ServerSpec:
    """An SGLang server's launch spec from the `rollout` section; `overrides` set the other ServerSpec fields;
    `lora_rank` > 0 serves LoRA adapters of that rank on every linear; `return_routed_experts`: the server records
    each token's experts for the requests that ask (routing replay, actor.moe); `rollout.quantization` fp8 makes the
    server hold its linear weights in the block-wise FP8 format the sync pushes (SGLang reads the format from the
    model's quantization_config, which the override gives it); `rollout.speculative` launches it with its own
    speculative decoding, drafted by the model's MTP layer (speculative_flags)."""
    sglang = rollout.sglang
    flags: dict[str, Any] = {}
    if lora_rank:
        flags.update({"enable-lora": True, "max-lora-rank": lora_rank, "lora-target-modules": "all"})
    if return_routed_experts:
        flags[RETURN_ROUTED_EXPERTS] = True
    if rollout.weight_sync == "delta":
        flags["custom-weight-loader"] = DELTA_LOADER  # where a delta push lands in the server (rollout/delta.py)
    if rollout.speculative is not None:
        flags.update(speculative_flags(rollout.speculative.num_draft_tokens))
    if rollout.quantization == "fp8":
        flags.update({"quantization": "fp8",
                      "json-model-override-args": json.dumps({"quantization_config": FP8_ROLLOUT.config})})
    fields = dict(
        python=sglang.python,
        tp_size=rollout.tensor_parallel_size,
        ep_size=rollout.expert_parallel_size,
        enable_dp_attention=rollout.enable_dp_attention,
        mem_fraction_static=rollout.mem_fraction_static,
        enable_memory_saver=sglang.enable_memory_saver,
        load_format=sglang.load_format,
        skip_tokenizer_init=sglang.skip_tokenizer_init,
        extra_args={**flags, **sglang.extra_args},
    )
    return ServerSpec(model_path=model_path, port=port, **{**fields, **overrides})
