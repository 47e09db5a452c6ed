"""A disaggregated push to several servers from one sender: each bucket to every server at once, against each server
alone, one after another (the schedule before 2026-11-29, which waited for one server's load before the next
server's broadcast), in the same run.

    python benchmarks/disaggregated_push.py [--servers 4] [--buckets 6] [--bucket-mb 4] [--load-s 0.2] [--repeats 3]

The servers are the loopback SGLang stand-in of tests/rollout/fake_sglang (HTTP and a gloo weight-update group per
server, as rollout/sglang/weight_push.DistributedWeightPush drives SGLang), which takes `--load-s` after receiving a
bucket before it answers: a stand-in for the model's load of the bucket (SGLang's load_weights, ~0.23 ms a tensor on
GPU, benchmarks/RESULTS.md). Prints the seconds of each schedule, their median over `--repeats`, and the ratio.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from rlmegatron.rollout.sglang.protocol import DistributedGroupSpec  # noqa: E402
from rlmegatron.rollout.sglang.weight_push import DistributedWeightPush  # noqa: E402
from rlmegatron.runtime.distributed import free_port  # noqa: E402
from tests.rollout.test_sglang import make_engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--buckets", type=int, default=6)
    parser.add_argument("--bucket-mb", type=int, default=4)
    parser.add_argument("--load-s", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    side = int(((args.bucket_mb << 20) // 4) ** 0.5)  # a square fp32 tensor of one bucket's bytes
    weights = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(side, side)) for i in range(args.buckets)]
    with tempfile.TemporaryDirectory() as tmp:
        engines = [make_engine(Path(tmp) / f"s{k}", **{"fake-load-s": args.load_s}) for k in range(args.servers)]
        try:
            push = DistributedWeightPush(bucket_bytes=args.bucket_mb << 20)
            for key, engine in enumerate(engines):
                push.connect(key, engine.spec.url, engine.spec.tp_size,
                             DistributedGroupSpec("127.0.0.1", free_port(), f"bench_{key}", "gloo"))
            times: dict[str, list[float]] = {"every server at once": [], "one server after another": []}
            for repeat in range(args.repeats):
                started = time.perf_counter()
                assert push.push(iter(weights), f"v{repeat}a") == []
                times["every server at once"].append(time.perf_counter() - started)
                started = time.perf_counter()
                for key in range(args.servers):
                    assert push.push(iter(weights), f"v{repeat}b", only=[key]) == []
                times["one server after another"].append(time.perf_counter() - started)
        finally:
            for engine in engines:
                engine.shutdown()
    print(f"{args.servers} servers, {args.buckets} buckets of {args.bucket_mb} MiB, {args.load_s} s load per bucket")
    for schedule, seconds in times.items():
        print(f"  {schedule:<25} " + " ".join(f"{s:.2f}" for s in seconds)
              + f" s; median {statistics.median(seconds):.2f} s")
    ratio = statistics.median(times["one server after another"]) / statistics.median(times["every server at once"])
    print(f"  one after another / at once: {ratio:.2f}x")


if __name__ == "__main__":
    main()
