"""A model of one RL step's seconds, phase by phase, from FLOPs, bytes and bandwidths: an estimate, never a measurement.

Formulas and their sources:
- Training FLOPs per token: 2 x the parameters a token passes through for a forward pass, 4 x for the backward
  (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1; Narayanan et al. 2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters", section 5.1), plus causal attention: QK^T and AV cost
  2 x s x heads x head_dim FLOPs per token and layer averaged over a causal sequence of s tokens. A forward-only pass
  (old and reference log-probs) is a third of a training pass; full recompute adds one forward (Korthikanti et al.
  2022). The achieved fraction of the GPU's peak is TRAIN_EFFICIENCY.
- Communication that Megatron does not hide: with tensor parallelism (and sequence parallelism) each layer
  all-gathers and reduce-scatters its activations twice per pass, (t - 1) / t of 2 bytes x hidden per token; an MoE
  layer's all-to-all sends each token to its top-k experts and back, (e - 1) / e of it leaving the GPU. Within a node
  over NVLink, across nodes over the network (Narayanan et al. 2021, section 3.2; DeepSeek-V3 report, section 3.2).
- Pipeline bubble: (PP - 1) / (VPP x micro-batches) of the pipeline's time (Narayanan et al. 2021, equation 2).
- Decoding is bound by memory bandwidth: every decode step reads the engine's share of the weights the batch touches
  (an MoE layer's experts any of its b tokens picks: 1 - (1 - k/E)^b of them) and every running sample's KV cache
  (Pope et al. 2022, "Efficiently Scaling Transformer Inference", section 2; the roofline of Williams et al. 2009),
  at DECODE_EFFICIENCY of the HBM bandwidth, and waits for its tensor-parallel all-reduces (2 per layer), a
  fixed latency each (ALLREDUCE_LATENCY_S within a node, more across nodes), and the server's per-step work
  (DECODE_STEP_OVERHEAD_S: scheduling, sampling, detokenising). The longest response sets the number of steps; a
  batch too large for the KV cache runs in waves.
- Weight sync: each engine GPU receives its TP share of the weights in the rollout dtype; disaggregated over the
  network, as NCCL broadcast reaches BROADCAST_EFFICIENCY of the link for bucketed pushes; colocated, the shares its
  own GPU does not hold arrive from the trainer ranks that do (over NVLink within a node, else the network, at the
  same efficiency), then cross into the engine by CUDA IPC at IPC_EFFICIENCY of half the HBM bandwidth (a copy
  reads and writes).
- Delta weight sync sends the measured share of those bytes (planner/memory.delta_sent_ratio) and adds the host's
  work on the whole policy at DELTA_HOST_GB_PER_S.
- Offload (colocated): what a role moves out of GPU memory while the engine runs crosses PCIe out and back each step.

The efficiency constants are fitted to published runs (benchmarks/RESULTS.md, "Step-time model"); the fit and the
runs held out of it are there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil, log2

from rlmegatron.config.spec import JobSpec, MegatronConfig, micro_batch_tokens
from rlmegatron.models.families import ModelArchitecture
from rlmegatron.planner.memory import EngineMemory, TrainingMemory, rollout_weight_bytes, stage_layers
from rlmegatron.planner.parameters import ParameterCount

# Fitted: see the module's docstring. MoE models get their own: a routed layer's grouped GEMMs see a few tokens per
# expert, and their all-to-alls and load imbalance cost what a dense layer's matmuls do not.
TRAIN_EFFICIENCY = {"dense": 0.30, "moe": 0.08}
DECODE_EFFICIENCY = {"dense": 0.6, "moe": 0.4}
DECODE_STEP_OVERHEAD_S = 4e-3
ALLREDUCE_LATENCY_S = {"node": 15e-6, "network": 300e-6}
BROADCAST_EFFICIENCY = 0.17
IPC_EFFICIENCY = 0.5
PCIE_EFFICIENCY = 0.6
PREFILL_EFFICIENCY = 0.5
DELTA_HOST_GB_PER_S = 0.84
"""Delta sync's own work per byte of the policy (its copy to the host, the comparison with the last-sent copy, the
records' serialization, the engine's rebuild): measured end to end on 2 CPU cores against a full push of the same
model (benchmarks/RESULTS.md, "Delta weight sync"); no GPU figure yet."""


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Defaults: an H100 SXM in a DGX node with one 400 Gb/s InfiniBand port per GPU."""

    peak_tflops: float = 989.0  # dense BF16
    hbm_gb_per_s: float = 3350.0
    nvlink_gb_per_s: float = 450.0  # per direction
    network_gbps: float = 400.0  # bits
    pcie_gb_per_s: float = 64.0  # gen 5 x16
    gpus_per_node: int = 8

    def link_gb_per_s(self, group: int) -> float:
        """The bandwidth a collective over `group` consecutive GPUs gets: NVLink within a node, else the network."""
        return self.nvlink_gb_per_s if group <= self.gpus_per_node else self.network_gbps / 8


