"""Rank side of a checkpoint: model and optimizer through dist_checkpointing, and this rank's RNG states."""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from rlmegatron.models.lora import LoRASettings, has_adapters, is_adapter_name
from rlmegatron.runtime.distributed import rng_tracker_states, set_rng_tracker_states
from rlmegatron.runtime.sharded_save import save_sharded
from rlmegatron.rank.roles.megatron_step import unwrap


def _model_sharded_state_dict(chunks: list) -> dict:
    """The trained weights: with LoRA only the adapters and the modules it trains whole, as the base model is the HF
    checkpoint's, unchanged."""
    adapters_only = has_adapters(chunks)
    states = []
    for chunk in chunks:
        trained = {name for name, param in unwrap(chunk).named_parameters() if param.requires_grad}
        states.append({key: value for key, value in unwrap(chunk).sharded_state_dict().items()
                       if not adapters_only or is_adapter_name(key) or key in trained})
    return states[0] if len(chunks) == 1 else {f"model{i}": state for i, state in enumerate(states)}


def _optimizer_state(worker, model: dict, is_loading: bool) -> dict:
    # The default (fully_sharded_model_space) uses flattened ranges, which this dist_checkpointing rejects;
    # dp_reshardable saves each DP rank's flat shard, so a resume needs the same DP size.
    return worker.optimizer.sharded_state_dict(
        model, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
    )


def save_training_state(worker, path: str) -> None:
    """A trained worker's weights, optimizer (Adam moments, step) and learning-rate schedule position as one
    distributed checkpoint; the schedule is the same on every rank, so it is saved once, as common state."""
    model = _model_sharded_state_dict(worker.chunks)
    save_sharded({"model": model, "optimizer": _optimizer_state(worker, model, is_loading=False),
                  "lr_scheduler": worker.scheduler.state_dict()}, path)


def _load_model_state(chunks: list, state: dict) -> None:
    strict = not has_adapters(chunks)  # adapters alone leave the base weights as they are
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(state, strict=strict)
    else:
        for i, chunk in enumerate(chunks):
            unwrap(chunk).load_state_dict(state[f"model{i}"], strict=strict)


def load_model_weights(chunks: list, path: str) -> None:
    """The model part of a training state `save_training_state` wrote (with LoRA: the adapters) into `chunks`, at
    their layout, whatever the saved one; optimizer and schedule stay on disk."""
    from megatron.core import dist_checkpointing

    _load_model_state(chunks, dist_checkpointing.load({"model": _model_sharded_state_dict(chunks)}, path)["model"])


def load_training_state(worker, path: str) -> None:
    from megatron.core import dist_checkpointing

    for optimizer in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
        # The non-distributed optimizers create their state while building the sharded state dict.
        if not optimizer.optimizer.state and hasattr(optimizer, "_init_optimizer_states_with_dummy_values"):
            # A fresh torch Adam has no state (no `step`) to load into; Megatron-LM fills it with one
            # zero-gradient step the same way. The weights it touches are overwritten by the load below.
            optimizer._init_optimizer_states_with_dummy_values()
    model = _model_sharded_state_dict(worker.chunks)
    state = dist_checkpointing.load(
        {"model": model, "optimizer": _optimizer_state(worker, model, is_loading=True)}, path
    )
    _load_model_state(worker.chunks, state["model"])
    with torch.no_grad():  # the main-param shards are views of leaf weights: copying into them must not be traced
        worker.optimizer.load_state_dict(state["optimizer"])
    _restore_adam_steps(worker.optimizer, state["optimizer"])
    # After the optimizer, whose param groups carry the saved learning rates: the schedule sets them anew.
    worker.scheduler.load_state_dict(state["lr_scheduler"])


ADAPTER_META = "lora.json"
"""Beside a LoRA actor's training state: what its adapters adapt, which the adapter-only checkpoint lacks."""


@dataclass(frozen=True)
class AdapterMeta:
    """The LoRA settings and base model of an adapter-only checkpoint: what `rlm convert lora-to-hf` rebuilds."""

    lora: LoRASettings
    base_model: str  # the HF directory whose weights the adapters adapt
    dtype: str
    random_init: bool  # the base weights were random ones, in no file
    padded_vocab_size: int  # the run's (an embedding in modules_to_save was saved at it, whatever the TP it loads at)

    def save(self, directory: str) -> None:
        Path(directory, ADAPTER_META).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, directory: str | Path) -> "AdapterMeta":
        data = json.loads(Path(directory, ADAPTER_META).read_text())
        lora = {key: tuple(value) if isinstance(value, list) else value for key, value in data.pop("lora").items()}
        return cls(lora=LoRASettings(**lora), **data)


def _restore_adam_steps(optimizer, loaded) -> None:
    """Megatron-Core's dp_reshardable load restores torch Adam's `step` from the checkpoint's param groups, then
    copies the step of the template (the dummy step's 1) over it with the Adam moments; put the saved one back.
    (Fused GPU Adams keep their step in the param groups only, which the load gets right.)"""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    for inner, state in zip(chained, [loaded] if len(chained) == 1 else [loaded[i] for i in range(len(chained))]):
        if "param_state" not in state:  # not the distributed optimizer
            continue
        steps = {group["step"] for group in state["optimizer"]["param_groups"] if "step" in group}
        for param_state in inner.optimizer.state.values():
            if "step" in param_state and len(steps) == 1:
                param_state["step"] = torch.tensor(float(*steps), dtype=param_state["step"].dtype)


def rng_states() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "megatron_trackers": rng_tracker_states(),  # one per role layout
    }


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    set_rng_tracker_states(states["megatron_trackers"])
