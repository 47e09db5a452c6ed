"""Gated DeltaNet's recurrence on CPU: this package's chunked torch rule (models/gated_delta_net.gated_delta_rule)
against transformers' torch fallback (torch_chunk_gated_delta_rule, what transformers runs without fla), forward and
backward on the same inputs in one process, and their largest difference. Qwen3.5-397B's head sizes (128), fewer
heads and a 2 x 2048-token batch, so that it fits a CPU.

    .venv/bin/python benchmarks/gated_delta_net.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlmegatron.models.gated_delta_net import _l2_normalised, gated_delta_rule

BATCH, TOKENS, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 2, 2048, 2, 4, 128


def inputs():
    generator = torch.Generator().manual_seed(0)
    shape = (BATCH, TOKENS)
    q, k = (torch.randn(*shape, KEY_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
    v = torch.randn(*shape, VALUE_HEADS, HEAD_DIM, generator=generator)
    decay = -torch.rand(*shape, VALUE_HEADS, generator=generator)
    beta = torch.rand(*shape, VALUE_HEADS, generator=generator)
    return [t.requires_grad_() for t in (q, k, v, decay, beta)]


def ours(q, k, v, decay, beta):
    repeat = VALUE_HEADS // KEY_HEADS
    q, k = (_l2_normalised(t).repeat_interleave(repeat, dim=2) for t in (q, k))
    return gated_delta_rule(q * HEAD_DIM ** -0.5, k, v, decay, beta)


def transformers_fallback(q, k, v, decay, beta):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)[0]


def timed(rule, repeats: int) -> tuple[float, torch.Tensor]:
    times = []
    for _ in range(repeats):
        tensors = inputs()
        start = time.perf_counter()
        out = rule(*tensors)
        out.square().sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    baseline, reference = timed(transformers_fallback, args.repeats)
    mine, out = timed(ours, args.repeats)
    print(f"{BATCH} x {TOKENS} tokens, {KEY_HEADS}/{VALUE_HEADS} heads of {HEAD_DIM}, {torch.get_num_threads()} threads, "
          f"forward + backward, median of {args.repeats}")
    print(f"transformers' torch_chunk_gated_delta_rule: {baseline:.3f} s")
    print(f"models.gated_delta_net.gated_delta_rule:    {mine:.3f} s  (ratio {mine / baseline:.2f})")
    print(f"largest difference of the outputs: {float((out - reference).abs().max()):.2e} "
          f"(outputs up to {float(reference.abs().max()):.2f})")


if __name__ == "__main__":
    main()
