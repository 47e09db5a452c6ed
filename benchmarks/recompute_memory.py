"""Activation memory and step time of each recompute setting (spec `megatron.recompute_*`), on one CPU rank.

    python benchmarks/recompute_memory.py --hidden 512 --layers 8 --seq-len 512 --batch 2

Memory is the bytes autograd saves for backward during the forward pass (distinct storages, parameters
excluded; see tests/models/recompute_jobs.py), time one forward + backward (the second of two runs).
"""
from __future__ import annotations

import argparse

from rlmegatron.transport.local_ranks import run_ranks
from tests.models.recompute_jobs import hf_config, recompute_job

SETTINGS = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full, block, 4 layers": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 4},
    "full, uniform, 2 layers": {"recompute_granularity": "full", "recompute_method": "uniform",
                                "recompute_num_layers": 2},
    "full, uniform, 1 layer": {"recompute_granularity": "full", "recompute_method": "uniform",
                               "recompute_num_layers": 1},
}


def _twice(hf: dict, batch: int, seq_len: int) -> dict:
    recompute_job(hf, SETTINGS, batch, seq_len)  # warm-up: first-call allocations and kernel selection
    return recompute_job(hf, SETTINGS, batch, seq_len)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    hf = hf_config("qwen2", hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                   num_key_value_heads=4, intermediate_size=3 * args.hidden, vocab_size=1024,
                   max_position_embeddings=args.seq_len)
    (report,) = run_ranks(_twice, 1, hf, args.batch, args.seq_len, timeout_s=1800)
    base = report["none"]
    print("| recompute | saved for backward (MB) | vs none | forward+backward (s) | vs none | max grad diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in report.items():
        print(f"| {label} | {r['saved_bytes'] / 1e6:.1f} | {r['saved_bytes'] / base['saved_bytes']:.2f} | "
              f"{r['seconds']:.3f} | {r['seconds'] / base['seconds']:.2f} | {r['grad_max_abs_diff']:.1e} |")


if __name__ == "__main__":
    main()
