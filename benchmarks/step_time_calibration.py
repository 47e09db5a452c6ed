"""The step-time model (rlmegatron/planner/step_time.py) against published runs, each with its publisher's layout:
predicted seconds per step and per phase beside the published figure, and the error; the constants' fit; and a
leave-one-out test over every run.

    python -m benchmarks.step_time_calibration [--markdown] [--fit [--never-fit MODEL ...]]

Runs marked "fit" set the constants step_time.Constants leaves free (FREE: the training efficiencies, the decode
bandwidth efficiency and per-sample host work, the cross-node all-reduce latency, the weight sync's link efficiency
and per-tensor load, and a multi-head latent attention model's shares of the efficiencies); `--fit` refits them on
those runs alone (what step_time.FITTED_BY_RELEASE holds, rounded) and then, for each run of all of them, on every
other run, predicting the one left out.

Constants per software release: the efficiencies (SOFTWARE) describe a software stack, and NeMo-RL v0.4 and v0.6 are
two (v0.6 runs v0.4's published layouts 20-40 % faster: Qwen3-30B-A3B 1-step off 244 -> 152 s, Qwen3-235B-A22B on
128 GPUs 506 -> 395 s), so each release's are fitted on that release's fit rows alone and predict that release's
rows; the network's all-reduce latency and the sync's constants (SHARED) are fitted on every fit row. v0.6 publishes
no dense run, so its train_dense is v0.4's (unidentified, and nothing of v0.6's uses it).

Which runs fit: a step's published total alone cannot say how much of it is generation and how much training, so an
on-policy run (generation + training) is fitted with its 1-step off-policy twin (the longer of the two): Llama-3.1-8B
(dense, v0.4), Qwen3-30B-A3B (MoE on one node) and Qwen3-235B-A22B (MoE, on policy with TP16 engines across two nodes:
the cross-node all-reduce latency), each both ways, in each release that publishes them. The sync: verl's benchmark
and NeMo-RL's NCCL refit of DeepSeek-V3, the only two NCCL refits published with their bytes and tensors, two rows
for two constants (link, tensor_s). DeepSeek-V3's v0.4 pair (on policy on 256 GPUs, 1-step off on 512), by the
same twin rule, fits the two constants of a multi-head latent attention model (mla_train, mla_decode: its training
and decode efficiencies as shares of what the Qwen3 and Llama runs give, SHARED across releases). Without them the
model gives every DeepSeek-V3 run 37-47 % too little time, on policy and off, and its on/off twins need generation
and training each about twice what it gives (`twin_phases`, printed under the table), which no constant the Qwen3
runs share can carry: NeMo-RL's stack runs DeepSeek-V3 far below its Qwen3 MoE runs in both phases, for a cause the
published figures do not show (benchmarks/RESULTS.md, "Step-time model out of sample", rounds 4 and 5). The two
constants say how much slower, not why. Held out: Qwen3-32B both ways (a dense model the fit never sees),
Qwen3-235B-A22B on 256 GPUs (v0.6), v0.6's Qwen3-30B-A3B 8-step off (a schedule no fit row has), and DeepSeek-V3's
three v0.6 runs (another release's software, and 512 GPUs on policy at EP 32).
`--never-fit MODEL` keeps a model's runs out of every leave-one-out fit (the main fit keeps its fit rows). Other
transports (shown, never fitted, outside the criterion): NeMo-RL's NCCL reshard and NIXL refits of DeepSeek-V3,
which send each rank only its shard.

Sources:
- NeMo-RL v0.4 performance summary (docs/about/performance-summary.md in NVIDIA-NeMo/RL, r0.4.0): GRPO on
  OpenMathInstruct-2, DGX-H100, BF16 training and generation, Megatron-Core, colocated when on policy. Its "average
  sequence length" is taken as prompt + response, with prompts of 128 tokens on average (the dataset's math problems
  in a chat template) and a 256-token prompt budget inside the published maximum sequence length; NeMo-RL computes
  the old log-probs in a pass of their own every step, and GRPO there has a reference KL term. From its recipes
  (examples/configs/recipes/llm/performance): vLLM reserves 0.6 of the GPU when colocated (grpo_math_1B.yaml's
  default) and 0.8 on its own GPUs (the async-1off recipes); Llama-3.1-8B, DeepSeek-V3 and Qwen3-235B-A22B train
  with activation checkpointing (full recompute), the Qwen3-30B-A3B and Qwen3-32B recipes without; sequence packing
  with one packed sequence of the maximum length per micro-batch; the 1-step off-policy runs are disaggregated,
  half the GPUs generating and half training (their recipes' "16T16G"-style splits).
- NeMo-RL v0.6 performance summary (docs/about/performance-summary.md at r0.6.0, "H100 BF16"): the same dataset,
  system and precision; layouts from its r0.6.0 recipes, which differ from the table once: the 512-GPU DeepSeek-V3
  on-policy recipe (grpo-deepseek-v3-64n8g.yaml) sets EP 32 where the table says 16 (the recipe is taken). The
  recipes' layer splits (num_layers_in_first/last_pipeline_stage: DeepSeek-V3 3 and 2, Qwen3-235B-A22B 11 and 11)
  are taken for both releases (the v0.4 recipes set the same). The 8-step off row: 64 generating and 128 training
  GPUs (grpo-qwen3-30ba3b-24n8g-async-8off.yaml), max_trajectory_age_steps 8, taken as trainer.mode=async with
  max_staleness 8. Its note: DeepSeek-V3's checkpoint changed between releases (shorter responses).
- NeMo-RL's off-policy schedule (nemo_rl/algorithms/async_utils.py at r0.4.0 and r0.6.0, AsyncTrajectoryCollector):
  every off-policy row is its async GRPO, which starts one prompt group per thread under a semaphore of
  num_prompts_per_step x max_trajectory_age_steps groups, a new group as one ends, for any step up to that age ahead;
  the trainer waits for its own step's groups (ReplayBuffer.sample). So the engines run full and no batch drains at a
  step's end: generation is priced at the full batch's rate (step_time's `steps_in_flight`), with at most that many
  steps' samples running. Its recipes set in_flight_weight_updates, so the refit does not wait for the running
  generations; vLLM still stops decoding while it loads (collective_rpc runs between engine steps), so a step is
  the longer of generation and training plus the refit, as step_time's overlap has it.
- verl's checkpoint-engine benchmark (verl/checkpoint_engine/README.md): Qwen3-30B-A3B, 4 x 8 H100 with 400 Gb/s
  ConnectX-7, NCCL backend, an FSDP pair sending to 30 rollout GPUs each receiving the whole BF16 model (its
  receivers load nothing into an engine: the per-tensor work is the sender's gather of each): about 7 s. verl does
  not publish its bucket size: taken at this project's default (512 MB).
- NeMo-RL's DeepSeek-V3 refit benchmark (docs/guides/checkpoint-engine-refit.md, "DeepSeek-V3 Benchmark";
  docs/design-docs/checkpoint-engines.md): Megatron TP1/PP16/EP16 on 32 nodes into one vLLM TP32 engine on 4.
  NCCL, 14.21 s by its async refit timer: "non-colocated generation without checkpoint engines still uses the
  existing NCCL collective path" (checkpoint-engines.md), "the default full-weight collective" (docs/guides/refit.md),
  so every vLLM rank receives every tensor whole (1342 GB) and loads all 45,395. NIXL, 9.25 s: each vLLM rank receives from its own
  policy worker only its 1/32 of each expert and every dense tensor whole (69.95 GiB, the same 45,395 tensors, 18
  batches of 4096 MiB; experts copied straight into vLLM's storage).
- NeMo-RL's NCCL reshard (docs/design-docs/nccl-reshard-refit.md, "Expected Performance"): DeepSeek-V3 BF16, PP16 x
  EP16 -> TP32 x DP8 on H100, 2.39-2.83 s; each vLLM rank receives exactly its own shard from the trainer ranks
  that hold it, the FFN weights (97.6 % of the bytes) bypassing vLLM's loader. This is the figure ../shared/DESIGN.md
  quotes (as colocated; it is not).

The step rows' refit is NeMo-RL's transport (NEMO_RL_TRANSPORT), read at r0.4.0 and r0.6.0 in NVIDIA-NeMo/RL: every
vLLM rank receives every HF tensor whole (prepare_refit_info in nemo_rl/models/policy/workers/megatron_policy_worker.py,
v0.4: nemo_rl/models/policy/megatron_policy_worker.py, announces the full shapes, and vLLM's load_weights slices), as
this project's push does, from Megatron-Bridge's export_hf_weights, which broadcasts each weight's shard from its
pipeline stage before the TP/EP gathers (MegatronParamMapping.megatron_to_hf: "1. Pipeline parallel broadcasting
2. Tensor parallel gathering"), as this project's export now does; colocated over CUDA IPC from the trainer rank on
the GPU, two buffers in turn (stream_weights_via_ipc_zmq_impl, nemo_rl/models/policy/utils.py); disaggregated in one
NCCL group of every trainer and every vLLM rank (nemo_rl/algorithms/grpo.py, init_collective's world = train +
inference GPUs), so trainer rank 0's broadcast of a bucket reaches every engine at once and crosses each node by all
its links (every GPU of the sending and receiving nodes is in the group), two buffers in turn
(packed_broadcast_producer, nemo_rl/utils/packed_tensor.py, NRL_REFIT_NUM_BUFFERS=2), the receivers loading each
(vllm_backend.py, update_weights_from_collective). This project's push instead visits one server after another from
rank 0 alone, each bucket's answer awaited before the next is exported (planner/memory.WeightSync, Transport).
"""
from __future__ import annotations

