"""Rank-side code for the worker tests: tiny GPTModels, a synthetic rollout batch, and per-layout jobs."""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from rlmegatron.algorithms import policy_mismatch
from rlmegatron.runtime import ParallelLayout, init_model_parallel, layout_scope
from rlmegatron.rank.roles import (
    ActorSettings,
    ActorWorker,
    CriticSettings,
    CriticWorker,
    OptimizerSettings,
    ReferenceWorker,
    RolloutBatch,
    gpt_model_provider,
)
from tests.helpers.megatron_parity import transformer_config

VOCAB = 128
PROMPT, RESPONSE = 6, 6


def rollout_batch(n: int = 8, seed: int = 3, samples_per_prompt: int = 1,
                  lengths: list[tuple[int, int]] | None = None) -> RolloutBatch:
    """Left-padded prompts, right-padded responses of varied lengths (or row i's (prompt, response) lengths
    `lengths[i]`), with PPO fields filled in; each prompt is the prompt of `samples_per_prompt` consecutive rows
    (GRPO's group)."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (n, PROMPT + RESPONSE), generator=gen)
    attention_mask = torch.zeros(n, PROMPT + RESPONSE, dtype=torch.long)
    response_mask = torch.zeros(n, RESPONSE)
    for i in range(n):
        first = i - i % samples_per_prompt
        input_ids[i, :PROMPT] = input_ids[first, :PROMPT]
        prompt_len, response_len = (2 + first % (PROMPT - 1), 1 + (3 * i) % RESPONSE) if lengths is None \
            else lengths[i]
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


def model_provider(layout: ParallelLayout, kind: str = "dense", tie_embeddings: bool | None = None,
                   init_groups: bool = True, **config_fields):
    """Build the parallel groups for `layout` (unless already built) and a provider of the tiny `kind` GPTModel
    (`config_fields` replace its TransformerConfig's)."""
    if init_groups:
        init_model_parallel(layout)
    config = replace(transformer_config(kind, layout, dispatcher="alltoall"), **config_fields)
    tie = (kind == "dense") if tie_embeddings is None else tie_embeddings
    return gpt_model_provider(config, VOCAB, PROMPT + RESPONSE, tie_embeddings=tie, use_te=False)


# adam_eps=1: the first Adam step is ~lr*g, not lr*sign(g), so grad rounding is not amplified.
OPTIMIZER = OptimizerSettings(lr=1e-2, adam_eps=1.0, clip_grad=1.0)
ACTOR_DEFAULTS = dict(ppo_mini_batch_size=8, micro_batch_size=2, temperature=0.7, use_kl_loss=True,
                      entropy_coeff=0.01, optimizer=OPTIMIZER, use_packing=True)


def make_actor(layout: ParallelLayout, kind: str = "dense", **settings) -> ActorWorker:
    actor = ActorWorker(ActorSettings(**{**ACTOR_DEFAULTS, **settings}), model_provider(layout, kind), layout)
    actor.init(parallel_state_ready=True)
    return actor


def make_reference(layout: ParallelLayout) -> ReferenceWorker:
    reference = ReferenceWorker(ActorSettings(**ACTOR_DEFAULTS), model_provider(layout), layout)
    reference.init(parallel_state_ready=True)
    return reference


def make_critic(layout: ParallelLayout, **settings) -> CriticWorker:
    settings = CriticSettings(**{**dict(ppo_mini_batch_size=8, micro_batch_size=2, cliprange_value=0.5,
                                        optimizer=OPTIMIZER), **settings})
    critic = CriticWorker(settings, model_provider(layout, tie_embeddings=False), layout)
    critic.init(parallel_state_ready=True)
    return critic


def make_reward_model_critic(layout: ParallelLayout, path: str) -> CriticWorker:
    """A critic built from an HF reward model's config.json and initialised from its weights."""
    from rlmegatron.models.hf_config import build_gpt_model, model_facts, read_hf_config, transformer_config

    init_model_parallel(layout)
    facts = replace(model_facts(read_hf_config(path), layout.tp), tie_word_embeddings=False)
    config = transformer_config(facts, layout)
    settings = CriticSettings(ppo_mini_batch_size=8, micro_batch_size=2, optimizer=OPTIMIZER)
    critic = CriticWorker(settings, lambda pre, post, vp: build_gpt_model(facts, config, vp_stage=vp), layout)
    critic.init(parallel_state_ready=True)
    critic.load_reward_model(path, facts)
    return critic


def full_parameters(*paths: str, kind: str = "dense") -> list[dict[str, torch.Tensor]]:
    """Weights saved at any layout, each loaded at TP=PP=1 as full tensors, into one actor built once."""
    actor = make_actor(ParallelLayout(), kind)
    loaded = []
    for path in paths:
        actor.load_weights(path)
        loaded.append({n: p.detach().clone() for n, p in actor.chunks[0].module.named_parameters()})
    return loaded


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def parity_job(layout_variants: list[tuple[str, ParallelLayout, dict]], workdir: str) -> dict:
    """The TP=PP=1 actor vs padded, dynamic-bsz and each (label, layout, actor settings); reference; offload.
    The batch's prompts are each two rows', which saves enough for the layouts that support it to lay each out
    once (models/shared_prompts.py); each variant reports whether it did."""
    batch = rollout_batch(samples_per_prompt=2)
    weights = os.path.join(workdir, "weights")
    make_actor(ParallelLayout()).save_weights(weights)
    # Every actor, the TP=1 baseline included, starts from the checkpoint: fresh models differ by init RNG.
    baseline = make_actor(ParallelLayout())
    baseline.load_weights(weights)
    log_probs, entropy = baseline.compute_log_prob(batch)
    train_batch = replace(batch, old_log_probs=log_probs - 0.05 * batch.response_mask)
    metrics = baseline.update(train_batch)
    baseline.save_weights(os.path.join(workdir, "updated-baseline"))
    report = {"log_probs": log_probs, "entropy": entropy, "metrics": metrics, "variants": {}}

    reference = make_reference(ParallelLayout())
    reference.load_weights(weights)
    ref_log_probs = reference.compute_log_prob(batch)
    reference.offload()
    reference.onload()
    report["reference_equal"] = torch.equal(ref_log_probs, log_probs)
    report["reference_equal_after_offload"] = torch.equal(reference.compute_log_prob(batch), log_probs)

    # A second update after an offload round trip must equal one without: weights, grads and Adam state survive.
    offloaded = make_actor(ParallelLayout())
    offloaded.load_weights(weights)
    offloaded.update(train_batch)
    offloaded.offload()
    report["offloaded_bytes"] = offloaded.offloader.offloaded_bytes
    offloaded.onload()
    offloaded.update(train_batch)
    offloaded.save_weights(os.path.join(workdir, "twice-offloaded"))
    baseline.update(train_batch)
    baseline.save_weights(os.path.join(workdir, "twice-baseline"))

    # The dynamic-bsz budget of 10 tokens gives DP ranks different micro-batch counts than the fixed size 2 (and
    # splits a group of two, which alone would not save enough to share by default).
    variants = [("padded", ParallelLayout(), {"use_packing": False, "share_prompts": False}),
                ("packed", ParallelLayout(), {"share_prompts": False}),
                ("dynamic-bsz", ParallelLayout(), {"max_token_len": 10, "share_prompts": True}),
                *layout_variants]
    report["shared"] = {"baseline": _lays_prompts_out_shared(baseline, batch)}
    for label, layout, settings in variants:
        actor = make_actor(layout, **settings)
        actor.load_weights(weights)
        report["shared"][label] = _lays_prompts_out_shared(actor, batch)
        variant_log_probs, variant_entropy = actor.compute_log_prob(batch)
        variant_metrics = actor.update(train_batch)
        actor.save_weights(os.path.join(workdir, f"updated-{label}"))
        report["variants"][label] = {
            "log_probs_diff": float((variant_log_probs - log_probs).abs().max()),
            "entropy_diff": float((variant_entropy - entropy).abs().max()),
            "pg_loss_diff": abs(variant_metrics["actor/pg_loss"] - metrics["actor/pg_loss"]),
        }

    names = ["updated-baseline", "weights", *(f"updated-{label}" for label, _, _ in variants), "twice-offloaded",
             "twice-baseline"]
    full = dict(zip(names, full_parameters(*(os.path.join(workdir, name) for name in names))))
    expected = full["updated-baseline"]
    report["update_size"] = _max_diff(expected, full["weights"])
    for label, _, _ in variants:
        report["variants"][label]["param_diff"] = _max_diff(full[f"updated-{label}"], expected)
    report["offload_param_diff"] = _max_diff(full["twice-offloaded"], full["twice-baseline"])
    return report


def _lays_prompts_out_shared(worker, batch: RolloutBatch) -> bool:
    from rlmegatron.models.shared_prompts import SharedPromptParams
    from rlmegatron.rank.roles.training import micro_batches

    return all(isinstance(micro.packed_seq_params, SharedPromptParams)
               for micro in micro_batches(worker.settings, batch, worker.chunks))


def plugin_loss_job(reference: str) -> dict:
    """One update with the user's loss `reference` and one with the built-in `gpg`, from the same initial weights."""
    batch = rollout_batch()
    report = {}
    for name in (reference, "gpg"):
        torch.manual_seed(0)  # the tiny model initialises on the CPU generator: the same weights both times
        actor = make_actor(ParallelLayout(), policy_loss=name)
        initial = {n: p.detach().clone() for n, p in actor.chunks[0].module.named_parameters()}
        log_probs, _ = actor.compute_log_prob(batch, with_entropy=False)
        metrics = actor.update(replace(batch, old_log_probs=log_probs))
        updated = {n: p.detach().clone() for n, p in actor.chunks[0].module.named_parameters()}
        report[name] = {"metrics": metrics, "initial": initial, "updated": updated}
    return report


def on_policy_job() -> dict:
    """One on-policy update (one epoch, one mini-batch) with the old log-probs of a separate pass, and one without
    them (the update's own forward, detached), from the same initial weights; then an update that is not
    on-policy without them."""
    batch = rollout_batch()
    report = {}
    for name in ("with the pass", "without"):
        torch.manual_seed(0)  # the tiny model initialises on the CPU generator: the same weights both times
        actor = make_actor(ParallelLayout())
        old_log_probs = actor.compute_log_prob(batch, with_entropy=False)[0] if name == "with the pass" else None
        metrics = actor.update(replace(batch, old_log_probs=old_log_probs))
        updated = {n: p.detach().clone() for n, p in actor.chunks[0].module.named_parameters()}
        report[name] = {"metrics": metrics, "updated": updated}
    # With the engine's log-probs of the sampled tokens (here the trainer's, moved): the mismatch the old-log-prob
    # pass measures, and the one the on-policy update measures from its own forward.
    torch.manual_seed(0)
    actor = make_actor(ParallelLayout())
    old_log_probs = actor.compute_log_prob(batch, with_entropy=False)[0]
    rollout_log_probs = (old_log_probs + 0.1 * torch.randn(old_log_probs.shape)) * batch.response_mask
    report["mismatch of the pass"] = policy_mismatch(old_log_probs, rollout_log_probs, batch.response_mask)
    report["mismatch of the update"] = {
        name: value for name, value in actor.update(replace(batch, rollout_log_probs=rollout_log_probs)).items()
        if name.startswith(("training/rollout_probs_diff", "training/rollout_kl"))}
    try:
        make_actor(ParallelLayout(), ppo_epochs=2).update(batch)
    except ValueError as error:
        report["two epochs"] = str(error)
    return report


def critic_and_moe_job(workdir: str) -> dict:
    """Critic values at TP=2 and CP=2 vs TP=1 and value-loss descent; one PPO update of a MoE actor at EP=2; the EP=2
    actor's micro-batches in every layout (moe_micro_batch_counts_job)."""
    batch = rollout_batch()
    actor_weights = os.path.join(workdir, "actor")
    make_actor(ParallelLayout()).save_weights(actor_weights)
    critic = make_critic(ParallelLayout())
    critic.load_actor_weights(actor_weights)
    values = critic.compute_values(batch)
    # The saved critic stands in for a reward-model checkpoint: it has a value head to load.
    critic_weights = os.path.join(workdir, "critic")
    critic.save_weights(critic_weights)

    tp2_critic = make_critic(ParallelLayout(tp=2))
    tp2_critic.load_weights(critic_weights)
    report = {"values": values, "values_tp2_diff": float((tp2_critic.compute_values(batch) - values).abs().max())}
    # Each prompt of two rows laid out once: the value at the prompt's last position serves both responses.
    grouped = rollout_batch(samples_per_prompt=2)
    shared_critic, unshared_critic = (make_critic(ParallelLayout(), share_prompts=share) for share in (True, False))
    for each in (shared_critic, unshared_critic):
        each.load_weights(critic_weights)
    report["values_shared_diff"] = float((shared_critic.compute_values(grouped)
                                          - unshared_critic.compute_values(grouped)).abs().max())
    report["values_shared_size"] = float(unshared_critic.compute_values(grouped).abs().max())
    report["values_shared_layouts"] = [_lays_prompts_out_shared(each, grouped)
                                       for each in (shared_critic, unshared_critic)]
    gen = torch.Generator().manual_seed(5)
    returns = (values + 0.3 * torch.randn(values.shape, generator=gen)) * batch.response_mask
    train_batch = replace(batch, values=values, returns=returns)
    report["critic_metrics"] = [tp2_critic.update(train_batch) for _ in range(4)]
    cp2_critic = make_critic(ParallelLayout(cp=2))  # builds the CP=2 groups: after the TP=2 critic's last call
    cp2_critic.load_weights(critic_weights)
    report["values_cp2_diff"] = float((cp2_critic.compute_values(batch) - values).abs().max())

    moe = make_actor(ParallelLayout(ep=2), kind="moe")
    before = {n: p.detach().clone() for n, p in moe.chunks[0].module.named_parameters()}
    moe_log_probs, _ = moe.compute_log_prob(batch, with_entropy=False)
    report["moe_metrics"] = moe.update(replace(batch, old_log_probs=moe_log_probs))
    after = dict(moe.chunks[0].module.named_parameters())
    report["moe_param_change"] = {n: float((after[n] - before[n]).abs().max()) for n in before}

    # A reference at EP=4 beside the EP=2 actor: each built and run under its own groups, switched by layout_scope.
    actor_layout, reference_layout = ParallelLayout(ep=2), ParallelLayout(ep=4)
    init_model_parallel(actor_layout, others=[reference_layout])
    moe = ActorWorker(ActorSettings(**ACTOR_DEFAULTS), model_provider(actor_layout, "moe", init_groups=False),
                      actor_layout)
    moe.init(parallel_state_ready=True)
    moe.save_weights(os.path.join(workdir, "moe"))
    moe.load_weights(os.path.join(workdir, "moe"))  # fresh inits differ over DP ranks here; the saved replica does not
    with layout_scope(reference_layout):
        reference = ReferenceWorker(ActorSettings(**ACTOR_DEFAULTS),
                                    model_provider(reference_layout, "moe", init_groups=False), reference_layout)
        reference.init(parallel_state_ready=True)
        reference.load_weights(os.path.join(workdir, "moe"))
        moe_ref_log_probs = reference.compute_log_prob(batch)
    moe_log_probs = moe.compute_log_prob(batch, with_entropy=False)[0]
    report["moe_log_probs"] = moe_log_probs
    report["moe_local_experts"] = [len(chunk.decoder.layers[0].mlp.experts.local_experts)
                                   for chunk in (moe.chunks[0].module, reference.chunks[0])]
    report["moe_reference_diff"] = float((moe_ref_log_probs - moe_log_probs).abs().max())

    reward_model = os.path.join(workdir, "reward_model")  # written by the test
    report["reward_model_values"] = make_reward_model_critic(ParallelLayout(tp=2), reward_model).compute_values(batch)
    report["moe_counts"] = moe_micro_batch_counts_job(workdir)
    return report


# Each layout at EP=2 on a batch whose token-balanced DP shares cut into different numbers of micro-batches:
# two long rows and fourteen short ones over DP=4 give ranks 3 and 5 rows. One row per micro-batch (padded) leaves
# the 3-row ranks 2 fillers short of the others; pairs (packed), a token budget and shared prompts need splits, and
# the shared prompt's rank (one unit of two rows) a filler too.
MOE_COUNT_LENGTHS = [(6, 6), (6, 6)] + [(2, 1)] * 14
MOE_COUNT_VARIANTS = {
    "padded": dict(use_packing=False, share_prompts=False, micro_batch_size=1),
    "packed": dict(use_packing=True, share_prompts=False, micro_batch_size=2),
    "shared-prompt": dict(share_prompts=True, micro_batch_size=2),
    "dynamic-bsz": dict(share_prompts=False, max_token_len=16),
}


def moe_micro_batch_counts_job(workdir: str) -> dict:
    """At DP=4, an EP=1 actor's log-probs before and after one update, then per layout variant the EP=2 actor's, with
    its micro-batch counts per rank, how many are fillers and the layouts of the others. No router aux loss: a filler
    runs the router on real tokens, which an aux loss would count (megatron_step._same_count_as_peers)."""
    from rlmegatron.rank.roles.training import micro_batches

    batch = rollout_batch(n=16, seed=7, samples_per_prompt=2, lengths=MOE_COUNT_LENGTHS)
    train_batch = replace(batch, old_log_probs=-2.0 * batch.response_mask)
    weights = os.path.join(workdir, "moe-counts")
    report: dict = {}
    for label, ep, settings in [("ep1", 1, MOE_COUNT_VARIANTS["padded"]),
                                *((label, 2, settings) for label, settings in MOE_COUNT_VARIANTS.items())]:
        layout = ParallelLayout(ep=ep)
        # One mini-batch of the whole batch: the update runs the micro-batches reported.
        actor = ActorWorker(ActorSettings(**{**ACTOR_DEFAULTS, "ppo_mini_batch_size": len(batch), **settings}),
                            model_provider(layout, "moe", moe_aux_loss_coeff=0.0), layout)
        actor.init(parallel_state_ready=True)
        if ep == 1:
            actor.save_weights(weights)  # every actor starts from these
        actor.load_weights(weights)
        mine = micro_batches(actor.settings, batch, actor.chunks)
        counts = torch.tensor([len(mine), sum(not micro.rows for micro in mine)])
        every = [torch.zeros(2, dtype=torch.long) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(every, counts)
        before = actor.compute_log_prob(batch, with_entropy=False)[0]
        metrics = actor.update(train_batch)
        report[label] = {"counts": [int(c[0]) for c in every], "fillers": [int(c[1]) for c in every],
                         "layouts": sorted({_layout_of(micro) for micro in mine if micro.rows}),
                         "before": before, "after": actor.compute_log_prob(batch, with_entropy=False)[0],
                         "pg_loss": metrics["actor/pg_loss"]}
    return report


def _layout_of(micro) -> str:
    from rlmegatron.models.shared_prompts import SharedPromptParams

    params = micro.packed_seq_params
    return "padded" if params is None else "shared-prompt" if isinstance(params, SharedPromptParams) else "packed"


# A warm-up of 2 trainer steps, then a decay to min_lr at step 5 (the schedule's last).
SCHEDULE = dict(lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_steps=5)


def optimizer_job(workdir: str) -> dict:
    """At DP=2: the lr of 5 updates per decay style (2 optimizer steps each), a resume from step 3's checkpoint
    with the distributed and the plain optimizer, and one update of each optimizer at the same lr."""
    from rlmegatron.rank.checkpoint_state import load_training_state, save_training_state

    batch = rollout_batch()
    weights = os.path.join(workdir, "weights")
    first = make_actor(ParallelLayout())
    first.save_weights(weights)
    log_probs, _ = first.compute_log_prob(batch, with_entropy=False)
    train_batch = replace(batch, old_log_probs=log_probs - 0.05 * batch.response_mask)

    def actor(distributed: bool, **optimizer):
        worker = make_actor(ParallelLayout(), ppo_mini_batch_size=4, use_distributed_optimizer=distributed,
                            optimizer=replace(OPTIMIZER, **optimizer))
        worker.load_weights(weights)
        return worker

    def parameters(worker):
        return {n: p.detach().clone() for n, p in worker.chunks[0].module.named_parameters()}

    report = {"lr": {}, "resumed_lr": {}, "resumed_param_diff": {}}
    finals, after_one = {}, {}
    for style, distributed in (("constant", True), ("linear", False), ("cosine", True)):
        worker = actor(distributed, lr_decay_style=style, **SCHEDULE)
        report["lr"][style] = []
        for step in range(1, 6):
            report["lr"][style].append(worker.update(train_batch)["actor/lr"])
            if step == 1:
                after_one[style] = parameters(worker)
            if step == 3:
                save_training_state(worker, os.path.join(workdir, f"step3-{style}"))
        finals[style] = parameters(worker)
    for style, distributed in (("linear", False), ("cosine", True)):
        worker = actor(distributed, lr_decay_style=style, **SCHEDULE)
        load_training_state(worker, os.path.join(workdir, f"step3-{style}"))
        report["resumed_lr"][style] = [worker.update(train_batch)["actor/lr"] for _ in range(2)]
        report["resumed_param_diff"][style] = _max_diff(parameters(worker), finals[style])

    # Step 1 of a 2-step warm-up trains at lr / 2: like a constant lr / 2, with either optimizer.
    half = {}
    for distributed in (True, False):
        worker = actor(distributed, lr=SCHEDULE["lr"] / 2)
        worker.update(train_batch)
        half[distributed] = parameters(worker)
    report["warmup_vs_half_lr_diff"] = _max_diff(after_one["constant"], half[True])
    report["distributed_vs_plain_diff"] = _max_diff(half[True], half[False])
    report["update_size"] = _max_diff(half[True], parameters(first))
    return report


def divergence_job() -> dict:
    """At TP=2, what each rank sees of NaN weights: after an optimizer step with a finite grad norm (a NaN in one
    rank's share of an embedding row no token reads), and in the actor's, reference's and critic's outputs (a NaN
    final-norm weight). Every rank reports its own errors."""
    from rlmegatron.errors import Divergence
    from rlmegatron.rank.roles.training import weights_finite

    def error_of(call) -> str:
        try:
            call()
        except Divergence as error:
            return str(error)
        return "no divergence"

    def poison_final_norm(worker):
        with torch.no_grad():
            engine_module(worker).decoder.final_layernorm.weight[0] = float("nan")

    layout = ParallelLayout(tp=2)
    batch = rollout_batch()
    actor = ActorWorker(ActorSettings(**ACTOR_DEFAULTS), model_provider(layout, tie_embeddings=False), layout)
    actor.init(parallel_state_ready=True)
    report = {"finite_before": weights_finite(actor.chunks)}
    unread = min(set(range(VOCAB)) - set(batch.input_ids.flatten().tolist()))
    embedding = engine_module(actor).embedding.word_embeddings
    if embedding.vocab_start_index <= unread < embedding.vocab_end_index:
        with torch.no_grad():
            embedding.weight[unread - embedding.vocab_start_index, 0] = float("nan")
    report["finite_after_poison"] = weights_finite(actor.chunks)
    log_probs, _ = actor.compute_log_prob(batch)  # nothing reads the row: finite
    report["update"] = error_of(lambda: actor.update(replace(batch, old_log_probs=log_probs)))

    poison_final_norm(actor)
    report["log_prob"] = error_of(lambda: actor.compute_log_prob(batch))
    reference = make_reference(layout)
    poison_final_norm(reference)
    report["ref_log_prob"] = error_of(lambda: reference.compute_log_prob(batch))
    critic = make_critic(layout)
    poison_final_norm(critic)
    report["values"] = error_of(lambda: critic.compute_values(batch))
    report["response_tokens"] = int(batch.response_mask.sum())
    return report


def engine_module(worker):
    """The GPTModel of a worker's first chunk, inside DDP or not."""
    from rlmegatron.rank.roles.megatron_step import unwrap

    return unwrap(worker.chunks[0])
