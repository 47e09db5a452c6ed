"""Benchmark: peak memory of importing a block-wise FP8 checkpoint (dequantised as it streams) vs the same model's
bf16 checkpoint, into a bf16 Megatron model, one rank each in a fresh process.

    python benchmarks/fp8_import_memory.py --hidden 1024 --layers 8
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile


def write_fp8_copy(source: str, out: str) -> None:
    """`source`'s shards quantised block-wise (128 x 128, DeepSeek-V3's format), one shard at a time."""
    from safetensors.torch import load_file, save_file

    from rlmegatron.models.fp8 import DEFAULT as fp8

    os.makedirs(out)
    index = json.loads(open(os.path.join(source, "model.safetensors.index.json")).read())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = dict(fp8.quantised_stream(load_file(os.path.join(source, shard)).items()))
        save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as file:
        json.dump({"metadata": {}, "weight_map": weight_map}, file)
    config = json.loads(open(os.path.join(source, "config.json")).read())
    with open(os.path.join(out, "config.json"), "w") as file:
        json.dump({**config, "quantization_config": fp8.config}, file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fp8-bench-") as workdir:
        compare(args, os.path.join(workdir, "bf16"), os.path.join(workdir, "fp8"))


def compare(args, bf16_dir: str, fp8_dir: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from convert_throughput import _model_bytes, import_job  # this directory is on sys.path when run as a script
    from rlmegatron.transport.local_ranks import run_ranks

    config = AutoConfig.for_model("qwen2", hidden_size=args.hidden, num_hidden_layers=args.layers,
                                  num_attention_heads=args.hidden // 64, num_key_value_heads=4,
                                  intermediate_size=args.hidden * 3, vocab_size=args.vocab)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(bf16_dir, max_shard_size="200MB")
    write_fp8_copy(bf16_dir, fp8_dir)
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; into a bf16 Megatron model, TP=1")
    for name, path in (("bf16", bf16_dir), ("fp8", fp8_dir)):
        (result,) = run_ranks(import_job, 1, path, 1, "bf16", timeout_s=3600)
        # The growth counts the checkpoint's pages read through mmap and the model's pages as they are first
        # written, on top of what the import holds besides.
        growth = result["peak_rss"] - result["rss_before_import"]
        print(f"{name}: checkpoint {_model_bytes(path) / 1e9:.3f} GB, import {result['seconds']:.2f} s, "
              f"model {result['shard_bytes'] / 1e9:.3f} GB, peak RSS {result['peak_rss'] / 1e9:.3f} GB, "
              f"of which {growth / 1e9:.3f} GB during the import")


if __name__ == "__main__":  # ranks are spawned and re-import __main__
    main()