import argparse
import dataclasses
from math import exp, inf, log
from pathlib import Path

from scipy.optimize import least_squares

from rlmegatron.prelaunch.spec_pipeline import load_spec
from rlmegatron.models.families import read_architecture
from rlmegatron.planner.parameters import checkpoint_tensors, count_parameters
from rlmegatron.planner.plan import PlanSettings, build_plan
from rlmegatron.config.spec import MegatronConfig
from rlmegatron.planner.memory import WEIGHT_BYTES, Transport
from rlmegatron.planner.step_time import (FITTED_BY_RELEASE, LATEST, RELEASES, Constants, Hardware, export_seconds,
                                          step_time, sync_seconds, workload_of)

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_MEAN, PROMPT_BUDGET = 128, 256
BUCKET_BYTES = 512 << 20
H100_GB = 85.0
NEMO_RL_PACK_MB = {"colocated": int(0.3 * (1 - 0.6) * H100_GB * 1e9 / 2) >> 20,
                   "disaggregated": int(0.02 * H100_GB * 1e9) >> 20}
"""The bucket NeMo-RL's refit moves at a time (which this module's step rows take as
rollout.update_weights_bucket_mb): colocated, half of a buffer of 0.3 of the GPU's free memory
(NRL_REFIT_BUFFER_MEMORY_RATIO in nemo_rl/algorithms/grpo.py, refit_policy_generation; halved for its two ping-pong
buffers in nemo_rl/models/policy/utils.py, stream_weights_via_ipc_zmq_impl), free taken as what vLLM's 0.6 leaves
(the trainer's weights on the GPU, a few GB, neglected); disaggregated, 0.02 of the GPU's memory
(nemo_rl/utils/packed_tensor.py, get_target_packed_tensor_size, at most 5 GiB; two such buffers)."""
"""An H100 SXM's "80 GB" is 80 GiB, of which CUDA reports 79.2 GiB (85.0e9 bytes): what vLLM's
gpu_memory_utilization and SGLang's mem_fraction_static take their share of (the planner's default, 80, is the
conservative reading)."""
NEMO_RL_TRANSPORT = Transport(links=8, pipelined=True)
"""NeMo-RL's refit (the module's docstring): disaggregated, one NCCL group of every trainer and vLLM rank, so a
bucket's broadcast crosses each node by all 8 of its links; two buffers on each side, so the export, the transfer and
the loads of successive buckets overlap. Its export (Megatron-Bridge's) moves shards between stages as ours does."""
SOFTWARE = ("train_dense", "train_moe", "decode_hbm", "decode_sample_s")
"""The constants of a software stack (the trainer's efficiency, the decode engine's and its server's host work): the
fit sets one of each per NeMo-RL release, on that release's fit rows alone."""
SHARED = ("allreduce_network_s", "link", "tensor_s", "mla_train", "mla_decode")
"""The constants the fit shares over every fit row: the network's all-reduce latency (hardware), the weight sync's
(its rows are verl's and NeMo-RL's refit benchmarks, neither a performance-page release), and an MLA model's shares
of its release's efficiencies (fitted on one release, tested on the other)."""
FREE = SOFTWARE + SHARED
"""The constants the fit sets; the others keep step_time.Constants' defaults."""


