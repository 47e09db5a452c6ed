"""The step-time model (rlmegatron/planner/step_time.py) against published runs, each with its publisher's layout:
predicted seconds per step and per phase beside the published figure, and the error; the constants' fit; and a
leave-one-out test over every run.

    python -m benchmarks.step_time_calibration [--markdown] [--fit]

Runs marked "fit" set the constants step_time.Constants leaves free (FREE: the training efficiencies, the decode
bandwidth efficiency and per-sample host work, the cross-node all-reduce latency, the weight sync's link
efficiency); `--fit` refits them on those runs alone (what step_time.FITTED holds, rounded) and then, for each run
of all of them, on every other run, predicting the one left out.

Which runs fit: a step's published total alone cannot say how much of it is generation and how much training, so an
on-policy run (generation + training) is fitted with its 1-step off-policy twin (the longer of the two): Llama-3.1-8B
(dense) and Qwen3-30B-A3B (MoE), both ways; DeepSeek-V3 off policy for the all-reduce latency of an engine across
nodes; verl's sync for the link. Held out: Qwen3-32B and Qwen3-235B-A22B both ways (models the fit never sees),
DeepSeek-V3 on policy, and NeMo-RL's refit. Every v0.6 row is held out too: they came after the constants were fitted,
so they test the model as it was (the strongest test there is for the models it fitted, and for Qwen3-235B-A22B,
which it never saw); fitting them would also mix two releases whose software differs on identical layouts (Qwen3-30B-A3B
1-step off: 244 s in v0.4, 152 s in v0.6), which no constant of the model can stand for.

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
- verl's checkpoint-engine benchmark (verl/checkpoint_engine/README.md): Qwen3-30B-A3B, 4 x 8 H100 with 400 Gb/s
  ConnectX-7, NCCL backend, 30 rollout GPUs each receiving the whole BF16 model: about 7 s.
- NeMo-RL's DeepSeek-V3 refit over NCCL with sharded experts, PP16 x EP16 -> TP32: 2.4-2.8 s (../shared/DESIGN.md).
Neither sync source publishes its bucket size: both are taken at this project's default (512 MB).
"""
from __future__ import annotations

import argparse
import dataclasses
from math import exp, log
from pathlib import Path

from scipy.optimize import least_squares

from rlmegatron.prelaunch.spec_pipeline import load_spec
from rlmegatron.models.families import read_architecture
from rlmegatron.planner.parameters import count_parameters
from rlmegatron.planner.plan import PlanSettings, build_plan
from rlmegatron.planner.step_time import FITTED, Constants, Hardware, step_time, sync_seconds, workload_of

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_MEAN, PROMPT_BUDGET = 128, 256
BUCKET_BYTES = 512 << 20
H100_GB = 85.0
"""An H100 SXM's "80 GB" is 80 GiB, of which CUDA reports 79.2 GiB (85.0e9 bytes): what vLLM's
gpu_memory_utilization and SGLang's mem_fraction_static take their share of (the planner's default, 80, is the
conservative reading)."""
FREE = ("train_dense", "train_moe", "decode_hbm", "decode_sample_s", "allreduce_network_s", "link")
"""The constants the fit sets; the others keep step_time.Constants' defaults."""


@dataclasses.dataclass(frozen=True)
class Published:
    name: str
    model: str  # configs/models/<model>
    role: str  # fit or held out
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


