"""Checkpoint tensors outside the language model that the bridge carries as they are (Family.carried_prefixes:
Kimi-K2.5's vision tower and projector): never in Megatron, never trained or synced (the engines load them from the
checkpoint and keep them), but in every HF checkpoint written from the model, so that nothing of the checkpoint a
user converted is lost. A Megatron checkpoint converted from an HF one keeps them in CARRIED_FILE beside it."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from rlmegatron.models.convert import META_FILE, HFCheckpoint
from rlmegatron.models.families.base import Source

CARRIED_FILE = "carried.safetensors"


def carried_tensors(directory: str | os.PathLike, family) -> dict[str, torch.Tensor]:
    """The carried tensors of an HF checkpoint directory, or of a Megatron checkpoint converted from one."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not family.carried_prefixes or not directory.is_dir():
        return {}
    if (directory / CARRIED_FILE).is_file():
        return load_file(directory / CARRIED_FILE)
    if (directory / META_FILE).is_file() or not any(directory.glob("*.safetensors")):
        # A Megatron checkpoint of a model that carries nothing, or a config-only directory (model.random_init),
        # whose carried parts are as random in the engines as in an export that leaves them out.
        return {}
    checkpoint = HFCheckpoint(directory)
    try:
        return {key: checkpoint.read(Source(key)) for key in checkpoint.key_files if family.carries(key)}
    finally:
        checkpoint.close()


def save_carried(hf_path: str, out: str, family) -> None:
    """The HF checkpoint's carried tensors into the Megatron checkpoint `out` (nothing when the family has none)."""
    from safetensors.torch import save_file

    tensors = carried_tensors(hf_path, family)
    if tensors:
        save_file({key: tensor.contiguous() for key, tensor in tensors.items()}, os.path.join(out, CARRIED_FILE))
