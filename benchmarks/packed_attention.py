"""Forward + backward time of one THD-packed micro-batch on the quickstart's tiny Qwen3, one CPU rank (issue 14).

    python benchmarks/packed_attention.py --sequences 64 --min-len 16 --max-len 24 --repeats 50 --threads 1

The local spec's attention (rlmegatron/models/layers.py) decides the cost of a pack of many short sequences; the
rest of the model is per token. Prints, over `repeats` timed runs after two warm-ups, the fastest and the median wall
time and the median CPU time of the process (less sensitive to other jobs on a shared machine), and the log-prob
sum, so two versions of the code can be compared for time and result.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parents[1] / "configs" / "quickstart" / "model"


def packed_job(sequences: int, min_len: int, max_len: int, repeats: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from rlmegatron.models.hf_config import build_gpt_model, model_facts, read_hf_config, transformer_config
    from rlmegatron.runtime import ParallelLayout, init_model_parallel
    from rlmegatron.rank.roles.batch import RolloutBatch, build_micro_batch

    layout = ParallelLayout()
    init_model_parallel(layout)
    torch.manual_seed(0)
    facts = model_facts(read_hf_config(MODEL), layout.tp)
    model = build_gpt_model(facts, transformer_config(facts, layout))
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(min_len, max_len + 1, (sequences,), generator=gen)
    input_ids = torch.randint(5, facts.vocab_size, (sequences, max_len), generator=gen)
    attention_mask = (torch.arange(max_len) < lengths[:, None]).long()
    batch = RolloutBatch(input_ids=input_ids * attention_mask, attention_mask=attention_mask,
                         response_mask=attention_mask[:, -1:].float())
    micro = build_micro_batch(batch, list(range(sequences)), True)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        logits = model(micro.input_ids, micro.position_ids, None, packed_seq_params=micro.packed_seq_params)
        log_probs = torch.log_softmax(logits.float(), -1).gather(-1, micro.labels.unsqueeze(-1))
        log_probs.sum().backward()
        return float(log_probs.sum())

    step(), step()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        value = step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"tokens": int(lengths.sum()), "wall_min_s": min(wall), "wall_median_s": statistics.median(wall),
            "cpu_median_s": statistics.median(cpu), "log_prob_sum": value}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    from rlmegatron.transport.local_ranks import run_ranks

    (report,) = run_ranks(packed_job, 1, args.sequences, args.min_len, args.max_len, args.repeats, args.threads,
                          timeout_s=1800)
    print(f"{args.sequences} sequences, {report['tokens']} tokens: forward+backward wall min "
          f"{1e3 * report['wall_min_s']:.1f} ms, median {1e3 * report['wall_median_s']:.1f} ms, CPU time median "
          f"{1e3 * report['cpu_median_s']:.1f} ms; log-prob sum {report['log_prob_sum']:.6f}")


if __name__ == "__main__":
    main()
