"""LoRA on the Megatron actor: the gradient and Adam-state bytes it keeps, against full training, and the most
probability a frozen random output layer lets any token reach (why the quickstart's LoRA run stalled).

    python benchmarks/lora_memory.py                                  # the quickstart's model
    python benchmarks/lora_memory.py --modules-to-save embedding      # its LoRA config (configs/quickstart_lora.yaml)
    python benchmarks/lora_memory.py --hidden 1024 --layers 8 --vocab 32000 --rank 16

One gloo rank on CPU, fp32 (the quickstart's dtype). Gradient bytes are Megatron's DDP gradient buffers, which hold a
slot for every parameter that trains; optimizer bytes are every tensor in the Adam state (exp_avg, exp_avg_sq) and any
fp32 master copy. Both are measured after one update, when Adam has created its state.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QUICKSTART_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "quickstart",
                                "model")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_bytes(optimizer) -> int:
    import torch

    total = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            total += _tensor_bytes(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        total += _tensor_bytes(p for group in getattr(inner, "shard_fp32_from_float16_groups", []) for p in group)
    return total


def measure(hf: dict, lora_rank: int, alpha: float, temperatures: list[float], saved: tuple[str, ...] = ()) -> dict:
    """The actor's trainable parameters, gradient-buffer and optimizer-state bytes after one update."""
    from dataclasses import replace

    import torch

    from rlmegatron.models.hf_config import build_gpt_model, model_facts, transformer_config
    from rlmegatron.models.lora import LoRASettings, add_adapters
    from rlmegatron.runtime import ParallelLayout, init_model_parallel
    from rlmegatron.rank.roles import ActorSettings, ActorWorker, OptimizerSettings
    from rlmegatron.rank.roles.megatron_step import unwrap
    from tests.rank.roles.jobs import rollout_batch

    layout = ParallelLayout()
    init_model_parallel(layout)
    facts = model_facts(hf, 1)
    config = transformer_config(facts, layout)
    lora = LoRASettings(rank=lora_rank, alpha=alpha, modules_to_save=saved) if lora_rank else None

    def provide(pre, post, vp):
        torch.manual_seed(0)
        model = build_gpt_model(facts, config, vp_stage=vp)
        return model if lora is None else add_adapters(model, lora, seed=0)

    actor = ActorWorker(ActorSettings(ppo_mini_batch_size=8, micro_batch_size=8, vocab_size=facts.vocab_size,
                                      optimizer=OptimizerSettings(lr=1e-3)), provide, layout)
    actor.init(parallel_state_ready=True)
    batch = rollout_batch()
    batch = replace(batch, input_ids=batch.input_ids % facts.vocab_size)
    batch = replace(batch, old_log_probs=actor.compute_log_prob(batch)[0])
    actor.update(batch)
    model = unwrap(actor.chunks[0])
    result = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "gradient_bytes": sum(_tensor_bytes([buffer.grad_data]) for chunk in actor.chunks for buffer in chunk.buffers),
        "optimizer_bytes": _optimizer_bytes(actor.optimizer),
    }
    if lora is None:
        # The final RMSNorm gives the hidden state norm at most c = max|gamma| sqrt(h), so token u's logit lies in
        # [-c|E_u|, c|E_u|] whatever the layers before (and their adapters) do: p(v) <= e^(c|E_v|) /
        # (e^(c|E_v|) + sum_u!=v e^(-c|E_u|)). "aligned": p(v) with the hidden state along E_v, which is reachable.
        embedding = model.embedding.word_embeddings.weight.detach()[: facts.vocab_size].float()
        gamma = float(model.decoder.final_layernorm.weight.detach().abs().max())
        c = gamma * math.sqrt(hf["hidden_size"])
        norms = embedding.norm(dim=1)
        aligned = c * (embedding / norms[:, None]) @ embedding.T  # [hidden state along E_v, token]
        result["max_probability"] = {}
        for t in temperatures:
            # 1 / (1 + sum_u!=v e^(-c(|E_u| + |E_v|)/t)), in log space: the exponentials overflow at small t.
            spread = -(c / t) * (norms[:, None] + norms[None, :])
            spread.fill_diagonal_(-math.inf)
            bound = torch.exp(-torch.log1p(torch.exp(torch.logsumexp(spread, dim=1))))
            result["max_probability"][str(t)] = {"bound": float(bound.max()),
                                                 "aligned": float(torch.softmax(aligned / t, dim=1).diagonal().max())}
        result["embedding_row_norm_mean"] = float(embedding.norm(dim=1).mean())
    return result


def _job(hf: dict, rank: int, alpha: float, temperatures: list[float], saved: tuple[str, ...]) -> dict:
    return {"full": measure(hf, 0, alpha, temperatures), "lora": measure(hf, rank, alpha, temperatures, saved)}


def main() -> None:
    from rlmegatron.models.hf_config import read_hf_config
    from rlmegatron.transport.local_ranks import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--hidden", type=int, default=None, help="override the quickstart model's hidden size")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.1])
    parser.add_argument("--modules-to-save", nargs="*", default=[], choices=["embedding", "output_layer"])
    args = parser.parse_args()
    hf = read_hf_config(QUICKSTART_MODEL)
    if args.hidden:
        hf.update(hidden_size=args.hidden, intermediate_size=2 * args.hidden, head_dim=args.hidden // 4)
    if args.layers:
        hf.update(num_hidden_layers=args.layers, max_window_layers=args.layers)
    if args.vocab:
        hf.update(vocab_size=args.vocab)
    report = run_ranks(_job, 1, hf, args.rank, args.alpha, args.temperatures, tuple(args.modules_to_save),
                       timeout_s=1800)[0]
    full, lora = report["full"], report["lora"]
    for name in ("gradient_bytes", "optimizer_bytes"):
        report[f"{name}_saved"] = 1 - lora[name] / full[name]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
