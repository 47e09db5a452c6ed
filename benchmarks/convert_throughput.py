"""Benchmark: HF->Megatron streaming import speed (GB/s) vs raw safetensors read, and peak RSS vs model size.

    python benchmarks/convert_throughput.py --hidden 1024 --layers 8 --nproc 1 [--tp N]
"""
from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time


def _model_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def raw_read_seconds(path: str) -> float:
    from safetensors import safe_open

    start = time.perf_counter()
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as handle:
                for key in handle.keys():
                    handle.get_tensor(key).clone()  # mmap hands back views; copy, as the import does
    return time.perf_counter() - start


def import_job(hf_path: str, tp: int, dtype: str = "fp32") -> dict:
    """Rank body: time the streaming fill of this rank's shard (a `dtype` model); report its peak RSS."""
    from rlmegatron.models.convert import HFCheckpoint, build_chunks, load_hf_weights
    from rlmegatron.models.hf_config import model_facts
    from rlmegatron.models.weight_map import WeightMap
    from rlmegatron.runtime import ParallelLayout, init_model_parallel

    layout = ParallelLayout(tp=tp)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    checkpoint = HFCheckpoint(hf_path)
    facts = model_facts(checkpoint.config, tp)
    init_model_parallel(layout)
    chunks = build_chunks(facts, layout, dtype)
    shard_bytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    start = time.perf_counter()
    load_hf_weights(chunks, WeightMap(facts), checkpoint)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "shard_bytes": shard_bytes, "rss_before_import": rss_before,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=4)
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlmegatron.transport.local_ranks import run_ranks

    workdir = tempfile.mkdtemp(prefix="convert-bench-")
    config = AutoConfig.for_model("qwen2", hidden_size=args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=args.hidden // 64, num_key_value_heads=args.kv_heads,
                                  intermediate_size=args.hidden * 3, vocab_size=args.vocab)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(workdir, max_shard_size="200MB")
    size = _model_bytes(workdir)
    raw_read_seconds(workdir)  # warm the page cache so both measurements read from memory
    raw = raw_read_seconds(workdir)
    ranks = run_ranks(import_job, args.tp, workdir, args.tp, timeout_s=3600)
    slowest = max(r["seconds"] for r in ranks)
    gb = size / 1e9
    print(f"model {gb:.3f} GB fp32 ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}), TP={args.tp}")
    print(f"raw safetensors read: {gb / raw:.2f} GB/s ({raw:.2f} s)")
    print(f"HF->Megatron import : {gb / slowest:.2f} GB/s ({slowest:.2f} s, slowest rank)")
    for rank, r in enumerate(ranks):
        print(f"rank {rank}: shard {r['shard_bytes'] / 1e9:.3f} GB, peak RSS {r['peak_rss'] / 1e9:.3f} GB "
              f"(before import {r['rss_before_import'] / 1e9:.3f} GB), peak RSS / model size {r['peak_rss'] / size:.2f}")


if __name__ == "__main__":  # ranks are spawned and re-import __main__
    main()
