"""The plan of a checked job spec: memory per phase against the GPU, sync cost, and the layouts that cannot run."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rlmegatron.models.families import ModelArchitecture
from rlmegatron.config.checks import teacher_architecture
from rlmegatron.config.errors import SpecProblem
from rlmegatron.config.spec import JobSpec, MegatronConfig
from rlmegatron.models.families import built_mtp_layers, read_architecture
from rlmegatron.planner.memory import (
    GB,
    EngineMemory,
    RolloutBufferMemory,
    ScoringMemory,
    TrainingMemory,
    WeightSync,
    delta_sent_ratio,
    engine_memory,
    micro_batch,
    resident_model_state,
    rollout_buffer_memory,
    scoring_memory,
    teacher_memory,
    training_memory,
    weight_sync,
)
from rlmegatron.planner.parameters import count_parameters, lora_parameters
from rlmegatron.planner.step_time import Hardware, StepTime, step_time, workload_of

DEFAULT_GPU_MEM_GB = 80.0  # an H100 SXM
DEFAULT_LINK_GBPS = 400.0  # one NDR InfiniBand port per GPU; intra-node NVLink 4 is ~3600 Gb/s


@dataclass(frozen=True)
class PlanSettings:
    gpu_mem_gb: float = DEFAULT_GPU_MEM_GB
    link_gbps: float = DEFAULT_LINK_GBPS
    gpu_tflops: float = Hardware.peak_tflops
    hbm_gb_per_s: float = Hardware.hbm_gb_per_s
    prompt_tokens: float | None = None
    """Mean prompt and response lengths for the step-time estimate; None: the spec's maxima."""
    response_tokens: float | None = None
    nvlink_gb_per_s: float = Hardware.nvlink_gb_per_s
    nvlink_domain: int | None = None
    """Hardware.nvlink_domain: GPUs one NVLink fabric joins, when more than a node's; None: a node's."""

    def hardware(self, gpus_per_node: int) -> Hardware:
        return Hardware(peak_tflops=self.gpu_tflops, hbm_gb_per_s=self.hbm_gb_per_s, network_gbps=self.link_gbps,
                        nvlink_gb_per_s=self.nvlink_gb_per_s, gpus_per_node=gpus_per_node,
                        nvlink_domain=self.nvlink_domain)


@dataclass(frozen=True)
class PhaseMemory:
    """Per-GPU bytes while one phase of the step runs, with everything else that stays resident."""

    phase: str  # actor_update, critic_update, rollout
    bytes: float
    parts: dict[str, float]


@dataclass(frozen=True)
class Plan:
    model_type: str
    total_parameters: int
    active_parameters: int
    vision_parameters: int  # the image encoder's, within total_parameters; 0 for a text-only model
    mtp_parameters: int  # the multi-token-prediction layers', apart from total_parameters; 0 without them
    image_tokens: int  # decoder tokens of one image at data.max_image_pixels; 0 for a text-only model
    gpu_bytes: float
    actor: TrainingMemory
    critic: TrainingMemory | None
    reward_model: ScoringMemory | None
    teacher: ScoringMemory | None  # on-policy distillation's teacher (algorithm.distill), at its own layout
    engine: EngineMemory
    sync: WeightSync
    trainer_phases: tuple[PhaseMemory, ...]  # on the trainer GPUs (and the engines' when colocated)
    rollout_gpu_bytes: float | None  # on the engines' own GPUs when disaggregated
    trainer_gpus: int
    rollout_gpus: int | None  # the rollout pool's own GPUs when disaggregated (None: they are the trainer's)
    rollout_buffer: RolloutBufferMemory  # in the driver's host memory
    step_time: StepTime
    problems: tuple[SpecProblem, ...]

    @property
    def peak_bytes(self) -> float:
        return max(phase.bytes for phase in self.trainer_phases)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["problems"] = [str(problem) for problem in self.problems]
        data["peak_bytes"] = self.peak_bytes
        data["actor"]["total"] = self.actor.total
        data["step_time_s"] = self.step_time.total
        data["step_time"] = {"phases_s": self.step_time.phases, "overlapped": self.step_time.overlapped,
                             "assumptions": list(self.step_time.assumptions)}
        return data


