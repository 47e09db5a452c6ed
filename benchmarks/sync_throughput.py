"""Weight-sync throughput: bucketing and SGLang bucket serialization next to a plain copy of the same bytes.

Each configuration runs in a fresh process so its peak RSS above the resident weights is its own.
Usage: python benchmarks/sync_throughput.py [--total-mb 512] [--bucket-mb 16 64 256] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

import torch

from rlmegatron.rollout.buckets import Bucketer
from rlmegatron.rollout.sglang.protocol import serialize_flattened_bucket


def synthetic_weights(total_mb: int) -> list[tuple[str, torch.Tensor]]:
    """bf16 tensors shaped like one transformer layer's (hidden 2048), repeated up to total_mb."""
    shapes = {"q_proj": (2048, 2048), "k_proj": (512, 2048), "v_proj": (512, 2048), "o_proj": (2048, 2048),
              "gate_proj": (5632, 2048), "up_proj": (5632, 2048), "down_proj": (2048, 5632), "norm": (2048,)}
    named, total, layer = [], 0, 0
    while total < total_mb * 2**20:
        for part, shape in shapes.items():
            tensor = torch.randn(shape).to(torch.bfloat16)
            named.append((f"model.layers.{layer}.{part}.weight", tensor))
            total += tensor.numel() * 2
        layer += 1
    return named


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_one(mode: str, total_mb: int, bucket_mb: int, repeats: int) -> dict:
    torch.multiprocessing.set_sharing_strategy("file_system")
    named = synthetic_weights(total_mb)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    baseline_rss = max_rss_bytes()
    best = float("inf")
    # Both sides keep their destination between repeats, so the best repeat measures copying, not page faults.
    destination = torch.zeros(nbytes, dtype=torch.uint8) if mode == "copy" else None
    bucketer = Bucketer(bucket_mb * 2**20, reuse_buffer=True, shared_memory=mode.endswith("serialize")) if mode != "copy" else None
    for _ in range(repeats):
        start = time.perf_counter()
        if mode == "copy":
            offset = 0
            for _, tensor in named:
                size = tensor.numel() * tensor.element_size()
                destination[offset : offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
                offset += size
        else:
            for bucket in bucketer.buckets(iter(named)):
                if mode == "bucket+serialize":
                    serialize_flattened_bucket(bucket)
        best = min(best, time.perf_counter() - start)
    return {"mode": mode, "bucket_mb": bucket_mb, "gb": nbytes / 1e9, "seconds": best,
            "gb_per_s": nbytes / 1e9 / best, "peak_extra_mb": (max_rss_bytes() - baseline_rss) / 2**20,
            "peak_buffer_mb": bucketer.peak_buffer_bytes / 2**20 if bucketer else 0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--total-mb", type=int, default=512)
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", nargs=2, metavar=("MODE", "BUCKET_MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one[0], args.total_mb, int(args.one[1]), args.repeats)))
        return
    configs = [("copy", 0)] + [(mode, mb) for mb in args.bucket_mb for mode in ("bucket", "bucket+serialize")]
    rows = []
    for mode, mb in configs:
        out = subprocess.run([sys.executable, __file__, "--total-mb", str(args.total_mb), "--repeats",
                              str(args.repeats), "--one", mode, str(mb)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout))
    copy_rate = rows[0]["gb_per_s"]
    print(f"{args.total_mb} MB of bf16 weights, CPU, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"best of {args.repeats}\n")
    print("| mode | bucket MB | GB/s | vs plain copy | peak extra RSS MB | largest bucket buffer MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['mode']} | {row['bucket_mb'] or '-'} | {row['gb_per_s']:.2f} | {row['gb_per_s'] / copy_rate:.2f} | "
              f"{row['peak_extra_mb']:.0f} | {row['peak_buffer_mb']:.0f} |")


if __name__ == "__main__":
    main()
