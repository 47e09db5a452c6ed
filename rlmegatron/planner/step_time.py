"""A model of one RL step's seconds, phase by phase, from FLOPs, bytes and bandwidths: an estimate, never a measurement.

Formulas and their sources:
- Training FLOPs per token: 2 x the parameters a token passes through for a forward pass, 4 x for the backward
  (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1; Narayanan et al. 2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters", section 5.1), plus causal attention: QK^T and AV cost
  2 x s x heads x head_dim FLOPs per token and layer averaged over a causal sequence of s tokens. A forward-only pass
  (old and reference log-probs) is a third of a training pass; full recompute adds one forward (Korthikanti et al.
  2022). The achieved fraction of the GPU's peak is `train_dense` or `train_moe`.
- Communication that Megatron does not hide: with tensor parallelism (and sequence parallelism) each layer
  all-gathers and reduce-scatters its activations twice per pass, (t - 1) / t of 2 bytes x hidden per token; an MoE
  layer's all-to-all sends each token to its top-k experts and back, (e - 1) / e of it leaving the GPU. Within a node
  over NVLink, across nodes over the network (Narayanan et al. 2021, section 3.2; DeepSeek-V3 report, section 3.2).
- Pipeline bubble: (PP - 1) / (VPP x micro-batches) of the pipeline's time (Narayanan et al. 2021, equation 2).
- Decoding is bound by memory bandwidth: every decode step reads the engine's share of the weights the batch touches
  (an MoE layer's experts any of its b tokens picks: 1 - (1 - k/E)^b of them) and every running sample's KV cache
  (Pope et al. 2022, "Efficiently Scaling Transformer Inference", section 2; the roofline of Williams et al. 2009),
  at `decode_hbm` of the HBM bandwidth, and waits for its tensor-parallel all-reduces (2 per layer), a fixed latency
  each (within a node, plus a network hop per doubling of the nodes it spans: NCCL's tree), and the server's host
  work: `decode_step_s` per step and `decode_sample_s` per running sample (scheduling, sampling, detokenising).
- The decode batch is what the engine's KV cache holds (planner/memory.engine_memory: the static reservation less
  the weights, over the KV bytes of a token) at the context a decoded token sees on average (the prompt and
  E[l^2] / 2 E[l] of response); more wait and enter as others end, the batch staying full until none waits. Then it drains: response lengths are taken as exponential with the spec's
  mean, cut at its maximum (the lengths RL sampling gives: many short, a tail that hits the limit), so the batch
  shrinks as e^(-s/mu) and the longest of the engine's n samples, min(max, mu x H_n), sets the steps: the tail, not
  the mean, bounds a synchronous batch.
- Weight sync (refit), priced as this project's push does it (planner/memory.WeightSync): each receiver (an engine
  GPU) gets every tensor whole in the rollout dtype, whatever the engine's TP (rollout/sglang/weight_push.py sends
  the export's HF tensors and SGLang's loader slices them). First the trainer's export hands every rank every tensor
  whole (export_seconds: each rank's shard broadcast from the pipeline stage that holds it, then the TP/EP all-gather
  on every stage, over NVLink within a node, else the network; resharding/export.py). Then the bytes cross to the
  receivers at `link` of the links' bandwidth, plus `bucket_s` per bucket of rollout.update_weights_bucket_mb (each
  is a collective of its own), plus `tensor_s` per tensor (parameters.checkpoint_tensors: every HF tensor, each
  routed expert's three apart): the work done tensor by tensor whatever its size (the engine's load_weights
  dispatches, slices and copies each; a sender that gathers each does as much). Disaggregated, over the network from
  every trainer rank (with delta sync, the first of each node), all at once, each over its GPU's own link, each bucket
  to all of its share of the servers at once (`DistributedWeightPush._broadcast`: announce it to each over HTTP,
  broadcast it over each server's group, wait for every answer, which comes after the load), so the bytes cross a
  sender's link once per server it sends to (WeightSync.servers_per_link) and the loads overlap; the next bucket waits
  for them all; colocated, every GPU at once, into the engine by CUDA IPC at `ipc` of half the HBM bandwidth (a copy
  reads and writes; `share_buckets`). The export, the bytes and the loads follow one another. Another framework's
  refit is priced by its memory.Transport: a broadcast that spreads over every link of a node, an export that overlaps
  the transfer and the loads (benchmarks/step_time_calibration.py prices NeMo-RL's so).
- Delta weight sync sends the measured share of those bytes (planner/memory.delta_sent_ratio) and adds the host's
  work on the whole policy at DELTA_HOST_GB_PER_S; disaggregated, its records travel in request bodies, base64, a
  copy per TP rank of each server (memory.WeightSync.sent_per_server).
- Offload (colocated): what a role moves out of GPU memory while the engine runs crosses PCIe out and back each step.
- Overlap: one_step_off and async on their own GPUs generate step n + 1 while the trainer trains step n, so a step
  is the longer of the two sides plus what neither hides (the weight sync). A schedule that keeps prompts in flight
  across steps (`steps_in_flight`: NeMo-RL's async GRPO starts a prompt as another ends, up to
  max_trajectory_age_steps steps' worth) never drains a batch: its generation runs at the full batch's rate.

The constants (`Constants`) FLOPs, bytes and bandwidths do not give are fitted to published runs by
benchmarks/step_time_calibration.py; the fit, the runs held out of it and a leave-one-out test are in
benchmarks/RESULTS.md ("Step-time model out of sample"). The efficiencies of a software stack (training's MFU, the
decode engine's bandwidth and host work) are fitted per NeMo-RL release (FITTED_BY_RELEASE): v0.6 runs v0.4's
published layouts 20-40 % faster, which no layout term can carry; the network's latency and the sync's constants are
shared, and so are a multi-head latent attention model's shares of the efficiencies (`mla_train`, `mla_decode`:
NeMo-RL's DeepSeek-V3 runs train and decode far below what its Qwen3 runs give, for a cause not published). The
planner prices with the newest release's (FITTED).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil, exp, expm1, inf, log, log2

from rlmegatron.config.spec import JobSpec, MegatronConfig, micro_batch_tokens
from rlmegatron.models.families import ModelArchitecture
from rlmegatron.planner.memory import (EngineMemory, ScoringMemory, TrainingMemory, Transport,
                                       WeightSync, engine_count, rollout_weight_bytes, stage_layers)
from rlmegatron.planner.parameters import ParameterCount, checkpoint_tensors

@dataclass(frozen=True)
class Constants:
    """What FLOPs, bytes and bandwidths leave to measurement: efficiencies and latencies. FITTED holds the values
    benchmarks/step_time_calibration.py fits on its fit runs (the names in its FREE); the others are set here."""

    train_dense: float
    """Fraction of peak FLOPS a dense model's training passes reach."""
    train_moe: float
    """An MoE model's: its routed layers' grouped GEMMs see a few tokens per expert, and their all-to-alls and load
    imbalance cost what a dense layer's matmuls do not."""
    decode_hbm: float
    """Fraction of the HBM bandwidth a decode step's weight and KV reads reach."""
    allreduce_network_s: float
    """A small all-reduce's latency per network hop (an engine whose TP spans nodes)."""
    link: float
    """Fraction of a link's bandwidth a weight sync's transfers reach: the export's gathers and stage broadcasts, and
    the bucketed transfer to the engines."""
    tensor_s: float = 0.0
    """A weight sync receiver's work per tensor it loads (the engine's load_weights: a Python dispatch per name, the
    slice of its share, the copy into the parameter), whatever the tensor's size."""
    decode_sample_s: float = 0.0
    """The server's work per running sample per decode step (its scheduling, sampling with log-probs, detokenising):
    host work that grows with the batch where the GPU's reads do not."""
    decode_step_s: float = 4e-3
    """The server's own work per decode step, whatever its batch."""
    allreduce_node_s: float = 15e-6
    """A small all-reduce within an NVLink node (NCCL's latency-bound regime)."""
    bucket_s: float = 5e-3
    """Per weight-sync bucket: its collective's launch and the receiver's load of the bucket into the model."""
    ipc: float = 0.5
    pcie: float = 0.6
    prefill: float = 0.5
    """Fraction of peak FLOPS a prefill reaches (large matmuls, like training's)."""
    mla_train: float = 1.0
    """A multi-head latent attention model's training efficiency as a share of what train_moe (train_dense) gives
    the others: fitted on NeMo-RL's DeepSeek-V3 runs, which its stack trains and decodes far below its Qwen3 MoE
    runs for a cause the published figures do not show (benchmarks/RESULTS.md, "Step-time model out of sample",
    round 5). A share of the family's, not a physical rate: it says how much slower, not why."""
    mla_decode: float = 1.0
    """Its decode's share of decode_hbm, as mla_train's of training."""

    def train(self, arch: ModelArchitecture) -> float:
        return (self.train_moe if arch.is_moe else self.train_dense) * (self.mla_train if arch.mla is not None else 1.0)

    def decode(self, arch: ModelArchitecture) -> float:
        return self.decode_hbm * (self.mla_decode if arch.mla is not None else 1.0)