def build_plan(spec: JobSpec, arch: ModelArchitecture, settings: PlanSettings, file: str = "") -> Plan:
    params = count_parameters(arch, built_mtp_layers(arch, spec.model.path, spec.model.random_init))
    gpu_bytes = settings.gpu_mem_gb * GB
    actor_batch = micro_batch(spec, spec.actor.ppo_micro_batch_size_per_gpu, spec.actor.use_dynamic_bsz,
                              spec.actor.ppo_max_token_len_per_gpu, spec.actor.megatron)
    lora = spec.actor.lora
    adapters = lora_parameters(arch, lora.rank, tuple(lora.target_modules)) if lora.rank else None
    actor = training_memory(spec, arch, params, spec.actor.megatron, spec.actor.offload, actor_batch, adapters,
                            tuple(lora.modules_to_save), mtp_runs=spec.actor.mtp.loss_weight > 0)
    resident = {"actor": resident_model_state(actor, spec.actor.offload)}
    if spec.needs_reference and not lora.rank:  # with LoRA the reference is the actor with its adapters off
        ref = training_memory(spec, arch, params, spec.ref.megatron, spec.actor.offload, actor_batch)
        resident["ref"] = 0.0 if spec.ref.offload.params else ref.parameters
    critic = None
    if spec.critic.enable:
        # The value model is the policy with a one-output head; the difference is below 1% here.
        critic_batch = micro_batch(
            spec,
            spec.critic.ppo_micro_batch_size_per_gpu,
            spec.critic.use_dynamic_bsz,
            spec.critic.ppo_max_token_len_per_gpu,
            spec.critic.megatron,
        )
        critic = training_memory(spec, arch, params, spec.critic.megatron, spec.critic.offload, critic_batch)
        resident["critic"] = resident_model_state(critic, spec.critic.offload)
    reward_model = None
    if spec.reward.model.path is not None:  # on the trainer ranks, colocated or not
        reward_arch = read_architecture(spec.reward.model.path)
        reward_model = scoring_memory(spec, reward_arch, count_parameters(reward_arch))
        resident["reward model"] = 0.0 if spec.reward.model.offload.params else reward_model.weights
    teacher, teacher_model = None, None
    if spec.algorithm.distill is not None:  # the checks read its architecture and passed
        teacher_arch = teacher_architecture(spec)[0]
        teacher_model = (teacher_arch, count_parameters(teacher_arch))
        teacher = teacher_memory(spec, *teacher_model)
        resident["teacher"] = 0.0 if spec.teacher.offload.params else teacher.weights
    engine = engine_memory(spec, arch, params, gpu_bytes)
    colocated = spec.placement.mode == "colocate"

    def others(*training: str) -> dict[str, float]:
        return {f"{role} (idle)": size for role, size in resident.items() if role not in training}

    phases = [PhaseMemory("actor_update", 0.0, {"actor": actor.total, **others("actor")})]
    if critic is not None:
        phases.append(PhaseMemory("critic_update", 0.0, {"critic": critic.total, **others("critic")}))
    if reward_model is not None:
        phases.append(PhaseMemory("reward_scoring", 0.0,
                                  {"reward model": reward_model.total, **others("reward model")}))
    if teacher is not None:
        phases.append(PhaseMemory("teacher_log_prob", 0.0, {"teacher": teacher.total, **others("teacher")}))
    if colocated:
        phases.append(PhaseMemory("rollout", 0.0, {"engine": engine.static_reservation, **others()}))
    phases = [PhaseMemory(p.phase, sum(p.parts.values()), p.parts) for p in phases]

    sync = weight_sync(spec, params, settings.link_gbps)
    plan = Plan(
        model_type=arch.model_type,
        total_parameters=params.total,
        active_parameters=params.active,
        vision_parameters=params.vision,
        mtp_parameters=params.mtp_total,
        image_tokens=_largest_image_tokens(arch, spec.data.max_image_pixels),
        gpu_bytes=gpu_bytes,
        actor=actor,
        critic=critic,
        reward_model=reward_model,
        teacher=teacher,
        engine=engine,
        sync=sync,
        trainer_phases=tuple(phases),
        rollout_gpu_bytes=None if colocated else engine.static_reservation,
        trainer_gpus=spec.placement.trainer_world_size,
        rollout_gpus=None if colocated else spec.placement.rollout_pool_size,
        rollout_buffer=rollout_buffer_memory(spec, arch),
        step_time=step_time(spec, arch, params, actor, engine, sync,
                            workload_of(spec, settings.prompt_tokens, settings.response_tokens),
                            settings.hardware(spec.placement.gpus_per_node),
                            teacher=None if teacher is None else (*teacher_model, teacher)),
        problems=(),
    )
    problems = [
        SpecProblem(problem.field, problem.value, problem.reason, file=file)
        for problem in _layout_problems(spec, plan, settings)
    ]
    return Plan(**{**plan.__dict__, "problems": tuple(problems)})


