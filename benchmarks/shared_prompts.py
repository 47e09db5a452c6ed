"""The actor's update with and without shared-prompt micro-batches (models/shared_prompts.py), on TRL's echo model.

    python benchmarks/shared_prompts.py [--updates 25] [--model DIR] [P,R,N,PROMPTS ...]

Each configuration is PROMPTS prompts of P tokens with N responses each of R/2..R tokens, one micro-batch, one
rank in this process (one thread, as a launched CPU rank of two has). The two actors start from the same weights and
their updates alternate, so the machine's load falls on both alike; the table gives the median update and the
tokens each layout runs. The model: TRL's echo model from the task files `benchmarks/peer_trl.py` writes
(runs/peer_trl/task), or any HF checkpoint directory (`--model`; token ids 4-47 are used).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

MODEL = "runs/peer_trl/task/model"


def grouped_batch(prompt: int, response: int, n: int, prompts: int, generator: torch.Generator):
    from rlmegatron.rank.roles import RolloutBatch

    rows = n * prompts
    input_ids = torch.zeros(rows, prompt + response, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for p in range(prompts):
        tokens = torch.randint(4, 48, (prompt,), generator=generator)
        for row in range(p * n, (p + 1) * n):
            size = int(torch.randint(max(1, response // 2), response + 1, (), generator=generator))
            input_ids[row, :prompt] = tokens
            input_ids[row, prompt : prompt + size] = torch.randint(4, 48, (size,), generator=generator)
            mask[row, : prompt + size] = 1
    response_mask = mask[:, prompt:].float()
    return RolloutBatch(input_ids, mask, response_mask, advantages=torch.randn(rows, response) * response_mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=25)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("configs", nargs="*", default=["9,4,8,8", "3,4,8,8", "4,8,4,8", "8,8,2,16", "2,8,2,16"])
    args = parser.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from rlmegatron.runtime.distributed import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    torch.set_num_threads(1)
    from rlmegatron.models.convert import HFCheckpoint
    from rlmegatron.models.hf_config import build_gpt_model, transformer_config
    from rlmegatron.runtime import ParallelLayout, init_distributed, init_model_parallel
    from rlmegatron.rank.roles import ActorSettings, ActorWorker, OptimizerSettings

    init_distributed("cpu")
    layout = ParallelLayout()
    init_model_parallel(layout)
    facts = HFCheckpoint(args.model).facts(1)
    config = transformer_config(facts, layout)
    print("| P, R, n, prompts | tokens unshared | tokens shared | ratio | update unshared ms | update shared ms | "
          "shared / unshared |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for spec in args.configs:
        prompt, response, n, prompts = (int(x) for x in spec.split(","))
        actors = {}
        for share in (False, True):
            torch.manual_seed(0)
            actors[share] = ActorWorker(
                ActorSettings(ppo_mini_batch_size=n * prompts, micro_batch_size=n * prompts,
                              vocab_size=facts.vocab_size, share_prompts=share, optimizer=OptimizerSettings(lr=1e-3)),
                lambda pre, post, vp: build_gpt_model(facts, config, vp_stage=vp), layout)
            actors[share].init(parallel_state_ready=True)
        generator = torch.Generator().manual_seed(0)
        batches = [grouped_batch(prompt, response, n, prompts, generator) for _ in range(args.updates)]
        seconds = {False: [], True: []}
        for batch in batches:
            for share, actor in actors.items():
                start = time.perf_counter()
                actor.update(batch)
                seconds[share].append(time.perf_counter() - start)
        unshared = sum(int(b.attention_mask.sum()) for b in batches) // len(batches)
        shared = sum(prompt * prompts + int(b.attention_mask[:, prompt:].sum()) for b in batches) // len(batches)
        median = {share: statistics.median(values[3:]) * 1e3 for share, values in seconds.items()}
        print(f"| {spec} | {unshared} | {shared} | {shared / unshared:.2f} | {median[False]:.1f} | {median[True]:.1f} "
              f"| {median[True] / median[False]:.2f} |")


if __name__ == "__main__":
    main()
