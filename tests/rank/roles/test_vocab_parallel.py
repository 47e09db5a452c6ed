"""The fused vocab-parallel log-prob and entropy against plain full-vocabulary torch, values and gradients, at TP=1
and TP=2 (gloo), with a temperature and Megatron's vocabulary padding."""
from __future__ import annotations

import math

import pytest
import torch

from rlmegatron.runtime import ParallelLayout, init_model_parallel

from rlmegatron.transport.local_ranks import run_ranks

PADDED, TOKENS = 40, 12  # TP=2 shards of 20


def reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab: int):
    log_softmax = torch.log_softmax(logits[:, :vocab].double() / temperature, dim=-1)
    log_probs = log_softmax.gather(-1, labels[:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


def job(tp: int, temperature: float, vocab: int) -> dict:
    from rlmegatron.rank.roles.vocab_parallel import vocab_parallel_log_probs_and_entropy

    init_model_parallel(ParallelLayout(tp=tp))
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(0)
    # Spread-out logits: some probabilities underflow to 0 in fp32, where 0 log 0 must count as 0.
    logits = torch.randn(TOKENS, PADDED, generator=generator) * 30
    labels = torch.randint(0, vocab, (TOKENS,), generator=generator)
    weights = torch.randn(2, TOKENS, generator=generator)
    shard = PADDED // tp
    local = logits[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs_and_entropy(local, labels, temperature, True, vocab)
    ((weights[0] * log_probs).sum() + (weights[1] * entropy).sum()).backward()

    full = logits.double().requires_grad_()
    ref_log_probs, ref_entropy = reference(full, labels, temperature, vocab)
    ((weights[0] * ref_log_probs).sum() + (weights[1] * ref_entropy).sum()).backward()
    no_entropy, none = vocab_parallel_log_probs_and_entropy(local.detach(), labels, temperature, False, vocab)
    # A label in the vocabulary's padding (filler tokens of a batch): a finite, very negative log-prob, as
    # Megatron's cross-entropy gives, not -inf or NaN; the other tokens are unaffected.
    padding_labels = labels.clone()
    padding_labels[0] = vocab + 1
    padded, _ = vocab_parallel_log_probs_and_entropy(local.detach(), padding_labels, temperature, True, vocab)
    return {
        "padding_label": float(padded[0]),
        "others_unchanged": torch.equal(padded[1:], log_probs.detach()[1:]),
        "log_probs": float((log_probs.double() - ref_log_probs.detach()).abs().max()),
        "entropy": float((entropy.double() - ref_entropy.detach()).abs().max()),
        "grad": float((local.grad.double() - full.grad[:, rank * shard : (rank + 1) * shard]).abs().max()),
        "grad_scale": float(full.grad.abs().max()),
        "without_entropy_equal": torch.equal(no_entropy, log_probs.detach()) and none is None,
    }


# 37 real ids: the last shard holds 3 padding ids; 15: TP=2's second shard is padding alone.
@pytest.mark.parametrize("tp, vocab", [(1, 37), (2, 37), (2, 15)])
def test_log_probs_entropy_and_their_gradients_equal_full_vocabulary_torch(tp, vocab):
    for report in run_ranks(job, tp, tp, 0.7, vocab, timeout_s=120):
        assert report["grad_scale"] > 0.1  # the gradient is not trivially zero
        assert report["log_probs"] < 1e-5 and report["entropy"] < 1e-5 and report["grad"] < 1e-6, report
        assert report["without_entropy_equal"]
        assert -math.inf < report["padding_label"] < -1e20 and report["others_unchanged"], report