def _layout_problems(spec: JobSpec, plan: Plan, settings: PlanSettings) -> list[SpecProblem]:
    problems = []
    gpu = f"the {settings.gpu_mem_gb:g} GB GPU (--gpu-mem-gb)"
    rollout = spec.rollout
    tp = rollout.tensor_parallel_size
    engine = plan.engine
    if engine.kv_cache <= 0:
        reason = (
            f"leaves no KV cache: the weights take {_gb(engine.weights)} per GPU, more than "
            f"rollout.mem_fraction_static={rollout.mem_fraction_static} of {gpu} ({_gb(engine.static_reservation)}); "
            "raise the engine's tensor parallelism or mem_fraction_static"
        )
        problems.append(SpecProblem("rollout.tensor_parallel_size", tp, reason))
    if plan.rollout_gpu_bytes is not None and plan.rollout_gpu_bytes > plan.gpu_bytes:
        problems.append(SpecProblem("rollout.mem_fraction_static", rollout.mem_fraction_static, f"exceeds {gpu}"))
    for phase in plan.trainer_phases:
        if phase.bytes <= plan.gpu_bytes:
            continue
        field, value, fix = _fix_for(phase.phase, spec)
        parts = ", ".join(f"{name} {_gb(size)}" for name, size in phase.parts.items())
        reason = f"needs an estimated {_gb(phase.bytes)} per GPU during {phase.phase} ({parts}), more than {gpu}; {fix}"
        problems.append(SpecProblem(field, value, reason))
    return problems


def _fix_for(phase: str, spec: JobSpec) -> tuple[str, Any, str]:
    if phase == "rollout":
        return (
            "rollout.mem_fraction_static",
            spec.rollout.mem_fraction_static,
            "lower it, or offload the idle roles (actor.offload.params/grads, ref.offload.params)",
        )
    if phase == "teacher_log_prob":
        return ("teacher.megatron", _layout(spec.teacher.megatron),
                "raise its tensor/pipeline/expert parallelism, shorten its micro-batch "
                "(teacher.log_prob_micro_batch_size_per_gpu), or offload the idle roles")
    if phase == "reward_scoring":
        return (
            "reward.model.tensor_model_parallel_size",
            spec.reward.model.tensor_model_parallel_size,
            "raise it, lower reward.model.micro_batch_size_per_gpu, or offload the idle roles",
        )
    megatron = spec.actor.megatron if phase == "actor_update" else spec.critic.megatron
    role = "actor" if phase == "actor_update" else "critic"
    fix = (
        "raise tensor/pipeline/expert parallelism, enable recompute_granularity=full, "
        f"set {role}.offload.optimizer=true, or shorten the micro-batch"
    )
    return f"{role}.megatron", _layout(megatron), fix