OTHER_TRANSPORT = "other transport"
"""The role of a refit by a transport neither this project nor the step rows use: shown, never fitted (not in
leave-one-out either)."""


@dataclasses.dataclass(frozen=True)
class Published:
    name: str
    model: str  # configs/models/<model>
    role: str  # fit, held out or OTHER_TRANSPORT
    gpus: int
    samples: int  # G-GBS: responses per step
    train_batch: int  # T-GBS
    max_sequence: int
    mean_sequence: int
    rollout_tp: int
    layout: tuple[int, int, int, int]  # training TP, CP, EP, PP
    step_s: float
    on_policy: bool = True
    recompute: bool = False  # the recipe's activation_checkpointing
    version: str = "v0.4"  # the NeMo-RL release whose performance summary publishes the run
    stages: tuple[int, int] | None = None  # the recipe's num_layers_in_first/last_pipeline_stage
    generation_gpus: int | None = None  # off policy: the recipe's generation GPUs (default: half)
    staleness: int = 1  # off policy: the recipe's max_trajectory_age_steps

    @property
    def generating(self) -> int:
        """The GPUs that generate: all of them on policy (colocated), else the recipe's split."""
        return self.gpus if self.on_policy else self.generation_gpus or self.gpus // 2

    @property
    def training(self) -> int:
        """The GPUs that train: all of them on policy, else those that do not generate."""
        return self.gpus if self.on_policy else self.gpus - self.generating


