"""Per-GPU memory of the Megatron roles and the rollout engines, and the cost of one weight sync.

Sources of the formulas (all bytes, 1 GB = 1e9 bytes):
- Model state per parameter, from Megatron-LM's docs/source/api-guide/dist_optimizer.md: bf16 params
  with fp32 grads take 2 + 4 bytes plus 12 bytes of Adam state (fp32 master, m, v), i.e. 18 bytes, or
  6 + 12/DP with the distributed optimizer; fp16 takes 2 + 2 + 16 (the fp32 grad copy is optimizer
  state); fp32 takes 4 + 4 + 8. Expert parameters shard their optimizer over the expert-data-parallel
  group (world / (EP × ETP × PP)) instead of the dense one (world / (TP × PP)).
- Activations, from Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
  (2022), 16-bit activations per layer and micro-batch: sbh(34 + 5as/h) without parallelism,
  sbh(34 + 5as/h)/t with tensor + sequence parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor
  parallelism alone; selective recompute drops the 5as/h attention-score term (flash attention does
  too, so `none` overestimates Megatron-Core runs that use it); full recompute keeps 2sbh per
  recompute group (divided by t under sequence parallelism) and rebuilds one group at a time; its
  block method checkpoints only the first recompute_num_layers layers of a stage. The 1F1B
  schedule keeps PP - i micro-batches in flight on stage i; the output layer and loss add 4sbv/t.
  The formula describes a 4h GELU MLP with multi-head attention; SwiGLU, GQA and MoE layers are
  charged the same, which overestimates MoE layers whose routed MLPs are narrower than 4h per token.
- `offload.optimizer` is read as a CPU-resident optimizer (Megatron's optimizer_cpu_offload with an
  offload fraction of 1, verl's OFFLOAD_FRACTION=1): Adam state and fp32 master weights live in host
  memory and the step runs there, so the GPU keeps only the bf16 weights and the gradients.
  `offload.params` / `offload.grads` move those out only while the role is idle (during rollout).
- The rollout engine reserves mem_fraction_static of the GPU for its weights and KV cache (SGLang's
  definition); what is left after the weights is the KV budget.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from math import ceil

from rlmegatron.models.families import ModelArchitecture
from rlmegatron.config.spec import JobSpec, MegatronConfig, OffloadConfig, micro_batch_tokens
from rlmegatron.models.pipeline import FIRST_STAGE, LAST_STAGE, pipeline_stage_layers
from rlmegatron.planner.parameters import LoRALayerParameters, ParameterCount

GB = 1e9

# (weights, gradients, optimizer state) bytes per parameter, by training dtype (Megatron's table).
_STATE_BYTES = {"bf16": (2, 4, 12), "fp16": (2, 2, 16), "fp32": (4, 4, 8)}
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_ACTIVATION_BYTES = 2  # the paper's formula counts 16-bit activations


@dataclass(frozen=True)
class MicroBatch:
    """The tokens one forward/backward pass sees on one data-parallel rank."""

    sequences: int
    sequence_length: int


@dataclass(frozen=True)
class TrainingMemory:
    """Per-GPU bytes of one trained role on its most loaded pipeline stage; compare against measured peaks."""

    pipeline_stage: int
    dense_parameters: int  # parameters this GPU holds, sharded by TP (and PP)
    expert_parameters: int  # routed-expert parameters this GPU holds, sharded by EP × ETP (and PP)
    parameters: float
    gradients: float
    optimizer_state: float  # 0 when the optimizer lives on the CPU
    activations: float
    adapter_parameters: int = 0  # LoRA factors this GPU holds (actor.lora): with them, the only ones that train

    @property
    def model_state(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        return self.model_state + self.activations


@dataclass(frozen=True)
class EngineMemory:
    """Per-GPU bytes of one rollout engine: weights and KV cache inside mem_fraction_static of the GPU."""

    weights: float
    static_reservation: float  # mem_fraction_static × GPU memory
    kv_cache: float  # the static reservation minus the weights (and states); negative when the weights do not fit
    kv_bytes_per_token: float
    kv_tokens: int
    recurrent_states: float = 0.0  # a hybrid model's Gated DeltaNet states: SGLang's pool of them beside the KV cache


@dataclass(frozen=True)
class Transport:
    """How a refit's bytes travel, as far as its time goes (planner/step_time.sync_seconds). The defaults are this
    project's push; benchmarks/step_time_calibration.py describes NeMo-RL's."""

    links: int = 1
    """Network links a disaggregated broadcast spreads over: 1 where the sender is its node's only rank in the group
    (this project's push: a sending trainer rank and one server's ranks); a node's GPU count where every GPU of the
    sending and the receiving nodes is in it (NeMo-RL's one group of every trainer and vLLM rank), NCCL's channels
    then leaving and entering each node through all its links."""
    pipelined: bool = False
    """The export of a bucket, the transfer of the one before and the load of the one before that run at once
    (NeMo-RL's two buffers on each side); False: one after the other (this project's push waits for each bucket's
    answer before it exports the next)."""


@dataclass(frozen=True)
class WeightSync:
    """What one refit moves and how: as this project's push moves it (memory.weight_sync; `transport` can describe
    another framework's, as benchmarks/step_time_calibration.py does NeMo-RL's). Every engine GPU receives every
    tensor whole, whatever the engine's TP: the push sends HF tensors as the export streams them and SGLang's loader slices its share out of
    each (the local engine is TP 1). Disaggregated, every trainer rank (with delta sync, the first of each node)
    pushes to its share of the servers (rank/weight_push.sending_ranks), all at once, each over its GPU's link, and
    each bucket to all its servers at once (rollout/sglang/weight_push.py, `DistributedWeightPush._broadcast`: their
    transfers share the link, their loads overlap); colocated, every GPU takes its bytes at once from the trainer
    rank on it (`share_buckets`)."""

    total_bytes: float  # the whole policy as the engines hold it (rollout_weight_bytes)
    bytes_per_receiver: float
    """What each engine GPU receives in a step: the whole policy (with delta sync, the share a step sends on
    average)."""
    servers_per_link: int
    """How many servers' bytes cross one sender's link: disaggregated, the engines over the trainer's GPUs (each
    trainer rank sends to its share over its GPU's link; with delta sync, over its nodes: the first rank of each
    node sends), rounded up; colocated, 1."""
    sent_per_server: float
    """What crosses the trainer's link to one disaggregated server: bytes_per_receiver, broadcast once to its ranks;
    with delta sync, its records go in the request body as base64 (4/3 of their bytes), one copy per TP rank
    (`DistributedWeightPush._post`: SGLang takes one payload per rank)."""
    link_gbps: float
    seconds: float  # the bytes alone: servers_per_link x sent_per_server over the link
    delta_ratio: float | None = None
    """rollout.weight_sync=delta: the bytes a step sends against a full push (`delta_sent_ratio`), full pushes
    included; None: full pushes."""
    exported_bytes: float = 0.0
    """What the trainer's export gathers and moves between its ranks each refit, in model.dtype (the export runs before
    any cast to the rollout's): the policy less a frozen image encoder, plus the MTP layer the engines draft with."""
    transport: Transport = Transport()


