"""Benchmark: export-plus-sync throughput (GB/s) from a sharded Megatron model into a local engine, per layout,
next to a plain memory copy of the same bytes on the same machine, and the peak extra memory of the stream.

    python benchmarks/export_sync_throughput.py --hidden 768 --layers 8 --layouts 1,1,1 2,1,1 1,2,1 [--bucket-mb 0]
    python benchmarks/export_sync_throughput.py --family qwen3_moe --hidden 512 --layers 4 --layouts 1,1,1 1,1,2

A layout is TP,PP,EP; each runs on TP*PP*EP ranks. "Sync" is the colocated path on CPU: the export
stream (TP/EP all-gather, PP broadcast, weight-map split), flattened buckets (one reused buffer,
as a colocated server gets them; --bucket-mb 0 skips them, as the in-process engine can), and the
engine's in-place load. Peak extra memory is sampled RSS during the sync minus RSS just before it.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import psutil
import torch


def _peak_rss_during(fn):
    """(fn's result, peak RSS growth in bytes while fn ran), sampling every 2 ms."""
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = [baseline]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    return result, peak[0] - baseline


def sync_job(hf_dir: str, layout, bucket_mb: int, repeats: int) -> dict:
    """Rank body: import the checkpoint at `layout`, then time export -> buckets -> local engine load."""
    from transformers import AutoModelForCausalLM

    from rlmegatron.models.convert import import_hf
    from rlmegatron.resharding import HFWeightExporter
    from rlmegatron.rollout.buckets import iter_buckets
    from rlmegatron.rollout.local import LocalEngine

    _, weight_map, chunks = import_hf(hf_dir, layout)
    exporter = HFWeightExporter(chunks, weight_map)
    engine = LocalEngine(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32))
    engine_params = dict(engine.model.state_dict())

    def sync_once():
        pushed = 0
        if bucket_mb:  # the colocated-server path: one reused flat buffer per bucket, then the engine's copy
            named = (t for bucket in iter_buckets(exporter.stream(), bucket_mb * 2**20, reuse_buffer=True)
                     for t in bucket.named_tensors())
        else:  # an in-process engine: straight from the stream into its parameters
            named = exporter.stream()
        for name, tensor in named:
            engine_params[name].copy_(tensor)
            pushed += tensor.nbytes
        return pushed

    sync_once()  # warm-up: first-touch of buffers, lazy imports
    times, peaks = [], []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        pushed, extra = _peak_rss_during(sync_once)
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
        peaks.append(extra)
    total = sum(t.nbytes for t in engine_params.values() if t.dtype.is_floating_point)
    source = torch.empty(total // 4, dtype=torch.float32).uniform_()
    target = torch.empty_like(source)
    copy_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        copy_times.append(time.perf_counter() - start)
    largest = max(t.nbytes for t in engine_params.values())
    return {"bytes": pushed, "sync_s": min(times), "copy_s": min(copy_times), "peak_extra": min(peaks),
            "largest_tensor": largest}


def main() -> None:
    from rlmegatron.runtime import ParallelLayout
    from rlmegatron.transport.local_ranks import run_ranks
    from tests.models.tiny_hf import save_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=64, help="0: no buckets (in-process engine)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=["1,1,1", "2,1,1", "1,2,1"])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as workdir:
        hf_dir = os.path.join(workdir, "hf")
        save_tiny_model(args.family, hf_dir, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        intermediate_size=4 * args.hidden, vocab_size=32000)
        print(f"| layout | model GB | export+sync GB/s | plain copy GB/s | ratio | peak extra MB | largest tensor MB |")
        print("|---|---|---|---|---|---|---|")
        for spec in args.layouts:
            tp, pp, ep = (int(x) for x in spec.split(","))
            layout = ParallelLayout(tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1 and args.family.endswith("moe"))
            results = run_ranks(sync_job, tp * pp * ep, hf_dir, layout, args.bucket_mb, args.repeats, timeout_s=900)
            r = max(results, key=lambda x: x["sync_s"])  # the slowest rank bounds the sync
            gb = r["bytes"] / 1e9
            print(f"| {layout} | {gb:.3f} | {gb / r['sync_s']:.2f} | {gb / r['copy_s']:.2f} | "
                  f"{r['copy_s'] / r['sync_s']:.2f} | {max(x['peak_extra'] for x in results) / 2**20:.0f} | "
                  f"{r['largest_tensor'] / 2**20:.0f} |", flush=True)


if __name__ == "__main__":
    main()
