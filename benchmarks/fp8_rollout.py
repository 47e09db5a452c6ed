"""FP8 rollout (rollout.quantization fp8): the weight-sync bytes against bf16, and the quickstart trained with the
local engine sampling from block-wise FP8 weights, without and with TIS, against the quickstart as shipped.

    python -m benchmarks.fp8_rollout --steps 150 [--variants none fp8 fp8_tis] [--out-dir DIR]

Sync bytes are counted from the HF tensor shapes of configs/models' Qwen3-1.7B, Qwen3-30B-A3B and DeepSeek-V3 (a
model built on the meta device: no weights): bf16 for every tensor, against FP8 for the projections the sync
quantises (1 byte an element and a float32 scale per 128 x 128 block) and bf16 for the rest. Each training variant runs
in a child process (benchmarks/async_modes.py's); per variant: the reward curve, the first step whose 5-step mean
reward reaches 0.8, and the rollout/trainer mismatch the trainer logs each step (training/rollout_probs_diff_mean:
|p_rollout - p_trainer| per response token; training/rollout_kl: KL(rollout || trainer), k3 on the samples).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.async_modes import REWARD, first_reach

REPO_ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "none": [],
    "fp8": ["rollout.quantization=fp8"],
    "fp8_tis": ["rollout.quantization=fp8", "algorithm.rollout_correction.rollout_is=token"],
}
# An on-policy check no gap reaches: the quickstart's update is exactly on-policy, so without it (or a correction)
# the trainer computes no old log-probs of its own before the update, and logs no mismatch.
COMMON = ["trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false", "data.val_files=[]",
          "tracking.backends=[console]", "trainer.resume=disable", "trainer.on_policy_check=1000"]
MISMATCH = ("training/rollout_probs_diff_mean", "training/rollout_kl")
SYNC_MODELS = ("qwen3-1.7b", "qwen3-30b-a3b", "deepseek-v3")


def sync_bytes(model_dir: Path) -> dict:
    """Bytes of one weight sync of the model in bf16 and with FP8 projections, from its tensors' shapes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlmegatron.models.fp8 import DEFAULT as fp8

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    bf16 = quantised = scales = 0
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the sync sends a tied head once, as the embedding
        bf16 += tensor.numel() * 2
        # transformers stacks the experts; the sync sends each expert's gate, up and down projections by name.
        if name.endswith("experts.gate_up_proj"):
            experts, rows, cols = tensor.shape
            matrices = [(rows // 2, cols)] * (2 * experts)
        elif name.endswith("experts.down_proj"):
            matrices = [tuple(tensor.shape[1:])] * tensor.shape[0]
        elif fp8.quantises(name):
            matrices = [tuple(tensor.shape)]
        else:
            quantised += tensor.numel() * 2
            continue
        for rows, cols in matrices:
            grid = fp8.scale_shape((rows, cols))
            quantised += rows * cols + grid[0] * grid[1] * 4
            scales += grid[0] * grid[1] * 4
    # The scales alone are also what `rlm convert hf-to-mcore` keeps of an FP8 checkpoint of the model
    # (fp8_scales.safetensors), so that `mcore-to-hf --fp8` gives its bytes back.
    return {"bf16_gb": round(bf16 / 1e9, 3), "fp8_gb": round(quantised / 1e9, 3), "ratio": round(quantised / bf16, 3),
            "scales_mb": round(scales / 1e6, 1)}


def run_variant(name: str, steps: int, out_dir: Path) -> dict:
    out = out_dir / f"{name}.json"
    out.unlink(missing_ok=True)
    overrides = [*COMMON, *VARIANTS[name], f"trainer.total_steps={steps}", f"trainer.run_dir={out_dir / name}"]
    start = time.perf_counter()
    child = subprocess.run([sys.executable, "-m", "benchmarks.async_modes", "--child", str(out), "False", *overrides],
                           cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    if child.returncode != 0 or not out.exists():
        return {"variant": name, "error": f"exit {child.returncode}"}
    run = json.loads(out.read_text())

    def series(metric: str) -> list[float]:
        return [value for _, value in run["history"].get(metric, [])]

    rewards = series(REWARD)
    row = {"variant": name, "steps": len(rewards), "fit_s": round(run["seconds"], 1),
           "wall_s": round(time.perf_counter() - start, 1), "first_step_5_mean_ge_0.8": first_reach(rewards),
           "reward_5_mean_at": {step: round(sum(rewards[step - 5:step]) / 5, 3)
                                for step in (5, 25, 50, 75, 100, 125, 150) if step <= len(rewards)}}
    for metric in MISMATCH:
        values = series(metric)
        row[metric] = {"mean": sum(values) / len(values), "max": max(values)} if values else None
    row["reward_curve"] = rewards
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS),
                        help="training variants to run; none (a bare --variants): the sync bytes only")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "runs" / "fp8_rollout")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {"sync": {name: sync_bytes(REPO_ROOT / "configs" / "models" / name) for name in SYNC_MODELS},
              "variants": []}
    print(json.dumps(report["sync"]), flush=True)
    for name in args.variants:
        report["variants"].append(run_variant(name, args.steps, args.out_dir))
        print(json.dumps({k: v for k, v in report["variants"][-1].items() if k != "reward_curve"}), flush=True)
        (args.out_dir / "result.json").write_text(json.dumps(report, indent=1))
    return 0 if all("error" not in row for row in report["variants"]) else 1


if __name__ == "__main__":
    sys.exit(main())
