"""Log-probs and entropy of tokens from vocab-parallel logits, without gathering the vocabulary across TP."""
from __future__ import annotations

import torch


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax(logits) where the last dim is this TP rank's vocabulary shard.

    H = log Z - E_p[x] needs three all-reduces (max, sum exp, sum p*x). The gradient
    dH/dx_i = -p_i (x_i - E_p[x]) is local to each shard, so backward needs no communication.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group) -> torch.Tensor:
        logits_max = logits.max(dim=-1).values
        torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        exp_shifted = shifted.exp()
        sum_exp = exp_shifted.sum(dim=-1)
        torch.distributed.all_reduce(sum_exp, group=group)
        probs = exp_shifted / sum_exp.unsqueeze(-1)
        expected_shifted = (probs * shifted).sum(dim=-1)
        torch.distributed.all_reduce(expected_shifted, group=group)
        ctx.save_for_backward(probs, shifted, expected_shifted)
        return sum_exp.log() - expected_shifted

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor):
        probs, shifted, expected_shifted = ctx.saved_tensors
        grad_logits = -probs * (shifted - expected_shifted.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad_logits, None


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy [...] of logits [..., vocab/TP] sharded over the tensor-parallel group."""
    from megatron.core import parallel_state

    return _VocabParallelEntropy.apply(logits, parallel_state.get_tensor_model_parallel_group())


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and entropy per token of logits [..., vocab/TP] scaled by the rollout temperature.

    Ids at or beyond `vocab_size` (Megatron's TP padding of the vocabulary) get no probability.
    """
    from megatron.core import parallel_state, tensor_parallel

    scaled = logits.float() / temperature
    if vocab_size is not None:
        shard = scaled.shape[-1]
        first_id = parallel_state.get_tensor_model_parallel_rank() * shard
        if first_id + shard > vocab_size:
            padding = torch.arange(first_id, first_id + shard, device=scaled.device) >= vocab_size
            # A large finite value, not -inf: the entropy's p * logit must stay 0 * x, never 0 * inf.
            scaled = scaled.masked_fill(padding, -1e30)
    entropy = vocab_parallel_entropy(scaled) if with_entropy else None
    # vocab_parallel_cross_entropy subtracts the max from its input in place; the entropy above
    # saved only its own tensors, so sharing `scaled` is safe and saves a vocab-sized copy.
    log_probs = -tensor_parallel.vocab_parallel_cross_entropy(scaled, labels)
    return log_probs, entropy