@dataclass(frozen=True)
class Workload:
    """What one step processes: `samples` responses of `response_tokens` mean length after prompts of
    `prompt_tokens`; the longest response is `max_response_tokens`."""

    samples: int
    prompt_tokens: float
    response_tokens: float
    max_response_tokens: int

    @property
    def tokens(self) -> float:
        return self.samples * (self.prompt_tokens + self.response_tokens)

    @property
    def sequence(self) -> float:
        return self.prompt_tokens + self.response_tokens


@dataclass(frozen=True)
class StepTime:
    phases: dict[str, float]
    """Predicted seconds of each phase."""
    overlapped: bool
    """one_step_off/async on their own GPUs: generation overlaps the training phases."""
    assumptions: tuple[str, ...] = field(default=())

    @property
    def total(self) -> float:
        if not self.overlapped:
            return sum(self.phases.values())
        generation = self.phases.get("generation", 0.0)
        training = sum(v for k, v in self.phases.items() if k not in ("generation", "weight_sync"))
        return max(generation, training) + self.phases.get("weight_sync", 0.0)


def workload_of(spec: JobSpec, prompt_tokens: float | None = None, response_tokens: float | None = None) -> Workload:
    """The spec's step; mean lengths default to the maxima (every response runs to data.max_response_length)."""
    data = spec.data
    return Workload(samples=data.train_batch_size * spec.rollout.n,
                    prompt_tokens=data.max_prompt_length if prompt_tokens is None else prompt_tokens,
                    response_tokens=data.max_response_length if response_tokens is None else response_tokens,
                    max_response_tokens=data.max_response_length)


def _kind(arch: ModelArchitecture) -> str:
    return "moe" if arch.is_moe else "dense"


def _attention_flops_per_token(arch: ModelArchitecture, sequence: float) -> float:
    """Forward QK^T and AV per token over all layers, averaged over a causal sequence."""
    if arch.mla is not None:
        qk = arch.mla.qk_nope_head_dim + arch.mla.qk_rope_head_dim
        per_head = qk + arch.mla.v_head_dim
    else:
        per_head = 2 * arch.head_dim
    return arch.num_hidden_layers * sequence * arch.num_attention_heads * per_head


