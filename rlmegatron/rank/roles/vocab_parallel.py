"""Log-probs and entropy of tokens from vocab-parallel logits, without gathering the vocabulary across TP."""
from __future__ import annotations

import torch

from rlmegatron.runtime.distributed import all_reduce_shared


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
        # Megatron pads the vocabulary to a multiple of 128 x TP, and the padding ids get no probability: only the
        # ids below vocab_size are computed on (TRL's 48-token echo model has 128 logits, 80 of them padding; exp
        # and xlogy of -1e30 there were 2.7x the work and ran on a slow underflow path). A shard of padding alone
        # keeps one column at -1e30 so that it still joins the collectives.
        real = shard if vocab_size is None else min(shard, max(vocab_size - first_id, 0))
        x = logits[..., : max(real, 1)].float() / temperature  # a new fp32 buffer, reused in place below
        if real == 0:
            x.fill_(-1e30)
        x_max = x.max(dim=-1).values
        all_reduce_shared(x_max, group, torch.distributed.ReduceOp.MAX)
        x.sub_(x_max.unsqueeze(-1))
        local_label = labels - first_id
        in_shard = (local_label >= 0) & (local_label < shard)
        in_vocab = in_shard & (local_label < real)
        local_label = local_label.clamp(0, x.shape[-1] - 1)
        # A label in the padding (a batch's filler tokens) gets a very negative but finite log-prob, as in
        # Megatron's cross-entropy, instead of an infinite one.
        label_logit = torch.where(in_vocab, x.gather(-1, local_label.unsqueeze(-1)).squeeze(-1),
                                  torch.where(in_shard, -1e30, 0.0))
        all_reduce_shared(label_logit, group)
        probs = x.exp_()
        sum_exp = probs.sum(dim=-1)
        all_reduce_shared(sum_exp, group)
        probs.div_(sum_exp.unsqueeze(-1))
        log_probs = label_logit - sum_exp.log()
        entropy = None
        if with_entropy:
            entropy = -torch.special.xlogy(probs, probs).sum(dim=-1)  # 0 log 0 = 0: padding and underflow
            all_reduce_shared(entropy, group)
        ctx.save_for_backward(probs, local_label, in_vocab, entropy)
        ctx.temperature, ctx.input_dtype, ctx.shard = temperature, logits.dtype, shard
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        probs, local_label, in_vocab, entropy = ctx.saved_tensors
        grad_log_probs = torch.zeros_like(probs[..., 0]) if grad_log_probs is None else grad_log_probs
        grad = probs * -grad_log_probs.unsqueeze(-1)
        grad.scatter_add_(-1, local_label.unsqueeze(-1), (grad_log_probs * in_vocab).unsqueeze(-1))
        if grad_entropy is not None and entropy is not None:
            dentropy = torch.special.xlogy(probs, probs).addcmul_(probs, entropy.unsqueeze(-1))
            grad.addcmul_(dentropy, grad_entropy.unsqueeze(-1), value=-1.0)
        grad = (grad / ctx.temperature).to(ctx.input_dtype)
        if grad.shape[-1] < ctx.shard:  # the padding ids' logits had no effect: zero gradient
            grad = torch.nn.functional.pad(grad, (0, ctx.shard - grad.shape[-1]))
        return grad, None, None, None, None, None


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
