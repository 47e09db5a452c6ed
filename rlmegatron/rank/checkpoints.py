"""Checkpoints and HF export inside a trainer rank: each trained role (actor, critic) saved and restored at its own
layout with this rank's RNG states, and the policy written as an HF checkpoint."""
from __future__ import annotations

import os
from typing import Optional

import torch

from rlmegatron.checkpoint.integrity import load_failures_named
from rlmegatron.models.carried import carried_tensors
from rlmegatron.rank.checkpoint_state import (
    AdapterMeta,
    load_training_state,
    rng_states,
    save_training_state,
    set_rng_states,
)
from rlmegatron.rank.role_models import RoleModels
from rlmegatron.models.source import ModelSource
from rlmegatron.resharding import export_hf


def save(models: RoleModels, path: str) -> None:
    """Everything the rank trains plus its RNG; each role at its own layout."""
    for role, worker in models.trained():
        with models.phase(role):
            save_training_state(worker, os.path.join(path, role))
    settings = models.settings
    if settings.lora is not None and torch.distributed.get_rank() == 0:
        # The adapters alone do not say what they adapt: `rlm convert lora-to-hf` reads it here.
        model = settings.model
        base = os.path.abspath(model.path) if os.path.isdir(model.path) else model.path
        AdapterMeta(settings.lora, base, model.dtype, model.random_init,
                    models.weight_map.facts.padded_vocab_size).save(os.path.join(path, "actor"))
    os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    torch.save(rng_states(), _rng_file(path))
    torch.distributed.barrier()


def load(models: RoleModels, path: str) -> None:
    """What `save` wrote; a file that fails to load is named (CheckpointLoadFailed)."""
    with load_failures_named(path):
        for role, worker in models.trained():
            with models.phase(role):
                load_training_state(worker, os.path.join(path, role))
        set_rng_states(torch.load(_rng_file(path), weights_only=False))


def export_policy(models: RoleModels, path: str) -> Optional[str]:
    """The policy as an HF checkpoint (safetensors shards + config.json, the tokenizer and the generation config),
    written by rank 0; returns the path there."""
    # The tensors the family carries (models.carried) come from the checkpoint the run started from.
    carried = carried_tensors(models.settings.model.path, models.weight_map.facts.family) \
        if torch.distributed.get_rank() == 0 else {}
    with models.phase("actor"):
        export_hf(models.actor.chunks, models.weight_map, path, models.weight_map.facts.hf, carried=carried)
    if torch.distributed.get_rank() != 0:
        return None
    _add_tokenizer_and_generation_config(models.settings.model, path)
    return path


def _add_tokenizer_and_generation_config(model: ModelSource, path: str) -> None:
    """What `from_pretrained` needs beside the weights to generate: without tokenizer files transformers builds an
    empty tokenizer from config.json, and generate() fails on it. The generation config is the model's own where it
    has one, else the one its config.json implies (its BOS, EOS and pad ids)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    AutoTokenizer.from_pretrained(model.tokenizer_path, trust_remote_code=model.trust_remote_code).save_pretrained(path)
    try:
        generation = GenerationConfig.from_pretrained(model.path)
    except OSError:  # the model directory ships none (a config-only directory, model.random_init)
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    generation.save_pretrained(path)


def _rng_file(path: str) -> str:
    return os.path.join(path, "rng", f"rank_{torch.distributed.get_rank()}.pt")