def training_seconds(arch: ModelArchitecture, params: ParameterCount, megatron: MegatronConfig, world: int,
                     work: Workload, passes: float, tokens_per_micro_batch: float, hw: Hardware) -> float:
    """`passes` forward-equivalents over the step's tokens (1: a log-prob pass; 3: an update, 4 with full
    recompute) on `world` GPUs laid out by `megatron`, in micro-batches of `tokens_per_micro_batch`."""
    tp, pp, cp = (megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
                  megatron.context_parallel_size)
    ep, etp = megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size or tp
    dp = max(world // (tp * pp * cp), 1)
    flops = passes * work.tokens * (2 * params.active + _attention_flops_per_token(arch, work.sequence))
    compute = flops / (world * hw.peak_tflops * 1e12 * TRAIN_EFFICIENCY[_kind(arch)])
    # Per GPU: its data-parallel share of the tokens, split by CP, on its stage's layers; activations are bf16.
    tokens_per_gpu = work.tokens / (dp * cp)
    layers = max(len(stage) for stage in stage_layers(arch.num_hidden_layers, megatron))
    moe_layers = sum(arch.moe_layers) * layers / arch.num_hidden_layers
    comm_passes = passes if passes < 3 else passes - 1  # a backward pass communicates as much as its forward
    tp_bytes = 4 * 2 * arch.hidden_size * (tp - 1) / tp * tokens_per_gpu * layers if tp > 1 else 0.0
    ep_bytes = (2 * 2 * arch.hidden_size * (arch.num_experts_per_tok or 0) * (ep - 1) / ep
                * tokens_per_gpu / tp * moe_layers) if ep > 1 else 0.0
    comm = comm_passes * (tp_bytes / hw.link_gb_per_s(tp) + ep_bytes / hw.link_gb_per_s(ep * etp)) / 1e9
    micro_batches = max(ceil(work.tokens / dp / tokens_per_micro_batch), 1)
    vpp = megatron.virtual_pipeline_model_parallel_size or 1
    bubble = 1 + (pp - 1) / (vpp * micro_batches)
    return (compute + comm) * bubble


def training_phases(spec: JobSpec, arch: ModelArchitecture, params: ParameterCount, megatron: MegatronConfig,
                    ref_megatron: MegatronConfig, world: int, work: Workload, hw: Hardware) -> dict[str, float]:
    """The trainer's phases of a step: the old-log-prob and reference passes when the spec runs them, the update;
    the actor laid out by `megatron`, the reference by `ref_megatron`."""
    actor = spec.actor
    # A token budget packs rows up to it; fixed micro-batches hold rows of the mean length.
    micro_tokens = micro_batch_tokens(actor.ppo_max_token_len_per_gpu, megatron) if actor.use_dynamic_bsz \
        else actor.ppo_micro_batch_size_per_gpu * work.sequence
    phases = {}
    if spec.needs_old_log_prob_pass:
        phases["old_log_prob"] = training_seconds(arch, params, megatron, world, work, 1, micro_tokens, hw)
    if spec.needs_reference:
        phases["ref_log_prob"] = training_seconds(arch, params, ref_megatron, world, work, 1, micro_tokens, hw)
    update_passes = (4 if megatron.recompute_granularity == "full" else 3) * actor.ppo_epochs
    phases["update"] = training_seconds(arch, params, megatron, world, work, update_passes, micro_tokens, hw)
    return phases


def generation_seconds(arch: ModelArchitecture, params: ParameterCount, engine: EngineMemory, engines: int, tp: int,
                       work: Workload, weight_bytes: float, hw: Hardware) -> float:
    """`weight_bytes`: per parameter as the engine holds it (below 1 byte and a bit with FP8 projections)."""
    per_engine = work.samples / engines
    # Continuous batching admits a waiting sample as soon as one ends, so the KV cache holds samples of the mean
    # length; what does not fit runs later, each later wave as long as a mean response.
    concurrent = max(min(per_engine, engine.kv_tokens / (work.prompt_tokens + work.response_tokens)), 1)
    steps = work.max_response_tokens + (per_engine / concurrent - 1) * work.response_tokens
    # Over the steps the batch holds, on average, the tokens it decodes spread over the steps it takes.
    batch = per_engine * work.response_tokens / steps
    expert_bytes = params.routed_experts * weight_bytes
    if arch.is_moe:
        touched = 1 - (1 - (arch.num_experts_per_tok or 0) / arch.num_experts) ** batch
        expert_bytes *= touched
    weights_read = ((params.total - params.routed_experts) * weight_bytes + expert_bytes) / tp
    efficiency = DECODE_EFFICIENCY[_kind(arch)]
    hbm = hw.hbm_gb_per_s * 1e9 * efficiency
    peak = hw.peak_tflops * 1e12
    # A small all-reduce's latency: NVLink's within a node, plus a network hop per doubling of the nodes it spans
    # (NCCL's tree all-reduce across nodes).
    nodes = ceil(tp / hw.gpus_per_node)
    latency = 2 * arch.num_hidden_layers * (ALLREDUCE_LATENCY_S["node"] + ALLREDUCE_LATENCY_S["network"]
                                            * log2(nodes)) if tp > 1 else 0.0
    step = max(weights_read / hbm, 2 * params.active * batch / tp / (peak * efficiency)) + latency \
        + DECODE_STEP_OVERHEAD_S
    # Each generated token reads its sample's KV cache so far: on average the prompt and half the response.
    kv = per_engine * work.response_tokens * (work.prompt_tokens + work.response_tokens / 2) \
        * engine.kv_bytes_per_token / hbm
    prefill = 2 * params.active * per_engine * work.prompt_tokens / tp / (peak * PREFILL_EFFICIENCY)
    return steps * step + kv + prefill


def sync_seconds(bytes_per_engine_gpu: float, colocated: bool, trainer_shards: int, hw: Hardware) -> float:
    """`trainer_shards`: over how many GPUs the trainer splits a weight (TP x PP, or EP x ETP x PP for experts)."""
    if not colocated:
        return bytes_per_engine_gpu / (hw.network_gbps / 8 * 1e9 * BROADCAST_EFFICIENCY)
    # The GPU holds 1/shards of what its engine needs; the rest arrives from the trainer ranks that hold it, then
    # crosses into the engine by CUDA IPC.
    gathered = bytes_per_engine_gpu * (1 - 1 / trainer_shards) \
        / (hw.link_gb_per_s(trainer_shards) * 1e9 * BROADCAST_EFFICIENCY)
    return gathered + bytes_per_engine_gpu / (hw.hbm_gb_per_s * 1e9 / 2 * IPC_EFFICIENCY)


def offload_seconds(moved_bytes_per_gpu: float, hw: Hardware) -> float:
    """Out of the GPU before generation and back after: twice over PCIe."""
    return 2 * moved_bytes_per_gpu / (hw.pcie_gb_per_s * 1e9 * PCIE_EFFICIENCY)


def step_time(spec: JobSpec, arch: ModelArchitecture, params: ParameterCount, actor: TrainingMemory,
              engine: EngineMemory, sync_bytes_per_engine_gpu: float, work: Workload, hw: Hardware) -> StepTime:
    world = spec.placement.trainer_world_size
    megatron = spec.actor.megatron
    colocated = spec.placement.mode == "colocate"
    rollout_gpus = world if colocated else (spec.placement.rollout_pool_size or world)
    tp_g = spec.rollout.tensor_parallel_size
    weight_bytes = rollout_weight_bytes(spec, params) / params.total
    phases = {"generation": generation_seconds(arch, params, engine, max(rollout_gpus // tp_g, 1), tp_g, work,
                                               weight_bytes, hw),
              **training_phases(spec, arch, params, megatron, spec.ref.megatron, world, work, hw)}
    pp = megatron.pipeline_model_parallel_size
    shards = pp * max(megatron.tensor_model_parallel_size,
                      megatron.expert_model_parallel_size * (megatron.expert_tensor_parallel_size or 1))
    phases["weight_sync"] = sync_seconds(sync_bytes_per_engine_gpu, colocated, shards, hw)
    if spec.rollout.weight_sync == "delta":  # the bytes it saves cost host work on the whole policy
        phases["weight_sync"] += rollout_weight_bytes(spec, params) / (DELTA_HOST_GB_PER_S * 1e9)
    if colocated:
        # What leaves the GPU while the engine runs; a CPU optimizer's state (offload.optimizer) never sits there.
        offload = spec.actor.offload
        moved = (actor.parameters if offload.params else 0.0) + (actor.gradients if offload.grads else 0.0)
        if spec.needs_reference and spec.ref.offload.params:
            moved += actor.parameters
        phases["offload"] = offload_seconds(moved, hw)
    assumptions = (
        f"{work.samples} responses of {work.response_tokens:g} tokens on average (longest "
        f"{work.max_response_tokens}) after {work.prompt_tokens:g}-token prompts",
        f"{hw.peak_tflops:g} TFLOPS, {hw.hbm_gb_per_s:g} GB/s HBM, {hw.network_gbps:g} Gb/s network per GPU",
        f"fitted efficiencies: training {TRAIN_EFFICIENCY[_kind(arch)]:g} of peak, decode "
        f"{DECODE_EFFICIENCY[_kind(arch)]:g} of HBM, broadcast {BROADCAST_EFFICIENCY:g} of the link",
    )
    overlapped = spec.trainer.mode != "sync" and not colocated
    return StepTime(phases, overlapped, assumptions)