NEMO_RL = (
    Published("Llama-3.1-8B", "llama-3.1-8b", "fit", 16, 2048, 512, 4096, 1060, 1, (1, 1, 1, 2), 97.7,
              recompute=True),
    Published("DeepSeek-V3", "deepseek-v3", "held out", 256, 512, 512, 1536, 745, 32, (1, 1, 16, 16), 154,
              recompute=True, stages=(3, 2)),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "held out", 128, 512, 512, 8192, 5671, 16, (2, 2, 16, 8), 506,
              recompute=True, stages=(11, 11)),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "fit", 32, 2048, 512, 4096, 3154, 4, (2, 1, 8, 1), 225),
    Published("Qwen3-32B", "qwen3-32b", "held out", 32, 2048, 512, 4096, 3206, 4, (4, 1, 1, 4), 393),
    Published("Llama-3.1-8B", "llama-3.1-8b", "fit", 16, 2048, 512, 4096, 1129, 1, (1, 1, 1, 2), 74.6, False,
              recompute=True),
    Published("DeepSeek-V3", "deepseek-v3", "fit", 512, 512, 512, 1536, 744, 32, (1, 1, 16, 16), 77.9, False,
              recompute=True, stages=(3, 2)),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "held out", 256, 512, 512, 8192, 5691, 8, (4, 1, 16, 8), 241,
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
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "held out", 128, 512, 512, 8192, 5698, 16, (2, 2, 16, 8), 395,
              recompute=True, version="v0.6", stages=(11, 11)),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "held out", 256, 512, 512, 8192, 5713, 16, (2, 2, 16, 8), 312,
              recompute=True, version="v0.6", stages=(11, 11)),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "held out", 256, 512, 512, 8192, 5721, 8, (4, 1, 16, 8), 231,
              False, recompute=True, version="v0.6", stages=(11, 11)),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "held out", 32, 2048, 512, 4096, 3203, 2, (1, 1, 8, 1), 192,
              version="v0.6"),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "held out", 32, 2048, 512, 4096, 3201, 2, (1, 1, 8, 2), 152, False,
              version="v0.6"),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "held out", 192, 2048, 512, 4096, 3206, 2, (1, 1, 8, 1), 34.5,
              False, version="v0.6", generation_gpus=64, staleness=8),
)


def overrides(run: Published) -> list[str]:
    tp, cp, ep, pp = run.layout
    arch = read_architecture(REPO_ROOT / "configs" / "models" / run.model)
    nodes = run.gpus // 8
    generation = run.generation_gpus or run.gpus // 2
    trainer_gpus = run.gpus - generation
    mode = "one_step_off" if run.staleness == 1 else f"async trainer.max_staleness={run.staleness}"
    placement = ([f"placement.nnodes={nodes}", "placement.gpus_per_node=8", "rollout.mem_fraction_static=0.6"]
                 if run.on_policy else
                 [f"placement.nnodes={trainer_gpus // 8 or 1}", f"placement.gpus_per_node={min(trainer_gpus, 8)}",
                  "placement.mode=disaggregate", *f"trainer.mode={mode}".split(),
                  f"placement.rollout_nnodes={generation // 8 or 1}",
                  f"placement.rollout_gpus_per_node={min(generation, 8)}", "rollout.mem_fraction_static=0.8"])
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

    def predict(c: Constants) -> dict:
        estimate = step_time(spec, arch, params, plan.actor, plan.engine, plan.sync.bytes_per_engine_gpu, work, hw, c)
        return {"phases": estimate.phases, "total": estimate.total}

    return Case(run_name(run), run.role, run.step_s, f"{run.step_s:g}", predict)


def predict(run: Published, c: Constants = FITTED) -> dict:
    return _step_case(run).predict(c)


def _sync_cases() -> list[Case]:
    hw = Hardware()

    def verl(c: Constants) -> dict:  # the whole BF16 model into each of 30 rollout GPUs over the network
        seconds = sync_seconds(30.53e9 * 2, colocated=False, trainer_shards=2, hw=hw, bucket_bytes=BUCKET_BYTES, c=c)
        return {"phases": {"weight_sync": seconds}, "total": seconds}

    def nemo(c: Constants) -> dict:  # DeepSeek-V3 from PP16 x EP16 on 256 GPUs into TP32 engines: 1/32 each
        seconds = sync_seconds(671.03e9 * 2 / 32, colocated=True, trainer_shards=256, hw=hw,
                               bucket_bytes=BUCKET_BYTES, c=c)
        return {"phases": {"weight_sync": seconds}, "total": seconds}

    return [Case("verl checkpoint engine, Qwen3-30B-A3B, NCCL, 30 receivers", "fit", 7.0, "~7", verl),
            Case("NeMo-RL refit, DeepSeek-V3, PP16 x EP16 -> TP32, colocated", "held out", 2.6, "2.4-2.8", nemo)]


