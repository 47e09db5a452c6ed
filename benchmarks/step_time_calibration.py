"""The step-time model (rlmegatron/planner/step_time.py) against published runs, each with its publisher's layout:
predicted seconds per step and per phase beside the published figure, and the error.

    python -m benchmarks.step_time_calibration [--markdown]

Runs marked "fit" set the model's efficiency constants (the dense ones on the two dense on-policy runs, the MoE ones
and the cross-node latency on DeepSeek-V3's and Qwen3-30B-A3B's, the broadcast efficiency on verl's sync); the others
are held out of the fit and test it.

Sources:
- NeMo-RL v0.4 performance summary (docs/about/performance-summary.md in NVIDIA-NeMo/RL, r0.4.0): GRPO on
  OpenMathInstruct-2, DGX-H100, BF16 training and generation, Megatron-Core, colocated when on policy. Its "average
  sequence length" is taken as prompt + response, with prompts of 128 tokens on average (the dataset's math problems
  in a chat template) and a 256-token prompt budget inside the published maximum sequence length; NeMo-RL computes
  the old log-probs in a pass of their own every step, and GRPO there has a reference KL term. 1-step off-policy
  rows are disaggregated; the split of their GPUs is not published: half generate, half train.
- verl's checkpoint-engine benchmark (verl/checkpoint_engine/README.md): Qwen3-30B-A3B, 4 x 8 H100 with 400 Gb/s
  ConnectX-7, NCCL backend, 30 rollout GPUs each receiving the whole BF16 model: about 7 s.
- NeMo-RL's DeepSeek-V3 refit over NCCL with sharded experts, PP16 x EP16 -> TP32: 2.4-2.8 s (../shared/DESIGN.md).
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from rlmegatron.prelaunch.spec_pipeline import load_spec
from rlmegatron.models.families import read_architecture
from rlmegatron.planner.plan import PlanSettings, build_plan
from rlmegatron.planner.step_time import Hardware, sync_seconds

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT_MEAN, PROMPT_BUDGET = 128, 256


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


NEMO_RL = (
    Published("Llama-3.1-8B", "llama-3.1-8b", "fit", 16, 2048, 512, 4096, 1060, 1, (1, 1, 1, 2), 97.7),
    Published("DeepSeek-V3", "deepseek-v3", "fit", 256, 512, 512, 1536, 745, 32, (1, 1, 16, 16), 154),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "held out", 128, 512, 512, 8192, 5671, 16, (2, 2, 16, 8), 506),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "fit", 32, 2048, 512, 4096, 3154, 4, (2, 1, 8, 1), 225),
    Published("Qwen3-32B", "qwen3-32b", "fit", 32, 2048, 512, 4096, 3206, 4, (4, 1, 1, 4), 393),
    Published("Llama-3.1-8B", "llama-3.1-8b", "held out", 16, 2048, 512, 4096, 1129, 1, (1, 1, 1, 2), 74.6, False),
    Published("DeepSeek-V3", "deepseek-v3", "held out", 512, 512, 512, 1536, 744, 32, (1, 1, 16, 16), 77.9, False),
    Published("Qwen3-235B-A22B", "qwen3-235b-a22b", "held out", 256, 512, 512, 8192, 5691, 8, (4, 1, 16, 8), 241,
              False),
    Published("Qwen3-30B-A3B", "qwen3-30b-a3b", "held out", 32, 2048, 512, 4096, 3158, 2, (1, 1, 8, 2), 244, False),
    Published("Qwen3-32B", "qwen3-32b", "held out", 64, 2048, 512, 4096, 3207, 4, (4, 1, 1, 4), 215, False),
)


def overrides(run: Published) -> list[str]:
    tp, cp, ep, pp = run.layout
    arch = read_architecture(REPO_ROOT / "configs" / "models" / run.model)
    nodes = run.gpus // 8
    placement = ([f"placement.nnodes={nodes}", "placement.gpus_per_node=8"] if run.on_policy else
                 [f"placement.nnodes={nodes // 2 or 1}", f"placement.gpus_per_node={8 if nodes > 1 else 4}",
                  "placement.mode=disaggregate", "trainer.mode=one_step_off",
                  f"placement.rollout_nnodes={nodes // 2 or 1}",
                  f"placement.rollout_gpus_per_node={8 if nodes > 1 else 4}"])
    # Layers that do not split evenly: the first stage takes fewer (it also holds the embedding).
    first_stage = arch.num_hidden_layers - (pp - 1) * -(-arch.num_hidden_layers // pp)
    uneven = [f"actor.megatron.extra.num_layers_in_first_pipeline_stage={first_stage}"] \
        if arch.num_hidden_layers % pp else ["~actor.megatron.extra.num_layers_in_first_pipeline_stage"]
    return [f"model.path=hub/{run.model}", f"model.hf_config=configs/models/{run.model}",
            f"data.max_prompt_length={PROMPT_BUDGET}", f"data.max_response_length={run.max_sequence - PROMPT_BUDGET}",
            f"data.train_batch_size={run.samples // 8}", "rollout.n=8",
            f"actor.ppo_mini_batch_size={run.train_batch // 8}",
            f"actor.megatron.tensor_model_parallel_size={tp}", f"actor.megatron.context_parallel_size={cp}",
            f"actor.megatron.expert_model_parallel_size={ep}", f"actor.megatron.pipeline_model_parallel_size={pp}",
            f"actor.megatron.sequence_parallel={str(tp > 1).lower()}", "actor.megatron.expert_tensor_parallel_size=1",
            "actor.use_kl_loss=true", f"rollout.tensor_parallel_size={run.rollout_tp}",
            f"rollout.expert_parallel_size={run.rollout_tp if arch.is_moe else 1}",
            "actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={run.max_sequence * 2}",
            *placement, *uneven]


def predict(run: Published) -> dict:
    spec = load_spec(REPO_ROOT / "configs" / "deepseek_v3_671b_grpo.yaml", overrides(run))
    if not spec.needs_old_log_prob_pass:  # NeMo-RL computes them anyway: force the pass the way a user would
        spec = spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"on_policy_check": 1.0})})
    arch = read_architecture(REPO_ROOT / "configs" / "models" / run.model)
    plan = build_plan(spec, arch, PlanSettings(prompt_tokens=PROMPT_MEAN,
                                               response_tokens=run.mean_sequence - PROMPT_MEAN))
    return {"phases": plan.step_time.phases, "total": plan.step_time.total}


def sync_checks() -> list[dict]:
    hw = Hardware()
    # verl: the whole BF16 model into each of 30 rollout GPUs over the network.
    verl = sync_seconds(30.53e9 * 2, colocated=False, trainer_shards=2, hw=hw)
    # NeMo-RL: DeepSeek-V3 from PP16 x EP16 on 256 GPUs into engines of TP32: each GPU gets 1/32 of the model.
    nemo = sync_seconds(671.03e9 * 2 / 32, colocated=True, trainer_shards=256, hw=hw)
    return [{"name": "verl checkpoint engine, Qwen3-30B-A3B, NCCL, 30 receivers", "role": "fit", "published": 7.0,
             "shown": "~7 s", "predicted": verl},
            {"name": "NeMo-RL refit, DeepSeek-V3, PP16 x EP16 -> TP32, colocated", "role": "held out",
             "published": 2.6, "shown": "2.4-2.8 s", "predicted": nemo}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = []
    for run in NEMO_RL:
        predicted = predict(run)
        rows.append((run, predicted, predicted["total"] / run.step_s - 1))
    if args.markdown:
        print("| run (NeMo-RL v0.4, H100) | policy | GPUs | role | published s | predicted s | error | phases s |")
        print("|---|---|---:|---|---:|---:|---:|---|")
    for run, predicted, error in rows:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in predicted["phases"].items())
        policy = "on" if run.on_policy else "1-step off"
        if args.markdown:
            print(f"| {run.name} | {policy} | {run.gpus} | {run.role} | {run.step_s:g} | {predicted['total']:.1f} | "
                  f"{error:+.0%} | {phases} |")
        else:
            print(f"{run.name:16} {policy:10} {run.gpus:4} {run.role:9} published {run.step_s:6.1f}  predicted "
                  f"{predicted['total']:6.1f}  {error:+5.0%}   {phases}")
    for check in sync_checks():
        print(f"{check['name']}: published {check['shown']}, predicted {check['predicted']:.1f} s "
              f"({check['predicted'] / check['published'] - 1:+.0%}, {check['role']})")


if __name__ == "__main__":
    main()