NEMO_RL = (
    Published("Llama-3.1-8B", "llama-3.1-8b", "fit", 16, 2048, 512, 4096, 1060, 1, (1, 1, 1, 2), 97.7,
              recompute=True),
    Published("DeepSeek-V3", "deepseek-v3", "fit", 256, 512, 512, 1536, 745, 32, (1, 1, 16, 16), 154,
              recompute=True, stages=(3, 2)),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "fit", 128, 512, 512, 8192, 5671, 16, (2, 2, 16, 8), 506,
              recompute=True, stages=(11, 11)),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "fit", 32, 2048, 512, 4096, 3154, 4, (2, 1, 8, 1), 225),
    Published("Qwen3-32B", "qwen3-32b", "held out", 32, 2048, 512, 4096, 3206, 4, (4, 1, 1, 4), 393),
    Published("Llama-3.1-8B", "llama-3.1-8b", "fit", 16, 2048, 512, 4096, 1129, 1, (1, 1, 1, 2), 74.6, False,
              recompute=True),
    Published("DeepSeek-V3", "deepseek-v3", "fit", 512, 512, 512, 1536, 744, 32, (1, 1, 16, 16), 77.9, False,
              recompute=True, stages=(3, 2)),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "fit", 256, 512, 512, 8192, 5691, 8, (4, 1, 16, 8), 241,
              False, recompute=True, stages=(11, 11)),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "fit", 32, 2048, 512, 4096, 3158, 2, (1, 1, 8, 2), 244, False),
    Published("Qwen3-32B", "qwen3-32b", "held out", 64, 2048, 512, 4096, 3207, 4, (4, 1, 1, 4), 215, False),
    # NeMo-RL v0.6's H100 BF16 GRPO rows, each with its r0.6.0 recipe's layout.
    Published("DeepSeek-V3", "deepseek-v3", "held out", 256, 512, 512, 1536, 701, 32, (1, 1, 16, 16), 134,
              recompute=True, version="v0.6", stages=(3, 2)),
    Published("DeepSeek-V3", "deepseek-v3", "held out", 512, 512, 512, 1536, 697, 32, (1, 1, 32, 16), 111,
              recompute=True, version="v0.6", stages=(3, 2)),
    Published("DeepSeek-V3", "deepseek-v3", "held out", 512, 512, 512, 1536, 710, 32, (1, 1, 16, 16), 64.1, False,
              recompute=True, version="v0.6", stages=(3, 2)),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "fit", 128, 512, 512, 8192, 5698, 16, (2, 2, 16, 8), 395,
              recompute=True, version="v0.6", stages=(11, 11)),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "held out", 256, 512, 512, 8192, 5713, 16, (2, 2, 16, 8), 312,
              recompute=True, version="v0.6", stages=(11, 11)),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "fit", 256, 512, 512, 8192, 5721, 8, (4, 1, 16, 8), 231,
              False, recompute=True, version="v0.6", stages=(11, 11)),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "fit", 32, 2048, 512, 4096, 3203, 2, (1, 1, 8, 1), 192,
              version="v0.6"),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "fit", 32, 2048, 512, 4096, 3201, 2, (1, 1, 8, 2), 152, False,
              version="v0.6"),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "held out", 192, 2048, 512, 4096, 3206, 2, (1, 1, 8, 1), 34.5,
              False, version="v0.6", generation_gpus=64, staleness=8),
)


