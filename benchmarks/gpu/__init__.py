"""One-call GPU harness (benchmarks/gpu/run.sh): actor MFU, colocated weight sync, local-engine generation, GRPO."""