_FITTED_SHARED = dict(allreduce_network_s=61.5e-6, link=0.567, tensor_s=226e-6, mla_train=0.477, mla_decode=0.288)
FITTED_BY_RELEASE = {
    "v0.4": Constants(train_dense=0.393, train_moe=0.0700, decode_hbm=0.503, decode_sample_s=25.0e-6,
                      **_FITTED_SHARED),
    "v0.6": Constants(train_dense=0.393, train_moe=0.155, decode_hbm=0.557, decode_sample_s=52.5e-6,
                      **_FITTED_SHARED),
}
"""The fitted constants of each NeMo-RL release's software (benchmarks/step_time_calibration.py: each release's
SOFTWARE constants on its own fit rows, the SHARED ones on all; v0.6 has no dense row, so its train_dense is v0.4's)."""
RELEASES = ("v0.4", "v0.6")
LATEST = RELEASES[-1]
FITTED = FITTED_BY_RELEASE[LATEST]
"""What `rlm plan` prices with: the newest release's software efficiencies, the closest published stack to today's."""
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
    nvlink_domain: int | None = None
    """GPUs one NVLink fabric joins, when more than a node's (GB200 NVL72: 72 GPUs over 4-GPU trays); None: a
    node's. A collective within it runs over NVLink, and a decode's all-reduce crosses the network only beyond it."""

    @property
    def domain(self) -> int:
        return self.nvlink_domain or self.gpus_per_node

    def link_gb_per_s(self, group: int) -> float:
        """The bandwidth a collective over `group` consecutive GPUs gets: NVLink within an NVLink domain (a node,
        unless nvlink_domain says more), else the network."""
        return self.nvlink_gb_per_s if group <= self.domain else self.network_gbps / 8

    def network_gb_per_s(self, links: int) -> float:
        """What `links` network links carry at once into or out of a node, at most what NVLink forwards within it."""
        return min(links * self.network_gbps / 8, self.nvlink_gb_per_s)


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