def overrides(run: Published) -> list[str]:
    tp, cp, ep, pp = run.layout
    arch = read_architecture(REPO_ROOT / "configs" / "models" / run.model)
    nodes = run.gpus // 8
    generation, trainer_gpus = run.generating, run.training
    mode = "one_step_off" if run.staleness == 1 else f"async trainer.max_staleness={run.staleness}"
    placement = ([f"placement.nnodes={nodes}", "placement.gpus_per_node=8", "rollout.mem_fraction_static=0.6",
                  f"rollout.update_weights_bucket_mb={NEMO_RL_PACK_MB['colocated']}"]
                 if run.on_policy else
                 [f"placement.nnodes={trainer_gpus // 8 or 1}", f"placement.gpus_per_node={min(trainer_gpus, 8)}",
                  "placement.mode=disaggregate", *f"trainer.mode={mode}".split(),
                  f"placement.rollout_nnodes={generation // 8 or 1}",
                  f"placement.rollout_gpus_per_node={min(generation, 8)}", "rollout.mem_fraction_static=0.8",
                  f"rollout.update_weights_bucket_mb={NEMO_RL_PACK_MB['disaggregated']}"])
    if run.stages is not None:  # the recipe's split
        uneven = [f"actor.megatron.extra.num_layers_in_first_pipeline_stage={run.stages[0]}",
                  f"actor.megatron.extra.num_layers_in_last_pipeline_stage={run.stages[1]}"]
    elif arch.num_hidden_layers % pp:  # layers that do not split evenly: the first stage takes fewer
        uneven = [f"actor.megatron.extra.num_layers_in_first_pipeline_stage="
                  f"{arch.num_hidden_layers - (pp - 1) * -(-arch.num_hidden_layers // pp)}"]
    else:
        uneven = ["~actor.megatron.extra.num_layers_in_first_pipeline_stage"]
    return [f"model.path=hub/{run.model}", f"model.hf_config=configs/models/{run.model}",
            f"data.max_prompt_length={PROMPT_BUDGET}", f"data.max_response_length={run.max_sequence - PROMPT_BUDGET}",
            f"data.train_batch_size={run.samples // 8}", "rollout.n=8",
            f"actor.ppo_mini_batch_size={run.train_batch // 8}",
            f"actor.megatron.tensor_model_parallel_size={tp}", f"actor.megatron.context_parallel_size={cp}",
            f"actor.megatron.expert_model_parallel_size={ep}", f"actor.megatron.pipeline_model_parallel_size={pp}",
            f"actor.megatron.sequence_parallel={str(tp > 1).lower()}", "actor.megatron.expert_tensor_parallel_size=1",
            f"actor.megatron.recompute_granularity={'full' if run.recompute else 'none'}",
            "actor.use_kl_loss=true", f"rollout.tensor_parallel_size={run.rollout_tp}",
            f"rollout.expert_parallel_size={run.rollout_tp if arch.is_moe else 1}",
            "actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={run.max_sequence}",
            *placement, *uneven]


@dataclasses.dataclass(frozen=True)
class Case:
    """A published figure and how the model predicts it under given constants."""

    name: str
    role: str
    published: float
    shown: str
    predict: object  # Constants -> {"phases": ..., "total": ...}
    release: str | None = None  # the NeMo-RL release whose software ran it; None: a sync benchmark
    uses: frozenset = frozenset(FREE)  # the FREE constants its prediction depends on
    model: str | None = None  # a step row's configs/models name; None: a sync benchmark


Fitted = dict  # release -> Constants


def run_name(run: Published) -> str:
    policy = "on" if run.on_policy else f"{run.staleness}-step off"
    return f"{run.name} {policy} {run.gpus} ({run.version})"


def _step_case(run: Published) -> Case:
    spec = load_spec(REPO_ROOT / "configs" / "deepseek_v3_671b_grpo.yaml", overrides(run))
    if not spec.needs_old_log_prob_pass:  # NeMo-RL computes them anyway: force the pass the way a user would
        spec = spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"on_policy_check": 1.0})})
    arch = read_architecture(REPO_ROOT / "configs" / "models" / run.model)
    settings = PlanSettings(gpu_mem_gb=H100_GB, prompt_tokens=PROMPT_MEAN,
                            response_tokens=run.mean_sequence - PROMPT_MEAN)
    plan = build_plan(spec, arch, settings)
    params = count_parameters(arch)
    work = workload_of(spec, settings.prompt_tokens, settings.response_tokens)
    hw = settings.hardware(spec.placement.gpus_per_node)
    # NeMo-RL's refit, not this project's: whole tensors into every vLLM rank as ours, but disaggregated in one
    # broadcast that reaches every engine at once (the module's docstring), so no server waits for another.
    sync = dataclasses.replace(plan.sync, servers_per_link=1, transport=NEMO_RL_TRANSPORT)

    def predict(c: Constants) -> dict:
        # Off policy, NeMo-RL's async GRPO keeps max_trajectory_age_steps steps' prompts in flight (the module's
        # docstring): no batch drains at a step's end.
        estimate = step_time(spec, arch, params, plan.actor, plan.engine, sync, work, hw, c,
                             steps_in_flight=None if run.on_policy else run.staleness)
        return {"phases": estimate.phases, "total": estimate.total}

    uses = frozenset(FREE) - {"train_dense" if arch.is_moe else "train_moe"} \
        - (set() if arch.mla is not None else {"mla_train", "mla_decode"})
    return Case(run_name(run), run.role, run.step_s, f"{run.step_s:g}", predict, run.version, uses, run.model)