def sync_checks(c: Constants = FITTED) -> list[dict]:
    return [{"name": case.name, "role": case.role, "published": case.published, "shown": case.shown,
             "predicted": case.predict(c)["total"]} for case in _sync_cases()]


def cases() -> list[Case]:
    return [_step_case(run) for run in NEMO_RL] + _sync_cases()


def fit(fitted_on: list[Case], start: Constants = FITTED) -> Constants:
    """The FREE constants that minimise the squared log-errors over `fitted_on` (each in log space, bounded to
    physical ranges), the others kept."""
    bounds = {"train_dense": (0.02, 0.7), "train_moe": (0.005, 0.7), "decode_hbm": (0.1, 0.85),
              "decode_sample_s": (1e-7, 2e-4), "allreduce_network_s": (5e-6, 2e-3), "link": (0.02, 0.95)}

    def constants(x) -> Constants:
        return dataclasses.replace(start, **{name: exp(value) for name, value in zip(FREE, x)})

    def residuals(x):
        c = constants(x)
        return [log(case.predict(c)["total"] / case.published) for case in fitted_on]

    x0 = [log(min(max(getattr(start, name), bounds[name][0] * 1.01), bounds[name][1] * 0.99)) for name in FREE]
    result = least_squares(residuals, x0, bounds=([log(bounds[n][0]) for n in FREE], [log(bounds[n][1]) for n in FREE]))
    return constants(result.x)


def leave_one_out(all_cases: list[Case]) -> list[tuple[Case, float, Constants]]:
    """For each case: its prediction by the constants fitted on every other case."""
    out = []
    for index, case in enumerate(all_cases):
        c = fit(all_cases[:index] + all_cases[index + 1:])
        out.append((case, case.predict(c)["total"], c))
    return out


def _constants_line(c: Constants) -> str:
    return ", ".join(f"{name} {getattr(c, name):.3g}" for name in FREE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--fit", action="store_true", help="refit on the fit runs, then leave each run out in turn")
    args = parser.parse_args()
    all_cases = cases()
    c = fit([case for case in all_cases if case.role == "fit"]) if args.fit else FITTED
    print(("refitted on the fit runs: " if args.fit else "step_time.FITTED: ") + _constants_line(c))
    if args.markdown:
        print("| run (NeMo-RL on H100: policy, GPUs, release; the sync rows as named) | role | published s | predicted s | "
              "error | phases s |")
        print("|---|---|---:|---:|---:|---|")
    for case in all_cases:
        predicted = case.predict(c)
        error = predicted["total"] / case.published - 1
        phases = ", ".join(f"{k} {v:.1f}" for k, v in predicted["phases"].items())
        if args.markdown:
            print(f"| {case.name} | {case.role} | {case.shown} | {predicted['total']:.1f} | {error:+.0%} | {phases} |")
        else:
            print(f"{case.name:32} {case.role:9} published {case.shown:>7}  predicted {predicted['total']:6.1f}  "
                  f"{error:+5.0%}   {phases}")
    if args.fit:
        print("leave-one-out: each run predicted by the constants fitted on all the others")
        if args.markdown:
            print("| run left out | published s | predicted s | error | constants fitted without it |")
            print("|---|---:|---:|---:|---|")
        for case, predicted, loo in leave_one_out(all_cases):
            error = predicted / case.published - 1
            if args.markdown:
                print(f"| {case.name} | {case.shown} | {predicted:.1f} | {error:+.0%} | {_constants_line(loo)} |")
            else:
                print(f"{case.name:32} published {case.shown:>7}  predicted {predicted:6.1f}  {error:+5.0%}   "
                      f"({_constants_line(loo)})")


if __name__ == "__main__":
    main()
