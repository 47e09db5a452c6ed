"""Rank-side body of the LoRA tests: a LoRA actor built from a tiny HF checkpoint at a layout, trained two steps."""
from __future__ import annotations

import os
from dataclasses import replace

import torch
from megatron.core import parallel_state as ps

from rlmegatron.models.convert import HFCheckpoint, load_hf_weights
from rlmegatron.models.hf_config import build_gpt_model, transformer_config
from rlmegatron.models.lora import (
    LoRASettings,
    adapters_disabled,
    add_adapters,
    is_adapter_name,
    remember_base_weights,
)
from rlmegatron.models.weight_map import WeightMap
from rlmegatron.resharding import HFWeightExporter
from rlmegatron.runtime import ParallelLayout, init_model_parallel
from rlmegatron.rank.roles import ActorSettings, ActorWorker, OptimizerSettings
from rlmegatron.rank.roles.megatron_step import unwrap
from tests.rank.roles.jobs import rollout_batch

LORA = LoRASettings(rank=4, alpha=8.0)
RESHARDED = ("TP2-SP", "EP2")  # layouts whose trained adapters are also loaded back at TP=1
CONVERTED = ("TP1", "TP2")  # dense layouts saved as a run's checkpoint, for `rlm convert lora-to-hf`
# adam_eps=1: an Adam step is ~lr*g, so a wrong gradient shows as a wrong update, not as the same sign step.
SETTINGS = dict(ppo_mini_batch_size=8, micro_batch_size=2, optimizer=OptimizerSettings(lr=0.5, adam_eps=1.0))


def build_actor(path: str, layout: ParallelLayout, lora: LoRASettings | None) -> tuple[ActorWorker, WeightMap]:
    """An actor at `layout` with the HF checkpoint's weights, adapted by `lora` (None: the plain model)."""
    init_model_parallel(layout)
    checkpoint = HFCheckpoint(path)
    facts = checkpoint.facts(layout.tp)
    config = transformer_config(facts, layout)

    def provide(pre, post, vp):
        model = build_gpt_model(facts, config, vp_stage=vp)
        return model if lora is None else add_adapters(model, lora, seed=7)

    actor = ActorWorker(ActorSettings(**SETTINGS, vocab_size=facts.vocab_size), provide, layout)
    actor.init(parallel_state_ready=True)
    weight_map = WeightMap(facts)
    load_hf_weights([unwrap(chunk) for chunk in actor.chunks], weight_map, checkpoint)
    checkpoint.close()
    remember_base_weights(actor.chunks)  # as a run's ranks do once the base weights are in
    return actor, weight_map


def _adam_state_numel(optimizer) -> int:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(state["exp_avg"].numel() for opt in inner for state in opt.optimizer.state.values())


def _save_run_checkpoint(actor, weight_map, base: str, checkpoint: str, lora: LoRASettings = LORA) -> dict | None:
    """`actor` saved as a run saves its checkpoint (adapters, AdapterMeta, manifest); returns its Megatron logits of
    fixed tokens with the adapters on and off (rank 0)."""
    from pathlib import Path

    from rlmegatron.checkpoint.integrity import write_manifest
    from rlmegatron.rank.checkpoint_state import AdapterMeta, save_training_state
    from rlmegatron.models.convert import megatron_logits, verify_tokens

    chunks, facts = [unwrap(chunk) for chunk in actor.chunks], weight_map.facts
    tokens = verify_tokens(facts.vocab_size)
    logits = megatron_logits(chunks, facts, tokens)
    with adapters_disabled(actor.chunks):
        base_logits = megatron_logits(chunks, facts, tokens)
    save_training_state(actor, os.path.join(checkpoint, "actor"))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        AdapterMeta(lora, base, "fp32", random_init=False,
                    padded_vocab_size=weight_map.facts.padded_vocab_size).save(os.path.join(checkpoint, "actor"))
        write_manifest(Path(checkpoint), step=2)
    torch.distributed.barrier()
    return {"tokens": tokens, "logits": logits, "base_logits": base_logits}