def predict(run: Published, by_release: Fitted = FITTED_BY_RELEASE) -> dict:
    return _step_case(run).predict(by_release[run.version])


def _sync_cases() -> list[Case]:
    hw = Hardware()

    def sync(bytes_per_receiver: float, bucket_bytes: float, tensors: int, export_s=lambda c: 0.0,
             transport: Transport = Transport()):
        def predict(c: Constants) -> dict:
            seconds = sync_seconds(bytes_per_receiver, False, hw, bucket_bytes, c, tensors, export_s=export_s(c),
                                   transport=transport)
            return {"phases": {"weight_sync": seconds}, "total": seconds}
        return predict

    uses = frozenset(SHARED) - {"allreduce_network_s", "mla_train", "mla_decode"}
    deepseek = read_architecture(REPO_ROOT / "configs" / "models" / "deepseek-v3")
    params = count_parameters(deepseek)
    whole = params.total * WEIGHT_BYTES["bf16"]
    # verl: the whole BF16 model from an FSDP pair into each of 30 GPUs over the network, 18,867 tensors gathered and
    # sent one by one (its receivers load nothing: the per-tensor work is the sender's).
    verl = sync(30.53e9 * 2, BUCKET_BYTES, checkpoint_tensors(read_architecture(
        REPO_ROOT / "configs" / "models" / "qwen3-30b-a3b")))
    # NeMo-RL's NCCL refit in its checkpoint-engine benchmark: the default full-weight collective, every tensor whole
    # into each rank of one vLLM TP32 engine, 45,395 tensors loaded, from TP1/PP16/EP16 trainer ranks on 32 nodes.
    trainer = MegatronConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=16,
                             expert_model_parallel_size=16, expert_tensor_parallel_size=1)

    def export(c: Constants) -> float:
        return export_seconds(whole, params.routed_experts / params.total, trainer, 256, hw, c)

    nccl = sync(whole, NEMO_RL_PACK_MB["disaggregated"] << 20, checkpoint_tensors(deepseek), export,
                NEMO_RL_TRANSPORT)
    # Its NIXL refit: each vLLM rank receives from its own policy worker (one link) its 1/32 of every expert and every
    # dense tensor whole, 69.95 GiB and the same 45,395 tensors, in 4096 MiB batches, two buffers in turn.
    nixl = sync(69.95 * 2**30, 4096 << 20, checkpoint_tensors(deepseek), export,
                dataclasses.replace(NEMO_RL_TRANSPORT, links=1))
    # NeMo-RL's NCCL reshard (refit_transport=nccl_reshard): each vLLM rank receives its own TP32 shard only, shard
    # to shard from the trainer ranks that hold it; the FFN weights (97.6 % of the bytes) bypass vLLM's loader, the
    # other tensors (each layer's attention and norms) go through it.
    shard_tensors = checkpoint_tensors(deepseek) - 3 * deepseek.num_experts * sum(deepseek.moe_layers)
    reshard = sync(whole / 32, whole / 32, shard_tensors)
    return [Case("verl checkpoint engine, Qwen3-30B-A3B, NCCL, 30 receivers", "fit", 7.0, "~7", verl, uses=uses),
            Case("NeMo-RL NCCL refit, DeepSeek-V3, TP1/PP16/EP16 -> TP32, full weights", "fit", 14.21, "14.21",
                 nccl, uses=uses),
            Case("NeMo-RL NIXL refit, DeepSeek-V3, TP1/PP16/EP16 -> TP32, expert shards", OTHER_TRANSPORT, 9.25,
                 "9.25", nixl, uses=uses),
            Case("NeMo-RL NCCL reshard, DeepSeek-V3, PP16 x EP16 -> TP32 x DP8, shards", OTHER_TRANSPORT, 2.6,
                 "2.39-2.83", reshard, uses=uses)]


