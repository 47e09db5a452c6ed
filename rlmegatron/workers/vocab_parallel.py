"""Log-probs and entropy of tokens from vocab-parallel logits, without gathering the vocabulary across TP."""
from __future__ import annotations

import torch


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """log p(label) and entropy H of softmax(logits / T), the last dim being this TP rank's vocabulary shard.

    One fp32 vocabulary-sized buffer is made, turned in place into p, and it is all that backward keeps: both
    gradients are functions of p alone,
        d log p(y) / dx_i = [i = y] - p_i,    dH / dx_i = -p_i (log p_i + H),
    so neither the shifted logits nor a second softmax are saved (Megatron's cross-entropy and a separate entropy
    kept three such buffers per token: on an H100 they capped a 0.5 B model's micro-batch at 4 x 2048 tokens).
    Four all-reduces of per-token scalars (max, label logit, sum exp, sum p log p); backward needs none.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature: float, vocab_size, with_entropy: bool, group):
        rank, shard = torch.distributed.get_rank(group), logits.shape[-1]
        first_id = rank * shard
        x = logits.float() / temperature  # a new fp32 buffer, whatever the logits' dtype: reused in place below
        if vocab_size is not None and first_id + shard > vocab_size:
            # Megatron pads the vocabulary to a multiple of TP; the padding ids get no probability. A large finite
            # value, not -inf: a label id in the padding (a batch's filler tokens) then has a very negative but
            # finite log-prob, as in Megatron's cross-entropy, instead of an infinite one.
            x[..., max(vocab_size - first_id, 0):] = -1e30
        x_max = x.max(dim=-1).values
        torch.distributed.all_reduce(x_max, op=torch.distributed.ReduceOp.MAX, group=group)
        x.sub_(x_max.unsqueeze(-1))
        local_label = labels - first_id
        in_shard = (local_label >= 0) & (local_label < shard)
        local_label = local_label.clamp(0, shard - 1)
        label_logit = torch.where(in_shard, x.gather(-1, local_label.unsqueeze(-1)).squeeze(-1), 0.0)
        torch.distributed.all_reduce(label_logit, group=group)
        probs = x.exp_()
        sum_exp = probs.sum(dim=-1)
        torch.distributed.all_reduce(sum_exp, group=group)
        probs.div_(sum_exp.unsqueeze(-1))
        log_probs = label_logit - sum_exp.log()
        entropy = None
        if with_entropy:
            entropy = -torch.special.xlogy(probs, probs).sum(dim=-1)  # 0 log 0 = 0: padding and underflow
            torch.distributed.all_reduce(entropy, group=group)
        ctx.save_for_backward(probs, local_label, in_shard, entropy)
        ctx.temperature, ctx.input_dtype = temperature, logits.dtype
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        probs, local_label, in_shard, entropy = ctx.saved_tensors
        grad_log_probs = torch.zeros_like(probs[..., 0]) if grad_log_probs is None else grad_log_probs
        grad = probs * -grad_log_probs.unsqueeze(-1)
        grad.scatter_add_(-1, local_label.unsqueeze(-1), (grad_log_probs * in_shard).unsqueeze(-1))
        if grad_entropy is not None and entropy is not None:
            dentropy = torch.special.xlogy(probs, probs).addcmul_(probs, entropy.unsqueeze(-1))
            grad.addcmul_(dentropy, grad_entropy.unsqueeze(-1), value=-1.0)
        return (grad / ctx.temperature).to(ctx.input_dtype), None, None, None, None, None


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
    from megatron.core import parallel_state

    return _VocabParallelLogProbEntropy.apply(
        logits, labels, temperature, vocab_size, with_entropy, parallel_state.get_tensor_model_parallel_group()
    )