def _attention_flops_per_token(arch: ModelArchitecture, sequence: float) -> float:
    """Forward QK^T and AV per token over all layers, averaged over a causal sequence."""
    if arch.mla is not None:
        qk = arch.mla.qk_nope_head_dim + arch.mla.qk_rope_head_dim
        per_head = qk + arch.mla.v_head_dim
    else:
        per_head = 2 * arch.head_dim
    return arch.num_hidden_layers * sequence * arch.num_attention_heads * per_head


def training_seconds(arch: ModelArchitecture, params: ParameterCount, megatron: MegatronConfig, world: int,
                     work: Workload, passes: float, tokens_per_micro_batch: float, hw: Hardware,
                     c: Constants = FITTED) -> float:
    """`passes` forward-equivalents over the step's tokens (1: a log-prob pass; 3: an update, 4 with full
    recompute) on `world` GPUs laid out by `megatron`, in micro-batches of `tokens_per_micro_batch`."""
    tp, pp, cp = (megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
                  megatron.context_parallel_size)
    ep, etp = megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size or tp
    dp = max(world // (tp * pp * cp), 1)
    flops = passes * work.tokens * (2 * params.active + _attention_flops_per_token(arch, work.sequence))
    compute = flops / (world * hw.peak_tflops * 1e12 * c.train(arch))
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
                    ref_megatron: MegatronConfig, world: int, work: Workload, hw: Hardware,
                    c: Constants = FITTED) -> dict[str, float]:
    """The trainer's phases of a step: the old-log-prob and reference passes when the spec runs them, the update;
    the actor laid out by `megatron`, the reference by `ref_megatron`."""
    actor = spec.actor
    # A token budget packs rows up to it; fixed micro-batches hold rows of the mean length.
    micro_tokens = micro_batch_tokens(actor.ppo_max_token_len_per_gpu, megatron) if actor.use_dynamic_bsz \
        else actor.ppo_micro_batch_size_per_gpu * work.sequence
    phases = {}
    if spec.needs_old_log_prob_pass:
        phases["old_log_prob"] = training_seconds(arch, params, megatron, world, work, 1, micro_tokens, hw, c)
    if spec.needs_reference:
        phases["ref_log_prob"] = training_seconds(arch, params, ref_megatron, world, work, 1, micro_tokens, hw, c)
    update_passes = (4 if megatron.recompute_granularity == "full" else 3) * actor.ppo_epochs
    phases["update"] = training_seconds(arch, params, megatron, world, work, update_passes, micro_tokens, hw, c)
    if actor.mtp.loss_weight > 0 and params.mtp:
        phases["mtp_update"] = mtp_seconds(arch, params, megatron, world, work, update_passes, hw, c)
    return phases