def _layout(megatron: MegatronConfig) -> dict[str, int]:
    return {
        "TP": megatron.tensor_model_parallel_size,
        "PP": megatron.pipeline_model_parallel_size,
        "CP": megatron.context_parallel_size,
        "EP": megatron.expert_model_parallel_size,
        "ETP": megatron.expert_tensor_parallel_size or megatron.tensor_model_parallel_size,
    }


def _gb(size: float) -> str:
    return f"{size / GB:.1f} GB"


def _largest_image_tokens(arch: ModelArchitecture, max_pixels: int) -> int:
    """Decoder tokens of the largest square image data.max_image_pixels lets in (each counts toward
    data.max_prompt_length)."""
    if arch.vision is None:
        return 0
    side = int(max_pixels ** 0.5)
    return arch.vision.image_tokens(side, side)


def _vision_line(spec: JobSpec, plan: Plan) -> str:
    trained = "frozen" if spec.actor.vision.freeze else "trained"
    return (f"vision tower: {plan.vision_parameters / 1e9:.2f}B parameters, whole on each first-stage rank, {trained} "
            f"(actor.vision.freeze); an image of data.max_image_pixels={spec.data.max_image_pixels} is "
            f"{plan.image_tokens} prompt tokens of data.max_prompt_length={spec.data.max_prompt_length}")


def _mtp_line(spec: JobSpec, plan: Plan) -> str:
    weight, speculative = spec.actor.mtp.loss_weight, spec.rollout.speculative
    held = (f"trained (actor.mtp.loss_weight={weight:g}) with their gradients and Adam state" if weight
            else "carried untrained (actor.mtp.loss_weight=0): frozen, no gradients or Adam state")
    if speculative is None:
        synced = "never synced: no engine drafts with them (rollout.speculative)"
    else:
        pushes = "every weight sync" if weight else "an engine's first push only"
        synced = (f"the first drafts {speculative.num_draft_tokens} tokens per step in the engines "
                  f"(rollout.speculative) and goes with {pushes}")
    return f"MTP layers: {plan.mtp_parameters / 1e9:.2f}B parameters on the last pipeline stage, {held}; {synced}"


