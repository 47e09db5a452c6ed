"""One engine batch of TRL's echo task in `LocalEngine`: the time of `generate` and a checksum of what it returned.

    python benchmarks/local_generation.py [--prompts 8] [--n 8] [--max-new-tokens 4] [--repeats 300] [--threads 1]
                                          [--unseeded] [--profile FILE]

A trainer rank of that task generates 8 prompts x 8 samples, at most 4 new tokens, temperature 1, with a seed per
request (Trainer.generate): this runs that batch `repeats` times after a warm-up on the task's model (the files
`benchmarks/peer_trl.py` writes to runs/peer_trl/task) and prints the median and fastest wall time of a call and
the median CPU time of the process (less sensitive to other jobs on a shared machine). The
checksum (tokens, log-prob sum) of the seeded batch tells two versions of the engine apart or equal; compare their
times by running them in turn (PYTHONPATH=TREE), the machine being shared. `--profile FILE` writes the torch
profiler's table of the timed calls.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

TASK = Path(__file__).resolve().parents[1] / "runs" / "peer_trl" / "task"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--unseeded", action="store_true", help="requests without a seed (the engine's generator)")
    parser.add_argument("--profile", metavar="FILE")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
    from rlmegatron.rollout.local import LocalEngine

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(TASK / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(TASK / "tokenizer")
    rows = [json.loads(line) for line in (TASK / "train.jsonl").read_text().splitlines()[: args.prompts]]
    engine = LocalEngine(model, pad_token_id=model.config.pad_token_id or 0,
                         eos_token_ids=[model.config.eos_token_id], seed=0)
    requests = [
        GenerationRequest(tuple(tokenizer(row["prompt"])["input_ids"]),
                          SamplingSpec(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                       seed=None if args.unseeded else 1234 + i))
        for i, row in enumerate(rows)
    ]
    results = engine.generate(requests)  # warm-up, and the checksum of a fresh seeded batch
    tokens = sum(len(r.output_token_ids) for r in results)
    checksum = sum(t * (k + 1) for r in results for k, t in enumerate(r.output_token_ids))
    logprob_sum = sum(sum(r.output_token_logprobs) for r in results)

    times, cpu_times = [], []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    if profiler is not None:
        profiler.start()
    for _ in range(args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        engine.generate(requests)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    if profiler is not None:
        profiler.stop()
        Path(args.profile).write_text(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    print(f"generate, {len(results)} samples of {args.prompts} prompts, <= {args.max_new_tokens} new tokens, "
          f"{'un' if args.unseeded else ''}seeded, {args.threads} thread(s): "
          f"median {statistics.median(times) * 1e3:.2f} ms (process CPU {statistics.median(cpu_times) * 1e3:.2f}), "
          f"fastest {min(times) * 1e3:.2f} ms over {args.repeats}; {tokens} tokens, checksum {checksum}, "
          f"log-prob sum {logprob_sum:.6f}")


if __name__ == "__main__":
    main()