def mtp_seconds(arch: ModelArchitecture, params: ParameterCount, megatron: MegatronConfig, world: int,
                work: Workload, passes: float, hw: Hardware, c: Constants = FITTED) -> float:
    """What training the MTP layers (actor.mtp.loss_weight) adds to the update: their `passes` over the step's
    tokens, each MTP layer a decoder layer and a pass through the output head, on the GPUs of the last pipeline
    stage, which hold them; the other stages wait for it."""
    stage_gpus = max(world // megatron.pipeline_model_parallel_size, 1)
    attention = _attention_flops_per_token(arch, work.sequence) / arch.num_hidden_layers * len(params.mtp)
    flops = passes * work.tokens * (2 * params.mtp_active + attention)
    return flops / (stage_gpus * hw.peak_tflops * 1e12 * c.train(arch))


def length_scale(mean: float, longest: float) -> float:
    """mu of exponential response lengths cut at `longest` whose mean is `mean`: mu (1 - e^(-longest/mu)) = mean
    (infinite when every response runs to the limit)."""
    if mean >= longest:
        return inf
    low, high = mean, mean * 1e6  # the cut mean rises with mu from 0 to `longest`; at mu = mean it is below mean
    for _ in range(100):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if mid * -expm1(-longest / mid) < mean else (low, mid)
    return low


def longest_response(mean: float, longest: float, samples: float) -> float:
    """The expected longest of `samples` such lengths: the exponential's maximum, mu x H_n, at most the cut."""
    harmonic = log(max(samples, 1.0)) + 0.5772 + 1 / (2 * max(samples, 1.0))
    return min(longest, length_scale(mean, longest) * harmonic)


def generation_seconds(arch: ModelArchitecture, params: ParameterCount, engine: EngineMemory, engines: int, tp: int,
                       work: Workload, weight_bytes: float, hw: Hardware, c: Constants = FITTED,
                       drafts: int = 0, max_running: float = inf, steps_in_flight: int | None = None) -> float:
    """`weight_bytes`: per parameter as the engine holds it (below 1 byte and a bit with FP8 projections).
    `drafts` (rollout.speculative): each decode step reads the MTP layer's weights once per drafted token, verifies
    the drafts and the token after them in one pass of the main model (k + 1 tokens' compute on the same weight
    reads), and yields tokens_per_verification(drafts) of them: the steps shrink by that much. `max_running`: the most
    samples an engine runs at once (running_cap), below what its KV cache holds. `steps_in_flight`: a schedule that
    keeps up to that many steps' samples running, starting one as another ends, so no batch drains at a step's end
    and the step's tokens come at the full batch's rate (NeMo-RL's async GRPO); None: the step's batch is generated,
    then drains (this project's modes)."""
    per_engine = work.samples / engines
    hbm = hw.hbm_gb_per_s * 1e9 * c.decode(arch)
    peak = hw.peak_tflops * 1e12
    domains = ceil(tp / hw.domain)  # the NVLink domains (nodes) the engine spans
    latency = 2 * arch.num_hidden_layers * (c.allreduce_node_s + c.allreduce_network_s * log2(domains)) \
        if tp > 1 else 0.0
    dense_bytes = (params.total - params.routed_experts) * weight_bytes / tp
    expert_bytes = params.routed_experts * weight_bytes / tp
    pick = (arch.num_experts_per_tok or 0) / arch.num_experts if arch.is_moe else 1.0

    draft_bytes = drafts * params.mtp_total / max(len(params.mtp), 1) * weight_bytes / tp

    def step(batch: float, context_tokens: float) -> float:
        """One decode step of `batch` samples holding `context_tokens` in the KV cache."""
        touched = 1 - (1 - pick) ** batch if arch.is_moe else 1.0
        weights = (dense_bytes + expert_bytes * touched + draft_bytes) / hbm
        compute = 2 * params.active * batch * (drafts + 1) / tp / (peak * c.decode(arch))
        return max(weights, compute) + context_tokens * engine.kv_bytes_per_token / hbm + latency + c.decode_step_s \
            + c.decode_sample_s * batch

    prompt, mean, cut = work.prompt_tokens, work.response_tokens, work.max_response_tokens
    mu = length_scale(mean, cut)
    # A decoded token's context: the prompt and its response so far, which long responses weigh most (for lengths
    # l, sum(l^2) / 2 over sum(l); l^2's mean for the cut exponential is 2 mu^2 (1 - e^-x (1 + x)), x = cut / mu).
    x = cut / mu
    second = cut ** 2 if mu == inf else 2 * mu ** 2 * -(expm1(-x) + x * exp(-x))
    context = prompt + second / (2 * mean)
    # The batch the KV cache holds at that context; the rest wait and enter as others end, so the batch stays full
    # while the (n - held) waiting samples' tokens are decoded.
    prefill = 2 * params.active * per_engine * prompt / tp / (peak * c.prefill)
    if steps_in_flight is not None:
        held = max(min(per_engine * steps_in_flight, engine.kv_tokens / context, max_running), 1.0)
        return per_engine * mean / held * step(held, held * context) / tokens_per_verification(drafts) + prefill
    held = max(min(per_engine, engine.kv_tokens / context, max_running), 1.0)
    full = (per_engine - held) * mean / held * step(held, held * context)
    # Then the last `held` drain: alive at step s with probability e^(-s/mu), until the engine's longest response.
    tail = longest_response(mean, cut, per_engine)
    chunks = 128
    drain = 0.0
    for index in range(chunks):
        s = (index + 0.5) * tail / chunks
        alive = max(held * exp(-s / mu), 1.0)
        drain += tail / chunks * step(alive, alive * (prompt + s))
    return (full + drain) / tokens_per_verification(drafts) + prefill


SPEC_ACCEPTANCE = 0.85
"""Speculative decoding's assumed chance that a drafted token is accepted, given the drafts before it were:
DeepSeek-V3's report (section 5.4.3) measures 85-90 % for its one MTP layer's token; chained drafts of the same
layer (SGLang's NEXTN with k > 1) fall off, which this does not model: an optimistic figure for k > 1, until the
local engine's measured rollout/spec_accept_rate replaces it."""


def running_cap(spec: JobSpec) -> float:
    """The most samples an SGLang engine runs at once: --max-running-requests as rollout.sglang.extra_args gives it,
    else 48 with speculative decoding (SGLang 0.5.23 sets that for its EAGLE/NEXTN drafting when none is given), else
    no cap but the KV cache's."""
    given = spec.rollout.sglang.extra_args.get("max-running-requests")
    if given is not None:
        return float(given)
    return SGLANG_SPECULATIVE_RUNNING if spec.rollout.speculative is not None and spec.rollout.engine == "sglang" \
        else inf


SGLANG_SPECULATIVE_RUNNING = 48.0


def tokens_per_verification(drafts: int, acceptance: float = SPEC_ACCEPTANCE) -> float:
    """Tokens one verification of `drafts` drafted tokens yields on average: the accepted run, stopping at the first
    rejection, plus the token the verification samples itself; 1 without drafts."""
    return (1 - acceptance ** (drafts + 1)) / (1 - acceptance)


def export_seconds(policy_bytes: float, expert_share: float, megatron: MegatronConfig, world: int, hw: Hardware,
                   c: Constants = FITTED) -> float:
    """The trainer's export that hands every rank every tensor whole: `policy_bytes` in the training dtype,
    `expert_share` of them routed experts, on `world` GPUs laid out by `megatron`. Each rank's shard of a weight is
    broadcast from the pipeline stage that holds it to the same rank of the others, then gathered over TP (a routed
    expert's over EP x ETP) on every stage (resharding/export.py; Megatron-Bridge's export_hf_weights orders them so
    too). Every GPU of a node broadcasts to its own stage group at once, so a broadcast between stages on different
    nodes gets one link a GPU; a gather within a node runs over NVLink, one over whole nodes is a ring whose channels
    cross each node by all its links."""
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    experts = megatron.expert_model_parallel_size * (megatron.expert_tensor_parallel_size or tp)

    def ring(group: int) -> float:
        return hw.nvlink_gb_per_s if group <= hw.domain else hw.network_gb_per_s(hw.gpus_per_node)

    dense, routed = policy_bytes * (1 - expert_share), policy_bytes * expert_share
    gather = dense * (1 - 1 / tp) / ring(tp) + routed * (1 - 1 / experts) / ring(experts)
    between = 0.0
    if pp > 1:  # the shards, from their stage; a stage group spans nodes unless the whole trainer sits in one
        between = (dense / tp + routed / experts) / hw.link_gb_per_s(world)
    return (gather + between) / (1e9 * c.link)


def sync_seconds(bytes_per_receiver: float, colocated: bool, hw: Hardware, bucket_bytes: float,
                 c: Constants = FITTED, tensors: int = 0, per_link: int = 1,
                 sent_per_server: float | None = None, export_s: float = 0.0,
                 transport: Transport = Transport()) -> float:
    """One refit: `bytes_per_receiver` into each engine GPU, in buckets of `bucket_bytes`, the receiver loading
    `tensors` tensors (parameters.checkpoint_tensors; 0 prices the bytes alone), after or alongside the trainer's
    export (`export_s`, export_seconds). Disaggregated, `per_link` servers share a sender's link, each bucket sent to
    them at once (memory.WeightSync.servers_per_link; 1 where one broadcast reaches them all), each sent
    `sent_per_server` bytes (None: bytes_per_receiver) over `transport.links` network links, their loads overlapping;
    colocated, each GPU's bytes cross into its engine by CUDA IPC. `transport.pipelined`: the export, the transfer and
    the loads of successive buckets overlap, so the slowest of the three sets the pace; else each follows the
    other."""
    load = ceil(bytes_per_receiver / bucket_bytes) * c.bucket_s + tensors * c.tensor_s
    if colocated:  # a copy reads and writes HBM
        moved = bytes_per_receiver / (hw.hbm_gb_per_s * 1e9 / 2 * c.ipc)
    else:
        sent = bytes_per_receiver if sent_per_server is None else sent_per_server
        moved = per_link * sent / (hw.network_gb_per_s(transport.links) * 1e9 * c.link)
    return max(export_s, moved, load) if transport.pipelined else export_s + moved + load


def offload_seconds(moved_bytes_per_gpu: float, hw: Hardware, c: Constants = FITTED) -> float:
    """Out of the GPU before generation and back after: twice over PCIe."""
    return 2 * moved_bytes_per_gpu / (hw.pcie_gb_per_s * 1e9 * c.pcie)


def step_time(spec: JobSpec, arch: ModelArchitecture, params: ParameterCount, actor: TrainingMemory,
              engine: EngineMemory, sync: WeightSync, work: Workload, hw: Hardware,
              c: Constants = FITTED,
              teacher: tuple[ModelArchitecture, ParameterCount, ScoringMemory] | None = None,
              steps_in_flight: int | None = None) -> StepTime:
    """`sync`: what a refit moves and how (memory.weight_sync; benchmarks/step_time_calibration.py gives NeMo-RL's
    transport instead). `teacher`: on-policy distillation's teacher (its architecture, parameters and memory), whose
    log-prob pass is a phase of its own. `steps_in_flight`: generation_seconds'; this project's modes drain each
    step's batch (None)."""
    world = spec.placement.trainer_world_size
    megatron = spec.actor.megatron
    colocated = spec.placement.mode == "colocate"
    tp_g = spec.rollout.tensor_parallel_size
    weight_bytes = rollout_weight_bytes(spec, params) / params.total
    speculative = spec.rollout.speculative
    drafts = speculative.num_draft_tokens if speculative is not None else 0
    phases = {"generation": generation_seconds(arch, params, engine, engine_count(spec), tp_g, work,
                                               weight_bytes, hw, c, drafts, running_cap(spec), steps_in_flight),
              **training_phases(spec, arch, params, megatron, spec.ref.megatron, world, work, hw, c)}
    if teacher is not None:  # on-policy distillation: the teacher's forward over the step's tokens, at its layout
        section = spec.teacher
        # As the actor's: a token budget packs rows up to it; fixed micro-batches hold rows of the mean length.
        micro_tokens = micro_batch_tokens(section.log_prob_max_token_len_per_gpu, section.megatron) \
            if section.log_prob_use_dynamic_bsz else section.log_prob_micro_batch_size_per_gpu * work.sequence
        phases["teacher_log_prob"] = training_seconds(teacher[0], teacher[1], section.megatron, world, work, 1,
                                                      micro_tokens, hw, c)
    tensors = checkpoint_tensors(arch)  # each receiver loads them one by one
    export = export_seconds(sync.exported_bytes, params.routed_experts / params.total, megatron, world, hw, c)
    phases["weight_sync"] = sync_seconds(sync.bytes_per_receiver, colocated, hw,
                                         spec.rollout.update_weights_bucket_mb << 20, c, tensors,
                                         sync.servers_per_link, sync.sent_per_server, export, sync.transport)
    if spec.rollout.weight_sync == "delta":  # the bytes it saves cost host work on the whole policy
        phases["weight_sync"] += rollout_weight_bytes(spec, params) / (DELTA_HOST_GB_PER_S * 1e9)
    if colocated:
        # What leaves the GPU while the engine runs; a CPU optimizer's state (offload.optimizer) never sits there.
        offload = spec.actor.offload
        moved = (actor.parameters if offload.params else 0.0) + (actor.gradients if offload.grads else 0.0)
        if spec.needs_reference and spec.ref.offload.params:
            moved += actor.parameters
        if teacher is not None and spec.teacher.offload.params:
            moved += teacher[2].weights
        phases["offload"] = offload_seconds(moved, hw, c)
    assumptions = (
        f"{work.samples} responses of {work.response_tokens:g} tokens on average, exponential cut at "
        f"{work.max_response_tokens} (the longest of an engine's batch sets its decode steps), after "
        f"{work.prompt_tokens:g}-token prompts",
        f"{hw.peak_tflops:g} TFLOPS, {hw.hbm_gb_per_s:g} GB/s HBM, {hw.nvlink_gb_per_s:g} GB/s NVLink within "
        f"{hw.domain} GPUs, {hw.network_gbps:g} Gb/s network per GPU",
        f"fitted efficiencies: training {c.train(arch):.3g} of peak, decode {c.decode(arch):.3g} of HBM and "
        f"{c.decode_sample_s * 1e6:.0f} us per sample per step, weight sync {c.link:g} of the link and "
        f"{c.tensor_s * 1e3:.2g} ms per tensor loaded ({tensors:,} per engine GPU)",
        f"weight_sync begins with the trainer's export, {export:.1f} s of it (each rank's shard between the "
        f"{megatron.pipeline_model_parallel_size} pipeline stages, then the TP/EP all-gathers), then "
        + ("the bytes and the loads" if colocated else
           f"the bytes of {sync.servers_per_link} server(s) through one link, then their loads, at once (each "
           f"trainer rank pushes to its share of the servers, every bucket to all of them)"),
        *([f"speculative decoding: {drafts} MTP drafts per step, each accepted with probability {SPEC_ACCEPTANCE:g} "
           f"(assumed), {tokens_per_verification(drafts):.2f} tokens per verification"] if drafts else []),
        *([f"at most {running_cap(spec):g} samples running per engine (--max-running-requests; "
           "rollout.sglang.extra_args sets it)"] if running_cap(spec) < inf else []),
        *([f"a multi-head latent attention model: training at {c.mla_train:g} and decoding at {c.mla_decode:g} of "
           "the efficiencies the Qwen3 and Llama runs give, as NeMo-RL's published DeepSeek-V3 runs gave them (a "
           "cause they do not show; benchmarks/RESULTS.md)"] if arch.mla is not None else []),
    )
    overlapped = spec.trainer.mode != "sync" and not colocated
    return StepTime(phases, overlapped, assumptions)