@dataclasses.dataclass(frozen=True)
class TwinPhases:
    """What an on-policy run and its off-policy twin (the same trainer and the same engines) leave to generation and
    training together, given the model's other phases; a step's total alone cannot split them, two can bound them."""

    name: str
    low: float  # each of generation (in flight, as off policy) and training takes at least this
    high: float  # and at most this
    generation: float  # the model's
    training: float


def twins(runs=NEMO_RL) -> list[tuple[Published, Published]]:
    """The (on policy, off policy) pairs of one model and release whose off-policy run trains on its own GPUs with the
    on-policy run's layout on as many GPUs, and generates with as many engines of the same TP."""
    def trainer(run):
        return run.training, run.layout

    def engines(run):
        return run.generating // run.rollout_tp, run.rollout_tp

    return [(on, off) for on in runs if on.on_policy for off in runs
            if not off.on_policy and off.staleness == 1 and (on.model, on.version) == (off.model, off.version)
            and trainer(on) == trainer(off) and engines(on) == engines(off)]


def twin_phases(on: Published, off: Published, by_release: Fitted = FITTED_BY_RELEASE) -> TwinPhases:
    """Off policy a step is max(G, T) + its refit, so each of G and T is at most the off run's total less the
    model's refit; on policy it is G + drain + T + refit + offload, so G + T is the on run's total less the model's
    drain (the tail an on-policy batch adds over the in-flight schedule), refit and offload, and each is at least that
    sum less the other's most. G and T are the off run's (the twins' lengths differ by a few tokens)."""
    c = by_release[on.version]
    step_on, step_off = _step_case(on), _step_case(off)
    phases_on, phases_off = step_on.predict(c)["phases"], step_off.predict(c)["phases"]
    most = off.step_s - phases_off["weight_sync"]
    drain = phases_on["generation"] - phases_off["generation"]
    both = on.step_s - drain - phases_on["weight_sync"] - phases_on.get("offload", 0.0)
    training = sum(v for k, v in phases_off.items() if k not in ("generation", "weight_sync"))
    return TwinPhases(f"{on.name} ({on.version}), on {on.gpus} / {off.staleness}-step off {off.gpus}",
                      both - most, most, phases_off["generation"], training)


def constants_of(case: Case, by_release: Fitted) -> Constants:
    """The constants a case is predicted with: its release's; a sync row depends on the shared ones only."""
    return by_release[case.release] if case.release is not None else by_release[LATEST]


def sync_checks(by_release: Fitted = FITTED_BY_RELEASE) -> list[dict]:
    return [{"name": case.name, "role": case.role, "published": case.published, "shown": case.shown,
             "predicted": case.predict(constants_of(case, by_release))["total"]} for case in _sync_cases()]


def cases() -> list[Case]:
    return [_step_case(run) for run in NEMO_RL] + _sync_cases()


BOUNDS = {"train_dense": (0.02, 0.7), "train_moe": (0.005, 0.7), "decode_hbm": (0.1, 0.85),
          "decode_sample_s": (1e-7, 2e-4), "allreduce_network_s": (5e-6, 2e-3), "link": (0.02, 0.95),
          "tensor_s": (1e-6, 5e-3), "mla_train": (0.05, 2.0), "mla_decode": (0.05, 2.0)}


def fit(fitted_on: list[Case], start: Fitted = FITTED_BY_RELEASE) -> Fitted:
    """The FREE constants that minimise the squared log-errors over `fitted_on` (each in log space, bounded to
    physical ranges), the others kept: SHARED once, SOFTWARE once per release (in RELEASES' order), each on that
    release's rows. A release none of whose fit rows depends on a SOFTWARE constant (v0.6 has no dense row) takes the
    release before it's."""
    free = [(None, name) for name in SHARED if any(name in case.uses for case in fitted_on)] + [
        (release, name) for release in RELEASES for name in SOFTWARE
        if any(case.release == release and name in case.uses for case in fitted_on)]

    def constants(x) -> Fitted:
        values = dict(zip(free, x))
        out = {}
        for index, release in enumerate(RELEASES):
            before = out[RELEASES[index - 1]] if index else start[release]
            fitted = {}
            for name in FREE:  # one not fitted keeps its start (a SOFTWARE one: the release before's)
                key, kept = ((None, name), start[release]) if name in SHARED else ((release, name), before)
                fitted[name] = exp(values[key]) if key in values else getattr(kept, name)
            out[release] = dataclasses.replace(start[release], **fitted)
        return out

    def residuals(x):
        by_release = constants(x)
        return [log(case.predict(constants_of(case, by_release))["total"] / case.published) for case in fitted_on]

    x = [log(min(max(getattr(start[release or LATEST], name), BOUNDS[name][0] * 1.01), BOUNDS[name][1] * 0.99))
         for release, name in free]
    # A 1-step-off row whose generation and training are about equal puts a kink (their max) in the residuals, where
    # one solve stops short: solve again from where the last stopped until the cost no longer falls.
    cost = inf
    for _ in range(30):
        result = least_squares(residuals, x, bounds=([log(BOUNDS[n][0]) for _, n in free],
                                                     [log(BOUNDS[n][1]) for _, n in free]), xtol=1e-10, ftol=1e-10)
        x = result.x
        if result.cost > cost * (1 - 1e-4):
            break
        cost = result.cost
    return constants(x)


