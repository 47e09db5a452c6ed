"""The train-rollout mismatch of a tiny MoE policy with routing replay off, r2 and r3, against the same dense model,
in fp32 and bf16, and whether r3 learns the quickstart's task as fast as routing freely.

    python benchmarks/routing_replay.py [--steps 12] [--learn-steps 120] [--out DIR]

Each run is `rlm train configs/quickstart.yaml` (the next-digit task, the local engine, 2 CPU ranks) on a random
model with the quickstart's tokenizer: a Qwen3-MoE of 3 layers and 8 experts (top-2), a DeepSeek-V3 of 3 layers (MLA,
one dense layer, 8 experts in 2 groups of which each token picks 1, top-2, no MTP), and the quickstart's dense Qwen3.
The update has two mini-batches, so every mode has an old-log-prob pass and logs the mismatch beside it:
moe/routing_agreement (with actor.moe.routing_agreement where r3 does not measure it anyway),
training/rollout_probs_diff_mean/max and training/rollout_kl. The table gives each metric's mean over the steps.
The learning comparison trains the Qwen3-MoE at EP=2 in bf16 with replay off and r3 for --learn-steps steps and gives
the held-out score (greedy, 64 prompts) before and after, and the step where the 5-step mean reward first reaches 0.5.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
METRICS = ("moe/routing_agreement", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_max",
           "training/rollout_kl")


def write_model(directory: Path, family: str) -> Path:
    """The quickstart's model directory (tokenizer, config) as `family` (its Qwen3-MoE ships as
    configs/quickstart/moe_model); random_init builds the weights."""
    if family == "qwen3_moe":
        return REPO_ROOT / "configs" / "quickstart" / "moe_model"
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(REPO_ROOT / "configs" / "quickstart" / "model", directory)
    config = json.loads((directory / "config.json").read_text())
    if family == "deepseek_v3":
        keep = {key: config[key] for key in ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id",
                                             "hidden_size", "max_position_embeddings", "rms_norm_eps", "rope_theta")}
        config = {**keep, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96,
                  "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                  "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                  "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                  "v_head_dim": 16, "num_nextn_predict_layers": 0, "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def train(run_dir: Path, model: Path, steps: int, *overrides: str) -> dict:
    """One `rlm train` of the quickstart in this process's job code (the ranks are processes); its metric history."""
    from rlmegatron.driver.job import check_training, run_training
    from rlmegatron.prelaunch.spec_pipeline import SpecSource

    source = SpecSource(str(REPO_ROOT / "configs" / "quickstart.yaml"), [
        f"model.path={model}", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", "trainer.save_freq=-1",
        "tracking.backends=[console]", "actor.ppo_mini_batch_size=8", *overrides])
    with contextlib.redirect_stdout(sys.stderr):  # the run's own report; stdout keeps the tables
        return run_training(check_training(source)).history


def mean_of(history: dict, name: str) -> float | None:
    points = [value for step, value in history.get(name, []) if step > 0]
    return statistics.fmean(points) if points else None


def first_reaching(history: dict, name: str, level: float, window: int = 5) -> int | None:
    values = [value for _, value in sorted(history.get(name, []))]
    for end in range(window, len(values) + 1):
        if statistics.fmean(values[end - window : end]) >= level:
            return end
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--learn-steps", type=int, default=120)
    parser.add_argument("--out", default="runs/routing_replay")
    args = parser.parse_args()
    out = Path(args.out)
    models = {family: write_model(out / family, family) for family in ("qwen3_moe", "deepseek_v3")}
    models["qwen3 (dense)"] = REPO_ROOT / "configs" / "quickstart" / "model"
    quiet = ["trainer.val_before_train=false", "trainer.test_freq=-1", "data.val_files=[]"]
    layouts = {"EP=2": ["actor.megatron.expert_model_parallel_size=2"],
               "TP=2": ["actor.megatron.tensor_model_parallel_size=2", "actor.megatron.sequence_parallel=true"]}
    modes = {"off": ["actor.moe.routing_agreement=true"],
             "r2": ["actor.moe.routing_replay=r2", "actor.moe.routing_agreement=true"],
             "r3": ["actor.moe.routing_replay=r3"]}
    rows = []
    for dtype in ("fp32", "bf16"):
        for family, model in models.items():
            dense = family.endswith("(dense)")
            for layout_name, layout in ({"TP=2": ["actor.megatron.tensor_model_parallel_size=2"]} if dense
                                        else layouts).items():
                for mode, settings in ({"-": []} if dense else modes).items():
                    started = time.perf_counter()
                    history = train(out / "runs" / f"{family}-{dtype}-{layout_name}-{mode}".replace(" ", ""),
                                    model, args.steps, f"model.dtype={dtype}", *quiet, *layout, *settings)
                    rows.append((dtype, family, layout_name, mode, *(mean_of(history, m) for m in METRICS),
                                 time.perf_counter() - started))
                    print(rows[-1], file=sys.stderr, flush=True)
    print(f"Mismatch per step, mean over {args.steps} steps (local engine, 2 CPU ranks):\n")
    print("| dtype | model | layout | replay | routing agreement | probs diff mean | probs diff max | rollout KL |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for dtype, family, layout_name, mode, agreement, diff_mean, diff_max, kl, _ in rows:
        cells = ["-" if v is None else f"{v:.4g}" for v in (agreement, diff_mean, diff_max, kl)]
        print(f"| {dtype} | {family} | {layout_name} | {mode} | " + " | ".join(cells) + " |")
    print(f"\nLearning, Qwen3-MoE at EP=2 in bf16, {args.learn_steps} steps:\n")
    print("| replay | val score before | val score after | step the 5-step mean reward reaches 0.5 | seconds |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("off", "r3"):
        started = time.perf_counter()
        history = train(out / "runs" / f"learn-{mode}", models["qwen3_moe"], args.learn_steps, "model.dtype=bf16",
                        "actor.megatron.expert_model_parallel_size=2", f"trainer.test_freq={args.learn_steps}",
                        *(["actor.moe.routing_replay=r3"] if mode == "r3" else []))
        scores = [value for _, value in sorted(history["val/next_digit/score/mean"])]
        reached = first_reaching(history, "critic/score/mean", 0.5)
        print(f"| {mode} | {scores[0]:.3f} | {scores[-1]:.3f} | {reached or 'not reached'} | "
              f"{time.perf_counter() - started:.0f} |", flush=True)


if __name__ == "__main__":
    main()