# Bytes a delta push sends against a full one, after 10 Adam steps of a 106M-parameter Qwen3 in bf16 at each
# learning rate (benchmarks/delta_sync.py encodings; benchmarks/RESULTS.md, "Delta weight sync"). The share falls as
# the steps go on (Adam's first steps move every weight by lr); the 10th step's is taken.
DELTA_SENT_RATIO_BF16 = {1e-6: 0.0411, 1e-5: 0.1522}


def delta_sent_ratio(model_dtype: str, lr: float, full_sync_every: int) -> tuple[float, str]:
    """(bytes a step sends against a full push, how that was found). bf16 from the measured table, log-linear in
    the learning rate between its points, the lowest point's below them (an upper bound: fewer weights change);
    every full_sync_every-th push whole. What was not measured counts as full pushes: a rate above the table's
    (the ratio climbs towards 1), and other dtypes (fp32 weights change in nearly every element at these rates)."""
    (low, r_low), (high, r_high) = sorted(DELTA_SENT_RATIO_BF16.items())
    if model_dtype != "bf16":
        ratio, source = 1.0, f"model.dtype={model_dtype} not measured: counted whole"
    elif lr > high:
        ratio, source = 1.0, f"lr {lr:g} above the rates measured: counted whole"
    else:
        position = (math.log10(lr) - math.log10(low)) / (math.log10(high) - math.log10(low))
        ratio = r_low if lr <= low else r_low + (r_high - r_low) * position
        source = f"measured for bf16 at lr 1e-6 and 1e-5, here lr {lr:g}"
    if full_sync_every:
        ratio = (ratio * (full_sync_every - 1) + 1) / full_sync_every
    return ratio, source