def leave_one_out(all_cases: list[Case], never_fit: frozenset = frozenset()) -> list[tuple[Case, float, Fitted]]:
    """For each case: its prediction by the constants fitted on every other case (OTHER_TRANSPORT ones and the step
    rows of the models in `never_fit` never fit)."""
    out = []
    modelled = [case for case in all_cases if case.role != OTHER_TRANSPORT and case.model not in never_fit]
    without_none = None  # what every case outside `modelled` is predicted by: one fit serves them all
    for case in all_cases:
        if any(case is other for other in modelled):
            by_release = fit([other for other in modelled if other is not case])
        else:
            without_none = without_none or fit(modelled)
            by_release = without_none
        out.append((case, case.predict(constants_of(case, by_release))["total"], by_release))
    return out


def _constants_line(by_release: Fitted, release: str | None = None) -> str:
    """The shared constants, then each release's software ones (or one release's)."""
    shared = ", ".join(f"{name} {getattr(by_release[LATEST], name):.3g}" for name in SHARED)
    return "; ".join([shared] + [f"{r}: " + ", ".join(f"{name} {getattr(by_release[r], name):.3g}" for name in SOFTWARE)
                                 for r in RELEASES if release in (None, r)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--fit", action="store_true", help="refit on the fit runs, then leave each run out in turn")
    parser.add_argument("--never-fit", action="append", default=[], metavar="MODEL",
                        help="a configs/models name whose runs leave-one-out never fits (repeatable)")
    args = parser.parse_args()
    all_cases = cases()
    by_release = fit([case for case in all_cases if case.role == "fit"]) if args.fit else FITTED_BY_RELEASE
    print(("refitted on the fit runs: " if args.fit else "step_time.FITTED_BY_RELEASE: ") + _constants_line(by_release))
    if args.markdown:
        print("| run (NeMo-RL on H100: policy, GPUs, release; the sync rows as named) | role | published s | predicted s | "
              "error | phases s |")
        print("|---|---|---:|---:|---:|---|")
    for case in all_cases:
        predicted = case.predict(constants_of(case, by_release))
        error = predicted["total"] / case.published - 1
        phases = ", ".join(f"{k} {v:.1f}" for k, v in predicted["phases"].items())
        if args.markdown:
            print(f"| {case.name} | {case.role} | {case.shown} | {predicted['total']:.1f} | {error:+.0%} | {phases} |")
        else:
            print(f"{case.name:32} {case.role:9} published {case.shown:>7}  predicted {predicted['total']:6.1f}  "
                  f"{error:+5.0%}   {phases}")
    print("twins: what each on/off pair's totals leave to generation (in flight) and training, each, given the "
          "model's drain, refit and offload")
    for twin in (twin_phases(on, off, by_release) for on, off in twins()):
        split = (f"each {twin.low:.1f}-{twin.high:.1f} s" if twin.low <= twin.high else
                 f"no split unless the model's drain, refit and offload were {twin.low - twin.high:.1f} s longer; "
                 f"each ~{twin.high:.1f} s")
        print(f"  {twin.name}: {split}; the model's generation {twin.generation:.1f}, training {twin.training:.1f}")
    if args.fit:
        print("leave-one-out: each run predicted by the constants fitted on all the others"
              + (f" (never fitting {', '.join(args.never_fit)})" if args.never_fit else ""))
        if args.markdown:
            print("| run left out | published s | predicted s | error | constants fitted without it |")
            print("|---|---:|---:|---:|---|")
        for case, predicted, loo in leave_one_out(all_cases, frozenset(args.never_fit)):
            error = predicted / case.published - 1
            line = _constants_line(loo, case.release)
            if args.markdown:
                print(f"| {case.name} | {case.shown} | {predicted:.1f} | {error:+.0%} | {line} |")
            else:
                print(f"{case.name:32} published {case.shown:>7}  predicted {predicted:6.1f}  {error:+5.0%}   ({line})")


if __name__ == "__main__":
    main()
