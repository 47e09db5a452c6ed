"""Rank-side code for the worker tests: tiny GPTModels, a synthetic rollout batch, and per-layout jobs."""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from rlmegatron.runtime import ParallelLayout, init_model_parallel
from rlmegatron.workers import ActorSettings, ActorWorker, OptimizerSettings, RolloutBatch, gpt_model_provider
from tests.helpers.megatron_parity import transformer_config

VOCAB = 128
PROMPT, RESPONSE = 6, 6


def rollout_batch(n: int = 8, seed: int = 3) -> RolloutBatch:
    """Left-padded prompts, right-padded responses of varied lengths, with PPO fields filled in."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (n, PROMPT + RESPONSE), generator=gen)
    attention_mask = torch.zeros(n, PROMPT + RESPONSE, dtype=torch.long)
    response_mask = torch.zeros(n, RESPONSE)
    for i in range(n):
        prompt_len = 2 + i % (PROMPT - 1)
        response_len = 1 + (3 * i) % RESPONSE
        attention_mask[i, PROMPT - prompt_len : PROMPT + response_len] = 1
        response_mask[i, :response_len] = 1
    input_ids = input_ids * attention_mask
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        advantages=torch.randn(n, RESPONSE, generator=gen) * response_mask,
        ref_log_probs=(-5.0 + torch.randn(n, RESPONSE, generator=gen)) * response_mask,
    )


def make_actor(layout: ParallelLayout, kind: str = "dense", **settings) -> ActorWorker:
    init_model_parallel(layout)
    config = transformer_config(kind, layout, dispatcher="alltoall")
    provider = gpt_model_provider(config, VOCAB, PROMPT + RESPONSE, tie_embeddings=(kind == "dense"), use_te=False)
    # adam_eps=1: the first Adam step is ~lr*g, not lr*sign(g), so grad rounding is not amplified.
    defaults = dict(ppo_mini_batch_size=8, micro_batch_size=2, temperature=0.7, use_kl_loss=True,
                    entropy_coeff=0.01, optimizer=OptimizerSettings(lr=1e-2, adam_eps=1.0, clip_grad=1.0))
    actor = ActorWorker(ActorSettings(**{**defaults, **settings}), provider, layout)
    actor.init(parallel_state_ready=True)
    return actor


def full_parameters(path: str, kind: str = "dense") -> dict[str, torch.Tensor]:
    """Weights saved at any layout, loaded at TP=PP=1 as full tensors."""
    actor = make_actor(ParallelLayout(), kind)
    actor.load_weights(path)
    return {n: p.detach().clone() for n, p in actor.chunks[0].module.named_parameters()}


def parity_job(layouts: list[ParallelLayout], workdir: str) -> dict:
    """Log-probs, entropy and one PPO update at each layout vs TP=PP=1, plus packing and dynamic-bsz checks."""
    batch = rollout_batch()
    weights = os.path.join(workdir, "weights")
    make_actor(ParallelLayout()).save_weights(weights)
    # Every actor, the TP=1 reference included, starts from the checkpoint (see the report on why).
    reference = make_actor(ParallelLayout())
    reference.load_weights(weights)
    ref_log_probs, ref_entropy = reference.compute_log_prob(batch)
    padded = make_actor(ParallelLayout(), use_packing=False)
    padded.load_weights(weights)
    padded_log_probs, padded_entropy = padded.compute_log_prob(batch)

    train_batch = replace(batch, old_log_probs=ref_log_probs - 0.05 * batch.response_mask)
    report = {
        "log_probs": ref_log_probs,
        "entropy": ref_entropy,
        "padded_log_probs_diff": float((padded_log_probs - ref_log_probs).abs().max()),
        "padded_entropy_diff": float((padded_entropy - ref_entropy).abs().max()),
        "layouts": {},
    }
    metrics = reference.update(train_batch)
    report["metrics"] = metrics
    reference.save_weights(os.path.join(workdir, "updated-ref"))
    padded_metrics = padded.update(train_batch)
    report["padded_pg_loss_diff"] = abs(padded_metrics["actor/pg_loss"] - metrics["actor/pg_loss"])
    padded.save_weights(os.path.join(workdir, "updated-padded"))

    for layout in layouts:
        actor = make_actor(layout)
        actor.load_weights(weights)
        log_probs, entropy = actor.compute_log_prob(batch)
        layout_metrics = actor.update(train_batch)
        actor.save_weights(os.path.join(workdir, f"updated-{layout}"))
        report["layouts"][str(layout)] = {
            "log_probs_diff": float((log_probs - ref_log_probs).abs().max()),
            "entropy_diff": float((entropy - ref_entropy).abs().max()),
            "pg_loss_diff": abs(layout_metrics["actor/pg_loss"] - metrics["actor/pg_loss"]),
        }

    expected = full_parameters(os.path.join(workdir, "updated-ref"))
    initial = full_parameters(weights)
    report["update_size"] = max(float((expected[n] - initial[n]).abs().max()) for n in expected)
    for label in ["padded", *map(str, layouts)]:
        params = full_parameters(os.path.join(workdir, f"updated-{label}"))
        diff = max(float((params[n] - expected[n]).abs().max()) for n in expected)
        if label == "padded":
            report["padded_param_diff"] = diff
        else:
            report["layouts"][label]["param_diff"] = diff
    return report