def stage_layers(num_layers: int, megatron: MegatronConfig) -> list[list[int]]:
    """Layers of each pipeline stage, all its virtual stages together, by the split Megatron builds."""
    split = pipeline_stage_layers(num_layers, megatron.pipeline_model_parallel_size,
                                  megatron.virtual_pipeline_model_parallel_size,
                                  megatron.extra.get(FIRST_STAGE), megatron.extra.get(LAST_STAGE))
    return [[layer for chunk in chunks for layer in chunk] for chunks in split]


def micro_batch(spec: JobSpec, update_sequences: int, use_dynamic_bsz: bool, max_tokens: int,
                megatron: MegatronConfig) -> MicroBatch:
    if use_dynamic_bsz:  # packed: one row of up to max_tokens tokens per GPU, split over the CP ranks
        return MicroBatch(1, micro_batch_tokens(max_tokens, megatron))
    return MicroBatch(update_sequences, spec.data.max_prompt_length + spec.data.max_response_length)


def training_memory(
    spec: JobSpec,
    arch: ModelArchitecture,
    params: ParameterCount,
    megatron: MegatronConfig,
    offload: OffloadConfig,
    batch: MicroBatch,
    lora: tuple[LoRALayerParameters, ...] | None = None,
    modules_to_save: tuple[str, ...] = (),
    mtp_runs: bool = False,
) -> TrainingMemory:
    """The most loaded pipeline stage of a role trained with `megatron` (the actor's or the critic's layout); with
    `lora` (the actor's adapters, per layer) the base weights are frozen: gradients and Adam state are the adapters'
    alone, and those of the `modules_to_save` (actor.lora) that train whole. The model's MTP layers (`params.mtp`)
    sit on the last stage; `mtp_runs` (actor.mtp.loss_weight > 0): the update trains them, which keeps their
    gradients, Adam state, activations and logits (otherwise they are frozen: models/mtp.freeze_mtp_layers)."""
    world = spec.placement.trainer_world_size
    tp, pp, cp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size, megatron.context_parallel_size
    ep, etp = megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size or tp
    dense_dp = max(world // (tp * pp), 1)  # Megatron shards the optimizer over DP × CP
    expert_dp = max(world // (ep * etp * pp), 1)
    weight, grad, optim = _STATE_BYTES[spec.model.dtype]
    if offload.optimizer:
        optim = 0
    dense_optim = optim / dense_dp if megatron.use_distributed_optimizer else optim
    expert_optim = optim / expert_dp if megatron.use_distributed_optimizer else optim

    stages = stage_layers(arch.num_hidden_layers, megatron)
    candidates = []
    for index, layers in enumerate(stages):
        dense = sum(params.layers[i].dense for i in layers)
        if index == 0:
            dense += params.embedding
        if index == pp - 1:
            # A tied output layer still needs its own copy of the embedding on a separate last stage.
            dense += params.final_norm + (params.output_layer or (params.embedding if pp > 1 else 0))
            # The MTP layers embed the next tokens: a separate last stage holds the embedding (an untied one too).
            dense += params.embedding if params.mtp and params.output_layer and pp > 1 else 0
        dense //= tp
        mtp_dense = params.mtp_dense // tp if index == pp - 1 else 0
        dense += mtp_dense
        # The image encoder is not split by TP: each rank of the first stage holds it whole; frozen, it has no
        # gradients or Adam state.
        vision = params.vision if index == 0 else 0
        dense += vision
        mtp_experts = params.mtp_routed_experts // (ep * etp) if index == pp - 1 else 0
        experts = sum(params.layers[i].routed_experts for i in layers) // (ep * etp) + mtp_experts
        dense_adapters = sum(lora[i].dense_per_gpu(tp) for i in layers) if lora else 0
        expert_adapters = sum(lora[i].experts_per_gpu(ep, etp) for i in layers) if lora else 0
        saved = params.embedding if "embedding" in modules_to_save and index == 0 else 0
        if index == pp - 1:  # the output layer, or a tied one's copy of the embedding on a last stage of its own
            tied_copy = params.output_layer == 0 and pp > 1
            saved += params.output_layer if "output_layer" in modules_to_save else 0
            saved += params.embedding if "embedding" in modules_to_save and tied_copy else 0
        # What trains: every weight, or with LoRA only the factors (frozen weights get no gradient or Adam state).
        trained_dense, trained_experts = (dense_adapters + saved // tp, expert_adapters) if lora else (dense, experts)
        if spec.actor.vision.freeze and not lora:
            trained_dense -= vision
        if not mtp_runs and not lora:
            trained_dense, trained_experts = trained_dense - mtp_dense, trained_experts - mtp_experts
        in_flight = pp - index if pp > 1 else 1
        stored, recompute_working_set = _stage_activations(arch, megatron, batch, len(layers), cp)
        activations = in_flight * stored + recompute_working_set
        if index == pp - 1:
            activations += _output_activations(arch, batch, tp, cp)
            if mtp_runs:  # each MTP layer is one more layer of the stage, with logits of its own
                mtp_stored, _ = _stage_activations(arch, megatron, batch, len(params.mtp), cp)
                activations += in_flight * mtp_stored + len(params.mtp) * _output_activations(arch, batch, tp, cp)
        candidates.append(
            TrainingMemory(
                pipeline_stage=index,
                dense_parameters=dense,
                expert_parameters=experts,
                # A module LoRA trains whole keeps a copy of its base weights, for the adapters-off model.
                parameters=(dense + experts + dense_adapters + expert_adapters + saved // tp) * weight,
                gradients=(trained_dense + trained_experts) * grad,
                optimizer_state=trained_dense * dense_optim + trained_experts * expert_optim,
                activations=activations,
                adapter_parameters=dense_adapters + expert_adapters,
            )
        )
    return max(candidates, key=lambda memory: memory.total)


def _layer_activations(arch: ModelArchitecture, megatron: MegatronConfig, s: int, b: int, full_scores: bool,
                       keys: int) -> float:
    """Korthikanti et al.'s per-layer activation bytes (they count 16-bit values, hence the bare constants) for `s`
    query tokens per rank attending to `keys` tokens: the attention scores are s x keys per head, the rest s wide."""
    h, a, t = arch.hidden_size, arch.num_attention_heads, megatron.tensor_model_parallel_size
    scores = 5 * a * keys / h if full_scores else 0.0
    if megatron.sequence_parallel:
        return s * b * h * (34 + scores) / t
    return s * b * h * (10 + 24 / t + scores / t)


def _stage_activations(
    arch: ModelArchitecture, megatron: MegatronConfig, batch: MicroBatch, num_layers: int, cp: int
) -> tuple[float, float]:
    """(bytes kept per in-flight micro-batch, bytes of the one recompute group being rebuilt) on a stage.

    Context parallelism splits the sequence: each rank keeps the activations of its 1/CP of the tokens, whose
    queries attend to the keys of the whole sequence (ring attention streams them; the CPU path gathers them), so
    the attention scores shrink by CP, not CP². Only the micro-batch in its backward pass rebuilds a recompute
    group, so that working set is counted once, not per micro-batch in flight.
    """
    s, b, keys = ceil(batch.sequence_length / cp), batch.sequences, batch.sequence_length
    granularity = megatron.recompute_granularity
    if granularity == "none":
        return num_layers * _layer_activations(arch, megatron, s, b, full_scores=True, keys=keys), 0.0
    if granularity == "selective":
        return num_layers * _layer_activations(arch, megatron, s, b, full_scores=False, keys=keys), 0.0
    group = min(megatron.recompute_num_layers, num_layers)
    sp_split = megatron.tensor_model_parallel_size if megatron.sequence_parallel else 1
    checkpoint = _ACTIVATION_BYTES * s * b * arch.hidden_size / sp_split
    full = _layer_activations(arch, megatron, s, b, full_scores=True, keys=keys)
    if megatron.recompute_method == "block":  # the first `group` layers keep their input only, the rest everything
        return group * checkpoint + (num_layers - group) * full, full
    return ceil(num_layers / group) * checkpoint, group * full


def _output_activations(arch: ModelArchitecture, batch: MicroBatch, tp: int, cp: int) -> float:
    """The paper's 4sbv/t for the logits and the loss (log-probs in RL) on the last stage."""
    s = ceil(batch.sequence_length / cp)
    return 4 * s * batch.sequences * arch.vocab_size / tp


@dataclass(frozen=True)
class ScoringMemory:
    """Per-GPU bytes of a frozen model that scores on the trainer ranks at its own layout, the reward model
    (reward.model) or on-policy distillation's teacher: its weights, and while it scores, one layer's activations for
    one micro-batch (a forward pass keeps none for a backward), the teacher's logits too."""

    parameters: int  # its weights on this GPU (the reward model's decoder and one-label head), sharded by its layout
    weights: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.activations


def scoring_memory(spec: JobSpec, arch: ModelArchitecture, params: ParameterCount) -> ScoringMemory:
    model = spec.reward.model
    megatron = MegatronConfig(tensor_model_parallel_size=model.tensor_model_parallel_size,
                              sequence_parallel=model.sequence_parallel)
    # Its output layer is the one-label score head, not the vocabulary's.
    held = (params.total - params.output_layer + arch.hidden_size) // model.tensor_model_parallel_size
    s = spec.data.max_prompt_length + spec.data.max_response_length
    activations = _layer_activations(arch, megatron, s, model.micro_batch_size_per_gpu, full_scores=True, keys=s)
    return ScoringMemory(parameters=held, weights=held * WEIGHT_BYTES[spec.model.dtype], activations=activations)


def teacher_memory(spec: JobSpec, arch: ModelArchitecture, params: ParameterCount) -> ScoringMemory:
    """On-policy distillation's teacher at teacher.megatron: its most loaded pipeline stage's weights, one layer's
    activations of one of its micro-batches and the last stage's logits."""
    teacher = spec.teacher
    megatron = teacher.megatron
    batch = micro_batch(spec, teacher.log_prob_micro_batch_size_per_gpu, teacher.log_prob_use_dynamic_bsz,
                        teacher.log_prob_max_token_len_per_gpu, megatron)
    # Its stages' weights as a trained role's are laid out (training_memory), without gradients or Adam state.
    held = training_memory(spec, arch, params, megatron, OffloadConfig(), batch)
    cp = megatron.context_parallel_size
    s = ceil(batch.sequence_length / cp)
    activations = _layer_activations(arch, megatron, s, batch.sequences, full_scores=True, keys=batch.sequence_length)
    activations += _output_activations(arch, batch, megatron.tensor_model_parallel_size, cp)
    parameters = held.dense_parameters + held.expert_parameters
    return ScoringMemory(parameters=parameters, weights=held.parameters, activations=activations)


@dataclass(frozen=True)
class RolloutBufferMemory:
    """Host memory of the rollouts alive at once in the driver: the one training and, in one_step_off and async, the
    `trainer.staleness_bound` made ahead (driver.rollout_buffer.Ahead). Counts the batch tensors (token ids and
    attention mask as int64, response mask and rollout log-probs as fp32, and with the rollout's routing asked for
    (actor.moe) its int16 expert ids per token, MoE layer and top-k slot; rollout_data.build_batch), not the engines'
    per-token Python lists beside them. The routing ids travel with the batch to every trainer rank each step."""

    rollouts: int
    bytes_per_rollout: float
    routing_bytes_per_rollout: float = 0.0
    """Of bytes_per_rollout, the routing ids."""

    @property
    def total(self) -> float:
        return self.rollouts * self.bytes_per_rollout


# int16: expert ids below 32,768 and -1 for a token without a record (models/routing_replay.py).
_ROUTING_ID_BYTES = 2


def rollout_buffer_memory(spec: JobSpec, arch: ModelArchitecture) -> RolloutBufferMemory:
    prompt, response = spec.data.max_prompt_length, spec.data.max_response_length
    samples = spec.data.train_batch_size * spec.rollout.n
    per_sample = 2 * 8 * (prompt + response) + 2 * 4 * response
    routing = 0.0
    if spec.actor.wants_rollout_routing and arch.is_moe:
        routing = samples * (prompt + response) * arch.num_moe_layers * arch.num_experts_per_tok * _ROUTING_ID_BYTES
    return RolloutBufferMemory(rollouts=spec.trainer.staleness_bound + 1,
                               bytes_per_rollout=samples * per_sample + routing, routing_bytes_per_rollout=routing)


def resident_model_state(memory: TrainingMemory, offload: OffloadConfig) -> float:
    """What a role keeps on the GPU while it is idle, after its offload settings move the rest to the host."""
    kept = memory.optimizer_state
    kept += 0 if offload.params else memory.parameters
    kept += 0 if offload.grads else memory.gradients
    return kept


def rollout_weight_bytes(spec: JobSpec, params: ParameterCount) -> float:
    """The policy's bytes as the engines hold it and the sync moves it: in model.dtype, or with
    rollout.quantization fp8 its projections in FP8 (a byte each, and a float32 scale per 128 x 128 block) and the
    rest (embeddings, head, norms) in model.dtype. The layers' biases, q/k norms and routers count as projections:
    a few MB. The MTP layers are apart (mtp_rollout_bytes)."""
    return _rollout_bytes(spec, params.total, params.layers)


def mtp_rollout_bytes(spec: JobSpec, params: ParameterCount) -> float:
    """The MTP layers' bytes as rollout_weight_bytes counts the policy's (their eh_proj stays unquantised with FP8,
    as models/fp8.py leaves it): what a speculative engine's draft model holds."""
    return _rollout_bytes(spec, params.mtp_total, params.mtp)


def mtp_sync_bytes(spec: JobSpec, params: ParameterCount) -> float:
    """What the MTP layers add to a step's weight sync: the first layer's weights when the engines draft with it
    (rollout.speculative) and a loss trains it (actor.mtp.loss_weight; frozen, it goes with the first push only).
    No engine loads the other layers, or the layers' copies of the embedding and head (SGLang's draft takes the main
    model's), so the sync sends none of them (resharding.HFWeightExporter.stream)."""
    if spec.rollout.speculative is None or spec.actor.mtp.loss_weight == 0 or not params.mtp:
        return 0.0
    return mtp_rollout_bytes(spec, params) / len(params.mtp)


def _rollout_bytes(spec: JobSpec, total: int, layers: tuple) -> float:
    """`total` parameters of which the projections of `layers` are quantised with rollout.quantization fp8."""
    weight_bytes = WEIGHT_BYTES[spec.model.dtype]
    if spec.rollout.quantization == "none":
        return total * weight_bytes
    from rlmegatron.models.fp8 import DEFAULT_CONFIG  # the format FP8 rollout syncs; its module imports torch

    rows, cols = DEFAULT_CONFIG["weight_block_size"]
    projections = sum(layer.attention + layer.mlp + layer.routed_experts for layer in layers)
    return projections * (1 + 4 / (rows * cols)) + (total - projections) * weight_bytes


# SGLang's split of a hybrid model's cache memory: its linear-attention layers' recurrent states get this much per
# byte of KV cache (its server argument mamba_full_memory_ratio, default 0.9); only full-attention layers cache keys.
SGLANG_STATE_TO_KV_RATIO = 0.9


def engine_memory(spec: JobSpec, arch: ModelArchitecture, params: ParameterCount, gpu_bytes: float) -> EngineMemory:
    tp = spec.rollout.tensor_parallel_size
    weight_bytes = WEIGHT_BYTES[spec.model.dtype]  # the KV cache's
    # With speculative decoding the engine also holds the MTP layers as its draft model (sharing the embedding and
    # head), and their own KV cache: one more layer each.
    drafts = len(params.mtp) if spec.rollout.speculative is not None else 0
    # SGLang splits dense matrices over TP and experts over EP × MoE-TP = TP, so weights divide by TP.
    weights = (rollout_weight_bytes(spec, params) + (mtp_rollout_bytes(spec, params) if drafts else 0)) / tp
    static = spec.rollout.mem_fraction_static * gpu_bytes
    layers, state_share = arch.num_hidden_layers, 0.0
    if arch.linear_attention is not None:
        layers -= sum(arch.linear_attention.layers)
        state_share = SGLANG_STATE_TO_KV_RATIO / (1 + SGLANG_STATE_TO_KV_RATIO)
    if arch.mla is not None:
        # MLA caches one compressed latent plus the rope key per token, replicated on every TP rank.
        per_token = (layers + drafts) * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * weight_bytes
    else:
        kv_heads_per_gpu = ceil(arch.num_key_value_heads / tp)  # heads are replicated when TP > KV heads
        per_token = 2 * (layers + drafts) * kv_heads_per_gpu * arch.head_dim * weight_bytes
    states = max(static - weights, 0.0) * state_share
    kv_cache = static - weights - states
    return EngineMemory(
        weights=weights,
        static_reservation=static,
        kv_cache=kv_cache,
        kv_bytes_per_token=per_token,
        kv_tokens=max(int(kv_cache // per_token), 0),
        recurrent_states=states,
    )


def engine_count(spec: JobSpec) -> int:
    """The engines of the spec's rollout: its GPUs (the trainer's when colocated; a disaggregated pool's, the
    trainer's size when undeclared) over the engine's TP."""
    placement = spec.placement
    gpus = placement.trainer_world_size if placement.mode == "colocate" else \
        (placement.rollout_pool_size or placement.trainer_world_size)
    return max(gpus // spec.rollout.tensor_parallel_size, 1)


def weight_sync(spec: JobSpec, params: ParameterCount, link_gbps: float) -> WeightSync:
    # A frozen image encoder goes with the first push only (resharding.HFWeightExporter skips it after).
    frozen_vision = params.vision if spec.actor.vision.freeze else 0
    mtp = mtp_sync_bytes(spec, params)
    weight_bytes = WEIGHT_BYTES[spec.model.dtype]
    total = rollout_weight_bytes(spec, params) - frozen_vision * weight_bytes + mtp
    ratio = None
    if spec.rollout.weight_sync == "delta":
        ratio, _ = delta_sent_ratio(spec.model.dtype, spec.actor.optim.lr, spec.rollout.full_sync_every)
    per_receiver = total * (ratio or 1.0)
    # The export runs in model.dtype, before any cast to the rollout's.
    exported = (params.total - frozen_vision + (params.mtp_total / len(params.mtp) if mtp else 0)) * weight_bytes
    tp, colocated = spec.rollout.tensor_parallel_size, spec.placement.mode == "colocate"
    # Disaggregated, every trainer rank sends (delta: one per node; rank/weight_push.sending_ranks), each to its share.
    senders = spec.placement.nnodes if ratio is not None else spec.placement.trainer_world_size
    per_link = 1 if colocated else ceil(engine_count(spec) / senders)
    sent = per_receiver * (tp * 4 / 3 if ratio is not None and not colocated else 1.0)
    return WeightSync(
        total_bytes=total, bytes_per_receiver=per_receiver, servers_per_link=per_link, sent_per_server=sent,
        link_gbps=link_gbps, seconds=per_link * sent * 8 / (link_gbps * 1e9), delta_ratio=ratio,
        exported_bytes=exported,
    )