def render_plan(spec: JobSpec, plan: Plan) -> str:
    """The plan as a short human-readable report."""
    actor, engine, sync = plan.actor, plan.engine, plan.sync
    m = spec.actor.megatron
    lines = [
        f"model: {plan.model_type}, {plan.total_parameters / 1e9:.2f}B parameters "
        f"({plan.active_parameters / 1e9:.2f}B active per token)",
        *([_vision_line(spec, plan)] if plan.vision_parameters else []),
        *([_mtp_line(spec, plan)] if plan.mtp_parameters else []),
        f"trainer: {spec.placement.nnodes} node(s) x {spec.placement.gpus_per_node} GPUs, "
        f"GPU memory {_gb(plan.gpu_bytes)}, placement {spec.placement.mode}",
        f"actor layout: {', '.join(f'{k}={v}' for k, v in _layout(m).items())}, "
        f"recompute={m.recompute_granularity}, sequence_parallel={m.sequence_parallel}, "
        f"distributed_optimizer={m.use_distributed_optimizer}, cpu_optimizer={spec.actor.offload.optimizer}",
        f"actor training, per GPU (pipeline stage {actor.pipeline_stage}):",
        f"  parameters        {_gb(actor.parameters):>10}  ({actor.dense_parameters / 1e9:.2f}B dense"
        f" + {actor.expert_parameters / 1e9:.2f}B expert shards)",
        *([f"  LoRA adapters     {actor.adapter_parameters / 1e6:>8.2f} M  parameters, the only ones that train"]
          if actor.adapter_parameters else []),
        f"  gradients         {_gb(actor.gradients):>10}",
        f"  optimizer state   {_gb(actor.optimizer_state):>10}",
        f"  activations       {_gb(actor.activations):>10}",
        f"  total             {_gb(actor.total):>10}",
        "per-GPU memory by phase:",
    ]
    for phase in plan.trainer_phases:
        parts = ", ".join(f"{name} {_gb(size)}" for name, size in phase.parts.items())
        lines.append(f"  {phase.phase:<15} {_gb(phase.bytes):>10}  ({parts})")
    if plan.rollout_gpu_bytes is not None:
        lines.append(f"  rollout GPUs    {_gb(plan.rollout_gpu_bytes):>10}  (engine static reservation)")
    if plan.teacher is not None:
        layout = ", ".join(f"{k}={v}" for k, v in _layout(spec.teacher.megatron).items())
        lines.append(f"teacher ({layout}) on the trainer GPUs: weights "
                     f"{_gb(plan.teacher.weights)}, log-prob activations {_gb(plan.teacher.activations)} per GPU")
    if plan.reward_model is not None:
        lines.append(f"reward model (TP={spec.reward.model.tensor_model_parallel_size}) on the trainer GPUs: "
                     f"weights {_gb(plan.reward_model.weights)}, scoring activations "
                     f"{_gb(plan.reward_model.activations)} per GPU")
    pools = (f"{plan.trainer_gpus} trainer GPUs and the engines on them" if plan.rollout_gpus is None
             else f"{plan.trainer_gpus} trainer GPUs, {plan.rollout_gpus or 'undeclared'} rollout GPUs")
    buffer = plan.rollout_buffer
    lines.append(f"pools: {pools}; trainer.mode={spec.trainer.mode}: {buffer.rollouts} rollout(s) in the driver's "
                 f"memory at once, {_gb(buffer.total)} of batch tensors")
    if buffer.routing_bytes_per_rollout:
        lines.append(f"routing ids (actor.moe): {_gb(buffer.routing_bytes_per_rollout)} per rollout, in the batch "
                     f"every trainer rank receives each step")
    fp8 = " (projections in FP8: rollout.quantization)" if spec.rollout.quantization == "fp8" else ""
    lines += [
        f"rollout engine (TP={spec.rollout.tensor_parallel_size}), per GPU: weights {_gb(engine.weights)}{fp8}, "
        f"KV cache {_gb(engine.kv_cache)} of mem_fraction_static={spec.rollout.mem_fraction_static} "
        f"({engine.kv_tokens:,} tokens at {engine.kv_bytes_per_token / 1e3:.1f} kB/token)"
        + (f", linear-attention states {_gb(engine.recurrent_states)}" if engine.recurrent_states else ""),
        f"weight sync: {_gb(sync.total_bytes)} in all, {_gb(sync.bytes_per_receiver)} to each engine GPU (whole "
        f"tensors, whatever the engine's TP), "
        + (f"{sync.servers_per_link} servers' bytes through each sender's link, "
           if sync.servers_per_link > 1 else "")
        + f"~{sync.seconds:.2f} s of bytes at {sync.link_gbps:g} Gb/s (--link-gbps)"
        + ("" if sync.delta_ratio is None else
           f"; delta: {sync.delta_ratio:.1%} of a full push per step ("
           f"{delta_sent_ratio(spec.model.dtype, spec.actor.optim.lr, spec.rollout.full_sync_every)[1]})"),
        f"step time, estimated (a model, not a measurement; planner/step_time.py): ~{plan.step_time.total:.1f} s"
        + (" (generation overlaps training)" if plan.step_time.overlapped else ""),
        *(f"  {phase:<15} {seconds:>8.1f} s" for phase, seconds in plan.step_time.phases.items()),
        *(f"  assumes {assumption}" for assumption in plan.step_time.assumptions),
    ]
    return "\n".join(lines) + "\n"
