"""What training the MTP layers with the policy (actor.mtp.loss_weight) costs an actor update, on CPU.

    python benchmarks/mtp_update.py [--updates 8] [--sequences 32] [--response 48]

A tiny DeepSeek-V3 with one MTP layer (tests/models/tiny_hf.save_quickstart_mtp_model: 4 decoder layers, MLA, 4
experts, the quickstart's 128-token vocabulary) on 2 gloo ranks through a PolicyRank built from the quickstart's spec.
Each update is one optimizer step over `--sequences` sequences of 16-token prompts and `--response`-token responses
(random tokens and advantages); the weights 0 and 0.5 alternate update by update in one rank process, so both see the
same machine load. Prints the median seconds of each and their ratio; the first update of each is left out (warm-up).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = 16


def _job(model: str, workdir: str, updates: int, sequences: int, response: int) -> dict:
    import torch

    from rlmegatron.driver.role_settings import trainer_rank_settings
    from rlmegatron.prelaunch.spec_pipeline import load_spec
    from rlmegatron.rank.policy_rank import PolicyRank
    from rlmegatron.rank.roles.batch import RolloutBatch

    os.chdir(REPO_ROOT)
    spec = load_spec("configs/quickstart.yaml", [
        f"model.path={model}", "model.random_init=false", f"trainer.run_dir={workdir}",
        f"data.max_prompt_length={PROMPT}", f"data.max_response_length={response}", "rollout.n=2",
        f"actor.ppo_mini_batch_size={sequences // 2}", "actor.ppo_micro_batch_size_per_gpu=8",
        "actor.mtp.loss_weight=0.5"])
    rank = PolicyRank(dataclasses.replace(trainer_rank_settings(spec, updates * 2), colocated=False))
    actor = rank.models.actor
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 128, (sequences, PROMPT + response), generator=generator)
    mask = torch.ones(sequences, response)
    batch = RolloutBatch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), response_mask=mask,
                         advantages=torch.randn(mask.shape, generator=generator))
    seconds = {0.0: [], 0.5: []}
    for _ in range(updates):
        for weight in seconds:
            actor.settings = dataclasses.replace(actor.settings, mtp_loss_weight=weight)
            start = time.perf_counter()
            rank.update_actor(batch)
            seconds[weight].append(time.perf_counter() - start)
    rank.shutdown()
    return {str(weight): times[1:] for weight, times in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--response", type=int, default=48)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT))
    from rlmegatron.transport.local_ranks import run_ranks
    from tests.models.tiny_hf import save_quickstart_mtp_model

    with tempfile.TemporaryDirectory() as workdir:
        model = save_quickstart_mtp_model(os.path.join(workdir, "model"))
        times = run_ranks(_job, 2, model, os.path.join(workdir, "run"), args.updates, args.sequences, args.response,
                          timeout_s=1800)[0]
    off, on = statistics.median(times["0.0"]), statistics.median(times["0.5"])
    print(f"update of {args.sequences} x ({PROMPT} + {args.response}) tokens, median of {len(times['0.0'])}:")
    print(f"  actor.mtp.loss_weight=0    {off:.3f} s")
    print(f"  actor.mtp.loss_weight=0.5  {on:.3f} s  ({on / off:.2f}x)")


if __name__ == "__main__":
    main()