def lora_job(cases: list[tuple[str, str, ParallelLayout]], workdir: str) -> dict:
    """Per (family, label, layout): log-probs before and after two LoRA updates, with the adapters off, the merged
    HF weights (rank 0), and what trains."""
    batch = rollout_batch()
    report = {}
    for family, label, layout in cases:
        path = os.path.join(workdir, family)
        actor, weight_map = build_actor(path, layout, LORA)
        model = unwrap(actor.chunks[0])
        base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_name(n)}
        log_probs, _ = actor.compute_log_prob(batch)
        train_batch = replace(batch, old_log_probs=log_probs - 0.05 * batch.response_mask)
        metrics = [actor.update(train_batch) for _ in range(2)]  # the second moves A: B is zero in the first
        with adapters_disabled(actor.chunks):
            adapters_off = actor.compute_log_prob(batch)[0]
        exporter = HFWeightExporter(actor.chunks, weight_map)
        merged = dict(exporter.stream())
        # PEFT-format factors: dense models on one stage (what SGLang's and peft's LoRA loading take)
        adapter = dict(exporter.adapter_stream()) if family == "qwen3" and layout.pp == 1 else None
        adapter_numel = sum(p.numel() for n, p in model.named_parameters() if is_adapter_name(n))
        optimizer_numel = torch.tensor([_adam_state_numel(actor.optimizer)])
        torch.distributed.all_reduce(optimizer_numel, group=ps.get_data_parallel_group())  # the optimizer's shards
        result = {
            "log_probs": log_probs,
            "trained_log_probs": actor.compute_log_prob(batch)[0],
            "adapters_off": adapters_off,
            "grad_norms": [m["actor/grad_norm"] for m in metrics],
            "trainable": sorted({n.rpartition(".")[2] for n, p in model.named_parameters() if p.requires_grad}),
            "base_changed": sorted(n for n, p in model.named_parameters()
                                   if n in base_before and not torch.equal(p, base_before[n])),
            "adapter_numel": adapter_numel,
            "optimizer_numel": int(optimizer_numel),
            "base_numel": sum(t.numel() for t in base_before.values()),
        }
        if torch.distributed.get_rank() == 0:
            result["merged"], result["adapter"] = merged, adapter
        if label in RESHARDED:
            actor.save_weights(os.path.join(workdir, f"{family}-{label}"))
        if family == "qwen3" and label in CONVERTED:
            result["logits"] = _save_run_checkpoint(actor, weight_map, path, os.path.join(workdir, f"run-{label}"))
        if label == "TP1":  # the plain model at the same layout: what the adapters start from and switch off to
            del actor
            plain, _ = build_actor(path, layout, None)
            result["plain_log_probs"] = plain.compute_log_prob(batch)[0]
        report[f"{family}/{label}"] = result
    for family, label, _ in cases:  # adapters saved at another layout, loaded at TP=1: the same merged weights
        if label in RESHARDED:
            actor, weight_map = build_actor(os.path.join(workdir, family), ParallelLayout(), LORA)
            actor.load_weights(os.path.join(workdir, f"{family}-{label}"))
            merged = dict(HFWeightExporter(actor.chunks, weight_map).stream())
            if torch.distributed.get_rank() == 0:
                report[f"{family}/{label}"]["resharded"] = merged
    # `rlm convert lora-to-hf`'s rank body here, on these two ranks at TP=2, for the checkpoint saved at TP=1 (the
    # test runs the command itself for the other, at TP=1): spawning ranks costs more than converting.
    from rlmegatron.entry.convert_command import lora_to_hf

    run = os.path.join(workdir, "run-TP1")
    lora_to_hf(run, f"{run}-peft", f"{run}-merged", ParallelLayout(tp=2, sequence_parallel=True))
    # The embedding (tied to the output layer) trained whole beside the adapters at TP=2, converted at TP=1.
    path, saved = os.path.join(workdir, "qwen3"), replace(LORA, modules_to_save=("embedding",))
    actor, weight_map = build_actor(path, ParallelLayout(tp=2), saved)
    train_batch = replace(batch, old_log_probs=actor.compute_log_prob(batch)[0] - 0.05 * batch.response_mask)
    for _ in range(2):
        actor.update(train_batch)
    run = os.path.join(workdir, "run-TP2-embedding")
    report["qwen3/TP2-embedding"] = {"trained_log_probs": actor.compute_log_prob(batch)[0],
                                     "logits": _save_run_checkpoint(actor, weight_map, path, run, saved)}
    lora_to_hf(run, f"{run}-peft", f"{run}-merged", ParallelLayout())
    return report

